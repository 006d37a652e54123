"""A planner: the fastest training configuration that fits a model on a cluster.

Chapters 1–6 each bought memory with one technique; a real run combines them. For a model, a
cluster (GPU count, memory per GPU, FLOP/s, link bandwidths, host memory and CPU speed) and a
global batch, the planner searches precision × optimizer × ZeRO stage × offload × the layout
D × T × P × C (data, tensor, pipeline, context parallel; D·T·P·C = GPUs) × activation
recomputation × attention kernel × micro-batch size, and keeps the configurations whose busiest
GPU (and its node's host memory) fits. Among them it returns the fastest, with the runners-up
and the reason each lost. The order of the search follows the chapter: fit the static state
first (ZeRO, TP, PP, offload), then the activations (recomputation, fused attention, SP, CP),
then speed. Context parallelism runs with fused attention only (every implementation is a ring
or an all-gather of fused blocks, the course's exercise 5.5 too), and selective recomputation
with naive attention only (fused attention stores no attention core to recompute).

Memory (``memory_estimate``): lab 6's per-GPU model (``labkit.lab6.parallel_memory.per_gpu_bytes``,
exercise 6.4), for the model's shape (``ModelSpec``: GPT-style, or Llama-style with grouped-query
attention, a SwiGLU MLP, no dropout), with sequence parallelism whenever T > 1 (Megatron's
practice). Offload is ZeRO-Offload (Ren et al. 2021, https://arxiv.org/abs/2101.06840): the fp32
master copy and the moments of this GPU's shard live in host memory and the Adam step runs on the
CPU; the 16-bit gradients leave the GPU as backward produces them, so the GPU keeps one
bucket of them (one layer's, the largest single gradient chapter 2 measured) instead of all;
the host keeps, per GPU, the shard's states and its 16-bit gradient buffer, and a node's
``gpus_per_node`` shards must fit in its ``host_memory_bytes``. A configuration fits if its GPU
total is at most ``(1 − margin)`` of the GPU's memory (and, with offload, its node's host bytes
at most ``(1 − margin)`` of the host's): the margin (``DEFAULT_MARGIN``) stands for what the
model does not count (the CUDA context, the allocator's fragmentation, communication buffers,
the logits, ZeRO-3's gathered layer).

Time (``step_time``), in seconds per optimizer step, an estimate with stated assumptions:

* compute: 2Ψ + 4·L·s·h FLOPs per token forward (the weights' matmuls and the attention scores
  and weighted sum over all s × s pairs; a fused kernel is causal and skips the blocks above the
  diagonal, 2·L·s·h — naive attention computes them all and masks), three times that for
  forward + backward, plus the recomputed forward (full: all of it; selective: the attention
  core; fused attention recomputes the scores in its backward, half its core), at
  ``utilisation`` of the peak (16-bit tensor cores, or the fp32 peak for the fp32 recipe),
  shared by all GPUs. 2Ψ counts every parameter as a matmul weight (an untied input
  embedding is a lookup: 2·V·h too many per token);
* the 1F1B pipeline bubble: (P − 1)/m of the compute time, i.e. a fraction (P − 1)/(m + P − 1)
  of the step (Narayanan et al. 2021, https://arxiv.org/abs/2104.04473, §2.2.1);
* communication, bytes per GPU over the bandwidth of its axis (ring collectives: an all-reduce
  moves 2(n − 1)/n of the buffer, a reduce-scatter or all-gather (n − 1)/n). The mesh is ordered
  P (outermost), D, C, T (innermost): Megatron-LM's default order ``tp-cp-ep-dp-pp`` (innermost
  first) and torchtitan's mesh ``("pp", "dp", "cp", "tp")`` (outermost first) agree on it. An
  axis whose groups lie inside a node uses ``intra_bw``, otherwise ``inter_bw``; every ring
  step (hop) also costs that axis' latency (``Cluster.intra_latency``, ``inter_latency``), which
  decides for small messages. DP (ZeRO over
  D·C ranks): ZeRO-0/1 one gradient all-reduce per step; ZeRO-2 a gradient reduce-scatter per
  micro-batch and a parameter all-gather; ZeRO-3 two parameter all-gathers and a gradient
  reduce-scatter per micro-batch. TP: four all-reduces of the layer's activations per layer and
  micro-batch (six with full recomputation). PP: an activation and a gradient per micro-batch.
  CP: the K and V blocks of the other C − 1 ranks per layer (forward), twice more in backward.
  Offload: the 16-bit gradient shard down and the 16-bit parameter shard up over ``pcie_bw``,
  and the CPU's Adam step over the node's ``gpus_per_node`` shards at ``host_adam_rate``
  parameters per second (a number to measure on the host, as chapter 7 does);
* no overlap of communication, transfers or the CPU step with compute: an upper bound.
  ZeRO-Offload overlaps the gradient copies with backward, and its one-step delayed parameter
  update hides the CPU step behind the next step (changing the optimizer's arithmetic); the
  planner assumes neither, so offload is charged in full.

``sensitivity`` re-ranks the fitting configurations with utilisation and each bandwidth moved by
±20%: the configurations that win somewhere in that box are ones this model cannot tell apart.

Chapter 7 (book/07_panorama.md); Lab 7, exercise 7.1 (labs/07_panorama.ipynb).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from labkit import validate
from labkit.memory_model import CONSUMERS, OPTIMIZERS, RECIPES, ZERO_STAGES, bytes_per_parameter
from labkit.lab6.parallel_memory import ATTENTION, CHECKPOINTING, per_gpu_bytes

GB = 10**9
AXES = ("dp", "tp", "pp", "cp", "offload", "cpu adam")
"""The communication and offload terms of ``StepTime.comm``."""
MESH_ORDER = ("pp", "dp", "cp", "tp")
"""The mesh's axes, outermost to innermost (``labkit.lab6.device_mesh.AXES``)."""
DEFAULT_MARGIN = 0.1
"""The share of GPU (and host) memory the planner leaves for what its model does not count."""
DEFAULT_UTILISATION = 0.4
"""The share of the peak FLOP/s the compute of the default ``Cluster`` reaches: an input, not a
fit. Chapter 7 shows the utilisation each published run implies (``labkit.reference.lab7``); at
0.4 the planner predicts 0.6–0.85 of their throughput (tests/test_lab7_calibration.py)."""


