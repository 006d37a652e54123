"""nbval runs every notebook of the course once, and what it ran is what the book shows.

    python -m pytest -p tools.nbval_book --nbval-lax --book-cache _build/.jupyter_cache \\
        -n 2 --dist loadfile labs book tests/notebooks

nbval (``--nbval-lax``) executes each notebook in a fresh kernel, one pytest item per code cell,
and fails on a cell error with the cell's source and traceback. This plugin adds three things
to it and changes nothing of how nbval runs or judges a cell:

- **MyST notebooks.** nbval reads only ``.ipynb``; the chapters are MyST Markdown notebooks
  (``book/*.md``). They are read exactly as myst-nb reads them for the book
  (``tools/execute_notebooks.read_notebook``) and handed to nbval's own cell items.
- **The book's cache** (``--book-cache DIR``). A notebook whose every cell passed is stored, with
  its outputs, in the jupyter-cache at DIR, keyed as myst-nb looks a page up (its code cells
  and kernelspec). ``jupyter-book build`` in ``execute_notebooks: cache`` mode then finds each
  page there and executes nothing: one execution is both the check and the book's outputs.
  The outputs are rebuilt from the kernel messages nbval read, with nbformat's
  ``output_from_msg`` (what nbclient uses), in their order; consecutive pieces of one stream
  are one output, as JupyterLab shows them (nbclient keeps each piece, and a table printed
  line by line became one grey box per line on the page); the state of any ipywidgets is
  asked of the kernel at the end (``Widget.get_manager_state``, as ``ipywidgets.embed``
  does) so that the page draws them. Left out: display updates (``update_display_data``),
  which no page of the course uses; a page keeps the first display.
  What it leaves out: nbval is a test runner, not a notebook front end, and does not route
  output into an ipywidgets ``Output`` widget. A notebook that opens one is checked but not
  stored (a line says so); the book then executes that page itself. The labs use such widgets
  and are not executed by the book (``_config.yml``: ``execute.exclude_patterns``).
- **A table** of wall and CPU seconds per notebook at the end (CPU: the kernel and everything it
  started and waited for, graders and ranks included), and ``--book-report FILE``: the same as
  JSON, with the first failing cell's report of each failed notebook.

Two kernels at a time: pytest-xdist with ``--dist loadfile`` (every cell of a notebook on the
same worker, in order). Workers store into the one cache under a file lock.
"""
from __future__ import annotations

import ast
import copy
import fcntl
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from nbformat.v4 import output_from_msg
from nbval.plugin import IPyNbCell, IPyNbFile, find_comment_markers, find_metadata_tags

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tools.execute_notebooks import read_notebook, store  # noqa: E402

RECORD = "nbval_book"  # the user property that carries a notebook's record to the controller
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# Asked of the kernel after the last cell: the widgets' state, if ipywidgets was imported there.
STATE_EXPR = ("__import__('json').dumps(__import__('sys').modules['ipywidgets'].Widget.get_manager_state()"
              " if 'ipywidgets' in __import__('sys').modules else None)")


def pytest_addoption(parser):
    group = parser.getgroup("nbval_book", "the course's notebooks and the book's cache")
    group.addoption("--book-cache", default=None, metavar="DIR",
                    help="store each notebook whose cells all passed in this jupyter-cache")
    group.addoption("--book-report", default=None, metavar="FILE",
                    help="write each notebook's result, wall and CPU seconds here (JSON)")


def is_notebook(path: Path) -> bool:
    """A Jupyter notebook, or a MyST Markdown file that is a notebook (a kernelspec)."""
    return path.suffix == ".ipynb" or (path.suffix == ".md" and read_notebook(path) is not None)


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    """Every notebook is a BookNotebook (in place of nbval's own collector of it)."""
    collected = yield
    option = parent.config.option
    if not (option.nbval or option.nbval_lax) or not is_notebook(file_path):
        return collected
    return [c for c in collected if not isinstance(c, IPyNbFile)] + [
        BookNotebook.from_parent(parent, path=file_path)]


class BookNotebook(IPyNbFile):
    """nbval's notebook, which also keeps the kernel messages it reads and, at the end, stores
    the executed notebook in the book's cache."""

    def collect(self):
        if self.path.suffix == ".ipynb":
            yield from super().collect()
            return
        self.nb = read_notebook(self.path)[0]
        cells = [c for c in self.nb.cells if c.cell_type == "code"]
        for number, cell in enumerate(cells):  # as nbval's collect(), for a notebook read by myst-nb
            options = defaultdict(bool, find_metadata_tags(cell.metadata))
            options.update(dict(find_comment_markers(cell.source)))
            options.setdefault("check", self.compare_outputs)
            yield IPyNbCell.from_parent(self, name=f"Cell {number}", cell_num=number, cell=cell,
                                        options=options)

    def setup(self):
        self.started = time.monotonic()
        self.messages: list[dict] = []
        self.outputs: dict[int, list] = {}
        self.passed = True
        self.last_item = None
        super().setup()

    def get_kernel_message(self, timeout=None, stream="iopub"):
        msg = super().get_kernel_message(timeout=timeout, stream=stream)
        self.messages.append(msg)
        return msg

    def teardown(self):
        record = {"path": str(self.path), "ok": self.passed,
                  "wall": 0.0, "cpu": 0.0, "stored": False, "note": ""}
        kernel_alive = self.kernel is not None and self.kernel.is_alive()
        cache = self.config.option.book_cache
        if kernel_alive and self.passed and cache:
            record["stored"], record["note"] = self.keep_for_book(Path(cache))
        record["cpu"] = _cpu_seconds(self.kernel.km.provisioner.pid) if kernel_alive else 0.0
        super().teardown()
        record["wall"] = time.monotonic() - self.started
        if self.last_item is not None:
            self.last_item.user_properties.append((RECORD, record))

    def keep_for_book(self, cache: Path) -> tuple[bool, str]:
        kinds = {m["content"].get("data", {}).get("state", {}).get("_model_name")
                 for m in self.messages if m["msg_type"] == "comm_open"}
        if "OutputModel" in kinds:
            return False, ("not stored for the book: it opens an ipywidgets Output widget, whose "
                           "contents nbval does not capture")
        nb = copy.deepcopy(self.nb)
        for number, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
            cell.outputs = self.outputs.get(number, [])
        client = self.kernel.kc
        info = client.kernel_info(reply=True, timeout=30)["content"]
        if "language_info" in info:
            nb.metadata["language_info"] = info["language_info"]
        reply = client.execute("", silent=True, store_history=False, reply=True, timeout=60,
                               user_expressions={"state": STATE_EXPR})["content"]
        state = reply.get("user_expressions", {}).get("state", {})
        if state.get("status") == "ok":
            widgets = json.loads(ast.literal_eval(state["data"]["text/plain"]) or "null")
            if widgets and widgets.get("state"):
                nb.metadata["widgets"] = {WIDGET_STATE: widgets}
        with locked(cache):
            store(cache, nb, str(self.path), time.monotonic() - self.started)
        return True, ""


