"""CAME: Adafactor's factored second moment plus a factored *confidence* of the update.

Adafactor (``labkit.lab2.adafactor``) saves Adam's second moment by storing its row and column means,
but its updates are unstable without a first moment. CAME (Luo et al. 2023, "CAME:
Confidence-guided Adaptive Memory Efficient Optimization", arXiv 2307.02047) keeps a first
moment m of the normalized update and measures how far each new update strays from it,
U = (u − m)²: the *instability*. That matrix too is stored factored (row and column means), and
the step is m scaled down where the instability is large: low confidence, small step.

Per m×n weight, state: m (m·n floats, the first moment), the row and column factors of v and
of the instability (2·(m + n) floats): 4·(m·n + 2(m + n)) bytes, about 4 bytes per parameter
next to Adam's 8. A vector keeps its v whole and no instability (2n floats).

The update is the paper's Algorithm 1 (β = (β₁, β₂, β₃), ε = (ε₁, ε₂), update clipping at d,
decoupled weight decay); Lab 2 writes it out step by step, and the grader computes it in full.

Chapter 2 (book/02_optimizer_states.md); Lab 2, exercise 2.8 (labs/02_optimizer_states.ipynb).
"""
from __future__ import annotations

import torch

from labkit import validate
from labkit.optim_base import PerParameterOptimizer
from labkit.optimizer_states import came_state_bytes  # noqa: F401  (the formula, for the lab)

# ==== given: the course's code — read it, call it, don't change it ====


class CAME(PerParameterOptimizer):
    """CAME for ≥2-D weights (factored over the last two dims) and vectors (unfactored).

    ``step(closure=None)`` (given, ``labkit.optim_base``) calls ``_update`` with the fp32
    gradient of every parameter that has one; a parameter without one keeps its state and step
    count. ``load_state_dict`` keeps the fp32 state fp32, also for 16-bit parameters. State of a
    parameter (fp32): ``"step"`` (int), ``"exp_avg"`` (its shape), and for a weight of shape
    (..., m, n): ``"exp_avg_sq_row"`` (..., m), ``"exp_avg_sq_col"`` (..., n),
    ``"exp_avg_res_row"`` (..., m), ``"exp_avg_res_col"`` (..., n); for a vector:
    ``"exp_avg_sq"`` (its shape) and no instability (the paper's vectors use Adafactor's rule).

    Args:
        params: the parameters, or parameter groups (dicts with "params" and any of the
            options below), as for ``torch.optim``; each group's options apply to its parameters.
        lr: the step size. betas: (β₁, β₂, β₃). eps: (ε₁, ε₂). d: update clipping threshold.
        weight_decay: decoupled, θ ← θ(1 − lr·λ).
    """

    grad_dtype = torch.float32

    def __init__(self, params, lr: float = 2e-4, betas=(0.9, 0.999, 0.9999),
                 eps=(1e-30, 1e-16), d: float = 1.0, weight_decay: float = 0.0):
        validate.came_args(lr=lr, betas=betas, eps=eps, d=d, weight_decay=weight_decay)
        super().__init__(validate.params("params", params),
                         dict(lr=lr, betas=tuple(betas), eps=tuple(eps), d=d,
                              weight_decay=weight_decay))

    # ==== exercise 2.8: your code ====

    def _update(self, p, g, state, group) -> None:
        """One CAME step of parameter ``p`` with fp32 gradient ``g``; creates its state on first use.

        Contract: the state keys and shapes of the class docstring; after the call ``p`` equals
        the paper's Algorithm 1 applied to it (the module docstring), to fp32 rounding: the
        factored second moment from ``g² + ε₁``, the clipped normalized update, its first moment,
        the factored instability from ``(u − m)² + ε₂`` (weights only) and the confidence-scaled
        step with decoupled weight decay. The full m×n estimates of v and of the instability
        are temporaries; only their factors are kept.
        """
        # BEGIN SOLUTION 2.8: create the state on first use, then one step of the paper's Algorithm 1 keeping only the factors of v and of the instability
        beta1, beta2, beta3 = group["betas"]
        eps1, eps2 = group["eps"]
        factored = g.dim() >= 2
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(g)
            if factored:
                state["exp_avg_sq_row"] = g.new_zeros(g.shape[:-1])
                state["exp_avg_sq_col"] = g.new_zeros(g.shape[:-2] + g.shape[-1:])
                state["exp_avg_res_row"] = g.new_zeros(g.shape[:-1])
                state["exp_avg_res_col"] = g.new_zeros(g.shape[:-2] + g.shape[-1:])
            else:
                state["exp_avg_sq"] = torch.zeros_like(g)
        state["step"] += 1
        g2 = g * g + eps1
        if factored:
            r, c = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            r.mul_(beta2).add_(g2.mean(dim=-1), alpha=1 - beta2)
            c.mul_(beta2).add_(g2.mean(dim=-2), alpha=1 - beta2)
            u = g * _factored_rsqrt(r, c)
        else:
            v = state["exp_avg_sq"]
            v.mul_(beta2).add_(g2, alpha=1 - beta2)
            u = g * v.rsqrt()
        u.div_(max(1.0, (u.norm() / u.numel() ** 0.5).item() / group["d"]))
        m = state["exp_avg"]
        m.mul_(beta1).add_(u, alpha=1 - beta1)
        if factored:
            res = (u - m).square_().add_(eps2)
            rr, cc = state["exp_avg_res_row"], state["exp_avg_res_col"]
            rr.mul_(beta3).add_(res.mean(dim=-1), alpha=1 - beta3)
            cc.mul_(beta3).add_(res.mean(dim=-2), alpha=1 - beta3)
            update = m * _factored_rsqrt(rr, cc)
        else:
            update = m.clone()
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-group["lr"])
        # END SOLUTION


def _factored_rsqrt(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """1/√(r c / mean(r)) as a (..., m, n) tensor from r (..., m) and c (..., n): the inverse
    square root of the rank-one matrix rebuilt from a row and a column factor."""
    # BEGIN SOLUTION 2.8: the (..., m, n) inverse square root of the matrix rebuilt from the row and column factors
    r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)  # (..., m, 1)
    return r * col.rsqrt().unsqueeze(-2)  # (..., m, n)
    # END SOLUTION

