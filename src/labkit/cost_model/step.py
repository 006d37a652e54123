"""Seconds per optimizer step of a configuration: compute, the pipeline bubble, and the
communication that compute does not hide.

* **Compute**: m micro-batches of ``labkit.cost_model.kernels.micro_batch_time`` (every kernel
  on its roofline; recomputation included).
* **Bubble**: 1F1B idles (P − 1) micro-batch slots of a stage (Narayanan et al. 2021,
  https://arxiv.org/abs/2104.04473, §2.2.1); the interleaved schedule with v virtual stages
  idles (P − 1)/v of them (§2.2.2): (P − 1)/(v·m) of the compute, as Llama 3 states its own
  (Grattafiori et al. 2024, https://arxiv.org/abs/2407.21783, §3.3.2) — for m ≥ P; with fewer
  micro-batches than stages each of the v rounds also waits P − m slots (``idle_slots``). A slot
  is one micro-batch's compute plus its tensor-, context- and expert-parallel traffic.
* **Communication**, bytes per GPU over the bandwidth of its axis (ring collectives: an
  all-reduce moves 2(n − 1)/n of the buffer, a reduce-scatter or all-gather (n − 1)/n), plus the
  axis' latency per ring step. The mesh is P (outermost), D, C, T (innermost), Megatron-LM's
  default order, E the inner part of D; an axis whose groups fit in a node runs on NVLink,
  otherwise on the network.

  - TP: four all-reduces (with SP, as many reduce-scatter + all-gather pairs, the same bytes) of
    a layer's hidden states per layer and micro-batch, six with full recomputation; on the
    critical path, **not overlapped** (Megatron-LM of 2021 did not; TransformerEngine's
    userbuffer overlap is left out).
  - CP: a ring passes the K and V of the other C − 1 ranks per layer in forward, K, V and their
    gradients in backward; each step's transfer **overlaps** the attention of the block in hand
    and only its excess shows — short chunks hide little.
  - EP (an MoE model with E > 1): four all-to-alls per MoE layer and micro-batch — dispatch
    and combine, forward and backward; six with full recomputation — each of the n_expert·C·h
    buffer of ``labkit.moe_memory.all_to_all_bytes`` (for this TP rank's tokens: s/(C·T) with
    SP, all s/C without), of which (E − 1)/E leaves the GPU; on the critical path, **not
    overlapped** (DualPipe's and Megatron-Core's overlap of the all-to-all are left out) and
    part of a pipeline slot. The E group lies inside the D ranks (the mesh (pp, dp[ep], cp, tp):
    stride T·C): what goes to GPUs of the same node crosses NVLink and what goes to other nodes
    the network, both at once (the slower sets the time), plus E − 1 latencies of the
    pairwise exchange (Thakur et al. 2005).
  - PP: an activation and a gradient per micro-batch and virtual stage boundary (÷T: Megatron's
    scatter/gather), **not overlapped**.
  - DP/ZeRO over the D·C ranks, **overlapped** up to ``Cluster.overlap_share`` (0.8 by default:
    the first bucket cannot start before its gradients exist, the last ends after the compute,
    and NCCL's kernels take SMs from the matmuls — an assumption) of the compute of the window
    the schedule gives it (an MoE model's experts, one more collective over the D·C/E ranks that
    share them, after the rest): ZeRO-0's all-reduce and ZeRO-1's reduce-scatter behind the last
    micro-batch's backward, ZeRO-1/2's parameter all-gather behind the first micro-batch's
    forward, ZeRO-2's per-micro-batch reduce-scatter behind each backward, ZeRO-3's gathers
    behind each forward and backward (one gather per micro-batch without re-sharding after
    forward, two with).
  - Offload: the 16-bit gradient shard down and the parameter shard up over PCIe, and the CPU's
    Adam step over the node's shards at ``host_adam_rate``, **not overlapped** (ZeRO-Offload can
    overlap the copies and delay the update by a step; the model charges both in full).

Chapter 7 (book/07_panorama.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit.memory_model import RECIPES
from labkit.moe_memory import all_to_all_bytes

from .hardware import Cluster
from .kernels import MicroBatchTime, micro_batch_time
from .memory import kv_heads_per_rank, local_params, moe_layers_on_stage, offloaded_shard
from .spec import Config, ModelSpec, check_expert_parallel

AXES = ("dp", "tp", "pp", "cp", "ep", "offload", "cpu adam")
"""The communication and offload terms of ``StepTime.comm``."""
MESH_ORDER = ("pp", "dp", "cp", "tp")
"""The mesh's axes, outermost to innermost (``labkit.lab6.device_mesh.AXES``); E is the inner
part of dp (an expert-parallel group: E consecutive data-parallel ranks)."""


@dataclass(frozen=True)
class StepTime:
    """Seconds per step: ``compute`` (recompute included), ``bubble``, ``comm`` per term of
    ``AXES`` (what compute does not hide), and ``hidden``: the traffic time overlap hid."""

    compute: float
    bubble: float
    comm: dict = field(compare=False)
    hidden: dict = field(default_factory=dict, compare=False)

    @property
    def total(self) -> float:
        return self.compute + self.bubble + sum(self.comm.values())


def _intra(cluster: Cluster, inner: int, size: int) -> bool:
    """Whether every group of an axis of ``size`` ranks with stride ``inner`` lies in one node."""
    return cluster.gpus_per_node % (inner * size) == 0


def _link(cluster: Cluster, intra: bool) -> tuple[float, float]:
    return (cluster.intra_bw, cluster.intra_latency) if intra else (cluster.inter_bw, cluster.inter_latency)


def _exposed(seconds: float, window: float, share: float) -> tuple[float, float]:
    """(exposed, hidden) seconds of a transfer beside ``window`` seconds of compute, ``share`` of
    which can hide it."""
    shown = max(0.0, seconds - share * window)
    return shown, seconds - shown


def idle_slots(P: int, v: int, m: int) -> float:
    """Micro-batch slots a stage idles per step: P − 1 under 1F1B; with v > 1 virtual stages
    (P − 1)/v once m ≥ P, and P − m more when fewer micro-batches than stages cannot keep the
    loop of P·v chunks busy (each chunk round waits for the first micro-batch's trip)."""
    if v == 1:
        return float(P - 1)
    return max(0, P - m) + (P - 1) / v


def data_parallel(model: ModelSpec, cluster: Cluster, cfg: Config, mb: MicroBatchTime) -> tuple[float, float]:
    """(exposed, hidden) seconds of the ZeRO/data-parallel traffic of one step (module docstring)."""
    n = cfg.dp * cfg.cp
    if n == 1:
        return 0.0, 0.0
    r = RECIPES[cfg.recipe]
    bw, lat = _link(cluster, _intra(cluster, cfg.tp * cfg.cp, cfg.dp))
    layers, m = model.n_layer // cfg.pp, cfg.n_micro
    (local, experts), ring = local_params(model, cfg), (n - 1) / n
    n_e = n // cfg.ep  # the ranks that hold the same experts
    e_bw, e_lat = _link(cluster, _intra(cluster, cfg.tp * cfg.cp * cfg.ep, cfg.dp // cfg.ep))

    def coll(bytes_per_param: float) -> float:  # one reduce-scatter or all-gather, bucketed by layer
        seconds = ring * local * bytes_per_param / bw + layers * (n - 1) * lat
        if experts and n_e > 1:  # then the experts' own, over the D·C/E ranks that share them
            seconds += (n_e - 1) / n_e * experts * bytes_per_param / e_bw + layers * (n_e - 1) * e_lat
        return seconds

    grads, params = coll(r.gradient), coll(r.parameter)
    share = cluster.overlap_share
    backward, forward = mb.backward + mb.recompute, mb.forward
    z = cfg.zero_stage
    if z == 0:
        parts = [(1, _exposed(2 * grads, backward, share))]
    elif z == 1:
        parts = [(1, _exposed(grads, backward, share)), (1, _exposed(params, forward, share))]
    elif z == 2:
        parts = [(m, _exposed(grads, backward, share)), (1, _exposed(params, forward, share))]
    elif cfg.reshard_after_forward:
        parts = [(m, _exposed(params, forward, share)), (m, _exposed(params + grads, backward, share))]
    else:
        parts = [(m, _exposed(params, forward, share)), (m, _exposed(grads, backward, share))]
    return sum(k * p[0] for k, p in parts), sum(k * p[1] for k, p in parts)


def expert_parallel(model: ModelSpec, cluster: Cluster, cfg: Config) -> float:
    """Seconds of one micro-batch's all-to-alls on the slowest stage (module docstring); 0 for
    E = 1."""
    E = cfg.ep
    if E == 1:
        return 0.0
    sp = cfg.tp if cfg.sequence_parallel else 1
    tokens = max(1, model.seq_len // cfg.cp * cfg.micro_batch // sp)
    buffer = all_to_all_bytes(tokens, model.n_expert, model.top_k, model.capacity_factor, model.hidden,
                              RECIPES[cfg.recipe].activation)
    inner = cfg.tp * cfg.cp
    if _intra(cluster, inner, E):
        seconds = (E - 1) / E * buffer / cluster.intra_bw + (E - 1) * cluster.intra_latency
    else:  # the group's ranks in this node over NVLink, the others over the network, at once
        here = max(1, min(E, cluster.gpus_per_node // inner))
        seconds = max((here - 1) / E * buffer / cluster.intra_bw, (E - here) / E * buffer / cluster.inter_bw) \
            + (E - 1) * cluster.inter_latency
    calls = 6 if cfg.checkpointing == "full" else 4
    return moe_layers_on_stage(model, cfg) * calls * seconds


def step_time(model: ModelSpec, cluster: Cluster, cfg: Config, global_batch: int) -> StepTime:
    """The module docstring's estimate of one optimizer step of ``global_batch`` sequences."""
    check_expert_parallel(model, cfg)
    D, T, P, C, b, m, v = cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.micro_batch, cfg.n_micro, cfg.virtual_stages
    e = RECIPES[cfg.recipe].activation
    mb = micro_batch_time(model, cluster, cfg)
    layers = model.n_layer // P
    act = (model.seq_len // C) * b * model.hidden * e  # one layer's hidden states of a micro-batch
    # tensor parallelism: on the critical path
    bw, lat = _link(cluster, _intra(cluster, 1, T))
    n_coll = 6 if cfg.checkpointing == "full" else 4
    tp_mb = layers * n_coll * (2 * (T - 1) / T * act / bw + 2 * (T - 1) * lat) if T > 1 else 0.0
    # context parallelism: each ring step hides behind the attention of the block in hand
    cp_mb = cp_hidden = 0.0
    if C > 1:
        bw, lat = _link(cluster, _intra(cluster, T, C))
        kv = 2 * e * (model.seq_len // C) * b * model.head_dim * kv_heads_per_rank(model, T)
        attn = mb.attention / layers / C  # one step's attention, forward
        passes = [(kv, attn), (2 * kv, 2.5 * attn)] + ([(kv, attn)] if cfg.checkpointing == "full" else [])
        for moved, window in passes:
            shown, hid = _exposed(moved / bw + lat, window, share=1.0)  # the ring's design
            cp_mb += layers * (C - 1) * shown
            cp_hidden += layers * (C - 1) * hid
    # pipeline: activations and gradients across each of the v·P − 1 boundaries
    pp = 0.0
    if P > 1:
        bw, lat = _link(cluster, _intra(cluster, T * C * D, P))
        pp = 2 * m * v * (act / T / bw + lat)
    ep_mb = expert_parallel(model, cluster, cfg)
    dp, dp_hidden = data_parallel(model, cluster, cfg, mb)
    comm = {"dp": dp, "tp": m * tp_mb, "pp": pp, "cp": m * cp_mb, "ep": m * ep_mb, "offload": 0.0,
            "cpu adam": 0.0}
    if cfg.offload:
        if cluster.host_adam_rate is None:
            raise ValueError("offload needs cluster.host_adam_rate (parameters per second one "
                             "node's CPUs update with Adam): measure it on the host")
        r, shard = RECIPES[cfg.recipe], offloaded_shard(model, cfg)
        comm["offload"] = shard * (r.gradient + r.parameter) / cluster.pcie_bw
        comm["cpu adam"] = min(cluster.gpus_per_node, cluster.n_gpus) * shard / cluster.host_adam_rate
    bubble = idle_slots(P, v, m) * (mb.total + tp_mb + cp_mb + ep_mb)
    return StepTime(m * mb.total, bubble, comm, {"dp": dp_hidden, "cp": m * cp_hidden})
