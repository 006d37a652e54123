"""Red flags: what in a student's code the instructor should look at, found by reading it.

The trusted parent reads what extraction took (exercise bodies, added definitions) and raises per
exercise the flags of :data:`FLAGS` (docs/grading.md says which zero the exercise, and why). Names
are read through the module's imports and the function's aliases (``F.gelu`` is
``torch.nn.functional.gelu``) and through the modules the interpreter really has
(``torch.sys.modules`` is ``sys.modules``), against :data:`MODULES`, what exercise code may use;
a name that is computed cannot be read: that is the ``dynamic names`` flag.
"""
from __future__ import annotations

import ast
import builtins
import collections
import decimal
import fractions
import functools
import importlib
import operator
import re
import sys
import types
import typing
from dataclasses import dataclass, field

import torch

from labkit.grade import shortcuts
from labkit.grade.extract import BUILTIN_NAMES, DEFS, bound_names, scope

ANSWER_NUMBERS = 4  # specific numbers in one unit that make a table of answers (GELU's has 1)
FLAGS = {  # flag: (zeroes the exercise, what it means)
    "module": (True, "uses a module or a function no exercise here needs, or a module as a value "
               "(the modules exercise code may use: labkit.grade.flags.MODULES)"),
    "grader": (True, "reaches the grader, the tests' references or the score table"),
    "interpreter": (True, "reaches the interpreter's internals: sys.modules, frames, code, "
                    "namespaces (a module's, by computed names too), gc, builtins, a module's "
                    "private names"),
    "processes": (True, "starts processes"),
    "dynamic code": (True, "turns text or bytes into code or imports (eval, torch.hub, "
                     "unpickling...)"),
    "patching": (True, "changes code that is not the student's: a module's attribute, a given "
                 "function or class, a name of the course's module"),
    "shortcut": (True, "uses what the exercise rebuilds (labkit.grade.shortcuts)"),
    "dynamic names": (False, "looks attributes or namespaces up by computed names"),
    "private torch": (False, "reaches a private torch namespace (torch._C, torch._VF, torch.ops "
                      "beyond aten) or a private attribute of an object not the student's"),
    "threads": (False, "starts threads"),
    "special methods": (False, "makes objects that can answer the tests' checks: special "
                        "methods, a subclass of a value type, a metaclass"),
    "false values": (True, "redefines how a value type's subclass (of int, float, str, Tensor...) "
                     "compares, converts or prints: a value made to answer the tests' checks"),
    "measured elsewhere": (False, "takes tensor data out of torch (.numpy(), torch.from_numpy) "
                           "in an exercise whose tests measure torch's work, which they then miss"),
    "files": (False, "opened a file outside the test's scratch folder (seen at run time)"),
    "answers": (False, f"writes {ANSWER_NUMBERS} or more numbers of 7 significant digits (not "
                "powers of two) in one unit: answers looked up rather than computed?"),
    "unreadable": (True, "the grader could not read this code (a fault of the grader's: report "
                   "it); it is not run unread"),
}
ZEROES = {name for name, (zero, _) in FLAGS.items() if zero}
MODULES = {  # what exercise code may use (None: freely), and what it may not, by dotted prefix:
    # the longest prefix that matches a name's real path decides; a path no prefix matches is a
    # module no exercise needs (the "module" flag)
    **dict.fromkeys(("torch", "numpy", "math", "functools", "itertools", "operator", "collections",
                     "heapq", "bisect", "copy", "dataclasses", "enum", "typing", "abc", "contextlib",
                     "re", "time", "warnings", "weakref", "fractions", "statistics", "random",
                     "numbers", "labkit", "logging", "__future__", "os.path", "posixpath", "os.sep",
                     "os.environ.get", "os.getenv", "pprint",
                     "os.cpu_count", "gc.collect", "types.SimpleNamespace", "sys.maxsize",
                     "sys.float_info", "sys.byteorder", "sys.version_info", "sys.platform",
                     "sys.stdout", "sys.stderr", "sys.getsizeof")),
    **dict.fromkeys(("threading", "concurrent", "asyncio", "queue"), "threads"),
    **dict.fromkeys(("sys", "gc"), "interpreter"),
    **dict.fromkeys(("torch.library", "operator.setitem", "operator.delitem",
                     "functools.update_wrapper"), "patching"),
    **dict.fromkeys((f"operator.{n}" for n in dir(operator) if n[0] == "i" and  # iadd, ior...:
                     {n[1:], n[1:] + "_"} & set(dir(operator))), "patching"),  # in place
    **dict.fromkeys(("torch.multiprocessing", "torch.distributed.run", "torch.distributed.launch",
                     "torch.distributed.launcher", "torch.distributed.elastic",
                     "torch.utils.collect_env", "torch.utils.bottleneck", "logging.handlers",
                     "asyncio.subprocess", "asyncio.create_subprocess_exec",
                     "asyncio.create_subprocess_shell",
                     "concurrent.futures.process", "concurrent.futures.ProcessPoolExecutor"),
                    "processes"),
    **dict.fromkeys(("torch.hub", "torch.package", "torch.utils.cpp_extension",
                     "torch.utils.benchmark", "torch.ops.load_library", "torch.fx",
                     "torch.jit.CompilationUnit", "torch.jit.load", "numpy.load",
                     "numpy.ctypeslib", "numpy.f2py", "numpy.testing", "numpy.lib.format",
                     "numpy.lib.npyio", "typing.get_type_hints", "typing.ForwardRef", "torch.compile",
                     "torch.compiler",  # (a backend the student gives is handed fx graphs to run)
                     "typing.get_args", "logging.config"),
                    "dynamic code"),  # they run or load text, bytes or files as code
    **dict.fromkeys(("labkit.grade", "labkit.score_table", "labkit.reference", "labkit.harness",
                     "labkit.cross_check"), "grader"),
    **dict.fromkeys(("operator.attrgetter", "operator.methodcaller"), "dynamic names"),
}
BUILTINS = {"eval": "dynamic code", "exec": "dynamic code", "compile": "dynamic code",
            "breakpoint": "interpreter", "globals": "dynamic names",
            "vars": "dynamic names", "locals": "dynamic names"}
BY_NAME = ("getattr", "setattr", "delattr", "hasattr")
CONTAINERS = ("list", "dict", "set", "tuple", "frozenset", "sorted", "copy.copy", "copy.deepcopy",
              "collections.defaultdict", "collections.OrderedDict", "collections.Counter",
              "collections.deque")
"""What makes a new container of what it is given (a copy: the student's own container)."""
INTERNALS = ("sys", "os", "posix", "builtins", "ctypes", "gc", "importlib", "subprocess", "pickle",
             "inspect", "_module")
"""Attributes of objects that hold such modules (``np.zeros(1).ctypes``, a warnings catcher's
``_module``): read on anything but a module's path (which is resolved)."""
VIEWS = ("next", "iter", "max", "min", "reversed", "getattr", "filter", "map", "zip", "enumerate",
         "weakref.proxy", "collections.ChainMap")
"""What returns its argument, or a view of it (a call of the student's own function may too)."""
FRAMES = {a for t in (types.FrameType, types.TracebackType, types.GeneratorType, types.CodeType,
                      types.CoroutineType, types.AsyncGeneratorType)
          for a in dir(t) if a[0] != "_" and "_" in a}
"""The attributes of frames, tracebacks, generators and code objects (``f_back``, ``tb_frame``...)."""
DATA_MODEL = {n for t in (int, float, str, list, dict, set, tuple) for n in dir(t)
              if n[:2] == n[-2:] == "__"} - set(dir(object))
"""The operators' and containers' methods (``__iadd__``, ``__lt__`` of an int...): on the
student's own objects, as harmless as the operators; on foreign ones, MUTATORS says."""
DUNDERS_OK = ("__init__", "__post_init__", "__name__", "__file__", "__class__", "__dict__",
              "__setattr__", "__repr__", "__str__", "__call__", "__len__", "__iter__", "__next__",
              "__getitem__", "__setitem__", "__contains__", "__enter__", "__exit__",
              "__torch_dispatch__", "__slots__", "__version__", "__qualname__", "__module__",
              "__doc__", "__match_args__", "__members__", "__weakref__", "__debug__", "__new__",
              "__format__")
HIGHER_ORDER = ("functools.reduce", "itertools.accumulate", "itertools.starmap", "map", "filter")
"""What calls the function it is given first (its result holds none of that function)."""
TYPE_MAKERS = ("enum.Enum", "collections.namedtuple", "typing.NamedTuple", "typing.NewType",
               "typing.TypeVar", "typing.TypedDict")
