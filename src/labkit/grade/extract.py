"""Take a student's exercise code out of a submission and put it into a pristine course.

An **exercise unit** is a function or a method that is a stub in the pristine course: its body
contains ``raise NotImplementedError("exercise N.E: ...")`` (found with :mod:`ast`, at any depth
of the function). From a submission the grader takes only

* the student's version of every exercise unit (its signature and body; the decorators stay the
  course's), and
* the definitions the student added beside them: new top-level functions and classes, new
  methods of a class that holds an exercise method, and new ``import`` statements (an import that
  rebinds a name of the course's module is dropped).

Everything else — given functions and classes, module-level statements, other files — comes from
the pristine course, and what was left behind is listed (:class:`Dropped`). The merged module
keeps the course's line numbers above the first exercise unit; :class:`Merged` records the line
ranges of the student's code, so the child process can tell student frames from the course's.
"""
from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass, field

STUB = re.compile(r"^exercise (\d+\.\d+)\b")


@dataclass
class Unit:
    """One function or method of a module: its qualified name and where it is."""
    qualname: str          # "flash_attention_forward", "FlashAttention.forward"
    node: ast.AST
    exercises: tuple[str, ...]   # the stub ids it holds (empty for given code)


@dataclass
class Dropped:
    """Something of the submission the grader did not take, and why."""
    path: str
    line: int
    what: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}: {self.why}"


@dataclass
class Merged:
    """The merged text of one exercise module and where the student's code sits in it."""
    path: str                                  # "labkit/lab5/flash_attention.py"
    source: str
    student_lines: list[tuple[int, int]] = field(default_factory=list)   # inclusive ranges
    units: dict[str, tuple[str, ...]] = field(default_factory=dict)      # taken qualname -> ids
    added: list[str] = field(default_factory=list)                       # added names
    dropped: list[Dropped] = field(default_factory=list)
    taken: list[tuple[str, ast.AST, tuple[str, ...]]] = field(default_factory=list)
    constants: list[str] = field(default_factory=list)                   # added constants
    """``taken``: (label, the student's node, its exercises) for every unit and added definition
    taken: what :mod:`labkit.grade.flags` reads (added definitions carry the module's exercises)."""


def stub_ids(node: ast.AST) -> tuple[str, ...]:
    """The exercise ids of every ``raise NotImplementedError("exercise N.E...")`` under ``node``."""
    ids = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Raise) and isinstance(sub.exc, ast.Call) \
                and isinstance(sub.exc.func, ast.Name) and sub.exc.func.id == "NotImplementedError" \
                and sub.exc.args and isinstance(sub.exc.args[0], ast.Constant) \
                and isinstance(sub.exc.args[0].value, str):
            m = STUB.match(sub.exc.args[0].value)
            if m and m.group(1) not in ids:
                ids.append(m.group(1))
    return tuple(ids)


FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
BUILTIN_NAMES = set(__import__("builtins").__dict__)


def units(tree: ast.Module) -> dict[str, Unit]:
    """Every function and method (classes walked recursively), by qualified name."""
    found: dict[str, Unit] = {}

    def walk(body, prefix):
        for node in body:
            if isinstance(node, FUNCS):
                name = prefix + node.name
                found[name] = Unit(name, node, stub_ids(node))
            elif isinstance(node, ast.ClassDef):
                walk(node.body, prefix + node.name + ".")
    walk(tree.body, "")
    return found


def exercise_ids(source: str) -> tuple[str, ...]:
    """The exercises a pristine module holds, in order."""
    out = []
    for unit in units(ast.parse(source)).values():
        out += [e for e in unit.exercises if e not in out]
    return tuple(out)


