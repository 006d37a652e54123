"""Graders of lab 5's exercise 5.6 (labs/05_activations.ipynb): FlashAttention forward and backward.

References: ``F.scaled_dot_product_attention`` (PyTorch's) and its autograd for outputs and
gradients, the plain softmax in float64, and ``MemTracker`` for peak bytes.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch

from labkit.measure import saved_activation_bytes
from _lab5_helpers import one_thread  # noqa: F401  (autouse fixture)
from _lab5_helpers import ATTN_TOL, refuses
from _given import as_given, ctx_bytes, given


# ------------------------------------------------------------------ 5.6 FlashAttention

ATTN_SHAPES = [(2, 3, 100, 16, 32, 16), (1, 2, 64, 8, 64, 64), (1, 1, 7, 4, 3, 5),
               (2, 2, 130, 32, 64, 64)]  # (B, H, S, D, block_q, block_k); S need not divide


HINTS = {
    "O": "O is Σ exp(s − m)·v / ℓ over every tile of the row: is the accumulator rescaled by "
         "exp(m_old − m_new) whenever a tile raises the running max m, and divided by ℓ once, at the end?",
    "L": "L is m + log ℓ of each row, with m its running max and ℓ its running sum of exp(s − m) "
         "over every tile (ℓ rescaled too when m grows)",
    "dq": "dq sums dS·k over the key tiles, scaled by 1/√d, with P recomputed as exp(q·kᵀ/√d − L) "
          "and dS = P∘(dP − D), D = rowsum(dO∘O)",
    "dk": "dk sums dSᵀ·q over the query tiles, scaled by 1/√d (dS = P∘(dP − D), D = rowsum(dO∘O))",
    "dv": "dv sums Pᵀ·dO over the query tiles, with P recomputed from L",
}


def assert_attention_close(quantity, got, want, *, atol, rtol, case, block_q=None, causal=False):
    """assert_close that says which quantity is wrong (O, L, dq, dk, dv), where (how many
    entries, which rows of the sequence and which query tiles, the largest difference) and the
    likely cause. NaN or inf counts as wrong. Shapes (B, H, S[, D]): the rows are dim 2."""
    assert tuple(got.shape) == tuple(want.shape), (
        f"{quantity}, {case}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    diff = (got.double() - want.double()).abs()
    bad = ~(diff <= atol + rtol * want.double().abs())  # NaN is bad too
    if not bool(bad.any()):
        return
    score = torch.where(bad, diff.nan_to_num(nan=math.inf), torch.tensor(-1.0, dtype=diff.dtype))
    worst = tuple(int(i) for i in torch.unravel_index(score.argmax(), score.shape))
    rows = sorted({int(r) for r in torch.nonzero(bad)[:, 2]})
    shown = ", ".join(map(str, rows[:8])) + (", …" if len(rows) > 8 else "")
    tiles = f" (query tiles {sorted({r // block_q for r in rows})} of {block_q} rows)" if block_q else ""
    cause = HINTS[quantity]
    if got.dtype == torch.float64 and float(score.max()) <= 1e-5 * (1 + want.abs().max().item()):
        cause = ("float64 inputs, but the error is float32's (~1e-7 relative): are the running "
                 "statistics or the accumulators float32?")
    elif causal:
        cause += ("; causal: if only rows whose tiles cross the diagonal are wrong, look at the "
                  "mask of those tiles (global positions q0 + i against k0 + j)")
    raise AssertionError(
        f"{quantity}, {case}: {int(bad.sum()):,} of {bad.numel():,} entries off, in rows {shown}"
        f"{tiles}; the largest at index {worst}: got {got[worst].item():.6g}, expected "
        f"{want[worst].item():.6g} (allowed atol {atol:g} + rtol {rtol:g}·|expected|) — {cause}")


def _inputs(b, h, s, d, strided=False):
    """A (B, H, S, D) input; ``strided``: as a model makes it, (B, S, H, D) memory seen through a
    transpose (not contiguous), so ``view`` where ``reshape`` is needed fails."""
    if strided:
        return torch.randn(b, s, h, d).transpose(1, 2)
    return torch.randn(b, h, s, d)


@pytest.mark.exercise("5.6", points=2)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_forward_matches_sdpa(causal):
    """Check O against F.scaled_dot_product_attention and L against logsumexp of the scores
    (every other shape with strided inputs)."""
    from labkit.lab5.flash_attention import flash_attention_forward
    flash_attention_forward = as_given(flash_attention_forward)

    for i, (b, h, s, d, bq, bk) in enumerate(ATTN_SHAPES):
        q, k, v = (_inputs(b, h, s, d, strided=i % 2) for _ in range(3))
        out, lse = flash_attention_forward(q, k, v, causal=causal, block_q=bq, block_k=bk)
        case = (f"(B, H, S, D) = {(b, h, s, d)}, tiles {bq} × {bk}, causal={causal}"
                + (", strided inputs" if i % 2 else ""))
        assert_attention_close("O", out, F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                               **ATTN_TOL, case=case, block_q=bq, causal=causal)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        if causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        assert_attention_close("L", lse, torch.logsumexp(scores, dim=-1), **ATTN_TOL, case=case,
                               block_q=bq, causal=causal)


@pytest.mark.exercise("5.6", points=3)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_backward_matches_sdpa_gradients(causal):
    """Check dq, dk, dv through flash_attention against autograd through SDPA."""
    from labkit.lab5.flash_attention import flash_attention

    for i, (b, h, s, d, bq, bk) in enumerate(ATTN_SHAPES):
        q, k, v = (_inputs(b, h, s, d, strided=i % 2).requires_grad_() for _ in range(3))
        grad_out = torch.randn(b, h, s, d)
        with given("flash_attention (forward, then backward)", q=q, k=k, v=v, grad_out=grad_out):
            ours = torch.autograd.grad(flash_attention(q, k, v, causal=causal, block_q=bq,
                                                       block_k=bk), (q, k, v), grad_out)
        ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                  (q, k, v), grad_out)
        case = (f"(B, H, S, D) = {(b, h, s, d)}, tiles {bq} × {bk}, causal={causal}"
                + (", strided inputs" if i % 2 else ""))
        for name, g, r in zip("qkv", ours, ref):
            assert_attention_close(f"d{name}", g, r, **ATTN_TOL, case=case, block_q=bq,
                                   causal=causal)


def _reference_attention(q, k, v, causal):
    """SDPA and the rows' log-sum-exp, computed in float64 on the same (rounded) inputs."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[-2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal), torch.logsumexp(scores, -1)


