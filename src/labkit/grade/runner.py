"""The trusted side of ``labkit-grade``: build the graded copy, run the children, decide, score.

No student code runs in this process. It copies the course without ``solutions/``, lists the
graded tests from it (:mod:`.collect`: the only list of tests and points it trusts), merges the
exercise code in (:mod:`.extract`), reads the red flags (:mod:`.flags`), plants one **tripwire**
per exercise (a randomly named test that must fail: a blanket "every test passes" tamper makes it
pass), runs each lab's tests in a child behind the wall (:mod:`.isolation`, :mod:`.child`) and
decides each test from its one record on the result pipe (:func:`read_records`).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from labkit.grade import extract, flags, isolation
from labkit.grade.submission import find_labkit, read_submitted, unpack
from labkit.score_table import LEFT_OUT, OUTCOMES

NOT_COPIED = ("solutions/", ".git/")
MAX_PIPE_BYTES = 32 * 2**20     # what the parent keeps of a child's result pipe
OUTPUT_TAIL = 64 * 2**10        # what the parent keeps of a child's output
TRIPWIRE = '''

import pytest as _pytest_tripwire  # noqa: E402 - added by labkit-grade


@_pytest_tripwire.mark.exercise({exercise!r}, points=1)
def {name}():
    """A tripwire of the grader: this test must fail. A run in which it passed was tampered with."""
    assert False, "this test must fail"
'''


def course_root() -> Path:
    """The repository holding this labkit (src/labkit → root), or ``LABKIT_GRADE_COURSE``."""
    env = os.environ.get("LABKIT_GRADE_COURSE")
    return Path(env).resolve() if env else Path(__file__).resolve().parents[3]


def course_files(root: Path) -> list[str]:
    """The course's files: what git tracks (without solutions/), or every file when the course
    is not a git checkout (an autograder's copy), without build outputs."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True)
        files = [p for p in out.stdout.decode().split("\0") if p]
    else:
        skip = {".git", ".venv", "_build", "__pycache__", ".pytest_cache", "solutions",
                ".venv-compat", "precomputed"}
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
            files += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames]
    return sorted(p for p in files if not p.startswith(NOT_COPIED) and (root / p).is_file())


def copy_course(root: Path, dest: Path) -> None:
    """The course's files into ``dest``, readable by all (the child may run as another user)."""
    for rel in course_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        shutil.copyfile(root / rel, target)
        target.chmod(0o755 if os.access(root / rel, os.X_OK) else 0o644)
    for dirpath, _, _ in os.walk(dest):
        os.chmod(dirpath, 0o755)


def hidden(course: Path, base: Path) -> tuple[Path, ...]:
    """What the child must not see of the course it was copied from (it runs on the copy in
    ``base``): every folder at the course's top (solutions/; .git, their history; _build/, the
    chapters' outputs; caches) but one holding the copy or this Python (a virtual environment),
    and the course's git directory where it lies elsewhere (a worktree's)."""
    course = course.resolve()
    git = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
                         cwd=course, capture_output=True, text=True) if shutil.which("git") else None
    found = [Path(git.stdout.strip())] if git and git.returncode == 0 else []
    keep = [Path(p).resolve() for p in (base, sys.prefix, sys.base_prefix, sys.executable)]
    found += [p.resolve() for p in course.iterdir() if p.is_dir()]
    return tuple(sorted({p for p in found if not any(k == p or p in k.parents for k in keep)}))


def exercise_modules(course: Path) -> dict[str, tuple[str, ...]]:
    """{"labkit/lab5/flash_attention.py": ("5.6",), ...}: the pristine modules with stubs."""
    found = {p.relative_to(course / "src").as_posix(): extract.exercise_ids(p.read_text())
             for p in sorted((course / "src" / "labkit").glob("lab[0-9]*/*.py"))}
    return {rel: ids for rel, ids in found.items() if ids}


# ------------------------------------------------------------------ one graded copy

@dataclass
class Prepared:
    workspace: Path
    tests: dict                      # trusted: nodeid -> {exercise, points, test, file, ...}
    student: dict = field(default_factory=dict)     # merged file -> line ranges of student code
    dropped: list = field(default_factory=list)
    flags: dict = field(default_factory=dict)       # exercise -> [its flags, as text]
    zeroed: dict = field(default_factory=dict)      # exercise -> [the flags that zeroed it]
    tripwires: dict = field(default_factory=dict)   # nodeid -> exercise
    hide: tuple = ()                 # what the child must not see: :func:`hidden`


