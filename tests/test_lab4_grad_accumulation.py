"""Graders of Lab 4, exercise 4.1 (labs/04_gradients.ipynb): gradient accumulation.

References nobody in this course wrote: the gradient of the whole batch in one backward (the
plain computation); for weight="samples", the gradient of Σᵢ (Bᵢ/B)·lossᵢ in one backward;
``torch.nn.parallel.DistributedDataParallel``'s own full-batch backward on the same real gloo
ranks (``labkit.reference.lab4.ddp_backward``); ``labkit.comm_count`` for collective calls and
bytes; ``labkit.measure.peak_saved_bytes`` for activation bytes.

Tolerance: float64 sums in another order differ by ~1e-16 relative, so gradients are checked at
atol 1e-12 (a missed or doubled micro-batch is off by ≥ 1e-3).
"""
from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

from _lab4_helpers import F64_TOL, tiny_gpt
from labkit.ranks import launch
from labkit.measure import peak_saved_bytes
from labkit.models import SyntheticData


def full_batch_grads(model, x, y):
    """The reference: one forward and one backward over the whole batch."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    ref(x, y).backward()
    return {name: p.grad for name, p in ref.named_parameters()}


def assert_grads_equal(model, want, cause, **tol):
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}.grad is None after accumulation: {cause}"
        torch.testing.assert_close(p.grad, want[name], **tol,
                                   msg=lambda m, name=name: f"{name}.grad differs from the full batch's — {cause}\n{m}")


def masked(y, counted):
    """y with sample i keeping only its first counted[i] targets (the rest ignore_index -100)."""
    y = y.clone()
    for i, n in enumerate(counted):
        y[i, n:] = -100
    return y


@pytest.mark.exercise("4.1", points=1)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_accumulation_equals_the_full_batch(k):
    """Check that k equal micro-batches of a batch of 8 leave the full batch's gradient in .grad
    (float64, atol 1e-12) and return the full batch's loss; a second call on another batch adds
    that batch's gradient to .grad."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt(dtype=torch.float64)
    x, y = SyntheticData(64, 32, 8, seed=1).batch(0)
    want = full_batch_grads(model, x, y)
    loss = accumulate_gradients(model, x, y, k)
    assert_grads_equal(model, want, f"k = {k}: is each micro-batch's loss scaled by its share "
                       "(1/k here), and is every micro-batch's backward run once?", **F64_TOL)
    # the contract returns a Python float (float(t), t.item() and numpy's float64 all are one),
    # not a tensor, which would also keep the last micro-batch's tensor alive for the caller
    assert isinstance(loss, float), (
        f"returned {type(loss).__name__} {loss!r}: the docstring's Returns is the whole batch's "
        "loss as a float")
    full_loss = float(copy.deepcopy(model)(x, y).detach())
    assert math.isclose(loss, full_loss, rel_tol=1e-12), (
        f"returned loss {loss!r}, the full batch's is {full_loss!r}: return the weighted sum of "
        "the micro-batch losses")
    # a second batch on top: .grad must grow by its gradient (as backward() does), not restart
    x2, y2 = SyntheticData(64, 32, 8, seed=7).batch(0)
    second = full_batch_grads(model, x2, y2)
    accumulate_gradients(model, x2, y2, k)
    again = {n: want[n] + second[n] for n in want}
    if not all(torch.allclose(p.grad, again[n], **F64_TOL) for n, p in model.named_parameters()) and \
            all(torch.allclose(p.grad, second[n], **F64_TOL) for n, p in model.named_parameters()):
        raise AssertionError(f"k = {k}, second call: .grad holds only the second batch's gradient; "
                             "the first batch's, already in .grad, was dropped (no zero_grad or "
                             ".grad assignment inside accumulate_gradients: add to .grad)")
    assert_grads_equal(model, again, f"k = {k}, a second call on another batch: .grad must hold "
                       "the sum of both batches' gradients", **F64_TOL)


