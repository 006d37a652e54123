"""Graders of Lab 3, exercise 3.6 (labs/03_parameters.ipynb): a pipeline over send/recv.

The course GPT (``lab_config("cpu")``, 4 blocks; 3 blocks for P = 3) is cut into P = 2, 3 and 4
stages on P real gloo ranks (``labkit.ranks.launch``); a batch of M micro-batches of b = 2
sequences runs under a GPipe or a 1F1B action list WRITTEN OUT HERE (P = 2 by hand, P = 3 and 4
by the rules below; not taken from exercise 3.5: each exercise is graded alone).

References nobody in this course wrote: the single-device GPT's ``loss.backward()`` on the whole
batch (gradients and loss); PyTorch's own pipeline, ``torch.distributed.pipelining``'s
ScheduleGPipe / Schedule1F1B over ``PipelineStage`` s of the same split on gloo; the activation
bytes autograd saves for ONE micro-batch's forward on the same stage, measured here by
``labkit.measure.peak_saved_bytes`` (a stage with k micro-batches in flight must hold k times
that: k = M under GPipe, min(P−s, M) under 1F1B, Narayanan et al. 2021); and the formula for the
point-to-point traffic (``count_comm``). Every test that measures a run (saved or live bytes,
messages, sends) also checks that run's gradients against the single-device GPT's
(``check_measured``): a measurement counts only for the right result.

Tolerances: gradients and loss are float32 sums of the same terms in another order (M
micro-batch means of 1/M weight instead of one batch mean): rtol 1e-5, atol 1e-7 (measured
relative error ~1e-6 of the largest entry; PyTorch's pipeline sums the same micro-batch
gradients and scales by 1/M after, measured 7e-7). Saved bytes, calls and bytes sent are exact.
"""
from __future__ import annotations

import functools

import pytest
import torch

P, B_MICRO, T = 2, 2, 32

