"""Graders of Lab 6, exercise 6.3 (labs/06_system.ipynb): the device mesh.

References nobody in this course wrote: ``torch.distributed.device_mesh.init_device_mesh`` on 8
real gloo ranks, and ``torch.arange(world_size).view(shape)`` / ``torch.unravel_index`` without
processes. Every quantity compared is an exact integer (ranks): no tolerances.

Also: the course's mesh order is Megatron-LM's and torchtitan's, pp outermost, then dp, cp, tp
(Megatron-LM ``initialize_model_parallel(order="tp-cp-ep-dp-pp")``, innermost first,
megatron/core/parallel_state.py at d98e8a64; torchtitan's ``("pp", "dp", "cp", "tp")``, outermost
first, torchtitan/distributed/parallel_dims.py at b5bcd76c); bad input is refused by name before
any work (issue 27.8: ``my_groups`` with a rank outside the mesh raised StopIteration).
"""
from __future__ import annotations

import math

import pytest
import torch


MESH_SHAPES = [
    ((8,), ("dp",)),
    ((2, 4), ("dp", "tp")),
    ((2, 2, 2), ("dp", "pp", "tp")),
    ((4, 2, 2, 8), ("dp", "pp", "cp", "tp")),
    ((8, 16, 8), ("dp", "pp", "tp")),       # 1024 ranks
    ((3, 5, 7), ("a", "b", "c")),           # sizes with no common factor
    ((1, 4, 1, 2), ("pp", "dp", "cp", "tp")),  # unused axes of size 1 (no pipeline, no context parallelism)
    ((3, 1), ("dp", "tp")),                 # a size-1 innermost axis: 3 groups of one rank
    ((1,), ("dp",)),                        # a single GPU
]


@pytest.mark.exercise("6.3", points=1)
@pytest.mark.parametrize("shape,names", MESH_SHAPES, ids=lambda v: "x".join(map(str, v)) if isinstance(v[0], int) else None)
def test_coords_match_torch_unravel_index(shape, names):
    """Check coords_of(rank) against torch.unravel_index and rank_of as its inverse, all ranks."""
    from labkit.lab6.device_mesh import coords_of, rank_of

    n = math.prod(shape)
    ref = torch.stack(torch.unravel_index(torch.arange(n), shape), dim=1).tolist()
    for rank in range(n):
        got = coords_of(rank, shape)
        assert list(got) == ref[rank], \
            f"coords_of({rank}, {shape}) = {got}, expected {tuple(ref[rank])}: the LAST dimension (tp) is innermost"
        back = rank_of(tuple(ref[rank]), shape)
        assert back == rank, f"rank_of({tuple(ref[rank])}, {shape}) = {back}, expected {rank}"


@pytest.mark.exercise("6.3", points=1)
@pytest.mark.parametrize("shape,names", MESH_SHAPES, ids=lambda v: "x".join(map(str, v)) if isinstance(v[0], int) else None)
def test_axis_groups_match_the_mesh_tensor(shape, names):
    """Check every axis' groups against the mesh tensor torch's DeviceMesh builds,
    ``arange(world_size).view(shape)``: the groups along dim d are its rows after moving d last."""
    from labkit.lab6.device_mesh import axis_groups

    mesh = torch.arange(math.prod(shape)).view(shape)
    for d, axis in enumerate(names):
        ref = sorted(mesh.movedim(d, -1).reshape(-1, shape[d]).tolist())
        got = axis_groups(shape, names, axis)
        assert got == ref, (f"groups along {axis!r} of {shape}: first {got[:2]}..., expected {ref[:2]}...: "
                            f"ranks that differ only in the {axis!r} coordinate, in coordinate order, sorted by first rank")


def test_bad_meshes_raise():
    """Not graded (the checks are infrastructure, in the stub too): a shape whose product is not
    the world size, a dimension name twice, an unknown axis, a rank outside."""
    from labkit.lab6.device_mesh import axis_groups, check_mesh, coords_of

    with pytest.raises(ValueError, match="world_size"):
        check_mesh((2, 3), ("dp", "tp"), world_size=8)
    with pytest.raises(ValueError, match="distinct"):
        axis_groups((2, 2), ("dp", "dp"), "dp")
    with pytest.raises(ValueError, match="axis"):
        axis_groups((2, 2), ("dp", "tp"), "pp")
    with pytest.raises(ValueError, match="rank"):
        coords_of(8, (2, 4))


@pytest.fixture(scope="module")
def mesh_ranks():
    from labkit.harness.lab6 import mesh_worker
    from labkit.ranks import launch

    try:
        return launch(mesh_worker, 8, (2, 2, 2), ("dp", "pp", "tp"), timeout=120.0)
    except NotImplementedError:
        raise
    except Exception as exc:  # a stub's NotImplementedError arrives wrapped in RankError
        if "NotImplementedError" in str(exc):
            raise NotImplementedError(f"exercise 6.3: {exc}") from exc
        raise


