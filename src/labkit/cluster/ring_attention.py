"""Ring attention (lab 5) under torchrun: each rank's peak next to one device's over the whole sequence."""
from __future__ import annotations

import torch

from labkit.cluster.common import RANK, STEP_S, Demo, UsageError, key, rows as table_rows, timed
from labkit.cluster.options import RingRun
from labkit.harness.lab5 import ring_worker
from labkit.reference.lab5 import ring_bytes_per_rank, single_device_peak_bytes


def run(rank: int, world_size: int, o: RingRun) -> dict:
    """Ring attention (lab 5) over a sequence split into N chunks: each rank's peak next to one
    device's peak over the whole sequence, bytes sent next to the ring's 2(N-1)·B·H·(S/N)·D
    elements."""
    gen = torch.Generator().manual_seed(0)  # the same q, k, v on every rank
    q, k, v = (torch.randn(o.batch, o.heads, o.seq, o.head_dim, generator=gen).to(o.device) for _ in range(3))
    seconds, out = timed(o.device, ring_worker, rank, world_size, q, k, v, causal=o.causal)
    single = single_device_peak_bytes(q, k, v, causal=o.causal) if rank == 0 else None
    return {"rank": rank, "peak_bytes": int(out["peak_bytes"]), "single_device_peak_bytes": single,
            "bytes_sent": int(out["bytes_sent"].get("send", 0)),  # (recv counts what arrives)
            "predicted_bytes_sent": ring_bytes_per_rank(o.batch, o.heads, o.seq, o.head_dim, world_size,
                                                        element_size=q.element_size()),
            "calls": out["calls"], "step_seconds": seconds}


def rows(results) -> list[str]:
    single = results[0]["single_device_peak_bytes"]
    return [f"one device over the whole sequence: peak {single:,} B"] + table_rows(results, [
        RANK, ("peak B", 12, ",", key("peak_bytes")), ("of one device", 13, ".2f", lambda r: r["peak_bytes"] / single),
        ("sent B", 12, ",", key("bytes_sent")), ("predicted", 12, ",", key("predicted_bytes_sent")), STEP_S])


def check(o: RingRun, world_size: int) -> None:
    if o.seq % world_size:
        raise UsageError(f"ring_attention splits --seq {o.seq} into {world_size} equal chunks: use a multiple "
                         f"of the world size {world_size}, e.g. {o.seq - o.seq % world_size or world_size}")


DEMO = Demo("ring_attention", RingRun, run, rows, check, defaults={"seq": 256, "batch": 1})
