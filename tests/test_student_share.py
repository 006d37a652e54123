"""tools/student_share.py counts what the student writes against what they open, on a tiny course
whose counts are known by hand, and on this course agrees with the stub generator."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools import student_share  # noqa: E402

SOLUTION = '''"""A module."""
X = 1


def f():
    # BEGIN SOLUTION 9.1: write f
    a = 1

    return a
    # END SOLUTION


def g():
    # BEGIN SOLUTION 9.2: write g
    return 2
    # END SOLUTION
'''
STUB = '''"""A module."""
X = 1


def f():
    raise NotImplementedError("exercise 9.1: write f (labs/09_x.ipynb)")


def g():
    raise NotImplementedError("exercise 9.2: write g (labs/09_x.ipynb)")
'''


def test_a_tiny_course_is_counted_as_by_hand(tmp_path):
    """Two blocks holding 3 + 1 lines (a blank line inside a block counts), a stub of 10 lines."""
    for folder, text in (("solutions", SOLUTION), ("src", STUB)):
        (tmp_path / folder / "labkit" / "lab9").mkdir(parents=True)
        (tmp_path / folder / "labkit" / "lab9" / "demo.py").write_text(text)
    [row] = student_share.shares(tmp_path)
    assert (row.lab, row.module, row.blocks, row.exercise_lines, row.stub_lines) == ("lab9", "demo", 2, 4, 10)
    assert row.share == pytest.approx(0.4)
    assert "| lab9 | demo | 2 | 4 | 10 | 40% |" in student_share.table([row])


def test_every_block_of_the_course_is_one_raise_line_of_its_stub():
    """The stub is the solution with each block (markers included) replaced by one line: so
    stub lines = solution lines - exercise lines - blocks, module by module."""
    for row in student_share.shares(ROOT):
        rel = Path("labkit") / row.lab / f"{row.module}.py"
        solution_lines = len((ROOT / "solutions" / rel).read_text().splitlines())
        assert row.stub_lines == solution_lines - row.exercise_lines - row.blocks, rel


def test_a_root_without_solutions_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        student_share.main(["--root", str(tmp_path)])
    assert "no solutions/labkit/ there" in capsys.readouterr().err
