"""Graders of lab 5's exercises 5.1–5.3 (labs/05_activations.ipynb): checkpointing schedules.

References nobody in this course wrote: ``torch.utils.checkpoint`` and the plain model (same
weights) for gradients, ``FlopCounterMode`` for FLOPs, ``MemTracker`` (via ``labkit.measure``)
for bytes, and brute-force search and a step-by-step simulation (tests/_lab5_helpers.py) for
the schedulers. Tolerances: see tests/_lab5_helpers.py.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from labkit.measure import count_flops, measure_step, saved_activation_bytes
from _lab5_helpers import one_thread  # noqa: F401  (autouse fixture)
from _lab5_helpers import GRAD_TOL, B, T, C, small_gpt, simulate_schedule, all_schedules, least_recompute, block_saved_bytes, blocks_step, blocks_memory, model_grads, data, refuses
from _given import as_given


# ---------------------------------------------------------------- 5.1 sqrt_schedule, cost

@pytest.mark.exercise("5.1", points=2)
def test_schedule_cost_matches_a_step_by_step_simulation():
    """Check schedule_cost against walking forward and backward through every schedule."""
    from labkit.lab5.checkpointing import Schedule, schedule_cost
    schedule_cost = as_given(schedule_cost)

    rng = random.Random(0)
    for n_layers in range(1, 6):
        for _ in range(4):
            act = [rng.randint(1, 20) for _ in range(n_layers)]
            inp = [rng.randint(0, a) for a in act]
            flops = [rng.randint(1, 9) for _ in range(n_layers)]
            for segments in all_schedules(n_layers):
                cost = schedule_cost(Schedule(n_layers, segments), act, inp, flops)
                peak, recompute = simulate_schedule(n_layers, segments, act, inp, flops)
                assert cost.peak == peak, (
                    f"schedule {segments} (act_bytes={act}, input_bytes={inp}): peak "
                    f"{cost.peak:g}, the step-by-step walk says {peak:g}: during a segment's "
                    f"recompute, are the bytes of the layers before it counted? Is a kept "
                    f"checkpoint charged its input only? Is the end of forward a candidate?")
                assert cost.recompute == recompute, (
                    f"schedule {segments} (flops={flops}): recompute {cost.recompute:g}, "
                    f"expected {recompute:g} = the flops of every layer inside a segment")


@pytest.mark.exercise("5.1", points=2)
def test_sqrt_schedule_cuts_ceil_sqrt_segments_covering_every_layer():
    """Check ⌈√L⌉ contiguous segments, lengths within one of each other, longer ones first."""
    from labkit.lab5.checkpointing import sqrt_schedule

    for n_layers in range(1, 50):
        schedule = sqrt_schedule(n_layers)
        segments = schedule.segments
        want = math.isqrt(n_layers - 1) + 1  # ⌈√L⌉ in integers, exact for every L
        assert schedule.n_layers == n_layers, f"L={n_layers}: schedule.n_layers={schedule.n_layers}"
        assert len(segments) == want, (
            f"L={n_layers}: {len(segments)} segments {segments}, expected ⌈√L⌉ = {want}: "
            f"floor instead of ceiling, or float rounding of √L?")
        assert segments[0][0] == 0 and segments[-1][1] == n_layers and all(
            a[1] == b[0] for a, b in zip(segments, segments[1:])), (
            f"L={n_layers}: segments {segments} must cover 0..{n_layers} without gaps")
        lengths = [stop - start for start, stop in segments]
        assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True), (
            f"L={n_layers}: segment lengths {lengths} must differ by at most one, longer first")


@pytest.mark.exercise("5.1", points=1)
def test_sqrt_schedule_predicts_its_peak_and_one_extra_forward():
    """Check the predicted peak (unit layers) against the simulation: ≤ 2⌈√L⌉; recompute = L."""
    from labkit.lab5.checkpointing import sqrt_schedule

    for n_layers in range(1, 50):
        schedule = sqrt_schedule(n_layers)
        ones = [1] * n_layers
        peak, recompute = simulate_schedule(n_layers, schedule.segments, ones, ones, ones)
        assert schedule.peak == peak, (
            f"L={n_layers}: sqrt_schedule predicts peak {schedule.peak}, the walk gives {peak} "
            f"(unit layers): predicted with schedule_cost on all-ones costs?")
        assert schedule.recompute == recompute == n_layers, (
            f"L={n_layers}: recompute {schedule.recompute}, expected L = {n_layers} (one extra "
            f"forward)")
        assert peak <= 2 * math.ceil(math.sqrt(n_layers)), f"L={n_layers}: peak {peak} > 2⌈√L⌉"


@pytest.mark.exercise("5.1", points=1)
def test_sqrt_schedule_and_schedule_cost_reject_bad_arguments():
    """Check ValueError naming the argument for n_layers < 1 or not an int, and bad cost arrays."""
    from labkit.lab5.checkpointing import Schedule, schedule_cost, sqrt_schedule
    schedule_cost = as_given(schedule_cost)

    for bad in (0, -3, 2.5, "4"):
        with pytest.raises(ValueError, match="n_layers"):
            sqrt_schedule(bad)
    with pytest.raises(ValueError, match="act_bytes"):
        schedule_cost(Schedule(3, ()), [1, 2], [1, 1, 1], [1, 1, 1])
    with pytest.raises(ValueError, match="flops"):
        schedule_cost(Schedule(2, ()), [1, 2], [1, 1], [1, -1])


# ------------------------------------------------------------------ 5.2 apply_schedule
# Seven schedules on six blocks: both ends of the spectrum, uniform ones, and segments of
# different lengths with plain blocks between them, as optimal_schedule plans them (5.3) or a
# student writes them by hand (a list of pairs: the other form apply_schedule accepts).
N6 = 6
SCHEDULES_6 = {
    "keep all (no segment)": (),
    "keep none (one segment)": ((0, 6),),
    "every block": tuple((i, i + 1) for i in range(N6)),
    "√L (3 segments of 2)": ((0, 2), (2, 4), (4, 6)),
    "non-uniform, by hand": [[0, 3], [4, 5]],
    "last block only": ((5, 6),),
    "optimal-like (2, 1, 1, then 2 kept)": ((0, 2), (2, 3), (3, 4)),
}


def _schedule_arg(segments):
    """The by-hand form stays a list of pairs; the others become a Schedule."""
    from labkit.lab5.checkpointing import Schedule

    return segments if isinstance(segments, list) else Schedule(N6, segments)


def _recomputed(segments):
    return {i for start, stop in segments for i in range(start, stop)}


def scheduled_gpt(segments, names=None):
    """small_gpt(N6) under ``segments``; ``names`` (a dict) gets {id(parameter): its name before}."""
    from labkit.lab5.checkpointing import apply_schedule

    model = small_gpt(N6)
    if names is not None:
        names.update({id(p): n for n, p in model.named_parameters()})
    returned = apply_schedule(model, _schedule_arg(segments))
    assert returned is model, "apply_schedule must return the model it changed, in place"
    return model


class _TorchCheckpointSegment(torch.nn.Module):
    """The grader's reference: PyTorch's non-reentrant checkpoint over a run of blocks."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x):
        def run(h):
            for block in self.blocks:
                h = block(h)
            return h
        return checkpoint(run, x, use_reentrant=False)


