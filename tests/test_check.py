"""labkit.check as a student meets it, and the warm Python that makes a check cheap to start.

* the report: each test's own message, TODO for a stub, SKIP / N/A for what this machine cannot
  grade (neither counts against the exercise), the traceback with verbose=True — on a tiny course
  laid out like this one (tests/test_lab9_*.py, the grader's plugin), through the real warm Python;
* what happens before any test can run: a wrong id, a lab whose code does not import, tests that
  never finish;
* the warm Python (labkit.self_check.warm) against the plain command it stands for,
  ``python -m MODULE ARGS`` in a subprocess: the same exit status, output, working directory,
  arguments and environment; the code on disk now, never a stale copy; nothing left running
  after a timeout.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import labkit
from _process_helpers import assert_all_gone
from labkit import self_check
from labkit.self_check import warm

SRC = Path(labkit.__file__).resolve().parent


@pytest.fixture(scope="module", autouse=True)
def _stop_the_server():
    yield
    warm.stop()  # leave no process behind


# ---------------------------------------------------------------- the report, on a tiny course

COURSE = '''
import pytest

def unwritten():
    raise NotImplementedError("exercise 9.1: write it (labs/09_x.ipynb)")

@pytest.mark.exercise("9.1", points=2)
def test_reaches_the_stub():
    unwritten()

@pytest.mark.exercise("9.2", points=1)
def test_passes():
    assert sum([1, 2]) == 3

@pytest.mark.exercise("9.2", points=1)
def test_fails_with_its_own_words():
    got, want = [4368], [3276]
    assert got == want, f"rank 0 keeps {got[0]:,} B of state, expected K*S = {want[0]:,}: a view?"

@pytest.mark.exercise("9.3", points=1)
@pytest.mark.skipif(True, reason="needs CUDA")
def test_on_a_gpu():
    pass

@pytest.mark.exercise("9.3", points=1)
def test_against_a_library_not_installed():
    from labkit.score_table import optional_reference
    optional_reference("no_such_module_for_labkit_tests")
'''


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A course root with tests/test_lab9_demo.py, graded with labkit's plugin; lab 9 known."""
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-p labkit.score_table"\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_lab9_demo.py").write_text(COURSE)
    monkeypatch.setattr(self_check, "repository_root", lambda: tmp_path)
    monkeypatch.setattr(self_check, "known_labs", lambda: [9])
    return tmp_path


@pytest.mark.parametrize("exercise, ok, shown", [
    ("9.1", False, ["exercise 9.1: 0/2 points", "TODO  test_reaches_the_stub  (not attempted"]),
    ("9.2", False, ["exercise 9.2: 1/2 points", "PASS  test_passes", "FAIL  test_fails_with_its_own_words",
                    "rank 0 keeps 4,368 B of state, expected K*S = 3,276: a view?"]),
    ("9.3", True, ["exercise 9.3: 0/0 points", "SKIP  test_on_a_gpu", "N/A   test_against_a_library_not_installed",
                   "no_such_module_for_labkit_tests"]),  # what this machine cannot grade does not count
])
def test_the_report_shows_each_test_in_its_own_words(course, capsys, exercise, ok, shown):
    assert labkit.check(exercise) is ok
    out = capsys.readouterr().out
    for words in shown:
        assert words in out, out
    assert "Use -v" not in out and "assert [4368] ==" not in out  # pytest's introspection stays out


def test_verbose_adds_the_traceback(course, capsys):
    assert labkit.check("9.2", verbose=True) is False
    out = capsys.readouterr().out
    assert "--- details ---" in out and "assert [4368] == [3276]" in out


# ---------------------------------------------------------------- before any test runs

@pytest.mark.parametrize("given, words", [
    (1.2, r"a str \(with quotes: labkit.check\('1.2'\)\), got 1.2 \(float\)"),
    (None, r"an exercise id such as '1.2', a str"),
    ("lab1", r"an exercise id such as '1.2' \(lab 1, exercise 2\), got 'lab1'"),
    ("1.2.3", r"an exercise id such as '1.2' \(lab 1, exercise 2\)"),
    ("", r"an exercise id such as '1.2' \(lab 1, exercise 2\)"),
    ("9.1", r"there is no lab 9; the known exercises are those of labs 1, 2, 3, 4, 5, 6, 7"),
    ("0.1", r"there is no lab 0"),
])
def test_a_wrong_exercise_id_says_what_to_pass_without_running_anything(monkeypatch, given, words):
    """A float, a lab name and a lab that does not exist are refused at once ("9.9" once ran every
    test file of the course before saying it has no tests)."""
    monkeypatch.setattr(self_check, "run_graders", lambda *a, **k: pytest.fail("the graders ran"))
    with pytest.raises(ValueError, match=words):
        labkit.check(given)


