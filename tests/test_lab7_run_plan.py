"""Graders of Lab 7, exercise 7.2 (labs/07_panorama.ipynb): run a plan on 4 real gloo ranks.

The lab's GPT (``lab_config("cpu")``) trains 3 steps on a batch of 16 sequences under each of the
three plans of ``labkit.lab7.run_plan.PLANS`` — ZeRO-3 over 4 replicas; TP 2 × DP 2 (plain Adam, the
replicas' gradients all-reduced); PP 2 × DP 2 (1F1B, 2 micro-batches, ZeRO-1) — all in ONE
``labkit.ranks.launch`` of 4 ranks (each plan makes its own process groups).

References nobody in this course wrote: ``torch.optim.Adam`` on one device over the whole batch,
run here in the test process (the losses); MemTracker's peak on each rank, compared with the
student's ``predict_peak`` (the memory); the plain rules of a valid plan (bad input).

Batch 16 (twice the lab's 8) so that activations dominate and every rank's peak is when backward
begins: at the update, when a collective's buffer is freed depends on gloo's worker thread (see
tests/test_cluster.py), which moves an update-time peak by up to one flat gradient buffer.

Tolerance for losses: fp32; the replicas' mean of means, TP's partial sums added by all-reduce,
the pipeline's per-micro-batch losses and the averaged gradients add the same numbers in other
orders than one device does. After two Adam steps of lr 1e-3 the losses agreed to 4e-7 (measured
on the solutions); 1e-4 is 250 times that and still well under what one wrong piece moves them
(a missing average, a tied weight not summed, a wrong slice of the batch: see the mutants).
Tolerance for peaks: 10% (the issue's), against a prediction that counts each consumer from the
chapters' formulas; the solution's prediction is within 6% on every rank. The harness measures
with ``labkit.tracker.Tracker``, which lets a module's leaf inputs go: PyTorch's MemTracker by
itself keeps every received activation of a pipeline stage (and its gradient) alive from step to
step, and the later stages' peaks grew with the number of steps run (tests/test_measure.py).
"""
from __future__ import annotations

import copy
import functools
import math
import re

import pytest
import torch

from labkit.models import GPT, SyntheticData, lab_config


def _worst(got, want) -> float:
    """The largest |a − b| of two loss curves; inf where either is NaN (Python's max skips a
    NaN that is not first, and NaN < tol is False only when it is the result)."""
    gaps = [abs(a - b) for a, b in zip(got, want)]
    return math.inf if any(math.isnan(g) for g in gaps) else max(gaps)


STEPS, BATCH, WORLD = 3, 16, 4
CFG = lab_config("cpu")
LOSS_TOL = 1e-4
PEAK_TOL = 0.10
NAMES = ("zero3x4", "tp2xdp2", "pp2xdp2")
GRAD_TOL = 1e-4  # relative: fp32 norms of the same gradient summed in another order


def _setup():
    torch.manual_seed(0)
    model = GPT(CFG)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    data = SyntheticData(CFG.vocab_size, CFG.block_size, BATCH, seed=0)
    return model, state, [data.batch(i) for i in range(STEPS)]


@functools.lru_cache(maxsize=1)
def runs() -> dict:
    """{plan name: per-rank results of run_plans_worker}: one launch for the three plans."""
    from labkit.ranks import launch
    from labkit.harness.lab7 import run_plans_worker
    from labkit.lab7.run_plan import PLANS

    _, state, batches = _setup()
    plans = [PLANS[n] for n in NAMES] + list(EXTRA.values())
    results = launch(run_plans_worker, WORLD, plans, CFG, state, batches, timeout=240)
    return {n: [rank[i] for rank in results] for i, n in enumerate(NAMES + tuple(EXTRA))}


def plan_of(name):
    from labkit.lab7.run_plan import PLANS

    return PLANS[name] if name in PLANS else EXTRA[name]


def one_device_grad_norms(lo: int, hi: int) -> dict:
    """Norms of the probes' gradients of one device's mean loss on sequences [lo, hi) of step 1
    (the tied weight: wte.weight, which holds both uses)."""
    model, _, batches = _setup()
    x, y = batches[0]
    model(x[lo:hi], y[lo:hi]).backward()
    g = {n: float(p.grad.norm()) for n, p in model.named_parameters()}
    return {"wte.weight": g["wte.weight"], "lm_head.weight": g["wte.weight"], "ln_f.weight": g["ln_f.weight"]}