@pytest.mark.exercise("5.6", points=1)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_keeps_float64_accuracy(causal):
    """Check float64 inputs give float64 results: O, L and the gradients within 1e-12 of SDPA.

    1e-12: float64 rounding over sums of a few hundred terms is ~1e-14; statistics kept in
    float32 land near 1e-7.
    """
    from labkit.lab5.flash_attention import flash_attention, flash_attention_forward
    flash_attention_forward = as_given(flash_attention_forward)

    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 150, 16, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out, lse = flash_attention_forward(q, k, v, causal=causal, block_q=32, block_k=64)
    ref_out, ref_lse = _reference_attention(q.detach(), k.detach(), v.detach(), causal)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64, (
        f"float64 inputs gave O in {out.dtype} and L in {lse.dtype}; expected float64 for both: "
        f"are the statistics forced to float32?")
    case = f"float64 inputs (1, 2, 150, 16), tiles 32 × 64, causal={causal}"
    assert_attention_close("O", out, ref_out, atol=1e-12, rtol=1e-12, case=case, block_q=32)
    assert_attention_close("L", lse, ref_lse, atol=1e-12, rtol=1e-12, case=case, block_q=32)
    grad_out = torch.randn_like(ref_out)
    with given("flash_attention (forward, then backward)", q=q, k=k, v=v, grad_out=grad_out):
        ours = torch.autograd.grad(flash_attention(q, k, v, causal=causal, block_q=32,
                                                   block_k=64), (q, k, v), grad_out)
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                              (q, k, v), grad_out)
    for name, g, r in zip("qkv", ours, ref):
        assert_attention_close(f"d{name}", g, r, atol=1e-12, rtol=1e-12, block_q=32,
                               case=f"float64 inputs (1, 2, 150, 16), tiles 32 × 64, causal={causal}")


