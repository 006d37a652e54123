"""The package's layout is a rule, not a habit: who may import whom, and how an exercise module
marks the student's part and the course's.

* A toolkit module (``src/labkit/*.py``, ``labkit.reference``, ``labkit.self_check``…) never
  imports a lab package; the declared harnesses (``labkit.harness``, the ``labkit.cluster``
  demos, ``cross_check``, ``widgets``) may.
* A lab package imports only the toolkit and itself; lab 7, the capstone, may import earlier labs.
* Every reference a grader compares against (``labkit.reference``) imports no lab package even
  indirectly, checked in a fresh interpreter: no edit of a student's file can move a reference.
* The import graph of labkit has no cycle, and no module imports a name from the ``__init__`` of
  a package it belongs to (an import that runs back up a level): a package's ``__init__``
  re-exports its modules' names, never the other way round.
* The package root has one job: ``import labkit`` loads the torch gate and ``check`` — not torch,
  not the toolkit; the solutions overlay and the warm Python's server import no toolkit module.
* One marker style in every exercise module (docs/conventions.md).
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "labkit"
SOLUTIONS = ROOT / "solutions" / "labkit"
HARNESSES = {"cross_check", "widgets"}  # modules at the top of labkit
HARNESS_PACKAGES = {"harness", "cluster"}  # packages of labkit whose every module is a harness
LAB = re.compile(r"^labkit\.lab(\d+)\b")


def _imports(path: Path) -> list[str]:
    """Every module name ``path`` imports, at any depth (function-level imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            if node.module == "labkit":  # from labkit import lab2
                names += [f"labkit.{a.name}" for a in node.names]
    return names


def _toolkit_modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if not p.relative_to(SRC).parts[0].startswith("lab")
                  or p.parent == SRC)


def _lab_modules() -> list[Path]:
    found = sorted(SRC.glob("lab[0-9]*/*.py"))
    if SOLUTIONS.is_dir():
        found += sorted(SOLUTIONS.glob("lab[0-9]*/*.py"))
    return found


def _is_harness(path: Path) -> bool:
    rel = path.relative_to(SRC)
    return rel.parts[0] in HARNESS_PACKAGES or (len(rel.parts) == 1 and path.stem in HARNESSES)


@pytest.mark.parametrize("path", _toolkit_modules(), ids=lambda p: p.relative_to(SRC).as_posix())
def test_toolkit_modules_import_no_lab_package(path):
    if _is_harness(path):
        pytest.skip("a declared harness: it runs the student's code")
    labs = sorted({n for n in _imports(path) if LAB.match(n)})
    assert not labs, (f"{path.relative_to(ROOT)} is the course's toolkit and imports {labs}: move "
                      "what needs the student's code to labkit/harness/, or the lab package")


@pytest.mark.parametrize("path", _lab_modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_lab_packages_import_only_the_toolkit_and_themselves(path):
    lab = int(path.parent.name[3:])
    bad = []
    for name in _imports(path):
        m = LAB.match(name)
        if m and int(m[1]) != lab and not (lab == 7 and int(m[1]) < 7):
            bad.append(name)
        if any(name == h or name.startswith(h + ".") for h in ("labkit.harness", "labkit.cluster",
                                                                 "labkit.cross_check")):
            bad.append(name)
    assert not bad, (f"{path.relative_to(ROOT)} (lab {lab}) imports {sorted(set(bad))}: a lab "
                     "package imports only the toolkit and itself (lab 7 may import earlier labs)")


def test_references_import_no_lab_package_even_indirectly():
    """Import every labkit.reference module in a fresh interpreter, solutions on and off."""
    modules = sorted(f"labkit.reference.{p.stem}" for p in (SRC / "reference").glob("*.py")
                     if p.stem != "__init__")
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.startswith('labkit.lab')))")
    for env in ({}, {"LABKIT_SOLUTIONS": str(ROOT / "solutions")}):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"), **env},
                             timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == "[]", (f"a reference pulls in lab packages {out.stdout.strip()}: "
                                            "its value would follow a student's edit")


