"""Graders of Lab 3, exercise 3.3 (labs/03_parameters.ipynb): an fp8 linear layer with
per-tensor scaling (labkit/lab3/fp8.py).

References nobody in this course wrote: ``torch.finfo`` (the formats' maxima), torch's own fp8
casts, ``torch._scaled_mm`` (PyTorch's fp8 matmul, on CPU in 2.13), ``nn.Linear`` in fp32, the
plain fp32 product of the dequantised fp8 operands, the delayed-scaling formula recomputed in a
loop, and ``labkit.measure.saved_activation_bytes`` (saved-tensor hooks) for the stored bytes.

Tolerances: the forward is compared bit for bit (same fp8 operands, same kernel). The gradients
are compared (a) with the fp32 product of the dequantised operands — the same numbers, only the
summation order may differ: rtol 1e-5, atol 1e-5 × the largest |reference| — and (b) with
fp32 ``nn.Linear``: norm-wise relative error ≤ 0.12. Why 0.12: E5M2 keeps 2 mantissa bits, a
relative rounding error uniform in ±2^-3 (RMS 2^-3/√3 ≈ 0.072) on grad_out, E4M3 3 bits (RMS
≈ 0.036) on the other operand; independent errors add in quadrature, ≈ 0.08 for the product;
0.12 leaves 1.5× for the Gaussian tails the per-tensor scale leaves in low binades.
Byte counts and scale sequences are exact.
"""
from __future__ import annotations

import pytest
import torch

from labkit.measure import saved_activation_bytes
from _given import as_given, ctx_bytes, given

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def ref_scale(amax, fmt, margin=0):
    """The formula: amax · 2^margin / max(fmt); 1 when amax is 0."""
    amax = float(amax)
    return torch.tensor(1.0 if amax == 0 else amax * 2.0 ** margin / torch.finfo(fmt).max, dtype=torch.float32)


def ref_quant(x, scale, fmt):
    """Saturating cast, done by torch's cast on values already inside the range."""
    top = torch.finfo(fmt).max
    return (x.float() / scale).clamp(-top, top).to(fmt)


def layer(bias=True, k=64, n=48, seed=0, **kw):
    from labkit.lab3.fp8 import Fp8Linear

    torch.manual_seed(seed)
    return Fp8Linear(k, n, bias=bias, **kw)


def scaled_mm_reference(lin, x, bias, dtype):
    """torch._scaled_mm of the E4M3 operands scaled by their own amax (current scaling), plus
    the bias: what Fp8Linear's forward must give, bit for bit."""
    sx, sw = ref_scale(x.detach().abs().max(), E4M3), ref_scale(lin.weight.detach().abs().max(), E4M3)
    want = torch._scaled_mm(ref_quant(x.detach(), sx, E4M3), ref_quant(lin.weight.detach(), sw, E4M3).t(),
                            scale_a=sx, scale_b=sw, out_dtype=dtype)
    return want + lin.bias.detach().to(dtype) if bias else want


def data(m=32, k=64, n=48, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype).requires_grad_()
    gy = (torch.randn(m, n, generator=g) * 1e-3).to(dtype)
    return x, gy


@pytest.mark.exercise("3.3", points=1)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_scale_maps_amax_to_format_max(fmt):
    """Check amax_scale(amax) = amax · 2^margin / max(fmt) exactly, and 1 for amax 0."""
    from labkit.lab3.fp8 import amax_scale

    for amax, margin in ((3.7, 0), (1e-6, 0), (250.0, 2), (0.0, 0)):
        got = amax_scale(torch.tensor(amax), fmt, margin=margin)
        want = ref_scale(amax, fmt, margin)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.numel() == 1, (
            f"amax_scale returned {got!r}, expected a one-element float32 tensor")
        assert torch.equal(got.reshape(()), want), (
            f"amax_scale({amax}, {fmt}, margin={margin}) = {got.item()!r}, expected amax·2^margin/{torch.finfo(fmt).max:g}"
            f" = {want.item()!r}: is it the dequantisation scale (x ≈ q·scale), 1.0 for amax 0?")