@pytest.mark.exercise("5.6", points=2)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_keeps_statistics_in_float32_for_16_bit_inputs(dtype):
    """Check 16-bit inputs: L in float32 and within 1e-4 of the exact log-sum-exp; O in dtype.

    1e-4: float32 statistics land ~1e-6 from the float64 reference on these inputs; running
    max and sum kept in bfloat16 (8 significant bits) are ~3e-2 off, float16 ~4e-3.
    O: half an ulp of the 16-bit output (|O| < 4) plus float32 rounding: 1.6e-2 for bfloat16,
    2e-3 for float16.
    """
    from labkit.lab5.flash_attention import flash_attention_forward
    flash_attention_forward = as_given(flash_attention_forward)

    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 2, 300, 16, dtype=dtype) for _ in range(3))
    out, lse = flash_attention_forward(q, k, v, causal=True, block_q=32, block_k=32)
    assert lse.dtype == torch.float32, (
        f"{dtype} inputs gave L in {lse.dtype}, expected torch.float32: keep the running max, "
        f"sum and log-sum-exp in float32 whatever the input's precision")
    ref_out, ref_lse = _reference_attention(q, k, v, causal=True)
    err = (lse.double() - ref_lse).abs().max().item()
    assert err <= 1e-4, (
        f"L of {dtype} inputs is {err:.2e} off the exact log-sum-exp (allowed 1e-4): are the "
        f"running max/sum or the tile scores kept in {dtype}?")
    assert out.dtype == dtype, f"O must come back in the input's dtype {dtype}, got {out.dtype}"
    atol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
    assert_attention_close("O", out, ref_out, atol=atol, rtol=0, block_q=32, causal=True,
                           case=f"{dtype} inputs (2, 2, 300, 16), tiles 32 × 32 (accumulator in {dtype}?)")


