"""The trusted side of ``labkit-grade``: build the graded copy, run the children, decide, score.

No student code runs in this process. For one submission it

1. copies the course (git-tracked files, without ``solutions/``) into a fresh folder;
2. lists the graded tests from that pristine copy (:mod:`labkit.grade.collect`): node ids,
   exercises, points, CUDA-only tests — the only list of tests and points it trusts;
3. merges the submission's exercise code in (:mod:`labkit.grade.extract`), scans it
   (:mod:`labkit.grade.scan`) and puts the stub back for every exercise the scan refuses;
4. runs each lab's graded tests in a child ``pytest`` with the guard and the signing plugin
   (:mod:`labkit.grade.child`), a fresh key per child sent on its stdin, the records read from
   an inherited pipe; a record that does not verify, or a test without one, is failed;
5. checks after each child that no file of the copy changed (a child that changed one has its
   results voided, and the copy is restored);
6. scores with :func:`labkit.grade.plugin._table` and returns the table; :mod:`labkit.grade.formats`
   writes it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from labkit.grade import extract, scan
from labkit.grade.guard import ENV as GUARD_ENV

LEFT_OUT = ("solutions/", ".git/")
MAX_FILE_BYTES = 2 * 2**20      # a student's module larger than this is not read (graded as stub)
MAX_ZIP_BYTES = 64 * 2**20      # the Python files of a zip, unpacked
MAX_ZIP_ENTRIES = 20000
MAX_PIPE_BYTES = 32 * 2**20     # what the parent keeps of a child's result pipe
OUTPUT_TAIL = 64 * 2**10        # what the parent keeps of a child's output


def course_root() -> Path:
    """The course the command runs from: the repository holding this labkit (src/labkit → root),
    or ``LABKIT_GRADE_COURSE``."""
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
    return sorted(p for p in files if not p.startswith(LEFT_OUT) and (root / p).is_file())


def copy_course(root: Path, dest: Path) -> None:
    for rel in course_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def exercise_modules(course: Path) -> dict[str, tuple[str, ...]]:
    """{"labkit/lab5/flash_attention.py": ("5.6",), ...}: the pristine modules with stubs."""
    out = {}
    for path in sorted((course / "src" / "labkit").glob("lab[0-9]*/*.py")):
        ids = extract.exercise_ids(path.read_text())
        if ids:
            out[path.relative_to(course / "src").as_posix()] = ids
    return out


# ------------------------------------------------------------------ the submission

def unpack(submission: Path, into: Path) -> Path:
    """A folder holding the submission: the folder itself, or a zip extracted into ``into``."""
    submission = Path(submission)
    if submission.is_dir():
        return submission
    if zipfile.is_zipfile(submission):
        with zipfile.ZipFile(submission) as z:
            total = 0
            for info in z.infolist()[:MAX_ZIP_ENTRIES]:
                name = info.filename
                if name.startswith("/") or ".." in Path(name).parts or info.is_dir():
                    continue
                if stat.S_ISLNK(info.external_attr >> 16):
                    continue
                if not name.endswith(".py") or info.file_size > MAX_FILE_BYTES:
                    continue  # only Python files are ever graded; a huge one is not read
                total += info.file_size
                if total > MAX_ZIP_BYTES:
                    raise ValueError(f"SUBMISSION={submission} unpacks to more than "
                                     f"{MAX_ZIP_BYTES // 2**20} MiB of Python files")
                target = into / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        return into
    raise ValueError(f"SUBMISSION={submission} must be a folder or a .zip file")


def find_labkit(root: Path) -> Path:
    """The submission's labkit folder (the one holding lab1/ … lab7/): ``root/src/labkit``,
    ``root/labkit``, ``root`` itself, or the same one or two folders down (a zip's wrapper)."""
    def is_labkit(p: Path) -> bool:
        return _real_dir(p) and any(_real_dir(c) and re.fullmatch(r"lab\d+", c.name)
                                    and any(c.glob("*.py")) for c in p.iterdir())

    frontier = [root]
    for _ in range(3):
        nxt = []
        for base in frontier:
            for cand in (base / "src" / "labkit", base / "labkit", base):
                if is_labkit(cand):
                    return cand
            nxt += [d for d in sorted(base.iterdir()) if _real_dir(d) and not d.name.startswith(".")
                    and d.name not in ("__MACOSX", "node_modules", ".venv")]
        frontier = nxt
    raise FileNotFoundError(f"no labkit folder (with lab1/ … lab7/) in the submission {root}")


def _real_dir(p: Path) -> bool:
    """A folder that is no link (a submission's links may point at the instructor's solutions)."""
    return p.is_dir() and not p.is_symlink()


def read_submitted(path: Path, root: Path) -> tuple[str | None, str]:
    """The text of a submitted module and, when it is not taken, why: a link (or a file under a
    linked folder) is never followed — it could point at the instructor's solutions —, a huge
    file is not read, a file that is not UTF-8 is not guessed at."""
    if not path.exists() and not path.is_symlink():
        return None, "missing from the submission"
    real, top = os.path.realpath(path), os.path.realpath(root)
    if path.is_symlink() or not real.startswith(top + os.sep) or \
            any(p.is_symlink() for p in path.relative_to(root).parents if str(p) != "." and
                (root / p).is_symlink()):
        return None, "a link, not a file: links are not followed (a link may point anywhere)"
    if not path.is_file():
        return None, "not a regular file"
    if path.stat().st_size > MAX_FILE_BYTES:
        return None, f"larger than {MAX_FILE_BYTES // 2**20} MiB: not read"
    try:
        return path.read_bytes().decode("utf-8"), ""
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte {exc.start}): Python source is read as UTF-8"