def reference_scheduled_gpt(segments):
    model = small_gpt(N6)
    blocks, layers, i = list(model.h), [], 0
    for start, stop in segments:
        layers += blocks[i:start] + [_TorchCheckpointSegment(blocks[start:stop])]
        i = stop
    model.h = torch.nn.ModuleList(layers + blocks[i:])
    return model


def forward_through_blocks(model, keep=None):
    """The blocks' forward on a fixed input; ``keep`` (a list) gets (input, output)."""
    torch.manual_seed(1)
    h = x = torch.randn(B, T, C, requires_grad=True)
    for layer in model.h:
        h = layer(h)
    if keep is not None:
        keep.append((x, h))
    return h


def _input_gradient(x, h):
    """∂(h · probe)/∂x through the graph the forward kept (a fixed probe)."""
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(2))
    (h * probe).sum().backward()
    return x.grad


_PLAIN_BLOCKS = []


def check_measured_forward(keep, label):
    """A measurement counts only for the right result: the forward whose saved bytes were counted
    must give the plain blocks' output, and backward through what it kept the plain blocks'
    input gradient (GRAD_TOL; saving the right bytes but computing the blocks without a graph,
    or not at all, earns nothing)."""
    if not _PLAIN_BLOCKS:
        plain = []
        forward_through_blocks(small_gpt(N6), plain)
        _PLAIN_BLOCKS.append((plain[0][1].detach(), _input_gradient(*plain[0])))
    want_out, want_grad = _PLAIN_BLOCKS[0]
    x, h = keep[-1]
    torch.testing.assert_close(h.detach(), want_out, **GRAD_TOL, msg=lambda m: (
        f"{label}: the output of the forward whose saved bytes were counted differs from the plain "
        f"blocks': {m} — is a block skipped or run twice?"))
    torch.testing.assert_close(_input_gradient(x, h), want_grad, **GRAD_TOL, msg=lambda m: (
        f"{label}: backward through the measured forward gives another input gradient than the "
        f"plain blocks': {m} — is a segment computed without a graph (no_grad) or detached from "
        f"its input, its saved bytes made up?"))


