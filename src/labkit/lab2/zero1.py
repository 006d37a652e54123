"""ZeRO stage 1: each of N data-parallel ranks keeps the optimizer states of 1/N of the parameters.

In plain data parallelism every rank holds a full copy of Adam's states: 12Ψ bytes in mixed
precision (fp32 master weights, m and v). ZeRO-1 (Rajbhandari et al. 2019, arXiv 1910.02054)
notices that the update is elementwise, so no rank needs the states of parameters it does not
update. The trainable parameters are viewed as one flat vector of Ψ elements, padded to N·S
with S = ceil(Ψ/N) (``labkit.flat_params``), and rank r owns the slice [r·S, (r+1)·S), cut at
parameter boundaries into pieces, one tensor each for the wrapped optimizer
(``labkit.sharding``: so it skips, counts and configures each parameter as torch would). A step:

1. backward as usual (full gradients on every rank);
2. **reduce-scatter** the flat gradient: rank r receives only the sum of its slice, and divides
   it by N (the average, as DDP takes), plus, per parameter, how many ranks had a gradient;
3. the wrapped optimizer (any elementwise ``torch.optim`` class, with the model's parameter
   groups) updates this rank's pieces only, with their states; a parameter no rank had a
   gradient for is skipped, as Adam skips it under DDP;
4. **all-gather** the updated slices, so every rank has every updated parameter again.

Communication: a reduce-scatter and an all-gather each put (N−1)/N · Ψ elements on the wire per
rank, 2Ψ in all — the same volume as the all-reduce of plain data parallelism (which *is* a
reduce-scatter followed by an all-gather), plus one count per parameter in each rank's chunk.
ZeRO-1 therefore costs no extra communication.
States per rank: K·S bytes, K = 8 for Adam on fp32 parameters (m and v) and K = 12 on 16-bit
parameters (plus the fp32 master slice); per GPU in mixed precision 2Ψ + 2Ψ + 12Ψ/N.

``torch.distributed.optim.ZeroRedundancyOptimizer`` shards whole tensors instead (each rank
gets a set of parameters, which cannot split Ψ evenly) and broadcasts the updated tensors; the
flat partition here gives every rank the same share, at a price: an optimizer whose update of
an element reads other elements of its tensor (Adafactor's factors, LAMB's norms) would see
only its piece, so ZeRO-1 wraps elementwise optimizers (Adam, AdamW, SGD, ...) and refuses
the others it knows (``labkit.sharding.NOT_ELEMENTWISE``: Adafactor, LBFGS, Muon).

Chapter 2 (book/02_optimizer_states.md); Lab 2, exercise 2.5 (labs/02_optimizer_states.ipynb).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.flat_params import copy_from_flat, partition
from labkit.optim_base import run_closure
from labkit.sharding import ShardedOptimizer

# torch 2.13 names them *_single; older releases *_tensor / *_into_tensor (same operators).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["ZeRO1", "partition"]

# ==== given: the course's code — read it, call it, don't change it ====


class ZeRO1(ShardedOptimizer):
    """Any elementwise ``torch.optim`` optimizer sharded ZeRO-1 style over a process group.

    Every rank builds it with the same parameters (same order, shapes and groups). The given
    half (``labkit.sharding.ShardedOptimizer``) sets up what the step uses:

    * ``self.params``: the trainable parameters (``requires_grad``; frozen ones are outside the
      flat vector, never updated, no state), one dtype ``self.dtype``;
    * ``self.layout``: their flat layout (Ψ = ``self.numel``, S = ``self.shard_size``,
      ``self.padding``), with ``self.layout.pieces`` (where each parameter meets this rank's
      slice: ``index``, ``start_in_shard``, ``length``, ...), ``self.layout.pack(grads, dtype)``
      (the reduce-scatter input: N chunks of S gradient elements + one presence count per
      parameter) and ``self.layout.unpack(received)`` (→ the summed slice, the counts);
    * ``self.master``: for 16-bit parameters, this rank's fp32 slice of them, (S,) (the master,
      counted as optimizer state); None otherwise (the parameters are their own master, fp32 or
      fp64: ``self.master_dtype``);
    * ``self.pieces``: one tensor per piece, a view of the master or of the parameter itself;
      ``self.local_slice()``: the slice as one (S,) tensor in ``self.master_dtype``;
      ``self.optim = optimizer_class(...)`` over the pieces, grouped as the parameters were,
      with each group's options (``self.param_groups``: for schedulers): its states cover
      exactly this slice;
    * ``zero_grad``, ``state``, ``shard_state()`` (the states as flat (S,) tensors),
      ``state_dict()`` / ``load_state_dict()`` (this rank's: the shard and the optimizer's).

    An optimizer: it never touches the model's buffers (DDP broadcasts rank 0's before each
    forward): each rank keeps the BatchNorm running statistics of its own batches.

    Args:
        params: tensors, or parameter groups (dicts with "params" and per-group options such as
            ``lr`` or ``weight_decay``), as for ``torch.optim``; trainable ones share one
            floating dtype and device.
        optimizer_class: a ``torch.optim.Optimizer`` subclass (default ``torch.optim.Adam``)
            whose update is elementwise.
        group: the data-parallel process group (None: the default group).
        **defaults: options for ``optimizer_class`` (``lr=...``, ``betas=...``, ...).
    """

    def __init__(self, params, optimizer_class=torch.optim.Adam, *, group=None, **defaults):
        super().__init__(params, optimizer_class, group=group, **defaults)

    # ==== exercise 2.5: your code ====

    @torch.no_grad()
    def step(self, closure=None):
        """One data-parallel step of the sharded optimizer; every rank calls it after backward.

        Guarantees, on every rank: the parameters equal what ``optimizer_class`` (same groups and
        options) gives under ``DistributedDataParallel(find_unused_parameters=True)``, unsharded,
        to rounding: each parameter's gradient is the average over the ranks, a rank without
        ``.grad`` for it contributing zeros, and a parameter no rank has a gradient for gets
        none (the optimizer skips it: its step count does not advance); 16-bit parameters are
        the rounded master, which the step updates; only this rank's pieces' states exist and
        change; frozen parameters are untouched. Every collective runs over ``self.group`` (a
        subgroup of the world, possibly: lab 7 runs ZeRO-1 inside one). Communication: exactly
        one reduce-scatter of ``self.layout.pack(...)`` (the padded flat gradients with one
        presence count per parameter, in the parameters' dtype) and one all-gather of the
        updated slices (the same volume as DDP's one all-reduce); no all-reduce. ``closure``
        (optional, given) runs first, as for ``torch.optim``; its loss is returned.
        """
        loss = run_closure(closure)
        self.check_trainable()  # given: refuses a parameter unfrozen since construction
        raise NotImplementedError("exercise 2.5: reduce-scatter the packed gradients, average your slice, give each piece its gradient (None for a parameter no rank had one for), step, all-gather the slices into the parameters (labs/02_optimizer_states.ipynb)")
        return loss
