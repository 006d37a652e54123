"""PyTorch's ``MemTracker``, as ``labkit.measure`` uses it: frozen parameters accepted, its
bookkeeping after each operator made cheaper (same numbers), and a timeline of bytes by consumer
after every operator.

A module of its own so that importing ``labkit.measure`` stays cheap: ``MemTracker``'s module
imports DTensor and ``torch._dynamo`` (~2 CPU-s in a fresh interpreter), which a process pays
only when it measures (``labkit.measure`` imports this module inside the functions that do).
Chapter 1 (book/01_where_the_memory_goes.md) explains what it counts.
"""
from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

from labkit.consumers import TimelinePoint, _device_entry, by_consumer


class _NoHook:
    """Stands in for a gradient hook's handle on a frozen parameter (there is nothing to remove)."""

    @staticmethod
    def remove() -> None:
        return None


class Tracker(MemTracker):
    """PyTorch's MemTracker, accepting models with frozen parameters.

    MemTracker registers a gradient hook on every parameter of each module it sees run forward,
    and ``register_hook`` refuses a tensor that does not require grad, so a model with one frozen
    layer (fine-tuning, a frozen embedding) raised "cannot register a hook on a tensor that doesn't
    require gradient". A frozen parameter gets no gradient, so it needs no hook: it is marked as
    hooked already (and still counted as a parameter). Every tracker of ``labkit.measure`` is one.
    """

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
