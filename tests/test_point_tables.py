"""The labs' tables of points equal the graders' registry (tools/point_tables.py; issue 37).

The points of an exercise are the sum of the ``points=`` of its graded tests' marks, as the grade
plugin reads them from pytest's collection; every lab notebook shows them in one generated block.
These tests are infrastructure, not graded.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("point_tables", ROOT / "tools" / "point_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


TOOL = _tool()


def test_every_lab_table_equals_the_graders_registry(capsys):
    """Check, with a fresh collection of tests/ (pytest's own, marks read by the grade plugin), that
    every lab notebook's block is what the registry gives today: per exercise the sum of its tests'
    points, CUDA-only points apart, the lab's total, every graded test listed. A lab or an
    exercise added later is covered without touching this test. A parameter id that pytest
    escapes (``10\\xb7sbh``: labkit.check shows the test's name so) fails it too.

    ``tools/point_tables.py --check`` runs here, in this process: its pytest session collects
    tests/ afresh (new items, marks read again), reusing the test modules this run has imported
    already instead of importing torch and every module again in a new interpreter (11.5 CPU-s
    there, about 2 here)."""
    code = TOOL.main(["--check"])
    out = capsys.readouterr()
    assert code == 0, (
        "a lab's table of points differs from the graders' marks (run python tools/point_tables.py):\n"
        + out.out[-3000:] + out.err[-3000:])


def _stub_lab(tmp_path: Path) -> Path:
    stubs = tmp_path / "labkit"
    (stubs / "lab9").mkdir(parents=True)
    (stubs / "lab9" / "thing.py").write_text(
        "class Block:\n"
        "    def forward(self, x):\n"
        "        raise NotImplementedError(\"exercise 9.2: run the block (labs/09_x.ipynb)\")\n\n"
        "def plan(n):\n"
        "    raise NotImplementedError(f\"exercise 9.1: plan {n} (labs/09_x.ipynb)\")\n")
    return stubs


def test_a_new_exercise_gets_its_row_its_points_and_its_tests(tmp_path):
    """Check the table of a lab the tool has never seen: rows in exercise order with the stubs'
    functions, points summed over parametrized cases, CUDA-only points apart, the total."""
    T = TOOL.GradedTest
    tests = [T("9.2", "tests/test_lab9_thing.py", "test_block_runs", [2]),
             T("9.1", "tests/test_lab9_thing.py", "test_plan_is_right", [1, 1, 1], checks="Check it."),
             T("9.2", "tests/test_lab9_thing.py", "test_block_on_gpu", [4], cuda_only=True),
             T("1.1", "tests/test_lab1_x.py", "test_other_lab", [5])]
    text = TOOL.table("9", tests, stubs=_stub_lab(tmp_path))
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| 9.1 | `plan` in `thing.py` | 3 |",
                        "| 9.2 | `Block.forward` in `thing.py` | 2 + 4 on CUDA |",
                        "| **lab 9** | | **5 + 4 on CUDA** |"], rows
    assert "- 1 × 3 · `test_plan_is_right` — Check it." in text
    assert "- 4 · `test_block_on_gpu` (needs CUDA)" in text
    assert "test_other_lab" not in text


def test_a_notebook_without_exactly_one_marked_table_is_refused(tmp_path):
    """A lab whose table markers are missing (or doubled) is an error naming the markers, not a
    lab silently left with a hand-written table."""
    path = tmp_path / "labs" / "09_x.ipynb"
    path.parent.mkdir()
    cell = {"cell_type": "markdown", "metadata": {}, "source": ["# Lab 9\n", "| 9.1 | 3 |\n"]}
    path.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    tests = [TOOL.GradedTest("9.1", "tests/test_lab9_thing.py", "test_plan", [3])]
    with pytest.raises(ValueError, match="points table marker"):
        TOOL.update(path, tests, write=False)


def test_first_sentence_keeps_abbreviations_and_colons():
    """The listed sentence ends at a full stop before a capital, not at "e.g." or a colon."""
    def f():
        """Check X (e.g. Adam): a bound. More details."""
    assert TOOL.first_sentence(f) == "Check X (e.g. Adam): a bound."
