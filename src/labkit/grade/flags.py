"""Red flags: what in a student's code the instructor should look at, found by reading it.

The grader does not try to enumerate every trick: inside the process that runs student code, code
can reach everything else in it. Instead it reads the code it took from a submission (exercise
bodies, added definitions, added imports: :mod:`labkit.grade.extract`) in the trusted parent and
raises a short list of **flags** per exercise, shown in ``report.txt``, Gradescope's output and
the CSV. Six flags also **zero** the exercise (it is graded as its stub, and its code never
runs): what they name has no use in any exercise of this course, and code that uses it can
change any verdict in the test process, so nothing it earns could be trusted. The others are
for review: honest code uses them now and then.

How names are read: an attribute chain is resolved through the module's imports and the
function's own aliases (``F.gelu`` is ``torch.nn.functional.gelu``; ``m = torch.testing`` makes
``m.x`` ``torch.testing.x``); every tail of the chain is checked (``torch.sys.modules`` reaches
``sys.modules``). A name that is computed (``getattr(x, name)``, ``getattr`` passed as a value,
``vars``) cannot be read: that is itself the ``dynamic names`` flag.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

from labkit.grade import shortcuts

FLAGS = {  # flag: (zeroes the exercise, what it means)
    "grader": (True, "reaches the grader, the test runner, the tests' modules, the references or "
               "the environment the grader set"),
    "interpreter": (True, "reaches the interpreter's internals: sys.modules, frames, code objects, "
                    "namespaces, gc, ctypes, builtins, private modules"),
    "processes": (True, "starts or signals processes"),
    "dynamic code": (True, "turns text or bytes into code or imports (eval, exec, importlib, "
                     "pkgutil, timeit, unpickling...)"),
    "patching": (True, "changes code that is not the student's: an attribute of a module, of a "
                 "given function or class, a name of the course's module"),
    "shortcut": (True, "uses what the exercise rebuilds (labkit.grade.shortcuts)"),
    "dynamic names": (False, "looks attributes or namespaces up by computed names"),
    "private torch": (False, "reaches a private torch namespace (torch._C, torch._VF, torch.ops "
                      "beyond aten)"),
    "threads": (False, "starts threads"),
    "special methods": (False, "defines an object that can answer the tests' checks: special "
                        "methods, a subclass of a value type, a metaclass, mocks"),
    "files": (False, "opened a file outside the test's scratch folder (seen at run time)"),
}
ZEROES = {name for name, (zero, _) in FLAGS.items() if zero}

MODULES = {  # a module (and everything under it) -> the flag its use raises
    **dict.fromkeys(("gc", "ctypes", "inspect", "builtins", "atexit", "signal", "faulthandler"),
                    "interpreter"),
    **dict.fromkeys(("subprocess", "multiprocessing", "pty", "torch.multiprocessing"), "processes"),
    **dict.fromkeys(("importlib", "pkgutil", "runpy", "timeit", "code", "pickle", "marshal",
                     "torch.hub", "torch.package", "torch.utils.cpp_extension"), "dynamic code"),
    **dict.fromkeys(("pytest", "pluggy", "conftest", "labkit.grade", "labkit.reference",
                     "labkit.harness", "labkit.cross_check"), "grader"),
    **dict.fromkeys(("threading", "concurrent", "asyncio"), "threads"),
    "unittest": "special methods", "torch.library": "patching",
}
SYS_OK = ("maxsize", "float_info", "byteorder", "version_info", "stdout", "stderr")
OS_PROCESSES = ("fork", "exec", "spawn", "posix_spawn", "kill", "system", "popen", "_exit", "abort")
OS_ENVIRONMENT = ("environ", "getenv", "putenv", "unsetenv")
BUILTINS = {"eval": "dynamic code", "exec": "dynamic code", "compile": "dynamic code",
            "__import__": "dynamic code", "breakpoint": "interpreter", "globals": "dynamic names",
            "vars": "dynamic names", "locals": "dynamic names"}
BY_NAME = ("getattr", "setattr", "delattr", "hasattr")
FRAMES = ("gi_frame", "cr_frame", "ag_frame", "tb_frame", "f_back", "f_globals", "f_locals")
DUNDERS_OK = ("__init__", "__post_init__", "__name__", "__class__", "__dict__", "__setattr__",
              "__repr__", "__str__", "__call__", "__len__", "__iter__", "__next__", "__getitem__",
              "__setitem__", "__contains__", "__enter__", "__exit__", "__torch_dispatch__")
VALUE_TYPES = ("Tensor", "Parameter", "ndarray", "int", "float", "bool", "str", "Mock", "MagicMock")
LEAVES = {"get_type_hints": "dynamic code", "attrgetter": "dynamic names",
          "methodcaller": "dynamic names"}
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class Flag:
    """One red flag: its name, where, and what was seen there."""
    name: str
    where: str
    what: str
    unit: str = field(default="", compare=False)  # the label of the unit it is in (Merged.taken)

    @property
    def zeroes(self) -> bool:
        return self.name in ZEROES

    def __str__(self) -> str:
        return f"{self.name}: {self.what} at {self.where} ({FLAGS[self.name][1]})"


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _path_flags(parts: list[str], kind: str = "module") -> list[tuple[str, str]]:
    """(flag, what) for the parts of an attribute chain of ``kind`` (:meth:`_Reader.chain`):
    every tail of a module's path is checked (``torch.sys.modules`` reaches ``sys.modules``);
    on an expression (``[labkit][0].grade``) each attribute is compared with the modules' last
    names; on a local object (``err.code``) only frames, dunders, ``sys`` and ``os``."""
    out, modules = [], kind == "module"
    for i, head in enumerate(parts):
        tail, nxt = ".".join(parts[i:]), (parts[i + 1] if i + 1 < len(parts) else "")
        out += [(flag, m) for m, flag in MODULES.items()
                if (modules and (tail == m or tail.startswith(m + "."))) or
                (kind == "?" and head == m.split(".")[-1])]
        if head == "sys" and nxt not in SYS_OK:
            out.append(("interpreter", f"sys.{nxt}".rstrip(".")))
        if head == "os" and nxt.startswith(OS_PROCESSES):
            out.append(("processes", f"os.{nxt}"))
        if head == "os" and nxt in OS_ENVIRONMENT:
            out.append(("grader", f"os.{nxt}"))
        if head in FRAMES or (_dunder(head) and head not in DUNDERS_OK):
            out.append(("interpreter", head))
        if head in LEAVES:
            out.append((LEAVES[head], head))
    if modules and parts and parts[0].startswith("_") and parts[0] != "__future__":
        out.append(("interpreter", parts[0]))
    if modules and parts[:1] == ["torch"] and (
            any(p.startswith("_") and not _dunder(p) for p in parts[1:-1]) or
            (parts[1:2] == ["ops"] and parts[2:3] not in ([], ["aten"]))):
        out.append(("private torch", ".".join(parts)))
    if kind != "local" and "__dict__" in parts:
        out.append(("interpreter", ".".join(parts)))  # a module's namespace
    return out


class _Reader(ast.NodeVisitor):
    """The flags of one unit of a student's code (a function, a class, an import, a constant)."""

    def __init__(self, path: str, aliases: dict[str, str], modules: set[str], course: set[str],
                 unit: str, exercises: tuple[str, ...]):
        self.path, self.aliases, self.modules, self.course = path, dict(aliases), modules, course
        self.unit, self.exercises = unit, exercises
        self.found: list[Flag] = []
        self.literal_loops: dict[str, bool] = {}
        self.opaque: set[str] = set()  # names bound to what a module was turned into

    def flag(self, node, name: str, what: str) -> None:
        self.found.append(Flag(name, f"{self.path}:{getattr(node, 'lineno', 0)}", f"`{what}`",
                               self.unit))

    def chain(self, node) -> tuple[str, list[str]]:
        """("module", parts) for a chain resolved through an alias, ("self", attrs) on self or cls,
        ("local", attrs) on another name, ("?", attrs) on an expression (a call, a subscript)."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                return "module", self.aliases[node.id].split(".") + attrs
            if node.id in self.opaque:
                return "?", attrs
            return ("self" if node.id in ("self", "cls") else "local"), [node.id] + attrs
        return "?", attrs

    def shortcut(self, node, *names: str) -> None:
        for ex in self.exercises:
            hit = shortcuts.matching(ex, *names)
            if hit:
                self.flag(node, "shortcut", f"{hit} in exercise {ex}")

    def visit_Attribute(self, node):
        kind, parts = self.chain(node)
        for flag, what in _path_flags(parts if kind in ("module", "?") else parts[1:], kind):
            self.flag(node, flag, what)
        if kind != "self":
            self.shortcut(node, *(parts if kind == "module" else parts[1:]))
        base = node
        while isinstance(base, ast.Attribute):
            base = base.value
        if not isinstance(base, ast.Name):
            self.visit(base)

    def visit_Name(self, node):
        if node.id in BUILTINS and node.id not in self.aliases:
            self.flag(node, BUILTINS[node.id], node.id)
        elif node.id in BY_NAME and not getattr(node, "_called", False):
            self.flag(node, "dynamic names", f"{node.id} used as a value")
        elif node.id in self.aliases:
            parts = self.aliases[node.id].split(".")
            for flag, what in _path_flags(parts):
                self.flag(node, flag, what)
            self.shortcut(node, *parts)
            if node.id in self.modules:  # never the base of an attribute: those are not visited
                self.flag(node, "dynamic names", f"the module {node.id} used as a value")

    def visit_Constant(self, node):
        if isinstance(node.value, str) and _dunder(node.value) and node.value not in DUNDERS_OK:
            self.flag(node, "interpreter", repr(node.value))

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Name) and func.id in BY_NAME and len(node.args) >= 2:
            func._called = True
            target, name = node.args[0], node.args[1]
            kind, parts = self.chain(target)
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                named = parts + [name.value] if kind in ("module", "?") else [name.value]
                for flag, what in _path_flags(named, kind if kind in ("module", "?") else "local"):
                    self.flag(node, flag, what)
            elif not (kind == "self" or (isinstance(name, ast.Name) and
                                          self.literal_loops.get(name.id))):
                self.flag(node, "dynamic names", f"{func.id}({ast.unparse(target)[:30]}, "
                          f"{ast.unparse(name)[:30]})")
            if func.id in ("setattr", "delattr") and self._not_own(target):
                self.flag(node, "patching", f"{func.id}({ast.unparse(target)[:40]}, ...)")
            if kind in ("module", "local", "self"):  # read like an attribute, not as a value
                for child in (*node.args[1:], *node.keywords):
                    self.visit(child)
                return
        if isinstance(func, ast.Attribute) and func.attr == "__setattr__" and node.args and \
                self._not_own(node.args[0]):
            self.flag(node, "patching", ast.unparse(node)[:60])
        if isinstance(func, ast.Name) and func.id == "type" and len(node.args) == 3:
            self.flag(node, "dynamic names", "type(name, bases, namespace)")
        for kw in node.keywords:
            if (kw.arg, getattr(kw.value, "value", None)) in (("weights_only", False),
                                                               ("allow_pickle", True)) or \
                    kw.arg in ("weights_only", "allow_pickle") and not isinstance(kw.value,
                                                                                  ast.Constant):
                self.flag(node, "dynamic code", f"{kw.arg}={ast.unparse(kw.value)} (unpickling)")
        self.generic_visit(node)

    def _not_own(self, target) -> bool:
        """A target that is not the student's own object: a module, a given name, the class of
        an object (``type(x)``, ``cls``), a namespace (``vars(m)``), anything reached from them."""
        while isinstance(target, (ast.Attribute, ast.Subscript)) or (
                isinstance(target, ast.Call) and not isinstance(target.func, ast.Name)):
            target = target.func if isinstance(target, ast.Call) else target.value
        if isinstance(target, ast.Call):
            return target.func.id in ("type", "vars", "getattr", "globals")
        return isinstance(target, ast.Name) and (
            target.id in self.aliases or target.id == "cls" or target.id in self.course)

    def _target(self, target, verb: str) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._target(t, verb)
        elif isinstance(target, (ast.Attribute, ast.Subscript)) and self._not_own(target.value):
            self.flag(target, "patching", f"{verb} {ast.unparse(target)[:60]}")

    def visit_Assign(self, node):
        for t in node.targets:
            self._target(t, "assignment to")
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            kind, parts = self.chain(node.value) if isinstance(
                node.value, (ast.Name, ast.Attribute)) else ("?", [])
            if kind == "module":
                self.aliases[node.targets[0].id] = ".".join(parts)
            elif any(isinstance(n, ast.Name) and n.id in self.modules | self.opaque
                     for n in ast.walk(node.value)):
                self.opaque.add(node.targets[0].id)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._target(node.target, "assignment to")
        self.generic_visit(node)

    def visit_Delete(self, node):
        for t in node.targets:
            self._target(t, "del")
        self.generic_visit(node)

    def visit_Global(self, node):
        for name in set(node.names) & self.course:
            self.flag(node, "patching", f"global {name}")

    def visit_For(self, node):
        if isinstance(node.target, ast.Name):
            self.literal_loops[node.target.id] = isinstance(node.iter, (ast.Tuple, ast.List)) and \
                all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts)
        self.generic_visit(node)

    def visit_ClassDef(self, node):
        for base in node.bases:
            kind, parts = self.chain(base) if isinstance(base, (ast.Name, ast.Attribute)) \
                else ("?", [])
            if parts and parts[-1] in VALUE_TYPES:
                self.flag(base, "special methods", f"class {node.name}({ast.unparse(base)})")
        if any(kw.arg == "metaclass" for kw in node.keywords):
            self.flag(node, "special methods", f"class {node.name}(metaclass=...)")
        for stmt in node.body:
            names = [stmt.name] if isinstance(stmt, FUNCS) else \
                [t.id for t in getattr(stmt, "targets", [getattr(stmt, "target", None)])
                 if isinstance(t, ast.Name)]
            for name in names:
                if _dunder(name) and name not in DUNDERS_OK:
                    self.flag(stmt, "special methods", f"{name} in class {node.name}")
        self.generic_visit(node)

    def visit_Import(self, node):
        pass  # an import is read where its names are used

    visit_ImportFrom = visit_Import


def aliases(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """{local name: dotted path} of a module's imports, and the names bound to modules."""
    out, modules = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                modules.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out, modules


