"""ZeRO-3 (lab 3) under torchrun: each rank's parameter shards next to Σ_units 4⌈Ψ_unit/N⌉ B."""
from __future__ import annotations

from labkit.cluster.common import (Demo, gpt_and_batches, key, n_params, summed_calls, timed, training_figures,
                                   training_rows)
from labkit.cluster.options import GPTRun
from labkit.harness.lab3 import train_zero3


def run(rank: int, world_size: int, o: GPTRun) -> dict:
    """Data-parallel training with ZeRO-3 (lab 3): each rank's parameter shards next to
    Σ_units 4⌈Ψ_unit/N⌉ B, the most gathered bytes next to the root unit plus the largest block,
    bytes sent per step over 4Ψ."""
    model, batches = gpt_and_batches(o, world_size)
    psi = n_params(model)
    seconds, out = timed(o.device, train_zero3, rank, world_size, model, batches)
    padded = [world_size * -(-n // world_size) for n in out["unit_numels"]]  # blocks, then root
    sent = sum(sum(c["bytes"].values()) for c in out["comm"])
    return {"rank": rank, "shard_bytes": int(out["shard_bytes"]),
            "predicted_shard_bytes": sum(4 * (n // world_size) for n in padded),
            "peak_live_bytes": int(out["peak_live_bytes"]),
            "predicted_peak_live_bytes": 4 * (padded[-1] + max(padded[:-1])),
            **training_figures(o, psi, seconds, sent, summed_calls(out["comm"]), out["losses"])}


def rows(results) -> list[str]:
    return training_rows(results, lambda psi: f"fp32 parameters 4Ψ = {4 * psi:,} B", [
        ("param shards B", 15, ",", key("shard_bytes")), ("predicted", 12, ",", key("predicted_shard_bytes")),
        ("peak gathered B", 16, ",", key("peak_live_bytes")),
        ("root+block", 12, ",", key("predicted_peak_live_bytes"))])


DEMO = Demo("zero3", GPTRun, run, rows, cpu_reason="labkit.lab3.zero3 keeps its shards and buffers on the CPU")
