"""The wall at the operating system: how the child that runs student code is shut in.

Three levels (docs/grading.md says which machine gets which; every output names it):
``namespaces``, its own PID, mount, network, IPC and UTS namespaces (``unshare``), whose first
process (this module run as a script) seals the mounts read-only but the scratch folder, hides
the course's own folders (the solutions, their git history) and brings up loopback, the tests
running as the dedicated user (as root) or with every capability dropped (in a user namespace);
``user``, root where namespaces are refused: the dedicated user, whose processes are killed after
(:meth:`Isolation.sweep`); ``none``.
"""
from __future__ import annotations

import atexit
import fcntl
import functools
import os
import pwd
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

LEVELS = ("namespaces", "user", "none")
USER, FALLBACK_UID = "labkit-student", 64123
"""The dedicated user: ``labkit-student`` (tools/autograder/ensure_isolation.sh creates it), else
this uid, which no account and no file of a usual system has."""
STOPS = {
    "namespaces": "student code could not write outside its scratch folder, reach the network, "
                  "or leave a process running after its tests",
    "user": "student code ran as a user that can write only its scratch folder and /tmp, and "
            "every process it started was killed before the score was written; the network "
            "was not cut",
    "none": "NO ISOLATION: student code ran as the grader's user, could write the output folder "
            "and keep processes running; treat the grade as unverified",
}


@dataclass
class Isolation:
    level: str
    how: str
    as_user: bool = False  # the tests run as the dedicated user (the grader runs as root)

    @property
    def uid(self) -> int | None:
        if not self.as_user:
            return None
        try:
            return pwd.getpwnam(USER).pw_uid
        except KeyError:
            return FALLBACK_UID

    def wrap(self, command: list[str], scratch: Path, hide: tuple = ()) -> list[str]:
        """``command`` run behind this wall, with ``scratch`` its one writable folder; under
        namespaces the folders ``hide`` (the course's own: the solutions, .git) are empty."""
        uid = self.uid
        if self.level == "none":
            return command
        if uid is not None:
            os.chown(scratch, uid, uid)
            command = [_shared_python() if c == sys.executable else c for c in command]
        drop = ["setpriv", "--no-new-privs"] + (["--clear-groups"] if os.geteuid() == 0 else []) \
            + ([f"--reuid={uid}", f"--regid={uid}"] if uid is not None else [])
        if self.level == "user":
            return [*drop, "--", *command]
        return ["unshare", *([] if os.geteuid() == 0 else ["--user", "--map-root-user"]), "--pid",
                "--fork", "--kill-child", "--mount", "--net", "--ipc", "--uts", "--mount-proc",
                sys.executable, "-I", "-S", __file__, str(scratch), *map(str, hide), "--", *drop,
                "--bounding-set=-all", "--inh-caps=-all", "--", *command]

    def sweep(self) -> None:
        """Kill every process left of the dedicated user (level ``user``; under ``namespaces``
        the kernel did). ``kill(-1)`` sent *as* that user reaches exactly its processes, in one
        pass that a process forking at the time cannot escape."""
        if self.level != "user" or self.uid is None:
            return
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                try:
                    os.setgroups([])
                    os.setresgid(self.uid, self.uid, self.uid)
                    os.setresuid(self.uid, self.uid, self.uid)
                    os.kill(-1, 9)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)

    @property
    def one_at_a_time(self) -> bool:  # sweep() kills every process of the user: a sibling's too
        return self.level == "user"

    def describe(self) -> dict:
        return {"level": self.level, "how": self.how, "guarantees": STOPS[self.level]}


@functools.cache
def _shared_python() -> str:
    """This Python if every user may run it; else (it lies in a folder only root may read, like
    /root/.pyenv) a copy in a virtual environment others may run, seeing this one's packages:
    the dedicated user must start it, and start it again (ranks started afresh)."""
    real = os.path.realpath(sys.executable)
    if all(os.stat(d).st_mode & 0o005 == 0o005 for d in Path(real).parents) and \
            os.stat(real).st_mode & 0o005 == 0o005:
        return sys.executable
    venv = Path(tempfile.mkdtemp(prefix="labkit-python-"))
    atexit.register(shutil.rmtree, venv, True)
    subprocess.run([sys.executable, "-m", "venv", "--copies", "--without-pip", str(venv)],
                   check=True, capture_output=True)
    site = subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig."
                           "get_paths()['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()
    (Path(site) / "labkit_grader.pth").write_text("\n".join(sys.path[1:]) + "\n")
    for folder, _, files in os.walk(venv):
        for path in [folder, *(os.path.join(folder, f) for f in files)]:
            os.chmod(path, os.stat(path).st_mode | (0o555 if os.path.isdir(path) or
                                                    os.access(path, os.X_OK) else 0o444))
    return str(venv / "bin/python")


_chosen: dict[str, Isolation] = {}