# ------------------------------------------------------------------ one graded copy

@dataclass
class Prepared:
    workspace: Path
    tests: dict                      # trusted: nodeid -> {exercise, points, test, file, cuda}
    student: dict = field(default_factory=dict)     # merged file -> ranges
    dropped: list = field(default_factory=list)
    refused: dict = field(default_factory=dict)     # exercise -> [reason]
    added_files: list = field(default_factory=list)


def collect(workspace: Path, timeout: float = 600, labs: list[str] | None = None) -> dict:
    """The graded tests of the pristine copy (run before any student code is in it); with
    ``labs``, only those labs' test files."""
    out = workspace.parent / "collected.json"
    env = _base_env(workspace, workspace.parent / "collect-tmp")
    env["LABKIT_GRADE_COLLECT"] = str(out)
    files = sorted(p.relative_to(workspace).as_posix()
                   for p in (workspace / "tests").glob("test_lab[0-9]*_*.py")
                   if not labs or re.match(r"test_lab(\d+)_", p.name).group(1) in labs)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "exercise",
                           "-p", "labkit.grade.collect", "-p", "no:cacheprovider", *files],
                          cwd=workspace, env=env, capture_output=True, text=True, timeout=timeout)
    if not out.exists():
        raise RuntimeError(f"collecting the course's graded tests failed:\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _base_env(workspace: Path, tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LABKIT_", "PYTEST_", "COV_")) and k not in ("PYTHONPATH",)}
    # torch's compile caches go inside the child's one writable folder: importing torch._dynamo
    # sets TORCHINDUCTOR_CACHE_DIR in os.environ (to /tmp/torchinductor_$USER), and a child that
    # inherited it would create that folder outside tmp, which the guard refuses
    env.update(PYTHONPATH=str(workspace / "src"), PYTHONDONTWRITEBYTECODE="1",
               TMPDIR=str(tmp), HOME=str(tmp), MPLCONFIGDIR=str(tmp / "mpl"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp / "torchinductor"),
               TRITON_CACHE_DIR=str(tmp / "triton"),
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONHASHSEED="0")
    return env


