"""Selective activation recomputation: keep what is expensive to recompute, drop what is cheap.

Full checkpointing of a block recomputes all of it, its matrix multiplications too. Yet many
of a block's activation bytes come from cheap operators: LayerNorm, GELU, softmax, dropout,
masking, whose outputs cost a few FLOPs per element to recompute, while a GEMM's output costs
O(n_embd). Korthikanti et al. 2022 (https://arxiv.org/abs/2205.05198, §4.2) recompute only the
attention core, whose (seq_len × seq_len) tensors are most of the bytes at long sequences and
few of the FLOPs ("selective activation recomputation"). The policy here applies the same rule
to every operator, from its numbers: keep an output when recomputing it costs many FLOPs per
byte it would keep (``FlopsPerBytePolicy``); the default threshold keeps the matmul outputs and
recomputes everything cheap.

PyTorch expresses this with a *policy*: ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
calls ``policy(ctx, op, *args, **kwargs)`` for every operator run inside a checkpointed
region, and the policy answers ``CheckpointPolicy.MUST_SAVE`` (keep the output) or
``PREFER_RECOMPUTE`` (drop it and run the op again in backward).

Memory of a block at the default threshold 0: its input plus its matmul outputs, instead of
everything it saves; extra compute: no matmul runs twice, so ``FlopCounterMode`` (which counts
matmuls) sees none. A higher threshold also recomputes the matmuls that do few FLOPs per byte
of output: q·kᵀ first (2d/4 per byte of its s × s scores, d the head size).

Lab 5 (labs/05_activations.ipynb), exercise 5.4; Chapter 5 (book/05_activations.md).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from labkit.validate import non_negative_number

# ==== given: the course's code — read it, call it, don't change it ====

aten = torch.ops.aten

MATMUL_OPS = frozenset({
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
})
"""Operators whose outputs are expensive to recompute (GEMMs and fused attention)."""


# ==== exercise 5.4: your code ====

def recompute_flops(op, args: tuple, kwargs: dict, out) -> int:
    """FLOPs of running ``op(*args, **kwargs)`` again, exactly as ``FlopCounterMode`` would count
    this call (an int), without running anything.

    ``FlopCounterMode`` counts matrix products (mm, addmm, bmm, convolutions, fused attention)
    and nothing else: an element-wise or reduction operator counts 0 (a few FLOPs per element,
    negligible next to a GEMM's 2k per element). ``out`` is the operator's output, as
    ``ctx.op_output`` gives it. The graders compare with ``FlopCounterMode`` running the same
    call, on every operator of a block and on CUDA's fused attention operators.
    """
    raise NotImplementedError("exercise 5.4: the FLOPs FlopCounterMode's own formula gives for this operator, 0 if it has none (labs/05_activations.ipynb)")


def output_bytes(out) -> int:
    """Bytes an operator's output keeps: a tensor's, or all the tensors' of a tuple or list of
    outputs (a fused attention returns O, the log-sum-exp and more); anything else counts 0."""
    raise NotImplementedError("exercise 5.4: the bytes of every tensor the operator returned (labs/05_activations.ipynb)")


class FlopsPerBytePolicy:
    """Korthikanti et al.'s selective recomputation as a rule on each operator's numbers.

    Keep an operator's output for backward when recomputing it would cost more than
    ``min_flops_per_byte`` FLOPs per byte kept; recompute it otherwise. ``min_flops_per_byte
    = 0`` keeps every matrix product and recomputes every element-wise operator. A matmul does
    2k FLOPs per element of its output, k its inner size: 2k/4 per byte in fp32. So q·kᵀ, whose
    (s × s) output has the head size d inside, does 2d/4 per byte — few, at any s — while
    softmax·v (inner size s, output s × d) does 2s/4 and the weight GEMMs 2h/4 or more: a
    threshold above 2d/4 recomputes the (s × s) scores, which are most of the attention core's
    bytes at long sequences, and keeps every other matmul's output once s is large.

    Args:
        min_flops_per_byte: the threshold, a number >= 0.
    """

    def __init__(self, min_flops_per_byte: float = 0.0):
        self.min_flops_per_byte = non_negative_number("min_flops_per_byte", min_flops_per_byte)

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        """Decide for one operator run inside a selectively checkpointed region.

        Contract: ``CheckpointPolicy.MUST_SAVE`` when recomputing the operator would cost more
        than ``min_flops_per_byte`` FLOPs per byte of the output it keeps,
        ``CheckpointPolicy.PREFER_RECOMPUTE`` otherwise (an output of 0 bytes is recomputed);
        the same answer in forward and in the recompute (``ctx.is_recompute``). Graded on every
        operator of a block at several thresholds, exactly at and next to each operator's own
        FLOPs per byte.

        Args:
            ctx: a ``torch.utils.checkpoint.SelectiveCheckpointContext``; ``ctx.op_output`` is
                the operator's output.
            op: the operator (an ``OpOverload`` such as ``torch.ops.aten.mm.default``).
            args, kwargs: the operator's arguments.
        """
        raise NotImplementedError("exercise 5.4: compare the operator's recompute FLOPs with the bytes its output would keep (labs/05_activations.ipynb)")


# ==== given: the course's code — read it, call it, don't change it ====

keep_matmuls_policy = FlopsPerBytePolicy(0.0)
"""The default policy: keep every matrix product's output, recompute everything else."""


# ==== exercise 5.4: your code ====

class SelectiveCheckpointBlock(nn.Module):
    """One transformer block under selective checkpointing with a per-operator policy."""

    def __init__(self, block: nn.Module, policy=None):
        super().__init__()
        if not isinstance(block, nn.Module):
            raise TypeError(f"block must be an nn.Module (one transformer block, e.g. model.h[0]), "
                            f"got {type(block).__name__}")
        if policy is not None and not callable(policy):
            raise TypeError(f"policy must be callable (ctx, op, *args, **kwargs) -> "
                            f"CheckpointPolicy, e.g. FlopsPerBytePolicy(...), got {policy!r}")
        self.block = block
        self.policy = policy if policy is not None else keep_matmuls_policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``block(x)`` under non-reentrant checkpointing that asks ``self.policy`` about every
        operator (keep its output or recompute it in backward).

        Args:
            x: (batch_size, seq_len, n_embd).
        Returns:
            the block's output, same shape.
        """
        raise NotImplementedError("exercise 5.4: run the block under checkpointing that consults the policy for every operator (labs/05_activations.ipynb)")
