"""The solutions overlay: with ``LABKIT_SOLUTIONS`` set, ``import labkit.labN.<module>`` loads the
reference solution instead of the student's stub.

``LABKIT_SOLUTIONS=<path to solutions/>`` (set by the tests, the notebook runs and the book build;
never by a student) names a folder holding ``labkit/lab1`` … ``labkit/lab7``, the complete
exercise modules. Each lab package calls :func:`solutions_overlay` from its ``__init__.py``,
which puts that lab's solution folder in front of the package's own ``__path__``: the solution's
module is found before the stub beside it. The toolkit is never overlaid: there is one copy of it.
The variable is read once, when this module is first imported.
"""
from __future__ import annotations

import os


def solutions_root() -> str | None:
    """``$LABKIT_SOLUTIONS/labkit``, checked, or None when the variable is unset or empty."""
    solutions = os.environ.get("LABKIT_SOLUTIONS")
    if not solutions:
        return None
    root = os.path.join(os.path.abspath(solutions), "labkit")
    if not os.path.isdir(root):
        raise ImportError(
            f"LABKIT_SOLUTIONS={solutions!r} has no labkit/ folder; "
            "point it at the repository's solutions/ directory or unset it"
        )
    return root


_SOLUTIONS_ROOT = solutions_root()


def solutions_overlay(package_path: list[str], lab: str) -> None:
    """Put ``$LABKIT_SOLUTIONS/labkit/<lab>`` first on a lab package's ``__path__``.

    Called by each ``labkit/labN/__init__.py`` as ``solutions_overlay(__path__, "labN")``: with the
    variable set, ``import labkit.labN.zero1`` finds the solution's module before the stub.
    """
    if _SOLUTIONS_ROOT is None:
        return
    overlay = os.path.join(_SOLUTIONS_ROOT, lab)
    if os.path.isdir(overlay) and overlay not in package_path:
        package_path.insert(0, overlay)