@pytest.mark.exercise("5.6", points=1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_backward_of_16_bit_inputs_matches_float64_gradients(dtype):
    """Check dq, dk, dv of 16-bit inputs (causal, ragged tiles) against float64 SDPA's gradients
    on the same rounded inputs, returned in the input dtype.

    Tolerance: float32 accumulation lands ~1e-6 from float64; rounding the results to the 16-bit
    output dtype costs half an ulp of |g| < 4: 1.6e-2 for bfloat16, 2e-3 for float16 (measured
    errors 7e-3 and 8e-4). Accumulating in the 16-bit dtype is ~10x off, or fails to run.
    """
    from labkit.lab5.flash_attention import flash_attention_backward, flash_attention_forward
    flash_attention_forward = as_given(flash_attention_forward)
    flash_attention_backward = as_given(flash_attention_backward)

    torch.manual_seed(4)
    q, k, v, g = (torch.randn(2, 2, 300, 16, dtype=dtype) for _ in range(4))
    out, lse = flash_attention_forward(q, k, v, causal=True, block_q=32, block_k=48)
    grads = flash_attention_backward(q, k, v, out, lse, g, causal=True, block_q=32, block_k=48)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(g.double())
    atol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
    for name, got, want in zip(("dq", "dk", "dv"), grads, (qd.grad, kd.grad, vd.grad)):
        assert got.dtype == dtype, f"{name} of {dtype} inputs came back in {got.dtype}"
        assert_attention_close(name, got, want, atol=atol, rtol=0, block_q=32, causal=True,
                               case=f"{dtype} inputs (2, 2, 300, 16), tiles 32 × 48, causal")


@pytest.mark.exercise("5.6", points=1)
def test_flash_saves_only_inputs_output_and_log_sum_exp():
    """Check autograd keeps q, k, v, O and L: 4·B·H·S·D + B·H·S floats, no S × S matrix; and
    that the measured forward's output, and the gradients backward computes from what it saved,
    are attention's."""
    from labkit.lab5.flash_attention import flash_attention

    b, h, s, d = 1, 2, 256, 32
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    out = []
    with given("flash_attention's forward", q=q, k=k, v=v):
        saved = saved_activation_bytes(lambda: out.append(flash_attention(q, k, v, causal=True)))
    saved += ctx_bytes(out[0], skip=(q, k, v))  # tensors kept as ctx attributes count too
    want = (4 * b * h * s * d + b * h * s) * 4
    assert saved == want, (
        f"bytes autograd keeps for backward at (B, H, S, D) = {(b, h, s, d)}, fp32: {saved:,}, "
        f"expected {want:,} (q, k, v, O and L: 4·B·H·S·D + B·H·S floats): "
        + ("more: is a tile, the (S × S) scores or a copy of q, k, v saved as well (autograd saves "
           "what the operators inside an autograd.Function's forward need only if they run with "
           "grad enabled)?" if saved > want else "fewer: are O and L both saved?"))
    grad_out = torch.randn(b, h, s, d)
    with given("flash_attention's backward", q=q, k=k, v=v, out=out[0], grad_out=grad_out):
        out[0].backward(grad_out)  # backward from what was saved: O and L must be the right ones
    _check_measured(out[0], q, k, v, grad_out)


def _check_measured(out, q, k, v, grad_out=None):
    """A measurement counts only for the right result: the output the bytes or FLOPs were
    measured on must be attention's (returning zeros saves nothing and computes nothing); with
    ``grad_out``, the gradients the measured backward left on q, k and v must be SDPA's too."""
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.detach(), want, **ATTN_TOL,
                               msg=lambda m: f"the measured run's output is not attention's: {m}")
    if grad_out is not None:
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        ref = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True), leaves,
                                  grad_out)
        for name, x, r in zip("qkv", (q, k, v), ref):
            assert x.grad is not None, f"the measured backward left no gradient on {name}"
            torch.testing.assert_close(x.grad, r, **ATTN_TOL, msg=lambda m, name=name: (
                f"the measured backward's d{name} is not attention's: {m}"))


