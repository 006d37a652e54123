"""Graders of Lab 3, exercise 3.8 (labs/03_parameters.ipynb): zero-bubble pipelines (B/W split).

References nobody in this course wrote: the order ``torch.distributed.pipelining``'s
``ScheduleInterleavedZeroBubble`` (one stage per rank: ZB-H1) *executes* on real gloo ranks —
recorded by a ``PipelineStage`` that logs each forward, input-gradient and weight-gradient call
the runtime makes — and its plan for many more sizes; the plan of ``ScheduleZBVZeroBubble`` (two
stages per rank in a V); the longest path through the schedule's dependency graph, computed
here (every action starts at the latest end among the previous action of its rank and the
actions it needs); ZB-H1's bubble (Qi et al. 2023, arXiv 2401.10241, §2.1: the 1F1B bubble
(P−1)(F+B+W) shrinks to (P−1)(F+B−W) for W ≤ F) and its memory ((P−s)·M_B + s·M_W on stage s,
never above 1F1B's first stage P·M_B). Everything is integer or exact rational: no tolerance.
"""
from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from labkit.reference.lab3 import torch_zero_bubble_order

SIZES = [(1, 1), (2, 2), (2, 5), (3, 3), (4, 4), (4, 9), (5, 7), (3, 12)]  # (P, M), M ≥ P


def one_f_one_b_split(P, M):
    """1F1B with the backward split and each W right after its B (written here): F and B as
    1F1B's forward and backward, nothing held back."""
    order = []
    for s in range(P):
        warmup = min(P - s, M)
        row = [("F", m, s) for m in range(warmup)]
        for k in range(M):
            row += [("B", k, s), ("W", k, s)]
            if warmup + k < M:
                row.append(("F", warmup + k, s))
        order.append(row)
    return order


def longest_path(schedule, costs):
    """The makespan of a fixed-order schedule, computed independently: the longest path through
    the graph of rank-order edges and F/B/W dependency edges (fixed-point iteration)."""
    S = 1 + max(a[2] for row in schedule for a in row)
    needs = {}
    for row in schedule:
        for prev, a in zip([None] + row[:-1], row):
            kind, m, j = a
            deps = [tuple(prev)] if prev is not None else []
            if kind == "F" and j > 0:
                deps.append(("F", m, j - 1))
            if kind == "B":
                deps += [("F", m, j)] + ([("B", m, j + 1)] if j < S - 1 else [])
            if kind == "W":
                deps.append(("B", m, j))
            needs[tuple(a)] = deps
    end = {}
    while len(end) < len(needs):
        for a, deps in needs.items():
            if a not in end and all(d in end for d in deps):
                end[a] = max([end[d] for d in deps], default=0) + costs[a[0]]
    return max(end.values())


def running_peaks(schedule, delta):
    """Each rank's most-held amount over its order, for per-kind changes ``delta``."""
    peaks = []
    for row in schedule:
        held = peak = 0
        for a in row:
            held += delta[a[0]]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


@pytest.mark.exercise("3.8", points=1)
def test_zb_h1_runs_f_b_and_w_of_every_microbatch_once_in_order():
    """Check each rank's ZB-H1 list: stage s on rank s, F, B and W of micro-batches 0..M−1 once
    each, each kind in micro-batch order."""
    from labkit.lab3.zero_bubble import zb_h1_schedule

    for P, M in SIZES + [(4, 2), (6, 1)]:
        sched = zb_h1_schedule(P, M)
        assert len(sched) == P, f"ZB-H1 P={P} M={M}: {len(sched)} rank lists, expected {P}"
        for s, row in enumerate(sched):
            assert {a[2] for a in row} == {s}, f"P={P} M={M} rank {s}: stages {sorted({a[2] for a in row})}, expected [{s}]"
            for kind in "FBW":
                ms = [a[1] for a in row if a[0] == kind]
                assert ms == list(range(M)), (f"P={P} M={M} rank {s}: {kind} of micro-batches {ms}, "
                                              f"expected 0..{M - 1} once each in order")


