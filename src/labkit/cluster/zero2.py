"""ZeRO-2 (lab 4) under torchrun: each rank's gradient shard next to 4⌈Ψ/N⌉ B."""
from __future__ import annotations

from labkit.cluster.common import (Demo, gpt_and_batches, key, n_params, summed_calls, timed, training_figures,
                                   training_rows)
from labkit.cluster.options import ZeRO2Run
from labkit.harness.lab4 import train_zero2


def run(rank: int, world_size: int, o: ZeRO2Run) -> dict:
    """Data-parallel training with ZeRO-2 (lab 4): each rank's gradient shard next to 4⌈Ψ/N⌉ B,
    the most ``.grad`` bytes alive during backward (full gradients are freed bucket by bucket,
    ``--bucket-kb``) next to the full 4Ψ, bytes sent per step over 4Ψ."""
    model, batches = gpt_and_batches(o, world_size)
    psi = n_params(model)
    seconds, out = timed(o.device, train_zero2, rank, world_size, model, batches,
                         bucket_cap_bytes=o.bucket_kb * 1024, reference=False)
    sent = sum(sum(c["bytes_sent"].values()) for c in out["comm"])
    return {"rank": rank, "shard_bytes": int(out["shard_bytes"]),
            "predicted_shard_bytes": 4 * -(-psi // world_size),
            "peak_grad_bytes": int(out["peak_grad_bytes"]), "full_grad_bytes": 4 * psi,
            **training_figures(o, psi, seconds, sent, summed_calls(out["comm"]), out["losses"])}


def rows(results) -> list[str]:
    return training_rows(results, lambda psi: f"full fp32 gradient 4Ψ = {4 * psi:,} B", [
        ("grad shard B", 13, ",", key("shard_bytes")), ("predicted 4Ψ/N", 15, ",", key("predicted_shard_bytes")),
        ("peak .grad B", 13, ",", key("peak_grad_bytes")),
        ("of 4Ψ", 6, ".2f", lambda r: r["peak_grad_bytes"] / r["full_grad_bytes"])])


DEMO = Demo("zero2", ZeRO2Run, run, rows)
