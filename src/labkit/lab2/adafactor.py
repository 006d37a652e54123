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

# ==== given: the course's code — read it, call it, don't change it ====


class Adafactor(torch.optim.Optimizer):
    """Adafactor with a factored second moment for ≥2-D weights and a full one for vectors.

    State of a parameter (the same keys and shapes as ``torch.optim.Adafactor``):

    * ``"step"``: a float32 scalar tensor, the number of steps taken;
    * ``"row_var"`` of shape ``(..., m, 1)`` and ``"col_var"`` of shape ``(..., 1, n)`` for a
      weight of shape ``(..., m, n)``: running means of G² over its last and its
      second-to-last dimension;
    * ``"variance"``, the shape of the parameter, for a 1-D parameter.

    State bytes: 4·(m + n) + 4 for an m×n fp32 weight, 4·n + 4 for a vector of n.

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

    def __init__(self, params, lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0):
        params = validate.params("params", params)
        validate.non_negative_number("lr", lr)
        validate.number("beta2_decay", beta2_decay, high=0)
        if not (isinstance(eps, (tuple, list)) and len(eps) == 2):
            raise ValueError(f"eps must be a pair (eps1 >= 0 or None, eps2 >= 0), got {eps!r}")
        if eps[0] is not None:
            validate.non_negative_number("eps[0] (ε₁)", eps[0])
        validate.non_negative_number("eps[1] (ε₂)", eps[1])
        validate.number("d (the clipping threshold)", d, low=1)
        validate.non_negative_number("weight_decay", weight_decay)
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """Take one Adafactor step for every parameter that has a gradient.

        Contract: after each call, every parameter with a gradient and its state equal what
        ``torch.optim.Adafactor`` (same options) gives, to rounding: the same relative step
        (capped by ``lr``, scaled by the parameter's RMS but never below ε₂), the same decoupled
        weight decay, the same β̂₂ schedule for the running means of G², the same variance
        estimate rebuilt from the row and column factors (≥2-D) or kept whole (1-D), and the
        same update clipping at ``d``. The state holds only the factors (or the vector's
        variance) and the step counter; the full estimate V̂ is a temporary. The lab and the
        chapter derive each piece.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:  # an empty tensor has nothing to update
                    continue  # (torch.optim.Adafactor divides by its numel and raises)
                self._update(p, p.grad, self.state[p], group)
        return loss

    # ==== exercise 2.1: your code ====

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        """One Adafactor step of parameter ``p`` (see ``step``); creates its state on first use."""
        raise NotImplementedError("exercise 2.1: create this parameter's state on first use (the class docstring lists it), then take one step that meets the contract of step() (labs/02_optimizer_states.ipynb)")


# ==== given: the course's code — read it, call it, don't change it ====


def factored_state_bytes(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
    """Bytes of Adafactor's state for one parameter of ``shape``, by the formula.

    ≥2-D (..., m, n): (prod(...)·(m + n)) elements; 1-D (n,): n elements; plus a 4-byte float32
    step counter. Compare Adam's 2·numel elements.
    """
    if (not isinstance(shape, (tuple, list, torch.Size)) or len(shape) < 1
            or any(not validate.is_int(s) or s < 1 for s in shape)):
        raise ValueError(f"shape must be a non-empty tuple of positive ints, got {shape!r}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
    item = torch.empty((), dtype=dtype).element_size()
    if len(shape) == 1:
        return item * shape[0] + 4
    lead = 1
    for s in shape[:-2]:
        lead *= s
    return item * lead * (shape[-2] + shape[-1]) + 4
