"""Graders of Lab 3, exercise 3.5 (labs/03_parameters.ipynb): pipeline schedules.

References nobody in this course wrote: the bubble formula (P−1)/(M+P−1) of Huang et al. (2019)
with unit costs, exact as a Fraction; the in-flight bounds (M for GPipe, P−s for 1F1B on stage s,
Narayanan et al. 2021); a brute-force dependency check written here; and the order of actions
that ``torch.distributed.pipelining``'s ScheduleGPipe and Schedule1F1B *execute* on real gloo
ranks (recorded by wrapping the stage's forward and backward; in torch 2.13
``Schedule1F1B.pipeline_order`` is wrong for the last rank, so what runs is the reference).
Interleaved 1F1B (v chunks per rank, Narayanan et al. 2021 §2.2): the bubble
(P−1)/(v·M+P−1) with unit costs per chunk action for M ≥ P, 1 − vM/(vP+M−1) for M < P (derived
below), a brute-force
scan over the v·P virtual stages, and the order ScheduleInterleaved1F1B executes on gloo.
Everything is integer or exact rational: no tolerance.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

SIZES = [(1, 1), (2, 1), (2, 4), (4, 4), (4, 8), (3, 7), (8, 3)]


def brute_force_violations(spans_by_stage):
    """Independent check: every dependency of every span, by scanning all spans."""
    spans = [sp for row in spans_by_stage for sp in row]
    P = len(spans_by_stage)
    bad = []
    for sp in spans:
        kind, m = sp.action
        need = [(sp.stage - 1, "F")] if kind == "F" and sp.stage > 0 else []
        if kind == "B":
            need = [(sp.stage, "F")] + ([(sp.stage + 1, "B")] if sp.stage < P - 1 else [])
        for stage, k in need:
            dep = [d for d in spans if d.stage == stage and d.action == (k, m)]
            if len(dep) != 1 or not dep[0].end <= sp.start:  # NaN times are violations too
                bad.append((sp, stage, k))
    for row in spans_by_stage:
        for a in row:
            for b in row:
                if a is not b and not (a.start >= b.end or b.start >= a.end):  # NaN overlaps
                    bad.append((a, b))
    return bad


@pytest.mark.exercise("3.5", points=1)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_each_stage_runs_every_action_once_in_microbatch_order(kind):
    """Check each stage's list holds F0..F(M−1) and B0..B(M−1) once each, each kind in order."""
    from labkit.lab3.pipeline_schedule import make_schedule

    for P, M in SIZES:
        sched = make_schedule(kind, P, M)
        assert len(sched) == P, f"{kind} P={P} M={M}: {len(sched)} stage lists, expected {P}"
        for s, actions in enumerate(sched):
            fs = [m for k, m in actions if k == "F"]
            bs = [m for k, m in actions if k == "B"]
            assert fs == list(range(M)) and bs == list(range(M)), (
                f"{kind} P={P} M={M} stage {s}: forwards {fs}, backwards {bs}, expected 0..{M - 1} "
                "once each in order")


@pytest.mark.exercise("3.5", points=2)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1(kind):
    """Check the simulated bubble with unit costs (F = B = 1, and F = 1, B = 2) is exactly
    (P−1)/(M+P−1) and the makespan (M+P−1)(F+B)."""
    from labkit.lab3.pipeline_schedule import make_schedule, simulate

    for P, M in SIZES:
        for f, b in ((1, 1), (1, 2)):
            tl = simulate(make_schedule(kind, P, M), f, b)
            want = Fraction(P - 1, M + P - 1)
            assert tl.makespan == (M + P - 1) * (f + b), (
                f"{kind} P={P} M={M} F={f} B={b}: makespan {tl.makespan}, expected (M+P−1)(F+B) = "
                f"{(M + P - 1) * (f + b)}: does each action start as soon as its stage is free and "
                "its dependencies have ended?")
            assert tl.bubble == want, (f"{kind} P={P} M={M} F={f} B={b}: bubble {tl.bubble}, expected "
                                       f"(P−1)/(M+P−1) = {want}: is the idle share 1 − busy/(P·makespan)?")


