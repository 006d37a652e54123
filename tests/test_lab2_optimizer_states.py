"""Graders of Lab 2 (labs/02_optimizer_states.ipynb): optimizer states — don't store, store less,
store apart.

References nobody in this course wrote: ``torch.optim.Adafactor``, ``torch.optim.Adam`` and
``torch.optim.SGD`` for the updates; ``bitsandbytes`` (``quantize_blockwise``,
``dequantize_blockwise``, ``optim.Adam8bit``) for 8-bit quantization; a brute-force nearest-code
search for the codes; ``MemTracker`` (via ``labkit.measure``) for gradient bytes; the tensors
in each optimizer's ``state`` (``labkit.optimizer_states``) and the chapter's formulas for state
bytes; ``labkit.comm_count`` for the collectives of ZeRO-1 over real gloo ranks
(``labkit.dist``), with the unsharded reference computed here in the test process.

Tolerances (fp32 on a CPU), each justified where it is used: the same update computed with
sums in another order differs by a few ulps (atol 1e-6 for parameters of magnitude ≤ ~1,
rtol 1e-5); byte counts and collective counts are exact integers.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from labkit.measure import measure_step
from labkit.models import GPT, GPTConfig, SyntheticData
from labkit.optimizer_states import state_bytes

# fp32 rounding of the same formula with reductions in another order (mean of G² as
# norm²/n or as mean(G·G); RMS(θ); the all-reduce's sum order): a few ulps of numbers ≤ ~1.
UPDATE_TOL = dict(atol=1e-6, rtol=1e-5)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    """A GPT small enough for a few steps in well under a second on a CPU."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def train(model, optimizer, data, steps, *, start=0):
    """Plain loop: forward, backward, ``optimizer.step()`` (skipped when None), zero_grad."""
    losses = []
    for i in range(start, start + steps):
        x, y = data.batch(i)
        loss = model(x, y)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def assert_params_close(model_a, model_b, **tol):
    for (name, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


# =================================================================== 2.1 Adafactor

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
            # running means of G²: relative agreement to ulps of the gradients
            torch.testing.assert_close(s_mine[key], s_ref[key], rtol=1e-4, atol=1e-20, msg=lambda m, name=name, key=key: (
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
    ref_layer = copy.deepcopy(layer)
    ref = torch.optim.Adafactor(ref_layer.parameters())
    ref_layer(torch.randn(2, n)).sum().backward()
    ref.step()
    assert state_bytes(opt) == state_bytes(ref)
    assert state_bytes(opt) < 8 * (m * n + m)


# =================================================================== 2.2 block-wise quantization

def brute_force_quantize(x, code, block_size):
    """The plain definition: per-block absmax, then the index of the nearest code entry."""
    n = x.numel()
    blocks = math.ceil(n / block_size)
    flat = torch.zeros(blocks * block_size)
    flat[:n] = x.reshape(-1).float()
    flat = flat.view(blocks, block_size)
    absmax = flat.abs().amax(dim=1)
    normalized = flat / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    index = (normalized[..., None] - code).abs().argmin(dim=-1)  # first of equal distances
    return index.reshape(-1)[:n].view(x.shape), absmax


def heavy_tailed(*shape, seed=0):
    """Values over many orders of magnitude, like Adam's moments."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(*shape, generator=g) ** 6


@pytest.mark.exercise("2.2", points=1)
@pytest.mark.parametrize("kind", ["linear", "dynamic"])
def test_quantize_picks_the_nearest_code_per_block(kind):
    """Check codes and scales against a brute-force nearest-code search for blocks of 64, 256
    and 1000 (a size none of them divides), and that dequantize returns code[index] · absmax."""
    from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code, linear_code, quantize_blockwise

    code = linear_code() if kind == "linear" else dynamic_code()
    x = heavy_tailed(37, 29)  # 1073 elements: blocks never divide it
    for block_size in (64, 256, 1000):
        codes, absmax = quantize_blockwise(x, code, block_size)
        ref_index, ref_absmax = brute_force_quantize(x, code, block_size)
        where = f"{kind} code, block_size={block_size}"
        assert codes.dtype == torch.uint8 and codes.shape == x.shape, (
            f"{where}: codes are {codes.dtype} of shape {tuple(codes.shape)}, expected torch.uint8 "
            f"of x's shape {tuple(x.shape)}: one byte per element, in x's shape")
        assert absmax.dtype == torch.float32, f"{where}: absmax is {absmax.dtype}, expected torch.float32"
        n_blocks = math.ceil(x.numel() / block_size)
        assert absmax.shape == (n_blocks,), (
            f"{where}: absmax has shape {tuple(absmax.shape)}, expected ({n_blocks},): one per block, "
            f"the last block padded ({x.numel()} elements do not divide by {block_size})")
        torch.testing.assert_close(absmax, ref_absmax, rtol=0, atol=0, msg=lambda m: (
            f"{where}: absmax differs from the largest |x| of each block: {m}"))
        # The chosen entry is a nearest one: as close as brute force's, up to float32 rounding
        # of the distances (near a midpoint both neighbours are at the same rounded distance).
        scales = ref_absmax.repeat_interleave(block_size)[: x.numel()].view(x.shape)
        normalized = x / torch.where(scales > 0, scales, torch.ones_like(scales))
        dist_mine = (normalized - code[codes.long()]).abs()
        dist_ref = (normalized - code[ref_index]).abs()
        worse = int((dist_mine > dist_ref + 1e-7).sum())
        assert worse == 0, (
            f"{where}: {worse} of {x.numel()} elements are not mapped to a nearest code entry "
            f"(largest excess distance {float((dist_mine - dist_ref).max()):.3g}): round to the "
            "nearest entry of the sorted code (midpoints between neighbours), not down or up")
        torch.testing.assert_close(dequantize_blockwise(codes, absmax, code, block_size),
                                   code[codes.long()] * scales, rtol=0, atol=0, msg=lambda m: (
            f"{where}: dequantize must return code[index] · absmax of the element's block: {m}"))


@pytest.mark.exercise("2.2", points=1)
@pytest.mark.parametrize("block_size", [64, 256, 4096])
def test_quantize_against_bitsandbytes(block_size):
    """Check against bitsandbytes.functional.quantize_blockwise with its dynamic map: the same
    absmax per block; dequantizing bitsandbytes' codes gives bitsandbytes' values; and the
    round-trip error is no larger than bitsandbytes' (its CPU kernel's search is not always
    the nearest entry, the exact nearest can only be closer)."""
    from labkit.grading import optional_reference
    from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code, quantize_blockwise

    optional_reference("bitsandbytes", min_version="0.50")
    import bitsandbytes.functional as F

    code = dynamic_code()
    x = heavy_tailed(50_001, seed=1)
    q_bnb, st = F.quantize_blockwise(x, code=code, blocksize=block_size)
    codes, absmax = quantize_blockwise(x, code, block_size)
    torch.testing.assert_close(absmax, st.absmax, rtol=0, atol=0, msg=lambda m: (
        f"absmax per block of {block_size} vs bitsandbytes: {m} — one scale per block of the "
        "flattened tensor, the last block short"))
    torch.testing.assert_close(dequantize_blockwise(q_bnb, st.absmax, code, block_size),
                               F.dequantize_blockwise(q_bnb, st), rtol=0, atol=0, msg=lambda m: (
        f"dequantizing bitsandbytes' codes: {m} — code[index] × its block's absmax"))
    err_mine = (dequantize_blockwise(codes, absmax, code, block_size) - x).abs()
    err_bnb = (F.dequantize_blockwise(q_bnb, st) - x).abs()
    assert err_mine.mean() <= err_bnb.mean() * (1 + 1e-6), (
        f"mean round-trip error {err_mine.mean():.3g} is {err_mine.mean() / err_bnb.mean():.2f}× "
        "bitsandbytes': are you rounding to the nearest code entry?")
    worse = int((err_mine > err_bnb + 1e-7 * x.abs().max()).sum())
    assert worse == 0, f"{worse} elements round worse than bitsandbytes: is the nearest entry chosen?"


@pytest.mark.exercise("2.2", points=1)
def test_round_trip_error_bounds_and_block_size():
    """Check the stated bounds: |x − x̂| ≤ absmax/255 for the linear code (half its step of
    2/255) and ≤ absmax · (largest half-gap of the code) for the dynamic code; all-zero
    blocks come back as zeros; and the error grows with the block size on heavy-tailed data."""
    from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code, linear_code, quantize_blockwise

    x = heavy_tailed(20_000, seed=2)
    x[:512] = 0.0  # two all-zero blocks of 256
    for code in (linear_code(), dynamic_code()):
        half_gap = (code[1:] - code[:-1]).max() / 2
        codes, absmax = quantize_blockwise(x, code, 256)
        x_hat = dequantize_blockwise(codes, absmax, code, 256)
        per_element_absmax = absmax.repeat_interleave(256)[: x.numel()]
        assert ((x_hat - x).abs() <= per_element_absmax * half_gap * (1 + 1e-5) + 1e-12).all()
        zero_index = int(code.abs().argmin())  # the entry nearest 0 (first of equals)
        assert torch.equal(absmax[:2], torch.zeros(2)), (
            f"absmax of the two all-zero blocks is {absmax[:2].tolist()}, expected [0.0, 0.0]: "
            "store the block's true absmax, even when it is 0 (divide by 1 instead)")
        assert (codes[:512] == zero_index).all(), (
            f"{int((codes[:512] != zero_index).sum())} codes of the all-zero blocks are not the "
            f"index {zero_index} of the code's entry nearest 0: is 0/0 (NaN) being quantized?")
        assert torch.equal(x_hat[:512], torch.zeros(512)), "all-zero blocks must come back as zeros"
    linear = linear_code()
    assert torch.isclose((linear[1:] - linear[:-1]).max() / 2, torch.tensor(1 / 255))
    errors = []
    for block_size in (32, 256, 2048, 20_000):
        codes, absmax = quantize_blockwise(x, dynamic_code(), block_size)
        errors.append((dequantize_blockwise(codes, absmax, dynamic_code(), block_size) - x)
                      .abs().mean().item())
    assert errors == sorted(errors), f"mean error by block size {errors} should grow"
    bf16 = x.to(torch.bfloat16)
    codes, absmax = quantize_blockwise(bf16, dynamic_code(), 256)
    assert codes.shape == bf16.shape and absmax.dtype == torch.float32


# =================================================================== 2.3 8-bit Adam

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
    assert_params_close(mine, ref, **UPDATE_TOL)
    for p, q in zip(mine.parameters(), ref.parameters()):
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg"].shape == p.shape
        assert state["exp_avg_sq"].dtype == torch.uint8
        for key, code in (("exp_avg", dynamic_code(True)), ("exp_avg_sq", dynamic_code(False))):
            index, absmax = brute_force_quantize(ref_state[key], code, 64)
            stored = dequantize_blockwise(state[key], state[key + "_absmax"], code, 64)
            scales = absmax.repeat_interleave(64)[: p.numel()].view(p.shape)
            # m, v agree to ulps; a value on a boundary between two codes may round either way
            mismatch = (stored - code[index] * scales).abs() > 1e-6 * scales
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
    from labkit.grading import optional_reference

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

@pytest.mark.exercise("2.4", points=1)
def test_lomo_params_match_sgd():
    """Check that 3 LOMO steps (update inside backward) give torch.optim.SGD's parameters
    after ordinary backward + step: the same θ − lr·g on the same g, to rounding."""
    from labkit.lab2.lomo import LOMO

    mine, ref = tiny_gpt(), tiny_gpt()
    data = SyntheticData(64, 32, 4, seed=1)
    lomo = LOMO(mine.parameters(), lr=0.1)
    train(mine, None, data, 3)
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data, 3)
    for (name, a), b in zip(mine.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, **UPDATE_TOL, msg=lambda m, name=name: (
            f"{name} after 3 LOMO steps differs from torch.optim.SGD's θ − lr·g: {m} — is the "
            "update applied once per parameter, with the complete (accumulated) gradient, and "
            "under torch.no_grad()?"))
    lomo.remove()
    before = [p.detach().clone() for p in mine.parameters()]
    train(mine, None, data, 1, start=3)
    assert all(torch.equal(a, p) for a, p in zip(before, mine.parameters())), \
        "parameters moved after lomo.remove(): remove() must take every hook handle off"


@pytest.mark.exercise("2.4", points=1)
def test_lomo_frees_every_gradient_inside_backward():
    """Check that when backward returns every .grad is None and every parameter has moved."""
    from labkit.lab2.lomo import LOMO

    model = tiny_gpt()
    before = [p.detach().clone() for p in model.parameters()]
    LOMO(model.parameters(), lr=0.1)
    x, y = SyntheticData(64, 32, 4, seed=1).batch(0)
    model(x, y).backward()
    kept = [name for name, p in model.named_parameters() if p.grad is not None]
    assert not kept, (f"after backward {len(kept)} parameters still hold a .grad (e.g. {kept[0]}): "
                      "set param.grad = None in the hook, right after the update")
    still = [name for (name, p), a in zip(model.named_parameters(), before) if torch.equal(a, p)]
    assert not still, (f"{len(still)} parameters did not move in backward (e.g. {still[0]}): "
                       "is a hook registered on every parameter?")


@pytest.mark.exercise("2.4", points=2)
def test_lomo_peak_gradient_bytes_is_the_largest_gradient():
    """Measure gradient bytes with MemTracker (labkit.measure): with LOMO the peak is the
    largest single gradient, exactly; with ordinary backward + SGD it is every gradient, 4Ψ."""
    from labkit.lab2.lomo import LOMO, lomo_step

    model = tiny_gpt()
    batch = SyntheticData(64, 32, 4, seed=1).batch(0)
    LOMO(model.parameters(), lr=0.1)
    fused = measure_step(model, None, batch, steps=2, step_fn=lomo_step)
    largest = max(4 * p.numel() for p in model.parameters())
    assert fused.peak_of("gradients") == largest, (
        f"peak gradient bytes with LOMO {fused.peak_of('gradients'):,}, expected the largest single "
        f"gradient {largest:,}: is each gradient freed inside its own hook, before the next one "
        "is made?")
    plain_model = tiny_gpt()
    plain = measure_step(plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.1), batch)
    every = 4 * sum(p.numel() for p in plain_model.parameters())
    assert plain.peak_of("gradients") == every, (
        f"reference run: backward + SGD held {plain.peak_of('gradients'):,} B of gradients, "
        f"expected 4Ψ = {every:,} (this line checks the measurement, not your code)")


# =================================================================== 2.5 ZeRO-1

# Ψ = 605 (vocab 38, n_embd 5, no biases): odd, so neither 2, 3 nor 4 ranks divide it.
ZERO_CFG = dict(vocab_size=38, block_size=8, n_layer=1, n_head=1, n_embd=5, bias=False)
ZERO_STEPS, ZERO_LR = 3, 1e-2
# the parameter-group case: embeddings at another lr without weight decay, the rest AdamW's
# decay, one matrix frozen
ZERO_GROUPS = [{"params": ["wte.weight", "wpe.weight"], "lr": 3e-2, "weight_decay": 0.0}]
ZERO_FROZEN = ("h.0.attn.c_proj.weight",)


def zero_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(**ZERO_CFG))


def zero_batches(world_size):
    data = SyntheticData(38, 8, 2, seed=5)
    return [[data.batch(s * world_size + r) for r in range(world_size)]
            for s in range(ZERO_STEPS)]


def flat_order(model, groups=None, frozen=()):
    """Names of the trainable parameters in ZeRO-1's flat order: the groups', then the rest."""
    named = [n for n in (g["params"] for g in groups or []) for n in n]
    rest = [n for n, _ in model.named_parameters() if n not in named]
    return [n for n in named + rest if n not in frozen]


def unsharded(model, batches, world_size, optimizer_class=torch.optim.Adam, lr=ZERO_LR,
              dtype=None, groups=None, frozen=(), **options):
    """The reference, computed here: ``optimizer_class`` unsharded (same groups) on fp32 master
    copies, fed the gradients of every rank's batch summed in the parameters' dtype (as the
    collective does) and divided by N, then cast back. Returns the parameters in model order
    and the optimizer's state as {state name: flat fp32 vector in ZeRO-1's flat order}."""
    model = copy.deepcopy(model)
    if dtype is not None:
        model = model.to(dtype)
    names = flat_order(model, groups, frozen)
    params = dict(model.named_parameters())
    master = {n: params[n].detach().float().clone() for n in names}
    spec = [{**g, "params": [master[n] for n in g["params"] if n in master]} for g in groups or []]
    in_groups = {n for g in groups or [] for n in g["params"]}
    spec.append({"params": [master[n] for n in names if n not in in_groups]})
    opt = optimizer_class(spec, lr=lr, **options)
    for step_batches in batches:
        grads = {n: torch.zeros_like(params[n]) for n in names}
        for x, y in step_batches:
            model.zero_grad()
            model(x, y).backward()
            for n in names:
                grads[n] += params[n].grad
        for n in names:
            master[n].grad = grads[n].float() / world_size
        opt.step()
        with torch.no_grad():
            for n in names:
                params[n].copy_(master[n])
    keys = {k for n in names for k, v in opt.state[master[n]].items() if v.dim() > 0}
    state = {k: torch.cat([opt.state[master[n]][k].reshape(-1) for n in names]) for k in keys}
    return [p.detach() for p in model.parameters()], state


_zero_runs: dict = {}


def run_dp(world_size, dtype=None, optimizer="zero1", variant="adam"):
    """Launch a data-parallel run on real gloo ranks once per setting; later tests reuse it.
    variant "adam": Adam, one group; "adamw_groups": AdamW with ZERO_GROUPS and ZERO_FROZEN;
    "sgd": SGD with momentum and weight decay, one group."""
    key = (world_size, dtype, optimizer, variant)
    if key not in _zero_runs:
        from labkit.dist import launch
        from labkit.lab2.zero1 import train_data_parallel

        model, batches = zero_model(), zero_batches(world_size)
        kwargs = VARIANTS[variant]
        try:
            results = launch(train_data_parallel, world_size, model, batches, optimizer=optimizer,
                             dtype=dtype, timeout=60, **kwargs)
        except Exception as exc:  # remembered, so each test reports it without relaunching
            results = exc
        _zero_runs[key] = (model, batches, results)
    model, batches, results = _zero_runs[key]
    if isinstance(results, Exception):
        raise results
    return model, batches, results


VARIANTS = {
    "adam": dict(lr=ZERO_LR),
    "adamw_groups": dict(optimizer_class=torch.optim.AdamW, lr=ZERO_LR, weight_decay=0.1,
                         groups=ZERO_GROUPS, frozen=ZERO_FROZEN),
    "sgd": dict(optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01),
}


def assert_same_params(model, results, reference, tol, cause):
    names = [n for n, _ in model.named_parameters()]
    for rank, result in enumerate(results):
        for name, got, want in zip(names, result["params"], reference):
            torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m, name=name, rank=rank:
                                       f"rank {rank}, parameter {name} — {cause}\n{m}")


@pytest.mark.exercise("2.5", points=1)
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero1_params_match_unsharded_adam(world_size):
    """Check, on 2 and 4 gloo ranks and Ψ = 605 (not divisible), that after 3 steps every rank
    holds the parameters of torch.optim.Adam on the averaged gradients. Tolerance: the
    collective sums in another order than the reference, ulps of the gradient, which Adam
    turns into ulps of the update (UPDATE_TOL)."""
    model, batches, results = run_dp(world_size)
    reference, _ = unsharded(model, batches, world_size)
    assert_same_params(model, results, reference, UPDATE_TOL,
                       "are the gradients averaged (÷N) and every slice gathered back?")


@pytest.mark.exercise("2.5", points=1)
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero1_moments_are_the_slice_of_adams(world_size):
    """Check each rank's m and v (its pieces' exp_avg / exp_avg_sq, concatenated) against the
    slice [rank·S, (rank+1)·S) of unsharded Adam's moments in flat order (padding: zeros).
    A missing ÷N hides in the parameters (Adam's update is scale-free) but not here.
    Tolerance: the collective sums the ranks' gradients in another order, so a moment differs
    by ulps of the *largest* gradient where the sum cancels: rtol 1e-5 and atol 1e-5 × the
    largest |moment| of the slice (a missing ÷N is off by a factor N, or N² for v)."""
    model, batches, results = run_dp(world_size)
    _, ref_state = unsharded(model, batches, world_size)
    shard = results[0]["shard_size"]
    for key in ("exp_avg", "exp_avg_sq"):
        flat = torch.cat([ref_state[key], torch.zeros(world_size * shard - ref_state[key].numel())])
        for rank, result in enumerate(results):
            got = result["shard_state"].get(key)
            assert got is not None, f"rank {rank} has no {key!r} state: did the wrapped optimizer step?"
            want = flat[rank * shard:(rank + 1) * shard]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=lambda m, key=key, rank=rank:
                                       f"rank {rank}, {key} of its slice: {m} — are the gradients "
                                       "averaged over the N ranks (÷N), and is the slice [rank·S, "
                                       "(rank+1)·S) of the flat gradient the one given to the optimizer?")


@pytest.mark.exercise("2.5", points=1)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero1_state_bytes_are_k_psi_over_n(world_size, dtype):
    """Check each rank's measured state bytes: K·S with S = ceil(Ψ/N), K = 8 for fp32
    parameters (Adam's m, v), 12 for bf16 ones (m, v, fp32 master), plus Adam's 4-byte step
    counter; and that the owned counts sum to Ψ."""
    model, _, results = run_dp(world_size, dtype)
    psi = sum(p.numel() for p in model.parameters())
    shard = math.ceil(psi / world_size)
    k = 8 if dtype is None else 12
    got = [r["state_bytes"] for r in results]
    want = k * shard + 4
    assert got == [want] * world_size, (
        f"state bytes per rank {got}, expected K·S + 4 = {k}·{shard} + 4 = {want:,} on each: "
        "does every rank keep states for its S elements only (and an fp32 master slice for "
        "16-bit parameters)?")
    owned = sum(r["numel_owned"] for r in results)
    assert owned == psi, f"ranks own {owned} elements in all, expected Ψ = {psi}"


@pytest.mark.exercise("2.5", points=1)
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero1_one_reduce_scatter_and_one_all_gather_per_step(world_size):
    """Count each rank's collectives over 3 steps: exactly one reduce-scatter of the gradients
    and one all-gather of the parameters per step, and no all-reduce (ZeRO's scheme)."""
    _, _, results = run_dp(world_size)
    want = {"reduce_scatter_tensor": ZERO_STEPS, "all_gather_into_tensor": ZERO_STEPS}
    for rank, r in enumerate(results):
        assert r["comm"]["calls"] == want, (
            f"rank {rank} made collectives {r['comm']['calls']} in {ZERO_STEPS} steps, expected "
            f"{want}: reduce-scatter the flat gradient (not all-reduce, not one call per tensor), "
            "then one all-gather of the flat slices")


@pytest.mark.exercise("2.5", points=1)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero1_moves_the_bytes_of_data_parallel(world_size, dtype):
    """Check the bytes per step: the reduce-scatter takes the padded flat gradient and the
    all-gather returns the padded flat parameters, N·S elements each in the parameters' dtype;
    on a ring that is 2·(N−1)/N · N·S elements per rank, the all-reduce volume of DDP for Ψ
    elements plus the padding."""
    model, _, results = run_dp(world_size, dtype)
    psi = sum(p.numel() for p in model.parameters())
    shard = math.ceil(psi / world_size)
    item = 4 if dtype is None else 2
    flat_bytes = item * world_size * shard
    for rank, r in enumerate(results):
        sent = r["comm"]["bytes_sent"]
        for op, what in (("reduce_scatter_tensor", "flat gradient"), ("all_gather_into_tensor", "flat parameters")):
            got = sent.get(op, 0)
            assert got == ZERO_STEPS * flat_bytes, (
                f"rank {rank}: {op} moved {got:,} B in {ZERO_STEPS} steps, expected "
                f"{ZERO_STEPS}·N·S·{item} = {ZERO_STEPS * flat_bytes:,} (the padded {what} in the "
                f"parameters' dtype {dtype or torch.float32})")
        ring = sum(r["comm"]["ring_bytes"].values())
        want = ZERO_STEPS * 2 * (world_size - 1) / world_size * flat_bytes
        assert math.isclose(ring, want), (f"rank {rank} put {ring:,.0f} B on the ring, expected "
                                          f"2(N−1)/N·N·S·{item} per step = {want:,.0f}")


@pytest.mark.exercise("2.5", points=1)
def test_zero1_bf16_params_follow_the_fp32_master():
    """Check bf16 parameters on 2 ranks against Adam on an fp32 master copy, rounded to bf16.
    With lr = 1e-2 the updates are ~100 bf16 ulps of the weights; an update applied to the
    bf16 weights without a master, or a master that is never written back, misses by many
    ulps. Tolerance: one bf16 ulp (rtol 2⁻⁷) for master values that land near a rounding
    boundary (the reference sums the ranks' bf16 gradients in bf16 as the collective does)."""
    model, batches, results = run_dp(2, torch.bfloat16)
    reference, _ = unsharded(model, batches, 2, dtype=torch.bfloat16)
    for result in results:
        assert all(p.dtype == torch.bfloat16 for p in result["params"]), "parameters must stay bf16"
    assert_same_params(model, results, reference, dict(rtol=2 ** -7, atol=1e-4),
                       "is the update applied to the fp32 master slice and the master (cast to "
                       "bf16) gathered back?")


@pytest.mark.exercise("2.5", points=2)
@pytest.mark.parametrize("variant", ["adamw_groups", "sgd"])
def test_zero1_wraps_any_optimizer_with_groups_and_frozen_params(variant):
    """On 3 ranks (Ψ does not divide): AdamW with two parameter groups (embeddings: lr 3e-2 and
    no weight decay; the rest: lr 1e-2, weight decay 0.1) and one frozen matrix, and SGD with
    momentum and weight decay, against the same optimizer unsharded on the averaged gradients.
    The frozen matrix must not change at all. Tolerance: UPDATE_TOL (collective sum order)."""
    model, batches, results = run_dp(3, variant=variant)
    kwargs = dict(VARIANTS[variant])
    reference, _ = unsharded(model, batches, 3, **kwargs)
    names = [n for n, _ in model.named_parameters()]
    for name in kwargs.get("frozen", ()):
        i = names.index(name)
        for rank, r in enumerate(results):
            assert torch.equal(r["params"][i], dict(model.named_parameters())[name].detach()), (
                f"rank {rank}: frozen parameter {name} changed: parameters with "
                "requires_grad=False must stay out of the flat vector and the update")
    assert_same_params(model, results, reference, UPDATE_TOL,
                       "does each piece of the slice go to the local optimizer with its own "
                       "group's options (lr, weight_decay), and does the step use the wrapped "
                       "optimizer class?")


# =================================================================== infrastructure (not graded)

def test_dynamic_code_is_bitsandbytes_dynamic_map():
    F = pytest.importorskip("bitsandbytes.functional")
    from labkit.lab2.quantize8bit import dynamic_code

    for signed in (True, False):
        assert torch.equal(dynamic_code(signed), F.create_dynamic_map(signed=signed))


def test_state_bytes_counts_adam_and_shared_tables_once():
    model = tiny_gpt()
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, SyntheticData(64, 32, 4), 1)
    params = list(model.parameters())
    assert state_bytes(opt) == 8 * sum(p.numel() for p in params) + 4 * len(params)
    shared = torch.zeros(256)
    opt.state[params[0]]["table"] = shared
    opt.state[params[1]]["table"] = shared
    assert state_bytes(opt) == 8 * sum(p.numel() for p in params) + 4 * len(params) + 1024
    with pytest.raises(ValueError, match="optimizer"):
        state_bytes(object())


def _param():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("call,word", [
    (lambda m: m.Adafactor(_param(), lr=-1), "lr"),
    (lambda m: m.Adafactor(_param(), lr="fast"), "lr"),
    (lambda m: m.Adafactor(_param(), beta2_decay=0.5), "beta2_decay"),
    (lambda m: m.Adafactor(_param(), d=0.5), "d "),
    (lambda m: m.Adafactor(_param(), eps=(None,)), "eps"),
    (lambda m: m.Adafactor(_param(), eps=("a", 1e-3)), "eps"),
    (lambda m: m.Adafactor(_param(), weight_decay=-0.1), "weight_decay"),
    (lambda m: m.factored_state_bytes((0, 3)), "shape"),
    (lambda m: m.factored_state_bytes(7), "shape"),
    (lambda m: m.factored_state_bytes((2, 3), dtype="float32"), "dtype"),
])
def test_adafactor_refuses_bad_input(call, word):
    import labkit.lab2.adafactor as m

    with pytest.raises((ValueError, TypeError), match=word):
        call(m)


@pytest.mark.parametrize("call,word", [
    (lambda m: m.num_blocks(10, 0), "block_size"),
    (lambda m: m.num_blocks(-1, 4), "numel"),
    (lambda m: m.num_blocks(10.0, 4), "numel"),
    (lambda m: m.quantized_bytes(-1), "numel"),
    (lambda m: m.quantized_bytes(10, block_size=-2), "block_size"),
    (lambda m: m.linear_code("yes"), "signed"),
    (lambda m: m.dynamic_code(1), "signed"),
    (lambda m: m.quantize_blockwise(torch.zeros(4), m.dynamic_code(), block_size=0), "block_size"),
    (lambda m: m.quantize_blockwise(torch.zeros(4), torch.zeros(10), 4), "code"),
    (lambda m: m.quantize_blockwise(torch.zeros(4, dtype=torch.long), m.dynamic_code(), 4), "x"),
    (lambda m: m.dequantize_blockwise(torch.zeros(4), torch.zeros(1), m.dynamic_code(), 4), "codes"),
    (lambda m: m.dequantize_blockwise(torch.zeros(4, dtype=torch.uint8), torch.zeros(3),
                                      m.dynamic_code(), 4), "absmax"),
])
def test_quantize8bit_refuses_bad_input(call, word):
    import labkit.lab2.quantize8bit as m

    with pytest.raises((ValueError, TypeError), match=word):
        call(m)


@pytest.mark.parametrize("call,word", [
    (lambda m: m.Adam8bit(_param(), block_size=0), "block_size"),
    (lambda m: m.Adam8bit(_param(), betas=(0.9, 1.5)), "betas"),
    (lambda m: m.Adam8bit(_param(), lr=-1e-3), "lr"),
    (lambda m: m.Adam8bit(_param(), eps=-1.0), "eps"),
    (lambda m: m.adam8bit_state_bytes([100, -5]), "numels"),
    (lambda m: m.adam8bit_state_bytes([100], block_size=0), "block_size"),
    (lambda m: m.adam8bit_state_bytes(100), "numels"),
])
def test_adam8bit_refuses_bad_input(call, word):
    import labkit.lab2.adam8bit as m

    with pytest.raises((ValueError, TypeError), match=word):
        call(m)


@pytest.mark.parametrize("call,word", [
    (lambda m: m.LOMO(_param(), lr="fast"), "lr"),
    (lambda m: m.LOMO(_param(), lr=-0.1), "lr"),
    (lambda m: m.LOMO([], lr=0.1), "params"),
    (lambda m: m.LOMO([torch.zeros(3)], lr=0.1), "params"),
    (lambda m: m.LOMO(torch.nn.Parameter(torch.zeros(3)), lr=0.1), "params"),
])
def test_lomo_refuses_bad_input(call, word):
    import labkit.lab2.lomo as m

    with pytest.raises((ValueError, TypeError), match=word):
        call(m)


def test_lomo_with_a_tied_parameter_listed_twice_is_sgd():
    """A parameter listed twice (tied weights gathered by hand) gets one hook and one update."""
    from labkit.lab2.lomo import LOMO

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 4))
    w_ref = torch.nn.Parameter(w.detach().clone())
    LOMO([w, w], lr=0.1)
    x = torch.randn(2, 4)
    (x @ w @ w).sum().backward()
    (x @ w_ref @ w_ref).sum().backward()
    torch.optim.SGD([w_ref], lr=0.1).step()
    torch.testing.assert_close(w.detach(), w_ref.detach())
    assert w.grad is None


