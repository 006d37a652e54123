"""``labkit-grade``: extraction, scan, formats, and the Gradescope autograder in its layout."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from _grade_helpers import ROOT, module, replace_body, student_edition
from labkit.grade import extract, formats, runner, scan, shortcuts

PRISTINE = '''"""A module."""
import math

import torch


def given(x):
    return x + 1


def exercise(x):
    """Doc."""
    raise NotImplementedError("exercise 9.1: do it (labs/09_x.ipynb)")


class Thing:
    def given_method(self):
        return 1

    def method(self, y):
        z = given(y)
        raise NotImplementedError("exercise 9.2: do it (labs/09_x.ipynb)")
'''
STUDENT = '''"""A module."""
import math
import itertools

import torch

LIMIT = 3  # a module-level constant: taken
torch.manual_seed(LIMIT)  # a module-level statement: dropped


def given(x):
    return x + 2  # an edit of given code


def exercise(x):
    """Doc."""
    return helper(x) * 2 + Thing.OFFSET


def helper(x):
    return x - LIMIT + 3


class Thing:
    def given_method(self):
        return 1

    OFFSET = 0  # a class constant the student added: taken

    def method(self, y):
        return self.extra(y)

    def extra(self, y):
        return y + 1


class Added:
    pass
'''


def test_extraction_takes_exercise_bodies_and_added_definitions_only():
    """Exercise units, added definitions and added constants (module-level and in an exercise's
    class) come from the student; the given function, the module-level statement and the edit
    are dropped and listed; line ranges mark the student's."""
    merged = extract.merge(PRISTINE, STUDENT, "labkit/lab9/m.py")
    assert extract.exercise_ids(PRISTINE) == ("9.1", "9.2")
    assert set(merged.units) == {"exercise", "Thing.method"}
    assert set(merged.added) == {"helper", "Thing.extra", "Added", "LIMIT", "Thing.OFFSET"}
    ns: dict = {}
    exec(compile(merged.source, "m.py", "exec"), ns)
    assert ns["given"](1) == 2 and ns["exercise"](3) == 6 and ns["Thing"]().method(1) == 2
    assert ns["LIMIT"] == 3 and ns["Thing"].OFFSET == 0 and "itertools" in ns
    dropped = "\n".join(map(str, merged.dropped))
    assert "torch.manual_seed(LIMIT)" in dropped and "module-level statement" in dropped
    assert "LIMIT = 3" not in dropped and "OFFSET" not in dropped
    assert "given `given`" in dropped
    lines = merged.source.splitlines()
    for lo, hi in merged.student_lines:
        assert "raise NotImplementedError" not in "\n".join(lines[lo - 1:hi])
    assert any("def exercise" in lines[lo - 1] for lo, hi in merged.student_lines)
    assert any(lines[lo - 1].startswith("LIMIT = 3") for lo, hi in merged.student_lines)
    assert scan.scan(merged, PRISTINE) == []


def test_a_missing_or_broken_file_is_graded_as_the_stub():
    assert extract.merge(PRISTINE, None, "m.py").source == PRISTINE
    broken = extract.merge(PRISTINE, "def (:", "m.py")
    assert broken.source == PRISTINE and "does not parse" in str(broken.dropped[0])


def test_every_reference_solution_passes_the_scan_and_merges_to_itself():
    """The scan refuses nothing a solution does, and merging a solution into the pristine stubs
    leaves no stub and drops nothing (the registry does not block what a solution uses)."""
    modules = runner.exercise_modules(ROOT)
    assert len(modules) >= 30
    for rel in modules:
        pristine = (ROOT / "src" / rel).read_text()
        solution = (ROOT / "solutions" / rel).read_text()
        merged = extract.merge(pristine, solution, rel)
        assert scan.scan(merged, pristine) == [], (rel, [str(r) for r in scan.scan(merged, pristine)])
        assert merged.dropped == [] and extract.exercise_ids(merged.source) == (), rel


