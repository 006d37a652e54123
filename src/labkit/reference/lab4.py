"""Lab 4's references: PyTorch's own data parallelism, Adam and PowerSGD hook, run on the ranks.

Each function runs inside one rank of ``labkit.ranks.launch`` (the harness calls it next to the
student's code, on the same process group and batches) and returns plain data:

- :func:`ddp_backward`: one backward of ``DistributedDataParallel`` — the parameters it leaves
  after wrapping (the group's first rank's) and the averaged gradients (4.1, 4.2);
- :func:`ddp_adam_steps`: DDP + ``torch.optim.Adam``, several backward passes per step allowed
  (DDP all-reduces each and ``.grad`` adds them up), with Adam's state after every step and the
  ``.grad`` bytes alive during backward (4.3);
- :func:`master_adam_steps`: the plain mixed-precision computation for 16-bit parameters: the
  gradients summed over the ranks in fp32, ``torch.optim.Adam`` on an fp32 master copy, the
  parameters rounded from it (4.3 with bf16);
- :func:`ddp_sgd_steps`: DDP + SGD with an optional communication hook, for the training curves
  of 4.4 (the hook is the caller's; without one it is DDP's own all-reduce);
- :func:`torch_powersgd_steps`: DDP with PyTorch's ``powerSGD_hook`` (4.5).

:func:`pair_groups` makes the subgroups the graders run in (a 4-rank world split in two).
Nothing here imports a lab package (tests/test_layout.py): no edit of a student's file can move
a reference value.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from labkit.comm_count import count_comm
from labkit.validate import positive_int

__all__ = ["grad_bytes", "pair_groups", "ddp_backward", "ddp_adam_steps",
           "master_adam_steps", "ddp_sgd_steps", "torch_powersgd_steps"]


def grad_bytes(params) -> int:
    """Bytes of the ``.grad`` tensors of ``params`` that exist right now (each storage once)."""
    seen = {}
    for p in params:
        if p.grad is not None:
            st = p.grad.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def pair_groups(rank: int, world_size: int, group_size: int | None):
    """Split the world into consecutive groups of ``group_size`` ranks and return this rank's
    ``(group, ranks)``; ``group_size`` None: ``(None, all ranks)`` (the default group).

    Every rank creates every group, in the same order (``dist.new_group`` requires it)."""
    if group_size is None:
        return None, list(range(world_size))
    group_size = positive_int("group_size", group_size)
    if world_size % group_size:
        raise ValueError(f"group_size {group_size} does not divide world_size {world_size}")
    mine = None
    for start in range(0, world_size, group_size):
        ranks = list(range(start, start + group_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group, ranks
    return mine


def _loss(model, batch, loss_fn):
    x, y = batch
    return model(x, y) if loss_fn is None else loss_fn(model(x), y)


def ddp_backward(model: torch.nn.Module, batch, *, group=None) -> dict:
    """Wrap a copy of ``model`` in ``DistributedDataParallel`` over ``group``, run one forward
    and backward of ``model(x, y)`` on ``batch``; return ``{"params"`` (right after wrapping),
    ``"grads"`` (averaged), ``"calls"``, ``"bytes"`` (of the backward, ``count_comm``)``}``."""
    replica = copy.deepcopy(model)
    ddp = DistributedDataParallel(replica, process_group=group)
    params = [p.detach().clone() for p in replica.parameters()]
    with count_comm() as counts:
        _loss(ddp, batch, None).backward()
    return {"params": params,
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in replica.parameters()],
            "calls": dict(counts.calls), "bytes": dict(counts.bytes_sent)}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def ddp_adam_steps(model: torch.nn.Module, steps, *, lr: float, group=None) -> dict:
    """Train a copy of ``model`` with DDP over ``group`` + ``torch.optim.Adam`` (default betas
    and eps). ``steps[s]`` is the list of this rank's ``(x, y)`` micro-batches of step s: one
    backward each (DDP all-reduces each; ``.grad`` adds them), then one ``step()``.

    Returns ``{"params", "losses"`` (per step, the last micro-batch's), ``"exp_avg"``,
    ``"exp_avg_sq"`` (per step, flat fp32 over the trainable parameters in order),
    ``"peak_grad_bytes"`` (most ``.grad`` bytes alive during the backward passes and before the
    step), ``"timeline"`` (the ``.grad`` bytes alive after each gradient-ready event of the first
    step)``}``."""
    replica = copy.deepcopy(model)
    ddp = DistributedDataParallel(replica, process_group=group)
    params = [p for p in replica.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    peak, timeline = [0], []

    def record(_p):
        timeline.append(grad_bytes(params))
        peak[0] = max(peak[0], timeline[-1])

    handles = [p.register_post_accumulate_grad_hook(record) for p in params]
    losses, exp_avg, exp_avg_sq, first = [], [], [], None
    for micro in steps:
        for batch in micro:
            loss = _loss(ddp, batch, None)
            loss.backward()
        first = list(timeline) if first is None else first
        peak[0] = max(peak[0], grad_bytes(params))  # DDP writes the averages after the hooks
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        exp_avg.append(_flat(opt.state[p]["exp_avg"] for p in params))
        exp_avg_sq.append(_flat(opt.state[p]["exp_avg_sq"] for p in params))
    for h in handles:
        h.remove()
    return {"params": [p.detach().clone() for p in replica.parameters()], "losses": losses,
            "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "peak_grad_bytes": peak[0],
            "timeline": first}


def master_adam_steps(model: torch.nn.Module, steps, *, lr: float, group=None) -> dict:
    """The plain mixed-precision data-parallel Adam for a 16-bit ``model``: per step, the
    backward passes of ``steps[s]`` (this rank's micro-batches), the gradients upcast to fp32,
    summed over ``group`` (one all-reduce) and divided by its size; ``torch.optim.Adam`` on an
    fp32 master copy of the parameters; the parameters rounded from the master.

    Returns ``{"params"`` (16-bit), ``"master"`` (flat fp32), ``"exp_avg"``, ``"exp_avg_sq"``
    (per step, flat fp32)``}``."""
    replica = copy.deepcopy(model)
    params = [p for p in replica.parameters() if p.requires_grad]
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.Adam(master, lr=lr)
    world = dist.get_world_size(group)
    exp_avg, exp_avg_sq = [], []
    for micro in steps:
        for batch in micro:
            _loss(replica, batch, None).backward()
        flat = _flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in params)
        dist.all_reduce(flat, group=group)
        flat /= world
        offset = 0
        for m in master:
            m.grad = flat[offset:offset + m.numel()].view_as(m).clone()
            offset += m.numel()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
                p.grad = None
        exp_avg.append(_flat(opt.state[m]["exp_avg"] for m in master))
        exp_avg_sq.append(_flat(opt.state[m]["exp_avg_sq"] for m in master))
    return {"params": [p.detach().clone() for p in replica.parameters()], "master": _flat(master),
            "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def ddp_sgd_steps(model: torch.nn.Module, steps, *, lr: float, hook=None, hook_state=None,
                  eval_batch=None, group=None) -> dict:
    """Train a copy of ``model`` (its loss is ``model(x, y)``) with DDP over ``group`` (one
    bucket) and SGD; with ``hook``, ``ddp.register_comm_hook(hook_state, hook)`` on the fresh
    DDP (a hook state keeps no state before DDP's bucket rebuild: its ``start_iter``).
    ``steps[s]`` is this rank's ``(x, y)`` of step s.

    Returns ``{"losses"`` (the mean over the group's ranks, per step), ``"eval"`` (the loss on
    ``eval_batch`` after training, or None), ``"bytes"``, ``"ring_bytes"`` (what this rank sent
    in the last step's backward, per collective)``}``."""
    ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1024, process_group=group)
    if hook is not None:
        ddp.register_comm_hook(hook_state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    world = dist.get_world_size(group)
    losses, sent = [], ({}, {})
    for x, y in steps:
        with count_comm() as counts:
            loss = ddp(x, y)
            loss.backward()
        sent = dict(counts.bytes_sent), dict(counts.ring_bytes)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(float(mean) / world)
    final = None
    if eval_batch is not None:
        with torch.no_grad():
            final = float(ddp.module(*eval_batch))
    return {"losses": losses, "eval": final, "bytes": sent[0], "ring_bytes": sent[1]}


def torch_powersgd_steps(model: torch.nn.Module, steps, *, r: int, seed: int = 0,
                         loss_fn=None, group=None, errors: list | None = None) -> list[dict]:
    """A fresh DDP (one bucket, over ``group``) with PyTorch's ``powerSGD_hook`` at rank ``r``:
    error feedback and warm start on, ``min_compression_rate=1`` (a matrix is compressed when
    its factors are smaller), ``start_powerSGD_iter=2`` (its smallest: iterations 0 and 1 are
    plain all-reduces, across DDP's bucket rebuild), the starting Q drawn from ``seed``.
    ``steps[s]`` is this rank's ``(x, y)``; the loss is ``model(x, y)``, or ``loss_fn(model(x),
    y)``. Returns per step the gradients (parameter name → tensor); ``errors`` (a list)
    receives per step a copy of the hook's ``error_dict`` (bucket index → the error it keeps for
    the next step)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ref

    ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1024, process_group=group)
    state = ref.PowerSGDState(group, matrix_approximation_rank=r, start_powerSGD_iter=2,
                              min_compression_rate=1, use_error_feedback=True, warm_start=True,
                              random_seed=seed)
    ddp.register_comm_hook(state, ref.powerSGD_hook)
    out = []
    for batch in steps:
        _loss(ddp, batch, loss_fn).backward()
        out.append({n: p.grad.clone() for n, p in ddp.module.named_parameters()})
        if errors is not None:
            errors.append({i: e.clone() for i, e in state.error_dict.items()})
        ddp.zero_grad(set_to_none=True)
    return out
