"""The run-time guard of the process that runs a student's code (the grader's child).

Installed before any student module is imported, it cannot be removed (``sys.addaudithook``):

* **an audit hook** refuses what tampering needs and no exercise does — reading frames
  (``sys._getframe``, ``tb_frame``, ``gi_frame``), code objects and the garbage collector's
  lists, tracing (``settrace``/``setprofile``), ``ctypes``, killing or starting processes,
  running code built at run time (``exec``, ``compile``), new audit hooks, importing the
  grader — when the student's code makes the call itself; and writing, removing or renaming a
  file outside the test's own temporary folders, whoever asks (the course's copy, the
  environment and the grader's output stay as they were);
* **shortcut wrappers** (:mod:`labkit.grade.shortcuts`) raise when, while an exercise's test
  runs, a function that exercise rebuilds is called with the student's code on the stack;
* **an integrity check** after every test: a function or class of torch, numpy, pytest or the
  course's toolkit that was rebound during the test is put back, and the test fails.

Every refusal is recorded; the child's plugin (:mod:`labkit.grade.child`) fails the test that
saw one and says why. The student's code is told apart by its code objects: the file and line
ranges of the student's exercise units and added definitions in the merged modules
(:mod:`labkit.grade.extract`), passed in ``LABKIT_GRADE_GUARD`` (no secret is in it).
"""
from __future__ import annotations

import json
import os
import sys
import threading

ENV = "LABKIT_GRADE_GUARD"
_installed = []


def install_from_env() -> None:
    """Install the guard in this process if ``LABKIT_GRADE_GUARD`` asks for it (once)."""
    spec = os.environ.get(ENV)
    if spec and not _installed:
        install(json.loads(spec))


def install(spec: dict) -> None:
    """spec: {"student": {filename: [[lo, hi], ...]}, "write_roots": [...]} ."""
    if _installed:
        return
    state = _State(spec)
    sys.addaudithook(_make_hook(state))
    _install_shortcuts(state)
    _installed.append(_api(state))


def api():
    """The plugin's handle on the guard: begin/end a test, its refusals, the integrity check."""
    return _installed[0] if _installed else None


class _State:
    def __init__(self, spec):
        self.student = {os.path.realpath(f): [tuple(r) for r in rs]
                        for f, rs in spec.get("student", {}).items()}
        self.write_roots = tuple(os.path.realpath(r) + os.sep for r in spec.get("write_roots", ()))
        self.exercise = None
        self.refusals: list[str] = []
        self.outside: list[str] = []     # refusals outside any test (a student module's import)
        self.cache: dict = {}

    def is_student(self, code) -> bool:
        hit = self.cache.get(code)
        if hit is None:
            ranges = self.student.get(code.co_filename)
            if ranges is None and code.co_filename not in self.cache:
                real = os.path.realpath(code.co_filename) if code.co_filename[:1] == "/" else ""
                ranges = self.student.get(real)
            hit = bool(ranges) and any(lo <= code.co_firstlineno <= hi for lo, hi in ranges)
            self.cache[code] = hit
        return hit

    def is_student_frame(self, frame) -> bool:
        """A frame of the student's code: one of its functions, or a module or class body
        running one of its lines (a decorator, a default value, a constant, at import)."""
        code = frame.f_code
        if code.co_flags & 0x2:  # CO_NEWLOCALS: a function's own code object
            return self.is_student(code)
        ranges = self.student.get(code.co_filename)
        if ranges is None and code.co_filename[:1] == "/":
            ranges = self.student.get(os.path.realpath(code.co_filename))
        line = frame.f_lineno or 0
        return bool(ranges) and any(lo <= line <= hi for lo, hi in ranges)

    def where(self, frame) -> str:
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} " \
               f"({frame.f_code.co_name})"

    def student_frame(self, frame):
        """The innermost student frame on the stack from ``frame`` outwards, or None."""
        while frame is not None:
            if self.is_student_frame(frame):
                return frame
            frame = frame.f_back
        return None

    def refuse(self, text: str):
        if self.exercise is None:  # at import or between tests: every later test fails with it
            self.outside.append(text)
        self.refusals.append(text)
        raise PermissionError(f"refused while grading: {text}")


