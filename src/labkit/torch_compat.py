"""What the course needs from torch, on the older releases a Colab runtime may have.

Colab ships its own CUDA build of torch, often a few releases behind the one the course is
developed on (``requirements.txt``); labkit runs on any torch from ``labkit.MIN_TORCH`` on.
Where a later release added something a lab relies on, this module gives the older releases
the same behaviour, and changes nothing on the releases that have it.

``selective_checkpoint_op_output``: lab 5's ``FlopsPerBytePolicy`` reads the operator's output
from ``ctx.op_output``, which ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
hands a policy on recent releases (the policy is called after the operator ran). Older
releases (2.9, for one) call the policy *before* the operator runs and give no output. There
``create_selective_checkpoint_contexts`` is wrapped so that a policy finds ``ctx.op_output`` all
the same: the output computed on the ``meta`` device (its shapes, strides and dtypes; nothing
is computed and no random number is drawn), the same in forward and in the recompute.

``distributed_new_names``: torch 2.13 names the flat collectives ``dist.all_gather_single`` and
``dist.reduce_scatter_single`` (and deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor``,
which take the same arguments in the same order); on older releases the new names are given to
the old functions, so code written for either release runs on both. Both end in the same c10d
operators, so ``labkit.comm_count`` counts them alike.
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

__all__ = ["distributed_new_names", "has_op_output", "output_on_meta", "with_op_output",
           "selective_checkpoint_op_output"]


def has_op_output() -> bool:
    """True when this torch's ``SelectiveCheckpointContext`` carries the operator's output."""
    from torch.utils.checkpoint import SelectiveCheckpointContext

    return "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


def output_on_meta(op, args: tuple, kwargs: dict | None):
    """``op(*args, **kwargs)``'s output as meta tensors (None if the operator has no meta kernel)."""
    kwargs = dict(kwargs or {})
    if "device" in kwargs:  # a factory (randn, empty, ...): make it on meta too, drawing nothing
        kwargs["device"] = torch.device("meta")
    try:
        # with every dispatch mode off: a FlopCounterMode or MemTracker around the checkpointed
        # region must not count this shape computation as work or memory of the step
        with _disable_current_modes():
            return op(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
    except Exception:  # noqa: BLE001 - no meta kernel: the policy sees no output (0 bytes)
        return None


def with_op_output(policy):
    """``policy`` such that ``ctx.op_output`` is set (on meta) when torch does not set it."""

    @functools.wraps(policy)
    def policy_with_output(ctx, op, *args, **kwargs):
        if getattr(ctx, "op_output", None) is None:
            ctx.op_output = output_on_meta(op, args, kwargs)
        return policy(ctx, op, *args, **kwargs)

    return policy_with_output


def selective_checkpoint_op_output() -> None:
    """On a torch without ``ctx.op_output``, wrap ``create_selective_checkpoint_contexts`` so
    that its policy gets one (``with_op_output``). Idempotent; nothing on recent releases."""
    import torch.utils.checkpoint as checkpoint

    original = checkpoint.create_selective_checkpoint_contexts
    if has_op_output() or getattr(original, "labkit_op_output", False):
        return

    @functools.wraps(original)
    def create_selective_checkpoint_contexts(policy_fn_or_list, *args, **kwargs):
        if callable(policy_fn_or_list):
            policy_fn_or_list = with_op_output(policy_fn_or_list)
        return original(policy_fn_or_list, *args, **kwargs)

    create_selective_checkpoint_contexts.labkit_op_output = True
    checkpoint.create_selective_checkpoint_contexts = create_selective_checkpoint_contexts


NEW_COLLECTIVE_NAMES = {"all_gather_single": "all_gather_into_tensor",
                        "reduce_scatter_single": "reduce_scatter_tensor"}
"""torch 2.13's name → the older function with the same arguments."""


def distributed_new_names() -> None:
    """Give ``torch.distributed`` the 2.13 names of the flat collectives where it lacks them."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    for new, old in NEW_COLLECTIVE_NAMES.items():
        if not hasattr(dist, new):
            setattr(dist, new, getattr(dist, old))
