"""The wall at the operating system around student code (labkit.grade.isolation), on this machine.

Which wall each way of running gets, and that it holds: a detached process started from an
exercise is gone before the score is written and cannot rewrite grades.json afterwards, a write to
the output folder or to the course's copy fails, a network connection fails, and the honest
answer beside them still earns every point. Root gets namespaces and the dedicated user; an
ordinary user gets user namespaces; a run without isolation says so (test_grade.py). What a
machine cannot give (no unshare, not root) is skipped with the reason.
"""
from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from _grade_helpers import CHEATS, ROOT, apply_cheat, student_edition
from labkit.grade import flags, formats, isolation, runner

pytestmark = pytest.mark.timeout(900)
COUNT_PARAMS = (CHEATS / "count_params_body.txt").read_text()
OTHER_UID = 64124
"""An ordinary user for the test run as one (no account, no file of a usual system has it)."""


def test_this_machine_gets_the_strongest_wall_it_has():
    """auto takes namespaces where unshare can make PID, mount, network, IPC and UTS namespaces
    here, and says how; the answer is in every output of a grade (see the other tests)."""
    wall = isolation.choose("auto")
    print(wall.describe())
    spaces = ["--pid", "--fork", "--mount", "--net", "--ipc", "--uts", "true"]
    raw = subprocess.run(["unshare", *spaces] if os.geteuid() == 0 else
                         ["unshare", "--user", "--map-root-user", *spaces],
                         capture_output=True) if shutil.which("unshare") else None
    if raw is not None and raw.returncode == 0 and shutil.which("setpriv"):
        assert wall.level == "namespaces", wall
    assert wall.level in isolation.LEVELS and wall.describe()["guarantees"]


def _listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.5)
    return srv


def _cheating_submission(root: Path, out: Path, port: int, token: str, solutions: Path) -> Path:
    """1.1 honest, behind detached_process_rewrites_grades (see its header)."""
    sub = student_edition(root / "sub")
    apply_cheat(sub / "src" / "labkit", "detached_process_rewrites_grades", OUT=str(out),
                PORT=str(port), TOKEN=token, SOLUTIONS=str(solutions), COUNT_PARAMS=COUNT_PARAMS)
    return sub


def _alive(token: str) -> dict[int, str]:
    """{pid: command line} of the processes whose command line holds ``token``."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if token in cmd:
            found[int(pid)] = cmd
    return found


def _kill(token: str) -> None:
    """Only if a wall failed: end the processes this test's cheat started, by their ids."""
    for pid in _alive(token):
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def _assert_the_wall_held(out: Path, srv: socket.socket, token: str, kept: Path | None,
                          network: bool = True) -> dict:
    time.sleep(8)  # longer than the detached process waits before it rewrites grades.json
    grades = json.loads((out / "grades.json").read_text())
    assert grades["earned"] == grades["possible"] == 5, grades["exercises"]["1.1"]
    assert not _alive(token), _alive(token)
    if network:  # the user level does not cut the network (isolation.STOPS says so)
        with pytest.raises(OSError):
            srv.accept()  # nobody connected
    assert not (out / "grades.json").read_text().endswith("# written by the student\n")
    if kept is not None:
        copy = (kept / "src/labkit/lab1/accounting.py").read_text()
        assert not copy.endswith("# written by the student\n")
    return grades


