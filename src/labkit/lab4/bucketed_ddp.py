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

import torch
import torch.distributed as dist

from labkit.validate import positive_int

# ==== given: the course's code — read it, call it, don't change it ====


class BucketedDDP(torch.nn.Module):
    """Wrap ``module`` for data parallelism over a process group, with bucketed overlap.

    Contract:
        * At construction every parameter is replaced by the value of the group's first rank
          (a broadcast; in a subgroup, ``dist.broadcast``'s ``src`` is that rank's global
          number), and a post-accumulate-grad hook ``self._on_grad_ready`` is registered on each
          parameter that requires a gradient (handles kept in ``self.handles``; frozen ones are skipped).
        * During backward, gradients join the current bucket in the order they become ready;
          a bucket whose fp32 bytes reach ``bucket_cap_bytes`` starts one asynchronous
          all-reduce (``async_op=True``) of its gradients at once, as one flat fp32 tensor, from
          inside the hook of the gradient that brought it to the cap (not one gradient later).
        * ``finish()``, called after backward and before the optimizer step, sends the last
          bucket, waits for every all-reduce, and leaves in each ``.grad`` the average over the
          ranks (what ``DistributedDataParallel`` leaves).
        * ``self.buckets_sent`` counts the all-reduces started since the last ``finish()``.

    Args:
        module: the model; the same architecture on every rank.
        bucket_cap_bytes: int > 0, fp32 bytes of gradients per bucket (DDP's default,
            ``torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB`` = 25 MiB).
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
        self.bucket: list[torch.nn.Parameter] = []
        self.bucket_bytes = 0
        self.in_flight: list[tuple] = []  # (work, flat buffer, [params])
        self.buckets_sent = 0
        self.handles = []
        self._setup()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ==== exercise 4.2: your code ====

    def _setup(self) -> None:
        """Make every replica start from the group's first rank's parameters; hook every
        parameter of ``self.params``."""
        module, group = self.module, self.group
        raise NotImplementedError("exercise 4.2: make every replica start from the group's first rank's parameters, then hook every trainable parameter (labs/04_gradients.ipynb)")

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Autograd calls this once ``param.grad`` is complete."""
        raise NotImplementedError("exercise 4.2: add the parameter to the bucket; once the bucket reaches the cap, start its all-reduce without waiting (labs/04_gradients.ipynb)")

    def _send_bucket(self) -> None:
        """Start the asynchronous all-reduce of the current bucket (nothing if it is empty)."""
        raise NotImplementedError("exercise 4.2: flatten the bucket's gradients (fp32) into one tensor, start its all-reduce asynchronously, remember it, empty the bucket (labs/04_gradients.ipynb)")

    @torch.no_grad()
    def finish(self) -> None:
        """After backward: send the last bucket, wait for all, write the averages into .grad."""
        raise NotImplementedError("exercise 4.2: send what is left, wait for every all-reduce, copy each average back into its .grad (labs/04_gradients.ipynb)")