# ==== given: the course's code — read it, call it, don't change it ====

@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: Ψ parameters, L layers of hidden size h with a heads, s tokens.

    GPT-style by default (multi-head attention, a 4h GELU MLP, dropout). Llama-style models set
    ``n_kv_head`` (grouped-query attention: K and V have n_kv_head heads), ``ffn_hidden`` and
    ``gated_mlp=True`` (SwiGLU: three ffn-wide tensors), ``dropout=False``; RMSNorm and the
    absence of biases change no activation the model counts (a norm keeps its input either way)
    and Ψ is given, not derived. ``ModelSpec.llama(...)`` builds one.
    """

    n_params: float
    n_layer: int
    hidden: int
    n_head: int
    seq_len: int
    name: str = "model"
    n_kv_head: int | None = None
    ffn_hidden: int | None = None
    gated_mlp: bool = False
    dropout: bool = True

    def __post_init__(self) -> None:
        validate.positive_number("n_params", self.n_params)
        for name in ("n_layer", "hidden", "n_head", "seq_len"):
            validate.positive_int(name, getattr(self, name))
        if self.hidden % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide hidden={self.hidden}")
        if self.n_kv_head is not None:
            validate.positive_int("n_kv_head", self.n_kv_head)
            if self.n_head % self.n_kv_head:
                raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        if self.ffn_hidden is not None:
            validate.positive_int("ffn_hidden", self.ffn_hidden)
        validate.boolean("gated_mlp", self.gated_mlp)
        validate.boolean("dropout", self.dropout)
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {self.name!r}")
        if self.n_params < self.block_weights / 2:  # a shape that contradicts Ψ (Ψ in billions?)
            raise ValueError(
                f"n_params={self.n_params:.4g} is less than half the {self.block_weights:.4g} "
                f"weights of the layers alone (n_layer={self.n_layer} × the attention's and the "
                f"MLP's matrices of hidden={self.hidden}): Ψ counts every parameter, e.g. 7e9 for 7B")

    @property
    def block_weights(self) -> float:
        """The weight matrices of the L layers (no biases, norms or embeddings): Q and the
        output projection h², K and V h²·g/a each, the MLP 2·h·f (3·h·f gated)."""
        h, a = self.hidden, self.n_head
        g = self.n_kv_head or a
        f = self.ffn_hidden or 4 * h
        return float(self.n_layer * (2 * h * h + 2 * h * h * g // a + (3 if self.gated_mlp else 2) * h * f))

    @classmethod
    def llama(cls, n_params: float, n_layer: int, hidden: int, n_head: int, n_kv_head: int,
              ffn_hidden: int, seq_len: int, name: str = "llama") -> "ModelSpec":
        """A Llama-style spec: GQA with ``n_kv_head`` heads, SwiGLU of ``ffn_hidden``, no dropout."""
        return cls(n_params, n_layer, hidden, n_head, seq_len, name, n_kv_head=n_kv_head,
                   ffn_hidden=ffn_hidden, gated_mlp=True, dropout=False)

    @property
    def shape(self) -> dict:
        """The layer-shape options ``per_gpu_bytes`` takes."""
        return dict(n_kv_head=self.n_kv_head, ffn_hidden=self.ffn_hidden,
                    gated_mlp=self.gated_mlp, dropout=self.dropout)

    @classmethod
    def from_gpt_config(cls, cfg, name: str = "lab model") -> "ModelSpec":
        """The spec of ``labkit.models.GPT(cfg)``: Ψ counted on the meta device (no memory used)."""
        import torch

        from labkit.models import GPT

        with torch.device("meta"):
            n = sum(p.numel() for p in GPT(cfg).parameters())
        return cls(float(n), cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, name)


@dataclass(frozen=True)
class Cluster:
    """``n_gpus`` GPUs, ``gpus_per_node`` to a node; bandwidths in bytes/s per GPU, one direction.

    The defaults are an H100 SXM node (NVIDIA's datasheet): 80 GB, 989 TFLOP/s dense bf16
    (67 TFLOP/s fp32), NVLink 450 GB/s each way (900 GB/s is both directions), one 400 Gb/s
    InfiniBand NIC per GPU (50 GB/s), PCIe 5.0 x16 (64 GB/s), 2 TB of host memory per node (a
    DGX H100), ``DEFAULT_UTILISATION`` of the peak reached. ``host_adam_rate`` (parameters per
    second one node's CPUs update with Adam) has no default: offload needs it measured.
    ``intra_latency`` and ``inter_latency`` are the seconds one step of a ring collective (one
    hop) costs beyond its bytes, inside a node and across nodes: assumed, not measured (the
    order of magnitude of the small-message time of NCCL's all-reduce divided by its 2(n − 1)
    hops); they matter only for small messages, where a ring of many hops costs more than its
    bytes (the α of Thakur et al. 2005's α-β model of ring collectives).
    """

    n_gpus: int
    gpus_per_node: int = 8
    memory_bytes: float = 80 * GB
    flops: float = 989e12
    fp32_flops: float = 67e12
    intra_bw: float = 450 * GB
    inter_bw: float = 50 * GB
    pcie_bw: float = 64 * GB
    utilisation: float = DEFAULT_UTILISATION
    host_memory_bytes: float = 2000 * GB
    host_adam_rate: float | None = None
    intra_latency: float = 2e-6
    inter_latency: float = 8e-6

    def __post_init__(self) -> None:
        for name in ("n_gpus", "gpus_per_node"):
            validate.positive_int(name, getattr(self, name))
        for name in ("memory_bytes", "flops", "fp32_flops", "intra_bw", "inter_bw", "pcie_bw",
                     "host_memory_bytes"):
            validate.positive_number(name, getattr(self, name))
        if self.host_adam_rate is not None:
            validate.positive_number("host_adam_rate", self.host_adam_rate)
        for name in ("intra_latency", "inter_latency"):
            validate.number(name, getattr(self, name), low=0)
        validate.number("utilisation", self.utilisation, low=0, low_open=True, high=1)


@dataclass(frozen=True, order=True)
class Config:
    """One point of the search space. Ordered field by field (the planner's last tie-break)."""

    recipe: str
    optimizer: str
    zero_stage: int
    offload: bool
    dp: int
    tp: int
    pp: int
    cp: int
    checkpointing: str
    micro_batch: int
    n_micro: int
    attention: str = "naive"

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    def label(self) -> str:
        parts = [f"D{self.dp}·T{self.tp}·P{self.pp}·C{self.cp}", f"ZeRO-{self.zero_stage}",
                 self.recipe, self.optimizer, f"ckpt {self.checkpointing}", f"{self.attention} attn",
                 f"b={self.micro_batch}×m={self.n_micro}"]
        return ", ".join(parts + (["offload"] if self.offload else []))


@dataclass(frozen=True)
class StepTime:
    """Seconds per step: ``compute`` (recompute included), ``bubble``, ``comm`` per term of ``AXES``."""

    compute: float
    bubble: float
    comm: dict = field(compare=False)

    @property
    def total(self) -> float:
        return self.compute + self.bubble + sum(self.comm.values())


@dataclass(frozen=True)
class Estimate:
    """A configuration with its memory on the busiest GPU (bytes per consumer + "total"), the
    host bytes of its node (0 without offload) and the usable bytes of each."""

    config: Config
    memory: dict = field(compare=False)
    time: StepTime = field(compare=False)
    usable: float = field(compare=False)
    host: float = field(default=0.0, compare=False)
    host_usable: float = field(default=math.inf, compare=False)

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.usable and self.host <= self.host_usable


def _offloaded_shard(model: ModelSpec, cfg: Config) -> float:
    """Parameters of the shard whose optimizer step one GPU hands to the CPU under offload."""
    return model.n_params / (cfg.tp * cfg.pp) / (cfg.dp * cfg.cp)


def memory_estimate(model: ModelSpec, cluster: Cluster, cfg: Config) -> dict[str, float]:
    """Bytes of the four consumers on the busiest GPU of ``cfg`` (lab 6's model), and "total".

    Lab 6 divides K and V by T and refuses a T that does not divide the key/value heads (as
    Megatron-LM does); for such a layout (MQA, GQA with T > n_kv_head) lab 6 is asked for the
    multi-head shape and the activations are corrected to the ``kv_heads_per_rank`` whole heads
    a rank really holds (replicated ones too).

    Under offload the optimizer states leave the GPU and its gradients shrink to one bucket:
    one layer's 16-bit gradients of this GPU's parameters (the module docstring)."""
    g, kv = model.n_kv_head or model.n_head, kv_heads_per_rank(model, cfg.tp)
    shape = dict(model.shape)
    if g % cfg.tp:  # lab 6 refuses it: ask for the multi-head shape, correct below
        g = shape["n_kv_head"] = model.n_head
    out = per_gpu_bytes(model.n_params, world_size=cluster.n_gpus, dp=cfg.dp, tp=cfg.tp,
                        pp=cfg.pp, cp=cfg.cp, zero_stage=cfg.zero_stage, recipe=cfg.recipe,
                        optimizer=cfg.optimizer, n_layer=model.n_layer, hidden=model.hidden,
                        n_head=model.n_head, seq_len=model.seq_len, micro_batch=cfg.micro_batch,
                        n_micro=cfg.n_micro, checkpointing=cfg.checkpointing,
                        sequence_parallel=cfg.sequence_parallel, attention=cfg.attention,
                        **shape)
    out = {c: float(out[c]) for c in CONSUMERS}
    if kv * cfg.tp != g and cfg.checkpointing != "full":
        # lab 6 split K and V of g heads by T; a rank holds kv whole key/value heads
        e, s = RECIPES[cfg.recipe].activation, model.seq_len // cfg.cp
        per_layer = 2 * e * s * cfg.micro_batch * model.hidden / model.n_head * (kv - g / cfg.tp)
        out["activations"] += model.n_layer // cfg.pp * min(cfg.pp, cfg.n_micro) * per_layer
    if cfg.offload:
        out["optimizer states"] = 0.0  # in host memory
        local = model.n_params / (cfg.tp * cfg.pp)
        bucket = local / (model.n_layer // cfg.pp) * RECIPES[cfg.recipe].gradient
        out["gradients"] = min(out["gradients"], bucket)
    out["total"] = sum(out[c] for c in CONSUMERS)
    return out


def host_bytes(model: ModelSpec, cluster: Cluster, cfg: Config) -> float:
    """Host bytes of one node under offload: each of its GPUs' shard of optimizer states (fp32
    master and moments) and the shard's 16-bit gradient buffer; 0 without offload."""
    if not cfg.offload:
        return 0.0
    per = bytes_per_parameter(cfg.recipe, cfg.optimizer)
    per_gpu = _offloaded_shard(model, cfg) * (per["optimizer states"] + per["gradients"])
    return min(cluster.gpus_per_node, cluster.n_gpus) * per_gpu


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """Key/value heads one of ``tp`` tensor-parallel ranks holds: the groups its n_head/tp query
    heads use (n_kv_head/tp when tp divides n_kv_head; one, replicated, when tp is a multiple of
    it — Megatron-LM requires the first, vLLM-style replication allows the second; the most any
    rank needs otherwise)."""
    a, g = model.n_head, model.n_kv_head or model.n_head
    q, group = a // tp, a // g  # query heads per rank, query heads per key/value head
    return max((r * q + q - 1) // group - (r * q) // group + 1 for r in range(tp))


def _intra(cluster: Cluster, inner: int, size: int) -> bool:
    """Whether every group of an axis of ``size`` ranks with stride ``inner`` lies in one node."""
    return cluster.gpus_per_node % (inner * size) == 0


def step_time(model: ModelSpec, cluster: Cluster, cfg: Config, global_batch: int) -> StepTime:
    """The module docstring's estimate of one optimizer step of ``global_batch`` sequences."""
    psi, L, h, s = model.n_params, model.n_layer, model.hidden, model.seq_len
    D, T, P, C, b, m = cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.micro_batch, cfg.n_micro
    r = RECIPES[cfg.recipe]
    # FLOPs per token forward: the weights' 2Ψ and the attention's QKᵀ and softmax·V, 4·L·s·h
    # for all s × s pairs; a fused (causal) kernel skips the blocks above the diagonal: half
    core = 4 * L * s * h * (0.5 if cfg.attention == "fused" else 1.0)
    forward = 2 * psi + core
    again = {"none": 0.0, "selective": core, "full": forward}[cfg.checkpointing]
    if cfg.attention == "fused" and cfg.checkpointing != "full":
        again += core / 2  # the scores QKᵀ, recomputed in the fused kernel's backward
    peak = cluster.fp32_flops if cfg.recipe == "fp32" else cluster.flops
    compute = global_batch * s * (3 * forward + again) / (cluster.n_gpus * peak * cluster.utilisation)
    bubble = compute * (P - 1) / m

    local, n = psi / (T * P), D * C  # parameters per GPU; the ranks ZeRO shards over
    ring = (n - 1) / n
    dp = {0: 2 * ring * local * r.gradient, 1: 2 * ring * local * r.gradient,
          2: ring * local * (m * r.gradient + r.parameter),
          3: 3 * m * ring * local * r.parameter}[cfg.zero_stage]
    act = (s // C) * b * h * r.activation  # one layer's hidden states of one micro-batch
    layers = L // P
    tp = layers * m * (6 if cfg.checkpointing == "full" else 4) * 2 * (T - 1) / T * act
    pp = 2 * m * act / T if P > 1 else 0.0
    # K and V of one rank are kv_heads_per_rank of its a/T query heads' size (GQA; replicated
    # when T exceeds the key/value heads)
    cp = layers * m * 3 * (C - 1) * 2 * kv_heads_per_rank(model, T) / model.n_head * act
    # hops (ring steps) per step, each costing the axis' latency: a ring all-reduce over n ranks
    # takes 2(n − 1), a reduce-scatter or all-gather n − 1; DP's gradients go one layer's bucket
    # at a time; a pipeline stage sends an activation and a gradient per micro-batch
    hops = {"dp": layers * (n - 1) * {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[cfg.zero_stage],
            "tp": layers * m * (6 if cfg.checkpointing == "full" else 4) * 2 * (T - 1),
            "pp": 2 * m if P > 1 else 0, "cp": layers * m * 3 * (C - 1)}
    bw = {"tp": _intra(cluster, 1, T), "cp": _intra(cluster, T, C),
          "dp": _intra(cluster, T * C, D), "pp": _intra(cluster, T * C * D, P)}
    comm = {a: v / (cluster.intra_bw if bw[a] else cluster.inter_bw)
            + hops[a] * (cluster.intra_latency if bw[a] else cluster.inter_latency)
            for a, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp))}
    comm["offload"] = comm["cpu adam"] = 0.0
    if cfg.offload:
        if cluster.host_adam_rate is None:
            raise ValueError("offload needs cluster.host_adam_rate (parameters per second one "
                             "node's CPUs update with Adam): measure it on the host")
        shard = _offloaded_shard(model, cfg)
        comm["offload"] = shard * (r.gradient + r.parameter) / cluster.pcie_bw
        comm["cpu adam"] = min(cluster.gpus_per_node, cluster.n_gpus) * shard / cluster.host_adam_rate
    return StepTime(compute, bubble, comm)


def evaluate(model: ModelSpec, cluster: Cluster, cfg: Config, global_batch: int,
             margin: float = DEFAULT_MARGIN) -> Estimate:
    """``cfg``'s memory and time; it fits if its GPU total is at most (1 − margin) of the GPU's
    memory and its node's host bytes at most (1 − margin) of the host's."""
    return Estimate(cfg, memory_estimate(model, cluster, cfg),
                    step_time(model, cluster, cfg, global_batch),
                    cluster.memory_bytes * (1 - margin), host_bytes(model, cluster, cfg),
                    cluster.host_memory_bytes * (1 - margin))


def why_slower(best: Estimate, other: Estimate) -> str:
    """One line: how much slower ``other`` is than ``best`` and the terms that grew most."""
    def terms(e: Estimate) -> dict[str, float]:
        return {"compute": e.time.compute, "bubble": e.time.bubble,
                **{f"{a} comm" if a in ("dp", "tp", "pp", "cp") else a: v
                   for a, v in e.time.comm.items()}}
    a, b = terms(best), terms(other)
    diff = sorted(((b[k] - a[k], k) for k in a), reverse=True)
    grew = [f"{k} +{d:.3g} s" for d, k in diff if d > 0][:2]
    if other.time.total == best.time.total:
        return (f"as fast ({other.time.total:.3g} s), but lost the tie-break "
                f"({other.memory['total'] / GB:.3g} GB vs {best.memory['total'] / GB:.3g} GB, then field order)")
    slower = other.time.total / best.time.total - 1
    return f"{slower:.1%} slower ({other.time.total:.3g} s vs {best.time.total:.3g} s): " + ", ".join(grew)


@dataclass(frozen=True)
class PlanResult:
    """The fastest fitting configuration and the next ``n_runners_up`` in the planner's order."""

    best: Estimate
    runners_up: list

    def reasons(self) -> list[str]:
        return [why_slower(self.best, e) for e in self.runners_up]

    def table(self) -> list[dict]:
        """One row per configuration (the best first): layout, choices, GB, seconds, reason."""
        rows = []
        for e, why in [(self.best, "chosen")] + list(zip(self.runners_up, self.reasons())):
            rows.append(row(e) | {"why": why})
        return rows


def row(e: Estimate) -> dict:
    """One configuration as a table row: layout, choices, GB per GPU, seconds per step."""
    c = e.config
    return {"D×T×P×C": f"{c.dp}×{c.tp}×{c.pp}×{c.cp}", "ZeRO": c.zero_stage,
            "recipe": c.recipe, "optimizer": c.optimizer, "offload": c.offload,
            "recompute": c.checkpointing, "attention": c.attention,
            "b × m": f"{c.micro_batch} × {c.n_micro}",
            "GB/GPU": round(e.memory["total"] / GB, 2), "s/step": float(f"{e.time.total:.4g}")}


def _choices(name: str, values, allowed) -> tuple:
    values = tuple(values) if isinstance(values, (list, tuple)) else None
    if not values or any(not any(v == a and type(v) is type(a) for a in allowed) for v in values) \
            or len(set(values)) != len(values):
        raise ValueError(f"{name} must be a non-empty tuple of distinct values from {tuple(allowed)}, "
                         f"got {values!r}")
    return values


def combinations(zero_stages, offload, checkpointing, attention, cp: int):
    """The (zero stage, offload, recomputation, attention) choices the search pairs with a layout
    of context-parallel size ``cp``: offload needs ZeRO ≥ 1 (a shard to hand to the CPU), CP
    needs fused attention, selective recomputation needs naive attention."""
    for zero, off, ckpt, attn in itertools.product(zero_stages, offload, checkpointing, attention):
        if (off and zero == 0) or (cp > 1 and attn != "fused") or (ckpt == "selective" and attn == "fused"):
            continue
        yield zero, off, ckpt, attn


def check_space(model: ModelSpec, cluster: Cluster, global_batch, *, recipes, optimizers,
                zero_stages, checkpointing, offload, attention, margin, n_runners_up) -> dict:
    """Validate ``plan``'s arguments (the values, then that the space is not empty for a reason
    the arguments alone decide); returns them as tuples."""
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model must be a ModelSpec, got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    validate.positive_int("global_batch", global_batch)
    space = dict(recipes=_choices("recipes", recipes, RECIPES),
                 optimizers=_choices("optimizers", optimizers, OPTIMIZERS),
                 zero_stages=_choices("zero_stages", zero_stages, ZERO_STAGES),
                 checkpointing=_choices("checkpointing", checkpointing, CHECKPOINTING),
                 offload=_choices("offload", offload, (False, True)),
                 attention=_choices("attention", attention, ATTENTION))
    validate.number("margin", margin, low=0, high=1, high_open=True)
    validate.non_negative_int("n_runners_up", n_runners_up)
    if space["offload"] == (True,) and space["zero_stages"] == (0,):
        raise ValueError("the search space is empty: offload=(True,) needs a ZeRO stage ≥ 1 (a "
                         "shard of optimizer states to hand to the CPU), and zero_stages=(0,)")
    if not list(combinations(space["zero_stages"], space["offload"], space["checkpointing"],
                             space["attention"], 1)):
        raise ValueError(f"the search space is empty: checkpointing={space['checkpointing']} with "
                         f"attention={space['attention']} (selective recomputation needs naive "
                         f"attention) and offload={space['offload']}, zero_stages={space['zero_stages']}")
    if True in space["offload"] and cluster.host_adam_rate is None:
        raise ValueError("offload needs cluster.host_adam_rate (parameters per second one node's "
                         "CPUs update with Adam): measure it, or search offload=(False,)")
    return space


# ==== exercise 7.1: your code ====

def layouts(model: ModelSpec, cluster: Cluster, global_batch: int) -> list[tuple[int, int, int, int]]:
    """Every layout (dp, tp, pp, cp) the planner may use, in ascending order.

    A layout is valid when dp·tp·pp·cp = ``cluster.n_gpus``, tp ≤ ``cluster.gpus_per_node``
    (tensor parallelism stays inside a node), tp divides ``model.n_head``, pp divides
    ``model.n_layer``, cp divides ``model.seq_len`` and dp divides ``global_batch`` (every
    data-parallel rank gets whole sequences).
    """
    raise NotImplementedError("exercise 7.1: list every valid (dp, tp, pp, cp), sorted (labs/07_panorama.ipynb)")


def plan(model: ModelSpec, cluster: Cluster, global_batch: int, *, recipes=("mixed",),
         optimizers=("adam",), zero_stages=ZERO_STAGES, checkpointing=CHECKPOINTING,
         offload=(False,), attention=ATTENTION, margin: float = DEFAULT_MARGIN,
         n_runners_up: int = 5) -> PlanResult:
    """The fastest configuration that fits, and the runners-up.

    The space: every recipe in ``recipes``, optimizer in ``optimizers``, layout from ``layouts``,
    and for each layout the (ZeRO stage, offload, recomputation, attention) choices that
    ``combinations`` yields for its cp, and micro-batch size b dividing global_batch/dp (then
    n_micro = global_batch/(dp·b)). A configuration fits when ``evaluate(...).fits``. The order:
    step time (``Estimate.time.total``), then the total bytes on the GPU, then the ``Config``
    itself (its fields in order) — exact comparisons, so the answer is deterministic.

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
                        attention=attention, margin=margin, n_runners_up=n_runners_up)
    raise NotImplementedError("exercise 7.1: search the space (prune what cannot fit), rank, and explain a failure (labs/07_panorama.ipynb)")


# ==== given: the course's code — read it, call it, don't change it ====

def every_fitting(model: ModelSpec, cluster: Cluster, global_batch: int, **space) -> list[Estimate]:
    """Every fitting configuration of ``plan``'s space, in the planner's order (best first)."""
    result = plan(model, cluster, global_batch, **space, n_runners_up=10**9)
    return [result.best] + list(result.runners_up)


def rank_of_layout(ranked: list[Estimate], dp: int, tp: int, pp: int, cp: int = 1) -> tuple[int, Estimate | None]:
    """The 1-based place of the first configuration with layout D×T×P×C in ``ranked`` (the
    planner's order) and that estimate; (0, None) if no configuration of that layout fits."""
    for i, e in enumerate(ranked):
        c = e.config
        if (c.dp, c.tp, c.pp, c.cp) == (dp, tp, pp, cp):
            return i + 1, e
    return 0, None


SENSITIVITY = (0.8, 1.0, 1.2)
"""The factors ``sensitivity`` applies to the utilisation and to each bandwidth."""
KNOBS = ("utilisation", "intra_bw", "inter_bw", "pcie_bw")
"""The cluster's inputs ``sensitivity`` moves; a step's time is linear in the inverse of each."""


def time_terms(model: ModelSpec, cluster: Cluster, cfg: Config, global_batch: int) -> tuple[float, dict]:
    """``(t0, parts)``: the step time on ``cluster`` and, per knob of ``KNOBS``, the part of it
    that scales with 1/knob (compute and bubble with 1/utilisation, each axis' bytes with 1/its
    bandwidth; the CPU step with none), so that with every knob k scaled by f_k the step takes
    t0 + Σ parts[k]·(1/f_k − 1). Found by halving each knob (exact: the time is linear in 1/knob)."""
    t0 = step_time(model, cluster, cfg, global_batch).total
    parts = {k: step_time(model, replace(cluster, **{k: getattr(cluster, k) / 2}), cfg,
                          global_batch).total - t0 for k in KNOBS}
    return t0, parts


def sensitivity(model: ModelSpec, cluster: Cluster, global_batch: int, ranked: list[Estimate],
                factors=SENSITIVITY) -> dict:
    """Re-rank ``ranked`` (``every_fitting``'s list) with the utilisation, NVLink, InfiniBand and
    PCIe bandwidths each scaled by every factor of ``factors`` (3⁴ = 81 combinations by default;
    memory does not change, only time; a scaled utilisation above 1 is allowed: it is a model
    input). Returns ``{"winners": {Config: combinations where it is fastest}, "spread": {Config:
    (fastest, slowest) step time}}`` for the winners, most wins first: the configurations this
    model cannot tell apart within those factors. A configuration slower than best·max(f)/min(f)
    at the nominal inputs can win nowhere and is skipped."""
    lo, hi = min(factors), max(factors)
    limit = ranked[0].time.total * (1 / lo) / (1 / hi)  # the best's slowest vs another's fastest
    terms = [(e, *time_terms(model, cluster, e.config, global_batch)) for e in ranked
             if e.time.total <= limit]
    wins, spread = {}, {}
    for combo in itertools.product(factors, repeat=len(KNOBS)):
        times = [(t0 + sum(parts[k] * (1 / f - 1) for k, f in zip(KNOBS, combo)), e.memory["total"], e.config)
                 for e, t0, parts in terms]
        best = min(times)
        wins[best[2]] = wins.get(best[2], 0) + 1
        for tt, _, cfg in times:
            a, b = spread.get(cfg, (math.inf, 0.0))
            spread[cfg] = (min(a, tt), max(b, tt))
    order = sorted(wins.items(), key=lambda kv: -kv[1])
    return {"winners": dict(order), "spread": {cfg: spread[cfg] for cfg, _ in order}}
