"""Pipeline schedules: which stage runs which micro-batch's forward or backward, and when.

Pipeline parallelism cuts a model into P consecutive stages on P devices and a batch into M
micro-batches. Stage s can run the forward of micro-batch m once stage s−1 has, and its
backward once stage s+1 has run the backward of m. A *schedule* fixes, per stage, the order of
its 2M actions; the timeline follows from the dependencies.

- **GPipe** (Huang et al. 2019, arXiv 1811.06965): all M forwards, then all M backwards. With
  unit costs the idle share (the *bubble*) is (P−1)/(M+P−1), and every stage holds the
  activations of all M micro-batches before its first backward.
- **1F1B** (Narayanan et al. 2021, arXiv 2104.04473, PipeDream-Flush): stage s runs P−s
  forwards (warm-up), then alternates one backward and one forward, then drains the
  backwards. Same bubble, but at most P−s micro-batches are in flight on stage s.

This module generates both, simulates the timeline with given action costs, and checks a
timeline's dependencies. Lab 3, exercise 3.5; chapter 3 (book/03_parameters.md) draws its Gantt
charts from :func:`simulate`. ``record_torch_schedule`` runs ``torch.distributed.pipelining``'s
schedules on real gloo ranks and records the actions they execute, for comparison.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

import torch

__all__ = ["Action", "Span", "Timeline", "make_schedule", "simulate", "check_dependencies",
           "SCHEDULES", "record_torch_schedule"]

SCHEDULES = ("gpipe", "1f1b")


class Action(NamedTuple):
    """One unit of work on a stage: ``kind`` "F" (forward) or "B" (backward) of ``microbatch``."""
    kind: str
    microbatch: int


class Span(NamedTuple):
    """An action placed on the timeline of ``stage`` during [start, end)."""
    stage: int
    action: Action
    start: int
    end: int


@dataclass
class Timeline:
    """The result of :func:`simulate`.

    Attributes:
        spans: per stage, its spans in execution order.
        makespan: the time the last action ends.
        bubble: the idle share of P × makespan (a Fraction, exact for integer costs).
        in_flight: per stage, the most micro-batches whose forward has run and whose backward
            has not, at any point of the stage's order.
    """
    spans: list[list[Span]]
    makespan: int
    bubble: Fraction
    in_flight: list[int]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def make_schedule(kind: str, num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Each stage's ordered actions for the schedule ``kind`` ("gpipe" or "1f1b").

    Returns a list of ``num_stages`` lists; list s holds stage s's 2M actions in the order the
    stage runs them, every ``Action("F", m)`` and ``Action("B", m)`` for m in 0..M−1 exactly
    once; forwards and backwards each in micro-batch order. "gpipe": all forwards, then all
    backwards. "1f1b": min(P−s, M) forwards, then alternately one backward and one forward
    while forwards remain, then the remaining backwards (torch's ``Schedule1F1B`` order).
    """
    if kind not in SCHEDULES:
        raise ValueError(f"kind must be one of {SCHEDULES}, got {kind!r}")
    P = _positive_int("num_stages", num_stages)
    M = _positive_int("num_microbatches", num_microbatches)
    raise NotImplementedError("exercise 3.5: build each stage's order for GPipe and for 1F1B (warm-up, steady alternation, drain) (labs/03_parameters.ipynb)")


def _validate_schedule(schedule) -> tuple[int, int]:
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError("schedule must be a non-empty list of per-stage action lists")
    P = len(schedule)
    M = len(schedule[0]) // 2
    want = sorted([Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)])
    for s, actions in enumerate(schedule):
        if sorted(Action(*a) for a in actions) != want:
            raise ValueError(f"schedule[{s}] must hold F and B of micro-batches 0..{M - 1} once each")
    return P, M


def simulate(schedule: list[list[Action]], forward_cost: int = 1,
             backward_cost: int = 1) -> Timeline:
    """Place every action as early as its stage and its dependencies allow.

    An action starts when its stage has finished the previous action in its order and:
    F of micro-batch m on stage s > 0 after F of m on stage s−1 ends; B of m on stage s after
    F of m on stage s and, for s < P−1, after B of m on stage s+1 ends. F lasts
    ``forward_cost``, B ``backward_cost`` (ints ≥ 1). A schedule whose orders wait on each other
    forever → ValueError("schedule deadlocks ...").

    Returns a :class:`Timeline`: the spans, the makespan, the bubble = 1 − busy time /
    (P · makespan) as a Fraction, and each stage's peak number of micro-batches in flight.
    """
    _positive_int("forward_cost", forward_cost)
    _positive_int("backward_cost", backward_cost)
    P, M = _validate_schedule(schedule)
    raise NotImplementedError("exercise 3.5: list scheduling — repeatedly start each stage's next action once its dependencies have ended; then bubble and in-flight peaks (labs/03_parameters.ipynb)")


