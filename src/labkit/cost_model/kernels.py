"""How long a GPU takes for one micro-batch of its layers: every kernel on a roofline.

Each kernel of a transformer layer is timed by what bounds it, not by one utilisation for all:

* **GEMMs** (the QKV, projection and MLP matmuls, forward and the two of backward; naive
  attention's batched QKᵀ and scores·V): ``max(FLOPs / matmul rate, bytes / HBM bandwidth)``,
  divided by the **wave efficiency**. The matmul rate is the GPU's measured ceiling (MAMF,
  ``labkit.cost_model.hardware``); the memory roof is the datasheet's HBM bandwidth over the
  bytes of the two inputs and the output. A GEMM runs as output tiles of ``TILE`` × ``TILE``,
  one per SM at a time; its last wave of tiles leaves SMs idle: efficiency = tiles / (⌈tiles /
  SMs⌉ · SMs) (NVIDIA, *Matrix Multiplication Background User's Guide*, §3.2 "Wave
  Quantization", https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/).
  This is what makes thin GEMMs pay: tensor parallelism narrows n to h/T, context parallelism
  and micro-batch 1 shorten m to b·s/C tokens.
* **Fused attention** (FlashAttention): its FLOPs (causal: half the s × s pairs) at the
  cluster's ``attention_flops`` (the kernel generation's long-sequence rate,
  ``labkit.cost_model.hardware``) times keys/(keys + ``FLASH_HALF_KEYS``): FlashAttention-2's
  and -3's published throughput curves (Dao 2023, https://arxiv.org/abs/2307.08691; Shah et al.
  2024, https://arxiv.org/abs/2407.08608) rise with the sequence and flatten past a few thousand
  tokens; the constant is read off their shape, not fitted here. A context-parallel
  ring attends s/C keys per step, so short chunks run visibly slower. Backward does 2.5× the
  forward's FLOPs (its five matmuls against two).
* **Memory-bound kernels** (norms, GELU/SwiGLU, dropout, residual adds, naive attention's
  softmax): their bytes over the HBM bandwidth, fused as Megatron-LM fuses them (bias + GELU,
  bias + dropout + add, scale + mask + softmax). Forward, per token of a layer: the two norms 2h
  elements each, the two bias-dropout-adds 3h each (plus a 1-byte mask with dropout), the MLP's
  activation 2f (3f gated); naive attention's softmax reads and writes (a/T)·s scores per query
  (and dropout 2 more, with a 1-byte mask). Backward moves twice the forward's bytes (it reads
  what forward saved and writes gradients). The h-wide ones run on s/T tokens with sequence
  parallelism and on all s tokens of every TP rank without it.

**An MoE layer** (``ModelSpec.n_expert``) keeps the attention and runs, in place of the MLP's
two GEMMs, the router's (tokens × n_expert), the shared experts' (as the MLP, of their width)
and the routed experts' as one grouped GEMM: n_expert/E local experts, each on the E·C slots its
expert-parallel group sends it, C = ⌈capacity_factor·tokens·k/n_expert⌉ (``labkit.moe.capacity``)
— 6·Ψ_active FLOPs per token with the routed experts' real, thinner shapes (a fine-grained
expert's few hundred rows lose waves a dense MLP's thousands do not; the capacity's padding is
computed too); its memory-bound kernels also copy the tokens into the slots and back (h-wide,
read and written, for dispatch and for combine) and the router's fp32 scores. A stage's layers are MoE layers as far as the model has them (its
dense layers come first, the slowest stage is the last). The all-to-all is traffic
(``labkit.cost_model.step``).

The last pipeline stage also runs the output layer (``ModelSpec.extra_weights``): every stage
waits for it, so it is charged whole to the step, as Megatron-LM's uneven stages would balance.
Left out: kernel-launch gaps, cuBLAS's split-K and stream-K kernels (which soften the wave
quantization of thin GEMMs), the rotary embedding and the optimizer's own kernels. The
datasheet HBM bandwidth is an upper bound (memory-bound kernels reach 80–90% of it).

Chapter 7 (book/07_panorama.md).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from labkit.memory_model import RECIPES

from .hardware import Cluster
from .memory import kv_heads_per_rank
from .spec import Config, ModelSpec

TILE = 128
"""The output tile of one SM, rows × columns (cuBLAS's 128 × 128 of the NVIDIA guide's Table)."""
FLASH_HALF_KEYS = 256
"""Keys per query block at which fused attention reaches half that rate (module docstring)."""


def wave_efficiency(rows: int, cols: int, n_sm: int, batch: int = 1) -> float:
    """The share of SM time a GEMM of ``batch`` × (rows × cols) outputs keeps busy (§3.2)."""
    tiles = batch * math.ceil(rows / TILE) * math.ceil(cols / TILE)
    return tiles / (math.ceil(tiles / n_sm) * n_sm)


def gemm_seconds(cluster: Cluster | Rates, rows: float, cols: float, inner: float, element_bytes: int,
                 batch: int = 1, rate: float | None = None) -> float:
    """Seconds of ``batch`` GEMMs (rows × inner) @ (inner × cols) on one GPU: the roofline over
    the wave efficiency. ``rate`` defaults to the cluster's matmul ceiling."""
    rows, cols, inner = max(1, round(rows)), max(1, round(cols)), max(1, round(inner))
    flops = 2.0 * batch * rows * cols * inner
    moved = element_bytes * batch * (rows * inner + inner * cols + rows * cols)
    compute = flops / (rate or cluster.matmul_flops) / wave_efficiency(rows, cols, cluster.n_sm, batch)
    return max(compute, moved / cluster.hbm_bw)


