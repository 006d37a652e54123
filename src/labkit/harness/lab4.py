"""Lab 4's harnesses: per-rank functions that run the student's code next to the references.

Each function runs inside one rank of ``labkit.ranks.launch``, builds the student's object from
``labkit.lab4``, runs it beside the matching run of ``labkit.reference.lab4`` on the same process
group and batches, and returns plain data for a grader, the lab or ``labkit.cluster``:

- :func:`accumulate_with_ddp` (4.1): ``accumulate_gradients`` on a ``DistributedDataParallel``;
- :func:`compare_with_ddp` (4.2): ``BucketedDDP`` beside DDP, with the order of gradient-ready
  events and collectives;
- :func:`train_zero2` (4.3): ``ZeRO2Adam`` beside DDP + Adam (or the fp32-master computation for
  16-bit parameters), with the gradient bytes alive during and after backward;
- :func:`hook_worker`, :func:`train_worker` (4.4): ``compression_hook`` inside DDP;
- :func:`compare_with_torch` (4.5): ``powersgd_hook`` beside PyTorch's ``powerSGD_hook``.

``group_size`` (where accepted) splits the world into consecutive groups of that many ranks and
runs everything inside this rank's group (``labkit.reference.lab4.pair_groups``).

:class:`EventLog` records, in order, the collectives this thread issues (with their bytes and
whether they were issued asynchronously, read from the c10d operator's ``async_op`` argument)
next to the gradient-ready events a probe hook appends: exact facts, not wall time.
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.comm_count import count_comm
from labkit.tracker import Tracker
from labkit.reference.lab4 import (
    ddp_adam_steps, ddp_backward, ddp_sgd_steps, grad_bytes, master_adam_steps, pair_groups,
    torch_powersgd_steps)

__all__ = ["EventLog", "accumulate_with_ddp", "compare_with_ddp", "train_zero2", "hook_worker",
           "train_worker", "compare_with_torch"]

# c10d operator -> (kind, index of its async_op argument); the Python API omits the argument
# when it is True (the default) and passes False for a blocking call.
_COLLECTIVES = {"allreduce_": ("all_reduce", 4), "allreduce_coalesced_": ("all_reduce", 4),
                "reduce_scatter_": ("reduce_scatter", 4),
                "_reduce_scatter_base_": ("reduce_scatter", 4),
                "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 4)}


def _nbytes(arg) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    return sum(_nbytes(a) for a in arg)


class EventLog(TorchDispatchMode):
    """Records ``(kind, detail, async)`` events in order: every all-reduce and reduce-scatter
    issued on this thread (``detail`` = bytes of its input, ``async`` = issued with
    ``async_op=True``), and whatever :meth:`note` appends (gradient-ready events, ends of
    phases; ``async`` None)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, object, bool | None]] = []

    def note(self, kind: str, detail: object = "") -> None:
        self.events.append((kind, detail, None))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in _COLLECTIVES:
            kind, at = _COLLECTIVES[name]
            data = args[1] if kind == "reduce_scatter" else args[0]  # the inputs
            is_async = bool(args[at]) if len(args) > at else bool((kwargs or {}).get("async_op", True))
            self.events.append((kind, _nbytes(data), is_async))
        return func(*args, **(kwargs or {}))


def _probe(log: EventLog, model: torch.nn.Module) -> list:
    """Register, after the student's hooks, a post-accumulate-grad hook per trainable parameter
    that notes ("grad", parameter name); returns the handles."""
    names = {p: n for n, p in model.named_parameters()}
    return [p.register_post_accumulate_grad_hook(lambda p: log.note("grad", names[p]))
            for p in model.parameters() if p.requires_grad]


def _micro_batches(item) -> list:
    """A step's batch for one rank: one ``(x, y)`` or a list of ``(x, y)`` micro-batches."""
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor):
        return [tuple(item)]
    return [tuple(b) for b in item]


# ---------------------------------------------------------------- 4.1 gradient accumulation

