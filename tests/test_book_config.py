"""The book's configuration: table of contents, lab set-up cells, offline site.

The built site is checked only when `_build/html` exists (after `make book`).
"""
import fnmatch
import importlib.util
import os
import re
import subprocess
import sys
import types
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
TOC = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
SPHINX = CONFIG["sphinx"]["config"]
STATIC = ROOT / SPHINX["html_static_path"][0]
SITE = ROOT / "_build" / "html"
LABS = sorted((ROOT / "labs").glob("*.ipynb"))


def _lab_setup_cell():
    path = ROOT / "tools" / "lab_setup_cell.py"
    spec = importlib.util.spec_from_file_location("lab_setup_cell", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toc_files():
    """Every `file:` of _toc.yml in order, root first (without suffix)."""
    files = [TOC["root"]]

    def walk(entries):
        for entry in entries:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections", []))

    for part in TOC.get("parts", [{"chapters": TOC.get("chapters", [])}]):
        walk(part["chapters"])
    return files


def _source(doc):
    """The source file of a toc entry (its suffix may be left out in _toc.yml)."""
    if Path(doc).suffix in (".md", ".ipynb"):
        return ROOT / doc
    found = [ROOT / (doc + suffix) for suffix in (".md", ".ipynb")]
    found = [path for path in found if path.exists()]
    return found[0] if len(found) == 1 else None


# --- table of contents -------------------------------------------------------------------------

def test_every_toc_entry_has_exactly_one_source_file():
    for doc in _toc_files():
        assert _source(doc) is not None, f"_toc.yml lists {doc}: no single {doc}.md or {doc}.ipynb"


def test_every_chapter_and_lab_is_in_the_toc():
    listed = {_source(doc).relative_to(ROOT).as_posix() for doc in _toc_files() if _source(doc)}
    pages = sorted((ROOT / "book").glob("0*.md")) + LABS
    missing = [p.relative_to(ROOT).as_posix() for p in pages]
    missing = [name for name in missing if name not in listed]
    assert not missing, f"not in _toc.yml (only_build_toc_files would skip them): {missing}"


def test_each_lab_follows_its_chapter_in_the_toc():
    files = _toc_files()
    for i, doc in enumerate(files):
        if doc.startswith("labs/"):
            number = Path(doc).name[:2]
            assert i > 0 and files[i - 1].startswith(f"book/{number}"), (
                f"{doc} should come right after book/{number}_*.md in _toc.yml")


def test_chapters_are_myst_notebooks_with_the_python3_kernel():
    for chapter in sorted((ROOT / "book").glob("0*.md")):
        front = chapter.read_text(encoding="utf-8").split("---")[1]
        meta = yaml.safe_load(front)
        assert meta["kernelspec"]["name"] == "python3", chapter.name
        assert meta["jupytext"]["text_representation"]["format_name"] == "myst", chapter.name


# --- build settings ----------------------------------------------------------------------------

def test_build_executes_from_cache_and_fails_on_a_cell_error():
    assert CONFIG["only_build_toc_files"] is True
    assert CONFIG["execute"]["execute_notebooks"] == "cache"
    assert CONFIG["execute"]["allow_errors"] is False
    assert CONFIG["execute"]["timeout"] >= 600
    for folder in (".venv", "_build", "solutions", "src", "tests", "tools"):
        assert folder in CONFIG["exclude_patterns"], folder


def test_labs_are_run_by_nbval_and_shown_as_students_get_them():
    """make test's nbval part runs every lab; the book executes none (a lab page shows the lab
    to run, not the reference solutions' results) and every chapter (from nbval's cache)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import execute_notebooks

    excluded = CONFIG["execute"].get("exclude_patterns", [])
    assert "labs/*" in excluded, excluded
    checked = {p.relative_to(ROOT).as_posix() for p in execute_notebooks.notebooks()}
    assert {lab.relative_to(ROOT).as_posix() for lab in LABS} <= checked
    chapters = [f + ".md" for f in _toc_files() if f.startswith("book/")]
    assert not [c for c in chapters if any(fnmatch.fnmatch(c, pat) for pat in excluded)]


def test_widget_and_math_javascript_is_vendored_not_from_a_cdn():
    scripts = [SPHINX["mathjax_path"], *SPHINX["nb_ipywidgets_js"],
               *SPHINX.get("html_js_files", [])]
    for script in scripts:
        assert "//" not in script, f"{script} is not a local path"
        assert (STATIC / script).is_file(), f"{script} is not in {STATIC}"
    for attributes in SPHINX["nb_ipywidgets_js"].values():
        for value in attributes.values():
            assert "//" not in str(value), f"widget script attribute points off the site: {value}"
    for licence in ("ipywidgets/LICENSE-ipywidgets.txt", "ipywidgets/LICENSE-requirejs.txt",
                    "ipywidgets/LICENSE-fontawesome.txt", "mathjax/LICENSE"):
        assert (STATIC / licence).is_file(), licence


def test_colab_launch_buttons_point_at_the_repository():
    assert CONFIG["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    assert CONFIG["repository"]["url"].startswith("https://github.com/")
    assert CONFIG["repository"]["path_to_book"] == ""


# --- the labs' set-up cell -----------------------------------------------------------------------

def test_every_lab_starts_with_the_generated_setup_cell():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "lab_setup_cell.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_setup_cell_clones_the_repository_named_in_config():
    url = CONFIG["repository"]["url"]
    assert LABS, "no labs/*.ipynb"
    for lab in LABS:
        first = nbformat.read(lab, as_version=4).cells[0]
        urls = set(re.findall(r"https?://[^\s\"']+", first.source))
        assert urls == {url}, f"{lab.name}: set-up cell clones {urls}, _config.yml says {url}"


class _FakeIPython:
    def __init__(self):
        self.magics = []

    def run_line_magic(self, name, line):
        self.magics.append((name, line))


def _run_setup_cell(monkeypatch, on_colab):
    """Run the set-up cell with IPython, subprocess and os faked; return what it did."""
    import IPython

    ipython, commands, moves = _FakeIPython(), [], []
    monkeypatch.setattr(IPython, "get_ipython", lambda: ipython)
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: commands.append(list(args))
                        or types.SimpleNamespace(returncode=0))
    monkeypatch.setattr(os, "chdir", moves.append)
    monkeypatch.setattr(os.path, "isdir", lambda path: False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    if on_colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(_lab_setup_cell().setup_cell_source(), {})
    return ipython.magics, commands, moves


def test_the_repository_url_is_written_only_in_config():
    """Chapters link repository files with the {src} role and labs get the URL from their
    generated set-up cell, so moving the course means changing _config.yml alone."""
    url = CONFIG["repository"]["url"].rstrip("/")
    offenders = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "book").glob("*.md"))
                 if url in p.read_text(encoding="utf-8")]
    for lab in sorted((ROOT / "labs").glob("*.ipynb")):
        cells = nbformat.read(lab, as_version=4).cells[1:]  # cell 0: the generated set-up cell
        if any(url in cell.source for cell in cells):
            offenders.append(lab.relative_to(ROOT).as_posix())
    assert not offenders, f"{url} typed in {offenders}: use {{src}}`labkit/...` or the config"


def test_setup_cell_off_colab_only_turns_on_autoreload(monkeypatch):
    magics, commands, moves = _run_setup_cell(monkeypatch, on_colab=False)
    assert magics == [("load_ext", "autoreload"), ("autoreload", "2")]
    assert commands == [] and moves == []


def test_setup_cell_on_colab_clones_installs_and_enters_labs(monkeypatch):
    magics, commands, moves = _run_setup_cell(monkeypatch, on_colab=True)
    clone, install, *optional = commands
    assert clone[:2] == ["git", "clone"] and CONFIG["repository"]["url"] in clone
    assert clone[-1] == "/content/course"
    # every pip call keeps the runtime's torch (a constraint file pins it; tests/test_lab_setup_cell.py)
    assert install[:7] == [sys.executable, "-m", "pip", "install", "-q", "-e", "/content/course"]
    assert install[7] == "-c", install
    # lab 2's optional 8-bit reference, at the version that runs on CPU tensors (issue 18), and
    # only when it is missing
    import importlib.util

    want = [] if importlib.util.find_spec("bitsandbytes") else [True]
    assert [c[:5] == [sys.executable, "-m", "pip", "install", "-q"] and "bitsandbytes>=0.50" in c
            for c in optional] == want, optional
    assert "/content/course/src" in sys.path
    assert moves == ["/content/course/labs"]
    assert magics == [("load_ext", "autoreload"), ("autoreload", "2")]


# --- the built site (after `make book`) ----------------------------------------------------------

class _Resources(HTMLParser):
    """Collect the URLs a page loads by itself: scripts, stylesheets, images, iframes."""

    LOADING_LINKS = {"stylesheet", "preload", "modulepreload", "icon"}

    def __init__(self):
        super().__init__()
        self.loaded, self.widget_views, self.widget_state, self.widget_cdn = [], 0, 0, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script":
            kind = attrs.get("type", "")
            self.widget_views += kind == "application/vnd.jupyter.widget-view+json"
            self.widget_state += kind == "application/vnd.jupyter.widget-state+json"
            if "data-jupyter-widgets-cdn" in attrs:
                self.widget_cdn.append(attrs["data-jupyter-widgets-cdn"])
            if attrs.get("src"):
                self.loaded.append(attrs["src"])
        elif tag == "link" and set(attrs.get("rel", "").split()) & self.LOADING_LINKS:
            self.loaded.append(attrs.get("href", ""))
        elif tag in ("img", "iframe") and attrs.get("src"):
            self.loaded.append(attrs["src"])


def _built_pages():
    if not SITE.is_dir():
        pytest.skip("the book is not built (make book)")
    pages = sorted(SITE.rglob("*.html"))
    return [p for p in pages if "_static" not in p.relative_to(SITE).parts]


def test_built_pages_load_nothing_from_other_hosts():
    for page in _built_pages():
        parser = _Resources()
        parser.feed(page.read_text(encoding="utf-8"))
        urls = parser.loaded + parser.widget_cdn
        remote = [url for url in urls if re.match(r"^(https?:)?//", url)]
        assert not remote, f"{page.relative_to(SITE)} loads {remote}"


def test_built_pages_with_widgets_carry_their_state_and_the_local_widget_manager():
    for page in _built_pages():
        parser = _Resources()
        parser.feed(page.read_text(encoding="utf-8"))
        if parser.widget_views:
            name = page.relative_to(SITE)
            assert parser.widget_state == 1, f"{name}: widget views but no saved widget state"
            assert any(src.split("?")[0].endswith("_static/ipywidgets/embed-amd.js")
                       for src in parser.loaded), f"{name}: no local embed-amd.js"
