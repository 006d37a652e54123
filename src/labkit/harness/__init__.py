"""The harnesses that run a student's code for the graders, the labs and ``labkit.cluster``.

``labkit.harness.labN`` holds lab N's per-rank functions (``labkit.ranks.launch`` starts them) and
measurement runs: they build the student's object from ``labkit.labN``, train or run it, and
return plain data (tensors, numbers, byte counts) for a grader to compare with
``labkit.reference.labN``. They are the course's code: a student uses them and does not edit
them (a submission's copy of them is ignored by ``labkit-grade``).

These are the "declared harnesses" of ``tests/test_layout.py``: toolkit modules that may import
lab packages (with ``labkit.cluster``, ``labkit.cross_check`` and ``labkit.widgets``).
"""
