"""The pytest plugin of the grader's child: run the graded tests, report each outcome to the parent.

Loaded with ``-p labkit.grade.child`` in the process that runs student code, inside the operating
system's wall (:mod:`labkit.grade.isolation`). Nothing here decides a grade and nothing here is
secret: student code in this process can reach all of it. The child *reports*, one JSON line per
test on an inherited pipe; the trusted parent (:mod:`labkit.grade.runner`) decides. It collected
the tests and their points itself, refuses a second record for a test and any record after
"done", and plants tripwire tests that must fail. What this plugin adds is what can only be
seen from inside, each reported with the test it concerns:

* **shortcuts at the dispatcher**: while an exercise's tests run, an operator it rebuilds
  (:mod:`labkit.grade.shortcuts`) is refused when student code is on the stack. A
  ``TorchDispatchMode`` (PyTorch's extension point) sees the operator however it was spelled:
  ``F.gelu``, ``torch._C._nn.gelu``, ``torch.ops.aten.gelu.default``, ``torch._VF``...;
* **work on other threads**: dispatch modes, MemTracker's and FlopCounterMode's included, hold
  for one thread. A thread started during a test gets a mode (``threading.setprofile``) that
  refuses torch operators run with student code on its stack: a measurement cannot be dodged;
* **shared state**: torch's global state (default dtype, grad mode, modes, global hooks) is
  compared after every test with the state before any student module was imported, and put
  back; the tests' shared constants (``TOL = dict(atol=..., rtol=...)``) are read-only; the set
  of pytest plugins and of their hook functions is fixed when the session starts;
* **files**: an audit hook notes the files student code opens outside the test's scratch folder.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.grade import shortcuts

SPEC = json.loads(os.environ.get("LABKIT_GRADE_SPEC", "{}"))
"""{"fd": the result pipe, "scratch": the one writable folder, "student": {file: [[first, last]
line of each unit of student code]}}: what the parent passed (nothing in it is secret)."""
STUDENT = {os.path.realpath(f): [tuple(r) for r in rs] for f, rs in SPEC.get("student", {}).items()}
READ_OK = tuple(os.path.realpath(p) + os.sep for p in (SPEC.get("scratch", "/nonexistent"),
                                                       sys.prefix, sys.base_prefix)) + ("/dev/",)


def _send(record: dict) -> None:
    fd = SPEC.get("fd", -1)
    data = (json.dumps(record) + "\n").encode()
    while fd >= 0 and data:
        data = data[os.write(fd, data):]


_codes: dict = {}


def student_frame(frame=None) -> str | None:
    """"file:line" of the innermost frame of student code on this thread's stack, or None."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        hit = _codes.get(code)
        if hit is None:
            ranges = STUDENT.get(code.co_filename) or STUDENT.get(os.path.realpath(code.co_filename)) \
                if code.co_filename.startswith("/") else None
            hit = _codes[code] = bool(ranges) and any(a <= code.co_firstlineno <= b for a, b in ranges)
        if hit:
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class Test:
    """What this process saw of the test that runs now (one at a time)."""
    exercise: str | None = None
    refused: list[str] = []
    flags: list[str] = []


class Refuse(TorchDispatchMode):
    """Refuse, with student code on the stack, the operators ``exercise`` rebuilds (or, on a thread
    started during a test, every operator: ``exercise=None``)."""

    def __init__(self, exercise: str | None):
        super().__init__()
        self.exercise, self.hits = exercise, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        hit = self.hits.get(func)
        if hit is None:
            hit = self.hits[func] = self.exercise is None or bool(shortcuts.matching(
                self.exercise, func.overloadpacket.__name__, func.namespace))
        where = hit and student_frame()
        if where:
            why = (shortcuts.reason(self.exercise, func.name()) if self.exercise else
                   f"torch operator {func.name()} run by student code on another thread: the "
                   "test's measurements and refusals hold for its own thread only")
            Test.refused.append(f"{why} (from {where})")
            raise PermissionError(f"refused while grading: {why}")
        return func(*args, **(kwargs or {}))


def _on_new_thread(frame, event, arg):
    sys.setprofile(None)
    if Test.exercise is not None:
        Refuse(None).__enter__()  # never left: it ends with the thread


