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
as tensor parallelism, while the norm region's activations shrink to 1/T. Lab 5, exercise 5.8;
chapter 5 (book/05_activations.md). PyTorch's ``parallelize_module`` with ``SequenceParallel``
does the same with DTensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.comm_count import count_comm

__all__ = ["gather_from_sp", "reduce_scatter_to_sp", "SPMLPBlock", "run_sp", "run_sequence_parallel_module"]


def _all_gather_seq(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Return the ranks' ``x`` concatenated along ``dim`` in rank order, with exactly one
    collective call (no all-reduce)."""
    raise NotImplementedError("exercise 5.8: one collective; it works on the first dimension of contiguous tensors (labs/05_activations.ipynb)")


def _reduce_scatter_seq(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Return rank r's r-th slice along ``dim`` of the SUM of the ranks' ``x``, with exactly
    one collective call (no all-reduce); ``x.shape[dim]`` is divisible by the group size."""
    raise NotImplementedError("exercise 5.8: one collective; it works on the first dimension of contiguous tensors (labs/05_activations.ipynb)")


class _GatherFromSP(torch.autograd.Function):
    """g: all-gather along the sequence in forward, reduce-scatter in backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        raise NotImplementedError("exercise 5.8: g's forward: every rank needs the whole sequence (labs/05_activations.ipynb)")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("exercise 5.8: g's backward: each rank holds a partial gradient of the whole sequence; it must end with the total for its own slice (labs/05_activations.ipynb)")


class _ReduceScatterToSP(torch.autograd.Function):
    """ḡ: reduce-scatter along the sequence in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        raise NotImplementedError("exercise 5.8: ḡ's forward: partial sums of the whole sequence in, the total of this rank's slice out (labs/05_activations.ipynb)")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("exercise 5.8: ḡ's backward: what the row-parallel layer of each rank needs (labs/05_activations.ipynb)")


def _check_dim(x, dim):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-d x, got {dim!r}")


def gather_from_sp(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Megatron's g over ``group`` (T ranks): returns the ranks' ``x`` concatenated along
    ``dim`` in rank order (shape[dim] × T); in backward, rank r's slice of the SUM of the
    ranks' gradients. Exactly one collective each way, no all-reduce."""
    _check_dim(x, dim)
    return _GatherFromSP.apply(x, dim, group)


def reduce_scatter_to_sp(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Megatron's ḡ over ``group`` (T ranks): returns rank r's r-th slice along ``dim`` of the
    SUM of the ranks' ``x`` (shape[dim] / T); in backward, the ranks' gradients concatenated
    along ``dim``. Exactly one collective each way, no all-reduce. ``x.shape[dim]`` not
    divisible by T → ValueError naming ``x`` and T, before any communication."""
    _check_dim(x, dim)
    raise NotImplementedError("exercise 5.8: refuse a sequence that does not split evenly, then apply ḡ (labs/05_activations.ipynb)")


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
    single-device gradient). 4C not divisible by T → ValueError."""

    def __init__(self, ln: nn.LayerNorm, mlp: nn.Module, group=None):
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
        self.dropout = nn.Dropout(mlp.dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("exercise 5.8: the norm on the slice, g, the two local matmuls with GELU, ḡ, the bias once, dropout and the residual on the slice (labs/05_activations.ipynb)")


# ---------------------------------------------------------------- per-rank workers (infrastructure)

def _counts(c) -> dict:
    return {"calls": dict(c.calls), "bytes": dict(c.bytes_sent), "ring": dict(c.ring_bytes)}


class _SavedIn:
    """Bytes autograd saves while a module's forward runs (pre-hook enters saved_tensors_hooks,
    forward hook leaves); each storage once."""

    def __init__(self, module: nn.Module):
        self.bytes, self.input_bytes, self._seen, self._ctx = 0, 0, set(), None
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave)

    def _pack(self, t):
        base = t._base if t._base is not None else t
        if not isinstance(base, nn.Parameter):
            key = base.untyped_storage().data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += base.untyped_storage().nbytes()
        return t

    def _enter(self, module, args):
        self.input_bytes += args[0].numel() * args[0].element_size()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()

    def _leave(self, module, args, out):
        self._ctx.__exit__(None, None, None)


def run_sp(rank: int, world_size: int, ln: nn.LayerNorm, mlp: nn.Module, x: torch.Tensor,
           grad_out: torch.Tensor) -> dict:
    """Build ``SPMLPBlock(ln, mlp)`` on this rank, run forward on its slice of ``x`` (B, S, C)
    and backward with its slice of ``grad_out``; run by ``labkit.dist.launch``.

    Returns ``{"out", "x_grad", "grads": {name: grad}, "forward", "backward": comm counts,
    "ln_saved_bytes", "ln_input_bytes", "dropout_input_bytes", "all_reduce_ring_bytes"}``; the
    last is the ring bytes of one plain all-reduce of a (B, S, C) tensor, counted here."""
    S = x.shape[1]
    per = S // world_size
    sp = SPMLPBlock(ln, mlp)
    ln_saved, drop_in = _SavedIn(sp.ln), _SavedIn(sp.dropout)
    xr = x[:, rank * per:(rank + 1) * per].clone().requires_grad_()
    with count_comm() as fwd:
        out = sp(xr)
    with count_comm() as bwd:
        out.backward(grad_out[:, rank * per:(rank + 1) * per])
    with count_comm() as plain:
        dist.all_reduce(torch.zeros_like(x))
    return {"out": out.detach(), "x_grad": xr.grad,
            "grads": {n: p.grad for n, p in sp.named_parameters()},
            "forward": _counts(fwd), "backward": _counts(bwd),
            "ln_saved_bytes": ln_saved.bytes, "ln_input_bytes": ln_saved.input_bytes,
            "dropout_input_bytes": drop_in.input_bytes,
            "all_reduce_ring_bytes": plain.ring_bytes["all_reduce"]}


def run_sequence_parallel_module(rank: int, world_size: int, ln: nn.LayerNorm, mlp: nn.Module,
                                 x: torch.Tensor) -> dict:
    """PyTorch's version on the same weights: ``parallelize_module`` with ``SequenceParallel``
    on the LayerNorm, ``ColwiseParallel(input_layouts=Shard(1))`` on c_fc and
    ``RowwiseParallel(output_layouts=Shard(1))`` on c_proj, on a CPU DeviceMesh; returns this
    rank's slice of ``x + mlp(ln(x))`` and the forward's comm counts."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world_size,))
    ln, mlp = copy.deepcopy(ln), copy.deepcopy(mlp)
    parallelize_module(ln, mesh, SequenceParallel())
    parallelize_module(mlp, mesh, {"c_fc": ColwiseParallel(input_layouts=Shard(1)),
                                   "c_proj": RowwiseParallel(output_layouts=Shard(1))})
    per = x.shape[1] // world_size
    xr = x[:, rank * per:(rank + 1) * per].clone()
    with count_comm() as fwd:
        out = xr + mlp(ln(xr))
        out = out.wait() if hasattr(out, "wait") else out
    dist.barrier()
    return {"out": torch.Tensor(out.detach()).clone(), "forward": _counts(fwd)}
