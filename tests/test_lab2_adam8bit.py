"""Graders of Lab 2, exercise 2.3 (labkit.lab2.adam8bit): 8-bit Adam against ``torch.optim.Adam`` (its
first step, from zero moments that 8 bits store exactly; per-element steps after), a
brute-force quantization of Adam's moments, ``bitsandbytes.optim.Adam8bit`` where installed, and
the formula for its state bytes.

Tolerances (fp32 on a CPU) are justified where used; byte counts are exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from _lab2_helpers import (UPDATE_TOL, StrictDevices, assert_models_close, brute_force_quantize, late_gradient_run,
                           one_param, tiny_gpt, train)
from labkit.models import SyntheticData
from labkit.optimizer_states import state_bytes
from _given import assert_state_kept_in_state


@pytest.mark.exercise("2.3", points=2)
def test_adam8bit_first_step_is_adam_and_stores_quantized_moments():
    """Check that step 1 (from zero moments, which 8 bits store exactly) moves the parameters
    as torch.optim.Adam does, and that the stored moments are Adam's m and v quantized with
    the dynamic codes (signed for m, unsigned for v) in blocks of 64 (brute force)."""
    from labkit.lab2.adam8bit import Adam8bit
    from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code

    mine, ref = tiny_gpt(), tiny_gpt()
    data = SyntheticData(64, 32, 4, seed=1)
    opt = Adam8bit(mine.parameters(), lr=1e-3, block_size=64)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    train(mine, opt, data, 1)
    train(ref, ref_opt, data, 1)
    assert_models_close(mine, ref, **UPDATE_TOL)
    for p, q in zip(mine.parameters(), ref.parameters()):
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg"].shape == p.shape
        assert state["exp_avg_sq"].dtype == torch.uint8
        for key, code in (("exp_avg", dynamic_code(True)), ("exp_avg_sq", dynamic_code(False))):
            index, absmax = brute_force_quantize(ref_state[key], code, 64)
            stored = dequantize_blockwise(state[key], state[key + "_absmax"], code, 64)
            scales = absmax.repeat_interleave(64)[: p.numel()].view(p.shape)
            # m, v agree to ulps; a value on a boundary between two codes may round either way.
            # Written as "not within": NaN (a NaN scale or code) is a mismatch, not a pass
            mismatch = ~((stored - code[index] * scales).abs() <= 1e-6 * scales)
            assert mismatch.float().mean() < 1e-3, f"{key}: {int(mismatch.sum())} elements differ"


@pytest.mark.exercise("2.3", points=2)
def test_adam8bit_state_is_two_bytes_per_parameter_plus_scales():
    """Check the measured state: Σ 2n + 8·ceil(n/B) bytes (uint8 m and v, one fp32 absmax per
    block for each), a quarter of fp32 Adam's 8 bytes a parameter plus the scales."""
    from labkit.lab2.adam8bit import Adam8bit

    model = tiny_gpt()
    data = SyntheticData(64, 32, 4, seed=1)
    for block_size in (256, 100):
        opt = Adam8bit(model.parameters(), lr=1e-3, block_size=block_size)
        train(model, opt, data, 2)
        expected = sum(2 * p.numel() + 8 * math.ceil(p.numel() / block_size)
                       for p in model.parameters())
        assert state_bytes(opt) == expected
        assert_state_kept_in_state(opt, skip=(opt.code_m, opt.code_v))  # the 2 shared codes aside
    psi = sum(p.numel() for p in model.parameters())
    assert 2 * psi < state_bytes(opt) < 2.1 * psi


@pytest.mark.exercise("2.3", points=2)
def test_adam8bit_trains_like_fp32_adam_and_bitsandbytes():
    """Train the lab's task (same seed, same batches, 30 steps) with fp32 Adam and this Adam8bit,
    then (if installed) bitsandbytes' Adam8bit (every tensor in 8 bits: min_8bit_size=0).
    Tolerance: the mean loss of the last 10 steps within 2% of fp32 Adam's. Measured on this
    task: both 8-bit optimizers land within 0.05% of fp32 Adam (the dynamic code's relative
    error, ~1% per element, averages out over a block and over steps); the same optimizer with
    a linear code diverges (small v round to 0, so m/√v explodes), and plain SGD at the same lr
    ends ~20% higher. 2% separates them with room for other seeds and machines."""
    from labkit.lab2.adam8bit import Adam8bit
    from labkit.score_table import optional_reference

    data = SyntheticData(64, 32, 8, seed=3)

    def final_loss(make):
        model = tiny_gpt(seed=4)
        losses = train(model, make(model.parameters()), data, 30)
        return sum(losses[-10:]) / 10

    adam = final_loss(lambda p: torch.optim.Adam(p, lr=3e-3))
    assert adam < 0.9 * math.log(64), f"fp32 Adam did not learn ({adam:.3f}): the test's set-up is broken"
    mine = final_loss(lambda p: Adam8bit(p, lr=3e-3))
    assert abs(mine - adam) <= 0.02 * adam, (
        f"final loss {mine:.4f} vs fp32 Adam's {adam:.4f} ({mine / adam - 1:+.1%}, allowed ±2%): "
        "are both moments quantized with the dynamic codes (signed m, unsigned v) and the bias "
        "correction applied?")
    bnb = optional_reference("bitsandbytes", min_version="0.50")
    theirs = final_loss(lambda p: bnb.optim.Adam8bit(p, lr=3e-3, min_8bit_size=0))
    assert abs(theirs - adam) <= 0.02 * adam, f"bitsandbytes' Adam8bit {theirs:.4f} vs Adam {adam:.4f}"