def choose(requested: str | None = None) -> Isolation:
    """The strongest wall that works here (``auto``), or the one asked for (default:
    ``LABKIT_GRADE_ISOLATION``, else auto); a ValueError naming the argument when it does not work."""
    requested = requested or os.environ.get("LABKIT_GRADE_ISOLATION") or "auto"
    if requested not in ("auto", *LEVELS):
        raise ValueError(f"isolation={requested!r}: must be one of auto, {', '.join(LEVELS)}")
    if requested == "none":
        return Isolation("none", "turned off by the instructor (--isolation none)")
    if requested not in _chosen:
        candidates = [Isolation("namespaces", f"unshare + setpriv as {USER}", as_user=True),
                      Isolation("namespaces", "unshare as root, capabilities dropped"),
                      Isolation("user", f"setpriv as {USER}, its processes killed after", True)] \
            if os.geteuid() == 0 else [
                Isolation("namespaces", "unshare in a user namespace, capabilities dropped")]
        why = []
        for cand in [c for c in candidates if requested in ("auto", c.level)]:
            problem = _try(cand)
            if problem is None:
                _chosen[requested] = cand
                break
            why.append(f"{cand.level} ({cand.how}): {problem}")
        else:
            if requested != "auto":
                raise ValueError(f"isolation={requested!r} is not available here: " + "; ".join(why))
            _chosen[requested] = Isolation("none", "nothing available: " + "; ".join(why))
    return _chosen[requested]


def _try(cand: Isolation) -> str | None:
    """None if a child behind ``cand`` imports torch and pytest, writes its scratch folder,
    cannot write beside it and can start this Python again (a rank that forkserver or spawn
    starts: not so as the dedicated user when the interpreter lies in a folder only root may
    read, like /root/.pyenv); else what went wrong."""
    if not sys.platform.startswith("linux") or not shutil.which("setpriv") or \
            (cand.level == "namespaces" and not shutil.which("unshare")):
        return "needs Linux with util-linux's unshare and setpriv"
    base = Path(tempfile.mkdtemp(prefix="labkit-probe-"))
    try:
        base.chmod(0o755)
        (base / "scratch").mkdir()
        probe = ("import pathlib, subprocess, sys, torch, pytest\n"
                 "(pathlib.Path(sys.argv[1]) / 'ok').touch()\n"
                 "try:\n    open(sys.argv[2], 'w')\nexcept OSError:\n    pass\nelse:\n"
                 "    sys.exit('it could write outside its scratch folder')\n"
                 "try:\n    subprocess.run([sys.executable, '-c', ''], check=True)\n"
                 "except (OSError, subprocess.CalledProcessError) as exc:\n"
                 "    sys.exit(f'it cannot start this Python again, as ranks started afresh do "
                 "({exc})')\n")
        done = subprocess.run(cand.wrap([sys.executable, "-c", probe, str(base / "scratch"),
                                         str(base / "outside")], base / "scratch"),
                              capture_output=True, text=True, timeout=120)
        if done.returncode or not (base / "scratch" / "ok").exists():
            return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:300]
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)[:300]
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------ the namespaces' first process

def _seal(scratch: str, hide: list[str]) -> None:
    """Loopback up; ``scratch`` a writable mount of its own; a fresh ``/dev/shm``; the folders
    ``hide`` empty; every other mount read-only (keeping the flags a user namespace may not clear)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # SIOCGIFFLAGS, SIOCSIFFLAGS
        flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))  # IFF_UP
    with open("/proc/self/mountinfo") as f:
        mounts = [(p.encode().decode("unicode_escape"), o.split(",")) for p, o in
                  (line.split()[4:6] for line in f)]
    course = max((p for p, _ in mounts if scratch.startswith(p.rstrip("/") + "/")), key=len)
    subprocess.run(["mount", "--bind", scratch, scratch], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm"], check=True)
    for folder in hide:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=4k", "tmpfs", folder], check=True)
    kept = {"nosuid", "nodev", "noexec", "noatime", "nodiratime", "relatime", "strictatime"}
    for point, options in mounts:
        if "ro" in options or point in ("/proc", "/dev/shm") or point.startswith("/proc/"):
            continue
        done = subprocess.run(["mount", "-o", ",".join(["remount", "bind", "ro", *(
            o for o in options if o in kept)]), point], capture_output=True)
        if done.returncode and point == course:  # the mount holding the course's copy must seal
            sys.exit(f"isolation: cannot make {point} read-only: {done.stderr.decode().strip()}")


if __name__ == "__main__":  # unshare ... python -I -S isolation.py SCRATCH -- COMMAND...
    _seal(sys.argv[1], [a for a in sys.argv[2:sys.argv.index("--")] if os.path.isdir(a)])
    child = os.fork()
    if child == 0:
        command = sys.argv[sys.argv.index("--") + 1:]
        os.execvp(command[0], command)
    while True:  # reap every orphan; end with the command (the kernel then kills the rest)
        pid, status = os.wait()
        if pid == child:
            sys.exit(os.waitstatus_to_exitcode(status))