def adam_losses(model, batches) -> list[float]:
    """The losses of one device training a copy of ``model`` with torch.optim.Adam (lr 1e-3)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    losses = []
    for x, y in batches:
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


@functools.lru_cache(maxsize=1)
def one_device_losses() -> list[float]:
    model, _, batches = _setup()
    return adam_losses(model, batches)


def whole_batch_losses(ranks: list[dict]) -> list[float]:
    """Per step, the mean over the replicas of the loss their computing ranks report."""
    replicas = {}
    for r in ranks:
        if r["losses"][0] is not None:
            replicas.setdefault(r["coords"]["dp"], r["losses"])
    assert replicas, "no rank reported a loss: train_step must return the replica's loss on " \
                     "the ranks that compute it (every rank without a pipeline, its last stage with one)"
    steps = len(next(iter(replicas.values())))
    return [sum(ls[s] for ls in replicas.values()) / len(replicas) for s in range(steps)]


def check_measured(name, results, want, what="peak"):
    """A measurement counts only for the right result: the run whose {what} was measured must
    have trained like one device (its mean losses against ``want``, one device's: LOSS_TOL)."""
    for step, (g, w) in enumerate(zip(whole_batch_losses(results), want), 1):
        assert abs(g - w) <= LOSS_TOL, (
            f"{name}, step {step}, the run whose {what} was measured: loss {g:.6f}, one device "
            f"{w:.6f} (|Δ| = {abs(g - w):.2e} > {LOSS_TOL:g}): the memory counts only for a run "
            "that trains right — is every replica's gradient averaged over the data-parallel "
            "group, and is every step taken?")


def _extra_plans():
    from labkit.lab7.run_plan import Plan

    # ZeRO-2 inside a TP × DP mesh: its group (the replicas) is not the world
    # GPipe: every micro-batch in flight at the first backward, one fewer at the later ones
    return {"zero2tp2xdp2": Plan(dp=2, tp=2, zero_stage=2),
            "gpipe2xdp2": Plan(dp=2, pp=2, n_micro=4, schedule="gpipe")}


EXTRA = _extra_plans()


@pytest.mark.exercise("7.2", points=1)
@pytest.mark.parametrize("name", ["tp2xdp2", "pp2xdp2"])
def test_gradients_are_the_replicas_mean_and_the_tied_copies_sum(name):
    """Check the gradients as the first step begins (Adam's update hides their scale, so the
    losses cannot): without ZeRO every rank holds the whole batch's mean-loss gradient of wte and
    ln_f; under a pipeline both copies of the tied weight (stage 0's wte, the last stage's lm_head)
    hold the sum of their two uses — of the replica's slice, or already averaged over the replicas."""
    plan = plan_of(name)
    whole = one_device_grad_norms(0, BATCH)
    per = BATCH // plan.dp
    for rank, result in enumerate(runs()[name]):
        got = {k: v for k, v in result["grad_norms"].items() if k != "recorded"}
        d = result["coords"]["dp"]
        wants = [whole] if plan.zero_stage == 0 else [whole, one_device_grad_norms(d * per, (d + 1) * per)]
        assert got, f"{name}, rank {rank}: no probe of {sorted(whole)} had a gradient when the step began"
        for key, g in got.items():
            ok = any(abs(g / w[key] - 1) <= GRAD_TOL for w in wants)
            assert ok, (
                f"{name}, rank {rank} {result['coords']}: ‖∇{key}‖ = {g:.6g} when the step began, "
                f"expected {' or '.join(f'{w[key]:.6g}' for w in wants)} (ratio "
                f"{g / whole[key]:.3f} of the whole batch's): "
                + ("the replicas' gradients summed, not averaged?" if abs(g / whole[key] - plan.dp) < 0.05 else
                   "the tied weight's two copies averaged, not summed?" if key != "ln_f.weight" and
                   any(abs(2 * g / w[key] - 1) < 0.05 for w in wants) else "a gradient of the wrong scale"))


@pytest.mark.exercise("7.2", points=2)
@pytest.mark.parametrize("name", NAMES + tuple(EXTRA))
def test_losses_equal_one_device_adam_on_the_whole_batch(name):
    """Check the plan's loss at each of 3 steps (mean over the replicas) equals one device's
    torch.optim.Adam on the whole batch: the same data, the same gradients, the same updates."""
    got, want = whole_batch_losses(runs()[name]), one_device_losses()
    for step, (g, w) in enumerate(zip(got, want), 1):
        causes = ("the replicas do not split the batch into their own consecutive slices, or the "
                  "loss is not the replica's mean" if step == 1 else
                  "the update differs from one device's: do all replicas update with the same "
                  "gradient, all-reduced over the data-parallel group (or reduce-scattered by "
                  "ZeRO)? under a pipeline, are the two copies of the tied embedding's gradient "
                  "summed? does each piece get the right process group?")
        assert abs(g - w) <= LOSS_TOL, (
            f"{name}, step {step}: loss {g:.6f}, one device {w:.6f} (|Δ| = {abs(g - w):.2e} > "
            f"{LOSS_TOL:g}): {causes}")


def peak_gaps(results: list[dict], plan, cfg, batch_size: int):
    """(rank, result, predicted bytes, measured / predicted − 1) for every rank of one plan."""
    from labkit.lab7.run_plan import predict_peak

    for rank, result in enumerate(results):
        want = predict_peak(plan, cfg, batch_size, rank)
        assert isinstance(want, int) and want > 0, f"predict_peak returned {want!r}: expected bytes (an int > 0)"
        yield rank, result, want, result["peak"] / want - 1


@pytest.mark.exercise("7.2", points=2)
@pytest.mark.parametrize("name", NAMES + ("gpipe2xdp2",))
def test_every_ranks_peak_is_within_10_percent_of_the_prediction(name):
    """Check each rank's MemTracker peak over the 3 steps is within 10% of predict_peak(plan,
    cfg, 16, rank) for that rank; and that the measured run trained like one device."""
    for rank, result, want, gap in peak_gaps(runs()[name], plan_of(name), CFG, BATCH):
        got = result["peak"]
        assert abs(gap) <= PEAK_TOL, (
            f"{name}, rank {rank} {result['coords']}: measured peak {got:,} B, predicted "
            f"{want:,} B ({gap:+.1%}, more than ±{PEAK_TOL:.0%}); at the peak: "
            + ", ".join(f"{k} {v:,}" for k, v in result["at_peak"].items() if v)
            + ": a consumer missing from the prediction (the micro-batches in flight on this "
              "stage? ZeRO's gathered unit or flat buffers? the parameters this rank really "
              "holds?), or a piece holding more than it should (full gradients kept, a unit "
              "never freed)")
    check_measured(name, runs()[name], one_device_losses())


GPIPE_TOL = 0.05  # the solution's prediction is within 1.7% on every rank of gpipe2xdp2 (B = 16, M = 4)


@pytest.mark.exercise("7.2", points=1)
def test_gpipe_later_backwards_hold_one_micro_batch_fewer():
    """Check GPipe's peak within 5%: under GPipe every micro-batch is in flight when backward
    begins, and at each later backward one fewer is, next to every gradient of the stage.
    Counting all M still in flight at the later backwards over-predicts every rank by 8.3–8.7%
    (one micro-batch's activations): 10% cannot tell, 5% can. No ZeRO here, so no flat buffer
    whose release depends on gloo's thread: the solution's prediction is within 1.7% on every
    rank. Two more counts of micro-batches
    in flight, from predict_peak alone: with M = 1 the two schedules are one (each stage runs F0
    then B0), so they must predict the same; and 1F1B's last stage runs F, B of one micro-batch at
    a time, so with b fixed its prediction must not grow with M (from M = 2 on)."""
    from labkit.lab7.run_plan import Plan, predict_peak

    for P in (2, 4):
        one = {s: [predict_peak(Plan(pp=P, schedule=s), CFG, 4, r) for r in range(P)]
               for s in ("1f1b", "gpipe")}
        assert one["1f1b"] == one["gpipe"], (
            f"P = {P}, M = 1 (batch 4): predict_peak gives {one['1f1b']} under 1F1B and "
            f"{one['gpipe']} under GPipe, stage by stage; with one micro-batch both schedules "
            "are F0 then B0 on every stage: can a stage hold more micro-batches than M?")
        # b = 4 sequences per micro-batch whatever M: the last stage holds the same tensors at
        # every M; only the step's batch of token ids grows (32·64·8·2 B = 32 KiB at M = 8, 0.3%
        # of its ~13 MB), so 5% is slack, while counting M − 1 micro-batches there is +57% at M = 4
        last = {M: predict_peak(Plan(pp=P, n_micro=M, schedule="1f1b"), CFG, 4 * M, P - 1)
                for M in (2, 4, 8)}
        assert max(last.values()) <= 1.05 * min(last.values()), (
            f"P = {P}, 1F1B, 4 sequences per micro-batch: the last stage's prediction is "
            f"{last} for M = 2, 4, 8; it runs each micro-batch's forward and backward back to "
            "back, so how many micro-batches are in flight there at a later backward?")
    for rank, result, want, gap in peak_gaps(runs()["gpipe2xdp2"], plan_of("gpipe2xdp2"), CFG, BATCH):
        assert abs(gap) <= GPIPE_TOL, (
            f"gpipe2xdp2, rank {rank} {result['coords']}: measured {result['peak']:,} B, predicted "
            f"{want:,} B ({gap:+.1%}, more than ±{GPIPE_TOL:.0%}): under GPipe, how many micro-batches "
            f"are in flight at the first backward, and how many at the later ones, when every "
            f"gradient of the stage is alive too?")
    check_measured("gpipe2xdp2", runs()["gpipe2xdp2"], one_device_losses())


UPDATE_CFG = lab_config("cpu", block_size=16)  # short sequences: the update, not backward, peaks
UPDATE_BATCH = 4


def _update_setup():
    """The 16-token lab model and its 2 batches of 4."""
    torch.manual_seed(0)
    model = GPT(UPDATE_CFG)
    data = SyntheticData(UPDATE_CFG.vocab_size, UPDATE_CFG.block_size, UPDATE_BATCH, seed=0)
    return model, [data.batch(i) for i in range(2)]


@functools.lru_cache(maxsize=1)
def update_runs() -> dict:
    """{plan name: per-rank results} for two plans without ZeRO (plain Adam: its peak does not
    move with gloo's thread) on the 16-token lab model, batch 4, 2 steps."""
    from labkit.harness.lab7 import run_plans_worker
    from labkit.lab7.run_plan import PLANS, Plan
    from labkit.ranks import launch

    model, batches = _update_setup()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plans = {"tp2xdp2": PLANS["tp2xdp2"], "dp4": Plan(dp=4)}
    results = launch(run_plans_worker, WORLD, list(plans.values()), UPDATE_CFG, state, batches,
                     timeout=240)
    return {n: ([rank[i] for rank in results], plan) for i, (n, plan) in enumerate(plans.items())}


@pytest.mark.exercise("7.2", points=1)
@pytest.mark.parametrize("name", ["tp2xdp2", "dp4"])
def test_a_peak_at_the_update_is_predicted(name):
    """Check every rank's peak within 10% of predict_peak when the update is the peak: 16-token
    sequences, 4 a step, where the activations are a few KiB and the step holds the parameters,
    every gradient, Adam's two states and its temporaries at once (the measured peak holds
    nearly all the gradients). The moment 'backward begins' alone is 16–23% low here; the
    solution's prediction is within 0.5% on every rank. The measured run must train like one
    device (its losses against torch.optim.Adam's on the same model and batches)."""
    results, plan = update_runs()[name]
    for rank, result, want, gap in peak_gaps(results, plan, UPDATE_CFG, UPDATE_BATCH):
        at = result["at_peak"]
        # the premise: the peak is at the end of backward or in the update, when (nearly) every
        # gradient is alive — gloo's timing decides whether the last one (the 128 KiB embedding's)
        # is written yet, so 90%, not all
        assert at.get("gradients", 0) >= 0.9 * at.get("parameters", 0) > 0, (
            f"test set-up: {name}'s peak was meant to be at the update (every gradient alive), got {at}")
        assert abs(gap) <= PEAK_TOL, (
            f"{name} on {UPDATE_CFG.block_size}-token sequences, batch {UPDATE_BATCH}, rank {rank}: "
            f"measured {result['peak']:,} B, predicted {want:,} B ({gap:+.1%}): at the update the "
            f"parameters, every gradient, Adam's states and the temporaries of its step are alive "
            f"at once — is that moment among those predict_peak compares?")
    check_measured(f"{name} ({UPDATE_CFG.block_size}-token sequences)", results,
                   adam_losses(*_update_setup()))


@pytest.mark.exercise("7.2", points=1)
@pytest.mark.parametrize("name", NAMES)
def test_no_full_gradient_is_left_after_the_step(name):
    """Check train_step's guarantee: after each step no parameter of the rank's module keeps a
    .grad (a zeroed gradient still holds its bytes between steps); and that the run trained like
    one device."""
    for rank, result in enumerate(runs()[name]):
        assert not result["grads_left"], (
            f"{name}, rank {rank}: after train_step {len(result['grads_left'])} parameters still "
            f"have a .grad (e.g. {result['grads_left'][:3]}): the step must leave them None "
            f"(zero_grad(set_to_none=True), or ZeRO freeing its unsharded gradients)")
    check_measured(name, runs()[name], one_device_losses(), "gradients left")


BAD_PLANS = [  # (plan fields, world_size, batch_size, the words the message must name)
    (dict(dp=3, tp=2), 4, 16, "world_size"),
    (dict(tp=3), 3, 16, "plan.tp"),
    (dict(tp=8), 8, 16, "plan.tp"),  # T | n_embd = 128 but not n_head = 4: heads decide
    (dict(pp=8), 8, 16, "plan.pp"),
    (dict(pp=3), 3, 16, "plan.pp"),  # P = 3 ≤ n_layer = 4 but not a divisor: unequal stages
    (dict(dp=4), 4, 6, "batch_size"),
    (dict(dp=2, pp=2, n_micro=4), 4, 12, "batch_size"),
    (dict(dp=2, tp=2, zero_stage=3), 4, 16, "plan.zero_stage"),
    (dict(dp=4, zero_stage=5), 4, 16, "plan.zero_stage"),
    (dict(dp=2, pp=2, n_micro=2, schedule="zigzag"), 4, 16, "plan.schedule"),
    (dict(dp=4, n_micro=2), 4, 16, "plan.n_micro"),
    (dict(dp=2, pp=2, n_micro=2, zero_stage=2), 4, 16, "plan.zero_stage"),   # ZeRO-2's hooks need the whole model
    (dict(dp=2, pp=2, n_micro=2, checkpointing=True), 4, 16, "plan.checkpointing"),
    # the docstring's other rules: plan is a Plan (None below: the dict {"dp": 4} is passed); its
    # sizes are ints >= 1 (each case breaks that rule only, or names either field it breaks);
    # ZeRO-3 without a pipeline too; checkpointing a bool
    (None, 4, 16, "plan"),
    (dict(dp=-2, tp=-2), 4, 16, "plan.dp|plan.tp"),  # product 4 = world_size, -2 divides 4 heads
    (dict(pp=2, n_micro=0), 2, 16, "plan.n_micro"),
    (dict(tp=2.0), 2, 16, "plan.tp"),  # 2.0 == 2 and 4 % 2.0 == 0: only "an int" refuses it
    (dict(pp=2, n_micro=2.0), 2, 16, "plan.n_micro"),
    (dict(dp=2, pp=2, n_micro=2, zero_stage=3), 4, 16, "plan.zero_stage"),  # ZeRO-3: no PP either
    (dict(checkpointing="yes"), 1, 16, "plan.checkpointing"),
]


def _bad_plan_id(fields, words):
    if fields is None:
        return "plan-not-a-Plan"
    return words.split("|")[0] + "-" + "-".join(f"{k}{v}" for k, v in fields.items())


@pytest.mark.exercise("7.2", points=1)
@pytest.mark.parametrize("fields, world_size, batch_size, words", BAD_PLANS,
                         ids=[_bad_plan_id(f, w) for f, _, _, w in BAD_PLANS])
def test_a_plan_the_ranks_cannot_run_is_refused_naming_the_argument(fields, world_size, batch_size, words):
    """Check check_plan (and predict_peak, which calls it) raise ValueError naming the field."""
    from labkit.lab7.run_plan import Plan, check_plan, predict_peak

    plan = {"dp": 4} if fields is None else Plan(**fields)
    # a value of the wrong type (not a Plan, a float size, a str flag) may also be a TypeError
    wrong_type = fields is None or any(type(v) not in (int, bool) for k, v in fields.items()
                                       if k != "schedule")
    expected = (TypeError, ValueError) if wrong_type else ValueError
    alternatives = words.split("|")
    wanted = "TypeError or ValueError" if wrong_type else "ValueError"
    try:
        check_plan(plan, CFG, batch_size, world_size)
    except expected as error:
        message = f"{type(error).__name__}({str(error)!r})"
        assert any(w in str(error) for w in alternatives), (
            f"check_plan({plan}, world_size={world_size}, batch_size={batch_size}) raised "
            f"{message}: the message must name {' or '.join(map(repr, alternatives))}")
    except Exception as error:  # noqa: BLE001 (an AttributeError, a ZeroDivisionError...)
        raise AssertionError(
            f"check_plan({plan}, world_size={world_size}, batch_size={batch_size}) raised "
            f"{type(error).__name__}({str(error)!r}) before refusing the plan: check the rule "
            f"first and raise {wanted} naming {' or '.join(alternatives)}") from error
    else:
        raise AssertionError(
            f"check_plan({plan}, world_size={world_size}, batch_size={batch_size}) accepted the "
            f"plan, which the docstring's rules refuse: it must raise {wanted} naming "
            f"{' or '.join(alternatives)}")
    if fields is not None and world_size == plan.world_size:
        with pytest.raises(expected, match="|".join(map(re.escape, alternatives))):
            predict_peak(plan, CFG, batch_size, 0)


@pytest.fixture(scope="module")
def built():
    """{plan label: per-rank build_worker results} for two plans where a wrong mesh or embedding
    group gives a different answer: D 2 × P 2 × T 2 on 8 ranks (T and P both > 1: the orders
    differ) and P 4 on 4 ranks (P ≥ 3: the pipeline group is not the embedding group)."""
    from labkit.ranks import launch
    from labkit.harness.lab7 import build_worker
    from labkit.lab7.run_plan import Plan

    cfg = lab_config("cpu", n_layer=4)
    torch.manual_seed(0)
    state = GPT(cfg).state_dict()
    out = {}
    for plan, world in [(Plan(dp=2, pp=2, tp=2, zero_stage=1, n_micro=2), 8), (Plan(pp=4, n_micro=4), 4)]:
        try:
            out[plan.label] = (plan, launch(build_worker, world, plan, cfg, state, timeout=120))
        except Exception as exc:  # a stub's NotImplementedError arrives wrapped in RankError
            if "NotImplementedError" in str(exc) and "exercise 7.2" in str(exc):
                raise NotImplementedError(f"exercise 7.2: {exc}") from exc
            raise
    return out


@pytest.mark.exercise("7.2", points=1)
def test_ranks_follow_the_course_mesh_order_and_the_embedding_group_joins_first_and_last(built):
    """Check every rank's coordinates and groups against the device mesh in the course's order
    (pp, dp, tp), computed here with ``torch.arange(world).view(P, D, T)``, and that the embedding
    group is exactly the first and last stage of the rank's pipeline."""
    for label, (plan, results) in built.items():
        mesh = torch.arange(plan.world_size).view(plan.pp, plan.dp, plan.tp)
        for rank, res in enumerate(results):
            p, d, t = (int(i) for i in (mesh == rank).nonzero()[0])
            assert res["coords"] == {"pp": p, "dp": d, "tp": t}, (
                f"{label}, rank {rank}: coords {res['coords']}, expected pp={p}, dp={d}, tp={t}: the mesh "
                f"is (P, D, T), pipeline outermost, tensor-parallel innermost")
            want = {"pp": mesh[:, d, t].tolist(), "dp": mesh[p, :, t].tolist(), "tp": mesh[p, d, :].tolist()}
            for axis, ranks in want.items():
                assert res["groups"][axis] == ranks, f"{label}, rank {rank}: {axis} group {res['groups'][axis]}, expected {ranks}"
            pipe = want["pp"]
            emb = [pipe[0], pipe[-1]] if rank in (pipe[0], pipe[-1]) else None
            assert res["groups"]["embedding"] == emb, (
                f"{label}, rank {rank}: embedding group {res['groups']['embedding']}, expected {emb} "
                f"(the first and last stage of its pipeline {pipe}, which hold the tied weight's two copies)")


def _four_stage_plans() -> dict:
    from labkit.lab7.run_plan import Plan

    return {"1f1b": Plan(pp=4, n_micro=4, schedule="1f1b"),
            "gpipe": Plan(pp=4, n_micro=4, schedule="gpipe")}


@functools.lru_cache(maxsize=1)
def four_stage_runs() -> dict:
    """{schedule: per-rank results} of P = 4 on 4 gloo ranks (4 micro-batches; the 4-layer lab
    model, one block a stage) under 1F1B and GPipe: one launch for the tests below."""
    from labkit.ranks import launch
    from labkit.harness.lab7 import run_plans_worker

    _, state, batches = _setup()
    plans = _four_stage_plans()
    results = launch(run_plans_worker, 4, list(plans.values()), CFG, state, batches, timeout=120)
    return {name: [rank[i] for rank in results] for i, name in enumerate(plans)}


@pytest.mark.exercise("7.2", points=2)
def test_a_four_stage_pipeline_trains_like_one_device():
    """Check P = 4 on 4 gloo ranks (1F1B, 4 micro-batches; the 4-layer lab model, one block a
    stage): the losses equal one device's Adam on the whole batch within 1e-4. With P ≥ 3 the
    pipeline group is not the embedding group: the tied weight's two gradients are summed
    between the first and last stage only, the middle stages take no part."""
    results = four_stage_runs()["1f1b"]
    got, want = whole_batch_losses(results), one_device_losses()
    worst = _worst(got, want)
    assert worst < LOSS_TOL, (
        f"P = 4: losses {[round(v, 6) for v in got]}, one device {[round(v, 6) for v in want]} "
        f"(largest |Δ| {worst:.1e}): from step 2 on, the update differs")


@pytest.mark.exercise("7.2", points=1)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_every_stage_of_a_four_stage_pipeline_is_predicted_within_10_percent(schedule):
    """Check each stage's MemTracker peak of P = 4 (4 micro-batches, batch 16) within 10% of
    predict_peak: the middle stages, which only a pipeline deeper than 2 has, hold their received
    input and their output for each micro-batch in flight (1F1B: min(P − p, M) on stage p at
    its first backward; GPipe: all M), and under GPipe the last stage holds every micro-batch's
    head while the loss's gradients exist for one backward at a time. The solution's
    prediction is within 3% on every stage of both; counting the loss's gradients once per
    micro-batch in flight over-predicts GPipe's last stage by 12%. The measured run must train
    like one device."""
    plan = _four_stage_plans()[schedule]
    results = four_stage_runs()[schedule]
    for rank, result, want, gap in peak_gaps(results, plan, CFG, BATCH):
        assert abs(gap) <= PEAK_TOL, (
            f"P = 4, {schedule.upper()}, M = 4, stage {rank}: measured peak {result['peak']:,} B, "
            f"predicted {want:,} B ({gap:+.1%}, more than ±{PEAK_TOL:.0%}); at the peak: "
            + ", ".join(f"{k} {v:,}" for k, v in result["at_peak"].items() if v)
            + ": how many micro-batches are in flight on this stage when its backward begins, "
              "and what does a stage keep for each (its input, its output, the head's "
              "activations on the last)? what exists once per backward, not per micro-batch?")
    check_measured(f"P = 4 ({schedule})", results, one_device_losses())


# ------------------------------------------------------------ infrastructure (not graded)

def test_an_earlier_exercise_left_undone_is_named_not_a_traceback():
    """The runner turns a stub's NotImplementedError from exercise 3.7 into a RuntimeError that
    says which exercise and module to finish first; 7.2's own stubs stay NotImplementedError."""
    from labkit.harness.lab7 import _prerequisite_error

    err = _prerequisite_error(NotImplementedError("exercise 3.7: resize the full buffer (labs/03_parameters.ipynb)"))
    assert isinstance(err, RuntimeError)
    assert "exercise 3.7 (labkit.lab3.zero3) is not done yet" in str(err)
    assert 'labkit.check("3.7")' in str(err)
    own = NotImplementedError("exercise 7.2: ...")
    assert _prerequisite_error(own) is own


def test_the_prerequisites_are_listed_until_written():
    """Stubs of the exercises 7.2 builds on are listed by exercise and module; none with the
    solutions."""
    import labkit.lab3
    from labkit.lab7.run_plan import PREREQUISITES, missing_prerequisites

    assert set(PREREQUISITES.values()) >= {"2.5", "3.4", "3.6", "3.7", "6.3", "6.4", "1.3"}
    missing = missing_prerequisites()
    if any("solutions" in str(p) for p in labkit.lab3.__path__):
        assert missing == []
    else:  # the student edition, nothing written yet
        assert "3.7 (labkit.lab3.zero3)" in missing


def test_plans_with_zero2_or_checkpointing_train_like_one_device():
    """Not graded (no graded plan uses them): ZeRO-2 (4.3) and checkpointing (5.2) still compose
    with the runner — 2 ranks, a 2-layer GPT, 3 steps, the same loss tolerance as above."""
    from labkit.ranks import launch
    from labkit.harness.lab7 import run_plans_worker
    from labkit.lab7.run_plan import Plan

    cfg = lab_config("cpu", n_layer=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    data = SyntheticData(cfg.vocab_size, cfg.block_size, 8, seed=0)
    batches = [data.batch(i) for i in range(STEPS)]
    want = adam_losses(model, batches)
    plans = [Plan(dp=2, zero_stage=2), Plan(dp=2, zero_stage=1, checkpointing=True)]
    results = launch(run_plans_worker, 2, plans, cfg, state, batches, timeout=240)
    for i, plan in enumerate(plans):
        got = whole_batch_losses([rank[i] for rank in results])
        assert _worst(got, want) < LOSS_TOL, (plan.label, got, want)


def test_a_three_axis_plan_on_8_ranks_trains_like_one_device():
    """Not graded: DP 2 × PP 2 × TP 2 on 8 gloo ranks (every axis at once: the pipeline's stages
    tensor-parallel inside, ZeRO-1 over the replicas) trains like one device, and every rank's
    peak is within 10% of ``predict_peak`` (the solution's: +0.7% on the first stage, +2.8% on
    the last)."""
    from labkit.ranks import launch
    from labkit.harness.lab7 import run_plans_worker
    from labkit.lab7.run_plan import Plan, predict_peak

    model, state, batches = _setup()
    plan = Plan(dp=2, pp=2, tp=2, zero_stage=1, n_micro=2, schedule="1f1b")
    results = [rank[0] for rank in launch(run_plans_worker, 8, [plan], CFG, state, batches, timeout=240)]
    got, want = whole_batch_losses(results), one_device_losses()
    assert _worst(got, want) < LOSS_TOL, (got, want)
    for rank, res in enumerate(results):
        predicted = predict_peak(plan, CFG, BATCH, rank)
        assert abs(res["peak"] / predicted - 1) <= PEAK_TOL, (rank, res["coords"], res["peak"], predicted)


def test_replica_losses_of_results_without_any_loss_is_a_named_error():
    """Given code: no rank's losses (an empty list, every loss None) → a ValueError naming
    ``results``, not a StopIteration."""
    from labkit.lab7.run_plan import replica_losses

    for results in ([], [{"losses": [None, None], "coords": {"dp": 0}}]):
        with pytest.raises(ValueError, match="results must be"):
            replica_losses(results)
    assert replica_losses([{"losses": [2.0], "coords": {"dp": 0}},
                           {"losses": [4.0], "coords": {"dp": 1}}]) == [3.0]