def _per_step_updates(make, steps=12):
    """|Δθ| of every element at every step, for gradients that span 6 orders of magnitude
    inside each block (columns scaled 1e-6 … 1): many v are tiny next to their block's absmax."""
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-6, 0, 256)[None, :]
    p = torch.nn.Parameter(torch.zeros(16, 256))
    opt = make([p])
    out = []
    for _ in range(steps):
        before = p.detach().clone()
        p.grad = torch.randn(16, 256, generator=g) * scale
        opt.step()
        out.append((p.detach() - before).abs())
    return out, opt, p


@pytest.mark.exercise("2.3", points=1)
def test_adam8bit_never_stores_a_nonzero_v_as_zero():
    """After steps on gradients spanning 6 orders of magnitude per block, every element's v is
    non-zero (every gradient is), so no stored v code may decode to 0: a v rounded to 0 leaves
    ε alone under m and the element jumps by up to lr·m/ε."""
    from labkit.lab2.adam8bit import Adam8bit
    from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code

    _, opt, p = _per_step_updates(lambda ps: Adam8bit(ps, lr=1e-3))
    state = opt.state[p]
    v = dequantize_blockwise(state["exp_avg_sq"], state["exp_avg_sq_absmax"], dynamic_code(False), 256)
    zeros = int((v == 0).sum())
    assert zeros == 0, (f"{zeros} of {v.numel()} elements have a non-zero v stored as 0: round a "
                        "non-zero v that falls below the code's smallest entry up to that entry")


@pytest.mark.exercise("2.3", points=1)
def test_adam8bit_per_element_steps_stay_near_adams():
    """Every element's step |Δθ| at every one of 12 steps is at most 4× fp32 Adam's on the same
    gradients (Adam's step floored at lr/10, below which the ratio means little). Measured: the
    reference solution stays within 3.1× (an element with a small m or v in a block with a large
    absmax carries the code's coarser relative error); v flushed to 0 gives ~10⁴×."""
    from labkit.lab2.adam8bit import Adam8bit

    mine, _, _ = _per_step_updates(lambda ps: Adam8bit(ps, lr=1e-3))
    ref, _, _ = _per_step_updates(lambda ps: torch.optim.Adam(ps, lr=1e-3))
    for step, (a, b) in enumerate(zip(mine, ref), start=1):
        ratio = float((a / b.clamp_min(1e-4)).max())
        assert ratio <= 4.0, (
            f"step {step}: an element moved {ratio:.3g}× as far as fp32 Adam moves it (allowed 4×): "
            "is a non-zero v stored as 0, or m/v dequantized with the wrong code or block?")


# =================================================================== 2.4 LOMO


@pytest.mark.parametrize("call,word", [
    (lambda m: m.Adam8bit(one_param(), block_size=0), "block_size"),
    (lambda m: m.Adam8bit(one_param(), betas=(0.9, 1.5)), "betas"),
    (lambda m: m.Adam8bit(one_param(), lr=-1e-3), "lr"),
    (lambda m: m.Adam8bit(one_param(), eps=-1.0), "eps"),
    (lambda m: m.adam8bit_state_bytes([100, -5]), "numels"),
    (lambda m: m.adam8bit_state_bytes([100], block_size=0), "block_size"),
    (lambda m: m.adam8bit_state_bytes(100), "numels"),
])
def test_adam8bit_refuses_bad_input(call, word):
    import labkit.lab2.adam8bit as m

    with pytest.raises((ValueError, TypeError), match=word):
        call(m)


@pytest.mark.exercise("2.3", points=1)
def test_adam8bit_state_lives_on_the_parameters_device():
    """Parameters on another device than the codes (the GPU vs the CPU in Colab; here ``meta``,
    with ``StrictDevices`` raising as CUDA does on an op that mixes devices): a step must run,
    and every state tensor (codes and absmax scales) must live on the parameter's device."""
    from labkit.lab2.adam8bit import Adam8bit

    p = torch.nn.Parameter(torch.empty(300, 7, device="meta"))
    opt = Adam8bit([p], lr=1e-3, block_size=64)
    p.grad = torch.empty(300, 7, device="meta")
    with StrictDevices():
        try:
            opt.step()
        except NotImplementedError:
            raise  # an untouched stub: "not attempted", not a device error
        except RuntimeError as exc:
            raise AssertionError(f"Adam8bit.step with a parameter on another device than the "
                                 f"codes: {exc}") from None
    wrong = {k: str(v.device) for k, v in opt.state[p].items()
             if isinstance(v, torch.Tensor) and v.device != p.device}
    assert not wrong, (f"state tensors {wrong} are not on the parameter's device {p.device}: "
                       "create the codes and the absmax scales where the parameter lives")


