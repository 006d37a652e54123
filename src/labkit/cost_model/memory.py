"""Bytes on the busiest GPU of a configuration: the four consumers, and the host under offload.

**Static state.** Tensor (T) and pipeline (P) parallelism leave Ψ/(T·P) parameters on a GPU
(every parameter split evenly: the end stages' embedding and output layer are left out). ZeRO
shards their state over the D·C ranks that hold the same weights (Megatron-LM's distributed
optimizer shards over the DP × CP group): stage 1 the optimizer states, 2 the gradients too, 3
the parameters too (Rajbhandari et al. 2019, https://arxiv.org/abs/1910.02054). ZeRO-3 without
re-sharding after forward (FSDP's ``reshard_after_forward=False``) holds the stage's whole 16-bit
parameters from a forward to its backward: parameters as unsharded as ZeRO-2's, gradients and
states sharded.

**Experts** (an MoE model, chapter 6's ``labkit.moe_memory.per_gpu_static_bytes``): the routed
experts are split by E·T·P — each rank of an expert-parallel group of E keeps n_expert/E whole
experts, each split by the tensor-parallel T (expert tensor parallelism equal to T, Megatron-Core's
default) — and ZeRO shards their state over the D·C/E ranks that hold the same experts;
everything else (attention, norms, router, shared experts, dense layers) as above.

**Activations** (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198; e bytes an element,
1-byte dropout masks), one layer and one micro-batch of b sequences on a rank of a
context-parallel group of C, which holds s' = s/C tokens:

* what tensor parallelism does not split — the two norms' inputs, the inputs of the QKV and
  first MLP matmuls, two dropout masks: (4e + 2)·s'bh, 4e·s'bh without dropout. Sequence
  parallelism splits it by T; without it every TP rank keeps all of it.
* what TP splits — Q and the projection's input (e·s'bh/T each), K and V of the key/value heads
  the rank holds (``kv_heads_per_rank``: whole heads, replicated when T exceeds them), the MLP's
  f-wide tensors (2e·s'bf/T, 3e gated);
* naive attention's scores: the rank's s' queries against all s keys, e·(a/T)·s'·s·b, and with
  dropout its mask and output, (2e + 1)·(a/T)·s'·s·b. A fused kernel (FlashAttention) stores none;
  selective recomputation drops them; full recomputation keeps only each layer's input, e·s'bh
  (÷T with SP).

**An MoE layer** keeps the same attention and norms, and in place of the MLP's first matmul
input and f-wide tensors what ``labkit.moe_memory.layer_activation_bytes`` counts for the s'·b
tokens of this rank at the model's capacity factor: the router's input and fp32 scores, the
capacity-padded received buffer, the experts' f-wide tensors (split by T, like the MLP's), the
k gathered outputs (the h-wide parts split by T only with SP; the shared experts' input is
counted as split by T, a slight undercount without SP). The rank's buffers are the same size
whatever E: it sends n_expert·C slots and receives as many. A pipeline stage's layers are
counted as MoE layers as far as the model has them (the busiest stage: runs put the dense
layers first).

**In flight.** The first pipeline stage holds the most: plain 1F1B min(P, m) micro-batches of its
L/P layers (one without a pipeline); interleaved 1F1B with v virtual stages runs
min(m·v, (v + 1)·P − 1) chunk forwards of L/(P·v) layers before its first backward — for many
micro-batches L·(1 + (P − 1)/(P·v)) layer-micro-batches, Megatron-LM's factor
(``megatron/training/theoretical_memory_usage.py``).

**Offload** (ZeRO-Offload, Ren et al. 2021, https://arxiv.org/abs/2101.06840): the fp32 master
and the moments of this GPU's shard live in host memory and the Adam step runs on the CPU; the
16-bit gradients leave as backward produces them, so the GPU keeps one layer's worth (a bucket).
The host of a node keeps, per GPU, the shard's states and its 16-bit gradient buffer.

Left out (the planner's margin stands for them): the CUDA context, the allocator's
fragmentation, communication buffers, the logits, ZeRO-3's gathered layers, the end stages'
embedding and output layer.

Chapter 7 (book/07_panorama.md).
"""
from __future__ import annotations

import functools

from labkit.memory_model import CONSUMERS, RECIPES, bytes_per_parameter

