"""labkit: the toolkit of the course *Where the Memory Goes*.

Infrastructure (complete): ``models`` (the course's GPT and its synthetic data),
``measure`` (bytes by consumer with PyTorch's MemTracker, FLOPs), ``dist`` (launch N real
ranks), ``plot`` (one figure style), ``widgets``, ``grading`` (the pytest plugin behind
``check``).  Exercise modules (``accounting``, ...) are the ones you write in the labs.

Setting ``LABKIT_SOLUTIONS=<path to solutions/>`` before the first ``import labkit`` makes
``import labkit.<module>`` load the reference solution instead of the student stub: the
solutions' ``labkit`` folder is put in front of this package's search path.
"""
from __future__ import annotations

import os as _os

_solutions = _os.environ.get("LABKIT_SOLUTIONS")
if _solutions:
    _overlay = _os.path.join(_os.path.abspath(_solutions), "labkit")
    if not _os.path.isdir(_overlay):
        raise ImportError(
            f"LABKIT_SOLUTIONS={_solutions!r} has no labkit/ folder; "
            "point it at the repository's solutions/ directory or unset it"
        )
    __path__.insert(0, _overlay)  # noqa: F821  (the package's own __path__)

__version__ = "0.1.0"


def check(exercise: str, *, verbose: bool = False) -> bool:
    """Run the graded tests of one exercise (e.g. ``check("1.2")``) and print a short report.

    The tests run in a fresh Python process, so the code you just edited is what gets graded.
    A failed test prints its own message (what was expected, what came back, the likely cause);
    ``verbose=True`` adds the traceback and details. Returns True when every test that could run
    here passed (a test that needs CUDA on a CPU machine, or one whose optional reference
    library is missing, is reported but does not count).
    """
    from labkit.grading import check as _check

    return _check(exercise, verbose=verbose)