DIRECT = {
    "sys._getframe": "reading the interpreter's frames",
    "sys._current_frames": "reading the interpreter's frames",
    "sys.settrace": "tracing the grader's code", "sys.setprofile": "tracing the grader's code",
    "gc.get_objects": "walking the garbage collector's objects",
    "gc.get_referrers": "walking the garbage collector's objects",
    "gc.get_referents": "walking the garbage collector's objects",
    "object.__getattr__": "reading frames or code objects",
    "object.__setattr__": "rewriting code objects or classes",
    "object.__delattr__": "deleting attributes of classes",
    "os.kill": "sending signals", "os.killpg": "sending signals",
    "signal.pthread_kill": "sending signals",
    "os.fork": "starting processes", "os.forkpty": "starting processes",
    "os.system": "starting programs", "os.exec": "replacing the process",
    "os.posix_spawn": "starting programs", "os.spawn": "starting programs",
    "subprocess.Popen": "starting programs", "pty.spawn": "starting programs",
    "os.putenv": "changing the environment", "os.unsetenv": "changing the environment",
    "sys.addaudithook": "adding audit hooks",
    "exec": "running code built at run time", "compile": "building code at run time",
    "function.__new__": "building functions at run time", "code.__new__": "building code objects",
    "builtins.breakpoint": "a debugger",
}
PICKLE_FORBIDDEN = ("sys", "os", "posix", "builtins", "subprocess", "gc", "ctypes", "importlib",
                    "inspect", "labkit.grade", "labkit.grade.plugin", "pytest", "_pytest", "runpy",
                    "code", "types", "marshal", "pickle", "operator", "functools", "shutil",
                    "signal", "atexit", "torch.hub", "torch.library", "nt", "io", "codecs")
PICKLE_NEVER = ("sys", "os", "posix", "nt", "subprocess", "importlib", "labkit.grade",
                "labkit.grade.plugin", "pytest", "_pytest", "runpy", "code", "ctypes", "gc", "inspect",
                "marshal", "signal", "atexit", "shutil", "pty", "pickle", "torch.hub",
                "torch.library", "unittest")
PICKLE_NEVER_BUILTINS = {"exec", "eval", "compile", "getattr", "setattr", "delattr",
                         "__import__", "open", "globals", "vars", "breakpoint", "input", "locals"}
"""What no unpickled object may come from, whoever unpickles it (a rank's return value is
unpickled by the launcher in the test's process, with no student frame on the stack)."""
"""Modules an unpickled object may not come from while a student's code is on the stack
(``torch.load(..., weights_only=False)`` of hand-made bytes reaches ``sys.modules``)."""
FORBIDDEN_IMPORTS = ("labkit.grade", "labkit.grade.plugin", "pytest", "_pytest", "gc", "ctypes",
                     "atexit", "inspect", "importlib", "builtins", "signal", "subprocess",
                     "labkit.reference", "labkit.harness", "labkit.cross_check", "unittest",
                     "torch.hub", "torch.library", "torch.package")
