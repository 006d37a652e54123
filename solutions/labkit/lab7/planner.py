"""A planner: the fastest training configuration that fits a model on a cluster.

Chapters 1–6 each bought memory with one technique; a real run combines them. For a model, a
cluster and a global batch, the planner searches precision × optimizer × ZeRO stage (and ZeRO-3's
re-sharding) × offload × the layout D × T × P × C (data, tensor, pipeline, context parallel;
D·T·P·C = GPUs) and, for a mixture of experts, the expert-parallel E carved out of D ×
recomputation × attention kernel × sequence parallelism × the pipeline's virtual stages ×
micro-batch size, keeps the configurations whose busiest GPU (and its node's host memory) fits,
and returns the fastest, with the runners-up and the reason each lost.

What a configuration costs is the course's cost model, ``labkit.cost_model`` (read its module
docstrings: the planner's answer is only as good as they are): ``evaluate(model, cluster, config,
global_batch, margin)`` gives its bytes per consumer on the busiest GPU, whether it fits, and its
step time (``memory_estimate(model, config)`` and ``host_bytes(model, gpus_per_node, config)``
give the bytes alone, without the time, which costs more to compute); ``combinations`` the
choices a layout may be paired with; ``check_space`` the argument checks. This file holds the
search: which layouts exist, which configurations to try, which to skip without trying, how to
rank them, and what to say when nothing fits.

Chapter 7 (book/07_panorama.md); Lab 7, exercise 7.1 (labs/07_panorama.ipynb).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace

from labkit.cost_model import (ATTENTION, CHECKPOINTING, DEFAULT_MARGIN, Cluster, Config,
                               ModelSpec, PlanResult, check_space, combinations, evaluate,
                               host_bytes, memory_estimate)
from labkit.memory_model import CONSUMERS, ZERO_STAGES, bytes_per_parameter

GB = 10**9


# ==== exercise 7.1: your code ====

def layouts(model: ModelSpec, cluster: Cluster, global_batch: int) -> list[tuple[int, int, int, int, int]]:
    """Every layout (dp, tp, pp, cp, ep) the planner may use, in ascending order.

    A layout is valid when dp·tp·pp·cp = ``cluster.n_gpus``, tp ≤ ``cluster.gpus_per_node``
    (tensor parallelism stays inside a node), tp divides ``model.n_head``, pp divides
    ``model.n_layer``, cp divides ``model.seq_len`` and dp divides ``global_batch`` (every
    data-parallel rank gets whole sequences). ep, the expert-parallel size, is carved out of the
    data-parallel ranks (it does not multiply the GPUs): it divides dp and the model's routed
    experts ``model.n_expert``; a dense model (``model.n_expert is None``) has only ep = 1.
    """
    # BEGIN SOLUTION 7.1: list every valid (dp, tp, pp, cp, ep), sorted
    N = cluster.n_gpus
    divisors = [k for k in range(1, N + 1) if N % k == 0]
    experts = model.n_expert or 1
    out = []
    for tp in divisors:
        if tp > cluster.gpus_per_node or model.n_head % tp:
            continue
        for pp in divisors:
            if model.n_layer % pp or N % (tp * pp):
                continue
            for cp in divisors:
                if model.seq_len % cp or N % (tp * pp * cp):
                    continue
                dp = N // (tp * pp * cp)
                if global_batch % dp == 0:
                    out += [(dp, tp, pp, cp, ep) for ep in range(1, dp + 1)
                            if dp % ep == 0 and experts % ep == 0]
    return sorted(out)
    # END SOLUTION


def plan(model: ModelSpec, cluster: Cluster, global_batch: int, *, recipes=("mixed",),
         optimizers=("adam",), zero_stages=ZERO_STAGES, checkpointing=CHECKPOINTING,
         offload=(False,), attention=ATTENTION, sequence_parallel=(False, True),
         interleave=(False, True), reshard_after_forward=(True, False),
         margin: float = DEFAULT_MARGIN, n_runners_up: int = 5) -> PlanResult:
    """The fastest configuration that fits, and the runners-up.

    The space: every recipe in ``recipes``, optimizer in ``optimizers``, layout (dp, tp, pp, cp,
    ep) from ``layouts`` (``ep`` is ``Config``'s last field), and for each layout every choice
    ``combinations(space, model, tp, pp, cp)`` yields (``space``: what ``check_space`` returns),
    and every micro-batch size b dividing global_batch/dp (then n_micro = global_batch/(dp·b)). A configuration fits when ``evaluate(...).fits`` (with
    ``margin``). The order: step time (``Estimate.time.total``), then the total bytes on the GPU,
    then the ``Config`` itself (its fields in order) — exact comparisons, so the answer is
    deterministic.

    Returns a ``PlanResult``: ``best`` the first fitting configuration in that order and
    ``runners_up`` the next ``n_runners_up`` (fewer if fewer fit). Any pruning is allowed that
    never changes this answer. Raises ``ValueError`` (after ``check_space``'s checks) naming the
    real cause when nothing fits:
    * no layout is valid (saying which constraints);
    * even the static state (a configuration's GPU total minus its activations) fits in no
      configuration: how many GPUs of this memory it would need fully sharded, at least
      ⌈(fewest bytes per parameter that stay on the GPU over ``recipes`` × ``optimizers``; with
      offload allowed, only the parameters') × Ψ / memory⌉, e.g. "needs at least 20 GPUs of
      80 GB for the static state alone";
    * the GPU state fits only offloaded, and the host memory of a node never holds what offload
      puts there (a message that names the host memory);
    * the static state fits but the activations never do (a message that names the activations).
    """
    space = check_space(model, cluster, global_batch, recipes=recipes, optimizers=optimizers,
                        zero_stages=zero_stages, checkpointing=checkpointing, offload=offload,
                        attention=attention, sequence_parallel=sequence_parallel,
                        interleave=interleave, reshard_after_forward=reshard_after_forward,
                        margin=margin, n_runners_up=n_runners_up)
    # BEGIN SOLUTION 7.1: search the space (prune what cannot fit), rank, and explain a failure
    grid = layouts(model, cluster, global_batch)
    if not grid:
        raise ValueError(
            f"no layout D×T×P×C of {cluster.n_gpus} GPUs is valid: T ≤ {cluster.gpus_per_node} "
            f"GPUs per node and T | n_head={model.n_head}, P | n_layer={model.n_layer}, "
            f"C | seq_len={model.seq_len}, D | global_batch={global_batch}")
    usable = cluster.memory_bytes * (1 - margin)
    host_usable = cluster.host_memory_bytes * (1 - margin)
    fitting, smallest_static, smallest_host, smallest_total = [], math.inf, math.inf, math.inf
    for recipe, optimizer in itertools.product(space["recipes"], space["optimizers"]):
        for dp, tp, pp, cp, ep in grid:
            per_rank = global_batch // dp
            small = [b for b in range(1, math.isqrt(per_rank) + 1) if per_rank % b == 0]
            sizes = sorted(set(small + [per_rank // b for b in small]))  # O(√B), not O(B)
            for choice in combinations(space, model, tp, pp, cp):
                cfg = Config(recipe, optimizer, dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=1,
                             n_micro=per_rank, ep=ep, **choice)
                # the static and host state do not depend on recomputation or micro-batches
                memory = memory_estimate(model, cfg)
                static = memory["total"] - memory["activations"]
                smallest_static = min(smallest_static, static)
                if static > usable:
                    continue
                host = host_bytes(model, min(cluster.gpus_per_node, cluster.n_gpus), cfg)
                smallest_host = min(smallest_host, host)
                if host > host_usable:
                    continue
                for b in sizes:  # activations never shrink as b grows: stop at the first miss
                    cfg = replace(cfg, micro_batch=b, n_micro=per_rank // b)
                    total = memory_estimate(model, cfg)["total"]
                    smallest_total = min(smallest_total, total)
                    if total > usable:
                        break
                    fitting.append(evaluate(model, cluster, cfg, global_batch, margin))
    if not fitting:
        if smallest_static > usable:
            on_gpu = ("parameters",) if True in space["offload"] else CONSUMERS[:3]
            per_param = min(sum(bytes_per_parameter(r, o)[c] for c in on_gpu)
                            for r in space["recipes"] for o in space["optimizers"])
            need = math.ceil(per_param * model.n_params / cluster.memory_bytes)
            raise ValueError(
                f"needs at least {need} GPUs of {cluster.memory_bytes / GB:g} GB for the static state "
                f"alone ({per_param:g} B per parameter × {model.n_params:.3g} parameters, fully "
                f"sharded), {math.ceil(per_param * model.n_params / usable)} with the {margin:.0%} "
                f"margin; the best configuration here keeps {smallest_static / GB:.3g} GB per GPU "
                f"> {usable / GB:.3g} GB usable on {cluster.n_gpus} GPUs")
        if smallest_total == math.inf:
            raise ValueError(
                f"the GPU state fits only with offload, and a node's host memory never holds the "
                f"offloaded states: {smallest_host / GB:.3g} GB per node at best > "
                f"{host_usable / GB:.3g} GB usable of {cluster.host_memory_bytes / GB:g} GB")
        raise ValueError(
            f"the static state fits ({smallest_static / GB:.3g} GB per GPU at best) but the "
            f"activations never do: the smallest configuration whose static state fits needs "
            f"{smallest_total / GB:.3g} GB > {usable / GB:.3g} GB usable; allow full recomputation, "
            f"fused attention, sequence or context parallelism, more GPUs or shorter sequences")
    fitting.sort(key=lambda e: (e.time.total, e.memory["total"], e.config))
    return PlanResult(fitting[0], fitting[1:1 + n_runners_up])
    # END SOLUTION
