"""What lab 7's planner tests share (not collected): a search without pruning, written plainly.

``brute_force`` enumerates every configuration the docstring of ``labkit.lab7.planner.plan``
describes — every (dp, tp, pp) in 1..N with cp = N/(dp·tp·pp) and every expert-parallel ep in
1..dp (dividing dp and the routed experts; 1 for a dense model), every micro-batch size in
1..global_batch, every recipe, optimizer, ZeRO stage (ZeRO-3 with and without re-sharding after
forward), offload flag, attention kernel, recomputation, sequence parallelism and number of
virtual pipeline stages — filtered by the rules stated there, scored with the course's
``labkit.cost_model.evaluate`` (memory and time are not the exercise) and sorted by the stated
order. No pruning, no cleverness: slow and obviously right. Both sides call the same
``evaluate`` on the same ``Config``, so floats are identical and comparisons exact.
"""
from __future__ import annotations

import itertools

from labkit import cost_model

GB = 10**9
DEFAULT_SPACE = dict(recipes=("mixed",), optimizers=("adam",), zero_stages=(0, 1, 2, 3),
                     checkpointing=("none", "selective", "full"), offload=(False,),
                     attention=("naive", "fused"), sequence_parallel=(False, True),
                     interleave=(False, True), reshard_after_forward=(True, False))


def brute_layouts(model, cluster, global_batch):
    N, out = cluster.n_gpus, []
    for dp, tp, pp in itertools.product(range(1, N + 1), repeat=3):
        cp, rest = divmod(N, dp * tp * pp)
        if rest or cp == 0:
            continue
        if (tp <= cluster.gpus_per_node and model.n_head % tp == 0 and model.n_layer % pp == 0
                and model.seq_len % cp == 0 and global_batch % dp == 0):
            for ep in range(1, dp + 1):
                if dp % ep == 0 and (model.n_expert or 1) % ep == 0:
                    out.append((dp, tp, pp, cp, ep))
    return sorted(out)


def brute_configs(model, cluster, global_batch, space):
    """Every Config of the space, by the rules of plan()'s docstring and ``combinations``."""
    for recipe, opt, zero, off, attn, ckpt in itertools.product(
            space["recipes"], space["optimizers"], space["zero_stages"], space["offload"],
            space["attention"], space["checkpointing"]):
        if (off and zero == 0) or (ckpt == "selective" and attn == "fused"):
            continue
        for dp, tp, pp, cp, ep in brute_layouts(model, cluster, global_batch):
            if cp > 1 and attn != "fused":
                continue
            per_stage = model.n_layer // pp
            deeper = [v for v in range(2, per_stage + 1) if per_stage % v == 0] \
                if pp > 1 and True in space["interleave"] else []
            virtual = ([1] if False in space["interleave"] or not deeper else []) + deeper
            reshards = space["reshard_after_forward"] if zero == 3 else (True,)
            sps = space["sequence_parallel"] if tp > 1 else (False,)
            for b, reshard, sp, v in itertools.product(range(1, global_batch + 1), reshards, sps, virtual):
                if global_batch % (dp * b):
                    continue
                yield cost_model.Config(recipe, opt, zero, off, dp, tp, pp, cp, ckpt, b,
                                        global_batch // (dp * b), attn, sp, v, reshard, ep)


def brute_force(model, cluster, global_batch, margin=0.1, **space):
    """(every fitting configuration in the planner's order, every configuration evaluated)."""
    space = {**DEFAULT_SPACE, **space}
    every = [cost_model.evaluate(model, cluster, cfg, global_batch, margin)
             for cfg in brute_configs(model, cluster, global_batch, space)]
    fitting = sorted((e for e in every if e.fits), key=lambda e: (e.time.total, e.memory["total"], e.config))
    return fitting, every


def describe(model, cluster, batch):
    moe = (f", {model.n_expert} experts, top-{model.top_k}, {model.n_moe_layers} MoE layers"
           if model.is_moe else "")
    return (f"{model.name} (Ψ={model.n_params:.3g}, L={model.n_layer}, h={model.hidden}, "
            f"a={model.n_head}, s={model.seq_len}{moe}) on {cluster.n_gpus} GPUs "
            f"({cluster.gpus_per_node}/node, {cluster.memory_bytes / GB:.3g} GB), batch {batch}")
