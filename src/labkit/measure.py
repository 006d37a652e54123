"""Measure where the memory of a training step goes, and what it costs in FLOPs.

Built on PyTorch's own ``MemTracker`` (``torch.distributed._tools.mem_tracker``), which sees
every tensor storage that an operator creates, tags it by what it is for (parameter, gradient,
optimizer state, activation, temporary) and frees it from the books when the storage dies.  It
works the same on CPU and CUDA (on CUDA it rounds each storage up to the allocator's 512-byte
blocks), so the labs measure on a laptop exactly what the chapters explain.

    step = measure_step(model, optimizer, batch)     # one real step: forward, backward, update
    step.peak, step.at_peak["activations"], step.timeline

Consumers, in the book's vocabulary: ``CONSUMERS``.  MemTracker calls every tensor created in
forward an "activation" (kept for backward or not) and every tensor created in backward a
"temporary"; gradients are the ``.grad`` tensors.  On CUDA ``measure_step`` also reads
``torch.cuda.max_memory_allocated`` and can write a snapshot for pytorch.org/memory_viz; on a CPU
that counter silently reads 0, so it is never used there.  On a GPU, the optimizers' ``step``
counters stay in host memory (a CPU tensor per parameter tensor); ``measure_step`` counts them
with the optimizer states all the same (``StepMemory.host_state_bytes`` says how many), so the
labs' "optimizer states" are the same bytes on both devices.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.consumers import CONSUMERS, PHASES, TimelinePoint, _device_entry, by_consumer


@dataclass
class StepMemory:
    """What one measured training step held, by consumer."""

    peak: int
    """Largest total bytes tracked at any moment of the step(s)."""
    at_peak: dict[str, int]
    """Bytes per consumer at that moment."""
    timeline: list[TimelinePoint]
    """Bytes per consumer after each operator, in order."""
    before: dict[str, int]
    """Bytes per consumer when measuring started (parameters and any existing state)."""
    after: dict[str, int]
    """Bytes per consumer when the step(s) finished."""
    step_boundaries: list[int] = field(default_factory=list)
    """Timeline index at which each step started."""
    losses: list[float] = field(default_factory=list)
    cuda_max_allocated: int | None = None
    """``torch.cuda.max_memory_allocated`` over the step(s); None on a CPU."""
    host_state_bytes: int = 0
    """Of ``at_peak["optimizer states"]`` (and so of ``peak``), the bytes held in host memory:
    on a GPU run, Adam's and Adafactor's ``step`` counters live on the CPU (4 B per parameter
    tensor); they are optimizer state all the same, so they are counted. 0 on a CPU run, where
    everything is on the one device. ``peak - host_state_bytes`` is the device's own peak."""

    def peak_of(self, consumer: str, phase: str | None = None) -> int:
        """Most bytes one consumer held at any point (optionally within one phase)."""
        if consumer not in CONSUMERS:
            raise ValueError(f"consumer must be one of {CONSUMERS}, got {consumer!r}")
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase must be None or one of {PHASES}, got {phase!r}")
        points = [p for p in self.timeline if phase is None or p.phase == phase]
        return max([p.bytes[consumer] for p in points] + [self.before[consumer]])


def default_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One plain training step: loss = model(x, y); backward; optimizer step; grads set to None."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError("batch must be an (inputs, targets) pair for the default step_fn, got "
                        + (f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list))
                           else type(batch).__name__) + "; pass step_fn=... to take another kind of batch")
    x, y = batch
    loss = model(x, y)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _one_step(step_fn, model, optimizer, batch):
    """``step_fn(...)``, with MemTracker's refusal of a second forward explained in course terms."""
    try:
        return step_fn(model, optimizer, batch)
    except NotImplementedError as exc:
        if "multiple iterative calls" not in str(exc):
            raise
        raise ValueError("step_fn called the model more than once in one step (gradient accumulation, "
                         "micro-batches): measure_step counts one forward of the model per step. Use "
                         "labkit.measure.peak_over_calls(model, fn) for a run that calls it many times, "
                         "or steps=k for k steps of one forward each") from None


