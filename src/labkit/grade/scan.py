"""The static scan of a student's extracted code: refuse what no exercise needs and tampering uses.

It reads only what :mod:`labkit.grade.extract` takes from a submission (exercise units, added
definitions and imports) and refuses, with the reason:

* imports of the grader and of what tampering is made of: ``labkit.grade.plugin``, ``labkit.grade``,
  ``pytest``/``_pytest``, ``gc``, ``ctypes``, ``atexit``, ``inspect``, ``importlib``, ``builtins``,
  ``signal``, ``subprocess``, ``multiprocessing``, ``sys``'s internals (``sys.modules``,
  ``sys._getframe``, ``settrace``, ``setprofile``, ``meta_path``…), ``os._exit``/``os.kill``/
  ``os.fork``/``os.system``/``os.exec*``;
* ``exec``, ``eval``, ``compile``, ``__import__``, ``globals``, ``vars``, ``breakpoint``;
* frame, code and subclass introspection (``__globals__``, ``__subclasses__``, ``f_back``,
  ``f_locals``, ``__code__``, ``__closure__``, ``__dict__`` of a module…), also when spelled as a
  string in ``getattr``;
* ``global`` statements (an exercise body rebinding the module's names) and assignments to,
  ``setattr`` or ``del`` on attributes of imported modules or of the module's given functions and
  classes (monkey-patching torch, numpy or labkit);
* the library functions the exercise rebuilds (:mod:`labkit.grade.shortcuts`), named;
* reaching what decides the grade through objects rather than names: attribute names that lead
  to the interpreter or the grader on any object (``torch.sys.modules``, ``[labkit][0].grade``,
  :data:`ATTR_DENY`), every ``__dunder__`` attribute, name or string but a few
  (:data:`DUNDER_OK`), a module used as a value (in a list, an argument, a return value),
  ``getattr``/``setattr`` with a computed name (``getattr(self, name)`` and loops over literal
  names excepted), ``type(name, bases, ns)``, ``operator.attrgetter``, unpickling
  (``weights_only=False``), the references and harnesses, ``unittest.mock``, ``torch.library``,
  ``torch.hub``, ``torch.package``, ``torch.overrides``;
* objects that lie to a test: a class defining a comparison, truth, conversion, arithmetic,
  hashing, ``__format__``, ``__getattr__``, descriptor, pickling or ``__torch_function__``
  method (:data:`DUNDER_DEFINE_OK` lists what may be defined), a tensor/array subclass, a
  metaclass, a generator paused inside ``with`` (a mode left on);
* code that runs at import (decorators, default values, annotations, class bodies, module-level
  constants): it may only build values (:data:`SAFE_IMPORT_TIME_CALLS`).

It is one wall of two: the child process that runs the tests also guards at run time
(:mod:`labkit.grade.guard`). A refused exercise is graded as its stub, with the reason.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from labkit.grade import shortcuts

FORBIDDEN_MODULES = {
    "labkit.grade.plugin": "the grading plugin is the course's: an exercise never imports it",
    "labkit.grade": "the grader is the course's: an exercise never imports it",
    "pytest": "pytest runs the graders: an exercise never needs it",
    "_pytest": "pytest's internals run the graders: an exercise never needs them",
    "gc": "walking the garbage collector reaches the grader's objects: no exercise needs it",
    "ctypes": "raw memory access can rewrite anything in the process: no exercise needs it",
    "atexit": "exit handlers run after the tests: no exercise needs them",
    "inspect": "frame and source introspection reaches the grader: no exercise needs it",
    "importlib": "dynamic imports hide what a module uses: no exercise needs them",
    "builtins": "rebinding builtins changes the graders' code: no exercise needs it",
    "signal": "signal handlers can interrupt the graders: no exercise needs them",
    "subprocess": "an exercise runs in its own process: it never starts programs",
    "multiprocessing": "ranks are started by labkit.ranks, not by an exercise",
    "faulthandler": "no exercise needs it", "sysconfig": "no exercise needs it",
    "marshal": "building code objects: no exercise needs it",
    "types": "building functions and code objects: no exercise needs it",
    "runpy": "running modules: no exercise needs it", "code": "an interpreter: no exercise needs it",
    "pdb": "a debugger attaches to frames: not while grading", "bdb": "a debugger: not while grading",
    "traceback": "tracebacks hold frames: no exercise needs them",
    "threading.settrace": "tracing other code: no exercise needs it",
    "threading.setprofile": "tracing other code: no exercise needs it",
    "posix": "the os module's raw half (posix._exit, posix.kill): no exercise needs it",
    "nt": "the os module's raw half: no exercise needs it",
    "_thread": "interrupting the main thread: no exercise needs it",
    "_signal": "signal handlers can interrupt the graders: no exercise needs them",
    "_ctypes": "raw memory access: no exercise needs it",
    "_posixsubprocess": "starting programs: no exercise needs it",
    "_imp": "the import machinery: no exercise needs it",
    "_frozen_importlib": "the import machinery: no exercise needs it",
    "_frozen_importlib_external": "the import machinery: no exercise needs it",
    "_weakref": "no exercise needs it", "_abc": "no exercise needs it",
    "pty": "starting programs: no exercise needs it", "pickle": "unpickling runs code: no "
    "exercise needs it (torch.save/torch.load are the course's format)",
    "labkit.reference": "the graders' references are what an exercise is compared against: an "
    "exercise computes its answer itself",
    "labkit.harness": "the graders' harnesses drive the exercises and the references: an "
    "exercise never calls them", "labkit.cross_check": "the course's cross-checks run the "
    "references: an exercise never calls them",
    "unittest": "mock objects (unittest.mock.ANY equals anything) stand in for answers: no "
    "exercise needs them", "doctest": "no exercise needs it",
    "copyreg": "pickling hooks run code: no exercise needs them",
    "shelve": "unpickling runs code: no exercise needs it", "dill": "unpickling runs code",
    "cloudpickle": "unpickling runs code", "pydoc": "no exercise needs it",
    "operator.attrgetter": "an attribute looked up by a computed name hides what the code uses",
    "operator.methodcaller": "a method looked up by a computed name hides what the code uses",
    "torch.hub": "torch.hub imports and runs code from files: no exercise needs it",
    "torch.package": "torch.package imports code from archives: no exercise needs it",
    "torch.utils.cpp_extension": "compiling and loading native code: no exercise needs it",
    "torch.library": "registering kernels replaces PyTorch's own operators (the ones the graders "
    "compare with): no exercise needs it",
    "torch._library": "registering kernels replaces PyTorch's operators: no exercise needs it",
    "torch.overrides": "torch-function modes intercept every torch call, the graders' too: no "
    "exercise needs them",
    "torch.jit.load": "loading TorchScript runs code from files: no exercise needs it",
    "torch.serialization": "torch.save/torch.load are enough (unpickling runs code)",
    "torch.utils._python_dispatch._push_mode": "a dispatch mode left on intercepts the graders' "
    "own torch calls: enter modes with `with`",
    "torch.utils._python_dispatch._pop_mode": "modes are entered and left with `with`",
}
SYS_INTERNALS = {"modules", "_getframe", "settrace", "setprofile", "_current_frames", "meta_path",
                 "path_hooks", "path_importer_cache", "addaudithook", "audit", "exc_info",
                 "_clear_type_cache", "breakpointhook", "excepthook", "exit", "stdin",
                 "gettrace", "getprofile", "displayhook", "exception", "last_traceback",
                 "_current_exceptions", "monitoring", "setrecursionlimit", "settrace"}
OS_FORBIDDEN = {"_exit", "kill", "killpg", "fork", "forkpty", "system", "popen", "execv",
                "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnl",
                "spawnle", "spawnv", "spawnve", "spawnlp", "spawnvp", "posix_spawn",
                "posix_spawnp", "abort", "setsid", "chmod", "chown", "putenv", "unsetenv",
                "register_at_fork", "pidfd_open", "environ", "getenv", "environb"}
NAMES = {"exec": "runs code built at run time", "eval": "runs code built at run time",
         "compile": "builds code at run time", "__import__": "a hidden import",
         "globals": "reaches the module's namespace", "vars": "reaches a namespace",
         "breakpoint": "a debugger", "__builtins__": "the builtins' namespace",
         "exit": "ends the process", "quit": "ends the process"}
ATTRIBUTES = {"__globals__", "__subclasses__", "__code__", "__closure__", "__builtins__",
              "__defaults__", "__kwdefaults__", "__self__", "__func__", "__wrapped__",
              "__getattribute__", "__setattr__", "__delattr__", "__class__", "__bases__",
              "__mro__", "__base__", "__loader__", "__spec__", "__import__", "__reduce__",
              "__reduce_ex__", "__init_subclass__", "__set_name__",
              "f_back", "f_locals", "f_globals", "f_code", "f_builtins", "f_trace",
              "tb_frame", "tb_next", "gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame",
              "co_code", "co_consts", "cell_contents", "_getframe", "__traceback__"}
DUNDER_OK = {"__init__", "__name__", "__qualname__", "__doc__", "__module__", "__file__",
             "__slots__", "__post_init__"}
"""Dunder names an exercise may read or define; every other ``__x__`` attribute or string is
refused (they reach frames, namespaces, classes and the operators' protocol)."""
DUNDER_DEFINE_OK = DUNDER_OK | {"__call__", "__repr__", "__str__", "__len__", "__iter__",
                                "__next__", "__getitem__", "__setitem__", "__enter__", "__exit__",
                                "__torch_dispatch__"}
"""Special methods a student's class may define. The others — comparisons, ``__bool__``,
numeric conversions and arithmetic, ``__hash__``, ``__contains__``, ``__format__``,
``__getattr__``, descriptors, ``__torch_function__``, ``__init_subclass__``, pickling… — make an
object that lies to the test that checks it (an ``__eq__`` that returns True passes every
``assert got == expected``). ``__torch_dispatch__`` only in a ``TorchDispatchMode`` subclass
(what the course's recorders use), never in a tensor subclass."""
ATTR_DENY = {
    "sys": "the interpreter's module (sys.modules reaches the grader) through another module",
    "os": "the os module through another module", "gc": "the garbage collector",
    "builtins": "the builtins' namespace", "importlib": "the import machinery",
    "inspect": "frame introspection", "ctypes": "raw memory access", "atexit": "exit handlers",
    "subprocess": "starting programs", "signal": "signal handlers", "pickle": "unpickling",
    "marshal": "code objects", "multiprocessing": "starting processes",
    "grading": "the grading plugin", "grade": "the grader", "reference": "the graders' "
    "references", "harness": "the graders' harnesses", "cross_check": "the course's cross-checks",
    "pytest": "the test runner", "_pytest": "the test runner", "unittest": "mock objects",
    "hub": "torch.hub runs code from files", "package": "torch.package imports code",
    "cpp_extension": "native code", "library": "torch.library replaces operators",
    "_library": "torch.library replaces operators", "overrides": "torch-function modes",
    "py_impl": "a Python kernel replaces an operator", "py_kernels": "an operator's kernels",
    "_push_mode": "a mode left on", "_pop_mode": "a mode left on",
    "_set_torch_function_mode": "a mode left on", "_make_subclass": "tensor subclasses",
    "_make_wrapper_subclass": "tensor subclasses", "solutions_overlay": "the solutions' path",
    "_SOLUTIONS_ROOT": "the solutions' path", "environ": "the environment",
    "getenv": "the environment", "argv": "the grader's command line", "orig_argv":
    "the grader's command line", "_exit": "ending the process", "serialization": "unpickling",
    **dict.fromkeys((
        "register_module_forward_hook", "register_module_forward_pre_hook",
        "register_module_full_backward_hook", "register_module_full_backward_pre_hook",
        "register_module_backward_hook", "register_module_buffer_registration_hook",
        "register_module_module_registration_hook", "register_module_parameter_registration_hook",
        "register_optimizer_step_pre_hook", "register_optimizer_step_post_hook",
        "_push_saved_tensors_default_hooks"),
        "a global hook runs on every module or optimizer, the graders' references too"),
}
"""Attribute names refused on any object (however it was reached: ``torch.sys.modules``,
``[labkit][0].grading``, ``getattr(x, "grade")``), with what they reach."""
WHY_DENY = "no exercise needs it, and it reaches what decides the grade"
SAFE_IMPORT_TIME_CALLS = {"field", "dataclasses.field", "torch.device", "torch.dtype",
                          "float", "int", "str", "bool", "tuple", "frozenset", "set", "list",
                          "dict", "range", "math.sqrt", "math.log", "math.log2", "math.exp",
                          "math.pow", "math.prod", "math.ceil", "math.floor", "dataclass",
                          "dataclasses.dataclass", "torch.no_grad", "torch.enable_grad",
                          "torch.inference_mode", "functools.lru_cache", "lru_cache",
                          "functools.wraps", "wraps", "functools.cache", "cache", "staticmethod",
                          "classmethod", "property", "torch.finfo", "torch.iinfo",
                          "functools.partial", "partial", "len", "min", "max", "abs", "round",
                          "sum", "sorted", "enumerate", "zip", "torch.float32", "typing.TypeVar",
                          "TypeVar", "namedtuple", "collections.namedtuple",
                          "typing.NamedTuple", "NamedTuple"}
"""What code that runs when the module is imported (decorators, default values, annotations,
class bodies, module-level constants) may call: it runs before any test and outside an
exercise, so it may only build values, never act."""
WHY_ATTRIBUTE = "frame, code and class introspection reaches the grader's objects: no exercise needs it"


WHY_SPECIAL = ("a special method that answers comparisons, truth, conversions or torch's "
               "protocols can make a wrong result pass the graders' checks (an __eq__ that "
               "returns True passes `assert got == expected`): an exercise returns plain values")
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


_MODULE_PATHS: dict[str, bool] = {}


def _is_module_path(full: str) -> bool:
    """Whether the dotted name is a module (``torch.testing``) rather than a function, a class
    or a constant (``torch.float32``), without importing anything new."""
    if full not in _MODULE_PATHS:
        import importlib.util
        import sys

        ok = full in sys.modules
        if not ok:
            try:
                ok = importlib.util.find_spec(full) is not None
            except (ImportError, ValueError, AttributeError):
                ok = False
        _MODULE_PATHS[full] = ok
    return _MODULE_PATHS[full]


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


@dataclass
class Refusal:
    """One thing the scan refuses in a student's code."""
    path: str
    line: int
    unit: str
    exercises: tuple[str, ...]
    what: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in `{self.unit}`: {self.what} — {self.why}"


def _dotted(node: ast.AST) -> list[str] | None:
    """["torch", "nn", "functional", "gelu"] for ``torch.nn.functional.gelu``; None otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def aliases(tree: ast.Module) -> dict[str, str]:
    """What each top-level imported name of a module refers to: {"F": "torch.nn.functional"}.

    Simple module-level assignments of a dotted path (``aten = torch.ops.aten``) count too.
    """
    out: dict[str, str] = {}
    for node in ast.walk(tree) if False else tree.body:
        _bind_imports(node, out)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            dotted = _dotted(node.value)
            if dotted and dotted[0] in out:
                out[node.targets[0].id] = ".".join([out[dotted[0]], *dotted[1:]])
    return out


def _bind_imports(node: ast.AST, out: dict[str, str]) -> None:
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname:
                out[a.asname] = a.name
            else:
                out[a.name.split(".")[0]] = a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        for a in node.names:
            out[a.asname or a.name] = f"{node.module}.{a.name}"


def _forbidden_module(name: str) -> str | None:
    for mod, why in FORBIDDEN_MODULES.items():
        if name == mod or name.startswith(mod + "."):
            return why
    return None


def import_refusal(node: ast.AST) -> str | None:
    """Why a module-level ``import`` the student added is refused, or None (it is then taken)."""
    s = _Scanner("", "", (), {}, set(), {})
    s.visit(node)
    return s.found[0].why if s.found else None


class _Scanner(ast.NodeVisitor):
    def __init__(self, path, unit, exercises, names, given, blocked):
        self.path, self.unit, self.exercises = path, unit, exercises
        self.names = dict(names)     # name -> dotted path (imports, module aliases)
        self.given = given           # the module's given functions and classes
        self.blocked = blocked       # {dotted name: exercise} the exercises rebuild
        self.found: list[Refusal] = []
        self.called: set[int] = set()      # ids of nodes that are the function of a call
        self.type_calls: set[int] = set()  # ids of `type` names called with one argument
        self.with_depth = 0
        self.defined: set[str] = set()      # the module's own functions (their __dict__ is fine)
        self.params: set[str] = set()       # an exercise's parameters (the test's objects)
        self.unpacked: set[int] = set()     # ids of expressions unpacked with ** in a call or {}
        self.loops: dict[str, list[str]] = {}  # loop variables over literal strings
        self.classes: set[str] = set()       # local names bound to type(x)

    def visit_For(self, node):
        """``for name in ("dp", "tp"): getattr(plan, name)``: the names are literal."""
        loops = {}
        if isinstance(node.iter, (ast.Tuple, ast.List)):
            targets = [node.target] if isinstance(node.target, ast.Name) else \
                list(node.target.elts) if isinstance(node.target, ast.Tuple) else []
            for i, t in enumerate(targets):
                values = []
                for e in node.iter.elts:
                    e = e if isinstance(node.target, ast.Name) else \
                        (e.elts[i] if isinstance(e, ast.Tuple) and len(e.elts) > i else None)
                    values.append(e.value if isinstance(e, ast.Constant) and
                                  isinstance(e.value, str) else None)
                if isinstance(t, ast.Name) and values and None not in values:
                    loops[t.id] = values
        self.visit(node.iter)
        self.visit(node.target)
        self.loops.update(loops)
        for stmt in (*node.body, *node.orelse):
            self.visit(stmt)

    def visit_Dict(self, node):
        self.unpacked |= {id(v) for k, v in zip(node.keys, node.values) if k is None}
        self.generic_visit(node)

    def refuse(self, node, what, why):
        self.found.append(Refusal(self.path, getattr(node, "lineno", 0), self.unit,
                                  self.exercises, what, why))

    def resolve(self, node) -> str | None:
        dotted = _dotted(node)
        if not dotted:
            return None
        if dotted[0] in self.names:
            return ".".join([self.names[dotted[0]], *dotted[1:]])
        return None

    # imports ---------------------------------------------------------------
    def visit_Import(self, node):
        for a in node.names:
            why = _forbidden_module(a.name)
            if why:
                self.refuse(node, f"import {a.name}", why)
        _bind_imports(node, self.names)

    def visit_ImportFrom(self, node):
        if node.module:
            mod = node.module
            for a in node.names:
                full = f"{mod}.{a.name}"
                why = _forbidden_module(mod) or _forbidden_module(full) or self._attr_why(full) \
                    or (f"{ATTR_DENY[a.name]}: {WHY_DENY}" if a.name in ATTR_DENY else None)
                if why:
                    self.refuse(node, f"from {mod} import {a.name}", why)
                self._check_blocked(node, full)
        _bind_imports(node, self.names)

    # names, attributes, calls ------------------------------------------------
    def visit_Name(self, node):
        if node.id in NAMES and node.id not in self.names:
            self.refuse(node, f"`{node.id}`", NAMES[node.id] + ": no exercise needs it")
        elif _dunder(node.id) and node.id not in DUNDER_OK:
            self.refuse(node, f"`{node.id}`", WHY_ATTRIBUTE)
        elif node.id == "type" and id(node) not in self.type_calls and "type" not in self.names:
            self.refuse(node, "`type` used other than as `type(x)`",
                        "type(name, bases, namespace) builds classes at run time (and hides "
                        "what they define): no exercise needs it")
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.loops.pop(node.id, None)  # no longer the loop's literal
        if node.id == "self" and isinstance(node.ctx, (ast.Store, ast.Del)):
            self.refuse(node, "an assignment to `self`", "`self` is the object the method was "
                        "called on: rebinding it hides what the code reaches")

    def _attr_why(self, full: str) -> str | None:
        parts = full.split(".")
        if parts[0] == "sys" and len(parts) > 1 and parts[1] in SYS_INTERNALS:
            return "the interpreter's internals (modules, frames, tracing) reach the grader"
        if parts[0] == "os" and len(parts) > 1 and parts[1] in OS_FORBIDDEN:
            return "processes, signals and the environment are the grader's, not an exercise's"
        if len(parts) > 1 and parts[-1] in ATTRIBUTES:
            return WHY_ATTRIBUTE
        return _forbidden_module(full)

    def _check_blocked(self, node, full: str) -> None:
        for name, ex in self.blocked.items():
            if full == name or full.startswith(name + "."):
                self.refuse(node, f"`{full}`", shortcuts.reason(ex, name))
                return

    def visit_Attribute(self, node):
        own_dict = node.attr == "__dict__" and isinstance(node.value, ast.Name) \
            and node.value.id not in self.names and (
                node.value.id in self.defined or  # the module's own function: its attributes
                (node.value.id in self.params and id(node) in self.unpacked))  # {**cfg.__dict__}
        if node.attr in ATTRIBUTES or (_dunder(node.attr) and node.attr not in DUNDER_OK
                                       and not own_dict):
            self.refuse(node, f"`.{node.attr}`", WHY_ATTRIBUTE)
        elif node.attr in ATTR_DENY and not (node.attr == "modules" and id(node) in self.called):
            self.refuse(node, f"`{ast.unparse(node)[:80]}`", f"{ATTR_DENY[node.attr]}: {WHY_DENY}")
        elif node.attr == "modules" and id(node) not in self.called:
            self.refuse(node, f"`{ast.unparse(node)[:80]}` (not called)",
                        f"a module table (sys.modules) reaches the grader: {WHY_DENY}")
        full = self.resolve(node)
        if full:
            why = self._attr_why(full)
            if why:
                self.refuse(node, f"`{full}`", why)
            self._check_blocked(node, full)
        for leaf, (ex, name) in shortcuts.private_leaves(self.blocked).items():
            if node.attr == leaf and not full:
                self.refuse(node, f"`.{leaf}`", shortcuts.reason(ex, name))
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str):
            if node.value in ATTRIBUTES or node.value in ("__dict__", "__import__") or \
                    (_dunder(node.value) and node.value not in DUNDER_DEFINE_OK):
                self.refuse(node, f"the string {node.value!r}", WHY_ATTRIBUTE)
            for leaf, (ex, name) in shortcuts.private_leaves(self.blocked).items():
                if node.value == leaf or node.value == name:
                    self.refuse(node, f"the string {node.value!r}", shortcuts.reason(ex, name))

    def _is_module_ref(self, node) -> bool:
        dotted = _dotted(node)
        return bool(dotted) and (dotted[0] in self.names or dotted[0] in self.given)

    def visit_Call(self, node):
        func = node.func
        self.called.add(id(func))
        self.unpacked |= {id(k.value) for k in node.keywords if k.arg is None}
        args = list(node.args)
        if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(args) >= 2 \
                and isinstance(args[1], ast.Constant):
            args = args[1:]  # getattr(dist, "all_gather_single", None): checked as dist.<name>
        for a in (*args, *[k.value for k in node.keywords]):
            self._no_module_value(a, "passed to a call")
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args and (
                isinstance(node.args[0], ast.Call) or (isinstance(node.args[0], ast.Name)
                                                       and node.args[0].id in self.classes)):
            self.refuse(node, f"`{func.id}({ast.unparse(node.args[0])[:40]}, ...)`",
                        "patching the class of an object changes what the graders run")
        if isinstance(func, ast.Name) and func.id == "type" and len(node.args) == 1 \
                and not node.keywords:
            self.type_calls.add(id(func))
        if isinstance(func, ast.Name) and func.id in ("getattr", "setattr", "delattr") \
                and len(node.args) >= 2:
            name = node.args[1]
            literal = [name.value] if isinstance(name, ast.Constant) and \
                isinstance(name.value, str) else self.loops.get(getattr(name, "id", None))
            if literal:
                for value in literal:
                    if _dunder(value) and value not in DUNDER_OK:
                        self.refuse(node, f"`{func.id}(..., {value!r})`", WHY_ATTRIBUTE)
                if {*literal} & ({*ATTR_DENY} | {"modules"}):
                    name = ast.Constant(sorted({*literal} & ({*ATTR_DENY} | {"modules"}))[0])
                    self.refuse(node, f"`{func.id}(..., {name.value!r})`",
                                f"{ATTR_DENY.get(name.value, 'a module table')}: {WHY_DENY}")
            elif not (func.id == "getattr" and isinstance(node.args[0], ast.Name)
                      and node.args[0].id in ("self", "cls")):
                self.refuse(node, f"`{func.id}({ast.unparse(node.args[0])[:40]}, <computed name>)`",
                            "an attribute looked up by a computed name hides what the code "
                            "reaches (only an object's own attributes, getattr(self, name), may "
                            "be): spell the name out")
        for kw in node.keywords:
            if kw.arg in ("weights_only", "allow_pickle") and not (
                    isinstance(kw.value, ast.Constant) and
                    kw.value.value is (kw.arg == "weights_only")):
                self.refuse(node, f"`{kw.arg}={ast.unparse(kw.value)}`",
                            "unpickling arbitrary objects runs code: load weights only")
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
            if self._is_module_ref(node.args[0]):
                self.refuse(node, f"`{func.id}({ast.unparse(node.args[0])}, ...)`",
                            "patching a module, or the course's given code, changes what the "
                            "graders run: an exercise only writes its own code")
        if isinstance(func, ast.Name) and func.id in ("getattr", "setattr", "delattr", "hasattr") \
                and len(node.args) >= 2 and self._is_module_ref(node.args[0]):
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                base = self.resolve(node.args[0])
                if base:
                    full = f"{base}.{name.value}"
                    why = self._attr_why(full)
                    if why:
                        self.refuse(node, f"`{full}`", why)
                    self._check_blocked(node, full)
            else:
                self.refuse(node, f"`{func.id}({ast.unparse(node.args[0])}, <computed name>)`",
                            "a module attribute looked up by a computed name hides what the "
                            "code uses: spell the name out")
        self.generic_visit(node)

    # assignments -------------------------------------------------------------
    def _module_value(self, node) -> str | None:
        """The module a bare expression refers to (``torch``, ``torch.testing``, an alias), or None."""
        full = self.resolve(node)
        return full if full and _is_module_path(full) else None

    def _no_module_value(self, node, where: str) -> None:
        """A module is only ever the base of an attribute (``torch.x``): one put in a list,
        passed, returned or stored hides from the scan what the code reaches through it."""
        full = self._module_value(node)
        if full:
            self.refuse(node, f"the module `{full}` {where}",
                        "a module used as a value (in a list, an argument, a return value, an "
                        "attribute) hides from the checks what is reached through it: use its "
                        "functions by name")

    def visit_List(self, node):
        for e in node.elts:
            self._no_module_value(e, "in a list, tuple or set")
        self.generic_visit(node)

    visit_Tuple = visit_Set = visit_List

    def visit_Return(self, node):
        if node.value is not None:
            self._no_module_value(node.value, "returned")
        self.generic_visit(node)

    def visit_Subscript(self, node):
        self._no_module_value(node.value, "subscripted")
        self.generic_visit(node)

    def visit_comprehension(self, node):
        self._no_module_value(node.iter, "iterated")
        self.generic_visit(node)

    def _check_target(self, target, verb):
        base = target.value if isinstance(target, (ast.Attribute, ast.Subscript)) else None
        if base is not None and (isinstance(base, ast.Call) or (
                isinstance(base, ast.Name) and base.id in self.classes)):
            self.refuse(target, f"{verb} `{ast.unparse(target)[:70]}`",
                        "patching the class of an object (type(x).name = ...) changes what the "
                        "graders run: an exercise only writes its own code")
        if isinstance(target, ast.Attribute) and self._is_module_ref(target.value):
            self.refuse(target, f"{verb} `{ast.unparse(target)}`",
                        "patching a module, or the course's given code, changes what the graders "
                        "run: an exercise only writes its own code")
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._check_target(t, verb)
        elif isinstance(target, ast.Subscript):
            base = target.value
            if isinstance(base, ast.Attribute) and base.attr == "__dict__":
                self.refuse(target, f"{verb} `{ast.unparse(target)}`", WHY_ATTRIBUTE)

    def visit_Assign(self, node):
        for t in node.targets:
            self._check_target(t, "assignment to")
        # a local alias of a module (m = torch.nn.functional) stays a module for the checks
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            full = self.resolve(node.value)
            if full:
                self.names[node.targets[0].id] = full
            elif isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) \
                    and node.value.func.id == "type":
                self.classes.add(node.targets[0].id)
        else:
            self._no_module_value(node.value, "stored in an attribute or an item")
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._check_target(node.target, "assignment to")
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        self._check_target(node.target, "assignment to")
        self.generic_visit(node)

    def visit_Delete(self, node):
        for t in node.targets:
            self._check_target(t, "del")
        self.generic_visit(node)

    # classes, modes, generators ----------------------------------------------------
    def visit_ClassDef(self, node):
        bases = [self.resolve(b) or ast.unparse(b) for b in node.bases]
        for b, text in zip(node.bases, bases):
            if text.split(".")[-1] in ("Tensor", "Parameter", "UninitializedParameter", "ndarray",
                                       "generic", "matrix", "MaskedArray", "number", "floating",
                                       "integer", "Mock", "MagicMock") or \
                    text in ("torch.Tensor", "torch.nn.Parameter", "torch._C.TensorBase"):
                self.refuse(b, f"class `{node.name}({ast.unparse(b)})`",
                            "a tensor (or array) subclass can answer the graders' comparisons "
                            "(its methods, (got == want).all(), torch functions) with anything: "
                            "return plain tensors and arrays")
        for kw in node.keywords:
            if kw.arg == "metaclass":
                self.refuse(kw, f"`metaclass=` in class `{node.name}`",
                            "a metaclass runs code when the class is made and changes how it "
                            "behaves: no exercise needs one")
        mode = any(t.split(".")[-1].endswith("DispatchMode") for t in bases)
        for stmt in node.body:
            names = []
            if isinstance(stmt, FUNCS):
                names = [stmt.name]
            elif isinstance(stmt, ast.Assign):
                names = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                names = [stmt.target.id]
            for n in names:
                if _dunder(n) and (n not in DUNDER_DEFINE_OK or
                                   (n == "__torch_dispatch__" and not mode)):
                    self.refuse(stmt, f"`{n}` in class `{node.name}`", WHY_SPECIAL)
        self.generic_visit(node)

    def visit_With(self, node):
        self.with_depth += 1
        self.generic_visit(node)
        self.with_depth -= 1

    def visit_Yield(self, node):
        if self.with_depth:
            self.refuse(node, "`yield` inside a `with` block",
                        "a generator paused inside `with` leaves its context (a mode, a hook) "
                        "on while the graders check the result: no exercise needs it")
        self.generic_visit(node)

    visit_YieldFrom = visit_Yield

    def visit_Global(self, node):
        self.refuse(node, f"`global {', '.join(node.names)}`",
                    "an exercise body that rebinds the module's names changes the course's code")


def _import_time_parts(node) -> list[ast.AST]:
    """The expressions of a definition that run when the module is imported, not when it is
    called: decorators, default values, annotations, base classes, class bodies' statements;
    a module-level constant's value."""
    if isinstance(node, FUNCS):
        a = node.args
        parts = [*node.decorator_list, *a.defaults, *[d for d in a.kw_defaults if d is not None]]
        parts += [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg,
                                         a.kwarg) if x is not None and x.annotation is not None]
        return parts + ([node.returns] if node.returns is not None else [])
    if isinstance(node, ast.ClassDef):
        parts = [*node.decorator_list, *node.bases, *[k.value for k in node.keywords]]
        for stmt in node.body:
            if isinstance(stmt, (*FUNCS, ast.ClassDef)):
                parts += _import_time_parts(stmt)
            elif not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
                parts.append(stmt)
        return parts
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        return [node.value] if node.value is not None else []
    return []


