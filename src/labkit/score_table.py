"""The score table of the graded tests: the pytest plugin of every test run.

Loaded by every run of the test suite (``addopts = "-p labkit.score_table"``). A graded test
carries ``@pytest.mark.exercise("5.1", points=2)``; the plugin

* classifies every graded test as passed, failed, **not attempted** (it reached a stub's
  ``NotImplementedError("exercise 5.1: ...")``), **needs CUDA** (skipped on a CPU machine) or
  **not graded** (:func:`optional_reference` found no reference library);
* with ``--grade`` prints a table per lab and exercise and writes it as JSON (``--grade-json``):
  ``make grade`` and ``labkit.check`` show it, and ``labkit-grade`` scores with :func:`_table`;
* with ``--exercise 5.1`` runs only that exercise's tests (what ``labkit.check`` uses);
* with ``--stubs-must-fail`` turns the run around for CI: it succeeds only when every graded
  test failed, because a grader that passes on a stub grades nothing.

It is not the submission grader (:mod:`labkit.grade`): that one runs it in its child to read
each test's outcome, and decides the score elsewhere.
"""
from __future__ import annotations

import json
import os
import traceback
from collections import defaultdict
from pathlib import Path

import _pytest
import pluggy
import pytest

STUB_SIGNATURE = "NotImplementedError: exercise "
INTERRUPTED = "the test was stopped before its own run (its call phase) reported"
OUTCOMES = ("passed", "failed", "not attempted", "needs CUDA", "not graded")
OPTIONAL_REFERENCE = "optional reference"
"""A graded test that skips with a reason starting with this (``optional_reference()``) because a
library it compares against is not installed is "not graded": its points leave the total, so
a student never loses points for what their machine lacks."""


def optional_reference(module: str, min_version: str | None = None):
    """Import and return ``module`` for a grader's comparison, or skip the test as "not graded".

    Use it for references that are not in every environment (``bitsandbytes`` on Colab): the
    test is then left out of the score instead of failing. Put it after the assertions that need
    only the student's code, so those still count.
    """
    import importlib

    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install raising anything
        pytest.skip(f"{OPTIONAL_REFERENCE} not installed: {module} ({type(exc).__name__}: {exc})")
    if min_version is not None:
        from packaging.version import Version

        have = getattr(mod, "__version__", "0")
        if Version(have) < Version(min_version):
            pytest.skip(f"{OPTIONAL_REFERENCE} too old: {module} {have} < {min_version}")
    return mod


def pytest_addoption(parser):
    group = parser.getgroup("labkit grading")
    group.addoption("--grade", action="store_true",
                    help="print the score table of the graded tests and write it as JSON")
    group.addoption("--grade-json", default="grades.json",
                    help="where --grade writes the JSON table (default: grades.json)")
    group.addoption("--exercise", action="append", default=[],
                    help="run only the graded tests of this exercise id, e.g. 1.2 (repeatable)")
    group.addoption("--stubs-must-fail", action="store_true",
                    help="succeed only if every graded test fails (run against the stubs)")
    group.addoption("--first-test-only", action="store_true",
                    help="of each exercise, run only its first graded test (make test's notebook "
                         "runs: the check cells' machinery; the tests all run in its solutions part)")


def pytest_configure(config):
    config.addinivalue_line("markers", "exercise(id, points): a graded test of lab exercise `id`")
    config._labkit_results = {}  # nodeid -> record


def _exercise_of(item) -> tuple[str, int] | None:
    mark = item.get_closest_marker("exercise")
    if mark is None:
        return None
    ex_id = mark.args[0] if mark.args else mark.kwargs.get("id")
    points = mark.kwargs.get("points", mark.args[1] if len(mark.args) > 1 else 1)
    if not isinstance(ex_id, str) or "." not in ex_id:
        raise pytest.UsageError(f"{item.nodeid}: exercise id must look like '1.2', got {ex_id!r}")
    if not isinstance(points, int) or points < 1:
        raise pytest.UsageError(f"{item.nodeid}: points must be a positive int, got {points!r}")
    return ex_id, points


def exercise_key(exercise: str) -> tuple[int, ...]:
    """The sort key of an exercise id: "1.10" after "1.9"."""
    return tuple(int(p) for p in exercise.split("."))


def pytest_collection_modifyitems(config, items):
    known = sorted({ex[0] for item in items if (ex := _exercise_of(item))}, key=exercise_key)
    config._labkit_known = known
    wanted = set(config.getoption("exercise"))
    first_only = config.getoption("first_test_only")
    if not wanted and not first_only:
        return
    keep, drop, seen = [], [], set()
    for item in items:
        ex = _exercise_of(item)
        taken = ex and (not wanted or ex[0] in wanted) and not (first_only and ex[0] in seen)
        (keep if taken else drop).append(item)
        if taken:
            seen.add(ex[0])
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