@pytest.mark.exercise("3.3", points=1)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_rounds_and_saturates(fmt):
    """Check quantize(x, s) equals torch's cast of x/s inside the range and ±max(fmt) beyond it
    (never inf or NaN: on CPU torch's E5M2 cast overflows to inf)."""
    from labkit.lab3.fp8 import quantize
    quantize = as_given(quantize)

    top = torch.finfo(fmt).max
    x = torch.cat([torch.randn(256) * 100, torch.tensor([1e9, -1e9, float("inf"), -float("inf"), 0.0])])
    s = torch.tensor(0.25)
    got = quantize(x, s, fmt)
    assert got.dtype == fmt, f"quantize returned dtype {got.dtype}, expected {fmt}"
    want = ref_quant(x, s, fmt)
    assert torch.isfinite(got.float()).all(), (
        f"quantize gave {int((~torch.isfinite(got.float())).sum())} non-finite values: saturate at ±{top:g} "
        "before casting (the CPU cast of E5M2 overflows to inf)")
    bad = got.float() != want.float()
    assert not bad.any(), (f"{int(bad.sum())} values differ from round(x/scale) saturated at ±{top:g}, "
                           f"e.g. x={x[bad][0].item():g}: got {got.float()[bad][0].item():g}, "
                           f"expected {want.float()[bad][0].item():g} — divided by the scale (not multiplied)?")


@pytest.mark.exercise("3.3", points=2)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_bit_exact_vs_scaled_mm(bias, dtype):
    """Check the forward equals torch._scaled_mm of the E4M3 operands scaled by their own amax
    (current scaling), plus the bias, bit for bit."""
    lin = layer(bias=bias)
    x, _ = data(dtype=dtype)
    with given("Fp8Linear's forward", lin=lin, x=x):
        got = lin(x)
    want = scaled_mm_reference(lin, x, bias, dtype)
    assert got.dtype == dtype, f"output dtype {got.dtype}, expected x's dtype {dtype}"
    assert got.shape == want.shape, f"output shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    diff = (got.detach().float() - want.float()).abs()
    assert torch.equal(got.detach(), want), (
        f"forward differs from torch._scaled_mm on the same E4M3 operands in {int((diff > 0).sum())} elements "
        f"(max |diff| {diff.max().item():.3g}): " + _signed_amax_hint(lin, x.detach(), got.detach(), bias, dtype,
        "scales from each tensor's amax over 448, operands x/scale in E4M3, scale_a/scale_b passed to "
        "_scaled_mm (not applied twice)?"))


def _signed_amax_hint(lin, x, got, bias, dtype, otherwise):
    """Name the signed-max mistake when the output is exactly what max(t) (not max|t|) gives
    for x, the weight, or both."""
    w = lin.weight.detach()
    for signed in (("x",), ("weight",), ("x", "weight")):
        if all(t.max() == t.abs().max() for n, t in (("x", x), ("weight", w)) if n in signed):
            continue
        sx = ref_scale((x.max() if "x" in signed else x.abs().max()).clamp_min(0), E4M3)
        sw = ref_scale((w.max() if "weight" in signed else w.abs().max()).clamp_min(0), E4M3)
        alt = torch._scaled_mm(ref_quant(x, sx, E4M3), ref_quant(w, sw, E4M3).t(),
                               scale_a=sx, scale_b=sw, out_dtype=dtype)
        if bias:
            alt = alt + lin.bias.detach().to(dtype)
        if torch.equal(got, alt):
            names = " and ".join(signed)
            return (f"the output is exactly the one scales from max(t) give for {names} (x: max "
                    f"{x.max().item():.4g}, max|x| {x.abs().max().item():.4g}); the amax is the largest "
                    "magnitude, max|t|, and here it is a negative element")
    return otherwise


def _dequant_grads(lin, x, gy):
    """The plain computation: E5M2 grad_out, E4M3 x and weight (current scaling), fp32 products."""
    w = lin.weight.detach()
    sx, sw, sg = (ref_scale(t.abs().max(), f) for t, f in ((x.detach(), E4M3), (w, E4M3), (gy, E5M2)))
    dx, dw, dg = (ref_quant(t, s, f).float() * s for t, s, f in ((x.detach(), sx, E4M3), (w, sw, E4M3), (gy, sg, E5M2)))
    return dg @ dw, dg.t() @ dx