@pytest.mark.exercise("2.3", points=1)
def test_adam8bit_counts_steps_per_parameter_and_reads_each_group():
    """Two parameter groups (a 4×6 weight at lr 0.1, betas (0.9, 0.999); a 6-vector at lr 0.05,
    betas (0.5, 0.9)), the vector's first gradient at step 2. The vector's step 2 is its first
    (from zero moments, which 8 bits store exactly), so it must equal ``torch.optim.Adam``'s
    with the same groups: lr and betas of its group, bias corrections of t = 1. The weight's
    first step likewise. After ``step()`` the caller's gradients are untouched (as torch's).
    Tolerance: UPDATE_TOL."""
    from labkit.lab2.adam8bit import Adam8bit

    groups = [dict(lr=0.1), dict(lr=0.05, betas=(0.5, 0.9))]
    opt, a, b, got = late_gradient_run(lambda ps: Adam8bit(ps, block_size=8), groups=groups)
    _, _, _, want = late_gradient_run(lambda ps: torch.optim.Adam(ps), groups=groups)
    torch.testing.assert_close(got[0][0], want[0][0], **UPDATE_TOL, msg=lambda m: (
        f"the weight's first step (group 0: {groups[0]}) vs torch.optim.Adam: {m}"))
    torch.testing.assert_close(got[0][1], want[0][1], rtol=0, atol=0, msg=lambda m: (
        f"the vector moved at step 1 without a gradient: {m}"))
    torch.testing.assert_close(got[1][1], want[1][1], **UPDATE_TOL, msg=lambda m: (
        f"the vector's first step (step 2; group 1: {groups[1]}) vs torch.optim.Adam: {m} — use "
        "the group's lr and betas, and bias-correct with the parameter's own step count (1)"))
    steps = (opt.state[a]["step"], opt.state[b]["step"])
    assert all(type(t) is int for t in steps) and steps == (3, 2), (
        f"step counts weight {steps[0]!r}, vector {steps[1]!r}, expected the ints 3 and 2 (the "
        "contract: state['step'] is an int, this parameter's own count of steps)")
    # Adam's first step is lr·sign(g) whatever the betas; the stored m = (1 − β₁)·g is not.
    # Tolerance: the signed dynamic code's largest half-gap is < 1% of the block's absmax.
    from labkit.lab2.quantize8bit import dequantize_blockwise

    _, _, b2, _ = late_gradient_run(lambda ps: Adam8bit(ps, block_size=8), steps=2, groups=groups)
    opt2 = b2._opt
    state = opt2.state[b2]
    m = dequantize_blockwise(state["exp_avg"], state["exp_avg_absmax"], opt2.code_m, 8)
    want_m = (1 - groups[1]["betas"][0]) * b2._grads[1]
    torch.testing.assert_close(m, want_m, rtol=0, atol=0.01 * float(want_m.abs().max()), msg=lambda msg: (
        f"the vector's stored m after its first step (group 1, β₁ = {groups[1]['betas'][0]}): "
        f"{msg} — expected (1 − β₁)·g with the group's β₁"))
    p = torch.nn.Parameter(torch.zeros(5))
    o = Adam8bit([p])
    p.grad = torch.ones(5)
    o.step()
    assert p.grad is not None and torch.equal(p.grad, torch.ones(5)), (
        "step() changed or dropped the parameter's .grad: zero_grad() is the caller's")


@pytest.mark.exercise("2.3", points=1)
def test_adam8bit_on_bf16_parameters():
    """bf16 parameters, two steps: each step equals Adam computed in fp32 from the moments that
    were stored (dequantized here: step 2 starts from them) and the fp32 gradient, rounded to
    bf16; the parameters stay bf16. Tolerance: one bf16 ulp (the fp32 result rounded either
    way)."""
    from labkit.lab2.adam8bit import Adam8bit
    from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code

    g = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(10, 30, generator=g).to(torch.bfloat16))
    opt = Adam8bit([w], lr=1e-2, block_size=64)
    code_m, code_v = dynamic_code(True), dynamic_code(False)
    m = v = torch.zeros(10, 30)
    for t in (1, 2):
        grad = torch.randn(10, 30, generator=g).to(torch.bfloat16)
        before = w.detach().float().clone()
        w.grad = grad
        opt.step()
        m = 0.9 * m + 0.1 * grad.float()
        v = 0.999 * v + 0.001 * grad.float() ** 2
        want = before - 1e-2 / (1 - 0.9 ** t) * m / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)
        assert w.dtype == torch.bfloat16, f"the parameter became {w.dtype}: keep its dtype"
        torch.testing.assert_close(w.detach().float(), want, atol=1e-5, rtol=2 ** -7,
                                   msg=lambda msg, t=t: f"bf16 weight after step {t}: {msg}")
        state = opt.state[w]
        m = dequantize_blockwise(state["exp_avg"], state["exp_avg_absmax"], code_m, 64)
        v = dequantize_blockwise(state["exp_avg_sq"], state["exp_avg_sq_absmax"], code_v, 64)