@pytest.mark.parametrize("body, needle", [
    ("sys._getframe(1).f_back", "sys._getframe"),
    ("x = (lambda: 0).__code__", ".__code__"),
    ("object.__subclasses__()", ".__subclasses__"),
    ("eval('1')", "`eval`"),
    ("torch.nn.functional.gelu = print", "assignment to `torch.nn.functional.gelu`"),
    ("setattr(torch, 'x', 1)", "setattr(torch, ...)"),
    ("getattr(os, name)", "<computed name>"),
    ("global given", "global given"),
    ("import importlib", "import importlib"),
    ("m = torch.testing\nm.assert_close = print", "assignment to `m.assert_close`"),
    ("given.cache = 1", "assignment to `given.cache`"),
])
def test_the_scan_refuses_tampering_with_a_reason(body, needle):
    pristine = "import os\nimport sys\nimport torch\n\ndef given():\n    pass\n\n" \
        "def f(name):\n    raise NotImplementedError('exercise 9.1: x')\n"
    student = pristine.replace("    raise NotImplementedError('exercise 9.1: x')",
                               "\n".join("    " + line for line in body.splitlines()))
    found = scan.scan(extract.merge(pristine, student, "m.py"), pristine)
    assert found and any(needle in r.what for r in found), [str(r) for r in found]
    assert all(r.exercises == ("9.1",) and r.why for r in found)


def test_every_exercise_of_the_registry_exists_and_names_functions_this_torch_has():
    """Each registry entry is a real exercise, and at least one of its names resolves here (so
    the run-time guard wraps something); the table lists every entry."""
    from labkit.grade.guard import _resolve

    known = {e for ids in runner.exercise_modules(ROOT).values() for e in ids}
    for ex, entry in shortcuts.REBUILDS.items():
        assert ex in known and entry["why"] and entry["names"], ex
        if ex in ("2.2", "2.3"):  # bitsandbytes is optional; 2.3 also lists torch's Adam
            continue
        assert any(_resolve(n) is not None for n in entry["names"]), ex
    assert _resolve("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu") is not None
    assert "| 5.6 |" in shortcuts.table()


def test_find_labkit_in_an_edition_its_src_labkit_and_a_zip(tmp_path):
    sub = student_edition(tmp_path / "edition")
    assert runner.find_labkit(sub) == sub / "src" / "labkit"
    assert runner.find_labkit(sub / "src" / "labkit") == sub / "src" / "labkit"
    archive = tmp_path / "hand-in.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for p in (sub / "src" / "labkit").rglob("*.py"):
            z.write(p, "wrapper/labkit/" + p.relative_to(sub / "src" / "labkit").as_posix())
        z.writestr("../evil.py", "x = 1")
    root = runner.unpack(archive, tmp_path / "unpacked")
    assert runner.find_labkit(root) == tmp_path / "unpacked" / "wrapper" / "labkit"
    assert not (tmp_path / "evil.py").exists()


TABLE = {
    "exercises": {"1.1": {"earned": 2, "possible": 3, "cuda_points": 1, "ungraded_points": 0,
                          "passed": 1, "failed": 1, "not attempted": 0, "needs CUDA": 1,
                          "not graded": 0, "tests": [
                              {"test": "a", "points": 2, "outcome": "passed", "message": ""},
                              {"test": "b", "points": 1, "outcome": "failed", "message": "off by one"},
                              {"test": "c", "points": 1, "outcome": "needs CUDA", "message": ""}]},
                  "1.2": {"earned": 0, "possible": 1, "cuda_points": 0, "ungraded_points": 0,
                          "passed": 0, "failed": 0, "not attempted": 1, "needs CUDA": 0,
                          "not graded": 0, "tests": [
                              {"test": "d", "points": 1, "outcome": "not attempted",
                               "message": "NotImplementedError: exercise 1.2"}]}},
    "labs": {"1": {"earned": 2, "possible": 4, "cuda_points": 1, "ungraded_points": 0}},
    "earned": 2, "possible": 3, "cuda_points": 1, "ungraded_points": 0,
    "submission": {"path": "s", "labkit": ".", "dropped": ["m.py:3: `x = 1`: dropped"],
                   "refused": {"1.1": ["m.py:9: `eval` — no"]}},
}


def test_gradescope_results_and_the_class_csv(tmp_path):
    res = formats.results_json(TABLE)
    assert res["score"] == 2 and res["max_score"] == 3
    by_name = {t["name"]: t for t in res["tests"]}
    assert by_name["1.1 a"] == {**by_name["1.1 a"], "score": 2, "max_score": 2, "visibility": "visible"}
    assert by_name["1.1 b"]["score"] == 0 and "off by one" in by_name["1.1 b"]["output"]
    assert by_name["1.1 c"]["max_score"] == 0 and "needs CUDA" in by_name["1.1 c"]["output"]
    assert "refused" in res["output"] and "dropped" in res["output"]
    assert "not attempted (graded as the stub): 1.2" in res["output"]
    assert "not attempted (graded as the stub): 1.2" in formats.report(TABLE)
    assert formats.not_attempted(TABLE) == ["1.2"]
    formats.write_csv(formats.csv_rows("ada", TABLE), tmp_path / "class.csv")
    rows = (tmp_path / "class.csv").read_text().splitlines()
    assert rows[0].startswith("student,exercise,earned,possible") and rows[1].startswith("ada,1.1,2,3")


