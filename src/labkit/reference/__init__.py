"""The references the graders compare against: the course's side, never a student's file.

``labkit.reference.labN`` holds lab N's reference runs — the computations a grader checks a
student's code against: PyTorch's own implementation where one exists (DDP, FSDP2's
``fully_shard``, ``ZeroRedundancyOptimizer``, ``GradScaler``, SDPA, ``parallelize_module``,
``torch.distributed.pipelining``, the PowerSGD hook) and otherwise the plain, unoptimized
computation (one device's training, Adam on the whole batch).

Rule (``tests/test_layout.py``): nothing under ``labkit.reference`` imports a lab package, even
indirectly, so no edit of a student's file can move a value a grade is decided against. The
per-rank functions that run the *student's* code live in ``labkit.harness``.
"""
