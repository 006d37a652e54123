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

from labkit import validate


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


# ---- the formulas of Lab 2's optimizers (what the graders and the chapter compare the counts with)

def _shape(shape) -> tuple:
    if (not isinstance(shape, (tuple, list, torch.Size)) or len(shape) < 1
            or any(not validate.is_int(s) or s < 1 for s in shape)):
        raise ValueError(f"shape must be a non-empty tuple of positive ints, got {shape!r}")
    return tuple(int(s) for s in shape)


def factored_state_bytes(shape, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of Adafactor's state for one parameter of ``shape``, by the formula.

    ≥2-D (..., m, n): prod(...)·(m + n) elements; 1-D (n,): n elements; plus a 4-byte float32
    step counter. Compare Adam's 2·numel elements.
    """
    shape = _shape(shape)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
    item = torch.empty((), dtype=dtype).element_size()
    if len(shape) == 1:
        return item * shape[0] + 4
    lead = 1
    for s in shape[:-2]:
        lead *= s
    return item * lead * (shape[-2] + shape[-1]) + 4


def adam8bit_state_bytes(numels, block_size: int = 256) -> int:
    """State bytes of 8-bit Adam for parameters of these sizes: Σ 2·n + 8·ceil(n/B) (two uint8
    codes per element, one fp32 absmax per block of B per moment)."""
    block_size = validate.positive_int("block_size", block_size)
    if isinstance(numels, (int, torch.Tensor)):
        raise TypeError("numels must be an iterable of ints (parameter sizes), e.g. [p.numel() for p in params]")
    numels = list(numels)
    for n in numels:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"numels must hold ints >= 0, got {n!r}")
    return sum(2 * n + 8 * -(-n // block_size) for n in numels)


def came_state_bytes(shape) -> int:
    """Bytes of CAME's state for one fp32 parameter of ``shape`` (step counter not counted:
    a Python int): m·n + 2(m + n) floats for (..., m, n), 2n for a vector."""
    shape = _shape(shape)
    numel = 1
    for s in shape:
        numel *= s
    if len(shape) == 1:
        return 4 * 2 * numel
    lead = numel // (shape[-1] * shape[-2])
    return 4 * (numel + 2 * lead * (shape[-2] + shape[-1]))
