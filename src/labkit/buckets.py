"""Gradient buckets that every rank sends in the same order, whatever its backward did.

A collective is matched across ranks by its place in each rank's sequence: the k-th call of one
rank meets the k-th call of the others, which must have the same kind and size (gloo aborts
the process otherwise: "Is there a distributed collective mismatch?"). Buckets filled in the
order gradients become ready are therefore only safe while every rank's backward produces its
gradients in the same order. A rank whose model skipped a branch (a parameter used on some
ranks only, conditional computation) would fill other buckets, or never fill one.

So, as ``DistributedDataParallel`` does:

* the buckets are fixed once, the same on every rank (:func:`plan_buckets`): the trainable
  parameters in reverse order (roughly the order backward produces their gradients), cut when a
  bucket's bytes reach the cap;
* bucket k is sent only after buckets 0..k−1, as soon as all its parameters are ready;
* at the end of every backward (:class:`BackwardEnd`: a callback autograd runs once the whole
  backward is done) the buckets not sent yet are sent, in order, a parameter that got no
  gradient on this rank counting as zeros; so every rank sends every bucket once per backward.

What "no gradient" means is settled over the ranks by *presence counts* sent with the gradients:
one number per parameter, 1 on a rank where it has a gradient; the sum says how many ranks had
one. A parameter no rank had a gradient for is left without one, as
``DistributedDataParallel(find_unused_parameters=True)`` leaves it (and Adam then skips it).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.autograd import Variable

from labkit.flat_params import master_dtype
from labkit.validate import positive_int, process_group

__all__ = ["plan_buckets", "BackwardEnd", "pack_bucket", "unpack_bucket", "BucketSchedule",
           "BucketedModule"]


def plan_buckets(numels, element_size: int, cap_bytes: int) -> list[list[int]]:
    """The fixed buckets: positions into ``numels`` (the trainable parameters' sizes, in the
    model's order), taken in reverse order; a bucket closes when its bytes
    (``element_size`` per element) reach ``cap_bytes``. DDP's first assignment works the same
    way (it later reorders once, after the first iteration)."""
    cap_bytes = positive_int("bucket_cap_bytes", cap_bytes)
    buckets, filling, size = [], [], 0
    for i in reversed(range(len(numels))):
        filling.append(i)
        size += element_size * numels[i]
        if size >= cap_bytes:
            buckets.append(filling)
            filling, size = [], 0
    return buckets + ([filling] if filling else [])


class BackwardEnd:
    """Run ``fn`` once at the end of every backward in which :meth:`arm` was called (from a
    gradient hook): autograd's final callback (``queue_callback``), which runs after every
    gradient of that backward has been computed and accumulated — what DDP and FSDP use to
    finish their reductions."""

    def __init__(self, fn):
        self.fn, self.armed = fn, False

    def arm(self) -> None:
        """Make sure ``fn`` runs when the current backward ends (once, however often called)."""
        if not self.armed:
            self.armed = True
            Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.armed = False
        self.fn()


def pack_bucket(params, dtype: torch.dtype) -> torch.Tensor:
    """One flat tensor for a bucket: every gradient of ``params`` flattened in order (zeros for a
    parameter whose ``.grad`` is None), then one presence count per parameter (1 where it has a
    ``.grad``), in ``dtype``."""
    params = list(params)
    device = params[0].device
    grads = [p.grad.detach().reshape(-1).to(dtype) if p.grad is not None
             else torch.zeros(p.numel(), dtype=dtype, device=device) for p in params]
    counts = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=device)
    return torch.cat(grads + [counts])


def unpack_bucket(flat: torch.Tensor, params) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Undo :func:`pack_bucket` after a reduction: per parameter ``(param, its part of flat
    viewed in its shape)``, or ``(param, None)`` where the presence count is 0 (no rank had a
    gradient)."""
    params = list(params)
    counts = flat[flat.numel() - len(params):]
    out, offset = [], 0
    for p, count in zip(params, counts.tolist()):
        piece = flat[offset:offset + p.numel()].view(p.shape)
        out.append((p, piece if count > 0 else None))
        offset += p.numel()
    return out


class BucketSchedule:
    """The given half of a bucketed reduction, shared by ``BucketedDDP`` (Lab 4, exercise 4.2)
    and ``ZeRO2Adam`` (4.3): the fixed buckets, which parameters are ready in this backward,
    whose turn it is, ``no_sync()`` and the end-of-backward flush. The subclass writes
    ``_send_bucket()`` (send bucket ``next_bucket``, then move ``next_bucket`` on) and calls
    ``self.backward_end.arm()`` from its gradient hooks.

    Attributes (set by :meth:`_plan_buckets`): ``buckets`` (lists of positions into the
    trainable parameters), ``index`` (id(parameter) → its position), ``ready`` (positions ready
    in this backward), ``next_bucket``, ``require_sync`` (False inside ``no_sync()``),
    ``backward_end`` (a :class:`BackwardEnd` running ``_end_of_backward``), ``had_grad``
    (positions that have had a gradient on this rank: those ``zero_grad(set_to_none=False)``
    leaves a zero gradient, as ``torch.optim`` does).
    """

    def _plan_buckets(self, params, element_size: int, cap_bytes: int) -> None:
        self.buckets = plan_buckets([p.numel() for p in params], element_size, cap_bytes)
        self.index = {id(p): i for i, p in enumerate(params)}
        self.ready: set[int] = set()
        self.next_bucket = 0
        self.require_sync = True
        self.backward_end = BackwardEnd(self._end_of_backward)
        self.had_grad: set[int] = set()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate ``.grad`` locally (as DDP's ``no_sync``); the
        next backward outside sends the sums."""
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
        self.had_grad |= self.ready
        self.ready.clear()
        self.next_bucket = 0

    def _send_bucket(self) -> None:
        raise NotImplementedError  # pragma: no cover - the exercise


class BucketedModule(BucketSchedule, torch.nn.Module):
    """The given half of ``BucketedDDP`` (4.2): wraps ``module``, checks the arguments, plans the
    buckets in ``reduce_dtype`` (``labkit.flat_params.master_dtype`` of the parameters: fp32 for
    fp32 and 16-bit ones, fp64 for fp64), and calls the subclass's ``_setup()``.

    Attributes: ``module``, ``bucket_cap_bytes``, ``group``, ``world_size``, ``params`` (the
    trainable parameters), ``reduce_dtype``, ``in_flight`` (``(work, flat buffer, [params])``
    of the all-reduces started), ``buckets_sent``, ``handles``, and :class:`BucketSchedule`'s.
    """

    def __init__(self, module: torch.nn.Module, *, bucket_cap_bytes: int = 25 * 2**20, group=None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        bucket_cap_bytes = positive_int("bucket_cap_bytes", bucket_cap_bytes)
        process_group("group", group)
        self.module = module
        self.bucket_cap_bytes, self.group = bucket_cap_bytes, group
        self.world_size = dist.get_world_size(group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.reduce_dtype = functools.reduce(
            torch.promote_types,
            {master_dtype(p.dtype, name="parameters' dtype") for p in self.params}, torch.float32)
        self._plan_buckets(self.params, self.reduce_dtype.itemsize, bucket_cap_bytes)
        self.in_flight: list[tuple] = []
        self.buckets_sent = 0
        self.handles = []
        self._setup()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _setup(self) -> None:
        raise NotImplementedError  # pragma: no cover - the exercise