def _gradescope(tmp_path, zip_path, submission):
    """/autograder laid out as Gradescope lays it out, under tmp_path."""
    root = tmp_path / "autograder"
    (root / "source").mkdir(parents=True)
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(root / "source")
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    os.chmod(root / "run_autograder", 0o755)
    shutil.copytree(submission, root / "submission")
    (root / "results").mkdir()
    return root


@pytest.mark.timeout(900)
def test_the_autograder_zip_gives_full_marks_to_a_solution_and_zero_to_the_stubs(tmp_path):
    """The zip of `make autograder`, unpacked as Gradescope does; its run_autograder on a
    submission with 1.1 solved writes results.json with full marks for 1.1, on the stubs zero
    (LABKIT_GRADE_EXERCISES=1.1 keeps the test short)."""
    sys.path.insert(0, str(ROOT / "tools" / "autograder"))
    import build

    zip_path = tmp_path / "autograder.zip"
    names = build.build(zip_path)
    assert {"setup.sh", "run_autograder", "src/labkit/grade/cli.py"} <= set(names)
    assert not any(n.startswith("solutions/") for n in names)
    solved = student_edition(tmp_path / "solved")
    replace_body(module(solved, "lab1/accounting.py"), "count_params",
                 (ROOT / "tests" / "cheats" / "count_params_body.txt").read_text())
    stubs = student_edition(tmp_path / "stubs")
    scores = {}
    for name, sub in (("solved", solved), ("stubs", stubs)):
        root = _gradescope(tmp_path / f"gradescope-{name}", zip_path, sub)
        env = {**os.environ, "AUTOGRADER_ROOT": str(root), "LABKIT_PYTHON": sys.executable,
               "LABKIT_GRADE_EXERCISES": "1.1", "LABKIT_GRADE_JOBS": "1"}
        env.pop("LABKIT_SOLUTIONS", None)
        proc = subprocess.run([str(root / "run_autograder")], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        scores[name] = json.loads((root / "results" / "results.json").read_text())
    assert scores["solved"]["score"] == scores["solved"]["max_score"] == 5
    assert scores["stubs"]["score"] == 0 and scores["stubs"]["max_score"] == 5
    assert all(t["score"] == 0 and "not attempted" in t["output"] for t in scores["stubs"]["tests"])


def test_the_student_edition_ships_a_readme_for_students(tmp_path):
    """The edition's README says where to write code (the lab folders), how to check and score
    it, the book and Colab, and says nothing of solutions/, make stubs or make test."""
    sys.path.insert(0, str(ROOT / "tools"))
    import student_edition

    copied = student_edition.write_student_edition(tmp_path / "edition")
    readme = (tmp_path / "edition" / "README.md").read_text()
    assert "README.md" in copied and not any(p.startswith("solutions/") for p in copied)
    for words in ("src/labkit/lab1/", "src/labkit/lab7/", 'labkit.check("1.2")', "make grade",
                  "make book", "colab.research.google.com"):
        assert words in readme, words
    for words in ("solutions/", "make stubs", "make test", "LABKIT_SOLUTIONS"):
        assert words not in readme, words


@pytest.mark.timeout(600)
def test_the_command_grades_a_class_into_one_csv(tmp_path):
    """`labkit-grade subs/* --out DIR --csv class.csv`: a folder and a zip, one row per student
    per exercise, each student's grades.json/results.json in DIR/<student>/. (1.1 is refused by
    the scan in both, so no test process needs to run.)"""
    subs = tmp_path / "subs"
    ada = student_edition(subs / "ada")
    replace_body(module(ada, "lab1/accounting.py"), "count_params", "return eval('0')")
    bob = student_edition(tmp_path / "bob")
    replace_body(module(bob, "lab1/accounting.py"), "count_params", "return eval('1')")
    with zipfile.ZipFile(subs / "bob.zip", "w") as z:
        for p in (bob / "src").rglob("*.py"):
            z.write(p, p.relative_to(bob).as_posix())
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_SOLUTIONS"}
    proc = subprocess.run([sys.executable, "-m", "labkit.grade", str(subs / "ada"), str(subs / "bob.zip"),
                           "--out", str(tmp_path / "out"), "--csv", str(tmp_path / "class.csv"),
                           "--exercise", "1.1"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = (tmp_path / "class.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[1].startswith("ada,1.1,0,5") and rows[2].startswith("bob,1.1,0,5")
    assert "`eval`" in rows[1]
    for name in ("ada", "bob"):
        res = json.loads((tmp_path / "out" / name / "results.json").read_text())
        assert res["score"] == 0 and "refused" in res["output"]


def test_links_huge_and_non_utf8_files_of_a_submission_are_not_read(tmp_path):
    """A folder submission whose module is a link to the instructor's solution (or whose
    src/labkit is one) grades nothing from it; a huge file or one that is not UTF-8 is graded as
    the stub, and the report says why; a zip keeps only its Python files, within a size cap."""
    solution = ROOT / "solutions" / "labkit" / "lab1" / "accounting.py"
    sub = tmp_path / "sub" / "src" / "labkit"
    (sub / "lab1").mkdir(parents=True)
    (sub / "lab1" / "accounting.py").symlink_to(solution)
    (sub / "lab2").mkdir()
    (sub / "lab2" / "adafactor.py").write_bytes(b"x = '\xff\xfe'\n")
    (sub / "lab2" / "offload.py").write_text("#" * (runner.MAX_FILE_BYTES + 10))
    (sub / "lab3").mkdir()
    (sub / "lab3" / "loss_scaler.py").write_text("# nothing\n")
    assert runner.find_labkit(tmp_path / "sub") == sub
    text, why = runner.read_submitted(sub / "lab1" / "accounting.py", sub)
    assert text is None and "link" in why
    assert "not UTF-8" in runner.read_submitted(sub / "lab2" / "adafactor.py", sub)[1]
    assert "larger than" in runner.read_submitted(sub / "lab2" / "offload.py", sub)[1]
    assert runner.read_submitted(sub / "lab3" / "loss_scaler.py", sub) == ("# nothing\n", "")
    linked = tmp_path / "linked"
    (linked / "src").mkdir(parents=True)
    (linked / "src" / "labkit").symlink_to(ROOT / "solutions" / "labkit")
    with pytest.raises(FileNotFoundError):
        runner.find_labkit(linked)
    zpath = tmp_path / "sub.zip"
    with zipfile.ZipFile(zpath, "w") as z:
        z.writestr("src/labkit/lab1/accounting.py", "x = 1\n")
        z.writestr("src/labkit/lab1/big.py", "#" * (runner.MAX_FILE_BYTES + 1))
        z.writestr("src/labkit/lab1/data.bin", b"\0" * 100)
    out = runner.unpack(zpath, tmp_path / "unz")
    assert (out / "src/labkit/lab1/accounting.py").exists()
    assert not (out / "src/labkit/lab1/big.py").exists() and not (out / "src/labkit/lab1/data.bin").exists()


def test_an_outcome_that_takes_points_out_of_the_total_is_believed_only_where_it_can_happen():
    """A child (or a student's code raising a skip) that reports "needs CUDA" for a test that
    runs here, or "not graded" for a test whose optional reference this machine has, would take
    the test's points out of ``possible``: the parent fails it. A collected file that asks for
    an optional reference this machine lacks keeps "not graded"."""
    test = {"exercise": "1.1", "points": 2, "test": "t", "cuda_only_here": False,
            "may_be_ungraded": False}
    for outcome in ("needs CUDA", "not graded"):
        out = runner._decide(test, {"outcome": outcome, "message": "Skipped"}, "", None)
        assert out["outcome"] == "failed" and "this machine" in out["message"], out
    out = runner._decide({**test, "may_be_ungraded": True}, {"outcome": "not graded"}, "", None)
    assert out["outcome"] == "not graded"
    from labkit.grade.collect import _optional_missing

    fake = ROOT / "tests" / "test_lab1_accounting.py"
    assert _optional_missing(fake) is (importlib.util.find_spec("bitsandbytes") is None)


def test_the_childs_torch_caches_stay_in_its_writable_folder(tmp_path, monkeypatch):
    """Importing torch._dynamo puts TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor_$USER in
    os.environ; a child inheriting it created that folder outside its one writable folder, and
    the guard failed every test of 1.1 on a machine where it did not exist yet (CI)."""
    from labkit.grade.runner import _base_env

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_someone")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/triton_someone")
    env = _base_env(tmp_path / "ws", tmp_path / "tmp")
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TMPDIR", "HOME"):
        assert env[name].startswith(str(tmp_path / "tmp")), (name, env[name])
