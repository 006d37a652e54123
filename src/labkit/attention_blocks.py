"""Attention of queries against one block of keys, with the log-sum-exp of its score rows: the
building block of ring attention (Lab 5, exercise 5.7) and of its single-device reference.

A block's result (O, L) can be merged exactly with another block's (the online-softmax rule of
``labkit.lab5.ring_attention.merge_attention``), so attention over a sequence held in pieces is
computed one key block at a time. Shared by ``labkit.lab5.ring_attention`` (the student's ring
calls it) and ``labkit.reference.lab5`` (the whole sequence on one device), which may not
import a student's file.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch

from labkit.validate import boolean

__all__ = ["attention_with_lse", "count_attention_work", "check_chunk"]

_work: list[int] | None = None  # score entries computed by attention_with_lse, while counted


@contextmanager
def count_attention_work() -> Iterator[list[int]]:
    """Count the score entries :func:`attention_with_lse` computes inside the block.

    Yields a one-element list whose item grows by B·H·Sq·Sk for each call (B·H·Sq·(Sq+1)/2 for a
    causal one: only the entries on or below the diagonal are computed). This counts the work a
    rank does, exactly, whatever the machine's load.
    """
    global _work
    previous, _work = _work, [0]
    try:
        yield _work
    finally:
        _work = previous


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against one block of keys, and the log-sum-exp of each score row.

    Args:
        q: (B, H, Sq, D); k, v: (B, H, Sk, D).
        causal: mask key j > query i (for a block on the diagonal, Sq = Sk).
    Returns:
        (O, L): O (B, H, Sq, D) = softmax(q kᵀ/√D) v and L (B, H, Sq) = logsumexp of the rows.
    """
    check_chunk(q, k, v, causal)
    if _work is not None:
        b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        _work[0] += b * h * (sq * (sq + 1) // 2 if causal else sq * sk)
    if (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and not (q.requires_grad or k.requires_grad or v.requires_grad)):
        # PyTorch's fused CPU kernel returns the log-sum-exp too: no (Sq × Sk) matrix in memory
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal)
        return out, lse
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, Sq, Sk)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Sq)
    return torch.exp(scores - lse[..., None]) @ v, lse


def check_chunk(q, k, v, causal) -> None:
    """Refuse q, k, v that are not one dtype of floating (B, H, S, D) tensors that agree, an empty
    chunk, or a causal block whose queries and keys differ in number, naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 4:
            got = (f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise TypeError(f"{name} must be a floating (B, H, S, D) tensor, got {got}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q (B, H, Sq, D) and k, v (B, H, Sk, D) must agree, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if 0 in (q.shape[2], k.shape[2], q.shape[3]):  # the fused CPU kernel dies on empty input
        raise ValueError(f"q and k, v need at least one position and head_dim >= 1, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}")
    boolean("causal", causal)
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal needs as many keys as queries in a block, got "
                         f"{q.shape[2]} and {k.shape[2]}")