def _audit(event, args):
    if event == "open" and Test.exercise is not None and isinstance(args[0], (str, bytes)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if not (path + os.sep).startswith(READ_OK) and not path.startswith("/dev/"):
            where = student_frame(sys._getframe(1))
            if where and not sys._getframe(1).f_code.co_filename.startswith("<frozen"):
                Test.flags.append(f"files: opened {path} (from {where})")


def _torch_state() -> dict:
    import torch.nn.modules.module as module
    import torch.optim.optimizer as optimizer

    hooks = [v for n, v in vars(module).items() if n.startswith("_global_") and n.endswith("hooks")]
    hooks += [optimizer._global_optimizer_pre_hooks, optimizer._global_optimizer_post_hooks]
    return {"default dtype": torch.get_default_dtype(), "grad mode": torch.is_grad_enabled(),
            "dispatch modes": torch._C._len_torch_dispatch_stack(),
            "torch-function modes": torch._C._len_torch_function_stack(),
            "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
            "global module and optimizer hooks": sum(map(len, hooks)), "_hooks": hooks}


def _restore(before: dict) -> list[str]:
    """torch's global state that differs from ``before``, each put back."""
    now = _torch_state()
    changed = [f"torch's {k} ({before[k]} -> {now[k]})" for k in before
               if not k.startswith("_") and now[k] != before[k]]
    torch.set_default_dtype(before["default dtype"])
    torch.set_grad_enabled(before["grad mode"])
    torch.use_deterministic_algorithms(before["deterministic algorithms"])
    while torch._C._len_torch_dispatch_stack() > before["dispatch modes"]:
        torch._C._pop_torch_dispatch_stack()
    while torch._C._len_torch_function_stack() > before["torch-function modes"]:
        torch._C._pop_torch_function_stack()
    if now["global module and optimizer hooks"] != before["global module and optimizer hooks"]:
        for hooks in now["_hooks"]:
            hooks.clear()  # the course installs none; the state before had none
    return changed


class Session:
    config = None
    state: dict = {}
    plugins: tuple = ()
    seen: dict = {}
    tamper: list = []


def _plugins(config) -> tuple:
    """Every registered plugin, and every hook function of the hooks that make a report."""
    hooks = ("pytest_runtest_makereport", "pytest_runtest_logreport", "pytest_report_teststatus",
             "pytest_runtest_protocol", "pytest_runtest_call", "pytest_pyfunc_call")
    pm = config.pluginmanager
    return (tuple(map(id, pm.get_plugins())),
            tuple(id(impl.function) for h in hooks for impl in getattr(pm.hook, h).get_hookimpls()))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    Session.config, Session.state = session.config, _torch_state()
    Session.plugins = _plugins(session.config)[0]
    threading.setprofile(_on_new_thread)
    sys.addaudithook(_audit)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    added = [p for p in session.config.pluginmanager.get_plugins() if id(p) not in Session.plugins]
    if any(not (getattr(p, "__name__", "") if isinstance(p, types.ModuleType) else
                type(p).__module__).startswith("_pytest.") for p in added):
        Session.tamper.append("a pytest plugin was registered while the tests were collected")
    Session.plugins = _plugins(session.config)  # from now on, fixed
    _freeze_shared_constants(session)
    _send({"kind": "hello", "collected": [item.nodeid for item in session.items]})


def _freeze_shared_constants(session) -> None:
    """Make the tests' module-level constant dicts of plain values (tolerances, settings)
    read-only, in every test module that holds them: an exercise cannot widen them."""
    tests = os.path.realpath(str(session.config.rootpath / "tests")) + os.sep
    frozen: dict[int, types.MappingProxyType] = {}
    for mod in list(sys.modules.values()):
        if not os.path.realpath(getattr(mod, "__file__", None) or "/").startswith(tests):
            continue
        for name, value in list(vars(mod).items()):
            if name.isupper() and type(value) is dict and all(
                    isinstance(v, (int, float, str, bool, tuple, type(None))) for v in value.values()):
                setattr(mod, name, frozen.setdefault(id(value), types.MappingProxyType(value)))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    mark = item.get_closest_marker("exercise")
    Test.exercise, Test.refused, Test.flags = (mark.args[0] if mark and mark.args else "?"), [], []
    mode = Refuse(Test.exercise) if Test.exercise in shortcuts.REBUILDS else None
    if mode is not None:
        mode.__enter__()
    yield
    tamper = list(Session.tamper)
    if mode is not None:
        while torch._C._len_torch_dispatch_stack() > Session.state["dispatch modes"] + 1:
            torch._C._pop_torch_dispatch_stack()
            Test.refused.append("a dispatch mode was left on after the test")
        mode.__exit__(None, None, None)
    Test.exercise = None
    changed = _restore(Session.state)
    if _plugins(item.config) != Session.plugins:
        tamper.append("pytest's plugins or hook functions changed while the tests ran")
    record = dict(item.config._labkit_results.get(item.nodeid) or {"outcome": "failed"})
    seen = Session.seen.pop(item.nodeid, None)
    problems = Test.refused + changed + tamper
    if seen and record.get("outcome") == "passed":
        problems.append(f"the test's report {seen}, its record said passed")
    if problems:
        record.update(outcome="failed", message="refused while grading: " + " | ".join(problems))
    _send({"kind": "test", "nodeid": item.nodeid, "outcome": record.get("outcome"),
           "message": (record.get("message") or "")[:3000],
           "details": (record.get("details") or "")[-3000:],
           "flags": sorted(set(Test.flags))[:20], "tamper": tamper})


def pytest_runtest_logreport(report):
    if report.failed:
        Session.seen[report.nodeid] = "failed"
    elif report.skipped and report.nodeid not in Session.seen:
        Session.seen[report.nodeid] = "skipped"


def pytest_sessionfinish(session, exitstatus):
    _send({"kind": "done"})
