"""Run the course's distributed techniques on a real cluster: ``torchrun ... -m labkit.cluster <demo>``.

    torchrun --standalone --nproc-per-node 2 -m labkit.cluster zero1 --steps 3
    torchrun --standalone --nproc-per-node 4 -m labkit.cluster ring_attention --seq 4096
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m labkit.cluster zero1 --n-layer 24 --n-embd 2048

Each rank reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (set by torchrun), joins one process
group (NCCL on CUDA, gloo on CPU; ``--device``), is placed on its local GPU, and runs the demo
through :func:`labkit.dist.launch`, which inside torchrun runs the function on this existing
group instead of starting processes: the very calls the labs make in a notebook. The exercise
modules are whatever ``labkit`` is installed: in the student edition, the student's own code.

Rank 0 prints one row per rank: the measured bytes next to the chapter's prediction, the bytes
this rank communicated, and the step time, then a line ``json: {...}`` with the same figures
(what the tests compare against an in-process :func:`labkit.dist.launch` run).

Demos (``DEMOS``):

- ``zero1``: data-parallel training of the course GPT with ZeRO-1 (``labkit.lab2.zero1``, lab 2):
  each rank's optimizer state next to 8Ψ/N (Adam's two fp32 moments, 1/N each), the
  MemTracker peak of the run, and bytes sent per step in units of the fp32 model, 4Ψ.
- ``ring_attention``: attention over a sequence split into N chunks (``labkit.lab5.ring_attention``,
  lab 5): each rank's peak next to one device's peak over the whole sequence, bytes sent next
  to the ring's 2(N-1)·B·H·(S/N)·D elements.
- ``tensor_parallel``: one layer of the course GPT (its MLP, or its attention with ``--layer
  attn``) split over the N ranks (``labkit.lab3.tensor_parallel``, lab 3), forward and backward:
  each rank's parameter bytes next to 1/N of the layer's (the row-parallel bias stays whole),
  bytes sent next to two all-reduces of the (B, S, C) activation, one in forward, one in backward.
- ``zero2``: data-parallel training with ZeRO-2 (``labkit.lab4.zero2``, lab 4): each rank's gradient
  shard next to 4⌈Ψ/N⌉ B, the most ``.grad`` bytes alive during backward (full gradients are
  freed bucket by bucket, ``--bucket-kb``) next to the full 4Ψ, bytes sent per step over 4Ψ.
- ``zero3``: data-parallel training with ZeRO-3 (``labkit.lab3.zero3``, lab 3; CPU only: its buffers
  live on the CPU): each rank's parameter shards next to Σ_units 4⌈Ψ_unit/N⌉ B, the most
  gathered bytes next to the root unit plus the largest block, bytes sent per step over 4Ψ.
- ``pipeline``: the course GPT cut into N stages, one per rank (``labkit.lab3.pipeline``, lab 3),
  one step of ``--microbatches`` M micro-batches of ``--batch`` sequences under the
  ``--schedule`` (gpipe or 1f1b) that ``labkit.lab3.pipeline_schedule.make_schedule`` generates
  (CPU only, like ``run_stage``'s buffers): each stage's peak of saved activations next to k ×
  one micro-batch's (k = M under GPipe, min(N−s, M) under 1F1B), bytes sent next to M
  messages of b·T·C·4 per neighbour.
- ``sequence_parallel``: the second half of a GPT block, x + MLP(LayerNorm(x)), with tensor
  and sequence parallelism over the N ranks (``labkit.lab5.sequence_parallel``, lab 5), forward and
  backward: the LayerNorm's saved bytes next to 1/N of one device's, the ring bytes of its
  all-gathers and reduce-scatters next to those of one all-reduce per direction (tensor
  parallelism's).

- ``plan``: the course GPT trained under a parallel plan (``labkit.lab7.run_plan``, lab 7):
  ``--config`` names it, e.g. ``tp2xdp2`` (TP 2 inside, DP 2 outside), ``pp2xdp2``, ``zero3x4``,
  or tokens joined by ``x``: ``dpN``, ``tpN``, ``ppN``, ``zeroK``, ``mN`` (micro-batches),
  ``gpipe``, ``ckpt`` (default ``zero3``: ZeRO-3 over every rank; the data-parallel size is what
  the other axes leave). Each rank's MemTracker peak next to ``run_plan.predict_peak``, bytes
  sent per step, and the loss per step (CPU only: the pipeline and ZeRO-3 keep their buffers on
  the CPU). ``--batch`` is sequences per replica.

Several demos in one job (``-m labkit.cluster zero1 zero2 zero3``) run one after another with
the same options, each printing its table.

Bad input (an unknown demo, a world size the demo cannot use, ``--device cuda`` without a GPU,
no torchrun) ends with a message and exit status 2 before any collective starts.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

DEMOS = ("zero1", "ring_attention", "tensor_parallel", "zero2", "zero3", "pipeline",
         "sequence_parallel", "plan")
CPU_ONLY = ("zero3", "pipeline", "plan")  # their labkit modules keep buffers on the CPU


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


# ------------------------------------------------------------------ the demos (one rank each)

def _peak_over_steps(model: torch.nn.Module, fn, *args, **kwargs):
    """(MemTracker peak bytes, result) of ``fn(*args, **kwargs)``, which calls ``model`` once per
    step: MemTracker refuses a second forward unless its module statistics are reset before it,
    so ``model``'s calls reset them first (its class is swapped for the run, then restored)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker, cls = MemTracker(), type(model)

    class _ResetEachCall(cls):
        def __call__(self, *a, **k):
            tracker.reset_mod_stats()
            return super().__call__(*a, **k)

    model.__class__ = _ResetEachCall
    try:
        with tracker:
            result = fn(*args, **kwargs)
    finally:
        model.__class__ = cls
    peak = tracker.get_tracker_snapshot("peak")
    return int(sum(snap.get("Total", 0) for snap in peak.values())), result