def assert_grads_equal_plain(model, names, expected, label):
    """Every parameter's gradient equals the plain model's (``expected``: by name; ``names``:
    {id: name} of the model before it was scheduled), GRAD_TOL."""
    for p in model.parameters():
        assert p.grad is not None, (
            f"{label}: no gradient reached {names[id(p)]}: is the segment's input "
            f"detached from the graph (or the block run under no_grad with nothing to recompute)?")
        torch.testing.assert_close(
            p.grad, expected[names[id(p)]], **GRAD_TOL,
            msg=lambda m, n=names[id(p)]: f"{label}: gradient of {n}: {m}")


@pytest.mark.exercise("5.2", points=2)
def test_scheduled_gradients_equal_the_plain_model():
    """Check loss and every gradient against the plain model (same weights), 7 schedules."""
    idx, targets = data()
    reference = model_grads(small_gpt(N6), idx, targets)
    expected = {n: p.grad for n, p in reference.named_parameters()}
    plain_loss = small_gpt(N6)(idx, targets).item()
    for label, segments in SCHEDULES_6.items():
        model = small_gpt(N6)
        names = {id(p): n for n, p in model.named_parameters()}
        from labkit.lab5.checkpointing import apply_schedule

        apply_schedule(model, _schedule_arg(segments))
        params = list(model.parameters())
        missing = len(set(names) - {id(p) for p in params})
        new = len({id(p) for p in params} - set(names))
        assert not missing and not new, (
            f"{label} {segments}: the scheduled model lacks {missing} of the given model's "
            f"{len(names)} parameters and has {new} others: keep every block, the model's own "
            f"objects (none dropped, copied or re-created)")
        loss = model(idx, targets)
        assert loss.item() == pytest.approx(plain_loss, rel=1e-6, abs=0), (
            f"{label} {segments}: loss {loss.item()!r}, the plain model's {plain_loss!r}: is a "
            f"block skipped or run twice in forward?")
        loss.backward()
        assert_grads_equal_plain(model, names, expected, f"{label} {segments}")


@pytest.mark.exercise("5.2", points=1)
def test_scheduled_gradients_with_dropout_equal_the_plain_model():
    """Check gradients with dropout p = 0.2 in training mode, same seed: the recompute must draw
    the masks forward drew (a segment of several blocks and one of a single block)."""
    from labkit.lab5.checkpointing import apply_schedule

    idx, targets = data()

    def run(segments):
        model = small_gpt(N6, dropout=0.2)
        names = {id(p): n for n, p in model.named_parameters()}
        if segments is not None:
            apply_schedule(model, list(segments))
        torch.manual_seed(11)
        model(idx, targets).backward()
        return {names[id(p)]: p.grad for p in model.parameters()}

    expected = run(None)
    segments = [[0, 3], [4, 5]]
    for name, grad in run(segments).items():
        torch.testing.assert_close(
            grad, expected[name], **GRAD_TOL,
            msg=lambda m, name=name: f"{segments} with dropout 0.2: gradient of {name}: {m} — does "
            f"the recompute draw new dropout masks (the RNG state forward used must be restored)?")


@pytest.mark.exercise("5.2", points=1)
def test_segments_use_the_non_reentrant_checkpoint():
    """Check that no node of the reentrant checkpoint (CheckpointFunctionBackward) is in the graph."""
    idx, targets = data()
    loss = scheduled_gpt(SCHEDULES_6["√L (3 segments of 2)"])(idx, targets)
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        assert "CheckpointFunction" not in type(node).__name__, (
            f"the graph holds a {type(node).__name__} node: that is the re-entrant checkpoint, "
            f"which runs its own backward inside the outer one; use the non-reentrant variant")
        stack.extend(fn for fn, _ in node.next_functions)