WRITES = {"os.remove", "os.rename", "os.rmdir", "os.chmod", "os.chown", "os.truncate",
          "os.symlink", "os.link", "os.utime", "shutil.rmtree", "shutil.move", "os.mkdir",
          "os.chflags", "os.lchown", "os.lchmod"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
SECRET_FILES = {"mem", "kmem", "pagemap"}
"""Files of /proc and /dev that hold this process's memory: reading them would find the
grader's key. Refused whoever opens them (libraries read /proc/self/maps, never these)."""
STUDENT_SECRET_FILES = {"environ", "cmdline", "maps", "smaps"}
"""Refused when a student's code is on the stack: the environment and command line tell the
grader apart, the maps locate the key."""
DEVICES = ("/dev/null", "/dev/shm/", "/dev/tty", "/proc/self/fd/")


def _make_hook(state: _State):
    busy = set()
    get_ident = threading.get_ident
    getframe = sys._getframe
    realpath = os.path.realpath
    write_roots = state.write_roots
    student = state.student
    direct = DIRECT

    def writable(path, dir_fd=None) -> bool:
        if isinstance(path, int) or path is None:
            return True
        path = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
        if path.startswith(DEVICES):
            return True
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):
            try:
                path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            except OSError:
                return False
        real = realpath(path)
        return (real + os.sep).startswith(write_roots) or real.startswith(DEVICES)

    def caller(frame):
        # the first frame outside the import machinery
        while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
            frame = frame.f_back
        return frame

    def hook(event, args):
        if not student:
            return
        is_write = event == "open" or event in WRITES
        if event not in direct and not is_write and event != "import" \
                and not event.startswith("ctypes.") and event != "pickle.find_class":
            return
        me = get_ident()
        if me in busy:
            return
        busy.add(me)
        try:
            frame = getframe(1)  # the frame whose call raised the event
            if event == "exec" and args and hasattr(args[0], "co_filename") \
                    and args[0].co_filename[:1] == "/" and \
                    (realpath(args[0].co_filename) + os.sep).startswith(write_roots):
                state.refuse(f"running code from {args[0].co_filename}: a file the test may "
                             "write is never run (torch.hub, runpy, an import from a temporary "
                             "folder)")
            if event == "pickle.find_class":
                module = str(args[0]) if args else ""
                name = str(args[1]) if len(args) > 1 else ""
                if any(module == m or module.startswith(m + ".") for m in PICKLE_NEVER) or \
                        (module == "builtins" and name in PICKLE_NEVER_BUILTINS):
                    state.refuse(f"unpickling {module}.{name}: no result of the course's code "
                                 "is made of it (an object a rank returns included)")
                if any(module == m or module.startswith(m + ".") for m in PICKLE_FORBIDDEN) \
                        and state.student_frame(frame) is not None:
                    state.refuse(f"unpickling {module}.{args[1] if len(args) > 1 else '?'} "
                                 f"from {state.where(state.student_frame(frame))}: an unpickled "
                                 "object reaches the interpreter's modules (load weights only)")
                return
            if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
                where = os.fsdecode(args[0])
                leaf = os.path.basename(where.rstrip("/"))
                if where.startswith(("/proc/", "/dev/")) and (leaf in SECRET_FILES or (
                        leaf in STUDENT_SECRET_FILES and state.student_frame(frame) is not None)):
                    state.refuse(f"open {where}: this process's memory and environment are "
                                 "the grader's (they hold its key), never an exercise's")
            if is_write:
                if event == "open":
                    path, mode, flags = (tuple(args) + (None, None))[:3]
                    wants = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                        (isinstance(flags, int) and flags & WRITE_FLAGS)
                    if not wants or writable(path):
                        return
                    target = path
                else:
                    paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
                    fds = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
                    dir_fd = fds[-1] if fds else None
                    if all(writable(p, dir_fd) for p in paths):
                        return
                    target = paths[0] if paths else "?"
                state.refuse(f"{event} {os.fsdecode(target) if not isinstance(target, int) else target}"
                             f" from {state.where(caller(frame))}: writing outside the test's "
                             "temporary folder (the course, the environment and the grade are "
                             "not the student's to change)")
            if event == "import":
                name = args[0] if args else ""
                if not any(name == m or name.startswith(m + ".") for m in FORBIDDEN_IMPORTS):
                    return
                frame = caller(frame)
                if frame is not None and state.is_student_frame(frame):
                    state.refuse(f"import {name} from {state.where(frame)}: the grader's and "
                                 "the interpreter's internals are not an exercise's to use")
                return
            if frame is not None and state.is_student_frame(frame):
                what = direct.get(event, "raw memory access (ctypes)")
                detail = f" {args[1]}" if event.startswith("object.") and len(args) > 1 else ""
                state.refuse(f"{event}{detail} from {state.where(frame)}: {what} — no exercise "
                             "needs it, and tampering with the grader does")
        finally:
            busy.discard(me)

    return hook


# ------------------------------------------------------------------ shortcuts

