"""labkit.check as a student meets it: a wrong id, and a lab whose code does not import.

(An untouched stub and a wrong answer are graded by every lab's tests; here, what happens before
any test can run.) Fast: no grader is started; the import probe runs in a tiny fake labkit.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import labkit

SRC = Path(labkit.__file__).resolve().parent


@pytest.mark.parametrize("given, error, words", [
    (1.2, ValueError, r"a str \(with quotes: labkit.check\('1.2'\)\), got 1.2 \(float\)"),
    ("lab1", ValueError, r"an exercise id such as '1.2' \(lab 1, exercise 2\), got 'lab1'"),
    ("9.1", ValueError, r"there is no lab 9; the known exercises are those of labs 1, 2, 3, 4, 5, 6, 7"),
    ("0.1", ValueError, r"there is no lab 0"),
])
def test_a_wrong_exercise_id_says_what_to_pass_without_running_anything(given, error, words):
    """Check a float, a lab name and a lab that does not exist are refused at once ("9.9" ran
    every test file of the course before saying it has no tests)."""
    with pytest.raises(error, match=words):
        labkit.check(given)


def test_an_id_with_spaces_or_leading_zeros_is_the_same_id(monkeypatch):
    seen = []
    monkeypatch.setattr("labkit.grade.plugin.check", lambda ex, verbose=False: seen.append(ex) or True)
    assert labkit.check(" 1.02 ") and seen == ["1.2"]


def test_a_lab_that_does_not_import_is_reported_with_its_file_line_and_what_to_do(monkeypatch, capsys):
    """Check a syntax error in the student's file is the report, not "exercise '1.1' has no
    graded tests; known exercises: " (pytest collected nothing)."""
    def nothing_collected(ex, verbose=False):
        raise ValueError(f"exercise={ex!r} has no graded tests; known exercises: ")

    monkeypatch.setattr("labkit.grade.plugin.check", nothing_collected)
    monkeypatch.setattr(labkit, "_modules_that_fail_to_import",
                        lambda lab: {"labkit.lab1.accounting": 'File "accounting.py", line 128\nSyntaxError: invalid syntax'})
    assert labkit.check("1.1") is False
    out = capsys.readouterr().out
    assert "exercise 1.1: not graded: the lab's code does not import" in out
    assert "labkit.lab1.accounting" in out and "line 128" in out and "SyntaxError" in out
    assert "Fix the line shown, save the file, and run labkit.check('1.1') again" in out


def test_the_import_probe_names_each_broken_module_and_its_line(tmp_path):
    """Check the probe (a fresh process importing each module of the lab, as the grader does)
    finds a syntax error and a misspelt import, with file and line, and passes a good module."""
    fake = tmp_path / "src" / "labkit"
    (fake / "lab9").mkdir(parents=True)
    shutil.copy(SRC / "__init__.py", fake / "__init__.py")
    (fake / "lab9" / "__init__.py").write_text("")
    (fake / "lab9" / "good.py").write_text("X = 1\n")
    (fake / "lab9" / "typo.py").write_text("x = 1\ny = (x x)\n")
    (fake / "lab9" / "misspelt.py").write_text("import os\nfrom os import pathh\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LABKIT_")}
    env["PYTHONPATH"] = str(tmp_path / "src")
    code = "import json, labkit; print(json.dumps(labkit._modules_that_fail_to_import('9')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    broken = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(broken) == ["labkit.lab9.misspelt", "labkit.lab9.typo"], out.stderr[-2000:]
    assert "line 2" in broken["labkit.lab9.typo"] and "SyntaxError" in broken["labkit.lab9.typo"]
    assert "line 2" in broken["labkit.lab9.misspelt"] and "ImportError: cannot import name 'pathh'" in broken["labkit.lab9.misspelt"]


def test_tests_that_never_finish_are_a_message_not_a_timeout_traceback(monkeypatch, capsys):
    """Check an exercise whose code loops forever (the grader's 900 s limit) is reported as that."""
    import subprocess

    def too_long(ex, verbose=False):
        raise subprocess.TimeoutExpired(["pytest"], 900)

    monkeypatch.setattr("labkit.grade.plugin.check", too_long)
    assert labkit.check("2.1") is False
    assert "exercise 2.1: not graded: its tests had not finished after 900 s" in capsys.readouterr().out