@pytest.mark.exercise("5.2", points=3)
def test_saved_bytes_after_forward_equal_the_cost_model_exactly():
    """Check labkit.measure.saved_activation_bytes of a forward through the blocks, 7 schedules.

    The cost model's forward end, exactly: a whole block's saved bytes a for each block outside
    the segments plus one input x per segment (a and x measured on a plain block; every block
    of the small GPT has the same shapes). The measured forward must give the plain blocks'
    output, and its saved graph their input gradient (``check_measured_forward``).
    """
    from labkit.lab5.checkpointing import Schedule, schedule_cost
    schedule_cost = as_given(schedule_cost)

    a, x = block_saved_bytes(small_gpt(1).h[0]), B * T * C * 4
    for label, segments in SCHEDULES_6.items():
        model, keep = scheduled_gpt(segments), []
        got = saved_activation_bytes(lambda: forward_through_blocks(model, keep))
        pairs = tuple(map(tuple, segments))
        kept = N6 - len(_recomputed(pairs))
        want = kept * a + len(pairs) * x
        # schedule_cost's peak is at the end of forward when no recompute exceeds it
        predicted = schedule_cost(Schedule(N6, pairs), [a] * N6, [x] * N6, [0] * N6).peak
        assert want <= predicted, (
            f"{label} {segments}: your schedule_cost (5.1) predicts a peak of {predicted:,} B, below "
            f"the {want:,} B held when forward ends ({kept} whole blocks + {len(pairs)} inputs): "
            f"fix schedule_cost first (labkit.check('5.1'))")
        assert got == want, (
            f"{label} {segments}: {got:,} B saved when forward ends, expected {want:,} = "
            f"{kept} whole blocks × {a:,} B + {len(pairs)} kept inputs × {x:,} B: does each "
            f"segment keep only its input (one checkpoint per segment, not per block)? Does "
            f"every block outside the segments run as usual?")
        check_measured_forward(keep, f"{label} {segments}")


@pytest.mark.exercise("5.2", points=2)
def test_peak_during_backward_equals_pytorch_checkpoint_over_the_same_segments():
    """Check MemTracker's activation peak and held bytes against the grader's reference.

    The reference runs the same segments through torch.utils.checkpoint in a wrapper the grader
    wrote: the same tensors, allocated and freed in the same order, so the bytes agree exactly.
    Both also sit on schedule_cost's prediction plus what the harness holds besides the blocks'
    saved tensors (the stack's output and the probe's product, one or two inputs x). The measured
    step's input gradient must be the reference step's (GRAD_TOL).
    """
    from labkit.lab5.checkpointing import Schedule, schedule_cost
    schedule_cost = as_given(schedule_cost)

    a, x = block_saved_bytes(small_gpt(1).h[0]), B * T * C * 4
    for label, segments in SCHEDULES_6.items():
        pairs = tuple(map(tuple, segments))
        grads = []
        held, peak = blocks_memory(scheduled_gpt(segments), grads)
        held_ref, peak_ref = blocks_memory(reference_scheduled_gpt(pairs), grads)
        predicted = schedule_cost(Schedule(N6, pairs), [a] * N6, [x] * N6, [0] * N6).peak
        assert (held, peak) == (held_ref, peak_ref), (
            f"{label} {segments}: activations held after forward {held:,} B and peak "
            f"{peak:,} B; torch.utils.checkpoint over the same segments gives {held_ref:,} and "
            f"{peak_ref:,}: are a segment's blocks recomputed together, each once, from its "
            f"input (not block by block, nor the whole model)?")
        assert predicted <= peak_ref <= predicted + 2 * x + 64, (
            f"{label}: PyTorch's checkpoint over the segments peaks at {peak_ref:,} B, your "
            f"schedule_cost (5.1) predicts {predicted:,} (+ up to two inputs x and 64 B of the "
            f"harness): fix schedule_cost first (labkit.check('5.1'))")
        torch.testing.assert_close(grads[0], grads[1], **GRAD_TOL, msg=lambda m: (
            f"{label} {segments}: the measured step's input gradient differs from "
            f"torch.utils.checkpoint's over the same segments: {m} — is every segment recomputed "
            f"and back-propagated through, with the graph kept from its input?"))


@pytest.mark.exercise("5.2", points=2)
def test_each_recomputed_block_runs_forward_twice_and_the_others_once():
    """Count each block's forward calls in one step (forward pre-hooks on the model's blocks):
    once in the forward, once more in backward if recomputed.

    Counted apart: a block run twice in the forward and never in backward keeps every
    activation, though its total is right. PyTorch's default early stop ends a recompute once it has what backward needs, but only
    inside the segment's last block: every recomputed block's forward is still entered once.
    """
    idx, targets = data()
    for label, segments in SCHEDULES_6.items():
        model = small_gpt(N6)
        blocks = list(model.h)
        calls = [0] * N6
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda module, args, i=i: calls.__setitem__(i, calls[i] + 1))
        from labkit.lab5.checkpointing import apply_schedule

        apply_schedule(model, _schedule_arg(segments))
        loss = model(idx, targets)
        assert calls == [1] * N6, (
            f"{label} {segments}: forward calls per block in the forward {calls}, expected one "
            f"each: a block runs again only when backward needs its activations")
        loss.backward()
        want = [2 if i in _recomputed(map(tuple, segments)) else 1 for i in range(N6)]
        assert calls == want, (
            f"{label} {segments}: forward calls per block {calls}, expected {want} (2 = "
            f"recomputed in backward): is a segment off by one, a block left out of its "
            f"segment, or a segment not checkpointed?")


