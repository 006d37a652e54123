"""Tiny per-rank functions for :func:`labkit.ranks.launch`: its tests, its notebook, its chapter.

They live in an importable module because a *spawned* rank finds its function by importing it
by name (a notebook cell or a test body cannot be imported). Each takes ``(rank, world_size)``
first, like every function that ``launch`` runs.
"""
from __future__ import annotations

import os
import subprocess
import time

import torch
import torch.distributed as dist

from labkit.comm_count import count_comm


def all_reduce_ranks(rank: int, world_size: int, n: int = 4) -> dict:
    """Sum the tensors ``full(n, rank + 1)`` over all ranks: every element is N(N+1)/2."""
    x = torch.full((n,), float(rank + 1))  # (n,)
    dist.all_reduce(x)
    return {"rank": rank, "pid": os.getpid(), "sum": x}


def fail_on_rank(rank: int, world_size: int, bad_rank: int = 1,
                 message: str = "rank-specific failure") -> None:
    """``bad_rank`` raises ``NotImplementedError(message)``; the others wait in an all-reduce
    that can never complete, as they would if a real exercise failed on one rank."""
    if rank == bad_rank:
        raise NotImplementedError(message)
    dist.all_reduce(torch.ones(1))


def hang_on_rank(rank: int, world_size: int, stuck_rank: int = 1, pid_dir: str | None = None) -> None:
    """``stuck_rank`` starts a helper process and sleeps forever; the others wait in a barrier.

    Each rank writes its pid (and the stuck rank its helper's pid) to ``pid_dir`` so a test can
    check that nothing survives the launch.
    """
    pids = [os.getpid()]
    if rank == stuck_rank:
        pids.append(subprocess.Popen(["sleep", "600"]).pid)  # a grandchild that must die too
    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{rank}.pids"), "w") as f:
            f.write(" ".join(map(str, pids)))
    if rank == stuck_rank:
        while True:
            time.sleep(1)
    dist.barrier()


def return_unless_rank(rank: int, world_size: int, stuck_rank: int = 1) -> int:
    """Every rank but ``stuck_rank`` returns its rank at once (and waits in ``launch``'s closing
    barrier); ``stuck_rank`` sleeps forever: the one rank still inside the function."""
    while rank == stuck_rank:
        time.sleep(1)
    return rank


def where_started(rank: int, world_size: int, env_name: str = "LABKIT_EXAMPLE") -> dict:
    """This rank's process id, its parent's (the zygote's, under forkserver) and the value of
    the environment variable ``env_name`` as this rank sees it."""
    return {"rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "env": os.environ.get(env_name)}


# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor for these new names
# (same c10d operators, so count_comm reports them under the old names).
all_gather_into_tensor = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def count_basic_comm(rank: int, world_size: int, n: int = 1000) -> dict:
    """Count one all-reduce, all-gather and reduce-scatter of ``n`` float32 each (the all-gather
    output and the reduce-scatter input are N·n), and one send from rank 0 to rank 1."""
    x = torch.ones(n)  # (n,) float32: 4n bytes
    gathered = torch.empty(world_size * n)  # (N*n,)
    with count_comm() as counts:
        dist.all_reduce(x)
        all_gather_into_tensor(gathered, x)
        reduce_scatter_tensor(x, gathered)
        if rank == 0:
            dist.send(x, dst=1)
        elif rank == 1:
            dist.recv(x, src=0)
    return {"calls": dict(counts.calls), "bytes_sent": dict(counts.bytes_sent),
            "ring_bytes": dict(counts.ring_bytes)}


def change_arguments_in_place(rank: int, world_size: int, tensor: torch.Tensor,
                              model: torch.nn.Module, state: dict) -> dict:
    """Change every argument in place (a tensor, a module's parameters, a dict) and report what
    this rank then sees: ``launch`` must give each rank its own copy, so the caller's objects
    stay as they were."""
    with torch.no_grad():
        tensor.add_(rank + 1)
        for p in model.parameters():
            p.add_(rank + 1)
    state["touched_by"] = rank
    return {"tensor": tensor.clone(), "weight": model.weight.detach().clone(),
            "state": dict(state), "shared": tensor.is_shared()}


def count_both_spellings(rank: int, world_size: int, new_names: bool | None = None, n: int = 8):
    """Count one all-gather and one reduce-scatter of ``n`` float32 per rank, spelled with torch
    2.13's names (``all_gather_single``, ``reduce_scatter_single``) on rank 1 and with the older
    ones on rank 0 (where torch has the new names; else both ranks use the old ones)."""
    import warnings

    use_new = (rank == 1) if new_names is None else new_names
    gather = getattr(dist, "all_gather_single", None) if use_new else None
    scatter = getattr(dist, "reduce_scatter_single", None) if use_new else None
    x, out = torch.ones(n), torch.empty(world_size * n)
    with warnings.catch_warnings():  # the old names warn from torch 2.13 on
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        with count_comm() as counts:
            (gather or dist.all_gather_into_tensor)(out, x)
            (scatter or dist.reduce_scatter_tensor)(x, out)
    return {"calls": dict(counts.calls), "bytes_sent": dict(counts.bytes_sent)}


def cpu_seconds_so_far(rank: int, world_size: int) -> dict:
    """This rank's CPU seconds since its process began (start-up, imports, joining the group),
    and its process id: what one rank costs to start (``tools/launch_cost.py``)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"rank": rank, "pid": os.getpid(), "cpu_s": usage.ru_utime + usage.ru_stime}
