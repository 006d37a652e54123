"""Bytes on the busiest GPU of a configuration: the four consumers, and the host under offload.

**Static state.** Tensor (T) and pipeline (P) parallelism leave Ψ/(T·P) parameters on a GPU
(every parameter split evenly: the end stages' embedding and output layer are left out). ZeRO
shards their state over the D·C ranks that hold the same weights (Megatron-LM's distributed
optimizer shards over the DP × CP group): stage 1 the optimizer states, 2 the gradients too, 3
the parameters too (Rajbhandari et al. 2019, https://arxiv.org/abs/1910.02054). ZeRO-3 without
re-sharding after forward (FSDP's ``reshard_after_forward=False``) holds the stage's whole 16-bit
parameters from a forward to its backward: parameters as unsharded as ZeRO-2's, gradients and
states sharded.

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

from .spec import Config, ModelSpec


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


def static_bytes(model: ModelSpec, cfg: Config) -> dict[str, float]:
    """Parameters, gradients and optimizer states on one GPU (module docstring)."""
    per = _per_parameter(cfg.recipe, cfg.optimizer)
    local, n = model.n_params / (cfg.tp * cfg.pp), cfg.dp * cfg.cp
    z, whole = cfg.zero_stage, cfg.zero_stage == 3 and not cfg.reshard_after_forward
    return {"parameters": local * per["parameters"] / (n if z >= 3 and not whole else 1),
            "gradients": local * per["gradients"] / (n if z >= 2 else 1),
            "optimizer states": local * per["optimizer states"] / (n if z >= 1 else 1)}


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
    out = static_bytes(model, cfg)
    out["activations"] = layers_in_flight(model, cfg) * activation_bytes_per_layer(model, cfg)
    if cfg.offload:
        out["optimizer states"] = 0.0  # in host memory
        local = model.n_params / (cfg.tp * cfg.pp)
        bucket = local / (model.n_layer // cfg.pp) * RECIPES[cfg.recipe].gradient
        out["gradients"] = min(out["gradients"], bucket)
    out = {c: float(out[c]) for c in CONSUMERS}
    out["total"] = sum(out.values())
    return out


def offloaded_shard(model: ModelSpec, cfg: Config) -> float:
    """Parameters of the shard whose optimizer step one GPU hands to the CPU under offload."""
    return model.n_params / (cfg.tp * cfg.pp) / (cfg.dp * cfg.cp)


def host_bytes(model: ModelSpec, gpus_per_node: int, cfg: Config) -> float:
    """Host bytes of one node under offload: each of its ``gpus_per_node`` GPUs' shard of
    optimizer states (fp32 master and moments) and the shard's 16-bit gradient buffer; 0
    without offload."""
    if not cfg.offload:
        return 0.0
    per = _per_parameter(cfg.recipe, cfg.optimizer)
    return gpus_per_node * offloaded_shard(model, cfg) * (per["optimizer states"] + per["gradients"])
