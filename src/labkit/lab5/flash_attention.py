"""FlashAttention in plain PyTorch: tiles and an online softmax, O(S) memory instead of O(S²).

Naive attention materialises the scores S = QKᵀ/√d and P = softmax(S), two (S × S) matrices
per head, and keeps P for backward: memory O(S²). FlashAttention (Dao et al. 2022,
https://arxiv.org/abs/2205.14135; FlashAttention-2, https://arxiv.org/abs/2307.08691) walks
over blocks of keys for each block of queries, keeping for every query row only a running
maximum m, a running sum ℓ of exp(s − m) and a running output; when a new block raises the
maximum from m to m', the old sum and output are rescaled by exp(m − m') (the *online
softmax*, Milakov & Gimelshein 2018, https://arxiv.org/abs/1805.02867). Forward saves only the
output O and the log-sum-exp L = m + log ℓ per row; backward recomputes each tile's
probabilities from L as P = exp(QKᵀ/√d − L), so no (S × S) matrix ever exists: memory is
O(S·d) plus one (block_q × block_k) tile.

Shapes: q, k, v are (batch, heads, seq_len, head_dim); ``causal`` masks key j > query i
(as ``F.scaled_dot_product_attention(is_causal=True)`` does for equal lengths).

Lab 5 (labs/05_activations.ipynb), exercise 5.6; Chapter 5 (book/05_activations.md).
"""
from __future__ import annotations

import math

import torch

from labkit.validate import boolean, positive_int, tensor

# ==== given: the course's code — read it, call it, don't change it ====

# Tiles of 64 queries × 256 keys (as many scores as 128 × 128): short query tiles skip more
# of the causal triangle, long key tiles make fewer, larger matmuls. Of the pairs from 64 to
# 256 timed against SDPA on the course CPU at S = 256 … 2048 (tools/bench/lab5.py), this one
# stayed within 1.15× at every S; 128 × 128 reached 1.39× at S = 256.
DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 256


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int,
           causal: bool = False) -> None:
    """Refuse bad input before any work (names the argument and what is allowed)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        tensor(name, t, floating=True)
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError("q, k, v must share one shape (batch, heads, seq_len, head_dim); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] == 0:
        raise ValueError(f"q, k, v need head_dim >= 1 (the scores are scaled by 1/√head_dim), "
                         f"got shape {tuple(q.shape)}")
    boolean("causal", causal)
    positive_int("block_q", block_q)
    positive_int("block_k", block_k)


def _check_saved(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor) -> None:
    """Refuse a backward whose saved results or incoming gradient do not match q."""
    for name, t, shape in (("out", out, q.shape), ("grad_out", grad_out, q.shape),
                           ("lse", lse, q.shape[:-1])):
        tensor(name, t, floating=True)
        if t.shape != shape:
            raise ValueError(f"{name} must have shape {tuple(shape)} (q is {tuple(q.shape)}), "
                             f"got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the running statistics (m, ℓ, L) and accumulators for inputs of ``dtype``:
    float32 for 16-bit inputs (their range and precision are too small for a running sum),
    the input's own dtype when it is wider (float64 keeps float64 accuracy)."""
    return torch.promote_types(dtype, torch.float32)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    causal: bool = False) -> torch.Tensor:
    """softmax(QKᵀ/√d)V with the whole (S × S) matrix in memory: the O(S²) baseline."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, S, S)
    if causal:
        S = q.shape[-2]
        mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (B, H, S, D)


_ABOVE_DIAGONAL: dict = {}  # (q0 - k0, bq, bk, device) -> bool mask; a few KiB each, bounded


def _above_diagonal(q0: int, k0: int, bq: int, bk: int, device: torch.device) -> torch.Tensor | None:
    """The causal mask of the tile of queries [q0, q0+bq) × keys [k0, k0+bk): a (bq, bk) bool
    tensor, True where the key comes after the query (the scores to hide); None for a tile wholly
    on or below the diagonal (it needs no mask). Built once per distinct (q0 - k0, bq, bk) and
    device and kept for later calls (at most 64 of them: one byte per entry)."""
    if k0 + bk - 1 <= q0:
        return None
    key = (q0 - k0, bq, bk, device)
    mask = _ABOVE_DIAGONAL.get(key)
    if mask is None:
        if len(_ABOVE_DIAGONAL) >= 64:
            _ABOVE_DIAGONAL.clear()
        mask = _ABOVE_DIAGONAL[key] = torch.ones(bq, bk, dtype=torch.bool, device=device).triu(q0 - k0 + 1)
    return mask


# ==== exercise 5.6: your code ====

def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                            causal: bool = False, block_q: int = DEFAULT_BLOCK_Q,
                            block_k: int = DEFAULT_BLOCK_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled attention forward with the online softmax: no (S × S) matrix is ever built.

    Contract: at most one (block_q × block_k) tile of scores exists at a time; tiles wholly
    above the diagonal are skipped when causal; the running statistics are kept in
    ``stats_dtype(q.dtype)`` (float32 for 16-bit inputs, float64 for float64 inputs).

    Args:
        q, k, v: (B, H, S, D), one floating dtype and device.
        causal: mask keys after each query.
        block_q, block_k: tile sizes (any S works; the last tile may be shorter).
    Returns:
        (O, L): the output (B, H, S, D) in q's dtype, equal to SDPA's, and the log-sum-exp of
        each score row (B, H, S) in ``stats_dtype(q.dtype)``.
    Raises:
        TypeError / ValueError: mixed dtypes or devices, shapes that differ, bad tile sizes.
    """
    _check(q, k, v, block_q, block_k, causal)
    raise NotImplementedError("exercise 5.6: the tiled forward with the online softmax; return O and L (labs/05_activations.ipynb)")


