"""Graders of Lab 2, exercise 2.1 (labkit.lab2.adafactor): Adafactor against ``torch.optim.Adafactor``
(torch 2.13), the reference nobody in this course wrote, and its state bytes against the formula.

Tolerances (fp32 on a CPU): the same update computed with sums in another order differs by a
few ulps (UPDATE_TOL: atol 1e-6 for parameters of magnitude ≤ ~1, rtol 1e-5), justified where
used; byte counts are exact.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _lab2_helpers import (UPDATE_TOL, late_gradient_run, one_param, tiny_gpt, train)
from labkit.models import SyntheticData
from labkit.optimizer_states import state_bytes
from _given import assert_state_kept_in_state


ADAFACTOR_SETTINGS = [
    dict(),  # torch's defaults: lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1, no decay
    dict(lr=0.05, beta2_decay=-0.5, eps=(1e-12, 1e-3), d=2.0, weight_decay=0.1),
    # lr = 1 ≥ 1/√t for every step: the relative step ρ_t = min(lr, 1/√t) is the cap 1/√t,
    # and the decay factor 1 − lr·λ = 0.9 is large, so a missing cap or a decay scaled by ρ_t
    # instead of lr moves the weights by far more than the tolerance
    dict(lr=1.0, weight_decay=0.1),
]


@pytest.mark.exercise("2.1", points=1)
@pytest.mark.parametrize("settings", ADAFACTOR_SETTINGS, ids=["defaults", "custom", "capped-decay"])
def test_adafactor_matches_torch_adafactor(settings):
    """Check that 5 steps on a GPT give the parameters and states of torch.optim.Adafactor."""
    from labkit.lab2.adafactor import Adafactor

    # No biases: the key bias of attention gets a gradient of pure rounding noise (softmax
    # ignores it), which Adafactor's normalization would blow up to full-size steps.
    mine, ref = tiny_gpt(bias=False), tiny_gpt(bias=False)
    data = SyntheticData(64, 32, 4, seed=1)
    opt_mine = Adafactor(mine.parameters(), **settings)
    opt_ref = torch.optim.Adafactor(ref.parameters(), **settings)
    # With lr = 1 a step is ρ_t·RMS(θ) ≈ 0.5 of a LayerNorm weight, so its rounding is ulps of 1
    # (1.2e-7) over a few operations, compounding over 5 large steps to ~2e-5: atol, rtol 1e-4
    # (a missing cap or a wrongly scaled decay moves
    # weights by > 1e-2). Otherwise steps are ≤ 0.05 and UPDATE_TOL holds.
    tol = dict(atol=1e-4, rtol=1e-4) if settings.get("lr", 0) >= 1 else UPDATE_TOL
    for i in range(5):
        train(mine, opt_mine, data, 1, start=i)
        train(ref, opt_ref, data, 1, start=i)
        for (name, a), b in zip(mine.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name, i=i: (
                f"{name} after step {i + 1} with {settings or 'defaults'} — check the relative "
                "step ρ_t = min(lr, 1/√t), the scale max(ε₂, RMS(θ)), the decay factor 1 − lr·λ, "
                f"the β̂₂ = 1 − t^τ schedule and the update clipping by max(1, RMS(U)/d)\n{m}"))
    for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
        s_mine, s_ref = opt_mine.state[p], opt_ref.state[q]
        assert set(s_mine) == set(s_ref), f"{name}: state keys {set(s_mine)} != torch's {set(s_ref)}"
        for key in s_ref:
            assert s_mine[key].shape == s_ref[key].shape, (
                f"{name}: state {key!r} has shape {tuple(s_mine[key].shape)}, torch's "
                f"{tuple(s_ref[key].shape)}: row factors keep the last dim as 1, column factors "
                "the second-to-last")
            # running means of G²: relative agreement to ulps of the gradients (1e-4); with lr = 1
            # the parameters themselves differ by up to ~2e-5 (above), so the gradients, and their
            # squares, by a few times that on small entries (1.2e-4 seen once under load): 1e-3.
            # A wrong weight 1 − β̂₂ is off by > 10% from step 2 on (t^-0.8 = 0.57 at t = 2).
            state_rtol = 1e-3 if settings.get("lr", 0) >= 1 else 1e-4
            torch.testing.assert_close(s_mine[key], s_ref[key], rtol=state_rtol, atol=1e-20, msg=lambda m, name=name, key=key: (
                f"{name}[{key!r}] — the running mean of G² uses the weight 1 − β̂₂ = t^beta2_decay\n{m}"))


@pytest.mark.exercise("2.1", points=1)
def test_adafactor_factors_the_last_two_dims_of_a_3d_weight():
    """Check a (3, 20, 30) weight and a vector against torch.optim.Adafactor (factored over the
    last two dims, so row_var is (3, 20, 1) and col_var (3, 1, 30))."""
    from labkit.lab2.adafactor import Adafactor

    torch.manual_seed(0)
    w0, b0 = torch.randn(3, 20, 30), torch.randn(30)
    target = torch.randn(3, 20, 30)
    results = []
    for cls in (Adafactor, torch.optim.Adafactor):
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        opt = cls([w, b], lr=0.05)
        for _ in range(4):
            loss = ((w + b - target) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        results.append((w.detach(), b.detach(), opt.state[w]))
    (w1, b1, s1), (w2, b2, s2) = results
    torch.testing.assert_close(w1, w2, **UPDATE_TOL)
    torch.testing.assert_close(b1, b2, **UPDATE_TOL)
    assert s1["row_var"].shape == (3, 20, 1) and s1["col_var"].shape == (3, 1, 30)


@pytest.mark.exercise("2.1", points=1)
@pytest.mark.parametrize("m,n", [(64, 256), (300, 7), (1000, 1000)])
def test_adafactor_state_bytes_are_m_plus_n(m, n):
    """Check the measured state of an m×n weight + bias: 4(m+n) + 4n + two 4-byte step
    counters — exactly torch.optim.Adafactor's — against Adam's 8mn + 8n."""
    from labkit.lab2.adafactor import Adafactor

    layer = torch.nn.Linear(n, m)  # weight (m, n), bias (m,)
    opt = Adafactor(layer.parameters())
    layer(torch.randn(2, n)).sum().backward()
    opt.step()
    expected = 4 * (m + n) + 4 * m + 2 * 4  # row + col factors, the bias' variance, 2 steps
    assert state_bytes(opt) == expected
    assert_state_kept_in_state(opt)
    ref_layer = copy.deepcopy(layer)
    ref = torch.optim.Adafactor(ref_layer.parameters())
    ref_layer(torch.randn(2, n)).sum().backward()
    ref.step()
    assert state_bytes(opt) == state_bytes(ref)
    assert state_bytes(opt) < 8 * (m * n + m)


# =================================================================== 2.2 block-wise quantization


@pytest.mark.parametrize("call,word", [
    (lambda m: m.Adafactor(one_param(), lr=-1), "lr"),
    (lambda m: m.Adafactor(one_param(), lr="fast"), "lr"),
    (lambda m: m.Adafactor(one_param(), beta2_decay=0.5), "beta2_decay"),
    (lambda m: m.Adafactor(one_param(), d=0.5), "d "),
    (lambda m: m.Adafactor(one_param(), eps=(None,)), "eps"),
    (lambda m: m.Adafactor(one_param(), eps=("a", 1e-3)), "eps"),
    (lambda m: m.Adafactor(one_param(), weight_decay=-0.1), "weight_decay"),
    (lambda m: m.factored_state_bytes((0, 3)), "shape"),
    (lambda m: m.factored_state_bytes(7), "shape"),
    (lambda m: m.factored_state_bytes((2, 3), dtype="float32"), "dtype"),
])
def test_adafactor_refuses_bad_input(call, word):
    import labkit.lab2.adafactor as m

    with pytest.raises((ValueError, TypeError), match=word):
        call(m)


@pytest.mark.exercise("2.1", points=1)
def test_adafactor_groups_and_a_late_parameter_match_torch():
    """Two parameter groups (lr 0.05, d 1; lr 1.0 — the 1/√t cap —, d 1.5, weight decay 0.2), the
    second's parameter getting its first gradient at step 2, against ``torch.optim.Adafactor``
    with the same groups: each group's options, and each parameter's own step count (ρ_t and
    β̂₂ of the late one start at t = 1). Tolerance: atol, rtol 1e-4 (lr 1 steps, see above)."""
    from labkit.lab2.adafactor import Adafactor

    groups = [dict(lr=0.05), dict(lr=1.0, d=1.5, weight_decay=0.2)]
    _, _, _, got = late_gradient_run(lambda ps: Adafactor(ps), groups=groups)
    _, _, _, want = late_gradient_run(lambda ps: torch.optim.Adafactor(ps), groups=groups)
    for step, ((ga, gb), (wa, wb)) in enumerate(zip(got, want), 1):
        for name, x, y in (("weight (group 0, a gradient every step)", ga, wa),
                           ("vector (group 1, first gradient at step 2)", gb, wb)):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4, msg=lambda m, name=name, step=step: (
                f"{name} after step {step} vs torch.optim.Adafactor: {m}"))


@pytest.mark.exercise("2.1", points=1)
def test_adafactor_moves_a_parameter_that_starts_at_zero():
    """A zero-initialised 4×6 weight and 6-vector (as a bias is): their RMS is 0, so the relative
    step must be scaled by ε₂ (the smallest RMS, 1e-3) — without that floor they never train.
    3 steps against ``torch.optim.Adafactor``; after them both have moved. Tolerance:
    UPDATE_TOL (steps of order lr·ε₂ = 1e-5 per element, compared at atol 1e-6 + rtol 1e-5)."""
    from labkit.lab2.adafactor import Adafactor

    g = torch.Generator().manual_seed(3)
    grads = [(torch.randn(4, 6, generator=g), torch.randn(6, generator=g)) for _ in range(3)]
    runs = {}
    for name, make in (("yours", Adafactor), ("torch", torch.optim.Adafactor)):
        w, b = torch.nn.Parameter(torch.zeros(4, 6)), torch.nn.Parameter(torch.zeros(6))
        opt = make([w, b])
        for gw, gb in grads:
            w.grad, b.grad = gw.clone(), gb.clone()
            opt.step()
        runs[name] = (w.detach(), b.detach())
    for what, got, want in zip(("weight", "vector"), runs["yours"], runs["torch"]):
        assert got.abs().max() > 0, (f"a zero-initialised {what} did not move in 3 steps: the "
                                     "step is lr·max(ε₂, RMS(θ)), never 0")
        torch.testing.assert_close(got, want, **UPDATE_TOL, msg=lambda m, what=what: (
            f"zero-initialised {what} after 3 steps vs torch.optim.Adafactor: {m}"))


@pytest.mark.exercise("2.1", points=1)
def test_adafactor_zero_gradient_rows_and_columns_stay_finite():
    """A 12×16 weight whose gradient is zero in 3 columns and 2 rows at every step: V̂ is 0
    there, so the estimate must be clamped (ε₁) before its inverse square root, as torch does.
    Against ``torch.optim.Adafactor``, 3 steps; every weight finite. Tolerance: UPDATE_TOL."""
    from labkit.lab2.adafactor import Adafactor

    g = torch.Generator().manual_seed(8)
    mask = torch.ones(12, 16)
    mask[:, :3] = 0
    mask[:2] = 0
    w0 = torch.randn(12, 16, generator=g)
    grads = [torch.randn(12, 16, generator=g) * mask for _ in range(3)]
    out = []
    for cls in (Adafactor, torch.optim.Adafactor):
        w = torch.nn.Parameter(w0.clone())
        opt = cls([w], lr=0.05)
        for gr in grads:
            w.grad = gr.clone()
            opt.step()
        out.append(w.detach())
    bad = int((~torch.isfinite(out[0])).sum())
    assert bad == 0, (f"{bad} of {out[0].numel()} weights are NaN/inf with zero-gradient rows and "
                      "columns: clamp V̂ from below (ε₁²) before taking 1/√V̂")
    torch.testing.assert_close(out[0], out[1], **UPDATE_TOL)


@pytest.mark.exercise("2.1", points=1)
@pytest.mark.parametrize("dtype,scale", [(torch.float64, 1e-9), (torch.bfloat16, 1e-3)],
                         ids=["fp64", "bf16"])
def test_adafactor_in_other_dtypes_matches_torch(dtype, scale):
    """A (2, 6, 8) weight and a vector in fp64 and in bf16, 3 steps against torch.optim.Adafactor
    in the same dtype, with gradients of a size (``scale``) whose G² lies near ε₁² of that dtype
    (its machine epsilon, squared), so the clamps use the parameter's ε₁, not fp32's.
    Tolerance: fp64 rtol 1e-10 (same operations, ulps of 1e-16); bf16 one ulp (2⁻⁷ relative),
    as both round the same bf16 operations."""
    from labkit.lab2.adafactor import Adafactor

    g = torch.Generator().manual_seed(5)
    w0, v0 = torch.randn(2, 6, 8, generator=g), torch.randn(8, generator=g)
    grads = [(torch.randn(2, 6, 8, generator=g) * scale, torch.randn(8, generator=g) * scale)
             for _ in range(3)]
    out = []
    for cls in (Adafactor, torch.optim.Adafactor):
        w = torch.nn.Parameter(w0.to(dtype))
        v = torch.nn.Parameter(v0.to(dtype))
        opt = cls([w, v], lr=0.05)
        history = []
        for gw, gv in grads:
            w.grad, v.grad = gw.to(dtype), gv.to(dtype)
            opt.step()
            history.append((w.detach().clone(), v.detach().clone()))
        out.append(history)
    tol = dict(atol=0, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=2 ** -7)
    for step, ((wa, va), (wb, vb)) in enumerate(zip(*out), 1):
        for name, a, b in (("weight", wa, wb), ("vector", va, vb)):
            assert a.dtype == dtype, f"{name} became {a.dtype}: the step must keep the parameter's dtype"
            torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name, step=step: (
                f"{str(dtype).removeprefix('torch.')} {name} after step {step} vs "
                f"torch.optim.Adafactor: {m}"))


def test_adafactor_skips_an_empty_parameter():
    """Not graded (given code): a parameter with no elements has nothing to update; the step
    skips it (``torch.optim.Adafactor`` divides by its numel and raises ZeroDivisionError)."""
    from labkit.lab2.adafactor import Adafactor

    empty = torch.nn.Parameter(torch.zeros(0, 4))
    empty.grad = torch.zeros(0, 4)
    Adafactor([empty]).step()
    assert empty.shape == (0, 4) and not Adafactor([empty]).state