@pytest.mark.exercise("4.1", points=1)
@pytest.mark.parametrize("weight", ["tokens", "samples"])
@pytest.mark.parametrize("k", [3, 5])
def test_accumulation_with_uneven_micro_batches(k, weight):
    """Check a batch of 8 in k = 3 or 5 micro-batches (sizes 3,3,2 / 2,2,2,1,1): with equal
    sequence lengths both weightings equal the full batch's gradient (1/k would not)."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt(dtype=torch.float64)
    x, y = SyntheticData(64, 32, 8, seed=2).batch(0)
    want = full_batch_grads(model, x, y)
    accumulate_gradients(model, x, y, k, weight=weight)
    assert_grads_equal(model, want, f"k = {k} does not divide 8: weight each micro-batch by its "
                       f"share of the batch's {weight}, not by 1/k", **F64_TOL)


@pytest.mark.exercise("4.1", points=1)
def test_accumulation_weights_by_counted_tokens():
    """Check a batch whose samples have different numbers of counted targets (the rest are
    ignore_index = -100, as padding would be): weight="tokens" gives the full batch's gradient
    and returns the full batch's loss (not the plain mean of the micro-batch losses)."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt(dtype=torch.float64)
    x, y = SyntheticData(64, 32, 8, seed=3).batch(0)
    y = masked(y, [4 * i + 3 for i in range(8)])
    want = full_batch_grads(model, x, y)
    loss = accumulate_gradients(model, x, y, 3, weight="tokens")
    assert_grads_equal(model, want, "samples have different numbers of counted tokens: scale "
                       "each micro-batch's loss by (its counted tokens) / (the batch's counted "
                       "tokens), counting only targets != -100", **F64_TOL)
    full_loss = float(copy.deepcopy(model)(x, y).detach())
    assert math.isclose(loss, full_loss, rel_tol=1e-12), (
        f"returned loss {loss!r}, the full batch's is {full_loss!r} (micro-batches with 12, 24 "
        "and 20 % of the counted tokens): return the sum of the micro-batch losses each weighted "
        "by its share, not their plain mean")


@pytest.mark.exercise("4.1", points=1)
def test_weight_samples_weighs_by_samples_even_with_masked_tokens():
    """Check weight="samples" on a masked batch in k = 3 micro-batches (3, 3, 2 samples): the
    gradient of Σᵢ (Bᵢ/8)·lossᵢ computed in one backward, which differs from the tokens weighting
    here (the samples of each micro-batch count different numbers of tokens)."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt(dtype=torch.float64)
    x, y = SyntheticData(64, 32, 8, seed=5).batch(0)
    y = masked(y, [32, 32, 32, 4, 4, 4, 16, 2])
    ref = copy.deepcopy(model)
    pieces = [(x[:3], y[:3]), (x[3:6], y[3:6]), (x[6:], y[6:])]
    sum(ref(xi, yi) * (xi.shape[0] / 8) for xi, yi in pieces).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    accumulate_gradients(model, x, y, 3, weight="samples")
    assert_grads_equal(model, want, "weight=\"samples\": each micro-batch's mean loss scaled by "
                       "(its samples) / (the batch's samples), whatever its token count", **F64_TOL)


@pytest.mark.exercise("4.1", points=1)
def test_a_micro_batch_with_no_counted_token_is_skipped():
    """Check a batch of 8 in k = 4 where micro-batch 1 (samples 2, 3) has every target masked:
    the full batch's gradient and loss, no NaN (its mean loss would be 0/0); with
    weight="samples", the shares of the 6 samples run."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt(dtype=torch.float64)
    x, y = SyntheticData(64, 32, 8, seed=6).batch(0)
    y = masked(y, [32, 20, 0, 0, 5, 32, 9, 1])
    want = full_batch_grads(model, x, y)
    loss = accumulate_gradients(model, x, y, 4)
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    assert not bad, (f"{len(bad)} gradients hold NaN or inf (first {bad[0]}): a micro-batch "
                     "without a counted target has a NaN mean loss — skip it")
    assert_grads_equal(model, want, "micro-batch 1 counts no token", **F64_TOL)
    full_loss = float(copy.deepcopy(model)(x, y).detach())
    assert math.isclose(loss, full_loss, rel_tol=1e-12), f"returned loss {loss!r}, expected {full_loss!r}"
    # weight="samples": the shares are those of the micro-batches run (6 samples, not 8)
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)
    run = [(x[i:i + 2], y[i:i + 2]) for i in (0, 4, 6)]
    sum(ref(xi, yi) * (2 / 6) for xi, yi in run).backward()
    accumulate_gradients(model, x, y, 4, weight="samples")
    assert_grads_equal(model, {n: p.grad for n, p in ref.named_parameters()},
                       'weight="samples" with micro-batch 1 skipped: each micro-batch run stands '
                       "for its share of the samples run (2 of 6), not of all 8", **F64_TOL)
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="y"):  # nothing counted at all: refuse, touch nothing
        accumulate_gradients(model, x, torch.full_like(y, -100), 4)
    assert all(p.grad is None for p in model.parameters()), (
        "a batch without any counted target raised only after computing gradients")


