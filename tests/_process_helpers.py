"""Helpers of the tests that start processes (not collected): is a process still running, and
wait until a set of them is gone."""
from __future__ import annotations

import os
import time


def alive(pid: int) -> bool:
    """True if `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def assert_all_gone(pids, within: float = 2.0) -> None:
    deadline = time.monotonic() + within  # an orphaned grandchild is reaped by init, not by us
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], f"left behind: {pids}"
