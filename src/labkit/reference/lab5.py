"""Lab 5's references: what the graders, the lab and the chapter compare the student's code with.

- ``ring_bytes_per_rank``: the ring's closed-form traffic, N − 1 key/value blocks per rank;
- ``plain_attention_with_lse`` / ``single_device_peak_bytes``: attention over the whole sequence
  on one device (PyTorch's fused CPU kernel where it applies, the plain softmax otherwise), the
  baseline of ring attention's per-rank memory;
- ``run_sequence_parallel_module``: PyTorch's own sequence parallelism (``parallelize_module``
  with ``SequenceParallel``) on the same weights, the reference of exercise 5.8;
- ``comm_counts``: a ``labkit.comm_count`` counter as plain data.

Nothing here imports a lab package (``tests/test_layout.py``), so no edit of a student's file can
move a value a grade is decided against.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.attention_blocks import attention_with_lse
from labkit.comm_count import count_comm
from labkit.measure import peak_bytes
from labkit.validate import positive_int

__all__ = ["ring_bytes_per_rank", "plain_attention_with_lse", "single_device_peak_bytes",
           "run_sequence_parallel_module", "comm_counts"]


def ring_bytes_per_rank(batch: int, heads: int, seq_len: int, head_dim: int, world_size: int,
                        element_size: int = 4) -> int:
    """Bytes each rank sends in one ring pass: N−1 blocks of keys and values, 2·(N−1)·B·H·(S/N)·D elements.

    Raises:
        ValueError: a size that is not an int >= 1, or ``seq_len`` not a multiple of ``world_size``.
    """
    for name, value in (("batch", batch), ("heads", heads), ("seq_len", seq_len),
                        ("head_dim", head_dim), ("world_size", world_size),
                        ("element_size", element_size)):
        positive_int(name, value)
    if seq_len % world_size:
        raise ValueError(f"seq_len={seq_len} must split evenly over world_size={world_size} ranks")
    return 2 * (world_size - 1) * batch * heads * (seq_len // world_size) * head_dim * element_size


def plain_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ/√D) v and the log-sum-exp of each score row, on one device: the toolkit's
    ``labkit.attention_blocks.attention_with_lse`` over the whole sequence (PyTorch's fused CPU
    kernel where it applies, the plain computation with the whole score matrix otherwise)."""
    return attention_with_lse(q, k, v, causal=causal)


def single_device_peak_bytes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             causal: bool = False) -> int:
    """MemTracker peak of attention over the whole sequence on one device (the ring's baseline)."""
    return peak_bytes(plain_attention_with_lse, q, k, v, causal=causal)[0]


def comm_counts(counter) -> dict:
    """A ``count_comm()`` counter as plain data: calls, bytes sent and ring bytes per operation."""
    return {"calls": dict(counter.calls), "bytes": dict(counter.bytes_sent),
            "ring": dict(counter.ring_bytes)}


def run_sequence_parallel_module(rank: int, world_size: int, ln: nn.LayerNorm, mlp: nn.Module,
                                 x: torch.Tensor) -> dict:
    """PyTorch's version on the same weights: ``parallelize_module`` with ``SequenceParallel``
    on the LayerNorm, ``ColwiseParallel(input_layouts=Shard(1))`` on c_fc and
    ``RowwiseParallel(output_layouts=Shard(1))`` on c_proj, on a CPU DeviceMesh; returns this
    rank's slice of ``x + mlp(ln(x))`` and the forward's comm counts. Run by ``labkit.ranks.launch``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = init_device_mesh("cpu", (world_size,))
    ln, mlp = copy.deepcopy(ln), copy.deepcopy(mlp)
    parallelize_module(ln, mesh, SequenceParallel())
    parallelize_module(mlp, mesh, {"c_fc": ColwiseParallel(input_layouts=Shard(1)),
                                   "c_proj": RowwiseParallel(output_layouts=Shard(1))})
    per = x.shape[1] // world_size
    xr = x[:, rank * per:(rank + 1) * per].clone()
    with count_comm() as fwd:
        out = xr + mlp(ln(xr))
        out = out.wait() if hasattr(out, "wait") else out
    dist.barrier()
    return {"out": torch.Tensor(out.detach()).clone(), "forward": comm_counts(fwd)}