# Per-stage action lists for P = 2 (stage 0, stage 1), written out by hand.
GPIPE = {
    2: [[("F", 0), ("F", 1), ("B", 0), ("B", 1)]] * 2,
    4: [[("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)]] * 2,
}
ONE_F_ONE_B = {
    2: [[("F", 0), ("F", 1), ("B", 0), ("B", 1)],
        [("F", 0), ("B", 0), ("F", 1), ("B", 1)]],
    4: [[("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
        [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]],
}
SCHEDULES = {"gpipe": GPIPE, "1f1b": ONE_F_ONE_B}


def actions(kind, P, M):
    """Per-stage action lists: the hand-written ones for P = 2; for more stages the harness's
    ``schedule_lists`` (GPipe: every F then every B; 1F1B, Narayanan et al. 2021: min(P−s, M)
    forwards, then one backward and one forward while forwards remain, then the remaining
    backwards)."""
    from labkit.harness.lab3 import schedule_lists

    if P == 2 and M in SCHEDULES[kind]:
        return SCHEDULES[kind][M]
    return schedule_lists(kind, P, M)


def setup(M, P=P):
    from labkit.models import GPT, SyntheticData, lab_config

    torch.manual_seed(0)
    cfg = lab_config("cpu", n_layer=3) if P == 3 else lab_config("cpu")
    model = GPT(cfg)
    x, y = SyntheticData(cfg.vocab_size, T, B_MICRO * M, seed=1).batch(0)
    return cfg, model, x, y


# The subgroup runs also start from a .grad that already holds PREFILL (as after an earlier
# accumulation step): run_stage must add to it. 2^-10 is exact in fp32 and ~100× the gradients'
# tolerance, so dropping it fails clearly while adding it back costs at most one fp32 rounding.
PREFILL = 2.0 ** -10


@functools.lru_cache(maxsize=None)
def _run(kind, M, P, groups=1):
    from labkit.ranks import launch
    from labkit.harness.lab3 import pipeline_worker

    cfg, model, x, y = setup(M, P)
    # The harness's watchdog (15 s without any operator on a rank) fires well before this
    # launch timeout: a deadlock is reported as one, not as "Connection closed by peer".
    return launch(pipeline_worker, P * groups, cfg, model.state_dict(), actions(kind, P, M), x, y,
                  M, groups=groups, timeout=60.0, prefill=PREFILL if groups > 1 else 0.0)


STALLED: list[str] = []  # set by the first test whose pipeline stalled: the others stop at once


def run(kind, M, P=P, groups=1):
    """The student's pipeline on P ranks (``groups`` pipelines side by side in subgroups of the
    world); a rank's error becomes a failure naming the likely cause."""
    from labkit.ranks import RankError
    from labkit.harness.lab3 import STALL_MESSAGE

    if STALLED:
        pytest.fail(f"not run: {STALLED[0]} stalled ({STALL_MESSAGE}); every 3.6 test would wait "
                    "the same way — fix that first")
    try:
        return _run(kind, M, P, groups)
    except RankError as exc:
        text = str(exc)
        if "NotImplementedError" in text:
            raise
        if STALL_MESSAGE in text:
            STALLED.append(f"{kind} P={P} M={M}")
            pytest.fail(f"{kind} P={P} M={M}: {STALL_MESSAGE}. No rank ran an operator for 15 s: "
                        "a blocking dist.send waits for its receiver while the receiver itself "
                        "waits in a send (under 1F1B both neighbours send at the same time), or a "
                        "recv waits on a peer that never sends. Start every send with dist.isend "
                        "and wait for it later.")
        pytest.fail(f"{kind} P={P} M={M}: a rank failed: {text.strip().splitlines()[-1][-300:]} — does stage r receive "
                    "its activation from rank r−1 and send its output to rank r+1 (gradients the "
                    "other way), never a fixed rank, and does every send have a matching receive?")


@functools.lru_cache(maxsize=None)
def run_torch(kind, M, P=P):
    """PyTorch's ScheduleGPipe / Schedule1F1B on the same split (labkit.reference.lab3, cut independently of split_gpt)."""
    from labkit.ranks import launch
    from labkit.reference.lab3 import torch_pipeline_worker

    cfg, model, x, y = setup(M, P)
    return launch(torch_pipeline_worker, P, cfg, model.state_dict(), kind, x, y, M, timeout=60.0)


def summed_grads(results, kind):
    """{name: gradient} over all stages; the untied lm_head's gradient is added to wte's."""
    got = {}
    for r in results:
        for name, g in r["grads"].items():
            assert g is not None, (f"{kind}: {name} has no gradient after the step: did every "
                                   "micro-batch's backward run on this stage?")
            name = "wte.weight" if name == "lm_head.weight" else name
            got[name] = got[name] + g if name in got else g
    return got


@functools.lru_cache(maxsize=None)
def single_device_grads(M, P=P):
    """The reference: every parameter's gradient of the single-device GPT on the whole batch."""
    cfg, model, x, y = setup(M, P)
    model(x, y).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def assert_grads_equal_single_device(kind, M, P, results, cause):
    """Every parameter's gradient (tied wte/lm_head: the sum of both stages') equals the
    single-device GPT's. Tolerance: the module docstring's (rtol 1e-5, atol 1e-7)."""
    got = summed_grads(results, kind)
    for name, want in single_device_grads(M, P).items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: (
            f"{kind} P={P} M={M}, gradient of {name}: {m} — {cause}"))


def check_measured(kind, M, P=P):
    """A measurement counts only for the right result: the run whose saved bytes, live bytes,
    messages or sends were measured must give the single-device gradients."""
    assert_grads_equal_single_device(
        kind, M, P, run(kind, M, P), "the run whose memory or messages were measured must also "
        "compute the gradients: is the received gradient the one of this micro-batch's output, "
        "and the input's gradient sent back?")


@functools.lru_cache(maxsize=None)
def one_microbatch_saved_bytes(stage_index, M, P=P):
    """Bytes autograd saves for one micro-batch's forward on this stage (loss included on the
    last), with its output kept alive: the unit of activation memory of a micro-batch in flight."""
    from labkit.measure import peak_saved_bytes
    from labkit.lab3.pipeline import split_gpt

    cfg, model, x, y = setup(M, P)
    stage = split_gpt(model, P)[stage_index]
    xin = x[:B_MICRO].clone() if stage_index == 0 else torch.randn(
        B_MICRO, T, cfg.n_embd, requires_grad=True)
    keep = []

    def fwd():
        out = stage(xin)
        if stage_index == P - 1:
            out = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                    y[:B_MICRO].clone().reshape(-1)) / M
        keep.append(out)
    return peak_saved_bytes(fwd)


@pytest.mark.exercise("3.6", points=3)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_gradients_equal_the_single_device_model(kind):
    """Check every parameter's gradient (tied wte/lm_head: the sum of both stages') equals the
    single-device GPT's on the whole batch, P = 2, M = 4."""
    M = 4
    assert_grads_equal_single_device(kind, M, P, run(kind, M), "is loss_m divided by M, is the "
                                     "received gradient the one of this micro-batch's output, and "
                                     "is the input's gradient sent back?")


@pytest.mark.exercise("3.6", points=1)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [3, 4])
def test_gradients_equal_the_single_device_model_on_3_and_4_stages(kind, stages):
    """Check every gradient equals the single-device GPT's with P = 3 (a 3-block GPT) and P = 4
    stages, M = 4: middle ranks both receive and send in each direction."""
    M = 4
    assert_grads_equal_single_device(kind, M, stages, run(kind, M, stages), "does a middle stage "
                                     "receive its input from rank r−1 AND send its output to r+1 "
                                     "(and the gradients the other way)?")


@pytest.mark.exercise("3.6", points=1)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_gradients_equal_torch_pipelining_on_the_same_split(kind, stages):
    """Check each stage's gradients and the last rank's loss equal those of PyTorch's own
    pipeline (torch.distributed.pipelining ScheduleGPipe / Schedule1F1B, PipelineStage over
    gloo) on the same stages and micro-batches, M = 4."""
    M = 4
    mine, ref = run(kind, M, stages), run_torch(kind, M, stages)
    for s in range(stages):
        for name, want in ref[s]["grads"].items():
            got = mine[s]["grads"].get(name)
            assert got is not None, f"{kind} P={stages}, stage {s}: {name} has no gradient"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m: (
                f"{kind} P={stages}, stage {s}, gradient of {name} vs torch.distributed.pipelining: "
                f"{m} — is each micro-batch's loss scaled by 1/M and backpropagated once?"))
    assert mine[-1]["loss"] is not None, f"{kind}: the last rank returned no loss"
    torch.testing.assert_close(mine[-1]["loss"], ref[-1]["loss"], rtol=1e-5, atol=1e-7, msg=lambda m: (
        f"{kind} P={stages}, loss vs torch's mean of the micro-batch losses: {m}"))


@pytest.mark.exercise("3.6", points=1)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_last_rank_returns_the_batch_loss(kind):
    """Check the last rank returns the whole batch's mean loss (the single-device model's), the
    other ranks None."""
    M = 4
    cfg, model, x, y = setup(M)
    res = run(kind, M)
    assert all(r["loss"] is None for r in res[:-1]), f"{kind}: only the last rank returns a loss"
    assert res[-1]["loss"] is not None, f"{kind}: the last rank returned no loss"
    with torch.no_grad():
        want = model(x, y)
    torch.testing.assert_close(res[-1]["loss"], want, rtol=1e-5, atol=1e-7, msg=lambda m: (
        f"{kind}, loss: {m} — the last rank must return the sum of loss_m = CE/M over micro-batches"))


@pytest.mark.exercise("3.6", points=1)
def test_microbatches_of_unequal_sizes():
    """Check a batch of 5 sequences cut by ``x.chunk(3)`` into micro-batches of 2, 2 and 1
    sequences, 1F1B on P = 2: the contract's activation of micro-batch m is (b, T, n_embd) with
    m's own b, so stage 1 must size what it receives from ``inputs[m]``. Reference: the
    single-device GPT's gradients and loss of the sum over m of loss_m = CE(micro-batch m) / M
    (the module docstring's tolerance, rtol 1e-5, atol 1e-7)."""
    from labkit.harness.lab3 import pipeline_worker
    from labkit.models import GPT, SyntheticData, lab_config
    from labkit.ranks import RankError, launch

    M = 3
    torch.manual_seed(0)
    cfg = lab_config("cpu")
    model = GPT(cfg)
    x, y = SyntheticData(cfg.vocab_size, T, 5, seed=1).batch(0)
    try:
        res = launch(pipeline_worker, P, cfg, model.state_dict(), actions("1f1b", P, M), x, y, M,
                     timeout=60.0)
    except RankError as exc:
        if "NotImplementedError" in str(exc):
            raise
        pytest.fail(f"1f1b P={P}, micro-batches of 2, 2 and 1 sequences: a rank failed: "
                    f"{str(exc).strip().splitlines()[-1][-300:]} — does a stage size the activation "
                    "it receives for micro-batch m from inputs[m] (micro-batches may differ in size)?")
    want_loss = sum(model(xm, ym) / M for xm, ym in zip(x.chunk(M), y.chunk(M)))
    want_loss.backward()
    got = summed_grads(res, "1f1b")
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: (
            f"1f1b P={P}, micro-batches of 2, 2 and 1 sequences, gradient of {name}: {m} — is "
            "each micro-batch run (and received) in its own shape, its loss divided by M?"))
    assert res[-1]["loss"] is not None, "1f1b, micro-batches of unequal sizes: the last rank returned no loss"
    torch.testing.assert_close(res[-1]["loss"], want_loss.detach(), rtol=1e-5, atol=1e-7, msg=lambda m: (
        f"1f1b, micro-batches of 2, 2 and 1 sequences, loss: {m} — the sum of loss_m = CE_m / M"))


