"""Red flags: what in a student's code the instructor should look at, found by reading it.

The trusted parent reads what extraction took (exercise bodies, added definitions) and raises per
exercise the flags of :data:`FLAGS` (docs/grading.md says which zero the exercise, and why). Names
are read through the module's imports and the function's aliases (``F.gelu`` is
``torch.nn.functional.gelu``), every tail of a chain is checked (``torch.sys.modules`` reaches
``sys.modules``), and a name that is computed cannot be read: that is the ``dynamic names`` flag.
"""
from __future__ import annotations

import ast
import re
import sys
import types
from dataclasses import dataclass, field

from labkit.grade import shortcuts
from labkit.grade.extract import DEFS, bound_names

FLAGS = {  # flag: (zeroes the exercise, what it means)
    "grader": (True, "reaches the grader, pytest, the tests, the references, the grader's "
               "environment or the network"),
    "interpreter": (True, "reaches the interpreter's internals: sys.modules, frames, code, "
                    "namespaces, gc, ctypes, builtins, private modules"),
    "processes": (True, "starts or signals processes"),
    "dynamic code": (True, "turns text or bytes into code or imports (eval, importlib, pkgutil, "
                     "timeit, doctest, profile, unpickling...)"),
    "patching": (True, "changes code that is not the student's: a module's attribute, a given "
                 "function or class, a name of the course's module"),
    "shortcut": (True, "uses what the exercise rebuilds (labkit.grade.shortcuts)"),
    "dynamic names": (False, "looks attributes or namespaces up by computed names"),
    "private torch": (False, "reaches a private torch namespace (torch._C, torch._VF, torch.ops "
                      "beyond aten)"),
    "threads": (False, "starts threads"),
    "special methods": (False, "makes objects that can answer the tests' checks: special "
                        "methods, a subclass of a value type, a metaclass, mocks"),
    "files": (False, "opened a file outside the test's scratch folder (seen at run time)"),
}
ZEROES = {name for name, (zero, _) in FLAGS.items() if zero}
MODULES = {  # a module (and everything under it) -> the flag its use raises
    **dict.fromkeys(("gc", "ctypes", "inspect", "builtins", "atexit", "signal", "faulthandler"),
                    "interpreter"),
    **dict.fromkeys(("subprocess", "multiprocessing", "pty", "ProcessPoolExecutor",
                     "create_subprocess_exec", "create_subprocess_shell"), "processes"),
    **dict.fromkeys(("importlib", "pkgutil", "runpy", "timeit", "code", "pickle", "marshal",
                     "torch.hub", "torch.package", "torch.utils.cpp_extension", "codeop",
                     "zipimport", "pydoc", "doctest", "bdb", "pdb", "cProfile", "Profile", "runctx",
                     "Trace", "dictConfig"), "dynamic code"),  # the last ones run text as code
    # or import by name; names matched on any expression too, so none as common as "run"
    **dict.fromkeys(("pytest", "pluggy", "conftest", "labkit.grade", "labkit.score_table",
                     "labkit.reference", "labkit.harness", "labkit.cross_check", "socket",
                     "urllib", "http"), "grader"),
    **dict.fromkeys(("threading", "concurrent", "asyncio"), "threads"),
    "unittest": "special methods", "torch.library": "patching",
}
SYS_OK = {"stdout", "stderr", "getsizeof"} | {n for n, v in vars(sys).items()
                                              if n[0] != "_" and isinstance(v, (int, float, str, tuple))}
"""What of ``sys`` is harmless: its streams, ``getsizeof`` and its plain values (``sys.maxsize``,
``sys.float_info``); its other functions and its containers (``sys.modules``) are the interpreter's."""
OS_PROCESSES = ("fork", "exec", "spawn", "posix_spawn", "kill", "system", "popen", "_exit", "abort")
OS_ENVIRONMENT = ("environ", "getenv", "putenv", "unsetenv")
BUILTINS = {"eval": "dynamic code", "exec": "dynamic code", "compile": "dynamic code",
            "breakpoint": "interpreter", "globals": "dynamic names",
            "vars": "dynamic names", "locals": "dynamic names"}
