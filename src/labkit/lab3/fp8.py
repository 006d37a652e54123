"""fp8 linear layer with per-tensor scaling (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", arXiv 2209.05433). Lab 3, exercise 3.3; chapter 3 (book/03_parameters.md).

Conventions used throughout (those of ``torch._scaled_mm``): a tensor ``x`` is stored as
``q = x / scale`` in fp8 together with a float32 scalar ``scale`` (the *dequantisation* scale),
so that ``x ≈ q.float() * scale``. Activations and weights use E4M3 (max 448), gradients E5M2
(max 57344). ``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`` multiplies an fp8
row-major ``a`` (M×K) by an fp8 column-major ``b`` (K×N: strides (1, K)), all sizes multiples
of 16, and returns ``scale_a * scale_b * (a @ b)`` in ``out_dtype``; it has no autograd, hence
the ``autograd.Function`` below. The layout rule binds on a GPU ("mat2 must be col_major"; the
meta kernel enforces it too) but not on the CPU, so a CPU run does not tell you: the graders check
every call's strides. The CUDA kernel needs compute capability 8.9 or more (L4, H100); on a T4 or
an A100 the lab runs the fp8 math on CPU copies.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from labkit.validate import non_negative_int, positive_int

__all__ = ["FP8_FORMATS", "amax_scale", "quantize", "DelayedScaling", "Fp8Matmul", "Fp8Linear"]

FP8_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.float32, torch.bfloat16)


# ==== given: the course's code — read it, call it, don't change it ====
def _check_format(fmt, name="fmt"):
    if fmt not in FP8_FORMATS:
        raise ValueError(f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {fmt!r}")


# ==== exercise 3.3: your code ====
def amax_scale(amax, fmt=torch.float8_e4m3fn, margin: int = 0) -> torch.Tensor:
    """The per-tensor dequantisation scale for a tensor whose largest magnitude is ``amax``.

    Returns a 0-d float32 tensor ``scale`` such that ``amax / scale`` is ``2**-margin`` times the
    largest finite value of ``fmt`` (the tensor's largest element lands on the top of the format,
    ``margin`` binades below it). An ``amax`` of 0 gives scale 1.0 (nothing to scale).

    Raises ValueError for a non-fp8 ``fmt``, a negative or non-integer ``margin``, or a negative
    or non-finite ``amax``.
    """
    _check_format(fmt)
    non_negative_int("margin", margin)
    amax = torch.as_tensor(amax, dtype=torch.float32).detach()
    if amax.numel() != 1 or not torch.isfinite(amax).all() or (amax < 0).any():
        raise ValueError(f"amax must be one finite number >= 0, got {amax.tolist()!r}")
    amax = amax.reshape(())
    raise NotImplementedError("exercise 3.3: the scale that maps amax onto the format's largest value (margin binades below); 1.0 when amax is 0 (labs/03_parameters.ipynb)")


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt=torch.float8_e4m3fn) -> torch.Tensor:
    """``x / scale`` rounded to the fp8 format ``fmt``, **saturating**: every value beyond the
    format's largest finite value ``M`` (including ±inf) becomes ±M, on every device (on CPU
    torch's cast saturates E4M3 but turns large values into inf in E5M2; CUDA differs).

    Returns a tensor of dtype ``fmt`` and x's shape. Raises ValueError for a non-fp8 ``fmt`` or a
    scale that is not one positive finite number.
    """
    _check_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    scale = torch.as_tensor(scale, dtype=torch.float32)
    if scale.numel() != 1 or not torch.isfinite(scale).all() or (scale <= 0).any():
        raise ValueError(f"scale must be one positive finite number, got {scale.tolist()!r}")
    raise NotImplementedError("exercise 3.3: divide by the scale in fp32, saturate at the format's largest finite value, cast (labs/03_parameters.ipynb)")


class DelayedScaling:
    """Delayed scaling: the scale for this step comes from the amaxes of *previous* steps.

    Keeps the amaxes of the last ``history_len`` tensors it scaled. ``scale_for(x)`` returns the
    scale to quantise ``x`` with, ``amax_scale(max(history), fmt, margin)``, and only then records
    ``x``'s own amax (``x.abs().max()``) in the history, dropping the oldest beyond
    ``history_len``. With an empty history (the first call) it uses ``x``'s own amax (current
    scaling once). ``history`` is the list of recorded amaxes (Python floats, oldest first).
    """

    def __init__(self, history_len: int = 16, fmt=torch.float8_e4m3fn, margin: int = 0):
        positive_int("history_len", history_len)
        _check_format(fmt)
        non_negative_int("margin", margin)
        self.history_len, self.fmt, self.margin = history_len, fmt, margin
        self.history: list[float] = []

    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        """The scale to quantise ``x`` with now (see the class); records x's amax afterwards."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        raise NotImplementedError("exercise 3.3: scale from the history's max (x's own amax if the history is empty), then record x's amax, keep the last history_len (labs/03_parameters.ipynb)")


# ==== given: the course's code — read it, call it, don't change it ====
def _current(x: torch.Tensor, fmt) -> torch.Tensor:
    """Current scaling: the scale from x's own amax, on x's device. A tensor holding inf or NaN
    has no finite scale: ValueError saying so (not amax_scale's "amax must be ... finite")."""
    amax = x.detach().abs().max().float() if x.numel() else 0.0
    try:
        return amax_scale(amax, fmt).to(x.device)
    except ValueError:
        if not x.numel() or torch.isfinite(amax):  # checked only here: no extra device sync
            raise
        raise ValueError(f"a tensor to quantise to {fmt} (the input x, the weight or the output "
                         f"gradient) holds inf or NaN (its amax is {amax.item()}): current scaling "
                         "has no finite scale for it (a diverged step? a loss scaler skips those)") from None


# ==== exercise 3.3: your code ====
class Fp8Matmul(torch.autograd.Function):
    """``y = x @ weight.T`` with x and weight in E4M3 and the gradients in E5M2.

    ``Fp8Matmul.apply(x, weight, scalers)``: x is (M, K) float32 or bfloat16, weight (N, K), M, K
    and N multiples of 16; ``scalers`` is None (current scaling: each scale from the tensor's own
    amax via ``amax_scale``) or a dict with DelayedScaling objects under "x", "weight" and "grad".

    Forward: quantise x and weight (E4M3) and return ``torch._scaled_mm`` of them, in x's dtype.
    It saves for backward only the two fp8 tensors and their two float32 scales.
    Backward: quantise grad_out to E5M2 (its own scale) and compute grad_x = grad_out @ weight and
    grad_weight = grad_out.T @ x, each one ``torch._scaled_mm`` of fp8 operands, in x's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, scalers=None):
        raise NotImplementedError("exercise 3.3: scale and quantise x and weight to E4M3, one _scaled_mm (weight column-major), save the fp8 tensors and scales (labs/03_parameters.ipynb)")

    @staticmethod
    def backward(ctx, grad_out):
        raise NotImplementedError("exercise 3.3: quantise grad_out to E5M2; grad_x and grad_weight as _scaled_mm of fp8 operands (row-major first, column-major second) (labs/03_parameters.ipynb)")


# ==== given: the course's code — read it, call it, don't change it ====
class Fp8Linear(nn.Module):
    """A linear layer whose matmul runs in fp8 (``Fp8Matmul``); the weight (the master copy) and
    the bias stay in float32. ``forward(x)``: x of shape (..., in_features), float32 or bfloat16,
    with the product of the leading dimensions a multiple of 16; returns
    ``Fp8Matmul(x2d, weight) + bias`` reshaped to (..., out_features), in x's dtype.

    Args: in_features, out_features (multiples of 16, else ValueError); bias; scaling "current"
    or "delayed" (else ValueError); history_len for delayed scaling.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 scaling: str = "current", history_len: int = 16):
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v % 16:
                raise ValueError(f"{name} must be a positive multiple of 16 (torch._scaled_mm), got {v!r}")
        if scaling not in ("current", "delayed"):
            raise ValueError(f"scaling must be 'current' or 'delayed', got {scaling!r}")
        ref = nn.Linear(in_features, out_features, bias=bias)
        self.weight, self.bias = ref.weight, ref.bias
        self.in_features, self.out_features, self.scaling = in_features, out_features, scaling
        self.scalers = None if scaling == "current" else {
            "x": DelayedScaling(history_len, torch.float8_e4m3fn),
            "weight": DelayedScaling(history_len, torch.float8_e4m3fn),
            "grad": DelayedScaling(history_len, torch.float8_e5m2)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dtype not in OUT_DTYPES:
            raise ValueError(f"x must be a float32 or bfloat16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() < 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have shape (..., {self.in_features}), got {tuple(x.shape)}")
        rows = math.prod(x.shape[:-1])
        if rows % 16:
            raise ValueError(f"x's leading dimensions must multiply to a multiple of 16 (torch._scaled_mm), got {rows}")
        out = Fp8Matmul.apply(x.reshape(rows, self.in_features), self.weight, self.scalers)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)
