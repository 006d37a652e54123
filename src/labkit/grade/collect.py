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
    from labkit.score_table import _exercise_of

    tests = {}
    optional: dict[str, bool] = {}
    for item in session.items:
        ex = _exercise_of(item)
        if ex is None:
            continue
        cuda = any("needs CUDA" in str(m.kwargs.get("reason", "")) and
                   (not m.args or bool(m.args[0])) for m in item.iter_markers("skipif"))
        file = item.nodeid.split("::")[0]
        if file not in optional:
            optional[file] = _optional_missing(item.path)
        tests[item.nodeid] = {"exercise": ex[0], "points": ex[1], "test": item.name,
                              "file": file, "cuda_only_here": cuda,
                              "may_be_ungraded": optional[file]}
    with open(path, "w") as f:
        json.dump(tests, f)


def _optional_missing(path) -> bool:
    """Whether a test of this file may be "not graded" here: the file asks for an optional
    reference (``optional_reference("bitsandbytes", min_version="0.50")``) that this machine
    lacks or has too old. Otherwise a "not graded" outcome is a forged one and fails."""
    import importlib.metadata
    import importlib.util
    import re

    from packaging.version import Version

    text = path.read_text()
    for module, version in re.findall(
            r'optional_reference\(\s*"([\w.]+)"(?:\s*,\s*min_version\s*=\s*"([\w.]+)")?', text):
        try:
            if importlib.util.find_spec(module) is None:
                return True
            if version and Version(importlib.metadata.version(module)) < Version(version):
                return True
        except Exception:  # noqa: BLE001 - a broken install: the skip is plausible
            return True
    return False
