"""Execute notebooks of the course with nbval, once each, and keep the outputs for the book.

    python tools/execute_notebooks.py                 # every notebook page of _toc.yml and
                                                      # tests/notebooks/*.ipynb; 2 kernels
    python tools/execute_notebooks.py labs/02_optimizer_states.ipynb --workers 1

The execution is nbval's (``pytest --nbval-lax`` with the course's plugin tools/nbval_book.py,
two kernels at a time with pytest-xdist): each notebook (a lab ``.ipynb`` or a chapter's MyST
``.md``, read exactly as the book build reads it, with myst-nb's own reader) runs in a fresh
kernel, cwd = its folder, and fails on a cell error with the cell and its traceback; a
notebook whose cells all passed is stored in the book's jupyter-cache
(``_build/.jupyter_cache``), so ``jupyter-book build`` in ``execute_notebooks: cache`` mode
finds the page there and executes nothing. ``make test``'s notebook part runs the same
command (tools/make_test.py); so do ``make notebooks``, the student edition's precomputed
outputs (tools/student_edition.py) and ``make test-gpu``.

Prints a table of wall and CPU seconds per notebook (CPU: the kernel and everything it
started, graders included).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "_build" / ".jupyter_cache"
TIMEOUT = 600  # seconds per cell, as _config.yml's execute.timeout


def toc_files(root: Path = ROOT) -> list[Path]:
    """The pages of _toc.yml (root first), as existing files."""
    import yaml

    toc = yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8"))
    names = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                names.append(entry["file"])
            walk(entry.get("sections"))
            walk(entry.get("chapters"))

    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    walk(toc.get("chapters"))
    found = []
    for name in names:
        for suffix in ("", ".ipynb", ".md"):
            path = root / f"{name}{suffix}"
            if path.is_file():
                found.append(path)
                break
    return found


def read_notebook(path: Path):
    """(notebook, read_fmt) as myst-nb reads the page, or None if it is plain Markdown."""
    from myst_nb.core.config import NbParserConfig
    from myst_nb.core.read import create_nb_reader
    from myst_parser.config.main import MdParserConfig

    text = path.read_text(encoding="utf-8")
    reader = create_nb_reader(str(path), MdParserConfig(), NbParserConfig(), text)
    if reader is None:
        return None
    return reader.read(text), reader.read_fmt


def notebooks(root: Path = ROOT) -> list[Path]:
    """Every notebook page of the book, then the test notebooks (tests/notebooks/*.ipynb)."""
    pages = [p for p in toc_files(root) if read_notebook(p) is not None]
    return pages + sorted((root / "tests" / "notebooks").glob("*.ipynb"))


def store(cache_path: Path, nb, path: str, seconds: float) -> None:
    """Put an executed notebook in a jupyter-cache, keyed as myst-nb will look the page up."""
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache_path.parent.mkdir(parents=True, exist_ok=True)
    get_cache(str(cache_path)).cache_notebook_bundle(
        CacheBundleIn(nb, path, data={"execution_seconds": seconds}), check_validity=False, overwrite=True)


def slowest_first(paths: list[Path], seconds: dict[str, float] | None = None) -> list[Path]:
    """The order in which two kernels finish together: longest first.

    ``seconds``: each notebook's wall time in an earlier run (``--book-report``'s JSON), where
    known; otherwise the labs first (they run graders), then the rest by the size of its code.
    """
    seconds = seconds or {}

    def code_size(p: Path) -> int:
        nb = read_notebook(p)
        return sum(len(c.source) for c in nb[0].cells if c.cell_type == "code") if nb else 0

    def key(p: Path):
        known = seconds.get(str(Path(p).resolve()))
        return (known is None, -(known or 0.0), "/labs/" not in str(p), -code_size(p), str(p))

    return sorted(paths, key=key)


def nbval_command(paths: list[Path], workers: int = 2, cache_path: Path = CACHE,
                  report: Path | None = None, python: str = sys.executable,
                  seconds: dict[str, float] | None = None) -> list[str]:
    """The pytest command that executes ``paths`` with nbval and stores them in the cache.

    xdist hands out whole notebooks in the order given (--no-loadscope-reorder): the slowest
    first (``slowest_first``), so that the two kernels finish together. A kernel may take
    minutes to answer its first message on a loaded 2-core machine (``make test`` runs the
    solutions' tests beside it; nbval's 60 s once failed every cell of a lab that way)."""
    command = [python, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tools.nbval_book", "--nbval-lax",
               "-q", f"--timeout={TIMEOUT}", "--nbval-kernel-startup-timeout=300",
               "--book-cache", str(cache_path)]
    if report is not None:
        command += ["--book-report", str(report)]
    if workers > 1:
        command += ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"]
    return command + [str(p) for p in slowest_first(paths, seconds)]


def earlier_seconds(report: Path) -> dict[str, float]:
    """{notebook: wall seconds} from an earlier run's report, or {} when there is none."""
    try:
        return {r["path"]: r["wall"] for r in json.loads(report.read_text()) if r.get("ok")}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def execute_all(paths: list[Path], workers: int = 2, cache_path: Path = CACHE,
                env: dict | None = None, echo=None) -> list[dict]:
    """Execute ``paths`` with nbval, ``workers`` kernels at a time; cache the successes.

    Returns one record per notebook, in the order of ``paths``: path, ok, wall and cpu
    seconds, stored (in the cache), error (nbval's report of the first failing cell)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = nbval_command(paths, workers, cache_path, report)
        # one thread per kernel (the course's convention): two kernels on two cores
        run_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
        done = subprocess.run(command, cwd=ROOT, env=run_env, capture_output=echo is None, text=True)
        records = {r["path"]: r for r in json.loads(report.read_text())} if report.is_file() else {}
    results = []
    for p in paths:
        r = records.get(str(Path(p).resolve()))
        if r is None:  # not even collected: pytest's own output says why
            output = "" if echo is not None else (done.stdout + done.stderr)[-3000:]
            r = {"path": str(p), "ok": False, "wall": 0.0, "cpu": 0.0, "stored": False,
                 "error": f"nbval did not run it (pytest exit status {done.returncode})\n{output}"}
        results.append(r)
    return results


def report(results: list[dict], root: Path = ROOT) -> str:
    """The table of wall and CPU seconds per notebook."""
    from tools.nbval_book import table

    return table([{**r, "path": str(Path(r["path"]).resolve())} for r in results])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="notebooks (default: every notebook of the book)")
    parser.add_argument("--workers", type=int, default=2, help="parallel kernels (default 2)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--cache", default=str(CACHE),
                        help="the jupyter-cache to store the executed notebooks in "
                             "(default: the book's, _build/.jupyter_cache)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    paths = [Path(p).resolve() for p in args.paths] or notebooks()
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    results = execute_all(paths, workers=args.workers, cache_path=Path(args.cache), echo=print)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
