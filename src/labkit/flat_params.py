"""Flat, padded parameter vectors: the bookkeeping under every ZeRO stage and FSDP.

ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054) views a set of tensors as one flat vector of
Ψ elements and gives each of N ranks an equal slice. Ψ rarely divides by N, so the vector is
padded with zeros to N·S elements, S = ceil(Ψ/N), and rank r owns ``[r·S, (r+1)·S)``. Equal
slices are what reduce-scatter and all-gather want (every rank sends and receives the same
number of elements), and they let every GPU be sized for the same share.

This module is infrastructure, not an exercise: ZeRO-1 (lab 2), ZeRO-2 (lab 4) and ZeRO-3
(lab 3) each build their own sharded step on it.

    S, pad = partition(numel, world_size)
    flat = flatten_padded(grads, pad, torch.float32)   # (N·S,)
    mine = flat[shard_range(rank, S)]                   # (S,)
"""
from __future__ import annotations

import torch

from labkit.validate import non_negative_int, positive_int

__all__ = ["partition", "shard_range", "flatten_padded", "copy_from_flat", "master_dtype"]


def partition(numel: int, world_size: int) -> tuple[int, int]:
    """Split ``numel`` elements evenly over ``world_size`` ranks.

    Returns:
        ``(shard_size, padding)``: S = ceil(numel / N) elements per rank, and the N·S − numel
        zeros appended at the end so that every rank's slice has exactly S elements
        (0 ≤ padding < N).
    """
    numel, world_size = positive_int("numel", numel), positive_int("world_size", world_size)
    shard_size = -(-numel // world_size)  # ceil in integers: a float division rounds above 2**53
    return shard_size, shard_size * world_size - numel


def shard_range(rank: int, shard_size: int) -> slice:
    """The slice ``[rank·S, (rank+1)·S)`` of the padded flat vector that ``rank`` owns."""
    rank, shard_size = non_negative_int("rank", rank), positive_int("shard_size", shard_size)
    return slice(rank * shard_size, (rank + 1) * shard_size)


def flatten_padded(tensors, padding: int, dtype: torch.dtype) -> torch.Tensor:
    """Concatenate ``tensors`` flattened, in order, then ``padding`` zeros; as ``dtype``.

    Returns a new tensor of ``sum(numel) + padding`` elements on the first tensor's device.
    """
    tensors = _tensor_list("tensors", tensors)
    if not tensors:
        raise ValueError("tensors must be a non-empty sequence of tensors")
    padding = non_negative_int("padding", padding)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}")
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        raise ValueError(f"tensors must all be on one device to be flattened together, got {devices}")
    pieces = [t.detach().reshape(-1).to(dtype) for t in tensors]
    pieces.append(torch.zeros(padding, dtype=dtype, device=pieces[0].device))
    return torch.cat(pieces)  # (numel + padding,)


def copy_from_flat(flat: torch.Tensor, tensors) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors``, in order (trailing padding ignored)."""
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise TypeError("flat must be a 1-D tensor, got " + (f"shape {tuple(flat.shape)}" if
                        isinstance(flat, torch.Tensor) else type(flat).__name__))
    tensors = _tensor_list("tensors", tensors)
    needed = sum(t.numel() for t in tensors)
    if flat.numel() < needed:
        raise ValueError(f"flat has {flat.numel()} elements, the tensors need {needed}")
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _tensor_list(name: str, tensors) -> list:
    """``tensors`` as a list of tensors; a single tensor (which iterates over its rows) or anything
    else is a TypeError naming ``name``."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{name} must be a sequence of tensors, got a single Tensor (wrap it: [t])")
    try:
        tensors = list(tensors)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of tensors, got {type(tensors).__name__}") from None
    bad = [type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"{name} must hold only tensors, got {bad[0]}")
    return tensors


def master_dtype(dtype: torch.dtype, *, name: str = "dtype") -> torch.dtype:
    """The dtype a sharded or offloaded optimizer keeps its copy of a parameter (and its states)
    in, one rule for every ZeRO stage and offload of the course: the parameter's own dtype when
    it is at least fp32 (fp32 → fp32, fp64 → fp64: trained exactly as ``torch.optim`` trains
    it), fp32 for 16-bit parameters (fp16, bf16: the mixed-precision master). Anything that is
    not a floating dtype is refused, naming ``name``."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{name} must be a floating-point dtype (float16, bfloat16, float32 or "
                         f"float64), got {dtype}")
    if dtype.itemsize < 4:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64 to be "
                             f"trained, got {dtype} (an fp8 parameter has no optimizer here)")
        return torch.float32
    return dtype
