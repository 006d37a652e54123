"""ZeRO-1 (lab 2) under torchrun: each rank's optimizer state next to 8Ψ/N."""
from __future__ import annotations

from labkit.cluster.common import Demo, gpt_and_batches, key, n_params, timed, training_figures, training_rows
from labkit.cluster.options import GPTRun
from labkit.harness.lab2 import train_data_parallel
from labkit.measure import peak_over_calls


def run(rank: int, world_size: int, o: GPTRun) -> dict:
    """Data-parallel training with ZeRO-1 (lab 2): each rank's optimizer state next to 8Ψ/N
    (Adam's two fp32 moments, 1/N each), the MemTracker peak of the run, and bytes sent per step
    in units of the fp32 model, 4Ψ."""
    model, batches = gpt_and_batches(o, world_size)
    psi = n_params(model)
    seconds, (peak, _, out) = timed(o.device, peak_over_calls, model, train_data_parallel,
                                    rank, world_size, model, batches, optimizer="zero1")
    sent = sum(out["comm"]["bytes_sent"].values())
    return {"rank": rank, "peak_bytes": peak, "state_bytes": int(out["state_bytes"]),
            "predicted_state_bytes": 8 * -(-psi // world_size),
            **training_figures(o, psi, seconds, sent, out["comm"]["calls"], out["losses"])}


def rows(results) -> list[str]:
    return training_rows(results, lambda psi: f"Adam's fp32 moments 8Ψ = {8 * psi:,} B in all", [
        ("optimizer state B", 18, ",", key("state_bytes")),
        ("predicted 8Ψ/N", 15, ",", key("predicted_state_bytes")), ("peak B", 12, ",", key("peak_bytes"))],
        calls=False)


DEMO = Demo("zero1", GPTRun, run, rows)
