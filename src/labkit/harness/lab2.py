"""Lab 2's harnesses: the runs that drive a student's lab-2 code for the graders, the lab and
``labkit.cluster``.

* ``train_data_parallel``: one rank's data-parallel training with the student's ``ZeRO1``
  (exercise 2.5), or with PyTorch's references (``labkit.reference.lab2``), through one loop;
* ``lomo_step`` and ``offload_step``: training steps for ``labkit.measure.measure_step`` with
  LOMO (2.4) or ZeRO-Offload (2.6) attached;
* ``memory_by_location``: where ZeRO-Offload's bytes live, counted from the tensors themselves.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from labkit import validate
from labkit.lab2.zero1 import ZeRO1
from labkit.lab2.zero_offload import ZeROOffload
from labkit.optimizer_states import state_tensors
from labkit.reference import lab2 as reference

OPTIMIZERS = ("zero1",) + reference.REFERENCE_OPTIMIZERS


def _contiguous_groups(world_size: int, n_groups: int):
    """Split the world into ``n_groups`` equal groups of consecutive ranks; every rank creates
    every group (``dist.new_group`` is collective) and gets back its own."""
    n_groups = validate.positive_int("dp_groups", n_groups)
    if world_size % n_groups:
        raise ValueError(f"dp_groups must divide the world size {world_size}, got {n_groups}")
    size = world_size // n_groups
    mine = None
    for g in range(n_groups):
        ranks = list(range(g * size, (g + 1) * size))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def train_data_parallel(rank: int, world_size: int, model: torch.nn.Module, batches, *,
                        optimizer: str = "zero1", optimizer_class=torch.optim.Adam,
                        lr: float = 1e-3, dtype=None, groups=None, frozen=(), dp_groups: int = 1,
                        drop_grads=(), **options) -> dict:
    """Train ``model`` on this rank's batches, data-parallel; run by ``labkit.ranks.launch``.

    Args:
        model: the same initial model on every rank (a GPT: ``model(x, y)`` is the loss).
        batches: ``batches[step][rank]`` is this rank's ``(x, y)`` at that step (global rank).
        optimizer: ``"zero1"`` (the student's ``ZeRO1`` around ``optimizer_class``), or one of
            the references of ``labkit.reference.lab2.train_reference``: ``"ddp"``,
            ``"zero_redundancy"``.
        optimizer_class: a ``torch.optim.Optimizer`` subclass; ``lr`` and ``**options`` go to it.
        dtype: a floating ``torch.dtype`` to cast the model to first (e.g. torch.bfloat16), or None.
        groups: parameter groups by name, e.g. ``[{"params": ["wte.weight"], "lr": 1e-2}]``; the
            parameters not named form a last group with the defaults. None: one group.
        frozen: names of parameters to freeze (``requires_grad=False``).
        dp_groups (zero1): split the world into this many groups of consecutive ranks, each a
            data-parallel group of its own (ZeRO-1 inside a subgroup, as lab 7 runs it).
        drop_grads (zero1): ``(step, name, ranks)``: that parameter's ``.grad`` is set to None
            after backward at that step on those global ranks (None: every rank) — a parameter
            the step did not use there.

    Returns:
        ``{"params": [tensors], "losses": [floats], "state_bytes": this rank's optimizer
        state bytes, "state": {name: (numel, dtype)}, "shard_state": {name: (S,) tensor} (zero1),
        "shard_size" (zero1), "numel_owned": parameters this rank updates, "comm": {"calls",
        "bytes_sent", "ring_bytes"} of the steps (backward + optimizer step)}``.
    """
    validate.one_of("optimizer", optimizer, OPTIMIZERS)
    if optimizer != "zero1":
        if dp_groups != 1 or drop_grads:
            raise ValueError("dp_groups and drop_grads apply to optimizer='zero1' only")
        return reference.train_reference(rank, world_size, model, batches, optimizer=optimizer,
                                         optimizer_class=optimizer_class, lr=lr, dtype=dtype,
                                         groups=groups, frozen=frozen, **options)
    batches = reference.check_run_args(world_size, batches, optimizer_class=optimizer_class,
                                       lr=lr, dtype=dtype)
    names = dict(model.named_parameters())
    for step, name, _ in drop_grads:
        if name not in names:
            raise ValueError(f"drop_grads names an unknown parameter {name!r}")
    group = _contiguous_groups(world_size, dp_groups) if dp_groups != 1 else None
    if dtype is not None:
        model = model.to(dtype)
    names = dict(model.named_parameters())
    opt = ZeRO1(reference.named_groups(model, groups, frozen), optimizer_class, group=group,
                lr=lr, **options)

    def before_step(step: int) -> None:
        for s, name, ranks in drop_grads:
            if s == step and (ranks is None or rank in ranks):
                names[name].grad = None

    losses, comm = reference.run_steps(model, opt, batches, rank, before_step=before_step)
    extra = {"master": (opt.master.numel(), str(opt.master.dtype))} if opt.master is not None else {}
    result = reference.result_of(model, losses, comm, opt, inner=opt.optim, extra_state=extra,
                                 numel_owned=min(opt.shard_size,
                                                 max(0, opt.numel - opt.rank * opt.shard_size)))
    result["shard_state"] = {k: v.clone() for k, v in opt.shard_state().items()}
    result["shard_size"] = opt.shard_size
    return result


def lomo_step(model: torch.nn.Module, optimizer, batch) -> torch.Tensor:
    """A training step for ``labkit.measure.measure_step`` when LOMO is attached: forward and
    backward only (backward is the update). ``optimizer`` is ignored (pass None).

    MemTracker's own post-accumulate-grad hook runs after LOMO's and finds ``.grad`` already
    freed; its warning about that None is silenced here.
    """
    x, y = batch
    loss = model(x, y)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper")
        loss.backward()
    return loss.detach()


def offload_step(model: torch.nn.Module, optimizer, batch, *, offload: ZeROOffload) -> torch.Tensor:
    """One training step with ZeRO-Offload, for ``labkit.measure.measure_step`` (bind
    ``offload`` with ``functools.partial``; pass ``offload.optim`` as the optimizer so that
    MemTracker sees its state). MemTracker's own post-accumulate-grad hook runs after the
    offloader's and finds ``.grad`` released; its warning about that is silenced."""
    x, y = batch
    loss = model(x, y)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper")
        loss.backward()
    offload.step()
    return loss.detach()


def memory_by_location(offload: ZeROOffload) -> dict[str, dict[str, int]]:
    """Bytes by location and consumer, counted from the tensors themselves (each storage once).

    Returns ``{"device": {...}, "host": {...}}`` with keys "parameters", "gradients",
    "optimizer states". The device holds the model's parameters and any ``.grad`` left on them;
    the host the master weights and the optimizer's state ("optimizer states"), the gradient
    buffers and any gradient left on a master weight ("gradients"). On CUDA a tensor's location is its ``.device``. On a CPU, where both
    are the same memory, a tensor is on the host only if its storage is not also a parameter's
    or a device gradient's (a "host" buffer that *is* the device gradient is counted on the
    device: nothing left it); otherwise by who holds it.
    """
    if not isinstance(offload, ZeROOffload):
        raise TypeError(f"offload must be a ZeROOffload, got {type(offload).__name__}")
    out = {where: dict.fromkeys(("parameters", "gradients", "optimizer states"), 0)
           for where in ("device", "host")}
    seen: set = set()

    def key(t: torch.Tensor):
        return (str(t.device), t.untyped_storage().data_ptr())

    device_side = [(p, "parameters") for p in offload.params]
    device_side += [(p.grad, "gradients") for p in offload.params if p.grad is not None]
    device_keys = {key(t) for t, _ in device_side}

    def add(t: torch.Tensor, where: str, consumer: str) -> None:
        if key(t) in seen:
            return
        seen.add(key(t))
        if offload.device.type != "cpu":
            where = "device" if t.device == offload.device else "host"
        elif key(t) in device_keys:
            where = "device"
        out[where][consumer] += t.untyped_storage().nbytes()

    for t, consumer in device_side:
        add(t, "device", consumer)
    for t in list(offload.master) + state_tensors(offload.optim):
        add(t, "host", "optimizer states")
    for g in offload.host_grads:
        add(g, "host", "gradients")
    for m in offload.master:  # an fp32 gradient the host step made and kept
        if m.grad is not None:
            add(m.grad, "host", "gradients")
    return out