@pytest.mark.exercise("5.2", points=1)
def test_recompute_flops_equal_the_recomputed_blocks_forward():
    """Check FlopCounterMode: extra FLOPs = Σ forward FLOPs of the recomputed blocks, exactly.

    Early stopping is turned off: by default PyTorch stops a recomputation as soon as it has
    every tensor backward needs, which skips each segment's last GEMM (whose output only
    flows onward); the chapter measures that saving separately. The counted step's gradients
    must be the plain model's (GRAD_TOL).
    """
    idx, targets = data()
    block_flops, _ = count_flops(small_gpt(1).h[0], torch.randn(B, T, C))

    def step_flops(model):  # (the forward's, the backward's)
        with set_checkpoint_early_stop(False):
            forward, loss = count_flops(lambda: model(idx, targets))
            backward, _ = count_flops(loss.backward)
        return forward, backward

    reference = small_gpt(N6)
    plain_forward, plain = step_flops(reference)
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for label, segments in SCHEDULES_6.items():
        names = {}
        model = scheduled_gpt(segments, names)
        forward, backward = step_flops(model)
        assert forward == plain_forward, (
            f"{label} {segments}: the forward took {forward - plain_forward:+,} FLOPs over the "
            "plain model's: a checkpointed forward computes each block once; the recompute "
            "belongs in backward")
        extra = backward - plain
        want = len(_recomputed(map(tuple, segments))) * block_flops
        assert extra == want, (
            f"{label} {segments}: {extra:+,} FLOPs over the plain step, expected {want:,} (one "
            f"forward of each recomputed block): is a block outside its segment, run twice, or "
            f"not checkpointed at all?")
        assert_grads_equal_plain(model, names, expected, f"{label} {segments}, the step whose "
                                 f"FLOPs were counted")


@pytest.mark.exercise("5.2", points=1)
def test_a_second_schedule_replaces_the_first():
    """Check √L then every block then none ([] and Schedule.none): the model runs every block,
    same parameters, exact bytes."""
    from labkit.lab5.checkpointing import Schedule, apply_schedule

    a, x = block_saved_bytes(small_gpt(1).h[0]), B * T * C * 4
    model = scheduled_gpt(SCHEDULES_6["√L (3 segments of 2)"])
    blocks = list(small_gpt(1).h)
    params = [id(p) for p in model.parameters()]
    apply_schedule(model, [[i, i + 1] for i in range(N6)])
    assert sorted(id(p) for p in model.parameters()) == sorted(params), (
        "after a second apply_schedule the model has other parameters: reuse the blocks the "
        "model already runs (a scheduled model's blocks sit inside its segments)")
    keep = []
    got = saved_activation_bytes(lambda: forward_through_blocks(model, keep))
    assert got == N6 * x, (
        f"after √L then every block: {got:,} B saved when forward ends, expected {N6 * x:,} "
        f"(six kept inputs): does the new schedule wrap the old segments instead of the "
        f"blocks themselves?")
    check_measured_forward(keep, "√L then every block")
    for empty in ([], Schedule.none(N6)):  # no segment at all: back to the plain model
        apply_schedule(model, empty)
        keep = []
        got = saved_activation_bytes(lambda: forward_through_blocks(model, keep))
        assert got == N6 * a, (
            f"after every block then {empty!r}: {got:,} B saved when forward ends, expected "
            f"{N6 * a:,} (every block keeps what it saves): does a schedule without segments "
            f"leave the previous schedule in place?")
        check_measured_forward(keep, f"every block then {empty!r}")
        assert len(model.h) == N6 and all(type(m) is type(blocks[0]) for m in model.h), (
            f"after {empty!r} model.h holds {[type(m).__name__ for m in model.h]}, expected "
            f"the {N6} plain blocks")