@pytest.mark.exercise("3.6", points=2)
def test_gpipe_holds_the_activations_of_all_m_microbatches():
    """Check under GPipe each stage's peak of saved activations is M × one micro-batch's,
    for M = 2 and M = 4 (it grows with M)."""
    for M in (2, 4):
        res = run("gpipe", M)
        for s in range(P):
            one = one_microbatch_saved_bytes(s, M)
            got = res[s]["peak_saved"]
            assert got == M * one, (
                f"GPipe M={M}, stage {s}: peak saved activations {got:,} B, expected M × "
                f"{one:,} = {M * one:,} B: does each forward run on the micro-batch's own input "
                "and keep its graph until its backward, and nothing more?")
        check_measured("gpipe", M)


@pytest.mark.exercise("3.6", points=2)
def test_1f1b_holds_at_most_p_minus_s_microbatches():
    """Check under 1F1B stage s's peak of saved activations is min(P−s, M) × one micro-batch's
    for M = 2 and 4 on P = 2 stages and M = 4 on P = 3 and 4 (bounded by P, not M)."""
    for stages, M in ((2, 2), (2, 4), (3, 4), (4, 4)):
        res = run("1f1b", M, stages)
        for s in range(stages):
            one, k = one_microbatch_saved_bytes(s, M, stages), min(stages - s, M)
            got = res[s]["peak_saved"]
            assert got == k * one, (
                f"1F1B P={stages} M={M}, stage {s}: peak saved activations {got:,} B, expected min(P−s, M) "
                f"× {one:,} = {k * one:,} B: is micro-batch m's graph freed by its backward "
                "(nothing kept in a list after B), and are the actions run in the given order?")
        check_measured("1f1b", M, stages)


