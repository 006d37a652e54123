"""A planner: the fastest training configuration that fits a model on a cluster.

Chapters 1–6 each bought memory with one technique; a real run combines them. For a model, a
cluster (GPU count, memory per GPU, FLOP/s, link bandwidths) and a global batch, the planner
searches precision × optimizer × ZeRO stage × offload × the layout D × T × P × C (data, tensor,
pipeline, context parallel; D·T·P·C = GPUs) × activation recomputation × micro-batch size, and
keeps the configurations whose busiest GPU fits. Among them it returns the fastest, with the
runners-up and the reason each lost. The order of the search follows the chapter: fit the
static state first (ZeRO, TP, PP), then the activations (recomputation, SP, CP), then speed.

Memory (``memory_estimate``): lab 6's per-GPU model (``labkit.lab6.parallel_memory.per_gpu_bytes``,
exercise 6.4) with sequence parallelism whenever T > 1 (Megatron's practice); offload moves the
optimizer states (master copy and moments) to CPU memory (ZeRO-Offload, Ren et al. 2021,
https://arxiv.org/abs/2101.06840). A configuration fits if its total is at most
``(1 − margin)`` of the GPU's memory: the margin (10% by default) stands for what the model does
not count (the CUDA context, the allocator's fragmentation, communication buffers, the logits,
ZeRO-3's gathered layer).

Time (``step_time``), in seconds per optimizer step, an estimate with stated assumptions:

* compute: 2Ψ + 4·L·s·h FLOPs per token forward (the weights' matmuls and the attention scores
  and weighted sum), three times that for forward + backward, plus the recomputed forward
  (full: all of it; selective: the attention core, 4·L·s·h), at ``utilisation`` of the peak
  (16-bit tensor cores, or the fp32 peak for the fp32 recipe), shared by all GPUs;
* the 1F1B pipeline bubble: a fraction (P − 1)/(m + P − 1) of the step is idle (Narayanan et al.
  2021, https://arxiv.org/abs/2104.04473), i.e. the compute time × (P − 1)/m;
* communication, bytes per GPU over the bandwidth of its axis (ring collectives: an all-reduce
  moves 2(n − 1)/n of the buffer, a reduce-scatter or all-gather (n − 1)/n). The mesh is ordered
  T (innermost), C, D, P (outermost), as Megatron-LM's default; an axis whose groups lie inside
  a node uses ``intra_bw``, otherwise ``inter_bw``. DP (ZeRO over D·C ranks): ZeRO-0/1 one
  gradient all-reduce per step; ZeRO-2 a gradient reduce-scatter per micro-batch and a parameter
  all-gather; ZeRO-3 two parameter all-gathers and a gradient reduce-scatter per micro-batch.
  TP: four all-reduces of the layer's activations per layer and micro-batch (six with full
  recomputation). PP: an activation and a gradient per micro-batch. CP: the K and V blocks of
  the other C − 1 ranks per layer (forward), twice more in backward. Offload: the gradient
  shard down and the parameter shard up over ``pcie_bw``;
* no overlap of communication with compute: an upper bound (the chapter discusses overlap).

Chapter 7 (book/07_panorama.md); Lab 7, exercise 7.1 (labs/07_panorama.ipynb).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from labkit.memory_model import CONSUMERS, OPTIMIZERS, RECIPES, ZERO_STAGES, bytes_per_parameter
from labkit.lab6.parallel_memory import CHECKPOINTING, per_gpu_bytes

GB = 10**9
AXES = ("dp", "tp", "pp", "cp", "offload")
"""The communication terms of ``StepTime.comm``."""


def _positive(name: str, value, kind=int) -> None:
    ok = (int, float) if kind is float else int
    if isinstance(value, bool) or not isinstance(value, ok) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive, finite {kind.__name__}, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style transformer: Ψ parameters, L layers of hidden size h with a heads, s tokens."""

    n_params: float
    n_layer: int
    hidden: int
    n_head: int
    seq_len: int
    name: str = "model"

    def __post_init__(self) -> None:
        _positive("n_params", self.n_params, float)
        for name in ("n_layer", "hidden", "n_head", "seq_len"):
            _positive(name, getattr(self, name))
        if self.hidden % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide hidden={self.hidden}")

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

    The defaults are an H100 SXM node: 80 GB, 989 TFLOP/s dense bf16 (67 TFLOP/s fp32), NVLink
    450 GB/s, one 400 Gb/s InfiniBand NIC per GPU (50 GB/s), PCIe 5.0 x16 (64 GB/s), 40% of the
    peak reached (``utilisation``).
    """

    n_gpus: int
    gpus_per_node: int = 8
    memory_bytes: float = 80 * GB
    flops: float = 989e12
    fp32_flops: float = 67e12
    intra_bw: float = 450 * GB
    inter_bw: float = 50 * GB
    pcie_bw: float = 64 * GB
    utilisation: float = 0.4

    def __post_init__(self) -> None:
        for name in ("n_gpus", "gpus_per_node"):
            _positive(name, getattr(self, name))
        for name in ("memory_bytes", "flops", "fp32_flops", "intra_bw", "inter_bw", "pcie_bw"):
            _positive(name, getattr(self, name), float)
        if not (isinstance(self.utilisation, (int, float)) and 0 < self.utilisation <= 1):
            raise ValueError(f"utilisation must be in (0, 1], got {self.utilisation!r}")


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

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    def label(self) -> str:
        parts = [f"D{self.dp}·T{self.tp}·P{self.pp}·C{self.cp}", f"ZeRO-{self.zero_stage}",
                 self.recipe, self.optimizer, f"ckpt {self.checkpointing}",
                 f"b={self.micro_batch}×m={self.n_micro}"]
        return ", ".join(parts + (["offload"] if self.offload else []))


@dataclass(frozen=True)
class StepTime:
    """Seconds per step: ``compute`` (recompute included), ``bubble``, ``comm`` per axis."""

    compute: float
    bubble: float
    comm: dict = field(compare=False)

    @property
    def total(self) -> float:
        return self.compute + self.bubble + sum(self.comm.values())


@dataclass(frozen=True)
class Estimate:
    """A configuration with its memory on the busiest GPU (bytes per consumer + "total")."""

    config: Config
    memory: dict = field(compare=False)
    time: StepTime = field(compare=False)
    usable: float = field(compare=False)

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.usable


def memory_estimate(model: ModelSpec, cluster: Cluster, cfg: Config) -> dict[str, float]:
    """Bytes of the four consumers on the busiest GPU of ``cfg`` (lab 6's model), and "total"."""
    out = per_gpu_bytes(model.n_params, world_size=cluster.n_gpus, dp=cfg.dp, tp=cfg.tp,
                        pp=cfg.pp, cp=cfg.cp, zero_stage=cfg.zero_stage, recipe=cfg.recipe,
                        optimizer=cfg.optimizer, n_layer=model.n_layer, hidden=model.hidden,
                        n_head=model.n_head, seq_len=model.seq_len, micro_batch=cfg.micro_batch,
                        n_micro=cfg.n_micro, checkpointing=cfg.checkpointing,
                        sequence_parallel=cfg.sequence_parallel)
    out = {c: float(out[c]) for c in CONSUMERS}
    if cfg.offload:
        out["optimizer states"] = 0.0  # in CPU memory
    out["total"] = sum(out[c] for c in CONSUMERS)
    return out


def _intra(cluster: Cluster, inner: int, size: int) -> bool:
    """Whether every group of an axis of ``size`` ranks with stride ``inner`` lies in one node."""
    return cluster.gpus_per_node % (inner * size) == 0


def step_time(model: ModelSpec, cluster: Cluster, cfg: Config, global_batch: int) -> StepTime:
    """The module docstring's estimate of one optimizer step of ``global_batch`` sequences."""
    psi, L, h, s = model.n_params, model.n_layer, model.hidden, model.seq_len
    D, T, P, C, b, m = cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.micro_batch, cfg.n_micro
    r = RECIPES[cfg.recipe]
    forward = 2 * psi + 4 * L * s * h  # FLOPs per token
    again = {"none": 0.0, "selective": 4 * L * s * h, "full": forward}[cfg.checkpointing]
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
    cp = layers * m * 3 * (C - 1) * 2 * act / T
    bw = {"tp": _intra(cluster, 1, T), "cp": _intra(cluster, T, C),
          "dp": _intra(cluster, T * C, D), "pp": _intra(cluster, T * C * D, P)}
    comm = {a: v / (cluster.intra_bw if bw[a] else cluster.inter_bw)
            for a, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp))}
    comm["offload"] = local / n * (r.gradient + r.parameter) / cluster.pcie_bw if cfg.offload else 0.0
    return StepTime(compute, bubble, comm)