"""What makes a class from its arguments (a module's constant made by one is no text)."""
NAMEDTUPLE = set(dir(collections.namedtuple("T", ""))) - set(dir(tuple))  # _replace, _asdict..
VALUE_TYPES = ("Tensor", "Parameter", "ndarray", "int", "float", "bool", "str")
COMPARED = {*VALUE_TYPES, torch.Size.__name__} | {
    c.__name__ for m in (builtins, collections, fractions, decimal) for c in vars(m).values()
    if isinstance(c, type) and c.__eq__ is not object.__eq__ and not issubclass(c, BaseException)}
"""What tests compare or convert (``list``, ``complex``, ``deque``, ``Fraction``, ``torch.Size``...):
a subclass whose own comparison or conversion (:data:`ANSWERS`) answers a test's check is a
false value (a value type's subclass may define no special method beyond :data:`DUNDERS_OK`)."""
ANSWERS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__",
           "__len__", "__contains__", "__int__", "__float__", "__index__", "__complex__", "__abs__",
           "__round__", "__array__")
LABEL = re.compile(r"[\w.]+ \([\w ,]*\)")
STORAGE_METADATA = ("nbytes", "data_ptr", "resize_", "size", "element_size", "device", "is_pinned")
"""What a tensor's storage says without its data (``untyped_storage().nbytes()``)."""
MUTATORS = {n for t in (dict, list, set, collections.deque) for n in dir(t)} - {
    n for t in (types.MappingProxyType, tuple, frozenset) for n in dir(t)} | {"__init__"}
"""The methods that change a dict, list or set in place (``update``, ``append``, ``__setitem__``,
``__ior__``...; on a foreign object, like a tensor's ``add_``)."""


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


OUT_OF_TORCH = ("numpy", "from_numpy", "to_dlpack")  # by name: tensor data out of torch, shared


def _specific(value) -> bool:
    """A number of 7 significant digits or more that is not a power of two (an int, a float, a
    word of text: decimal, or hexadecimal with a letter): 275414777856, 0.7978845608 or
    "401FB80000" is; 2**30, 175e9 or 0.999 is not."""
    try:
        value = (int(value, 16) if re.search("[a-fA-F]", value) else float(value) if "." in value
                 else int(value)) if isinstance(value, str) else value
    except ValueError:
        return False
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or \
            abs(value) == float("inf") or isinstance(value, int) and abs(value) & (abs(value) - 1) == 0:
        return False
    return len(repr(abs(value)).split("e")[0].replace(".", "").strip("0")) >= 7


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _verdict(path: str) -> str | None:
    """The flag of a dotted path by :data:`MODULES` (None: exercise code may use it)."""
    parts = path.split(".")
    if parts[:2] == ["numpy", "testing"] and parts[-1].startswith("assert_"):
        return None  # a self-check (numpy.testing's other tools run text: measure, extbuild)
    if parts[-1].startswith(("register_module_", "register_optimizer_step_")):
        return "patching"  # torch's global hooks: every module's forward, every optimizer's step
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return MODULES[".".join(parts[:n])]
    return "module"


@functools.lru_cache(maxsize=None)
def _module(name: str):
    """The module ``name`` as the interpreter has it, if exercise code may use its package
    (a package no exercise needs is never imported here); else None."""
    if MODULES.get(name.split(".")[0], "module") not in (None, "threads") or \
            any(p.startswith("_") for p in name.split(".")):
        return None
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - not a module, or one that does not import here
        return None


@functools.lru_cache(maxsize=None)
def _objects(parts: tuple[str, ...]) -> tuple:
    """The objects along a dotted path as the interpreter has them, as far as they resolve
    through modules and classes (private names too; a submodule not yet loaded is imported)."""
    out, obj = [], _module(parts[0]) or sys.modules.get(parts[0])
    for i, name in enumerate(parts):
        if i:
            if not isinstance(obj, (types.ModuleType, type)):
                break
            try:
                nxt = getattr(obj, name, None)
            except Exception:  # noqa: BLE001 - a module's __getattr__ that raises
                nxt = None
            obj = nxt if nxt is not None or not isinstance(obj, types.ModuleType) else \
                _module(f"{obj.__name__}.{name}")
        if obj is None:
            break
        out.append(obj)
    return tuple(out)


@functools.cache
def _denied() -> dict:
    """{id of an object: (its flag, its entry)} for the entries of :data:`MODULES` that name a
    function or a class, so that ``numpy.load`` is refused however it is reached."""
    found = {}
    for entry, flag in MODULES.items():
        objs = _objects(tuple(entry.split(".")))
        if flag and len(objs) == entry.count(".") + 1 and not isinstance(objs[-1], types.ModuleType):
            found[id(objs[-1])] = (flag, entry)
    return found


def _path_flags(parts: list[str], kind: str = "module") -> list[tuple[str, str]]:
    """(flag, what) for an attribute chain of ``kind`` (:meth:`_Reader.chain`): for a module's
    path, by :data:`MODULES`, the path as written, the path from every module it reaches by its
    real name (``torch.sys.modules`` is ``sys.modules``) and every function or class it reaches;
    private names; on any chain, frames, dunders and a module's namespace."""
    out = []
    if kind == "module" and parts:
        objs = _objects(tuple(parts))
        paths = [".".join(parts)] + [".".join((o.__name__, *parts[i + 1:])) for i, o in
                                     enumerate(objs) if isinstance(o, types.ModuleType)
                                     and o.__name__ != ".".join(parts[:i + 1])]
        out += [(_verdict(path), path) for path in paths if _verdict(path)]
        out += [_denied()[id(o)] for o in objs if id(o) in _denied()]
        out += [(v, where) for where in map(_defined_at, objs)  # a re-export of what is refused
                if where and (v := _verdict(where)) not in (None, "module")]
        private = [p for p in parts[1:] if p.startswith("_") and not _dunder(p)]
        if private and parts[0] != "torch":
            out.append(("interpreter", ".".join(parts)))
    for head in parts:
        if head in FRAMES or (_dunder(head) and head not in {*DUNDERS_OK, *DATA_MODEL}) or (
                kind != "module" and (head in INTERNALS or (head[:1] == "_" and
                                                            head.lstrip("_") in INTERNALS))):
            out.append(("interpreter", head))
    if kind == "module" and parts[:1] == ["torch"] and (
            any(p.startswith("_") and not _dunder(p) for p in parts[1:-1]) or
            (parts[1:2] == ["ops"] and parts[2:3] not in ([], ["aten"]))):
        out.append(("private torch", ".".join(parts)))
        if any(_imports(o) for o in _objects(tuple(parts))):  # torch._utils._import_dotted_name
            out.append(("dynamic code", f"{'.'.join(parts)} (imports what it is told to)"))
    if kind != "local" and "__dict__" in parts:
        out.append(("interpreter", ".".join(parts)))  # a module's namespace
    return out


def _imports(obj) -> bool:
    """Whether a function's code (its nested functions' too) imports by a name it computes
    (``__import__``, ``importlib.import_module``)."""
    todo = [obj.__code__] if isinstance(obj, types.FunctionType) else []
    while todo:
        code = todo.pop()
        if {"__import__", "import_module"} & set(code.co_names):
            return True
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return False


@functools.lru_cache(maxsize=None)
def _toolkit_uses(name) -> tuple:
    """The course's modules a toolkit module imports (labkit.page_calculator's memory_model)."""
    mod = sys.modules.get(name) if str(name).startswith("labkit.") and not str(name).startswith(
        ("labkit.lab", "labkit.grade")) else None
    return tuple({u for v in vars(mod).values() for u in [getattr(v, "__name__" if isinstance(
        v, types.ModuleType) else "__module__", "")] if str(u).startswith("labkit.") and u != name}
                 if mod else ())


def _defined_at(obj) -> str | None:
    """"module.qualname" of where a function or class is defined, if it says."""
    try:
        where = f"{obj.__module__}.{obj.__qualname__}"
    except Exception:  # noqa: BLE001 - no such attributes, or ones that raise
        return None
    return where if isinstance(obj.__module__, str) and isinstance(obj.__qualname__, str) else None


def _is_module(parts: list[str]) -> bool:
    """Whether a module's path names a module (however reached: torch.nn.modules.activation.F)."""
    objs = _objects(tuple(parts))
    return ".".join(parts) in sys.modules or (  # (types: loaded, though not resolved here)
        len(objs) == len(parts) and isinstance(objs[-1], types.ModuleType))


def _as_code(value) -> ast.Module | None:
    """``value`` parsed, if it is a string of Python that does more than name something (a call,
    an import, a statement); else None ("cpu", "attn.weight", "Time (s)" read as names only)."""
    try:
        tree = ast.parse(value) if isinstance(value, str) and len(value) < 10**5 else None
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return tree if tree and tree.body and not (len(tree.body) == 1 and isinstance(
        tree.body[0], ast.Expr) and (isinstance(tree.body[0].value, ast.Constant) or _path(
            tree.body[0].value))) else None  # ("a.b[0].c" is code: a ForwardRef evaluates it)


