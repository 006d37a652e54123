"""Gradient accumulation: the gradient of a batch of B samples from k micro-batches of ≈ B/k.

Backward of a loss that is a weighted sum of k terms gives the same weighted sum of their
gradients, and ``.grad`` adds up over successive backward calls. So k forward/backward passes
over the k pieces of a batch, each loss scaled by the share of the batch it stands for, leave in
``.grad`` exactly the gradient of the whole batch's loss, while only one micro-batch's
activations exist at a time. The compute batch (what fits in memory) is decoupled from the
statistical batch (what the optimizer sees); the price is k smaller, less efficient passes.

The share must be measured in what the loss averages over. The course GPT's loss is the mean
cross-entropy over every target token that is not ``ignore_index`` (-100), so with padded or
masked targets a micro-batch stands for (its counted tokens) / (the batch's counted tokens), not
for 1/k, nor for (its samples) / B. With equal micro-batches and no masked tokens all three agree.

Under data parallelism the gradients are averaged over the ranks once per optimizer step, not
once per micro-batch: DDP's ``no_sync()`` context skips the all-reduce for the first k − 1
backward passes.

Chapter 4 (book/04_gradients.md); Lab 4, exercise 4.1 (labs/04_gradients.ipynb).
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from labkit.validate import one_of, positive_int, tensor

# ==== given: the course's code — read it, call it, don't change it ====

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it count for nothing
WEIGHTS = ("tokens", "samples")


def split_batch(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut ``(x, y)`` along dim 0 into ``k`` consecutive micro-batches whose sizes differ by at
    most one (the first ``B mod k`` get one more sample), as ``torch.tensor_split`` does."""
    tensor("x", x)
    tensor("y", y)
    k = positive_int("k", k)
    if x.dim() == 0 or y.dim() == 0:
        raise ValueError(f"x and y must have a batch dimension (dim 0), got shapes {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have the same batch size, got {x.shape[0]} and {y.shape[0]}")
    if k > x.shape[0]:
        raise ValueError(f"k must be at most the batch size {x.shape[0]}, got {k}")
    return list(zip(torch.tensor_split(x, k), torch.tensor_split(y, k)))


# ==== exercise 4.1: your code ====


def accumulate_gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, k: int, *,
                         weight: str = "tokens") -> float:
    """Accumulate into ``.grad`` the gradient of ``model(x, y)`` using ``k`` micro-batches.

    Contract:
        * ``model(xi, yi)`` returns the mean loss of a micro-batch over its target tokens that
          are not ``IGNORE_INDEX``; the micro-batches are those of ``split_batch(x, y, k)``.
        * Afterwards every parameter's ``.grad`` has grown by the gradient of ``model(x, y)``
          (the whole batch at once), up to rounding. Only one micro-batch's activations are
          alive at any time.
        * ``weight="tokens"``: each micro-batch stands for its share of the counted target
          tokens (exact for any mask); ``weight="samples"``: its share of the samples (exact
          when every sample has the same number of counted tokens).
        * If ``model`` is a ``DistributedDataParallel``, gradients are synchronised across the
          ranks once, on the last micro-batch, not k times.
        * A micro-batch with no counted target token is skipped (its mean loss would be 0/0);
          the shares are then those among the micro-batches run (with ``weight="samples"``, its
          samples over the samples run), and under DDP the micro-batch that synchronises is the
          last one that is not skipped.

    Returns:
        The whole batch's loss as a float (the weighted sum of the micro-batch losses).

    Raises:
        ValueError: ``k`` not an int in [1, batch size]; ``weight`` not "tokens" or "samples"
            (checked below, before the exercise); no counted target token in the batch (before
            any forward).
    """
    weight = one_of("weight", weight, WEIGHTS)
    micro = split_batch(x, y, k)  # checks x, y and k
    if y.dtype != torch.int64:
        raise TypeError(f"y must be an int64 tensor of target ids (IGNORE_INDEX = -100 for the "
                        f"ones that do not count), got dtype {y.dtype}")
    raise NotImplementedError("exercise 4.1: weigh each micro-batch by its share (per `weight`; refuse a batch that counts no token); for each: forward, scaled loss, backward, skipping empty ones; DDP synchronises only on the last one run (labs/04_gradients.ipynb)")
