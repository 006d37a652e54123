"""``labkit-grade``: grade a submission behind the operating system's wall, decide where no student code runs.

    labkit-grade SUBMISSION --out DIR          # or: python -m labkit.grade SUBMISSION --out DIR
    labkit-grade subs/* --csv class.csv        # many submissions: one CSV row per student per exercise

What a grade guarantees and how the parts fit: docs/grading.md; the trusted parent is
:mod:`.runner`. Nothing here is imported by ``import labkit``.
"""
