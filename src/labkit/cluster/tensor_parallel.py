"""Tensor parallelism (lab 3) under torchrun: one GPT layer's parameter bytes next to 1/N of its own."""
from __future__ import annotations

import torch

from labkit.cluster.common import RANK, STEP_S, Demo, UsageError, key, layer_figures, rows as table_rows, timed
from labkit.cluster.options import LayerRun
from labkit.harness.lab3 import run_tp
from labkit.models import MLP, CausalSelfAttention, GPTConfig


def run(rank: int, world_size: int, o: LayerRun) -> dict:
    """One layer of the course GPT (its MLP, or its attention with ``--layer attn``) split over
    the N ranks (lab 3), forward and backward: each rank's parameter bytes next to 1/N of the
    layer's (the row-parallel bias stays whole), bytes sent next to two all-reduces of the
    (B, S, C) activation, one in forward, one in backward."""
    torch.manual_seed(0)  # the same full layer, input and output gradient on every rank
    cfg = GPTConfig(vocab_size=16, block_size=o.seq, n_layer=1, n_head=o.n_head, n_embd=o.n_embd)
    module = (MLP(cfg) if o.layer == "mlp" else CausalSelfAttention(cfg)).to(o.device)
    x = torch.randn(o.batch, o.seq, o.n_embd, device=o.device)
    grad_out = torch.randn(o.batch, o.seq, o.n_embd, device=o.device)
    seconds, out = timed(o.device, run_tp, rank, world_size, o.layer, module, x, grad_out)
    full = sum(p.numel() for p in module.parameters())
    whole = 0 if module.c_proj.bias is None else module.c_proj.bias.numel()  # replicated
    size = x.element_size()
    sent = sum(out["forward"]["bytes"].values()) + sum(out["backward"]["bytes"].values())
    return {"rank": rank, "layer": o.layer, "full_param_bytes": size * full,
            "param_bytes": int(out["param_bytes"]),
            "predicted_param_bytes": size * ((full - whole) // world_size + whole),
            "bytes_sent": int(sent), "predicted_bytes_sent": 2 * size * o.batch * o.seq * o.n_embd,
            **layer_figures(out, seconds)}


def rows(results) -> list[str]:
    r0 = results[0]
    return [f"one {r0['layer']} layer: {r0['full_param_bytes']:,} B of parameters in all; "
            f"all-reduces forward {r0['forward_calls']}, backward {r0['backward_calls']}"] + table_rows(results, [
        RANK, ("param B", 12, ",", key("param_bytes")), ("predicted", 12, ",", key("predicted_param_bytes")),
        ("sent B", 12, ",", key("bytes_sent")), ("predicted 2·BSC·4", 18, ",", key("predicted_bytes_sent")),
        STEP_S])


def check(o: LayerRun, world_size: int) -> None:
    if o.layer == "mlp" and (4 * o.n_embd) % world_size:
        raise UsageError(f"tensor_parallel splits the MLP's 4·--n-embd = {4 * o.n_embd} columns over "
                         f"{world_size} ranks: use a multiple of the world size {world_size}")
    if o.layer == "attn" and o.n_head % world_size:
        raise UsageError(f"tensor_parallel splits --n-head {o.n_head} heads over {world_size} ranks: "
                         f"use a multiple of the world size {world_size}")


DEMO = Demo("tensor_parallel", LayerRun, run, rows, check)
