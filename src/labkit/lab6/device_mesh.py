"""A device mesh: which GPUs talk to which in 3D (4D) parallelism.

A training job on ``world_size = D × P × C × T`` GPUs runs data parallelism (dp) over D groups,
pipeline parallelism (pp) over P stages, context parallelism (cp) over C chunks of the
sequence and tensor parallelism (tp) over T shards of every matrix. Lay the ranks out as an
array of that shape in row-major order, the last dimension innermost: rank
``r = ((d·P + p)·C + c)·T + t``. Then the T ranks of a tensor-parallel group are consecutive —
on one node, on NVLink, where TP's all-reduce after every layer belongs — and the dp groups,
which talk once per step, are the farthest apart. A *group along an axis* is the set of ranks
whose coordinates agree on every other axis. ``torch.distributed.device_mesh.init_device_mesh``
builds the same layout (``mesh = arange(world_size).view(shape)``) and one process group per
dimension for each rank.

Chapter 6 (book/06_system.md); Lab 6, exercise 6.3 (labs/06_system.ipynb).
"""
from __future__ import annotations

import math

AXES = ("dp", "pp", "cp", "tp")  # outermost to innermost


def check_mesh(shape, names, world_size: int | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Validate a mesh: positive int sizes, one distinct name per dimension, product = world_size."""
    if not isinstance(shape, (tuple, list)) or not shape:
        raise ValueError(f"shape must be a non-empty tuple of positive ints, got {shape!r}")
    for s in shape:
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise ValueError(f"shape must be a non-empty tuple of positive ints, got {shape!r}")
    if not isinstance(names, (tuple, list)) or len(names) != len(shape):
        raise ValueError(f"names must be a tuple of {len(shape)} str (one per dimension), got {names!r}")
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"names must be non-empty str, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"names must be distinct, got {names!r} (a dimension name twice)")
    if world_size is not None and math.prod(shape) != world_size:
        raise ValueError(f"the product of shape {tuple(shape)} is {math.prod(shape)}, "
                         f"not world_size = {world_size}")
    return tuple(shape), tuple(names)


def coords_of(rank: int, shape) -> tuple[int, ...]:
    """The coordinates of ``rank`` in a row-major mesh of ``shape`` (last dimension innermost)."""
    shape, _ = check_mesh(shape, tuple(f"d{i}" for i in range(len(shape))))
    n = math.prod(shape)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < n:
        raise ValueError(f"rank must be an int in [0, {n}), got {rank!r}")
    raise NotImplementedError("exercise 6.3: the mixed-radix digits of rank, last dimension fastest (labs/06_system.ipynb)")


def rank_of(coords, shape) -> int:
    """The rank at ``coords`` in a row-major mesh of ``shape``; the inverse of ``coords_of``."""
    shape, _ = check_mesh(shape, tuple(f"d{i}" for i in range(len(shape))))
    if (not isinstance(coords, (tuple, list)) or len(coords) != len(shape)
            or not all(isinstance(c, int) and 0 <= c < s for c, s in zip(coords, shape))):
        raise ValueError(f"coords must be {len(shape)} ints within shape {shape}, got {coords!r}")
    raise NotImplementedError("exercise 6.3: the row-major index of coords (labs/06_system.ipynb)")


def axis_groups(shape, names, axis: str) -> list[list[int]]:
    """Every group along ``axis``: the ranks whose coordinates agree on all other dimensions.

    Returns a list of ``world_size / shape[axis]`` groups; each group lists its ranks in the
    order of their coordinate along ``axis``; groups are sorted by their first rank.
    """
    shape, names = check_mesh(shape, names)
    if axis not in names:
        raise ValueError(f"axis must be one of {names}, got {axis!r}")
    raise NotImplementedError("exercise 6.3: for each combination of the other coordinates, the ranks along axis (labs/06_system.ipynb)")


def my_groups(rank: int, shape, names) -> dict[str, list[int]]:
    """For each axis name, the ranks of the group along it that contains ``rank``."""
    shape, names = check_mesh(shape, names)
    return {axis: next(g for g in axis_groups(shape, names, axis) if rank in g) for axis in names}


# ====================================================================== on real ranks

def build_process_groups(shape, names) -> dict[str, object]:
    """Inside an initialized process group: one ``new_group`` per group of every axis (every
    rank creates every group, in the same order, as ``new_group`` requires); returns, for each
    axis, the group that contains this rank."""
    import torch.distributed as dist

    shape, names = check_mesh(shape, names, dist.get_world_size())
    rank = dist.get_rank()
    mine = {}
    for axis in names:
        for ranks in axis_groups(shape, names, axis):
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[axis] = group
    return mine


def mesh_worker(rank: int, world_size: int, shape, names) -> dict:
    """Rank body for ``labkit.dist.launch``: PyTorch's ``init_device_mesh`` and this module's
    groups side by side, and an all-reduce of ``rank + 1`` along every axis in both."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    out = {"torch_mesh": mesh.mesh.tolist(), "torch_groups": {}, "ours": {}, "sums": {},
           "torch_sums": {}}
    ours = build_process_groups(shape, names)
    for axis in names:
        tg = mesh.get_group(axis)
        out["torch_groups"][axis] = dist.get_process_group_ranks(tg)
        out["ours"][axis] = dist.get_process_group_ranks(ours[axis])
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x, group=ours[axis])
        out["sums"][axis] = float(x)
        y = torch.tensor([float(rank + 1)])
        dist.all_reduce(y, group=tg)
        out["torch_sums"][axis] = float(y)
    return out
