"""ZeRO stage 3 (Rajbhandari et al. 2019, arXiv 1910.02054) / FSDP (Zhao et al. 2023, arXiv
2304.11277): shard the parameters too.

ZeRO-1 (chapter 2) shards the optimizer states, ZeRO-2 the gradients as well; ZeRO-3 also keeps
only 1/N of the parameters on each rank. The model is cut into *units* (here: each transformer
block, plus the *root* unit of the remaining parameters: embeddings, final LayerNorm, head). Each
unit's parameters are one flat vector, padded to N·S elements (S = ceil(Ψ_unit/N)); rank r keeps
the slice [r·S, (r+1)·S) (``labkit.flat_params``). Per step:

1. before a unit's forward, **all-gather** its full parameters; after it, free them;
2. before the unit's backward, all-gather them **again**; after it, free them;
3. **reduce-scatter** the unit's gradients: rank r receives the sum of slice r (and, per
   parameter, how many ranks had its gradient); divide by N;
4. Adam on the owned slices only (states 1/N too).

The hooks that call these steps, the order of the reduce-scatters (the same on every rank),
and the sharded ``torch.optim.Adam`` over each unit's pieces are given
(``labkit.fsdp_units.ShardedUnits``); the sharding is the exercise.

Persistent parameter bytes per rank: Σ_units ceil(Ψ_unit/N) × 4 (fp32); at any moment one block
(and the root, which is used at both ends of the step and stays gathered from the start of
forward to the end of backward) is materialized on top. Communication per step: 2 all-gathers
and 1 reduce-scatter of each block's Ψ_unit (3Ψ in all, 1.5× data parallelism's 2Ψ of one
all-reduce); the root is gathered once. With ``prefetch=True`` the all-gather of the unit that
runs next is issued before this one computes (asynchronously), so the transfer can overlap the
compute; the peak then holds one more block. PyTorch's FSDP2 (``fully_shard``) does the same
(``labkit.reference.lab3.train_fsdp2`` runs it for comparison). Frozen parameters
(``requires_grad=False``) are sharded and gathered like the others and receive no update. A
16-bit model keeps fp32 shards (its master) and gathers 16-bit copies; an fp64 model trains in
fp64 (``labkit.flat_params.master_dtype``, the rule of every ZeRO stage here).
Lab 3, exercise 3.7; chapter 3 (book/03_parameters.md).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.fsdp_units import ShardedUnits, Unit
from labkit.flat_params import flatten_padded, shard_range

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["Unit", "ZeRO3"]


# ==== given: the course's code — read it, call it, don't change it ====
class ZeRO3(ShardedUnits):
    """ZeRO-3 on ``model`` over a process group: units ``model.h[i]`` and the root.

    Build it on every rank with the same model (same initial weights); it installs hooks, so
    ``loss = model(x, y); loss.backward(); zero3.step()`` trains with sharded parameters.
    Given (``labkit.fsdp_units.ShardedUnits``): the units (``self.units``, each a ``Unit``
    with its ``layout``, ``dtype`` and ``master_dtype``), the hooks, the order of the
    reduce-scatters, ``self.optim`` (Adam over each unit's ``pieces``), ``step(closure)``,
    ``zero_grad``, ``state_dict``, ``full_parameters``, ``log_all_gathers``.

    Buffers are not sharded and not broadcast (DDP broadcasts rank 0's before each forward):
    each rank keeps the BatchNorm running statistics of its own batches. A model with no
    parameter outside its blocks has an empty root unit (nothing to shard or gather).

    Args:
        model: a ``labkit.models.GPT`` (anything with a ModuleList ``h`` of blocks).
        lr, betas, eps: as ``torch.optim.Adam`` (no weight decay).
        group: the process group (None: the default group).
        prefetch: start the all-gather of the block that runs next before this block computes.
    """

    # ==== exercise 3.7: your code ====
    def _shard(self, u: Unit) -> None:
        """Set up unit ``u``: S and padding (``u.layout``'s); ``u.shard`` = a copy of this rank's
        slice of the padded flat parameters, in ``u.master_dtype``; ``u.full`` = an N·S buffer
        in ``u.dtype`` whose pieces become the parameters' ``.data`` (views, in order); then
        free ``u``."""
        # BEGIN SOLUTION 3.7: partition, keep this rank's slice as the shard, make the params views into one padded full buffer, free it
        u.shard_size, u.padding = u.layout.shard_size, u.layout.padding
        flat = flatten_padded(u.params, u.padding, u.master_dtype)
        u.shard = flat[shard_range(self.rank, u.shard_size)].clone()
        u.full = torch.zeros(self.world_size * u.shard_size, dtype=u.dtype)
        offset = 0
        for p in u.params:
            p.data = u.full[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        self._free(u)
        # END SOLUTION

    def _gather(self, u: Unit) -> None:
        """Materialize unit ``u``: give ``u.full`` its storage back and all-gather every rank's
        shard into it (one all-gather of N·S elements in ``u.dtype``), without bumping its version counter
        (autograd saved views of it in forward). Nothing to do if it is already gathered; if a
        prefetch of ``u`` is in flight (``u.pending``), wait for it instead."""
        # BEGIN SOLUTION 3.7: resize the storage back, all-gather the shards into it (version counter preserved)
        if u.pending is not None:
            u.pending.wait()
            u.pending = None
            return
        nbytes = u.full.numel() * u.full.element_size()
        if u.full.untyped_storage().nbytes() == nbytes:
            return  # already gathered
        u.full.untyped_storage().resize_(nbytes)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(u.full):
            _all_gather_flat(u.full, u.shard.to(u.dtype), group=self.group)
        # END SOLUTION

    def _prefetch(self, u: Unit) -> None:
        """Start materializing unit ``u`` without waiting: its storage back and the all-gather of
        the shards issued asynchronously (version counter preserved), its handle kept in
        ``u.pending`` for :meth:`_gather` to wait on. Nothing to do if ``u`` is already gathered
        or in flight."""
        # BEGIN SOLUTION 3.7: like _gather, but the collective is asynchronous and its handle kept
        nbytes = u.full.numel() * u.full.element_size()
        if u.pending is not None or u.full.untyped_storage().nbytes() == nbytes:
            return
        u.full.untyped_storage().resize_(nbytes)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(u.full):
            u.pending = _all_gather_flat(u.full, u.shard.to(u.dtype), group=self.group, async_op=True)
        # END SOLUTION

    def _free(self, u: Unit) -> None:
        """Release the full parameters of ``u``: resize ``u.full``'s storage to 0 bytes."""
        # BEGIN SOLUTION 3.7: resize the full buffer's storage to 0 bytes
        u.full.untyped_storage().resize_(0)
        # END SOLUTION

    def _reduce_scatter_grads(self, u: Unit) -> None:
        """Once ``u``'s gradients are complete (the given hooks call it, in the same order on
        every rank): one reduce-scatter of ``u.layout.pack(...)`` in ``u.master_dtype`` (the
        padded flat gradients, a parameter without ``.grad`` — frozen, or not reached by this
        rank's backward — counting as zeros, then one presence count per parameter); ``u.grad``
        = this rank's slice / N and ``u.present`` = the counts, each added to an existing one
        (several backwards before one step accumulate); drop the full gradients (``p.grad =
        None``) and free ``u``."""
        # BEGIN SOLUTION 3.7: pack the grads, reduce-scatter, average into u.grad and add the counts into u.present, drop full grads, free the unit
        send = u.layout.pack([p.grad for p in u.params], u.master_dtype)  # (N·(S + P),)
        received = torch.empty(send.numel() // self.world_size, dtype=u.master_dtype)
        _reduce_scatter_flat(received, send, group=self.group)
        mine, present = u.layout.unpack(received)
        mine = mine / self.world_size
        u.grad = mine if u.grad is None else u.grad + mine
        u.present = present if u.present is None else u.present + present
        for p in u.params:
            p.grad = None
        self._free(u)
        # END SOLUTION

    def _step(self) -> None:
        """The body of ``step()`` (given: ``ShardedUnits.step`` runs the closure, then this):
        give each of a unit's ``pieces`` its part of ``u.grad`` (``u.piece_info[k]``: the
        parameter ``index``, ``start_in_shard``, ``length``), or None where ``u.present`` says
        no rank had that parameter's gradient (or the unit has no ``u.grad``: it did not run);
        one ``self.optim.step()``; then forget ``u.grad``, ``u.present`` and the pieces'
        gradients. The full parameters are refreshed by the next gather."""
        # BEGIN SOLUTION 3.7: hand each piece its gradient slice (None where no rank had one), one Adam step, forget the slices
        for u in self.units:
            for piece, pc in zip(u.pieces, u.piece_info):
                used = u.grad is not None and bool(u.present[pc.index] > 0)
                piece.grad = u.grad[pc.start_in_shard:pc.start_in_shard + pc.length] if used else None
        self.optim.step()
        for u in self.units:
            u.grad = u.present = None
            for piece in u.pieces:
                piece.grad = None
        # END SOLUTION
