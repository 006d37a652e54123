"""Plant plausible student bugs in a copy of the solutions and report which the graders catch.

Each lab lists its mutants in ``tools/mutants/labN.py``::

    MUTANTS = [
        Mutant("2.5", "lab2/zero1.py", find="flat_grad /= self.world_size", replace="pass",
               why="forgets to average the gradients over the ranks"),
        ...
    ]
    INDEPENDENT = [...]   # a second list, written before reading the graders (optional)

``MUTANTS`` is the list written beside the graders; ``INDEPENDENT`` a second one, written by someone
who had not read them (plausible student bugs, not the graders' own targets). ``--list`` picks
which (default: both, reported apart).

``find`` must occur exactly once in ``solutions/labkit/<file>`` (the runner refuses otherwise,
so a list never silently stops applying). For every mutant the runner copies ``solutions/`` to
a temporary folder, applies the replacement, runs that exercise's graded tests
(``tests/test_labN_*.py -m exercise --exercise ID``) with ``LABKIT_SOLUTIONS`` pointing at the
copy, and counts the mutant *caught* when at least one graded test fails. It prints one line
per mutant with the first failure message the student would see (what ``labkit.check`` prints),
and the catch rate per exercise and per lab; it exits 1 if a lab is below ``--min-rate`` (95%).
Two mutants are graded at a time (``--workers``), one per core.

    .venv/bin/python -m tools.mutants            # every lab that has a list
    .venv/bin/python -m tools.mutants --lab 2    # one lab
    .venv/bin/python -m tools.mutants --lab 2 --only 2.5

Not part of ``make test`` (it runs the graders once per mutant); ``make mutants [LAB=N]`` runs it.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.mutants.mutant import Mutant  # noqa: F401  (the lists import it from here too)

ROOT = Path(__file__).resolve().parents[2]


def _labs(only_lab: int | None) -> list[int]:
    found = sorted(int(p.stem[3:]) for p in (ROOT / "tools" / "mutants").glob("lab*.py"))
    if only_lab is not None:
        if only_lab not in found:
            raise SystemExit(f"--lab {only_lab}: no tools/mutants/lab{only_lab}.py (have {found})")
        return [only_lab]
    return found


def run_mutant(lab: int, mutant, timeout: float = 900) -> dict:
    """Apply one mutant to a copy of solutions/ and run its exercise's graders; return the outcome."""
    with tempfile.TemporaryDirectory(prefix="labkit-mutant-") as tmp:
        copy = Path(tmp) / "solutions"
        shutil.copytree(ROOT / "solutions", copy)
        target = copy / "labkit" / mutant.file
        source = target.read_text()
        if source.count(mutant.find) != 1:
            return {"status": "error", "message": f"find text occurs {source.count(mutant.find)} "
                    f"times in {mutant.file} (must be exactly once)"}
        target.write_text(source.replace(mutant.find, mutant.replace))
        out = Path(tmp) / "grade.json"
        files = sorted(str(p) for p in (ROOT / "tests").glob(f"test_lab{lab}_*.py"))
        cmd = [sys.executable, "-m", "pytest", *files, "-m", "exercise", "--exercise", mutant.exercise,
               "--grade", "--grade-json", str(out), "-q", "--tb=no", "-p", "no:cacheprovider", "-x"]
        env = {**os.environ, "LABKIT_SOLUTIONS": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": "caught", "message": f"graders timed out after {timeout:g} s"}
        if not out.exists():
            return {"status": "error", "message": "the graders did not run"}
        table = json.loads(out.read_text())
    tests = table["exercises"].get(mutant.exercise, {}).get("tests", [])
    failed = [t for t in tests if t["outcome"] in ("failed", "not attempted")]
    if not tests:
        return {"status": "error", "message": f"no graded tests ran for {mutant.exercise}"}
    if failed:
        return {"status": "caught", "message": f"{failed[0]['test']}: {failed[0]['message'][:300]}"}
    return {"status": "SURVIVED", "message": f"{len(tests)} graded tests passed"}


def _order(ex_id: str) -> tuple[int, ...]:
    return tuple(int(p) for p in ex_id.split("."))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lab", type=int, default=None)
    parser.add_argument("--only", default=None, help="one exercise id, e.g. 2.5")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--workers", type=int, default=2,
                        help="mutants graded at the same time (default 2: one per core)")
    parser.add_argument("--list", choices=("both", "mutants", "independent"), default="both",
                        help="which list of each lab: MUTANTS, INDEPENDENT or both (default)")
    parser.add_argument("--min-rate", type=float, default=0.95,
                        help="exit 1 if a lab's catch rate is below this (default 0.95)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    report, bad, low = {}, 0, []
    lists = {"both": ("MUTANTS", "INDEPENDENT"), "mutants": ("MUTANTS",),
             "independent": ("INDEPENDENT",)}[args.list]
    for lab, list_name in [(lab, n) for lab in _labs(args.lab) for n in lists]:
        mutants = getattr(importlib.import_module(f"tools.mutants.lab{lab}"), list_name, None)
        if mutants is None:
            continue
        if args.only:
            mutants = [m for m in mutants if m.exercise == args.only]
        with ThreadPoolExecutor(max_workers=args.workers) as pool:  # each mutant is a subprocess
            results = list(pool.map(lambda m: run_mutant(lab, m), mutants))
        rows, per_exercise = [], {}
        for m, r in zip(mutants, results):
            bad += r["status"] == "error"
            rows.append({"exercise": m.exercise, "file": m.file, "why": m.why, **r})
            tally = per_exercise.setdefault(m.exercise, [0, 0])
            tally[0] += r["status"] == "caught"
            tally[1] += 1
            print(f"[{r['status']:>8}] {m.exercise} {m.why}\n           {r['message']}", flush=True)
        caught = sum(c for c, _ in per_exercise.values())
        rate = caught / len(mutants) if mutants else float("nan")
        for ex_id in sorted(per_exercise, key=_order):
            c, n = per_exercise[ex_id]
            print(f"  exercise {ex_id:<6} {c:>3} / {n:<3} caught ({c / n:.0%})")
        print(f"lab {lab} {list_name}: {caught} / {len(mutants)} mutants caught ({rate:.0%})\n",
              flush=True)
        if mutants and rate < args.min_rate:
            low.append(f"{lab} ({list_name})")
        report[f"{lab} {list_name}"] = {"caught": caught, "total": len(mutants), "rate": rate,
                       "per_exercise": {k: {"caught": c, "total": n} for k, (c, n) in per_exercise.items()},
                       "mutants": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if low:
        print(f"below the {args.min_rate:.0%} catch rate: lab(s) {', '.join(map(str, low))}")
    if bad:
        print(f"{bad} mutant(s) could not be applied or graded (see 'error' lines)")
    return 1 if bad or low else 0


if __name__ == "__main__":
    raise SystemExit(main())