def _attention_peak(fn, s, b=1, h=2, d=32):
    """MemTracker's peak bytes over forward + backward of fn(q, k, v)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(b, h, s, d)
    with given("the measured forward and backward", q=q, k=k, v=v, grad_out=grad_out), \
            MemTracker() as tracker:
        out = fn(q, k, v)
        out.backward(grad_out)
    _check_measured(out, q, k, v, grad_out)
    return sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())


@pytest.mark.exercise("5.6", points=2)
def test_flash_peak_memory_grows_linearly_naive_quadratically():
    """Check the growth of MemTracker's peak at S, 2S, 4S: second step / first step.

    Linear memory doubles its increment when S doubles (ratio 2); quadratic memory quadruples
    it (ratio 4). Allowed: ≤ 2.5 for flash, ≥ 3 for naive (lower-order terms pull it down).
    """
    from labkit.lab5.flash_attention import flash_attention, naive_attention

    sizes = (128, 256, 512)
    flash = [_attention_peak(lambda q, k, v: flash_attention(q, k, v, causal=True), s)
             for s in sizes]
    naive = [_attention_peak(lambda q, k, v: naive_attention(q, k, v, causal=True), s)
             for s in sizes]
    growth = lambda p: (p[2] - p[1]) / (p[1] - p[0])  # noqa: E731
    peaks = ", ".join(f"S = {s}: flash {f:,} B, naive {n:,} B" for s, f, n in zip(sizes, flash, naive))
    assert growth(flash) <= 2.5, (
        f"peak memory of flash attention grows {growth(flash):.2f}× from S = 256→512 compared with "
        f"128→256 (linear memory gives 2, allowed ≤ 2.5): {peaks} — more than one (block_q × block_k) "
        f"tile of scores alive at once, or an (S × S) matrix (a mask, the scores, dS) built whole?")
    assert growth(naive) >= 3.0, f"the naive reference should grow quadratically (≥ 3): {peaks}"
    assert flash[2] < naive[2] / 4, (
        f"at S = {sizes[2]} flash attention peaks at {flash[2]:,} B, expected below a quarter of "
        f"naive attention's {naive[2]:,} B = {naive[2] / 4:,.0f}: {peaks} — more than one score tile "
        f"alive at once (tiles kept in a list, the backward's P or dS of every tile kept until the "
        f"end), or tiles as large as S?")


def _tile_flops(s, d, bh, bq, bk, causal, matmuls):
    """Upper bound on the matmul FLOPs of a tiled pass that skips the tiles wholly above the
    diagonal: every tile [q0, q0+bq) × [k0, k0+bk) with k0 < q0+bq (all of them when not
    causal), each costing ``matmuls`` products of 2·bq·bk·d FLOPs (the last tiles clipped at S)."""
    total = 0
    for q0 in range(0, s, bq):
        q1 = min(s, q0 + bq)
        for k0 in range(0, q1 if causal else s, bk):
            total += matmuls * 2 * (q1 - q0) * (min(s, k0 + bk) - k0) * d * bh
    return total


class _MatmulFlops(torch.utils._python_dispatch.TorchDispatchMode):
    """FLOPs of every matrix product run inside, in-place ones included (2·m·n·k a product), and
    the largest results: of a product (entries of one of its (m × n) matrices, and in all) and
    of any operator (elements); and the most elements one reduction (a sum, a max, a softmax...)
    combines along the dimensions it reduces.

    ``FlopCounterMode`` does not count in-place ``baddbmm_``/``addmm_``, which a tiled kernel
    accumulates with, so this counts from the operands' shapes itself; matrix-vector and vector
    products (``mv``, ``dot``...) are products too. A fused attention kernel (SDPA's, not a
    tile's) is a product too: its implied scores, Sq × Sk per (batch, head). Scores need no
    product operator at all (a broadcast multiply and a sum), but a row's softmax then reduces
    over all its keys: the reductions catch a strip however it was made."""

    OPS = {"mm": 0, "bmm": 0, "addmm": 1, "addmm_": 1, "baddbmm": 1, "baddbmm_": 1}
    VECTOR_OPS = {"mv": 0, "addmv": 1, "addmv_": 1, "dot": 0, "vdot": 0}  # (matrix ·) vector
    REDUCTIONS = {"sum", "nansum", "mean", "amax", "amin", "max", "min", "logsumexp", "_softmax",
                  "_log_softmax"}  # (each with its dimensions second: all of them if none)

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.matrix = self.product = self.tensor = self.reduced = (0, None)  # (entries, operator)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        first, vector = self.OPS.get(name), self.VECTOR_OPS.get(name)
        if vector is not None:
            a = args[vector]
            self.flops += 2 * a.numel()  # (n × m) · m, or m · m
            n = a.shape[0] if a.dim() == 2 else 1
            self._largest("matrix", n, f"{func} ({n} × 1)")
            self._largest("product", n, str(func))
        elif name in self.REDUCTIONS and args and isinstance(args[0], torch.Tensor) and \
                args[0].is_floating_point():
            x, dims = args[0], args[1] if len(args) > 1 else (kwargs or {}).get("dim")
            dims = [dims] if isinstance(dims, int) else dims
            extent = 0 if isinstance(dims, torch.Tensor) else \
                math.prod(x.shape[i] for i in dims) if isinstance(dims, (list, tuple)) and \
                dims and x.dim() else x.numel()  # (max(a, b) of two tensors reduces nothing)
            self._largest("reduced", extent, f"{func} over {extent} of {tuple(x.shape)}")
        if first is not None:
            a, b = args[first], args[first + 1]
            self.flops += 2 * math.prod(a.shape) * b.shape[-1]
            m, n = a.shape[-2], b.shape[-1]
            self._largest("matrix", m * n, f"{func} ({m} × {n})")
            self._largest("product", math.prod(a.shape[:-1]) * n, str(func))
        elif name.startswith(("_scaled_dot_product", "_flash_attention", "_efficient_attention")):
            q, k = args[0], args[1]
            self._largest("matrix", q.shape[-2] * k.shape[-2],
                          f"{func} ({q.shape[-2]} × {k.shape[-2]} implied scores)")
            self._largest("product", math.prod(q.shape[:-1]) * k.shape[-2], str(func))
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self._largest("tensor", t.numel(), f"{func} {tuple(t.shape)}")
        return out

    def _largest(self, what, entries, op):
        if entries > getattr(self, what)[0]:
            setattr(self, what, (entries, op))


def _check_one_tile_at_a_time(name, counter, s, d, bh, bq, bk):
    """Each matrix product of a tiled pass makes one tile: a tile's scores (bq × bk), or its
    contribution to O, dQ, dK or dV (bq × D or bk × D; D ≤ bq, bk here); in all at most
    B·H·max(bq·bk, S) entries (S: a per-row quantity such as rowsum(dO∘O) done as a product).
    A reduction combines at most a tile's keys or queries or a head's D channels (a second pass
    over per-tile statistics: at most S/2 here); a row's softmax against all keys combines S.
    No tensor exceeds 3·B·H·S·D elements (q, k and v stacked); scores against all S keys
    would, for more than 3D query rows."""
    tile = bq * bk
    got, op = counter.matrix
    assert got <= tile, (
        f"{name}: a matrix product made a {got:,}-entry result per (batch, head) ({op}), more "
        f"than one {bq} × {bk} tile ({tile:,}) at S = {s}, D = {d}: scores of query rows against "
        f"all keys (a strip) instead of one key tile at a time with the online softmax?")
    got, op = counter.product
    assert got <= bh * max(tile, s), (
        f"{name}: a matrix product made {got:,} entries in all ({op}), more than one "
        f"{bq} × {bk} tile per (batch, head) (B·H·max(bq·bk, S) = {bh * max(tile, s):,}): "
        f"several tiles, or a strip of query rows against all keys, computed at once?")
    got, op = counter.reduced
    assert got <= max(bq, bk, d, s // 2), (
        f"{name}: one reduction combined {got:,} elements ({op}), more than one {bq} × {bk} "
        f"tile's keys or queries, a head's {d} channels, or half of the S = {s} keys: a softmax, sum or "
        f"max over a query row against all its keys (a strip of scores, however it was made) "
        f"instead of one key tile at a time with the online softmax?")
    got, op = counter.tensor
    assert got <= 3 * bh * s * d, (
        f"{name}: an operator made a tensor of {got:,} elements ({op}), more than q, k and v "
        f"together (3·B·H·S·D = {3 * bh * s * d:,}): an (S × S) matrix (scores, a mask, dS) "
        f"or query rows against all keys at once?")


@pytest.mark.exercise("5.6", points=1)
def test_causal_flash_skips_the_tiles_above_the_diagonal():
    """Count the matmul FLOPs (in-place products too) of the causal forward and backward, and
    the size of every product's result: one tile at a time, at most the FLOPs of the tiles that
    touch the diagonal or lie below it (forward: QKᵀ and PV; backward: the recomputed QKᵀ, dV,
    dP, dQ, dK), far below the non-causal count (S = 12 tiles of keys)."""
    from labkit.lab5.flash_attention import flash_attention_backward, flash_attention_forward

    b, h, s, d, bq, bk = 1, 2, 96, 8, 8, 8  # S > bq·bk: even one query row against all keys is
    q, k, v, grad_out = (torch.randn(b, h, s, d) for _ in range(4))  # more than a tile
    with given("flash_attention_forward", q=q, k=k, v=v), _MatmulFlops() as fwd:
        out, lse = flash_attention_forward(q, k, v, causal=True, block_q=bq, block_k=bk)
    with given("flash_attention_backward", q=q, k=k, v=v, out=out, lse=lse, grad_out=grad_out), \
            _MatmulFlops() as bwd:
        grads = flash_attention_backward(q, k, v, out, lse, grad_out, causal=True, block_q=bq,
                                         block_k=bk)
    _check_measured(out, q, k, v)  # the FLOPs counted are those of the right results
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    F.scaled_dot_product_attention(qr, kr, vr, is_causal=True).backward(grad_out)
    for name, got, want in zip(("dq", "dk", "dv"), grads, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(got, want, **ATTN_TOL, msg=lambda m, name=name: f"the "
                                   f"measured backward's {name} is not attention's: {m}")
    for name, counter, matmuls in (("forward", fwd, 2), ("backward", bwd, 5)):
        _check_one_tile_at_a_time(f"causal {name}", counter, s, d, b * h, bq, bk)
        got = counter.flops
        bound = _tile_flops(s, d, b * h, bq, bk, True, matmuls)
        full = _tile_flops(s, d, b * h, bq, bk, False, matmuls)
        assert got <= bound, (
            f"causal {name} FLOPs: expected at most {bound:,} (the tiles on or below the "
            f"diagonal; all tiles would be {full:,}), got {got:,}: "
            + ("are the tiles wholly above the diagonal computed (masked) instead of skipped?"
               if got >= full else "is more computed per tile than its products?"))


# ---- bad input (not graded)

def _flash_cases():
    from labkit.lab5 import flash_attention as f

    x = torch.randn(1, 1, 8, 4)
    return [
        ("mixed dtypes", lambda: f.flash_attention(x, x.double(), x), TypeError, "dtype"),
        ("integer tensors", lambda: f.flash_attention(x.long(), x.long(), x.long()), TypeError,
         "floating"),
        ("not a tensor", lambda: f.flash_attention(x.tolist(), x, x), TypeError, "q"),
        ("3-d", lambda: f.flash_attention(x[0], x[0], x[0]), ValueError, "shape"),
        ("shapes differ", lambda: f.flash_attention(x, x[:, :, :4], x), ValueError, "shape"),
        ("block_q 0", lambda: f.flash_attention(x, x, x, block_q=0), ValueError, "block_q"),
        ("block_k float", lambda: f.flash_attention(x, x, x, block_k=2.0), ValueError, "block_k"),
        ("causal text", lambda: f.flash_attention(x, x, x, causal="yes"), TypeError, "causal"),
        ("forward mixed", lambda: f.flash_attention_forward(x.half(), x, x), TypeError, "dtype"),
        ("head_dim 0", lambda: f.flash_attention(x[..., :0], x[..., :0], x[..., :0]), ValueError,
         "head_dim"),
        ("backward lse shape", lambda: f.flash_attention_backward(x, x, x, x, x, x), ValueError,
         "lse"),
        ("backward grad_out shape", lambda: f.flash_attention_backward(
            x, x, x, x, x[..., 0], x[:, :, :4]), ValueError, "grad_out"),
        ("backward out dtype", lambda: f.flash_attention_backward(
            x, x, x, x.long(), x[..., 0], x), TypeError, "out"),
    ]


def test_bad_input_is_refused_with_the_argument_named():
    """Check each public function refuses bad input with ValueError/TypeError naming it, before any
    work. The checks sit outside the exercise blocks, so this passes on the stubs: not graded."""
    refuses(_flash_cases())
