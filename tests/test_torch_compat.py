"""labkit.torch_compat: the behaviour of recent torch releases on the older ones Colab may have.

On torch releases whose ``SelectiveCheckpointContext`` has no ``op_output`` (2.9, for one),
``create_selective_checkpoint_contexts`` is wrapped so lab 5's policy still finds the operator's
output. The course's own torch has ``op_output``, so the wrapper's path is driven directly here
with a context that lacks it; the full lab 5 graders were run on torch 2.9.1 with it (13 passed,
3 failed without the mode-free meta computation: FlopCounterMode counted the shape probes).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.torch_compat import output_on_meta, with_op_output


def test_a_policy_without_op_output_gets_the_output_on_meta_and_nothing_is_counted():
    """A context without ``op_output`` (old torch): the wrapped policy sees an output of the
    right shape and dtype on meta, FlopCounterMode around it counts nothing, no RNG is drawn."""
    seen = []
    policy = with_op_output(lambda ctx, op, *args, **kwargs: seen.append(ctx.op_output) or "kept")
    a, b = torch.randn(4, 6), torch.randn(6, 5, dtype=torch.float32)
    state = torch.get_rng_state()
    with FlopCounterMode(display=False) as flops:
        assert policy(SimpleNamespace(is_recompute=False), torch.ops.aten.mm.default, a, b) == "kept"
        policy(SimpleNamespace(is_recompute=False), torch.ops.aten.randn.default, [3, 2],
               device=torch.device("cpu"))
    assert flops.get_total_flops() == 0, f"the shape probe was counted: {flops.get_total_flops()} FLOPs"
    assert torch.equal(torch.get_rng_state(), state), "computing the output drew random numbers"
    (mm, randn) = seen
    assert (mm.device.type, tuple(mm.shape), mm.dtype) == ("meta", (4, 5), torch.float32), mm
    assert (randn.device.type, tuple(randn.shape)) == ("meta", (3, 2)), randn


def test_a_context_that_has_op_output_is_left_alone_and_unknown_ops_give_none():
    """Recent torch sets ``op_output``: the wrapper passes it through unchanged; an operator that
    cannot run on meta gives None (0 bytes for the policy) instead of an error."""
    real = torch.ones(3)
    ctx = SimpleNamespace(is_recompute=False, op_output=real)
    assert with_op_output(lambda c, op, *a, **k: c.op_output)(ctx, torch.ops.aten.mm.default) is real
    assert output_on_meta(torch.ops.aten.mm.default, (torch.ones(2, 3), torch.ones(4, 5)), {}) is None


def test_the_new_collective_names_exist_and_take_the_old_arguments(monkeypatch):
    """On a torch without ``dist.all_gather_single`` (older than 2.13) the new names are the old
    functions; where torch has them they are left as torch made them."""
    import inspect

    import torch.distributed as dist

    from labkit.torch_compat import NEW_COLLECTIVE_NAMES, distributed_new_names

    have = {new: getattr(dist, new) for new in NEW_COLLECTIVE_NAMES if hasattr(dist, new)}
    distributed_new_names()
    for new, fn in have.items():
        assert getattr(dist, new) is fn, f"dist.{new} was replaced on a torch that has it"
    for new, old in NEW_COLLECTIVE_NAMES.items():
        monkeypatch.delattr(dist, new, raising=False)
    distributed_new_names()
    for new, old in NEW_COLLECTIVE_NAMES.items():
        assert getattr(dist, new) is getattr(dist, old), f"dist.{new} is not dist.{old}"
        assert list(inspect.signature(getattr(dist, old)).parameters)[:2] in (
            ["output_tensor", "input_tensor"], ["output", "input"]), old
