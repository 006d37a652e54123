"""The pytest plugin of the grader's child: run the graded tests, report each outcome to the parent.

Loaded with ``-p labkit.grade.child`` in the process that runs student code, behind the wall.
Nothing here decides a grade or is secret: student code can reach all of it. It *reports*, as JSON
lines on an inherited pipe that nothing here may open, when each test starts and its outcome, and
adds what only the inside sees, each failing its test (docs/grading.md, "What is refused"): a
``TorchDispatchMode`` refuses the operators the exercise rebuilds (:mod:`labkit.grade.shortcuts`)
however spelled; a thread started during a test gets a mode that refuses torch work that is not
the course's (dispatch modes, MemTracker's and FlopCounterMode's too, hold for one thread); in an
exercise whose tests measure torch's work, a ``TorchFunctionMode`` notes tensor data that student
code takes out of torch, however (``.numpy()``, ``np.asarray``, DLPack, ``.tolist()``, element by
element); audit events refuse processes started from student code; what the tests compare with
(:class:`Snapshot`), recorded before any student code is imported, and torch's global state are
put back after each test; the pytest plugins are fixed once collected; files opened outside the
scratch folder (but its own modules, read) are noted.
"""
from __future__ import annotations

import contextlib
import copy
import copyreg
import json
import math
import os
import re
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode

from labkit.grade import shortcuts

SPEC = json.loads(os.environ.get("LABKIT_GRADE_SPEC", "{}"))
"""What the parent passed (nothing in it is secret): {"fd": the result pipe, "scratch": the one
writable folder, "course": the graded copy, "student": {file: [[first, last] line of each unit of
student code]}}. The pipe's number leaves the environment (``os.path.expandvars`` read it; a rank
started afresh must not take another file for the pipe)."""
if "fd" in SPEC:
    os.environ["LABKIT_GRADE_SPEC"] = json.dumps({k: v for k, v in SPEC.items() if k != "fd"})
STUDENT = {os.path.realpath(f): [tuple(r) for r in rs] for f, rs in SPEC.get("student", {}).items()}
COURSE = os.path.realpath(SPEC.get("course", "/nonexistent")) + os.sep
READ_OK = tuple(os.path.realpath(p) + os.sep for p in (SPEC.get("scratch", "/nonexistent"),
                                                       sys.prefix, sys.base_prefix)) + ("/dev/",)
COMPARE = ("torch.testing.", "torch.nn.", "torch.optim.", "torch.autograd.", "torch.amp.",
           "torch.utils.checkpoint.", f"{pytest.approx.__module__}.", "math.", "labkit.",
           f"{TorchDispatchMode.__module__}.", "torch.overrides.", "torch.distributed._tools.")
# what the tests compare, measure and compute references with, found by the object, private
# modules too; and the torch modules the references and the tests import (State.used: those of
# pipelining's schedules...; not all of torch's public modules: 4x the names to compare a test)
EXERCISES = tuple(f"labkit.lab{n}." for n in range(1, 10))
"""The exercise modules: their classes' constants may be the student's own state (a class the
submission adds), so they are not recorded (the reading refuses changes to the course's)."""
PROCESSES = ("os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system",
             "subprocess.Popen", "os.kill", "os.killpg", "_posixsubprocess.fork_exec")


def _identity(target) -> tuple | None:
    """(device, inode) of the file a path or a file descriptor's number names, or None."""
    try:
        found = os.stat(target)
    except (OSError, TypeError, ValueError):
        return None
    return found.st_dev, found.st_ino


PIPE = _identity(SPEC["fd"]) if SPEC.get("fd", -1) >= 0 else None
"""The result pipe: every open of it is refused, whoever calls (a finalizer the cyclic GC runs
from the course's code too) and however named (its number, /proc/self/fd/N, a link to it)."""
SHARED = {torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.__dlpack__}
"""Where tensor data leaves torch shared, its whole storage in reach (numpy's functions given a
tensor call ``__array__``; ``as_strided`` widens a view of one element to all of it)."""
TEXT = {torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__}
OUT_OF_TORCH = SHARED | TEXT | {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__float__,
                                torch.Tensor.__int__, torch.Tensor.__index__,
                                torch.Tensor.__complex__, torch.Tensor.__bool__,
                                torch.Tensor.is_nonzero, torch.Tensor.apply_, torch.Tensor.map_,
                                torch.Tensor.map2_}
