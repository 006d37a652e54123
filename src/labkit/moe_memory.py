"""The bytes of a mixture-of-experts model, by consumer: total against active parameters, the
router and the capacity-padded dispatch buffers, and what expert parallelism (E) shards.

An MoE model (``labkit.moe``) keeps every expert, so parameters, gradients and optimizer states
scale with the *total* parameter count, while each token runs through k of the E routed
experts (plus any shared expert): its FLOPs and most of its activations scale with the
*active* count. Expert parallelism puts E_p = ``ep`` ranks' worth of experts side by side
(rank r of an expert-parallel group holds E/E_p whole experts) and carves that group out of the
data-parallel ranks, as Megatron-LM and DeepSeek-V3 do: the routed experts' static state is
divided by E_p (and by the pipeline P), the rest of the model's by T·P as usual, and ZeRO
divides each by the ranks that still hold a copy (D for the dense part, D/E_p for the experts).

What this model counts per MoE layer and micro-batch of ``tokens`` tokens (16-bit activations,
b = 2 bytes an element unless said):

- router: the layer's (normalised) input the router and the dispatch read, tokens·h·b, and the
  router's fp32 scores, tokens·E·4;
- dispatch: the received buffer of E·C slots of h, the experts' input, C = ⌈cf·tokens·k/E⌉
  (``labkit.moe.capacity``): E·C·h·b, padding included (the send buffer of the same size lives
  only during the all-to-all);
- experts: per slot the f-wide tensors autograd keeps — four for a SwiGLU expert (gate, up,
  SiLU(gate), their product), two for GELU (its input and output): 4·f·b or 2·f·b; a shared
  expert does the same for every token, with its input;
- combine: each token's k gathered outputs, tokens·k·h·b.

What it leaves out: index vectors (tokens·k integers), imbalance beyond the capacity (a
dropless layer's buffers follow the routing, not C), the attention and norms of the layer
(chapter 1's formula), the communication buffers of NCCL, and the fp32 master-weight layout of
any particular framework. Chapter 6 ("Mixture of experts") checks it against the course's own
layer measured with saved-tensor hooks, and the parameter counts against the published ones.

Sources of the configurations: Mixtral 8x7B, Jiang et al. 2024 (https://arxiv.org/abs/2401.04088,
Table 1); DeepSeek-V3, DeepSeek-AI 2024 (https://arxiv.org/abs/2412.19437, §4.2) and its
``config.json`` (https://huggingface.co/deepseek-ai/DeepSeek-V3, intermediate_size 18432,
vocab_size 129280).

Toolkit for chapter 6 and, later, ``labkit.memory_model`` and the planner (lab 7).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.validate import number, one_of, positive_int

__all__ = ["MoEModel", "MIXTRAL_8X7B", "DEEPSEEK_V3", "MODELS", "gqa_attention_params",
           "mla_attention_params", "param_counts", "layer_activation_bytes", "all_to_all_bytes",
           "per_gpu_static_bytes", "per_gpu_bytes"]

GATED = {"swiglu": 4, "gelu": 2}
"""f-wide tensors an expert keeps per slot for backward, by its MLP's kind."""


def gqa_attention_params(hidden: int, n_head: int, n_kv_head: int, head_dim: int) -> int:
    """Weights of grouped-query attention (no biases): Q and O of n_head heads, K and V of
    n_kv_head heads, all head_dim wide. Each an int ≥ 1, n_kv_head dividing n_head (each K/V
    head serves n_head / n_kv_head query heads); else ValueError naming it."""
    hidden, n_head, n_kv_head, head_dim = (positive_int(name, v) for name, v in (
        ("hidden", hidden), ("n_head", n_head), ("n_kv_head", n_kv_head), ("head_dim", head_dim)))
    if n_head % n_kv_head:
        raise ValueError(f"n_kv_head={n_kv_head} must divide n_head={n_head} (grouped-query "
                         "attention: each K/V head serves a whole group of query heads)")
    return hidden * head_dim * (2 * n_head + 2 * n_kv_head)


def mla_attention_params(hidden: int, n_head: int, q_rank: int, kv_rank: int, nope_dim: int,
                         rope_dim: int, v_dim: int) -> int:
    """Weights of DeepSeek's multi-head latent attention (arXiv 2405.04434): Q down to q_rank
    and up to n_head·(nope + rope), KV down to kv_rank plus a shared rope key, up to
    n_head·(nope + v), the output projection, and the two low-rank norms. Each an int ≥ 1;
    else ValueError naming it."""
    hidden, n_head, q_rank, kv_rank, nope_dim, rope_dim, v_dim = (positive_int(name, v) for name, v in (
        ("hidden", hidden), ("n_head", n_head), ("q_rank", q_rank), ("kv_rank", kv_rank),
        ("nope_dim", nope_dim), ("rope_dim", rope_dim), ("v_dim", v_dim)))
    return (hidden * q_rank + q_rank * n_head * (nope_dim + rope_dim)
            + hidden * (kv_rank + rope_dim) + kv_rank * n_head * (nope_dim + v_dim)
            + n_head * v_dim * hidden + q_rank + kv_rank)


