"""What lab 7's test files share (not collected): lab 6's per-GPU memory model written out.

The planner's memory comes from lab 6's ``parallel_memory.per_gpu_bytes`` (exercise 6.4); lab 7's
tests replace it with ``reference_per_gpu_bytes``, the formulas of the ZeRO paper (Rajbhandari et
al. 2019, https://arxiv.org/abs/1910.02054) and of Korthikanti et al. 2022
(https://arxiv.org/abs/2205.05198) written out plainly, so that no lab 7 result depends on the
student's 6.4.
"""
from __future__ import annotations

from labkit import memory_model


def reference_per_gpu_bytes(n_params, *, world_size, dp=1, tp=1, pp=1, cp=1, zero_stage=0,
                            recipe="mixed", optimizer="adam", n_layer, hidden, n_head, seq_len,
                            micro_batch, n_micro=1, checkpointing="none", sequence_parallel=False,
                            attention="naive", n_kv_head=None, ffn_hidden=None, gated_mlp=False,
                            dropout=True):
    """Lab 6's per-GPU model, written out: ZeRO's table and Korthikanti's activations (a rank's
    s/C queries against all s keys; fused attention keeps no scores; a Llama-style layer's
    K, V of n_kv_head heads, three f-wide SwiGLU tensors, no dropout masks)."""
    assert dp * tp * pp * cp == world_size and n_head % tp == 0 and n_layer % pp == 0
    per = memory_model.bytes_per_parameter(recipe, optimizer)
    local, n = n_params / (tp * pp), dp * cp
    out = {"parameters": local * per["parameters"] / (n if zero_stage >= 3 else 1),
           "gradients": local * per["gradients"] / (n if zero_stage >= 2 else 1),
           "optimizer states": local * per["optimizer states"] / (n if zero_stage >= 1 else 1)}
    e = memory_model.RECIPES[recipe].activation
    s, b, h, a = seq_len // cp, micro_batch, hidden, n_head
    g, f = n_kv_head or a, ffn_hidden or 4 * h
    masks = 1 if dropout else 0
    if checkpointing == "full":
        layer = e * s * b * h / (tp if sequence_parallel else 1)
    else:
        scores = a * s * seq_len * b * (e + masks * (e + 1)) if (checkpointing, attention) == ("none", "naive") else 0
        split = (e * s * b * (2 * h + 2 * h * g / a + (3 if gated_mlp else 2) * f) + scores) / tp
        layer = (4 * e + 2 * masks) * s * b * h / (tp if sequence_parallel else 1) + split
    out["activations"] = n_layer // pp * min(pp, n_micro) * layer
    return out
