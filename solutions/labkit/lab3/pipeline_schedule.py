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
- **Interleaved 1F1B** (Narayanan et al. 2021, §2.2): each of the P ranks holds v model
  *chunks* (virtual stages s, s+P, …, s+(v−1)P of v·P), so a micro-batch crosses every rank v
  times. With unit costs per chunk action the bubble is (P−1)/(v·M+P−1) for M ≥ P: the same
  P−1 idle slots of each kind, but every slot is 1/v of a stage's work (for M < P the makespan
  is (v·P+M−1) slots, bubble 1 − vM/(vP+M−1)). It costs v× the point-to-point messages.
  Actions are :class:`ChunkAction` (kind, micro-batch, chunk).

This module generates both, simulates the timeline with given action costs, and checks a
timeline's dependencies. Lab 3, exercise 3.5; chapter 3 (book/03_parameters.md) draws its Gantt
charts from :func:`simulate`. ``labkit.reference.lab3.record_torch_schedule`` runs
``torch.distributed.pipelining``'s schedules on real gloo ranks and records the actions they
execute, for comparison.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from labkit.validate import one_of, positive_int

__all__ = ["Action", "ChunkAction", "Span", "Timeline", "make_schedule", "simulate",
           "check_dependencies", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")


# ==== given: the course's code — read it, call it, don't change it ====
class Action(NamedTuple):
    """One unit of work on a stage: ``kind`` "F" (forward) or "B" (backward) of ``microbatch``."""
    kind: str
    microbatch: int


class ChunkAction(NamedTuple):
    """One unit of work of an interleaved schedule: ``kind`` "F" or "B" of ``microbatch`` on the
    rank's model chunk ``chunk`` (0..v−1); on rank s it is virtual stage ``chunk·P + s``."""
    kind: str
    microbatch: int
    chunk: int


def _chunk(action) -> int:
    """The chunk of an action: 0 for a plain :class:`Action` (one chunk per stage)."""
    return action[2] if len(action) == 3 else 0


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


# ==== exercise 3.5: your code ====
def make_schedule(kind: str, num_stages: int, num_microbatches: int,
                  num_chunks: int = 1) -> list[list[Action]]:
    """Each stage's ordered actions for the schedule ``kind`` ("gpipe", "1f1b", "interleaved").

    Returns a list of ``num_stages`` lists; list s holds stage s's 2M actions in the order the
    stage runs them, every ``Action("F", m)`` and ``Action("B", m)`` for m in 0..M−1 exactly
    once; forwards and backwards each in micro-batch order. "gpipe": all forwards, then all
    backwards. "1f1b": min(P−s, M) forwards, then alternately one backward and one forward
    while forwards remain, then the remaining backwards (torch's ``Schedule1F1B`` order).

    "interleaved" (``num_chunks`` = v ≥ 2; rank s holds chunks c = 0..v−1, virtual stages
    c·P + s): list s holds the 2vM :class:`ChunkAction` s of rank s in the order torch's
    ``ScheduleInterleaved1F1B`` runs them. Micro-batches go in rounds of R = M / max(1, ⌊M/P⌋)
    (M must divide into that many rounds): a rank's forwards take chunk 0 for a round of R
    micro-batches, then chunk 1 for the same round, …, then the next round; its backwards
    visit the chunks in the reverse order. A warm-up of forwards (as many as the first
    backward of rank s needs to be ready in the steady state, never more than vM), then
    alternately one forward and one backward while forwards remain, then the remaining
    backwards. Each chunk's forwards and backwards are each in micro-batch order.
    """
    one_of("kind", kind, SCHEDULES)
    P = positive_int("num_stages", num_stages)
    M = positive_int("num_microbatches", num_microbatches)
    v = positive_int("num_chunks", num_chunks)
    if (kind == "interleaved") != (v > 1):
        raise ValueError(f"num_chunks must be >= 2 for 'interleaved' and 1 for {kind!r}, got {v}")
    if kind == "interleaved" and M % max(1, M // P):
        raise ValueError(f"num_microbatches must be a multiple of the number of rounds "
                         f"max(1, M // P) = {max(1, M // P)} for 'interleaved', got {M}")
    # BEGIN SOLUTION 3.5: build each stage's order for GPipe and for 1F1B (warm-up, steady alternation, drain)
    if kind == "interleaved":
        return [_interleaved_order(s, P, M, v) for s in range(P)]
    stages = []
    for s in range(P):
        forwards = [Action("F", m) for m in range(M)]
        backwards = [Action("B", m) for m in range(M)]
        if kind == "gpipe":
            stages.append(forwards + backwards)
            continue
        warmup = min(P - s, M)
        order = forwards[:warmup]
        f, b = warmup, 0
        while f < M:
            order += [backwards[b], forwards[f]]
            b, f = b + 1, f + 1
        order += backwards[b:]
        stages.append(order)
    return stages
    # END SOLUTION


def _interleaved_order(s: int, P: int, M: int, v: int) -> list[ChunkAction]:
    """Rank s's order under interleaved 1F1B (see :func:`make_schedule`)."""
    # BEGIN SOLUTION 3.5: warm-up forwards, then one forward and one backward, then the drain; chunks change every round of micro-batches
    R = M // max(1, M // P)  # micro-batches per round
    warmup = min((v - 1) * R + 2 * (P - 1 - s), v * M)
    next_mb = {"F": [0] * v, "B": [0] * v}

    def take(kind, chunk):
        m = next_mb[kind][chunk]
        next_mb[kind][chunk] += 1
        return ChunkAction(kind, m, chunk)

    order = [take("F", (k // R) % v) for k in range(warmup)]
    for k in range(warmup, v * M):
        order.append(take("F", (k // R) % v))
        order.append(take("B", v - 1 - ((k - warmup) // R) % v))
    for k in range(v * M, v * M + warmup):
        order.append(take("B", v - 1 - ((k - warmup) // R) % v))
    return order
    # END SOLUTION


def _validate_schedule(schedule) -> tuple[int, int, int]:
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError("schedule must be a non-empty list of per-stage action lists")
    P = len(schedule)
    v = 1 + max((_chunk(a) for a in schedule[0]), default=0)
    M = len(schedule[0]) // (2 * v)
    if M == 0:
        raise ValueError("schedule must hold at least one micro-batch: each stage's list needs F "
                         f"and B actions, got {schedule!r}")
    want = sorted((k, m, c) for k in "FB" for m in range(M) for c in range(v))
    for s, actions in enumerate(schedule):
        if sorted((a[0], a[1], _chunk(a)) for a in actions) != want:
            raise ValueError(f"schedule[{s}] must hold F and B of micro-batches 0..{M - 1} "
                             f"(of chunks 0..{v - 1}) once each")
    return P, M, v


def _deps(P: int, v: int, s: int, kind: str, m: int, c: int) -> list[tuple[int, str, int, int]]:
    """What ``kind`` of micro-batch m on rank s, chunk c (virtual stage c·P + s) waits for, as
    (rank, kind, m, chunk): F after F of the previous virtual stage; B after F of its own and
    B of the next virtual stage."""
    # BEGIN SOLUTION 3.5: the previous / next virtual stage of chunk c on rank s, and what each kind needs
    vs = c * P + s
    prev, nxt = (vs - 1) % P, (vs + 1) % P
    if kind == "F":
        return [(prev, "F", m, (vs - 1) // P)] if vs > 0 else []
    return [(s, "F", m, c)] + ([(nxt, "B", m, (vs + 1) // P)] if vs < v * P - 1 else [])
    # END SOLUTION


def simulate(schedule: list[list[Action]], forward_cost: int = 1,
             backward_cost: int = 1) -> Timeline:
    """Place every action as early as its stage and its dependencies allow.

    An action starts when its stage has finished the previous action in its order and:
    F of micro-batch m on stage s > 0 after F of m on stage s−1 ends; B of m on stage s after
    F of m on stage s and, for s < P−1, after B of m on stage s+1 ends. F lasts
    ``forward_cost``, B ``backward_cost`` (ints ≥ 1). A schedule whose orders wait on each other
    forever → ValueError("schedule deadlocks ...").

    Interleaved schedules (:class:`ChunkAction`, v chunks per rank): the same rules on the v·P
    virtual stages, chunk c of rank s being virtual stage c·P + s (:func:`_deps`); each chunk
    action lasts ``forward_cost`` / ``backward_cost``.

    Returns a :class:`Timeline`: the spans, the makespan, the bubble = 1 − busy time /
    (P · makespan) as a Fraction, and each stage's peak number of micro-batches (of chunks, if
    interleaved) in flight.
    """
    positive_int("forward_cost", forward_cost)
    positive_int("backward_cost", backward_cost)
    P, M, v = _validate_schedule(schedule)
    # BEGIN SOLUTION 3.5: list scheduling — repeatedly start each stage's next action once its dependencies have ended; then bubble and in-flight peaks
    n = 2 * M * v  # actions per stage
    end: dict[tuple[int, str, int, int], int] = {}
    spans: list[list[Span]] = [[] for _ in range(P)]
    free = [0] * P
    nxt = [0] * P
    while any(nxt[s] < n for s in range(P)):
        progressed = False
        for s in range(P):
            if nxt[s] == n:
                continue
            action = schedule[s][nxt[s]]
            kind, m, c = action[0], action[1], _chunk(action)
            deps = _deps(P, v, s, kind, m, c)
            if any(d not in end for d in deps):
                continue
            start = max([free[s]] + [end[d] for d in deps])
            stop = start + (forward_cost if kind == "F" else backward_cost)
            end[(s, kind, m, c)] = stop
            spans[s].append(Span(s, action, start, stop))
            free[s], nxt[s] = stop, nxt[s] + 1
            progressed = True
        if not progressed:
            raise ValueError(f"schedule deadlocks: stages wait on {[schedule[s][nxt[s]] for s in range(P) if nxt[s] < n]}")
    makespan = max(free)
    busy = P * M * v * (forward_cost + backward_cost)
    in_flight = []
    for s in range(P):
        count = peak = 0
        for action in schedule[s]:
            count += 1 if action[0] == "F" else -1
            peak = max(peak, count)
        in_flight.append(peak)
    return Timeline(spans, makespan, 1 - Fraction(busy, P * makespan), in_flight)
    # END SOLUTION


def check_dependencies(timeline: Timeline) -> list[str]:
    """Every dependency a timeline breaks, as readable strings (an empty list: none).

    Checks, for every micro-batch m: F on stage s > 0 starts at or after F on s−1 ends;
    B on stage s starts at or after F on s ends and, for s < P−1, after B on s+1 ends; and no
    two spans of one stage overlap. Each violation names the stage, the action and the one it
    should have waited for, e.g. ``"stage 2 F3 starts at 4 before stage 1 F3 ends at 5"``.
    """
    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a Timeline (what simulate returns), got {type(timeline).__name__}")
    # BEGIN SOLUTION 3.5: look up each span's dependencies and report those that end after it starts; and overlaps on a stage
    P = len(timeline.spans)
    v = 1 + max((_chunk(sp.action) for row in timeline.spans for sp in row), default=0)
    where = {(sp.stage, sp.action[0], sp.action[1], _chunk(sp.action)): sp
             for row in timeline.spans for sp in row}
    name = lambda s, k, m, c: f"stage {s} {k}{m}" + (f" (chunk {c})" if v > 1 else "")  # noqa: E731
    problems = []
    for row in timeline.spans:
        for sp in row:
            s, kind, m, c = sp.stage, sp.action[0], sp.action[1], _chunk(sp.action)
            for d in _deps(P, v, s, kind, m, c):
                dep = where.get(d)
                if dep is None:
                    problems.append(f"{name(s, kind, m, c)} needs {name(*d)}, which never runs")
                elif sp.start < dep.end:
                    problems.append(f"{name(s, kind, m, c)} starts at {sp.start} before {name(*d)} "
                                    f"ends at {dep.end}")
        ordered = sorted(row, key=lambda sp: sp.start)
        for a, b in zip(ordered, ordered[1:]):
            if b.start < a.end:
                problems.append(f"stage {a.stage} {b.action.kind}{b.action.microbatch} starts at "
                                f"{b.start} while {a.action.kind}{a.action.microbatch} runs until {a.end}")
    return problems
    # END SOLUTION
