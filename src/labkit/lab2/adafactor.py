"""Adafactor: Adam's second moment stored as a row and a column, O(m+n) instead of O(mn).

Adam keeps, for every weight, a running mean of its squared gradient: an m×n weight costs
m·n floats of second moment. Adafactor (Shazeer & Stern 2018, arXiv 1804.04235) keeps only
its row means R (m×1) and column means C (1×n) and rebuilds the whole matrix as their
rank-one product, V̂ = R·C / mean(R). It keeps no first moment either, so an m×n weight
costs 4·(m+n) bytes of state instead of Adam's 8·m·n (plus a 4-byte step counter); vectors
(biases, LayerNorm weights) keep their full second moment, 4·n bytes.

This module follows ``torch.optim.Adafactor`` (torch 2.13, ``torch/optim/_adafactor.py``) step
for step, which differs from the paper in three places: ``lr`` caps the relative step
ρ_t = min(lr, 1/√t) and scales the decoupled weight decay; ε₁ (default: the dtype's machine
epsilon) clamps the denominators instead of being added to G²; the factors hold means, not sums.

Chapter 2 (book/02_optimizer_states.md); Lab 2, exercise 2.1 (labs/02_optimizer_states.ipynb).
"""
from __future__ import annotations

import torch

from labkit import validate
from labkit.optim_base import PerParameterOptimizer
from labkit.optimizer_states import factored_state_bytes  # noqa: F401  (the formula, for the lab)

# ==== given: the course's code — read it, call it, don't change it ====


class Adafactor(PerParameterOptimizer):
    """Adafactor with a factored second moment for ≥2-D weights and a full one for vectors.

    ``step(closure=None)`` (given, ``labkit.optim_base``) calls ``_update`` for every parameter
    that has a gradient (a parameter without one keeps its state and its step count), as
    ``torch.optim.Adafactor`` does; an empty parameter is left alone. State of a parameter (the
    same keys and shapes as ``torch.optim.Adafactor``):

    * ``"step"``: a float32 scalar tensor, the number of steps this parameter has taken;
    * ``"row_var"`` of shape ``(..., m, 1)`` and ``"col_var"`` of shape ``(..., 1, n)`` for a
      weight of shape ``(..., m, n)``: running means of G² over its last and its
      second-to-last dimension;
    * ``"variance"``, the shape of the parameter, for a 1-D parameter.

    The state lives in the parameter's dtype (as torch's). State bytes: 4·(m + n) + 4 for an
    m×n fp32 weight, 4·n + 4 for a vector of n (``factored_state_bytes``).

    Args:
        params: the parameters, or parameter groups (dicts with "params" and any of the
            options below), as for ``torch.optim``; each group's options apply to its parameters.
        lr: the largest relative step ρ_t; also the weight-decay coefficient's scale.
        beta2_decay: τ ≤ 0; the second moment's decay is β̂₂,t = 1 − t^τ.
        eps: (ε₁, ε₂): ε₁ clamps the variance estimate (None: the dtype's machine epsilon);
            ε₂ is the smallest parameter RMS that scales the step.
        d: update clipping threshold (≥ 1): the update is divided by max(1, RMS(U)/d).
        weight_decay: decoupled weight decay λ: θ ← θ·(1 − lr·λ) before the update.
    """

    skip_empty = True  # torch.optim.Adafactor divides by an empty tensor's numel and raises

    def __init__(self, params, lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0):
        validate.adafactor_args(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d,
                                weight_decay=weight_decay)
        super().__init__(validate.params("params", params),
                         dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d,
                              weight_decay=weight_decay))

    # ==== exercise 2.1: your code ====

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        """One Adafactor step of parameter ``p`` with its gradient ``grad``; creates its state on
        first use.

        Contract: afterwards ``p`` and its state equal what ``torch.optim.Adafactor`` (the
        group's options) gives, to rounding: the same relative step (capped by ``lr``, scaled by
        the parameter's RMS but never below ε₂, so that a parameter that starts at zero moves),
        the same decoupled weight decay, the same β̂₂ schedule for the running means of G² (t is
        this parameter's own step count), the same variance estimate rebuilt from the row and
        column factors (≥2-D) or kept whole (1-D), and the same update clipping at ``d``. The
        state holds only the factors (or the vector's variance) and the step counter; the full
        estimate V̂ is a temporary. The lab and the chapter derive each piece.
        """
        raise NotImplementedError("exercise 2.1: create this parameter's state on first use (the class docstring lists it), then take one step that meets the contract of step() (labs/02_optimizer_states.ipynb)")

