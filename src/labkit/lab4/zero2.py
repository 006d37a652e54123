"""ZeRO stage 2: each of N data-parallel ranks keeps 1/N of the gradients (and of Adam's states).

ZeRO-1 (lab 2) shards the optimizer states but still all-reduces a full gradient into every
rank: 2Ψ bytes of 16-bit gradients (4Ψ in fp32) per rank at the end of backward. Yet a rank
only updates its own slice of the flat parameter vector, so it only needs the reduced gradient
of that slice. ZeRO-2 (Rajbhandari et al. 2019, arXiv 1910.02054) therefore replaces the
all-reduce by a reduce-scatter, and does it during backward: gradients are grouped into fixed
buckets sent in the same order on every rank (``labkit.buckets``, as BucketedDDP); once a
bucket's gradients are all ready, one reduce-scatter sends each rank the sum of the pieces it
owns, and the full gradients of the bucket are freed at once. When the next bucket is sent, the
previous reduce-scatter (which had a whole bucket of backward to finish) is waited for and its
output added into the rank's gradient shard, so at most one is in flight. A
rank then holds its gradient shard (S = ceil(Ψ/N) elements, 4Ψ/N bytes in fp32), the bucket that
is filling and the one in flight; never the whole gradient. After backward: Adam on the owned
slice (``torch.optim.Adam`` over the slice's pieces, ``labkit.sharding``, as ZeRO-1), then one
all-gather of the updated slices. Per GPU in mixed precision: 2Ψ + (2 + 12)Ψ/N bytes.

Communication: reduce-scatter Ψ + all-gather Ψ elements per step, what one all-reduce (DDP)
costs — the gradient memory is saved for free.

The flat layout is ``labkit.flat_params`` over the trainable parameters (frozen ones, with
``requires_grad=False``, are outside it and never updated, as ``torch.optim.Adam`` skips them):
parameter i occupies ``[offset_i, offset_i + n_i)`` of a vector padded to N·S; rank r owns
``[r·S, (r+1)·S)``. A bucket's parameters need not be contiguous, so a bucket is reduced with
``dist.reduce_scatter(output, input_list)``: input i holds, concatenated in bucket order, the
pieces of the bucket's gradients that rank i owns (possibly none; the sizes differ between
ranks, which gloo and NCCL accept), then one presence count per parameter of the bucket (1 where
this rank has its gradient): a parameter no rank had a gradient for is left alone, as Adam
leaves it under ``DistributedDataParallel(find_unused_parameters=True)``.

Chapter 4 (book/04_gradients.md); Lab 4, exercise 4.3 (labs/04_gradients.ipynb).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.flat_params import copy_from_flat
from labkit.optim_base import run_closure
from labkit.sharding import BucketedShardedAdam, owned_pieces

__all__ = ["ZeRO2Adam", "owned_pieces"]

# ==== given: the course's code — read it, call it, don't change it ====


class ZeRO2Adam(BucketedShardedAdam):
    """Adam with ZeRO stage 2 over a process group: 1/N of the gradients and states per rank.

    Every rank builds it with the same parameters (same order, same shapes) *before* backward:
    the constructor registers a post-accumulate-grad hook on every trainable parameter. During
    backward the hooks send the fixed buckets ``self.buckets`` (``labkit.buckets.plan_buckets``:
    positions into ``self.params``, in reverse order, up to ``bucket_cap_bytes`` each) in order,
    each as soon as its gradients are ready: one reduce-scatter (``async_op=True``), the full
    gradients in it set to None, and the previous bucket's reduce-scatter waited for and its
    output added into ``grad_shard`` and ``present`` (at most one in flight). At the end of each
    backward the buckets not sent yet are sent (given, ``_end_of_backward``). ``step()`` waits
    for the one in flight, averages over the ranks, runs ``torch.optim.Adam`` (``self.optim``,
    over this rank's pieces: each parameter skipped and counted as Adam would) and all-gathers the
    updated parameters. Several backward passes before one ``step()`` add up, as ``.grad`` would;
    inside ``with opt.no_sync():`` a backward only accumulates ``.grad`` locally.

    Memory after backward: ``grad_shard`` (4Ψ/N bytes) + the bucket in flight (its input and
    this rank's output).

    Given (``labkit.sharding.BucketedShardedAdam``: the constructor, ``state``, ``zero_grad``,
    ``remove``, ``no_sync()``, ``_end_of_backward``) and used by the exercise:
        params, index (parameter → position), layout (``offsets``, ``shard_size`` S, ``rank``,
            ``world_size``), pieces (one tensor per ``layout.pieces`` entry: a view of the fp32
            master slice ``master`` for 16-bit parameters, else of the parameter),
            ``local_slice()`` (the slice as one (S,) tensor), optim (``torch.optim.Adam`` over
            the pieces).
        grad_shard: (S,) in ``master_dtype`` — the sum over ranks of this rank's slice of the
            gradient, as received so far (zeros after ``step()``).
        present: (P,) — per parameter, the presence counts received so far (zeros after step()).
        buckets, ready (positions ready in this backward), next_bucket (whose turn it is),
            in_flight (``(work, output buffer, [(start_in_shard, length)], [positions])`` or
            None), backward_end (``arm()`` it in every hook).
        state: ``"exp_avg"``, ``"exp_avg_sq"`` ((S,) each: Adam's states of the pieces are views
            of them) and ``"master"`` (the slice) for 16-bit parameters.

    An optimizer: it never touches the model's buffers (DDP broadcasts rank 0's before each
    forward): each rank keeps the BatchNorm running statistics of its own batches.

    Args:
        params: the model's parameters (a list, or parameter groups with their own lr, betas,
            eps, weight_decay; frozen ones are skipped); one floating dtype and one device for
            the trainable ones.
        lr, betas, eps, weight_decay: as ``torch.optim.Adam`` (refused where it refuses them).
        bucket_cap_bytes: int > 0, bytes of gradients per bucket (in ``master_dtype``: fp32 for
            fp32 and 16-bit parameters, fp64 for fp64 ones).
        group: the data-parallel process group (None: the default group).
    """

    # ==== exercise 4.3: your code ====

    def _register_hooks(self) -> None:
        """Register ``self._on_grad_ready`` as a post-accumulate-grad hook on every parameter of
        ``self.params``; keep the handles in ``self.handles``."""
        raise NotImplementedError("exercise 4.3: register self._on_grad_ready on every trainable parameter (keep the handles) (labs/04_gradients.ipynb)")

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Called by autograd once ``param.grad`` is complete: mark it ready, then send every
        bucket whose turn has come and whose parameters are all ready (``self._send_bucket()``)."""
        if not self.require_sync:
            return  # inside no_sync(): the gradient only adds up in .grad
        self.backward_end.arm()  # _end_of_backward runs when this backward ends
        raise NotImplementedError("exercise 4.3: mark the parameter ready; while the bucket whose turn it is has all its parameters ready, send it (labs/04_gradients.ipynb)")

    def _send_bucket(self) -> None:
        """Start one asynchronous reduce-scatter of bucket ``self.next_bucket`` (in
        ``master_dtype``): input i holds the pieces of the bucket's gradients that rank i owns
        (``owned_pieces``), in bucket order, then one presence count per parameter of the bucket
        (1 where this rank has its ``.grad``; a missing gradient's pieces are zeros); set the
        bucket's ``.grad`` to None; then finish the reduce-scatter sent before
        (``self._finish_in_flight()``), keep the new one in ``self.in_flight`` and move on to the
        next bucket."""
        raise NotImplementedError("exercise 4.3: one async reduce-scatter of the bucket's pieces (and presence counts) per owner rank, free the full gradients, finish the previous one, keep this one in flight, next bucket (labs/04_gradients.ipynb)")

    def _finish_in_flight(self) -> None:
        """Wait for the reduce-scatter in flight, if any, add its pieces into ``grad_shard`` at
        the places they stand for and its presence counts into ``present``, and forget it
        (``self.in_flight = None``)."""
        raise NotImplementedError("exercise 4.3: wait for the one in flight and add its pieces into grad_shard, its counts into present (labs/04_gradients.ipynb)")

    @torch.no_grad()
    def step(self, closure=None):
        """Finish the reduce-scatter in flight; average ``grad_shard`` over the ranks; give each
        piece its slice of it (None for a parameter no rank had a gradient for: Adam skips it);
        step ``self.optim``; all-gather the updated slices (in the parameters' dtype) into the
        parameters; zero ``grad_shard`` and ``present``. ``closure`` (optional, given) runs
        first, as for ``torch.optim``; its loss is returned."""
        loss = run_closure(closure)
        self.check_trainable()  # given: refuses a parameter unfrozen since construction
        raise NotImplementedError("exercise 4.3: finish, average the shard, hand the pieces their gradients, Adam, all-gather the parameters, reset the shard and the counts (labs/04_gradients.ipynb)")
        return loss
