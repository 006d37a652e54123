"""The ``labkit-grade`` command (also ``python -m labkit.grade``)."""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from labkit.grade import formats, isolation, runner

    parser = argparse.ArgumentParser(
        prog="labkit-grade", description="Grade submissions in a pristine copy of the course: "
        "only the exercise code is taken from a submission, it runs behind the operating "
        "system's wall, and the score is decided where no student code runs (docs/grading.md).")
    parser.add_argument("submissions", nargs="+", type=Path,
                        help="a student-edition folder, its src/labkit, or a zip of either")
    parser.add_argument("--out", type=Path, help="where to write grades.json, results.json and "
                        "report.txt (with several submissions: one subfolder per submission)")
    parser.add_argument("--csv", type=Path, help="write one row per submission per exercise")
    parser.add_argument("--exercise", action="append", default=[],
                        help="grade only this exercise (repeatable; default: all, or "
                        "LABKIT_GRADE_EXERCISES=1.1,6.3)")
    parser.add_argument("--course", type=Path, help="the course repository (default: the one "
                        "this labkit belongs to, or LABKIT_GRADE_COURSE)")
    parser.add_argument("--jobs", type=int, default=2, help="labs graded at once (default 2)")
    parser.add_argument("--timeout", type=float, default=1200,
                        help="seconds one lab's test process may run (default 1200)")
    parser.add_argument("--isolation", choices=("auto", *isolation.LEVELS),
                        default=os.environ.get("LABKIT_GRADE_ISOLATION", "auto"),
                        help="the wall around student code: auto (the strongest available, the "
                        "default), namespaces or user (refuse to grade without it), none (off: "
                        "every output says so); also LABKIT_GRADE_ISOLATION")
    args = parser.parse_args(argv)
    exercises = args.exercise or [e for e in os.environ.get("LABKIT_GRADE_EXERCISES", "").split(",")
                                  if e.strip()]
    if not args.out and not args.csv:
        parser.error("give --out DIR, --csv FILE, or both")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    missing = [str(s) for s in args.submissions if not s.exists()]
    if missing:
        parser.error(f"no such submission: {', '.join(missing)}")
    try:
        wall = isolation.choose(args.isolation)
    except ValueError as exc:
        parser.error(f"--isolation: {exc}")
    print(formats.isolation_line({"submission": {"isolation": wall.describe()}}), flush=True)
    course = args.course or runner.course_root()
    with tempfile.TemporaryDirectory() as tmp:  # the tests and points, from the pristine course
        runner.copy_course(Path(course), Path(tmp) / "course")
        labs = sorted({e.split(".")[0] for e in exercises}) if exercises else None
        collected = runner.collect(Path(tmp) / "course", labs=labs)
    rows = []
    for sub in args.submissions:
        name = sub.stem if sub.suffix == ".zip" else sub.name
        print(f"grading {sub} ...", flush=True)
        table = runner.grade_submission(sub, course=course, exercises=exercises or None,
                                        jobs=args.jobs, timeout=args.timeout, collected=collected,
                                        wall=wall)
        out = (args.out if len(args.submissions) == 1 else args.out / name) if args.out else None
        if out:
            formats.write_all(table, out)
        print(f"  {table['earned']} / {table['possible']} points" + (f" -> {out}" if out else ""))
        for line in formats.flag_lines(table):
            print(f"  {line[:300]}")
        rows += formats.csv_rows(name, table)
    if args.csv:
        formats.write_csv(rows, args.csv)
        print(f"class table written to {args.csv} ({len(rows)} rows)")
    return 0