def cell_outputs(messages: list[dict]) -> list:
    """The outputs of the cell whose execution the messages follow, as a notebook keeps them."""
    parents = [m["parent_header"].get("msg_id") for m in messages if m["msg_type"] == "execute_input"]
    outputs, clear = [], False
    for msg in messages:
        if not parents or msg["parent_header"].get("msg_id") != parents[-1]:
            continue
        kind = msg["msg_type"]
        if kind == "clear_output":
            outputs, clear = (outputs, True) if msg["content"].get("wait") else ([], False)
            continue
        if kind not in ("stream", "display_data", "execute_result", "error"):
            continue
        if clear:  # clear_output(wait=True): cleared when the next output comes
            outputs, clear = [], False
        out = output_from_msg(msg)
        if kind == "stream" and outputs and outputs[-1].output_type == "stream" and outputs[-1].name == out.name:
            outputs[-1].text += out.text
        else:
            outputs.append(out)
    return outputs


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    notebook = item.parent if isinstance(item.parent, BookNotebook) else None
    if notebook is not None:
        notebook.messages = []
        notebook.last_item = item
    try:
        return (yield)
    finally:
        if notebook is not None:
            notebook.outputs[item.cell_num] = cell_outputs(notebook.messages)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if isinstance(item.parent, BookNotebook) and (report.failed or report.skipped):
        item.parent.passed = False  # a skipped cell has no outputs: the page would lack them
    return report


class locked:
    """An exclusive lock on ``<cache>.lock`` while a worker writes to the shared cache."""

    def __init__(self, cache: Path):
        cache.parent.mkdir(parents=True, exist_ok=True)
        self.path = cache.with_name(cache.name + ".lock")

    def __enter__(self):
        self.file = open(self.path, "w")
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _cpu_seconds(pid: int | None) -> float:
    """User + system seconds of a process and of the children it waited for (/proc/PID/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return 0.0
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ the controller's report

class Report:
    """Collects each notebook's record (and its first failure) in the process that reports."""

    def __init__(self, config):
        self.config = config
        self.records: dict[str, dict] = {}
        self.failures: dict[str, str] = {}

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        if report.failed and path not in self.failures:
            self.failures[path] = f"{report.nodeid}: {report.longreprtext}"
        for name, value in report.user_properties:
            if name == RECORD:
                self.records[value["path"]] = value

    def results(self) -> list[dict]:
        """One record per notebook (a notebook whose kernel never started: its failure only)."""
        root = self.config.rootpath
        failed = {str(root / path): text for path, text in self.failures.items()}
        records = dict(self.records)
        for path in failed.keys() - records.keys():
            records[path] = {"path": path, "ok": False, "wall": 0.0, "cpu": 0.0, "stored": False, "note": ""}
        return [{**r, "ok": r["ok"] and r["path"] not in failed, "error": failed.get(r["path"])}
                for _, r in sorted(records.items())]

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter):
        results = self.results()
        if not results:
            return
        terminalreporter.write_line("\n" + table(results))
        for r in results:
            if r["note"]:
                terminalreporter.write_line(f"{_name(r['path'])}: {r['note']}")
        if self.config.option.book_report:
            Path(self.config.option.book_report).write_text(json.dumps(results, indent=1))


def _name(path: str) -> str:
    try:
        return Path(path).relative_to(ROOT).as_posix()
    except ValueError:
        return path


def table(results: list[dict]) -> str:
    """Wall and CPU seconds per notebook, and their sums."""
    rows = [f"{'notebook':<48}{'result':>8}{'wall s':>9}{'CPU s':>8}"]
    for r in results:
        rows.append(f"{_name(r['path']):<48}{'ok' if r['ok'] else 'FAILED':>8}{r['wall']:>9.1f}{r['cpu']:>8.1f}")
    rows.append(f"{'total':<48}{'':>8}{sum(r['wall'] for r in results):>9.1f}"
                f"{sum(r['cpu'] for r in results):>8.1f}")
    return "\n".join(rows)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(Report(config), "nbval_book_report")
