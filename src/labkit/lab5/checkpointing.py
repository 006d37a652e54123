"""Activation checkpointing: keep a few layer inputs, recompute the rest in backward.

Checkpointing trades compute for memory. Forward runs a *segment* of consecutive layers without
saving what their backward needs and keeps only the segment's input; backward runs the segment
forward again from that input (the *recompute*), then back-propagates through it. A schedule
says which segments are recomputed; the layers outside every segment keep all they save.

Cost model (Chen et al. 2016, https://arxiv.org/abs/1604.06174), per layer i:
``act_bytes[i]`` (what layer i saves for backward when it runs normally, its input included),
``input_bytes[i]`` (its input: what a checkpoint kept at i costs) and ``flops[i]`` (its forward
cost). With m(s) the bytes held for the layers before s,

    peak      = max( m(L),  max over segments [s, e) of  m(s) + act_bytes[s] + ... + act_bytes[e-1] )
    recompute = sum of flops[i] over the layers inside segments

so no checkpointing holds O(L) layers, √L segments of √L layers hold O(√L), and recomputing
every layer separately holds all L inputs plus one layer's activations. Either way every
recomputed layer runs forward twice: "about one extra forward" (≈ 1.33× the compute of a step,
whose backward costs two forwards).

Lab 5 (labs/05_activations.ipynb) writes ``schedule_cost``, ``sqrt_schedule`` (5.1),
``CheckpointedSegment.forward`` and ``apply_schedule`` (5.2: run any schedule, the one
``optimal_schedule`` plans or one written by hand) and ``optimal_schedule`` (5.3);
Chapter 5 (book/05_activations.md) explains them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from labkit.validate import positive_int


# ==== given: the course's code — read it, call it, don't change it ====

@dataclass(frozen=True)
class Schedule:
    """Which layers of an L-layer chain are recomputed in backward.

    ``segments`` are the recomputed segments, half-open ``(start, stop)`` ranges of layer
    indices, sorted and disjoint; the input of each segment's first layer is kept (a
    checkpoint). Layers outside every segment run normally and keep all their activations.
    ``peak`` and ``recompute`` are what the cost model predicts, in the units of the costs the
    schedule was planned with (None when the schedule was written by hand).

    Examples (L = 4): ``Schedule(4, ())`` keeps everything; ``Schedule.every_layer(4)`` is
    ``Schedule(4, ((0, 1), (1, 2), (2, 3), (3, 4)))``; ``Schedule(4, ((0, 2), (2, 4)))`` keeps
    the inputs of layers 0 and 2 and recomputes two layers at a time.
    """

    n_layers: int
    segments: tuple[tuple[int, int], ...] = ()
    peak: float | None = None
    recompute: float | None = None

    def __post_init__(self) -> None:
        positive_int("n_layers", self.n_layers)
        try:
            segments = tuple(tuple(segment) for segment in self.segments)
        except TypeError:
            raise TypeError(f"Schedule.segments must be a sequence of (start, stop) pairs of ints, "
                            f"got {self.segments!r}") from None
        for segment in segments:
            if len(segment) != 2 or any(isinstance(b, bool) or not isinstance(b, int)
                                        for b in segment):
                raise TypeError(f"Schedule.segments must hold (start, stop) pairs of ints (a "
                                f"layer index is never fractional), got {segment!r}")
        for name in ("peak", "recompute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value >= 0):
                raise ValueError(f"Schedule.{name} must be None or a number >= 0, got {value!r}")
        object.__setattr__(self, "segments", segments)
        previous_stop = 0
        for start, stop in segments:
            if not previous_stop <= start < stop <= self.n_layers:
                raise ValueError(
                    f"Schedule.segments must be sorted, disjoint (start, stop) ranges with "
                    f"0 <= start < stop <= n_layers={self.n_layers}; got {segments}"
                )
            previous_stop = stop

    @classmethod
    def none(cls, n_layers: int) -> "Schedule":
        """No checkpointing: every layer keeps its activations."""
        return cls(n_layers, ())

    @classmethod
    def every_layer(cls, n_layers: int) -> "Schedule":
        """Per-layer (per-block) checkpointing: keep each layer's input, recompute each layer."""
        return cls(n_layers, tuple((i, i + 1) for i in range(n_layers)))

    @property
    def kept_inputs(self) -> tuple[int, ...]:
        """Layers whose input is kept as a checkpoint (the first layer of each segment)."""
        return tuple(start for start, _ in self.segments)

    @property
    def recomputed_layers(self) -> tuple[int, ...]:
        """Layers that run forward twice."""
        return tuple(i for start, stop in self.segments for i in range(start, stop))


class Cost(NamedTuple):
    """What a schedule costs under the model in the module docstring."""

    peak: float
    """Most activation bytes held at once (forward end or during a segment's recompute)."""
    recompute: float
    """Forward cost run a second time in backward (sum of the recomputed layers' flops)."""


