"""Lab 5's harnesses: per-rank functions that run the student's ring attention (5.7) and
sequence parallelism (5.8) and return what the graders, the lab and ``labkit.cluster`` measure.

Each runs inside ``labkit.ranks.launch`` (``fn(rank, world_size, *args)``). ``group_size`` (when
given) splits the world into consecutive groups of that many ranks (a 4-rank world split in two:
ranks {0, 1} and {2, 3}) and runs the exercise inside this rank's group, so the student's code
meets a process group other than the default one, as lab 7 runs it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm_count import count_comm
from labkit.lab5.ring_attention import count_attention_work, rank_positions, ring_attention
from labkit.lab5.sequence_parallel import SPAttnBlock, SPBlock, SPMLPBlock
from labkit.measure import peak_bytes
from labkit.reference.lab5 import comm_counts
from labkit.validate import one_of, positive_int, tensor

__all__ = ["subgroup", "ring_worker", "SavedBytes", "SavedBytesIn", "run_sp", "run_sp_attn"]


def subgroup(rank: int, world_size: int, group_size: int | None):
    """(group, rank in it, its size): the default group when ``group_size`` is None, otherwise
    this rank's group of ``group_size`` consecutive ranks (every rank creates every group, in
    order, as ``dist.new_group`` requires)."""
    if group_size is None or group_size == world_size:
        return None, rank, world_size
    group_size = positive_int("group_size", group_size)
    if world_size % group_size:
        raise ValueError(f"group_size={group_size} must divide world_size={world_size}")
    mine = None
    for first in range(0, world_size, group_size):
        g = dist.new_group(list(range(first, first + group_size)))
        if first <= rank < first + group_size:
            mine = g
    return mine, rank % group_size, group_size


def ring_worker(rank: int, world_size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool = False, layout: str = "contiguous",
                group_size: int | None = None, strided: bool = False) -> dict:
    """Run the student's ``ring_attention`` on this rank's chunk of full q, k, v (B, H, S, D).

    The chunk holds ``rank_positions(S, N, r, layout)`` with r, N this rank's place in its group.
    ``strided``: pass the chunks as a model makes them, (B, S, H, D) memory seen as (B, H, S, D)
    by a transpose (not contiguous), instead of contiguous copies.
    Returns ``{"out": (B, H, S/N, D), "positions": the global positions of its rows,
    "peak_bytes": the MemTracker peak during the call, "bytes_sent": {op: bytes},
    "calls": {op: calls}, "work": score entries computed (``count_attention_work``)}``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        tensor(name, t, floating=True, ndim=4)
    one_of("layout", layout, ("contiguous", "zigzag"))
    group, r, n = subgroup(rank, world_size, group_size)
    if q.shape[2] % n:
        raise ValueError(f"seq_len={q.shape[2]} must split evenly over world_size={n} ranks "
                         f"(every rank holds S/N positions); pad the sequence to a multiple of {n}")
    positions = rank_positions(q.shape[2], n, r, layout)
    q_loc, k_loc, v_loc = (t[:, :, positions].contiguous() for t in (q, k, v))
    if strided:
        q_loc, k_loc, v_loc = (t.transpose(1, 2).contiguous().transpose(1, 2)
                               for t in (q_loc, k_loc, v_loc))
    with count_comm() as counts, count_attention_work() as work:
        peak, out = peak_bytes(ring_attention, q_loc, k_loc, v_loc, causal=causal, layout=layout,
                               group=group)
    return {"out": out, "positions": positions, "peak_bytes": peak,
            "bytes_sent": dict(counts.bytes_sent), "calls": dict(counts.calls), "work": work[0]}


class SavedBytes:
    """Bytes autograd saves inside the ``with`` block; each storage once, parameters excluded."""

    def __init__(self):
        self.bytes, self._seen = 0, set()

    def _pack(self, t):
        base = t._base if t._base is not None else t
        if not isinstance(base, nn.Parameter):
            key = base.untyped_storage().data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += base.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


