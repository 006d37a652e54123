"""Run the course's distributed techniques on a real cluster: ``torchrun ... -m labkit.cluster <demo>``.

    torchrun --standalone --nproc-per-node 2 -m labkit.cluster zero1 --steps 3
    torchrun --standalone --nproc-per-node 4 -m labkit.cluster ring_attention --seq 4096
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m labkit.cluster zero1 --n-layer 24 --n-embd 2048

Each rank reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (set by torchrun), joins one process
group (NCCL on CUDA, gloo on CPU; ``--device``), is placed on its local GPU, and runs the demo
through :func:`labkit.ranks.launch`, which inside torchrun runs the function on this existing
group instead of starting processes: the very calls the labs make in a notebook. The exercise
modules are whatever ``labkit`` is installed: in the student edition, the student's own code.

Rank 0 prints one row per rank: the measured bytes next to the chapter's prediction, the bytes
this rank communicated, and the step time, then a line ``json: {...}`` with the same figures
(what the tests compare against an in-process :func:`labkit.ranks.launch` run).

The demos are a registry, ``REGISTRY``: each :class:`Demo` is written once, in one place: its
options (a dataclass whose fields are the command-line options it takes), its per-rank
function (a docstring saying what it measures against which prediction), its row formatter, its
checks of the options against the job, and whether it runs on the CPU only. The course code a
demo runs is named in ``USES`` (one line per demo), imported only when the demo runs. Several
demos in one job (``-m labkit.cluster zero1 zero2 zero3``) run one after another with the same
options, each printing its table.

Bad input (an unknown demo, a world size the demo cannot use, ``--device cuda`` without a GPU,
no torchrun) ends with a message and exit status 2 before any collective starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import sys
import time
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

# The course code each demo runs, "module:name,name" (several modules: separated by spaces),
# imported when the demo runs. One line per demo: when a function moves, its line follows.
USES = {
    "zero1": "labkit.harness.lab2:train_data_parallel",
    "ring_attention": "labkit.harness.lab5:ring_worker labkit.reference.lab5:ring_bytes_per_rank,single_device_peak_bytes",
    "tensor_parallel": "labkit.harness.lab3:run_tp",
    "zero2": "labkit.harness.lab4:train_zero2",
    "zero3": "labkit.harness.lab3:train_zero3",
    "pipeline": "labkit.harness.lab3:pipeline_worker labkit.lab3.pipeline:split_gpt labkit.lab3.pipeline_schedule:make_schedule",
    "sequence_parallel": "labkit.harness.lab5:run_sp",
    "plan": "labkit.harness.lab7:run_plans_worker labkit.lab7.run_plan:predict_peak,PLANS,Plan",
}


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


def uses(demo: str) -> types.SimpleNamespace:
    """The objects ``USES[demo]`` names, as attributes (``uses("zero1").train_data_parallel``)."""
    found = {}
    for part in USES[demo].split():
        module, names = part.split(":")
        imported = importlib.import_module(module)
        found.update({name: getattr(imported, name) for name in names.split(",")})
    return types.SimpleNamespace(**found)


# ------------------------------------------------------------------ options (one dataclass per shape of run)

@dataclass(frozen=True)
class GPTRun:
    """The course GPT trained for ``steps`` steps on ``batch`` sequences per rank."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq: int
    batch: int
    steps: int
    device: str


@dataclass(frozen=True)
class ZeRO2Run(GPTRun):
    bucket_kb: int = 25 * 1024  # DDP's 25 MiB buckets


@dataclass(frozen=True)
class PlanRun(GPTRun):
    config: str = "zero3"  # ZeRO-3 over every rank


@dataclass(frozen=True)
class PipelineRun:
    """One step of the GPT cut into one stage per rank, ``microbatches`` micro-batches of ``batch``."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq: int
    batch: int
    microbatches: int
    schedule: str
    device: str


@dataclass(frozen=True)
class LayerRun:
    """Forward and backward of one GPT layer (``layer``: "mlp" or "attn") on (batch, seq, n_embd)."""

    layer: str
    n_embd: int
    n_head: int
    seq: int
    batch: int
    device: str


@dataclass(frozen=True)
class BlockHalfRun:
    """x + MLP(LayerNorm(x)) on (batch, seq, n_embd)."""

    n_embd: int
    seq: int
    batch: int
    device: str


@dataclass(frozen=True)
class RingRun:
    """Attention over (batch, heads, seq, head_dim), the sequence split over the ranks."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool
    device: str