@pytest.mark.exercise("3.6", points=1)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_send_recv_counts_equal_the_formula(kind):
    """Check each rank's point-to-point calls: M sends and M receives per neighbour link (stage
    s: M·[s<P−1] + M·[s>0] of each), and nothing else, on P = 2 and 3 stages."""
    M = 4
    for stages in (2, 3):
        for s, r in enumerate(run(kind, M, stages)):
            n = M * ((s < stages - 1) + (s > 0))
            want = {"send": n, "recv": n}
            assert r["calls"] == want, (
                f"{kind} P={stages}, rank {s}: calls {r['calls']}, expected {want}: one activation per forward "
                "to the next stage and one gradient per backward to the previous, no collectives")
        check_measured(kind, M, stages)


@pytest.mark.exercise("3.6", points=1)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_no_send_waits_for_its_receiver(kind):
    """Check no rank calls the blocking dist.send (P = 2, 3), nor waits for an isend right after
    issuing it: either returns only once the receiver has the data, and under 1F1B both
    neighbours send at once. gloo's socket buffers let the
    lab's small messages through, so the step works here and deadlocks at real sizes."""
    for stages in (2, 3):
        for s, r in enumerate(run(kind, 4, stages)):
            assert r["blocking_sends"] == 0, (
                f"{kind} P={stages}, rank {s}: {r['blocking_sends']} blocking dist.send calls: start "
                "each send with dist.isend and wait for its handle later")
            assert r["waited_at_once"] == 0, (
                f"{kind} P={stages}, rank {s}: {r['waited_at_once']} isend handles waited for right "
                "after being issued (no forward, backward, send or recv in between) — a blocking "
                "send in disguise: wait for a send only once its tensor must be released")
        check_measured(kind, 4, stages)


