"""The student edition is generated from the solutions and never drifts from them."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions" / "labkit"
needs_solutions = pytest.mark.skipif(not SOLUTIONS.is_dir(), reason="student edition: no solutions/")


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_solutions
def test_committed_stubs_equal_the_generated_ones():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "make_stubs.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_solutions
def test_every_solution_module_has_a_stub_and_no_stub_holds_a_solution():
    solutions = sorted(SOLUTIONS.rglob("*.py"))
    assert solutions and all(s.parent.name.startswith("lab") for s in solutions), \
        "solutions/labkit holds only lab folders (solutions/labkit/labN/<module>.py)"
    for solution in solutions:
        stub = ROOT / "src" / "labkit" / solution.relative_to(SOLUTIONS)
        assert stub.exists(), f"{solution.relative_to(SOLUTIONS)} has no stub in src/labkit"
    for stub in (ROOT / "src" / "labkit").rglob("*.py"):
        assert "# BEGIN SOLUTION" not in stub.read_text(), f"solution leaked into {stub}"


def test_make_stub_replaces_each_marked_block_at_its_indentation(tmp_path):
    make_stubs = _tool("make_stubs")
    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / "03_parameters.ipynb").write_text("{}")
    source = (
        "def f(x):\n"
        '    """Doc stays."""\n'
        "    # BEGIN SOLUTION 3.1: double x\n"
        "    y = 2 * x\n"
        "    return y\n"
        "    # END SOLUTION\n"
        "\n"
        "HELPER = 1\n"
    )
    stub = make_stubs.make_stub(source, root=tmp_path)
    assert stub == (
        "def f(x):\n"
        '    """Doc stays."""\n'
        '    raise NotImplementedError("exercise 3.1: double x (labs/03_parameters.ipynb)")\n'
        "\n"
        "HELPER = 1\n"
    )


@pytest.mark.parametrize("source, problem", [
    ("# BEGIN SOLUTION 1.1: a\nx = 1\n", "never closed"),
    ("# END SOLUTION\n", "without BEGIN"),
    ("# BEGIN SOLUTION 1.1\n# END SOLUTION\n", "hint"),
    ("# BEGIN SOLUTION 1.1: a\n# BEGIN SOLUTION 1.2: b\n", "nested"),
])
def test_make_stub_rejects_malformed_markers(source, problem):
    make_stubs = _tool("make_stubs")
    with pytest.raises(ValueError, match=problem):
        make_stubs.make_stub(source)


def test_solutions_overlay_loads_the_solution_module(tmp_path):
    """LABKIT_SOLUTIONS=<dir> puts <dir>/labkit/labN in front of lab N's search path; the
    toolkit (labkit.models) is never taken from <dir>, and a module only the stub folder has
    still loads from there."""
    (tmp_path / "labkit" / "lab1").mkdir(parents=True)
    (tmp_path / "labkit" / "lab1" / "accounting.py").write_text("WHO = 'solution'\n")
    (tmp_path / "labkit" / "models.py").write_text("raise SystemExit('the toolkit was overlaid')\n")
    code = ("import labkit.lab1.accounting as m, labkit.models, labkit.lab2.zero1 as z; "
            "print(getattr(m, 'WHO', 'stub'), labkit.models.__name__, z.__file__.split('/')[-3])")
    env = {"LABKIT_SOLUTIONS": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split() == ["solution", "labkit.models", "labkit"], out.stderr


def test_without_solutions_the_stub_is_loaded():
    code = "import labkit.lab1.accounting as m; print(m.__file__)"
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip().endswith("src/labkit/lab1/accounting.py"), out.stdout + out.stderr


def test_solutions_overlay_with_a_wrong_path_says_so(tmp_path):
    """The first lab package imported (labkit.overlay reads the variable) names the variable."""
    env = {"LABKIT_SOLUTIONS": str(tmp_path / "nowhere"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", "import labkit.lab1"], capture_output=True, text=True,
                         env=env)
    assert out.returncode != 0 and "LABKIT_SOLUTIONS" in out.stderr


@needs_solutions
def test_student_edition_has_no_solutions(tmp_path):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                      capture_output=True).returncode != 0:
        pytest.skip("not a git checkout with commits")
    copied = _tool("student_edition").write_student_edition(tmp_path / "edition")
    assert copied and not any(p.startswith("solutions/") for p in copied)
    assert (tmp_path / "edition" / "src" / "labkit" / "__init__.py").exists()
    assert not (tmp_path / "edition" / "solutions").exists()


PAGE = """---
jupytext:
  text_representation:
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---
# A page

```{code-cell} python
print(6 * 7)
```
"""


def test_student_edition_ships_every_notebook_page_precomputed(tmp_path):
    """The edition's `make book` must find each notebook page's outputs without executing it:
    precompute() executes what the source cache lacks and writes a cache in which every page,
    read from the edition's own copy as myst-nb reads it, has a match holding its outputs."""
    from jupyter_cache import get_cache

    edition = _tool("student_edition")
    execute = edition._execute_notebooks_module()
    course = tmp_path / "course"
    (course / "book").mkdir(parents=True)
    (course / "_toc.yml").write_text("format: jb-book\nroot: book/intro\nchapters:\n  - file: book/page\n")
    (course / "book" / "intro.md").write_text("# Intro\n")
    (course / "book" / "page.md").write_text(PAGE)
    dest = tmp_path / "edition"
    (dest / "book").mkdir(parents=True)
    (dest / "book" / "page.md").write_text(PAGE)
    pages = edition.precompute(dest, root=course, source_cache=tmp_path / "cache")
    assert pages == ["book/page.md"]
    cache = get_cache(str(dest / edition.PRECOMPUTED))
    nb = execute.read_notebook(dest / "book" / "page.md")[0]
    cached = cache.get_cache_bundle(cache.match_cache_notebook(nb).pk).nb
    outputs = [o for c in cached.cells if c.cell_type == "code" for o in c.outputs]
    assert outputs and outputs[0]["text"].strip() == "42"
    assert (dest / "precomputed" / "README.md").is_file()


def test_edition_book_target_explains_a_missing_output():
    """Without solutions/, a failing `make book` says why (the chapters need the solutions)."""
    makefile = (ROOT / "Makefile").read_text()
    assert "precomputed/.jupyter_cache" in makefile and "does not include" in makefile
