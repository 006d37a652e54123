"""How much of each exercise module is the student's: exercise lines / lines of the stub file.

The student opens ``src/labkit/labN/<module>.py`` (the stub) and writes the exercises; the rest of
the file is the course's code they read around them. For each exercise module this counts

* ``blocks``: the ``# BEGIN SOLUTION`` … ``# END SOLUTION`` blocks of the solution;
* ``exercise lines``: the lines strictly inside those blocks (what a student writes);
* ``stub lines``: the lines of the generated stub (what the student opens);
* ``share``: exercise lines / stub lines;

and prints one table per lab with the lab's totals, then the course's (Markdown, for a note).

    python tools/student_share.py                 # this checkout
    python tools/student_share.py --root ../main  # another checkout of the course
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = re.compile(r"^\s*# BEGIN SOLUTION \d+\.\d+")
END = re.compile(r"^\s*# END SOLUTION\s*$")


@dataclass(frozen=True)
class Share:
    """One exercise module: ``lab`` ("lab2"), ``module`` ("zero1"), and its counts."""

    lab: str
    module: str
    blocks: int
    exercise_lines: int
    stub_lines: int

    @property
    def share(self) -> float:
        return self.exercise_lines / self.stub_lines if self.stub_lines else 0.0


def exercise_lines(solution: str) -> tuple[int, int]:
    """(blocks, lines inside them) of a solution module's text."""
    blocks = lines = 0
    inside = False
    for line in solution.splitlines():
        if BEGIN.match(line):
            inside, blocks = True, blocks + 1
        elif END.match(line):
            inside = False
        elif inside:
            lines += 1
    return blocks, lines


def shares(root: Path = ROOT) -> list[Share]:
    """One :class:`Share` per exercise module of the course at ``root`` (labs in order)."""
    out = []
    solutions = root / "solutions" / "labkit"
    for solution in sorted(solutions.glob("lab[0-9]*/*.py"), key=lambda p: (int(p.parent.name[3:]), p.stem)):
        stub = root / "src" / "labkit" / solution.relative_to(solutions)
        blocks, lines = exercise_lines(solution.read_text())
        stub_lines = len(stub.read_text().splitlines()) if stub.exists() else 0
        out.append(Share(solution.parent.name, solution.stem, blocks, lines, stub_lines))
    return out


def table(rows: list[Share]) -> str:
    """Markdown: a row per module, the lab's total after its modules, the course's at the end."""
    head = ["| lab | module | blocks | exercise lines | stub lines | share |", "|---|---|--:|--:|--:|--:|"]

    def row(lab, module, items):
        b, e, s = (sum(getattr(r, k) for r in items) for k in ("blocks", "exercise_lines", "stub_lines"))
        return f"| {lab} | {module} | {b} | {e:,} | {s:,} | {e / s:.0%} |" if s else f"| {lab} | {module} | {b} | {e} | 0 | - |"

    lines = list(head)
    for lab in dict.fromkeys(r.lab for r in rows):
        mine = [r for r in rows if r.lab == lab]
        lines += [row(lab, r.module, [r]) for r in mine]
        lines.append(row(f"**{lab}**", f"**{len(mine)} modules**", mine))
    lines.append(row("**course**", f"**{len(rows)} modules**", rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the course checkout (default: this one)")
    args = parser.parse_args(argv)
    if not (args.root / "solutions" / "labkit").is_dir():
        parser.error(f"--root {args.root}: no solutions/labkit/ there (a full course checkout is needed)")
    print(table(shares(args.root)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