def evaluate(model: ModelSpec, cluster: Cluster, cfg: Config, global_batch: int,
             margin: float = 0.1) -> Estimate:
    """``cfg``'s memory and time; it fits if its total is at most (1 − margin) of the GPU."""
    return Estimate(cfg, memory_estimate(model, cluster, cfg),
                    step_time(model, cluster, cfg, global_batch),
                    cluster.memory_bytes * (1 - margin))


def why_slower(best: Estimate, other: Estimate) -> str:
    """One line: how much slower ``other`` is than ``best`` and the terms that grew most."""
    def terms(e: Estimate) -> dict[str, float]:
        return {"compute": e.time.compute, "bubble": e.time.bubble,
                **{f"{a} comm": v for a, v in e.time.comm.items()}}
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
            c = e.config
            rows.append({"D×T×P×C": f"{c.dp}×{c.tp}×{c.pp}×{c.cp}", "ZeRO": c.zero_stage,
                         "recipe": c.recipe, "optimizer": c.optimizer, "offload": c.offload,
                         "recompute": c.checkpointing, "b × m": f"{c.micro_batch} × {c.n_micro}",
                         "GB/GPU": round(e.memory["total"] / GB, 2),
                         "s/step": float(f"{e.time.total:.4g}"), "why": why})
        return rows


