"""Mixed-precision Adam (Micikevicius et al. 2018, arXiv 1710.03740): 16-bit parameters and
gradients for forward and backward, an fp32 master copy and fp32 moments for the update.

An Adam update is about lr per element, far smaller than most weights; added to a 16-bit weight
it often rounds away (bf16 keeps 8 significant bits: any change below 1/256 of the weight is
lost). The optimizer therefore keeps, per parameter, an fp32 master copy and updates *that*;
the 16-bit parameter is the master rounded after every step. Bytes per parameter:
2 (16-bit parameter) + 2 (16-bit gradient) + 4 + 4 + 4 (fp32 master, m, v) = 16, the same as
fp32 Adam's 4 + 4 + 8: mixed precision halves activations and speeds up the math, it does not
shrink the static state.

Speed: the update runs over all the parameters of a param group at once — foreach operations
(``torch._foreach_lerp_``, ``_foreach_addcmul_``, ``_foreach_addcdiv_``…, as ``torch.optim.Adam``
runs by default) or, as here, the one fused kernel ``torch.optim.Adam(fused=True)`` calls — not a
Python loop of small kernels per parameter. Lab 3, exercise 3.2; chapter 3 (book/03_parameters.md).
"""
from __future__ import annotations

import torch

from labkit.optim_base import Optimizer, run_closure
from labkit.validate import adam_args, params as check_params

__all__ = ["MixedPrecisionAdam"]

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


# ==== exercise 3.2: your code ====
class MixedPrecisionAdam(Optimizer):
    """Adam for 16-bit parameters with fp32 master weights and fp32 moments.

    ``self.state[p]`` holds, after the first step of p, exactly three float32 tensors of p's
    shape: ``"master"`` (the fp32 copy of p the updates go into), ``"exp_avg"`` and
    ``"exp_avg_sq"`` (Adam's moments), and the Python int ``"step"`` (p's own count of steps:
    a parameter without a gradient is skipped and its count does not advance, as in torch's
    Adam). So the state is 12 bytes per parameter. ``load_state_dict`` (given,
    ``labkit.optim_base``) keeps the three tensors fp32: torch's loader would cast them to the
    parameter's 16-bit dtype.

    Args:
        params: parameters of dtype float16 or bfloat16 (anything else → ValueError), or param
            groups (dicts with "params" and optionally "lr", "betas", "eps"), as torch's
            optimizers take them.
        lr, betas, eps: as ``torch.optim.Adam`` (no weight decay); the defaults of every group.
    """

    # ==== given: the course's code — read it, call it, don't change it ====
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        adam_args(lr=lr, betas=betas, eps=eps)
        super().__init__(check_params("params", params),
                         dict(lr=float(lr), betas=tuple(betas), eps=float(eps)))

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, refusing what this optimizer cannot update."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        adam_args(lr=group["lr"], betas=group["betas"], eps=group["eps"])
        bad = sorted({str(p.dtype) for p in group["params"] if p.dtype not in SIXTEEN_BIT})
        if bad:
            raise ValueError(f"params must be float16 or bfloat16 parameters, got dtypes {bad}")

    # ==== exercise 3.2: your code ====
    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step for every parameter with a gradient, exactly ``torch.optim.Adam``'s
        update (bias-corrected, with each group's lr, betas and eps) applied to the fp32 master
        with the gradient cast to fp32; then the 16-bit parameter becomes the master rounded to
        its dtype. ``closure`` (optional) re-evaluates the model and returns the loss, as for
        torch's optimizers: it is called first, with gradients enabled, and its loss returned."""
        loss = run_closure(closure)
        self.check_dense_grads()  # given: refuses a sparse gradient (labkit.optim_base)
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            raise NotImplementedError("exercise 3.2: create the fp32 state on the first step; Adam on the master with the fp32 gradient; round the master into p (labs/03_parameters.ipynb)")
        return loss
