"""Static memory planning: every tensor of a step gets a fixed offset in one pre-allocated arena.

A training step allocates the same tensors, in the same order, with the same sizes, every
step. Instead of asking an allocator at run time (and paying its rounding, caching and
fragmentation), a planner can read the lifetimes once and give each tensor an offset in one
buffer, so that two tensors alive at the same time never overlap. Megatron-LM and DeepSpeed
do a simple form of this with contiguous buffers for gradients and parameters; inference
runtimes (TFLite's planner, Pisarchyk & Lee 2020, arXiv 2001.03288) do it for every
intermediate. No plan can use less than the *peak of live bytes* (the most bytes alive at one
moment): that is the lower bound a plan is measured against. Finding the optimum is NP-hard
(dynamic storage allocation), but placing tensors largest first, each at the lowest offset
that fits, lands close to the bound on real networks.

A tensor lives over the events ``[start, end]`` of a trace (inclusive; ``end`` is the event
that frees it, or one past the last event if it is never freed). Two tensors *conflict* when
their lifetimes intersect; conflicting tensors need disjoint ``[offset, offset + size)``.

Chapter 6 (book/06_system.md); Lab 6, exercise 6.2 (labs/06_system.ipynb).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from labkit.validate import is_int, is_number, positive_int

# ==== given: the course's code — read it, call it, don't change it ====


@dataclass(frozen=True)
class TensorLife:
    """One tensor of a trace: ``size`` bytes alive over events ``start`` … ``end`` (inclusive)."""
    id: int
    size: int
    start: int
    end: int


def lifetimes(trace, *, round_to: int = 1) -> list[TensorLife]:
    """The tensors of an allocation trace (``labkit.allocation_trace``'s format), sizes rounded
    up to a multiple of ``round_to`` bytes (512 to compare with the CUDA allocator; a 0-byte
    tensor stays 0: the allocator gives it no block)."""
    from labkit.allocation_trace import check_trace

    trace = check_trace(trace)
    round_to = positive_int("round_to", round_to)
    start, size, end = {}, {}, {}
    for k, (op, ident, nbytes) in enumerate(trace):
        if op == "alloc":
            start[ident], size[ident] = k, -(-nbytes // round_to) * round_to
        else:
            end[ident] = k
    return [TensorLife(i, size[i], start[i], end.get(i, len(trace))) for i in start]


def conflict(a: TensorLife, b: TensorLife) -> bool:
    """True when the lifetimes of ``a`` and ``b`` intersect."""
    if not (isinstance(a, TensorLife) and isinstance(b, TensorLife)):
        raise TypeError(f"a and b must be TensorLife objects, got {type(a).__name__} and {type(b).__name__}")
    return a.start <= b.end and b.start <= a.end


def peak_live(tensors) -> int:
    """The lower bound of any plan: the largest sum of sizes of tensors alive at one event."""
    tensors = _check_tensors(tensors)
    deltas = {}
    for t in tensors:
        deltas[t.start] = deltas.get(t.start, 0) + t.size
        deltas[t.end + 1] = deltas.get(t.end + 1, 0) - t.size
    live = peak = 0
    for k in sorted(deltas):
        live += deltas[k]
        peak = max(peak, live)
    return peak


def arena_size(tensors, offsets: dict) -> int:
    """Bytes of the arena a plan needs: the highest ``offset + size``. A tensor without an
    offset, or a negative one: ValueError naming ``offsets``."""
    tensors = _check_tensors(tensors)
    if not isinstance(offsets, dict):
        raise TypeError(f"offsets must be a dict {{id: offset}}, got {type(offsets).__name__}")
    missing = [t.id for t in tensors if t.id not in offsets]
    if missing:
        raise ValueError(f"offsets has no offset for tensor id(s) {missing[:5]}: a plan places every tensor")
    for t in tensors:
        o = offsets[t.id]
        if not (is_int(o) or is_number(o)) or not 0 <= o < math.inf:
            raise ValueError(f"offsets[{t.id!r}] must be a byte offset >= 0 (an int), got {o!r}")
    return max((offsets[t.id] + t.size for t in tensors), default=0)


def _check_tensors(tensors) -> list[TensorLife]:
    if isinstance(tensors, (str, bytes)) or not hasattr(tensors, "__iter__"):
        raise TypeError(f"tensors must be a list of TensorLife (see lifetimes(trace)), got {type(tensors).__name__}")
    tensors = list(tensors)
    if not all(isinstance(t, TensorLife) for t in tensors):
        raise TypeError("tensors must be TensorLife objects (see lifetimes(trace))")
    for t in tensors:
        if not all(is_int(v) for v in (t.size, t.start, t.end)):
            raise TypeError(f"tensor {t.id!r}: size, start and end must be ints, got {t}")
        if t.size < 0 or t.start < 0 or t.end < t.start:
            raise ValueError(f"tensor {t.id!r}: size and start must be >= 0 and end >= start, got {t}")
    if len({t.id for t in tensors}) != len(tensors):
        raise ValueError("tensors must have distinct ids")
    try:
        sorted(t.id for t in tensors)
    except TypeError:
        raise TypeError("tensor ids must be comparable with each other (ties are broken by id): "
                        f"got ids of types {sorted({type(t.id).__name__ for t in tensors})}") from None
    return tensors


# ==== exercise 6.2: your code ====


def place(tensors, order) -> dict[int, int]:
    """Place the tensors one by one in ``order`` (a sequence of ids): each at the lowest offset
    where it overlaps no already placed tensor whose lifetime intersects its own.

    Returns ``{id: offset}`` for every tensor.
    """
    tensors = _check_tensors(tensors)
    by_id = {t.id: t for t in tensors}
    if isinstance(order, (str, bytes)) or not hasattr(order, "__iter__"):
        raise TypeError(f"order must be a sequence of tensor ids, got {type(order).__name__}")
    order = list(order)
    if sorted(order, key=repr) != sorted(by_id, key=repr):
        raise ValueError("order must list every tensor id exactly once")
    offsets: dict[int, int] = {}
    placed: list[TensorLife] = []
    raise NotImplementedError("exercise 6.2: for each tensor in order, the lowest gap among the placed tensors it conflicts with (labs/06_system.ipynb)")
    return offsets


def plan_greedy_by_size(tensors) -> dict[int, int]:
    """Largest first (ties: longer lifetime first, then lower id), each at the lowest offset."""
    tensors = _check_tensors(tensors)
    raise NotImplementedError("exercise 6.2: order by size (largest first; ties by longer lifetime, then id) and place (labs/06_system.ipynb)")


def plan_in_order_of_allocation(tensors) -> dict[int, int]:
    """First allocated first (by ``start``, then id), each at the lowest offset: what an
    allocator that never moves anything and always takes the lowest gap would do, knowing the
    future frees."""
    tensors = _check_tensors(tensors)
    raise NotImplementedError("exercise 6.2: order by start (then id) and place (labs/06_system.ipynb)")


def plan_optimal(tensors, max_tensors: int = 8) -> dict[int, int]:
    """The smallest arena, by brute force over every order (at most ``max_tensors`` tensors).

    Any plan can be pushed down, tensor by tensor in order of offset, until each sits at the
    lowest offset its placed neighbours allow; so some order of ``place`` reaches the optimum.
    """
    tensors = _check_tensors(tensors)
    max_tensors = positive_int("max_tensors", max_tensors)
    if len(tensors) > max_tensors:
        raise ValueError(f"brute force is for at most max_tensors = {max_tensors} tensors, got {len(tensors)}")
    raise NotImplementedError("exercise 6.2: try every order with place and keep the smallest arena (labs/06_system.ipynb)")