@pytest.mark.exercise("3.3", points=2)
def test_gradients_are_e5m2_products():
    """Check grad_x and grad_weight equal the fp32 products of the dequantised operands: grad_out
    in E5M2 (its own scale), x and weight in E4M3."""
    lin = layer()
    x, gy = data()
    with given("Fp8Linear (forward, then backward)", lin=lin, x=x, grad_out=gy):
        lin(x).backward(gy)
    want_x, want_w = _dequant_grads(lin, x, gy)
    for name, got, want in (("grad_x", x.grad, want_x), ("grad_weight", lin.weight.grad, want_w)):
        assert got is not None, f"{name} is None: does backward return a gradient for it?"
        torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                   msg=lambda m, name=name: (
                                       f"{name} vs E5M2(grad_out) @ E4M3 operand in fp32: {m} — grad_out cast to "
                                       "E5M2 with its own amax scale (not E4M3), both scales applied, transposes right?"))
    torch.testing.assert_close(lin.bias.grad, gy.sum(0), msg=lambda m: f"grad_bias: {m} — the bias stays fp32")


@pytest.mark.exercise("3.3", points=1)
def test_small_gradient_rows_use_e5m2_range():
    """Check grad_x row by row when grad_out spans 24 binades (row 0 large, the rest 2^-24 of
    it): each row equals the fp32 product of the dequantised operands (rtol 1e-5 of the row's
    norm), which holds only if grad_out's scale puts its amax on E5M2's max (57344)."""
    lin = layer()
    x, gy = data()
    gy[1:] *= 2.0 ** -24
    with given("Fp8Linear (forward, then backward)", lin=lin, x=x, grad_out=gy):
        lin(x).backward(gy)
    want_x, _ = _dequant_grads(lin, x, gy)
    err = (x.grad - want_x).norm(dim=1) / want_x.norm(dim=1)
    worst = int(err.argmax())
    assert err.max() <= 1e-5, (
        f"grad_x row {worst}: relative error {err[worst].item():.2e} vs E5M2(grad_out) @ E4M3(weight), expected "
        "≤ 1e-5: is grad_out scaled to E5M2's max (57344), not E4M3's (448)? Its small rows fall into subnormals")


