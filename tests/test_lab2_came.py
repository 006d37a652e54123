"""Graders of Lab 2, exercise 2.8 (labs/02_optimizer_states.ipynb): CAME (labkit.lab2.came) against
the paper's Algorithm 1 written out as the plain computation.

No library implements CAME in PyTorch core, so the reference is Luo et al. 2023 (arXiv
2307.02047), Algorithm 1, computed here with full (m×n) tensors (the factored estimates of v
and of the instability rebuilt as outer products, sums written as means as in the authors'
code: r c / Σr with sums equals r c / mean(r) with means) and an explicit loop over steps;
the state bytes against the formula m·n + 2(m + n) floats per matrix (``came_state_bytes``,
checked here against the count written out). Tolerance: fp32 rounding of the same formulas
with reductions in another order (rtol 1e-5, atol 1e-6 on weights ≤ ~1); a wrong β, a missing
clipping or a sum in place of a mean moves the weights by ≥ 1e-4.
"""
from __future__ import annotations

import pytest
import torch

from labkit.optimizer_states import state_bytes
from _given import assert_state_kept_in_state


def plain_came(w0, b0, grads, lr, betas, eps, d, weight_decay):
    b1, b2, b3 = betas
    e1, e2 = eps
    w, b = w0.clone(), b0.clone()
    m_w, m_b = torch.zeros_like(w), torch.zeros_like(b)
    r, c = torch.zeros(w.shape[0]), torch.zeros(w.shape[1])
    R, C = torch.zeros(w.shape[0]), torch.zeros(w.shape[1])
    v_b = torch.zeros_like(b)
    for gw, gb in grads:
        # weight: factored second moment, clipped update, first moment, factored instability
        r = b2 * r + (1 - b2) * (gw ** 2 + e1).mean(dim=1)
        c = b2 * c + (1 - b2) * (gw ** 2 + e1).mean(dim=0)
        v = torch.outer(r, c) / r.mean()
        u = gw / v.sqrt()
        u = u / max(1.0, float(u.pow(2).mean().sqrt()) / d)
        m_w = b1 * m_w + (1 - b1) * u
        U = (u - m_w) ** 2 + e2
        R = b3 * R + (1 - b3) * U.mean(dim=1)
        C = b3 * C + (1 - b3) * U.mean(dim=0)
        S = torch.outer(R, C) / R.mean()
        w = w * (1 - lr * weight_decay) - lr * m_w / S.sqrt()
        # vector: second moment whole, no instability
        v_b = b2 * v_b + (1 - b2) * (gb ** 2 + e1)
        ub = gb / v_b.sqrt()
        ub = ub / max(1.0, float(ub.pow(2).mean().sqrt()) / d)
        m_b = b1 * m_b + (1 - b1) * ub
        b = b * (1 - lr * weight_decay) - lr * m_b
    return w, b


@pytest.mark.exercise("2.8", points=2)
@pytest.mark.parametrize("settings", [dict(lr=1e-2, weight_decay=0.0, d=1.0),
                                      dict(lr=3e-2, weight_decay=0.1, d=2.0)])
