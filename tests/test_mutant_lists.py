"""The planted-bug lists (tools/mutants/labN.py) still apply to today's solutions.

A mutant whose ``find`` text no longer occurs exactly once in its solution module cannot be
planted, so ``make mutants`` would report it as an error instead of testing the graders; this
happens silently when a solution is edited (an argument renamed, a line reformatted). Cheap:
it only reads files."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted(p.stem for p in (ROOT / "tools" / "mutants").glob("lab*.py"))


@pytest.mark.parametrize("lab", LABS)
def test_every_mutant_applies_exactly_once(lab, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    module = importlib.import_module(f"tools.mutants.{lab}")
    mutants = module.MUTANTS + getattr(module, "INDEPENDENT", [])
    broken = []
    for m in mutants:
        source = (ROOT / "solutions" / "labkit" / m.file).read_text()
        if source.count(m.find) != 1:
            broken.append(f"{m.exercise} {m.file}: find text occurs {source.count(m.find)} times: "
                          f"{m.find[:60]!r} ({m.why})")
    assert not broken, f"{lab}: {len(broken)} mutant(s) no longer apply:\n" + "\n".join(broken)
