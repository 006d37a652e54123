"""8-bit Adam: both moments stored as block-wise 8-bit codes, about 2 bytes a parameter.

fp32 Adam keeps 8 bytes of state per parameter (m and v, 4 bytes each). 8-bit Adam
(Dettmers et al. 2021, arXiv 2110.02861) keeps each moment as one byte per element plus one
fp32 scale per block of B elements (``labkit.lab2.quantize8bit``): 2·Ψ + 8·Σ ceil(n/B) bytes,
a quarter of fp32 Adam's. Every step dequantizes the moments of one parameter to fp32,
updates them and the parameter exactly as Adam does, and quantizes them back; the fp32 copies
are temporaries that live only while that parameter is updated.

Which code: the signed dynamic code for m (it has a sign), the unsigned dynamic code for v
(never negative, so the sign bit buys one more bit of fraction) — as ``bitsandbytes.optim.Adam8bit``
does, with its blocks of 256. (bitsandbytes also keeps fp32 states for tensors under 4096
elements, ``min_8bit_size``; this one quantizes every tensor.)

Chapter 2 (book/02_optimizer_states.md); Lab 2, exercise 2.3 (labs/02_optimizer_states.ipynb).
"""
from __future__ import annotations

import math

import torch

from labkit import validate
from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code, quantize_blockwise
from labkit.optim_base import PerParameterOptimizer
from labkit.optimizer_states import adam8bit_state_bytes  # noqa: F401  (the formula, for the lab)

# ==== given: the course's code — read it, call it, don't change it ====


class Adam8bit(PerParameterOptimizer):
    """Adam whose two moments live as block-wise 8-bit codes with one fp32 absmax per block.

    ``step(closure=None)`` (given, ``labkit.optim_base``) calls ``_update`` for every parameter
    that has a gradient; a parameter without one is skipped and its step does not advance, as
    in ``torch.optim.Adam``. ``load_state_dict`` keeps the codes uint8 and the scales fp32
    (torch's loader would cast them to the parameter's dtype; bitsandbytes overrides it too).
    State of a parameter of n elements:

    * ``"step"``: an int, the steps this parameter has taken;
    * ``"exp_avg"``: uint8 codes of m (the parameter's shape), ``"exp_avg_absmax"``: float32
      (ceil(n/B),), in the signed dynamic code ``self.code_m``;
    * ``"exp_avg_sq"``, ``"exp_avg_sq_absmax"``: the same for v, in the unsigned dynamic code
      ``self.code_v``.

    Devices: every state tensor lives on the parameter's device; the two codes are built on
    the CPU and shared (``labkit.lab2.quantize8bit`` brings them where they are needed).

    State bytes: 2·n + 8·ceil(n/B) per parameter (the two 256-entry codes, 2 KiB, are shared).

    Args:
        params: the parameters, or parameter groups (dicts with "params" and any of the
            options below), as for ``torch.optim``; each group's options apply to its parameters.
        lr, betas, eps: as ``torch.optim.Adam``.
        block_size: elements per quantization block, B (bitsandbytes uses 256).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, block_size: int = 256):
        validate.adam_args(lr=lr, betas=betas, eps=eps)
        block_size = validate.positive_int("block_size", block_size)
        super().__init__(validate.params("params", params),
                         dict(lr=lr, betas=tuple(betas), eps=eps, block_size=block_size))
        self.code_m = dynamic_code(signed=True)  # (256,) for m, which has a sign
        self.code_v = dynamic_code(signed=False)  # (256,) for v >= 0

    # ==== exercise 2.3: your code ====

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        """One 8-bit Adam step of parameter ``p`` with its gradient ``grad``; creates its state on
        first use.

        Contract: ``p`` moves as ``torch.optim.Adam`` (the group's lr, betas, eps, bias
        correction) would move it from the moments that were stored, the only difference being
        the moments' rounding to 8 bits; afterwards ``state`` holds this step's m and v quantized
        block-wise (blocks of B, ``code_m`` for m, ``code_v`` for v, as
        ``labkit.lab2.quantize8bit`` does), the fp32 moments being temporaries of this
        parameter's update only, every state tensor on the parameter's device; and a v that is
        not zero is never stored as the code's 0 (it would leave ε alone under m). The bias
        corrections use this parameter's own step count (``state["step"]``).
        """
        # BEGIN SOLUTION 2.3: create the uint8 codes and absmax scales on first use; dequantize m and v, take one Adam step in fp32, quantize them back
        beta1, beta2 = group["betas"]
        lr, eps, block_size = group["lr"], group["eps"], group["block_size"]
        if len(state) == 0:
            blocks = math.ceil(p.numel() / block_size)
            state["step"] = 0
            for name in ("exp_avg", "exp_avg_sq"):
                state[name] = torch.zeros_like(p, dtype=torch.uint8)  # codes, p's shape
                state[name + "_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        m = dequantize_blockwise(state["exp_avg"], state["exp_avg_absmax"], self.code_m, block_size)
        v = dequantize_blockwise(state["exp_avg_sq"], state["exp_avg_sq_absmax"], self.code_v,
                                 block_size)
        g = grad.float()
        state["step"] += 1
        t = state["step"]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
        p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-lr / (1 - beta1 ** t))
        state["exp_avg"], state["exp_avg_absmax"] = quantize_blockwise(m, self.code_m, block_size)
        codes_v, state["exp_avg_sq_absmax"] = quantize_blockwise(v, self.code_v, block_size)
        # a non-zero v stored as 0 would leave only eps under m: round it up to the smallest entry
        state["exp_avg_sq"] = codes_v.masked_fill_((codes_v == 0) & (v > 0), 1)
        # END SOLUTION