def _type_like(node) -> bool:
    """Names, subscripts, literals and ``X | None`` only: what an annotation or a type alias is."""
    return all(isinstance(n, (ast.Name, ast.Attribute, ast.Subscript, ast.Constant, ast.Tuple,
                              ast.List, ast.expr_context, ast.BitOr)) or
               (isinstance(n, ast.BinOp) and isinstance(n.op, ast.BitOr)) for n in ast.walk(node))


def _makes_type(value, names: dict) -> bool:
    """A call that makes a class (``enum.Enum("Kind", "A B")``, ``namedtuple(...)``): what an
    annotation may name, not a text ``get_type_hints`` would run."""
    path = _path(value.func) if isinstance(value, ast.Call) else None
    parts = [*names.get(path.split(".")[0], path.split(".")[0]).split("."),
             *path.split(".")[1:]] if path else []
    objs = _objects(tuple(parts)) if parts else ()
    makers = [_objects(tuple(m.split(".")))[-1] for m in TYPE_MAKERS]
    if objs and objs[-1] is typing.TypedDict and (  # TypedDict("T", {"a": "<text>"}): text
            not all(isinstance(a, ast.Dict) for a in value.args[1:]) or any(_literal_text(v) for v in (
                *(v for a in value.args[1:] for v in a.values), *(k.value for k in value.keywords)))):
        return False
    return len(objs) == len(parts) > 0 and any(objs[-1] is m or (
        isinstance(objs[-1], type) and isinstance(m, type) and issubclass(objs[-1], m))
        for m in makers)


def _literal_text(node) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in ast.walk(node))


def _plain(obj) -> bool:
    """What no code can change: a value that is not callable (``torch.float32``, ``math.pi``),
    a type whose attributes cannot be set (``np.float32``, ``int``), a built-in function or
    method (``math.ceil``, ``F.gelu``); not a module, a dict, a list or a set."""
    return not isinstance(obj, (types.ModuleType, dict, list, set)) and (
        not callable(obj) or isinstance(obj, (types.BuiltinFunctionType, types.MethodDescriptorType,
                                              types.WrapperDescriptorType)) or
        (isinstance(obj, type) and bool(obj.__flags__ & 256)))  # Py_TPFLAGS_IMMUTABLETYPE


def _literal_names(unit) -> dict[str, list[str]]:
    """{name: the strings it takes} of the names whose every binding in ``unit`` is a loop over
    literal strings (``for name in ("dp", "tp")``, or a position of literal tuples: ``for obj,
    name in ((a, "x"), ...)``); what any other binding makes (an empty loop too) is computed."""
    found, other, looped = {}, set(), set()
    stores = collections.Counter(n.id for n in ast.walk(unit) if isinstance(n, ast.Name) and
                                 not isinstance(n.ctx, ast.Load))
    tuples = {a.targets[0].id: a.value for a in ast.walk(unit) if isinstance(a, ast.Assign) and
              len(a.targets) == 1 and isinstance(a.targets[0], ast.Name) and stores[
                  a.targets[0].id] == 1 and isinstance(a.value, ast.Tuple)}  # rows = ("a", "b")
    for loop in ast.walk(unit):
        if not isinstance(loop, (ast.For, ast.AsyncFor, ast.comprehension)):
            continue
        iterable = tuples.get(getattr(loop.iter, "id", None), loop.iter)  # for f in rows
        names = [loop.target] if isinstance(loop.target, ast.Name) else getattr(loop.target,
                                                                                "elts", [])
        rows = [[e] if isinstance(loop.target, ast.Name) else getattr(e, "elts", [])
                for e in getattr(iterable, "elts", [None])]
        for i, name in [(i, n) for i, n in enumerate(names) if isinstance(n, ast.Name)]:
            looped.add(id(name))  # (i: its position among all the targets)
            values = [row[i] if len(row) == len(names) else None for row in rows]
            if values and all(isinstance(v, ast.Constant) and isinstance(v.value, str)
                              for v in values):
                found.setdefault(name.id, []).extend(v.value for v in values)
            else:
                other.add(name.id)
    other |= {n.id for n in ast.walk(unit) if isinstance(n, ast.Name) and
              not isinstance(n.ctx, ast.Load) and id(n) not in looped}
    other |= {a.arg for a in ast.walk(unit) if isinstance(a, ast.arg)}
    return {name: values for name, values in found.items() if name not in other}


