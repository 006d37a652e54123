"""Which modules of a lab do not import, and where: ``python -m labkit.self_check.import_probe 1``.

When no graded test of an exercise could run, the likely cause is a lab file that does not import
(a syntax error, a misspelt import): then :func:`labkit.check` runs this, in a fresh process as
the graders import the lab, and shows the file, the line and the error instead of pytest's "no
tests ran". Prints ``{module: the last lines of its import error}`` as one JSON line.
"""
from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path


def lab_modules(lab: str) -> list[str]:
    """The exercise modules of ``labkit.lab<lab>`` (the files of its folder beside labkit)."""
    folder = Path(__file__).resolve().parents[1] / f"lab{lab}"
    return sorted(f"labkit.lab{lab}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__")


def import_errors(lab: str) -> dict[str, str]:
    """{module: where it failed (the last line of the lab's own files in the traceback) and the
    exception's lines} for each module of the lab that does not import."""
    out = {}
    for module in lab_modules(lab):
        try:
            importlib.import_module(module)
        except BaseException as exc:  # noqa: BLE001 - a SystemExit or KeyboardInterrupt at import too
            lines = traceback.format_exception_only(type(exc), exc)
            frames = traceback.extract_tb(exc.__traceback__)
            where = [f"{f.filename}, line {f.lineno}" for f in frames if "/labkit/lab" in f.filename]
            out[module] = "".join([f"{w}\n" for w in where[-1:]] + lines).strip()
    return out


if __name__ == "__main__":
    print(json.dumps(import_errors(sys.argv[1])))
