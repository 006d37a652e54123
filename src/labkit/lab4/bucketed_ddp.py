"""Data parallelism that sends gradients while backward is still computing them (a minimal DDP).

Backward produces gradients from the last layer to the first. Waiting for the whole backward
before all-reducing leaves the network idle during compute and the GPU idle during the
all-reduce. PyTorch's DistributedDataParallel (Li et al. 2020, arXiv 2006.15704) instead
groups the gradients into buckets of about ``bucket_cap_mb`` in the order they become ready, and
starts an asynchronous all-reduce as soon as a bucket is full, so communication of the late
layers overlaps the backward of the early ones. Small buckets start sending sooner but pay a
per-call latency many times; one bucket of everything cannot overlap at all.

This module keeps only the mechanism: parameters broadcast from rank 0 at the start (every
replica begins equal), buckets fixed once and sent in the same order on every rank (a
collective is matched by its place in each rank's sequence: ``labkit.buckets``), a
post-accumulate-grad hook per parameter, ``async_op=True`` all-reduces, and ``finish()`` that
waits for all of them and writes the averages back into ``.grad`` before the optimizer step. A
parameter that one rank's backward did not reach (conditional computation) is sent as zeros
with a presence count of 0, so the ranks still send the same buckets and the result is what
``DistributedDataParallel(find_unused_parameters=True)`` gives.

Chapter 4 (book/04_gradients.md); Lab 4, exercise 4.2 (labs/04_gradients.ipynb).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.buckets import BucketedModule, pack_bucket, unpack_bucket

# ==== given: the course's code — read it, call it, don't change it ====


class BucketedDDP(BucketedModule):
    """Wrap ``module`` for data parallelism over a process group, with bucketed overlap.

    Given (``labkit.buckets.BucketedModule``): the checks, ``self.module``, ``self.params`` (the
    trainable parameters), ``self.group``, ``self.world_size``, ``self.reduce_dtype`` (fp32; fp64
    for fp64 parameters), ``forward``, ``no_sync()``, and the fixed buckets ``self.buckets``
    (lists of positions into ``self.params``, the same on every rank: the parameters in reverse
    order, a bucket closing when its bytes in ``reduce_dtype`` reach ``bucket_cap_bytes``), with
    ``self.index`` (id(parameter) → position), ``self.ready`` (positions ready in this
    backward), ``self.next_bucket`` (whose turn it is), ``self.in_flight``,
    ``self.buckets_sent``, ``self.handles``; ``_end_of_backward`` (autograd runs it when a
    backward ends) sends the buckets not sent yet, in order.

    Contract:
        * At construction every parameter is replaced by the value of the group's first rank
          (a broadcast; in a subgroup, ``dist.broadcast``'s ``src`` is that rank's global
          number), and a post-accumulate-grad hook ``self._on_grad_ready`` is registered on each
          parameter that requires a gradient (handles kept in ``self.handles``).
        * During backward, bucket k is sent once all its parameters are ready and buckets
          0..k−1 have been sent: one asynchronous all-reduce (``async_op=True``) of
          ``labkit.buckets.pack_bucket(...)`` (its gradients as one flat tensor in
          ``self.reduce_dtype`` plus one presence count per parameter), from inside the hook of
          the gradient that makes it sendable; so every rank sends every bucket once per
          backward, in the same order.
        * ``finish()``, called after backward and before the optimizer step, waits for every
          all-reduce and leaves in each ``.grad`` the average over the ranks, a rank that had no
          gradient for it counting as zeros, and None where no rank had one: what
          ``DistributedDataParallel(find_unused_parameters=True)`` leaves.
        * ``self.buckets_sent`` counts the all-reduces started since the last ``finish()``.

    Buffers (BatchNorm's running statistics) are not broadcast, neither at construction nor
    before each forward as ``DistributedDataParallel(broadcast_buffers=True)`` does: each rank
    keeps those of its own batches (broadcast them yourself, or use SyncBatchNorm).

    Args:
        module: the model; the same architecture on every rank.
        bucket_cap_bytes: int > 0, bytes of gradients per bucket, counted in ``reduce_dtype``;
            DDP's default is ``torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB`` = 25 MiB.
        group: the process group (None: the default group).
    """

    # ==== exercise 4.2: your code ====

    def _setup(self) -> None:
        """Make every replica start from the group's first rank's parameters; hook every
        parameter of ``self.params``."""
        module, group = self.module, self.group
        raise NotImplementedError("exercise 4.2: make every replica start from the group's first rank's parameters, then hook every trainable parameter (labs/04_gradients.ipynb)")

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Autograd calls this once ``param.grad`` is complete: mark it ready, then send every
        bucket whose turn has come and whose parameters are all ready (``_send_bucket``)."""
        if not self.require_sync:
            return  # inside no_sync(): the gradient only adds up in .grad
        self.backward_end.arm()  # _end_of_backward runs when this backward ends
        raise NotImplementedError("exercise 4.2: mark the parameter ready; while the bucket whose turn it is has all its parameters ready, send it (labs/04_gradients.ipynb)")

    def _send_bucket(self) -> None:
        """Start the asynchronous all-reduce of bucket ``self.next_bucket`` and move on to the next."""
        raise NotImplementedError("exercise 4.2: pack the bucket's gradients and presence counts into one tensor, start its all-reduce asynchronously, remember it, count it, move to the next bucket (labs/04_gradients.ipynb)")

    @torch.no_grad()
    def finish(self) -> None:
        """After backward: wait for every all-reduce, write the averages into .grad (None where
        no rank had a gradient)."""
        raise NotImplementedError("exercise 4.2: wait for every all-reduce, copy each average back into its .grad (None where no rank had one), reset in_flight and buckets_sent (labs/04_gradients.ipynb)")