def _top_names(tree: ast.Module) -> set[str]:
    """Names the module binds at top level (defs, classes, imports, assignments)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (*FUNCS, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _assigned_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)]
    return []


def _free_names(expr: ast.AST) -> set[str]:
    """The names an expression reads that it does not bind itself (comprehensions, lambdas)."""
    loads = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    stores = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    args = {a.arg for n in ast.walk(expr) if isinstance(n, ast.Lambda)
            for a in (*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs, n.args.vararg,
                      n.args.kwarg) if a is not None}
    return loads - stores - args


def _constant_names(node: ast.AST) -> list[str]:
    """The names a student's constant binds (``EPS = 1e-8``, ``A, B = 1, 2``, ``N: int = 4``);
    [] for anything else (an augmented assignment, an attribute or item target, a dunder)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign) and node.value is not None and node.simple:
        targets = [node.target]
    else:
        return []
    names = []
    for t in targets:
        elts = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
        if not all(isinstance(e, ast.Name) for e in elts):
            return []
        names += [e.id for e in elts]
    if any(n.startswith("__") for n in names):
        return []
    return names


def _segment(lines: list[str], node: ast.AST, *, with_decorators: bool) -> str:
    start = node.lineno
    if with_decorators and getattr(node, "decorator_list", None):
        start = min(d.lineno for d in node.decorator_list)
    return textwrap.dedent("".join(lines[start - 1:node.end_lineno]))


def _describe(node: ast.AST) -> str:
    text = ast.unparse(node).splitlines()[0] if not isinstance(node, (*FUNCS, ast.ClassDef)) \
        else f"{'class' if isinstance(node, ast.ClassDef) else 'def'} {node.name}"
    return f"`{text[:70]}`"


def _indent(text: str, indent: str) -> list[str]:
    return [(indent + line if line.strip() else line) for line in text.splitlines(keepends=True)]


