"""The pytest plugin of the grader's child process: run the tests, report each outcome, signed.

Loaded with ``-p labkit.grade.child`` before any test module (so before any student module) is
imported. At import it reads one line from stdin — the key of this run, sent by the parent
(:mod:`labkit.grade.runner`) — and closes stdin; the key is then only in this module's
closure. The guard (:mod:`labkit.grade.guard`) is already installed by ``import labkit`` (the
parent set ``LABKIT_GRADE_GUARD``). After each test it sends one line over the pipe whose file
descriptor is in ``LABKIT_GRADE_FD``: the test's record (node id, outcome, message) and its
HMAC-SHA256 under the key. The parent accepts only records that verify, for tests it collected
itself from the pristine course; a test without one is failed. So the child cannot raise a
score: exiting early loses its own records, a forged line does not verify, and the score file
is written by the parent after the child has ended.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys

import pytest

from labkit.grade import guard


def _make_sender():
    line = sys.stdin.buffer.readline().strip()
    try:
        sys.stdin.close()
    except Exception:  # noqa: BLE001
        pass
    sys.stdin = open(os.devnull)
    key = bytes.fromhex(line.decode()) if line else b""
    fd = int(os.environ.get("LABKIT_GRADE_FD", "-1"))
    seq = [0]

    def send(record: dict) -> None:
        if fd < 0 or not key:
            return
        seq[0] += 1
        body = json.dumps({**record, "seq": seq[0]}, sort_keys=True)
        mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
        data = (body + "\t" + mac + "\n").encode()
        while data:
            data = data[os.write(fd, data):]
    return send


_send = _make_sender()
del _make_sender
_guard = guard.api()
_config: list = []
_seen: dict = {}
"""nodeid -> what this plugin saw of the test's phases itself ("failed", "skipped"): a record in
labkit.grade.plugin's table that says "passed" for a test whose report failed is not believed."""


def _exercise(item):
    mark = item.get_closest_marker("exercise")
    return (mark.args[0] if mark and mark.args else None) if mark else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    if _guard is not None:
        _guard.take_snapshot()
    _send({"kind": "hello", "collected": len(session.items)})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _guard is not None:
        _guard.begin(_exercise(item))


def pytest_runtest_logreport(report, _guard=_guard, _send=_send, _config=_config, _seen=_seen,
                             _dict=dict, _type=type):
    # the grader's own objects are bound here, at import (before any student module exists):
    # rebinding this module's globals changes nothing
    if report.failed:
        _seen[report.nodeid] = "failed"
    elif report.skipped and _seen.get(report.nodeid) != "failed":
        _seen[report.nodeid] = "skipped"
    if report.when != "teardown":
        return
    config = _config[0]
    table = config.__dict__.get("_labkit_results")
    if _type(table) is not _dict:
        record = {"outcome": "failed", "message": "refused while grading: the grading table was "
                  "replaced while the tests ran"}
    else:
        record = _dict(_dict.get(table, report.nodeid) or {})
    if not record:
        return
    seen = _seen.pop(report.nodeid, None)
    if record.get("outcome") == "passed" and seen is not None:
        record = {**record, "outcome": "failed", "message": "refused while grading: the test's "
                  f"report {seen}, its record said passed"}
    if _guard is not None:
        refused = _guard.end()
        changed = _guard.check_integrity()
        if changed:
            refused.append("a function of the course or of a library was replaced while this "
                           "test ran (put back): " + ", ".join(sorted(set(changed))[:8]))
        if refused:
            record["outcome"] = "failed"
            before = record.get("message", "") if record.get("message", "").startswith(
                "refused while grading") else ""
            record["message"] = (before + " | " if before else "refused while grading: ") + \
                " | ".join(refused)[:1500]
    _send({"kind": "test", "nodeid": report.nodeid, "outcome": record.get("outcome"),
           "message": (record.get("message") or "")[:3000],
           "details": (record.get("details") or "")[-3000:]})


def pytest_configure(config):
    _config.append(config)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    # every plugin is configured, no test module (so no student module) is imported yet
    if _guard is not None:
        _guard.take_grader_snapshot()


def pytest_sessionfinish(session, exitstatus):
    _send({"kind": "done"})
