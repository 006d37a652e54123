"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198, §4.2.2): the part of a transformer layer that tensor
parallelism leaves replicated — LayerNorm, dropout, the residual add — runs on each rank's 1/T
slice of the sequence instead of on the whole sequence.

Tensor parallelism (lab 3, Megatron's f and ḡ) keeps the (B, S, C) activations of the norm
region whole on every rank. Sequence parallelism replaces the pair with g and ḡ:

- g (:func:`gather_from_sp`), entering the tensor-parallel region: all-gather the ranks'
  (B, S/T, C) slices along the sequence into (B, S, C); in backward, reduce-scatter the
  gradient (each rank holds a partial gradient of the whole sequence; rank r keeps the sum of
  its slice);
- ḡ (:func:`reduce_scatter_to_sp`), leaving it: reduce-scatter the row-parallel layer's partial
  sums along the sequence, so rank r gets the sum of its slice; in backward, all-gather.

An all-reduce is a reduce-scatter followed by an all-gather, so the ring moves the same bytes
as tensor parallelism, while the norm region's activations shrink to 1/T. Both sub-blocks of a
transformer block run this way: :class:`SPAttnBlock` (``x + attn(ln_1(x))``, heads split,
causal attention over the whole gathered sequence) and :class:`SPMLPBlock`
(``x + mlp(ln_2(x))``); :class:`SPBlock` chains them. Dropout on a slice uses
:func:`slice_dropout`, whose masks are slices of the one mask a single device draws (the seed
scheme is in its docstring). Lab 5, exercise 5.8;
chapter 5 (book/05_activations.md). PyTorch's ``parallelize_module`` with ``SequenceParallel``
does the same with DTensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.validate import boolean, non_negative_int, number, tensor

__all__ = ["gather_from_sp", "reduce_scatter_to_sp", "slice_dropout", "SPMLPBlock", "SPAttnBlock", "SPBlock"]


# ==== exercise 5.8: your code ====

def _all_gather_seq(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Return the ranks' ``x`` concatenated along ``dim`` in rank order, with exactly one
    collective call (no all-reduce)."""
    # BEGIN SOLUTION 5.8: one collective; it works on the first dimension of contiguous tensors
    T = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((T * x0.shape[0],) + tuple(x0.shape[1:]))
    dist.all_gather_single(out, x0, group=group)
    return out.movedim(0, dim)
    # END SOLUTION


def _reduce_scatter_seq(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Return rank r's r-th slice along ``dim`` of the SUM of the ranks' ``x``, with exactly
    one collective call (no all-reduce); ``x.shape[dim]`` is divisible by the group size."""
    # BEGIN SOLUTION 5.8: one collective; it works on the first dimension of contiguous tensors
    T = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // T,) + tuple(x0.shape[1:]))
    dist.reduce_scatter_single(out, x0, group=group)
    return out.movedim(0, dim)
    # END SOLUTION


class _GatherFromSP(torch.autograd.Function):
    """g: all-gather along the sequence in forward, reduce-scatter in backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        # BEGIN SOLUTION 5.8: g's forward: every rank needs the whole sequence
        ctx.dim, ctx.group = dim, group
        return _all_gather_seq(x, dim, group)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION 5.8: g's backward: each rank holds a partial gradient of the whole sequence; it must end with the total for its own slice
        return _reduce_scatter_seq(grad, ctx.dim, ctx.group), None, None
        # END SOLUTION


class _ReduceScatterToSP(torch.autograd.Function):
    """ḡ: reduce-scatter along the sequence in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        # BEGIN SOLUTION 5.8: ḡ's forward: partial sums of the whole sequence in, the total of this rank's slice out
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_seq(x, dim, group)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION 5.8: ḡ's backward: what the row-parallel layer of each rank needs
        return _all_gather_seq(grad, ctx.dim, ctx.group), None, None
        # END SOLUTION


# ==== given: the course's code — read it, call it, don't change it ====

def _check_dim(x, dim):
    tensor("x", x)
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-d x, got {dim!r}")


def gather_from_sp(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Megatron's g over ``group`` (T ranks): returns the ranks' ``x`` concatenated along
    ``dim`` in rank order (shape[dim] × T); in backward, rank r's slice of the SUM of the
    ranks' gradients. Exactly one collective each way, no all-reduce."""
    _check_dim(x, dim)
    return _GatherFromSP.apply(x, dim, group)


# ==== exercise 5.8: your code ====

def reduce_scatter_to_sp(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Megatron's ḡ over ``group`` (T ranks): returns rank r's r-th slice along ``dim`` of the
    SUM of the ranks' ``x`` (shape[dim] / T); in backward, the ranks' gradients concatenated
    along ``dim``. Exactly one collective each way, no all-reduce. ``x.shape[dim]`` not
    divisible by T → ValueError naming ``x`` and T, before any communication."""
    _check_dim(x, dim)
    # BEGIN SOLUTION 5.8: refuse a sequence that does not split evenly, then apply ḡ
    T = dist.get_world_size(group)
    if x.shape[dim] % T:
        raise ValueError(f"x.shape[{dim}] = {x.shape[dim]} must be divisible by the tensor-parallel size T = {T}")
    return _ReduceScatterToSP.apply(x, dim, group)
    # END SOLUTION


class SPMLPBlock(nn.Module):
    """The second half of a ``labkit.models.Block`` — ``x + mlp(ln_2(x))`` — with tensor and
    sequence parallelism over ``group`` (T ranks).

    Rank r keeps ``ln`` (a copy of ``ln``, whole: it is small), the rows [r·4C/T, (r+1)·4C/T) of
    ``mlp.c_fc`` (column-parallel), the matching columns of ``mlp.c_proj`` (row-parallel) and its
    whole bias, and ``mlp``'s dropout. ``forward(x_r)`` takes this rank's slice of the sequence,
    (B, S/T, C) — rows [r·S/T, (r+1)·S/T) of the full x — and returns the same rows of the
    single-device ``x + mlp(ln(x))``. LayerNorm, dropout and the residual add run on the slice
    only; one all-gather and one reduce-scatter in forward, the same in backward, no all-reduce.
    The LayerNorm's parameter gradients are rank r's share (their sum over ranks is the
    single-device gradient). 4C not divisible by T → ValueError.

    ``seed`` (optional, added for :class:`SPBlock`): when given, the dropout is
    :func:`slice_dropout` with that seed on the rank's rows, so the mask is the rank's slice of
    the single device's; when None, a plain ``nn.Dropout`` (each rank its own random mask)."""

    def __init__(self, ln: nn.LayerNorm, mlp: nn.Module, group=None, seed: int | None = None):
        super().__init__()
        self.group = group
        T, r = dist.get_world_size(group), dist.get_rank(group)
        hidden = mlp.c_fc.out_features
        if hidden % T:
            raise ValueError(f"mlp.c_fc.out_features ({hidden}) must be divisible by the tensor-parallel size T = {T}")
        per = hidden // T
        rows = slice(r * per, (r + 1) * per)
        self.ln = nn.LayerNorm(ln.normalized_shape, eps=ln.eps, bias=ln.bias is not None)
        self.ln.load_state_dict(ln.state_dict())
        # plain local shards of the weights (copies), as Megatron splits them
        self.fc_weight = nn.Parameter(mlp.c_fc.weight.detach()[rows].clone())
        self.fc_bias = None if mlp.c_fc.bias is None else nn.Parameter(mlp.c_fc.bias.detach()[rows].clone())
        self.proj_weight = nn.Parameter(mlp.c_proj.weight.detach()[:, rows].clone())
        self.proj_bias = None if mlp.c_proj.bias is None else nn.Parameter(mlp.c_proj.bias.detach().clone())
        self.dropout = nn.Dropout(mlp.dropout.p) if seed is None else _SliceDropout(mlp.dropout.p, seed, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION 5.8: the norm on the slice, g, the two local matmuls with GELU, ḡ, the bias once, dropout and the residual on the slice
        h = gather_from_sp(self.ln(x), 1, self.group)
        h = F.linear(F.gelu(F.linear(h, self.fc_weight, self.fc_bias)), self.proj_weight)
        h = reduce_scatter_to_sp(h, 1, self.group)
        if self.proj_bias is not None:
            h = h + self.proj_bias
        return x + self.dropout(h)
        # END SOLUTION


# ==== given: the course's code — read it, call it, don't change it ====

def _check_seed(seed):
    if non_negative_int("seed", seed) >= 2**31:
        raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")


# ==== exercise 5.8: your code ====

def slice_dropout(h: torch.Tensor, p: float, seed: int, start: int, training: bool = True) -> torch.Tensor:
    """Dropout of ``h`` (B, L, C), the rows [start, start + L) of a (B, S, C) sequence, with the
    mask a single device would draw for those rows of the whole sequence.

    Seed scheme (the contract): each sequence position s has its own CPU random generator,
    seeded with seed·2³² + s; the (B, C) mask of position s is one uniform [0, 1) draw of shape
    (B, C) from it, an element kept where its draw is ≥ p. So a position's mask does not depend
    on which rank holds it nor on T. Kept values are scaled by 1/(1 − p); the result has ``h``'s
    dtype and device.
    ``training`` False, p = 0 or no rows (L = 0) → ``h`` unchanged. ``h`` not a floating
    (B, L, C) tensor → TypeError/ValueError naming h; p outside [0, 1) → ValueError naming p;
    seed outside [0, 2**31) → ValueError naming seed; start < 0 → ValueError naming start."""
    tensor("h", h, floating=True, ndim=3)
    number("p", p, low=0, high=1, high_open=True)
    _check_seed(seed)
    non_negative_int("start", start)
    boolean("training", training)
    if not training or p == 0 or h.shape[1] == 0:
        return h
    # BEGIN SOLUTION 5.8: one mask row per sequence position of h, drawn as the docstring says, then keep and rescale
    B, L, C = h.shape
    keep = torch.stack([torch.rand(B, C, generator=torch.Generator().manual_seed(seed * 2**32 + s)) >= p
                        for s in range(start, start + L)], dim=1)
    return h * keep.to(h.device) / (1 - p)
    # END SOLUTION


# ==== given: the course's code — read it, call it, don't change it ====

class _SliceDropout(nn.Module):
    """``slice_dropout`` on this rank's rows: rank r's input (B, L, C) is rows [r·L, (r+1)·L)."""

    def __init__(self, p: float, seed: int, group=None):
        super().__init__()
        _check_seed(seed)
        self.p, self.seed, self.group = p, seed, group

    def forward(self, h):
        return slice_dropout(h, self.p, self.seed, dist.get_rank(self.group) * h.shape[1], self.training)


# ==== exercise 5.8: your code ====

class SPAttnBlock(nn.Module):
    """The first half of a ``labkit.models.Block`` — ``x + attn(ln_1(x))`` — with tensor and
    sequence parallelism over ``group`` (T ranks).

    Rank r keeps ``ln`` (a copy, whole), the heads [r·H/T, (r+1)·H/T) of ``attn`` (H =
    ``attn.n_head``): the matching rows of the query, key and value blocks of ``attn.c_attn``
    (column-parallel, ``qkv_weight``/``qkv_bias`` = q rows, then k rows, then v rows), the
    matching columns of ``attn.c_proj`` (row-parallel, ``proj_weight``) and its whole bias
    (``proj_bias``). ``forward(x_r)`` takes this rank's rows [r·S/T, (r+1)·S/T) of x, (B, S/T,
    C), and returns the same rows of the single-device ``x + dropout(attn_eval(ln(x)))``, where
    ``attn_eval`` is ``attn`` without its attention-probability dropout (that dropout lives in
    the tensor-parallel region, per head; it is not applied here) and the causal attention
    covers the WHOLE sequence. LayerNorm, dropout and the residual add run on the slice only;
    the dropout is :func:`slice_dropout` with ``self.seed`` (p = ``attn.resid_dropout.p``; set
    ``seed`` anew each step — the same seed draws the same mask); one all-gather and one
    reduce-scatter in forward, the same in backward, no all-reduce. The LayerNorm's parameter
    gradients are rank r's share (their sum over ranks is the single-device gradient).
    H not divisible by T → ValueError naming attn.n_head; seed outside [0, 2**31) → ValueError."""

    def __init__(self, ln: nn.LayerNorm, attn: nn.Module, group=None, seed: int = 0):
        super().__init__()
        _check_seed(seed)
        self.group, self.seed = group, seed
        T, r = dist.get_world_size(group), dist.get_rank(group)
        H, C = attn.n_head, attn.n_embd
        # BEGIN SOLUTION 5.8: refuse a head count that does not split over the T ranks (name the argument and T)
        if H % T:
            raise ValueError(f"attn.n_head ({H}) must be divisible by the tensor-parallel size T = {T}")
        # END SOLUTION
        self.heads, per = H // T, C // T
        rows = [slice(k * C + r * per, k * C + (r + 1) * per) for k in range(3)]  # q, k, v
        self.ln = nn.LayerNorm(ln.normalized_shape, eps=ln.eps, bias=ln.bias is not None)
        self.ln.load_state_dict(ln.state_dict())
        w, b = attn.c_attn.weight.detach(), attn.c_attn.bias
        self.qkv_weight = nn.Parameter(torch.cat([w[s] for s in rows]).clone())
        self.qkv_bias = None if b is None else nn.Parameter(torch.cat([b.detach()[s] for s in rows]).clone())
        self.proj_weight = nn.Parameter(attn.c_proj.weight.detach()[:, r * per:(r + 1) * per].clone())
        self.proj_bias = None if attn.c_proj.bias is None else nn.Parameter(attn.c_proj.bias.detach().clone())
        self.p = attn.resid_dropout.p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION 5.8: the norm on the slice, g, this rank's heads over the whole sequence (causal), ḡ, the bias once, dropout on this rank's rows and the residual
        h = gather_from_sp(self.ln(x), 1, self.group)
        B, S, _ = h.shape
        q, k, v = (t.reshape(B, S, self.heads, -1).transpose(1, 2)
                   for t in F.linear(h, self.qkv_weight, self.qkv_bias).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, -1)
        h = reduce_scatter_to_sp(F.linear(y, self.proj_weight), 1, self.group)
        if self.proj_bias is not None:
            h = h + self.proj_bias
        start = dist.get_rank(self.group) * x.shape[1]
        return x + slice_dropout(h, self.p, self.seed, start, self.training)
        # END SOLUTION


# ==== given: the course's code — read it, call it, don't change it ====

class SPBlock(nn.Module):
    """A whole ``labkit.models.Block`` with sequence parallelism: :class:`SPAttnBlock` on
    ``block.ln_1``/``block.attn`` (seed ``seed``), then :class:`SPMLPBlock` on
    ``block.ln_2``/``block.mlp`` (seed ``seed + 1``). Input and output: this rank's rows of the
    sequence, (B, S/T, C)."""

    def __init__(self, block: nn.Module, group=None, seed: int = 0):
        super().__init__()
        self.attn = SPAttnBlock(block.ln_1, block.attn, group, seed)
        self.mlp = SPMLPBlock(block.ln_2, block.mlp, group, seed=seed + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))