BY_NAME = ("getattr", "setattr", "delattr", "hasattr")
FRAMES = {a for t in (types.FrameType, types.TracebackType, types.GeneratorType, types.CodeType,
                      types.CoroutineType, types.AsyncGeneratorType)
          for a in dir(t) if a[0] != "_" and "_" in a}
"""The attributes of frames, tracebacks, generators and code objects (``f_back``, ``tb_frame``...)."""
DUNDERS_OK = ("__init__", "__post_init__", "__name__", "__file__", "__class__", "__dict__",
              "__setattr__", "__repr__", "__str__", "__call__", "__len__", "__iter__", "__next__",
              "__getitem__", "__setitem__", "__contains__", "__enter__", "__exit__",
              "__torch_dispatch__")
VALUE_TYPES = ("Tensor", "Parameter", "ndarray", "int", "float", "bool", "str")  # mocks: unittest
LEAVES = {"get_type_hints": "dynamic code", "load_library": "dynamic code",
          "attrgetter": "dynamic names", "methodcaller": "dynamic names", "get_field": "dynamic names"}


@dataclass(frozen=True)
class Flag:
    """One red flag: its name, where, what was seen there, and the unit it is in."""
    name: str
    where: str
    what: str
    unit: str = field(default="", compare=False)  # its label in Merged.taken

    @property
    def zeroes(self) -> bool:
        return self.name in ZEROES

    def __str__(self) -> str:
        return f"{self.name}: {self.what} at {self.where} ({FLAGS[self.name][1]})"


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _path_flags(parts: list[str], kind: str = "module") -> list[tuple[str, str]]:
    """(flag, what) for an attribute chain of ``kind`` (:meth:`_Reader.chain`): every tail of a
    module's path; an expression's attributes against the modules' last names; on a local object
    (``err.code``) only frames, dunders, ``sys`` and ``os``."""
    out, resolved = [], kind == "module"
    for i, head in enumerate(parts):
        tail, nxt = ".".join(parts[i:]), (parts[i + 1] if i + 1 < len(parts) else "")
        out += [(flag, m) for m, flag in MODULES.items() if (kind == "?" and head == m.split(".")[-1])
                or (resolved and (tail == m or tail.startswith(m + ".")))]
        if head == "sys" and nxt not in SYS_OK:
            out.append(("interpreter", f"sys.{nxt}".rstrip(".")))
        if head in ("os", "posix") and nxt.startswith(OS_PROCESSES + OS_ENVIRONMENT):  # environb, getenvb
            out.append(("processes" if nxt.startswith(OS_PROCESSES) else "grader", f"{head}.{nxt}"))
        if head in FRAMES or (_dunder(head) and head not in DUNDERS_OK):
            out.append(("interpreter", head))
        if head in LEAVES:
            out.append((LEAVES[head], head))
    if resolved and parts and parts[0].startswith("_") and parts[0] != "__future__":
        out.append(("interpreter", parts[0]))
    if resolved and parts[:1] == ["torch"] and (
            any(p.startswith("_") and not _dunder(p) for p in parts[1:-1]) or
            (parts[1:2] == ["ops"] and parts[2:3] not in ([], ["aten"]))):
        out.append(("private torch", ".".join(parts)))
    if kind != "local" and "__dict__" in parts:
        out.append(("interpreter", ".".join(parts)))  # a module's namespace
    return out


def _as_code(value) -> ast.Module | None:
    """``value`` parsed, if it is a string of Python that does more than name something (a call,
    an import, a statement); else None ("cpu", "attn.weight", "Time (s)" read as names only)."""
    try:
        tree = ast.parse(value) if isinstance(value, str) and len(value) < 10**5 else None
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return tree if tree and tree.body and not (len(tree.body) == 1 and isinstance(
        tree.body[0], ast.Expr) and isinstance(tree.body[0].value, (ast.Name, ast.Attribute,
                                                                     ast.Constant))) else None