def merge(pristine: str, student: str | None, path: str, skip: frozenset = frozenset()) -> Merged:
    """The pristine module with the student's exercise units and added definitions in it, but
    those whose label (their entry in :attr:`Merged.taken`) is in ``skip``: red flags zeroed them."""
    p_tree = ast.parse(pristine)
    p_lines = pristine.splitlines(keepends=True)
    p_units = units(p_tree)
    merged = Merged(path=path, source=pristine)
    if student is None:
        merged.dropped.append(Dropped(path, 0, "the file", "missing from the submission: every "
                                      "exercise in it is graded as the stub"))
        return merged
    try:
        s_tree = ast.parse(student)
    except SyntaxError as exc:
        merged.dropped.append(Dropped(path, exc.lineno or 0, "the file",
                                      f"does not parse ({exc.msg}): every exercise in it is "
                                      "graded as the stub"))
        return merged
    s_lines = student.splitlines(keepends=True)
    s_units = units(s_tree)
    # replacements: pristine (start, end) line span -> new lines
    spans: list[tuple[int, int, list[str]]] = []

    def skipped(label: str, node: ast.AST) -> bool:
        if label in skip:
            merged.dropped.append(Dropped(path, node.lineno, f"`{label}`", "red flags that zero "
                                          "an exercise (see the flags): not taken"))
        return label in skip
    for name, unit in p_units.items():
        if not unit.exercises:
            if name in s_units and ast.dump(s_units[name].node) != ast.dump(unit.node):
                merged.dropped.append(Dropped(path, s_units[name].node.lineno, f"given `{name}`",
                                              "differs from the course's; the course's is graded"))
            continue
        if name not in s_units:
            merged.dropped.append(Dropped(path, 0, f"exercise {', '.join(unit.exercises)} "
                                          f"`{name}`", "not found in the file: graded as the stub"))
            continue
        s_node = s_units[name].node
        p_node = unit.node
        if skipped(name, s_node):
            continue
        text = _segment(s_lines, s_node, with_decorators=False)
        indent = re.match(r"[ \t]*", p_lines[p_node.lineno - 1]).group(0)
        if [ast.dump(d) for d in s_node.decorator_list] != [ast.dump(d) for d in p_node.decorator_list]:
            merged.dropped.append(Dropped(path, s_node.lineno, f"the decorators of `{name}`",
                                          "differ from the course's; the course's are kept"))
        spans.append((p_node.lineno, p_node.end_lineno, _indent(text, indent)))
        merged.units[name] = unit.exercises
        merged.taken.append((name, s_node, unit.exercises))
    module_ids = exercise_ids(pristine)
    # added methods of classes that hold an exercise method: at the end of the class
    p_classes = {n.name: n for n in p_tree.body if isinstance(n, ast.ClassDef)}
    s_classes = {n.name: n for n in s_tree.body if isinstance(n, ast.ClassDef)}
    for cname, p_cls in p_classes.items():
        s_cls = s_classes.get(cname)
        if s_cls is None:
            continue
        has_ex = any(u.exercises for q, u in p_units.items() if q.startswith(cname + "."))
        p_members = {n.name for n in p_cls.body if isinstance(n, (*FUNCS, ast.ClassDef))}
        extra = [n for n in s_cls.body if isinstance(n, FUNCS) and n.name not in p_members]
        for node in extra:
            if not has_ex:
                merged.dropped.append(Dropped(path, node.lineno, f"method `{cname}.{node.name}`",
                                              "added to a class with no exercise: not graded"))
                continue
            if skipped(f"{cname}.{node.name}", node):
                continue
            indent = re.match(r"[ \t]*", p_lines[p_cls.body[0].lineno - 1]).group(0)
            text = _segment(s_lines, node, with_decorators=True)
            spans.append((p_cls.end_lineno + 1, p_cls.end_lineno, ["\n", *_indent(text, indent)]))
            merged.added.append(f"{cname}.{node.name}")
            merged.taken.append((f"{cname}.{node.name}", node, module_ids))
        p_assigned = {n for stmt in p_cls.body for n in _assigned_names(stmt)}
        for node in s_cls.body:
            names = _constant_names(node)
            if names and has_ex and not (set(names) & (p_members | p_assigned)) \
                    and ast.dump(node) not in {ast.dump(n) for n in p_cls.body}:
                if skipped(f"{cname}.{', '.join(names)} (a class constant)", node):
                    continue
                indent = re.match(r"[ \t]*", p_lines[p_cls.body[0].lineno - 1]).group(0)
                text = _segment(s_lines, node, with_decorators=False)
                spans.append((p_cls.end_lineno + 1, p_cls.end_lineno,
                              ["\n", *_indent(text, indent)]))
                merged.added.append(f"{cname}.{'.'.join(names)}")
                merged.constants += [f"{cname}.{n}" for n in names]
                merged.taken.append((f"{cname}.{', '.join(names)} (a class constant)", node,
                                     module_ids))
                continue
            if not isinstance(node, (*FUNCS, ast.ClassDef, ast.Expr)) and \
                    ast.dump(node) not in {ast.dump(n) for n in p_cls.body}:
                merged.dropped.append(Dropped(path, node.lineno, f"{_describe(node)} in class "
                                              f"`{cname}`", "a statement of a class body, not "
                                              "an exercise: the course's class body is graded"))
    # added top-level definitions and imports: appended at the end of the module
    p_names = _top_names(p_tree)
    p_dumps = {ast.dump(n) for n in p_tree.body}
    tail: list[str] = []
    import builtins

    available = set(p_names) | set(dir(builtins)) | {"__name__", "__file__", "__doc__"}
    available |= {n.name for n in s_tree.body if isinstance(n, (*FUNCS, ast.ClassDef))}
    for node in s_tree.body:
        bound_here = {node.name} if isinstance(node, (*FUNCS, ast.ClassDef)) else \
            {(a.asname or a.name).split(".")[0] for a in node.names} \
            if isinstance(node, (ast.Import, ast.ImportFrom)) else set(_constant_names(node))
        shadowed = sorted((bound_here & BUILTIN_NAMES) - p_names)
        if shadowed:
            merged.dropped.append(Dropped(path, node.lineno, _describe(node),
                                          f"shadows the builtin {', '.join(shadowed)}, which the "
                                          "course's code in this module uses: dropped"))
            continue
        if isinstance(node, (*FUNCS, ast.ClassDef)):
            if node.name in p_names or skipped(node.name, node):
                continue  # a course definition: handled above
            tail.append("\n\n")
            tail += _indent(_segment(s_lines, node, with_decorators=True), "")
            merged.added.append(node.name)
            merged.taken.append((node.name, node, module_ids))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if ast.dump(node) in p_dumps:
                continue
            bound = {(a.asname or a.name).split(".")[0] for a in node.names}
            if bound & p_names or (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                merged.dropped.append(Dropped(path, node.lineno, _describe(node),
                                              "rebinds a name of the course's module: dropped"))
                continue
            tail.append(ast.get_source_segment(student, node) + "\n")
            available |= bound
            merged.taken.append((f"import at line {node.lineno}", node, module_ids))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            continue  # a docstring
        elif _constant_names(node) and not (set(_constant_names(node)) & p_names) \
                and ast.dump(node) not in p_dumps:
            # a module-level constant the student added (EPS = 1e-8): taken, scanned like the
            # code that runs at import (it may only build a value), if every name it reads is
            # defined (a constant that reads a dropped import would break the whole module)
            names = _constant_names(node)
            unknown = sorted(_free_names(node.value) - available)
            if unknown:
                merged.dropped.append(Dropped(path, node.lineno, _describe(node),
                                              f"reads {', '.join(unknown)}, which is not taken "
                                              "from the submission: dropped"))
                continue
            if skipped(f"the constant {', '.join(names)}", node):
                continue
            available.update(names)
            tail.append("\n")
            tail += _indent(_segment(s_lines, node, with_decorators=False), "")
            merged.added += names
            merged.constants += names
            merged.taken.append((f"the constant {', '.join(names)}", node, module_ids))
        elif ast.dump(node) not in p_dumps:
            merged.dropped.append(Dropped(path, node.lineno, _describe(node),
                                          "module-level statement: only exercise bodies and "
                                          "added definitions are graded"))
    # apply the spans bottom-up so the earlier line numbers stay valid
    out = list(p_lines)
    if out and not out[-1].endswith("\n"):
        out[-1] += "\n"
    for start, end, new in sorted(spans, key=lambda s: (s[0], s[1]), reverse=True):
        out[start - 1:end] = new
    body = "".join(out)
    if tail:
        body += "\n# ==== added by the student (definitions only) ====\n" + "".join(tail)
    merged.source = body
    merged.student_lines = _student_ranges(body, merged)
    return merged


def _student_ranges(source: str, merged: Merged) -> list[tuple[int, int]]:
    """Line ranges in the merged text of the student's units and added definitions."""
    tree = ast.parse(source)
    wanted = set(merged.units) | set(merged.added)
    ranges = [(u.node.lineno, u.node.end_lineno) for q, u in units(tree).items() if q in wanted]
    ranges += [(n.lineno, n.end_lineno) for n in tree.body
               if isinstance(n, ast.ClassDef) and n.name in wanted]
    consts = set(merged.constants)
    ranges += [(n.lineno, n.end_lineno) for n in tree.body if set(_constant_names(n)) & consts]
    ranges += [(s.lineno, s.end_lineno) for n in tree.body if isinstance(n, ast.ClassDef)
               for s in n.body if {f"{n.name}.{x}" for x in _constant_names(s)} & consts]
    # decorators run at import: their lines are the student's too
    for q, u in units(tree).items():
        if q in wanted and u.node.decorator_list:
            ranges.append((min(d.lineno for d in u.node.decorator_list), u.node.lineno))
    return sorted(ranges)