@pytest.mark.exercise("3.8", points=2)
def test_zb_h1_order_equals_torch_plan_for_many_sizes():
    """Check each rank's order against ScheduleInterleavedZeroBubble's plan with one stage per
    rank, for P ≤ 6 and M ≤ 12 (where torch accepts M: a multiple of max(1, M // P) rounds)."""
    from labkit.lab3.zero_bubble import zb_h1_schedule

    fmt = lambda row: " ".join(f"{k}{m}" for k, m, _ in row)  # noqa: E731
    for P in range(1, 7):
        for M in range(1, 13):
            if M % max(1, M // P):
                continue
            want, mine = torch_zero_bubble_order("zb1p", P, M), zb_h1_schedule(P, M)
            for s in range(P):
                assert [tuple(a) for a in mine[s]] == want[s], (
                    f"ZB-H1 P={P} M={M} rank {s}: your order {fmt(mine[s])}, torch plans {fmt(want[s])}")


@pytest.mark.exercise("3.8", points=2)
@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (3, 2)])
def test_zb_h1_order_equals_what_torch_pipelining_executes(P, M):
    """Check each rank's order equals the forward, input-gradient and weight-gradient calls that
    ScheduleInterleavedZeroBubble's runtime makes on P real gloo ranks (one stage each)."""
    from labkit.ranks import launch
    from labkit.lab3.zero_bubble import zb_h1_schedule
    from labkit.reference.lab3 import record_torch_zero_bubble

    ran = launch(record_torch_zero_bubble, P, "zb1p", M, timeout=90)
    mine = zb_h1_schedule(P, M)
    fmt = lambda row: " ".join(f"{k}{m}" for k, m, _ in row)  # noqa: E731
    for s in range(P):
        assert [tuple(a) for a in mine[s]] == ran[s], (
            f"ZB-H1 P={P} M={M} rank {s}: your order {fmt(mine[s])}, torch runs {fmt(ran[s])}")


COSTS = [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 3, 2), (1, 1, 3)]  # (F, B, W), B ≥ F


@pytest.mark.exercise("3.8", points=2)
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w():
    """Check the simulated ZB-H1 makespan M(F+B+W) + (P−1)(F+B−min(F, W)) and its bubble as an
    exact Fraction, for M ≥ P and B ≥ F; next to the split 1F1B (each W right after its B),
    M(F+B+W) + (P−1)(F+B).

    Derivation (Qi et al. §2.1): the first input-gradient of stage 0 waits for the forward wave
    to reach the end and the B wave to come back, (P−1)(F+B) as in 1F1B once B waits only for
    B; the W passes that stage s held back fill the idle slots of the drain, up to one F-sized
    slot per stage of distance: (P−1)·min(F, W) less. (Simulated for P ≤ 8, M ≤ 3P+1,
    F, B, W ≤ 4 with B ≥ F: all equal; with F > B the drain's slots are shorter than W.)"""
    from labkit.lab3.zero_bubble import simulate_split, zb_h1_schedule

    for P, M in SIZES:
        for f, b, w in COSTS:
            tl = simulate_split(zb_h1_schedule(P, M), f, b, w)
            busy = M * (f + b + w)
            want = busy + (P - 1) * (f + b - min(f, w))
            assert tl.makespan == want, (
                f"ZB-H1 P={P} M={M} F={f} B={b} W={w}: makespan {tl.makespan}, expected "
                f"M(F+B+W) + (P−1)(F+B−min(F,W)) = {want}: does B wait only for B of the next stage "
                "(not its W), and each action start as soon as its rank and dependencies allow?")
            assert tl.bubble == 1 - Fraction(busy, want), (
                f"ZB-H1 P={P} M={M}: bubble {tl.bubble}, expected {1 - Fraction(busy, want)}")
            split = simulate_split(one_f_one_b_split(P, M), f, b, w)
            assert split.makespan == busy + (P - 1) * (f + b), (
                f"1F1B with W right after B, P={P} M={M} F={f} B={b} W={w}: makespan {split.makespan}, "
                f"expected {busy + (P - 1) * (f + b)}")


