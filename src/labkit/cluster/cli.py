"""The command line of :mod:`labkit.cluster`: ``torchrun ... -m labkit.cluster DEMO [DEMO...] [options]``.

Checks everything it can before a process group exists (the demo names, torchrun's variables,
the device, each option against the job, through the demo's ``check``), then joins the group,
runs the demos one after another through :func:`labkit.ranks.launch`, and has rank 0 print each
table (:func:`labkit.cluster.table`).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys

import torch
import torch.distributed as dist

from labkit.cluster.common import UsageError
from labkit.cluster.registry import DEMOS, demo, run_demos, table
from labkit.models import lab_config
from labkit.ranks import launch
from labkit.ranks.checks import MAX_TIMEOUT


def demo_options(name: str, args: argparse.Namespace, world_size: int, device: str):
    """The demo's options from the command line: what was given, else the demo's default, else
    the lab's sizes (``labkit.models.lab_config``); checked against the job (UsageError)."""
    d = demo(name)
    for option in ("steps", "n_layer", "n_embd", "n_head", "vocab_size", "batch", "seq", "heads", "head_dim",
                   "bucket_kb", "microbatches"):
        value = getattr(args, option, None)
        if value is not None and value < 1:
            raise UsageError(f"--{option.replace('_', '-')} must be >= 1, got {value}")
    if not 0 < args.timeout <= MAX_TIMEOUT:  # inf or 1e20 overflowed init_process_group's timedelta
        raise UsageError(f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {args.timeout}")
    if d.cpu_only and device != "cpu":
        raise UsageError(f"{name} runs on the CPU only ({d.cpu_reason}): use --device cpu")
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


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables; UsageError if any is missing."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise UsageError(f"not started by torchrun ({', '.join(missing)} unset): run "
                         "`torchrun --standalone --nproc-per-node 2 -m labkit.cluster <demo>`")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def pick_device(choice: str, local_rank: int) -> str:
    """``"cuda:<local rank>"`` (and that GPU made current) or ``"cpu"``, from ``--device``."""
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
        for name in args.demo:
            if name not in DEMOS:
                raise UsageError(f"unknown demo {name!r}: choose one of {', '.join(DEMOS)}")
        rank, world_size, local_rank = torchrun_env()
        # a CPU-only demo's buffers live on the CPU: there "auto" means the CPU (an explicit cuda is refused)
        cpu_only = any(demo(name).cpu_only for name in args.demo)
        device = pick_device("cpu" if cpu_only and args.device == "auto" else args.device, local_rank)
        calls = [(name, demo_options(name, args, world_size, device)) for name in args.demo]
    except UsageError as exc:
        print(f"labkit.cluster: {exc}", file=sys.stderr)
        return 2
    if device == "cpu":
        torch.set_num_threads(1)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                            **({"device_id": torch.device(device)} if backend == "nccl" else {}))
    try:
        mine = launch(run_demos, world_size, calls=calls)[0]  # inside torchrun: runs here, on this group
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            for i, (name, _) in enumerate(calls):
                print(table(name, [g[i] for g in gathered], world_size, backend, device), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
