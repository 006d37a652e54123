"""The wall at the operating system: how the child that runs student code is shut in.

Inside one Python process no sandbox holds, so the grader puts the process that runs student
code behind what Linux gives, and says which wall it got:

* ``namespaces`` — the child runs in its own PID, mount and network namespaces (``unshare``,
  util-linux); its first process (:mod:`labkit.grade.jail`) makes every mount read-only but the
  test's scratch folder, gives it a fresh ``/dev/shm`` and only a loopback network, and when it
  ends the kernel kills every process left: nothing outlives the child. As root the tests also run
  as a dedicated unprivileged user (``setpriv``); as an ordinary user, inside a user namespace,
  with every capability dropped (so no mount can be made writable again).
* ``user`` — root where namespaces are refused (a container without ``CAP_SYS_ADMIN``): the
  tests run as the dedicated user, which can write only its scratch folder and the world-writable
  folders (``/tmp``), and every process of that user is killed before the score is written. The
  network is not cut.
* ``none`` — neither is available (macOS; a container without user namespaces, not root), or
  the instructor asked for it (``--isolation none``, ``LABKIT_GRADE_ISOLATION=none``): the
  student's code could write anything the grader's user can, and keep running after its test.
  Every output says so.

``--isolation auto`` (the default) takes the strongest that works here, tried once per run;
``--isolation namespaces`` (or ``user``) refuses to grade when it is not available.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

LEVELS = ("namespaces", "user", "none")
USER = "labkit-student"
FALLBACK_UID = 64123
"""The dedicated user: ``labkit-student`` (tools/autograder/ensure_isolation.sh and setup.sh
create it), else this uid, which no account or file on a normal system has."""
JAIL = Path(__file__).with_name("jail.py")
STOPS = {
    "namespaces": "student code cannot write outside its scratch folder, reach the network, or "
                  "leave a process running after its tests",
    "user": "student code runs as a user that can write only its scratch folder and /tmp, and "
            "every process it starts is killed before the score is written; the network is not cut",
    "none": "NO ISOLATION: student code ran as the grader's user, could write the output folder "
            "and keep processes running; treat the grade as unverified",
}


@dataclass
class Isolation:
    level: str
    how: str

    @property
    def uid(self) -> int | None:
        """The dedicated user's uid when the grader runs as root and shuts the child in."""
        if os.geteuid() != 0 or self.level == "none" or "as root" in self.how:
            return None
        try:
            return pwd.getpwnam(USER).pw_uid
        except KeyError:
            return FALLBACK_UID

    def wrap(self, command: list[str], scratch: Path) -> list[str]:
        """``command`` run behind this wall, with ``scratch`` its one writable folder."""
        if self.level == "none":
            return command
        uid = self.uid
        if uid is not None:
            os.chown(scratch, uid, uid)
        drop = ["setpriv", "--no-new-privs", "--clear-groups"] if os.geteuid() == 0 \
            else ["setpriv", "--no-new-privs"]
        if uid is not None:
            drop += [f"--reuid={uid}", f"--regid={uid}"]
        if self.level == "user":
            return [*drop, "--", *command]
        user_ns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        return ["unshare", *user_ns, "--pid", "--fork", "--kill-child", "--mount", "--net",
                "--mount-proc", sys.executable, "-I", "-S", str(JAIL), str(scratch), "--",
                *drop, "--bounding-set=-all", "--inh-caps=-all", "--", *command]

    def sweep(self) -> None:
        """Kill every process left of the dedicated user (level ``user``; under ``namespaces``
        the kernel has done it already). ``kill(-1)`` sent *as* that user reaches exactly its
        processes, in one pass the processes it races with cannot escape."""
        uid = self.uid
        if self.level != "user" or uid is None:
            return
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                try:
                    os.setgroups([])
                    os.setresgid(uid, uid, uid)
                    os.setresuid(uid, uid, uid)
                    os.kill(-1, 9)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)

    def describe(self) -> dict:
        return {"level": self.level, "how": self.how, "guarantees": STOPS[self.level]}


_chosen: dict[str, Isolation] = {}


def choose(requested: str = "auto") -> Isolation:
    """The strongest wall that works here (``auto``), or the one asked for (a ValueError naming
    the argument when it does not work)."""
    requested = requested or os.environ.get("LABKIT_GRADE_ISOLATION") or "auto"
    if requested not in ("auto", *LEVELS):
        raise ValueError(f"isolation={requested!r}: must be one of auto, {', '.join(LEVELS)}")
    if requested not in _chosen:
        _chosen[requested] = _choose(requested)
    return _chosen[requested]


def _choose(requested: str) -> Isolation:
    if requested == "none":
        return Isolation("none", "turned off by the instructor (--isolation none)")
    root = os.geteuid() == 0
    candidates = [Isolation("namespaces", f"unshare + setpriv as {USER}" if root else
                            "unshare in a user namespace, capabilities dropped")]
    if root:
        candidates += [Isolation("namespaces", "unshare as root, capabilities dropped"),
                       Isolation("user", f"setpriv as {USER}, its processes killed after")]
    why = []
    for cand in candidates:
        if requested not in ("auto", cand.level):
            continue
        problem = _try(cand)
        if problem is None:
            return cand
        why.append(f"{cand.level} ({cand.how}): {problem}")
    if requested != "auto":
        raise ValueError(f"isolation={requested!r} is not available here: " + "; ".join(why))
    return Isolation("none", "nothing available: " + "; ".join(why or ["not Linux"]))


def _try(cand: Isolation) -> str | None:
    """None if a child behind ``cand`` starts Python with torch and pytest and can write its
    scratch folder only; else what went wrong."""
    if not sys.platform.startswith("linux") or not shutil.which("setpriv") or (
            cand.level == "namespaces" and not shutil.which("unshare")):
        return "needs Linux with util-linux's unshare and setpriv"
    base = Path(tempfile.mkdtemp(prefix="labkit-probe-"))
    try:
        base.chmod(0o755)
        scratch = base / "scratch"
        scratch.mkdir()
        probe = ("import pathlib, sys, torch, pytest\n(pathlib.Path(sys.argv[1]) / 'ok').write_text('')\n"
                 "try:\n    open(sys.argv[2], 'w')\nexcept OSError:\n    pass\nelse:\n"
                 "    sys.exit('wrote outside the scratch folder')\n")
        command = cand.wrap([sys.executable, "-c", probe, str(scratch), str(base / "outside")], scratch)
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode or not (scratch / "ok").exists():
            return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:300]
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)[:300]
    finally:
        shutil.rmtree(base, ignore_errors=True)
