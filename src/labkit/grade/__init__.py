"""``labkit-grade``: grade a submission behind the operating system's wall, decide where no student code runs.

    labkit-grade SUBMISSION --out DIR          # or: python -m labkit.grade SUBMISSION --out DIR
    labkit-grade subs/* --csv class.csv        # many submissions: one CSV row per student per exercise

What a grade guarantees is in docs/grading.md. The parts: :mod:`.runner`, the trusted parent (the
graded copy, the children, tripwires, the verdict); :mod:`.submission` and :mod:`.extract`, what
is taken from a submission; :mod:`.flags`, its red flags, read in the parent; :mod:`.shortcuts`,
per exercise what it rebuilds (refused); :mod:`.isolation`, the wall around the child;
:mod:`.child` and :mod:`.collect`, the pytest plugins of the child (it reports) and of the trusted
collection; :mod:`.formats`, the outputs; :mod:`.cli`, the command. The child reads each test's
outcome with the suite's own plugin, :mod:`labkit.score_table`.

Nothing here is imported by ``import labkit``: the package root knows nothing of grading.
"""
