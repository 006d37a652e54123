"""Take a student's exercise code out of a submission and put it into a pristine course.

An **exercise unit** is a function or method that is a stub in the pristine course: its body
raises ``NotImplementedError("exercise N.E: ...")`` (at any depth). From a submission the grader
takes only the student's version of every exercise unit (signature and body; the decorators stay
the course's) and the definitions added beside them: top-level functions, classes, imports and
constants, and methods and constants of a class that holds an exercise method. What rebinds a
name of the course's (by its name or a ``:=``) or shadows a builtin is dropped, and so is a
constant that reads a name not taken, or text that does not parse back to the code read.
Everything else comes from the pristine course; what was left behind is listed
(:class:`Dropped`). Units are replaced in place (the course's line numbers above them hold),
added code goes after its class or at the module's end, and :class:`Merged` records the line
ranges of the student's code, so the child process can tell student frames from the course's.
"""
from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass, field

STUB = re.compile(r"^exercise (\d+\.\d+)\b")
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
DEFS = (*FUNCS, ast.ClassDef)
BUILTIN_NAMES = set(vars(builtins))


@dataclass
class Unit:
    """One function or method of a module and the stub ids it holds (none for given code)."""
    node: ast.AST
    exercises: tuple[str, ...]


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
    # (label, the student's node, its exercises) of every unit and added definition taken: what
    # labkit.grade.flags reads (an added definition carries the module's exercises)
    taken: list[tuple[str, ast.AST, tuple[str, ...]]] = field(default_factory=list)
    constants: list[str] = field(default_factory=list)                   # added constants


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


def units(tree: ast.Module) -> dict[str, Unit]:
    """Every function and method (classes walked recursively), by qualified name
    ("flash_attention_forward", "FlashAttention.forward")."""
    found: dict[str, Unit] = {}

    def walk(body, prefix):
        for node in body:
            if isinstance(node, FUNCS):
                found[prefix + node.name] = Unit(node, stub_ids(node))
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


def bound_names(node: ast.AST) -> set[str]:
    """The names a statement binds: a definition's, an import's, an assignment's targets."""
    if isinstance(node, DEFS):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def scope(nodes) -> list[ast.AST]:
    """The nodes that run in the scope of ``nodes`` (a module's or a function's body, one
    statement): not those of the bodies of the functions, lambdas and classes among them, which
    have scopes of their own (their decorators, defaults, annotations and bases run here, and a
    comprehension's ``:=`` binds here), nor those of an ``if`` the reading proved ``dead``."""
    out, todo = [], list(nodes)
    while todo:
        out.append(node := todo.pop())
        inner = [node.body] if isinstance(node, ast.Lambda) else \
            node.body if isinstance(node, DEFS) or getattr(node, "dead", False) else []
        todo += [c for c in ast.iter_child_nodes(node) if all(c is not b for b in inner)]
    return out


def source_lines(text: str) -> list[str]:
    """``text``'s lines as its AST numbers them, each ending in ``\\n``: cut at ``\\n``, ``\\r\\n``
    and ``\\r`` only (``str.splitlines`` also cuts at ``\\x0c``, ``\\x1c``, ``\\u2028``..., which
    Python reads within a line: the text cut by line numbers would shift by one per)."""
    return [line + "\n" for line in re.sub(r"\r\n?", "\n", text).removesuffix("\n").split("\n")]


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
    elts = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
    if not all(isinstance(e, ast.Name) for e in elts) or any(e.id.startswith("__") for e in elts):
        return []
    return [e.id for e in elts]