"""... and copied out: element by element (a bit at a time too), as text, or to a callback."""
SHAPED = {f for n in [*"nonzero argwhere masked_select unique unique_consecutive bincount where "
                       "repeat_interleave tensor_split".split(), *(n for n in dir(torch.Tensor)
                       if n.startswith("to_sparse"))] for f in (getattr(torch, n, 0), getattr(
                           torch.Tensor, n, 0)) if f}
"""... and as shapes: a result shaped by the data (a count, split points given as a tensor)."""
MOVED_MAX = 1024  # elements per test: shapes, counts and a scalar loss are fine, a layer's data is not
HOOKS = "global module and optimizer hooks"
REPORT_HOOKS = ("pytest_runtest_makereport", "pytest_runtest_logreport", "pytest_runtest_protocol",
                "pytest_report_teststatus", "pytest_runtest_call", "pytest_pyfunc_call")


def _send(record: dict) -> None:
    fd, data = SPEC.get("fd", -1), (json.dumps(record) + "\n").encode()
    while fd >= 0 and data:
        data = data[os.write(fd, data):]


class State:
    """What this process saw: of the session, and of the test that runs now."""
    early = None         # a Snapshot before any student code was imported
    snap = None          # a Snapshot once the tests were collected
    exercise: str | None = None
    refused: list = []
    flags: list = []
    torch: dict = {}
    plugins: tuple = ()
    seen: dict = {}      # nodeid -> "failed" or "skipped", as the reports said
    tamper: list = []
    kinds: dict = {}     # code object -> "student", "course" or ""
    guarded = False      # guard() ran in this process
    pid = os.getpid()    # this process's (a forked rank differs)
    moved = 0            # elements of tensor data student code took out of torch in this test
    side: set = set()    # the threads started during a test
    used: tuple = ()     # the torch modules the references and the tests import ("torch.x.")


def _in_student(filename: str, line: int) -> bool:
    """Whether ``line`` of ``filename`` lies in a unit of student code."""
    return any(a <= line <= b for a, b in STUDENT.get(os.path.realpath(filename), ()))


def _kind(code) -> str:
    """"student" (a unit of student code), "course" (other code of the graded copy: given code,
    the toolkit, the tests; not this plugin) or "" (a library's)."""
    kind = State.kinds.get(code)
    if kind is None:
        path = os.path.realpath(code.co_filename) if code.co_filename.startswith("/") else ""
        kind = State.kinds[code] = "student" if _in_student(path, code.co_firstlineno) \
            else "course" if path.startswith(COURSE) and path != os.path.realpath(__file__) else ""
    return kind


def student_frame(frame=None) -> str | None:
    """"file:line" of the innermost frame of student code on this thread's stack, or None."""
    frame = frame or sys._getframe(1)
    while frame is not None and _kind(frame.f_code) != "student" and not (  # a module's top:
            frame.f_code.co_name == "<module>" and  # a constant, a default value
            _in_student(frame.f_code.co_filename, frame.f_lineno)):
        frame = frame.f_back
    return frame and f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _thread_owner() -> str:
    """Whose work this thread does: the kind of its outermost frame of the graded copy ("" when
    only libraries' code is on it, as for ``pool.submit(F.gelu, x)``)."""
    frame, owner = sys._getframe(1), ""
    while frame is not None:
        owner, frame = _kind(frame.f_code) or owner, frame.f_back
    return owner


