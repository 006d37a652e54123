"""``labkit.check("1.2")``: run one exercise's graded tests from a notebook and print a short report.

The graders run as the command line would run them, ``python -m pytest tests/test_lab1_*.py
--exercise 1.2 --grade ...`` in the repository, in a fresh process: the code you just saved is
what gets graded, and a check reports exactly what ``pytest --exercise 1.2 --grade`` (the
score table's plugin, :mod:`labkit.score_table`) decides — the same tests, the same outcomes. The
process is forked from a warm Python that imported torch and pytest once (:mod:`.warm`), so a
check costs its tests, not a second of start-up each time.

The report: one line per test (PASS, FAIL with the test's own message, TODO for a stub not yet
written, SKIP for a test that needs CUDA on a CPU machine, N/A when an optional reference library
is missing); ``verbose=True`` adds each failure's traceback. Before any test runs, a malformed id
is refused with what to pass; when no test could run because the lab's code does not import, the
report names the file, the line and the error (:mod:`.import_probe`); tests still running after
``TIMEOUT`` seconds are stopped and reported as such.

A check is a self-check: it imports this tree's code, which can change anything in it. A grade an
instructor records comes from ``labkit-grade`` (:mod:`labkit.grade`).
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from labkit.self_check import warm

TIMEOUT = 900
"""Seconds an exercise's tests may run before the check stops them (a loop that never ends)."""

MARKS = {"passed": "PASS", "failed": "FAIL", "not attempted": "TODO", "needs CUDA": "SKIP",
         "not graded": "N/A "}


def repository_root() -> Path:
    """The course repository that holds this labkit (src/labkit/self_check → the root)."""
    return Path(__file__).resolve().parents[3]


def known_labs() -> list[int]:
    """The numbers of the labs this labkit has (its ``labN/`` folders)."""
    here = Path(__file__).resolve().parents[1]
    return sorted(int(p.name[3:]) for p in here.glob("lab[0-9]*") if p.name[3:].isdigit())


def exercise_id(exercise) -> str:
    """``exercise`` as an id "N.E" of a lab that exists ("1.2" from " 1.02 "); else a ValueError
    saying what to pass (a float such as 1.2 is refused: 1.10 and 1.1 would be the same number)."""
    if not isinstance(exercise, str):
        raise ValueError(f"exercise must be an exercise id such as '1.2', a str (with quotes: "
                         f"labkit.check('1.2')), got {exercise!r} ({type(exercise).__name__})")
    lab, _, number = exercise.strip().partition(".")
    if not (lab.isdigit() and number.isdigit()):
        raise ValueError(f"exercise must be an exercise id such as '1.2' (lab 1, exercise 2), "
                         f"got {exercise!r}")
    labs = known_labs()
    if int(lab) not in labs:
        raise ValueError(f"exercise={exercise!r}: there is no lab {int(lab)}; the known exercises are "
                         f"those of labs {', '.join(map(str, labs))} (an id is 'lab.exercise', e.g. "
                         f"'{labs[0]}.1')")
    return f"{int(lab)}.{int(number)}"


def grader_arguments(exercise: str, root: Path, grade_json: Path) -> list[str]:
    """pytest's arguments for one exercise: the lab's grader files (``tests/test_lab1_*.py`` for
    "1.2"; all of ``tests`` if it has none), only that exercise's tests, the score table written
    to ``grade_json``. Plugins come by name (the grader's from pyproject.toml's addopts, the
    timeout), not from every installed package: nbval's Jupyter imports are not a grader's.

    With ``LABKIT_CHECK_FIRST_TEST=1`` (set by ``make test`` where it runs the labs, whose
    solutions part has run every graded test already) only the exercise's first test runs: the
    cell's machinery is what the notebook run checks there."""
    lab = exercise.split(".")[0]
    files = sorted(p.relative_to(root).as_posix() for p in (root / "tests").glob(f"test_lab{lab}_*.py"))
    first = ["--first-test-only"] if os.environ.get("LABKIT_CHECK_FIRST_TEST") == "1" else []
    return [*(files or ["tests"]), "--exercise", exercise, *first, "--grade", "--grade-json",
            str(grade_json), "-q", "--no-header", "-p", "no:cacheprovider", "--tb=no", *_plugins()]