def accumulate_with_ddp(rank: int, world_size: int, model: torch.nn.Module, batches, ks, *,
                        weight: str = "tokens") -> dict:
    """For each k in ``ks``: ``accumulate_gradients(DDP(copy of model), x, y, k)`` on this
    rank's ``batches[rank]`` under ``count_comm``; and once DDP's own full-batch backward.

    Returns ``{k: {"grads", "calls", "bytes"}, "ddp": labkit.reference.lab4.ddp_backward(...)}``."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    x, y = batches[rank]
    out = {"ddp": ddp_backward(model, (x, y))}
    for k in ks:
        replica = copy.deepcopy(model)
        ddp = DistributedDataParallel(replica)
        with count_comm() as counts:
            accumulate_gradients(ddp, x, y, k, weight=weight)
        out[k] = {"grads": [None if p.grad is None else p.grad.detach().clone()
                            for p in replica.parameters()],
                  "calls": dict(counts.calls), "bytes": dict(counts.bytes_sent)}
    return out


# ---------------------------------------------------------------- 4.2 bucketed DDP

def compare_with_ddp(rank: int, world_size: int, model: torch.nn.Module, batches, *,
                     bucket_cap_bytes: int, group_size: int | None = None,
                     iterations: int = 2) -> dict:
    """``BucketedDDP`` for ``iterations`` backward + ``finish()`` on this rank's ``batches[rank]``,
    and one backward of ``DistributedDataParallel`` (same start: each rank's copy is first
    perturbed by its rank, so only the broadcast makes them equal), in this rank's group.

    Returns ``{"grads"`` (after the last finish), ``"ref_grads"``, ``"params"``, ``"ref_params"``
    (after wrapping), ``"events"`` (per iteration: the EventLog of backward, then
    ("backward_end",), then finish's, then ("finish_end",)), ``"sent_before_finish"`` (per
    iteration: ``buckets_sent`` right before ``finish()``), ``"sent_after_finish"``,
    ``"held_after_finish"`` (per iteration: ``len(in_flight)`` after ``finish()``), ``"calls"``,
    ``"bytes_sent"`` (per iteration, backward + finish), ``"init_bytes"``
    (construction), ``"ranks"`` (of this rank's group)``}``."""
    from labkit.lab4.bucketed_ddp import BucketedDDP

    group, ranks = pair_groups(rank, world_size, group_size)
    x, y = batches[rank]
    start = copy.deepcopy(model)
    with torch.no_grad():
        for p in start.parameters():
            p.add_(0.01 * rank)  # replicas differ until the broadcast
    mine = copy.deepcopy(start)
    with count_comm() as init_counts:
        ddp = BucketedDDP(mine, bucket_cap_bytes=bucket_cap_bytes, group=group)
    params = [p.detach().clone() for p in mine.parameters()]
    log = EventLog()
    _probe(log, mine)
    events, before, after, held, calls, sent = [], [], [], [], [], []
    for _ in range(iterations):
        for p in mine.parameters():
            p.grad = None
        loss = ddp(x, y)
        log.events = []
        with count_comm() as counts, log:
            loss.backward()
            log.note("backward_end")
            before.append(ddp.buckets_sent)
            ddp.finish()
            log.note("finish_end")
        after.append(ddp.buckets_sent)
        held.append(len(ddp.in_flight))
        events.append(list(log.events))
        calls.append(dict(counts.calls))
        sent.append(dict(counts.bytes_sent))
    ref = ddp_backward(start, (x, y), group=group)
    return {"grads": [None if p.grad is None else p.grad.clone() for p in mine.parameters()],
            "ref_grads": ref["grads"], "params": params, "ref_params": ref["params"],
            "events": events, "sent_before_finish": before, "sent_after_finish": after,
            "held_after_finish": held,
            "calls": calls, "bytes_sent": sent, "init_bytes": dict(init_counts.bytes_sent),
            "ranks": ranks}


# ---------------------------------------------------------------- 4.3 ZeRO-2

def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def train_zero2(rank: int, world_size: int, model: torch.nn.Module, batches, *, lr: float = 1e-3,
                bucket_cap_bytes: int = 25 * 2**20, reference: bool = True, probe: bool = True,
                group_size: int | None = None) -> dict:
    """Train a copy of ``model`` with ``ZeRO2Adam`` on this rank's batches; with ``reference``,
    train another copy the reference way on the same group and batches: DDP +
    ``torch.optim.Adam`` for fp32 parameters, the fp32-master computation for 16-bit ones.

    ``batches[step][rank]`` is this rank's ``(x, y)``, or a list of ``(x, y)`` micro-batches
    (one backward each before the step). The first step runs under PyTorch's ``MemTracker``
    (from the optimizer's construction) and an :class:`EventLog`; a probe hook, registered
    after the optimizer's, records the ``.grad`` bytes alive after every gradient-ready event.

    Returns ``{"params", "losses", "comm"`` (per step: calls, bytes_sent), ``"peak_grad_bytes"``
    (most ``.grad`` bytes alive during the backward passes), ``"held_after_backward"`` (bytes
    of every tensor MemTracker sees alive after the first step's backward passes, the
    parameters and Adam's states excluded: the gradient shard, the full gradients, buffers in
    flight),
    ``"shard_bytes"``, ``"shard_size"``, ``"largest_grad_bytes"``, ``"timeline"``, ``"events"``
    (the first step's backward: collectives and ("grad", name)), ``"exp_avg"``,
    ``"exp_avg_sq"`` (per step, this rank's (S,) slice), ``"shard_left"`` (per step, the largest
    |entry| of ``grad_shard`` right after ``step()``, before ``zero_grad()``), ``"master"`` (or None), ``"rank"``
    (in the group), ``"ranks"``; with ``reference``: ``"ref"`` = the reference's result}``."""
    from labkit.lab4.zero2 import ZeRO2Adam

    group, ranks = pair_groups(rank, world_size, group_size)
    zmodel = copy.deepcopy(model)
    params = [p for p in zmodel.parameters() if p.requires_grad]
    tracker = Tracker()  # MemTracker that accepts frozen parameters (labkit.measure)
    with tracker:
        opt = ZeRO2Adam(list(zmodel.parameters()), lr=lr, bucket_cap_bytes=bucket_cap_bytes,
                        group=group)
    peak, timeline = [0], []

    def record(_p):
        b = grad_bytes(params)
        peak[0] = max(peak[0], b)
        timeline.append(b)

    log = EventLog()
    if probe:
        for p in params:
            p.register_post_accumulate_grad_hook(record)
        _probe(log, zmodel)
    losses, comm, exp_avg, exp_avg_sq, held, shard_left = [], [], [], [], None, []
    # MemTracker warns about every parameter whose .grad is None (ZeRO-2 sets them so): noise here
    warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass",
                            category=UserWarning)
    for i, step_batches in enumerate(batches):
        micro = _micro_batches(step_batches[rank])
        with count_comm() as counts:
            if i == 0:
                with tracker, log:
                    for x, y in micro:
                        tracker.reset_mod_stats()  # it refuses a module's second forward otherwise
                        loss = zmodel(x, y)
                        loss.backward()
                    snap = tracker.get_tracker_snapshot("current")
                    total = sum(entry.get("Total", 0) for entry in snap.values())
                    held = total - _storage_bytes([*opt.state.values(), *zmodel.parameters()])
                first_timeline, events = list(timeline), list(log.events)
            else:
                for x, y in micro:
                    loss = zmodel(x, y)
                    loss.backward()
            opt.step()
        shard_left.append(float(opt.grad_shard.abs().max()))  # the contract: zeros after step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        comm.append({"calls": dict(counts.calls), "bytes_sent": dict(counts.bytes_sent)})
        exp_avg.append(opt.state["exp_avg"].clone())
        exp_avg_sq.append(opt.state["exp_avg_sq"].clone())
    out = {"params": [p.detach().clone() for p in zmodel.parameters()], "losses": losses,
           "comm": comm, "peak_grad_bytes": peak[0], "held_after_backward": held,
           "shard_bytes": opt.grad_shard.numel() * opt.grad_shard.element_size(),
           "shard_size": opt.shard_size,
           "largest_grad_bytes": max(4 * p.numel() for p in params),
           "timeline": first_timeline if probe else [], "events": events if probe else [],
           "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "shard_left": shard_left,
           "master": opt.state["master"].clone() if "master" in opt.state else None,
           "rank": dist.get_rank(group), "ranks": ranks}
    opt.remove()
    if reference:
        steps = [_micro_batches(s[rank]) for s in batches]
        if params[0].dtype == torch.float32:
            out["ref"] = ddp_adam_steps(model, steps, lr=lr, group=group)
        else:
            out["ref"] = master_adam_steps(model, steps, lr=lr, group=group)
    return out


# ---------------------------------------------------------------- 4.4 compression

def _recording_hook(rec, bucket):
    """Run ``compression_hook`` and log its input buffer, output, kept error and communication."""
    from labkit.lab4.compression import compression_hook

    state, log = rec
    before = bucket.buffer().detach().clone()
    iteration = state.iteration
    with count_comm() as counts:
        fut = compression_hook(state, bucket)

    def record(f):
        out = f.value()
        out = out[0] if isinstance(out, (list, tuple)) else out
        err = state.error.get(bucket.index())
        log.append({"bucket": bucket.index(), "input": before, "output": out.detach().clone(),
                    "error": None if err is None else err.detach().clone(),
                    "bytes": dict(counts.bytes_sent), "calls": dict(counts.calls),
                    "iteration": iteration})
        return out

    return fut.then(record)


def hook_worker(rank: int, world_size: int, model, batches, configs: dict, *,
                group_size: int | None = None):
    """Per entry of ``configs`` (label → ``CompressionState`` keyword arguments), a fresh DDP of
    a copy of ``model`` (one bucket, over this rank's group) with ``compression_hook`` registered
    at once; returns ``{label: log}`` (and ``"ranks"``: this rank's group).

    ``batches[s][rank]`` is this rank's (x, y) at step s; the loss is the mean squared error of
    ``model(x)`` and ``y``; no update between steps (only the gradients matter). One log entry
    per call of the hook: the buffer before it (``input``), the buffer it returned
    (``output``), ``state.error`` of the bucket after it (``error``, or None), the bytes and
    calls per collective that ``labkit.comm_count.count_comm`` counted during the call, and
    ``iteration`` (from 0; the hook compresses from ``state.start_iter``, 2 by default: the
    iterations before are DDP's plain all-reduce, across its bucket rebuild).
    """
    from labkit.lab4.compression import CompressionState

    group, ranks = pair_groups(rank, world_size, group_size)
    mse = torch.nn.functional.mse_loss
    out = {"ranks": ranks}
    for label, kwargs in configs.items():
        ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1024, process_group=group)
        log: list[dict] = []
        ddp.register_comm_hook((CompressionState(**kwargs, process_group=group), log),
                               _recording_hook)
        for step in batches:
            x, y = step[rank]
            mse(ddp(x), y).backward()
            ddp.zero_grad(set_to_none=True)
        out[label] = log
    return out