class SavedBytesIn(SavedBytes):
    """Bytes autograd saves while a module's forward runs (a pre-hook enters the hooks, a
    forward hook leaves them), each storage once, parameters excluded; and the module's input bytes."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.input_bytes = 0
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave)

    def _enter(self, module, args):
        self.input_bytes += args[0].numel() * args[0].element_size()
        self.__enter__()

    def _leave(self, module, args, out):
        self.__exit__(None, None, None)


def run_sp(rank: int, world_size: int, ln: nn.LayerNorm, mlp: nn.Module, x: torch.Tensor,
           grad_out: torch.Tensor, group_size: int | None = None) -> dict:
    """Build the student's ``SPMLPBlock(ln, mlp, group)`` on this rank, run forward on its slice
    of ``x`` (B, S, C) and backward with its slice of ``grad_out``.

    Returns ``{"out", "x_grad", "grads": {name: grad}, "forward", "backward": comm counts,
    "ln_saved_bytes", "ln_input_bytes", "dropout_input_bytes", "all_reduce_ring_bytes"}``; the
    last is the ring bytes of one plain all-reduce of a (B, S, C) tensor, counted here."""
    group, r, n = subgroup(rank, world_size, group_size)
    per = x.shape[1] // n
    sp = SPMLPBlock(ln, mlp, group)
    ln_saved, drop_in = SavedBytesIn(sp.ln), SavedBytesIn(sp.dropout)
    xr = x[:, r * per:(r + 1) * per].clone().requires_grad_()
    with count_comm() as fwd:
        out = sp(xr)
    with count_comm() as bwd:
        out.backward(grad_out[:, r * per:(r + 1) * per])
    with count_comm() as plain:
        dist.all_reduce(torch.zeros_like(x), group=group)
    return {"out": out.detach(), "x_grad": xr.grad,
            "grads": {name: p.grad for name, p in sp.named_parameters()},
            "forward": comm_counts(fwd), "backward": comm_counts(bwd),
            "ln_saved_bytes": ln_saved.bytes, "ln_input_bytes": ln_saved.input_bytes,
            "dropout_input_bytes": drop_in.input_bytes,
            "all_reduce_ring_bytes": plain.ring_bytes["all_reduce"]}


def run_sp_attn(rank: int, world_size: int, block: nn.Module, x: torch.Tensor,
                grad_out: torch.Tensor, seed: int = 0, whole_block: bool = True,
                group_size: int | None = None) -> dict:
    """Build the student's ``SPAttnBlock(block.ln_1, block.attn, group, seed)`` on this rank
    (training mode), run forward on its slice of ``x`` (B, S, C) and backward with its slice of
    ``grad_out``; then, if ``whole_block``, the same with ``SPBlock(block, group, seed)``.

    Returns ``{"attn": {"out", "x_grad", "grads", "forward", "backward", "ln_saved_bytes",
    "ln_input_bytes"}, "block": {"out", "x_grad", "forward", "backward", "saved_bytes"}}``
    ("block" absent when ``whole_block`` is False); ``saved_bytes``: what autograd saves in the
    whole block's forward on this rank, each storage once, parameters excluded."""
    group, r, n = subgroup(rank, world_size, group_size)
    per = x.shape[1] // n
    rows = slice(r * per, (r + 1) * per)
    sp = SPAttnBlock(block.ln_1, block.attn, group, seed=seed)
    ln_saved = SavedBytesIn(sp.ln)
    xr = x[:, rows].clone().requires_grad_()
    with count_comm() as fwd:
        out = sp(xr)
    with count_comm() as bwd:
        out.backward(grad_out[:, rows])
    res = {"attn": {"out": out.detach(), "x_grad": xr.grad,
                    "grads": {name: p.grad for name, p in sp.named_parameters()},
                    "forward": comm_counts(fwd), "backward": comm_counts(bwd),
                    "ln_saved_bytes": ln_saved.bytes, "ln_input_bytes": ln_saved.input_bytes}}
    if whole_block:
        sb = SPBlock(block, group, seed=seed)
        xr = x[:, rows].clone().requires_grad_()
        with count_comm() as fwd, SavedBytes() as saved:
            out = sb(xr)
        with count_comm() as bwd:
            out.backward(grad_out[:, rows])
        res["block"] = {"out": out.detach(), "x_grad": xr.grad, "forward": comm_counts(fwd),
                        "backward": comm_counts(bwd), "saved_bytes": saved.bytes}
    return res


def apply_selective_checkpointing(model: nn.Module, policy=None) -> nn.Module:
    """Wrap every block of ``model.h`` in the student's ``SelectiveCheckpointBlock`` (exercise
    5.4), in place; return the model.

    The parameters stay the same objects in the same order (names gain ``.block``).
    ``policy``: None for ``keep_matmuls_policy``, or any policy such as ``FlopsPerBytePolicy``.
    """
    if not isinstance(getattr(model, "h", None), nn.ModuleList):
        raise TypeError(f"model must be a course GPT (blocks in the nn.ModuleList model.h), got "
                        f"{type(model).__name__}")
    from labkit.lab5.selective_checkpoint import SelectiveCheckpointBlock

    for i, block in enumerate(model.h):
        if isinstance(block, SelectiveCheckpointBlock):
            block = block.block
        model.h[i] = SelectiveCheckpointBlock(block, policy)
    return model
