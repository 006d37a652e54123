"""Write the table of points of every lab notebook from the graders' own marks.

An exercise is worth what its graded tests give: the sum of ``points=`` of the
``@pytest.mark.exercise("N.E", points=P)`` marks, a parametrized test counting once per case.
This script reads that registry the way the grader does — pytest's own collection of ``tests/``,
each item's mark read by ``labkit.score_table._exercise_of`` — so what a lab announces is what
``labkit.check`` and ``labkit-grade`` will count, including exercises added later.

Each lab ``labs/0N_*.ipynb`` holds one table, in one Markdown cell, between the two marker lines
``BEGIN`` and ``END`` below (HTML comments: invisible in Jupyter, Colab and the book). The
generated block is the same for every lab:

* a table: exercise, what you write (the functions and methods whose stub raises
  ``NotImplementedError("exercise N.E…")``, read from ``src/labkit/labN/``), points (points that
  only a CUDA machine can earn — a ``skipif`` with reason "needs CUDA" — are given apart), and
  the lab's total;
* a collapsed list of every graded test: its points, its name and the first sentence of its
  docstring (what it checks).

Usage:
    python tools/point_tables.py            # rewrite the block in every lab notebook
    python tools/point_tables.py --check    # exit 1 and list the labs whose block differs
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"
STUBS = ROOT / "src" / "labkit"
BEGIN = "<!-- points table: written by tools/point_tables.py from the graders' marks; do not edit -->"
END = "<!-- end of the points table -->"


@dataclass
class GradedTest:
    """One graded test function (its parametrized cases together)."""
    exercise: str
    file: str  # tests/test_labN_x.py
    name: str  # the function's name, without the parameters
    points: list[int] = field(default_factory=list)  # one entry per collected case
    cuda_only: bool = False
    checks: str = ""  # the first sentence of its docstring


def exercise_order(ex_id: str) -> tuple[int, ...]:
    return tuple(int(part) for part in ex_id.split("."))


class _Registry:
    """A pytest plugin that records every graded item, as the grade plugin reads its mark."""

    def __init__(self):
        self.tests: dict[tuple[str, str, str], GradedTest] = {}
        self.escaped: list[str] = []  # names pytest escaped (non-ASCII parameter ids)

    def pytest_collection_finish(self, session):
        from labkit.score_table import _exercise_of

        for item in session.items:
            ex = _exercise_of(item)
            if ex is None:
                continue
            file = item.nodeid.split("::")[0]
            if re.search(r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})", item.name):
                self.escaped.append(item.nodeid)
            name = getattr(item, "originalname", None) or item.name.split("[")[0]
            key = (ex[0], file, name)
            test = self.tests.get(key)
            if test is None:
                function = getattr(item, "function", None)
                cuda = any("needs CUDA" in str(m.kwargs.get("reason", ""))
                           for m in item.iter_markers("skipif"))
                test = self.tests[key] = GradedTest(ex[0], file, name, cuda_only=cuda,
                                                    checks=first_sentence(function))
            test.points.append(ex[1])


def collect(root: Path = ROOT, escaped: list[str] | None = None) -> list[GradedTest]:
    """Every graded test of ``root/tests``, in collection order (pytest's own collection).
    ``escaped``, if given, receives the node ids whose parameter ids pytest escaped: a
    non-ASCII id (``·``, ``Ψ``) reaches ``labkit.check``'s report as ``\\xb7``, ``\\u03a8``."""
    import pytest

    registry = _Registry()
    out = io.StringIO()
    args = ["--collect-only", "-q", "-m", "exercise", "-p", "no:cacheprovider",
            "--rootdir", str(root), str(root / "tests")]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pytest.main(args, plugins=[registry])
    if code not in (0, 5) or not registry.tests:
        raise RuntimeError(f"collecting the graded tests failed (pytest exit {code}):\n"
                           f"{out.getvalue()[-3000:]}")
    if escaped is not None:
        escaped.extend(registry.escaped)
    return list(registry.tests.values())


def first_sentence(function) -> str:
    """The first sentence of a test's docstring, as one Markdown line."""
    doc = " ".join((getattr(function, "__doc__", None) or "").split("\n\n")[0].split())
    # a sentence ends at . ! or ? before a capital (not after "e.g." and the like), or at the end
    found = re.search(r"^(.+?(?<!\be\.g)(?<!\bi\.e)(?<!\bcf)(?<!\bvs)[.!?])(?:\s+[A-Z(`]|$)", doc)
    sentence = (found.group(1) if found else doc).rstrip(":;").rstrip()
    sentence = sentence.replace("``", "`")
    return sentence if sentence.endswith((".", "!", "?")) else sentence + "."


def exercise_functions(lab: str, stubs: Path = STUBS) -> dict[str, list[tuple[str, str]]]:
    """{exercise id: [(module file, qualified function name)]}: the stubs that raise
    ``NotImplementedError("exercise N.E…")`` in ``src/labkit/labN/``, in file order."""
    found: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for path in sorted((stubs / f"lab{lab}").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))

        def visit(node, prefix=""):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for ex_id in _raised_exercises(child):
                        entry = (path.name, prefix + child.name)
                        if entry not in found[ex_id]:
                            found[ex_id].append(entry)

        visit(tree)
    return dict(found)