def _costs(n_layers: int | None, **arrays: Sequence[float]) -> list[list[float]]:
    """Check per-layer cost arrays: equal lengths (= n_layers when given), finite, >= 0."""
    out = []
    for name, values in arrays.items():
        try:
            if isinstance(values, (str, bytes)):  # "1111" would be read digit by digit
                raise TypeError
            values = [float(v) for v in values]
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a sequence of numbers (one cost per layer), got "
                            f"{values!r:.80}") from None
        if not values:
            raise ValueError(f"{name} must list one cost per layer (at least one layer), got []")
        if n_layers is not None and len(values) != n_layers:
            raise ValueError(f"{name} must have n_layers={n_layers} entries, got {len(values)}")
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise ValueError(f"{name} must hold finite costs >= 0, got {values}")
        out.append(values)
    lengths = {len(values) for values in out}
    if len(lengths) > 1:
        raise ValueError(f"{', '.join(arrays)} must have the same length, got "
                         f"{', '.join(str(len(v)) for v in out)}")
    if "act_bytes" in arrays and "input_bytes" in arrays:
        names = list(arrays)
        act, inp = out[names.index("act_bytes")], out[names.index("input_bytes")]
        for i, (a, x) in enumerate(zip(act, inp)):
            if x > a:
                raise ValueError(f"input_bytes[{i}]={x} exceeds act_bytes[{i}]={a}: act_bytes "
                                 "counts the layer's input among what it saves")
    return out


# ==== exercise 5.1: your code ====

def schedule_cost(schedule: Schedule, act_bytes: Sequence[float], input_bytes: Sequence[float],
                  flops: Sequence[float]) -> Cost:
    """Predict a schedule's peak activation bytes and its recompute (the module's cost model).

    Forward holds, for each layer outside the segments, ``act_bytes[i]``, and for each segment
    its input ``input_bytes[start]``. Backward meets the segments last to first; recomputing
    segment [s, e) brings back ``act_bytes[s] + ... + act_bytes[e-1]`` (its input among them)
    on top of what the layers before s hold. Later layers are freed by then.

    Args:
        schedule: the segments to recompute.
        act_bytes, input_bytes, flops: one entry per layer (``schedule.n_layers`` entries).
    Returns:
        ``Cost(peak, recompute)``.
    Raises:
        ValueError: the arrays have the wrong length, negative entries, or an input larger
            than what its layer saves.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a labkit.lab5.checkpointing.Schedule (e.g. "
                        f"Schedule(L, segments), sqrt_schedule(L)), got {schedule!r}")
    act, inp, fl = _costs(schedule.n_layers, act_bytes=act_bytes, input_bytes=input_bytes,
                          flops=flops)  # checked lists of floats
    raise NotImplementedError("exercise 5.1: predict the schedule's peak and recompute under the module's cost model (labs/05_activations.ipynb)")


def sqrt_schedule(n_layers: int) -> Schedule:
    """Chen et al.'s √L schedule: ⌈√L⌉ recomputed segments covering all L layers.

    The segments' lengths differ by at most one, longer ones first (later segments are
    recomputed on top of more kept inputs, so they should be the shorter ones). The schedule's
    ``peak`` and ``recompute`` are predicted in units of one layer: every layer saves 1 unit,
    its input included (``act_bytes = input_bytes = flops = 1``), as in Chen et al.'s chain,
    where a layer's kept output is all it saves. Then no checkpointing peaks at L units, √L
    segments at most 2⌈√L⌉, and the recompute is L: one extra forward.

    Args:
        n_layers: L >= 1.
    Returns:
        the ``Schedule`` with its predicted ``peak`` and ``recompute``.
    Raises:
        ValueError: ``n_layers`` is not an int >= 1.
    """
    raise NotImplementedError("exercise 5.1: build the segments the docstring describes and attach their predicted cost (labs/05_activations.ipynb)")


# ==== exercise 5.2: your code ====

class CheckpointedSegment(nn.Module):
    """Consecutive blocks that keep only their input for backward: one recomputed segment."""

    def __init__(self, blocks: Sequence[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The segment's plain forward: the blocks one after the other."""
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``run(x)``, keeping for backward only ``x`` (no tensor computed inside).

        Contract: the output and every gradient equal the plain ``run(x)``'s; what autograd
        holds between forward and backward for this segment is ``x`` alone; when the gradient
        arrives, backward runs each block's forward once more from ``x`` (the recompute) and
        back-propagates through it. No re-entrant backward (the graph has no node of a custom
        autograd function that calls ``torch.autograd.backward`` inside itself).

        Args:
            x: the segment's input, (batch_size, seq_len, n_embd).
        Returns:
            the segment's output, same shape.
        """
        raise NotImplementedError("exercise 5.2: run the segment so that backward recomputes it from its input alone (labs/05_activations.ipynb)")


# ==== given: the course's code — read it, call it, don't change it ====

def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a course GPT, in order, whether or not they are checkpointed."""
    blocks = []
    for module in model.h:
        blocks.extend(module.blocks if isinstance(module, CheckpointedSegment) else [module])
    return blocks


