"""The pytest plugin of the grader's trusted collection run, on the pristine course only.

``pytest --collect-only -p labkit.grade.collect`` with ``LABKIT_GRADE_COLLECT=<file>`` writes
every graded test (node id, exercise, points, and which outcomes that leave the total can happen
to it on this machine) to that file. No student code exists in that run, so the parent trusts
what it lists: a child can neither add a test, change its points, nor skip it where it runs.
"""
from __future__ import annotations

import json
import os
import re

import pytest


def pytest_collection_finish(session):
    path = os.environ.get("LABKIT_GRADE_COLLECT")
    if not path:
        return
    from labkit.score_table import _exercise_of

    tests: dict = {}
    optional: dict[str, bool] = {}
    for item in session.items:
        ex = _exercise_of(item)
        if ex is None:
            continue
        file = item.nodeid.split("::")[0]
        if file not in optional:
            optional[file] = _optional_missing(item.path)
        cuda = any("needs CUDA" in str(m.kwargs.get("reason", "")) and
                   (not m.args or bool(m.args[0])) for m in item.iter_markers("skipif"))
        tests[item.nodeid] = {"exercise": ex[0], "points": ex[1], "test": item.name, "file": file,
                              "may_skip": ["needs CUDA"] * cuda + ["not graded"] * optional[file]}
    with open(path, "w") as f:
        json.dump(tests, f)


def _optional_missing(path) -> bool:
    """Whether the test file asks for an optional reference (``optional_reference("bitsandbytes",
    min_version="0.50")``) that this machine lacks or has too old: its tests may be "not graded"."""
    from labkit.score_table import optional_reference

    for module, version in re.findall(
            r'optional_reference\(\s*"([\w.]+)"(?:\s*,\s*min_version\s*=\s*"([\w.]+)")?',
            path.read_text()):
        try:
            optional_reference(module, version or None)
        except pytest.skip.Exception:
            return True
    return False
