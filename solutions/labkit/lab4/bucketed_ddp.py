"""Data parallelism that sends gradients while backward is still computing them (a minimal DDP).

Backward produces gradients from the last layer to the first. Waiting for the whole backward
before all-reducing leaves the network idle during compute and the GPU idle during the
all-reduce. PyTorch's DistributedDataParallel (Li et al. 2020, arXiv 2006.15704) instead
groups the gradients into buckets of about ``bucket_cap_mb`` in the order they become ready, and
starts an asynchronous all-reduce as soon as a bucket is full, so communication of the late
layers overlaps the backward of the early ones. Small buckets start sending sooner but pay a
per-call latency many times; one bucket of everything cannot overlap at all.

This module keeps only the mechanism: parameters broadcast from rank 0 at the start (every
replica begins equal), a post-accumulate-grad hook per parameter, a byte cap per bucket,
``async_op=True`` all-reduces, and ``finish()`` that waits for all of them and writes the
averages back into ``.grad`` before the optimizer step.

Chapter 4 (book/04_gradients.md); Lab 4, exercise 4.2 (labs/04_gradients.ipynb).
"""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.comm_count import count_comm


class BucketedDDP(torch.nn.Module):
    """Wrap ``module`` for data parallelism over a process group, with bucketed overlap.

    Contract:
        * At construction every parameter is replaced by rank 0's value (a broadcast), and a
          post-accumulate-grad hook ``self._on_grad_ready`` is registered on each parameter
          that requires a gradient (handles kept in ``self.handles``).
        * During backward, gradients join the current bucket in the order they become ready;
          a bucket whose fp32 bytes reach ``bucket_cap_bytes`` starts one asynchronous
          all-reduce (``async_op=True``) of its gradients at once, as one flat tensor.
        * ``finish()``, called after backward and before the optimizer step, sends the last
          bucket, waits for every all-reduce, and leaves in each ``.grad`` the average over the
          ranks (what ``DistributedDataParallel`` leaves).
        * ``self.buckets_sent`` counts the all-reduces started since the last ``finish()``.

    Args:
        module: the model; the same architecture on every rank.
        bucket_cap_bytes: int > 0, fp32 bytes of gradients per bucket.
        group: the process group (None: the default group).
    """

    def __init__(self, module: torch.nn.Module, *, bucket_cap_bytes: int = 25 * 2**20, group=None):
        super().__init__()
        if not isinstance(bucket_cap_bytes, int) or isinstance(bucket_cap_bytes, bool) \
                or bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes must be an int > 0, got {bucket_cap_bytes!r}")
        self.module = module
        self.bucket_cap_bytes, self.group = bucket_cap_bytes, group
        self.world_size = dist.get_world_size(group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.bucket: list[torch.nn.Parameter] = []
        self.bucket_bytes = 0
        self.in_flight: list[tuple] = []  # (work, flat buffer, [params])
        self.buckets_sent = 0
        self.handles = []
        # BEGIN SOLUTION 4.2: make every replica start from rank 0's parameters, then hook every parameter
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        for p in self.params:
            self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        # END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Autograd calls this once ``param.grad`` is complete."""
        # BEGIN SOLUTION 4.2: add the parameter to the bucket; once the bucket reaches the cap, start its all-reduce without waiting
        self.bucket.append(param)
        self.bucket_bytes += 4 * param.numel()
        if self.bucket_bytes >= self.bucket_cap_bytes:
            self._send_bucket()
        # END SOLUTION

    def _send_bucket(self) -> None:
        """Start the asynchronous all-reduce of the current bucket (nothing if it is empty)."""
        # BEGIN SOLUTION 4.2: flatten the bucket's gradients (fp32) into one tensor, start its all-reduce asynchronously, remember it, empty the bucket
        if not self.bucket:
            return
        flat = torch.cat([p.grad.detach().reshape(-1).float() if p.grad is not None
                          else torch.zeros(p.numel(), device=p.device) for p in self.bucket])
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.in_flight.append((work, flat, self.bucket))
        self.buckets_sent += 1
        self.bucket, self.bucket_bytes = [], 0
        # END SOLUTION

    @torch.no_grad()
    def finish(self) -> None:
        """After backward: send the last bucket, wait for all, write the averages into .grad."""
        # BEGIN SOLUTION 4.2: send what is left, wait for every all-reduce, copy each average back into its .grad
        self._send_bucket()
        for work, flat, params in self.in_flight:
            work.wait()
            flat /= self.world_size
            offset = 0
            for p in params:
                piece = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)
                offset += p.numel()
        self.in_flight = []
        self.buckets_sent = 0
        # END SOLUTION


# ---------------------------------------------------------------- per-rank worker (infrastructure)

class EventLog(TorchDispatchMode):
    """Records, in order, every all-reduce operator called on this thread, next to the
    gradient-ready events that a probe hook appends: ``(kind, detail, perf_counter())``."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("allreduce_", "allreduce_coalesced_"):
            nbytes = sum(t.numel() * t.element_size() for t in args[0])
            self.events.append(("all_reduce", str(nbytes), time.perf_counter()))
        return func(*args, **(kwargs or {}))


def compare_with_ddp(rank: int, world_size: int, model: torch.nn.Module, batches, *,
                     bucket_cap_bytes: int) -> dict:
    """One backward with ``BucketedDDP`` and one with ``DistributedDataParallel`` (same start:
    rank r's copy is first perturbed by r, so only the broadcast makes them equal).

    Returns ``{"grads", "ref_grads", "params", "ref_params" (after wrapping), "events":
    [(kind, detail, seconds from the start of backward)], "calls", "bytes_sent" (backward +
    finish), "init_bytes" (construction), "n_buckets"}``.
    """
    from torch.nn.parallel import DistributedDataParallel

    x, y = batches[rank]
    start = copy.deepcopy(model)
    with torch.no_grad():
        for p in start.parameters():
            p.add_(0.01 * rank)  # replicas differ until the broadcast
    mine = copy.deepcopy(start)
    with count_comm() as init_counts:
        ddp = BucketedDDP(mine, bucket_cap_bytes=bucket_cap_bytes)
    log = EventLog()
    names = {p: n for n, p in mine.named_parameters()}
    for p in ddp.params:  # registered after BucketedDDP's hooks: runs after them
        p.register_post_accumulate_grad_hook(
            lambda p: log.events.append(("grad", names[p], time.perf_counter())))
    loss = ddp(x, y)
    with count_comm() as counts, log:
        t0 = time.perf_counter()
        loss.backward()
        log.events.append(("backward_end", "", time.perf_counter()))
        n_buckets = ddp.buckets_sent + (1 if ddp.bucket else 0)
        ddp.finish()
        log.events.append(("finish_end", "", time.perf_counter()))
    ref_model = copy.deepcopy(start)
    ref = DistributedDataParallel(ref_model)
    ref(x, y).backward()
    return {"grads": [p.grad.clone() for p in mine.parameters()],
            "ref_grads": [p.grad.clone() for p in ref_model.parameters()],
            "params": [p.detach().clone() for p in mine.parameters()],
            "ref_params": [p.detach().clone() for p in ref_model.parameters()],
            "events": [(k, d, t - t0) for k, d, t in log.events],
            "calls": dict(counts.calls), "bytes_sent": dict(counts.bytes_sent),
            "init_bytes": dict(init_counts.bytes_sent), "n_buckets": n_buckets}