def test_the_watchdog_reports_a_deadlock_as_one():
    """Two ranks each waiting to receive first: the harness's watchdog reports "no progress"
    within seconds, long before the launch timeout."""
    import time

    from labkit.ranks import RankError, launch
    from labkit.harness.lab3 import STALL_MESSAGE, stall_demo

    start = time.monotonic()
    with pytest.raises(RankError, match=STALL_MESSAGE):
        launch(stall_demo, 2, 1.0, timeout=30)
    assert time.monotonic() - start < 20


@pytest.mark.exercise("3.6", points=1)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_send_recv_bytes_equal_the_formula(kind):
    """Check each rank's point-to-point bytes: every message is one float32 activation or
    gradient of b·T·C·4 bytes."""
    M = 4
    cfg = setup(M)[0]
    msg = B_MICRO * T * cfg.n_embd * 4
    for s, r in enumerate(run(kind, M)):
        n = M * ((s < P - 1) + (s > 0))
        want = {"send": n * msg, "recv": n * msg}
        assert r["bytes"] == want, (
            f"{kind}, rank {s}: bytes {r['bytes']}, expected {want} (each message b·T·C·4 = "
            f"{msg:,} B): is a float32 (b, T, C) tensor sent, not the logits or a whole batch?")
    check_measured(kind, M)