def prepare(submission_labkit: Path, workspace: Path, tests: dict) -> Prepared:
    """Merge the submission into the pristine ``workspace`` (already holding the course)."""
    prep = Prepared(workspace, tests)
    src = workspace / "src"
    modules = exercise_modules(workspace)
    for rel in sorted(p.relative_to(submission_labkit).as_posix()
                      for p in submission_labkit.rglob("*.py")):
        if f"labkit/{rel}" not in modules and not (src / "labkit" / rel).exists():
            prep.added_files.append(f"labkit/{rel}")
            prep.dropped.append(extract.Dropped(f"labkit/{rel}", 0, "the file",
                                                "not a course file: not graded"))
    for rel in modules:
        pristine = (src / rel).read_text()
        student_path = submission_labkit / Path(rel).relative_to("labkit")
        student, why = read_submitted(student_path, submission_labkit)
        merged = extract.merge(pristine, student, rel)
        if student is None and why:
            merged.dropped = [extract.Dropped(rel, 0, "the file", f"{why}: every exercise in "
                                              "it is graded as the stub")]
        refusals = scan.scan(merged, pristine) if merged.taken else []
        if refusals:
            bad = {e for r in refusals for e in r.exercises}
            for r in refusals:
                for e in r.exercises:
                    prep.refused.setdefault(e, []).append(str(r))
            # grade the module again without the refused exercises' code, nor the added
            # definitions (which may be what was refused)
            merged = _without(pristine, student, rel, bad)
            refusals = scan.scan(merged, pristine)
            if refusals:  # an added definition shared with the others: grade the stubs
                for r in refusals:
                    for e in extract.exercise_ids(pristine):
                        prep.refused.setdefault(e, []).append(str(r))
                merged = extract.merge(pristine, pristine, rel)
        prep.dropped += merged.dropped
        (src / rel).write_text(merged.source)
        if merged.student_lines:
            prep.student[str((src / rel).resolve())] = merged.student_lines
    return prep


def _without(pristine: str, student: str, rel: str, refused: set) -> extract.Merged:
    """Merge again with the refused exercises' units taken from the pristine module."""
    import ast

    p_units = extract.units(ast.parse(pristine))
    s_lines = student.splitlines(keepends=True)
    s_tree = ast.parse(student)
    s_units = extract.units(s_tree)
    # rebuild a student text where each refused unit is the pristine one
    spans = []
    for name, unit in p_units.items():
        if set(unit.exercises) & refused and name in s_units:
            node = s_units[name].node
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            p_node = unit.node
            p_start = min([p_node.lineno] + [d.lineno for d in p_node.decorator_list])
            p_text = "".join(pristine.splitlines(keepends=True)[p_start - 1:p_node.end_lineno])
            spans.append((start, node.end_lineno, p_text))
    for start, end, text in sorted(spans, reverse=True):
        s_lines[start - 1:end] = [text]
    return extract.merge(pristine, "".join(s_lines), rel)