from .spec import Config, ModelSpec, check_expert_parallel


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """Key/value heads one of ``tp`` tensor-parallel ranks holds: the groups its n_head/tp query
    heads use (n_kv_head/tp when tp divides n_kv_head; one, replicated, when tp is a multiple of
    it — Megatron-LM requires the first, vLLM-style replication allows the second; the most any
    rank needs otherwise)."""
    a, g = model.n_head, model.kv_heads
    q, group = a // tp, a // g  # query heads per rank, query heads per key/value head
    return max((r * q + q - 1) // group - (r * q) // group + 1 for r in range(tp))


_per_parameter = functools.lru_cache(maxsize=None)(bytes_per_parameter)
"""``bytes_per_parameter``, cached (read, never changed, here)."""


def local_params(model: ModelSpec, cfg: Config) -> tuple[float, float]:
    """(parameters outside the routed experts, routed experts' parameters) on one GPU: Ψ/(T·P)
    and 0.0 for a dense model."""
    return ((model.n_params - model.routed_params) / (cfg.tp * cfg.pp),
            model.routed_params / (cfg.ep * cfg.tp * cfg.pp))


def static_bytes(model: ModelSpec, cfg: Config) -> dict[str, float]:
    """Parameters, gradients and optimizer states on one GPU (module docstring)."""
    per = _per_parameter(cfg.recipe, cfg.optimizer)
    (local, experts), n = local_params(model, cfg), cfg.dp * cfg.cp
    z, whole = cfg.zero_stage, cfg.zero_stage == 3 and not cfg.reshard_after_forward
    shard = {"parameters": z >= 3 and not whole, "gradients": z >= 2, "optimizer states": z >= 1}
    out = {c: local * per[c] / (n if shard[c] else 1) for c in shard}
    if experts:  # an MoE model: the experts' copies are the D·C/E ranks of the same experts
        out = {c: out[c] + experts * per[c] / (n // cfg.ep if shard[c] else 1) for c in shard}
    return out


def activation_bytes_per_layer(model: ModelSpec, cfg: Config) -> float:
    """Bytes one layer keeps for backward, for one micro-batch on this GPU (module docstring)."""
    e, T = RECIPES[cfg.recipe].activation, cfg.tp
    s_local, b, h = model.seq_len // cfg.cp, cfg.micro_batch, model.hidden
    sbh = s_local * b * h
    sp = T if cfg.sequence_parallel else 1
    if cfg.checkpointing == "full":
        return e * sbh / sp
    masks = 1 if model.dropout else 0
    unsplit = sbh * (4 * e + 2 * masks) / sp
    kv = 2 * e * s_local * b * model.head_dim * kv_heads_per_rank(model, T)
    mlp = (3 if model.gated_mlp else 2) * e * s_local * b * model.ffn / T
    split = 2 * e * sbh / T + kv + mlp
    if cfg.checkpointing == "none" and cfg.attention == "naive":
        split += (model.n_head / T) * s_local * model.seq_len * b * (e + masks * (e + 1))
    return unsplit + split


@functools.lru_cache(maxsize=1 << 12)
def _moe_parts(model: ModelSpec, tokens: int, element_bytes: int) -> dict[str, int]:
    from labkit.moe_memory import layer_activation_bytes

    return layer_activation_bytes(model.moe, tokens, model.capacity_factor, act_bytes=element_bytes)


def moe_activation_bytes_per_layer(model: ModelSpec, cfg: Config) -> float:
    """Bytes one MoE layer keeps for backward, for one micro-batch on this GPU (module docstring):
    the dense layer's less its MLP's first matmul input and f-wide tensors, plus the MoE parts."""
    dense = activation_bytes_per_layer(model, cfg)
    if cfg.checkpointing == "full":
        return dense  # only the layer's input
    e, T = RECIPES[cfg.recipe].activation, cfg.tp
    s_local, b, h = model.seq_len // cfg.cp, cfg.micro_batch, model.hidden
    sp = T if cfg.sequence_parallel else 1
    mlp = e * s_local * b * h / sp + (3 if model.gated_mlp else 2) * e * s_local * b * model.ffn / T
    parts = _moe_parts(model, s_local * b, e)
    return dense - mlp + (parts["router"] + parts["dispatch"] + parts["combine"]) / sp + parts["experts"] / T


def moe_layers_on_stage(model: ModelSpec, cfg: Config) -> int:
    """MoE layers of the busiest pipeline stage's L/P: as many as the model has (module docstring)."""
    return min(model.n_layer // cfg.pp, model.n_moe_layers)


def layers_in_flight(model: ModelSpec, cfg: Config) -> float:
    """Layer-micro-batches of activations the first pipeline stage holds at its first backward."""
    P, v, m = cfg.pp, cfg.virtual_stages, cfg.n_micro
    if P == 1:
        return model.n_layer
    if v == 1:
        return model.n_layer // P * min(P, m)
    return model.n_layer // (P * v) * min(m * v, (v + 1) * P - 1)


def memory_estimate(model: ModelSpec, cfg: Config) -> dict[str, float]:
    """Bytes of the four consumers (``CONSUMERS``) on the busiest GPU of ``cfg``, and "total"."""
    check_expert_parallel(model, cfg)
    out = static_bytes(model, cfg)
    per_layer = activation_bytes_per_layer(model, cfg)
    if model.is_moe:  # the stage's mean over its dense and MoE layers
        layers, moe = model.n_layer // cfg.pp, moe_layers_on_stage(model, cfg)
        per_layer = ((layers - moe) * per_layer + moe * moe_activation_bytes_per_layer(model, cfg)) / layers
    out["activations"] = layers_in_flight(model, cfg) * per_layer
    if cfg.offload:
        out["optimizer states"] = 0.0  # in host memory
        local = sum(local_params(model, cfg))
        bucket = local / (model.n_layer // cfg.pp) * RECIPES[cfg.recipe].gradient
        out["gradients"] = min(out["gradients"], bucket)
    out = {c: float(out[c]) for c in CONSUMERS}
    out["total"] = sum(out.values())
    return out


def offloaded_shard(model: ModelSpec, cfg: Config) -> float:
    """Parameters of the shard whose optimizer step one GPU hands to the CPU under offload
    (Ψ/(T·P·D·C) whatever E: the experts' Ψ_e/(E·T·P) over D·C/E ranks is the same share)."""
    return model.n_params / (cfg.tp * cfg.pp) / (cfg.dp * cfg.cp)


def host_bytes(model: ModelSpec, gpus_per_node: int, cfg: Config) -> float:
    """Host bytes of one node under offload: each of its ``gpus_per_node`` GPUs' shard of
    optimizer states (fp32 master and moments) and the shard's 16-bit gradient buffer; 0
    without offload."""
    if not cfg.offload:
        return 0.0
    per = _per_parameter(cfg.recipe, cfg.optimizer)
    return gpus_per_node * offloaded_shard(model, cfg) * (per["optimizer states"] + per["gradients"])