@pytest.fixture(scope="module")
def lab1_tests(tmp_path_factory):
    """Lab 1's graded tests, collected once from the pristine course for the levels below (a
    collection is a child of its own, ~8 CPU-s; it runs before any student code, outside the wall)."""
    ws = tmp_path_factory.mktemp("collect") / "course"
    runner.copy_course(ROOT, ws)
    return runner.collect(ws, labs=["1"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (unshare, setpriv)")
@pytest.mark.parametrize("level", ["namespaces", "user"])
def test_the_wall_holds_around_a_cheating_exercise(tmp_path, level, monkeypatch, lab1_tests):
    """As this machine's user (root on CI and Gradescope): the wall, by level; under namespaces
    the instructor's solutions/ are also out of sight. The reading zeroes this cheat (a module's
    names looked up by computed names); the wall must hold where a reading misses, so here the
    grader runs without it (``flags.read`` finds nothing)."""
    monkeypatch.setattr(flags, "read", lambda merged, pristine: {})
    if level == "user":  # its sweep kills every process of its user: here the fallback uid, so
        monkeypatch.setattr(isolation, "USER", "labkit-no-such-user")  # that gradings beside it
    try:  # (as labkit-student: another xdist worker's, another grader's) are not touched
        wall = isolation.choose(level)
    except ValueError as exc:
        pytest.skip(str(exc))
    out, token, srv = tmp_path / "out", f"labkit-{secrets.token_hex(8)}", _listener()
    out.mkdir()
    # the instructor's solutions are hidden in the namespaces; the user level does not hide them
    solutions = ROOT / "solutions/labkit/lab1/accounting.py" if level == "namespaces" else tmp_path / "no"
    sub = _cheating_submission(tmp_path, out, srv.getsockname()[1], token, solutions)
    try:
        table = runner.grade_submission(sub, course=ROOT, exercises=["1.1"], jobs=1, timeout=600,
                                        keep=tmp_path / "kept", wall=wall, collected=lab1_tests)
        formats.write_all(table, out)  # what the parent writes, once the child's processes are gone
        grades = _assert_the_wall_held(out, srv, token, tmp_path / "kept", level == "namespaces")
    finally:
        _kill(token)
    assert grades["submission"]["isolation"]["level"] == level


WALL_PROBE = """
import ctypes, os, sys
made = ctypes.CDLL(None).shmget(int(sys.argv[1]), 4096, 0o1600)  # IPC_CREAT: a System V segment
print(made >= 0, [p for p in sys.argv[2:] if os.path.exists(p)])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (unshare, setpriv)")
def test_the_wall_hides_the_courses_folders_and_its_ipc():
    """rt15c_wall_reads_git_pack_of_solutions: behind the wall the course's .git, whose packs hold
    every version of solutions/, was read in full; rt15c_wall_sysv_shm_outlives_the_child: a
    System V segment made there outlived the child, seen by the next grading and the host. A
    probe behind the namespaces wall, as the grader puts it (runner.hidden): the course's own
    folders (solutions/, .git, tests/, a worktree's git directory...) are empty, and a segment it
    makes is in an IPC namespace of its own, gone with it."""
    try:
        wall = isolation.choose("namespaces")
    except ValueError as exc:
        pytest.skip(str(exc))
    git = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
                         cwd=ROOT, capture_output=True, text=True).stdout.strip()
    secret = [ROOT / "solutions/labkit/lab1/accounting.py", ROOT / "tests/test_lab1_accounting.py",
              *([Path(git) / "HEAD"] if git else [])]
    assert all(p.exists() for p in secret), secret  # (what the probe must not see, here)
    base = Path(tempfile.mkdtemp(prefix="labkit-wall-"))
    key, libc = 0x1AB00000 + secrets.randbelow(1 << 16), ctypes.CDLL(None)
    try:
        base.chmod(0o755)
        (base / "scratch").mkdir()
        probe = [sys.executable, "-c", WALL_PROBE, str(key), *map(str, secret)]
        out = subprocess.run(wall.wrap(probe, base / "scratch", runner.hidden(ROOT, base)),
                             capture_output=True, text=True, timeout=120)
        assert out.stdout.split("\n")[0] == "True []", out.stdout + out.stderr[-2000:]
        assert libc.shmget(key, 0, 0) == -1, "the probe's segment is on the host"
    finally:
        found = libc.shmget(key, 0, 0)
        if found >= 0:  # only if the wall failed: remove the probe's segment
            libc.shmctl(found, 0, None)  # IPC_RMID
        shutil.rmtree(base, ignore_errors=True)


def _python_for_everyone(as_user: list[str]) -> str:
    """A Python with this one's packages that another user may run and start again: the one the
    grader gives its dedicated user (isolation._shared_python: this one, or a copy others may
    run when it lives in a private folder, as under /root)."""
    python = isolation._shared_python()
    if subprocess.run([*as_user, python, "-c", "import pytest, torch"],
                      capture_output=True).returncode:
        pytest.skip(f"this checkout's packages ({sysconfig.get_paths()['purelib']}) lie in a "
                    "folder another user cannot read (a private temporary folder): clone the "
                    "course into a folder others may read to run this test")
    return python


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root to run the grader as another, ordinary user")
def test_the_wall_holds_when_an_ordinary_user_grades(tmp_path):
    """The grader run as an ordinary user (uid 64124, through setpriv): auto gets namespaces in a
    user namespace (when this kernel lets ordinary users make one), and the wall holds the same
    (the grader run without its reading, as above)."""
    as_user = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "--"]
    base, token = Path(tempfile.mkdtemp(prefix="labkit-user-grade-")), f"labkit-{secrets.token_hex(8)}"
    try:
        base.chmod(0o755)
        python = _python_for_everyone(as_user)
        course, out = base / "course", base / "out"
        runner.copy_course(ROOT, course)  # no .git: git refuses a repository of another user
        srv = _listener()
        sub = _cheating_submission(base, out, srv.getsockname()[1], token, base / "no")
        out.mkdir()
        for path in (base, out):
            os.chown(path, OTHER_UID, OTHER_UID)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LABKIT_")}
        env.update(HOME=str(base), PYTHONPATH=str(course / "src"), LABKIT_GRADE_COURSE=str(course))
        unread = ("import sys; from labkit.grade import cli, flags; "  # (as in the test above)
                  "flags.read = lambda merged, pristine: {}; sys.exit(cli.main(sys.argv[1:]))")
        proc = subprocess.run([*as_user, python, "-c", unread,
                               str(sub), "--out", str(out), "--exercise", "1.1", "--jobs", "1"],
                              cwd=base, env=env, capture_output=True, text=True, timeout=800)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        iso = json.loads((out / "grades.json").read_text())["submission"]["isolation"]
        if iso["level"] == "none":
            pytest.skip(f"this kernel gives an ordinary user no namespaces: {iso['how']}")
        assert iso["level"] == "namespaces" and "user namespace" in iso["how"], iso
        _assert_the_wall_held(out, srv, token, None)
    finally:
        _kill(token)
        shutil.rmtree(base, ignore_errors=True)
