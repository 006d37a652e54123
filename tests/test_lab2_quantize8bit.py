"""Graders of Lab 2, exercise 2.2 (labkit.lab2.quantize8bit): block-wise 8-bit quantization against a
brute-force nearest-code search and ``bitsandbytes.functional`` (quantize_blockwise,
dequantize_blockwise, create_dynamic_map), and against CUDA's device rule (``StrictDevices``).

Tolerances: codes and scales are exact (integers, and the largest |x| of a block); distances to
the code agree to float32 rounding (1e-7), justified where used.
"""

from __future__ import annotations

import math

import pytest
import torch

from _given import as_given
from _lab2_helpers import (StrictDevices, brute_force_quantize, heavy_tailed)


@pytest.mark.exercise("2.2", points=1)
@pytest.mark.parametrize("kind", ["linear", "dynamic"])
def test_quantize_picks_the_nearest_code_per_block(kind):
    """Check codes and scales against a brute-force nearest-code search for blocks of 64, 256
    and 1000 (a size none of them divides), and that dequantize returns code[index] · absmax."""
    from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code, linear_code, quantize_blockwise
    dequantize_blockwise, quantize_blockwise = as_given(dequantize_blockwise), as_given(quantize_blockwise)

    code = linear_code() if kind == "linear" else dynamic_code()
    x = heavy_tailed(37, 29)  # 1073 elements: blocks never divide it
    for block_size in (64, 256, 1000):
        codes, absmax = quantize_blockwise(x, code, block_size)
        ref_index, ref_absmax = brute_force_quantize(x, code, block_size)
        where = f"{kind} code, block_size={block_size}"
        assert codes.dtype == torch.uint8 and codes.shape == x.shape, (
            f"{where}: codes are {codes.dtype} of shape {tuple(codes.shape)}, expected torch.uint8 "
            f"of x's shape {tuple(x.shape)}: one byte per element, in x's shape")
        assert absmax.dtype == torch.float32, f"{where}: absmax is {absmax.dtype}, expected torch.float32"
        n_blocks = math.ceil(x.numel() / block_size)
        assert absmax.shape == (n_blocks,), (
            f"{where}: absmax has shape {tuple(absmax.shape)}, expected ({n_blocks},): one per block, "
            f"the last block padded ({x.numel()} elements do not divide by {block_size})")
        torch.testing.assert_close(absmax, ref_absmax, rtol=0, atol=0, msg=lambda m: (
            f"{where}: absmax differs from the largest |x| of each block: {m}"))
        # The chosen entry is a nearest one: as close as brute force's, up to float32 rounding
        # of the distances (near a midpoint both neighbours are at the same rounded distance).
        scales = ref_absmax.repeat_interleave(block_size)[: x.numel()].view(x.shape)
        normalized = x / torch.where(scales > 0, scales, torch.ones_like(scales))
        dist_mine = (normalized - code[codes.long()]).abs()
        dist_ref = (normalized - code[ref_index]).abs()
        worse = int((~(dist_mine <= dist_ref + 1e-7)).sum())  # NaN counts as worse
        assert worse == 0, (
            f"{where}: {worse} of {x.numel()} elements are not mapped to a nearest code entry "
            f"(largest excess distance {float((dist_mine - dist_ref).max()):.3g}): round to the "
            "nearest entry of the sorted code (midpoints between neighbours), not down or up")
        torch.testing.assert_close(dequantize_blockwise(codes, absmax, code, block_size),
                                   code[codes.long()] * scales, rtol=0, atol=0, msg=lambda m: (
            f"{where}: dequantize must return code[index] · absmax of the element's block: {m}"))