class Refuse(TorchDispatchMode):
    """Refuse the operators ``exercise`` rebuilds when student code is on the stack; on a thread
    started during a test (``side``) whoever calls them, and every operator of work that is not
    the course's."""

    def __init__(self, exercise: str, side: bool = False):
        super().__init__()
        self.exercise, self.side, self.hits = exercise, side, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        hit = self.hits.get(func)
        if hit is None:
            hit = self.hits[func] = bool(shortcuts.matching(
                self.exercise, func.overloadpacket.__name__, func.namespace))
        if hit and (self.side or student_frame()):
            why = shortcuts.reason(self.exercise, func.name())
        elif self.side and _thread_owner() != "course":
            why = f"torch operator {func.name()} on a thread that is not the course's: the " \
                "test's measurements and refusals hold for its own thread only"
        else:
            return func(*args, **(kwargs or {}))
        State.refused.append(f"{why} (from {student_frame() or 'a thread of the student'})")
        raise PermissionError(f"refused while grading: {why}")


class Watch(TorchFunctionMode):
    """Note, in an exercise whose tests measure torch's work (``shortcuts.MEASURED``), tensor data
    that student code takes out of torch, which no measurement of torch's then sees: the
    ``measured elsewhere`` flag, for review, once more than MOVED_MAX elements left in one test;
    in a rank (``rank``), whose flags have no way back to the parent, refused instead."""

    def __init__(self, side: bool = False, rank: bool = False):
        super().__init__()
        self.side = side  # on a thread started during the test: whoever calls, unless the course
        self.rank = rank

    def __torch_function__(self, func, types, args=(), kwargs=None):
        n = _leaving(func, args, kwargs or {}) if args and isinstance(args[0], torch.Tensor) else 0
        rank = self.rank or os.getpid() != State.pid  # (a forked rank inherits the test's Watch)
        if n and (State.moved <= MOVED_MAX or rank) and (student_frame() or (
                self.side and _thread_owner() != "course")):
            State.moved += n
            if State.moved > MOVED_MAX:
                why = f"over {MOVED_MAX} elements of tensor data taken out of torch by " \
                    f"{func.__name__} (from {student_frame() or 'a thread of the test'}), where " \
                    "the test measures torch's work"
                if rank:  # each time: a rank's flags have no way back to the parent
                    raise PermissionError(f"refused while grading, in a rank: {why}")
                State.flags.append(f"measured elsewhere: {why}")
        return func(*args, **(kwargs or {}))


def _leaving(func, args, kwargs) -> int:
    """The elements of tensor data a call takes out of torch (0: none), ``args[0]`` a tensor."""
    if func is torch.Tensor.__getitem__:  # a bool mask: its count of True, as the result's shape
        index = args[1] if type(args[1]) is tuple else args[1:]
        return int(any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index))
    if func in SHAPED:  # a count; split points given as a tensor: each of them
        return sum(a.numel() for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)) \
            if func.__name__ == "tensor_split" else int(func is not torch.where or len(args) == 1)
    t = args[0]
    return 0 if func not in OUT_OF_TORCH else t.untyped_storage().nbytes() // max(
        t.element_size(), 1) if func in SHARED else _printed(t) if func in TEXT else t.numel()


def _printed(t: torch.Tensor) -> int:
    """The elements torch's text of ``t`` holds under the print options set now: all of them, or,
    past ``threshold`` elements, a summary of ``edgeitems`` at each end of every dimension (a
    debugging ``print(tensor)``: a few elements; a threshold raised to print it whole: all)."""
    opts = torch._tensor_str.PRINT_OPTS
    if t.numel() <= opts.threshold:
        return t.numel()
    return math.prod(min(n, 2 * opts.edgeitems or n) for n in t.shape)


def _on_new_thread(frame, event, arg):
    sys.setprofile(None)
    if State.exercise is not None:
        State.side.add(threading.get_ident())
        Refuse(State.exercise, side=True).__enter__()  # never left: it ends with the thread
        if State.exercise in shortcuts.MEASURED:
            Watch(side=True).__enter__()


