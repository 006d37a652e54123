"""Write the student edition of the course: the repository as git tracks it, without solutions/.

    python tools/student_edition.py ../course-student

The exercise modules in src/labkit are already the stubs (see tools/make_stubs.py), so the copy
is complete for students: labs, book, tests (graders) and labkit.  It refuses to write into a
non-empty folder and checks that no solution marker leaked into the copy.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = ("solutions/",)


def tracked_files(root: Path = ROOT) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def write_student_edition(dest: Path, root: Path = ROOT) -> list[str]:
    """Copy the tracked files except solutions/ to ``dest``; return the copied paths."""
    dest = Path(dest).resolve()
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"DIR={dest} exists and is not empty; choose a new folder")
    if dest == root or root in dest.parents:
        raise ValueError(f"DIR={dest} must be outside the repository {root}")
    copied = []
    for rel in tracked_files(root):
        if rel.startswith(LEFT_OUT) or not (root / rel).is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
        copied.append(rel)
    leaks = [p for p in copied if p.startswith("src/") and p.endswith(".py")
             and "# BEGIN SOLUTION" in (dest / p).read_text()]
    if leaks:
        raise RuntimeError(f"solution markers in the student edition: {leaks}")
    return copied


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    copied = write_student_edition(Path(argv[0]))
    print(f"wrote {len(copied)} files to {Path(argv[0]).resolve()} (no solutions/)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
