"""What ``labkit-grade`` writes: ``grades.json``, Gradescope's ``results.json``, ``report.txt``, a CSV.

``grades.json`` is :func:`labkit.score_table._table`'s schema plus ``submission`` (what was
dropped, the flags, the isolation); ``results.json`` has only the keys of Gradescope's
specification, and its output text is ``report.txt``; a test that cannot run here is shown skipped.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

from labkit.score_table import LEFT_OUT, OUTCOMES

CSV_FIELDS = ("student", "exercise", "earned", "possible", *OUTCOMES, "zeroed", "flags", "isolation")
SKIPPED = {"needs CUDA": "skipped: needs CUDA, not run on this machine (left out of the total)",
           "not graded": "skipped: an optional reference library is missing here (left out of "
                         "the total)"}


def isolation_line(table: dict) -> str:
    iso = table.get("submission", {}).get("isolation", {"level": "?", "how": "", "guarantees": ""})
    return f"isolation: {iso['level']} ({iso['how']}): {iso['guarantees']}"


def flag_lines(table: dict) -> list[str]:
    """"exercise 1.1 ...: <flag>" for every flag, the zeroed exercises first."""
    zeroed, flagged = (table.get("submission", {}).get(k, {}) for k in ("zeroed", "flags"))
    return [f"exercise {ex} graded as the stub (a red flag that zeroes): {why[0]}"
            for ex, why in zeroed.items()] + [f"exercise {ex} flagged for review: {f}" for ex, fs
                                              in flagged.items() for f in fs if ex not in zeroed]


def not_attempted(table: dict) -> list[str]:
    """The exercises whose every graded test reached the stub, in order."""
    zeroed = table.get("submission", {}).get("zeroed", {})
    return [ex for ex, e in table["exercises"].items() if ex not in zeroed and
            any(t["outcome"] == "not attempted" for t in e["tests"]) and
            all(t["outcome"] in ("not attempted", *LEFT_OUT) for t in e["tests"])]


def report(table: dict) -> str:
    """The text report (also Gradescope's output): isolation, flags, points per exercise, what
    failed in the tests' own words, what was not taken from the submission."""
    sub = table.get("submission", {})
    lines = [f"{table['earned']} / {table['possible']} points; submission {sub.get('path', '?')} "
             f"(labkit at {sub.get('labkit', '?')})", isolation_line(table), *flag_lines(table),
             f"{'exercise':<10}{'points':>10}  outcome counts"]
    for ex_id, e in table["exercises"].items():
        counts = ", ".join(f"{e[k]} {k}" for k in OUTCOMES if e[k])
        flagged = "  [flagged]" if ex_id in sub.get("flags", {}) else ""
        lines.append(f"{ex_id:<10}{e['earned']:>4} / {e['possible']:<4} {counts}{flagged}")
    lines.append(f"{'total':<10}{table['earned']:>4} / {table['possible']:<4}")
    if table.get("cuda_points"):
        lines.append(f"(+ {table['cuda_points']} points that need CUDA: not run here)")
    if not_attempted(table):
        lines.append(f"not attempted (graded as the stub): {', '.join(not_attempted(table))}")
    failed = [(ex, t) for ex, e in table["exercises"].items() for t in e["tests"]
              if t["outcome"] == "failed" and t.get("message")]
    if failed:
        lines += ["what failed, in the tests' own words:",
                  *(f"  {ex} {t['test']}: {t['message'][:300]}" for ex, t in failed[:60])]
    if sub.get("dropped"):
        lines += ["not taken from the submission (the course's version was graded):",
                  *(f"  {d}" for d in sub["dropped"])]
    return "\n".join(lines) + "\n"


def results_json(table: dict) -> dict:
    """Gradescope's results.json: one entry per graded test, the report as its output text."""
    tests = []
    for ex_id, e in table["exercises"].items():
        for t in e["tests"]:
            entry = {"name": f"{ex_id} {t['test']}", "number": ex_id, "visibility": "visible"}
            if t["outcome"] in SKIPPED:
                entry.update(name=f"{entry['name']} [skipped]", output=SKIPPED[t["outcome"]],
                             tags=["skipped"])
            else:
                passed = t["outcome"] == "passed"
                entry.update(score=t["points"] if passed else 0, max_score=t["points"],
                             status="passed" if passed else "failed", output=t.get("message", "")
                             if t["outcome"] != "not attempted" else
                             "not attempted: the stub still raises NotImplementedError")
            tests.append(entry)
    sub = table.get("submission", {})
    return {"score": table["earned"], "execution_time": sub.get("seconds", 0),
            "output": report(table), "visibility": "visible", "stdout_visibility": "hidden",
            "extra_data": {"possible": table["possible"], "isolation": sub.get("isolation"),
                           "flags": sub.get("flags", {})}, "tests": tests}


def csv_rows(student: str, table: dict) -> list[dict]:
    sub = table.get("submission", {})
    return [{"student": student, "exercise": ex_id, **{k: e[k] for k in CSV_FIELDS[2:-3]},
             "zeroed": "; ".join(sub.get("zeroed", {}).get(ex_id, []))[:300],
             "flags": "; ".join(sub.get("flags", {}).get(ex_id, []))[:500],
             "isolation": sub.get("isolation", {}).get("level", "?")}
            for ex_id, e in table["exercises"].items()]


def write_all(table: dict, out: Path) -> None:
    """grades.json, results.json and report.txt into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grades.json").write_text(json.dumps(table, indent=1))
    (out / "results.json").write_text(json.dumps(results_json(table), indent=1))
    (out / "report.txt").write_text(report(table))


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
