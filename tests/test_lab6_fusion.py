"""Graders of Lab 6, exercise 6.5 (labs/06_system.ipynb): a fused GELU that saves one tensor.

References nobody in this course wrote: ``torch.nn.functional.gelu(x, approximate="tanh")``
(ATen's kernel), ``torch.autograd.gradcheck`` (finite differences), and the bytes autograd
saves (``saved_tensors_hooks``) and MemTracker sees (``labkit.measure``). Tolerances are stated
where they are used.
"""
from __future__ import annotations

import pytest
import torch

from _given import ctx_bytes, given


# The fused operator and F.gelu evaluate the same formula in another order: a few fp32 ulps of
# outputs of magnitude ≤ ~12 (atol 1e-6, rtol 1e-5). Gradients: the factor 1 − t² cancels
# for |x| ≳ 2, so its fp32 error ~6e-8 is multiplied by 0.5·|x|·k·(1 + 3a·x²)·|g| ≤ ~50 for
# |x| ≤ 12: up to ~3e-6 absolute (atol 1e-5).
FUSION_TOL = dict(atol=1e-6, rtol=1e-5)
FUSION_GRAD_TOL = dict(atol=1e-5, rtol=1e-5)


def check_measured(x, y, layers, what, tol=FUSION_TOL, grad_tol=FUSION_GRAD_TOL):
    """A measurement counts only for the right result: ``y``, the output of ``layers`` fused GELUs
    on ``x`` in the call whose bytes were measured, and the input gradient backward computes from
    what that call saved, must be ``layers`` F.gelu(approximate="tanh")'s (six layers of randn
    inputs: measured 1e-6 on both, within the one-layer tolerances)."""
    import torch.nn.functional as F

    g = torch.ones_like(y)  # as the bf16 test's tolerances assume
    with given("fused_gelu_tanh's backward", x=x, y=y, grad_out=g):
        (gx,) = torch.autograd.grad(y, x, g)
    xr = x.detach().clone().requires_grad_()
    ref = xr
    for _ in range(layers):
        ref = F.gelu(ref, approximate="tanh")
    (gref,) = torch.autograd.grad(ref, xr, g)
    torch.testing.assert_close(y, ref, **tol, msg=lambda m: (
        f"{what}: the output of the call whose bytes were measured is not F.gelu's: {m}"))
    torch.testing.assert_close(gx, gref, **grad_tol, msg=lambda m: (
        f"{what}: backward through what the measured call saved gives another input gradient "
        f"than F.gelu's: {m} — is the saved x the input, and the output computed from it?"))


@pytest.mark.exercise("6.5", points=1)
@pytest.mark.parametrize("dtype,layout", [(torch.float32, "contiguous"), (torch.float32, "transposed"),
                                          (torch.float64, "contiguous")])
