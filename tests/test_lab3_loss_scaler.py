"""Graders of Lab 3, exercise 3.1 (labs/03_parameters.ipynb): a dynamic loss scaler.

Reference nobody in this course wrote: ``torch.amp.GradScaler("cpu")`` (it runs on CPU in torch
2.13), driven in lockstep with the student's scaler on an identical copy of a model, with inf
and NaN gradients injected at chosen steps. Both scalers multiply by the same float32 numbers,
so the comparisons are exact (tolerance 0): the scale sequence, the skipped steps and the
parameters bit for bit.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

# step -> what is written into one gradient element after backward (before unscaling)
INJECT = {2: math.inf, 3: math.nan, 7: -math.inf, 8: math.inf}
SETTINGS = dict(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
# scales that are not powers of two: dividing by S and multiplying by float32(1/S) then differ
ODD = dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.7, growth_interval=2)


def lockstep(settings, steps=14, inject=INJECT, optimizer=torch.optim.SGD):
    """Train two identical models, one with each scaler; return per-step records of both."""
    from labkit.lab3.loss_scaler import DynamicLossScaler

    torch.manual_seed(0)
    mine = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ref = copy.deepcopy(mine)
    opt_mine = optimizer(mine.parameters(), lr=0.01)
    opt_ref = optimizer(ref.parameters(), lr=0.01)
    s_mine = DynamicLossScaler(**settings)
    s_ref = torch.amp.GradScaler("cpu", **settings)
    records = {"mine": [], "ref": []}
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        for name, model, opt, scaler in (("mine", mine, opt_mine, s_mine), ("ref", ref, opt_ref, s_ref)):
            before = [p.detach().clone() for p in model.parameters()]
            scale = float(scaler.get_scale())
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if step in inject:
                model[0].weight.grad[0, 0] = inject[step]
            if step % 2 == 0:  # half the steps unscale explicitly (as before gradient clipping)
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            stepped = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            records[name].append({"scale": scale, "stepped": stepped,
                                  "params": [p.detach().clone() for p in model.parameters()]})
            opt.zero_grad(set_to_none=True)
    return records


@pytest.mark.exercise("3.1", points=1)
def test_scale_multiplies_the_loss_by_the_current_scale():
    """Check scale(loss) = loss × scale exactly, differentiable, with the loss' dtype."""
    from labkit.lab3.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=2.0 ** 12)
    w = torch.tensor([1.5, -2.0], requires_grad=True)
    loss = (w * w).sum()
    scaled = scaler.scale(loss)
    assert scaled.dtype == loss.dtype, f"scaled loss has dtype {scaled.dtype}, expected {loss.dtype}"
    assert float(scaled.detach()) == float(loss.detach()) * 2 ** 12, \
        f"scale(loss) = {float(scaled.detach())}, expected loss × 4096 = {float(loss.detach()) * 2 ** 12}"
    scaled.backward()
    torch.testing.assert_close(w.grad, 2 * w.detach() * 2 ** 12, rtol=0, atol=0,
                               msg=lambda m: f"gradient of scale(loss): {m} — is the scaled loss "
                                             "still part of the autograd graph?")


@pytest.mark.exercise("3.1", points=1)
@pytest.mark.parametrize("settings", [SETTINGS, ODD], ids=["powers-of-2", "odd-factors"])
def test_scale_sequence_equals_gradscaler(settings):
    """Check the scale before each of 14 steps (with inf/NaN injected at 2, 3, 7, 8; growth
    every 3 or 2 good steps) equals torch.amp.GradScaler's, exactly."""
    records = lockstep(settings)
    got = [r["scale"] for r in records["mine"]]
    want = [r["scale"] for r in records["ref"]]
    for step, (a, b) in enumerate(zip(got, want)):
        assert a == b, (f"scale before step {step} is {a}, GradScaler's is {b} (sequence {got} vs "
                        f"{want}): is backoff applied on every non-finite step, growth after exactly "
                        "growth_interval good steps in a row, and the count reset after each change?")


@pytest.mark.exercise("3.1", points=1)
def test_skipped_steps_equal_gradscaler():
    """Check which steps leave the parameters untouched: exactly the steps with inf/NaN."""
    records = lockstep(SETTINGS)
    got = [i for i, r in enumerate(records["mine"]) if not r["stepped"]]
    want = [i for i, r in enumerate(records["ref"]) if not r["stepped"]]
    assert got == want == sorted(INJECT), (
        f"skipped steps {got}, GradScaler skips {want} (injected at {sorted(INJECT)}): is a "
        "NaN detected as well as ±inf, and is optimizer.step() skipped when one is found?")


@pytest.mark.exercise("3.1", points=1)
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("settings", [SETTINGS, ODD], ids=["powers-of-2", "odd-factors"])
def test_parameters_equal_gradscaler_bit_for_bit(optimizer, settings):
    """Check the parameters after every step equal GradScaler's run, bit for bit (both multiply
    by the same float32 reciprocal, so tolerance 0)."""
    records = lockstep(settings, optimizer=optimizer)
    for step, (a, b) in enumerate(zip(records["mine"], records["ref"])):
        for i, (p, q) in enumerate(zip(a["params"], b["params"])):
            torch.testing.assert_close(
                p, q, rtol=0, atol=0,
                msg=lambda m, i=i, step=step: f"parameter {i} after step {step}: {m} — are the "
                "gradients multiplied by the float32 reciprocal of the scale (computed in float64), "
                "once per iteration?")


@pytest.mark.exercise("3.1", points=1)
def test_growth_stops_at_float32_overflow():
    """Check a scale near float32's max is not grown to inf (GradScaler keeps it)."""
    big = dict(init_scale=2.0 ** 126, growth_factor=2.0 ** 4, backoff_factor=0.5, growth_interval=1)
    records = lockstep(big, steps=3, inject={})
    got = [r["scale"] for r in records["mine"]]
    want = [r["scale"] for r in records["ref"]]
    assert got == want, f"scales {got}, GradScaler's {want}: an infinite grown scale must be dropped"


@pytest.mark.parametrize("kwargs,name", [
    (dict(init_scale=math.inf), "init_scale"), (dict(init_scale=0.0), "init_scale"),
    (dict(init_scale=math.nan), "init_scale"), (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=1.5), "backoff_factor"), (dict(growth_interval=0), "growth_interval"),
])
def test_bad_settings_raise_value_error_naming_the_argument(kwargs, name):
    from labkit.lab3.loss_scaler import DynamicLossScaler

    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kwargs)