def _resolve(path: str):
    """(parent object, attribute name, value) for a dotted path, or None when it does not exist."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:  # noqa: BLE001 - not a module (or not installed): try a shorter prefix
            continue
        parent, name = None, None
        try:
            for part in parts[cut:]:
                parent, name, obj = obj, part, getattr(obj, part)
        except Exception:  # noqa: BLE001 - the attribute does not exist in this torch
            return None
        return parent, name, obj
    return None


def _install_shortcuts(state: _State) -> None:
    import types

    from labkit.grade import shortcuts

    by_object: dict[int, tuple] = {}   # id(original) -> (parent, attr, original, {name: ex})
    modules: list[tuple[types.ModuleType, str, str]] = []
    ops: dict[str, dict] = {}          # "aten::name" -> {exercise: dotted name}
    for ex, entry in shortcuts.REBUILDS.items():
        for name in entry["names"]:
            if name.startswith("torch.ops.aten."):
                ops.setdefault("aten::" + name.split(".")[3], {}).setdefault(ex, name)
                continue
            if name.startswith("torch._C."):
                continue  # the C module's own attributes stay: torch calls them internally
            found = _resolve(name)
            if found is None:
                continue
            parent, attr, obj = found
            if isinstance(obj, types.ModuleType):
                modules.append((obj, name, ex))
                continue
            key = (id(parent), attr)
            by_object.setdefault(key, (parent, attr, obj, {}))[3].setdefault(ex, name)
    for mod, name, ex in modules:
        for attr, obj in list(vars(mod).items()):
            if attr.startswith("__") or not callable(obj) or isinstance(obj, types.ModuleType):
                continue
            if getattr(obj, "__module__", None) not in (mod.__name__,) and \
                    not (mod.__name__.startswith("torch.ops") or isinstance(obj, type)):
                continue
            if isinstance(obj, type) and not (getattr(obj, "__module__", "") or "").startswith(mod.__name__):
                continue
            key = (id(mod), attr)
            by_object.setdefault(key, (mod, attr, obj, {}))[3].setdefault(ex, f"{mod.__name__}.{attr}")
    _guard_ops(state, ops)
    done = set()
    for parent, attr, obj, exercises in by_object.values():
        if id(obj) in done and isinstance(obj, type):
            continue
        done.add(id(obj))
        _wrap(state, parent, attr, obj, exercises)


def _guard_ops(state: _State, ops: dict) -> None:
    """Calls of ``torch.ops.aten.<op>`` and its overloads from Python: the check runs in the
    classes' ``__call__`` (no operator object is replaced: torch's dispatcher keeps its own)."""
    from torch import _ops

    for cls, name_of in ((_ops.OpOverloadPacket, lambda op: op._qualified_op_name),
                         (_ops.OpOverload, lambda op: op._overloadpacket._qualified_op_name)):
        original = cls.__call__

        def __call__(self, /, *args, _original=original, _name_of=name_of, **kwargs):
            if state.exercise is not None:
                hit = ops.get(_name_of(self))
                if hit:
                    _check(state, hit, "")
            return _original(self, *args, **kwargs)
        type.__setattr__(cls, "__call__", __call__)


def _check(state: _State, exercises: dict, shown: str):
    ex = state.exercise
    if ex is None or ex not in exercises:
        return
    frame = state.student_frame(sys._getframe(2))
    if frame is None:
        return
    from labkit.grade.shortcuts import reason

    state.refuse(f"{reason(ex, exercises[ex])}; called from {state.where(frame)}")


def _wrap(state: _State, parent, attr: str, obj, exercises: dict) -> None:
    if isinstance(obj, type):
        original_init = obj.__dict__.get("__init__")
        base_init = obj.__init__

        def __init__(self, *args, **kwargs):
            _check(state, exercises, attr)
            return base_init(self, *args, **kwargs) if original_init is None \
                else original_init(self, *args, **kwargs)
        __init__.__qualname__ = f"{obj.__qualname__}.__init__"
        try:
            type.__setattr__(obj, "__init__", __init__)
        except TypeError:  # a C type: wrap the name instead
            _replace(parent, attr, _function_wrapper(state, obj, exercises, attr))
        return
    if isinstance(parent, type):
        raw = parent.__dict__.get(attr)
        if isinstance(raw, (staticmethod, classmethod)):
            return
        wrapper = _function_wrapper(state, obj, exercises, attr)
        type.__setattr__(parent, attr, wrapper)
        return
    _replace(parent, attr, _function_wrapper(state, obj, exercises, attr))


def _replace(parent, attr, value) -> None:
    try:
        setattr(parent, attr, value)
    except (AttributeError, TypeError):
        pass


def _function_wrapper(state, fn, exercises, attr):
    def guarded(*args, **kwargs):
        _check(state, exercises, attr)
        return fn(*args, **kwargs)
    guarded.__name__ = getattr(fn, "__name__", attr)
    guarded.__qualname__ = getattr(fn, "__qualname__", attr)
    guarded.__doc__ = getattr(fn, "__doc__", None)
    guarded.__module__ = getattr(fn, "__module__", None)
    return guarded


# ------------------------------------------------------------------ integrity

TRUSTED = ("torch", "numpy", "labkit", "pytest", "_pytest", "math", "builtins")


def _trusted_module(name: str) -> bool:
    if name.startswith("labkit.lab") or name.startswith("labkit.grade"):
        return False
    return name.split(".")[0] in TRUSTED


def _snapshot():
    import types

    snap = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not _trusted_module(name):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        snap[name] = (mod, {k: v for k, v in items
                            if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type,
                                              types.ModuleType))})
    classes = {}
    import torch

    for cls in (torch.Tensor, torch._C.TensorBase, torch.nn.Module, torch.optim.Optimizer,
                torch.autograd.Function):
        classes[cls] = dict(vars(cls))
    # the methods of every class of the course's toolkit and of the torch packages the graders
    # build references from (a model's forward patched through type(model) changes a reference)
    methods = (types.FunctionType, property, staticmethod, classmethod, types.BuiltinFunctionType)
    for name, (mod, attrs) in snap.items():
        if not name.startswith(CLASS_MODULES):
            continue
        for v in attrs.values():
            if isinstance(v, type) and v not in classes and getattr(v, "__module__", None) == name:
                classes[v] = {k: x for k, x in vars(v).items() if isinstance(x, methods)}
    return snap, classes


CLASS_MODULES = ("labkit", "torch.nn", "torch.testing", "torch.autograd",
                 "torch.distributed", "torch.utils.checkpoint", "torch.amp", "torch._tensor",
                 "torch.functional")
"""Not torch.optim: an optimizer's first instance wraps its class's ``step`` (profiling hooks)."""


GRADER_MODULES = ("labkit.grade", "labkit.grade.plugin", "_pytest", "pytest", "pluggy")
OWN_MODULES = ("labkit.grade", "labkit.grade.plugin")
VOLATILE = {"_pytest.assertion.util"}
"""pytest sets these modules' hooks around every test (``util._reprcompare``)."""