def _plugins() -> list[str]:
    from importlib import metadata

    try:
        version = tuple(int(p) for p in metadata.version("pytest").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return []
    return ["--disable-plugin-autoload", "-p", "pytest_timeout"] if version >= (8, 4) else []


def run_graders(exercise: str, *, timeout: float = TIMEOUT) -> dict:
    """The grader's score table (``pytest --grade``'s JSON) of one exercise's tests, run in a
    fresh process. RuntimeError if pytest wrote none (it could not start or collect); ValueError
    if the exercise has no graded tests."""
    root = repository_root()
    if not (root / "tests").is_dir():
        raise FileNotFoundError(f"no tests/ folder next to labkit at {root}")
    with tempfile.TemporaryDirectory(prefix="labkit-check-") as tmp:
        table_path = Path(tmp) / "grade.json"
        proc = warm.run_module("pytest", grader_arguments(exercise, root, table_path), cwd=root,
                               env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, timeout=timeout)
        if not table_path.exists():
            raise RuntimeError(f"the grader did not run:\n{proc.stdout[-6000:]}")
        table = json.loads(table_path.read_text())
    if exercise not in table["exercises"]:
        known = ", ".join(table.get("known_exercises", []))
        raise ValueError(f"exercise={exercise!r} has no graded tests; known exercises: {known}")
    return table


def report(exercise: str, table: dict, *, verbose: bool = False) -> bool:
    """Print one exercise's lines of the score table; True when every test that could run here
    passed (a test that needs CUDA on a CPU machine, or whose optional reference is missing,
    does not count)."""
    e = table["exercises"][exercise]
    print(f"exercise {exercise}: {e['earned']}/{e['possible']} points")
    for t in e["tests"]:
        line = f"  {MARKS[t['outcome']]}  {t['test']}"
        if t["outcome"] == "not attempted":
            line += "  (not attempted: the stub still raises NotImplementedError)"
        elif t["outcome"] != "passed" and t["message"]:
            line += "\n        " + t["message"][:800].replace("\n", "\n        ")
        if verbose and t["outcome"] in ("failed", "not attempted") and t.get("details"):
            line += "\n        --- details ---\n        " + t["details"][-4000:].replace("\n", "\n        ")
        print(line)
    return e["passed"] == len(e["tests"]) - e["needs CUDA"] - e["not graded"]


def modules_that_fail_to_import(lab: str) -> dict[str, str]:
    """{module: its import error} for each module of ``labkit.lab<lab>`` that does not import,
    tried in a fresh process as the grader imports them ({} if the probe itself fails)."""
    try:
        proc = warm.run_module("labkit.self_check.import_probe", [lab], cwd=repository_root(),
                               env=dict(os.environ), timeout=300)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - a diagnosis that fails leaves the grader's own error
        return {}


def check(exercise: str, *, verbose: bool = False) -> bool:
    """Run the graded tests of one exercise (e.g. ``check("1.2")``) and print a short report.

    The tests run in a fresh Python process, so the code you just edited is what gets graded.
    A failed test prints its own message (what was expected, what came back, the likely cause);
    ``verbose=True`` adds the traceback and details. Returns True when every test that could run
    here passed (a test that needs CUDA on a CPU machine, or one whose optional reference
    library is missing, is reported but does not count).

    If the lab's code cannot even be imported (a syntax error, a misspelt import), no test can
    run: the report names the file, the line and the error instead, and returns False.
    """
    exercise = exercise_id(exercise)
    try:
        return report(exercise, run_graders(exercise), verbose=verbose)
    except subprocess.TimeoutExpired as exc:
        print(f"exercise {exercise}: not graded: its tests had not finished after {exc.timeout:g} s "
              "and were stopped. Look for a loop that never ends in your code (or a rank waiting for "
              "a peer that never sends); run the lab's cell for it to see where it stays.")
        return False
    except (ValueError, RuntimeError):
        broken = modules_that_fail_to_import(exercise.split(".")[0])
        if not broken:
            raise
        print(f"exercise {exercise}: not graded: the lab's code does not import, so no test could run.")
        for module, error in broken.items():
            print(f"  {module}:\n        " + error.replace("\n", "\n        "))
        print(f"  Fix the line shown, save the file, and run labkit.check({exercise!r}) again "
              "(in a notebook with %autoreload, re-run the cell that imports it too).")
        return False
