"""Every notebook of the course executes, top to bottom, in a fresh kernel (make test's notebook check).

Run it by name (it is not collected with the rest of tests/, which the solutions' run covers):

    LABKIT_SOLUTIONS=$PWD/solutions .venv/bin/python -m pytest tests/notebooks/check_notebooks.py

All notebooks (the book's chapters and labs as _toc.yml lists them, and tests/notebooks/*.ipynb)
run once, two at a time (``NOTEBOOK_WORKERS``), through tools/execute_notebooks.py, the same
execution that myst-nb's ``cache`` mode performs; each success is stored in the book's
jupyter-cache, so the book build that follows executes nothing. One test per notebook: it fails
with the failing cell's source and traceback (nbval's check, with one execution instead of two).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # tools.execute_notebooks, by name: its spawned workers import it
    sys.path.insert(0, str(ROOT))
execute_notebooks = importlib.import_module("tools.execute_notebooks")

NOTEBOOKS = execute_notebooks.notebooks()


@pytest.fixture(scope="session")
def executed(request):
    workers = int(os.environ.get("NOTEBOOK_WORKERS", "2"))
    results = execute_notebooks.execute_all(NOTEBOOKS, workers=workers)
    return {r["path"]: r for r in results}



@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.relative_to(ROOT).as_posix() for p in NOTEBOOKS])
def test_notebook_executes(path, executed, record_property):
    record = executed[str(path)]
    record_property("wall_s", round(record["wall"], 1))
    record_property("cpu_s", round(record["cpu"], 1))
    print(f"{path.relative_to(ROOT).as_posix()}: {record['wall']:.1f} s wall, {record['cpu']:.1f} s CPU")
    if not record["ok"]:
        pytest.fail(f"{path.relative_to(ROOT).as_posix()} stopped at a cell error:\n{record['error']}",
                    pytrace=False)


def test_zz_report(executed, capsys):
    """Print the table of wall and CPU seconds per notebook (shown with -s or -rA)."""
    table = execute_notebooks.report(list(executed.values()))
    with capsys.disabled():
        print("\n" + table)