@pytest.mark.exercise("3.8", points=2)
@pytest.mark.parametrize("kind", ["zb1p", "zbv"])
def test_simulated_makespan_is_the_longest_path_for_any_placement(kind):
    """Check simulate_split against the longest path through the dependency graph (written here)
    on torch's own plans, ZB-H1 and ZB-V (two stages per rank in a V: rank r holds stages r and
    2P−1−r, so F of stage P runs on the rank that ran stage P−1): the makespan, the bubble
    1 − M·S·(F+B+W)/(P·makespan) for S stages on P ranks, and no dependency broken in the spans."""
    from labkit.lab3.zero_bubble import simulate_split

    for P, M in [(2, 3), (2, 4), (3, 5), (4, 8), (4, 3)]:
        plan = torch_zero_bubble_order(kind, P, M)
        S = 1 + max(a[2] for row in plan for a in row)
        for f, b, w in COSTS[:4]:
            from labkit.lab3.zero_bubble import SplitAction

            tl = simulate_split([[SplitAction(*a) for a in row] for row in plan], f, b, w)
            want = longest_path(plan, {"F": f, "B": b, "W": w})
            assert tl.makespan == want, (
                f"{kind} P={P} M={M} F={f} B={b} W={w}: makespan {tl.makespan}, the longest path is "
                f"{want}: are dependencies looked up by global stage (stage j−1 / j+1 may live on "
                "another rank, or on this one)?")
            busy = Fraction(M * S * (f + b + w), P * want)
            assert tl.bubble == 1 - busy, (
                f"{kind} P={P} M={M}: bubble {tl.bubble}, expected 1 − M·S·(F+B+W)/(P·makespan) = "
                f"{1 - busy} with S = {S} stages on P = {P} ranks")
            at = {tuple(sp.action): sp for row in tl.spans for sp in row}
            assert len(at) == 3 * M * S, f"{kind}: {len(at)} actions placed, expected {3 * M * S}"
            for (k, m, j), sp in at.items():
                deps = {"F": [("F", m, j - 1)] if j else [],
                        "B": [("F", m, j)] + ([("B", m, j + 1)] if j < S - 1 else []),
                        "W": [("B", m, j)]}[k]
                for d in deps:
                    assert at[d].end <= sp.start, f"{kind} P={P} M={M}: {k}{m} of stage {j} starts before {d} ends"


@pytest.mark.exercise("3.8", points=1)
def test_in_flight_counts_f_run_and_w_pending():
    """Check each rank's peak of (micro-batch, stage) pairs whose F ran and whose W has not:
    P on every rank under ZB-H1 (M ≥ P), P−s under the split 1F1B, and counted the same way
    here on torch's ZB-V plan (two stages per rank)."""
    from labkit.lab3.zero_bubble import SplitAction, simulate_split, zb_h1_schedule

    for P, M in SIZES:
        got = simulate_split(zb_h1_schedule(P, M)).in_flight
        assert got == [P] * P, (f"ZB-H1 P={P} M={M}: in flight {got}, expected P on every rank: does "
                                "a micro-batch stay in flight until its W (not its B) has run?")
        split = simulate_split(one_f_one_b_split(P, M)).in_flight
        assert split == [P - s for s in range(P)], f"split 1F1B P={P} M={M}: in flight {split}"
    plan = torch_zero_bubble_order("zbv", 4, 8)
    got = simulate_split([[SplitAction(*a) for a in row] for row in plan]).in_flight
    assert got == running_peaks(plan, {"F": 1, "B": 0, "W": -1}), f"ZB-V P=4 M=8: in flight {got}"


