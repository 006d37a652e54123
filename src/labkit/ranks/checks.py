"""Refuse bad input to ``launch`` before any process starts, naming the argument and what is allowed."""
from __future__ import annotations

import multiprocessing as mp
import os

import torch
import torch.distributed as dist

from labkit.ranks.methods import BACKENDS, START_METHODS
from labkit.validate import is_int

MAX_TIMEOUT = 10**7
"""The longest ``timeout`` (seconds, about 116 days): any finite deadline a launch can mean."""

MAX_WORLD_SIZE = 64
"""The most ranks ``launch`` starts on one machine: each is a process with its own copy of the
model, and a typo (``launch(fn, 10**6)``) must be refused, not fork a million processes."""


def _check_launch_arguments(fn, world_size, timeout, backend, start_method) -> None:
    """Bad input → ValueError/TypeError naming the argument and what is allowed."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable fn(rank, world_size, ...), got {type(fn).__name__}")
    if not is_int(world_size):
        raise TypeError(f"world_size must be an int in [1, {MAX_WORLD_SIZE}], got {world_size!r} "
                        f"({type(world_size).__name__})")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be an int in [1, {MAX_WORLD_SIZE}], got {world_size}: each "
                         "rank is a process on this machine (the labs use 1 to 8); a larger job runs "
                         "under torchrun on a cluster (labkit.cluster)")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not 0 < timeout <= MAX_TIMEOUT:  # NaN fails too; past ~10**13 s a rank's timedelta overflows
        raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {timeout!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA GPUs and none is available here; use backend='gloo'")
    if start_method is not None and start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS} or None, got {start_method!r}")
    if start_method == "fork" and "fork" not in mp.get_all_start_methods():
        raise ValueError("start_method='fork' does not exist on this system; use 'spawn' or None")


def _check_gpus_for_nccl(world_size: int, backend: str) -> None:
    """NCCL refuses two ranks on one GPU: say so before starting any, not as a rank's crash."""
    if backend != "nccl":
        return
    gpus = torch.cuda.device_count()
    if world_size > gpus:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} ranks, and this machine "
            f"has {gpus} GPU{'s' if gpus != 1 else ''} (NCCL refuses two ranks on one GPU). Use "
            f"backend='gloo' (the ranks compute on the CPU, as every lab does) or world_size <= {gpus}")


def _torchrun_group(world_size: int) -> int | None:
    """This process's rank if it is one rank of an initialised group of ``world_size`` ranks that
    torchrun started (``TORCHELASTIC_RUN_ID`` or ``RANK`` set); else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if "TORCHELASTIC_RUN_ID" not in os.environ and "RANK" not in os.environ:
        return None
    if dist.get_world_size() != world_size:
        raise ValueError(f"world_size={world_size} inside a group of {dist.get_world_size()} ranks (a "
                         "rank of launch, or of a torchrun job): launch runs fn here, on the existing "
                         f"group, so world_size must be {dist.get_world_size()} (torchrun's "
                         "--nproc-per-node sets it); launch cannot start ranks from inside a rank")
    return dist.get_rank()


def _check_call(fn, args: tuple, kwargs: dict) -> None:
    """``fn(rank, world_size, *args, **kwargs)`` must bind: a TypeError naming ``fn`` here, not
    the same TypeError raised N times in N ranks (e.g. a keyword argument named ``rank``)."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return
    try:
        signature.bind(0, 1, *args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        given = ", ".join(["rank", "world_size"] + [f"<{len(args)} positional>"] * bool(args)
                          + [f"{k}=" for k in kwargs])
        raise TypeError(f"fn {name}{signature} cannot be called as {name}({given}): {exc}. launch "
                        "calls fn(rank, world_size, *args, **kwargs) with the arguments given after "
                        "world_size (keyword arguments named rank or world_size clash with those)") from None

