"""Mixed-precision Adam (Micikevicius et al. 2018, arXiv 1710.03740): 16-bit parameters and
gradients for forward and backward, an fp32 master copy and fp32 moments for the update.

An Adam update is about lr per element, far smaller than most weights; added to a 16-bit weight
it often rounds away (bf16 keeps 8 significant bits: any change below 1/256 of the weight is
lost). The optimizer therefore keeps, per parameter, an fp32 master copy and updates *that*;
the 16-bit parameter is the master rounded after every step. Bytes per parameter:
2 (16-bit parameter) + 2 (16-bit gradient) + 4 + 4 + 4 (fp32 master, m, v) = 16, the same as
fp32 Adam's 4 + 4 + 8: mixed precision halves activations and speeds up the math, it does not
shrink the static state. Lab 3, exercise 3.2; chapter 3 (book/03_parameters.md).
"""
from __future__ import annotations

import math

import torch

__all__ = ["MixedPrecisionAdam"]

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


class MixedPrecisionAdam(torch.optim.Optimizer):
    """Adam for 16-bit parameters with fp32 master weights and fp32 moments.

    ``self.state[p]`` holds, after the first step of p, exactly three float32 tensors of p's
    shape: ``"master"`` (the fp32 copy of p the updates go into), ``"exp_avg"`` and
    ``"exp_avg_sq"`` (Adam's moments), and the Python int ``"step"``. So the state is 12 bytes
    per parameter.

    Args:
        params: parameters of dtype float16 or bfloat16 (anything else → ValueError).
        lr, betas, eps: as ``torch.optim.Adam`` (no weight decay).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        params = list(params)
        bad = sorted({str(p.dtype) for p in params if p.dtype not in SIXTEEN_BIT})
        if not params or bad:
            raise ValueError(f"params must be float16 or bfloat16 parameters, got dtypes {bad or 'none'}")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"betas must be a pair of numbers in [0, 1), got {betas!r}")
        super().__init__(params, dict(lr=float(lr), betas=tuple(betas), eps=float(eps)))

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step for every parameter with a gradient, exactly ``torch.optim.Adam``'s
        update (bias-corrected) applied to the fp32 master with the gradient cast to fp32; then
        the 16-bit parameter becomes the master rounded to its dtype."""
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                raise NotImplementedError("exercise 3.2: create the fp32 state on the first step; Adam on the master with the fp32 gradient; round the master into p (labs/03_parameters.ipynb)")
        return None
