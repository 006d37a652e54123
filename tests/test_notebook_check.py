"""tools/execute_notebooks.py and tools/nbval_book.py: nbval executes each notebook once; a cell
error is reported with the cell and its traceback; a success lands in the cache the book reads,
with the outputs a notebook front end (nbclient, what the book would otherwise run) keeps."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tools import execute_notebooks as ex  # noqa: E402
from tools import nbval_book  # noqa: E402

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = KERNELSPEC
    nbformat.write(nb, path)
    return path


def _cached(cache_path: Path, path: Path):
    """The cached notebook that myst-nb's cache mode would match for the page at path."""
    from jupyter_cache import get_cache

    cache = get_cache(str(cache_path))
    record = cache.match_cache_notebook(ex.read_notebook(path)[0])
    return cache.get_cache_bundle(record.pk).nb


def test_a_cell_error_fails_with_the_cell_and_a_success_is_cached_for_the_book(tmp_path):
    good = _notebook(tmp_path / "good.ipynb", "x = 6 * 7", "print(x)")
    bad = _notebook(tmp_path / "bad.ipynb", "y = 1", "y / 0  # the failing cell")
    cache_path = tmp_path / "cache"
    results = ex.execute_all([good, bad], workers=2, cache_path=cache_path)
    assert [r["ok"] for r in results] == [True, False]
    error = results[1]["error"]
    assert "ZeroDivisionError" in error and "y / 0  # the failing cell" in error
    assert _cached(cache_path, good).cells[1].outputs[0]["text"].strip() == "42"
    assert results[1]["stored"] is False
    assert results[0]["cpu"] > 0 and "good.ipynb" not in ex.report(results).splitlines()[0]


# Outputs of every kind a page shows, in an order a simple collector would get wrong: stream
# pieces around a display (nbval's own comparison merges all of a cell's prints into one),
# stderr, clear_output(wait=True), an expression's value, and an ipywidget with its state.
FRONT_END_CELLS = (
    "from IPython.display import HTML, display, clear_output\nprint('a')\ndisplay(HTML('<b>b</b>'))\nprint('c')",
    "import sys\nprint('to stderr', file=sys.stderr)\nprint('to stdout')",
    "print('cleared')\nclear_output(wait=True)\nprint('kept')",
    "6 * 7",
    "import ipywidgets\nslider = ipywidgets.IntSlider(value=3, description='n')\ndisplay(slider)",
)


def _comparable(nb):
    """Outputs without what differs between any two runs (execution counts, widget model ids),
    and the widgets' kinds and values."""
    nb = copy.deepcopy(nb)
    state = nb.metadata.get("widgets", {}).get(nbval_book.WIDGET_STATE, {}).get("state", {})
    names = {mid: model["model_name"] for mid, model in state.items()}
    cells = []
    for cell in nb.cells:
        outputs = []
        for out in cell.outputs:
            out.pop("execution_count", None)
            view = out.get("data", {}).get("application/vnd.jupyter.widget-view+json")
            if view:
                view["model_id"] = names.get(view["model_id"], "a model not in the saved state")
                out["data"].pop("text/plain", None)  # holds the model id too
            outputs.append(dict(out))
        cells.append(outputs)
    sliders = sorted(m["state"].get("value") for m in state.values() if m["model_name"] == "IntSliderModel")
    return cells, sliders