# ------------------------------------------------------------------ helpers the demos share

def _timed(device: str, fn, *args, **kwargs):
    """(seconds, result) of ``fn(*args, **kwargs)``, the GPU's queue drained at both ends."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started, result


def _gpt(o):
    """(config, the course GPT of ``o``'s sizes), the same initial model on every rank."""
    from labkit.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=o.vocab_size, block_size=o.seq, n_layer=o.n_layer, n_head=o.n_head,
                    n_embd=o.n_embd)
    return cfg, GPT(cfg)


def _gpt_and_batches(o: GPTRun, world_size: int):
    """The same initial course GPT on every rank (on ``o.device``) and ``batches[step][rank]``."""
    from labkit.models import SyntheticData

    _, model = _gpt(o)
    data = SyntheticData(o.vocab_size, o.seq, o.batch, seed=0, device=o.device)
    batches = [[data.batch(step * world_size + r) for r in range(world_size)] for step in range(o.steps)]
    return model.to(o.device), batches


def _summed_calls(comms) -> dict:
    calls = {}
    for c in comms:
        for op, n in c["calls"].items():
            calls[op] = calls.get(op, 0) + n
    return calls


def _rows(results, columns) -> list[str]:
    """A header and one row per rank; ``columns``: (title, width, format, value(result)), the
    format after the width (``","``, ``".2f"``; a leading ``"+"`` is the sign)."""
    lines = [" ".join(f"{title:>{width}}" for title, width, _, _ in columns)]
    for r in results:
        lines.append(" ".join(format(value(r), f">{'+' if fmt.startswith('+') else ''}{width}{fmt.lstrip('+')}")
                              for _, width, fmt, value in columns))
    return lines


def _key(name):
    return lambda r: r[name]


RANK = ("rank", 4, "", _key("rank"))
STEP_S = ("step s", 8, ".3f", _key("step_seconds"))


# ------------------------------------------------------------------ the demos, one block each