def train_worker(rank: int, world_size: int, model, batches, runs: dict, *, lr: float,
                 eval_batch=None):
    """Train copies of the course's GPT with DDP + SGD, one per entry of ``runs``.

    ``runs`` maps a label to None (DDP's own uncompressed all-reduce: the reference) or to the
    keyword arguments of a ``CompressionState`` (``compression_hook``). ``batches[s][rank]`` is
    this rank's (x, y) at step s, the same for every run; every run starts from ``model``.
    Returns, per label, ``labkit.reference.lab4.ddp_sgd_steps``'s result."""
    from labkit.lab4.compression import CompressionState, compression_hook

    steps = [s[rank] for s in batches]
    out = {}
    for label, kwargs in runs.items():
        hook = None if kwargs is None else compression_hook
        state = None if kwargs is None else CompressionState(**kwargs)
        out[label] = ddp_sgd_steps(model, steps, lr=lr, hook=hook, hook_state=state,
                                   eval_batch=eval_batch)
    return out


# ---------------------------------------------------------------- 4.5 PowerSGD

def compare_with_torch(rank: int, world_size: int, model, batches, r: int, seed: int = 0,
                       model_computes_loss: bool = False, group_size: int | None = None):
    """DDP + ``powersgd_hook`` next to DDP + PyTorch's hook (``labkit.reference.lab4
    .torch_powersgd_steps``), in this rank's group.

    Both wrap copies of ``model`` in a fresh DDP (one bucket) with the hook registered at once,
    the same seed, and start compressing at the same iteration (``start_iter`` /
    ``start_powerSGD_iter`` = 2: iterations 0 and 1 are plain all-reduces, across DDP's bucket
    rebuild). The loss is ``model(x, y)`` if ``model_computes_loss`` (the
    course's GPT), else the mean squared error of ``model(x)`` and ``y``; ``batches[s][rank]`` is
    this rank's (x, y) at step s. Returns, per step, both models' gradients (name → tensor),
    both hooks' kept errors (``"error"``: ours and torch's, bucket index → tensor), the
    communication of the step with ``powersgd_hook`` (calls and bytes of all-reduce, as
    ``count_comm`` counts them) and whether it compressed (``"compressed"``).
    """
    from labkit.lab4.powersgd import PowerSGDState, powersgd_hook

    group, _ = pair_groups(rank, world_size, group_size)
    loss_fn = None if model_computes_loss else torch.nn.functional.mse_loss
    steps = [s[rank] for s in batches]
    their_errors: list[dict] = []
    theirs = torch_powersgd_steps(model, steps, r=r, seed=seed, loss_fn=loss_fn, group=group,
                                  errors=their_errors)
    ours = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1024, process_group=group)
    state = PowerSGDState(r, group, seed=seed)
    ours.register_comm_hook(state, powersgd_hook)
    out = []
    for batch, want, their_error in zip(steps, theirs, their_errors):
        with count_comm() as counts:
            x, y = batch
            (ours(x, y) if loss_fn is None else loss_fn(ours(x), y)).backward()
        out.append({"ours": {n: p.grad.clone() for n, p in ours.module.named_parameters()},
                    "torch": want, "error": {"ours": {i: e.clone() for i, e in state.error.items()},
                                             "torch": their_error},
                    "calls": counts.calls["all_reduce"], "bytes": counts.bytes_sent["all_reduce"],
                    "compressed": state.iteration > state.start_iter})
        ours.zero_grad(set_to_none=True)
    return out
