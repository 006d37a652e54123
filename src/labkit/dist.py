"""Launch N real ``torch.distributed`` ranks from a notebook or a test, and get their results back.

Every distributed lab (data parallel, ZeRO, FSDP, tensor and pipeline parallel) runs its code on
real process groups: ``launch(fn, 4)`` starts 4 processes, each joins one gloo group over TCP on
127.0.0.1 and calls ``fn(rank, world_size, ...)``; the parent gets back each rank's return value
in rank order. gloo runs on CPU everywhere, including a single-GPU Colab where NCCL refuses two
ranks on one GPU; the same ``fn`` runs under ``torchrun`` with NCCL on a real cluster.

Mechanism, and the choices behind it:

- **fork, not spawn, when it is safe.** A forked child starts as a copy of the parent, torch
  already imported and ``fn`` already defined (even in a notebook cell), so a launch costs
  ~0.1-0.6 s; a spawned child starts a fresh interpreter and imports torch again (4-11 s) and
  can only run functions it can import by name. A forked child cannot use CUDA once the parent
  has touched the driver (``torch.cuda.is_available()`` is enough: every lab calls it through
  ``default_device()``), so ``launch`` does not fork whenever the ranks may use CUDA: CUDA
  already initialised here, ``backend="nccl"``, a ``device`` keyword argument that names CUDA,
  or a CUDA tensor or module among the arguments (see :func:`start_method_for`).
- **forkserver, not spawn, when fork is unsafe.** Then the ranks are forked from a *zygote*:
  one clean process (multiprocessing's forkserver) that imported torch once and never touches
  CUDA, started on the first such launch and kept until this process ends (it is restarted if
  ``os.environ`` changes, since its children inherit its environment). Each rank still starts
  as a new process, imports ``fn``'s module fresh (an edit to labkit is always seen: the zygote
  holds torch only, never the course's code) and can use CUDA; it costs what a fork costs,
  not a fresh interpreter's import of torch (see ``tools/launch_cost.py`` for the figures).
  ``start_method="spawn"`` still gives a fresh interpreter per rank.
- **A function is sent by name, as its module defines it now.** Under forkserver and spawn a
  rank imports ``fn`` (and any function or class among the arguments) by module and qualified
  name. After IPython's ``%autoreload 2`` has reloaded an edited module, a name imported before
  the edit still points at the old object, which ``pickle`` refuses ("it's not the same object
  as ..."); ``launch`` looks each one up again in its module and sends the current definition.
- **Arguments by value, always.** A forked child works on a copy-on-write copy of the parent's
  memory. A spawned child receives its arguments through a pipe, and multiprocessing's pickler,
  as torch extends it, would move CPU tensors into shared memory: every rank would then train
  the parent's own model in place. So under spawn ``launch`` pickles ``(args, kwargs)`` to bytes
  with the plain pickler in the parent and unpickles them in the child: each rank gets its own
  copy, as under fork, and no change made by a rank reaches the parent.
- **Inside torchrun**, ``launch`` starts nothing: when the process already belongs to a
  process group of ``world_size`` ranks (``torchrun`` set ``RANK``/``WORLD_SIZE`` and the group
  exists), it runs ``fn(rank, world_size, ...)`` here and returns ``[this rank's result]``; see
  :mod:`labkit.cluster`.
- **``torch.set_num_threads(1)`` first, in every child.** The parent's intra-op thread pool
  does not exist in the forked child, and a child that enters a parallel region before resizing
  the pool can hang; N ranks of many threads each would also oversubscribe the cores.
- **The caller never hangs.** The process group gets a timeout a little under ``timeout`` (a
  rank stuck in a collective gives up by itself), the parent waits with an outer deadline, and
  on any exit (result, error, deadline, Ctrl-C) it kills each child's whole process group.
  A failing rank's traceback is re-raised in the parent as :class:`RankError`; at the deadline
  the parent prints where the unfinished ranks were stuck and raises :class:`RankTimeout`,
  naming only the ranks still inside ``fn``: each rank sends its result *before* the closing
  barrier, so a rank that returned and waits there for a slow peer is never the one blamed.
- **Collectives never run in the parent.** A mismatched collective can abort the process that
  runs it; here that is a child, never the notebook kernel or the pytest process.

Count a rank's communication with :func:`count_comm` (from :mod:`labkit.comm_count`).
Used in: every distributed chapter of ``book/`` and its lab in ``labs/``.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import types
import warnings
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.comm_count import CommCounts, count_comm

__all__ = ["launch", "start_method_for", "RankError", "RankTimeout", "count_comm", "CommCounts"]


class RankError(RuntimeError):
    """A rank raised (or died); ``str()`` holds the child's full traceback.

    ``rank``: the rank reported; ``ranks``: all failed ranks; ``exc_type``: the child's exception
    class name (``"NotImplementedError"``; None if it died silently); ``child_traceback``: its
    formatted traceback; ``pids``: the children's process ids, all dead by now.
    """

    def __init__(self, message, *, rank, ranks, exc_type, child_traceback, pids):
        super().__init__(message)
        self.rank, self.ranks, self.exc_type = rank, ranks, exc_type
        self.child_traceback, self.pids = child_traceback, pids


class RankTimeout(RankError, TimeoutError):
    """Some ranks had not finished at the deadline; ``ranks`` names them, ``exc_type`` is None."""


BACKENDS = ("gloo", "nccl")
START_METHODS = ("fork", "forkserver", "spawn")


def _mentions_cuda(obj, depth: int = 0) -> bool:
    """True if ``obj`` is (or holds, one container level down) a CUDA tensor, module or device."""
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "cuda"
    if isinstance(obj, torch.nn.Module):
        return any(t.device.type == "cuda" for t in obj.parameters()) or \
            any(t.device.type == "cuda" for t in obj.buffers())
    if isinstance(obj, torch.device):
        return obj.type == "cuda"
    if isinstance(obj, str):
        return obj == "cuda" or obj.startswith("cuda:")
    if depth < 2 and isinstance(obj, (list, tuple, set)):
        return any(_mentions_cuda(o, depth + 1) for o in obj)
    if depth < 2 and isinstance(obj, dict):
        return any(_mentions_cuda(o, depth + 1) for o in obj.values())
    return False


def start_method_for(backend: str = "gloo", args: tuple = (), kwargs: dict | None = None) -> str:
    """The start method ``launch`` uses by default: never ``"fork"`` when the ranks may use CUDA.

    Not fork if CUDA is initialised in this process, or the backend is ``"nccl"``, or a ``device``
    keyword argument names CUDA, or an argument is (or holds) a CUDA tensor or module: then
    ``"forkserver"`` (ranks forked from a clean process that imported torch once), or
    ``"spawn"`` where forkserver does not exist (Windows). Otherwise fork, which starts a rank
    in a fraction of a second.
    """
    kwargs = kwargs or {}
    wants_cuda = (torch.cuda.is_initialized() or backend == "nccl"
                  or _mentions_cuda(kwargs.get("device")) or _mentions_cuda(args)
                  or _mentions_cuda({k: v for k, v in kwargs.items() if k != "device"}))
    methods = mp.get_all_start_methods()
    if "fork" in methods and not wants_cuda:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


def _default_start_method() -> str:  # kept for callers of the old name
    return start_method_for()


def _by_name(module: str, qualname: str):
    """In a rank: the object ``module.qualname`` (how :class:`_CurrentPickler` sends a definition)."""
    import importlib

    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def current_definition(obj):
    """``obj``'s module's current object of the same name, if ``obj`` is a stale function or class.

    After a module is reloaded (IPython's ``%autoreload 2`` on an edited file), a function or
    class imported *before* the edit is no longer the object its module holds under that name;
    pickle sends such objects by name and refuses them ("it's not the same object as ...").
    Returns the module's object when it has the same qualified name (the code a rank importing
    it by name gets), else ``obj`` itself.
    """
    if not isinstance(obj, (types.FunctionType, type)):
        return obj
    module, qualname = sys.modules.get(getattr(obj, "__module__", None) or ""), obj.__qualname__
    if module is None or "<" in qualname:
        return obj
    current = module
    for part in qualname.split("."):
        current = getattr(current, part, None)
        if current is None:
            return obj
    same_kind = isinstance(current, (types.FunctionType, type))
    return current if same_kind and getattr(current, "__qualname__", None) == qualname else obj


class _CurrentPickler(pickle.Pickler):
    """Plain pickle (no shared memory: the child gets a copy, never the parent's storage) that
    sends a stale function or class (see :func:`current_definition`) as its current definition."""

    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)):
            current = current_definition(obj)
            if current is not obj:
                return _by_name, (current.__module__, current.__qualname__)
        return NotImplemented


def _dumps_by_value(obj, what: str, method: str = "spawn") -> bytes:
    """``obj`` pickled by value with :class:`_CurrentPickler`; TypeError naming ``what`` if it cannot be."""
    try:
        buffer = io.BytesIO()
        _CurrentPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return buffer.getvalue()
    except Exception as exc:  # noqa: BLE001 - any pickling failure means the same thing
        raise TypeError(f"launch(..., start_method={method!r}) cannot copy {what} to the ranks: {exc}. "
                        "Spawned (and forkserver) ranks receive their arguments pickled; pass tensors, modules and "
                        "plain values (a tensor that is the result of an operation needing grad: "
                        "pass .detach())") from exc


def _check_launch_arguments(fn, world_size, timeout, backend, start_method) -> None:
    """Bad input → ValueError/TypeError naming the argument and what is allowed."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable fn(rank, world_size, ...), got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int >= 1, got {world_size!r} ({type(world_size).__name__})")
    if world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not timeout > 0 or timeout != timeout or timeout == float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA GPUs and none is available here; use backend='gloo'")
    if start_method is not None and start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS} or None, got {start_method!r}")
    if start_method == "fork" and "fork" not in mp.get_all_start_methods():
        raise ValueError("start_method='fork' does not exist on this system; use 'spawn' or None")


