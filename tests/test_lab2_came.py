"""Graders of Lab 2, exercise 2.8 (labs/02_optimizer_states.ipynb): CAME (labkit.lab2.came) against
the paper's Algorithm 1 written out as the plain computation.

No library implements CAME in PyTorch core, so the reference is Luo et al. 2023 (arXiv
2307.02047), Algorithm 1, computed here with full (m×n) tensors (the factored estimates of v
and of the instability rebuilt as outer products, sums written as means as in the authors'
code: r c / Σr with sums equals r c / mean(r) with means) and an explicit loop over steps;
the state bytes against the formula m·n + 2(m + n) floats per matrix (``came_state_bytes``,
checked here against the count written out). Tolerance: fp32 rounding of the same formulas
with reductions in another order (rtol 1e-5, atol 1e-7 on weights ≤ ~1); a wrong β, a missing
clipping or a sum in place of a mean moves the weights by ≥ 1e-4.
"""
from __future__ import annotations

import pytest
import torch

from labkit.optimizer_states import state_bytes


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
    torch.testing.assert_close(w.detach(), ref_w, rtol=1e-5, atol=1e-7, msg=lambda m: (
        f"20×30 weight after 6 steps with {settings}: {m} — check v = r c / mean(r) from g² + ε₁ "
        "with β₂, the clipping of u by max(1, RMS(u)/d), m from the clipped u with β₁, the "
        "instability (u − m)² + ε₂ with the *new* m and β₃, the step m / √S, and the decay "
        "θ(1 − lr·λ) applied before it"))
    torch.testing.assert_close(b.detach(), ref_b, rtol=1e-5, atol=1e-7, msg=lambda m: (
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
