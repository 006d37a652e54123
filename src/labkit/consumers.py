"""The consumers of memory, as ``labkit.measure`` reports them: ``CONSUMERS``, ``PHASES``, a
``TimelinePoint`` (bytes by consumer after one operator) and ``by_consumer`` (one device's
MemTracker snapshot in those terms).

Apart from ``labkit.tracker`` (the trackers themselves) so that importing ``labkit.measure``
does not import ``torch.distributed._tools.mem_tracker``, which pulls DTensor and
``torch._dynamo`` (~2 CPU-s in a fresh interpreter): a process pays that only when it measures.
``labkit.measure`` re-exports every public name here. Chapter 1 (book/01_where_the_memory_goes.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PHASES = ("forward", "backward", "optimizer")
"""The phases of a step, as ``TimelinePoint.phase`` names them."""

CONSUMERS = ("parameters", "gradients", "optimizer states", "activations", "temporaries", "other")
"""The consumers, in the order figures stack them."""

# MemTracker's reference types (``_MemRefType``, a str enum) by value, so that this module
# needs no import of ``torch.distributed._tools.mem_tracker``.
_FROM_REFTYPE = {
    "Parameter": "parameters",
    "Buffer": "other",
    "Gradient": "gradients",
    "Optstate": "optimizer states",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
}


def by_consumer(device_snapshot: dict) -> dict[str, int]:
    """Turn one device's MemTracker snapshot into bytes per consumer (keys: ``CONSUMERS``)."""
    if not isinstance(device_snapshot, dict):
        raise TypeError(f"device_snapshot must be one device's MemTracker snapshot (a dict), "
                        f"got {type(device_snapshot).__name__}")
    out = dict.fromkeys(CONSUMERS, 0)
    for reftype, nbytes in device_snapshot.items():
        name = getattr(reftype, "value", None)  # a _MemRefType; "Total" is a plain str
        if name in _FROM_REFTYPE:
            out[_FROM_REFTYPE[name]] += int(nbytes)
    return out


@dataclass
class TimelinePoint:
    """Bytes by consumer right after one operator ran."""

    op: int
    """Index of the operator in the step (0, 1, 2, ...)."""
    phase: str
    """"forward", "backward" or "optimizer"."""
    bytes: dict[str, int]
    """Bytes per consumer (keys: ``CONSUMERS``)."""

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def _device_entry(snapshot: dict, device: torch.device) -> dict:
    for dev, entry in snapshot.items():
        if dev.type == device.type:
            return entry
    return {}