GIVEN = "# ==== given: the course's code — read it, call it, don't change it ===="
EXERCISE = re.compile(r"^# ==== exercise (\d+\.\d+(?:, \d+\.\d+)*): your code ====$")
HEADER = re.compile(r"^\s*# ?[-=─]{4,}")
BEGIN = re.compile(r"^\s*# BEGIN SOLUTION (\d+\.\d+)")


@pytest.mark.parametrize("path", sorted(SOLUTIONS.glob("lab[0-9]*/*.py")) if SOLUTIONS.is_dir()
                         else [], ids=lambda p: p.relative_to(SOLUTIONS).as_posix())
def test_exercise_modules_use_one_marker_style(path):
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    first_def = min((n.lineno for n in tree.body
                     if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))),
                    default=len(lines) + 1)
    opened: set[str] = set()
    first_header = None
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if HEADER.match(line):
            m = EXERCISE.match(text)
            assert text == GIVEN or m, (
                f"{path.name}:{number}: section header {text!r}; use one of the two wordings "
                f"{GIVEN!r} or '# ==== exercise N.E: your code ===='")
            first_header = first_header or number
            if m:
                opened |= set(m[1].split(", "))
        b = BEGIN.match(line)
        if b:
            assert b[1] in opened, (f"{path.name}:{number}: BEGIN SOLUTION {b[1]} has no "
                                    f"'# ==== exercise {b[1]}: your code ====' header above it")
    assert first_header is not None and first_header < first_def, (
        f"{path.name}: the first definition (line {first_def}) comes before any section header")


# ---------------------------------------------------------------- the import graph

def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _resolved(name: str) -> str:
    """The labkit module that ``import name`` or ``from name import ...`` loads last."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _edges(path: Path) -> list[tuple[str, int, str | None]]:
    """(module, line, name or None) for each labkit import of ``path``, at any depth: ``from
    labkit.x import y`` is ``labkit.x.y`` when that is a module, else (``labkit.x``, ``y``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, None) for a in node.names if a.name.split(".")[0] == "labkit"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "labkit":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((sub, node.lineno, None) if sub in MODULES else (node.module, node.lineno, a.name))
    return out


def test_the_import_graph_of_labkit_has_no_cycle():
    """Every import, function-level ones too: a cycle hidden in a function is still a knot."""
    graph = {m: {_resolved(t) for t, _, _ in _edges(p)} - {m} for m, p in MODULES.items()}
    state, cycles = {}, []

    def visit(module, trail):
        state[module] = "open"
        for nxt in sorted(graph[module] & MODULES.keys()):
            if state.get(nxt) == "open":
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_back_up_from_a_package_it_belongs_to():
    """``from labkit.cluster import DEMOS`` inside ``labkit.cluster.cli`` runs the package's
    ``__init__`` while it may still be loading: import from the module that defines the name
    (``labkit.cluster.registry``); ``from labkit import <submodule>`` is fine."""
    bad = []
    for module, path in MODULES.items():
        for target, line, name in _edges(path):
            if target != module and (module + ".").startswith(target + ".") and target in MODULES:
                what = f"from {target} import {name}" if name else f"import {target}"
                bad.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not bad, "imports that run back up a level:\n  " + "\n  ".join(bad)


def _loaded_by(code: str) -> list[str]:
    """The labkit modules (and torch, if loaded) after ``code`` in a fresh interpreter."""
    probe = code + "\nimport sys; print(sorted(m for m in sys.modules if m.split('.')[0] in ('labkit', 'torch')" \
                   " and m.count('.') < 2 or m == 'torch'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_import_labkit_loads_the_torch_gate_and_check_and_nothing_else():
    assert _loaded_by("import labkit") == ["labkit", "labkit.self_check", "labkit.torch_version"]


@pytest.mark.parametrize("module", ["labkit.overlay", "labkit.self_check.warm", "labkit.self_check.server"])
def test_the_overlay_and_the_check_s_server_import_no_toolkit_module(module):
    """Every lab package imports the overlay; the warm server imports no labkit at all (its
    children must import the student's code fresh). Checked on the source: no labkit import."""
    own = {"labkit.self_check.warm": {"labkit.self_check"}}.get(module, set())
    imported = {_resolved(t) for t, _, _ in _edges(MODULES[module])} - own
    assert not imported, f"{module} imports {sorted(imported)}"