def zero1_demo(rank: int, world_size: int, *, n_layer: int, n_embd: int, n_head: int,
               vocab_size: int, seq: int, batch: int, steps: int, device: str) -> dict:
    """Train the course GPT for ``steps`` steps with ZeRO-1 on this rank; measure it."""
    from labkit.models import GPT, GPTConfig, SyntheticData
    from labkit.lab2.zero1 import train_data_parallel

    torch.manual_seed(0)  # the same initial model on every rank
    cfg = GPTConfig(vocab_size=vocab_size, block_size=seq, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd)
    model = GPT(cfg).to(device)
    data = SyntheticData(vocab_size, seq, batch, seed=0, device=device)
    batches = [[data.batch(step * world_size + r) for r in range(world_size)] for step in range(steps)]
    psi = sum(p.numel() for p in model.parameters())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    peak, out = _peak_over_steps(model, train_data_parallel, rank, world_size, model, batches,
                                 optimizer="zero1")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    sent = sum(out["comm"]["bytes_sent"].values())
    return {"rank": rank, "psi": psi, "peak_bytes": peak, "state_bytes": int(out["state_bytes"]),
            "predicted_state_bytes": 8 * -(-psi // world_size),
            "bytes_sent_per_step": sent // steps, "sent_over_4psi": sent / steps / (4 * psi),
            "calls": out["comm"]["calls"], "final_loss": out["losses"][-1],
            "step_seconds": seconds / steps}


def ring_attention_demo(rank: int, world_size: int, *, batch: int, heads: int, seq: int,
                        head_dim: int, causal: bool, device: str) -> dict:
    """Ring attention over a sequence of ``seq`` positions split over the ranks; measure it."""
    from labkit.lab5.ring_attention import ring_bytes_per_rank, ring_worker, single_device_peak_bytes

    gen = torch.Generator().manual_seed(0)  # the same q, k, v on every rank
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=gen).to(device) for _ in range(3))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = ring_worker(rank, world_size, q, k, v, causal=causal)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    single = single_device_peak_bytes(q, k, v, causal=causal) if rank == 0 else None
    return {"rank": rank, "peak_bytes": int(out["peak_bytes"]), "single_device_peak_bytes": single,
            "bytes_sent": int(out["bytes_sent"].get("send", 0)),  # (recv counts what arrives)
            "predicted_bytes_sent": ring_bytes_per_rank(batch, heads, seq, head_dim, world_size,
                                                        element_size=q.element_size()),
            "calls": out["calls"], "step_seconds": seconds}


def _gpt_and_batches(world_size: int, *, n_layer: int, n_embd: int, n_head: int, vocab_size: int,
                     seq: int, batch: int, steps: int, device: str):
    """The same initial course GPT on every rank and ``batches[step][rank]``."""
    from labkit.models import GPT, GPTConfig, SyntheticData

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab_size, block_size=seq, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd)
    model = GPT(cfg).to(device)
    data = SyntheticData(vocab_size, seq, batch, seed=0, device=device)
    return model, [[data.batch(step * world_size + r) for r in range(world_size)] for step in range(steps)]


