"""tools/execute_notebooks.py, which make test's notebook check and the book build share: a cell
error is reported with the cell and its traceback, a success lands in the cache the book reads."""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tools import execute_notebooks as ex  # noqa: E402


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_a_cell_error_fails_with_the_cell_and_a_success_is_cached_for_the_book(tmp_path):
    good = _notebook(tmp_path / "good.ipynb", "x = 6 * 7", "print(x)")
    bad = _notebook(tmp_path / "bad.ipynb", "y = 1", "y / 0  # the failing cell")
    cache_path = tmp_path / "cache"
    results = ex.execute_all([good, bad], workers=2, cache_path=cache_path)
    assert [r["ok"] for r in results] == [True, False]
    error = results[1]["error"]
    assert "ZeroDivisionError" in error and "y / 0  # the failing cell" in error
    from jupyter_cache import get_cache

    cache = get_cache(str(cache_path))
    record = cache.match_cache_notebook(ex.read_notebook(good)[0])  # what myst-nb's cache mode does
    outputs = cache.get_cache_bundle(record.pk).nb.cells[1].outputs
    assert outputs[0]["text"].strip() == "42"
    assert results[0]["cpu"] > 0 and "good.ipynb" not in ex.report(results, root=tmp_path).splitlines()[0]


def test_the_book_s_notebooks_are_its_notebook_pages_and_the_test_notebooks():
    pages = ex.notebooks()
    names = [p.relative_to(ROOT).as_posix() for p in pages]
    assert "book/intro.md" in names  # a notebook page: its numbers are computed in the page
    assert all(n.startswith(("book/", "labs/", "tests/notebooks/")) for n in names)
    assert any(n.startswith("labs/") for n in names) and any(n.endswith(".md") for n in names)