def _check_spawnable(fn, method: str) -> None:
    """A spawned child finds ``fn`` by importing its module: refuse what it cannot import."""
    qualname, reason = getattr(fn, "__qualname__", repr(fn)), None
    if "<lambda>" in qualname or "<locals>" in qualname:
        reason = "it is a lambda or a function defined inside another function"
    elif getattr(fn, "__module__", None) == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
        reason = "it is defined in a notebook cell or an interactive session"
    else:
        try:
            _CurrentPickler(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
        except Exception as exc:  # noqa: BLE001 - any pickling failure means the same thing
            reason = f"it cannot be pickled ({exc})"
    if reason:
        raise ValueError(
            f"launch(..., start_method={method!r}) cannot send {qualname!r} to the children: {reason}. "
            f"{method.capitalize()}ed ranks import the function by name, so define it at module level in an "
            "importable module (e.g. labkit.<module>), or use start_method='fork' on Linux/macOS "
            "(only while CUDA is not initialised in this process)."
        )


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


_zygote_env: dict | None = None  # os.environ when the forkserver (the zygote) was started
ZYGOTE_PRELOAD = ("torch", "torch.distributed", "torch._dynamo")
"""What the zygote imports once for all its ranks: torch only, never the course's own code."""


def _zygote_context():
    """multiprocessing's forkserver context, its server importing ``ZYGOTE_PRELOAD`` once.

    The server starts on first use and lives until this process ends. Its children inherit its
    environment, not ours: if ``os.environ`` changed since it started, it is stopped and started
    again (sys.path and the working directory go to each child with multiprocessing's own
    preparation data)."""
    global _zygote_env
    import multiprocessing.forkserver as forkserver

    import torch._dynamo  # noqa: F401  sets TORCHINDUCTOR_CACHE_DIR: here first, so the zygote's
    # environment, inherited from ours, is ours after its own preload too
    context, server, env = mp.get_context("forkserver"), forkserver._forkserver, dict(os.environ)
    running = getattr(server, "_forkserver_pid", None) is not None
    if running and _zygote_env is not None and env != _zygote_env and hasattr(server, "_stop"):
        server._stop()
        running = False
    if not running:
        context.set_forkserver_preload(list(ZYGOTE_PRELOAD))
        server.ensure_running()
        _zygote_env = env
    return context


def _zygote_pid() -> int | None:
    import multiprocessing.forkserver as forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _torchrun_group(world_size: int) -> int | None:
    """This process's rank if it is one rank of an initialised group of ``world_size`` ranks that
    torchrun started (``TORCHELASTIC_RUN_ID`` or ``RANK`` set); else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if "TORCHELASTIC_RUN_ID" not in os.environ and "RANK" not in os.environ:
        return None
    if dist.get_world_size() != world_size:
        raise ValueError(f"world_size={world_size} inside a torchrun job of {dist.get_world_size()} "
                         f"ranks: launch runs on the existing group, so world_size must be "
                         f"{dist.get_world_size()} (torchrun --nproc-per-node sets it)")
    return dist.get_rank()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ResultPickler(pickle.Pickler):
    """Plain pickle (not torch's shared-memory reductions, which die with the child);
    tensors are detached and moved to CPU first."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and (obj.requires_grad or obj.device.type != "cpu"):
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


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


_DIST_ERRORS = ("RuntimeError", "DistBackendError", "DistStoreError", "DistNetworkError")


def _is_collective_timeout(exc_type, text: str) -> bool:
    """A rank gave up waiting for a peer (gloo: "Timed out waiting 2000ms for recv ...")."""
    return exc_type in _DIST_ERRORS and any(w in text.lower() for w in ("timed out", "timeout"))


def _is_peer_failure(exc_type, text: str) -> bool:
    """An echo of another rank's death (gloo: "Connection closed by peer")."""
    words = ("connection closed by peer", "connection reset", "broken pipe")
    return exc_type in _DIST_ERRORS and any(w in text.lower() for w in words)


def _ranks_text(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def _read_stacks(procs, ranks, stack_dir) -> dict:
    """Ask each still-running rank for its Python stack (faulthandler, on SIGUSR1)."""
    if not (ranks and hasattr(signal, "SIGUSR1")):
        return {}
    for r in ranks:
        with contextlib.suppress(OSError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.3)
    paths = {r: os.path.join(stack_dir, f"rank{r}.stack") for r in ranks}
    return {r: Path(p).read_text().strip() for r, p in paths.items() if os.path.getsize(p)}


def _kill_all(procs) -> None:
    """Kill each child's process group (the child and anything it started), then reap it."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        with contextlib.suppress(OSError, AttributeError):  # no such group (yet, any more); Windows
            os.killpg(p.pid, signal.SIGKILL)  # group id == child pid after its setsid()
        if p.exitcode is None:
            p.kill()
    for p in started:
        p.join(timeout=10)


def launch(fn, world_size: int, *args, timeout: float = 60.0, backend: str = "gloo",
           start_method: str | None = None, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` new ranks; return their results.

    Each child: ``torch.set_num_threads(1)``; ``init_process_group(backend, rank, world_size,
    init_method="tcp://127.0.0.1:<free port>")`` with a timeout a little under ``timeout``;
    ``fn``; ``destroy_process_group()``. Return values are pickled back (tensors detached and
    moved to CPU).

    Every rank gets its own copy of the arguments (fork: copy-on-write; spawn: pickled by value
    in the parent): what a rank changes in place never reaches the caller's objects.

    Inside a ``torchrun`` job whose process group already has ``world_size`` ranks, nothing is
    started: ``fn(rank, world_size, ...)`` runs in this process and the result is
    ``[this rank's result]``.

    Args:
        fn: the per-rank function; unless forked it must be importable (module level).
        world_size: number of ranks N, an int >= 1.
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
    port = _free_port()
    stack_dir, procs, conns = tempfile.mkdtemp(prefix="labkit-dist-"), [], []
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


def _receive(conn, proc, rank, sentinel_ready: bool):
    """The rank's report, a made-up one if it died without a word, or None if not there yet."""
    with contextlib.suppress(EOFError, OSError):
        if conn.poll(0.1):
            return conn.recv()
    if not sentinel_ready:
        return None
    proc.join(timeout=1)
    return ("error", None, f"exit code {proc.exitcode}",
            f"rank {rank} died (exit code {proc.exitcode}) without reporting (killed by a "
            "signal if negative, e.g. -9 by the out-of-memory killer; or it called os._exit)")


def _collect(procs, conns, fn, world_size, deadline, timeout, pg_timeout, stack_dir) -> list:
    """Wait for every rank's report; raise on the first real error or at the deadline."""
    results, errors, stuck = {}, {}, {}  # rank -> value | (exc_type, message, traceback)
    pending, give_up_at = set(range(world_size)), deadline
    while pending and time.monotonic() < give_up_at:
        ready = set(wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending],
                         timeout=max(0.0, give_up_at - time.monotonic())))
        for r in sorted(pending):
            if conns[r] in ready or procs[r].sentinel in ready:
                message = _receive(conns[r], procs[r], r, procs[r].sentinel in ready)
                if message is None:
                    continue
                pending.discard(r)
                if message[0] == "ok":
                    results[r] = pickle.loads(message[1])
                elif _is_collective_timeout(message[1], message[2]):
                    stuck[r] = message[1:]  # gave up waiting for a peer: a hang, not a bug here
                else:  # wait a moment for the other ranks' errors, longer if this one is an echo
                    errors[r] = message[1:]
                    grace = 1.0 if _is_peer_failure(message[1], message[2]) else 0.2
                    give_up_at = min(give_up_at, time.monotonic() + grace)
    fn_name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    pids = [p.pid for p in procs]
    if errors:
        first = next((r for r in errors if not _is_peer_failure(*errors[r][:2])), next(iter(errors)))
        exc_type, child_tb = errors[first][0], errors[first][2]
        lines = [f"rank {first} of {world_size} "
                 f"{'raised ' + exc_type if exc_type else 'died'} in {fn_name}"]
        lines += [f"  rank {r} also failed: {e[0]}: {e[1].strip()[:300]}"
                  for r, e in errors.items() if r != first]
        lines += [f"  rank {r} gave up waiting in a collective" for r in stuck]
        if pending:
            lines.append(f"  {_ranks_text(pending)} were still running and have been stopped")
        lines += ["", f"Traceback of rank {first}:", child_tb]
        raise RankError("\n".join(lines), rank=first, ranks=sorted(errors), exc_type=exc_type,
                        child_traceback=child_tb, pids=pids)
    if pending or stuck:
        stacks = _read_stacks(procs, sorted(pending), stack_dir)
        unfinished = sorted(pending | set(stuck))
        lines = [f"{_ranks_text(unfinished)} of {world_size} had not finished {fn_name} after "
                 f"{timeout:g} s (launch timeout); every rank has been killed"]
        if results:
            lines.append(f"  {_ranks_text(results)} had returned and waited for the others in "
                         "launch's closing barrier")
        lines += [f"  rank {r} gave up waiting in a collective after the {pg_timeout:g} s "
                  f"process-group timeout (a peer never joined it):\n{stuck[r][2]}" for r in sorted(stuck)]
        lines += [f"  rank {r} was still running; its stack, most recent call first:\n"
                  f"{stacks.get(r, '(no stack: the rank did not answer)')}" for r in sorted(pending)]
        # blame a rank busy in its own code before one waiting for it in a collective
        waiting = {r for r in pending if "distributed_c10d" in stacks.get(r, "")}
        first = min(pending - waiting or pending) if pending else unfinished[0]
        child_tb = stacks.get(first, "") if pending else stuck[first][2]
        raise RankTimeout("\n".join(lines), rank=first, ranks=unfinished, exc_type=None,
                          child_traceback=child_tb, pids=pids)
    return [results[r] for r in range(world_size)]
