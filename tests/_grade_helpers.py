"""Helpers of the grader's own tests (not collected): build submissions, edit one function."""
from __future__ import annotations

import ast
import shutil
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def student_edition(dest: Path, solved: tuple[str, ...] = ()) -> Path:
    """A submission folder like the student edition's: ``dest/src/labkit`` holding the stubs,
    with the modules in ``solved`` ("lab1/accounting.py") taken from the solutions."""
    labkit = dest / "src" / "labkit"
    shutil.copytree(ROOT / "src" / "labkit", labkit,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for rel in solved:
        shutil.copy(ROOT / "solutions" / "labkit" / rel, labkit / rel)
    return dest


def module(sub: Path, rel: str) -> Path:
    return sub / "src" / "labkit" / rel


def replace_body(path: Path, qualname: str, body: str) -> None:
    """Replace the body of function or method ``qualname`` in ``path`` by ``body`` (text,
    written at the function's own indentation; the signature and docstring stay)."""
    source = path.read_text()
    tree = ast.parse(source)
    node = _find(tree, qualname)
    lines = source.splitlines(keepends=True)
    first = node.body[0]
    keep_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
    start = (node.body[1].lineno if keep_doc and len(node.body) > 1 else
             first.end_lineno + 1 if keep_doc else first.lineno)
    indent = " " * (first.col_offset)
    new = textwrap.indent(textwrap.dedent(body).strip("\n") + "\n", indent)
    lines[start - 1:node.end_lineno] = [new]
    path.write_text("".join(lines))


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + "\n" + textwrap.dedent(text))


def _find(tree, qualname):
    body, node = tree.body, None
    for part in qualname.split("."):
        node = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef,
                                                      ast.AsyncFunctionDef)) and n.name == part)
        body = node.body
    return node


CHEATS = ROOT / "tests" / "cheats"


def cheat_files() -> list[Path]:
    """The cheats of tests/cheats/ (one per file: a header, ``---``, the code)."""
    return sorted(p for p in CHEATS.glob("*.txt") if p.read_text().startswith(("# cheat:", "# fair:")))


def load_cheat(path: Path) -> dict:
    """{"cheat" or "fair": what it tries, "module": "lab1/accounting.py", "edit": "append" or
    "body NAME", "expect": ..., "needle": ..., "code": ...}. ``expect`` is one of

    * ``zero 1.1 1.2``: a red flag that zeroes these exercises (``needle``: the flag's name);
    * ``flag 1.1``: a red flag for review on these exercises (``needle``: the flag's name); what
      the code does is stopped at run time, by a test of test_grade_cheats.py that names the file;
    * ``run``: nothing to read; stopped at run time (``needle``: what the report then says), by a
      test that names the file;
    * ``dropped``: extraction leaves it out (``absent``: a text of the code, its last line if
      not given, that must not be in the merged module); ``fair``: honest work, taken whole, no
      flag."""
    head, _, code = path.read_text().partition("\n---\n")
    out, key = {"code": code}, None
    for line in head.splitlines():
        text = line[2:] if line.startswith("# ") else line.lstrip("# ")
        if ":" in text and not line.startswith("#  "):
            key, _, value = text.partition(":")
            out[key.strip()] = value.strip()
        elif key:
            out[key] += " " + text.strip()
    return out


def apply_cheat(labkit: Path, cheat: dict | str, **fill: str) -> Path:
    """Apply one cheat (or the stem of a file of tests/cheats/) to the module it names under
    ``labkit`` (a submission's src/labkit); ``fill`` replaces placeholders in its code."""
    cheat = load_cheat(CHEATS / f"{cheat}.txt") if isinstance(cheat, str) else cheat
    code = cheat["code"]
    for name, value in fill.items():
        code = code.replace(name, value)
    path = labkit / cheat["module"]
    if cheat["edit"] == "append":
        append(path, code)
    else:
        replace_body(path, cheat["edit"].split()[1], code)
    return path
