"""Generate the student edition of each exercise module from its reference solution.

``solutions/labkit/labN/<module>.py`` is the complete module.  Each exercise body in it sits between

    # BEGIN SOLUTION 1.2: <one line saying what to write>
    ...
    # END SOLUTION

``src/labkit/labN/<module>.py`` is the same file with each marked block replaced by
``raise NotImplementedError("exercise 1.2: <what to write> (labs/01_....ipynb)")`` at the
block's indentation.  Never edit a stub by hand: run ``make stubs`` (this script); a test
(`tests/test_stubs.py`) fails when a committed stub differs from what this script writes.

    python tools/make_stubs.py           # rewrite every stub
    python tools/make_stubs.py --check   # list the stubs that differ; exit 1 if any
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<id>\d+\.\d+)(?::\s*(?P<hint>.*\S))?\s*$")
END = re.compile(r"^[ \t]*# END SOLUTION\s*$")


def lab_notebook(exercise_id: str, root: Path = ROOT) -> str:
    """The lab notebook that teaches an exercise: labs/0L_*.ipynb for exercise L.E."""
    lab = int(exercise_id.split(".")[0])
    found = sorted((root / "labs").glob(f"{lab:02d}_*.ipynb"))
    if not found:
        raise FileNotFoundError(f"exercise {exercise_id}: no labs/{lab:02d}_*.ipynb")
    return found[0].relative_to(root).as_posix()


def make_stub(source: str, path: str = "<solution>", root: Path = ROOT) -> str:
    """Replace every marked solution block of ``source`` by a NotImplementedError."""
    out, block = [], None
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        if block is None:
            m = BEGIN.match(line)
            if m:
                if not m["hint"]:
                    raise ValueError(f"{path}:{number}: BEGIN SOLUTION {m['id']} needs ': <hint>'")
                block = m
                continue
            if END.match(line):
                raise ValueError(f"{path}:{number}: END SOLUTION without BEGIN")
            out.append(line)
        elif BEGIN.match(line):
            raise ValueError(f"{path}:{number}: nested BEGIN SOLUTION")
        elif END.match(line):
            hint = block["hint"].replace("\\", "\\\\").replace('"', '\\"')
            message = f"exercise {block['id']}: {hint} ({lab_notebook(block['id'], root)})"
            out.append(f'{block["indent"]}raise NotImplementedError("{message}")\n')
            block = None
    if block is not None:
        raise ValueError(f"{path}: BEGIN SOLUTION {block['id']} is never closed")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stubs that differ")
    args = parser.parse_args(argv)
    differ = []
    solutions = ROOT / "solutions" / "labkit"
    for solution in sorted(solutions.glob("lab[0-9]*/*.py")):
        stub_path = ROOT / "src" / "labkit" / solution.relative_to(solutions)
        stub = make_stub(solution.read_text(), str(solution.relative_to(ROOT)))
        current = stub_path.read_text() if stub_path.exists() else None
        if current != stub:
            differ.append(stub_path.relative_to(ROOT).as_posix())
            if not args.check:
                stub_path.write_text(stub)
    if args.check and differ:
        print("stubs that differ from their solutions (run `make stubs`):", *differ, sep="\n  ")
        return 1
    for path in differ:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