class _Reader(ast.NodeVisitor):
    """The flags of one unit of a student's code (a function, a class, a constant)."""

    def __init__(self, path, aliases, modules, course, unit, exercises):
        self.path, self.aliases, self.modules, self.course = path, dict(aliases), modules, course
        self.unit, self.exercises, self.found = unit, exercises, []
        self.literal_loops: dict[str, bool] = {}
        self.opaque: set[str] = set()  # local names bound to what a module was turned into

    def flag(self, node, name: str, what: str) -> None:
        self.found.append(Flag(name, f"{self.path}:{getattr(node, 'lineno', 0)}", f"`{what}`",
                               self.unit))

    def flags(self, node, parts, kind="module") -> None:
        for name, what in _path_flags(parts, kind):
            self.flag(node, name, what)

    def chain(self, node) -> tuple[str, list[str]]:
        """("module", its path) for a chain resolved through an alias; ("self", attributes) on
        self or cls; ("local", [name, *attributes]) on another name; ("?", attributes) on an
        expression (a call, a subscript) or on what a module was turned into."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.insert(0, node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id in self.opaque:
            return "?", attrs
        if node.id in self.aliases:
            return "module", self.aliases[node.id].split(".") + attrs
        return ("self" if node.id in ("self", "cls") else "local"), [node.id] + attrs

    def shortcut(self, node, *names: str) -> None:
        for ex in self.exercises:
            hit = shortcuts.matching(ex, *names)
            if hit:
                self.flag(node, "shortcut", f"{hit} in exercise {ex}")

    def visit_Attribute(self, node):
        kind, parts = self.chain(node)
        self.flags(node, parts if kind in ("module", "?") else parts[1:], kind)
        if kind != "self":
            self.shortcut(node, *(parts if kind == "module" else parts[1:]))
        if node.attr == "__setattr__" and not getattr(node, "called", False):
            self.flag(node, "patching", "__setattr__ used as a value")  # like setattr's
        while isinstance(node, ast.Attribute):
            node = node.value
        if not isinstance(node, ast.Name):  # a name at the base was read with the chain
            self.visit(node)

    def visit_Name(self, node):
        if node.id in BUILTINS and node.id not in self.aliases:
            self.flag(node, BUILTINS[node.id], node.id)
        elif _dunder(node.id) and node.id not in DUNDERS_OK:
            self.flag(node, "interpreter", node.id)
        elif node.id in BY_NAME and not getattr(node, "called", False):
            self.flag(node, "patching" if node.id in ("setattr", "delattr") else "dynamic names",
                      f"{node.id} used as a value")
        elif node.id in self.aliases:
            self.flags(node, self.aliases[node.id].split("."))
            self.shortcut(node, *self.aliases[node.id].split("."))
            if node.id in self.modules:
                self.flag(node, "dynamic names", f"the module {node.id} used as a value")

    def visit_Constant(self, node):
        """A dunder spelled in a string without spaces ("__eq__", "0.__globals__" for
        ``string.Formatter().get_field``, "__setattr__" for ``getattr``), not in prose."""
        words = re.findall(r"\w+", node.value) if isinstance(node.value, str) and \
            not any(c.isspace() for c in node.value) else []
        if "__setattr__" in words:
            self.flag(node, "patching", repr(node.value))
        elif any(_dunder(w) and w not in DUNDERS_OK for w in words):
            self.flag(node, "interpreter", repr(node.value))
        text = _as_code(node.value)
        if text is not None:  # text that is code (for timeit, profile.run...) is read as code,
            ast.increment_lineno(text, node.lineno - 1)  # by a reader of its own (its names
            reader = _Reader(self.path, self.aliases, self.modules, self.course, self.unit,
                             self.exercises)  # bind nothing here)
            reader.generic_visit(text)
            self.found += reader.found

    def visit_Call(self, node):
        func, args = node.func, node.args
        if isinstance(func, ast.Name) and func.id in BY_NAME and len(args) >= 2:
            func.called = True
            kind, parts = self.chain(args[0])
            if isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
                resolved = kind in ("module", "?")
                self.flags(node, parts + [args[1].value] if resolved else [args[1].value],
                           kind if resolved else "local")
                self.shortcut(node, args[1].value)
            elif kind != "self" and not (isinstance(args[1], ast.Name) and
                                         self.literal_loops.get(args[1].id)):
                self.flag(node, "dynamic names", ast.unparse(node)[:60])
            if func.id in ("setattr", "delattr") and self._not_own(args[0]):
                self.flag(node, "patching", ast.unparse(node)[:60])
            if kind != "?":  # the object is read like an attribute's base, not as a value
                for child in (*args[1:], *node.keywords):
                    self.visit(child)
                return
        if isinstance(func, ast.Attribute) and func.attr == "__setattr__":
            func.called = True  # object.__setattr__(self, ...) sets the student's own object
            if not args or self._not_own(args[0]):
                self.flag(node, "patching", ast.unparse(node)[:60])
        if isinstance(func, ast.Name) and func.id == "vars" and args and \
                self.chain(args[0])[0] in ("module", "?"):
            self.flag(node, "interpreter", f"{ast.unparse(node)[:60]} (a module's namespace)")
        if isinstance(func, ast.Name) and func.id == "type" and len(args) == 3:
            self.flag(node, "dynamic names", "type(name, bases, namespace)")
        for kw in node.keywords:
            if kw.arg in ("weights_only", "allow_pickle") and getattr(kw.value, "value", None) \
                    is not (kw.arg == "weights_only"):
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
        return not isinstance(target, ast.Name) or (
            target.id in {*self.aliases, *self.course, *self.opaque, "cls"})

    def _targets(self, node, targets, verb: str) -> None:
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)):
                self._targets(node, t.elts, verb)
            elif isinstance(t, (ast.Attribute, ast.Subscript)) and self._not_own(t.value):
                self.flag(t, "patching", f"{verb} {ast.unparse(t)[:60]}")

    def visit_Assign(self, node):
        self._targets(node, node.targets if isinstance(node, ast.Assign) else [node.target],
                      "assignment to")
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            name, (kind, parts) = node.targets[0].id, self.chain(node.value)
            if kind == "module" and isinstance(node.value, (ast.Name, ast.Attribute)):
                self.aliases[name] = ".".join(parts)  # a local alias of a module
                return self.generic_visit(node)
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            self._bind(target, node.value)
        self.generic_visit(node)

    visit_AugAssign = visit_AnnAssign = visit_Assign

    def _bind(self, target, value) -> None:
        """Names bound to what a module was turned into (``[torch][0]``, ``for m in [torch]``,
        ``with x(torch) as m``, ``(m := [torch][0])``): a module used as a value."""
        if value is not None and any(
                isinstance(n, ast.Name) and n.id in {*self.modules, *self.opaque} and
                not any(isinstance(a, ast.Attribute) and a.value is n for a in ast.walk(value))
                for n in ast.walk(value)):
            self.opaque |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}

    def visit_withitem(self, node):
        self._bind(node.optional_vars or ast.Tuple([]), node.context_expr)
        self.generic_visit(node)

    def visit_NamedExpr(self, node):
        self._bind(node.target, node.value)
        self.generic_visit(node)

    def visit_Delete(self, node):
        self._targets(node, node.targets, "del")
        self.generic_visit(node)

    def visit_Global(self, node):
        for name in sorted(set(node.names) & self.course):
            self.flag(node, "patching", f"global {name}")

    def visit_For(self, node):
        """A loop over literal names (``for name in ("dp", "tp")``) reads like the names."""
        if isinstance(node.target, ast.Name):
            self.literal_loops[node.target.id] = isinstance(node.iter, (ast.Tuple, ast.List)) and \
                all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts)
        self._bind(node.target, node.iter)
        self.generic_visit(node)

    visit_comprehension = visit_For

    def visit_ListComp(self, node):  # the loops first: they bind the names the element reads
        for part in (*node.generators, *[getattr(node, k) for k in ("key", "value", "elt")
                                         if hasattr(node, k)]):
            self.visit(part)

    visit_SetComp = visit_GeneratorExp = visit_DictComp = visit_ListComp

    def visit_ClassDef(self, node):
        for base in node.bases:
            if (self.chain(base)[1] or [""])[-1] in VALUE_TYPES:
                self.flag(base, "special methods", f"class {node.name}({ast.unparse(base)})")
        if any(kw.arg == "metaclass" for kw in node.keywords):
            self.flag(node, "special methods", f"class {node.name}(metaclass=...)")
        for stmt in node.body:
            names = [stmt.name] if isinstance(stmt, DEFS) else [
                t.id for t in getattr(stmt, "targets", [getattr(stmt, "target", None)])
                if isinstance(t, ast.Name)]
            for name in [n for n in names if _dunder(n) and n not in DUNDERS_OK]:
                self.flag(stmt, "special methods", f"{name} in class {node.name}")
        self.generic_visit(node)

    def visit_Import(self, node):
        """An import inside the student's code is read like what it imports (an import at the
        module's top is read where its names are used: a leftover ``import gc`` zeroes nothing)."""
        base = node.module + "." if isinstance(node, ast.ImportFrom) and node.module else ""
        for alias in node.names:
            self.flags(node, (base + alias.name).split("."))
            self.shortcut(node, *(base + alias.name).split("."))

    visit_ImportFrom = visit_Import


