"""Sequence parallelism (lab 5) under torchrun: the LayerNorm's saved bytes next to 1/N of one device's."""
from __future__ import annotations

import torch

from labkit.cluster.common import RANK, STEP_S, Demo, UsageError, key, layer_figures, rows as table_rows, timed
from labkit.cluster.options import BlockHalfRun
from labkit.harness.lab5 import run_sp
from labkit.measure import saved_activation_bytes
from labkit.models import MLP, GPTConfig


def run(rank: int, world_size: int, o: BlockHalfRun) -> dict:
    """The second half of a GPT block, x + MLP(LayerNorm(x)), with tensor and sequence
    parallelism over the N ranks (lab 5), forward and backward: the LayerNorm's saved bytes next
    to 1/N of one device's, the ring bytes of its all-gathers and reduce-scatters next to those
    of one all-reduce per direction (tensor parallelism's)."""
    torch.manual_seed(0)  # the same layer, input and output gradient on every rank
    cfg = GPTConfig(vocab_size=16, block_size=o.seq, n_layer=1, n_head=1, n_embd=o.n_embd)
    ln, mlp = torch.nn.LayerNorm(o.n_embd).to(o.device), MLP(cfg).to(o.device)
    x = torch.randn(o.batch, o.seq, o.n_embd, device=o.device)
    grad_out = torch.randn(o.batch, o.seq, o.n_embd, device=o.device)
    seconds, out = timed(o.device, run_sp, rank, world_size, ln, mlp, x, grad_out)
    full_ln = saved_activation_bytes(lambda: ln(x.clone().requires_grad_()))
    ring = {phase: int(sum(out[phase]["ring"].values())) for phase in ("forward", "backward")}
    return {"rank": rank, "ln_saved_bytes": int(out["ln_saved_bytes"]),
            "full_ln_saved_bytes": int(full_ln), "predicted_ln_saved_bytes": int(full_ln) // world_size,
            "forward_ring_bytes": ring["forward"], "backward_ring_bytes": ring["backward"],
            "all_reduce_ring_bytes": int(out["all_reduce_ring_bytes"]),
            **layer_figures(out, seconds)}


def rows(results) -> list[str]:
    r0 = results[0]
    return [f"LayerNorm on one device saves {r0['full_ln_saved_bytes']:,} B; collectives "
            f"forward {r0['forward_calls']}, backward {r0['backward_calls']}"] + table_rows(results, [
        RANK, ("LN saved B", 11, ",", key("ln_saved_bytes")),
        ("predicted 1/N", 13, ",", key("predicted_ln_saved_bytes")),
        ("ring B fwd", 11, ",", key("forward_ring_bytes")), ("ring B bwd", 11, ",", key("backward_ring_bytes")),
        ("all-reduce ring B", 17, ",", key("all_reduce_ring_bytes")), STEP_S])


def check(o: BlockHalfRun, world_size: int) -> None:
    if (4 * o.n_embd) % world_size or o.seq % world_size:
        raise UsageError(f"sequence_parallel splits the MLP's 4·--n-embd = {4 * o.n_embd} columns and --seq "
                         f"{o.seq} positions over {world_size} ranks: use multiples of the world size {world_size}")


DEMO = Demo("sequence_parallel", BlockHalfRun, run, rows, check)
