"""Dynamic loss scaling: keep small fp16 gradients from underflowing to zero.

fp16 has 5 exponent bits: its smallest subnormal is 2⁻²⁴ ≈ 6·10⁻⁸, and many activation
gradients of a real network are smaller than that, so in a 16-bit backward pass they become 0.
Micikevicius et al. (2018, arXiv 1710.03740) multiply the loss by a scale S before backward:
every gradient is then S times larger (the chain rule is linear) and lands inside fp16's range.
Before the optimizer step the gradients are divided by S again ("unscaled").

A fixed S either still underflows or overflows to inf. *Dynamic* scaling adapts it:

- if any unscaled gradient is inf or NaN, the step is skipped and S is multiplied by
  ``backoff_factor`` (0.5);
- after ``growth_interval`` consecutive good steps S is multiplied by ``growth_factor`` (2).

This is what ``torch.amp.GradScaler`` does (its defaults: ``init_scale`` 2¹⁶, ``growth_factor`` 2,
``backoff_factor`` 0.5, ``growth_interval`` 2000); Lab 3, exercise 3.1, rebuilds it and grades it step
for step against ``torch.amp.GradScaler("cpu")``. bf16 has fp32's 8 exponent bits, so it needs
no scaler.

Speed: unscale every gradient with one foreach call per device and dtype, and read the
"any inf or NaN?" flag back once per step. A Python ``bool(torch.isfinite(g).all())`` per gradient
makes the host wait for the device once per gradient (a device→host sync: the GPU's queue drains
and the next kernel launches late), 52 times a step for a small GPT. Chapter 3 (book/03_parameters.md); labs/03_parameters.ipynb.
"""
from __future__ import annotations

import torch

from labkit.validate import number, positive_int

__all__ = ["DynamicLossScaler"]


# ==== given: the course's code — read it, call it, don't change it ====
def _check_optimizer(optimizer) -> None:
    """``optimizer`` must be a ``torch.optim.Optimizer`` (its ``param_groups`` hold the gradients
    to unscale); else a TypeError naming it, not an AttributeError from inside."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (the one that steps the "
                        f"scaled model), got {type(optimizer).__name__}")


# ==== exercise 3.1: your code ====
class DynamicLossScaler:
    """A dynamic loss scaler with the contract of ``torch.amp.GradScaler`` for one optimizer.

    The scale is held as a float32 scalar tensor (as GradScaler holds it). Per iteration::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)      # optional: step() does it when you did not
        scaler.step(optimizer)          # skipped when a gradient is inf or NaN
        scaler.update()

    Args:
        init_scale: the first scale (finite, > 0).
        growth_factor: multiplies the scale after ``growth_interval`` good steps in a row (> 1).
        backoff_factor: multiplies the scale after a step with a non-finite gradient (in (0, 1)).
        growth_interval: good steps in a row before growing (int ≥ 1).
    """

    # ==== given: the course's code — read it, call it, don't change it ====
    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        init_scale = number("init_scale", init_scale, low=0, low_open=True)
        self.growth_factor = number("growth_factor", growth_factor, low=1, low_open=True)
        self.backoff_factor = number("backoff_factor", backoff_factor, low=0, high=1,
                                     low_open=True, high_open=True)
        self.growth_interval = positive_int("growth_interval", growth_interval)
        self._scale = torch.tensor(init_scale, dtype=torch.float32)  # () float32, like GradScaler
        self._growth_tracker = 0  # good steps in a row since the last change of scale
        self._found_inf: bool | None = None  # None: this iteration's gradients are not unscaled yet

    def get_scale(self) -> float:
        """The current scale, as a Python float."""
        return float(self._scale)

    # ==== exercise 3.1: your code ====
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss`` multiplied by the current float32 scale tensor (a new tensor in the graph,
        on ``loss``'s device), exactly as ``GradScaler.scale`` does; the dtype is what torch's type
        promotion gives: a float32 loss stays float32, a 0-dim fp16 loss comes back float32 (both
        operands are 0-dim), so a scale of 2¹⁶ never overflows fp16's 65504."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        raise NotImplementedError("exercise 3.1: multiply the loss by the scale (as a tensor on the loss' device) (labs/03_parameters.ipynb)")

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide every gradient of ``optimizer``'s parameters (all its param groups; any dtype)
        by the scale, in place — every one of them, also when one holds an inf.

        Multiply by the float32 reciprocal of the scale (computed in float64, then rounded to
        float32, as GradScaler does), so the result is bit-identical to GradScaler's. Remember
        whether any gradient, after unscaling, holds an inf or a NaN, and return that flag.
        Calling it twice in one iteration is an error (RuntimeError): the gradients would be
        divided twice. An ``optimizer`` that is no ``torch.optim.Optimizer`` (a model, say):
        TypeError (given).
        """
        _check_optimizer(optimizer)
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last update()")
        raise NotImplementedError("exercise 3.1: unscale every gradient in place by the float32 reciprocal; record whether any is inf or NaN (labs/03_parameters.ipynb)")

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (unless ``unscale_`` was called this iteration), then call
        ``optimizer.step()`` only if no gradient is inf or NaN. Return True if it stepped."""
        _check_optimizer(optimizer)
        raise NotImplementedError("exercise 3.1: unscale if not done yet; step the optimizer unless a gradient was non-finite (labs/03_parameters.ipynb)")

    def update(self) -> None:
        """Adjust the scale after the iteration's ``step``, as ``torch._amp_update_scale_``:

        - a non-finite gradient was found: scale × backoff_factor, and the count of good
          steps in a row restarts at 0;
        - otherwise one more good step; when the count reaches ``growth_interval``, scale ×
          growth_factor (kept only if the product is finite) and the count restarts at 0.

        Each product is the float32 scale times the factor computed in float64, then rounded to
        float32 (GradScaler's C++ does so), so any factor (1.1, 0.77…) matches it bit for bit.

        The scale stays a float32 tensor. Afterwards the next iteration starts (not unscaled).
        """
        if self._found_inf is None:
            raise RuntimeError("update() needs step() (or unscale_()) first in this iteration")
        raise NotImplementedError("exercise 3.1: back off on a non-finite step, else count the good step and grow every growth_interval; reset for the next iteration (labs/03_parameters.ipynb)")