def _target_names(target) -> set[str]:
    """The names an assignment's target binds (``a``, ``a, *b``), not those it writes into."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*map(_target_names, target.elts))
    return _target_names(target.value) if isinstance(target, ast.Starred) else set()


def _path(node) -> str | None:
    """"box" or "box.t.u" of a name or an attribute chain on a name, else None."""
    if isinstance(node, ast.Attribute) and _path(node.value):
        return f"{_path(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else None


class _Reader(ast.NodeVisitor):
    """The flags of one unit of a student's code (a function, a class, a constant)."""

    def __init__(self, path, aliases, course, unit, exercises):
        self.path, self.aliases, self.course = path, dict(aliases), course
        self.unit, self.exercises, self.found = unit, exercises, []
        self.literal_loops: dict[str, list] = {}  # name -> the literal strings it takes
        self.functions: list[tuple] = []  # (name, parameters) of those being read, innermost last
        self.branches = 0  # how deep in branches the reading is
        self.assigned: set[str] = set()  # attribute paths the unit assigns (counts.parameters)
        self.own_classes: set[str] = set()  # the classes the submission defines
        self.instances: set[str] = set()  # names bound to new objects of those (or namespaces)
        self.plain: set[str] = set()  # the student's classes of no base but their own
        self.plain_classes: list[bool] = []  # per class being read: in plain
        self.fields: set[str] = set()  # what the submission assigns on self (self._module)
        self.writers: dict[str, set] = {}  # function -> (position, name) of parameters it changes
        self.local: set[str] = set()  # parameters and names the unit binds (compile = ...)
        self.texts: set[str] = set()  # the module's constants that are not types: text
        self.opaque: set[str] = set()  # local names and paths (holder.t) of foreign objects
        self.holders: set[str] = set()  # ... of the student's objects that hold foreign ones
        self.globals: set[str] = set()  # the names it declares global
        self.giving: set[str] = set()  # the student's functions that return foreign objects
        self.constants: dict = {}  # the module's constants: name -> the expression bound
        self.own_methods: set[str] = set()  # the names of the exercise's methods and added ones
        self.lying: set[str] = set()  # the student's classes of a value type, and their bases
        self.numbers = 0  # specific numbers written in the unit (_specific)
        self.compared: set[str] = set()  # ... of a type tests compare (COMPARED), and their bases
        self.root = ast.Module([], [])  # the unit's node
        self.defined: set[str] = set()  # the names the course's module binds
        self.jit = False  # names torch.jit: TorchScript, whose tolist/item no run-time watch sees

    def visit(self, node):
        """Read ``node``; inside a branch (a test, a loop, a ``try``) a name bound again may not be
        (``if c: K = 0``), so it stays foreign if it was."""
        branch = isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With,
                                   ast.AsyncWith, ast.Match, ast.IfExp, ast.BoolOp))
        self.branches += branch
        try:
            return super().visit(node)
        finally:
            self.branches -= branch

    def flag(self, node, name: str, what: str) -> None:
        """Raise flag ``name`` at ``node``, unless a rule judged the node cleared of it (its
        ``clear``: ``operator.iadd(own, x)`` patches nothing, ``attrgetter("a")`` computes no name)."""
        if name not in getattr(node, "clear", ()):
            self.found.append(Flag(name, f"{self.path}:{getattr(node, 'lineno', 0)}", f"`{what}`",
                                   self.unit))

    def flags(self, node, parts, kind="module") -> None:
        for name, what in _path_flags(parts, kind):
            self.flag(node, name, what)

    def _in_place_operator(self, node) -> bool:
        """``operator.iadd`` and its kin (which change their first operand), however named."""
        kind, parts = self.chain(node)
        return kind == "module" and parts[:1] == ["operator"] and len(parts) == 2 and \
            MODULES.get(".".join(parts)) == "patching" and parts[1].startswith("i")

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

    def shortcut(self, node, *names: str, module: bool = False) -> None:
        """The ``shortcut`` flag for ``names`` (of a module's path: where each object it reaches
        is defined too, ``torch.optim.adam._single_tensor_adam`` re-exported elsewhere)."""
        real = [(o.__name__ if isinstance(o, types.ModuleType) else _defined_at(o) or "")
                for o in _objects(names)] if module else []
        real += [d for o in (_objects(names) if module else ()) for d in _toolkit_uses(
            getattr(o, "__name__", None) if isinstance(o, types.ModuleType) else getattr(o, "__module__", None))]
        inside = tuple(n for r in real if not r.startswith("labkit.") for n in (*r.split("."), r)
                       if n not in names)  # (where it is defined, if not what is written; whole)
        for ex in self.exercises:
            hit = shortcuts.matching(ex, *names, *(n for r in real for n in r.split(".")),
                                     inside=inside)
            if hit:
                self.flag(node, "shortcut", f"{hit} in exercise {ex}")

    def leaving(self, node, names: list[str]) -> None:  # methodcaller("numpy"): as .numpy
        if set(names) & {*OUT_OF_TORCH, "storage", "untyped_storage"} and set(self.exercises) & \
                set(shortcuts.MEASURED):
            self.flag(node, "measured elsewhere", ast.unparse(node)[:60])

    def visit_Attribute(self, node):
        kind, parts = self.chain(node)
        mine = kind == "self" and parts[1] in {*self.fields, "__dict__"}  # self._module: own
        self.flags(node, parts if kind in ("module", "?") else parts[1 + mine:], kind)
        own = kind == "local" and (parts[0] in {*self.own_classes, *self.instances} or any(
            ".".join(parts[:i]) in self.assigned for i in range(2, len(parts) + 1)))  # (fields)
        if kind != "self" and not own and not isinstance(node.ctx, ast.Store):
            self.shortcut(node, *(parts if kind == "module" else parts[1:]), module=kind == "module")
        if kind == "module" and not getattr(node, "aliased", False) and _is_module(parts):
            self.flag(node, "module", f"the module {ast.unparse(node)} used as a value")
        if kind in ("local", "?") and not own and node.attr[:1] == "_" and not _dunder(node.attr) \
                and node.attr not in {*self.fields, *NAMEDTUPLE, *self.own_methods}:  # group._x(dev)
            self.flag(node, "private torch", f"{ast.unparse(node)[:60]} (a private attribute)")
        if isinstance(node.value, ast.Call) and node.attr in STORAGE_METADATA:
            node.value.func.clear = ("measured elsewhere",)  # x.untyped_storage().nbytes()
        if (node.attr in OUT_OF_TORCH and not (kind == "module" and _is_module(parts))
                or node.attr in ("untyped_storage", "storage") or kind == "module" and parts[:1] == [
                    "torch"] and node.attr in ("save", "serialization")) and set(self.exercises) & set(
                shortcuts.MEASURED):  # (a storage's data: .tolist(), bytes(), indexing; torch.save)
            self.flag(node, "measured elsewhere", ast.unparse(node)[:60])
        self.jit |= kind == "module" and parts[:2] == ["torch", "jit"]
        if node.attr == "__setattr__" and not getattr(node, "called", False):
            self.flag(node, "patching", "__setattr__ used as a value")  # like setattr's
        elif node.attr in MUTATORS and not getattr(node, "called", False) and not (
                kind == "module" and _is_module(parts[:-1])) and (  # operator.add: a function
                parts[:-1] in (["dict"], ["list"], ["set"], ["object"]) or
                self._not_own(node.value)):
            self.flag(node, "patching", f"{ast.unparse(node)[:60]} used as a value")
        while isinstance(node, ast.Attribute):
            node = node.value
        if not isinstance(node, ast.Name):  # a name at the base was read with the chain
            self.visit(node)

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Store):
            self.local.add(node.id)
        if node.id in BUILTINS and node.id not in self.aliases and node.id not in self.local:
            self.flag(node, BUILTINS[node.id], node.id)
        elif _dunder(node.id) and node.id not in DUNDERS_OK:
            self.flag(node, "interpreter", node.id)
        elif node.id in BY_NAME and not getattr(node, "called", False):
            self.flag(node, "patching" if node.id in ("setattr", "delattr") else "dynamic names",
                      f"{node.id} used as a value")
        elif node.id in self.aliases:
            self.flags(node, self.aliases[node.id].split("."))
            self.shortcut(node, *self.aliases[node.id].split("."), module=True)
            if isinstance(node.ctx, ast.Load) and not getattr(node, "aliased", False) and \
                    _is_module(self.aliases[node.id].split(".")):
                self.flag(node, "module", f"the module {node.id} used as a value")

    def visit_Constant(self, node):
        """In a string without spaces ("__eq__", "0.__globals__" for ``getattr`` or a
        ``Formatter``) or in a format field ("{0.f_back.f_globals}"), not in prose: dunders and
        frames' attributes; and text that is code, read as code."""
        value = node.value if isinstance(node.value, str) else ""
        fields = re.findall(r"\{([^{}]*)\}", value) + [value] * (not re.search(r"\s", value))
        words = {w for f in fields for w in re.findall(r"\w+", f)}
        self.numbers += sum(_specific(w) for w in re.findall(r"[\w.]+", value) if
                            re.search(r"\d", w) and len(w) < 40) if value else _specific(node.value)
        if re.search("LABKIT_GRADE|PYTEST_", value.upper()):  # the grader's and pytest's settings
            # (the environment's names: PYTEST_CURRENT_TEST says which test runs)
            self.flag(node, "grader", repr(value)[:60])
        if "__setattr__" in words:
            self.flag(node, "patching", repr(value)[:60])
        elif any(w in FRAMES or (_dunder(w) and w not in DUNDERS_OK) for w in words):
            self.flag(node, "interpreter", repr(value)[:60])
        text = _as_code(node.value)
        if text is not None and LABEL.fullmatch(node.value) and not set(re.findall(
                r"\w+", node.value.split("(", 1)[1])) & {*self.constants, *self.aliases, *self.course}:
            text = None  # "exec (s)", "torch.compile (ms)": a label and its unit, no name of the module's
        if text is not None:  # text that is code (for timeit, profile.run...) is read as code,
            ast.increment_lineno(text, node.lineno - 1)  # by a reader of its own (its names
            reader = _Reader(self.path, self.aliases, self.course, self.unit,
                             self.exercises)  # bind nothing here)
            reader.generic_visit(text)
            self.found += reader.found

    def visit_Call(self, node):
        func, args = node.func, node.args
        if self._in_place_operator(func) and args and not self._not_own(args[0]):
            func.clear = ("patching",)  # operator.iadd(own, x): like own += x
        higher = ".".join(self.chain(func)[1]) in HIGHER_ORDER
        if higher and args and self._in_place_operator(args[0]) and (  # reduce(operator.iadd,
                len(args) > 2 and not self._not_own(args[2]) or  # parts, own) changes own, or
                len(args) == 2 and not self._origin(args[1])):  # the student's own elements
            args[0].clear = ("patching",)
        getter = ".".join(self.chain(func)[1]) if self.chain(func)[0] == "module" else ""
        if getter in ("operator.attrgetter", "operator.methodcaller") and args and all(
                isinstance(a, ast.Constant) and isinstance(a.value, str)
                for a in args[:None if getter.endswith("getter") else 1]):
            func.clear = ("dynamic names",)  # attrgetter("start", "id"): each read like getattr's
            for name in args[:None if getter.endswith("getter") else 1]:
                self.flags(node, name.value.split("."), "local")
                self.shortcut(node, *name.value.split("."))
                self.leaving(node, name.value.split("."))
        for kw in node.keywords:  # SimpleNamespace(__dlpack__=...): a protocol numpy looks up
            if kw.arg and _dunder(kw.arg):  # on the object, as a class's special method
                self.flag(node, "special methods", f"{kw.arg}= in {ast.unparse(func)[:40]}(...)")
        if getter in ("os.environ.get", "os.getenv") and args and not (  # a computed name may
                isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)):  # be the
            self.flag(node, "grader", ast.unparse(node)[:60])  # grader's or pytest's, unread
        if isinstance(func, ast.Name) and func.id in BY_NAME and len(args) >= 2:
            func.called = True
            kind, parts = self.chain(args[0])
            literal = [args[1].value] if isinstance(args[1], ast.Constant) and isinstance(
                args[1].value, str) else self.literal_loops.get(getattr(args[1], "id", None))
            for name in literal or ():  # getattr(m, "x"); for name in ("a", "b"): getattr(m, name)
                resolved = kind in ("module", "?")
                self.flags(node, parts + [name] if resolved else [name],
                           kind if resolved else "local")
                self.shortcut(node, *(parts if kind == "module" else []), name,
                              module=kind == "module")
                self.leaving(node, [name])
            if literal is None and kind != "self":
                self.flag(node, "interpreter" if kind == "module" and _is_module(parts) else
                          "dynamic names", ast.unparse(node)[:60])  # a module's, like vars(m)
            if func.id in ("setattr", "delattr") and self._not_own(args[0]):
                self.flag(node, "patching", ast.unparse(node)[:60])
            if func.id == "setattr" and len(args) > 2 and isinstance(args[1], ast.Constant):
                self._bind(ast.Attribute(args[0], str(args[1].value), ast.Store()), args[2])
            if kind != "?":  # the object is read like an attribute's base, not as a value
                for child in (*args[1:], *node.keywords):
                    self.visit(child)
                return
        if isinstance(func, ast.Attribute) and (func.attr in MUTATORS or (
                func.attr.endswith("_") and not func.attr.startswith("_"))):  # RECIPES.update(),
            func.called = True  # dict.update(RECIPES, ...), T.add_(1); not torch.add, F.relu_
            (target, unbound), (kind, parts) = self._receiver(func, args), self.chain(func.value)
            if target is not None and self._not_own(target) and not (
                    kind == "module" and _is_module(parts)):
                self.flag(node, "patching", f"{ast.unparse(node)[:60]} changes it in place")
            if _path(target) and any(self._origin(a) for a in [*args[bool(unbound):], *(
                    k.value for k in node.keywords)]):
                self.holders.add(_path(target))  # box.append(given): box holds it
        if self.chain(func)[0] == "module" and args and _path(args[0]) and any(
                self._origin(a) for a in args[1:]) and self.chain(func)[1][0] not in ("torch", "numpy", "math"):
            self.holders.add(_path(args[0]))  # heapq.heappush(heap, (0, given)): heap holds it
        written = self.writers.get((self.chain(func)[1] or [""])[-1], set())  # (position, name)
        shift = int(isinstance(func, ast.Attribute))  # obj.m(a): a is m's second parameter
        if any(self._origin(a) for i, a in enumerate(args)
               if i + shift in {w[0] for w in written}) or any(
                self._origin(k.value) for k in node.keywords if k.arg in {w[1] for w in written}):
            self.flag(node, "patching", f"{ast.unparse(node)[:60]} (a function that changes "
                      "what it is given, given what is not the student's)")
        if isinstance(func, ast.Attribute) and func.attr == "__setattr__":
            func.called = True  # object.__setattr__(self, ...) sets the student's own object
            target = self._receiver(func, args)[0]
            if target is None or self._not_own(target):
                self.flag(node, "patching", ast.unparse(node)[:60])
        if isinstance(func, ast.Name) and func.id == "vars" and len(args) == 1 and \
                self.chain(args[0]) == ("self", ["self"]):
            func.clear = ("dynamic names",)  # vars(self): like self.__dict__
        if isinstance(func, ast.Name) and func.id == "vars" and args and \
                self.chain(args[0])[0] in ("module", "?"):
            self.flag(node, "interpreter", f"{ast.unparse(node)[:60]} (a module's namespace)")
        if isinstance(func, ast.Name) and func.id == "type" and len(args) == 3:
            self.flag(node, "dynamic names", "type(name, bases, namespace)")
        kind, parts = self.chain(func)
        callee = _objects(tuple(parts))[-1:] if kind == "module" else ()
        for kw in node.keywords:
            if kw.arg in ("weights_only", "allow_pickle") and getattr(kw.value, "value", None) \
                    is not (kw.arg == "weights_only") or (kw.arg is None and callee and
                                                          callee[0] is torch.load):
                self.flag(node, "dynamic code", f"{ast.unparse(node)[:60]} (unpickling)")
        if callee and callee[0] is functools.wraps and (len(args) > 1 or node.keywords):
            self.flag(node, "patching", f"{ast.unparse(node)[:60]} (setattr by names)")
        if callee and callee[0] is functools.update_wrapper and len(args) == 2 and not \
                node.keywords and not self._not_own(args[0]) and not self._not_own(args[1]):
            func.clear = ("patching",)  # update_wrapper(own, fn): sets the student's own names
        if callee and callee[0] is typing.get_args and len(args) == 1 and self._literal(args[0]):
            func.clear = ("dynamic code",)  # get_args(Literal[1, 2]): no text becomes code
        self.generic_visit(node)

    def _literal(self, node) -> bool:
        """``Literal[...]`` (a module constant bound to one too), or a subscript of non-text
        constants: what ``typing.get_args`` returns without a string turned into a ForwardRef."""
        node, seen = self.constants.get(getattr(node, "id", None), node), {id(node)}
        todo, literal = [node], self.chain(getattr(node, "value", None)) == ("module", [
            "typing", "Literal"])
        while todo:  # (Literal[Small, 4]: a name bound to a Literal constant is one too)
            n = todo.pop()
            if isinstance(n, ast.Name) and isinstance(self.constants.get(n.id), ast.Subscript) \
                    and id(self.constants[n.id]) not in seen:
                seen.add(id(self.constants[n.id]))
                n = self.constants[n.id]
            if isinstance(n, ast.Subscript) and n is not node and self.chain(n.value) != (
                    "module", ["typing", "Literal"]):
                return False
            if isinstance(n, ast.Subscript):
                todo.append(n.slice)
            elif isinstance(n, ast.Tuple):
                todo += n.elts
            elif not (isinstance(n, ast.Constant) and (literal or not isinstance(n.value, str))):
                return False
        return isinstance(node, ast.Subscript)

    def _receiver(self, func, args) -> tuple:
        """(what a method call changes, whether it was called on the class): ``x`` of
        ``x.update(...)``, of ``dict.update(x, ...)``, of ``object.__setattr__(x, ...)``."""
        kind, parts = self.chain(func.value)
        objs = _objects(tuple(parts)) if kind == "module" else ()
        unbound = parts in (["dict"], ["list"], ["set"], ["object"], ["type"]) or bool(
            objs and len(objs) == len(parts) and isinstance(objs[-1], type))
        return ((args[0] if args else None) if unbound else func.value), unbound

    def _not_own(self, target) -> bool:
        """A target that is not the student's own object: a module, a given name, the class of
        an object (``type(x)``, ``cls``), a namespace (``vars(m)``), anything reached from them,
        an element of a container that holds them."""
        through = False
        while True:
            path = _path(target)
            if path in self.opaque or (through and path in self.holders):
                return True  # box.t, box[0] of box.t = given, box.append(given): what it holds
            if not isinstance(target, (ast.Attribute, ast.Subscript)) and not (
                    isinstance(target, ast.Call) and not isinstance(target.func, ast.Name)):
                break
            if isinstance(target, ast.Call) and self._made_new(target):
                return False  # a library's function makes a new object: torch.einsum(...).mul_()
            if isinstance(target, ast.Call) and self._origin(target) == "foreign":
                return True  # box.setdefault("k", given).step = f
            if isinstance(target, ast.Attribute) and target.attr == "__class__":
                return True  # x.__class__.step = f: the class of anything, like type(x)
            through, target = True, target.func if isinstance(target, ast.Call) else target.value
        if through and self._origin(target):
            return True  # [c for c in (given,)][0], [given][0]
        if isinstance(target, ast.Call) and target.func.id in ("vars", "getattr") and target.args:
            obj = target.args[0]  # vars(own), getattr(own, "a"): the student's (unless it holds
            name = target.args[1:2] and getattr(target.args[1], "value", None)  # foreign ones)
            return self._not_own(ast.Attribute(obj, name) if isinstance(name, str) else obj) or \
                any(p.startswith(f"{_path(obj)}.") for p in self.opaque | self.holders)
        if isinstance(target, ast.Call):
            return target.func.id in ("type", "vars", "getattr", "globals") or \
                self._origin(target) == "foreign"
        if isinstance(target, ast.Name) and self.functions and target.id in self.functions[-1][1]:
            name, params = self.functions[-1]  # a write into a parameter: the callers' business
            self.writers.setdefault(name, set()).add((params.index(target.id), target.id))
        if isinstance(target, ast.Name):
            return target.id in {*self.aliases, *self.course} or target.id == "cls" and not (
                self.plain_classes and self.plain_classes[-1])  # (cls of the student's class)
        if isinstance(target, (ast.Tuple, ast.List, ast.Set, ast.Dict)):  # [torch.testing][0]
            return any(self._not_own(e) for e in ast.iter_child_nodes(target)
                       if not isinstance(e, ast.expr_context))
        return not isinstance(target, (ast.Constant, ast.ListComp, ast.SetComp, ast.DictComp,
                                       ast.BinOp, ast.JoinedStr))  # new objects: the student's

    def _targets(self, node, targets, verb: str) -> None:
        self.assigned |= {_path(t) for t in targets if isinstance(t, ast.Attribute)} - {None}
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)):
                self._targets(node, t.elts, verb)
            elif isinstance(t, (ast.Attribute, ast.Subscript)) and (self._not_own(t.value) or
                                                                    getattr(t, "attr", "") == "__class__"):
                self.flag(t, "patching", f"{verb} {ast.unparse(t)[:60]}")  # (x.__class__ = K)

    def visit_Assign(self, node):
        self._targets(node, node.targets if isinstance(node, ast.Assign) else [node.target],
                      "assignment to")
        name = getattr(node.targets[0], "id", None) if isinstance(node, ast.Assign) else None
        if getattr(getattr(node.value, "func", None), "attr", "") in ("untyped_storage", "storage") \
                and name and all(getattr(p, "attr", None) in STORAGE_METADATA for p in ast.walk(
                    self.root) for n in ast.iter_child_nodes(p) if getattr(n, "id", None) == name
                    and isinstance(n.ctx, ast.Load)):  # s = x.untyped_storage(): s.nbytes() only
            node.value.func.clear = ("measured elsewhere",)
        if isinstance(node, ast.AugAssign) and self._not_own(node.target):  # RECIPES |= {...}
            self.flag(node, "patching", f"{ast.unparse(node)[:60]} (in place)")
        if isinstance(node, ast.AnnAssign):
            self._annotation(node.annotation)
        if getattr(node, "value", None) is not None and (not _type_like(node.value) or (
                isinstance(node.value, ast.Constant) and isinstance(node.value.value, str))):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                self.texts |= _target_names(target)  # not a type: a text, if annotated with
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name) and not getattr(node, "in_class", False):
            name, (kind, parts) = node.targets[0].id, self.chain(node.value)
            if kind == "module" and isinstance(node.value, (ast.Name, ast.Attribute)):
                self.aliases[name] = ".".join(parts)  # a local alias (its uses are read)
                node.value.aliased = True
                return self.generic_visit(node)
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            self._bind(target, node.value)
        self.generic_visit(node)

    visit_AugAssign = visit_AnnAssign = visit_Assign

    def _bind(self, target, value, element: bool = False) -> None:
        """Names bound to what may be a module, a name of the course or what is reached from
        them (``[F][0]``, ``(m := given)``, ``RECIPES["mixed"]``): foreign, like what they came
        from; names bound to a new container that holds such objects (``{"fp32":
        torch.float32}``): the student's own, but not its elements. ``element``: the target
        takes the value's elements (a for loop). What a call returns is the student's own."""
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts) and not element:  # a, b = [], math.inf
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v)
        elif isinstance(value, ast.Name) and value.id in ("self", "cls") and \
                isinstance(target, ast.Name):  # me = self: me.kind is self.kind
            for known in (self.opaque, self.holders):
                known |= {target.id + p[len(value.id):] for p in known
                          if p.startswith(value.id + ".")}
        elif isinstance(value, ast.Lambda) and self._origin(value.body):
            self.giving |= _target_names(target)  # get = lambda: torch.optim.SGD
        elif value is not None:
            names, origin = _target_names(target) | {_path(target)} - {None}, \
                self._origin(value, element or isinstance(target, (ast.Tuple, ast.List)))
            if isinstance(target, ast.Subscript) and origin and _path(target.value):
                return self.holders.add(_path(target.value))  # box["t"] = given: box holds it
            kept = set() if self.branches else names  # (what a branch binds may not be bound)
            made = value  # _Kept(), _Kept().add(n), SimpleNamespace(...): a new own object
            while isinstance(made, (ast.Call, ast.Attribute)):
                made = made.func if isinstance(made, ast.Call) else made.value
            new = isinstance(value, ast.Call) and not origin and not element and (
                getattr(made, "id", None) in self.own_classes or
                self.chain(value.func) == ("module", ["types", "SimpleNamespace"]))
            self.instances = self.instances - names | (names if new else set())
            self.opaque = self.opaque - kept | (names if origin == "foreign" else set())
            self.holders = self.holders - kept | (names if origin == "holder" else set())

    def _origin(self, value, element: bool = False) -> str:
        """"foreign", "holder" (a new container of foreign objects) or "" (the student's own)."""
        if isinstance(value, (ast.Name, ast.Attribute)) and self.chain(value)[0] == "module":
            objs, parts = _objects(tuple(self.chain(value)[1])), self.chain(value)[1]
            return "" if len(objs) == len(parts) and _plain(objs[-1]) else "foreign"
        if isinstance(value, ast.Name):
            if value.id in {*self.course, *self.opaque}:
                return "foreign"
            return ("foreign" if element else "holder") if value.id in self.holders else ""
        if isinstance(value, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            inner = {self._origin(e) for e in ast.iter_child_nodes(value)
                     if not isinstance(e, ast.expr_context) and e is not None}
            return "" if not inner - {""} else "foreign" if element else "holder"
        if isinstance(value, ast.Subscript):
            return self._origin(value.value, element=True)
        if _path(value) in self.opaque or _path(value) in self.holders:  # box.t
            return "foreign" if _path(value) in self.opaque or element else "holder"
        if isinstance(value, ast.Attribute) and value.attr in ("__class__", "__name__",
                                                              "__qualname__", "__doc__"):
            return "foreign" if value.attr == "__class__" else ""  # (a class; a text)
        if isinstance(value, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            saved = set(self.opaque), set(self.holders)  # [c for c in (given,)]: holds them
            for gen in value.generators:
                self._bind(gen.target, gen.iter, element=True)
            inner = {self._origin(getattr(value, k)) for k in ("elt", "key", "value")
                     if hasattr(value, k)}
            self.opaque, self.holders = saved
            return "" if not inner - {""} else "foreign" if element else "holder"
        if isinstance(value, (ast.Attribute, ast.Starred, ast.NamedExpr)):
            return "foreign" if self._origin(value.value, element) == "foreign" else ""
        if isinstance(value, (ast.IfExp, ast.BoolOp)):
            origins = {self._origin(v, element) for v in (
                [value.body, value.orelse] if isinstance(value, ast.IfExp) else value.values)}
            return "foreign" if "foreign" in origins else "holder" if "holder" in origins else ""
        if isinstance(value, ast.Call):  # sorted([cls])[0]: an element of what it made
            return "foreign" if element and self._returns(value) == "holder" else \
                self._returns(value)
        return ""  # an operator: a new object

    def _made_new(self, call) -> bool:
        """A call of a library module's function (``torch.einsum``, ``np.zeros``, a class of
        it): a new object; not a class's method (``torch.optim.SGD.mro()``)."""
        kind, parts = self.chain(call.func)
        return kind == "module" and ".".join(parts) not in VIEWS and _is_module(parts[:-1])

    def _returns(self, call) -> str:
        """The origin of what a call returns: torch's, numpy's and math's functions make new
        objects; ``type``, ``vars`` and ``globals`` reach what is not the student's; a container
        made of foreign objects (``dict(...)``, ``sorted``, ``copy.copy``) holds them, but a class
        or function it is given comes back as it is; any other function may return what it was
        given (``functools.reduce``, ``next``, the student's own helpers)."""
        if isinstance(call.func, ast.Lambda):
            return self._origin(call.func.body)  # (lambda: given)()
        kind, parts = self.chain(call.func)
        given = [*call.args[".".join(parts) in HIGHER_ORDER:],  # reduce(operator.mul, shape)
                 *(k.value for k in call.keywords if k.arg != "key")]
        origins = {self._origin(a) for a in given} - {""}
        if parts[:1] in (["torch"], ["numpy"], ["math"]) and self._made_new(call):
            return ""
        if parts in (["type"], ["vars"], ["globals"]) or (kind in ("local", "self") and
                                                          parts[-1] in self.giving):
            return "foreign"  # (giving: the student's functions that return foreign objects)
        if isinstance(call.func, ast.Attribute) and not (kind == "module" and _is_module(
                parts[:-1])):  # a method: of a foreign object or container (table.get("sgd")),
            receiver, unbound = self._receiver(call.func, call.args)  # or of a library class
            if self._origin(call.func.value if receiver is None else receiver) in (
                    "foreign", "holder"):  # called on an instance (torch.Tensor.float(x): x's)
                return "foreign"
            if call.func.attr in ("get", "setdefault", "pop"):
                origins = {self._origin(a) for a in given[1:]} - {""}  # (a key never comes back)
        if kind == "local" and len(parts) == 1 and parts[0] in BUILTIN_NAMES and \
                parts[0] not in (*VIEWS, *CONTAINERS):
            return ""  # isinstance, len, ...: a new value
        if not origins:
            return ""
        if ".".join(parts) in CONTAINERS and not any(  # a class, a function: itself
                self.chain(a)[0] == "module" and callable((_objects(tuple(self.chain(a)[1]))
                                                           or [None])[-1]) for a in given):
            return "holder"
        return "foreign"

    def visit_Return(self, node):
        if node.value is not None and self._origin(node.value):
            self.giving.add(self.functions[-1][0] if self.functions else self.unit.split(".")[-1])
        self.generic_visit(node)

    visit_Yield = visit_YieldFrom = visit_Return

    def visit_withitem(self, node):
        self._bind(node.optional_vars or ast.Tuple([]), node.context_expr)
        self.generic_visit(node)

    def visit_NamedExpr(self, node):
        self._bind(node.target, node.value)
        self.generic_visit(node)

    def visit_Delete(self, node):
        self._targets(node, node.targets, "del")
        self.generic_visit(node)

    def _annotation(self, node) -> None:
        """An annotation is evaluated by get_type_hints (singledispatch, dataclasses): a name, a
        subscript, ``X | None`` or a string of them only; a string is read as code."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                return
            reader = _Reader(self.path, self.aliases, self.course, self.unit, self.exercises)
            reader.visit(node)
            self.found += reader.found
        if not _type_like(node) or any(isinstance(n, ast.Name) and n.id in self.texts
                                       for n in ast.walk(node)):  # x: t, t = "..." (a text)
            self.flag(node, "dynamic code", f"the annotation {ast.unparse(node)[:50]}")

    def visit_arg(self, node):
        if node.annotation is not None:
            self._annotation(node.annotation)
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        if node.returns is not None:
            self._annotation(node.returns)
        self.local |= {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        positional = node.args.posonlyargs + node.args.args
        for arg, default in [*zip(positional[len(positional) - len(node.args.defaults):],
                                  node.args.defaults), *zip(node.args.kwonlyargs,
                                                            node.args.kw_defaults)]:
            self._bind(ast.Name(arg.arg), default)  # def f(M=torch.nn.Module): M is foreign
        own = scope(node.body)  # a name the function binds is its own throughout (Python's
        comprehended = {id(n) for c in own if isinstance(c, ast.comprehension)  # rule), but
                        for n in ast.walk(c.target)}  # a comprehension's loop names
        bound = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)} | {
            n.id for n in own if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)
            and id(n) not in comprehended} | {getattr(n, "name", None) for n in own}
        bound -= {g for n in own if isinstance(n, (ast.Global, ast.Nonlocal)) for g in n.names}
        outer, course = self.aliases, self.course
        self.aliases = {n: a for n, a in outer.items() if n not in bound} | aliases(
            node.body, self.path)
        self.course = course - bound
        made = [(_path(d) or "").split(".")[-1] for d in node.decorator_list]
        if node.name in self.giving and {"property", "cached_property"} & set(made):
            self.opaque |= {f"self.{node.name}", f"cls.{node.name}"}  # self.kind: what it gives
        elif set(made) & self.giving:
            self.opaque.add(node.name)  # @keep def K(): K is what keep returns
        self.functions.append((node.name, [a.arg for a in (*node.args.posonlyargs, *node.args.args,
                                                           *node.args.kwonlyargs)]))
        self.generic_visit(node)
        self.functions.pop()
        self.aliases = {**outer, **{g: self.aliases[g] for g in self.globals & set(self.aliases)}}
        self.course = course

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        """``if TYPE_CHECKING:`` proved ``dead`` (:func:`_mark_dead`): its body never runs (nor
        do :func:`aliases` read it)."""
        if getattr(node, "dead", False):
            return [self.visit(n) for n in (node.test, *node.orelse)]
        self.generic_visit(node)

    def visit_Match(self, node):
        """``match torch.nn.Module: case M:`` binds M to the subject."""
        for case in node.cases:
            self._bind(ast.Tuple([ast.Name(n.name) for n in ast.walk(case.pattern)
                                  if isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name]),
                       node.subject, element=True)
        self.generic_visit(node)

    def visit_Global(self, node):
        self.globals |= set(node.names)
        for name in sorted(set(node.names) & (self.course | (
                self.defined if isinstance(node, ast.Global) else set()))):
            self.flag(node, "patching", f"global {name}")

    visit_Nonlocal = visit_Global

    def visit_For(self, node):
        self._bind(node.target, node.iter, element=True)
        self.generic_visit(node)

    visit_comprehension = visit_For

    def visit_ListComp(self, node):  # the loops first: they bind the names the element reads
        for part in (*node.generators, *[getattr(node, k) for k in ("key", "value", "elt")
                                         if hasattr(node, k)]):
            self.visit(part)

    visit_SetComp = visit_GeneratorExp = visit_DictComp = visit_ListComp

    def visit_ClassDef(self, node):
        self.plain_classes.append(node.name in self.plain)
        enum = any(self.chain(b)[1][:1] == ["enum"] for b in node.bases)  # class R(str, Enum)
        values = [b for b in ([] if enum else node.bases)
                  if (self.chain(b)[1] or [""])[-1] in VALUE_TYPES]
        for base in values:
            self.flag(base, "special methods", f"class {node.name}({ast.unparse(base)})")
        lying = node.name in self.lying  # a value type's subclass, or an own base of one
        compared = node.name in self.compared  # ... or of a container or number tests compare
        if any(kw.arg == "metaclass" and self.chain(kw.value) != ("module", ["abc", "ABCMeta"])
               for kw in node.keywords):
            self.flag(node, "special methods", f"class {node.name}(metaclass=...)")
        defined = {getattr(t, "id", getattr(t, "name", None)) for b in node.body
                   for t in [b, *getattr(b, "targets", [])]}
        for stmt in node.body:
            names = [stmt.name] if isinstance(stmt, DEFS) else [
                t.id for t in getattr(stmt, "targets", [getattr(stmt, "target", None)])
                if isinstance(t, ast.Name)]
            for target in getattr(stmt, "targets", []) if all(map(_dunder, names)) else []:
                target.clear = ("interpreter",)  # __radd__ = ...: a definition, like a def
            if names and all(map(_dunder, names)) and isinstance(stmt, ast.Assign) and (
                    getattr(stmt.value, "id", None) in defined or len(self.chain(stmt.value)[1]) == 2
                    and self.chain(stmt.value)[1][0] == "object"):  # __radd__ = __add__
                stmt.value.clear = ("interpreter",)  # (object.__hash__: the data model's own)
            if ast.unparse(stmt) == "__hash__ = None":  # the data model's "unhashable"
                names = []
            for name in [n for n in names if _dunder(n) and n not in DUNDERS_OK]:
                self.flag(stmt, "special methods", f"{name} in class {node.name}")
            for name in [n for n in names if lying and _dunder(n) and (n not in DUNDERS_OK or n in (
                    "__torch_dispatch__", "__torch_function__")) or compared and n in ANSWERS]:
                self.flag(stmt, "false values", f"{name} in class {node.name}, a value type's")
            self.class_level(stmt, node.name)
        self.generic_visit(node)
        self.plain_classes.pop()

    def class_level(self, stmt, cls: str) -> None:
        """A name bound in a class body is reached as ``self.X``, ``cls.X`` and ``Cls.X`` by every
        unit: foreign there if it holds a foreign object; a module there is a module used as a
        value (``class H: T = torch``)."""
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            base = _absolute(stmt, self.path) + "." if isinstance(stmt, ast.ImportFrom) else ""
            bound = {a.asname or a.name.split(".")[0]: (base + a.name).split(".")
                     for a in stmt.names}
            for name, parts in bound.items():
                if _is_module(parts):
                    self.flag(stmt, "module", f"the module {'.'.join(parts)} bound in class {cls}")
            origins = {n: "" if _plain((_objects(tuple(p)) or [None])[-1]) else "foreign"
                       for n, p in bound.items()}
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            stmt.in_class = True  # (no alias: self.T is not read through T)
            origin = self._origin(stmt.value)
            origins = {n: origin for t in getattr(stmt, "targets", [getattr(stmt, "target", None)])
                       for n in _target_names(t)}
        else:
            return
        for name, origin in origins.items():
            paths = {f"{root}.{name}" for root in ("self", "cls", cls)}
            self.opaque |= paths if origin == "foreign" else set()
            self.holders |= paths if origin == "holder" else set()

    def visit_Import(self, node):
        """An import inside the student's code is read like what it imports (an import at the
        module's top is read where its names are used: a leftover ``import gc`` zeroes nothing)."""
        base = _absolute(node, self.path) + "." if isinstance(node, ast.ImportFrom) else ""
        node.clear = ("dynamic names",)  # (attrgetter is judged where it is called)
        for alias in node.names:
            path = base + alias.name if alias.name != "*" else base[:-1]
            if not any(m.startswith(path + ".") and MODULES[m] is None for m in MODULES) and \
                    path != "numpy.testing":  # (its assertions are allowed: _verdict)
                self.flags(node, path.split("."))  # (import sys: sys.maxsize may be used)
            self.shortcut(node, *path.split("."), module=True)

    visit_ImportFrom = visit_Import


def _absolute(node: ast.ImportFrom, path: str) -> str:
    """The module a ``from`` import names, a relative one (``from .. import grade``) resolved
    from the importing module's path ("labkit/lab1/accounting.py")."""
    package = path.removesuffix(".py").split("/")[:-1]
    base = package[:max(0, len(package) + 1 - node.level)] if node.level else []
    return ".".join(p for p in [*base, node.module] if p)


def _mark_dead(nodes) -> None:
    """Mark ``dead`` each ``if TYPE_CHECKING:`` (``if typing.TYPE_CHECKING:``) whose body never
    runs: the name it tests is bound in ``nodes`` (the taken code, the course's module) by
    typing's import of it only, and no namespace is written by computed names (``globals()``).
    Any other ``if`` is read, body and all: ``TYPE_CHECKING = True`` may stand anywhere."""
    walked = [n for node in nodes for n in ast.walk(node)]
    if any(isinstance(n, ast.Name) and n.id in ("globals", "vars", "locals") for n in walked):
        return
    binds = collections.defaultdict(set)  # name -> what binds it: an import's path, or None
    for n in walked:
        for a in n.names if isinstance(n, (ast.Import, ast.ImportFrom)) else []:
            binds[a.asname or a.name.split(".")[0]].add(f"{n.module}.{a.name}" if isinstance(
                n, ast.ImportFrom) and not n.level else a.name)
        if not isinstance(n, ast.alias) and not isinstance(getattr(n, "ctx", None), ast.Load):
            binds[getattr(n, "id", None) or getattr(n, "arg", None) or getattr(n, "name", None)
                  or getattr(n, "rest", None)].add(None)  # a name, argument, def, except, case
    for n in walked:
        test = n.test if isinstance(n, ast.If) else None
        if isinstance(test, ast.Name):
            n.dead = binds.get(test.id) == {"typing.TYPE_CHECKING"}
        elif isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name):
            n.dead = test.attr == "TYPE_CHECKING" and binds.get(test.value.id) == {"typing"}


def aliases(nodes, path: str) -> dict[str, str]:
    """{local name: dotted path} of the imports of one scope (``nodes``: a module's body, a
    function's; ``from m import *`` as the names ``m`` really exports), ``path`` the module's
    ("labkit/lab1/accounting.py")."""
    out = {}
    for node in scope(nodes):
        for a in getattr(node, "names", []) if isinstance(node, ast.Import) else []:
            top = a.name.split(".")[0]
            out[a.asname or top] = a.name if a.asname else top
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            out.update({a.asname or a.name: f"{module}.{a.name}" for a in node.names})
            if any(a.name == "*" for a in node.names):  # the names the module really exports
                mod = _module(module)
                out.update({n: f"{module}.{n}" for n in getattr(mod, "__all__", None) or [
                    n for n in dir(mod) if not n.startswith("_")]} if mod else {})
    return out


def _value_classes(classes: dict, names: dict, constants: dict, types=VALUE_TYPES) -> set[str]:
    """The student's classes that derive from one of ``types`` (``int``, ``Tensor``...), however the
    base is written (an own class of one, ``Whole = int``, ``type(0)``), and their own bases
    (a mixin's ``__eq__`` is the subclass's)."""
    def value(base, depth=0) -> bool:
        if isinstance(base, ast.Name) and base.id in constants and depth < 5:  # Whole = int
            return value(constants[base.id], depth + 1)
        if isinstance(base, ast.Call):  # class E(type(0)); class P(namedtuple(...)) is a type's
            return not _makes_type(base, names)
        if isinstance(base, ast.Name) and base.id in classes:
            return base.id in found
        if isinstance(base, ast.Subscript):  # Generic[T], list[int]; not KINDS[0], a constant's
            return getattr(base.value, "id", None) in constants or value(base.value, depth + 1)
        path = (_path(base) or "").split(".")
        known = path[0] in {*names, *BUILTIN_NAMES} and path != [""]  # else a base the reading
        return not known or [*names.get(path[0], path[0]).split("."), *path[1:]][-1] in \
            types  # cannot name (*BASES, KINDS[0], (0).__class__, a local): a value type's

    found: set[str] = set()
    for _ in range(len(classes) + 1):
        found |= {c for c, n in classes.items() if any(value(b) for b in n.bases)}
        found |= {getattr(b, "id", None) for c in found for b in classes[c].bases} & set(classes)
    return found


def read(merged, pristine: str) -> dict[str, list[Flag]]:
    """{exercise: its flags} for what ``merged`` (an :class:`~labkit.grade.extract.Merged`) took.

    An added definition's flags go to the exercises whose code uses it (directly or through
    other added definitions); those of one that no exercise uses, to every exercise of the
    module (it may run at import)."""
    p_tree = ast.parse(pristine)
    _mark_dead([*(node for _, node, _ in merged.taken), *p_tree.body])
    names = aliases(ast.parse(merged.source).body, merged.path)
    course = {n.name for n in p_tree.body if isinstance(n, DEFS) and n.name not in merged.units} \
        | set(aliases(p_tree.body, merged.path))  # (an exercise function is the student's own)
    defined = set().union(*map(bound_names, p_tree.body))  # (global X: any of these)
    found, uses, binds = {}, {}, {}
    texts = {n for label, node, _ in merged.taken if label.startswith("the constant ")
             and not (isinstance(node.value, ast.Constant) and not isinstance(node.value.value, str))
             and not (_type_like(node.value) and not isinstance(node.value, ast.Constant))
             and not _makes_type(node.value, names) for n in bound_names(node)}  # (get_type_hints evaluates a text it is given by name)
    tree = ast.parse(merged.source)
    leaving = {u.split(".")[-1] for u, node, _ in merged.taken if any(  # x.tolist(), float(x[i])
        isinstance(n, ast.Attribute) and n.attr in ("tolist", "item") or isinstance(n, ast.Call)
        and getattr(n.func, "id", None) in ("float", "int", "bool") and isinstance(
            n.args[:1] and n.args[0], ast.Subscript) and getattr(n.args[0].value, "attr", "") != "shape"
        for n in ast.walk(node))}
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    methods = {u.split(".")[-1] for u in merged.units if "." in u} | {  # and their own classes'
        f.name for c in classes.values() if c.name not in course for f in c.body if isinstance(f, DEFS)}
    constants = {n: node.value for label, node, _ in merged.taken if label.startswith(
        "the constant ") and getattr(node, "value", None) for n in bound_names(node)}
    lying = _value_classes(classes, names, constants)
    compared = _value_classes(classes, names, constants, COMPARED)
    plain: set = set()  # the student's classes of no base but such classes: ``cls`` is theirs
    for _ in classes:
        plain |= {c for c, n in classes.items() if c not in course and not n.keywords and
                  all(getattr(b, "id", None) in plain for b in n.bases)}
    fields = {t.attr for _, node, _ in merged.taken for t in ast.walk(node) if isinstance(
        t, ast.Attribute) and isinstance(t.ctx, ast.Store) and getattr(t.value, "id", "") == "self"}
    seed: tuple = ({}, set(), set(), set(), {})  # aliases, opaque, holders, giving, writers
    for _ in range(len(merged.taken) + 1):  # again while units share what others do not know
        shared = (dict(seed[0]), *map(set, seed[1:4]), {f: set(w) for f, w in seed[4].items()})
        for unit, node, exercises in merged.taken:
            reader = _Reader(merged.path, {**names, **seed[0]}, course, unit, exercises)
            reader.texts, reader.opaque, reader.holders, reader.giving = set(texts), *map(
                set, seed[1:4])
            reader.writers = {f: set(w) for f, w in seed[4].items()}
            reader.literal_loops, reader.own_classes = _literal_names(node), set(classes) - course
            reader.root = node
            reader.fields, reader.plain, reader.constants = fields, plain, constants
            reader.own_methods, reader.lying, reader.compared = methods, lying, compared
            reader.defined = defined
            if unit.endswith("(a class constant)"):
                reader.class_level(node, unit.split(".")[0])
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or \
                    any(a.name == "*" for a in node.names):  # (whose names cannot be read)
                reader.visit(node)
            if reader.numbers >= ANSWER_NUMBERS:
                reader.flag(node, "answers", f"{reader.numbers} specific numbers in {unit}")
            if reader.jit and set(exercises) & set(shortcuts.MEASURED) and {unit.split(".")[-1], *(
                    getattr(n, "id", None) for n in ast.walk(node))} & leaving:  # TorchScript's
                # own tolist/item (its or a function's it compiles): no run-time watch sees them
                reader.flag(node, "measured elsewhere", f"tensor data out of torch in TorchScript ({unit})")
            found[unit] = reader.found
            uses[unit] = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node)}
            binds[unit] = bound_names(node)
            top = unit.startswith("the constant ")  # a module-level name, a global, self's
            kept = {p for p in (*reader.aliases, *reader.opaque, *reader.holders) if top or
                    p.split(".")[0] in ("self", "cls", unit, *classes, *reader.globals)}
            shared[0].update({p: a for p, a in reader.aliases.items() if p in kept and
                              names.get(p) != a})
            shared[1].update(kept & reader.opaque)
            shared[2].update(kept & reader.holders)
            shared[3].update(reader.giving)
            for f, w in reader.writers.items():
                shared[4].setdefault(f, set()).update(w)
        if shared == seed:
            break
        seed = shared
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
        for ex in owners.get(unit) or module_ids:  # (a shortcut of exercise X: X's only)
            out[ex] += [f for f in flags if f not in out[ex] and not (
                f.name == "shortcut" and not f.what.endswith(f" in exercise {ex}`"))]
    return out