def test_fused_gelu_matches_torch_gelu_tanh(dtype, layout):
    """Outputs and input gradients equal torch.nn.functional.gelu(x, approximate="tanh"), in x's
    dtype and shape, for a contiguous and a transposed (non-contiguous) x; x itself is left
    unchanged. (fp64 within the fp32 tolerances: looser than it needs.)"""
    import torch.nn.functional as F

    from labkit.lab6.fusion import fused_gelu_tanh

    torch.manual_seed(0)
    base = 3 * torch.randn(37, 129, dtype=dtype)
    x = (base if layout == "contiguous" else base.T.contiguous().T).requires_grad_()
    g = torch.randn(37, 129, dtype=dtype)
    with given("fused_gelu_tanh's forward", x=x):
        y = fused_gelu_tanh(x)
    assert (y.dtype, y.shape) == (dtype, x.shape), \
        f"output {y.dtype} {tuple(y.shape)}, expected {dtype} {tuple(x.shape)}: compute in x's dtype, elementwise"
    with given("fused_gelu_tanh's backward", x=x, y=y, grad_out=g):
        (gx,) = torch.autograd.grad(y, x, g)
    ref = F.gelu(x, approximate="tanh")
    (gref,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(y, ref, **FUSION_TOL, msg=lambda m: f"output: {m} — is the formula (k, a, 0.5) right?")
    torch.testing.assert_close(gx, gref, **FUSION_GRAD_TOL,
                               msg=lambda m: f"input gradient: {m} — dy/dx = 0.5(1+t) + 0.5·x·(1−t²)·k·(1+3a·x²)")


@pytest.mark.exercise("6.5", points=1)
def test_fused_gelu_gradcheck_in_float64():
    """torch.autograd.gradcheck (finite differences in float64) on the fused backward."""
    from labkit.lab6.fusion import fused_gelu_tanh

    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    with given("fused_gelu_tanh under gradcheck", x=x):
        assert torch.autograd.gradcheck(fused_gelu_tanh, (x,)), "gradcheck failed: the backward is not the derivative of the forward"


@pytest.mark.exercise("6.5", points=1)
def test_fused_gelu_saves_only_its_input():
    """Saved bytes (saved_tensors_hooks, distinct storages): the unfused chain saves x, tanh's
    output t, 0.5·x and 1 + t — 16 bytes per fp32 element (measured here on the chain); the
    fused operator only x: 4 bytes per element, 12 fewer. The measured call's output and the
    gradient from what it saved must be F.gelu's."""
    from labkit.lab6.fusion import fused_gelu_tanh, gelu_tanh_unfused
    from labkit.measure import saved_activation_bytes

    x = torch.randn(64, 1000, requires_grad=True)
    n = x.numel()
    unfused = saved_activation_bytes(lambda: gelu_tanh_unfused(x))
    assert unfused == 16 * n, (  # the given chain itself: 4 tensors of 4n bytes
        f"the given unfused chain saves {unfused:,} B, expected 16 B × {n:,} (x, t, 0.5·x, 1 + t): "
        f"was gelu_tanh_unfused changed?")
    out = []
    with given("fused_gelu_tanh's forward", x=x):
        fused = saved_activation_bytes(lambda: out.append(fused_gelu_tanh(x)))
    fused += ctx_bytes(out[0], skip=(x,))  # tensors kept as ctx attributes count too
    assert fused == unfused - 12 * n, \
        f"the fused operator saves {fused:,} B, expected {unfused - 12 * n:,} = the chain's {unfused:,} − 12·{n:,}: save only the input x"
    check_measured(x, out[0], 1, "saved bytes, fp32")


@pytest.mark.exercise("6.5", points=1)
def test_fused_gelu_lowers_held_and_peak_bytes_by_the_prediction():
    """Six layers of GELU in a row, forward then backward, under MemTracker (labkit.measure):
    after forward the fused chain holds 12 B per element per layer less (exact: outputs +
    saved tensors); the peak of forward + backward is lower by at least 12·n·(L − 2): at the
    peak both hold all layers' saved tensors, and a fused backward may allocate up to 3
    temporaries of n elements more than the chain's (12·n of slack). The measured runs' output
    and input gradient must be six F.gelu's."""
    from labkit.allocation_trace import retained_bytes
    from labkit.lab6.fusion import fused_gelu_tanh, gelu_tanh_unfused
    from labkit.measure import peak_bytes

    x = torch.randn(64, 1000, requires_grad=True)
    n, L = x.numel(), 6

    def stack(f, keep=None):
        def run(x):
            for _ in range(L):
                x = f(x)
            if keep is not None:
                keep.append(x)
            return x
        return run

    kept = []
    held_unfused = retained_bytes(stack(gelu_tanh_unfused), x)
    with given(f"{L} fused_gelu_tanh forwards", x=x):
        held_fused = retained_bytes(stack(fused_gelu_tanh, kept), x)
    assert held_unfused - held_fused == 12 * n * L, \
        f"after forward the fused chain holds {held_fused:,} B vs {held_unfused:,} B: expected {12 * n * L:,} B less (12 per element per layer)"
    check_measured(x, kept[0], L, f"held bytes, {L} layers")

    def forward_backward(f, x):
        stack(f)(x).sum().backward()

    peak_unfused, _ = peak_bytes(forward_backward, gelu_tanh_unfused, x.detach().clone().requires_grad_())
    xf = x.detach().clone().requires_grad_()
    with given(f"{L} fused_gelu_tanh forwards and backwards", x=xf):
        peak_fused, _ = peak_bytes(forward_backward, fused_gelu_tanh, xf)
    assert peak_unfused - peak_fused >= 12 * n * (L - 2), \
        f"peak {peak_fused:,} B fused vs {peak_unfused:,} B unfused: expected at least {12 * n * (L - 2):,} B lower"
    xr = x.detach().clone().requires_grad_()
    stack(gelu_tanh_unfused)(xr).sum().backward()  # the given chain: F.gelu's formula written out
    torch.testing.assert_close(xf.grad, xr.grad, **FUSION_GRAD_TOL, msg=lambda m: (
        f"the input gradient of the {L}-layer step whose peak was measured differs from the "
        f"chain's: {m} — is the saved x the input, and the gradient computed from it?"))


@pytest.mark.exercise("6.5", points=1)
def test_fused_gelu_in_bfloat16_saves_its_bf16_input():
    """In bf16 the fused operator keeps bf16: its output and gradient are bf16 and close to
    F.gelu(approximate="tanh") in bf16 (rtol 1.6e-2: two bf16 ulps, 2·2⁻⁸ — both round the same
    formula to 8 significant bits), and it saves only x itself: 2 bytes per element."""
    import torch.nn.functional as F

    from labkit.lab6.fusion import fused_gelu_tanh
    from labkit.measure import saved_activation_bytes

    torch.manual_seed(0)
    x = (3 * torch.randn(64, 1000)).bfloat16().requires_grad_()
    with given("fused_gelu_tanh's forward", x=x):
        y = fused_gelu_tanh(x)
    g = torch.ones_like(y)
    with given("fused_gelu_tanh's backward", x=x, y=y, grad_out=g):
        (gx,) = torch.autograd.grad(y, x, g)
    assert (y.dtype, gx.dtype) == (torch.bfloat16, torch.bfloat16), \
        f"dtypes: output {y.dtype}, gradient {gx.dtype}; expected bfloat16 for a bfloat16 input"
    ref = F.gelu(x, approximate="tanh")
    (gref,) = torch.autograd.grad(ref, x, torch.ones_like(ref))
    torch.testing.assert_close(y, ref, atol=1e-2, rtol=1.6e-2, msg=lambda m: f"bf16 output: {m}")
    torch.testing.assert_close(gx, gref, atol=2e-2, rtol=1.6e-2, msg=lambda m: f"bf16 input gradient: {m}")
    out = []
    with given("fused_gelu_tanh's forward", x=x):
        saved = saved_activation_bytes(lambda: out.append(fused_gelu_tanh(x)))
    saved += ctx_bytes(out[0], skip=(x,))  # tensors kept as ctx attributes count too
    assert saved == 2 * x.numel(), \
        f"the fused operator saves {saved:,} B for a bf16 input of {x.numel():,} elements, expected {2 * x.numel():,}: save x itself, in its dtype"
    check_measured(x, out[0], 1, "saved bytes, bf16", tol=dict(atol=1e-2, rtol=1.6e-2),
                   grad_tol=dict(atol=2e-2, rtol=1.6e-2))