@pytest.mark.exercise("6.3", points=2)
def test_groups_match_init_device_mesh_on_8_gloo_ranks(mesh_ranks):
    """On 8 real gloo ranks (2×2×2, dp, pp, tp): every rank's group along each axis equals the
    ranks of init_device_mesh's group for that dimension, and the mesh layouts agree."""
    from labkit.lab6.device_mesh import rank_of

    want_mesh = [[[rank_of((d, p, t), (2, 2, 2)) for t in range(2)] for p in range(2)] for d in range(2)]
    for rank, out in enumerate(mesh_ranks):
        assert out["torch_mesh"] == want_mesh, f"init_device_mesh's mesh {out['torch_mesh']} vs rank_of's {want_mesh}"
        for axis in ("dp", "pp", "tp"):
            assert out["ours"][axis] == out["torch_groups"][axis], \
                f"rank {rank}, axis {axis!r}: our group {out['ours'][axis]} vs init_device_mesh's {out['torch_groups'][axis]}"


@pytest.mark.exercise("6.3", points=1)
def test_all_reduce_along_each_axis_sums_the_groups_members(mesh_ranks):
    """An all-reduce of rank + 1 in our gloo group along each axis gives the sum over the
    members PyTorch's mesh puts in that group."""
    for rank, out in enumerate(mesh_ranks):
        for axis in ("dp", "pp", "tp"):
            want = float(sum(r + 1 for r in out["torch_groups"][axis]))
            assert out["sums"][axis] == want, \
                f"rank {rank}, axis {axis!r}: all-reduce gave {out['sums'][axis]}, expected {want} (members {out['torch_groups'][axis]})"
            assert out["torch_sums"][axis] == want, (  # the reference itself
                f"rank {rank}, axis {axis!r}: PyTorch's own mesh group summed to {out['torch_sums'][axis]}, "
                f"expected {want}: the reference run is broken, not your groups")



def test_the_course_mesh_order():
    """Not graded (a constant of the given code): outermost to innermost pp, dp, cp, tp, the order
    the planner's bandwidth model assumes."""
    from labkit.lab6.device_mesh import AXES
    from labkit.cost_model import MESH_ORDER

    assert AXES == ("pp", "dp", "cp", "tp") == MESH_ORDER


@pytest.mark.exercise("6.3", points=1)
def test_groups_of_the_course_order_on_a_node_grid():
    """Check the groups of (pp, dp, cp, tp) = (2, 3, 2, 4) (48 GPUs, 8 a node) against the mesh
    tensor ``arange(48).view(shape)``: each tp group inside one node, each pp group spanning the
    farthest ranks (stride D·C·T = 24)."""
    from labkit.lab6.device_mesh import AXES, axis_groups

    shape = (2, 3, 2, 4)
    mesh = torch.arange(math.prod(shape)).view(shape)
    for d, axis in enumerate(AXES):
        ref = sorted(mesh.movedim(d, -1).reshape(-1, shape[d]).tolist())
        got = axis_groups(shape, AXES, axis)
        assert got == ref, f"groups along {axis!r} of {shape}: first {got[:2]}, expected {ref[:2]}"
    tp = axis_groups(shape, AXES, "tp")
    assert all(len({r // 8 for r in g}) == 1 for g in tp), (
        f"tp groups of {shape} with 8 GPUs a node: {tp[:3]}…: each must sit inside one node "
        f"(tp is the innermost axis: consecutive ranks)")
    pp = axis_groups(shape, AXES, "pp")[0]
    assert pp == [0, 24], f"rank 0's pp group of {shape}: {pp}, expected [0, 24] (stride D·C·T = 24)"


@pytest.mark.parametrize("rank", [-1, 8, 2.0, True, "0", None])
def test_my_groups_refuses_a_rank_outside_the_mesh(rank):
    """Not graded (given code): ValueError naming the rank, not StopIteration."""
    from labkit.lab6.device_mesh import my_groups

    with pytest.raises(ValueError, match="rank"):
        my_groups(rank, (2, 4), ("dp", "tp"))


@pytest.mark.parametrize("call,word", [
    (lambda m: m.coords_of(0, (2, 0)), "shape"),
    (lambda m: m.coords_of(0, (2, 2.0)), "shape"),
    (lambda m: m.coords_of(0, ()), "shape"),
    (lambda m: m.coords_of(0, 4), "shape"),
    (lambda m: m.rank_of((0, 2), (2, 2)), "coords"),
    (lambda m: m.rank_of((0,), (2, 2)), "coords"),
    (lambda m: m.axis_groups((2, 2), ("dp",), "dp"), "names"),
    (lambda m: m.check_mesh((2, 2), ("dp", "tp"), world_size=4.0), "world_size"),
])
def test_bad_meshes_are_named(call, word):
    """Not graded (the checks are given code, in the stub too)."""
    from labkit.lab6 import device_mesh

    with pytest.raises(ValueError, match=word):
        call(device_mesh)
