"""Write the student edition of the course: the repository as git tracks it, without solutions/.

    python tools/student_edition.py ../course-student

The exercise modules in src/labkit are already the stubs (see tools/make_stubs.py), so the copy
is complete for students: labs, book, tests (graders) and labkit.  It refuses to write into a
non-empty folder and checks that no solution marker leaked into the copy. The instructors'
README (solutions/, make stubs, make test) is replaced by one written for students
(:func:`student_readme`): where to write code, how to check it, the score, the book, Colab.

The chapters and the labs' pages run the reference solutions, which the edition does not have,
so their outputs ship precomputed: ``precomputed/.jupyter_cache`` holds every notebook page of
the book, executed here with the solutions (taken from ``_build/.jupyter_cache`` when ``make
test`` or ``make notebooks`` already ran them, executed now otherwise). The edition's ``make
book`` copies it to ``_build/.jupyter_cache`` and builds the site without executing anything;
a page whose code cells were changed afterwards fails with a message that says why.
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
    (dest / "README.md").write_text(student_readme(root))
    return copied


def _repository_url(root: Path) -> str:
    import re

    text = (root / "_config.yml").read_text()
    match = re.search(r"^repository:\s*\n\s+url:\s*(\S+)", text, re.M)
    return match.group(1) if match else "<the course repository>"


def _labs(root: Path) -> list[tuple[str, str, str]]:
    """(lab folder, notebook, title) for each lab package, from its docstring's first line."""
    import ast

    rows = []
    for init in sorted((root / "src" / "labkit").glob("lab[0-9]*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        title = doc.splitlines()[0].split(":", 1)[-1].strip().rstrip(".") if doc else ""
        lab = init.parent.name
        notebooks = sorted((root / "labs").glob(f"{int(lab[3:]):02d}_*.ipynb"))
        rows.append((lab, notebooks[0].relative_to(root).as_posix() if notebooks else "", title))
    return rows


def student_readme(root: Path = ROOT) -> str:
    """The README of the student edition: for someone who does the labs, not who builds them."""
    title = (root / "README.md").read_text().splitlines()[0].lstrip("# ").strip()
    url = _repository_url(root)
    colab = url.replace("https://github.com/", "https://colab.research.google.com/github/")
    rows = "\n".join(f"| `src/labkit/{lab}/` | [{nb}]({nb}) | {title} |" for lab, nb, title in _labs(root))
    from labkit.grade.flags import MODULES

    allowed = ", ".join(f"`{m}`" for m, flag in MODULES.items() if flag in (None, "threads")
                        and m != "__future__")
    return f"""# {title} — student edition

Your copy of the course: the book, seven labs, and `labkit`, the package you build in them.

## Where you write code

Each lab has one folder, and that folder is the only place you write code:

| you write in | lab notebook | about |
|---|---|---|
{rows}

Each file there holds exercises whose body is
`raise NotImplementedError("exercise 1.2: …")`: replace the `raise` with your code. The file's
header `# ==== exercise N.E: your code ====` marks what is yours, `# ==== given: … ====` what
you read and call but do not change. You may add your own helper functions and classes beside
an exercise. Everything outside `src/labkit/labN/` (`labkit.models`, `labkit.measure`,
`labkit.ranks`, the tests) is the course's toolkit: use it, don't edit it.

## Check your work

In a lab notebook, after an exercise:

    import labkit
    labkit.check("1.2")          # that exercise's graders, in a fresh process

prints what passed and, for what failed, the test's own message (what was expected, what came
back); `labkit.check("1.2", verbose=True)` adds the details.

## Your score

    make grade

runs every graded test on your code and prints a table per lab and exercise (a lab you have
not started is one line) and writes `grades.json`. Tests that need a GPU are reported apart and
left out of a CPU machine's total (run them on Colab's GPU to earn those points).

What your instructors grade: the bodies of the exercise functions and the functions and
classes you add beside them. Code at the top level of a file, changes to the given code and new
files are not taken; calling the library function an exercise rebuilds (PyTorch's SDPA in the
FlashAttention exercise, GradScaler's kernels in the loss scaler, …) is refused while that
exercise is graded. Exercise code may use these modules and names only: {allowed}; any other
module (however it is reached) earns the exercise no points when it is graded, and so does a
module's name looked up by a name you compute (write `torch.float16`, or `getattr(torch,
"float16")`, not `getattr(torch, "float" + bits)`). Where the tests measure torch's work (memory,
FLOPs, saved tensors), keep it in torch: tensors taken to numpy are flagged for the instructor.

## The book

    make book       # builds the site (chapters and lab pages) and prints the path of index.html

The chapters' outputs ship precomputed (`precomputed/`): the site builds without running them.

## Colab

Open a lab from the site (the rocket icon → Colab) or from GitHub: {colab}/blob/main/labs/
Its first cell clones the course and installs `labkit`; run it first, then work in the lab
folder as above. Locally, `make lab` opens the labs in JupyterLab.
"""


PRECOMPUTED = "precomputed/.jupyter_cache"


def _execute_notebooks_module():
    """tools.execute_notebooks, imported by name (its spawned workers import it again)."""
    import importlib

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("tools.execute_notebooks")


def precompute(dest: Path, root: Path = ROOT, source_cache: Path | None = None) -> list[str]:
    """Write ``dest/precomputed/.jupyter_cache`` with every notebook page of ``root``'s book,
    executed with ``root``'s solutions; return the pages (relative paths)."""

    from jupyter_cache import get_cache

    ex = _execute_notebooks_module()
    source_cache = Path(source_cache or root / "_build" / ".jupyter_cache")
    pages = [p for p in ex.toc_files(root) if ex.read_notebook(p) is not None]
    source = get_cache(str(source_cache))

    def match(path):
        try:
            return source.match_cache_notebook(ex.read_notebook(path)[0])
        except KeyError:
            return None

    missing = [p for p in pages if match(p) is None]
    if missing:
        solutions = root / "solutions"
        env = {"LABKIT_SOLUTIONS": str(solutions)} if (solutions / "labkit").is_dir() else {}
        print(f"executing {len(missing)} page(s) not in {source_cache} ...", flush=True)
        results = ex.execute_all(missing, cache_path=source_cache, env=env)
        failed = [r for r in results if not r["ok"]]
        if failed:
            raise RuntimeError(f"{failed[0]['path']} does not execute:\n{failed[0]['error']}")
    target = get_cache(str(Path(dest) / PRECOMPUTED))
    from jupyter_cache.base import CacheBundleIn

    for page in pages:
        record = match(page)
        bundle = source.get_cache_bundle(record.pk)
        target.cache_notebook_bundle(CacheBundleIn(bundle.nb, page.relative_to(root).as_posix(),
                                                   data=record.data or {}),
                                     check_validity=False, overwrite=True)
    readme = Path(dest) / "precomputed" / "README.md"
    readme.write_text(
        "# Precomputed outputs\n\nThe book's chapters and lab pages run the reference solutions, "
        "which this edition does not include. Their outputs, computed with the solutions, are in "
        "`.jupyter_cache`; `make book` copies them to `_build/` and builds the site from them "
        "without executing anything. Do not edit the pages' code cells: a changed cell has no "
        "precomputed output, and `make book` then stops and says so.\n")
    return [p.relative_to(root).as_posix() for p in pages]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    copied = write_student_edition(Path(argv[0]))
    pages = precompute(Path(argv[0]))
    print(f"wrote {len(copied)} files to {Path(argv[0]).resolve()} (no solutions/), and the "
          f"precomputed outputs of {len(pages)} notebook pages in {PRECOMPUTED}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
