"""Block-wise 8-bit quantization: store a float tensor as one byte per element plus a scale per block.

An 8-bit optimizer (Dettmers et al. 2021, arXiv 2110.02861) keeps Adam's moments as 8-bit
codes instead of fp32 numbers: 1 byte instead of 4 per element and per moment. The mechanism:

* cut the flattened tensor into blocks of ``block_size`` elements (the last one may be short);
* per block, store its absolute maximum (``absmax``, fp32) and divide the block by it, so every
  value lands in [−1, 1];
* replace each normalized value by the index (0..255) of the nearest entry of a 256-entry
  **code**, a sorted table of numbers in [−1, 1] (or [0, 1] for non-negative data).

Dequantizing is a table look-up times the block's absmax. Bytes: ``numel + 4·ceil(numel/B)``.
Small blocks isolate outliers (one large value only coarsens its own block), at the price of
more scales. The code decides where precision goes: a **linear** code spaces its 256 values
evenly (error ≤ absmax/255 everywhere, but small values all round to 0); the **dynamic** code
(Dettmers 2015, arXiv 1511.04561) spends its bits like a float, with an exponent and a
fraction, so it resolves values from 1 down to a few 10⁻⁷ of the block's absmax, which is
what Adam's second moment (squared gradients over many orders of magnitude) needs.

``dynamic_code`` reproduces ``bitsandbytes.functional.create_dynamic_map`` entry for entry.

Chapter 2 (book/02_optimizer_states.md); Lab 2, exercise 2.2 (labs/02_optimizer_states.ipynb).
"""
from __future__ import annotations

import math

import torch

from labkit import validate

# ==== given: the course's code — read it, call it, don't change it ====

CODE_SIZE = 256
"""Entries of an 8-bit code."""


def linear_code(signed: bool = True) -> torch.Tensor:
    """256 evenly spaced values: in [−1, 1] if ``signed``, else in [0, 1]. Sorted, float32."""
    validate.boolean("signed", signed)
    return torch.linspace(-1.0 if signed else 0.0, 1.0, CODE_SIZE, dtype=torch.float32)


def dynamic_code(signed: bool = True) -> torch.Tensor:
    """The dynamic (tree) code of 8-bit optimizers: 256 sorted float32 values in [−1, 1] or [0, 1].

    A value is sign · 10^(−e) · f: for the exponent e = 6, 5, ..., 0 there are 2^(6−e) fraction
    values (2^(7−e) when unsigned: no sign bit), the midpoints of an even grid of [0.1, 1];
    plus 0 and 1. So the code is fine near 0 and coarse near 1, like a float, and its smallest
    non-zero magnitude is 5.5·10⁻⁷ (3.25·10⁻⁷ unsigned). Equal to
    ``bitsandbytes.functional.create_dynamic_map``.
    """
    validate.boolean("signed", signed)
    values = []
    exponent_bits = 7
    for i in range(exponent_bits):
        n_fraction = 2 ** i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, n_fraction + 1, dtype=torch.float32)
        means = ((edges[:-1] + edges[1:]) / 2.0 * 10.0 ** (i - exponent_bits + 1)).tolist()
        values += means + ([-v for v in means] if signed else [])
    values += [0.0, 1.0]
    if len(values) != CODE_SIZE:  # pragma: no cover - the construction above gives 256
        raise AssertionError(f"dynamic code has {len(values)} entries")
    return torch.tensor(sorted(values), dtype=torch.float32)


def _check_args(code: torch.Tensor, block_size: int) -> None:
    validate.positive_int("block_size", block_size)
    if not (isinstance(code, torch.Tensor) and code.shape == (CODE_SIZE,)
            and code.dtype == torch.float32):
        got = (f"{tuple(code.shape)} {code.dtype}" if isinstance(code, torch.Tensor)
               else type(code).__name__)
        raise ValueError(f"code must be a float32 tensor of shape ({CODE_SIZE},) "
                         f"(e.g. linear_code() or dynamic_code()), got {got}")


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks of ``block_size`` that cover ``numel`` elements: ceil(numel / block_size)."""
    numel = validate.non_negative_int("numel", numel)
    block_size = validate.positive_int("block_size", block_size)
    return -(-numel // block_size)


# ==== exercise 2.2: your code ====


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor,
                       block_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to 8-bit codes with one absmax scale per block of ``block_size`` elements.

    Blocks run over ``x.flatten()``; the last block may be shorter. A block whose absmax is 0
    (all zeros) is stored with absmax 0 and every value as the index of the code's 0.

    Args:
        x: a floating-point tensor of any shape.
        code: a sorted float32 tensor of 256 values (``linear_code()``, ``dynamic_code()``).
        block_size: elements per block, B.

    Returns:
        ``(codes, absmax)``: ``codes`` is uint8 of ``x``'s shape, the index of the code entry
        nearest to x / absmax of its block; ``absmax`` is float32 of shape
        (ceil(numel / B),), the largest |x| of each block. Both live on ``x``'s device.

    Devices: ``x`` may be on any device (the GPU, in an optimizer); ``code`` usually lives on
    the CPU (``linear_code()`` and ``dynamic_code()`` build it there). Every operation that
    mixes the two must first bring the code (or what is computed from it) to ``x``'s device:
    on a GPU, an op with one operand on each device raises.
    """
    _check_args(code, block_size)
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        raise ValueError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    raise NotImplementedError("exercise 2.2: pad x.flatten() to whole blocks, take each block's absmax, and pick the nearest code entry for x / absmax (labs/02_optimizer_states.ipynb)")


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                         block_size: int = 256) -> torch.Tensor:
    """Undo ``quantize_blockwise``: ``code[codes] · absmax`` of each element's block, float32.

    Args:
        codes: uint8 tensor of any shape (the shape of the result).
        absmax: float32 (ceil(numel / B),), one scale per block.
        code: the 256-entry code used to quantize (on any device: usually the CPU).
        block_size: elements per block, B.

    Returns a float32 tensor of ``codes``' shape on ``codes``' device (``absmax`` lives there
    too); a look-up into a CPU ``code`` with GPU indices raises on a GPU, so bring the code to
    ``codes``' device first.
    """
    _check_args(code, block_size)
    if not (isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8):
        raise ValueError(f"codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes))}")
    validate.tensor("absmax", absmax)
    if absmax.device != codes.device:
        raise ValueError(f"absmax must be on codes' device ({codes.device}), got {absmax.device}")
    if absmax.shape != (num_blocks(codes.numel(), block_size),):
        raise ValueError(f"absmax must have shape ({num_blocks(codes.numel(), block_size)},) "
                         f"for {codes.numel()} codes in blocks of {block_size}, "
                         f"got {tuple(absmax.shape)}")
    raise NotImplementedError("exercise 2.2: look up code[codes] and multiply every element by its block's absmax (labs/02_optimizer_states.ipynb)")


# ==== given: the course's code — read it, call it, don't change it ====


def quantized_bytes(numel: int, block_size: int = 256) -> int:
    """Bytes of a block-wise 8-bit tensor of ``numel`` elements: numel + 4·ceil(numel / B)."""
    numel = validate.non_negative_int("numel", numel)
    return numel + 4 * num_blocks(numel, block_size)