@pytest.mark.exercise("2.2", points=1)
@pytest.mark.parametrize("block_size", [64, 256, 4096])
def test_quantize_against_bitsandbytes(block_size):
    """Check against bitsandbytes.functional.quantize_blockwise with its dynamic map: the same
    absmax per block; dequantizing bitsandbytes' codes gives bitsandbytes' values; and the
    round-trip error is no larger than bitsandbytes' (its CPU kernel's search is not always
    the nearest entry, the exact nearest can only be closer)."""
    from labkit.score_table import optional_reference
    from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code, quantize_blockwise
    dequantize_blockwise, quantize_blockwise = as_given(dequantize_blockwise), as_given(quantize_blockwise)

    optional_reference("bitsandbytes", min_version="0.50")
    import bitsandbytes.functional as F

    code = dynamic_code()
    x = heavy_tailed(50_001, seed=1)
    q_bnb, st = F.quantize_blockwise(x, code=code, blocksize=block_size)
    codes, absmax = quantize_blockwise(x, code, block_size)
    torch.testing.assert_close(absmax, st.absmax, rtol=0, atol=0, msg=lambda m: (
        f"absmax per block of {block_size} vs bitsandbytes: {m} — one scale per block of the "
        "flattened tensor, the last block short"))
    torch.testing.assert_close(dequantize_blockwise(q_bnb, st.absmax, code, block_size),
                               F.dequantize_blockwise(q_bnb, st), rtol=0, atol=0, msg=lambda m: (
        f"dequantizing bitsandbytes' codes: {m} — code[index] × its block's absmax"))
    err_mine = (dequantize_blockwise(codes, absmax, code, block_size) - x).abs()
    err_bnb = (F.dequantize_blockwise(q_bnb, st) - x).abs()
    assert err_mine.mean() <= err_bnb.mean() * (1 + 1e-6), (
        f"mean round-trip error {err_mine.mean():.3g} is {err_mine.mean() / err_bnb.mean():.2f}× "
        "bitsandbytes': are you rounding to the nearest code entry?")
    worse = int((~(err_mine <= err_bnb + 1e-7 * x.abs().max())).sum())  # NaN counts as worse
    assert worse == 0, f"{worse} elements round worse than bitsandbytes: is the nearest entry chosen?"


@pytest.mark.exercise("2.2", points=1)
def test_round_trip_error_bounds_and_block_size():
    """Check the stated bounds: |x − x̂| ≤ absmax/255 for the linear code (half its step of
    2/255) and ≤ absmax · (largest half-gap of the code) for the dynamic code; all-zero
    blocks come back as zeros; and the error grows with the block size on heavy-tailed data."""
    from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code, linear_code, quantize_blockwise
    dequantize_blockwise, quantize_blockwise = as_given(dequantize_blockwise), as_given(quantize_blockwise)

    x = heavy_tailed(20_000, seed=2)
    x[:512] = 0.0  # two all-zero blocks of 256
    for code in (linear_code(), dynamic_code()):
        half_gap = (code[1:] - code[:-1]).max() / 2
        codes, absmax = quantize_blockwise(x, code, 256)
        x_hat = dequantize_blockwise(codes, absmax, code, 256)
        per_element_absmax = absmax.repeat_interleave(256)[: x.numel()]
        bound = per_element_absmax * half_gap * (1 + 1e-5) + 1e-12
        assert ((x_hat - x).abs() <= bound).all(), (
            f"{int(((x_hat - x).abs() > bound).sum())} of {x.numel()} elements come back further "
            "than half the code's largest gap times their block's absmax: is each value divided by "
            "its own block's absmax and mapped to the nearest code entry?")
        zero_index = int(code.abs().argmin())  # the entry nearest 0 (first of equals)
        assert torch.equal(absmax[:2], torch.zeros(2)), (
            f"absmax of the two all-zero blocks is {absmax[:2].tolist()}, expected [0.0, 0.0]: "
            "store the block's true absmax, even when it is 0 (divide by 1 instead)")
        assert (codes[:512] == zero_index).all(), (
            f"{int((codes[:512] != zero_index).sum())} codes of the all-zero blocks are not the "
            f"index {zero_index} of the code's entry nearest 0: is 0/0 (NaN) being quantized?")
        assert torch.equal(x_hat[:512], torch.zeros(512)), "all-zero blocks must come back as zeros"
    linear = linear_code()
    assert torch.isclose((linear[1:] - linear[:-1]).max() / 2, torch.tensor(1 / 255))
    errors = []
    for block_size in (32, 256, 2048, 20_000):
        codes, absmax = quantize_blockwise(x, dynamic_code(), block_size)
        errors.append((dequantize_blockwise(codes, absmax, dynamic_code(), block_size) - x)
                      .abs().mean().item())
    assert errors == sorted(errors), f"mean error by block size {errors} should grow"
    bf16 = x.to(torch.bfloat16)
    codes, absmax = quantize_blockwise(bf16, dynamic_code(), 256)
    assert codes.shape == bf16.shape and absmax.dtype == torch.float32, (
        f"a bf16 input gave codes of shape {tuple(codes.shape)} (its own: {tuple(bf16.shape)}) and "
        f"absmax in {absmax.dtype}: the docstring's absmax is fp32 whatever the input's dtype")