def _acting(frame) -> str | None:
    """Who acts: the innermost student frame, or, on a thread started during a test (the
    course's pools too, which student code may hand work to), that thread."""
    return student_frame(frame) or (f"thread {threading.get_ident()}" if State.exercise and
                                     threading.get_ident() in State.side else None)


def _refuse(why: str, frame) -> None:
    State.refused.append(f"{why} (from {_acting(frame) or 'a library or a finalizer'})")
    raise PermissionError(f"refused while grading: {why}")


def _step_hook(optimizer, args, kwargs):
    """A torch optimizer's step (every one runs the global pre-hooks): refused when it is what
    the exercise rebuilds and student code steps it, however its class was reached."""
    ex, cls = State.exercise, type(optimizer)  # (the course's and the student's classes aside)
    step = sys._getframe(1).f_locals.get("func")  # the step function that runs (Adam.step given
    step = [step] if isinstance(step, types.FunctionType) else []  # an object of the student's)
    names = [n for c in (*cls.__mro__, *step) if not c.__module__.startswith("labkit.")
             for n in (*c.__module__.split("."), c.__qualname__)]
    if ex not in shortcuts.STEPS_GIVEN and shortcuts.matching(ex or "", inside=tuple(names)) \
            and _acting(sys._getframe(1)):
        what = f"{(step or [cls])[0].__module__}.{(step or [cls])[0].__qualname__}" + ".step" * (not step)
        _refuse(shortcuts.reason(ex, what), sys._getframe(1))


def _audit(event, args):
    if event == "pickle.find_class" and _acting(sys._getframe(1)):
        _refuse(f"unpickling {args[0]}.{args[1]} from student code: names from bytes, code the "
                "reading cannot see", sys._getframe(1))
    if event in PROCESSES and State.exercise is not None and _acting(sys._getframe(1)):
        _refuse(f"{event} from student code: a process does work the test's measurements and "
                "refusals do not see", sys._getframe(1))
    if event == "open" and PIPE and _identity(args[0]) == PIPE:
        _refuse(f"opening {args[0]!r}: the result pipe, the grader's", sys._getframe(1))
    if event == "open" and _acting(sys._getframe(1)):  # (at import too)
        path = os.path.realpath(os.fsdecode(args[0])) if isinstance(args[0], (str, bytes)) else ""
        writes = any(c in (args[1] or "") for c in "wax+") or (args[2] or 0) & 0o3103
        if State.exercise is not None and not (path + os.sep).startswith(READ_OK) and not \
                sys._getframe(1).f_code.co_filename.startswith("<frozen") and not (
                    path in STUDENT and not writes):  # its own module: torch.jit.script reads it
            State.flags.append(f"files: opened {path} (from {_acting(sys._getframe(1))})")
        if not path or (path.startswith("/proc/") and writes):  # /dev/fd/3: /proc/PID/fd/3
            _refuse(f"opening {args[0]!r} from student code: a file descriptor, or one of the "
                    "process's own for writing (the wall stops other writes outside the "
                    "scratch folder)", sys._getframe(1))


