"""`make test`: the four checks of the course, two cores kept busy, and the time of each part.

    python tools/make_test.py [--only stubs,solutions,notebooks,book,site]

Parts, in three rounds (a round starts when the previous one has passed):

1. ``stubs`` (every graded test must FAIL on the student stubs) and ``solutions`` (every test
   passes with the reference solutions), side by side: two processes, two cores.
2. ``notebooks``: tests/notebooks/check_notebooks.py executes every chapter and lab once, two
   kernels at a time, fails with a cell's error, and stores the outputs in the book's
   jupyter-cache (_build/.jupyter_cache, emptied first so nothing stale is reused).
3. ``book``: the strict site build (-W -n --keep-going), which takes every page from that
   cache and executes nothing (it says so if it had to execute a page).
4. ``site``: every page of the built site in headless Chromium at a laptop and a phone width and
   in dark mode, offline (tools/site_check.py; Debian's chromium installed if missing).

Each part's output goes to _build/test-logs/<part>.log; the end of it is printed, the whole of
it when the part fails. At the end: a table of wall and CPU seconds per part (CPU: the part's
processes and all they started, kernels and ranks included).
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "_build" / "test-logs"


def parts(python: str) -> dict[str, tuple[list[str], dict]]:
    """name -> (command, environment changes); LABKIT_SOLUTIONS where solutions/ exists."""
    solutions = ROOT / "solutions"
    with_solutions = {"LABKIT_SOLUTIONS": str(solutions)} if (solutions / "labkit").is_dir() else {}
    pytest = [python, "-m", "pytest", "-p", "no:cacheprovider"]
    jb = str(Path(python).with_name("jupyter-book"))
    return {
        "stubs": (pytest + ["-q", "-m", "exercise", "--stubs-must-fail", "--tb=no", "tests"],
                  {"LABKIT_SOLUTIONS": None}),
        "solutions": (pytest + ["-q", "tests"], with_solutions),
        "notebooks": (pytest + ["-q", "-rA", "tests/notebooks/check_notebooks.py"], with_solutions),
        "book": ([jb, "build", ".", "-W", "-n", "--keep-going"], with_solutions),
        "site": (["bash", "-c", f"tools/ensure_chromium.sh && {python} tools/site_check.py"], {}),
    }


ROUNDS = (("stubs", "solutions"), ("notebooks",), ("book",), ("site",))


class Part:
    def __init__(self, name: str, command: list[str], env: dict):
        self.name, self.command = name, command
        self.env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
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


def _book_notes(part: Part) -> str:
    text = part.log.read_text(errors="replace")
    executed = text.count("Executing notebook")
    return f"executed {executed} notebook(s) itself (cache misses)" if executed else "all pages from the cache"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated parts to run (default: all)")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    table = parts(args.python)
    only = [p for p in args.only.split(",") if p]
    unknown = [p for p in only if p not in table]
    if unknown:
        parser.error(f"--only takes {', '.join(table)}; got {', '.join(unknown)}")
    LOGS.mkdir(parents=True, exist_ok=True)
    done: list[Part] = []
    failed = None
    started = time.monotonic()
    for names in ROUNDS:
        names = [n for n in names if not only or n in only]
        if not names:
            continue
        if "notebooks" in names:  # a fresh cache: the book must show what ran just now
            shutil.rmtree(ROOT / "_build" / ".jupyter_cache", ignore_errors=True)
        if "book" in names:  # a fresh site, but keep the cache the notebook check filled
            for sub in ("html", ".doctrees", "jupyter_execute"):
                shutil.rmtree(ROOT / "_build" / sub, ignore_errors=True)
        round_parts = [Part(n, *table[n]) for n in names]
        print(f"== {' + '.join(names)} ...", flush=True)
        threads = [threading.Thread(target=p.run) for p in round_parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in round_parts:
            ok = p.returncode == 0
            print(f"-- {p.name}: {'passed' if ok else 'FAILED'} in {p.wall:.0f} s "
                  f"(log: {p.log.relative_to(ROOT)})\n{p.tail(40 if ok else 400)}\n", flush=True)
            done.append(p)
            failed = failed or (None if ok else p)
        if failed:
            break
    total = time.monotonic() - started
    print(f"{'part':<12}{'result':>8}{'wall s':>9}{'CPU s':>9}")
    for p in done:
        note = f"   {_book_notes(p)}" if p.name == "book" else ""
        print(f"{p.name:<12}{'passed' if p.returncode == 0 else 'FAILED':>8}{p.wall:>9.0f}{p.cpu:>9.0f}{note}")
    print(f"{'make test':<12}{'FAILED' if failed else 'passed':>8}{total:>9.0f}"
          f"{sum(p.cpu for p in done):>9.0f}   (budget: 900 s wall on 2 cores)")
    if "book" in [p.name for p in done] and not failed:
        print(f"site: {ROOT / '_build' / 'html' / 'index.html'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