def test_came_matches_the_papers_algorithm(settings):
    """Check 6 steps of a 20×30 weight (gradients spanning three decades across columns) and a
    30-vector against Algorithm 1 computed in full: the weight exercises the factored second
    moment, clipping, first moment and factored instability; the vector Adafactor's rule."""
    from labkit.lab2.came import CAME

    torch.manual_seed(0)
    w0, b0 = torch.randn(20, 30) * 0.1, torch.randn(30) * 0.1
    g = torch.Generator().manual_seed(1)
    grads = [(torch.randn(20, 30, generator=g) * torch.logspace(-3, 0, 30),
              torch.randn(30, generator=g)) for _ in range(6)]
    betas, eps = (0.9, 0.999, 0.9999), (1e-30, 1e-16)
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    opt = CAME([w, b], betas=betas, eps=eps, **settings)
    for gw, gb in grads:
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
    ref_w, ref_b = plain_came(w0, b0, grads, settings["lr"], betas, eps, settings["d"],
                              settings["weight_decay"])
    # atol 1e-6: a weight near 0 carries the rounding of steps of ~lr (measured: 3.4e-7)
    torch.testing.assert_close(w.detach(), ref_w, rtol=1e-5, atol=1e-6, msg=lambda m: (
        f"20×30 weight after 6 steps with {settings}: {m} — check v = r c / mean(r) from g² + ε₁ "
        "with β₂, the clipping of u by max(1, RMS(u)/d), m from the clipped u with β₁, the "
        "instability (u − m)² + ε₂ with the *new* m and β₃, the step m / √S, and the decay "
        "θ(1 − lr·λ) applied before it"))
    torch.testing.assert_close(b.detach(), ref_b, rtol=1e-5, atol=1e-6, msg=lambda m: (
        f"30-vector after 6 steps with {settings}: {m} — a vector keeps its v whole (β₂, ε₁ "
        "inside), clips u the same way and steps by m, with no instability"))


@pytest.mark.exercise("2.8", points=1)
@pytest.mark.parametrize("shape", [(64, 256), (300, 7), (3, 20, 30), (50,)])
def test_came_state_bytes_are_the_formula(shape):
    """Check the measured state (its tensors, each storage once) after two steps: m (numel
    floats) plus the row and column factors of v and of the instability (2·lead·(m + n)
    floats) for a weight; m and v (2n floats) for a vector."""
    from labkit.lab2.came import CAME, came_state_bytes

    p = torch.zeros(shape, requires_grad=True)
    opt = CAME([p])
    for _ in range(2):
        p.grad = torch.randn(shape)
        opt.step()
    numel = p.numel()
    if len(shape) == 1:
        want = 4 * 2 * numel
    else:
        lead = numel // (shape[-1] * shape[-2])
        want = 4 * (numel + 2 * lead * (shape[-2] + shape[-1]))
    assert came_state_bytes(shape) == want  # the helper is the formula
    got = state_bytes(opt)
    assert_state_kept_in_state(opt)
    assert got == want, (
        f"CAME keeps {got:,} B of state for a {tuple(shape)} tensor, expected {want:,} "
        f"({'2n floats: m and v' if len(shape) == 1 else 'numel + 2·(m + n) floats per matrix: m and the factors'}): "
        "keep only the factors of v and of the instability (the full m×n estimates are temporaries)")