PYTEST_FRAMES = tuple(os.path.dirname(m.__file__) + os.sep for m in (pytest, _pytest, pluggy))


def _details(excinfo) -> str:
    """The failure's traceback as Python prints it (chained exceptions too), without pytest's and
    pluggy's own frames. (pytest's ``excinfo.getrepr()`` parses and walks every frame's whole file
    again for each failure, torch's large modules included: 0.1 to 0.4 s a failing test, minutes
    over the stubs, where every test fails.)"""
    top = traceback.TracebackException(excinfo.type, excinfo.value, excinfo.tb)
    todo = [top]  # (a tree: TracebackException already leaves out an exception seen twice)
    while todo:
        te = todo.pop()
        te.stack = traceback.StackSummary.from_list(
            [f for f in te.stack if not f.filename.startswith(PYTEST_FRAMES)])
        todo += [t for t in (te.__cause__, te.__context__) if t is not None]
    return "".join(top.format())


def assertion_message(exc: BaseException) -> str:
    """What a student should read about a failed check: the test's own words.

    For ``assert cond, "message"`` that is the message (pytest appends its introspection,
    ``assert [4368] == [3276]``, "Use -v to get more diff", after a newline starting with
    ``assert``: dropped). For ``torch.testing.assert_close(..., msg=...)``, the whole message.
    An assertion without a message gives its first line. Another exception gives
    ``Type: text``; a failing rank (:class:`labkit.ranks.RankError`) gives its first line and the
    rank's own exception line.
    """
    text = str(exc)
    if isinstance(exc, AssertionError):
        lines = text.splitlines()
        cut = next((i for i, line in enumerate(lines) if line.startswith("assert ")), len(lines))
        own = [line[2:] if i and line.startswith("  ") else line for i, line in enumerate(lines[:cut])]
        if any(line.strip() for line in own):
            return "\n".join(own).strip()
        first = lines[0] if lines else "assert"
        return f"{first[:300]}  (a check without a message: verbose=True shows the details)"
    child = getattr(exc, "child_traceback", None)
    if child:
        last = next((ln for ln in reversed(child.strip().splitlines()) if ln.strip()), "")
        return f"{text.splitlines()[0]}: {last.strip()}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.strip()
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        return str(report.longrepr[2])
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    ex = _exercise_of(item)
    if ex is None:
        return
    results = item.config._labkit_results
    record = results.get(item.nodeid)
    if record is None:  # passed only once its call phase reports so: an interrupt sends none
        record = results[item.nodeid] = {"exercise": ex[0], "points": ex[1], "test": item.name,
                                         "outcome": "failed", "message": INTERRUPTED}
    if report.when == "call" and report.passed:
        record.update(outcome="passed", message="")
    elif report.skipped:
        msg = _message(report)
        if "needs CUDA" in msg:
            record["outcome"] = "needs CUDA"
        elif msg.startswith(OPTIONAL_REFERENCE) or f"Skipped: {OPTIONAL_REFERENCE}" in msg:
            record["outcome"] = "not graded"
        else:
            record["outcome"] = "failed"
        record["message"] = msg
    elif report.failed:  # in any phase: setup, call or teardown
        text = str(report.longrepr)
        record["outcome"] = "not attempted" if STUB_SIGNATURE in text else "failed"
        excinfo = call.excinfo
        record["message"] = assertion_message(excinfo.value) if excinfo is not None else _message(report)
        try:
            record["details"] = _details(excinfo) if excinfo else text
        except Exception:  # noqa: BLE001 - never lose the grade over a traceback
            record["details"] = text


APART = {"needs CUDA": "cuda_points", "not graded": "ungraded_points"}
"""Outcomes whose points leave this machine's total, and where they are counted instead: the test
could not run here (no CUDA) or could not be graded (an optional reference library is missing),
so full marks are reachable on every machine."""
LEFT_OUT = tuple(APART)


def _table(results: dict) -> dict:
    """The score table: per exercise, per lab and in total, ``earned`` / ``possible`` with
    ``possible`` the points this machine could grade; ``cuda_points`` and ``ungraded_points``
    the points left out (a CUDA-only test on a CPU machine; a missing optional reference)."""
    exercises = defaultdict(lambda: {"earned": 0, "possible": 0, "cuda_points": 0,
                                     "ungraded_points": 0, **dict.fromkeys(OUTCOMES, 0),
                                     "tests": []})
    for nodeid, r in sorted(results.items()):
        e = exercises[r["exercise"]]
        e[APART.get(r["outcome"], "possible")] += r["points"]
        e["earned"] += r["points"] if r["outcome"] == "passed" else 0
        e[r["outcome"]] += 1
        e["tests"].append({"nodeid": nodeid, **r})
    keys = ("earned", "possible", "cuda_points", "ungraded_points")
    labs = defaultdict(lambda: dict.fromkeys(keys, 0))
    for ex_id, e in exercises.items():
        lab = ex_id.split(".")[0]
        for k in keys:
            labs[lab][k] += e[k]
    return {"exercises": {k: exercises[k] for k in sorted(exercises, key=exercise_key)},
            "labs": {k: labs[k] for k in sorted(labs, key=int)},
            **{k: sum(lab[k] for lab in labs.values()) for k in keys}}