def _timed(device: str, fn, *args, **kwargs):
    """(seconds, result) of ``fn(*args, **kwargs)``, the GPU's queue drained at both ends."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started, result


def tensor_parallel_demo(rank: int, world_size: int, *, layer: str, n_embd: int, n_head: int,
                         seq: int, batch: int, device: str) -> dict:
    """Forward and backward of one GPT layer (``layer``: "mlp" or "attn") split over the ranks."""
    from labkit.models import GPTConfig, MLP, CausalSelfAttention
    from labkit.lab3.tensor_parallel import run_tp

    torch.manual_seed(0)  # the same full layer, input and output gradient on every rank
    cfg = GPTConfig(vocab_size=16, block_size=seq, n_layer=1, n_head=n_head, n_embd=n_embd)
    module = (MLP(cfg) if layer == "mlp" else CausalSelfAttention(cfg)).to(device)
    x = torch.randn(batch, seq, n_embd, device=device)
    grad_out = torch.randn(batch, seq, n_embd, device=device)
    seconds, out = _timed(device, run_tp, rank, world_size, layer, module, x, grad_out)
    full = sum(p.numel() for p in module.parameters())
    whole = 0 if module.c_proj.bias is None else module.c_proj.bias.numel()  # replicated
    size = x.element_size()
    sent = sum(out["forward"]["bytes"].values()) + sum(out["backward"]["bytes"].values())
    return {"rank": rank, "layer": layer, "full_param_bytes": size * full,
            "param_bytes": int(out["param_bytes"]),
            "predicted_param_bytes": size * ((full - whole) // world_size + whole),
            "bytes_sent": int(sent), "predicted_bytes_sent": 2 * size * batch * seq * n_embd,
            "forward_calls": out["forward"]["calls"], "backward_calls": out["backward"]["calls"],
            "step_seconds": seconds}


def zero2_demo(rank: int, world_size: int, *, n_layer: int, n_embd: int, n_head: int,
               vocab_size: int, seq: int, batch: int, steps: int, bucket_kb: int, device: str) -> dict:
    """Train the course GPT for ``steps`` steps with ZeRO-2 on this rank; measure it."""
    from labkit.lab4.zero2 import train_zero2

    model, batches = _gpt_and_batches(world_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                                      vocab_size=vocab_size, seq=seq, batch=batch, steps=steps,
                                      device=device)
    psi = sum(p.numel() for p in model.parameters())
    seconds, out = _timed(device, train_zero2, rank, world_size, model, batches,
                          bucket_cap_bytes=bucket_kb * 1024, reference=False)
    sent = sum(sum(c["bytes_sent"].values()) for c in out["comm"])
    calls = {}
    for c in out["comm"]:
        for op, n in c["calls"].items():
            calls[op] = calls.get(op, 0) + n
    return {"rank": rank, "psi": psi, "shard_bytes": int(out["shard_bytes"]),
            "predicted_shard_bytes": 4 * -(-psi // world_size),
            "peak_grad_bytes": int(out["peak_grad_bytes"]), "full_grad_bytes": 4 * psi,
            "bytes_sent_per_step": sent // steps, "sent_over_4psi": sent / steps / (4 * psi),
            "calls": calls, "final_loss": out["losses"][-1], "step_seconds": seconds / steps}


def zero3_demo(rank: int, world_size: int, *, n_layer: int, n_embd: int, n_head: int,
               vocab_size: int, seq: int, batch: int, steps: int, device: str) -> dict:
    """Train the course GPT for ``steps`` steps with ZeRO-3 on this rank; measure it."""
    from labkit.lab3.zero3 import train_zero3

    model, batches = _gpt_and_batches(world_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                                      vocab_size=vocab_size, seq=seq, batch=batch, steps=steps,
                                      device=device)
    psi = sum(p.numel() for p in model.parameters())
    seconds, out = _timed(device, train_zero3, rank, world_size, model, batches)
    padded = [world_size * -(-n // world_size) for n in out["unit_numels"]]  # blocks, then root
    sent = sum(sum(c["bytes"].values()) for c in out["comm"])
    calls = {}
    for c in out["comm"]:
        for op, n in c["calls"].items():
            calls[op] = calls.get(op, 0) + n
    return {"rank": rank, "psi": psi, "shard_bytes": int(out["shard_bytes"]),
            "predicted_shard_bytes": sum(4 * (n // world_size) for n in padded),
            "peak_live_bytes": int(out["peak_live_bytes"]),
            "predicted_peak_live_bytes": 4 * (padded[-1] + max(padded[:-1])),
            "bytes_sent_per_step": sent // steps, "sent_over_4psi": sent / steps / (4 * psi),
            "calls": calls, "final_loss": out["losses"][-1], "step_seconds": seconds / steps}


def pipeline_demo(rank: int, world_size: int, *, n_layer: int, n_embd: int, n_head: int,
                  vocab_size: int, seq: int, batch: int, microbatches: int, schedule: str,
                  device: str) -> dict:
    """One pipeline step of the course GPT, stage ``rank`` of ``world_size``; measure it."""
    from labkit.measure import peak_saved_bytes
    from labkit.models import GPT, GPTConfig, SyntheticData
    from labkit.lab3.pipeline import pipeline_worker, split_gpt
    from labkit.lab3.pipeline_schedule import make_schedule

    torch.manual_seed(0)  # the same model on every rank
    cfg = GPTConfig(vocab_size=vocab_size, block_size=seq, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd)
    model = GPT(cfg)
    M = microbatches
    x, y = SyntheticData(vocab_size, seq, batch * M, seed=0).batch(0)
    actions = [[(a[0], a[1]) for a in stage] for stage in make_schedule(schedule, world_size, M)]
    seconds, out = _timed(device, pipeline_worker, rank, world_size, cfg, model.state_dict(),
                          actions, x, y, M)
    # one micro-batch's saved activations on this stage, alone (no communication): the unit
    stage, keep = split_gpt(model, world_size)[rank], []
    xin = x[:batch].clone() if rank == 0 else torch.randn(batch, seq, n_embd, requires_grad=True)

    def one_forward():
        o = stage(xin)
        if rank == world_size - 1:
            o = torch.nn.functional.cross_entropy(o.reshape(-1, o.shape[-1]), y[:batch].clone().reshape(-1)) / M
        keep.append(o)
    one = peak_saved_bytes(one_forward)
    in_flight = M if schedule == "gpipe" else min(world_size - rank, M)
    links = (rank < world_size - 1) + (rank > 0)
    return {"rank": rank, "schedule": schedule, "microbatches": M,
            "peak_saved_bytes": int(out["peak_saved"]), "one_microbatch_bytes": int(one),
            "in_flight": in_flight, "predicted_peak_saved_bytes": in_flight * int(one),
            "bytes_sent": int(out["bytes"].get("send", 0)),
            "predicted_bytes_sent": links * M * batch * seq * n_embd * 4,
            "calls": out["calls"], "loss": None if out["loss"] is None else float(out["loss"]),
            "step_seconds": seconds}


def sequence_parallel_demo(rank: int, world_size: int, *, n_embd: int, seq: int, batch: int,
                           device: str) -> dict:
    """x + MLP(LayerNorm(x)) with tensor and sequence parallelism over the ranks; measure it."""
    from labkit.measure import saved_activation_bytes
    from labkit.models import GPTConfig, MLP
    from labkit.lab5.sequence_parallel import run_sp

    torch.manual_seed(0)  # the same layer, input and output gradient on every rank
    cfg = GPTConfig(vocab_size=16, block_size=seq, n_layer=1, n_head=1, n_embd=n_embd)
    ln, mlp = torch.nn.LayerNorm(n_embd).to(device), MLP(cfg).to(device)
    x = torch.randn(batch, seq, n_embd, device=device)
    grad_out = torch.randn(batch, seq, n_embd, device=device)
    seconds, out = _timed(device, run_sp, rank, world_size, ln, mlp, x, grad_out)
    full_ln = saved_activation_bytes(lambda: ln(x.clone().requires_grad_()))
    ring = {phase: int(sum(out[phase]["ring"].values())) for phase in ("forward", "backward")}
    return {"rank": rank, "ln_saved_bytes": int(out["ln_saved_bytes"]),
            "full_ln_saved_bytes": int(full_ln), "predicted_ln_saved_bytes": int(full_ln) // world_size,
            "forward_ring_bytes": ring["forward"], "backward_ring_bytes": ring["backward"],
            "all_reduce_ring_bytes": int(out["all_reduce_ring_bytes"]),
            "forward_calls": out["forward"]["calls"], "backward_calls": out["backward"]["calls"],
            "step_seconds": seconds}


def plan_from_config(config: str, world_size: int):
    """``--config`` → a ``labkit.lab7.run_plan.Plan`` of ``world_size`` ranks (UsageError if it cannot be)."""
    from labkit.lab7.run_plan import PLANS, Plan

    if config in PLANS:
        plan = PLANS[config]
    else:
        fields, sizes = {}, {"dp": None, "tp": 1, "pp": 1}
        for token in config.replace(",", "x").split("x"):
            name = token.rstrip("0123456789")
            number = token[len(name):]
            if name in sizes and number:
                sizes[name] = int(number)
            elif name == "zero" and number:
                fields["zero_stage"] = int(number)
            elif name == "m" and number:
                fields["n_micro"] = int(number)
            elif token in ("gpipe", "1f1b"):
                fields["schedule"] = token
            elif token == "ckpt":
                fields["checkpointing"] = True
            else:
                raise UsageError(f"--config {config!r}: unknown part {token!r}; use dpN, tpN, ppN, "
                                 f"zeroK, mN, gpipe, 1f1b, ckpt joined by 'x', or one of {', '.join(PLANS)}")
        inner = sizes["tp"] * sizes["pp"]
        if sizes["dp"] is None:
            if inner < 1 or world_size % inner:
                raise UsageError(f"--config {config!r}: tp·pp = {inner} does not divide the world "
                                 f"size {world_size}")
            sizes["dp"] = world_size // inner
        plan = Plan(**sizes, **fields)
    if plan.world_size != world_size:
        raise UsageError(f"--config {config!r} needs dp·pp·tp = {plan.world_size} ranks, the job "
                         f"has {world_size}: use --nproc-per-node (times nodes) = {plan.world_size}")
    return plan


def plan_demo(rank: int, world_size: int, *, config: str, n_layer: int, n_embd: int, n_head: int,
              vocab_size: int, seq: int, batch: int, steps: int, device: str) -> dict:
    """Train the course GPT for ``steps`` steps under the plan ``config`` on this rank; measure it."""
    from labkit.comm_count import count_comm
    from labkit.models import GPT, GPTConfig, SyntheticData
    from labkit.lab7.run_plan import predict_peak, run_plans_worker

    plan = plan_from_config(config, world_size)
    torch.manual_seed(0)  # the same initial model and batches on every rank
    cfg = GPTConfig(vocab_size=vocab_size, block_size=seq, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd)
    state = GPT(cfg).state_dict()
    data = SyntheticData(vocab_size, seq, batch * plan.dp, seed=0)
    batches = [data.batch(step) for step in range(steps)]
    with count_comm() as c:
        out = run_plans_worker(rank, world_size, [plan], cfg, state, batches)[0]
    predicted = predict_peak(plan, cfg, batch * plan.dp, rank)
    return {"rank": rank, "plan": out["label"], "coords": out["coords"], "peak_bytes": out["peak"],
            "predicted_peak_bytes": predicted, "at_peak": out["at_peak"],
            "bytes_sent_per_step": sum(c.bytes_sent.values()) // steps, "calls": dict(c.calls),
            "losses": out["losses"], "step_seconds": out["seconds"] / steps}


def _plan_table(results: list[dict]) -> list[str]:
    lines = [f"plan: {results[0]['plan']}; peak per rank (MemTracker) next to run_plan.predict_peak"]
    lines.append(f"{'rank':>4} {'dp,pp,tp':>9} {'peak B':>12} {'predicted B':>12} {'gap':>7} "
                 f"{'sent B/step':>12} {'step s':>8}  losses")
    for r in results:
        c = r["coords"]
        losses = "-" if r["losses"][0] is None else " ".join(f"{v:.4f}" for v in r["losses"])
        lines.append(f"{r['rank']:>4} {c['dp']:>3},{c['pp']},{c['tp']:<3} {r['peak_bytes']:>12,} "
                     f"{r['predicted_peak_bytes']:>12,} {r['peak_bytes'] / r['predicted_peak_bytes'] - 1:>+7.1%} "
                     f"{r['bytes_sent_per_step']:>12,} {r['step_seconds']:>8.3f}  {losses}")
    return lines


# ------------------------------------------------------------------ command line

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.cluster",
                                description="Run a distributed demo of the course under torchrun.")
    p.add_argument("demo", nargs="+",
                   help=f"one or more of: {', '.join(DEMOS)} (several: run one after another "
                        "in the same job, with the same options)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: each rank's local GPU if there is one, else the CPU")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a rank stuck in a collective gives up (default 300)")
    p.add_argument("--steps", type=int, default=3, help="zero1/2/3: training steps (default 3)")
    p.add_argument("--n-layer", type=int, default=None, help="zero1/2/3, pipeline: layers (default: the lab's)")
    p.add_argument("--n-embd", type=int, default=None, help="zero1/2/3, pipeline, tensor_parallel, sequence_parallel: width (default: the lab's)")
    p.add_argument("--n-head", type=int, default=None, help="zero1/2/3, pipeline, tensor_parallel: heads (default: the lab's)")
    p.add_argument("--vocab-size", type=int, default=None, help="zero1/2/3, pipeline: vocabulary (default: the lab's)")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per rank (default 4; ring: 1; pipeline: per micro-batch)")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length (default: the lab's block size; ring_attention: 256)")
    p.add_argument("--heads", type=int, default=4, help="ring_attention: heads (default 4)")
    p.add_argument("--head-dim", type=int, default=32, help="ring_attention: head size (default 32)")
    p.add_argument("--causal", action="store_true", help="ring_attention: causal attention")
    p.add_argument("--layer", default="mlp", choices=("mlp", "attn"),
                   help="tensor_parallel: the layer to split (default mlp)")
    p.add_argument("--config", default="zero3",
                   help="plan: the parallel plan, e.g. tp2xdp2, pp2xdp2, zero3x4, dp2xzero1 "
                        "(default zero3: ZeRO-3 over every rank)")
    p.add_argument("--bucket-kb", type=int, default=25 * 1024,
                   help="zero2: gradient bucket size in KiB (default 25600, DDP's 25 MiB)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"),
                   help="pipeline: the schedule (default 1f1b)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pipeline: micro-batches per step (default 2 × the world size)")
    return p


def demo_call(args: argparse.Namespace, world_size: int, device: str):
    """(function, keyword arguments) of the demo, after checking what it needs."""
    positive = {name: getattr(args, name) for name in
                ("steps", "n_layer", "n_embd", "n_head", "vocab_size", "batch", "seq", "heads", "head_dim",
                 "bucket_kb", "microbatches")}
    bad = {k: v for k, v in positive.items() if v is not None and v < 1}
    if bad:
        raise UsageError(f"--{next(iter(bad)).replace('_', '-')} must be >= 1, got {next(iter(bad.values()))}")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.demo in ("zero1", "zero2", "zero3", "tensor_parallel", "pipeline", "sequence_parallel",
                     "plan"):
        from labkit.models import lab_config

        cfg = lab_config(device)
        kwargs = dict(n_layer=args.n_layer or cfg.n_layer, n_embd=args.n_embd or cfg.n_embd,
                      n_head=args.n_head or cfg.n_head, vocab_size=args.vocab_size or cfg.vocab_size,
                      seq=args.seq or cfg.block_size, batch=args.batch or 4, steps=args.steps,
                      device=device)
        if kwargs["n_embd"] % kwargs["n_head"]:
            raise UsageError(f"--n-embd {kwargs['n_embd']} must be a multiple of --n-head {kwargs['n_head']}")
        if args.demo == "zero1":
            return zero1_demo, kwargs
        if args.demo == "zero2":
            return zero2_demo, {**kwargs, "bucket_kb": args.bucket_kb}
        if args.demo == "plan":
            return plan_demo, {**_plan_kwargs(args, kwargs, world_size, device), "config": args.config}
        if args.demo == "zero3":
            if device != "cpu":
                raise UsageError("zero3 runs on the CPU only (labkit.lab3.zero3 keeps its shards and "
                                 "buffers on the CPU): use --device cpu")
            return zero3_demo, kwargs
        if args.demo == "pipeline":
            if device != "cpu":
                raise UsageError("pipeline runs on the CPU only (labkit.lab3.pipeline's run_stage "
                                 "receives into CPU buffers): use --device cpu")
            if kwargs["n_layer"] % world_size:
                raise UsageError(f"pipeline cuts --n-layer {kwargs['n_layer']} blocks into "
                                 f"{world_size} stages: use a multiple of the world size {world_size}")
            M = args.microbatches or 2 * world_size
            if args.schedule == "1f1b" and M < world_size:
                raise UsageError(f"pipeline --schedule 1f1b needs --microbatches >= the world size "
                                 f"{world_size}, got {M}")
            del kwargs["steps"]
            return pipeline_demo, {**kwargs, "microbatches": M, "schedule": args.schedule}
        n_embd, n_head = kwargs["n_embd"], kwargs["n_head"]
        if args.demo == "sequence_parallel":
            if (4 * n_embd) % world_size or kwargs["seq"] % world_size:
                raise UsageError(f"sequence_parallel splits the MLP's 4·--n-embd = {4 * n_embd} "
                                 f"columns and --seq {kwargs['seq']} positions over {world_size} "
                                 f"ranks: use multiples of the world size {world_size}")
            return sequence_parallel_demo, dict(n_embd=n_embd, seq=kwargs["seq"],
                                                batch=kwargs["batch"], device=device)
        if args.layer == "mlp" and (4 * n_embd) % world_size:
            raise UsageError(f"tensor_parallel splits the MLP's 4·--n-embd = {4 * n_embd} columns "
                             f"over {world_size} ranks: use a multiple of the world size {world_size}")
        if args.layer == "attn" and n_head % world_size:
            raise UsageError(f"tensor_parallel splits --n-head {n_head} heads over {world_size} "
                             f"ranks: use a multiple of the world size {world_size}")
        return tensor_parallel_demo, dict(layer=args.layer, n_embd=n_embd, n_head=n_head,
                                          seq=kwargs["seq"], batch=kwargs["batch"], device=device)
    if args.demo == "ring_attention":
        seq = args.seq or 256
        if seq % world_size:
            raise UsageError(f"ring_attention splits --seq {seq} into {world_size} equal chunks: "
                             f"use a multiple of the world size {world_size}, e.g. {seq - seq % world_size or world_size}")
        return ring_attention_demo, dict(batch=args.batch or 1, heads=args.heads, seq=seq,
                                         head_dim=args.head_dim, causal=args.causal, device=device)
    raise UsageError(f"unknown demo {args.demo!r}: choose one of {', '.join(DEMOS)}")


def _plan_kwargs(args, kwargs: dict, world_size: int, device: str) -> dict:
    """The plan demo's keyword arguments, after checking the plan fits the job and the model."""
    if device != "cpu":
        raise UsageError("plan runs on the CPU only (labkit.lab3.pipeline and labkit.lab3.zero3 keep their "
                         "buffers on the CPU): use --device cpu")
    plan = plan_from_config(args.config, world_size)
    if kwargs["n_head"] % plan.tp:
        raise UsageError(f"--config {args.config!r}: tp = {plan.tp} must divide --n-head {kwargs['n_head']}")
    if kwargs["n_layer"] % plan.pp:
        raise UsageError(f"--config {args.config!r}: pp = {plan.pp} must divide --n-layer {kwargs['n_layer']}")
    if kwargs["batch"] % plan.n_micro:
        raise UsageError(f"--config {args.config!r}: {plan.n_micro} micro-batches must divide --batch "
                         f"{kwargs['batch']} (sequences per replica)")
    return kwargs