def zero1_run(rank: int, world_size: int, o: GPTRun) -> dict:
    """Data-parallel training with ZeRO-1 (lab 2): each rank's optimizer state next to 8Ψ/N
    (Adam's two fp32 moments, 1/N each), the MemTracker peak of the run, and bytes sent per step
    in units of the fp32 model, 4Ψ."""
    from labkit.measure import peak_over_calls

    model, batches = _gpt_and_batches(o, world_size)
    psi = sum(p.numel() for p in model.parameters())
    seconds, (peak, _, out) = _timed(o.device, peak_over_calls, model, uses("zero1").train_data_parallel,
                                     rank, world_size, model, batches, optimizer="zero1")
    sent = sum(out["comm"]["bytes_sent"].values())
    return {"rank": rank, "psi": psi, "peak_bytes": peak, "state_bytes": int(out["state_bytes"]),
            "predicted_state_bytes": 8 * -(-psi // world_size),
            "bytes_sent_per_step": sent // o.steps, "sent_over_4psi": sent / o.steps / (4 * psi),
            "calls": out["comm"]["calls"], "final_loss": out["losses"][-1],
            "step_seconds": seconds / o.steps}


def zero1_rows(results) -> list[str]:
    psi = results[0]["psi"]
    return [f"model: {psi:,} parameters (Ψ); Adam's fp32 moments 8Ψ = {8 * psi:,} B in all"] + _rows(results, [
        RANK, ("optimizer state B", 18, ",", _key("state_bytes")),
        ("predicted 8Ψ/N", 15, ",", _key("predicted_state_bytes")), ("peak B", 12, ",", _key("peak_bytes")),
        ("sent B/step", 12, ",", _key("bytes_sent_per_step")), ("sent/(4Ψ)", 9, ".2f", _key("sent_over_4psi")),
        STEP_S])


def ring_attention_run(rank: int, world_size: int, o: RingRun) -> dict:
    """Ring attention (lab 5) over a sequence split into N chunks: each rank's peak next to one
    device's peak over the whole sequence, bytes sent next to the ring's 2(N-1)·B·H·(S/N)·D
    elements."""
    code = uses("ring_attention")
    gen = torch.Generator().manual_seed(0)  # the same q, k, v on every rank
    q, k, v = (torch.randn(o.batch, o.heads, o.seq, o.head_dim, generator=gen).to(o.device) for _ in range(3))
    seconds, out = _timed(o.device, code.ring_worker, rank, world_size, q, k, v, causal=o.causal)
    single = code.single_device_peak_bytes(q, k, v, causal=o.causal) if rank == 0 else None
    return {"rank": rank, "peak_bytes": int(out["peak_bytes"]), "single_device_peak_bytes": single,
            "bytes_sent": int(out["bytes_sent"].get("send", 0)),  # (recv counts what arrives)
            "predicted_bytes_sent": code.ring_bytes_per_rank(o.batch, o.heads, o.seq, o.head_dim, world_size,
                                                             element_size=q.element_size()),
            "calls": out["calls"], "step_seconds": seconds}


def ring_attention_rows(results) -> list[str]:
    single = results[0]["single_device_peak_bytes"]
    return [f"one device over the whole sequence: peak {single:,} B"] + _rows(results, [
        RANK, ("peak B", 12, ",", _key("peak_bytes")), ("of one device", 13, ".2f", lambda r: r["peak_bytes"] / single),
        ("sent B", 12, ",", _key("bytes_sent")), ("predicted", 12, ",", _key("predicted_bytes_sent")), STEP_S])


def ring_attention_check(o: RingRun, world_size: int) -> None:
    if o.seq % world_size:
        raise UsageError(f"ring_attention splits --seq {o.seq} into {world_size} equal chunks: use a multiple "
                         f"of the world size {world_size}, e.g. {o.seq - o.seq % world_size or world_size}")


def tensor_parallel_run(rank: int, world_size: int, o: LayerRun) -> dict:
    """One layer of the course GPT (its MLP, or its attention with ``--layer attn``) split over
    the N ranks (lab 3), forward and backward: each rank's parameter bytes next to 1/N of the
    layer's (the row-parallel bias stays whole), bytes sent next to two all-reduces of the
    (B, S, C) activation, one in forward, one in backward."""
    from labkit.models import MLP, CausalSelfAttention, GPTConfig

    torch.manual_seed(0)  # the same full layer, input and output gradient on every rank
    cfg = GPTConfig(vocab_size=16, block_size=o.seq, n_layer=1, n_head=o.n_head, n_embd=o.n_embd)
    module = (MLP(cfg) if o.layer == "mlp" else CausalSelfAttention(cfg)).to(o.device)
    x = torch.randn(o.batch, o.seq, o.n_embd, device=o.device)
    grad_out = torch.randn(o.batch, o.seq, o.n_embd, device=o.device)
    seconds, out = _timed(o.device, uses("tensor_parallel").run_tp, rank, world_size, o.layer, module, x, grad_out)
    full = sum(p.numel() for p in module.parameters())
    whole = 0 if module.c_proj.bias is None else module.c_proj.bias.numel()  # replicated
    size = x.element_size()
    sent = sum(out["forward"]["bytes"].values()) + sum(out["backward"]["bytes"].values())
    return {"rank": rank, "layer": o.layer, "full_param_bytes": size * full,
            "param_bytes": int(out["param_bytes"]),
            "predicted_param_bytes": size * ((full - whole) // world_size + whole),
            "bytes_sent": int(sent), "predicted_bytes_sent": 2 * size * o.batch * o.seq * o.n_embd,
            "forward_calls": out["forward"]["calls"], "backward_calls": out["backward"]["calls"],
            "step_seconds": seconds}


def tensor_parallel_rows(results) -> list[str]:
    r0 = results[0]
    return [f"one {r0['layer']} layer: {r0['full_param_bytes']:,} B of parameters in all; "
            f"all-reduces forward {r0['forward_calls']}, backward {r0['backward_calls']}"] + _rows(results, [
        RANK, ("param B", 12, ",", _key("param_bytes")), ("predicted", 12, ",", _key("predicted_param_bytes")),
        ("sent B", 12, ",", _key("bytes_sent")), ("predicted 2·BSC·4", 18, ",", _key("predicted_bytes_sent")),
        STEP_S])


def tensor_parallel_check(o: LayerRun, world_size: int) -> None:
    if o.layer == "mlp" and (4 * o.n_embd) % world_size:
        raise UsageError(f"tensor_parallel splits the MLP's 4·--n-embd = {4 * o.n_embd} columns over "
                         f"{world_size} ranks: use a multiple of the world size {world_size}")
    if o.layer == "attn" and o.n_head % world_size:
        raise UsageError(f"tensor_parallel splits --n-head {o.n_head} heads over {world_size} ranks: "
                         f"use a multiple of the world size {world_size}")


def zero2_run(rank: int, world_size: int, o: ZeRO2Run) -> dict:
    """Data-parallel training with ZeRO-2 (lab 4): each rank's gradient shard next to 4⌈Ψ/N⌉ B,
    the most ``.grad`` bytes alive during backward (full gradients are freed bucket by bucket,
    ``--bucket-kb``) next to the full 4Ψ, bytes sent per step over 4Ψ."""
    model, batches = _gpt_and_batches(o, world_size)
    psi = sum(p.numel() for p in model.parameters())
    seconds, out = _timed(o.device, uses("zero2").train_zero2, rank, world_size, model, batches,
                          bucket_cap_bytes=o.bucket_kb * 1024, reference=False)
    sent = sum(sum(c["bytes_sent"].values()) for c in out["comm"])
    return {"rank": rank, "psi": psi, "shard_bytes": int(out["shard_bytes"]),
            "predicted_shard_bytes": 4 * -(-psi // world_size),
            "peak_grad_bytes": int(out["peak_grad_bytes"]), "full_grad_bytes": 4 * psi,
            "bytes_sent_per_step": sent // o.steps, "sent_over_4psi": sent / o.steps / (4 * psi),
            "calls": _summed_calls(out["comm"]), "final_loss": out["losses"][-1],
            "step_seconds": seconds / o.steps}


def zero2_rows(results) -> list[str]:
    psi = results[0]["psi"]
    return [f"model: {psi:,} parameters (Ψ); full fp32 gradient 4Ψ = {4 * psi:,} B; "
            f"calls over all steps {results[0]['calls']}"] + _rows(results, [
        RANK, ("grad shard B", 13, ",", _key("shard_bytes")), ("predicted 4Ψ/N", 15, ",", _key("predicted_shard_bytes")),
        ("peak .grad B", 13, ",", _key("peak_grad_bytes")),
        ("of 4Ψ", 6, ".2f", lambda r: r["peak_grad_bytes"] / r["full_grad_bytes"]),
        ("sent B/step", 12, ",", _key("bytes_sent_per_step")), ("sent/(4Ψ)", 9, ".2f", _key("sent_over_4psi")),
        STEP_S])


def zero3_run(rank: int, world_size: int, o: GPTRun) -> dict:
    """Data-parallel training with ZeRO-3 (lab 3): each rank's parameter shards next to
    Σ_units 4⌈Ψ_unit/N⌉ B, the most gathered bytes next to the root unit plus the largest block,
    bytes sent per step over 4Ψ."""
    model, batches = _gpt_and_batches(o, world_size)
    psi = sum(p.numel() for p in model.parameters())
    seconds, out = _timed(o.device, uses("zero3").train_zero3, rank, world_size, model, batches)
    padded = [world_size * -(-n // world_size) for n in out["unit_numels"]]  # blocks, then root
    sent = sum(sum(c["bytes"].values()) for c in out["comm"])
    return {"rank": rank, "psi": psi, "shard_bytes": int(out["shard_bytes"]),
            "predicted_shard_bytes": sum(4 * (n // world_size) for n in padded),
            "peak_live_bytes": int(out["peak_live_bytes"]),
            "predicted_peak_live_bytes": 4 * (padded[-1] + max(padded[:-1])),
            "bytes_sent_per_step": sent // o.steps, "sent_over_4psi": sent / o.steps / (4 * psi),
            "calls": _summed_calls(out["comm"]), "final_loss": out["losses"][-1],
            "step_seconds": seconds / o.steps}


def zero3_rows(results) -> list[str]:
    psi = results[0]["psi"]
    return [f"model: {psi:,} parameters (Ψ); fp32 parameters 4Ψ = {4 * psi:,} B; "
            f"calls over all steps {results[0]['calls']}"] + _rows(results, [
        RANK, ("param shards B", 15, ",", _key("shard_bytes")), ("predicted", 12, ",", _key("predicted_shard_bytes")),
        ("peak gathered B", 16, ",", _key("peak_live_bytes")),
        ("root+block", 12, ",", _key("predicted_peak_live_bytes")),
        ("sent B/step", 12, ",", _key("bytes_sent_per_step")), ("sent/(4Ψ)", 9, ".2f", _key("sent_over_4psi")),
        STEP_S])


def pipeline_run(rank: int, world_size: int, o: PipelineRun) -> dict:
    """The course GPT cut into N stages, one per rank (lab 3), one step of ``--microbatches`` M
    micro-batches of ``--batch`` sequences under the ``--schedule`` (gpipe or 1f1b) that your
    ``make_schedule`` generates: each stage's peak of saved activations next to k × one
    micro-batch's (k = M under GPipe, min(N−s, M) under 1F1B), bytes sent next to M messages
    of b·T·C·4 per neighbour."""
    from labkit.measure import peak_saved_bytes
    from labkit.models import SyntheticData

    code = uses("pipeline")
    cfg, model = _gpt(o)
    M = o.microbatches
    x, y = SyntheticData(o.vocab_size, o.seq, o.batch * M, seed=0).batch(0)
    actions = [[(a[0], a[1]) for a in stage] for stage in code.make_schedule(o.schedule, world_size, M)]
    seconds, out = _timed(o.device, code.pipeline_worker, rank, world_size, cfg, model.state_dict(),
                          actions, x, y, M)
    # one micro-batch's saved activations on this stage, alone (no communication): the unit
    stage, keep = code.split_gpt(model, world_size)[rank], []
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


def pipeline_rows(results) -> list[str]:
    r0 = results[0]
    return [f"{r0['schedule']}, M = {r0['microbatches']} micro-batches; loss {results[-1]['loss']:.4f}; "
            "predicted peak = micro-batches in flight × one's"] + _rows(results, [
        ("stage", 5, "", _key("rank")), ("peak saved B", 13, ",", _key("peak_saved_bytes")),
        ("in flight", 9, "", _key("in_flight")), ("× one B", 11, ",", _key("one_microbatch_bytes")),
        ("predicted", 13, ",", _key("predicted_peak_saved_bytes")), ("sent B", 11, ",", _key("bytes_sent")),
        ("predicted", 11, ",", _key("predicted_bytes_sent")), STEP_S])


def pipeline_check(o: PipelineRun, world_size: int) -> None:
    if o.n_layer % world_size:
        raise UsageError(f"pipeline cuts --n-layer {o.n_layer} blocks into {world_size} stages: use a "
                         f"multiple of the world size {world_size}")
    if o.schedule == "1f1b" and o.microbatches < world_size:
        raise UsageError(f"pipeline --schedule 1f1b needs --microbatches >= the world size {world_size}, "
                         f"got {o.microbatches}")


def sequence_parallel_run(rank: int, world_size: int, o: BlockHalfRun) -> dict:
    """The second half of a GPT block, x + MLP(LayerNorm(x)), with tensor and sequence
    parallelism over the N ranks (lab 5), forward and backward: the LayerNorm's saved bytes next
    to 1/N of one device's, the ring bytes of its all-gathers and reduce-scatters next to those
    of one all-reduce per direction (tensor parallelism's)."""
    from labkit.measure import saved_activation_bytes
    from labkit.models import MLP, GPTConfig

    torch.manual_seed(0)  # the same layer, input and output gradient on every rank
    cfg = GPTConfig(vocab_size=16, block_size=o.seq, n_layer=1, n_head=1, n_embd=o.n_embd)
    ln, mlp = torch.nn.LayerNorm(o.n_embd).to(o.device), MLP(cfg).to(o.device)
    x = torch.randn(o.batch, o.seq, o.n_embd, device=o.device)
    grad_out = torch.randn(o.batch, o.seq, o.n_embd, device=o.device)
    seconds, out = _timed(o.device, uses("sequence_parallel").run_sp, rank, world_size, ln, mlp, x, grad_out)
    full_ln = saved_activation_bytes(lambda: ln(x.clone().requires_grad_()))
    ring = {phase: int(sum(out[phase]["ring"].values())) for phase in ("forward", "backward")}
    return {"rank": rank, "ln_saved_bytes": int(out["ln_saved_bytes"]),
            "full_ln_saved_bytes": int(full_ln), "predicted_ln_saved_bytes": int(full_ln) // world_size,
            "forward_ring_bytes": ring["forward"], "backward_ring_bytes": ring["backward"],
            "all_reduce_ring_bytes": int(out["all_reduce_ring_bytes"]),
            "forward_calls": out["forward"]["calls"], "backward_calls": out["backward"]["calls"],
            "step_seconds": seconds}


def sequence_parallel_rows(results) -> list[str]:
    r0 = results[0]
    return [f"LayerNorm on one device saves {r0['full_ln_saved_bytes']:,} B; collectives "
            f"forward {r0['forward_calls']}, backward {r0['backward_calls']}"] + _rows(results, [
        RANK, ("LN saved B", 11, ",", _key("ln_saved_bytes")),
        ("predicted 1/N", 13, ",", _key("predicted_ln_saved_bytes")),
        ("ring B fwd", 11, ",", _key("forward_ring_bytes")), ("ring B bwd", 11, ",", _key("backward_ring_bytes")),
        ("all-reduce ring B", 17, ",", _key("all_reduce_ring_bytes")), STEP_S])


def sequence_parallel_check(o: BlockHalfRun, world_size: int) -> None:
    if (4 * o.n_embd) % world_size or o.seq % world_size:
        raise UsageError(f"sequence_parallel splits the MLP's 4·--n-embd = {4 * o.n_embd} columns and --seq "
                         f"{o.seq} positions over {world_size} ranks: use multiples of the world size {world_size}")


def plan_from_config(config: str, world_size: int):
    """``--config`` → a ``run_plan.Plan`` of ``world_size`` ranks (UsageError if it cannot be).

    ``config`` is a name of ``run_plan.PLANS`` (``tp2xdp2``, ``pp2xdp2``, ``zero3x4``…) or tokens
    joined by ``x``: ``dpN``, ``tpN``, ``ppN``, ``zeroK``, ``mN`` (micro-batches), ``gpipe``,
    ``1f1b``, ``ckpt``; the data-parallel size is what the other axes leave."""
    code = uses("plan")
    if config in code.PLANS:
        plan = code.PLANS[config]
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
                                 f"zeroK, mN, gpipe, 1f1b, ckpt joined by 'x', or one of {', '.join(code.PLANS)}")
        inner = sizes["tp"] * sizes["pp"]
        if sizes["dp"] is None:
            if inner < 1 or world_size % inner:
                raise UsageError(f"--config {config!r}: tp·pp = {inner} does not divide the world size {world_size}")
            sizes["dp"] = world_size // inner
        plan = code.Plan(**sizes, **fields)
    if plan.world_size != world_size:
        raise UsageError(f"--config {config!r} needs dp·pp·tp = {plan.world_size} ranks, the job has "
                         f"{world_size}: use --nproc-per-node (times nodes) = {plan.world_size}")
    return plan


def plan_run(rank: int, world_size: int, o: PlanRun) -> dict:
    """The course GPT trained under a parallel plan (lab 7, ``--config``; ``--batch`` is
    sequences per replica): each rank's MemTracker peak next to ``run_plan.predict_peak``, bytes
    sent per step, and the loss per step."""
    from labkit.comm_count import count_comm
    from labkit.models import SyntheticData

    code, plan = uses("plan"), plan_from_config(o.config, world_size)
    cfg, model = _gpt(o)  # the same initial model and batches on every rank
    data = SyntheticData(o.vocab_size, o.seq, o.batch * plan.dp, seed=0)
    batches = [data.batch(step) for step in range(o.steps)]
    with count_comm() as c:
        out = code.run_plans_worker(rank, world_size, [plan], cfg, model.state_dict(), batches)[0]
    return {"rank": rank, "plan": out["label"], "coords": out["coords"], "peak_bytes": out["peak"],
            "predicted_peak_bytes": code.predict_peak(plan, cfg, o.batch * plan.dp, rank),
            "at_peak": out["at_peak"], "bytes_sent_per_step": sum(c.bytes_sent.values()) // o.steps,
            "calls": dict(c.calls), "losses": out["losses"], "step_seconds": out["seconds"] / o.steps}


def plan_rows(results) -> list[str]:
    def losses(r):
        return "-" if r["losses"][0] is None else " ".join(f"{v:.4f}" for v in r["losses"])

    def coords(r):
        c = r["coords"]
        return f"{c['dp']:>3},{c['pp']},{c['tp']:<3}"

    return [f"plan: {results[0]['plan']}; peak per rank (MemTracker) next to run_plan.predict_peak"] + _rows(results, [
        RANK, ("dp,pp,tp", 9, "", coords), ("peak B", 12, ",", _key("peak_bytes")),
        ("predicted B", 12, ",", _key("predicted_peak_bytes")),
        ("gap", 7, "+.1%", lambda r: r["peak_bytes"] / r["predicted_peak_bytes"] - 1),
        ("sent B/step", 12, ",", _key("bytes_sent_per_step")), STEP_S, ("losses", 0, "", losses)])


def plan_check(o: PlanRun, world_size: int) -> None:
    plan = plan_from_config(o.config, world_size)
    if o.n_head % plan.tp:
        raise UsageError(f"--config {o.config!r}: tp = {plan.tp} must divide --n-head {o.n_head}")
    if o.n_layer % plan.pp:
        raise UsageError(f"--config {o.config!r}: pp = {plan.pp} must divide --n-layer {o.n_layer}")
    if o.batch % plan.n_micro:
        raise UsageError(f"--config {o.config!r}: {plan.n_micro} micro-batches must divide --batch "
                         f"{o.batch} (sequences per replica)")


# ------------------------------------------------------------------ the registry

@dataclass(frozen=True)
class Demo:
    """One demo: ``run(rank, world_size, options)`` → this rank's figures (a dict),
    ``rows(results)`` → its table's lines, ``check(options, world_size)`` → UsageError if the
    job cannot run it. ``cpu_only``: its course modules keep their buffers on the CPU
    (``cpu_reason`` says which)."""

    name: str
    options: type
    run: Callable
    rows: Callable
    check: Callable | None = None
    cpu_reason: str | None = None
    defaults: dict = dataclasses.field(default_factory=dict)  # option defaults of this demo

    @property
    def cpu_only(self) -> bool:
        return self.cpu_reason is not None


REGISTRY = {d.name: d for d in (
    Demo("zero1", GPTRun, zero1_run, zero1_rows),
    Demo("ring_attention", RingRun, ring_attention_run, ring_attention_rows, ring_attention_check,
         defaults={"seq": 256, "batch": 1}),
    Demo("tensor_parallel", LayerRun, tensor_parallel_run, tensor_parallel_rows, tensor_parallel_check),
    Demo("zero2", ZeRO2Run, zero2_run, zero2_rows),
    Demo("zero3", GPTRun, zero3_run, zero3_rows, cpu_reason="labkit.lab3.zero3 keeps its shards and buffers on the CPU"),
    Demo("pipeline", PipelineRun, pipeline_run, pipeline_rows, pipeline_check,
         cpu_reason="labkit.lab3.pipeline's run_stage receives into CPU buffers"),
    Demo("sequence_parallel", BlockHalfRun, sequence_parallel_run, sequence_parallel_rows, sequence_parallel_check),
    Demo("plan", PlanRun, plan_run, plan_rows, plan_check,
         cpu_reason="labkit.lab3.pipeline and labkit.lab3.zero3 keep their buffers on the CPU"),
)}
DEMOS = tuple(REGISTRY)
CPU_ONLY = tuple(name for name, d in REGISTRY.items() if d.cpu_only)


def demo_options(demo: str, args: argparse.Namespace, world_size: int, device: str):
    """The demo's options from the command line: what was given, else the demo's default, else
    the lab's sizes (``labkit.models.lab_config``); checked against the job (UsageError)."""
    from labkit.models import lab_config

    if demo not in REGISTRY:
        raise UsageError(f"unknown demo {demo!r}: choose one of {', '.join(DEMOS)}")
    d = REGISTRY[demo]
    for name in ("steps", "n_layer", "n_embd", "n_head", "vocab_size", "batch", "seq", "heads", "head_dim",
                 "bucket_kb", "microbatches"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if d.cpu_only and device != "cpu":
        raise UsageError(f"{demo} runs on the CPU only ({d.cpu_reason}): use --device cpu")
    cfg = lab_config(device)
    lab = {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head, "vocab_size": cfg.vocab_size,
           "seq": cfg.block_size, "batch": 4, "microbatches": 2 * world_size, "device": device}
    values = {}
    for f in dataclasses.fields(d.options):
        given = getattr(args, f.name, None) if f.name != "device" else None
        if given is not None:
            values[f.name] = given
        elif f.name in d.defaults or f.name in lab:
            values[f.name] = d.defaults.get(f.name, lab.get(f.name))
    options = d.options(**values)
    if hasattr(options, "n_head") and hasattr(options, "n_embd") and options.n_embd % options.n_head:
        raise UsageError(f"--n-embd {options.n_embd} must be a multiple of --n-head {options.n_head}")
    if d.check is not None:
        d.check(options, world_size)
    return options


def table(demo: str, results: list[dict], world_size: int, backend: str, device: str) -> str:
    """Rank 0's report: the demo's rows, then ``json: {...}``."""
    lines = [f"{demo} on {world_size} rank(s), {backend} on {device.split(':')[0]}"]
    lines += REGISTRY[demo].rows(results)
    lines.append("json: " + json.dumps({"demo": demo, "world_size": world_size, "ranks": results}))
    return "\n".join(lines)


def run_demos(rank: int, world_size: int, calls: list) -> list[dict]:
    """Run the demos ``calls = [(name, options or their keyword arguments), ...]`` one after
    another on this rank (what ``launch`` runs, inside torchrun or from a test)."""
    out = []
    for name, options in calls:
        d = REGISTRY[name]
        out.append(d.run(rank, world_size, options if isinstance(options, d.options) else d.options(**options)))
    return out


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
    p.add_argument("--steps", type=int, default=3, help="zero1/2/3, plan: training steps (default 3)")
    p.add_argument("--n-layer", type=int, default=None, help="GPT demos: layers (default: the lab's)")
    p.add_argument("--n-embd", type=int, default=None, help="GPT and layer demos: width (default: the lab's)")
    p.add_argument("--n-head", type=int, default=None, help="GPT demos, tensor_parallel: heads (default: the lab's)")
    p.add_argument("--vocab-size", type=int, default=None, help="GPT demos: vocabulary (default: the lab's)")
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


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        for demo in args.demo:
            if demo not in REGISTRY:
                raise UsageError(f"unknown demo {demo!r}: choose one of {', '.join(DEMOS)}")
        rank, world_size, local_rank = _torchrun_env()
        # a CPU-only demo's buffers live on the CPU: there "auto" means the CPU (an explicit cuda is refused)
        cpu_only = any(REGISTRY[d].cpu_only for d in args.demo)
        device = _device("cpu" if cpu_only and args.device == "auto" else args.device, local_rank)
        calls = [(demo, demo_options(demo, args, world_size, device)) for demo in args.demo]
    except UsageError as exc:
        print(f"labkit.cluster: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(1) if device == "cpu" else None
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                            **({"device_id": torch.device(device)} if backend == "nccl" else {}))
    try:
        from labkit.ranks import launch

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