def _loss_value(loss) -> float:
    """The loss ``step_fn`` returned, as a float."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss)
    got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
           else type(loss).__name__)
    raise TypeError(f"step_fn must return the step's loss (a number or a one-element tensor), got {got}")


def measure_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 batch, *, steps: int = 1,
                 step_fn: Callable = default_step,
                 snapshot_path: str | None = None) -> StepMemory:
    """Run ``steps`` real training steps under MemTracker and return bytes by consumer.

    Args:
        model: the module to train; its parameters (and buffers) are tracked from the start.
        optimizer: its states are tracked from the step that creates them (None: no update).
        batch: what ``step_fn`` takes, by default an (inputs, targets) pair.
        steps: how many steps to run; with Adam, step 1 creates the states, so the peak of
            step 2 is higher ("fine at step 1, out of memory at step 2").
        step_fn: ``step_fn(model, optimizer, batch)`` runs one step and returns the loss.
        snapshot_path: on CUDA, write a memory snapshot there for pytorch.org/memory_viz.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    if not params:
        raise ValueError("model must have at least one parameter (measure_step places the "
                         "measurement on the parameters' device)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if not callable(step_fn):
        raise TypeError(f"step_fn must be a callable step_fn(model, optimizer, batch), got {step_fn!r}")
    if snapshot_path is not None and not isinstance(snapshot_path, (str, os.PathLike)):
        raise TypeError(f"snapshot_path must be a path (str) or None, got {type(snapshot_path).__name__}")
    device = params[0].device
    if device.type == "meta":
        raise ValueError("model is on the meta device: measure_step needs real storages (MemTracker "
                         "tells tensors that share memory, such as the GPT's tied embedding and head, "
                         "apart by their storage, and every meta tensor has none, so shared bytes would "
                         "count twice). Measure on 'cpu' (sizes in bytes are the same) or on 'cuda'")
    is_cuda = device.type == "cuda"
    recording = False
    try:
        if is_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            if snapshot_path:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
                recording = True
        from labkit.tracker import TimelineTracker

        tracker = TimelineTracker(device)
        tracker.track_external(model, *([optimizer] if optimizer is not None else []))
        before = tracker.current()
        boundaries, losses = [], []
        with tracker:
            for _ in range(steps):
                boundaries.append(len(tracker.timeline))
                tracker.step_start = len(tracker.timeline)
                tracker.reset_mod_stats()  # MemTracker refuses a second forward otherwise
                losses.append(_loss_value(_one_step(step_fn, model, optimizer, batch)))
        after = tracker.current()
        peak_snap = _device_entry(tracker.get_tracker_snapshot("peak"), device)
        at_peak = by_consumer(peak_snap)
        host = tracker.host_at_peak if is_cuda else 0
        at_peak["optimizer states"] += host
        cuda_max = None
        if is_cuda:
            torch.cuda.synchronize()
            cuda_max = torch.cuda.max_memory_allocated(device)
            if snapshot_path:
                torch.cuda.memory._dump_snapshot(str(snapshot_path))
    finally:
        if recording:  # also after an exception: never leave the allocator recording
            torch.cuda.memory._record_memory_history(enabled=None)
    return StepMemory(peak=sum(at_peak.values()), at_peak=at_peak, timeline=tracker.timeline,
                      before=before, after=after, step_boundaries=boundaries,
                      losses=losses, cuda_max_allocated=cuda_max, host_state_bytes=host)


def saved_activation_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct tensors autograd saves for backward while ``fn()`` runs forward.

    Counts each storage once (a saved view of a saved tensor costs nothing extra) and skips
    parameters and views of them (``nn.Linear`` saves ``weight.t()``), which live anyway.
    Uses ``torch.autograd.graph.saved_tensors_hooks``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable that takes no argument, got {type(fn).__name__}")
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if not isinstance(base, torch.nn.Parameter):
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def peak_bytes(fn: Callable, *args, **kwargs) -> tuple[int, object]:
    """Run ``fn(*args, **kwargs)`` under MemTracker; return (peak bytes tracked, fn's result).

    The peak counts only tensors created while ``fn`` runs (and those it touches), summed over
    devices: the memory a computation needs on top of what already existed.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    from labkit.tracker import Tracker

    with Tracker() as tracker:
        result = fn(*args, **kwargs)
    peak = tracker.get_tracker_snapshot("peak")
    return int(sum(snap.get("Total", 0) for snap in peak.values())), result


def peak_over_calls(module: torch.nn.Module, fn: Callable, *args,
                    **kwargs) -> tuple[int, dict[str, int], object]:
    """Run ``fn(*args, **kwargs)``, which may call ``module`` many times, under MemTracker.

    MemTracker refuses a module's second forward in one tracking session (it would count its
    activations twice) unless its module statistics are reset first; training loops, gradient
    accumulation and pipeline micro-batches call the model again and again. So for the run,
    each call of ``module`` resets them just before it starts (``module``'s class is swapped
    for a subclass whose ``__call__`` does that, and restored afterwards, also on error). The
    byte counts themselves are untouched: the peak is the whole run's.

    Returns:
        (peak bytes tracked over the run, summed over devices; bytes by consumer at the peak,
        keys ``CONSUMERS``; ``fn``'s result). Used by ``labkit.cluster`` and lab 7's plans.
    """
    import warnings

    from labkit.tracker import Tracker

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    tracker, cls = Tracker(), type(module)

    class _ResetEachCall(cls):
        def __call__(self, *a, **k):
            tracker.reset_mod_stats()
            return super().__call__(*a, **k)

    _ResetEachCall.__name__ = _ResetEachCall.__qualname__ = cls.__name__
    module.__class__ = _ResetEachCall
    try:
        with tracker, warnings.catch_warnings():
            # MemTracker looks for tensors among a module's outputs and warns at each None
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper")
            result = fn(*args, **kwargs)
    finally:
        module.__class__ = cls
    peak = tracker.get_tracker_snapshot("peak")
    at_peak = dict.fromkeys(CONSUMERS, 0)
    for snap in peak.values():
        for consumer, nbytes in by_consumer(snap).items():
            at_peak[consumer] += nbytes
    return int(sum(snap.get("Total", 0) for snap in peak.values())), at_peak, result


def count_flops(fn: Callable, *args, **kwargs) -> tuple[int, object]:
    """Run ``fn(*args, **kwargs)`` under ``FlopCounterMode``; return (total FLOPs, fn's result).

    FlopCounterMode counts matmul-like operators (2·m·n·k per matmul) in forward and backward;
    elementwise operators count zero.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    with FlopCounterMode(display=False) as counter:
        result = fn(*args, **kwargs)
    return counter.get_total_flops(), result


def peak_saved_bytes(fn) -> int:
    """Run ``fn()``; return the most bytes autograd held saved for backward at any moment.

    A ``saved_tensors_hooks`` pack hook sees every tensor autograd saves (parameters and views
    of them skipped: they live anyway) and wraps it in a small object that autograd keeps until
    backward frees the graph; ``weakref.finalize`` on that object subtracts its bytes. Each
    storage counts once while any saved view of it is alive. (``measure_step``
    cannot be used for gradient accumulation: MemTracker refuses a root module called k times per step.)

    Autograd calls only the innermost saved-tensor hooks: an operator recorded for backward
    while other hooks are on top of this measurement's (``torch.utils.checkpoint``'s, whose
    forward and recompute in backward pack with hooks of their own, or any ``saved_tensors_hooks``
    entered inside ``fn``) saves tensors this ledger never sees. A ``TorchDispatchMode`` checks,
    at every operator that autograd records (grad mode on, an input that requires grad), that the
    hooks on top are this measurement's; if any is not, ``RuntimeError``: the number would be
    wrong, so none is returned.
    """
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    if not callable(fn):
        raise TypeError(f"fn must be a callable taking no arguments, got {type(fn).__name__}")

    live, refs, peak, unseen = {}, {}, [0], {}

    class _Saved:
        __slots__ = ("t", "__weakref__")

        def __init__(self, t):
            self.t = t

    def release(key):
        refs[key] -= 1
        if refs[key] == 0:
            del refs[key], live[key]

    def pack(t):
        box = _Saved(t)
        base = t._base if t._base is not None else t
        if not isinstance(base, torch.nn.Parameter):
            key = t.untyped_storage().data_ptr()
            live[key] = t.untyped_storage().nbytes()
            refs[key] = refs.get(key, 0) + 1
            weakref.finalize(box, release, key)
            peak[0] = max(peak[0], sum(live.values()))
        return box

    def unpack(box):
        return box.t

    top = torch._C._autograd._top_saved_tensors_default_hooks

    class _Shadowed(TorchDispatchMode):
        """Notes the operators autograd records under saved-tensor hooks other than ours."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if torch.is_grad_enabled() and any(
                    isinstance(a, torch.Tensor) and a.requires_grad
                    for a in tree_leaves((args, kwargs))):
                hooks = top(False)
                if hooks is None or hooks[0] is not pack:
                    name = str(getattr(func, "__name__", func))
                    unseen[name] = unseen.get(name, 0) + 1
            return func(*args, **kwargs)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), _Shadowed():
        fn()
    if unseen:
        ops = ", ".join(f"{n} ×{c}" for n, c in sorted(unseen.items(), key=lambda i: -i[1])[:4])
        raise RuntimeError(
            f"peak_saved_bytes: {sum(unseen.values())} operators were recorded for backward under "
            f"saved-tensor hooks other than the measurement's ({ops}...): the activations they "
            "saved were not measured. torch.utils.checkpoint (forward and its recompute in "
            "backward) and saved_tensors_hooks entered inside the measured code hide the "
            "tensors autograd keeps; the saved bytes cannot be measured through them")
    return peak[0]
