"""The static scan of a student's extracted code: refuse what no exercise needs and tampering uses.

It reads only what :mod:`labkit.grade.extract` takes from a submission (exercise units, added
definitions and imports) and refuses, with the reason:

* imports of the grader and of what tampering is made of: ``labkit.grading``, ``labkit.grade``,
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
* the library functions the exercise rebuilds (:mod:`labkit.grade.shortcuts`), named.

It is one wall of two: the child process that runs the tests also guards at run time
(:mod:`labkit.grade.guard`). A refused exercise is graded as its stub, with the reason.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from labkit.grade import shortcuts

FORBIDDEN_MODULES = {
    "labkit.grading": "the grading plugin is the course's: an exercise never imports it",
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
    "multiprocessing": "ranks are started by labkit.dist, not by an exercise",
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
WHY_ATTRIBUTE = "frame, code and class introspection reaches the grader's objects: no exercise needs it"


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
                why = _forbidden_module(mod) or _forbidden_module(full) or self._attr_why(full)
                if why:
                    self.refuse(node, f"from {mod} import {a.name}", why)
                self._check_blocked(node, full)
        _bind_imports(node, self.names)

    # names, attributes, calls ------------------------------------------------
    def visit_Name(self, node):
        if node.id in NAMES and node.id not in self.names:
            self.refuse(node, f"`{node.id}`", NAMES[node.id] + ": no exercise needs it")

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
        if node.attr in ATTRIBUTES or (node.attr == "__dict__" and self._is_module_ref(node.value)):
            self.refuse(node, f"`.{node.attr}`", WHY_ATTRIBUTE)
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
            if node.value in ATTRIBUTES or node.value in ("__dict__", "__import__"):
                self.refuse(node, f"the string {node.value!r}", WHY_ATTRIBUTE)
            for leaf, (ex, name) in shortcuts.private_leaves(self.blocked).items():
                if node.value == leaf or node.value == name:
                    self.refuse(node, f"the string {node.value!r}", shortcuts.reason(ex, name))

    def _is_module_ref(self, node) -> bool:
        dotted = _dotted(node)
        return bool(dotted) and (dotted[0] in self.names or dotted[0] in self.given)

    def visit_Call(self, node):
        func = node.func
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
    def _check_target(self, target, verb):
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

    def visit_Global(self, node):
        self.refuse(node, f"`global {', '.join(node.names)}`",
                    "an exercise body that rebinds the module's names changes the course's code")


def scan(merged, pristine_source: str) -> list[Refusal]:
    """Every refusal in what ``merged`` (an :class:`~labkit.grade.extract.Merged`) took."""
    tree = ast.parse(pristine_source)
    names = aliases(tree)
    given = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef,
                                                         ast.AsyncFunctionDef))}
    given -= set(merged.added)
    given -= {q.split(".")[0] for q in merged.units if "." not in q}
    found: list[Refusal] = []
    for unit, node, exercises in merged.taken:
        blocked = shortcuts.blocked_for(exercises)
        s = _Scanner(merged.path, unit, exercises, names, given, blocked)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for d in node.decorator_list:
                s.visit(d)
            body = node.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                s.visit(node.args)
            for stmt in body:
                s.visit(stmt)
        else:
            s.visit(node)
        found += s.found
    return found
