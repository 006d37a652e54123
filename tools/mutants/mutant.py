"""One planted bug: replace ``find`` (exactly once) by ``replace`` in ``solutions/labkit/<file>``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    exercise: str
    """The exercise whose graders must catch it, e.g. ``"2.5"``."""
    file: str
    """The module under ``solutions/labkit``, e.g. ``"lab2/zero1.py"``."""
    find: str
    """Text that occurs exactly once in that file."""
    replace: str
    """What a plausible wrong solution has there instead."""
    why: str
    """The mistake, in a student's terms (``"forgets to average over the ranks"``)."""
