"""A device mesh: which GPUs talk to which in 3D (4D) parallelism.

A training job on ``world_size = P × D × C × T`` GPUs runs pipeline parallelism (pp) over P
stages, data parallelism (dp) over D replicas, context parallelism (cp) over C chunks of the
sequence and tensor parallelism (tp) over T shards of every matrix. Lay the ranks out as an
array of that shape in row-major order, the last dimension innermost: rank
``r = ((p·D + d)·C + c)·T + t``. The order is the one Megatron-LM and torchtitan use
(Megatron-LM's ``initialize_model_parallel(order="tp-cp-ep-dp-pp")``, innermost first,
megatron/core/parallel_state.py at d98e8a64; torchtitan's mesh ``("pp", "dp", "cp", "tp")``,
outermost first, torchtitan/distributed/parallel_dims.py at b5bcd76c), and the reason is the
traffic of each axis, heaviest innermost: T all-reduces activations inside every layer (it
needs NVLink, one node); C exchanges keys and values inside every layer; D reduces the
gradients (and under ZeRO-3 gathers every layer's parameters, per micro-batch: not "once per
step"), bulk traffic that overlaps backward; P only passes one activation and one gradient per
micro-batch from stage to stage, the least, so it spans the farthest ranks. A *group along an
axis* is the set of ranks whose coordinates agree on every other axis.
``torch.distributed.device_mesh.init_device_mesh`` builds the same layout
(``mesh = arange(world_size).view(shape)``) and one process group per dimension for each rank.

Chapter 6 (book/06_system.md); Lab 6, exercise 6.3 (labs/06_system.ipynb).
"""
from __future__ import annotations

import math

from labkit import validate

AXES = ("pp", "dp", "cp", "tp")
"""The course's mesh order, outermost to innermost (the module docstring says why)."""


# ==== given: the course's code — read it, call it, don't change it ====

def check_mesh(shape, names, world_size: int | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Validate a mesh: positive int sizes, one distinct name per dimension, product = world_size."""
    if not isinstance(shape, (tuple, list)) or not shape:
        raise ValueError(f"shape must be a non-empty tuple of positive ints, got {shape!r}")
    for s in shape:
        if not validate.is_int(s) or s < 1:
            raise ValueError(f"shape must be a non-empty tuple of positive ints, got {shape!r}")
    shape = tuple(int(s) for s in shape)
    if not isinstance(names, (tuple, list)) or len(names) != len(shape):
        raise ValueError(f"names must be a tuple of {len(shape)} str (one per dimension), got {names!r}")
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"names must be non-empty str, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"names must be distinct, got {names!r} (a dimension name twice)")
    if world_size is not None and (not validate.is_int(world_size) or math.prod(shape) != world_size):
        raise ValueError(f"the product of shape {tuple(shape)} is {math.prod(shape)}, "
                         f"not world_size = {world_size}")
    return tuple(shape), tuple(names)


def check_rank(rank, shape) -> int:
    """Validate a rank of a mesh of ``shape``: an int in [0, world size)."""
    n = math.prod(shape)
    if not validate.is_int(rank) or not 0 <= rank < n:
        raise ValueError(f"rank must be an int in [0, {n}) for a mesh of shape {tuple(shape)}, got {rank!r}")
    return int(rank)


def _names(shape) -> tuple[str, ...]:
    return tuple(f"d{i}" for i in range(len(shape))) if isinstance(shape, (tuple, list)) else ()


# ==== exercise 6.3: your code ====

def coords_of(rank: int, shape) -> tuple[int, ...]:
    """The coordinates of ``rank`` in a row-major mesh of ``shape`` (last dimension innermost)."""
    shape, _ = check_mesh(shape, _names(shape))
    rank = check_rank(rank, shape)
    raise NotImplementedError("exercise 6.3: the mixed-radix digits of rank, last dimension fastest (labs/06_system.ipynb)")


def rank_of(coords, shape) -> int:
    """The rank at ``coords`` in a row-major mesh of ``shape``; the inverse of ``coords_of``."""
    shape, _ = check_mesh(shape, _names(shape))
    if (not isinstance(coords, (tuple, list)) or len(coords) != len(shape)
            or not all(validate.is_int(c) and 0 <= c < s for c, s in zip(coords, shape))):
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


# ==== given: the course's code — read it, call it, don't change it ====

def my_groups(rank: int, shape, names) -> dict[str, list[int]]:
    """For each axis name, the ranks of the group along it that contains ``rank`` (ValueError for
    a rank outside the mesh)."""
    shape, names = check_mesh(shape, names)
    rank = check_rank(rank, shape)
    return {axis: next(g for g in axis_groups(shape, names, axis) if rank in g) for axis in names}


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
