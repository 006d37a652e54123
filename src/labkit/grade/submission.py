"""What a student hands in, read without trusting it: a folder or a zip, and its labkit's modules.

A zip gives only its Python files (no absolute paths, no ``..``, no links, within a size cap);
links are never followed (a link may point at the instructor's solutions); a huge file or one
that is not UTF-8 is not read. What is not read is graded as the stub, and the report says why.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import zipfile
from pathlib import Path

MAX_FILE_BYTES = 2 * 2**20      # a student's module larger than this is not read (graded as stub)
MAX_ZIP_BYTES = 64 * 2**20      # the Python files of a zip, unpacked
MAX_ZIP_ENTRIES = 20000


def unpack(submission: Path, into: Path) -> Path:
    """A folder holding the submission: the folder itself, or a zip's Python files in ``into``."""
    submission = Path(submission)
    if submission.is_dir():
        return submission
    if not zipfile.is_zipfile(submission):
        raise ValueError(f"SUBMISSION={submission} must be a folder or a .zip file")
    with zipfile.ZipFile(submission) as z:
        total = 0
        for info in z.infolist()[:MAX_ZIP_ENTRIES]:
            name = info.filename
            if name.startswith("/") or ".." in Path(name).parts or info.is_dir() or \
                    stat.S_ISLNK(info.external_attr >> 16) or not name.endswith(".py") or \
                    info.file_size > MAX_FILE_BYTES:
                continue  # only Python files are ever graded; a huge one is not read
            total += info.file_size
            if total > MAX_ZIP_BYTES:
                raise ValueError(f"SUBMISSION={submission} unpacks to more than "
                                 f"{MAX_ZIP_BYTES // 2**20} MiB of Python files")
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return into


def find_labkit(root: Path) -> Path:
    """The submission's labkit folder (the one holding lab1/ … lab7/): ``root/src/labkit``,
    ``root/labkit``, ``root`` itself, or the same one or two folders down (a zip's wrapper)."""
    def is_labkit(p: Path) -> bool:
        return _real_dir(p) and any(_real_dir(c) and re.fullmatch(r"lab\d+", c.name)
                                    and any(c.glob("*.py")) for c in p.iterdir())

    frontier = [root]
    for _ in range(3):
        nxt = []
        for base in frontier:
            for cand in (base / "src" / "labkit", base / "labkit", base):
                if is_labkit(cand):
                    return cand
            nxt += [d for d in sorted(base.iterdir()) if _real_dir(d) and not d.name.startswith(".")
                    and d.name not in ("__MACOSX", "node_modules", ".venv")]
        frontier = nxt
    raise FileNotFoundError(f"no labkit folder (with lab1/ … lab7/) in the submission {root}")


def _real_dir(p: Path) -> bool:
    """A folder that is no link (a submission's links may point at the instructor's solutions)."""
    return p.is_dir() and not p.is_symlink()


def read_submitted(path: Path, root: Path) -> tuple[str | None, str]:
    """The text of a submitted module and, when it is not taken, why (a link, even to a folder
    above it, a huge file, one that is not UTF-8)."""
    if not path.exists() and not path.is_symlink():
        return None, "missing from the submission"
    real, top = os.path.realpath(path), os.path.realpath(root)
    if path.is_symlink() or not real.startswith(top + os.sep) or any(
            (root / p).is_symlink() for p in path.relative_to(root).parents if str(p) != "."):
        return None, "a link, not a file: links are not followed (a link may point anywhere)"
    if not path.is_file():
        return None, "not a regular file"
    if path.stat().st_size > MAX_FILE_BYTES:
        return None, f"larger than {MAX_FILE_BYTES // 2**20} MiB: not read"
    try:
        return path.read_bytes().decode("utf-8"), ""
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte {exc.start}): Python source is read as UTF-8"
