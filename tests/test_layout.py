"""The package's layout is a rule, not a habit: who may import whom, and how an exercise module
marks the student's part and the course's.

* A toolkit module (``src/labkit/*.py``, ``labkit.reference``) never imports a lab package; the
  declared harnesses (``labkit.harness``, ``cluster``, ``cross_check``, ``widgets``) may.
* A lab package imports only the toolkit and itself; lab 7, the capstone, may import earlier labs.
* Every reference a grader compares against (``labkit.reference``) imports no lab package even
  indirectly, checked in a fresh interpreter: no edit of a student's file can move a reference.
* One marker style in every exercise module (tools/CONVENTIONS.md).
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
HARNESSES = {"cluster", "cross_check", "widgets"}
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
    return rel.parts[0] == "harness" or (len(rel.parts) == 1 and path.stem in HARNESSES)


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
        if name.startswith("labkit.harness") or name in ("labkit.cluster", "labkit.cross_check"):
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
