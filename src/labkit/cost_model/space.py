"""The planner's search space: its arguments checked, and the rules that pair choices with a layout.

Chapter 7 (book/07_panorama.md); the search itself is exercise 7.1 (``labkit.lab7.planner``).
"""
from __future__ import annotations

import itertools

from labkit import validate
from labkit.memory_model import OPTIMIZERS, RECIPES, ZERO_STAGES

from .hardware import Cluster
from .spec import ModelSpec

DEFAULT_MARGIN = 0.1
"""The share of GPU (and host) memory the planner leaves for what its model does not count."""
CHECKPOINTING = ("none", "selective", "full")
"""Activation recomputation: none, selective (the attention core), full (every layer)."""
ATTENTION = ("naive", "fused")
"""The attention kernel: naive (stores the a·s² scores for backward) or fused (FlashAttention)."""
SPACE = ("recipes", "optimizers", "zero_stages", "checkpointing", "offload", "attention",
         "sequence_parallel", "interleave", "reshard_after_forward")
"""The keyword arguments of ``plan`` that span the space, each a tuple of allowed values."""


def _choices(name: str, values, allowed) -> tuple:
    values = tuple(values) if isinstance(values, (list, tuple)) else None
    if not values or any(not any(v == a and type(v) is type(a) for a in allowed) for v in values) \
            or len(set(values)) != len(values):
        raise ValueError(f"{name} must be a non-empty tuple of distinct values from {tuple(allowed)}, "
                         f"got {values!r}")
    return values


def _allowed(zero: int, offload: bool, checkpointing: str, attention: str, cp: int) -> bool:
    return not ((offload and zero == 0) or (cp > 1 and attention != "fused")
                or (checkpointing == "selective" and attention == "fused"))


def combinations(space: dict, model: ModelSpec, tp: int, pp: int, cp: int):
    """Every choice the search pairs with a layout of sizes (tp, pp, cp), as ``Config`` keyword
    arguments (``zero_stage``, ``reshard_after_forward``, ``offload``, ``checkpointing``,
    ``attention``, ``sequence_parallel``, ``virtual_stages``). The rules: offload needs ZeRO ≥ 1
    (a shard to hand to the CPU); context parallelism needs fused attention (every
    implementation is a ring or a gather of fused blocks); selective recomputation needs naive
    attention (a fused kernel stores no core to recompute); sequence parallelism takes the values
    of ``space["sequence_parallel"]`` only when T > 1 (False otherwise: nothing to split);
    ``reshard_after_forward`` those of its tuple for ZeRO-3 only (True for the other stages);
    ``interleave`` allows v = 1 (False) and, on a pipeline (P > 1), every v > 1 dividing its
    L/P layers (True); v = 1 where no such v exists."""
    per_stage = model.n_layer // pp
    deeper = [v for v in range(2, per_stage + 1) if per_stage % v == 0] \
        if pp > 1 and True in space["interleave"] else []
    virtual = ([1] if False in space["interleave"] or not deeper else []) + deeper
    sp_values = space["sequence_parallel"] if tp > 1 else (False,)
    for zero, off, ckpt, attn in itertools.product(space["zero_stages"], space["offload"],
                                                   space["checkpointing"], space["attention"]):
        if not _allowed(zero, off, ckpt, attn, cp):
            continue
        reshards = space["reshard_after_forward"] if zero == 3 else (True,)
        for reshard, sp, v in itertools.product(reshards, sp_values, virtual):
            yield dict(zero_stage=zero, reshard_after_forward=reshard, offload=off,
                       checkpointing=ckpt, attention=attn, sequence_parallel=sp, virtual_stages=v)


def check_space(model: ModelSpec, cluster: Cluster, global_batch, *, margin, n_runners_up,
                **space) -> dict:
    """Validate ``plan``'s arguments (the values, then that the space is not empty for a reason
    the arguments alone decide); returns the space's arguments (``SPACE``) as tuples."""
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model must be a ModelSpec, got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    validate.positive_int("global_batch", global_batch)
    allowed = dict(recipes=RECIPES, optimizers=OPTIMIZERS, zero_stages=ZERO_STAGES,
                   checkpointing=CHECKPOINTING, offload=(False, True), attention=ATTENTION,
                   sequence_parallel=(False, True), interleave=(False, True),
                   reshard_after_forward=(True, False))
    if set(space) != set(SPACE):
        raise TypeError(f"the space's arguments are {SPACE}, got {tuple(space)}")
    space = {name: _choices(name, space[name], allowed[name]) for name in SPACE}
    validate.number("margin", margin, low=0, high=1, high_open=True)
    validate.non_negative_int("n_runners_up", n_runners_up)
    if space["offload"] == (True,) and space["zero_stages"] == (0,):
        raise ValueError("the search space is empty: offload=(True,) needs a ZeRO stage ≥ 1 (a "
                         "shard of optimizer states to hand to the CPU), and zero_stages=(0,)")
    if not any(_allowed(*c, 1) for c in itertools.product(space["zero_stages"], space["offload"],
                                                           space["checkpointing"], space["attention"])):
        raise ValueError(f"the search space is empty: checkpointing={space['checkpointing']} with "
                         f"attention={space['attention']} (selective recomputation needs naive "
                         f"attention) and offload={space['offload']}, zero_stages={space['zero_stages']}")
    if True in space["offload"] and cluster.host_adam_rate is None:
        raise ValueError("offload needs cluster.host_adam_rate (parameters per second one node's "
                         "CPUs update with Adam): measure it, or search offload=(False,)")
    return space
