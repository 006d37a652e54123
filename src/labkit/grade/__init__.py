"""``labkit-grade``: grade a submission behind the operating system's wall, decide where no student code runs.

    labkit-grade SUBMISSION --out DIR          # or: python -m labkit.grade SUBMISSION --out DIR
    labkit-grade subs/* --csv class.csv        # many submissions: one CSV row per student per exercise

The parts (docs/grading.md says what a grade guarantees):

* :mod:`~labkit.grade.extract` — take only the exercise code (and added definitions) out of a
  submission into a pristine copy of the course; list what was dropped;
* :mod:`~labkit.grade.flags` — the red flags of that code, read in the trusted parent; a few
  zero the exercise, the others are for the instructor's review;
* :mod:`~labkit.grade.shortcuts` — per exercise, what it rebuilds (refused);
* :mod:`~labkit.grade.isolation` — the wall around the child at the operating system;
* :mod:`~labkit.grade.child` and :mod:`~labkit.grade.collect` — the pytest plugins of the
  child (it reports) and of the trusted collection;
* :mod:`~labkit.grade.runner` — the trusted parent: children, tripwires, the verdict;
* :mod:`~labkit.grade.formats` — ``grades.json``, Gradescope's ``results.json``, the CSV;
* :mod:`~labkit.grade.cli` — the command.

The child reads each test's outcome with the suite's own plugin, :mod:`labkit.score_table`.

Nothing here is imported by ``import labkit``: the package root knows nothing of grading.
"""
