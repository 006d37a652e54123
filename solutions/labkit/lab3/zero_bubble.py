"""Zero-bubble pipelines: split each backward into B (input gradient) and W (weight gradient).

A stage's backward does two different jobs. For a linear layer Y = X·A it computes the input
gradient dX = dY·Aᵀ, which the previous stage is waiting for, and the weight gradient
dA = Xᵀ·dY, which nobody needs until the optimizer step. Qi et al. (2023, "Zero Bubble
Pipeline Parallelism", https://arxiv.org/abs/2401.10241) run them as two actions: **B**
(input gradient, on the critical path between stages) and **W** (weight gradient, free to
move). B of micro-batch m on stage s waits only for B of m on stage s+1, so the backward wave
travels back through the pipeline faster, and the W passes fill the idle slots that 1F1B
leaves at the start and end of a step.

- **ZB-H1** (their §2.1; ``torch.distributed.pipelining.ScheduleInterleavedZeroBubble`` with one
  stage per rank): 1F1B's forwards and input-backwards, with stage s holding its W passes back
  so that every stage reaches the same P micro-batches in flight. With equal costs F = B = W its
  bubble is a third of 1F1B's, at no more memory than 1F1B's first stage.
- **ZB-V** (their §6; ``ScheduleZBVZeroBubble``): two stages per rank placed in a V (rank r
  holds stages r and 2P−1−r), the bubble near zero at 1F1B's memory.
- DualPipe (DeepSeek-V3, https://arxiv.org/abs/2412.19437; ``ScheduleDualPipeV``) feeds
  micro-batches from both ends and overlaps a forward with a backward to hide the all-to-all of
  expert parallelism.

The price is memory: what W needs (the inputs X of every weight matmul and the output
gradients dY that B produced) stays alive from B until W. Qi et al. count it per micro-batch
and stage as M_B (stored by F, needed by B) and M_W (left after B until W); for a GPT layer
M_W = 32·s·b·h bytes against M_B = 34·s·b·h + 5·a·s²·b in 16 bits (their Table 1).

Actions are :class:`SplitAction` (kind "F", "B" or "W", micro-batch, global stage index); a
schedule is one list of actions per rank. Lab 3, exercise 3.8; chapter 3 (book/03_parameters.md).
``labkit.reference.lab3.record_torch_zero_bubble`` records what torch's schedules execute.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from labkit.lab3.pipeline_schedule import Span
from labkit.validate import is_number, positive_int

__all__ = ["SplitAction", "SplitTimeline", "KINDS", "zb_h1_schedule", "simulate_split",
           "peak_activation_memory"]

KINDS = ("F", "B", "W")


# ==== given: the course's code — read it, call it, don't change it ====
class SplitAction(NamedTuple):
    """One action of a split-backward schedule: ``kind`` "F" (forward), "B" (input gradient:
    torch's "I") or "W" (weight gradient) of ``microbatch`` on global stage ``stage``."""
    kind: str
    microbatch: int
    stage: int


@dataclass
class SplitTimeline:
    """The result of :func:`simulate_split`.

    Attributes:
        spans: per rank, its spans (``Span(rank, action, start, end)``) in execution order.
        makespan: the time the last action ends.
        bubble: the idle share of (number of ranks) × makespan, a Fraction.
        in_flight: per rank, the most (micro-batch, stage) pairs at once whose F has run on the
            rank and whose W has not.
    """
    spans: list[list[Span]]
    makespan: int
    bubble: Fraction
    in_flight: list[int]


def validate_split(schedule) -> tuple[int, int, int]:
    """Check a split schedule; return (ranks P, stages S, micro-batches M).

    Every rank's list holds :class:`SplitAction` s; every stage 0..S−1 lives on exactly one
    rank; F, B and W of every micro-batch 0..M−1 on every stage occur exactly once.
    """
    if not isinstance(schedule, (list, tuple)) or not schedule or \
            not all(isinstance(r, (list, tuple)) for r in schedule):
        raise ValueError("schedule must be a non-empty list of per-rank lists of SplitAction")
    actions = [(r, a) for r, row in enumerate(schedule) for a in row]
    if not actions:
        raise ValueError("schedule must hold at least one action, got only empty rank lists")
    for r, a in actions:
        if not (isinstance(a, tuple) and len(a) == 3 and a[0] in KINDS
                and all(isinstance(x, int) and x >= 0 for x in a[1:])):
            raise ValueError(f"schedule[{r}] holds {a!r}: each action must be a SplitAction(kind in "
                             f"{KINDS}, microbatch >= 0, stage >= 0)")
    home: dict[int, int] = {}
    for r, a in actions:
        if home.setdefault(a[2], r) != r:
            raise ValueError(f"stage {a[2]} appears on ranks {home[a[2]]} and {r}: a stage lives on one rank")
    S, M = 1 + max(home), 1 + max(a[1] for _, a in actions)
    want = sorted((k, m, j) for k in KINDS for m in range(M) for j in range(S))
    if sorted(tuple(a) for _, a in actions) != want:
        raise ValueError(f"schedule must hold F, B and W of micro-batches 0..{M - 1} on stages "
                         f"0..{S - 1} exactly once each")
    return len(schedule), S, M


def split_dependencies(action: SplitAction, num_stages: int) -> list[tuple[str, int, int]]:
    """What ``action`` waits for, as (kind, micro-batch, stage): F after F of the previous
    stage; B after F of its own stage and B of the next stage (the last stage: its own F
    only, the loss is computed there); W after B of its own stage."""
    kind, m, j = action
    if kind == "F":
        return [("F", m, j - 1)] if j > 0 else []
    if kind == "B":
        return [("F", m, j)] + ([("B", m, j + 1)] if j < num_stages - 1 else [])
    return [("B", m, j)]


# ==== exercise 3.8: your code ====
def zb_h1_schedule(num_stages: int, num_microbatches: int) -> list[list[SplitAction]]:
    """Each rank's order under ZB-H1: one stage per rank (stage s on rank s), the order torch's
    ``ScheduleInterleavedZeroBubble`` runs with one stage per rank.

    Contract: F and B (input gradient) go exactly as 1F1B runs F and its backward (3.5's
    "1f1b" order, B in place of the whole backward). Stage s holds its W passes back so that
    every stage reaches the same peak, P micro-batches in flight (F run, W not yet); after
    that each B is followed at once by the W of the oldest micro-batch whose W is pending; the
    W passes still pending when the B passes are done come last. F, B and W each run in
    micro-batch order. Any M ≥ 1 works (M < P too).
    """
    P = positive_int("num_stages", num_stages)
    M = positive_int("num_microbatches", num_microbatches)
    # BEGIN SOLUTION 3.8: each rank's ZB-H1 order: 1F1B's forwards and input-backwards, the W passes placed as the contract says
    stages = []
    for s in range(P):
        warmup = min(P - s, M)
        order = [SplitAction("F", m, s) for m in range(warmup)]
        w = 0
        for k in range(M):  # the k-th input-backward
            order.append(SplitAction("B", k, s))
            if k >= s:
                order.append(SplitAction("W", w, s))
                w += 1
            if warmup + k < M:
                order.append(SplitAction("F", warmup + k, s))
        order += [SplitAction("W", m, s) for m in range(w, M)]
        stages.append(order)
    return stages
    # END SOLUTION


def simulate_split(schedule: list[list[SplitAction]], forward_cost: int = 1,
                   backward_cost: int = 1, weight_cost: int = 1) -> SplitTimeline:
    """Place every action as early as its rank and its dependencies allow.

    An action starts when its rank has finished the previous action of its list and every
    action it depends on (:func:`split_dependencies`, over the global stages, wherever they
    live) has ended. F lasts ``forward_cost``, B ``backward_cost``, W ``weight_cost`` (ints
    ≥ 1). Lists that wait on each other forever → ValueError("schedule deadlocks ...").

    Returns a :class:`SplitTimeline`: spans, makespan, bubble = 1 − busy / (P · makespan) as a
    Fraction, and each rank's peak of (micro-batch, stage) pairs in flight (F run, W not yet).
    """
    costs = {"F": positive_int("forward_cost", forward_cost),
             "B": positive_int("backward_cost", backward_cost),
             "W": positive_int("weight_cost", weight_cost)}
    P, S, M = validate_split(schedule)
    # BEGIN SOLUTION 3.8: list scheduling over the ranks with the F/B/W dependencies; then the bubble and each rank's peak in flight
    end: dict[tuple[str, int, int], int] = {}
    spans: list[list[Span]] = [[] for _ in range(P)]
    free, nxt = [0] * P, [0] * P
    while any(nxt[r] < len(schedule[r]) for r in range(P)):
        progressed = False
        for r in range(P):
            if nxt[r] == len(schedule[r]):
                continue
            action = SplitAction(*schedule[r][nxt[r]])
            deps = split_dependencies(action, S)
            if any(d not in end for d in deps):
                continue
            start = max([free[r]] + [end[d] for d in deps])
            end[tuple(action)] = free[r] = start + costs[action.kind]
            spans[r].append(Span(r, action, start, free[r]))
            nxt[r] += 1
            progressed = True
        if not progressed:
            stuck = [schedule[r][nxt[r]] for r in range(P) if nxt[r] < len(schedule[r])]
            raise ValueError(f"schedule deadlocks: ranks wait on {stuck}")
    makespan = max(free)
    busy = M * S * sum(costs.values())
    in_flight = []
    for row in schedule:
        count = peak = 0
        for kind, _, _ in row:
            count += {"F": 1, "B": 0, "W": -1}[kind]
            peak = max(peak, count)
        in_flight.append(peak)
    return SplitTimeline(spans, makespan, 1 - Fraction(busy, P * makespan), in_flight)
    # END SOLUTION


def peak_activation_memory(schedule: list[list[SplitAction]], m_b, m_w) -> list:
    """Each rank's peak activation memory over its order, in the units of ``m_b`` and ``m_w``.

    Qi et al.'s accounting, per micro-batch and stage: F stores ``m_b`` (everything B needs);
    B frees what only it needed and keeps ``m_w`` (the inputs of the weight matmuls and the
    output gradients it made, everything W needs), so B adds ``m_w − m_b``; W frees ``m_w``.
    0 ≤ m_w ≤ m_b (finite numbers: ints, Fractions or floats; else ValueError naming it).
    Returns a list of P peaks (the most held after any action of the rank's list; 0 for an
    empty list).
    """
    validate_split(schedule)
    for name, value in (("m_b", m_b), ("m_w", m_w)):
        if not (is_number(value) or isinstance(value, Fraction)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if m_w > m_b:
        raise ValueError(f"m_w must be at most m_b (W needs part of what B needs), got m_w={m_w}, m_b={m_b}")
    # BEGIN SOLUTION 3.8: each rank's most memory held at once over its order, under F, B and W's changes
    delta = {"F": m_b, "B": m_w - m_b, "W": -m_w}
    peaks = []
    for row in schedule:
        held = peak = 0
        for kind, _, _ in row:
            held += delta[kind]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
    # END SOLUTION