def _not_started(table: dict, lab: str) -> bool:
    """Every test of the lab that ran reached a stub (nothing passed or failed)."""
    rows = [e for ex_id, e in table["exercises"].items() if ex_id.split(".")[0] == lab]
    return bool(rows) and all(e["passed"] == e["failed"] == 0 and e["not attempted"] for e in rows)


def _apart(row: dict) -> str:
    """"(+3 need CUDA, not run here)" for the points left out of a total."""
    parts = []
    if row.get("cuda_points"):
        parts.append(f"+{row['cuda_points']} need CUDA, not run here")
    if row.get("ungraded_points"):
        parts.append(f"+{row['ungraded_points']} not graded")
    return f"  ({'; '.join(parts)})" if parts else ""


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = config._labkit_results
    if config.getoption("grade"):
        table = _table(results)
        table["known_exercises"] = getattr(config, "_labkit_known", [])
        tr = terminalreporter
        tr.section("grade")
        tr.write_line(f"{'exercise':<10}{'points':>10}  {'passed':>6} {'failed':>6} "
                      f"{'not attempted':>13} {'needs CUDA':>10} {'not graded':>10}")
        failures = []
        for lab, lab_row in table["labs"].items():
            if _not_started(table, lab):
                n = sum(1 for ex_id in table["exercises"] if ex_id.split(".")[0] == lab)
                tr.write_line(f"{'lab ' + lab:<10}{lab_row['earned']:>4} / {lab_row['possible']:<3}  "
                              f"not started: all {n} exercises are still stubs{_apart(lab_row)}")
                continue
            for ex_id, e in table["exercises"].items():
                if ex_id.split(".")[0] != lab:
                    continue
                tr.write_line(f"{ex_id:<10}{e['earned']:>4} / {e['possible']:<3}  {e['passed']:>6} "
                              f"{e['failed']:>6} {e['not attempted']:>13} {e['needs CUDA']:>10} "
                              f"{e['not graded']:>10}")
                failures += [(ex_id, t) for t in e["tests"] if t["outcome"] in ("failed", "not graded")]
            tr.write_line(f"{'lab ' + lab:<10}{lab_row['earned']:>4} / {lab_row['possible']:<3}"
                          f"{_apart(lab_row)}")
        tr.write_line(f"{'total':<10}{table['earned']:>4} / {table['possible']:<3}{_apart(table)}")
        if table["cuda_points"]:
            tr.write_line(f"the {table['cuda_points']} points that need CUDA are left out of this "
                          "machine's total: run the graders on a GPU (Colab) to earn them")
        if failures:
            tr.write_line("")
            tr.write_line("what failed, in the tests' own words (not graded: its points are left out):")
        for ex_id, t in failures:
            tag = "FAIL" if t["outcome"] == "failed" else "N/A "
            msg = t["message"].replace("\n", "\n" + " " * 12)
            tr.write_line(f"  {ex_id:<6}{tag} {t['test']}\n            {msg[:600]}")
        path = Path(config.getoption("grade_json"))
        path.write_text(json.dumps(table, indent=1))
        tr.write_line(f"score table written to {path}")
        tr.write_line("(a self-check: this run imports the code of this tree, which can change "
                      "anything in it; a grade an instructor can trust comes from `labkit-grade "
                      "SUBMISSION --out DIR`, which runs only the exercises' code, apart)")
    if config.getoption("stubs_must_fail"):
        passed = [n for n, r in results.items() if r["outcome"] == "passed"]
        tr = terminalreporter
        tr.section("stubs must fail")
        if not results:
            tr.write_line("no graded test ran")
        for nodeid in passed:
            tr.write_line(f"PASSED ON A STUB (a grader that grades nothing): {nodeid}")
        if results and not passed:
            tr.write_line(f"all {len(results)} graded tests failed on the stubs, as they must")


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if config.getoption("grade") and exitstatus == pytest.ExitCode.TESTS_FAILED \
            and config._labkit_results:
        # the grade is the result: failed tests are scores, not an error of the run
        session.exitstatus = pytest.ExitCode.OK
    if config.getoption("stubs_must_fail"):
        results = config._labkit_results
        ok = bool(results) and all(r["outcome"] != "passed" for r in results.values())
        session.exitstatus = 0 if ok else 1