def test_an_id_with_spaces_or_leading_zeros_is_the_same_id(monkeypatch):
    seen = []
    monkeypatch.setattr(self_check, "run_graders", lambda ex, **k: seen.append(ex) or {})
    monkeypatch.setattr(self_check, "report", lambda ex, table, verbose=False: True)
    assert labkit.check(" 1.02 ") and seen == ["1.2"]


def test_a_lab_that_does_not_import_is_reported_with_its_file_line_and_what_to_do(monkeypatch, capsys):
    """A syntax error in the student's file is the report, not "exercise '1.1' has no graded
    tests; known exercises: " (pytest collected nothing)."""
    def nothing_collected(ex, **kwargs):
        raise ValueError(f"exercise={ex!r} has no graded tests; known exercises: ")

    monkeypatch.setattr(self_check, "run_graders", nothing_collected)
    monkeypatch.setattr(self_check, "modules_that_fail_to_import",
                        lambda lab: {"labkit.lab1.accounting": 'File "accounting.py", line 128\nSyntaxError: invalid syntax'})
    assert labkit.check("1.1") is False
    out = capsys.readouterr().out
    assert "exercise 1.1: not graded: the lab's code does not import" in out
    assert "labkit.lab1.accounting" in out and "line 128" in out and "SyntaxError" in out
    assert "Fix the line shown, save the file, and run labkit.check('1.1') again" in out


def test_the_import_probe_names_each_broken_module_and_its_line(tmp_path):
    """The probe (a fresh process importing each module of the lab, as the grader does) finds a
    syntax error and a misspelt import, with file and line, and passes a good module."""
    fake = tmp_path / "src" / "labkit"
    shutil.copytree(SRC, fake, ignore=lambda folder, names: [n for n in names if n.startswith("lab")
                                                              or n == "__pycache__"])
    (fake / "lab9").mkdir()
    (fake / "lab9" / "__init__.py").write_text("")
    (fake / "lab9" / "good.py").write_text("X = 1\n")
    (fake / "lab9" / "typo.py").write_text("x = 1\ny = (x x)\n")
    (fake / "lab9" / "misspelt.py").write_text("import os\nfrom os import pathh\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LABKIT_")}
    env["PYTHONPATH"] = str(tmp_path / "src")
    out = warm.run_module("labkit.self_check.import_probe", ["9"], cwd=tmp_path, env=env, timeout=120)
    broken = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(broken) == ["labkit.lab9.misspelt", "labkit.lab9.typo"], out.stdout[-2000:]
    assert "line 2" in broken["labkit.lab9.typo"] and "SyntaxError" in broken["labkit.lab9.typo"]
    assert "line 2" in broken["labkit.lab9.misspelt"]
    assert "ImportError: cannot import name 'pathh'" in broken["labkit.lab9.misspelt"]


def test_tests_that_never_finish_are_a_message_not_a_timeout_traceback(monkeypatch, capsys):
    """An exercise whose code loops forever (the check's 900 s limit) is reported as that."""
    def too_long(ex, **kwargs):
        raise subprocess.TimeoutExpired(["pytest"], self_check.TIMEOUT)

    monkeypatch.setattr(self_check, "run_graders", too_long)
    assert labkit.check("2.1") is False
    assert "exercise 2.1: not graded: its tests had not finished after 900 s" in capsys.readouterr().out


def test_the_graders_are_the_labs_files_with_the_grader_and_timeout_plugins_by_name():
    """The command a check runs: only the lab's grader files, only that exercise; the plugins
    named (pyproject's addopts adds the grader's), none loaded just because it is installed."""
    root = self_check.repository_root()
    args = self_check.grader_arguments("5.2", root, Path("/tmp/g.json"))
    files = [a for a in args if a.startswith("tests/")]
    assert files == sorted(p.relative_to(root).as_posix() for p in root.glob("tests/test_lab5_*.py"))
    assert args[len(files):len(files) + 4] == ["--exercise", "5.2", "--grade", "--grade-json"]
    assert args[-3:] == ["--disable-plugin-autoload", "-p", "pytest_timeout"]