def _check_schedule_type(schedule) -> None:
    """TypeError unless ``schedule`` is a Schedule or a sequence of (start, stop) int pairs."""
    if isinstance(schedule, Schedule):
        return
    ok = isinstance(schedule, (list, tuple)) and all(
        isinstance(pair, (list, tuple)) and len(pair) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) for b in pair)
        for pair in schedule)
    if not ok:
        raise TypeError(f"schedule must be a labkit.lab5.checkpointing.Schedule (e.g. sqrt_schedule(L), "
                        f"Schedule.every_layer(L), optimal_schedule(...)) or a list of "
                        f"(start, stop) pairs of block indices, got {schedule!r}")


# ==== exercise 5.2: your code ====

def apply_schedule(model: nn.Module, schedule: "Schedule | Sequence[tuple[int, int]]") -> nn.Module:
    """Make the course's GPT run ``schedule`` in every forward and backward; return the model.

    ``schedule`` is a ``Schedule`` (from ``sqrt_schedule``, ``optimal_schedule``,
    ``Schedule.every_layer``, ...) or its segments written by hand: a list of half-open
    ``(start, stop)`` ranges of block indices, e.g. ``[(0, 3), (4, 5)]`` on six blocks.

    Contract, for every schedule (segments of any lengths, a segment at the first or the last
    block, no segment at all, one segment over all blocks):

    * each segment keeps, between forward and backward, only the input of its first block;
      in backward its blocks run forward once more, together, from that input;
    * the blocks outside every segment run as usual and keep what they save;
    * loss and gradients equal the plain model's; the model keeps its own block objects, in
      order (the parameters are the same objects);
    * applying a schedule to a model that already runs one replaces the old schedule.

    So the bytes held and the recompute are what ``schedule_cost`` predicts for the schedule.

    Args:
        model: a ``labkit.models.GPT`` (anything whose blocks are ``model.h``).
        schedule: a ``Schedule`` or a list of ``(start, stop)`` pairs of ints.
    Returns:
        ``model``, changed in place.
    Raises:
        TypeError: ``model`` has no ``model.h`` of blocks; ``schedule`` is neither form.
        ValueError: naming ``schedule``, before the model is changed: a ``Schedule`` whose
            ``n_layers`` is not the model's number of blocks; a segment that is empty, outside
            the model's blocks, out of order, or that overlaps (or repeats) another.
    """
    _check_schedule_type(schedule)
    if not isinstance(model, nn.Module) or not isinstance(getattr(model, "h", None), nn.ModuleList):
        raise TypeError(f"model must be a course GPT (an nn.Module whose blocks are the "
                        f"nn.ModuleList model.h), got {type(model).__name__}")
    raise NotImplementedError("exercise 5.2: check the schedule against the model's blocks, then make model.h run it (labs/05_activations.ipynb)")


# ==== exercise 5.3: your code ====

def optimal_schedule(act_bytes: Sequence[float], input_bytes: Sequence[float],
                     flops: Sequence[float], budget: float) -> Schedule:
    """The schedule with the least recompute whose predicted peak fits in ``budget``.

    Contract: among all schedules (each layer recomputed at most once) whose
    ``schedule_cost(...).peak <= budget``, one with the least ``recompute``; its ``peak`` and
    ``recompute`` equal what ``schedule_cost`` says of it, to the last bit, so
    ``optimal_schedule(..., budget=schedule_cost(s, ...).peak)`` succeeds for every schedule s.
    Polynomial time in L (a dynamic programme over prefixes of the chain; lab 5 explains it).

    Args:
        act_bytes, input_bytes, flops: per-layer costs, as in ``schedule_cost``.
        budget: bytes of activations allowed at the peak, >= 0.
    Returns:
        a ``Schedule`` with its predicted ``peak`` (<= budget) and ``recompute``.
    Raises:
        ValueError: bad costs, ``budget`` < 0, or no schedule fits (the message gives the
            smallest peak any schedule reaches).
    """
    raise NotImplementedError("exercise 5.3: find the least-recompute schedule whose predicted peak fits the budget (ValueError when none does) (labs/05_activations.ipynb)")


# ==== given: the course's code — read it, call it, don't change it ====

def _smallest_peak(act: list[float], inp: list[float]) -> float:
    """The least peak over all schedules (DP over prefixes: min over splits of max(...))."""
    n = len(act)
    # best[i]: Pareto front of (held bytes, peak so far) after layers 0..i-1
    best: list[list[tuple[float, float]]] = [[] for _ in range(n + 1)]
    best[0] = [(0.0, 0.0)]
    for i in range(n):
        for m, p in best[i]:
            best[i + 1].append((m + act[i], p))
            inside = m
            for j in range(i + 1, n + 1):
                inside += act[j - 1]
                best[j].append((m + inp[i], max(p, inside)))
        for k in range(i + 1, n + 1):  # prune each front: keep pairs not dominated
            pruned, low = [], math.inf
            for m, p in sorted(set(best[k])):
                if p < low:
                    pruned.append((m, p))
                    low = p
            best[k] = pruned
    return min(max(m, p) for m, p in best[n])