@pytest.mark.exercise("3.5", points=1)
def test_in_flight_is_m_for_gpipe_and_p_minus_s_for_1f1b():
    """Check each stage's peak micro-batches in flight: M under GPipe, min(P−s, M) under 1F1B."""
    from labkit.lab3.pipeline_schedule import make_schedule, simulate

    for P, M in SIZES:
        g = simulate(make_schedule("gpipe", P, M)).in_flight
        o = simulate(make_schedule("1f1b", P, M)).in_flight
        assert g == [M] * P, f"GPipe P={P} M={M}: in flight {g}, expected M on every stage = {[M] * P}"
        want = [min(P - s, M) for s in range(P)]
        assert o == want, (f"1F1B P={P} M={M}: in flight {o}, expected min(P−s, M) = {want}: how many "
                           "forwards does stage s run before its first backward?")


@pytest.mark.exercise("3.5", points=1)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_simulated_timelines_respect_every_dependency(kind):
    """Check the simulated timeline against a brute-force dependency scan written here."""
    from labkit.lab3.pipeline_schedule import make_schedule, simulate

    for P, M in SIZES:
        tl = simulate(make_schedule(kind, P, M), 1, 2)
        bad = brute_force_violations(tl.spans)
        assert not bad, f"{kind} P={P} M={M}: the timeline breaks dependencies: {bad[:3]}"
        assert sum(len(r) for r in tl.spans) == 2 * P * M, f"{kind}: not every action was placed"


@pytest.mark.exercise("3.5", points=1)
def test_checker_finds_a_broken_dependency_and_accepts_a_good_timeline():
    """Check check_dependencies: [] on a valid timeline; a violation naming the stage and both
    actions when F of stage 1 starts before F of stage 0 ends, B before the next stage's B, or
    two spans overlap."""
    from labkit.lab3.pipeline_schedule import Action, Span, Timeline, check_dependencies, make_schedule, simulate

    good = simulate(make_schedule("1f1b", 3, 4))
    assert check_dependencies(good) == [], f"a valid timeline reported {check_dependencies(good)}"
    P0 = [Span(0, Action("F", 0), 0, 1), Span(0, Action("B", 0), 3, 4)]
    early_f = Timeline([P0, [Span(1, Action("F", 0), 0, 1), Span(1, Action("B", 0), 1, 2)]], 4, 0, [1, 1])
    early_b = Timeline([[Span(0, Action("F", 0), 0, 1), Span(0, Action("B", 0), 2, 3)],
                        [Span(1, Action("F", 0), 1, 2), Span(1, Action("B", 0), 2, 3)]], 3, 0, [1, 1])
    overlap = Timeline([[Span(0, Action("F", 0), 0, 1), Span(0, Action("F", 1), 0, 1),  # F0 ∥ F1
                         Span(0, Action("B", 0), 1, 2), Span(0, Action("B", 1), 2, 3)]], 3, 0, [2])
    for name, tl in (("stage 1 F0 before stage 0 F0 ends", early_f),
                     ("stage 0 B0 before stage 1 B0 ends", early_b), ("overlapping spans", overlap)):
        found = check_dependencies(tl)
        assert found, f"{name}: check_dependencies returned [] for a broken timeline"
        assert all(isinstance(v, str) for v in found), f"{name}: violations must be strings, got {found}"


@pytest.mark.exercise("3.5", points=1)
def test_checker_reports_a_dependency_that_never_runs_and_accepts_back_to_back_spans():
    """Check check_dependencies on three stages: a timeline from which stage 1's F2 and B2 are
    missing breaks the dependencies of stage 2's F2 and of stage 0's B2 (they wait on an action
    that never runs: reported, naming stage 1 and F2 or B2); a valid timeline whose spans touch
    end to start (a stage's next action starting exactly when the previous one ends) is []."""
    from labkit.lab3.pipeline_schedule import Timeline, check_dependencies, make_schedule, simulate

    good = simulate(make_schedule("gpipe", 3, 4))
    touching = [(a, b) for row in good.spans for a, b in zip(row, row[1:]) if a.end == b.start]
    assert touching and check_dependencies(good) == [], (
        f"a valid timeline with {len(touching)} back-to-back spans (one starts when the previous ends) "
        f"was reported: {check_dependencies(good)[:3]}")
    spans = [list(row) for row in good.spans]
    spans[1] = [sp for sp in spans[1] if sp.action[1] != 2]
    broken = Timeline(spans, good.makespan, good.bubble, good.in_flight)
    found = check_dependencies(broken)
    assert found, ("stage 1's F2 and B2 never run, yet check_dependencies returned []: stage 2's F2 and "
                   "stage 0's B2 wait on them (a dependency with no span is a violation)")
    named = [v for v in found if "stage 1" in v and ("F2" in v or "B2" in v)]
    assert named, f"the violations {found} do not name the missing stage 1 F2 / B2"