def flash_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, *,
                             causal: bool = False, block_q: int = DEFAULT_BLOCK_Q,
                             block_k: int = DEFAULT_BLOCK_K
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled attention backward that recomputes each tile's probabilities from L.

    Contract: the gradients of SDPA's output with respect to q, k, v, computed tile by tile
    from the forward's O and L (no (S × S) matrix; tiles above the diagonal skipped when
    causal), accumulated in ``stats_dtype(q.dtype)``.

    Args:
        q, k, v, out, lse: the forward's inputs and saved results.
        grad_out: dL/dO, (B, H, S, D).
    Returns:
        (dq, dk, dv), each shaped like q, in q's dtype.
    Raises:
        TypeError / ValueError: as ``flash_attention_forward``, or ``out``, ``grad_out`` not
            shaped like q, ``lse`` not (B, H, S) (``_check_saved``), before any work.
    """
    _check(q, k, v, block_q, block_k, causal)
    _check_saved(q, out, lse, grad_out)
    raise NotImplementedError("exercise 5.6: the tiled backward that recomputes each tile's probabilities from L (labs/05_activations.ipynb)")


# ==== given: the course's code — read it, call it, don't change it ====

class FlashAttention(torch.autograd.Function):
    """Autograd glue: forward saves q, k, v, O and L only; backward recomputes tile by tile."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, block_q: int, block_k: int):
        out, lse = flash_attention_forward(q, k, v, causal=causal, block_q=block_q,
                                           block_k=block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(q, k, v, out, lse, grad_out, causal=ctx.causal,
                                              block_q=ctx.block_q, block_k=ctx.block_k)
        return dq, dk, dv, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K) -> torch.Tensor:
    """Attention with O(S) memory: ``FlashAttention.apply``; same result as
    ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)``.

    Raises:
        TypeError / ValueError: as ``flash_attention_forward``, before any work.
    """
    _check(q, k, v, block_q, block_k, causal)
    return FlashAttention.apply(q, k, v, causal, block_q, block_k)
