"""labkit: the package of the course *Where the Memory Goes*.

Two rooms:

* ``labkit/lab1/`` … ``labkit/lab7/``: **the student's room**. Each holds exactly one lab's
  exercise modules (one technique per module, named after it: ``labkit.lab2.zero1``,
  ``labkit.lab5.flash_attention``); the lab package's docstring is the lab's map.
* everything at the top of ``labkit``: **the course's toolkit**, complete and tested: ``models``
  (the course's GPT and its synthetic data), ``measure`` (bytes by consumer with PyTorch's
  MemTracker, FLOPs), ``ranks`` (launch N real ranks), ``plot`` (one figure style), ``widgets``,
  ``self_check`` (``labkit.check``), ``grade`` (the grader), ``cluster`` (the demos under
  torchrun), the references the graders compare with (``reference``) and the harnesses that run
  a student's code (``harness``). Use it; don't edit it.

The root exports :func:`check` and the torch it needs (``MIN_TORCH``, ``TORCH_APIS``), and
refuses an older torch at import (:mod:`labkit.torch_version`). With ``LABKIT_SOLUTIONS`` set,
the lab packages load the reference solutions instead of the stubs (:mod:`labkit.overlay`).
"""
from labkit.torch_version import MIN_TORCH, TORCH_APIS, check_installed_torch

check_installed_torch()  # before anything imports torch: an old one is named, not a crash in a lab

from labkit.self_check import check  # noqa: E402 - after the gate

__version__ = "0.1.0"
__all__ = ["check", "MIN_TORCH", "TORCH_APIS", "__version__"]
