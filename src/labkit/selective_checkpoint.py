"""Selective activation recomputation: keep what is expensive to recompute, drop what is cheap.

Full checkpointing of a block recomputes all of it, its matrix multiplications too. Yet many
of a block's activation bytes come from cheap operators: LayerNorm, GELU, softmax, dropout,
masking, whose outputs cost a few FLOPs per element to recompute, while a GEMM's output costs
O(n_embd). Korthikanti et al. 2022 (https://arxiv.org/abs/2205.05198, §4.2) recompute only the
attention core, whose (seq_len × seq_len) tensors are most of the bytes at long sequences and
few of the FLOPs ("selective activation recomputation"). The policy here applies the same rule
to every operator: keep the matmul outputs, recompute everything cheap.

PyTorch expresses this with a *policy*: ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
calls ``policy(ctx, op, *args, **kwargs)`` for every operator run inside a checkpointed
region, and the policy answers ``CheckpointPolicy.MUST_SAVE`` (keep the output) or
``PREFER_RECOMPUTE`` (drop it and run the op again in backward).

Memory of a block: its input plus its matmul outputs, instead of everything it saves; extra
compute: no matmul runs twice, so ``FlopCounterMode`` (which counts matmuls) sees none.

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


def keep_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: save the outputs of ``MATMUL_OPS``, recompute every other op.

    Called by PyTorch for each operator that runs inside a selectively checkpointed region.

    Args:
        ctx: a ``torch.utils.checkpoint.SelectiveCheckpointContext`` (unused here).
        op: the operator (an ``OpOverload`` such as ``torch.ops.aten.mm.default``).
        args, kwargs: the operator's arguments (unused here).
    Returns:
        ``CheckpointPolicy.MUST_SAVE`` for a matmul, ``CheckpointPolicy.PREFER_RECOMPUTE`` otherwise.
    """
    raise NotImplementedError("exercise 5.4: decide whether this operator's output is kept for backward or recomputed (labs/05_activations.ipynb)")


class SelectiveCheckpointBlock(nn.Module):
    """One transformer block under selective checkpointing with ``keep_matmuls_policy``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``block(x)`` under non-reentrant checkpointing whose ``context_fn`` applies the policy.

        Args:
            x: (batch_size, seq_len, n_embd).
        Returns:
            the block's output, same shape.
        """
        raise NotImplementedError("exercise 5.4: run the block under checkpointing that consults the policy for every operator (labs/05_activations.ipynb)")


def apply_selective_checkpointing(model: nn.Module) -> nn.Module:
    """Wrap every block of ``model.h`` in a ``SelectiveCheckpointBlock``, in place; return the model.

    The parameters stay the same objects in the same order (names gain ``.block``).
    """
    for i, block in enumerate(model.h):
        if not isinstance(block, SelectiveCheckpointBlock):
            model.h[i] = SelectiveCheckpointBlock(block)
    return model