def aliases(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """{local name: dotted path} of a module's imports (anywhere in it), and the names bound to
    modules."""
    out, modules = {}, set()
    for node in ast.walk(tree):
        for a in getattr(node, "names", []) if isinstance(node, ast.Import) else []:
            top = a.name.split(".")[0]
            out[a.asname or top] = a.name if a.asname else top
            modules.add(a.asname or top)
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return out, modules


def read(merged, pristine: str) -> dict[str, list[Flag]]:
    """{exercise: its flags} for what ``merged`` (an :class:`~labkit.grade.extract.Merged`) took.

    An added definition's flags go to the exercises whose code uses it (directly or through
    other added definitions); those of one that no exercise uses, to every exercise of the
    module (it may run at import)."""
    p_tree = ast.parse(pristine)
    names, modules = aliases(ast.parse(merged.source))
    course = {n.name for n in p_tree.body if isinstance(n, DEFS)} | set(aliases(p_tree)[0])
    found, uses, binds = {}, {}, {}
    for unit, node, exercises in merged.taken:
        reader = _Reader(merged.path, names, modules, course, unit, exercises)
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            reader.visit(node)
        found[unit] = reader.found
        uses[unit] = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node)}
        binds[unit] = bound_names(node)
    owners = {u: set(exs) for u, _, exs in merged.taken if u in merged.units}
    changed = True
    while changed:  # who uses each added definition, through other added definitions too
        changed = False
        for unit in set(binds) - set(merged.units):
            users = set().union(*(owners.get(u, set()) for u in uses
                                  if u != unit and uses[u] & binds[unit]))
            changed |= bool(users - owners.get(unit, set()))
            owners[unit] = owners.get(unit, set()) | users
    module_ids = {e for _, _, exs in merged.taken for e in exs}
    out: dict[str, list[Flag]] = {ex: [] for ex in module_ids}
    for unit, flags in found.items():
        for ex in owners.get(unit) or module_ids:
            out[ex] += [f for f in flags if f not in out[ex]]
    return out