def _choices(name: str, values, allowed) -> tuple:
    values = tuple(values) if isinstance(values, (list, tuple)) else None
    if not values or any(v not in allowed for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{name} must be a non-empty tuple of distinct values from {tuple(allowed)}, "
                         f"got {values!r}")
    return values


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
         offload=(False, True), margin: float = 0.1, n_runners_up: int = 5) -> PlanResult:
    """The fastest configuration that fits, and the runners-up.

    The space: every recipe in ``recipes``, optimizer in ``optimizers``, ZeRO stage in
    ``zero_stages``, offload flag in ``offload`` (offload needs ZeRO ≥ 1), layout from
    ``layouts``, recomputation in ``checkpointing``, and micro-batch size b dividing
    global_batch/dp (then n_micro = global_batch/(dp·b)). A configuration fits when
    ``evaluate(...).fits``. The order: step time (``Estimate.time.total``), then the total bytes
    on the GPU, then the ``Config`` itself (its fields in order) — exact comparisons, so the
    answer is deterministic.

    Returns a ``PlanResult``: ``best`` the first fitting configuration in that order and
    ``runners_up`` the next ``n_runners_up`` (fewer if fewer fit). Any pruning is allowed that
    never changes this answer. Raises ``ValueError`` when no layout is valid (saying which
    constraints), when even the static state (a configuration's total minus its activations)
    fits in no configuration (saying how many GPUs of this memory it would need fully sharded:
    at least ⌈(fewest bytes per parameter that stay on the GPU over ``recipes`` × ``optimizers``;
    with offload allowed, only the parameters' and gradients') × Ψ / memory⌉, e.g. "needs at
    least 20 GPUs of 80 GB for the static state alone"), or when the static state fits but the
    activations never do (a message that names the activations).
    """
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model must be a ModelSpec, got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    _positive("global_batch", global_batch)
    recipes = _choices("recipes", recipes, RECIPES)
    optimizers = _choices("optimizers", optimizers, OPTIMIZERS)
    zero_stages = _choices("zero_stages", zero_stages, ZERO_STAGES)
    checkpointing = _choices("checkpointing", checkpointing, CHECKPOINTING)
    offload = _choices("offload", offload, (False, True))
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction in [0, 1), got {margin!r}")
    if isinstance(n_runners_up, bool) or not isinstance(n_runners_up, int) or n_runners_up < 0:
        raise ValueError(f"n_runners_up must be an int ≥ 0, got {n_runners_up!r}")
    raise NotImplementedError("exercise 7.1: search the space (prune what cannot fit), rank, and explain a failure (labs/07_panorama.ipynb)")