def _hashes(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for f in filenames:
            p = os.path.join(dirpath, f)
            try:
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
            except OSError:
                out[os.path.relpath(p, root)] = "unreadable"
    return out


# ------------------------------------------------------------------ the children

def run_child(prep: Prepared, files: list[str], exercises: list[str], tmp: Path,
              timeout: float) -> tuple[dict, str]:
    """Run one child on ``files`` for ``exercises``; return (verified records, a note)."""
    key = secrets.token_bytes(32)
    read_fd, write_fd = os.pipe()
    env = _base_env(prep.workspace, tmp)
    env[GUARD_ENV] = json.dumps({"student": prep.student, "write_roots": [str(tmp)]})
    env["LABKIT_GRADE_FD"] = str(write_fd)
    cmd = [sys.executable, "-m", "pytest", *files, "-p", "labkit.grade.child",
           "-p", "no:cacheprovider", "-q", "--no-header", "--tb=no", "-rN",
           "--basetemp", str(tmp / "pytest"), "-m", "exercise"]
    for ex in exercises:
        cmd += ["--exercise", ex]
    chunks: list[bytes] = []
    proc = subprocess.Popen(cmd, cwd=prep.workspace, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            pass_fds=(write_fd,), start_new_session=True)
    os.close(write_fd)

    kept = [0]

    def reader():
        with os.fdopen(read_fd, "rb") as f:
            for chunk in iter(lambda: f.read(65536), b""):
                if kept[0] < MAX_PIPE_BYTES:  # a flood is read (the child never blocks) but not kept
                    chunks.append(chunk)
                    kept[0] += len(chunk)
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    out_chunks: list[bytes] = []

    def output():
        tail = b""
        for chunk in iter(lambda: proc.stdout.read(65536), b""):
            tail = (tail + chunk)[-OUTPUT_TAIL:]  # a student printing gigabytes costs no memory
        out_chunks.append(tail)
    out_thread = threading.Thread(target=output, daemon=True)
    out_thread.start()
    try:
        proc.stdin.write(key.hex().encode() + b"\n")
        proc.stdin.close()
    except BrokenPipeError:
        pass
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
    thread.join(10)
    out_thread.join(10)
    records, done, bad = {}, False, 0
    expected_seq = 1
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        body, _, mac = line.rpartition("\t")
        good = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(good, mac):
            bad += 1
            continue
        rec = json.loads(body)
        if rec.get("seq") != expected_seq:
            bad += 1
            continue
        expected_seq += 1
        if rec.get("kind") == "test":
            records[rec["nodeid"]] = rec
        elif rec.get("kind") == "done":
            done = True
    if not done and not note:
        note = f"the test process ended before it finished (exit code {proc.returncode})"
    if bad:
        note += (f"; {bad} line(s) on the result pipe did not verify and were ignored"
                 if note else f"{bad} line(s) on the result pipe did not verify and were ignored")
    output = b"".join(out_chunks).decode(errors="replace")
    return records, note + ("" if done else "\n" + output[-1500:])


def grade_prepared(prep: Prepared, exercises: list[str] | None = None, jobs: int = 2,
                   timeout: float = 1200) -> dict:
    """Run every lab's children and return the results {nodeid: record} (trusted)."""
    tests = {n: t for n, t in prep.tests.items() if not exercises or t["exercise"] in exercises}
    by_lab: dict[str, list[str]] = {}
    for nodeid, t in tests.items():
        by_lab.setdefault(t["exercise"].split(".")[0], [])
        if t["exercise"] not in by_lab[t["exercise"].split(".")[0]]:
            by_lab[t["exercise"].split(".")[0]].append(t["exercise"])
    ws = prep.workspace
    before = _hashes(ws)
    original = {rel: (ws / rel).read_bytes() for rel in before}
    _read_only(ws)
    lock = threading.Lock()
    results: dict = {}

    def one(lab: str):
        wanted = [e for e in by_lab[lab] if e not in prep.refused]
        files = sorted({t["file"] for t in tests.values() if t["exercise"] in wanted})
        records, note = ({}, "")
        if wanted:
            tmp = Path(tempfile.mkdtemp(prefix=f"lab{lab}-", dir=ws.parent))
            records, note = run_child(prep, files, wanted, tmp, timeout)
            shutil.rmtree(tmp, ignore_errors=True)
        with lock:
            now = _hashes(ws)
            changed = sorted(k for k, v in now.items() if before.get(k) != v)
            changed += sorted(set(before) - set(now))
            if changed:
                records = {}
                note = ("the course's files were changed while this lab ran (its results are "
                        "void): " + ", ".join(changed[:5]))
                _restore(ws, original)
            for nodeid, t in tests.items():
                if t["exercise"].split(".")[0] != lab:
                    continue
                results[nodeid] = _decide(t, records.get(nodeid), note,
                                          prep.refused.get(t["exercise"]))

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, sorted(by_lab, key=int)))
    return results


