"""``labkit-grade``: grade a student's submission where the student's code cannot reach the score.

    labkit-grade SUBMISSION --out DIR          # or: python -m labkit.grade SUBMISSION --out DIR
    labkit-grade subs/* --csv class.csv        # many submissions: one CSV row per student per exercise

SUBMISSION is what a student hands in: their student-edition folder, its ``src/labkit``, or a
zip of either. The parts:

* :mod:`~labkit.grade.extract` — take only the exercise code (and added definitions) out of
  the submission into a pristine copy of the course; list what was dropped;
* :mod:`~labkit.grade.scan` — the static scan of that code (tampering, shortcuts);
* :mod:`~labkit.grade.shortcuts` — per exercise, the library functions it rebuilds;
* :mod:`~labkit.grade.guard` — the run-time guard of the child process (audit hook, shortcut
  wrappers, integrity check);
* :mod:`~labkit.grade.child` and :mod:`~labkit.grade.collect` — the pytest plugins of the
  child and of the trusted collection;
* :mod:`~labkit.grade.runner` — the trusted parent: children, signed records, the verdict;
* :mod:`~labkit.grade.formats` — ``grades.json``, Gradescope's ``results.json``, the CSV;
* :mod:`~labkit.grade.cli` — the command.
"""
