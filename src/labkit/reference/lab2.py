"""Lab 2's references: data-parallel training with PyTorch's own optimizers, run on real ranks.

The graders of ZeRO-1 (exercise 2.5) compare a student's ``ZeRO1`` with two runs nobody in this
course wrote: ``DistributedDataParallel`` + the unsharded optimizer (every rank keeps every
state), and ``torch.distributed.optim.ZeroRedundancyOptimizer`` (whole tensors per rank, after
an all-reduce of the gradients). Both are driven by the same training loop as the student's run
(``run_steps``), which ``labkit.harness.lab2`` reuses, so the comparison differs only in the
optimizer.

Imports no lab package (tests/test_layout.py checks it): no edit of a student's file can move a
value a grade is decided against.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit import validate
from labkit.comm_count import CommCounts, count_comm
from labkit.optimizer_states import state_bytes

REFERENCE_OPTIMIZERS = ("ddp", "zero_redundancy")


def named_groups(model: torch.nn.Module, groups, frozen) -> list:
    """Freeze the parameters named in ``frozen`` and build ``torch.optim``'s ``params`` from
    ``groups`` (dicts whose "params" are parameter *names*); the parameters no group names form a
    last group with the defaults. ``groups=None``: the model's parameters, one group."""
    names = dict(model.named_parameters())
    for name in frozen:
        if name not in names:
            raise ValueError(f"frozen names an unknown parameter {name!r}; known: {sorted(names)}")
        names[name].requires_grad_(False)
    if groups is None:
        return list(model.parameters())
    out, used = [], set()
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"groups[{i}] must be a dict with 'params' (parameter names)")
        for name in g["params"]:
            if name not in names:
                raise ValueError(f"groups[{i}] names an unknown parameter {name!r}")
        used.update(g["params"])
        out.append({**g, "params": [names[n] for n in g["params"]]})
    rest = [p for n, p in model.named_parameters() if n not in used]
    if rest:
        out.append({"params": rest})
    return out


def check_run_args(world_size: int, batches, *, optimizer_class, lr, dtype) -> list:
    """The checks every data-parallel run makes before it starts (so a bad argument fails on
    every rank before any collective); returns ``batches`` as a list."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    validate.non_negative_number("lr", lr)
    batches = list(batches)
    for s, step_batches in enumerate(batches):
        if len(step_batches) < world_size:
            raise ValueError(f"batches[{s}] has {len(step_batches)} entries, need one per rank "
                             f"({world_size})")
    return batches


def run_steps(runner, opt, batches, rank: int, *, trainable=(), average_over=None,
              before_step=None) -> tuple[list[float], CommCounts]:
    """The training loop: per step forward (``runner(x, y)`` is the loss), backward, optionally an
    all-reduce + average of the ``trainable`` gradients over ``average_over`` ranks (what DDP
    does, for an optimizer that does not), ``before_step(step)``, ``opt.step()``, ``zero_grad``.
    Returns the losses and the collectives counted over the steps."""
    losses, comm = [], CommCounts()
    for s, step_batches in enumerate(batches):
        x, y = step_batches[rank]
        with count_comm() as counts:
            loss = runner(x, y)
            loss.backward()
            if average_over is not None:
                for p in trainable:
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad.div_(average_over)
            if before_step is not None:
                before_step(s)
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        for name in ("calls", "bytes_sent", "ring_bytes"):
            getattr(comm, name).update(getattr(counts, name))
    return losses, comm


def state_shapes(optimizer: torch.optim.Optimizer) -> dict:
    """{state name: (elements summed over the parameters, dtype)} of an optimizer's tensors."""
    shapes: dict = {}
    for s in optimizer.state.values():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                n, _ = shapes.get(k, (0, None))
                shapes[k] = (n + v.numel(), str(v.dtype))
    return shapes


def result_of(model, losses, comm, opt, *, numel_owned: int, inner, extra_state=None) -> dict:
    """The dict a data-parallel run returns (see ``train_reference``)."""
    state = state_shapes(inner)
    state.update(extra_state or {})
    return {"params": [p.detach().clone() for p in model.parameters()], "losses": losses,
            "state_bytes": state_bytes(opt), "shard_state": {}, "state": state,
            "numel_owned": numel_owned,
            "comm": {"calls": dict(comm.calls), "bytes_sent": dict(comm.bytes_sent),
                     "ring_bytes": dict(comm.ring_bytes)}}


def train_reference(rank: int, world_size: int, model: torch.nn.Module, batches, *,
                    optimizer: str = "ddp", optimizer_class=torch.optim.Adam, lr: float = 1e-3,
                    dtype=None, groups=None, frozen=(), **options) -> dict:
    """Train ``model`` data-parallel with PyTorch's own machinery; run by ``labkit.ranks.launch``.

    ``optimizer="ddp"``: ``DistributedDataParallel`` + ``optimizer_class`` unsharded;
    ``"zero_redundancy"``: ``ZeroRedundancyOptimizer`` around ``optimizer_class`` (whole tensors
    per rank), the gradients all-reduced and averaged first, as DDP does. ``batches[step][rank]``
    is this rank's ``(x, y)``; ``dtype`` casts the model first; ``groups`` (by parameter name) and
    ``frozen`` as in ``named_groups``; ``lr`` and ``**options`` go to ``optimizer_class``.

    Returns ``{"params", "losses", "state_bytes", "state": {name: (numel, dtype)},
    "shard_state": {}, "numel_owned", "comm": {"calls", "bytes_sent", "ring_bytes"}}``.
    """
    validate.one_of("optimizer", optimizer, REFERENCE_OPTIMIZERS)
    batches = check_run_args(world_size, batches, optimizer_class=optimizer_class, lr=lr, dtype=dtype)
    if dtype is not None:
        model = model.to(dtype)
    params = named_groups(model, groups, frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        runner = DistributedDataParallel(model)
        opt = optimizer_class(params, lr=lr, **options)
        losses, comm = run_steps(runner, opt, batches, rank)
        return result_of(model, losses, comm, opt, inner=opt,
                         numel_owned=sum(p.numel() for p in trainable))
    from torch.distributed.optim import ZeroRedundancyOptimizer  # seconds to import: do it in the parent first

    if groups is not None:
        raise ValueError("groups: ZeroRedundancyOptimizer takes one group here (use zero1 or ddp)")
    opt = ZeroRedundancyOptimizer(trainable, optimizer_class=optimizer_class, lr=lr, **options)
    losses, comm = run_steps(model, opt, batches, rank, trainable=trainable, average_over=world_size)
    local = [p for g in opt.optim.param_groups for p in g["params"]]
    return result_of(model, losses, comm, opt, inner=opt.optim,
                     numel_owned=sum(p.numel() for p in local))