def _restore(workspace: Path, original: dict[str, bytes]) -> None:
    """Put the copy back as it was before the children ran (files changed, added or removed)."""
    for dirpath, dirnames, filenames in os.walk(workspace):
        for name in filenames + dirnames:
            os.chmod(os.path.join(dirpath, name), 0o755)
    for dirpath, dirnames, filenames in os.walk(workspace):
        for f in filenames:
            rel = os.path.relpath(os.path.join(dirpath, f), workspace)
            if rel not in original:
                os.unlink(os.path.join(dirpath, f))
    for rel, data in original.items():
        p = workspace / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if not p.exists() or p.read_bytes() != data:
            p.write_bytes(data)
    _read_only(workspace)


def _read_only(workspace: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(workspace):
        for name in filenames + dirnames:
            p = os.path.join(dirpath, name)
            os.chmod(p, os.stat(p).st_mode & ~0o222)


def _decide(test: dict, record: dict | None, note: str, refused: list | None) -> dict:
    """The trusted verdict of one test from its verified record (or its absence)."""
    out = {"exercise": test["exercise"], "points": test["points"], "test": test["test"],
           "outcome": "failed", "message": ""}
    if refused:
        out["message"] = "refused: " + " | ".join(refused)[:1500]
        return out
    if record is None:
        out["message"] = ("no result came back for this test: " + (note.strip() or
                          "the test process ended early or was killed"))[:1500]
        return out
    outcome = record.get("outcome")
    if outcome == "needs CUDA" and not test.get("cuda_only_here"):
        outcome, record = "failed", {**record, "message": "reported as needing CUDA, which this "
                                     "test does not on this machine"}
    if outcome == "not graded" and not test.get("may_be_ungraded", True):
        outcome, record = "failed", {**record, "message": "reported as not graded (an optional "
                                     "reference missing), which this machine has"}
    if outcome not in ("passed", "failed", "not attempted", "needs CUDA", "not graded"):
        outcome = "failed"
    out["outcome"] = outcome
    out["message"] = record.get("message") or ""
    if record.get("details"):
        out["details"] = record["details"]
    return out


def grade_submission(submission: Path, *, course: Path | None = None,
                     exercises: list[str] | None = None, jobs: int = 2, timeout: float = 1200,
                     keep: Path | None = None, collected: dict | None = None) -> dict:
    """Grade one submission; return the table (plugin._table's schema, plus the report)."""
    from labkit.grade.plugin import _table

    course = Path(course or course_root())
    started = time.time()
    base = Path(tempfile.mkdtemp(prefix="labkit-grade-"))
    try:
        workspace = base / "course"
        copy_course(course, workspace)
        labs = sorted({e.split(".")[0] for e in exercises}) if exercises else None
        tests = collected if collected is not None else collect(workspace, labs=labs)
        sub_root = unpack(Path(submission), base / "submission")
        labkit_dir = find_labkit(sub_root)
        prep = prepare(labkit_dir, workspace, tests)
        results = grade_prepared(prep, exercises, jobs, timeout)
        table = _table(results)
        table["known_exercises"] = sorted({t["exercise"] for t in tests.values()},
                                          key=lambda s: tuple(map(int, s.split("."))))
        table["submission"] = {
            "path": str(submission), "labkit": str(labkit_dir.relative_to(sub_root))
            if labkit_dir != sub_root else ".",
            "dropped": [str(d) for d in prep.dropped],
            "refused": prep.refused, "seconds": round(time.time() - started, 1),
            "graded_exercises": exercises or table["known_exercises"]}
        if keep:
            shutil.copytree(workspace, keep, dirs_exist_ok=True)
        return table
    finally:
        for dirpath, dirnames, filenames in os.walk(base):
            for name in dirnames + filenames:
                try:
                    os.chmod(os.path.join(dirpath, name), 0o755)
                except OSError:
                    pass
        shutil.rmtree(base, ignore_errors=True)