@pytest.mark.exercise("3.3", points=1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_close_to_fp32_linear(dtype):
    """Check the fp8 gradients are within a norm-wise relative error of 0.12 of fp32 nn.Linear's
    (see the module docstring for the bound), for fp32 and bf16 inputs."""
    lin = layer()
    ref = torch.nn.Linear(64, 48)
    ref.load_state_dict(lin.state_dict())
    x, gy = data(dtype=dtype)
    with given("Fp8Linear (forward, then backward)", lin=lin, x=x, grad_out=gy):
        lin(x).backward(gy)
    x32 = x.detach().float().requires_grad_()
    ref(x32).backward(gy.float())
    for name, got, want in (("grad_x", x.grad, x32.grad), ("grad_weight", lin.weight.grad, ref.weight.grad)):
        assert got is not None, f"{name} is None"
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert rel <= 0.12, (f"{name}: relative error {rel:.3f} vs fp32 nn.Linear, expected ≤ 0.12 "
                             "(E5M2 × E4M3 rounding ≈ 0.08): a scale missing or applied twice?")


@pytest.mark.exercise("3.3", points=2)
@pytest.mark.parametrize("history_len, margin", [(1, 0), (3, 0), (16, 1)])
def test_delayed_scaling_sequence(history_len, margin):
    """Check DelayedScaling's scale sequence over tensors with a spike equals the formula
    recomputed: scale_t = max(amax_{t−L..t−1}) · 2^margin / 448 (amax_0 on the first call)."""
    from labkit.lab3.fp8 import DelayedScaling

    amaxes = [2.0, 3.0, 1.0, 50.0, 0.5, 0.5, 0.25, 4.0, 1.0]
    ds = DelayedScaling(history_len=history_len, fmt=E4M3, margin=margin)
    for t, a in enumerate(amaxes):
        x = torch.linspace(-a / 2, a, 64)  # amax exactly a
        got = ds.scale_for(x)
        past = amaxes[max(0, t - history_len):t] or [a]
        want = ref_scale(max(past), E4M3, margin)
        assert torch.equal(torch.as_tensor(got, dtype=torch.float32).reshape(()), want), (
            f"step {t} (amaxes {amaxes[:t + 1]}): scale {float(got)!r}, expected {want.item()!r} = "
            f"max of the previous {history_len} amaxes {past} ·2^{margin}/448: is the history updated after "
            "computing the scale, and trimmed to history_len?")
    assert ds.history == amaxes[-history_len:], f"history {ds.history}, expected the last {history_len} amaxes"


@pytest.mark.exercise("3.3", points=1)
def test_delayed_linear_saturates_on_a_spike():
    """Check a delayed-scaling Fp8Linear quantises a spike with the *previous* scale: the output
    equals _scaled_mm of x saturated at 448 × the old scale (finite, no NaN)."""
    lin = layer(bias=False, scaling="delayed", history_len=4)
    x, _ = data()
    spike = x.detach() * 10
    with given("Fp8Linear's forward", lin=lin, x=x, spike=spike):
        lin(x.detach())
        got = lin(spike)
    sx = ref_scale(x.detach().abs().max(), E4M3)
    sw = ref_scale(lin.weight.detach().abs().max(), E4M3)
    want = torch._scaled_mm(ref_quant(spike, sx, E4M3), ref_quant(lin.weight.detach(), sw, E4M3).t(),
                            scale_a=sx, scale_b=sw, out_dtype=torch.float32)
    assert torch.isfinite(got).all(), "the spike gave non-finite outputs: saturate at ±448 before the cast"
    if not torch.equal(got.detach(), want):
        own = ref_scale(spike.abs().max(), E4M3)
        current = torch._scaled_mm(ref_quant(spike, own, E4M3), ref_quant(lin.weight.detach(), sw, E4M3).t(),
                                   scale_a=own, scale_b=sw, out_dtype=torch.float32)
        signed = ref_scale(x.detach().max(), E4M3)
        from_max = torch._scaled_mm(ref_quant(spike, signed, E4M3), ref_quant(lin.weight.detach(), sw, E4M3).t(),
                                    scale_a=signed, scale_b=sw, out_dtype=torch.float32)
        if torch.equal(got.detach(), current):
            cause = "it is exactly the output with the spike's own amax: the history's amax must be used"
        elif torch.equal(got.detach(), from_max):
            cause = (f"it is exactly the output with the previous step's max(x) = {x.detach().max().item():.4g}: "
                     f"the amax is max|x| = {x.detach().abs().max().item():.4g}")
        else:
            diff = (got.detach() - want).abs()
            cause = (f"{int((diff > 0).sum())} of {diff.numel()} elements differ, max |diff| "
                     f"{diff.max().item():.3g}; want uses the previous step's scale {sx.item():.4g}")
        raise AssertionError("the spike's output differs from _scaled_mm with the previous step's scale "
                             f"and saturation: {cause}")


@pytest.mark.exercise("3.3", points=1)
def test_delayed_backward_scales_the_gradient_from_its_history():
    """Check a delayed-scaling Fp8Linear's backward: at the second step grad_out is 8× larger, and
    grad_x must equal the fp32 product of E5M2(grad_out) quantised with the *first* step's grad
    scale (saturating) and the dequantised E4M3 weight (rtol 1e-5: the same fp8 values, summed in
    another order); the grad scaler's history holds both amaxes."""
    lin = layer(bias=False, scaling="delayed", history_len=4)
    x, gy = data()
    w = lin.weight.detach()
    x2, gy8 = x.detach().clone().requires_grad_(), gy * 8
    with given("Fp8Linear (forward, then backward)", lin=lin, x=x, grad_out=gy, x2=x2,
               grad_out2=gy8):
        lin(x.detach().requires_grad_()).backward(gy)
        lin(x2).backward(gy8)
    sg = ref_scale(gy.abs().max(), E5M2)  # the previous step's amax
    sw = ref_scale(w.abs().max(), E4M3)
    want = (ref_quant(gy * 8, sg, E5M2).float() * sg) @ (ref_quant(w, sw, E4M3).float() * sw)
    own = ref_scale((gy * 8).abs().max(), E5M2)
    current = (ref_quant(gy * 8, own, E5M2).float() * own) @ (ref_quant(w, sw, E4M3).float() * sw)
    if not torch.allclose(x2.grad, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()):
        cause = ("it matches the gradient's own amax scale: in backward, take the scale from "
                 "scalers['grad'] (delayed), not from grad_out itself"
                 if torch.allclose(x2.grad, current, rtol=1e-5, atol=1e-5 * current.abs().max().item())
                 else f"max |diff| {(x2.grad - want).abs().max().item():.3g} of max |want| {want.abs().max().item():.3g}")
        raise AssertionError(f"grad_x at the second delayed step vs E5M2 with the first step's grad scale: {cause}")
    hist = lin.scalers["grad"].history
    want_hist = [float(gy.abs().max()), float((gy * 8).abs().max())]
    assert hist == pytest.approx(want_hist, rel=0), (
        f"scalers['grad'].history = {hist}, expected the two grad_out amaxes {want_hist}")


@pytest.mark.exercise("3.3", points=1)
def test_saved_bytes_are_one_per_element_plus_scales():
    """Check the tensors autograd keeps for backward are the fp8 x and weight (1 byte per
    element) and their two float32 scales: M·K + N·K + 8 bytes (fp32 would save 4·M·K); and
    that the forward whose saved bytes were counted gave the right output (bit for bit, as in
    test_forward_bit_exact_vs_scaled_mm)."""
    lin = layer()
    x, _ = data()
    out = []
    with given("Fp8Linear's forward", lin=lin, x=x):
        got = saved_activation_bytes(lambda: out.append(lin(x)))
    got += ctx_bytes(out[0], skip=(x, lin.weight, lin.bias))  # tensors kept as ctx attributes too
    want = 32 * 64 + 48 * 64 + 2 * 4
    assert got == want, (f"saved for backward {got:,} B, expected M·K + N·K + 2·4 = {want:,}: save only the "
                         "fp8 operands and their scales (not x, not the fp32 weight)")
    ref = scaled_mm_reference(lin, x, True, torch.float32)
    diff = (out[0].detach() - ref).abs()
    assert torch.equal(out[0].detach(), ref), (
        f"the measured forward's output differs from torch._scaled_mm on the same E4M3 operands in "
        f"{int((diff > 0).sum())} elements (max |diff| {diff.max().item():.3g}): the bytes count only "
        "for the right output — is the product computed from the saved fp8 operands and scales?")


@pytest.mark.parametrize("kwargs, match", [
    (dict(in_features=60, out_features=48), "in_features"),
    (dict(in_features=64, out_features=40), "out_features"),
    (dict(in_features=64, out_features=48, scaling="fast"), "scaling"),
])
def test_bad_layer_raises(kwargs, match):
    from labkit.lab3.fp8 import Fp8Linear

    with pytest.raises(ValueError, match=match):
        Fp8Linear(**kwargs)


def test_bad_inputs_raise():
    from labkit.lab3.fp8 import DelayedScaling, Fp8Linear, amax_scale, quantize

    with pytest.raises(ValueError, match="x"):
        Fp8Linear(64, 48)(torch.randn(10, 64))  # 10 rows: not a multiple of 16
    with pytest.raises(ValueError, match="x"):
        Fp8Linear(64, 48)(torch.randn(16, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="fmt"):
        amax_scale(1.0, torch.float16)
    with pytest.raises(ValueError, match="amax"):
        amax_scale(float("nan"))
    with pytest.raises(ValueError, match="scale"):
        quantize(torch.ones(4), torch.tensor(0.0))
    with pytest.raises(ValueError, match="history_len"):
        DelayedScaling(history_len=0)
    with pytest.raises(TypeError, match="x"):  # not a tensor: named, not an AttributeError
        DelayedScaling().scale_for([1.0, 2.0])
    with pytest.raises(TypeError, match="int64"):  # the dtype is named
        quantize(torch.tensor([1, 2]), 1.0)
    for bad in (float("nan"), float("inf")):  # was "amax must be one finite number >= 0, got nan"
        x = torch.randn(16, 64)
        x[3, 5] = bad
        with pytest.raises(ValueError, match="holds inf or NaN"):
            Fp8Linear(64, 48)(x)


class _LayoutCheck:
    """Wraps torch._scaled_mm: records every call's operand shapes and strides, and runs torch's
    meta kernel on meta tensors of the same shapes, strides and dtypes, which enforces the rules
    the CUDA kernel does (self row-major, mat2 column-major, sizes multiples of 16) that the CPU
    kernel does not check."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, a, b, *args, **kwargs):
        def meta(t):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") \
                if isinstance(t, torch.Tensor) else t
        problem = None
        try:
            self.real(meta(a), meta(b), *(meta(t) for t in args),
                      **{k: meta(v) for k, v in kwargs.items()})
        except RuntimeError as exc:
            problem = str(exc).splitlines()[0]
        self.calls.append({"a": (tuple(a.shape), a.stride(), a.dtype), "b": (tuple(b.shape), b.stride(), b.dtype),
                           "problem": problem})
        return self.real(a, b, *args, **kwargs)


@pytest.mark.exercise("3.3", points=2)
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_every_scaled_mm_call_meets_the_gpu_layout_rule(monkeypatch, scaling):
    """Check every torch._scaled_mm call of a forward and backward passes torch's meta kernel,
    which enforces what a GPU requires and the CPU does not: mat1 row-major, mat2 column-major
    (strides (1, K)). A row-major mat2 passes every CPU test and crashes on an H100."""
    lin = layer(scaling=scaling)
    x, gy = data()
    check = _LayoutCheck(torch._scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm", check)
    with given("Fp8Linear (forward, then backward)", lin=lin, x=x, grad_out=gy):
        lin(x).backward(gy)
    assert len(check.calls) == 3, (f"{len(check.calls)} torch._scaled_mm calls in a forward and backward, "
                                   "expected 3 (the output, grad_x, grad_weight)")
    for i, call in enumerate(check.calls):
        where = ("forward (output)", "a backward call", "a backward call")[i]
        assert call["problem"] is None, (
            f"torch._scaled_mm call {i + 1} of 3 ({where}): mat1 {call['a'][0]} strides {call['a'][1]}, "
            f"mat2 {call['b'][0]} strides {call['b'][1]}: the meta kernel (the GPU's rule) says "
            f"\"{call['problem']}\"")


@pytest.mark.exercise("3.3", points=1)
def test_weight_gradient_keeps_the_weight_dtype_for_bf16_inputs():
    """Check with bf16 x and the fp32 weight (the master): grad_weight is fp32 and equals the fp32
    product E5M2(grad_out)ᵀ @ E4M3(x) (rtol 1e-5: not rounded to bf16, whose step is 2⁻⁸);
    grad_x is in x's dtype."""
    lin = layer()
    x, gy = data(dtype=torch.bfloat16)
    with given("Fp8Linear (forward, then backward)", lin=lin, x=x, grad_out=gy):
        lin(x).backward(gy)
    _, want_w = _dequant_grads(lin, x.float(), gy.float())
    assert x.grad is not None and x.grad.dtype == torch.bfloat16, \
        f"grad_x dtype {None if x.grad is None else x.grad.dtype}, expected x's bfloat16"
    got = lin.weight.grad
    assert got is not None and got.dtype == torch.float32, \
        f"grad_weight dtype {None if got is None else got.dtype}, expected the weight's float32"
    rel = ((got - want_w).norm() / want_w.norm()).item()
    assert rel <= 1e-5, (f"grad_weight vs the fp32 product of the dequantised operands: relative error "
                         f"{rel:.2e}, expected ≤ 1e-5 (bf16 rounding alone gives ~1e-3)")