# ---------------------------------------------------------------- the warm Python

PROGRAM = '''
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "var": os.environ.get("LABKIT_TEST_VAR"),
                  "version": VERSION, "path0": sys.path[0],
                  "labkit": sorted(m for m in sys.modules if m.split(".")[0] == "labkit")}))
sys.stderr.write("to stderr\\n")
sys.exit(int(sys.argv[1]))
'''


def _program(folder: Path, version: int) -> None:
    (folder / "probe_program.py").write_text(PROGRAM.replace("VERSION", str(version)))


def _plain(folder: Path, args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "probe_program", *args], cwd=folder, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)


def test_a_warm_run_is_the_command_line_run_and_sees_the_code_saved_since(tmp_path):
    """Against ``python -m probe_program 3 x`` in a subprocess: the same exit status, printed
    lines, arguments, directory, environment and sys.path[0]; an edit of the program between two
    runs is seen by the second (the server imported none of it, and no labkit module)."""
    _program(tmp_path, 1)
    env = {**os.environ, "LABKIT_TEST_VAR": "seen"}
    first = warm.run_module("probe_program", ["3", "x"], cwd=tmp_path, env=env, timeout=120)
    plain = _plain(tmp_path, ["3", "x"], env)
    assert (first.returncode, first.stdout) == (plain.returncode, plain.stdout) == (3, first.stdout)
    printed = json.loads(first.stdout.splitlines()[0])
    assert printed == {"argv": ["3", "x"], "cwd": str(tmp_path), "var": "seen", "version": 1,
                       "path0": str(tmp_path), "labkit": []}
    assert "to stderr" in first.stdout
    if warm.can_fork():
        assert first.cpu_seconds is not None, "not run by the warm server"
    _program(tmp_path, 2)
    second = warm.run_module("probe_program", ["0"], cwd=tmp_path, env=env, timeout=120)
    assert second.returncode == 0 and json.loads(second.stdout.splitlines()[0])["version"] == 2


def test_without_fork_the_run_is_a_plain_subprocess_with_the_same_result(tmp_path, monkeypatch):
    _program(tmp_path, 1)
    monkeypatch.setattr(warm, "can_fork", lambda: False)
    run = warm.run_module("probe_program", ["4"], cwd=tmp_path, env=dict(os.environ), timeout=120)
    plain = _plain(tmp_path, ["4"], dict(os.environ))
    assert (run.returncode, run.stdout) == (plain.returncode, plain.stdout)


SLEEPER = '''
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open("pids.txt", "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
'''


@pytest.mark.skipif(not warm.can_fork(), reason="the warm server forks: POSIX only, not macOS")
def test_a_run_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    """A program that starts a child and sleeps: TimeoutExpired at the deadline, then neither
    process is running, and the server serves the next run."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run_module("sleeper", [], cwd=tmp_path, env=dict(os.environ), timeout=3)
    assert time.monotonic() - started < 60
    assert_all_gone([int(p) for p in (tmp_path / "pids.txt").read_text().split()], within=10)
    _program(tmp_path, 1)
    assert warm.run_module("probe_program", ["0"], cwd=tmp_path, env=dict(os.environ), timeout=120).returncode == 0


BURN = '''
import time
end = time.process_time() + 0.5
while time.process_time() < end:
    pass
'''


@pytest.mark.skipif(not warm.can_fork(), reason="the warm server forks: POSIX only, not macOS")
def test_a_warm_run_s_cpu_counts_in_the_caller_s_children_once_the_server_stops(tmp_path):
    """make test and the notebook runner time a lab by its process's children: a check's CPU,
    spent in a grandchild reaped by the server, must reach them when the server is waited for
    (at stop(), and at exit)."""
    import resource

    (tmp_path / "burn.py").write_text(BURN)
    warm.stop()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = warm.run_module("burn", [], cwd=tmp_path, env=dict(os.environ), timeout=120)
    warm.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    counted = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert run.returncode == 0 and run.cpu_seconds >= 0.5
    assert counted >= run.cpu_seconds, f"children counted {counted:.2f} s, the run alone took {run.cpu_seconds:.2f} s"
