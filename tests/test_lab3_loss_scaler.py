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

from _given import as_given, given

# step -> what is written into one gradient element after backward (before unscaling)
INJECT = {2: math.inf, 3: math.nan, 7: -math.inf, 8: math.inf}
SETTINGS = dict(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
# scales that are not powers of two: dividing by S and multiplying by float32(1/S) then differ
ODD = dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.7, growth_interval=2)
# factors that are not exact in float32: GradScaler multiplies the float32 scale by the float64
# factor and rounds once (float32 arithmetic drifts in the last bit: 3.3000002 vs 3.2999999)
INEXACT = [dict(init_scale=3.0, growth_factor=1.1, backoff_factor=0.77, growth_interval=2),
           dict(init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=1)]
INJECT_LATE = {5: math.inf, 9: math.nan}  # growth first, with no backoff to reset the count


def _model(groups: bool, half: bool):
    """Two Linear layers; ``half``: the second in bf16 (gradients of two dtypes; GradScaler refuses fp16 parameters); ``groups``: an
    optimizer with one param group per layer (different learning rates)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if half:
        model[2].bfloat16()
    return model


class _Cast(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        h = self.model[1](self.model[0](x))
        return self.model[2](h.to(self.model[2].weight.dtype)).float()


def lockstep(settings, steps=14, inject=INJECT, optimizer=torch.optim.SGD, groups=False, half=False,
             inject_layer=0):
    """Train two identical models, one with each scaler; return per-step records of both
    (the scale before the step, whether it stepped, step()'s return value, the gradients after
    step() and the parameters after it). ``inject_layer``: the layer (0 or 2) whose weight
    gradient gets the injected inf/NaN."""
    from labkit.lab3.loss_scaler import DynamicLossScaler

    mine = _model(groups, half)
    ref = copy.deepcopy(mine)

    def make(model):
        if groups:
            return optimizer([{"params": model[0].parameters()},
                              {"params": model[2].parameters(), "lr": 0.003}], lr=0.01)
        return optimizer(model.parameters(), lr=0.01)

    opt_mine, opt_ref = make(mine), make(ref)
    s_mine = DynamicLossScaler(**settings)
    s_ref = torch.amp.GradScaler("cpu", **settings)
    records = {"mine": [], "ref": []}
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        for name, model, opt, scaler in (("mine", mine, opt_mine, s_mine), ("ref", ref, opt_ref, s_ref)):
            before = [p.detach().clone() for p in model.parameters()]
            scale = float(scaler.get_scale())
            loss = torch.nn.functional.mse_loss(_Cast(model)(x), y)
            scaler.scale(loss).backward()
            if step in inject:
                model[inject_layer].weight.grad[0, 0] = inject[step]
            if step % 2 == 0:  # half the steps unscale explicitly (as before gradient clipping)
                scaler.unscale_(opt)
            returned = scaler.step(opt)
            scaler.update()
            stepped = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            records[name].append({"scale": scale, "stepped": stepped, "returned": returned,
                                  "grads": [p.grad.clone() for p in model.parameters()],
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
    with given("DynamicLossScaler.scale", loss=loss, w=w):
        scaled = scaler.scale(loss)
    assert scaled.dtype == loss.dtype, f"scaled loss has dtype {scaled.dtype}, expected {loss.dtype}"
    assert float(scaled.detach()) == float(loss.detach()) * 2 ** 12, \
        f"scale(loss) = {float(scaled.detach())}, expected loss × 4096 = {float(loss.detach()) * 2 ** 12}"
    with given("the backward of DynamicLossScaler.scale", w=w):
        scaled.backward()
    torch.testing.assert_close(w.grad, 2 * w.detach() * 2 ** 12, rtol=0, atol=0,
                               msg=lambda m: f"gradient of scale(loss): {m} — is the scaled loss "
                                             "still part of the autograd graph?")


@pytest.mark.exercise("3.1", points=1)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_scale_of_16bit_losses_equals_gradscaler(dtype):
    """Check scale(loss) of 16-bit losses (0-dim and per-sample) at the default scale 2^16, which
    fp16 cannot hold (max 65504): value and dtype equal GradScaler.scale's (tolerance 0: both are
    one multiplication by the same float32 scalar, with torch's type promotion)."""
    from labkit.lab3.loss_scaler import DynamicLossScaler

    for loss in (torch.tensor(0.75, dtype=dtype), torch.tensor([0.5, 1e-3], dtype=dtype)):
        got = as_given(DynamicLossScaler().scale, "DynamicLossScaler.scale")(loss)
        want = torch.amp.GradScaler("cpu").scale(loss)
        assert got.dtype == want.dtype, (f"scale() of a {tuple(loss.shape)} {dtype} loss has dtype "
                                         f"{got.dtype}, GradScaler's {want.dtype}")
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m, loss=loss: (
            f"scale() of the {tuple(loss.shape)} {dtype} loss {loss.tolist()} at scale 2^16 vs "
            f"GradScaler's {want.tolist()}: {m} — multiply by the float32 scale tensor itself "
            "(cast to the loss' dtype, 2^16 becomes inf in fp16)"))


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
    returned = [r["returned"] for r in records["mine"]]
    assert returned == [r["stepped"] for r in records["mine"]], (
        f"step() returned {returned}; it must return True exactly when it stepped the optimizer "
        f"(skipped steps {got})")


