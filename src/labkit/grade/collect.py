"""The pytest plugin of the grader's trusted collection run, on the pristine course only.

``pytest --collect-only -p labkit.grade.collect`` with ``LABKIT_GRADE_COLLECT=<file>`` writes
every graded test — node id, exercise, points, and whether it is skipped here for lack of CUDA —
to that file. No student code exists in that run, so the parent trusts what it lists: a
child can neither add a test nor change a test's points.
"""
from __future__ import annotations

import json
import os


def pytest_collection_finish(session):
    path = os.environ.get("LABKIT_GRADE_COLLECT")
    if not path:
        return
    from labkit.grading import _exercise_of

    tests = {}
    for item in session.items:
        ex = _exercise_of(item)
        if ex is None:
            continue
        cuda = any("needs CUDA" in str(m.kwargs.get("reason", "")) and
                   (not m.args or bool(m.args[0])) for m in item.iter_markers("skipif"))
        tests[item.nodeid] = {"exercise": ex[0], "points": ex[1], "test": item.name,
                              "file": item.nodeid.split("::")[0], "cuda_only_here": cuda}
    with open(path, "w") as f:
        json.dump(tests, f)
