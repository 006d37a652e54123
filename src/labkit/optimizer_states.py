"""Count the bytes an optimizer keeps between steps: its state tensors, each storage once.

    state_bytes(torch.optim.Adam(...))        # after a step: 8 bytes a parameter + a step counter each

The count reads the optimizer's ``state`` (a ``torch.optim.Optimizer``'s param → dict of
tensors, or a dict name → tensor), and counts every
tensor's storage once, so a table shared by many parameters (bitsandbytes' quantization maps)
is not counted twice. ``ZeroRedundancyOptimizer`` and ``labkit.lab2.zero1.ZeRO1`` are read through their local optimizer
(``.optim``): the states this rank keeps, plus ZeRO1's fp32 master slice (``.master``) for
16-bit parameters. On CPU this is exactly what
``labkit.measure.measure_step`` reports as "optimizer states" after the step (MemTracker on
CUDA rounds each storage up to 512 bytes).

Used in: Chapter 2 (book/02_optimizer_states.md) and Lab 2.
"""
from __future__ import annotations

import torch


def state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor in the optimizer's state, in order (shared storages may repeat)."""
    extra = []
    master = getattr(optimizer, "master", None)  # labkit's ZeRO1: the fp32 master slice
    if isinstance(master, torch.Tensor):
        extra.append(master)
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer):  # ZeroRedundancyOptimizer, ZeRO1: this rank's optimizer
        optimizer = inner
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        raise ValueError(f"optimizer must have a dict .state (a torch.optim.Optimizer or "
                         f"labkit's ZeRO1), got {type(optimizer).__name__}")
    values = [v for s in state.values() for v in (s.values() if isinstance(s, dict) else [s])]
    return [v for v in values if isinstance(v, torch.Tensor)] + extra


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors, each storage counted once."""
    seen: dict[tuple, int] = {}
    for t in state_tensors(optimizer):
        storage = t.untyped_storage()  # a meta storage has no address (every one is 0): its id
        where = storage._cdata if t.device.type == "meta" else storage.data_ptr()
        seen[(str(t.device), where)] = storage.nbytes()
    return sum(seen.values())