@pytest.mark.exercise("3.8", points=2)
def test_peak_memory_of_zb_h1_is_p_minus_s_m_b_plus_s_m_w():
    """Check peak_activation_memory: ZB-H1's stage s peaks at (P−s)·M_B + s·M_W for M ≥ P
    (Qi et al. §2.1: never above 1F1B's first stage, P·M_B), the split 1F1B at (P−s)·M_B; for a
    GPT layer's M_B = 34, M_W = 32 (units of s·b·h bytes, Table 1) and Fractions (thirds too,
    which no float holds: the peaks of Fractions are exact Fractions); and on torch's ZB-V plan
    the same running sum computed here."""
    from labkit.lab3.zero_bubble import SplitAction, peak_activation_memory, zb_h1_schedule

    for P, M in SIZES:
        for m_b, m_w in ((34, 32), (1, 0), (Fraction(5, 2), Fraction(3, 2)), (Fraction(7, 3), Fraction(5, 3)),
                         (3, 3)):
            got = peak_activation_memory(zb_h1_schedule(P, M), m_b, m_w)
            want = [(P - s) * m_b + s * m_w for s in range(P)]
            assert got == want, (f"ZB-H1 P={P} M={M} M_B={m_b} M_W={m_w}: peaks {got}, expected "
                                 f"(P−s)·M_B + s·M_W = {want}: does B free M_B − M_W and W the rest?")
            split = peak_activation_memory(one_f_one_b_split(P, M), m_b, m_w)
            assert split == [(P - s) * m_b for s in range(P)], f"split 1F1B P={P} M={M}: peaks {split}"
    plan = torch_zero_bubble_order("zbv", 3, 6)
    got = peak_activation_memory([[SplitAction(*a) for a in row] for row in plan], 34, 32)
    assert got == running_peaks(plan, {"F": 34, "B": -2, "W": -32}), f"ZB-V P=3 M=6: peaks {got}"


@pytest.mark.exercise("3.8", points=1)
def test_simulate_split_reports_a_deadlock():
    """Check an order that can never run (rank 0 runs W0 before the B0 it needs; stage 1's B0
    waits on nothing) raises ValueError mentioning a deadlock instead of looping."""
    from labkit.lab3.zero_bubble import SplitAction as A, simulate_split

    stuck = [[A("F", 0, 0), A("W", 0, 0), A("B", 0, 0)], [A("F", 0, 1), A("B", 0, 1), A("W", 0, 1)]]
    with pytest.raises(ValueError, match="deadlock"):
        simulate_split(stuck)


# ---------------------------------------------------------------- given code (not graded)

@pytest.mark.parametrize("schedule", [[], [[]], "zb", [[("F", 0, 0)]],
                                      [[("F", 0, 0), ("B", 0, 0), ("W", 0, 0)], [("F", 0, 0)]],
                                      [[("X", 0, 0)]]])
def test_bad_schedules_are_refused_naming_the_argument(schedule):
    from labkit.lab3.zero_bubble import validate_split

    with pytest.raises(ValueError, match="schedule|stage"):
        validate_split(schedule)


def test_bad_arguments_are_refused_naming_them():
    from labkit.lab3.zero_bubble import peak_activation_memory, simulate_split

    one = [[("F", 0, 0), ("B", 0, 0), ("W", 0, 0)]]
    with pytest.raises(ValueError, match="weight_cost"):
        simulate_split(one, 1, 1, 0)
    with pytest.raises(ValueError, match="m_w"):
        peak_activation_memory(one, 1, 2)
    with pytest.raises(ValueError, match="m_b"):
        peak_activation_memory(one, -1, 0)
    for bad in (float("nan"), float("inf")):  # NaN compared as neither < 0 nor > m_w: peaks [0]
        with pytest.raises(ValueError, match="m_b must be a finite number"):
            peak_activation_memory(one, bad, 0)
        with pytest.raises(ValueError, match="m_w must be a finite number"):
            peak_activation_memory(one, 1, bad)


def test_reference_plans_match_what_torch_executes_for_zbv():
    """The ZB-V plan used above is what ScheduleZBVZeroBubble runs on gloo ranks."""
    from labkit.ranks import launch
    from labkit.reference.lab3 import record_torch_zero_bubble

    assert launch(record_torch_zero_bubble, 2, "zbv", 4, timeout=90) == torch_zero_bubble_order("zbv", 2, 4)


def test_torch_zbv_bubble_with_unit_costs_is_p_minus_1_slots():
    """A fact the chapter states, from torch's own ZB-V plan and the longest path (no student
    code): with F = B = W = 1 and M ≥ 2P − 1 the makespan is 6M + P − 1."""
    for P, M in itertools.product(range(2, 6), range(1, 13)):
        if M >= 2 * P - 1:
            assert longest_path(torch_zero_bubble_order("zbv", P, M), dict(F=1, B=1, W=1)) == 6 * M + P - 1