@pytest.mark.exercise("5.2", points=1)
def test_bad_schedules_are_refused_before_the_model_changes():
    """Check ValueError naming the schedule: unsorted, out of range, duplicate, empty, depth."""
    from labkit.lab5.checkpointing import Schedule, apply_schedule

    bad = {"unsorted": [[2, 4], [0, 2]], "past the last block": [[4, 7]],
           "negative start": [[-1, 2]], "duplicate": [[0, 2], [0, 2]],
           "overlapping": [[0, 3], [2, 4]], "empty segment": [[3, 3]],
           "sharing one block": [[0, 3], [2, 3]],
           "another depth": Schedule(5, ((0, 5),)), "a deeper plan": Schedule(7, ((0, 7),))}
    for label, schedule in bad.items():
        model = small_gpt(N6)
        before = list(model.h)
        try:
            apply_schedule(model, schedule)
        except ValueError as error:
            assert "schedule" in str(error).lower(), (
                f"{label} {schedule}: the ValueError must name the schedule, got: {error}")
        else:
            raise AssertionError(f"{label}: apply_schedule(model, {schedule}) must raise "
                                 f"ValueError on a model of {N6} blocks")
        assert list(model.h) == before, f"{label}: the model changed before the ValueError"


# ------------------------------------------------------------------ 5.3 optimal_schedule