# =================================================================== 2.3 8-bit Adam


def test_dynamic_code_is_bitsandbytes_dynamic_map():
    F = pytest.importorskip("bitsandbytes.functional")
    from labkit.lab2.quantize8bit import dynamic_code

    for signed in (True, False):
        assert torch.equal(dynamic_code(signed), F.create_dynamic_map(signed=signed))


@pytest.mark.parametrize("call,word", [
    (lambda m: m.num_blocks(10, 0), "block_size"),
    (lambda m: m.num_blocks(-1, 4), "numel"),
    (lambda m: m.num_blocks(10.0, 4), "numel"),
    (lambda m: m.quantized_bytes(-1), "numel"),
    (lambda m: m.quantized_bytes(10, block_size=-2), "block_size"),
    (lambda m: m.linear_code("yes"), "signed"),
    (lambda m: m.dynamic_code(1), "signed"),
    (lambda m: m.quantize_blockwise(torch.zeros(4), m.dynamic_code(), block_size=0), "block_size"),
    (lambda m: m.quantize_blockwise(torch.zeros(4), torch.zeros(10), 4), "code"),
    (lambda m: m.quantize_blockwise(torch.zeros(4, dtype=torch.long), m.dynamic_code(), 4), "x"),
    (lambda m: m.dequantize_blockwise(torch.zeros(4), torch.zeros(1), m.dynamic_code(), 4), "codes"),
    (lambda m: m.dequantize_blockwise(torch.zeros(4, dtype=torch.uint8), torch.zeros(3),
                                      m.dynamic_code(), 4), "absmax"),
])
def test_quantize8bit_refuses_bad_input(call, word):
    import labkit.lab2.quantize8bit as m

    with pytest.raises((ValueError, TypeError), match=word):
        call(m)


@pytest.mark.exercise("2.2", points=1)
def test_quantize_keeps_to_the_data_device_with_the_code_on_the_cpu():
    """On a GPU the data (an optimizer's moments) is on the device and the code, as
    ``linear_code()``/``dynamic_code()`` build it, on the CPU; an op that mixes the two raises
    there. The CPU cannot see this, so here the data is on the ``meta`` device and
    ``StrictDevices`` raises as CUDA would on any op mixing devices (copies and CPU indices
    aside). Quantize and dequantize must run, and return codes, absmax and values on the data's
    device."""
    from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code, linear_code, quantize_blockwise
    dequantize_blockwise, quantize_blockwise = as_given(dequantize_blockwise), as_given(quantize_blockwise)

    for code in (dynamic_code(), linear_code()):
        x = torch.empty(1000, 3, device="meta")
        with StrictDevices():
            try:
                codes, absmax = quantize_blockwise(x, code, 256)
                values = dequantize_blockwise(codes, absmax, code, 256)
            except NotImplementedError:
                raise  # an untouched stub: "not attempted", not a device error
            except RuntimeError as exc:
                raise AssertionError(
                    f"with x on another device than the code (the GPU vs the CPU): {exc} — bring "
                    "the code (or what you compute from it) to x's device before mixing them") from None
        for what, t, dtype in (("codes", codes, torch.uint8), ("absmax", absmax, torch.float32),
                               ("dequantized values", values, torch.float32)):
            assert t.device == x.device and t.dtype == dtype, (
                f"{what} are {t.dtype} on {t.device}, expected {dtype} on x's device {x.device}")
        assert codes.shape == x.shape and values.shape == x.shape and absmax.shape == (12,)