def test_accumulation_rejects_bad_input():
    """Not graded (the checks are given): ValueError naming the argument for k = 0, k = -1,
    k = 2.0, k > batch size, an unknown weight and 0-dim tensors, TypeError for float targets,
    before any gradient is touched."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt()
    x, y = SyntheticData(64, 32, 4, seed=0).batch(0)
    for bad in (0, -1, 2.0, 5):
        with pytest.raises(ValueError, match="k"):
            accumulate_gradients(model, x, y, bad)
    with pytest.raises(ValueError, match="weight"):
        accumulate_gradients(model, x, y, 2, weight="mean")
    with pytest.raises(TypeError, match="x"):
        accumulate_gradients(model, x.tolist(), y, 2)
    with pytest.raises(TypeError, match="y must be an int64"):  # not cross-entropy's RuntimeError
        accumulate_gradients(model, x, y.float(), 2)
    with pytest.raises(ValueError, match="batch dimension"):  # not an IndexError
        accumulate_gradients(model, torch.tensor(1), torch.tensor(1), 1)
    assert all(p.grad is None for p in model.parameters()), "a gradient was computed before the error"


@pytest.mark.exercise("4.1", points=1)
def test_accumulation_activation_peak_is_one_micro_batch():
    """Check that the peak bytes autograd holds saved for backward (activations) with k = 4 are
    at most 1/4 of the full batch's plus 10% (activations are linear in the batch; the margin
    covers per-step constants such as the position embedding's output); and that the measured
    runs leave the full batch's gradient (float64, F64_TOL): the bytes count only for it."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt(dtype=torch.float64)
    x, y = SyntheticData(64, 32, 16, seed=0).batch(0)
    # the baseline is the reference's: one plain forward and backward over the whole batch
    ref = copy.deepcopy(model)
    full = peak_saved_bytes(lambda: ref(x, y).backward())
    want = {name: p.grad for name, p in ref.named_parameters()}
    # peak_saved_bytes raises if autograd saved tensors under hooks other than the measurement's
    # (torch.utils.checkpoint's, or saved_tensors_hooks of the code's own): bytes it cannot see
    measured = {k: copy.deepcopy(model) for k in (4, 1)}
    try:
        peaks = {k: peak_saved_bytes(lambda k=k: accumulate_gradients(measured[k], x, y, k))
                 for k in (4, 1)}
    except RuntimeError as e:
        if "peak_saved_bytes" not in str(e):
            raise
        raise AssertionError(
            "the activations saved for backward could not be measured: autograd saved tensors "
            "under other saved-tensor hooks (checkpointing or hooks of the code's own) hide what "
            f"one micro-batch keeps; accumulate with a plain forward and backward per micro-batch\n{e}"
        ) from None
    assert full > 0, "the reference saved no activation for backward"
    assert peaks[1] > 0, "no activation was saved for backward with k = 1"
    bound = full / 4 * 1.10
    assert peaks[4] <= bound, (
        f"peak activation bytes with k = 4: {peaks[4]:,}, expected ≤ {bound:,.0f} (1/4 of the "
        f"full batch's {full:,}, measured on one plain forward and backward, + 10%): run "
        "backward after each micro-batch's forward, not once on the sum of the losses")
    for k, run in measured.items():
        assert_grads_equal(run, want, f"k = {k}, the run whose saved bytes were measured: is every "
                           "micro-batch's scaled loss backpropagated once?", **F64_TOL)


@functools.lru_cache(maxsize=None)  # one launch for the DDP tests (not cached if it raises)
def ddp_runs():
    from labkit.harness.lab4 import accumulate_with_ddp

    model = tiny_gpt(dtype=torch.float64)
    data = SyntheticData(64, 32, 8, seed=4)
    (x0, y0), (x1, y1) = data.batch(0), data.batch(1)
    # both ranks' last micro-batch of 4 (samples 6, 7) counts no token: DDP must still sync once
    batches = [(x0, masked(y0, [32, 3, 17, 32, 8, 30, 0, 0])), (x1, masked(y1, [5] * 6 + [0, 0]))]
    return launch(accumulate_with_ddp, 2, model, batches, (1, 4))


@pytest.mark.exercise("4.1", points=2)
def test_accumulation_under_ddp_all_reduces_once():
    """Check on 2 real gloo ranks with DistributedDataParallel, with the last of 4 micro-batches
    counting no token: k = 1 and k = 4 make exactly the all-reduce calls and bytes of DDP's own
    full-batch backward (one synchronisation), and its averaged gradients (float64)."""
    for rank, res in enumerate(ddp_runs()):
        ref = res["ddp"]
        n_ref, b_ref = ref["calls"].get("all_reduce", 0), ref["bytes"].get("all_reduce", 0)
        for k in (1, 4):
            n, b = res[k]["calls"].get("all_reduce", 0), res[k]["bytes"].get("all_reduce", 0)
            assert n == n_ref and b == b_ref, (
                f"rank {rank}, k = {k}: {n} all-reduce calls of {b:,} B in all, DDP's full-batch "
                f"backward makes {n_ref} of {b_ref:,} B: "
                + ("none at all — the micro-batch that synchronises must be the last one that is "
                   "not skipped" if n == 0 else
                   "the first k − 1 backward passes must run inside model.no_sync()"))
            for i, (g, want) in enumerate(zip(res[k]["grads"], ref["grads"])):
                assert g is not None, f"rank {rank}, k = {k}: parameter {i} has no gradient"
                torch.testing.assert_close(g, want, **F64_TOL, msg=lambda m, i=i, k=k: (
                    f"rank {rank}, k = {k}, parameter {i}: the gradient differs from DDP's "
                    f"full-batch average over the 2 ranks\n{m}"))