@pytest.mark.exercise("3.5", points=1)
def test_checker_does_not_depend_on_the_order_of_the_spans():
    """Check check_dependencies on timelines whose spans are listed in any order within a stage
    (a Timeline built by hand, or merged from several sources, need not be sorted by time): on 20
    shuffles of each, a valid timeline (GPipe, 1F1B) is still [], and broken ones — two spans of a
    stage that overlap, a forward that starts before the previous stage's ends — are still
    reported. The verdict of a brute-force scan written here decides which is which."""
    import random

    from labkit.lab3.pipeline_schedule import Action, Span, Timeline, check_dependencies, make_schedule, simulate

    A = Action
    cases = {f"{kind} P=3 M=4": simulate(make_schedule(kind, 3, 4)) for kind in ("gpipe", "1f1b")}
    # stage 0 runs F1 while F0 runs ([0, 2) and [1, 3)): they are not neighbours in every order
    cases["overlapping forwards"] = Timeline(
        [[Span(0, A("F", 0), 0, 2), Span(0, A("F", 1), 1, 3), Span(0, A("B", 0), 6, 7), Span(0, A("B", 1), 7, 8)],
         [Span(1, A("F", 0), 3, 4), Span(1, A("F", 1), 4, 5), Span(1, A("B", 0), 5, 6), Span(1, A("B", 1), 6, 7)]],
        8, 0, [2, 1])
    # stage 1 starts F1 at 2, before stage 0's F1 ends at 3
    cases["early forward"] = Timeline(
        [[Span(0, A("F", 0), 0, 1), Span(0, A("F", 1), 1, 3), Span(0, A("B", 0), 5, 6), Span(0, A("B", 1), 6, 7)],
         [Span(1, A("F", 0), 1, 2), Span(1, A("F", 1), 2, 3), Span(1, A("B", 0), 3, 4), Span(1, A("B", 1), 4, 5)]],
        7, 0, [2, 1])
    rng = random.Random(0)
    for name, tl in cases.items():
        broken = bool(brute_force_violations(tl.spans))
        for trial in range(20):
            rows = [rng.sample(row, len(row)) for row in tl.spans]
            found = check_dependencies(Timeline(rows, tl.makespan, tl.bubble, tl.in_flight))
            order = [[f"{sp.action.kind}{sp.action.microbatch}@{sp.start}" for sp in row] for row in rows]
            if broken:
                assert found, (f"{name}, spans listed as {order}: check_dependencies returned [] for a "
                               f"broken timeline: compare spans by their times, not by their place in the list")
            else:
                assert found == [], (f"{name} (valid), spans listed as {order}: check_dependencies reports "
                                     f"{found[:2]}: do you assume each stage's spans come sorted by start?")


@pytest.mark.exercise("3.5", points=2)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,M", [(2, 3), (4, 6)])
def test_order_equals_what_torch_pipelining_executes(kind, P, M):
    """Check each stage's order equals the actions torch.distributed.pipelining's ScheduleGPipe /
    Schedule1F1B execute on P real gloo ranks (one stage each)."""
    from labkit.ranks import launch
    from labkit.lab3.pipeline_schedule import make_schedule
    from labkit.reference.lab3 import record_torch_schedule

    ran = launch(record_torch_schedule, P, kind, M, timeout=90)
    mine = make_schedule(kind, P, M)
    for s in range(P):
        fmt = lambda acts: " ".join(f"{k}{m}" for k, m in acts)  # noqa: E731
        assert list(mine[s]) == ran[s], (f"{kind} P={P} M={M} stage {s}: your order {fmt(mine[s])}, "
                                         f"torch runs {fmt(ran[s])}")


# ---------------------------------------------------------------- interleaved 1F1B

# (P, M, v) with M >= P; M = 5 on P = 4 is torch's relaxed rounds (R = 5), 9 on 3 three rounds.
INTERLEAVED = [(2, 2, 2), (2, 4, 3), (3, 3, 2), (3, 9, 2), (4, 4, 2), (4, 5, 2), (4, 8, 3)]