@pytest.mark.exercise("5.3", points=3)
def test_optimal_schedule_has_the_least_recompute_a_brute_force_search_finds():
    """Check against every schedule of random chains (L ≤ 6), then against the grader's exact
    search on random chains of 30–60 layers: fits, least recompute, cost right."""
    from labkit.lab5.checkpointing import optimal_schedule
    optimal_schedule = as_given(optimal_schedule)

    def check(act, inp, flops, budget, best, chain, over_hint, best_hint):
        """The schedule fits the budget, recomputes ``best``, and predicts its own cost."""
        schedule = optimal_schedule(act, inp, flops, budget)
        peak, recompute = simulate_schedule(len(act), schedule.segments, act, inp, flops)
        assert peak <= budget, (f"{chain}, budget {budget}: {schedule.segments} peaks at {peak}, "
                                f"over the budget{': ' * bool(over_hint)}{over_hint}")
        assert recompute == best, (
            f"{chain}, budget {budget}: {schedule.segments} recomputes {recompute}, the best "
            f"schedule that fits recomputes {best}: {best_hint}")
        assert (schedule.peak, schedule.recompute) == (peak, recompute), (
            f"{chain}: {schedule.segments}: predicted (peak, recompute) = ({schedule.peak}, "
            f"{schedule.recompute}), the walk gives ({peak}, {recompute})")

    rng = random.Random(5)
    cases = 0
    while cases < 120:
        n_layers = rng.randint(1, 6)
        act = [rng.randint(1, 12) for _ in range(n_layers)]
        inp = [rng.randint(0, a) for a in act]
        flops = [rng.randint(1, 6) for _ in range(n_layers)]
        costs = {s: simulate_schedule(n_layers, s, act, inp, flops) for s in all_schedules(n_layers)}
        budget = rng.randint(min(p for p, _ in costs.values()), sum(act))
        best = min(r for p, r in costs.values() if p <= budget)
        check(act, inp, flops, budget, best, f"act={act}, input={inp}, flops={flops}",
              "is a recompute's peak (held bytes + the segment's activations) or the end of "
              "forward left out of the check?", "does the DP keep the cheapest way to reach each "
              "held-bytes state?")
        cases += 1
    # long chains: too many schedules to list (~2.4^L), so the reference is least_recompute
    # (tests/_lab5_helpers.py), an exact search over (held bytes, recompute) of each prefix;
    # integer costs, so "least" is exact. The budget is a random schedule's own peak (it fits)
    for case in range(6):  # ~1 s, most of it the exercise's own DP
        n_layers = rng.randint(30, 60)
        act = [rng.randint(1, 12) for _ in range(n_layers)]
        inp = [rng.randint(0, a) for a in act]
        flops = [rng.randint(1, 6) for _ in range(n_layers)]
        cuts = sorted(rng.sample(range(n_layers + 1), rng.randint(2, n_layers // 3)))
        some = tuple((a, b) for a, b in zip(cuts, cuts[1:]) if rng.random() < 0.7)
        budget = simulate_schedule(n_layers, some, act, inp, flops)[0]
        best = least_recompute(act, inp, flops, budget)
        check(act, inp, flops, budget, best, f"a random chain of {n_layers} layers (act={act}, "
              f"input={inp}, flops={flops})", "", "optimal means least among ALL schedules, on "
              "long chains too (a search over a family of schedules is not enough)")


@pytest.mark.exercise("5.3", points=1)
def test_optimal_schedule_fits_a_budget_equal_to_a_schedules_own_peak():
    """Check optimal_schedule(budget=schedule_cost(s).peak) succeeds with decimal costs.

    Decimal costs (0.1, 0.7, ...) are not exact in binary: a DP that adds the same numbers in
    another order than schedule_cost lands a last bit above the budget and finds nothing.
    """
    from labkit.lab5.checkpointing import Schedule, optimal_schedule, schedule_cost
    optimal_schedule, schedule_cost = as_given(optimal_schedule), as_given(schedule_cost)

    rng = random.Random(11)
    for case in range(60):
        n_layers = rng.randint(2, 7)
        act = [round(rng.uniform(0.1, 3.0), 1) + 0.1 for _ in range(n_layers)]
        inp = [round(a * rng.uniform(0.1, 0.9), 2) for a in act]
        flops = [round(rng.uniform(0.1, 2.0), 1) for _ in range(n_layers)]
        segments = rng.choice(list(all_schedules(n_layers)))
        budget = schedule_cost(Schedule(n_layers, segments), act, inp, flops).peak
        try:
            best = optimal_schedule(act, inp, flops, budget)
        except ValueError as error:
            raise AssertionError(
                f"optimal_schedule(budget={budget!r}) found nothing, yet schedule {segments} "
                f"peaks at exactly that (act={act}, input={inp}): are the held bytes summed in "
                f"another order than schedule_cost sums them?") from error
        again = schedule_cost(Schedule(n_layers, best.segments), act, inp, flops)
        assert best.peak == again.peak <= budget, (
            f"optimal_schedule says peak {best.peak!r}, schedule_cost says {again.peak!r} for "
            f"{best.segments} (budget {budget!r}): the two must agree to the last bit")


@pytest.mark.exercise("5.3", points=1)
def test_optimal_schedule_says_when_no_schedule_fits():
    """Check ValueError naming the budget below the smallest peak, and for a negative budget."""
    from labkit.lab5.checkpointing import optimal_schedule
    optimal_schedule = as_given(optimal_schedule)

    act, inp, flops = [5, 9, 4, 7], [1, 2, 1, 3], [1, 1, 1, 1]
    smallest = min(simulate_schedule(4, s, act, inp, flops)[0] for s in all_schedules(4))
    optimal_schedule(act, inp, flops, smallest)  # just fits
    with pytest.raises(ValueError, match="budget"):
        optimal_schedule(act, inp, flops, smallest - 1)
    with pytest.raises(ValueError, match="budget"):
        optimal_schedule(act, inp, flops, -1)
    with pytest.raises(ValueError, match="input_bytes|act_bytes|flops"):
        optimal_schedule(act, inp[:3], flops, 100)


@pytest.mark.exercise("5.3", points=1)
def test_optimal_schedule_beats_uniform_schedules_on_a_deep_gpt():
    """Check on 32 GPT-like layers (a = 17x): never more recompute than √L or every layer."""
    from labkit.lab5.checkpointing import Schedule, optimal_schedule
    optimal_schedule = as_given(optimal_schedule)

    n_layers, a, x, f = 32, 17, 1, 10
    act, inp, flops = [a] * n_layers, [x] * n_layers, [f] * n_layers
    for uniform in (Schedule.every_layer(n_layers),
                    Schedule(n_layers, tuple((s, min(s + 6, 32)) for s in range(0, 32, 6)))):
        peak, recompute = simulate_schedule(n_layers, uniform.segments, act, inp, flops)
        best = optimal_schedule(act, inp, flops, peak)
        assert best.recompute <= recompute and best.peak <= peak, (
            f"budget {peak}: optimal_schedule gives peak {best.peak}, recompute {best.recompute}; "
            f"a uniform schedule does {peak}, {recompute}")
    half = optimal_schedule(act, inp, flops, n_layers * a // 2)  # room for half the layers
    peak, recompute = simulate_schedule(n_layers, half.segments, act, inp, flops)
    assert peak <= n_layers * a // 2 and recompute < n_layers * f, (
        f"half the memory: peak {peak} (budget {n_layers * a // 2}), recompute {recompute} "
        f"(recomputing all would be {n_layers * f})")


def test_activation_figures_draw_and_refuse_bad_input():
    """labkit.plot_activations' schedule and sequence-parallel figures (not graded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit import plot_activations as pa

    torch.manual_seed(1)
    step = measure_step(small_gpt(1), None, (torch.randn(B, T, C, requires_grad=True),
                                             torch.randn(B, T, C)), step_fn=blocks_step)
    fig = pa.schedule_timelines({"none": step}, unit="KiB", budget=1e5)
    line = fig.axes[0].lines[0]
    assert list(line.get_ydata()) == [p.bytes["activations"] / 1024 for p in step.timeline]
    regions = [("LN", "sequence", 4.0, 2.0), ("MLP", "tensor", 8.0, 6.0),
               ("drop", "sequence", 2.0, 1.0)]
    fig2 = pa.sequence_parallel_regions(regions, t=2, unit="B")
    texts = [t.get_text() for t in fig2.axes[0].texts]
    assert texts.count("g") == 1 and texts.count("ḡ") == 1, texts  # into and out of TP
    plt.close("all")
    for call, error, name in (
            (lambda: pa.schedule_timelines({}), ValueError, "steps"),
            (lambda: pa.schedule_timelines({"x": step}, consumer="weights"), ValueError, "consumer"),
            (lambda: pa.schedule_timelines({"x": step}, unit="MB/s"), ValueError, "unit"),
            (lambda: pa.sequence_parallel_regions([("LN", "rows", 1, 1)], t=2), ValueError,
             "regions"),
            (lambda: pa.sequence_parallel_regions(regions, t=0), ValueError, "t must"),
            (lambda: pa.scaling_curves([1, 2], {"a": [1]}, xlabel="", ylabel=""), ValueError,
             "curves")):
        with pytest.raises(error, match=name):
            call()



# ---- bad input (not graded)

def _checkpointing_cases():
    from labkit.lab5 import checkpointing as c

    ones = [1, 1, 1]
    return [
        ("Schedule fractional bound", lambda: c.Schedule(4, ((0, 2.5),)), TypeError, "segments"),
        ("Schedule bound as text", lambda: c.Schedule(4, (("0", "2"),)), TypeError, "segments"),
        ("Schedule not pairs", lambda: c.Schedule(4, (1, 2)), TypeError, "segments"),
        ("Schedule overlapping", lambda: c.Schedule(4, ((0, 2), (1, 3))), ValueError, "segments"),
        ("Schedule n_layers 0", lambda: c.Schedule(0), ValueError, "n_layers"),
        ("Schedule n_layers float", lambda: c.Schedule(2.0), ValueError, "n_layers"),
        ("Schedule negative peak", lambda: c.Schedule(2, (), peak=-1), ValueError, "peak"),
        ("sqrt_schedule bool", lambda: c.sqrt_schedule(True), ValueError, "n_layers"),
        ("schedule_cost list schedule", lambda: c.schedule_cost([(0, 1)], ones, ones, ones),
         TypeError, "schedule"),
        ("schedule_cost text cost", lambda: c.schedule_cost(c.Schedule(3), ones, ones, ["a", 1, 1]),
         TypeError, "flops"),
        ("schedule_cost None cost", lambda: c.schedule_cost(c.Schedule(3), None, ones, ones),
         TypeError, "act_bytes"),
        ("schedule_cost costs as text", lambda: c.schedule_cost(c.Schedule(3), "111", ones, ones),
         TypeError, "act_bytes"),  # was read digit by digit: [1.0, 1.0, 1.0]
        ("schedule_cost nan", lambda: c.schedule_cost(c.Schedule(3), ones, ones, [1, float("nan"), 1]),
         ValueError, "flops"),
        ("schedule_cost input > act", lambda: c.schedule_cost(c.Schedule(3), ones, [1, 2, 1], ones),
         ValueError, "input_bytes"),
        ("apply_schedule name", lambda: c.apply_schedule(small_gpt(2), "sqrt"),
         TypeError, "schedule"),
        ("apply_schedule fractional pair", lambda: c.apply_schedule(small_gpt(2), [(0, 1.5)]),
         TypeError, "schedule"),
        ("apply_schedule no blocks", lambda: c.apply_schedule(torch.nn.Linear(2, 2),
                                                              c.Schedule(2)),
         TypeError, "model"),
        ("optimal_schedule budget text", lambda: c.optimal_schedule(ones, ones, ones, "10"),
         ValueError, "budget"),
        ("optimal_schedule budget nan", lambda: c.optimal_schedule(ones, ones, ones, float("nan")),
         ValueError, "budget"),
        ("optimal_schedule empty", lambda: c.optimal_schedule([], [], [], 10), ValueError,
         "act_bytes"),
    ]


def test_bad_input_is_refused_with_the_argument_named():
    """Check each public function refuses bad input with ValueError/TypeError naming it, before any
    work. The checks sit outside the exercise blocks, so this passes on the stubs: not graded."""
    refuses(_checkpointing_cases())
