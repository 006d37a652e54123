"""Exercise 6.3 (the device mesh): tests added by issue 26/27 (the lead merges this file with the
6.3 tests moved out of test_lab6_system.py).

* the course's mesh order is Megatron-LM's and torchtitan's: pp outermost, then dp, cp, tp
  (Megatron-LM ``initialize_model_parallel(order="tp-cp-ep-dp-pp")``, innermost first,
  megatron/core/parallel_state.py at d98e8a64; torchtitan's ``("pp", "dp", "cp", "tp")``,
  outermost first, torchtitan/distributed/parallel_dims.py at b5bcd76c);
* bad input is refused by name before any work (issue 27.8: ``my_groups`` with a rank outside
  the mesh raised StopIteration).
"""
from __future__ import annotations

import math

import pytest
import torch


def test_the_course_mesh_order():
    """Not graded (a constant of the given code): outermost to innermost pp, dp, cp, tp, the order
    the planner's bandwidth model assumes."""
    from labkit.lab6.device_mesh import AXES
    from labkit.lab7.planner import MESH_ORDER

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
    assert all(len({r // 8 for r in g}) == 1 for g in axis_groups(shape, AXES, "tp"))
    assert axis_groups(shape, AXES, "pp")[0] == [0, 24]


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