def _raised_exercises(function: ast.AST) -> list[str]:
    ids = []
    for node in ast.walk(function):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                and getattr(node.exc.func, "id", None) == "NotImplementedError" and node.exc.args:
            first = node.exc.args[0]
            text = first.value if isinstance(first, ast.Constant) else ""
            if isinstance(first, ast.JoinedStr):
                text = "".join(v.value for v in first.values if isinstance(v, ast.Constant))
            found = re.match(r"exercise (\d+\.\d+)", str(text))
            if found:
                ids.append(found.group(1))
    return ids


def _points(values: list[int]) -> str:
    """2 for one case; "1 × 4" for four cases of 1; "1 + 2" for cases that differ."""
    if len(values) == 1:
        return str(values[0])
    if len(set(values)) == 1:
        return f"{values[0]} × {len(values)}"
    return " + ".join(str(v) for v in values)


def _worth(cpu: int, cuda: int) -> str:
    return f"{cpu} + {cuda} on CUDA" if cuda and cpu else (f"{cuda} on CUDA" if cuda else str(cpu))


def table(lab: str, tests: list[GradedTest], stubs: Path = STUBS) -> str:
    """The generated block (without the marker lines) for lab ``lab``."""
    mine = sorted((t for t in tests if t.exercise.split(".")[0] == lab),
                  key=lambda t: exercise_order(t.exercise))  # stable: collection order within
    if not mine:
        raise ValueError(f"lab {lab} has no graded tests")
    writes = exercise_functions(lab, stubs)
    by_exercise: dict[str, list[GradedTest]] = defaultdict(list)
    for t in mine:
        by_exercise[t.exercise].append(t)
    rows = [f"| exercise | you write, in `src/labkit/lab{lab}/` | points |", "|---|---|---|"]
    total_cpu = total_cuda = 0
    for ex_id, ex_tests in by_exercise.items():
        cpu = sum(sum(t.points) for t in ex_tests if not t.cuda_only)
        cuda = sum(sum(t.points) for t in ex_tests if t.cuda_only)
        total_cpu, total_cuda = total_cpu + cpu, total_cuda + cuda
        files = defaultdict(list)
        for module, name in writes.get(ex_id, []):
            files[module].append(f"`{name}`")
        what = "; ".join(f"{', '.join(names)} in `{module}`" for module, names in files.items())
        rows.append(f"| {ex_id} | {what or '(no stub found)'} | {_worth(cpu, cuda)} |")
    rows.append(f"| **lab {lab}** | | **{_worth(total_cpu, total_cuda)}** |")
    n_tests = sum(len(t.points) for t in mine)
    lines = ["\n".join(rows), "",
             f"<details><summary>What each of the {n_tests} graded tests checks (points · test · "
             "the first sentence of its docstring)</summary>", ""]
    for ex_id, ex_tests in by_exercise.items():
        files = ", ".join(f"`{f}`" for f in dict.fromkeys(t.file for t in ex_tests))
        lines.append(f"**{ex_id}** ({files})")
        lines.append("")
        for t in ex_tests:
            cuda = " (needs CUDA)" if t.cuda_only else ""
            lines.append(f"- {_points(t.points)} · `{t.name}`{cuda} — {t.checks}")
        lines.append("")
    lines.append("</details>")
    return "\n".join(lines)


def notebook_lab(path: Path) -> str:
    found = re.match(r"0*(\d+)_", path.name)
    if not found:
        raise ValueError(f"{path.name}: a lab notebook is named NN_name.ipynb")
    return found.group(1)


def replace_block(text: str, block: str, where: str) -> str:
    """``text`` with what lies between the markers replaced by ``block``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{where}: needs exactly one {BEGIN!r} line and one {END!r} line after it")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def update(path: Path, tests: list[GradedTest], write: bool) -> bool:
    """Whether the notebook's block was out of date (and, with ``write``, rewritten). Only the
    cell's source changes: every other byte of the file stays as it was."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    cells = [c for c in raw["cells"] if c["cell_type"] == "markdown" and BEGIN in "".join(c["source"])]
    if len(cells) != 1:
        raise ValueError(f"{path.name}: {len(cells)} Markdown cells hold the points "
                         f"table marker (one must: put {BEGIN!r} and {END!r} where the table goes)")
    cell = cells[0]
    old = "".join(cell["source"])
    new = replace_block(old, table(notebook_lab(path), tests), path.name)
    if new == old:
        return False
    if write:
        cell["source"] = new.splitlines(keepends=True)
        path.write_text(json.dumps(raw, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return True


def labs(root: Path = ROOT) -> list[Path]:
    return sorted((root / "labs").glob("[0-9]*.ipynb"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a lab's table differs from the graders'")
    args = parser.parse_args(argv)
    escaped: list[str] = []
    tests = collect(escaped=escaped)
    graded_labs = sorted({t.exercise.split(".")[0] for t in tests}, key=int)
    paths = {notebook_lab(p): p for p in labs()}
    problems = [f"lab {lab} has graded tests but no labs/0{lab}_*.ipynb" for lab in graded_labs
                if lab not in paths]
    problems += [f"{nodeid}: a parameter id pytest escapes (labkit.check shows it so): give the "
                 f"parametrize ASCII ids" for nodeid in escaped]
    stale = []
    for lab, path in paths.items():
        if lab not in graded_labs:
            continue
        try:
            if update(path, tests, write=not args.check):
                stale.append(path.relative_to(ROOT).as_posix())
        except ValueError as error:
            problems.append(str(error))
    for problem in problems:
        print(problem)
    if args.check:
        for name in stale:
            print(f"{name}: the points table differs from the graders' marks")
        if stale:
            print("run: python tools/point_tables.py")
        return 1 if stale or problems else 0
    for name in stale:
        print(f"rewrote the points table of {name}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
