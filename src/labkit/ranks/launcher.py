"""``launch``: start N ranks, hand each its work, and return their results (see :mod:`labkit.ranks`)."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

import multiprocessing as mp

from labkit.ranks.checks import _check_call, _check_gpus_for_nccl, _check_launch_arguments, _torchrun_group
from labkit.ranks.collect import _collect, _kill_all
from labkit.ranks.methods import (_check_spawnable, _dumps_by_value, _zygote_context, _zygote_pid,
                                 start_method_for)
from labkit.ranks.rank import _run_rank


@contextlib.contextmanager
def reserved_port():
    """A free TCP port on 127.0.0.1 for a process group's store, kept from others for the block.

    A port found free and closed at once can be taken by another process before rank 0 binds it
    (a make test run saw rank 0 fail with EADDRINUSE: gloo's own connections bind such ports).
    On Linux the port stays bound here, with ``SO_REUSEADDR`` and never listening, until the
    block ends: the kernel gives it to nobody who asks for port 0, while the store, which binds
    with ``SO_REUSEADDR`` too, may still take it (Linux allows that while no socket listens on
    the port). Elsewhere the socket is closed before the block, as a plain free-port probe does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        if not sys.platform.startswith("linux"):
            s.close()
        yield port


def launch(fn, world_size: int, *args, timeout: float = 60.0, backend: str = "gloo",
           start_method: str | None = None, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` new ranks; return their results.

    Each child: ``torch.set_num_threads(1)``; ``init_process_group(backend, rank, world_size,
    init_method="tcp://127.0.0.1:<free port>")`` (see
    :func:`reserved_port`) with a timeout a little under ``timeout``;
    ``fn``; ``destroy_process_group()``. Return values are pickled back (tensors detached and
    moved to CPU).

    Every rank gets its own copy of the arguments (fork: copy-on-write; spawn: pickled by value
    in the parent): what a rank changes in place never reaches the caller's objects.

    Inside a ``torchrun`` job whose process group already has ``world_size`` ranks, nothing is
    started: ``fn(rank, world_size, ...)`` runs in this process and the result is
    ``[this rank's result]``.

    Args:
        fn: the per-rank function; unless forked it must be importable (module level).
        world_size: number of ranks N, an int in [1, MAX_WORLD_SIZE = 64] (each a process here).
        timeout: seconds (> 0) before the parent kills every rank and raises :class:`RankTimeout`.
        backend: ``"gloo"`` (CPU, the default) or ``"nccl"`` (one GPU per rank: refused, before
            any rank starts, when ``world_size`` exceeds the GPUs here).
        start_method: ``"fork"``, ``"forkserver"``, ``"spawn"`` or None (default:
            :func:`start_method_for`, i.e. forkserver whenever the ranks may use CUDA, fork
            otherwise).

    Returns:
        ``[result of rank 0, ..., result of rank N-1]``.

    Raises:
        TypeError, ValueError: bad arguments (named), before any process starts.
        RankError: a rank raised or died; names the rank, carries its traceback.
        RankTimeout: some ranks had not finished after ``timeout`` seconds; names the ranks
            still inside ``fn`` (not those that returned and wait in the closing barrier).
    """
    _check_launch_arguments(fn, world_size, timeout, backend, start_method)
    world_size = int(world_size)  # a numpy integer, say
    _check_call(fn, args, kwargs)
    inside = _torchrun_group(world_size)
    if inside is not None:  # already one rank of a torchrun job: run here, on the existing group
        return [fn(inside, world_size, *args, **kwargs)]
    _check_gpus_for_nccl(world_size, backend)
    method = start_method or start_method_for(backend, args, kwargs)
    payload, parent_pid = None, os.getpid()
    if method == "fork":  # a dispatch mode (count_comm, MemTracker) imports torch._dynamo on
        import torch._dynamo  # noqa: F401  first use (1-3 s): once here, not in every rank
        context = mp.get_context(method)
    else:
        _check_spawnable(fn, method)
        # fn checked above: a failure here is one of the arguments
        payload = _dumps_by_value((fn, args, kwargs), "the arguments", method)
        if method == "forkserver":
            context = _zygote_context()
            parent_pid = _zygote_pid()
        else:
            context = mp.get_context(method)
    started = time.monotonic()
    pg_timeout = timeout - min(max(1.0, 0.1 * timeout), 0.5 * timeout)
    stack_dir, procs, conns = tempfile.mkdtemp(prefix="labkit-dist-"), [], []
    with reserved_port() as port:  # held until every rank is gone
        try:
            for rank in range(world_size):
                receiver, sender = context.Pipe(duplex=False)
                stack_path = os.path.join(stack_dir, f"rank{rank}.stack")
                Path(stack_path).touch()
                direct = (fn, args, kwargs) if payload is None else (None, (), {})
                procs.append(context.Process(target=_run_rank, name=f"labkit-rank{rank}", args=(
                    direct[0], rank, world_size, *direct[1:], port, backend, pg_timeout, sender,
                    stack_path, parent_pid, payload)))
                with warnings.catch_warnings():  # Python 3.12 warns on any fork from a threaded
                    warnings.simplefilter("ignore", DeprecationWarning)  # process (a kernel is)
                    procs[-1].start()
                sender.close()
                conns.append(receiver)
            return _collect(procs, conns, fn, world_size, started + timeout, timeout, pg_timeout, stack_dir)
        finally:
            _kill_all(procs)
            for c in conns:
                c.close()
            shutil.rmtree(stack_dir, ignore_errors=True)