def table(demo: str, results: list[dict], world_size: int, backend: str, device: str) -> str:
    """Rank 0's report: one row per rank, then ``json: {...}``."""
    lines = [f"{demo} on {world_size} rank(s), {backend} on {device.split(':')[0]}"]
    if demo == "zero1":
        psi = results[0]["psi"]
        lines.append(f"model: {psi:,} parameters (Ψ); Adam's fp32 moments 8Ψ = {8 * psi:,} B in all")
        lines.append(f"{'rank':>4} {'optimizer state B':>18} {'predicted 8Ψ/N':>15} {'peak B':>12} "
                     f"{'sent B/step':>12} {'sent/(4Ψ)':>9} {'step s':>8}")
        for r in results:
            lines.append(f"{r['rank']:>4} {r['state_bytes']:>18,} {r['predicted_state_bytes']:>15,} "
                         f"{r['peak_bytes']:>12,} {r['bytes_sent_per_step']:>12,} "
                         f"{r['sent_over_4psi']:>9.2f} {r['step_seconds']:>8.3f}")
    elif demo == "tensor_parallel":
        r0 = results[0]
        lines.append(f"one {r0['layer']} layer: {r0['full_param_bytes']:,} B of parameters in all; "
                     f"all-reduces forward {r0['forward_calls']}, backward {r0['backward_calls']}")
        lines.append(f"{'rank':>4} {'param B':>12} {'predicted':>12} {'sent B':>12} "
                     f"{'predicted 2·BSC·4':>18} {'step s':>8}")
        for r in results:
            lines.append(f"{r['rank']:>4} {r['param_bytes']:>12,} {r['predicted_param_bytes']:>12,} "
                         f"{r['bytes_sent']:>12,} {r['predicted_bytes_sent']:>18,} {r['step_seconds']:>8.3f}")
    elif demo == "zero2":
        psi = results[0]["psi"]
        lines.append(f"model: {psi:,} parameters (Ψ); full fp32 gradient 4Ψ = {4 * psi:,} B; "
                     f"calls over all steps {results[0]['calls']}")
        lines.append(f"{'rank':>4} {'grad shard B':>13} {'predicted 4Ψ/N':>15} {'peak .grad B':>13} "
                     f"{'of 4Ψ':>6} {'sent B/step':>12} {'sent/(4Ψ)':>9} {'step s':>8}")
        for r in results:
            lines.append(f"{r['rank']:>4} {r['shard_bytes']:>13,} {r['predicted_shard_bytes']:>15,} "
                         f"{r['peak_grad_bytes']:>13,} {r['peak_grad_bytes'] / r['full_grad_bytes']:>6.2f} "
                         f"{r['bytes_sent_per_step']:>12,} {r['sent_over_4psi']:>9.2f} {r['step_seconds']:>8.3f}")
    elif demo == "zero3":
        psi = results[0]["psi"]
        lines.append(f"model: {psi:,} parameters (Ψ); fp32 parameters 4Ψ = {4 * psi:,} B; "
                     f"calls over all steps {results[0]['calls']}")
        lines.append(f"{'rank':>4} {'param shards B':>15} {'predicted':>12} {'peak gathered B':>16} "
                     f"{'root+block':>12} {'sent B/step':>12} {'sent/(4Ψ)':>9} {'step s':>8}")
        for r in results:
            lines.append(f"{r['rank']:>4} {r['shard_bytes']:>15,} {r['predicted_shard_bytes']:>12,} "
                         f"{r['peak_live_bytes']:>16,} {r['predicted_peak_live_bytes']:>12,} "
                         f"{r['bytes_sent_per_step']:>12,} {r['sent_over_4psi']:>9.2f} {r['step_seconds']:>8.3f}")
    elif demo == "plan":
        lines += _plan_table(results)
    elif demo == "pipeline":
        r0 = results[0]
        lines.append(f"{r0['schedule']}, M = {r0['microbatches']} micro-batches; loss "
                     f"{results[-1]['loss']:.4f}; predicted peak = micro-batches in flight × one's")
        lines.append(f"{'stage':>5} {'peak saved B':>13} {'in flight':>9} {'× one B':>11} {'predicted':>13} "
                     f"{'sent B':>11} {'predicted':>11} {'step s':>8}")
        for r in results:
            lines.append(f"{r['rank']:>5} {r['peak_saved_bytes']:>13,} {r['in_flight']:>9} "
                         f"{r['one_microbatch_bytes']:>11,} {r['predicted_peak_saved_bytes']:>13,} "
                         f"{r['bytes_sent']:>11,} {r['predicted_bytes_sent']:>11,} {r['step_seconds']:>8.3f}")
    elif demo == "sequence_parallel":
        r0 = results[0]
        lines.append(f"LayerNorm on one device saves {r0['full_ln_saved_bytes']:,} B; collectives "
                     f"forward {r0['forward_calls']}, backward {r0['backward_calls']}")
        lines.append(f"{'rank':>4} {'LN saved B':>11} {'predicted 1/N':>13} {'ring B fwd':>11} "
                     f"{'ring B bwd':>11} {'all-reduce ring B':>17} {'step s':>8}")
        for r in results:
            lines.append(f"{r['rank']:>4} {r['ln_saved_bytes']:>11,} {r['predicted_ln_saved_bytes']:>13,} "
                         f"{r['forward_ring_bytes']:>11,} {r['backward_ring_bytes']:>11,} "
                         f"{r['all_reduce_ring_bytes']:>17,} {r['step_seconds']:>8.3f}")
    else:
        single = results[0]["single_device_peak_bytes"]
        lines.append(f"one device over the whole sequence: peak {single:,} B")
        lines.append(f"{'rank':>4} {'peak B':>12} {'of one device':>13} {'sent B':>12} "
                     f"{'predicted':>12} {'step s':>8}")
        for r in results:
            lines.append(f"{r['rank']:>4} {r['peak_bytes']:>12,} {r['peak_bytes'] / single:>13.2f} "
                         f"{r['bytes_sent']:>12,} {r['predicted_bytes_sent']:>12,} {r['step_seconds']:>8.3f}")
    lines.append("json: " + json.dumps({"demo": demo, "world_size": world_size, "ranks": results}))
    return "\n".join(lines)


