"""The child's side: one rank joins the group, runs ``fn``, reports back and exits."""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import io
import os
import pickle
import signal
import sys
import traceback

import torch
import torch.distributed as dist


class _ResultPickler(pickle.Pickler):
    """Plain pickle (not torch's shared-memory reductions, which die with the child);
    tensors are detached and moved to CPU first."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "meta":  # no data to copy: its
            return _meta_tensor, (tuple(obj.shape), obj.dtype)  # shape and dtype come back
        if isinstance(obj, torch.Tensor) and (obj.requires_grad or obj.device.type != "cpu"):
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _meta_tensor(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """In the parent: a rank's meta tensor (shape and dtype, no data), as it was."""
    return torch.empty(shape, dtype=dtype, device="meta")


_INHERITED_WORLDS: list = []  # a forked rank's copies of the parent's process groups, never used


def _forget_inherited_group() -> None:
    """Start a forked rank from an empty process-group world.

    A rank forked from a process that has a process group of its own (a one-rank gloo group for a
    benchmark, say) inherits a copy of it, and joining the launch's group would fail ("trying to
    initialize the default process group twice"); destroying the copy could wait on threads that
    fork did not copy. So the copy is set aside, still referenced (no destructor runs: the rank
    leaves with ``os._exit``), and torch's world (``distributed_c10d._world``, which torch names
    an extension point) starts empty."""
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        _INHERITED_WORLDS.append(c10d._world)
        c10d._world = c10d._World()


def _format_child_exception(exc: BaseException) -> str:
    tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # drop _run_rank's own frame
    text = "".join(traceback.format_exception(type(exc), exc, tb)).rstrip("\n")
    stub_line = f"{type(exc).__name__}: {exc}"
    if str(exc).startswith("exercise ") and not text.endswith(stub_line):
        text += "\n" + stub_line  # the grader finds "not attempted" by this exact last line
    return text


def _become_independent(parent_pid: int) -> None:
    """Own process group (the parent kills us and our children at once); die with the parent.

    ``parent_pid``: the process that started us (``launch``'s, or the zygote's under forkserver,
    which itself exits when ``launch``'s process does)."""
    if hasattr(os, "setsid"):
        os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl
            os._exit(1)


def _run_rank(fn, rank, world_size, args, kwargs, port, backend, pg_timeout, conn, stack_path, parent_pid,
              payload=None):
    """Body of one child process: join the group, run ``fn``, report back, exit.

    ``payload``: under forkserver and spawn, ``(fn, args, kwargs)`` pickled by value in the
    parent (then ``fn`` is None and ``args``, ``kwargs`` are empty). The result goes to the
    parent as soon as ``fn`` returns, *before* the closing barrier: a rank that finished is
    never mistaken for one still inside ``fn`` (it may wait in the barrier for a slow peer)."""
    torch.set_num_threads(1)  # first of all: see the module docstring
    _become_independent(parent_pid)
    code, message = 0, None
    try:
        if payload is not None:
            fn, args, kwargs = pickle.loads(payload)
        _forget_inherited_group()
        if hasattr(signal, "SIGUSR1"):  # the parent asks for our stack at the deadline
            stack_file = open(stack_path, "a")  # noqa: SIM115 - must stay open until exit
            faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))  # as torchrun does
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args, **kwargs)
        buffer = io.BytesIO()
        try:
            _ResultPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(result)
        except Exception as exc:
            raise TypeError(f"rank {rank} returned a value that cannot be pickled back: {exc}") from exc
        message = ("ok", buffer.getvalue())
        conn.send(message)  # returned: from now on this rank is done, whatever its peers do
        if dist.is_initialized():  # no rank leaves while a peer may still read from it
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - report everything, SystemExit included
        code = 1
        if message is None:  # an error after the result was sent (the barrier) is no news
            message = ("error", type(exc).__name__, str(exc), _format_child_exception(exc))
            with contextlib.suppress(Exception):
                conn.send(message)
    try:
        conn.close()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: gloo threads may still be blocked
