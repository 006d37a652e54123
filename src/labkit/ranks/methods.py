"""How ranks start (fork, forkserver, spawn) and how a function and its arguments reach them.

See the package docstring (:mod:`labkit.ranks`) for why: fork when the ranks cannot use CUDA,
else forkserver (a zygote that imported torch once); everything sent by value, functions by
their current definition."""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import sys
import types

import torch

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