def test_zero_redundancy_optimizer_splits_whole_tensors_unevenly():
    """PyTorch's ZeroRedundancyOptimizer beside ZeRO-1: each rank owns whole tensors, so the
    owned counts sum to Ψ but differ between ranks (and so do the state bytes)."""
    model, _, results = run_dp(2, optimizer="zero_redundancy")
    owned = [r["numel_owned"] for r in results]
    assert sum(owned) == sum(p.numel() for p in model.parameters())
    assert owned[0] != owned[1]


def test_zero_redundancy_and_zero1_train_like_ddp_adam():
    """train_data_parallel's three optimizers give DDP + Adam's parameters (gradients averaged)."""
    model, _, ddp = run_dp(2, optimizer="ddp")
    for kind in ("zero_redundancy", "zero1"):
        _, _, results = run_dp(2, optimizer=kind)
        for rank, (a, b) in enumerate(zip(results, ddp)):
            for name, p, q in zip(dict(model.named_parameters()), a["params"], b["params"]):
                torch.testing.assert_close(p, q, **UPDATE_TOL, msg=lambda m, name=name:
                                           f"{kind} vs DDP + Adam, rank {rank}, {name}: {m}")


def test_zero1_ring_volume_equals_ddp_when_n_divides_psi():
    """With Ψ padded to N·S, ZeRO-1's reduce-scatter + all-gather put 2(N−1)/N·N·S elements on the
    ring, DDP's all-reduce 2(N−1)/N·Ψ: equal but for the padding."""
    model, _, ddp = run_dp(2, optimizer="ddp")
    _, _, zero = run_dp(2)
    psi = sum(p.numel() for p in model.parameters())
    pad = 2 * math.ceil(psi / 2) - psi
    ddp_ring = sum(ddp[0]["comm"]["ring_bytes"].values())
    zero_ring = sum(zero[0]["comm"]["ring_bytes"].values())
    assert math.isclose(ddp_ring, ZERO_STEPS * 2 * (1 / 2) * 4 * psi)
    assert math.isclose(zero_ring, ddp_ring + ZERO_STEPS * 2 * (1 / 2) * 4 * pad)


@pytest.mark.parametrize("call,word", [
    (lambda z: z.train_data_parallel(0, 1, zero_model(), [], dtype="bf16"), "dtype"),
    (lambda z: z.train_data_parallel(0, 1, zero_model(), [], optimizer="fsdp"), "optimizer"),
    (lambda z: z.train_data_parallel(0, 1, zero_model(), [], optimizer_class="adam"), "optimizer_class"),
    (lambda z: z.train_data_parallel(0, 1, zero_model(), [], lr=-1.0), "lr"),
    (lambda z: z.train_data_parallel(0, 2, zero_model(), [[None]]), "batches"),
    (lambda z: z.ZeRO1([torch.zeros(2, requires_grad=True)], optimizer_class=dict), "optimizer_class"),
    (lambda z: z.ZeRO1([torch.zeros(2, requires_grad=True)]), "process group"),
])
def test_zero1_refuses_bad_input(call, word):
    import labkit.lab2.zero1 as z

    with pytest.raises((ValueError, TypeError), match=word):
        call(z)