@pytest.mark.parametrize("kwargs,word", [
    (dict(lr=-1), "lr"), (dict(betas=(0.9, 0.999)), "betas"), (dict(eps=(1e-30,)), "eps"),
    (dict(d=0.5), "d "), (dict(weight_decay=-1), "weight_decay"),
])
def test_came_refuses_bad_input(kwargs, word):
    from labkit.lab2.came import CAME

    with pytest.raises((ValueError, TypeError), match=word):
        CAME([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def plain_came_tensor(p0, grads, lr, betas=(0.9, 0.999, 0.9999), eps=(1e-30, 1e-16), d=1.0,
                      weight_decay=0.0):
    """Algorithm 1 for one tensor of any shape, in full: (..., m, n) factored over its last two
    dims (one r, c, R, C per matrix of the stack), a vector unfactored. The parameter is kept in
    its own dtype (a 16-bit one rounded after each step), the state in fp32. Returns (p, m)."""
    b1, b2, b3 = betas
    e1, e2 = eps
    p = p0.clone()
    g0 = grads[0].double()
    m = torch.zeros_like(g0)
    factored = g0.dim() >= 2
    if factored:
        r = torch.zeros(g0.shape[:-1], dtype=torch.float64)
        c = torch.zeros(g0.shape[:-2] + g0.shape[-1:], dtype=torch.float64)
        R, C = r.clone(), c.clone()
    else:
        v = torch.zeros_like(g0)
    for g in grads:
        g = g.to(p0.dtype).double()
        if factored:
            r = b2 * r + (1 - b2) * (g ** 2 + e1).mean(dim=-1)
            c = b2 * c + (1 - b2) * (g ** 2 + e1).mean(dim=-2)
            vhat = r[..., :, None] * c[..., None, :] / r.mean(dim=-1)[..., None, None]
        else:
            v = b2 * v + (1 - b2) * (g ** 2 + e1)
            vhat = v
        u = g / vhat.sqrt()
        u = u / max(1.0, float(u.pow(2).mean().sqrt()) / d)
        m = b1 * m + (1 - b1) * u
        if factored:
            U = (u - m) ** 2 + e2
            R = b3 * R + (1 - b3) * U.mean(dim=-1)
            C = b3 * C + (1 - b3) * U.mean(dim=-2)
            S = R[..., :, None] * C[..., None, :] / R.mean(dim=-1)[..., None, None]
            step = m / S.sqrt()
        else:
            step = m
        p = (p.double() * (1 - lr * weight_decay) - lr * step).to(p0.dtype)
    return p, m.float()


def _run_came(p0, grads, **options):
    from labkit.lab2.came import CAME

    p = p0.clone().requires_grad_()
    opt = CAME([p], **options)
    for g in grads:
        p.grad = g.clone().to(p.dtype)
        opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.exercise("2.8", points=1)
def test_came_factors_each_matrix_of_a_3d_weight():
    """A (3, 8, 12) weight whose three matrices have gradients of very different scales (1e-3,
    1, 1e2) against Algorithm 1 applied to the stack: r, c, R, C and mean(r) are per matrix (the
    last two dims), while the clipping RMS is over the whole tensor, as for any tensor. A mean
    over dim 0, or over all rows of the stack, is right only for a 2-D weight. Tolerance: rtol
    1e-5, atol 1e-6 (fp32 rounding, as above)."""
    g = torch.Generator().manual_seed(2)
    scale = torch.tensor([1e-3, 1.0, 1e2])[:, None, None]
    grads = [torch.randn(3, 8, 12, generator=g) * scale for _ in range(4)]
    p0 = torch.randn(3, 8, 12, generator=g) * 0.1
    got, state = _run_came(p0, grads, lr=1e-2)
    want, _ = plain_came_tensor(p0, grads, 1e-2)
    assert state["exp_avg_sq_row"].shape == (3, 8) and state["exp_avg_sq_col"].shape == (3, 12), (
        f"factor shapes {tuple(state['exp_avg_sq_row'].shape)}, {tuple(state['exp_avg_sq_col'].shape)} "
        "for a (3, 8, 12) weight, expected (3, 8) and (3, 12): one row and one column factor per matrix")
    assert state["step"] == len(grads), (
        f"state['step'] is {state['step']!r} after {len(grads)} steps: count each step in the state")
    for k in range(3):
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda msg, k=k: (
            f"matrix {k} (gradient scale {float(scale[k]):g}) of a (3, 8, 12) weight after 4 steps: "
            f"{msg}"))


@pytest.mark.exercise("2.8", points=1)
def test_came_survives_zero_gradient_rows_and_columns():
    """A 16×24 weight whose gradient is zero in 4 columns and 2 rows at every step (an unused
    embedding row, a dead unit): ε₁ keeps v's factors positive and ε₂ the instability's, so
    every weight stays finite and matches Algorithm 1 (zero-gradient entries do not move).
    Tolerance: rtol 1e-5, atol 1e-6."""
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(16, 24)
    mask[:, :4] = 0
    mask[:2] = 0
    grads = [torch.randn(16, 24, generator=g) * mask for _ in range(4)]
    p0 = torch.randn(16, 24, generator=g) * 0.1
    got, _ = _run_came(p0, grads, lr=1e-2)
    bad = int((~torch.isfinite(got)).sum())
    assert bad == 0, (f"{bad} of {got.numel()} weights are NaN/inf after 4 steps with zero-gradient "
                      "rows and columns: ε₁ belongs inside v (g² + ε₁) and ε₂ inside the "
                      "instability ((u − m)² + ε₂), so no factor is 0")
    want, _ = plain_came_tensor(p0, grads, 1e-2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.exercise("2.8", points=1)
def test_came_bf16_weight_keeps_fp32_state():
    """A bf16 20×30 weight: the state is fp32 (m, the factors), the weight bf16, and both match
    Algorithm 1 with fp32 state and the weight rounded to bf16 after each step. m is compared to
    fp32 rounding (rtol 1e-5, atol 1e-7: an m kept in bf16 is off by ~2⁻⁹ relative); the weight
    to bf16 rounding of its steps: the first steps are ~0.1 (m/√S ≈ 11 at lr 1e-2), rounded to
    bf16 before the add and again after it, so where the step cancels the weight the absolute
    error is that rounding (rtol 2⁻⁶, atol 2⁻⁸ ≈ 3.9e-3; measured ≤ 3.9e-3)."""
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(20, 30, generator=g) for _ in range(3)]
    p0 = (torch.randn(20, 30, generator=g) * 0.1).to(torch.bfloat16)
    got, state = _run_came(p0, grads, lr=1e-2)
    want, want_m = plain_came_tensor(p0, grads, 1e-2)
    assert got.dtype == torch.bfloat16, f"the weight became {got.dtype}: keep the parameter's dtype"
    wrong = {k: str(v.dtype) for k, v in state.items()
             if isinstance(v, torch.Tensor) and v.dtype != torch.float32}
    assert not wrong, f"state tensors {wrong} of a bf16 weight are not fp32: keep CAME's state in fp32"
    torch.testing.assert_close(state["exp_avg"], want_m, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -8)


@pytest.mark.exercise("2.8", points=1)
def test_came_applies_each_groups_options():
    """Two parameter groups under the defaults lr 1e-2, d 1000 (a 12×10 weight: never clipped),
    and lr 3e-2, d 1, weight decay 0.1 (a 10×12 weight: clipped at every step, RMS(u) being
    ~30–100 in the first steps, before v has grown). CAME's step m/√S does not change when
    every u is scaled by the same factor, but clipping scales each step's u by its own 1/RMS,
    so d = 1 and d = 1000 give different weights. Each group against Algorithm 1 with its own
    options, as in torch.optim. Tolerance: rtol 1e-5, atol 1e-6."""
    from labkit.lab2.came import CAME

    g = torch.Generator().manual_seed(5)
    shapes = [(12, 10), (10, 12)]

    def spiky(shape):
        x = torch.randn(shape, generator=g)
        x.view(-1)[torch.randperm(x.numel(), generator=g)[:4]] *= 30
        return x

    grads = [[spiky(s) for _ in range(3)] for s in shapes]
    p0 = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    options = [dict(lr=1e-2, d=1000.0, weight_decay=0.0), dict(lr=3e-2, d=1.0, weight_decay=0.1)]
    ps = [x.clone().requires_grad_() for x in p0]
    opt = CAME([{"params": [ps[0]]}, {"params": [ps[1]], **options[1]}], lr=1e-2, d=1000.0)
    for k in range(3):
        for p, gr in zip(ps, grads):
            p.grad = gr[k].clone()
        opt.step()
    for i, (p, o) in enumerate(zip(ps, options)):
        want, _ = plain_came_tensor(p0[i], grads[i], o["lr"], d=o["d"], weight_decay=o["weight_decay"])
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6, msg=lambda m, i=i, o=o: (
            f"group {i} ({o}) after 3 steps: {m} — read lr, d and weight_decay from the group"))
