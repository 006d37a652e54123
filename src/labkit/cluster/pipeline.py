"""Pipeline parallelism (lab 3) under torchrun: each stage's peak of saved activations next to the
micro-batches in flight times one micro-batch's."""
from __future__ import annotations

import torch

from labkit.cluster.common import STEP_S, Demo, UsageError, gpt, key, rows as table_rows, timed
from labkit.cluster.options import PipelineRun
from labkit.harness.lab3 import pipeline_worker
from labkit.lab3.pipeline import split_gpt
from labkit.lab3.pipeline_schedule import make_schedule
from labkit.measure import peak_saved_bytes
from labkit.models import SyntheticData


def run(rank: int, world_size: int, o: PipelineRun) -> dict:
    """The course GPT cut into N stages, one per rank (lab 3), one step of ``--microbatches`` M
    micro-batches of ``--batch`` sequences under the ``--schedule`` (gpipe or 1f1b) that your
    ``make_schedule`` generates: each stage's peak of saved activations next to k × one
    micro-batch's (k = M under GPipe, min(N−s, M) under 1F1B), bytes sent next to M messages
    of b·T·C·4 per neighbour."""
    cfg, model = gpt(o)
    M = o.microbatches
    x, y = SyntheticData(o.vocab_size, o.seq, o.batch * M, seed=0).batch(0)
    actions = [[(a[0], a[1]) for a in stage] for stage in make_schedule(o.schedule, world_size, M)]
    seconds, out = timed(o.device, pipeline_worker, rank, world_size, cfg, model.state_dict(),
                         actions, x, y, M)
    # one micro-batch's saved activations on this stage, alone (no communication): the unit
    stage, keep = split_gpt(model, world_size)[rank], []
    xin = x[:o.batch].clone() if rank == 0 else torch.randn(o.batch, o.seq, o.n_embd, requires_grad=True)

    def one_forward():
        h = stage(xin)
        if rank == world_size - 1:
            h = torch.nn.functional.cross_entropy(h.reshape(-1, h.shape[-1]), y[:o.batch].clone().reshape(-1)) / M
        keep.append(h)

    one = peak_saved_bytes(one_forward)
    in_flight = M if o.schedule == "gpipe" else min(world_size - rank, M)
    links = (rank < world_size - 1) + (rank > 0)
    return {"rank": rank, "schedule": o.schedule, "microbatches": M,
            "peak_saved_bytes": int(out["peak_saved"]), "one_microbatch_bytes": int(one),
            "in_flight": in_flight, "predicted_peak_saved_bytes": in_flight * int(one),
            "bytes_sent": int(out["bytes"].get("send", 0)),
            "predicted_bytes_sent": links * M * o.batch * o.seq * o.n_embd * 4,
            "calls": out["calls"], "loss": None if out["loss"] is None else float(out["loss"]),
            "step_seconds": seconds}


def rows(results) -> list[str]:
    r0 = results[0]
    return [f"{r0['schedule']}, M = {r0['microbatches']} micro-batches; loss {results[-1]['loss']:.4f}; "
            "predicted peak = micro-batches in flight × one's"] + table_rows(results, [
        ("stage", 5, "", key("rank")), ("peak saved B", 13, ",", key("peak_saved_bytes")),
        ("in flight", 9, "", key("in_flight")), ("× one B", 11, ",", key("one_microbatch_bytes")),
        ("predicted", 13, ",", key("predicted_peak_saved_bytes")), ("sent B", 11, ",", key("bytes_sent")),
        ("predicted", 11, ",", key("predicted_bytes_sent")), STEP_S])


def check(o: PipelineRun, world_size: int) -> None:
    if o.n_layer % world_size:
        raise UsageError(f"pipeline cuts --n-layer {o.n_layer} blocks into {world_size} stages: use a "
                         f"multiple of the world size {world_size}")
    if o.schedule == "1f1b" and o.microbatches < world_size:
        raise UsageError(f"pipeline --schedule 1f1b needs --microbatches >= the world size {world_size}, "
                         f"got {o.microbatches}")


DEMO = Demo("pipeline", PipelineRun, run, rows, check,
            cpu_reason="labkit.lab3.pipeline's run_stage receives into CPU buffers")