def forward_and_backward_gemm(cluster: Cluster | Rates, rows, cols, inner, e, rate) -> tuple[float, float]:
    """(forward, backward) seconds of one linear layer: Y = X·W forward; backward dX = dY·Wᵀ
    (rows × inner, over cols) and dW = Xᵀ·dY (inner × cols, over rows)."""
    fwd = gemm_seconds(cluster, rows, cols, inner, e, rate=rate)
    bwd = gemm_seconds(cluster, rows, inner, cols, e, rate=rate) + \
        gemm_seconds(cluster, inner, cols, rows, e, rate=rate)
    return fwd, bwd


@dataclass(frozen=True)
class MicroBatchTime:
    """Seconds the slowest GPU — the last stage, which adds the output layer to its L/P layers —
    spends on one micro-batch (all its virtual stages):
    ``forward``, ``backward``, ``recompute`` (the part of forward recomputation repeats), and
    the attention core's part of forward (``attention``), which a context-parallel ring's
    transfers can hide behind."""

    forward: float
    backward: float
    recompute: float
    attention: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


class Rates(NamedTuple):
    """What a GPU's kernels run at: the ``Cluster`` fields the kernels read (no link, no host)."""

    flops: float
    fp32_flops: float
    matmul_flops: float
    attention_flops: float
    hbm_bw: float
    n_sm: int


def micro_batch_time(model: ModelSpec, cluster: Cluster, cfg: Config) -> MicroBatchTime:
    """The module docstring's kernels for one micro-batch of this GPU's layers."""
    rates = Rates(*(getattr(cluster, f) for f in Rates._fields))
    return _micro_batch_time(model, rates, cfg.recipe, cfg.tp, cfg.pp, cfg.cp, cfg.micro_batch,
                             cfg.attention, cfg.sequence_parallel, cfg.checkpointing, cfg.ep)