def _torch_state() -> dict:
    import torch.nn.modules.module as module
    import torch.optim.optimizer as optimizer

    hooks = [v for n, v in vars(module).items() if n.startswith("_global_") and n.endswith("hooks")]
    hooks += [optimizer._global_optimizer_pre_hooks, optimizer._global_optimizer_post_hooks]
    return {"default dtype": torch.get_default_dtype(), "grad mode": torch.is_grad_enabled(),
            "dispatch modes": torch._C._len_torch_dispatch_stack(),
            "torch-function modes": torch._C._len_torch_function_stack(),
            "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
            HOOKS: sum(map(len, hooks)), "_hooks": hooks,
            "_saved": [dict(h) for h in hooks],
            "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(True) is not None}


def _restore() -> list[str]:
    """torch's global state that differs from the session's start, each put back."""
    before, now = State.torch, _torch_state()
    changed = [f"torch's {k} ({before[k]} -> {now[k]})" for k in before
               if not k.startswith("_") and now[k] != before[k]]
    if now["_saved"] != before["_saved"] and now[HOOKS] == before[HOOKS]:
        changed.append(f"torch's {HOOKS} were replaced")  # (one removed, another added)
    torch.set_default_dtype(before["default dtype"])
    torch.set_grad_enabled(before["grad mode"])
    torch.use_deterministic_algorithms(before["deterministic algorithms"])
    while torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()  # the session starts with none
    while torch._C._len_torch_dispatch_stack() > before["dispatch modes"]:
        _pop_mode()
    while torch._C._len_torch_function_stack() > before["torch-function modes"]:
        torch._C._pop_torch_function_stack()
    for hooks, saved in zip(before["_hooks"], before["_saved"]):
        if hooks != saved:  # the course installs none; the grader, its own
            hooks.clear()
            hooks.update(saved)
    return changed + State.snap.changes()


def _plugins(config) -> tuple:
    """Every registered plugin, and every function of the hooks that make a report."""
    pm = config.pluginmanager
    return (tuple(map(id, pm.get_plugins())), tuple(
        id(impl.function) for h in REPORT_HOOKS for impl in getattr(pm.hook, h).get_hookimpls()))


class Snapshot:
    """What the tests depend on, recorded to be compared and put back: the names of namespaces
    (``names``: name -> value, and whether names added count), the code and defaults of their
    functions, and their tables of constants (``ATTN_TOL``, ``_DTYPE_PRECISIONS``: dicts of plain
    values named in capitals) by value, however they are reached (``gc``, a function's defaults)."""

    def __init__(self, spaces: list[tuple]):
        self.spaces = spaces
        self.functions = [(f, f.__code__, f.__defaults__, f.__kwdefaults__) for _, names, _ in
                          spaces for f in names.values() if isinstance(f, types.FunctionType)]
        self.values = [(f"{ns.__name__}.{n}", v, copy.deepcopy(v)) for ns, _, _ in spaces
                       for n, v in list(vars(ns).items()) if n.strip("_").isupper() and
                       type(v) is dict and 0 < len(v) < 10**4 and _plain(v) and
                       not ns.__name__.startswith(EXERCISES)]  # (the student's own tables)

    def changes(self) -> list[str]:
        """What differs from the record, each put back."""
        changed = []
        for ns, names, added in self.spaces:
            now = vars(ns)
            for name in [n for n, v in names.items() if now.get(n) is not v and
                         not _torch_wrap(now.get(n), v)] + \
                    [n for n in now if added and n not in names and n != "__warningregistry__"]:
                changed.append(f"{ns.__name__}.{name} was rebound")
                if name in names:
                    setattr(ns, name, names[name])
                else:
                    delattr(ns, name)
        for f, code, defaults, kwdefaults in self.functions:
            if (f.__code__, f.__defaults__, f.__kwdefaults__) != (code, defaults, kwdefaults):
                changed.append(f"the code or defaults of {f.__module__}.{f.__qualname__} changed")
                f.__code__, f.__defaults__, f.__kwdefaults__ = code, defaults, kwdefaults
        for label, value, kept in self.values:
            if value != kept:
                changed.append(f"{label} was changed in place")
                value.clear()
                value.update(copy.deepcopy(kept))
        return changed


def _torch_wrap(new, old) -> bool:
    """Whether ``new`` is torch's own wrapper of ``old``: an optimizer's step, wrapped by
    ``Optimizer.profile_hook_step`` when the first one is made (its code, nobody else's)."""
    from torch.optim.optimizer import Optimizer

    return getattr(new, "__wrapped__", None) is old and getattr(new, "__code__", None) in [
        c for c in Optimizer.profile_hook_step.__code__.co_consts if isinstance(c, types.CodeType)]


def _plain(value) -> bool:
    """Numbers, strings, dtypes and None, and tuples and dicts of them: a table of constants."""
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if isinstance(value, (tuple, frozenset)):
        return all(map(_plain, value))
    return isinstance(value, (int, float, str, type(None), torch.dtype))


def _compared() -> list:
    """The modules the tests compare and measure with (torch.testing, the course's references...)
    as loaded now, and their classes."""
    spaces = [m for n, m in list(sys.modules.items()) if isinstance(m, types.ModuleType) and
              (n + ".").startswith((*COMPARE, *State.used))]
    return spaces + [c for m in spaces for c in vars(m).values()
                     if issubclass(type(c), type) and c.__module__ == m.__name__]


def _torch_functions() -> dict:
    """torch's public functions (``torch.equal``, ``torch.logsumexp``...), which tests compare
    and compute references with."""
    return {n: v for n, v in vars(torch).items() if not n.startswith("_") and
            isinstance(v, (types.FunctionType, types.BuiltinFunctionType))}


def _code(ns) -> dict:
    """The functions, classes and modules a namespace holds, by name, and a class's constants
    (``ApproxBase.DEFAULT_RELATIVE_TOLERANCE``)."""
    return {n: v for n, v in vars(ns).items() if issubclass(type(v), (
        types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType, property,
        staticmethod, classmethod)) or (isinstance(ns, type) and n.isupper() and _plain(v) and
                                        not ns.__module__.startswith(EXERCISES))}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Before any student code is imported: the references loaded and what the tests compare
    with recorded (code that runs at import, when a module's constants are built, comes before
    the names of the tests' modules can be recorded)."""
    import importlib
    import pkgutil

    import labkit.reference

    for info in pkgutil.walk_packages(labkit.reference.__path__, "labkit.reference."):
        importlib.import_module(info.name)
    importlib.import_module("labkit.tracker")  # what labkit.measure imports when it measures
    for path in (*Path(labkit.reference.__path__[0]).rglob("*.py"),  # and the torch modules the
                 *(session.config.rootpath / "tests").glob("*.py")):  # references and the tests
        for name in re.findall(r"^\s*(?:from|import) (torch\.[\w.]+)", path.read_text(), re.M):
            with contextlib.suppress(Exception):  # import in a function (pipelining's schedules)
                importlib.import_module(name)
                State.used += (f"{name}.",)
    for cls in (torch.Tensor, torch.nn.Parameter):  # pickling caches cls.__slotnames__: now
        copyreg._slotnames(cls)
    from torch._dynamo.eval_frame import TorchPatcher  # torch wraps its optimizers' functions
    TorchPatcher.patch()  # the first time dynamo runs (once, cached): now, before the record
    State.early = Snapshot([(ns, _code(ns), False) for ns in _compared()] + [
        (torch.Tensor, dict(vars(torch.Tensor)), False), (torch, _torch_functions(), False)])
    guard()
    State.torch, State.plugins = _torch_state(), _plugins(session.config)


def guard() -> None:
    """The hooks of every process behind the wall, once: this plugin's, and those of a rank
    that forkserver or spawn starts from a fresh interpreter (``site/sitecustomize.py`` calls
    this there, the exercise being graded in ``LABKIT_GRADE_EXERCISE``; a forked rank inherits
    them): torch's optimizer steps, new threads, audit events (processes, unpickling)."""
    if State.guarded:
        return
    State.guarded, State.exercise = True, os.environ.get("LABKIT_GRADE_EXERCISE")
    register_optimizer_step_pre_hook(_step_hook)
    threading.setprofile(_on_new_thread)
    sys.addaudithook(_audit)
    import _posixsubprocess  # multiprocessing's spawn calls it with no audit event of its own

    def fork_exec(*args, _run=_posixsubprocess.fork_exec):
        sys.audit("_posixsubprocess.fork_exec")
        return _run(*args)
    _posixsubprocess.fork_exec = fork_exec
    if State.exercise in shortcuts.REBUILDS:  # a rank of this exercise's test: never left
        Refuse(State.exercise).__enter__()
    if State.exercise in shortcuts.MEASURED:
        Watch(rank=True).__enter__()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Student modules were imported while the tests were collected: a plugin that is not
    pytest's registered then is tampering; from now on the plugins are fixed. The tests'
    constant dicts of plain values become read-only, in every test module that holds them."""
    added = [p for p in session.config.pluginmanager.get_plugins() if id(p) not in State.plugins[0]]
    if any(not (p.__name__ if isinstance(p, types.ModuleType) else type(p).__module__)
           .startswith("_pytest.") for p in added):
        State.tamper.append("a pytest plugin was registered while the tests were collected")
    State.plugins = _plugins(session.config)
    State.tamper += [f"{c} while the tests were collected" for c in State.early.changes()]
    tests = os.path.realpath(str(session.config.rootpath / "tests")) + os.sep
    test_modules = [m for m in list(sys.modules.values()) if
                    os.path.realpath(getattr(m, "__file__", None) or "/").startswith(tests)]
    # the tests' modules, what they compare and measure with, the course's given code, torch's
    # functions and torch.Tensor's methods (not all of torch: torch, warnings and pytest rebind
    # their own modules' names while tests run)
    State.snap = Snapshot([(m, dict(vars(m)), True) for m in test_modules] + [
        (ns, _code(ns), False) for ns in _compared()] + [
        (torch.Tensor, dict(vars(torch.Tensor)), True), (torch, _torch_functions(), False)])
    frozen = {}  # the tests' constant dicts of plain values: read-only from now on
    for mod in test_modules:
        for name, value in list(vars(mod).items()):
            if name.isupper() and type(value) is dict and all(
                    isinstance(v, (int, float, str, bool, tuple, type(None))) for v in value.values()):
                proxy = frozen.setdefault(id(value), types.MappingProxyType(value))
                setattr(mod, name, proxy)
                State.snap.spaces[test_modules.index(mod)][1][name] = proxy


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    mark = item.get_closest_marker("exercise")
    State.exercise, State.refused, State.flags = (mark.args[0] if mark and mark.args else "?"), [], []
    os.environ["LABKIT_GRADE_EXERCISE"] = State.exercise  # for a rank's fresh interpreter
    mode = Refuse(State.exercise) if State.exercise in shortcuts.REBUILDS else None
    watch, State.moved = Watch() if State.exercise in shortcuts.MEASURED else None, 0
    for m in (mode, watch):
        if m is not None:
            m.__enter__()
    _send({"kind": "start", "nodeid": item.nodeid})  # should the process die in it: said where
    yield
    if mode is not None and torch._C._len_torch_dispatch_stack() == State.torch["dispatch modes"] + 1:
        mode.__exit__(None, None, None)  # else a mode was left on: _restore pops it, and says so
    if watch is not None and torch._C._len_torch_function_stack() == \
            State.torch["torch-function modes"] + 1:
        watch.__exit__(None, None, None)
    State.exercise = None
    os.environ.pop("LABKIT_GRADE_EXERCISE", None)
    problems = State.refused + _restore()
    tamper = State.tamper + ([] if _plugins(item.config) == State.plugins else
                             ["pytest's plugins or hook functions changed while the tests ran"])
    record = dict(item.config._labkit_results.get(item.nodeid) or {"outcome": "failed"})
    seen = State.seen.pop(item.nodeid, None)
    if seen and record.get("outcome") == "passed":
        problems.append(f"the test's report {seen}, its record said passed")
    if problems or tamper:
        record.update(outcome="failed", message="refused while grading: " + " | ".join(
            problems + tamper))
    _send({"kind": "test", "nodeid": item.nodeid, "outcome": record.get("outcome"),
           "message": (record.get("message") or "")[:3000],
           "details": (record.get("details") or "")[-3000:],
           "flags": sorted(set(State.flags))[:20], "tamper": tamper})


def pytest_runtest_logreport(report):
    if report.failed:
        State.seen[report.nodeid] = "failed"
    elif report.skipped and report.nodeid not in State.seen:
        State.seen[report.nodeid] = "skipped"


def pytest_sessionfinish(session, exitstatus):
    _send({"kind": "done"})