def read(merged, pristine: str) -> dict[str, list[Flag]]:
    """{exercise: its flags} for what ``merged`` (an :class:`~labkit.grade.extract.Merged`) took.

    An added definition's flags go to the exercises whose code uses it (directly or through
    another added definition); one that no exercise uses, or that code run at import uses, to
    every exercise of the module."""
    p_tree = ast.parse(pristine)
    names, modules = aliases(ast.parse(merged.source))
    course = {n.name for n in p_tree.body if isinstance(n, (*FUNCS, ast.ClassDef))} | \
        set(aliases(p_tree)[0])
    found, uses, binds = {}, {}, {}
    for unit, node, exercises in merged.taken:
        reader = _Reader(merged.path, names, modules, course, unit, exercises)
        reader.visit(node)
        found[unit] = reader.found
        uses[unit] = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
            {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        binds[unit] = {node.name} if isinstance(node, (*FUNCS, ast.ClassDef)) else \
            {n.id for t in getattr(node, "targets", [getattr(node, "target", None)])
             for n in ast.walk(t) if isinstance(n, ast.Name)} if hasattr(node, "value") else set()
    owners = {u: set(exs) for u, _, exs in merged.taken if u in merged.units}
    changed = True
    while changed:  # who uses each added definition, through other added definitions too
        changed = False
        for unit in set(binds) - set(merged.units):
            users = set().union(*(owners.get(u, set()) for u in uses
                                  if u != unit and uses[u] & binds[unit]))
            if users - owners.get(unit, set()):
                owners[unit] = owners.get(unit, set()) | users
                changed = True
    module_ids = {e for _, _, exs in merged.taken for e in exs}
    out: dict[str, list[Flag]] = {}
    for unit, flags in found.items():
        for ex in sorted(owners.get(unit) or module_ids):
            out.setdefault(ex, []).extend(f for f in flags if f not in out.get(ex, []))
    return out