def moe_mlp_time(model: ModelSpec, cluster: Rates, tokens: int, tp: int, ep: int, e: int,
                 rate: float) -> tuple[float, float, float, float]:
    """(forward GEMM seconds, backward GEMM seconds, forward h-wide memory-bound bytes (÷T with
    SP), forward f-wide ones (split by T)) of one MoE layer's router, shared and routed experts
    on this GPU (module docstring)."""
    from labkit.moe import capacity

    h, f, E, k = model.hidden, model.expert_width, model.n_expert, model.top_k
    up = (2 if model.gated_mlp else 1) * f / tp
    C = capacity(tokens, E, k, model.capacity_factor)
    slots = ep * C  # the rows each local expert gets from its expert-parallel group
    fwd, bwd = forward_and_backward_gemm(cluster, tokens, E, h, e, rate)  # the router
    if model.n_shared:
        for rows, cols, inner in ((tokens, model.n_shared * up, h), (tokens, h, model.n_shared * f / tp)):
            fw, bw = forward_and_backward_gemm(cluster, rows, cols, inner, e, rate)
            fwd, bwd = fwd + fw, bwd + bw
    for cols, inner in ((up, h), (h, f / tp)):  # grouped over the E/ep local experts
        fwd += gemm_seconds(cluster, slots, cols, inner, e, batch=E // ep, rate=rate)
        bwd += gemm_seconds(cluster, slots, inner, cols, e, batch=E // ep, rate=rate) + \
            gemm_seconds(cluster, inner, cols, slots, e, batch=E // ep, rate=rate)
    wide = 2 * e * h * (tokens + E * C) + 2 * 4 * tokens * E  # dispatch and combine; fp32 scores
    narrow = e * (3 if model.gated_mlp else 2) * f / tp * (E * C + model.n_shared * tokens)
    return fwd, bwd, wide, narrow


@functools.lru_cache(maxsize=1 << 15)
def _micro_batch_time(model, cluster, recipe, tp, pp, cp, micro_batch, attention,
                      sequence_parallel, checkpointing, ep=1) -> MicroBatchTime:
    """``micro_batch_time`` of the fields it depends on (cached: a search asks for the same
    micro-batch under every ZeRO stage, data-parallel size, schedule and bandwidth); ``cluster``
    is the GPU's ``Rates``."""
    cfg = Config(recipe, "adam", 0, False, 1, tp, pp, cp, checkpointing, micro_batch, 1, attention,
                 sequence_parallel)
    e = RECIPES[cfg.recipe].activation
    rate, flash = cluster.matmul_flops, cluster.attention_flops
    if cfg.recipe == "fp32":  # no 16-bit tensor cores: every rate scales down with the peak
        rate, flash = rate * cluster.fp32_flops / cluster.flops, flash * cluster.fp32_flops / cluster.flops
    T, C, b = cfg.tp, cfg.cp, cfg.micro_batch
    h, a, d, f, s = model.hidden, model.n_head, model.head_dim, model.ffn, model.seq_len
    s_local = s // C
    m = s_local * b  # tokens a GEMM of this GPU sees (SP all-gathers them before the matmul)
    kv = kv_heads_per_rank(model, T)
    up = (2 if model.gated_mlp else 1) * f / T
    layer_f, layer_b = 0.0, 0.0
    gemms = [forward_and_backward_gemm(cluster, rows, cols, inner, e, rate)
             for rows, cols, inner in ((m, h / T + 2 * kv * d, h), (m, h, h / T), (m, up, h), (m, h, f / T))]
    for fw, bw in gemms:
        layer_f, layer_b = layer_f + fw, layer_b + bw
    # the attention core
    heads = b * a // T
    if cfg.attention == "fused":
        flops = 4.0 * heads * s_local * s * d / 2  # QKᵀ and P·V over the causal half
        keys = s // C  # a ring's step attends one rank's chunk of keys
        attn_f = flops / (flash * keys / (keys + FLASH_HALF_KEYS))
        attn_b = 2.5 * attn_f
        scores_bytes = 0.0
    else:
        qk = gemm_seconds(cluster, s_local, s, d, e, batch=heads, rate=rate)
        pv = gemm_seconds(cluster, s_local, d, s, e, batch=heads, rate=rate)
        attn_f, attn_b = qk + pv, 2 * (qk + pv)
        masks = 1 if model.dropout else 0
        scores_bytes = heads * s_local * s * (2 * e + masks * (2 * e + 1))  # softmax, dropout
    # memory-bound kernels: h-wide ones on s/T tokens with SP, the f-wide and scores split by T
    masks = 2 if model.dropout else 0
    wide = m * (e * (2 * h + 3 * h + 2 * h + 3 * h) + masks * h) / (T if cfg.sequence_parallel else 1)
    narrow = m * e * (3 if model.gated_mlp else 2) * f / T + scores_bytes
    elem_f = (wide + narrow) / cluster.hbm_bw
    layer_f += attn_f + elem_f
    layer_b += attn_b + 2 * elem_f
    again = {"none": 0.0, "full": layer_f,
             "selective": attn_f + scores_bytes / cluster.hbm_bw}[cfg.checkpointing]
    layers = model.n_layer // cfg.pp
    # the output layer (and whatever Ψ holds outside the layers) runs on the last stage, the
    # slowest one, which sets the pipeline's pace
    out_f, out_b = forward_and_backward_gemm(cluster, m, model.extra_weights / (h * T), h, e, rate) \
        if model.extra_weights else (0.0, 0.0)
    if model.n_expert is None:
        return MicroBatchTime(layers * layer_f + out_f, layers * layer_b + out_b, layers * again, layers * attn_f)
    # an MoE layer: the attention's two GEMMs, then the router and the experts (module docstring)
    moe_f, moe_b, moe_wide, moe_narrow = moe_mlp_time(model, cluster, m, T, ep, e, rate)
    moe_f += sum(fw for fw, _ in gemms[:2])
    moe_b += sum(bw for _, bw in gemms[:2])
    elem = (wide + moe_wide / (T if cfg.sequence_parallel else 1) + moe_narrow + scores_bytes) / cluster.hbm_bw
    moe_f, moe_b = moe_f + attn_f + elem, moe_b + attn_b + 2 * elem
    moe_again = {"none": 0.0, "full": moe_f, "selective": again}[cfg.checkpointing]
    n_moe = min(layers, model.n_moe_layers)  # the last stage's
    return MicroBatchTime((layers - n_moe) * layer_f + n_moe * moe_f + out_f,
                          (layers - n_moe) * layer_b + n_moe * moe_b + out_b,
                          (layers - n_moe) * again + n_moe * moe_again, layers * attn_f)
