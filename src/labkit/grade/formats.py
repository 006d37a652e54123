"""What ``labkit-grade`` writes: the course's table, Gradescope's results.json, a class CSV.

* ``grades.json``: :func:`labkit.grade.plugin._table`'s schema (exercises, labs, earned, possible,
  each test's outcome and message), plus ``submission``: what was dropped or refused and why.
* ``results.json``: Gradescope's format — ``score``, ``output``, and per test ``name``,
  ``score``, ``max_score``, ``output``, ``visibility``, ``status``. A test this machine cannot
  run (needs CUDA) or could not grade (an optional reference library is missing) has
  ``max_score`` 0: it is shown, and left out of the total.
* the CSV: one row per student per exercise.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

CSV_FIELDS = ("student", "exercise", "earned", "possible", "passed", "failed", "not attempted",
              "needs CUDA", "not graded", "refused")


def results_json(table: dict) -> dict:
    tests = []
    for ex_id, e in table["exercises"].items():
        for t in e["tests"]:
            counts = t["outcome"] not in ("needs CUDA", "not graded")
            status = "passed" if t["outcome"] == "passed" else "failed"
            output = {"passed": "", "not attempted": "not attempted: the stub still raises "
                      "NotImplementedError", "needs CUDA": "needs CUDA: not run on this machine, "
                      "left out of the total", "not graded": "not graded (an optional reference "
                      "is missing): left out of the total"}.get(t["outcome"], "")
            if t["outcome"] in ("failed", "not graded") and t.get("message"):
                output = (output + "\n" if output else "") + t["message"]
            tests.append({"name": f"{ex_id} {t['test']}", "number": ex_id,
                          "score": t["points"] if t["outcome"] == "passed" else 0,
                          "max_score": t["points"] if counts else 0, "status": status,
                          "output": output, "visibility": "visible"})
    sub = table.get("submission", {})
    lines = [f"{table['earned']} / {table['possible']} points"]
    if table.get("cuda_points"):
        lines.append(f"{table['cuda_points']} points need CUDA and were not run here "
                     "(left out of the total)")
    for ex, reasons in sub.get("refused", {}).items():
        lines.append(f"exercise {ex} refused: {reasons[0]}")
    if not_attempted(table):
        lines.append(f"not attempted (graded as the stub): {', '.join(not_attempted(table))}")
    if sub.get("dropped"):
        lines.append("not graded from the submission (the course's version was used):")
        lines += [f"  {d}" for d in sub["dropped"][:40]]
    return {"score": table["earned"], "max_score": table["possible"],
            "output": "\n".join(lines), "visibility": "visible",
            "stdout_visibility": "hidden", "tests": tests}


def not_attempted(table: dict) -> list[str]:
    """The exercises whose every graded test reached the stub (or that were graded as the stub:
    missing, or refused), in order."""
    refused = table.get("submission", {}).get("refused", {})
    return [ex for ex, e in table["exercises"].items()
            if e["tests"] and e["passed"] == 0 and ex not in refused and
            any(t["outcome"] == "not attempted" for t in e["tests"]) and all(
                t["outcome"] in ("not attempted", "needs CUDA", "not graded")
                for t in e["tests"])]


def csv_rows(student: str, table: dict) -> list[dict]:
    refused = table.get("submission", {}).get("refused", {})
    rows = []
    for ex_id, e in table["exercises"].items():
        rows.append({"student": student, "exercise": ex_id, "earned": e["earned"],
                     "possible": e["possible"], "passed": e["passed"], "failed": e["failed"],
                     "not attempted": e["not attempted"], "needs CUDA": e["needs CUDA"],
                     "not graded": e["not graded"],
                     "refused": "; ".join(refused.get(ex_id, []))[:300]})
    return rows


def write_all(table: dict, out: Path) -> list[Path]:
    """grades.json, results.json and report.txt into ``out``; returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "grades.json", out / "results.json", out / "report.txt"]
    paths[0].write_text(json.dumps(table, indent=1))
    paths[1].write_text(json.dumps(results_json(table), indent=1))
    paths[2].write_text(report(table))
    return paths


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)


def report(table: dict) -> str:
    """The short text report: per exercise earned/possible, what was refused or dropped."""
    sub = table.get("submission", {})
    lines = [f"submission: {sub.get('path', '?')} (labkit at {sub.get('labkit', '?')})",
             f"{'exercise':<10}{'points':>10}  outcome counts"]
    for ex_id, e in table["exercises"].items():
        counts = ", ".join(f"{e[k]} {k}" for k in ("passed", "failed", "not attempted",
                                                   "needs CUDA", "not graded") if e[k])
        lines.append(f"{ex_id:<10}{e['earned']:>4} / {e['possible']:<4} {counts}")
    lines.append(f"{'total':<10}{table['earned']:>4} / {table['possible']:<4}")
    if table.get("cuda_points"):
        lines.append(f"(+ {table['cuda_points']} points that need CUDA: not run here)")
    if not_attempted(table):
        lines.append(f"not attempted (graded as the stub): {', '.join(not_attempted(table))}")
    for ex, reasons in sub.get("refused", {}).items():
        lines.append(f"refused {ex}: " + "\n    ".join(reasons))
    failed = [(ex, t) for ex, e in table["exercises"].items() for t in e["tests"]
              if t["outcome"] == "failed" and t.get("message")]
    if failed:
        lines.append("what failed, in the tests' own words:")
        lines += [f"  {ex} {t['test']}: {t['message'][:300]}" for ex, t in failed[:60]]
    if sub.get("dropped"):
        lines.append("not taken from the submission (the course's version was graded):")
        lines += [f"  {d}" for d in sub["dropped"]]
    return "\n".join(lines) + "\n"