def test_bad_actions_are_refused_before_any_work():
    from labkit.lab3.pipeline import check_actions

    with pytest.raises(ValueError, match="actions"):
        check_actions([("B", 0), ("F", 0)], 1)
    with pytest.raises(ValueError, match="actions"):
        check_actions([("F", 0), ("X", 0)], 1)
    with pytest.raises(ValueError, match="actions"):
        check_actions([("F", 0)], 1)
    with pytest.raises(ValueError, match="num_microbatches"):
        check_actions([], 0)
    assert check_actions(ONE_F_ONE_B[2][0], 2) == ONE_F_ONE_B[2][0]
    from labkit.lab3.pipeline import run_stage  # its given checks run before any send or recv

    stage = torch.nn.Identity()
    for inputs in ([], torch.zeros(2, 4), [[1, 2]]):
        with pytest.raises(ValueError, match="inputs"):
            run_stage(stage, [("F", 0), ("B", 0)], inputs, [torch.zeros(2)], rank=0, world_size=2)
    with pytest.raises(ValueError, match="targets"):
        run_stage(stage, [("F", 0), ("B", 0)], [torch.zeros(1, 4)], [], rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        run_stage(stage, [("F", 0), ("B", 0)], [torch.zeros(1, 4)], [torch.zeros(1)], rank=2, world_size=2)


def test_split_gpt_refuses_a_stage_count_that_does_not_divide_n_layer():
    from labkit.lab3.pipeline import split_gpt

    cfg, model, _, _ = setup(2)
    with pytest.raises(ValueError, match="num_stages"):
        split_gpt(model, 3)


@pytest.mark.parametrize("args,error,words", [
    ((1, 0, True, True), ValueError, "0 <= first <= last <= n_layer"),  # was a stage of no block
    ((-1, 1, True, True), ValueError, "0 <= first <= last <= n_layer"),  # was blocks -1..0: none
    ((0, 5, True, True), ValueError, "0 <= first <= last <= n_layer"),  # was an IndexError
    ((0, 1.0, True, True), ValueError, "first, last must be ints"),
    ((0, 1, "yes", True), TypeError, "is_first must be True or False"),
])
def test_a_stage_outside_the_model_is_refused_naming_the_argument(args, error, words):
    from labkit.lab3.pipeline import GPTStage

    _, model, _, _ = setup(2)
    with pytest.raises(error, match=words):
        GPTStage(model, *args)
    with pytest.raises(TypeError, match="model must be a labkit.models.GPT"):
        GPTStage(torch.nn.Linear(2, 2), 0, 1, True, True)


@pytest.mark.exercise("3.6", points=2)
def test_1f1b_live_memory_does_not_grow_with_m():
    """Check under 1F1B, P = 2, each stage's peak *live* bytes (every tensor the step creates and
    keeps alive: stash, received buffers, tensors held by pending sends, gradients; the harness's
    LiveBytes) is the same at M = 8 as at M = 4, within half a message (b·T·C·4 / 2 bytes): what
    a micro-batch holds must be released by its backward, sends included."""
    from labkit.models import lab_config

    C = lab_config("cpu").n_embd
    slack = B_MICRO * T * C * 4 // 2
    small, large = run("1f1b", 4), run("1f1b", 8)
    for s in range(P):
        grow = large[s]["peak_live"] - small[s]["peak_live"]
        assert grow <= slack, (
            f"stage {s}: peak live bytes {small[s]['peak_live']:,} at M = 4, {large[s]['peak_live']:,} "
            f"at M = 8 (+{grow:,} B, {grow / (2 * slack):.1f} micro-batch messages of {2 * slack:,} B) "
            "under 1F1B, where at most P − s micro-batches are in flight: something of every "
            "micro-batch is kept until the step ends (a stash entry not dropped at its backward, "
            "or a send handle — and the tensor it holds — not waited for until the end)")
    check_measured("1f1b", 4)
    check_measured("1f1b", 8)


@pytest.mark.exercise("3.6", points=2)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_two_pipelines_in_subgroups_of_the_world(kind):
    """Check 4 ranks as two pipelines of P = 2 ({0, 1} and {2, 3}, run_stage given group=, rank
    and world_size in the group): both pipelines' gradients equal the single-device GPT's. Peers
    addressed by global rank, or sends to the default group, fail here. Every .grad starts at
    PREFILL (an earlier accumulation step): run_stage must add to it, not replace it."""
    M = 4
    cfg, model, x, y = setup(M)
    model(x, y).backward()
    res = run(kind, M, P, groups=2)
    for g in range(2):
        raw = summed_grads(res[2 * g:2 * g + 2], kind)
        tied = {"wte.weight"}  # two parameters on two stages: PREFILL twice
        got = {n: t - PREFILL * (2 if n in tied else 1) for n, t in raw.items()}
        for name, p in model.named_parameters():
            if not torch.allclose(got[name], p.grad, rtol=1e-5, atol=1e-7) and \
                    torch.allclose(raw[name], p.grad, rtol=1e-5, atol=1e-7):
                raise AssertionError(
                    f"{kind}, pipeline {g}, {name}: .grad held {PREFILL} before the step and afterwards "
                    "holds only this step's gradient: run_stage must accumulate into .grad (no "
                    "zero_grad, no assignment)")
            torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, g=g, name=name: (
                f"{kind}, pipeline {g} (world ranks {2 * g}, {2 * g + 1}), gradient of {name}: {m}"))
