"""PyTorch's ``MemTracker``, as ``labkit.measure`` uses it: frozen parameters accepted, its
bookkeeping after each operator made cheaper (same numbers), no leak of a module's leaf inputs,
and a timeline of bytes by consumer after every operator.

A module of its own so that importing ``labkit.measure`` stays cheap: ``MemTracker``'s module
imports DTensor and ``torch._dynamo`` (~2 CPU-s in a fresh interpreter), which a process pays
only when it measures (``labkit.measure`` imports this module inside the functions that do).
Chapter 1 (book/01_where_the_memory_goes.md) explains what it counts.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

from labkit.consumers import TimelinePoint, _device_entry, by_consumer


class _NoHook:
    """Stands in for a gradient hook's handle on a frozen parameter (there is nothing to remove)."""

    @staticmethod
    def remove() -> None:
        return None


@contextlib.contextmanager
def releasing_input_hooks():
    """While it is entered, the backward hooks MemTracker's module tracker puts on a module
    call's inputs let go of those inputs once they have fired. What the hooks do is unchanged.

    Why: before each module call, ``ModTracker`` (torch/distributed/_tools/mod_tracker.py, torch
    2.13) registers ``torch.autograd.graph.register_multi_grad_hook`` on the call's inputs that
    require grad. In its "all" mode that hook's closure keeps the list of the inputs' autograd
    nodes (``grad_fns``). A leaf's node (AccumulateGrad) holds the leaf, and the leaf holds the
    hook: a cycle through C++ objects that Python's garbage collector cannot see, so every leaf
    input that requires grad stays alive as long as the process does, and is counted in every
    later peak. A pipeline stage after the first is fed such leaves (its received activations):
    measured over 3 steps on PP 4 (1F1B, M = 4), stage 2 kept the received inputs and their
    gradients of every earlier micro-batch (8 of 128 KiB a step) and its peak read 27% above what
    the run holds; without MemTracker nothing is left after a step. The list is read only when
    the hook first fires in a backward, so emptying it then breaks the cycle.
    ``tests/test_measure.py`` checks both: the leak without this, none with it.
    """
    from torch.distributed._tools import mod_tracker

    register = mod_tracker.register_multi_grad_hook

    def register_releasing(tensors, fn, *, mode="all"):
        if mode != "all":  # "any" mode keeps no list of nodes
            return register(tensors, fn, mode=mode)
        held = []  # the hooks' lists of autograd nodes

        def fire(grads):
            fn(grads)
            for nodes in held:
                nodes.clear()

        handle = register(tensors, fire, mode=mode)
        for one in getattr(handle, "handles", ()):
            hooks = one.hooks_dict_ref()
            hook = None if hooks is None else hooks.get(one.id)
            code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None) or ()
            for name, cell in zip(getattr(code, "co_freevars", ()), cells):
                if name == "grad_fns" and isinstance(cell.cell_contents, list):
                    held.append(cell.cell_contents)
        return handle

    mod_tracker.register_multi_grad_hook = register_releasing
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register


class Tracker(MemTracker):
    """PyTorch's MemTracker, accepting models with frozen parameters.

    MemTracker registers a gradient hook on every parameter of each module it sees run forward,
    and ``register_hook`` refuses a tensor that does not require grad, so a model with one frozen
    layer (fine-tuning, a frozen embedding) raised "cannot register a hook on a tensor that doesn't
    require gradient". A frozen parameter gets no gradient, so it needs no hook: it is marked as
    hooked already (and still counted as a parameter). Every tracker of ``labkit.measure`` is one.

    It also keeps no leaf input of a module call alive after its backward
    (:func:`releasing_input_hooks`, entered with the tracker).
    """

    def __enter__(self):
        stack = contextlib.ExitStack()
        stack.enter_context(releasing_input_hooks())
        with stack:  # undone if MemTracker's own entry fails
            tracker = super().__enter__()
            self.__dict__.setdefault("_releasing", []).append(stack.pop_all())  # (re-entrant)
        return tracker

    def __exit__(self, *args) -> None:
        try:
            super().__exit__(*args)
        finally:
            self._releasing.pop().close()

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        if install_grad_hooks:
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (_NoHook, _NoHook)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state) -> None:
        """MemTracker's own, after every operator: raise the peaks (the tracker's and those of
        the modules now running) to the current bytes where they are higher, keeping a copy of
        the bytes by kind at that moment.

        The same updates as MemTracker's, at a fraction of the cost: its loop resolves the weak
        reference of every module it has seen, after every operator (``nn.Module.__getattr__``
        raising on each one), and deep-copies the snapshots; here the statistics are read from
        the dictionary's values as they are stored, and a snapshot (kind -> int) is copied as a
        dict. (A module collected but not yet removed may have its stats updated: nobody can
        look them up any more.)
        ``tests/test_measure.py`` checks that both give the same peaks and module snapshots.
        """
        stored = getattr(self.memory_tracking, "data", None)
        if not isinstance(stored, dict):  # a torch whose MemTracker keeps them otherwise
            return super()._update_peak_stats(peak_state)
        current, parents = self._curr_mem_snap, self._mod_tracker.parents
        # (a list: a module collected while this loop allocates would otherwise remove its
        # entry from the dictionary being iterated)
        for stats in list(stored.values()):
            if stats.mod_fqn in parents and peak_state in stats.snapshots:
                for dev, snap in current.items():
                    if stats.local_peak.get(dev, 0) < snap[_TOTAL_KEY]:
                        stats.local_peak[dev] = snap[_TOTAL_KEY]
                        stats.snapshots[peak_state][-1][dev] = dict(snap)
        for dev, snap in current.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)


class TimelineTracker(Tracker):
    """MemTracker that also records bytes by consumer after every operator."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.timeline: list[TimelinePoint] = []
        self.step_start = 0  # timeline index where the current step began
        self.peak_total = -1  # the device's tracked peak so far, and the host-held optimizer
        self.host_at_peak = 0  # state at that moment (see host_state)

    def current(self) -> dict[str, int]:
        snap = self._curr_mem_snap  # read, not copied (get_tracker_snapshot deep-copies it)
        out = by_consumer(_device_entry(snap, self.device))
        out["optimizer states"] += self.host_state(snap)
        return out

    def host_state(self, snap: dict) -> int:
        """Optimizer state held in host memory while the model is on a GPU (Adam's and
        Adafactor's ``step`` counters are CPU tensors unless ``capturable``/``fused``)."""
        if self.device.type == "cpu":
            return 0
        return int(_device_entry(snap, torch.device("cpu")).get(_MemRefType.OPT, 0))

    def note_peak(self) -> None:
        """Remember the host-held state at the moment the device's tracked peak last grew."""
        total = _device_entry(self._peak_mem_snap, self.device).get("Total", 0)
        if total > self.peak_total:
            self.peak_total = total
            self.host_at_peak = self.host_state(self._curr_mem_snap)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.device.type != "cpu":
            self.note_peak()
        if getattr(func, "namespace", "") == "profiler":  # the optimizer's record_function markers
            return out
        if self._in_opt:
            phase = "optimizer"
        elif self._mod_tracker.is_bw:
            phase = "backward"
        elif self.timeline and self.timeline[-1].op >= self.step_start \
                and self.timeline[-1].phase != "forward":
            phase = self.timeline[-1].phase  # bookkeeping after backward (detach, .item())
        else:
            phase = "forward"
        self.timeline.append(TimelinePoint(len(self.timeline), phase, self.current()))
        return out