def check_dependencies(timeline: Timeline) -> list[str]:
    """Every dependency a timeline breaks, as readable strings (an empty list: none).

    Checks, for every micro-batch m: F on stage s > 0 starts at or after F on s−1 ends;
    B on stage s starts at or after F on s ends and, for s < P−1, after B on s+1 ends; and no
    two spans of one stage overlap. Each violation names the stage, the action and the one it
    should have waited for, e.g. ``"stage 2 F3 starts at 4 before stage 1 F3 ends at 5"``.
    """
    raise NotImplementedError("exercise 3.5: look up each span's dependencies and report those that end after it starts; and overlaps on a stage (labs/03_parameters.ipynb)")


# ---------------------------------------------------------------- torch.distributed.pipelining (infrastructure)

class _Tag(torch.autograd.Function):
    """Identity whose backward logs ``("B", m)``: marks where a micro-batch's backward starts."""

    @staticmethod
    def forward(ctx, x, m, log):
        ctx.m, ctx.log = m, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(Action("B", ctx.m))
        return grad, None, None


class _TaggedStage(torch.nn.Module):
    """A stage whose column 0 carries the micro-batch index through the pipeline unchanged."""

    def __init__(self, width: int, log: list):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.log = log

    def forward(self, x):
        m = int(x[0, 0].item())
        self.log.append(Action("F", m))
        out = torch.cat([x[:, :1], torch.tanh(self.lin(x[:, 1:]))], dim=1)
        return _Tag.apply(out, m, self.log)


def record_torch_schedule(rank: int, world_size: int, kind: str, num_microbatches: int,
                          width: int = 4) -> list[Action]:
    """Run ``torch.distributed.pipelining``'s ScheduleGPipe or Schedule1F1B (M ≥ P) for a step on
    ``world_size`` gloo ranks (one stage each, run by ``labkit.dist.launch``) and return the
    actions this rank's stage executed, in order, as :class:`Action`s."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if kind not in SCHEDULES:
        raise ValueError(f"kind must be one of {SCHEDULES}, got {kind!r}")
    torch.manual_seed(rank)
    log: list[Action] = []
    stage = PipelineStage(_TaggedStage(width, log), rank, world_size, torch.device("cpu"))
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    schedule = cls(stage, num_microbatches, loss_fn=lambda out, y: ((out[:, 1:] - y) ** 2).mean())
    x = torch.randn(num_microbatches, width + 1)
    x[:, 0] = torch.arange(num_microbatches, dtype=x.dtype)  # row m is micro-batch m
    y = torch.zeros(num_microbatches, width)
    for _ in range(2):  # the first step also infers shapes (extra forwards): record the second
        log.clear()
        if rank == 0:
            schedule.step(x)
        elif rank == world_size - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
    torch.distributed.barrier()  # no rank leaves (and destroys the group) while another sends
    return list(log)


def gantt(timeline: Timeline, ax=None, title: str | None = None):
    """Draw a timeline: one row per stage (stage 0 on top), forwards light, backwards dark, each
    box labelled with its micro-batch. Returns the Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(timeline.spans)))
    for row in timeline.spans:
        for sp in row:
            colour = "#9ecae1" if sp.action.kind == "F" else "#3182bd"
            ax.barh(sp.stage, sp.end - sp.start, left=sp.start, color=colour, edgecolor="white")
            ax.text((sp.start + sp.end) / 2, sp.stage, str(sp.action.microbatch), ha="center",
                    va="center", fontsize=7, color="black" if sp.action.kind == "F" else "white")
    ax.set_yticks(range(len(timeline.spans)), [f"stage {s}" for s in range(len(timeline.spans))])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.makespan)
    ax.set_xlabel("time (unit costs)")
    ax.set_title(title or f"makespan {timeline.makespan}, bubble {float(timeline.bubble):.1%}")
    return ax