def test_the_book_gets_the_outputs_a_notebook_front_end_keeps(tmp_path):
    """The same notebook run by nbclient (jupyter-cache's executor, the book's own) and by nbval
    with the plugin: the same outputs in the same order and the same widget state."""
    from nbclient import NotebookClient

    path = _notebook(tmp_path / "kinds.ipynb", *FRONT_END_CELLS)
    results = ex.execute_all([path], workers=1, cache_path=tmp_path / "cache")
    assert results[0]["ok"], results[0]["error"]
    ours = _cached(tmp_path / "cache", path)
    reference = nbformat.read(path, as_version=4)
    NotebookClient(reference, timeout=60, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert _comparable(ours) == _comparable(reference)
    cells, sliders = _comparable(ours)
    assert [o.get("text") for o in cells[0]] == ["a\n", None, "c\n"], cells[0]
    assert sliders == [3] and ours.metadata["language_info"]["name"] == "python"


def test_a_table_printed_line_by_line_is_one_output_not_a_box_per_line(tmp_path):
    """Three lines printed a moment apart reach the front end as three stream messages: nbclient
    keeps three outputs (three boxes on the page), the book gets one, with the same text."""
    from nbclient import NotebookClient

    source = ("import sys, time\nfor row in ('a  1', 'b  2', 'c  3'):\n"
              "    print(row); sys.stdout.flush(); time.sleep(0.3)")
    path = _notebook(tmp_path / "rows.ipynb", source)
    assert ex.execute_all([path], workers=1, cache_path=tmp_path / "cache")[0]["ok"]
    ours = _cached(tmp_path / "cache", path).cells[0].outputs
    reference = nbformat.read(path, as_version=4)
    NotebookClient(reference, timeout=60, kernel_name="python3").execute()
    pieces = reference.cells[0].outputs
    assert len(pieces) == 3, pieces  # the reference shows the problem: one box per line
    assert [o["output_type"] for o in ours] == ["stream"]
    assert ours[0]["text"] == "".join(p["text"] for p in pieces) == "a  1\nb  2\nc  3\n"


MYST_PAGE = """---
jupytext: {text_representation: {format_name: myst}}
kernelspec: {name: python3, display_name: Python 3, language: python}
---
# A chapter

```{code-cell} ipython3
print(6 * 7)
```
"""


def test_a_myst_chapter_is_run_by_nbval_and_cached_as_myst_nb_reads_it(tmp_path):
    page = tmp_path / "chapter.md"
    page.write_text(MYST_PAGE)
    plain = tmp_path / "notes.md"
    plain.write_text("# Notes\n\nNo code here.\n")
    assert nbval_book.is_notebook(page) and not nbval_book.is_notebook(plain)
    results = ex.execute_all([page], workers=1, cache_path=tmp_path / "cache")
    assert results[0]["ok"] and results[0]["stored"], results[0]
    assert _cached(tmp_path / "cache", page).cells[0].outputs[0]["text"] == "42\n"  # (the cache keeps code cells)


def test_a_notebook_with_an_output_widget_is_checked_but_not_cached(tmp_path):
    """nbval does not route output into an ipywidgets Output widget as a front end does: the
    notebook passes the check, is left out of the cache, and the report says why."""
    path = _notebook(tmp_path / "out.ipynb", "import ipywidgets\nout = ipywidgets.Output()\n"
                     "display(out)\nwith out:\n    print('inside')")
    results = ex.execute_all([path], workers=1, cache_path=tmp_path / "cache")
    assert results[0]["ok"] and not results[0]["stored"], results[0]
    assert "Output widget" in results[0]["note"]
    with pytest.raises(KeyError):
        _cached(tmp_path / "cache", path)


def test_cell_outputs_follow_only_the_cell_s_own_messages():
    """Messages of another request (a late print of an earlier cell) are not this cell's."""
    def msg(kind, parent, **content):
        return {"msg_type": kind, "parent_header": {"msg_id": parent}, "header": {"msg_type": kind},
                "content": content}

    messages = [msg("stream", "old", name="stdout", text="late\n"),
                msg("execute_input", "me", code="print(1)"),
                msg("stream", "me", name="stdout", text="1\n"),
                msg("stream", "me", name="stdout", text="2\n"),
                msg("status", "me", execution_state="idle")]
    assert [dict(o) for o in nbval_book.cell_outputs(messages)] == [
        {"output_type": "stream", "name": "stdout", "text": "1\n2\n"}]


def test_the_book_s_notebooks_are_its_notebook_pages_and_the_test_notebooks():
    pages = ex.notebooks()
    names = [p.relative_to(ROOT).as_posix() for p in pages]
    assert "book/intro.md" in names  # a notebook page: its numbers are computed in the page
    assert all(n.startswith(("book/", "labs/", "tests/notebooks/")) for n in names)
    assert any(n.startswith("labs/") for n in names) and any(n.endswith(".md") for n in names)


def test_the_slowest_notebooks_go_first_so_that_two_kernels_finish_together(tmp_path):
    """By the last run's times where known; else labs (they run graders), then the most code."""
    (tmp_path / "labs").mkdir()
    small = _notebook(tmp_path / "small.ipynb", "x = 1")
    big = _notebook(tmp_path / "big.ipynb", "y = 2\n" * 50)
    lab = _notebook(tmp_path / "labs" / "lab.ipynb", "z = 3")
    timed = _notebook(tmp_path / "timed.ipynb", "w = 4")
    assert ex.slowest_first([small, big, lab]) == [lab, big, small]
    seconds = {str(small.resolve()): 90.0, str(timed.resolve()): 30.0}
    assert ex.slowest_first([big, timed, lab, small], seconds) == [small, timed, lab, big]
    report = tmp_path / "report.json"
    report.write_text('[{"path": "/a.md", "ok": true, "wall": 3.5}, {"path": "/b.md", "ok": false, "wall": 1}]')
    assert ex.earlier_seconds(report) == {"/a.md": 3.5}
    assert ex.earlier_seconds(tmp_path / "none.json") == {}