@dataclass(frozen=True)
class MoEModel:
    """A published MoE transformer, as far as its memory is concerned.

    Attributes (keyword-only):
        name: what the page prints.
        n_layer: transformer layers; the first ``dense_layers`` have a dense FFN, the rest MoE.
        hidden: h. vocab_size: V (embedding and untied output layer).
        attention_params: weights of one layer's attention (``gqa_attention_params`` …).
        dense_layers, dense_ffn: dense FFN layers and their inner width.
        n_expert, top_k, expert_ffn: routed experts per MoE layer, chosen per token, inner width f.
        n_shared: shared experts per MoE layer (every token uses them), width ``expert_ffn``.
        mlp: "swiglu" (three h×f matrices per expert) or "gelu" (two).
        published_total, published_active: the source's parameter counts, for comparison.
    """
    name: str
    n_layer: int
    hidden: int
    vocab_size: int
    attention_params: int
    dense_layers: int
    dense_ffn: int
    n_expert: int
    top_k: int
    expert_ffn: int
    n_shared: int = 0
    mlp: str = "swiglu"
    published_total: float = 0.0
    published_active: float = 0.0

    @property
    def moe_layers(self) -> int:
        return self.n_layer - self.dense_layers

    @property
    def matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2


MIXTRAL_8X7B = MoEModel(
    name="Mixtral 8x7B", n_layer=32, hidden=4096, vocab_size=32000,
    attention_params=gqa_attention_params(4096, 32, 8, 128), dense_layers=0, dense_ffn=0,
    n_expert=8, top_k=2, expert_ffn=14336, published_total=46.7e9, published_active=12.9e9)
"""Jiang et al. 2024, Table 1: dim 4096, 32 layers, 32 heads of 128, 8 KV heads, FFN 14336,
vocab 32000, 8 experts, top-2; "47B parameters, 13B active" (§2.1: 46.7B / 12.9B)."""

DEEPSEEK_V3 = MoEModel(
    name="DeepSeek-V3", n_layer=61, hidden=7168, vocab_size=129280,
    attention_params=mla_attention_params(7168, 128, 1536, 512, 128, 64, 128),
    dense_layers=3, dense_ffn=18432, n_expert=256, top_k=8, expert_ffn=2048, n_shared=1,
    published_total=671e9, published_active=37e9)
"""DeepSeek-AI 2024, §4.2: 61 layers, hidden 7168, MLA (128 heads, q rank 1536, kv rank 512,
head dims 128 + 64 rope), the first 3 layers dense, then 1 shared + 256 routed experts of width
2048, 8 routed per token; 671B total, 37B activated (the multi-token-prediction module's 14B
not counted)."""

MODELS = {m.name: m for m in (MIXTRAL_8X7B, DEEPSEEK_V3)}


def param_counts(model: MoEModel) -> dict[str, int]:
    """Parameters by part: ``routed experts`` (all E of every MoE layer), ``other`` (attention,
    norms, router, shared experts, dense FFNs, embedding and output layer), ``total`` and
    ``active`` (other + the k routed experts a token uses in each MoE layer)."""
    h, m = model.hidden, model.matrices
    expert = m * h * model.expert_ffn
    per_layer = model.attention_params + 2 * h  # two RMSNorms
    other = model.n_layer * per_layer + model.dense_layers * m * h * model.dense_ffn
    other += model.moe_layers * (h * model.n_expert + model.n_shared * expert)  # router, shared
    other += 2 * model.vocab_size * h + h  # embedding, output layer, final norm
    routed = model.moe_layers * model.n_expert * expert
    return {"routed experts": routed, "other": other, "total": routed + other,
            "active": other + model.moe_layers * model.top_k * expert}


