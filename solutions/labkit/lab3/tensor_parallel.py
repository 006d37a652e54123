"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053): split each weight
matrix of a layer over T ranks, so each keeps 1/T of it.

An MLP y = GELU(x A) B is split as A = [A₁ … A_T] by columns (*column-parallel*: rank r computes
GELU(x A_r), no communication, GELU being elementwise) and B by rows (*row-parallel*: rank r
computes GELU(x A_r) B_r, a partial sum; an all-reduce adds the T partial sums). Attention
splits the same way by heads: the q, k, v projections column-parallel (rank r owns H/T heads),
the output projection row-parallel.

Two conjugate operators make the autograd work (Megatron's f and g):

- f (:func:`copy_to_tp`) sits before the column-parallel layer: identity forward, all-reduce
  backward (each rank holds only its share of ∂L/∂x);
- g (:func:`reduce_from_tp`) sits after the row-parallel layer: all-reduce forward, identity
  backward.

So each MLP and each attention costs exactly one all-reduce of the (B, S, C) activation in
forward and one in backward: 4 per transformer layer. Lab 3, exercise 3.4; chapter 3
(book/03_parameters.md). PyTorch's ``torch.distributed.tensor.parallel.parallelize_module``
(ColwiseParallel / RowwiseParallel) does the same with DTensor;
``labkit.reference.lab3.run_parallelize_module`` runs it for comparison.

Every layer takes a ``group`` (None: the default group): T is its size and r this rank's index
*in it* (``dist.get_rank(group)``), and every collective runs over it — in a 3D layout the
tensor-parallel group is a subgroup of the world.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["copy_to_tp", "reduce_from_tp", "ColumnParallelLinear", "RowParallelLinear", "TPMLP",
           "TPAttention"]


# ==== exercise 3.4: your code ====
class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce (sum) of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION 3.4: f's forward: what reaches every rank unchanged
        ctx.group = group
        return x.view_as(x)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION 3.4: f's backward: combine the ranks' partial gradients
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
        # END SOLUTION


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION 3.4: g's forward: combine the ranks' partial sums
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION 3.4: g's backward: what each rank's partial sum receives
        return grad, None
        # END SOLUTION


# ==== given: the course's code — read it, call it, don't change it ====
def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f over ``group``: returns x; in backward, the sum of the ranks' gradients."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g over ``group``: returns the sum of the ranks' x; backward passes through."""
    return _ReduceFromTP.apply(x, group)


def _check_linear(full) -> None:
    if not isinstance(full, nn.Linear):
        raise TypeError(f"full must be a torch.nn.Linear, got {type(full).__name__}")


def _split(name: str, size: int, parts: int) -> int:
    if size % parts:
        raise ValueError(f"{name} ({size}) must be divisible by the tensor-parallel size T = {parts}")
    return size // parts


# ==== exercise 3.4: your code ====
class ColumnParallelLinear(nn.Module):
    """Rank r's share of ``full`` (a Linear with weight (out, in)), split over output features:
    it keeps the rows [r·out/T, (r+1)·out/T) of the weight (and that slice of the bias) as its
    own parameters ``weight`` and ``bias``, copies (not views) of ``full``'s. ``forward(x)``
    returns this rank's slice of ``full(x)``, (..., out/T); no communication.
    ``rows`` (optional): the list of output rows to keep instead of the contiguous slice (used
    by attention to take the same heads from q, k and v)."""

    def __init__(self, full: nn.Linear, group=None, rows: torch.Tensor | None = None):
        super().__init__()
        _check_linear(full)
        T, r = dist.get_world_size(group), dist.get_rank(group)
        per = _split("out_features", full.out_features, T)
        if rows is None:
            rows = torch.arange(r * per, (r + 1) * per)
        # BEGIN SOLUTION 3.4: keep copies of the weight rows (and bias entries) this rank owns as parameters
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rows].clone())
        # END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank r's share of ``full`` split over input features: it keeps the columns
    [r·in/T, (r+1)·in/T) of the weight (a copy) and the whole bias. ``forward(x_r)`` takes this
    rank's slice of the input, (..., in/T), and returns ``full(x)`` on every rank, (..., out):
    the partial products summed over the ranks with :func:`reduce_from_tp`, the bias added once."""

    def __init__(self, full: nn.Linear, group=None):
        super().__init__()
        self.group = group
        _check_linear(full)
        T, r = dist.get_world_size(group), dist.get_rank(group)
        per = _split("in_features", full.in_features, T)
        # BEGIN SOLUTION 3.4: keep a copy of this rank's weight columns and the whole bias
        self.weight = nn.Parameter(full.weight.detach()[:, r * per:(r + 1) * per].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        # END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION 3.4: partial product, summed over the ranks, then the bias once
        out = reduce_from_tp(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias
        # END SOLUTION


class TPMLP(nn.Module):
    """The tensor-parallel version of ``labkit.models.MLP`` (c_fc column-, c_proj row-parallel).

    ``forward(x)`` takes the full (B, S, C) input on every rank and returns ``mlp(x)`` on every
    rank, with exactly one all-reduce in forward and one in backward. 4C not divisible by T →
    ValueError."""

    def __init__(self, mlp: nn.Module, group=None):
        super().__init__()
        self.group = group
        self.c_fc = ColumnParallelLinear(mlp.c_fc, group)
        self.c_proj = RowParallelLinear(mlp.c_proj, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION 3.4: f, then the column-parallel layer, GELU, the row-parallel layer
        return self.c_proj(F.gelu(self.c_fc(copy_to_tp(x, self.group))))
        # END SOLUTION


class TPAttention(nn.Module):
    """The tensor-parallel version of ``labkit.models.CausalSelfAttention``: rank r owns heads
    [r·H/T, (r+1)·H/T) — their rows of q, k and v in the fused ``c_attn`` — and the matching
    columns of ``c_proj``. ``forward(x)``: full (B, S, C) in, ``attn(x)`` out on every rank; one
    all-reduce in forward and one in backward. H not divisible by T → ValueError."""

    def __init__(self, attn: nn.Module, group=None):
        super().__init__()
        self.group = group
        T, r = dist.get_world_size(group), dist.get_rank(group)
        C, H = attn.n_embd, attn.n_head
        self.heads = _split("n_head", H, T)
        self.head_size = C // H
        self.attention = attn.attention
        # BEGIN SOLUTION 3.4: pick this rank's heads' rows of q, k and v in c_attn (column-parallel) and c_proj's matching columns (row-parallel)
        width = self.heads * self.head_size
        own = torch.arange(r * width, (r + 1) * width)
        self.c_attn = ColumnParallelLinear(attn.c_attn, group, rows=torch.cat([own, C + own, 2 * C + own]))
        self.c_proj = RowParallelLinear(attn.c_proj, group)
        # END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        # BEGIN SOLUTION 3.4: f, local q/k/v for this rank's heads, causal attention, the row-parallel projection
        width = self.heads * self.head_size
        q, k, v = self.c_attn(copy_to_tp(x, self.group)).split(width, dim=2)
        q, k, v = (t.view(B, S, self.heads, self.head_size).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_size))
            mask = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
            y = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(B, S, width)
        return self.c_proj(y)
        # END SOLUTION