def _cut(lines: list[str], node, indent: str = "", decorators: bool = True) -> list[str] | None:
    """The student's lines of ``node`` (from its first decorator, if ``decorators``) moved from
    its own indentation to ``indent``; None where they do not parse back to ``node``, the code the
    reading reads (another statement on one of its lines: ``X = 1; import os``)."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])
                                 if decorators])
    own = re.match(r"[ \t]*", lines[first - 1]).group(0)
    strings = {i for n in ast.walk(node) if isinstance(n, (ast.Constant, ast.JoinedStr))
               for i in range(n.lineno + 1, n.end_lineno + 1)}  # lines that go on a string: kept
    text = [indent + line[len(own):] if line.startswith(own) and i not in strings else line
            for i, line in enumerate(lines[first - 1:node.end_lineno], first)]
    want = node if decorators else type(node)(**{**vars(node), "decorator_list": []})
    try:
        placed = ast.parse("if 1:\n" * bool(indent) + "".join(text)).body
    except SyntaxError:
        return None
    return text if [ast.dump(n) for n in (placed[0].body if indent else placed)] == \
        [ast.dump(want)] else None


def _describe(node: ast.AST) -> str:
    text = ast.unparse(node).splitlines()[0] if not isinstance(node, DEFS) \
        else f"{'class' if isinstance(node, ast.ClassDef) else 'def'} {node.name}"
    return f"`{text[:70]}`"


def merge(pristine: str, student: str | None, path: str, skip: frozenset = frozenset(),
          missing: str = "missing from the submission") -> Merged:
    """The pristine module with the student's exercise units and added definitions in it, but
    those whose label (their entry in :attr:`Merged.taken`) is in ``skip``: red flags zeroed them.
    ``student`` None: the file was not read, for the reason ``missing``."""
    p_tree = ast.parse(pristine)
    p_lines = source_lines(pristine)
    p_units = units(p_tree)
    p_names = set().union(*map(bound_names, p_tree.body))
    p_spaces = {"": p_names, **{n.name: set().union(*map(bound_names, n.body))  # the course's
                                for n in p_tree.body if isinstance(n, ast.ClassDef)}}  # names
    merged, line = Merged(path=path, source=pristine), 0
    try:
        s_tree = None if student is None else ast.parse(student)
    except SyntaxError as exc:
        s_tree, line, missing = None, exc.lineno or 0, f"does not parse ({exc.msg})"
    if s_tree is None:
        merged.dropped.append(Dropped(path, line, "the file",
                                      f"{missing}: every exercise in it is graded as the stub"))
        return merged
    s_lines = source_lines(student)
    s_units = units(s_tree)
    module_ids = exercise_ids(pristine)
    spans: list[tuple[int, int, list[str]]] = []  # pristine lines (first, last) -> new lines
    tail: list[str] = []                           # added top-level code, after the module

    def drop(node, what: str, why: str) -> None:
        merged.dropped.append(Dropped(path, getattr(node, "lineno", 0), what, why))

    def take(label: str, node: ast.AST, exercises=module_ids) -> bool:
        """Whether ``node`` is taken (not zeroed by its flags); if so, it is in ``taken``."""
        if label in skip:
            drop(node, f"`{label}`", "red flags that zero an exercise (see the flags): not taken")
            return False
        merged.taken.append((label, node, exercises))
        return True

    def indent_of(line: int) -> str:
        return re.match(r"[ \t]*", p_lines[line - 1]).group(0)

    def placed(node, indent: str, space: str = "", unit: str = "", **cut) -> list[str] | None:
        """The lines that put the student's ``node`` at ``indent``; None, said in ``dropped``,
        where, when it runs, it binds a name the course's module (or its class ``space``) defines,
        by its own name (not a unit's) or by a ``:=`` in a part that runs there (a default, a
        decorator, a constant's value, not a body), or a builtin's at the top (which the course's
        code there uses), or where its lines do not parse back to the node read."""
        binds = bound_names(node) - ({node.name} if unit else set()) | {
            n.target.id for n in scope([node]) if isinstance(n, ast.NamedExpr)}
        rebound = sorted(binds & p_spaces.get(space, set()))
        shadowed = [] if space else sorted(binds & BUILTIN_NAMES - p_names)
        lines = _cut(s_lines, node, indent, **cut)
        why = f"rebinds the course's {', '.join(rebound)}" if rebound else f"shadows the " \
            f"builtin {', '.join(shadowed)}, which the course's code in this module uses" if \
            shadowed else "its lines do not parse back to the code read" if lines is None else ""
        if why:
            drop(node, unit or _describe(node),
                 why + (": graded as the stub" if unit else ": dropped"))
        return None if why else lines

    for name, unit in p_units.items():
        s_node = s_units[name].node if name in s_units else None
        if not unit.exercises:
            if s_node is not None and ast.dump(s_node) != ast.dump(unit.node):
                drop(s_node, f"given `{name}`", "differs from the course's; the course's is graded")
        elif s_node is None:
            drop(None, f"exercise {', '.join(unit.exercises)} `{name}`",
                 "not found in the file: graded as the stub")
        elif (lines := placed(s_node, indent_of(unit.node.lineno), name.rpartition(".")[0],
                              f"exercise {', '.join(unit.exercises)} `{name}`",
                              decorators=False)) and take(name, s_node, unit.exercises):
            p_node = unit.node
            if [ast.dump(d) for d in s_node.decorator_list] != \
                    [ast.dump(d) for d in p_node.decorator_list]:
                drop(s_node, f"the decorators of `{name}`",
                     "differ from the course's; the course's are kept")
            spans.append((p_node.lineno, p_node.end_lineno, lines))
            merged.units[name] = unit.exercises
    # added methods and constants of a class that holds an exercise method: at the class's end
    p_classes, s_classes = ({n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
                            for tree in (p_tree, s_tree))
    for cname, p_cls in p_classes.items():
        s_cls = s_classes.get(cname)
        if s_cls is None:
            continue
        has_ex = any(u.exercises for q, u in p_units.items() if q.startswith(cname + "."))
        p_members = {n.name for n in p_cls.body if isinstance(n, DEFS)}
        p_dumps = {ast.dump(n) for n in p_cls.body}

        def into_class(node, label: str, p_cls=p_cls) -> bool:
            lines = placed(node, indent_of(p_cls.body[0].lineno), p_cls.name)
            if lines is None or not take(label, node):
                return False
            spans.append((p_cls.end_lineno + 1, p_cls.end_lineno, ["\n", *lines]))
            return True
        for node in s_cls.body:  # in the student's order: a constant may read an earlier one
            names = _constant_names(node)
            if isinstance(node, FUNCS) and node.name not in p_members:
                if not has_ex:
                    drop(node, f"method `{cname}.{node.name}`",
                         "added to a class with no exercise: not graded")
                elif into_class(node, f"{cname}.{node.name}"):
                    merged.added.append(f"{cname}.{node.name}")
            elif names and has_ex and ast.dump(node) not in p_dumps:
                if into_class(node, f"{cname}.{', '.join(names)} (a class constant)"):
                    merged.added.append(f"{cname}.{'.'.join(names)}")
                    merged.constants += [f"{cname}.{n}" for n in names]
            elif not isinstance(node, (*DEFS, ast.Expr)) and ast.dump(node) not in p_dumps:
                drop(node, f"{_describe(node)} in class `{cname}`", "a statement of a class body, "
                     "not an exercise: the course's class body is graded")
    # added top-level definitions, imports and constants: appended at the end of the module
    p_dumps = {ast.dump(n) for n in p_tree.body}
    available = p_names | BUILTIN_NAMES | {"__file__"} | \
        {n.name for n in s_tree.body if isinstance(n, DEFS)}
    last = {n.name: n for n in s_tree.body if isinstance(n, DEFS)}  # the one Python keeps
    for node in s_tree.body:
        is_import, names = isinstance(node, (ast.Import, ast.ImportFrom)), _constant_names(node)
        if ast.dump(node) in p_dumps or isinstance(node, ast.Expr) and isinstance(
                node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # the course's own, a docstring
        if isinstance(node, DEFS) and last[node.name] is not node:
            drop(node, _describe(node), "defined again further down (that one is taken): dropped")
        elif isinstance(node, DEFS) and node.name in p_names:
            continue  # a course definition (a given function that differs is listed above)
        elif not (isinstance(node, DEFS) or is_import or names) or \
                getattr(node, "module", None) == "__future__":
            drop(node, _describe(node), "module-level statement: only exercise bodies and "
                 "added definitions are graded")
        elif (lines := placed(node, "")) is None:
            continue
        elif names and (unknown := sorted(_free_names(node.value) - available)):
            # a module-level constant the student added (EPS = 1e-8) is taken, scanned like the
            # code that runs at import (it may only build a value), if every name it reads is
            # defined (a constant that reads a dropped import would break the whole module)
            drop(node, _describe(node), f"reads {', '.join(unknown)}, which is not taken "
                 "from the submission: dropped")
        elif is_import:  # never zeroed: flags are read where its names are used
            tail += lines
            available |= bound_names(node)
            merged.taken.append((f"import at line {node.lineno}", node, module_ids))
        elif take(f"the constant {', '.join(names)}" if names else node.name, node):
            tail += ["\n" if names else "\n\n", *lines]
            available |= set(names)
            merged.added += names or [node.name]
            merged.constants += names
    # apply the spans bottom-up so the earlier line numbers stay valid; those inserted at one
    # place (a class's end) last first, so that they stand in the order they were taken
    out = list(p_lines)  # (each ends in a newline)
    for _, (start, end, new) in sorted(enumerate(spans), key=lambda s: (*s[1][:2], s[0]),
                                       reverse=True):
        out[start - 1:end] = new
    body = "".join(out)
    if tail:
        body += "\n# ==== added by the student (definitions only) ====\n" + "".join(tail)
    merged.source = body
    merged.student_lines = _student_ranges(body, merged)
    return merged


def _student_ranges(source: str, merged: Merged) -> list[tuple[int, int]]:
    """Line ranges in the merged text of the student's units and added definitions (a function's
    decorators too: its code object starts at the first)."""
    tree = ast.parse(source)
    wanted, consts = set(merged.units) | set(merged.added), set(merged.constants)
    ranges = []
    for q, u in units(tree).items():
        if q in wanted:
            ranges.append((u.node.lineno, u.node.end_lineno))
            if u.node.decorator_list:
                ranges.append((min(d.lineno for d in u.node.decorator_list), u.node.lineno))
    for n in tree.body:
        if (isinstance(n, ast.ClassDef) and n.name in wanted) or set(_constant_names(n)) & consts:
            ranges.append((n.lineno, n.end_lineno))
        ranges += [(s.lineno, s.end_lineno) for s in getattr(n, "body", [])
                   if isinstance(n, ast.ClassDef) and
                   {f"{n.name}.{x}" for x in _constant_names(s)} & consts]
    return sorted(ranges)
