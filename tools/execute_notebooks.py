"""Execute every notebook of the course once, in parallel, and keep the outputs for the book.

    python tools/execute_notebooks.py                 # every page of _toc.yml that is a notebook,
                                                      # and tests/notebooks/*.ipynb; 2 workers
    python tools/execute_notebooks.py labs/02_optimizer_states.ipynb --workers 1

Each notebook (a lab ``.ipynb`` or a chapter's MyST ``.md``) is read exactly as the book build
reads it (myst-nb's own reader), executed by the same function myst-nb's ``cache`` mode calls
(jupyter-cache's ``single_nb_execution``: a fresh kernel, cwd = the notebook's folder, a cell
error stops it), and on success stored in the book's jupyter-cache (``_build/.jupyter_cache``).
``jupyter-book build`` in ``execute_notebooks: cache`` mode (``_config.yml``) then finds every
page there and executes nothing: one execution serves both the notebook check and the site.

Used by ``tests/notebooks/check_notebooks.py`` (the pytest check of ``make test``, one test per
notebook that fails with the failing cell's error) and by ``make notebooks``. Prints a table of
wall and CPU seconds per notebook (CPU: the kernel and everything it started, graders included).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import resource
import sys
import time
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


def _execute(path_text: str) -> dict:
    """Worker: execute one notebook; return its result (the executed notebook as JSON)."""
    import nbformat
    from jupyter_cache.executors.utils import single_nb_execution

    path = Path(path_text)
    nb, read_fmt = read_notebook(path)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    result = single_nb_execution(nb, cwd=str(path.parent), allow_errors=False,
                                 timeout=TIMEOUT, meta_override=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    ok = result.err is None
    return {"path": path_text, "ok": ok, "wall": time.monotonic() - started, "cpu": cpu,
            "error": None if ok else (result.exc_string or repr(result.err)),
            "notebook": nbformat.writes(nb) if ok else None,
            "read_fmt": read_fmt}


def _store(cache, record: dict) -> None:
    """Put an executed notebook in the book's jupyter-cache, keyed as myst-nb will look it up."""
    import nbformat
    from jupyter_cache.base import CacheBundleIn

    nb = nbformat.reads(record["notebook"], as_version=4)
    cache.cache_notebook_bundle(CacheBundleIn(nb, record["path"],
                                              data={"execution_seconds": record["wall"]}),
                                check_validity=False, overwrite=True)


def execute_all(paths: list[Path], workers: int = 2, cache_path: Path = CACHE,
                env: dict | None = None) -> list[dict]:
    """Execute ``paths`` with ``workers`` processes; cache the successes; results in order."""
    from jupyter_cache import get_cache

    cache_path.parent.mkdir(parents=True, exist_ok=True)
    cache = get_cache(str(cache_path))
    results: dict[str, dict] = {}
    # The slowest first, so two workers finish together: labs run graders, so they go first.
    order = sorted(paths, key=lambda p: (p.suffix != ".ipynb", str(p)))
    old_env = dict(os.environ)
    # One thread per kernel (the course's convention): two kernels on two cores, and no OpenMP
    # threads spinning against each other on a loaded machine.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(env or {})
    try:
        with cf.ProcessPoolExecutor(max_workers=max(1, workers),
                                    mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_execute, str(p)): p for p in order}
            for future in cf.as_completed(futures):
                path = futures[future]
                try:
                    record = future.result()
                except Exception as exc:  # noqa: BLE001 - a worker that died still reports
                    record = {"path": str(path), "ok": False, "wall": 0.0, "cpu": 0.0,
                              "error": f"{type(exc).__name__}: {exc}", "notebook": None}
                if record["ok"]:
                    _store(cache, record)
                results[str(path)] = record
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    return [results[str(p)] for p in paths]


def report(results: list[dict], root: Path = ROOT) -> str:
    rows = [f"{'notebook':<48}{'result':>8}{'wall s':>9}{'CPU s':>8}"]
    for r in results:
        name = Path(r["path"]).resolve().relative_to(root).as_posix()
        rows.append(f"{name:<48}{'ok' if r['ok'] else 'FAILED':>8}{r['wall']:>9.1f}{r['cpu']:>8.1f}")
    rows.append(f"{'total':<48}{'':>8}{sum(r['wall'] for r in results):>9.1f}"
                f"{sum(r['cpu'] for r in results):>8.1f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="notebooks (default: every notebook of the book)")
    parser.add_argument("--workers", type=int, default=2, help="parallel kernels (default 2)")
    parser.add_argument("--json", help="also write the results (without notebooks) here")
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
    results = execute_all(paths, workers=args.workers, cache_path=Path(args.cache))
    print(report(results))
    for r in results:
        if not r["ok"]:
            print(f"\n{r['path']} failed:\n{r['error']}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "notebook"} for r in results], indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