def _decorators(node) -> list[ast.AST]:
    """Every decorator of a definition and of the definitions in its class body."""
    out = list(getattr(node, "decorator_list", ()))
    if isinstance(node, ast.ClassDef):
        for stmt in node.body:
            if isinstance(stmt, (*FUNCS, ast.ClassDef)):
                out += _decorators(stmt)
    return out


def _import_time_refusals(s: _Scanner, node) -> None:
    """Code that runs at import (before any test, outside an exercise) may only build values:
    every call in it must be one of :data:`SAFE_IMPORT_TIME_CALLS`; no statement but an
    assignment (and ``pass``) in a class body."""
    for deco in _decorators(node):
        dotted = _dotted(deco)
        if dotted is None:
            continue  # a call: checked below
        name, full = ".".join(dotted), s.resolve(deco)
        if not ({name, full} & SAFE_IMPORT_TIME_CALLS) and dotted[-1] not in (
                "setter", "getter", "deleter"):
            s.refuse(deco, f"the decorator `@{name}`", "a decorator is called when the module "
                     "is imported, before any test: only the usual ones (staticmethod, "
                     "classmethod, property, dataclass, functools' and torch.no_grad) may be")
    for part in _import_time_parts(node):
        if isinstance(part, ast.stmt) and not isinstance(part, (ast.Assign, ast.AnnAssign,
                                                                 ast.Pass)):
            s.refuse(part, f"`{ast.unparse(part).splitlines()[0][:70]}` in a class body",
                     "a class body runs when the module is imported, before any test: it may "
                     "only define methods and constants")
            continue
        for sub in ast.walk(part):
            if isinstance(sub, ast.Call):
                dotted = _dotted(sub.func)
                name = ".".join(dotted) if dotted else None
                full = s.resolve(sub.func) or name
                if not ({name, full} & SAFE_IMPORT_TIME_CALLS):
                    s.refuse(sub, f"the call `{ast.unparse(sub)[:70]}` at import time",
                             "decorators, default values, annotations, class bodies and "
                             "module-level constants run when the module is imported, before "
                             "any test: they may build values (numbers, tuples, torch.device, "
                             "dataclasses.field, @dataclass, @torch.no_grad()...), not call "
                             "other code")


def scan(merged, pristine_source: str) -> list[Refusal]:
    """Every refusal in what ``merged`` (an :class:`~labkit.grade.extract.Merged`) took."""
    tree = ast.parse(pristine_source)
    names = aliases(tree)
    given = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef,
                                                         ast.AsyncFunctionDef))}
    given -= set(merged.added)
    given -= {q.split(".")[0] for q in merged.units if "." not in q}
    defined = {n.name for n in tree.body if isinstance(n, FUNCS)} | {
        n.name for _, n, _ in merged.taken if isinstance(n, FUNCS)}
    found: list[Refusal] = []
    for unit, node, exercises in merged.taken:
        blocked = shortcuts.blocked_for(exercises)
        s = _Scanner(merged.path, unit, exercises, names, given, blocked)
        s.defined = defined
        if unit in merged.units and isinstance(node, FUNCS):
            a = node.args
            s.params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)} - {"self", "cls"}
        if isinstance(node, FUNCS):
            for d in node.decorator_list:
                s.visit(d)
            s.visit(node.args)
            if node.returns is not None:
                s.visit(node.returns)
            for stmt in node.body:
                s.visit(stmt)
        else:
            s.visit(node)
        _import_time_refusals(s, node)
        found += s.found
    return found