@pytest.mark.exercise("2.2", points=1)
def test_quantize_alternating_codes_and_a_bf16_input():
    """Quantize the same data with the dynamic, then the linear, then the dynamic code again
    (a cache keyed on anything less than the code would hand the second call the first code's
    table), against brute force; and a bf16 input, whose codes must be those of its values in
    fp32 (normalizing in bf16 rounds x/absmax to 8 bits before the code is looked up)."""
    from labkit.lab2.quantize8bit import dynamic_code, linear_code, quantize_blockwise
    quantize_blockwise = as_given(quantize_blockwise)

    x = heavy_tailed(3000, seed=7)
    for name, code in (("dynamic", dynamic_code()), ("linear", linear_code()),
                       ("dynamic", dynamic_code()), ("unsigned dynamic", dynamic_code(False))):
        data = x.abs() if name.startswith("unsigned") else x
        codes, _ = quantize_blockwise(data, code, 128)
        ref, _ = brute_force_quantize(data, code, 128)
        normalized = data / _block_scales(data, 128)
        worse = int((~((normalized - code[codes.long()]).abs()
                       <= (normalized - code[ref]).abs() + 1e-7)).sum())  # NaN counts as worse
        assert worse == 0, (f"{name} code (called after other codes): {worse} of {x.numel()} "
                            "elements are not at a nearest entry — is a table built for another "
                            "code being reused?")
    bf16 = (x * 1e3).to(torch.bfloat16)
    codes16, absmax16 = quantize_blockwise(bf16, dynamic_code(), 128)
    codes32, absmax32 = quantize_blockwise(bf16.float(), dynamic_code(), 128)
    assert torch.equal(absmax16, absmax32), "absmax of a bf16 input must be its fp32 values' absmax"
    differ = int((codes16 != codes32).sum())
    assert differ == 0, (f"{differ} of {x.numel()} codes of a bf16 input differ from those of the "
                         "same values in fp32: normalize in fp32, not in the input's dtype")


def _block_scales(x, block_size):
    n = x.numel()
    blocks = math.ceil(n / block_size)
    flat = torch.zeros(blocks * block_size)
    flat[:n] = x.reshape(-1).float()
    absmax = flat.view(blocks, block_size).abs().amax(dim=1)
    return torch.where(absmax > 0, absmax, torch.ones_like(absmax)).repeat_interleave(block_size)[:n].view(x.shape)


@pytest.mark.exercise("2.2", points=1)
def test_quantize_a_non_contiguous_tensor_by_its_logical_order():
    """A transposed (40, 30) tensor and a strided slice, quantized, must give the codes and
    scales of their contiguous copies (blocks run over ``x.flatten()``, the logical order, not
    the storage), and dequantize back to the same values. Exact: the same numbers either way."""
    from labkit.lab2.quantize8bit import dequantize_blockwise, dynamic_code, quantize_blockwise
    dequantize_blockwise, quantize_blockwise = as_given(dequantize_blockwise), as_given(quantize_blockwise)

    base = heavy_tailed(30, 80, seed=11)
    for name, x in (("a transposed tensor", base[:, :40].t()), ("a strided slice", base[::2, ::3])):
        assert not x.is_contiguous()
        codes, absmax = quantize_blockwise(x, dynamic_code(), 64)
        want_codes, want_absmax = quantize_blockwise(x.contiguous(), dynamic_code(), 64)
        assert codes.shape == x.shape, f"{name}: codes of shape {tuple(codes.shape)}, expected {tuple(x.shape)}"
        assert torch.equal(absmax, want_absmax), (
            f"{name}: the block scales differ from those of x.contiguous(): blocks must follow "
            "x.flatten() (its logical order), not the storage")
        assert torch.equal(codes, want_codes), (
            f"{name}: {int((codes != want_codes).sum())} of {x.numel()} codes differ from those "
            "of x.contiguous()")
        back = dequantize_blockwise(codes.t().contiguous().t(), absmax, dynamic_code(), 64)
        want = dequantize_blockwise(want_codes, want_absmax, dynamic_code(), 64)
        assert torch.equal(back, want), f"{name}: dequantizing non-contiguous codes gives other values"
