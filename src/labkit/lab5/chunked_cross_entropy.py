"""Chunked cross-entropy: the loss over a large vocabulary without ever holding the whole logits.

A language model's last layer turns N hidden states h (N × d) into N × V logits z = h·Wᵀ (W is
the (V × d) output embedding) and the loss is the mean over tokens of −log softmax(z)[target].
Frameworks compute it on logits cast to float32, and autograd keeps an (N × V) float32 tensor
for backward and makes another for its gradient: at Llama 3's vocabulary (V = 128,256) one
8,192-token micro-batch has 4.2 GB of fp32 logits, more than any transformer layer keeps.

Nothing forces the whole matrix to exist. Each token's loss needs only its own row, and the
gradient of the mean loss with respect to that row is (softmax(z) − onehot(target)) / n: it
too is known row by row once the row's log-sum-exp L = log Σⱼ exp(zⱼ) is known. So forward walks
over chunks of c tokens, computes the chunk's (c × V) logits, its losses and its L, keeps only L
(N floats) and drops the chunk; backward recomputes each chunk's logits from h and W, turns them
into the chunk's gradient in place and accumulates dh = g·W and dW += gᵀ·h. At most one or two
(c × V) tiles exist at a time: memory O(c·V + N·d + V·d) instead of O(N·V), for one extra
matmul of the logits (the recomputation, as in activation checkpointing).

Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024, https://arxiv.org/abs/2410.10989)
and the "cut cross-entropy" of Wijmans et al. 2024 (https://arxiv.org/abs/2411.09009) are
GPU kernels of the same idea; torchtune's chunked output loss is the PyTorch form.

Lab 5 (labs/05_activations.ipynb), exercise 5.9; Chapter 5 (book/05_activations.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.validate import positive_int, tensor

__all__ = ["IGNORE_INDEX", "loss_dtype", "plain_cross_entropy", "chunked_cross_entropy",
           "ChunkedCrossEntropy"]

# ==== given: the course's code — read it, call it, don't change it ====

IGNORE_INDEX = -100
"""A target equal to this counts for nothing (padding), as in ``F.cross_entropy``."""


def _check(hidden, weight, targets, chunk_size) -> None:
    """Refuse bad input before any work, naming the argument and what is allowed."""
    tensor("hidden", hidden, floating=True, ndim=2)
    tensor("weight", weight, floating=True, ndim=2)
    tensor("targets", targets, ndim=1)
    positive_int("chunk_size", chunk_size)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be (V, d) with d = hidden.shape[1] = {hidden.shape[1]}, "
                         f"got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share one dtype, got {hidden.dtype} and {weight.dtype}")
    if targets.dtype != torch.int64 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets must be int64 of shape (N,) = ({hidden.shape[0]},), got "
                         f"{targets.dtype} {tuple(targets.shape)}")
    if not hidden.device == weight.device == targets.device:
        raise ValueError(f"hidden, weight and targets must be on one device, got {hidden.device}, "
                         f"{weight.device}, {targets.device}")
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= weight.shape[0]))
    if bad.any():
        raise ValueError(f"targets must be in [0, V) = [0, {weight.shape[0]}) or {IGNORE_INDEX} "
                         f"(ignored), got {targets[bad][0].item()}")


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the logits are cast to and the loss is computed in, for inputs of ``dtype``:
    float32 for 16-bit inputs (a softmax over 10⁵ entries needs more than 8 or 11 bits), the
    input's own dtype when it is wider (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def plain_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                        targets: torch.Tensor) -> torch.Tensor:
    """The baseline: all (N × V) logits at once, cast to ``loss_dtype`` (float32 for 16-bit
    inputs), then ``F.cross_entropy`` (mean over the targets that are not ``IGNORE_INDEX``).
    Autograd keeps an (N × V) float32 tensor for backward."""
    logits = (hidden @ weight.T).to(loss_dtype(hidden.dtype))  # (N, V) fp32
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)


# ==== exercise 5.9: your code ====

class ChunkedCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of ``hidden @ weight.T`` computed ``chunk_size`` tokens at a time.

    Contract (forward and backward alike): no tensor of more than ``chunk_size × V`` elements
    is ever created, and at most two such (chunk × V) tiles are alive at once; besides them a
    step holds d hidden, d weight (accumulated in ``loss_dtype``) and vectors of N or chunk
    entries. What is saved for backward is ``hidden``, ``weight``, ``targets`` and at
    most one number per token, never logits. Each chunk's logits are the chunk's
    ``hidden @ weight.T`` in the input dtype, cast to ``loss_dtype`` (what
    :func:`plain_cross_entropy` computes), and every reduction over the vocabulary, the loss
    and the accumulated d weight are in ``loss_dtype`` (float32 for 16-bit inputs).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_size: int) -> torch.Tensor:
        """Returns the mean loss over the counted targets (a ``loss_dtype`` scalar; NaN when
        none counts, as ``F.cross_entropy``). Saves what backward needs in ``ctx``."""
        raise NotImplementedError("exercise 5.9: walk over chunks of tokens: each chunk's float32 logits, its losses and its log-sum-exp; keep only the log-sum-exps (labs/05_activations.ipynb)")

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        """Returns (d hidden, d weight, None, None) in the dtypes of hidden and weight."""
        raise NotImplementedError("exercise 5.9: recompute each chunk's logits, turn them into the chunk's gradient in place, accumulate d hidden and d weight (labs/05_activations.ipynb)")


# ==== given: the course's code — read it, call it, don't change it ====

def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_size: int = 1024) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` against ``targets``, equal to
    :func:`plain_cross_entropy`, with at most ``chunk_size`` rows of logits alive at a time.

    Args:
        hidden: (N, d) floating, the last hidden states (after the final norm).
        weight: (V, d), same dtype and device: the output embedding (``lm_head.weight``).
        targets: (N,) int64 in [0, V), or ``IGNORE_INDEX`` for a token that does not count.
        chunk_size: tokens per chunk (≥ 1; the last chunk may be shorter).
    Returns:
        The mean loss over the counted tokens, a float32 scalar; backward gives d hidden and
        d weight in their own dtypes.
    Raises:
        TypeError / ValueError naming the argument: shapes, dtypes, devices, targets out of range.
    """
    _check(hidden, weight, targets, chunk_size)
    return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_size)