def virtual_violations(spans_by_stage, v):
    """Independent check over virtual stages: chunk c of rank s is virtual stage c·P + s; F of
    m there needs F of m on virtual stage − 1 ended, B needs its own F and B on virtual stage + 1."""
    P = len(spans_by_stage)
    at = {}
    for row in spans_by_stage:
        for sp in row:
            kind, m, c = sp.action
            at[(c * P + sp.stage, kind, m)] = sp
    bad = []
    for (vs, kind, m), sp in at.items():
        need = [(vs - 1, "F")] if kind == "F" and vs > 0 else []
        if kind == "B":
            need = [(vs, "F")] + ([(vs + 1, "B")] if vs < v * P - 1 else [])
        for w, k in need:
            dep = at.get((w, k, m))
            if dep is None or not dep.end <= sp.start:  # NaN times are violations too
                bad.append((sp, w, k))
    for row in spans_by_stage:
        ordered = sorted(row, key=lambda sp: sp.start)
        bad += [(a, b) for a, b in zip(ordered, ordered[1:]) if not b.start >= a.end]
    return bad


@pytest.mark.exercise("3.5", points=1)
def test_interleaved_runs_every_chunk_action_once_in_microbatch_order():
    """Check each rank's interleaved list holds F and B of every (micro-batch, chunk) once, each
    chunk's forwards and backwards in micro-batch order."""
    from labkit.lab3.pipeline_schedule import make_schedule

    for P, M, v in INTERLEAVED:
        sched = make_schedule("interleaved", P, M, v)
        assert len(sched) == P, f"interleaved P={P} M={M} v={v}: {len(sched)} rank lists, expected {P}"
        for s, actions in enumerate(sched):
            for c in range(v):
                for kind in "FB":
                    ms = [a[1] for a in actions if a[0] == kind and a[2] == c]
                    assert ms == list(range(M)), (
                        f"interleaved P={P} M={M} v={v} rank {s} chunk {c}: {kind} of micro-batches "
                        f"{ms}, expected 0..{M - 1} once each in order")


@pytest.mark.exercise("3.5", points=2)
def test_interleaved_bubble_is_p_minus_1_over_v_m_plus_p_minus_1():
    """Check the interleaved bubble with unit costs per chunk action (F = B = 1, F = 1 and B = 2,
    F = 2 and B = 3) is exactly (P−1)/(v·M+P−1) and the makespan (v·M+P−1)(F+B) for M ≥ P; and
    for M < P (one round of M micro-batches) the makespan (v·P+M−1)(F+B).

    Derivation (Narayanan et al. 2021 §2.2): a chunk action costs 1/v of a stage's; the pipeline
    still fills and drains through P ranks, P−1 forward and P−1 backward slots of idle time per
    rank, each now a chunk's: idle (P−1)(F+B) next to busy v·M(F+B). With M < P a round is
    shorter than the trip around the P ranks, and each of the v·P virtual stages costs a slot:
    makespan (v·max(M, P) + min(M, P) − 1)(F+B) in both cases (simulated for P ≤ 8, v ≤ 4,
    M ≤ 3P + 1, all equal)."""
    from labkit.lab3.pipeline_schedule import make_schedule, simulate

    small = [(4, 1, 2), (4, 3, 2), (4, 2, 3), (3, 2, 2)]  # M < P
    for P, M, v in INTERLEAVED + small:
        for f, b in ((1, 1), (1, 2), (2, 3)):
            tl = simulate(make_schedule("interleaved", P, M, v), f, b)
            slots = v * max(M, P) + min(M, P) - 1
            want = 1 - Fraction(v * M, slots)
            assert tl.makespan == slots * (f + b), (
                f"interleaved P={P} M={M} v={v} F={f} B={b}: makespan {tl.makespan}, expected "
                f"(v·max(M,P)+min(M,P)−1)(F+B) = {slots * (f + b)}: do chunk c+1's forwards on rank 0 "
                "wait for chunk c on rank P−1, and is the warm-up long enough?")
            assert tl.bubble == want, (f"interleaved P={P} M={M} v={v}: bubble {tl.bubble}, expected "
                                       f"{want}" + (" = (P−1)/(vM+P−1)" if M >= P else ""))