def _grader_snapshot(extra_classes=()) -> tuple[dict, dict]:
    """What decides the grade in this process — the grader's modules (every value), pytest's and
    pluggy's functions and classes, and those classes' attributes — taken once the child's
    plugin is loaded, before any test module (so any student module) is imported."""
    import types

    mods, classes = {}, {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(GRADER_MODULES) or name in VOLATILE:
            continue
        try:
            items = dict(vars(mod))
        except TypeError:
            continue
        own = name.startswith(OWN_MODULES)
        mods[name] = (mod, {k: v for k, v in items.items() if own or isinstance(
            v, (types.FunctionType, types.BuiltinFunctionType, type))})
        for v in items.values():
            if isinstance(v, type) and getattr(v, "__module__", None) == name:
                classes[v] = (dict(vars(v)), own)
    for cls in extra_classes:
        classes[cls] = (dict(vars(cls)), True)
    return mods, classes


def _compare(snap, changed: list) -> None:
    modules, classes = snap
    for name, (mod, attrs) in modules.items():
        now = vars(mod)
        for k, v in attrs.items():
            if now.get(k, v) is not v:
                changed.append(f"{name}.{k}")
                setattr(mod, k, v)
    for cls, value in classes.items():
        attrs, own = value if isinstance(value, tuple) else (value, False)
        now = vars(cls)
        for k, v in attrs.items():
            if now.get(k, v) is not v:
                changed.append(f"{cls.__qualname__}.{k}")
                type.__setattr__(cls, k, v)
        for k in set(now) - set(attrs) if own else ():
            if k not in ("__abstractmethods__", "_abc_impl", "__annotations__"):
                changed.append(f"{cls.__qualname__}.{k} (added)")
                type.__delattr__(cls, k)


def _torch_state() -> dict:
    import torch

    return {"default dtype": torch.get_default_dtype(), "grad mode": torch.is_grad_enabled(),
            "torch-function modes": torch._C._len_torch_function_stack(),
            "dispatch modes": torch._C._len_torch_dispatch_stack(),
            "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
            "inference mode": torch.is_inference_mode_enabled(),
            "global module and optimizer hooks": _global_hooks()}


def _global_hooks() -> int:
    """How many global hooks (on every module's forward/backward, every optimizer's step) exist:
    one left by a student's code runs inside the graders' references too."""
    import torch.nn.modules.module as module
    import torch.optim.optimizer as optimizer

    names = [n for n in vars(module) if n.startswith("_global_") and n.endswith("hooks")]
    return sum(len(getattr(module, n)) for n in names) + \
        len(optimizer._global_optimizer_pre_hooks) + len(optimizer._global_optimizer_post_hooks)


def _global_state_changes(baseline: dict) -> list[str]:
    """torch's global state that differs from ``baseline`` (the state before any student module
    was imported): a default dtype, grad mode or a mode left on changes what the graders' own
    comparisons compute. Each is put back; the names are returned."""
    import torch

    now = _torch_state()
    changed = [f"torch's {k} ({baseline[k]} -> {now[k]})" for k in baseline if now[k] != baseline[k]]
    if now["default dtype"] != baseline["default dtype"]:
        torch.set_default_dtype(baseline["default dtype"])
    if now["grad mode"] != baseline["grad mode"]:
        torch.set_grad_enabled(baseline["grad mode"])
    while torch._C._len_torch_function_stack() > baseline["torch-function modes"]:
        torch._C._pop_torch_function_stack()
    while torch._C._len_torch_dispatch_stack() > baseline["dispatch modes"]:
        torch._C._pop_torch_dispatch_stack()
    if now["global module and optimizer hooks"] > baseline["global module and optimizer hooks"]:
        import torch.nn.modules.module as module
        import torch.optim.optimizer as optimizer

        if baseline["global module and optimizer hooks"] == 0:
            for n in [n for n in vars(module) if n.startswith("_global_") and n.endswith("hooks")]:
                getattr(module, n).clear()
            optimizer._global_optimizer_pre_hooks.clear()
            optimizer._global_optimizer_post_hooks.clear()
    if now["deterministic algorithms"] != baseline["deterministic algorithms"]:
        torch._C._set_deterministic_algorithms(baseline["deterministic algorithms"])
    return changed


def _api(state: _State):
    snapshot, early = [], []
    baseline = _torch_state()

    class Api:
        @staticmethod
        def begin(exercise):
            state.exercise = exercise
            state.refusals.clear()

        @staticmethod
        def end():
            state.exercise = None
            found = list(dict.fromkeys(state.outside + state.refusals))
            state.refusals.clear()
            return found

        @staticmethod
        def take_snapshot():
            snapshot[:] = [_snapshot()]

        @staticmethod
        def take_grader_snapshot():
            if not early:
                early.append(_grader_snapshot(extra_classes=(Api,)))

        @staticmethod
        def check_integrity():
            """Names of trusted functions rebound since the snapshots (each is put back), and
            torch's global state left changed since the guard was installed (put back too)."""
            changed = _global_state_changes(baseline)
            if early:
                _compare(early[0], changed)
            if snapshot:
                _compare(snapshot[0], changed)
            return changed
    return Api