@pytest.mark.exercise("3.1", points=1)
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("settings", [SETTINGS, ODD], ids=["powers-of-2", "odd-factors"])
def test_parameters_equal_gradscaler_bit_for_bit(optimizer, settings):
    """Check the parameters after every step equal GradScaler's run, bit for bit (both multiply
    by the same float32 reciprocal, so tolerance 0)."""
    _compare_runs(lockstep(settings, optimizer=optimizer))


def _compare_runs(records):
    """Scales first (a parameter difference after a scale difference says nothing new), then
    the gradients after step() (NaN where GradScaler has NaN) and the parameters, exactly."""
    for step, (a, b) in enumerate(zip(records["mine"], records["ref"])):
        assert a["scale"] == b["scale"], (
            f"scale before step {step}: {a['scale']}, GradScaler's {b['scale']} (the parameters "
            f"follow from it; sequences {[r['scale'] for r in records['mine']]} vs "
            f"{[r['scale'] for r in records['ref']]})")
        for kind in ("grads", "params"):
            for i, (p, q) in enumerate(zip(a[kind], b[kind])):
                torch.testing.assert_close(
                    p, q, rtol=0, atol=0, equal_nan=True,
                    msg=lambda m, i=i, step=step, kind=kind, p=p: (
                        f"{'gradient' if kind == 'grads' else 'parameter'} {i} ({p.dtype}) after "
                        f"step {step} (skipped by GradScaler: {not b['stepped']}), scales equal: {m}"))


@pytest.mark.exercise("3.1", points=1)
@pytest.mark.parametrize("settings", INEXACT, ids=["factors-1.1-0.77", "factors-1.7-0.3"])
def test_scale_sequence_equals_gradscaler_for_inexact_factors(settings):
    """Check the scales, gradients and parameters of 12 steps equal GradScaler's bit for bit
    when the factors are not exact in float32 (GradScaler multiplies in float64, rounds once)."""
    records = lockstep(settings, steps=12, inject=INJECT_LATE)
    got = [r["scale"] for r in records["mine"]]
    want = [r["scale"] for r in records["ref"]]
    for step, (a, b) in enumerate(zip(got, want)):
        ulps = abs(a - b) / math.ulp(b) if math.isfinite(a) and b else math.inf
        assert a == b, (f"scale before step {step} is {a!r}, GradScaler's is {b!r} "
                        f"({ulps:.0f} float32 ulp{'s' if ulps != 1 else ''} of the float64 value "
                        f"apart; sequences {got} vs {want})")
    _compare_runs(records)


@pytest.mark.exercise("3.1", points=1)
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
def test_param_groups_and_bf16_gradients_equal_gradscaler(optimizer):
    """Check two param groups (different learning rates), one of them bf16, an odd scale: every
    gradient after step() (also on the skipped steps: unscaled, inf/NaN where GradScaler's) and
    every parameter equal GradScaler's bit for bit — with the inf/NaN injected into the fp32
    layer, then into the bf16 one (an overflow in any group of gradients skips the step)."""
    _compare_runs(lockstep(ODD, optimizer=optimizer, groups=True, half=True))
    _compare_runs(lockstep(ODD, optimizer=optimizer, groups=True, half=True, inject_layer=2))


@pytest.mark.exercise("3.1", points=1)
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp32+bf16"])
def test_unscale_reads_the_flag_back_once_per_device_and_dtype(half):
    """Check the module's Speed note: unscale_ reads the "any inf or NaN?" flag back to the host
    at most once per (device, dtype) group of gradients, not once per gradient — counted as the
    calls of aten._local_scalar_dense (what .item(), bool() and float() of a tensor run: a
    device→host sync on a GPU) on a model of 4 gradients in one dtype (at most 1), then in two
    (at most 2), with an inf in one of them; the flag and the unscaled gradients must be
    GradScaler's (bit for bit)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from labkit.lab3.loss_scaler import DynamicLossScaler

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    models = [_model(False, half)]
    models.append(copy.deepcopy(models[0]))
    scaler = DynamicLossScaler(init_scale=2.0 ** 10)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for model, s in zip(models, (scaler, ref)):
        s.scale(torch.nn.functional.mse_loss(_Cast(model)(x), y)).backward()
        model[0].weight.grad[0, 0] = math.inf
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    ref.unscale_(opts[1])
    with Reads() as reads:
        found = scaler.unscale_(opts[0])
    groups = 2 if half else 1
    assert reads.n <= groups, (
        f"unscale_ read {reads.n} values back to the host for {groups} (device, dtype) group(s) of "
        "4 gradients: check them all with one foreach call per group (torch's "
        "_amp_foreach_non_finite_check_and_unscale_) and read the flag once, not bool(...) per gradient")
    assert found is True, f"unscale_ returned {found!r} with an inf in a gradient, expected True"
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True, msg=lambda m: (
            f"a gradient unscaled with the flag read once differs from GradScaler's: {m}"))


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


@pytest.mark.parametrize("method", ["unscale_", "step"])
@pytest.mark.parametrize("optimizer", [None, torch.nn.Linear(2, 2)], ids=["None", "a model"])
def test_unscale_and_step_refuse_what_is_not_an_optimizer(method, optimizer):
    """A given check, before the exercise's code: a TypeError naming ``optimizer``, not an
    AttributeError about param_groups from inside."""
    from labkit.lab3.loss_scaler import DynamicLossScaler

    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        getattr(DynamicLossScaler(), method)(optimizer)
