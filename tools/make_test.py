"""`make test`: the checks of the course, two cores kept busy, and the time of each part.

    python tools/make_test.py [--only isolation,stubs,solutions,grader,cheats,two-nodes,lint,notebooks,book,site]

Parts (each starts once the parts it depends on have passed, ``AFTER``, and its cores fit
beside what runs, ``WEIGHT`` and ``--slots``, in the order of ``PRIORITY``; on a failure nothing
new starts, and what runs is waited for and reported):

0. ``isolation`` (only where tools/autograder/ensure_isolation.sh exists): installs what the
   grader's OS isolation needs (bubblewrap, via apt, as tools/ensure_chromium.sh does Chromium),
   before any test runs.
1. The pytest runs: ``solutions`` (every test of tests/ passes with the reference solutions),
   ``stubs`` (every graded test must FAIL on the student stubs), ``two-nodes``
   (tests/test_two_nodes.py: the README's two-node torchrun command, two agents on 127.0.0.1),
   ``grader`` and ``cheats`` (tests/test_grade*.py, the grader's own tests, which grade
   submissions in children: test_grade_cheats.py in a part of its own on two pytest-xdist
   workers, last, so that the two cores share the work to the end), and ``lint`` (``ruff check
   .``; skipped with a message while ruff is not installed);
2. ``notebooks``: nbval (``pytest --nbval-lax``, tools/nbval_book.py) executes every chapter, lab and test
   notebook once, two kernels at a time (pytest-xdist), the slowest first, fails with a
   cell's error, and stores each chapter's outputs in the book's jupyter-cache
   (_build/.jupyter_cache, emptied first so nothing stale is reused).
3. ``book``: the strict site build (-W -n --keep-going), which takes every chapter from that
   cache and executes nothing (it says so if it had to execute a page); the lab pages show the
   labs as students get them (``execute.exclude_patterns`` in _config.yml).
4. ``site``: the checker's own tests (tests/test_site_check.py: planted faults, the calculator
   widget), then every page of the built site in headless Chromium at a laptop and a phone width and
   in dark mode, and printed, offline (tools/site_check.py --strict: a warning fails too;
   without screenshots, which are for people: ``make site-check`` takes them; Debian's
   chromium installed if missing).

Each part's output goes to _build/test-logs/<part>.log; the end of it is printed, the whole of
it when the part fails. At the end: a table of wall and CPU seconds per part (CPU: the part's
processes and all they started, kernels and ranks included).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "_build" / "test-logs"
CACHE = ROOT / "_build" / ".jupyter_cache"
NOTEBOOK_TIMES = LOGS / "notebooks.json"   # each notebook's result and seconds (tools/nbval_book.py)


ISOLATION = ROOT / "tools" / "autograder" / "ensure_isolation.sh"
GRADER_TESTS = "tests/test_grade*.py"  # the grader parts' files; the solutions part ignores them
CHEATS = "test_grade_cheats.py"  # the cheats part's file (the grader part has the others)
SITE_TESTS = "tests/test_site_check.py"  # the site part's (they need Chromium); not the solutions'
SLOTS = 3  # see WEIGHT
NO_RUFF = "lint: skipped, ruff is not installed in .venv (requirements.txt)"


def parts(python: str) -> dict[str, tuple[list[str], dict]]:
    """name -> (command, environment changes); LABKIT_SOLUTIONS where solutions/ exists."""
    from execute_notebooks import earlier_seconds, nbval_command, notebooks

    solutions = ROOT / "solutions"
    with_solutions = {"LABKIT_SOLUTIONS": str(solutions)} if (solutions / "labkit").is_dir() else {}
    pytest = [python, "-m", "pytest", "-p", "no:cacheprovider"]
    jb = str(Path(python).with_name("jupyter-book"))
    ruff = Path(python).with_name("ruff")
    table = {
        "isolation": (["bash", str(ISOLATION)], {}),
        # --durations: the slowest tests, at the end of each log (what to look at when it is slow)
        "stubs": (pytest + ["-q", "-m", "exercise", "--stubs-must-fail", "--tb=no", "--durations=15", "tests"],
                  {"LABKIT_SOLUTIONS": None}),
        "solutions": (pytest + ["-q", "--durations=25", "tests", "--ignore=tests/test_two_nodes.py",
                                f"--ignore={SITE_TESTS}", f"--ignore-glob={GRADER_TESTS}"],
                      with_solutions),
        # three processes (2026-12-06, fresh clones: in one, with ~500 CPU-s, it ran alone on
        # one core for its last 200 s and make test took 902 s; the cheats apart, still alone at
        # the end with 429 CPU-s of 1,458: 915 s; when it had ~400 CPU-s, one process was
        # faster: 815 s against 862 s); the cheats' gradings on two pytest-xdist workers
        "grader": (pytest + ["-q", "--durations=25"] + sorted(
            str(t.relative_to(ROOT)) for t in ROOT.glob(GRADER_TESTS) if t.name != CHEATS),
            with_solutions),
        "cheats": (pytest + ["-q", "-n", "2", "--durations=25", f"tests/{CHEATS}"], with_solutions),
        "two-nodes": (pytest + ["-q", "-rs", "tests/test_two_nodes.py"], with_solutions),
        "lint": ([str(ruff), "check", "."] if ruff.exists() else ["echo", NO_RUFF], {}),
        # the slowest notebooks first, by the last run's times where there was one
        "notebooks": (nbval_command(notebooks(), workers=2, cache_path=CACHE, python=python,
                                    report=NOTEBOOK_TIMES, seconds=earlier_seconds(NOTEBOOK_TIMES)),
                      # a lab's check cells run the exercise's first graded test, not all again:
                      # the solutions part runs them (all 40 checks: ~240 CPU-s, 2026-12-07)
                      {**with_solutions, "LABKIT_CHECK_FIRST_TEST": "1"}),
        "book": ([jb, "build", ".", "-W", "-n", "--keep-going"], with_solutions),
        # the checker's own tests first (planted faults, the calculator): ~75 s, mostly waiting
        # on Chromium, which in the solutions part, one process on the longest chain, held it
        "site": (["bash", "-c", f"tools/ensure_chromium.sh && {shlex.join(pytest)} -q -rs {SITE_TESTS}"
                  f" && {shlex.quote(python)} tools/site_check.py --no-screenshots --strict"],
                 with_solutions),
    }
    if not ISOLATION.is_file():
        del table["isolation"]
    return table


# Each part starts once the parts it names here have passed (parts not selected with --only
# count as passed). The longest chain is notebooks -> book -> site: the notebooks start first.
# How many cores each part keeps busy (pytest-xdist's two workers, two kernels, a torchrun job's
# ranks), and the most that run at once (``--slots``): a part starts once its AFTER parts have
# passed and its weight fits beside what runs (or nothing runs), the first that may in the order
# of ``PRIORITY``, the longest chain first.
# The site check mostly waits on Chromium; the cheats' two workers end last, both cores busy
# to the end (2026-12-07, fresh clones: 873 s wall with every part at once, 848 s with three
# slots but the stubs' one process last and alone).
WEIGHT = {"isolation": 0, "lint": 0, "notebooks": 2, "book": 1, "site": 0, "solutions": 1,
          "stubs": 1, "two-nodes": 2, "grader": 1, "cheats": 2}
PRIORITY = ("isolation", "lint", "notebooks", "book", "site", "solutions", "stubs", "two-nodes",
            "grader", "cheats")
AFTER = {"isolation": (),
         "notebooks": ("isolation",), "solutions": ("isolation",), "grader": ("isolation",),
         "cheats": ("isolation",),
         "two-nodes": ("isolation",), "lint": ("isolation",),
         "stubs": ("isolation",),
         "book": ("notebooks",),
         "site": ("book",)}


def prepare(name: str) -> None:
    """What a part needs before it starts: a fresh cache for the notebooks (the book must show
    what ran just now), a fresh site for the book (keeping that cache)."""
    if name == "notebooks":
        shutil.rmtree(CACHE, ignore_errors=True)
    if name == "book":
        for sub in ("html", ".doctrees", "jupyter_execute"):
            shutil.rmtree(ROOT / "_build" / sub, ignore_errors=True)


class Part:
    def __init__(self, name: str, command: list[str], env: dict):
        self.name, self.command = name, command
        # one intra-op thread per process (unless the caller set one): five parts share two
        # cores, and torch's second thread in each only waits for a core
        self.env = {k: v for k, v in {"OMP_NUM_THREADS": "1", **os.environ, **env}.items()
                    if v is not None}
        self.log = LOGS / f"{name}.log"
        self.returncode: int | None = None
        self.wall = self.cpu = 0.0

    def run(self) -> None:
        """Run in a child that reports its own and its descendants' CPU time (wait4's rusage)."""
        started = time.monotonic()
        with open(self.log, "w") as log:
            proc = subprocess.Popen(self.command, cwd=ROOT, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        self.returncode = proc.returncode
        self.wall = time.monotonic() - started
        self.cpu = usage.ru_utime + usage.ru_stime  # includes every descendant it waited for

    def tail(self, lines: int) -> str:
        text = self.log.read_text(errors="replace").rstrip().splitlines()
        return "\n".join(text[-lines:])


def _notes(part: Part) -> str:
    """What the table says beside a part: the book's cache misses, a skipped lint."""
    if part.name == "book":
        executed = part.log.read_text(errors="replace").count("Executing notebook")
        return f"executed {executed} notebook(s) itself (cache misses)" if executed else "all pages from the cache"
    if part.name == "lint" and part.command[0] == "echo":
        return "skipped: ruff is not installed"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated parts to run (default: all)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--slots", type=int, default=SLOTS,
                        help=f"the most cores' worth of parts run at once, 0: no limit (default {SLOTS})")
    args = parser.parse_args(argv)
    table = parts(args.python)
    only = [p for p in args.only.split(",") if p]
    unknown = [p for p in only if p not in table]
    if unknown:
        parser.error(f"--only takes {', '.join(table)}; got {', '.join(unknown)}")
    LOGS.mkdir(parents=True, exist_ok=True)
    selected = [n for n in PRIORITY if n in table and (not only or n in only)]
    pending, running, passed, done = list(selected), [], set(), []
    failed = None
    started = time.monotonic()
    while pending or running:
        for name in [] if failed else list(pending):  # start what may start
            busy = sum(WEIGHT[p.name] for p, _ in running)
            fits = not args.slots or not running or busy + WEIGHT[name] <= args.slots
            if fits and all(d in passed for d in AFTER[name] if d in selected):
                pending.remove(name)
                prepare(name)
                part = Part(name, *table[name])
                thread = threading.Thread(target=part.run)
                thread.start()
                running.append((part, thread))
                print(f"== {name} started at {time.monotonic() - started:.0f} s", flush=True)
        for part, thread in list(running):  # report what has ended
            thread.join(timeout=0.5 / len(running))
            if thread.is_alive():
                continue
            running.remove((part, thread))
            done.append(part)
            ok = part.returncode == 0
            print(f"-- {part.name}: {'passed' if ok else 'FAILED'} in {part.wall:.0f} s "
                  f"(log: {part.log.relative_to(ROOT)})\n{part.tail(40 if ok else 400)}\n", flush=True)
            if ok:
                passed.add(part.name)
            else:
                failed = failed or part  # nothing new starts; what runs ends and is reported
                pending.clear()
    total = time.monotonic() - started
    print(f"{'part':<12}{'result':>8}{'wall s':>9}{'CPU s':>9}")
    for p in sorted(done, key=lambda p: selected.index(p.name)):
        note = f"   {_notes(p)}" if _notes(p) else ""
        print(f"{p.name:<12}{'passed' if p.returncode == 0 else 'FAILED':>8}{p.wall:>9.0f}{p.cpu:>9.0f}{note}")
    print(f"{'make test':<12}{'FAILED' if failed else 'passed':>8}{total:>9.0f}"
          f"{sum(p.cpu for p in done):>9.0f}   (budget: 900 s wall on 2 cores)")
    if "book" in [p.name for p in done] and not failed:
        print(f"site: {ROOT / '_build' / 'html' / 'index.html'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