def collect(workspace: Path, labs: list[str] | None = None) -> dict:
    """The graded tests of the pristine copy (before any student code is in it), of ``labs``."""
    out = workspace.parent / "collected.json"
    env = _base_env(workspace, workspace.parent / "collect-tmp")
    env["LABKIT_GRADE_COLLECT"] = str(out)
    files = sorted(p.relative_to(workspace).as_posix()
                   for p in (workspace / "tests").glob("test_lab[0-9]*_*.py")
                   if not labs or re.match(r"test_lab(\d+)_", p.name).group(1) in labs)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "exercise",
                           "-p", "labkit.grade.collect", "-p", "pytest_timeout",
                           "-p", "no:cacheprovider", *files],
                          cwd=workspace, env=env, capture_output=True, text=True, timeout=600)
    if not out.exists():
        raise RuntimeError(f"collecting the course's graded tests failed:\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _base_env(workspace: Path, tmp: Path) -> dict:
    """The child's environment: the course's src first, every cache and temporary file inside
    ``tmp`` (importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to /tmp/torchinductor_$USER,
    which would be outside it), one thread, no pytest plugin but those named on the command."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LABKIT_", "PYTEST_", "COV_")) and k not in ("PYTHONPATH",)}
    env.update(PYTHONPATH=f"{workspace / 'src/labkit/grade/site'}:{workspace / 'src'}",
               PYTHONDONTWRITEBYTECODE="1",
               TMPDIR=str(tmp), HOME=str(tmp), USER="labkit-student", MPLCONFIGDIR=str(tmp / "mpl"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp / "torchinductor"), TRITON_CACHE_DIR=str(tmp / "triton"),
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONHASHSEED="0",
               GLOO_SOCKET_IFNAME="lo", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return env


def prepare(submission_labkit: Path, workspace: Path, tests: dict) -> Prepared:
    """Merge the submission into the pristine ``workspace`` (already holding the course), read
    its flags, grade as stubs the exercises whose flags zero them, plant the tripwires."""
    prep = Prepared(workspace, tests)
    src = workspace / "src"
    modules = exercise_modules(workspace)
    for rel in sorted(p.relative_to(submission_labkit).as_posix()
                      for p in submission_labkit.rglob("*.py")):
        if f"labkit/{rel}" not in modules and not (src / "labkit" / rel).exists():
            prep.dropped.append(extract.Dropped(f"labkit/{rel}", 0, "the file",
                                                "not a course file: not graded"))
    for rel in modules:
        pristine = (src / rel).read_text()
        student, why = read_submitted(submission_labkit / Path(rel).relative_to("labkit"),
                                      submission_labkit)
        if student == pristine:  # the course's own module: nothing to merge, read or attribute
            continue
        merged = extract.merge(pristine, student, rel, missing=why)
        try:
            found = flags.read(merged, pristine) if merged.taken else {}
        except Exception as exc:  # noqa: BLE001 - a code the reading cannot read is not run
            found = {ex: [flags.Flag("unreadable", rel, f"{exc!r:.80}")]
                     for ex in modules[rel]}
        zero = {ex for ex, fs in found.items() if any(f.zeroes for f in fs)}
        if zero:  # merge again without their code, nor any added code that carries such a flag
            skip = {u for u, ids in merged.units.items() if set(ids) & zero} | \
                {f.unit for fs in found.values() for f in fs if f.zeroes}
            merged = extract.merge(pristine, student, rel, skip=frozenset(skip))
            for ex in zero:
                prep.zeroed[ex] = [str(f) for f in found[ex] if f.zeroes]
        prep.flags.update({ex: [str(f) for f in fs] for ex, fs in found.items() if fs})
        prep.dropped += merged.dropped
        (src / rel).write_text(merged.source)
        if merged.student_lines:
            prep.student[str((src / rel).resolve())] = merged.student_lines
    for file in sorted({t["file"] for t in tests.values()}):
        exercises = sorted({t["exercise"] for t in tests.values() if t["file"] == file})
        with open(workspace / file, "a") as f:
            for ex in exercises:
                name = f"test_{secrets.token_hex(6)}"
                f.write(TRIPWIRE.format(exercise=ex, name=name))
                prep.tripwires[f"{file}::{name}"] = ex
    return prep


# ------------------------------------------------------------------ the children

def run_child(prep: Prepared, files: list[str], exercises: list[str], tmp: Path,
              timeout: float, wall: isolation.Isolation) -> tuple[list[str], str]:
    """Run one child on ``files`` for ``exercises`` behind ``wall``; return the lines of its
    result pipe and a note (its output's tail when it did not finish)."""
    read_fd, write_fd = os.pipe()
    try:  # mode 0: no reopening it by a path (/proc/self/fd/N), from C code too, without the
        os.fchmod(write_fd, 0)  # capability to pass over a file's mode (the child's, walled)
    except OSError:  # (a system with no mode on pipes: nothing walls the child there anyway)
        pass
    env = _base_env(prep.workspace, tmp)
    env["LABKIT_GRADE_SPEC"] = json.dumps({"fd": write_fd, "scratch": str(tmp),
                                           "course": str(prep.workspace), "student": prep.student})
    cmd = [sys.executable, "-m", "pytest", *files, "-p", "labkit.score_table",
           "-p", "labkit.grade.child", "-p", "pytest_timeout", "-p", "no:cacheprovider",
           "-q", "--no-header", "--tb=no", "-rN", "--basetemp", str(tmp / "pytest"),
           "-m", "exercise", *[a for ex in exercises for a in ("--exercise", ex)]]
    proc = subprocess.Popen(wall.wrap(cmd, tmp, prep.hide), cwd=prep.workspace, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, pass_fds=(write_fd,), start_new_session=True)
    os.close(write_fd)
    chunks, tail = [], [b""]

    def read_pipe():
        with os.fdopen(read_fd, "rb") as f:
            for chunk in iter(lambda: f.read(65536), b""):
                if sum(map(len, chunks)) < MAX_PIPE_BYTES:  # a flood is read, not kept
                    chunks.append(chunk)

    def read_output():
        for chunk in iter(lambda: proc.stdout.read(65536), b""):
            tail[0] = (tail[0] + chunk)[-OUTPUT_TAIL:]
    threads = [threading.Thread(target=t, daemon=True) for t in (read_pipe, read_output)]
    for t in threads:
        t.start()
    note = ""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        note = f"the test process ran past {timeout:.0f} s and was stopped"
    finally:
        try:
            os.killpg(proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        wall.sweep()
    for t in threads:
        t.join(10)
    lines = b"".join(chunks).decode(errors="replace").splitlines()
    if not any(line == '{"kind": "done"}' for line in lines):
        note = (note or f"the test process ended before it finished (exit code "
                f"{proc.returncode})") + "\n" + tail[0].decode(errors="replace")[-1500:]
    return lines, note


def read_records(lines: list[str], expected: set[str], tripwires: set[str]) -> tuple[dict, str]:
    """The records of one child's pipe and, if the run must be voided, why (else "").

    The child says when a test starts, then sends its record, one test after the other. One that
    ended without "done" (a crash, the time limit: honest code too) keeps the records of the
    tests it finished, no less its own for coming before the end; the test it was running gets
    a record that says so ("died"), and the tests after it none."""
    records, done, running = {}, False, None
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
            kind = rec["kind"]
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1 and not done:
                continue  # a line cut short by a child stopped mid-write
            return {}, "the result pipe carried a line the grader's plugin did not write"
        if done:
            return {}, "records came after the test run said it was done"
        if kind == "done":
            done = True
        elif kind in ("start", "test"):
            nodeid = rec.get("nodeid")
            if nodeid not in expected and nodeid not in tripwires:
                return {}, f"a record for a test the grader did not ask for ({str(nodeid)[:120]})"
            if nodeid in records:
                return {}, f"two records for one test ({nodeid})"
            if running != (None if kind == "start" else nodeid):
                return {}, f"a record out of the order the tests ran in ({nodeid})"
            if rec.get("tamper"):
                return {}, "; ".join(map(str, rec["tamper"]))
            if kind == "test":
                records[nodeid] = rec
            running = nodeid if kind == "start" else None
    if running and not done:
        records[running] = {"nodeid": running, "outcome": "failed", "died": True}
    for nodeid in sorted(tripwires):
        rec = records.pop(nodeid, None)
        if (rec is None and done) or (rec is not None and rec.get("outcome") != "failed"):
            return {}, ("a tripwire test that must fail " + ("passed" if rec else "sent no result")
                        + ": something in the test process changed the tests' outcomes")
    return records, ""


def grade_prepared(prep: Prepared, exercises: list[str] | None, jobs: int, timeout: float,
                   wall: isolation.Isolation) -> dict:
    """Run every lab's child and return the verdicts {nodeid: result} (trusted)."""
    tests = {n: t for n, t in prep.tests.items() if not exercises or t["exercise"] in exercises}
    labs = sorted({t["exercise"].split(".")[0] for t in tests.values()}, key=int)
    results: dict = {}

    def one(lab: str):
        mine = {n: t for n, t in tests.items() if t["exercise"].split(".")[0] == lab}
        wanted = sorted({t["exercise"] for t in mine.values()} - set(prep.zeroed))
        records, void, note = {}, "", ""
        if wanted:
            files = sorted({t["file"] for t in mine.values() if t["exercise"] in wanted})
            tmp = Path(tempfile.mkdtemp(prefix=f"lab{lab}-", dir=prep.workspace.parent))
            lines, note = run_child(prep, files, wanted, tmp, timeout, wall)
            shutil.rmtree(tmp, ignore_errors=True)
            trips = {n for n, ex in prep.tripwires.items() if ex in wanted}
            records, void = read_records(lines, set(mine), trips)
        for nodeid, t in mine.items():
            results[nodeid] = _decide(t, records.get(nodeid), note, prep.zeroed.get(t["exercise"]),
                                      void)
        for rec in records.values():
            ex = tests.get(rec.get("nodeid"), {}).get("exercise")
            extra = rec.get("flags", []) + ([f"refused at run time: {rec['message'][:300]}"]
                                            if rec.get("message", "").startswith("refused") else [])
            if ex and extra:
                prep.flags.setdefault(ex, []).extend(x for x in extra if x not in prep.flags[ex])
        if void:
            for ex in wanted:
                prep.flags.setdefault(ex, []).append(f"tampering: {void} (the lab's run is void)")

    with ThreadPoolExecutor(max_workers=1 if wall.one_at_a_time else max(1, jobs)) as pool:
        list(pool.map(one, labs))
    return results


def _decide(test: dict, record: dict | None, note: str, zeroed: list | None, void: str) -> dict:
    """The verdict of one test from its record (or its absence)."""
    out = {"exercise": test["exercise"], "points": test["points"], "test": test["test"],
           "outcome": "failed", "message": ""}
    if zeroed:
        out["message"] = "graded as the stub (red flags that zero the exercise): " + \
            " | ".join(zeroed)[:1500]
    elif void:
        out["message"] = f"void: {void}"
    elif record is None or record.get("died"):
        out["message"] = (("the test process died while this test ran (the tests after it did "
                           "not run): " if record else "no result came back for this test: ") +
                          (note.strip() or "the test process ended early or was killed"))[:1500]
    else:
        outcome = record.get("outcome")
        if outcome in LEFT_OUT and outcome not in test.get("may_skip", ()):
            outcome, record = "failed", {"message": f"reported as {outcome!r}, which this test "
                                         "cannot be on this machine"}
        out["outcome"] = outcome if outcome in OUTCOMES else "failed"
        out["message"] = str(record.get("message") or "")
        if record.get("details"):
            out["details"] = str(record["details"])
    return out


def grade_submission(submission: Path, *, course: Path | None = None,
                     exercises: list[str] | None = None, jobs: int = 2, timeout: float = 1200,
                     keep: Path | None = None, collected: dict | None = None,
                     wall: isolation.Isolation | None = None) -> dict:
    """Grade one submission; return the table (plugin._table's schema, plus ``submission``:
    what was dropped, the flags and zeroed exercises, the isolation)."""
    from labkit.score_table import _table, exercise_key

    course = Path(course or course_root())
    wall = wall or isolation.choose()
    started = time.time()
    base = Path(tempfile.mkdtemp(prefix="labkit-grade-"))
    base.chmod(0o755)  # the child may run as another user: it reads the copy, writes nothing here
    try:
        workspace = base / "course"
        copy_course(course, workspace)
        labs = sorted({e.split(".")[0] for e in exercises}) if exercises else None
        tests = collected if collected is not None else collect(workspace, labs=labs)
        sub_root = unpack(Path(submission), base / "submission")
        labkit_dir = find_labkit(sub_root)
        prep = prepare(labkit_dir, workspace, tests)
        prep.hide = hidden(course, base)
        results = grade_prepared(prep, exercises, jobs, timeout, wall)
        table = _table(results)
        table["known_exercises"] = sorted({t["exercise"] for t in tests.values()}, key=exercise_key)
        graded = set(table["exercises"])
        table["submission"] = {
            "path": str(submission), "labkit": str(labkit_dir.relative_to(sub_root))
            if labkit_dir != sub_root else ".", "dropped": [str(d) for d in prep.dropped],
            "zeroed": {e: z for e, z in prep.zeroed.items() if e in graded},
            "flags": {e: f for e, f in sorted(prep.flags.items()) if e in graded},
            "isolation": wall.describe(), "seconds": round(time.time() - started, 1),
            "graded_exercises": exercises or table["known_exercises"]}
        if keep:
            shutil.copytree(workspace, keep, dirs_exist_ok=True)
        return table
    finally:
        shutil.rmtree(base, ignore_errors=True)
