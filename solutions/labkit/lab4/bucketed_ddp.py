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

import contextlib
import functools

import torch
import torch.distributed as dist

from labkit.buckets import BackwardEnd, pack_bucket, plan_buckets, unpack_bucket
from labkit.flat_params import master_dtype
from labkit.validate import positive_int

# ==== given: the course's code — read it, call it, don't change it ====


class BucketedDDP(torch.nn.Module):
    """Wrap ``module`` for data parallelism over a process group, with bucketed overlap.

    Contract:
        * At construction every parameter is replaced by the value of the group's first rank
          (a broadcast; in a subgroup, ``dist.broadcast``'s ``src`` is that rank's global
          number), and a post-accumulate-grad hook ``self._on_grad_ready`` is registered on each
          parameter that requires a gradient (handles kept in ``self.handles``; frozen ones are skipped).
        * ``self.buckets`` (given, ``labkit.buckets.plan_buckets``): fixed lists of positions
          into ``self.params``, the same on every rank: the parameters in reverse order, a
          bucket closing when its bytes (in ``self.reduce_dtype``) reach ``bucket_cap_bytes``.
        * During backward, bucket k is sent once all its parameters are ready and buckets
          0..k−1 have been sent: one asynchronous all-reduce (``async_op=True``) of
          ``labkit.buckets.pack_bucket(...)`` (its gradients as one flat tensor in
          ``self.reduce_dtype`` plus one presence count per parameter), from inside the hook of
          the gradient that makes it sendable. At the end of each backward the buckets not sent
          yet are sent, in order (given: ``_end_of_backward``), so every rank sends every bucket
          once per backward.
        * ``finish()``, called after backward and before the optimizer step, waits for every
          all-reduce and leaves in each ``.grad`` the average over the ranks, a rank that had no
          gradient for it counting as zeros, and None where no rank had one: what
          ``DistributedDataParallel(find_unused_parameters=True)`` leaves.
        * ``self.buckets_sent`` counts the all-reduces started since the last ``finish()``.
        * Inside ``with ddp.no_sync():`` backward only accumulates ``.grad`` locally; the next
          backward outside it sends the sums (DDP's ``no_sync``).

    Args:
        module: the model; the same architecture on every rank.
        bucket_cap_bytes: int > 0, bytes of gradients per bucket, counted in ``reduce_dtype``
            (fp32 for fp32 and 16-bit parameters, fp64 for fp64 ones); DDP's default is
            ``torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB`` = 25 MiB.
        group: the process group (None: the default group).
    """

    def __init__(self, module: torch.nn.Module, *, bucket_cap_bytes: int = 25 * 2**20, group=None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        bucket_cap_bytes = positive_int("bucket_cap_bytes", bucket_cap_bytes)
        self.module = module
        self.bucket_cap_bytes, self.group = bucket_cap_bytes, group
        self.world_size = dist.get_world_size(group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.reduce_dtype = functools.reduce(
            torch.promote_types, {master_dtype(p.dtype, name="parameters' dtype") for p in self.params},
            torch.float32)
        self.buckets = plan_buckets([p.numel() for p in self.params], self.reduce_dtype.itemsize,
                                    bucket_cap_bytes)
        self.index = {id(p): i for i, p in enumerate(self.params)}  # parameter -> position
        self.ready: set[int] = set()  # positions whose gradient is ready in this backward
        self.next_bucket = 0  # the bucket whose turn it is
        self.in_flight: list[tuple] = []  # (work, flat buffer, [params])
        self.buckets_sent = 0
        self.require_sync = True
        self.backward_end = BackwardEnd(self._end_of_backward)
        self.handles = []
        self._setup()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate ``.grad`` locally (as DDP's ``no_sync``)."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _end_of_backward(self) -> None:
        """Run by autograd when a backward ends: send the buckets not sent yet, in order; the
        next backward starts with nothing ready."""
        while self.next_bucket < len(self.buckets):
            self._send_bucket()
        self.ready.clear()
        self.next_bucket = 0

    # ==== exercise 4.2: your code ====

    def _setup(self) -> None:
        """Make every replica start from the group's first rank's parameters; hook every
        parameter of ``self.params``."""
        module, group = self.module, self.group
        # BEGIN SOLUTION 4.2: make every replica start from the group's first rank's parameters, then hook every trainable parameter
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        for p in self.params:
            self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        # END SOLUTION

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Autograd calls this once ``param.grad`` is complete: mark it ready, then send every
        bucket whose turn has come and whose parameters are all ready (``_send_bucket``)."""
        if not self.require_sync:
            return  # inside no_sync(): the gradient only adds up in .grad
        self.backward_end.arm()  # _end_of_backward runs when this backward ends
        # BEGIN SOLUTION 4.2: mark the parameter ready; while the bucket whose turn it is has all its parameters ready, send it
        self.ready.add(self.index[id(param)])
        while (self.next_bucket < len(self.buckets)
               and all(i in self.ready for i in self.buckets[self.next_bucket])):
            self._send_bucket()
        # END SOLUTION

    def _send_bucket(self) -> None:
        """Start the asynchronous all-reduce of bucket ``self.next_bucket`` and move on to the next."""
        # BEGIN SOLUTION 4.2: pack the bucket's gradients and presence counts into one tensor, start its all-reduce asynchronously, remember it, count it, move to the next bucket
        params = [self.params[i] for i in self.buckets[self.next_bucket]]
        flat = pack_bucket(params, self.reduce_dtype)
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.in_flight.append((work, flat, params))
        self.buckets_sent += 1
        self.next_bucket += 1
        # END SOLUTION

    @torch.no_grad()
    def finish(self) -> None:
        """After backward: wait for every all-reduce, write the averages into .grad (None where
        no rank had a gradient)."""
        # BEGIN SOLUTION 4.2: wait for every all-reduce, copy each average back into its .grad (None where no rank had one), reset in_flight and buckets_sent
        for work, flat, params in self.in_flight:
            work.wait()
            for p, total in unpack_bucket(flat, params):
                p.grad = None if total is None else (total / self.world_size).to(p.dtype)
        self.in_flight = []
        self.buckets_sent = 0
        # END SOLUTION