def _torchrun_env() -> tuple[int, int, int]:
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise UsageError(f"not started by torchrun ({', '.join(missing)} unset): run "
                         "`torchrun --standalone --nproc-per-node 2 -m labkit.cluster <demo>`")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def _device(choice: str, local_rank: int) -> str:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but torch.cuda.is_available() is False on this node "
                             f"(torch {torch.__version__}); use --device cpu")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise UsageError(f"local rank {local_rank} has no GPU: this node has {count}; "
                             f"start at most {count} processes per node (--nproc-per-node)")
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return "cpu"


def run_demos(rank: int, world_size: int, calls: list) -> list[dict]:
    """Run the demos ``calls = [(name, keyword arguments), ...]`` one after another on this rank."""
    return [globals()[f"{name}_demo"](rank, world_size, **kwargs) for name, kwargs in calls]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        for demo in args.demo:
            if demo not in DEMOS:
                raise UsageError(f"unknown demo {demo!r}: choose one of {', '.join(DEMOS)}")
        rank, world_size, local_rank = _torchrun_env()
        # zero3's and pipeline's buffers live on the CPU: there "auto" means the CPU (an explicit
        # cuda is refused)
        cpu_only = any(d in CPU_ONLY for d in args.demo)
        choice = "cpu" if cpu_only and args.device == "auto" else args.device
        device = _device(choice, local_rank)
        calls = []
        for demo in args.demo:
            args_one = argparse.Namespace(**{**vars(args), "demo": demo})
            fn, kwargs = demo_call(args_one, world_size, device)
            calls.append((demo, kwargs))
    except UsageError as exc:
        print(f"labkit.cluster: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(1) if device == "cpu" else None
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                            **({"device_id": torch.device(device)} if backend == "nccl" else {}))
    try:
        from labkit.dist import launch

        mine = launch(run_demos, world_size, calls=calls)[0]  # inside torchrun: runs here, on this group
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            for i, (demo, _) in enumerate(calls):
                print(table(demo, [g[i] for g in gathered], world_size, backend, device), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