@pytest.mark.exercise("3.5", points=1)
def test_interleaved_timelines_respect_every_virtual_stage_dependency():
    """Check simulated interleaved timelines against a brute-force scan over the v·P virtual
    stages written here, and that check_dependencies finds a chunk that starts too early."""
    from labkit.lab3.pipeline_schedule import ChunkAction, Span, Timeline, check_dependencies, make_schedule, simulate

    for P, M, v in INTERLEAVED:
        tl = simulate(make_schedule("interleaved", P, M, v), 1, 2)
        bad = virtual_violations(tl.spans, v)
        assert not bad, f"interleaved P={P} M={M} v={v}: the timeline breaks dependencies: {bad[:3]}"
        assert check_dependencies(tl) == [], (
            f"interleaved P={P} M={M} v={v}: check_dependencies reports {check_dependencies(tl)[:2]} "
            "on a valid timeline")
    # P = 2, v = 2, M = 1: rank 0 chunk 1 (virtual stage 2) runs F0 before rank 1 chunk 0 ends it
    A = ChunkAction
    early = Timeline([[Span(0, A("F", 0, 0), 0, 1), Span(0, A("F", 0, 1), 1, 2),
                       Span(0, A("B", 0, 1), 4, 5), Span(0, A("B", 0, 0), 6, 7)],
                      [Span(1, A("F", 0, 0), 1, 2), Span(1, A("F", 0, 1), 2, 3),
                       Span(1, A("B", 0, 1), 3, 4), Span(1, A("B", 0, 0), 5, 6)]], 7, 0, [2, 2])
    found = check_dependencies(early)
    assert found, ("rank 0 chunk 1 F0 starts at 1, before rank 1 chunk 0 F0 ends at 2: "
                   "check_dependencies returned [] (chunk c of rank s is virtual stage c·P + s)")


@pytest.mark.exercise("3.5", points=2)
@pytest.mark.parametrize("P,M,v", [(2, 4, 2), (3, 3, 2), (4, 5, 2)])
def test_interleaved_order_equals_what_torch_pipelining_executes(P, M, v):
    """Check each rank's interleaved order equals the actions ScheduleInterleaved1F1B executes on
    P real gloo ranks, v stages (chunks) each."""
    from labkit.ranks import launch
    from labkit.lab3.pipeline_schedule import make_schedule
    from labkit.reference.lab3 import record_torch_schedule

    ran = launch(record_torch_schedule, P, "interleaved", M, num_chunks=v, timeout=90)
    mine = make_schedule("interleaved", P, M, v)
    fmt = lambda acts: " ".join(f"{k}{m}c{c}" for k, m, c in acts)  # noqa: E731
    for s in range(P):
        assert list(mine[s]) == ran[s], (f"interleaved P={P} M={M} v={v} rank {s}: your order "
                                         f"{fmt(mine[s])}, torch runs {fmt(ran[s])}")


@pytest.mark.parametrize("args,name", [(("zb", 2, 2), "kind"), (("gpipe", 0, 2), "num_stages"),
                                       (("1f1b", 2, 0), "num_microbatches"),
                                       (("gpipe", 2, 2, 2), "num_chunks"),
                                       (("interleaved", 2, 2, 1), "num_chunks"),
                                       (("interleaved", 4, 9, 2), "num_microbatches")])
def test_bad_arguments_raise_value_error_naming_them(args, name):
    from labkit.lab3.pipeline_schedule import make_schedule

    with pytest.raises(ValueError, match=name):
        make_schedule(*args)


def test_simulate_rejects_bad_costs_and_deadlocks():
    from labkit.lab3.pipeline_schedule import Action, simulate

    with pytest.raises(ValueError, match="forward_cost"):
        simulate([[Action("F", 0), Action("B", 0)]], 0, 1)
    # stage 0 runs B0 before F... impossible order: B0 first waits for F0 of its own stage
    with pytest.raises(ValueError, match="deadlock"):
        simulate([[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]])


def test_check_dependencies_refuses_what_is_not_a_timeline():
    """Given check: a list of spans (not simulate's Timeline) is a TypeError naming timeline."""
    from labkit.lab3.pipeline_schedule import check_dependencies

    with pytest.raises(TypeError, match="timeline"):
        check_dependencies([])


def test_reference_recording_survives_garbage_in_the_shape_inference_forward():
    """torch.distributed.pipelining's first step runs a non-first stage's forward on torch.empty
    memory (PipelineStage._to_tensor): the recording stage must not raise on a NaN there (it did:
    "cannot convert float NaN to integer", a grader that failed at random)."""
    from labkit.reference.lab3 import _TaggedStage

    log = []
    x = torch.full((2, 5), float("nan"))
    _TaggedStage(4, log)(x)
    assert log == [("F", -1)]


@pytest.mark.parametrize("schedule", [[[]], [[], []], [], "gpipe"])
def test_simulate_refuses_schedules_without_work_naming_the_argument(schedule):
    """Issue 27.8: ``simulate([[]])`` raised ZeroDivisionError from the bubble's Fraction."""
    from labkit.lab3.pipeline_schedule import simulate

    with pytest.raises(ValueError, match="schedule"):
        simulate(schedule)