def layer_activation_bytes(model: MoEModel, tokens: int, capacity_factor: float,
                           act_bytes: int = 2) -> dict[str, int]:
    """What one MoE layer keeps for backward for ``tokens`` tokens on one device (no expert
    parallelism: E_p = 1), by part (see the module docstring): ``router``, ``dispatch``,
    ``experts`` (routed, padding included; plus shared experts on every token), ``combine``."""
    T = positive_int("tokens", tokens)
    cf = number("capacity_factor", capacity_factor, low=0, low_open=True)
    b = positive_int("act_bytes", act_bytes)
    h, f, E, k = model.hidden, model.expert_ffn, model.n_expert, model.top_k
    C = math.ceil(cf * T * k / E - 1e-9)
    inner = GATED[model.mlp] * f * b  # what an expert keeps per slot besides its input
    return {"router": T * h * b + T * E * 4, "dispatch": E * C * h * b,
            "experts": E * C * inner + model.n_shared * T * (h * b + inner),
            "combine": T * k * h * b}


def all_to_all_bytes(tokens: int, n_expert: int, top_k: int, capacity_factor: float,
                     hidden: int, act_bytes: int = 2) -> int:
    """Bytes one rank passes to one all-to-all of an MoE layer under expert parallelism with
    capacity buffers: the (E, C, h) buffer, E·C·h·b (4 such calls per layer and micro-batch:
    dispatch and combine, forward and backward). The share that leaves the rank is (E_p−1)/E_p."""
    C = math.ceil(number("capacity_factor", capacity_factor, low=0, low_open=True)
                  * positive_int("tokens", tokens) * positive_int("top_k", top_k)
                  / positive_int("n_expert", n_expert) - 1e-9)
    return n_expert * C * positive_int("hidden", hidden) * positive_int("act_bytes", act_bytes)


def per_gpu_static_bytes(model: MoEModel, *, dp: int = 1, ep: int = 1, tp: int = 1, pp: int = 1,
                         zero_stage: int = 0, bytes_per_param=(2, 2, 12)) -> dict[str, float]:
    """Parameters, gradients and optimizer states per GPU (keys as ``labkit.memory_model``'s
    consumers; mixed-precision Adam by default: 2 + 2 + 12 bytes a parameter).

    The routed experts are split over ``ep`` (whole experts, E divisible by ``ep``), ``tp``
    (expert tensor parallelism equal to T, Megatron-Core's default) and ``pp``; everything
    else over ``tp``·``pp``. The expert-parallel group is carved out of the ``dp``
    data-parallel ranks (``ep`` divides ``dp``): ZeRO stage s shards the states of the dense
    part over D and those of the experts over D/E_p, the ranks that hold the same experts.
    Stages averaged over ``pp`` (the model's layers split evenly)."""
    D, Ep, T, P = (positive_int(n, v) for n, v in (("dp", dp), ("ep", ep), ("tp", tp), ("pp", pp)))
    one_of("zero_stage", zero_stage, (0, 1, 2, 3))
    if D % Ep:
        raise ValueError(f"ep must divide dp (the expert-parallel group is carved out of the "
                         f"data-parallel ranks), got dp={D}, ep={Ep}")
    if model.n_expert % Ep:
        raise ValueError(f"ep must divide the {model.n_expert} experts of {model.name}, got {Ep}")
    counts = param_counts(model)
    dense, experts = counts["other"] / (T * P), counts["routed experts"] / (Ep * T * P)
    out = {}
    for stage, (name, per) in enumerate(zip(("parameters", "gradients", "optimizer states"),
                                            bytes_per_param), start=1):
        shard = zero_stage >= (3 if stage == 1 else 2 if stage == 2 else 1)
        out[name] = per * (dense / (D if shard else 1) + experts / (D // Ep if shard else 1))
    return out


def per_gpu_bytes(model: MoEModel, *, dp: int = 1, ep: int = 1, pp: int = 1, zero_stage: int = 0,
                  tokens: int = 4096, capacity_factor: float = 1.25, n_micro: int = 1) -> dict[str, float]:
    """Bytes per GPU by consumer (the first pipeline stage's GPU), without tensor parallelism:
    :func:`per_gpu_static_bytes` plus the activations of its MoE layers only — the model's
    MoE layers / P of them, each :func:`layer_activation_bytes` for a micro-batch of ``tokens``
    tokens, times the min(P, m) micro-batches 1F1B keeps in flight on the first stage (chapter
    3). Attention, norms and dense layers' activations are not counted (chapter 1's formula
    adds them). What the page's MoE calculator computes (``labkit.page_calculator``)."""
    static = per_gpu_static_bytes(model, dp=dp, ep=ep, pp=pp, zero_stage=zero_stage)
    m = positive_int("n_micro", n_micro)
    layer = sum(layer_activation_bytes(model, tokens, capacity_factor).values())
    return {**static, "activations": layer * model.moe_layers / pp * min(pp, m)}
