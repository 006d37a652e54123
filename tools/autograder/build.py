"""Write a Gradescope autograder zip: the course (without solutions/), setup.sh, run_autograder.

    python tools/autograder/build.py [_build/autograder.zip]      # or: make autograder

Gradescope unpacks the zip into /autograder/source, runs ``setup.sh`` once (it installs the
course's pinned environment and the course), and for each submission runs ``run_autograder``,
which grades /autograder/submission with ``labkit-grade`` and writes
/autograder/results/results.json (Gradescope's format), grades.json and report.txt.
"""
from __future__ import annotations

import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def build(dest: Path, root: Path = ROOT) -> list[str]:
    """Write the zip to ``dest``; return the names it holds."""
    sys.path.insert(0, str(root / "src"))
    from labkit.grade.runner import course_files

    names = []
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as z:
        for name in ("setup.sh", "run_autograder"):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o100755 << 16
            z.writestr(info, (HERE / name).read_bytes())
            names.append(name)
        for rel in course_files(root):
            z.write(root / rel, rel)
            names.append(rel)
    leaks = [n for n in names if n.startswith("solutions/")]
    if leaks:
        raise RuntimeError(f"solutions in the autograder zip: {leaks[:3]}")
    return names


def main(argv: list[str]) -> int:
    dest = Path(argv[0]) if argv else ROOT / "_build" / "autograder.zip"
    names = build(dest)
    print(f"wrote {dest} ({len(names)} files: setup.sh, run_autograder and the course without "
          "solutions/); upload it as the Gradescope autograder")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
