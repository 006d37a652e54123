"""tools/site_check.py finds what a reader would see wrong, on tiny synthetic pages in Chromium.

Each page below has one planted fault (or none); the checker must report it, by kind, and
nothing on the clean page. The last tests drive the book's JS calculator in the browser and
compare the numbers it draws with labkit.widgets.calculator_bytes (labkit.lab6.parallel_memory). The browser tests skip without Chromium
(tools/ensure_chromium.sh installs it); the font and link tests need no browser.
"""
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(ROOT / "tools"))  # the tools are scripts: site_check imports site_check_cdp
import make_cjk_font  # noqa: E402
import site_check  # noqa: E402

CHROMIUM = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(b)), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (tools/ensure_chromium.sh)")


def _png(w=4, h=4, rgba=(0, 0, 0, 0)):
    """A w×h PNG of one colour (transparent by default), written without any imaging library."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"".join(b"\0" + bytes(rgba) * w for _ in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


HEAD = """<!doctype html><html><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<script>if (matchMedia("(prefers-color-scheme: dark)").matches) document.documentElement.dataset.theme = "dark";</script>
<style>html[data-theme=dark] body {{ background: #121212; color: #ddd }} html[data-theme=dark] a {{ color: #8ab4f8 }} {style}</style>
</head><body><main><article class="bd-article" style="max-width: 600px">
<section id="top">{body}</section></article></main></body></html>"""

PAGES = {
    "clean.html": ("@media print { .wide { width: auto !important } }",
                   """<p>Fine <a href="#top">here</a>, <a href="other.html#there">there</a>.</p>
        <div style="overflow-x: auto; mask-image: linear-gradient(to right, #000 90%, transparent)">
        <div class="wide" style="width: 900px">a wide row inside a scrolling box that fades at its edge</div></div>
        <img src="pic.png" alt="a picture" style="background: #fff; width: 40px">"""),
    "wide.html": ("", '<table><tr><td style="min-width: 900px">a table wider than the column</td></tr></table>'),
    "cut.html": ("", '<div style="overflow: hidden"><div style="width: 900px">cut at the edge</div></div>'),
    # scrolls on the screen, with its cue; on paper it cannot scroll
    "printcut.html": ("", '<div style="overflow-x: auto; mask-image: linear-gradient(#000, #000)">'
                          '<div style="width: 900px">a row wider than the page</div></div>'),
    "nocue.html": ("@media print { .wide { width: auto !important } }",
                   '<div style="overflow-x: auto"><div class="wide" style="width: 900px">'
                   'scrolls, but nothing says so</div></div>'),
    "twosearch.html": ("", '<button class="search-button-field">Search</button>'
                           '<button class="search-button-field">Search</button>'),
    # a column 60 px wide (under 6 em) whose sentence wraps at every character: squeezed, not clipped
    "squeezed.html": ("", '<table style="width: 400px; table-layout: fixed"><tr><td style="width: 340px">'
                          'a wide first column</td><td style="overflow-wrap: anywhere">why: an explanation '
                          'squeezed into a few characters</td></tr></table>'),
    "clipped.html": ("", '<table style="width: 300px; table-layout: fixed"><tr><td style="width: 150px">'
                         'anunbreakablewordmuchwiderthanitscell</td><td>b</td></tr></table>'),
    "noalt.html": ("", '<img src="pic.png" style="width: 40px">'),
    "missing.html": ("", '<img src="gone.png" alt="a picture that is not there">'),
    "console.html": ("", "<script>console.error('boom'); setTimeout(() => { throw new Error('late'); });</script>"),
    "links.html": ("", '<a href="nowhere.html">a</a> <a href="other.html#nope">b</a> <a href="#nope-here">c</a>'),
    "widget.html": ("", '<div class="cell_output"><script type="application/vnd.jupyter.widget-view+json">'
                        '{"model_id": "x", "version_major": 2}</script></div>'),
    "widgeterror.html": ("", '<div class="cell_output"><div class="jupyter-widgets" style="height: 2em">'
                             'Error displaying widget: model not found</div><script '
                             'type="application/vnd.jupyter.widget-view+json">{"model_id": "y"}</script></div>'),
    "offsite.html": ("", '<img src="https://example.com/x.png" alt="from another host">'),
    "filealt.html": ("", '<img src="pic.png" alt="../_images/pic.png" style="background: #fff; width: 40px">'),
    "dark.html": ("", '<img src="pic.png" alt="a transparent figure" style="width: 40px">'),
    "darktext.html": ("", '<p style="color: #333">text in a fixed dark colour</p>'),
    "cjk.html": ("", "<blockquote>不存、少存、分存</blockquote>"),
    "cjk-font.html": ("@font-face { font-family: 'WTMG CJK'; src: url('wtmg-cjk.woff') format('woff'); }"
                      " body { font-family: 'WTMG CJK', sans-serif }",
                      "<blockquote>不存、少存、分存</blockquote>"),
}
# page → a pattern that a problem of that page must match (None: no problem at all)
EXPECTED = {
    "clean.html": None,
    "wide.html": r"table .* past its column .* does not scroll",
    "cut.html": r"past its column .* is cut off",
    "printcut.html": r"^\[718-print\] .* past its column .* cut off at the paper's edge",
    "nocue.html": r"^\[700, 700-dark\] .*scrolls sideways \(\d+ px in \d+ px\) with no cue",
    "twosearch.html": r"2 search boxes are shown",
    "squeezed.html": r"table cell squeezed to \d+ px .*why: an explanation",
    "clipped.html": r"table cell clipped: its text needs \d+ px in \d+ px",
    "noalt.html": r"image without alt text: pic\.png",
    "missing.html": r"HTTP 404: /gone\.png",
    "console.html": r"console error: boom",
    "links.html": r"broken link: /nowhere\.html",
    "widget.html": r"widget 1 did not draw",
    "widgeterror.html": r"widget 1: Error displaying widget: model not found",
    "offsite.html": r"request to another host: https://example\.com/x\.png",
    "filealt.html": None,  # a warning only (test below)
    "dark.html": r"\[\d+-dark\] dark mode: image pic\.png sits on a dark backdrop",
    "darktext.html": r"\[700-dark\] dark mode: text with contrast 1\.\d+ < 3 .*text in a fixed dark colour",
    "cjk.html": r"CJK text \"不存、少存、分存\" has no web font",
    "cjk-font.html": None,
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    for name, (style, body) in PAGES.items():
        (site / name).write_text(HEAD.format(style=style, body=body), encoding="utf-8")
    (site / "other.html").write_text('<html><body><p id="there">x</p></body></html>')
    (site / "index.html").write_text("<html><body>index</body></html>")
    (site / "pic.png").write_bytes(_png())
    shutil.copy(make_cjk_font.OUT, site / "wtmg-cjk.woff")
    old = site_check.SETTLE_S
    site_check.SETTLE_S = 1.5  # the undrawn widget is given up on after this long
    try:
        lines = []
        found = site_check.run(site, site / "_shots", list(PAGES), [700], binary=CHROMIUM,
                               echo=lines.append)
        found["_lines"] = lines
        found["_shots"] = sorted(p.name for p in (site / "_shots").glob("clean@*.png"))
        return found
    finally:
        site_check.SETTLE_S = old


@needs_chromium
@pytest.mark.parametrize("page", list(PAGES))
def test_checker_reports_the_planted_fault(results, page):
    problems = results[page]
    want = EXPECTED[page]
    if want is None:
        assert problems == [], f"{page} has no fault, but the checker reports {problems}"
    else:
        assert any(re.search(want, p) for p in problems), \
            f"{page}: no problem matches {want!r}; the checker reports {problems}"


@needs_chromium
def test_checker_sees_cross_page_and_same_page_anchors(results):
    problems = " | ".join(results["links.html"])
    assert "broken anchor: /other.html#nope (no id 'nope' there)" in problems, problems
    assert "broken anchor: #nope-here" in problems, problems
    assert "other.html#there" not in problems, "other.html#there exists but is reported: " + problems


@needs_chromium
def test_checker_saves_a_screenshot_per_view(results):
    shots = results["_shots"]
    assert shots == ["clean@700-dark.png", "clean@700.png", "clean@718-print.png"], shots


@needs_chromium
def test_an_alt_text_that_is_a_file_name_is_a_warning(results):
    lines = results["_lines"]
    start = next(i for i, line in enumerate(lines) if "filealt.html" in line)
    assert "  0 problem(s)    1 warning(s)" in lines[start], lines[start]
    assert "warning: image whose alt text is its file name: pic.png" in lines[start + 1], lines[start + 1]


BARE_START = """
import os, sys
sys.path.insert(0, sys.argv[1])
free = [fd for fd in (3, 4) if not os.path.exists(f"/proc/self/fd/{fd}")]
from site_check_cdp import Browser
with Browser(sys.argv[2]) as browser:
    print(free, browser.send("Browser.getVersion", timeout=60)["product"])
"""


@needs_chromium
def test_the_browser_starts_from_a_process_with_no_other_fd_open():
    """`make site-check` from a bare shell: the DevTools pipe's own ends are then fds 3 and 4,
    the very numbers Chromium reads them on (a close-on-exec fd 3 made Chromium exit and the
    first command fail with a broken pipe). Only fds 0-2 are passed to the child here."""
    done = subprocess.run([sys.executable, "-c", BARE_START, str(ROOT / "tools"), CHROMIUM],
                          close_fds=True, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("[3, 4] ") and "Chrome/" in done.stdout, done.stdout


def test_links_are_checked_against_the_files_and_their_ids(tmp_path):
    (tmp_path / "a.html").write_text('<p id="x">x</p><a name="y"></a>')
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "index.html").write_text("")
    assert site_check.check_links(tmp_path, ["/a.html#x", "/a.html#y", "/a.html", "/d/"]) == []
    assert site_check.check_links(tmp_path, ["/a.html#z", "/b.html"]) == [
        "broken anchor: /a.html#z (no id 'z' there)", "broken link: /b.html (no such file)"]


def test_every_page_of_the_toc_is_checked():
    pages = site_check.toc_pages()
    assert pages[0] == "book/intro.html"
    assert all(p.endswith(".html") for p in pages) and len(pages) == len(set(pages))
    assert len(pages) > 1, pages


def test_the_shipped_cjk_font_covers_every_character_of_the_book():
    used = make_cjk_font.book_characters()
    missing = make_cjk_font.missing_characters()
    assert missing == "", (f"book/_static/fonts/wtmg-cjk.woff lacks {missing!r} of the "
                           f"{len(used)} CJK characters the book uses: a new chapter? "
                           f"run python tools/make_cjk_font.py")


def test_cjk_characters_are_found_in_chapters_and_labs(tmp_path):
    md = tmp_path / "a.md"
    md.write_text("> 不存就重算 — *recompute*; 123 abc ≈ Ψ")
    assert make_cjk_font.book_characters([md]) == "".join(sorted("不存就重算"))
    with pytest.raises(ValueError, match="chars"):
        make_cjk_font.make_font("", out=tmp_path / "x.woff")


# ----------------------------------------------------------------------------- the calculator
@pytest.fixture(scope="module")
def calculator_tab(tmp_path_factory):
    from labkit.page_calculator import calculator_html

    site = tmp_path_factory.mktemp("calc")
    (site / "calc.html").write_text(HEAD.format(style="", body=calculator_html()), encoding="utf-8")
    server, base = site_check.serve(site)
    browser = site_check.Browser(CHROMIUM)
    try:
        tab = site_check.Tab(browser)
        tab.set_view(site_check.DESKTOP)
        assert tab.visit(f"{base}/calc.html") == []
        yield tab
    finally:
        browser.close()
        server.shutdown()
        server.server_close()


CONTROLS_JS = """(() => {
  const root = document.querySelector(".wtmg-calculator"), out = {};
  root.querySelectorAll("[name]").forEach((el) => {
    const c = out[el.name] || (out[el.name] = {type: el.type || el.tagName.toLowerCase(), values: []});
    if (el.tagName === "SELECT") { c.values = [...el.options].map((o) => o.value); c.value = el.value; }
    else if (el.type === "radio") { c.values.push(el.value); if (el.checked) c.value = el.value; }
    else if (el.type === "checkbox") { c.values = [true, false]; c.value = el.checked; }
    else c.value = el.value;
  });
  return out;
})()"""

# Drawn numbers: each bar segment's <title> "consumer: X GB", four stages in order.
DRAWN_JS = """(() => {
  const root = document.querySelector(".wtmg-calculator");
  return {titles: [...root.querySelectorAll("svg rect title")].map((t) => t.textContent),
          msg: root.querySelector(".wtmg-msg").textContent,
          summary: root.querySelector(".wtmg-summary").textContent};
})()"""

SET_JS = """((name, value) => {
  const root = document.querySelector(".wtmg-calculator");
  const els = [...root.querySelectorAll("[name='" + name + "']")];
  const el = els.find((e) => e.type !== "radio" || e.value === value);
  if (el.type === "radio") el.checked = true;
  else if (el.type === "checkbox") el.checked = value;
  else el.value = value;
  el.dispatchEvent(new Event("input", {bubbles: true}));
  el.dispatchEvent(new Event("change", {bubbles: true}));
})(%s, %s)"""


def _model_kwargs(controls):
    """The page's control values as labkit.widgets.calculator_bytes arguments."""
    from labkit.widgets import DEFAULTS

    kwargs = {}
    for name, c in controls.items():
        if name not in DEFAULTS:
            continue
        value = c["value"]
        if name == "n_params":
            kwargs[name] = float(value) * 1e9          # the control is in billions
        elif c["type"] == "checkbox":
            kwargs[name] = bool(value)
        elif c["type"] in ("number", "radio", "range"):
            kwargs[name] = int(value) if float(value).is_integer() else float(value)
        else:
            kwargs[name] = value
    return kwargs


LAYOUT = ("world_size", "dp", "tp", "pp", "cp")


def _moves(controls):
    """Each control in turn: every other option of a menu, radio group or checkbox; a number
    doubled (the layout's sizes move together, below)."""
    for name, c in controls.items():
        if c["values"]:
            for v in c["values"]:
                if v != c["value"]:
                    yield name, v
        elif c["type"] in ("number", "range") and name not in LAYOUT:
            yield name, str(float(c["value"]) * 2).removesuffix(".0")


# (N, D, T, P, C), set control by control; every one valid once all five are set
LAYOUT_MOVES = [(1024, 16, 8, 8, 1), (512, 8, 8, 4, 2), (16, 2, 2, 2, 2), (64, 64, 1, 1, 1)]


def _check_drawn(tab, where):
    """The bars and the summary the page draws equal labkit.widgets.calculator_bytes; returns
    the number of bar segments compared."""
    from labkit import memory_model
    from labkit.widgets import calculator_bytes

    now = tab.evaluate(CONTROLS_JS)
    drawn = tab.evaluate(DRAWN_JS)
    assert drawn["msg"] == "", f"{where} the calculator says {drawn['msg']!r}"
    kwargs = _model_kwargs(now)
    titles = drawn["titles"]
    consumers = list(memory_model.CONSUMERS)
    stages = list(memory_model.ZERO_STAGES)
    assert len(titles) == len(stages) * len(consumers), \
        f"{where} the chart has {len(titles)} bar segments, " \
        f"expected {len(stages)} stages × {len(consumers)} consumers"
    for i, title in enumerate(titles):
        stage, consumer = stages[i // len(consumers)], consumers[i % len(consumers)]
        label, gb = re.fullmatch(r"(.+): ([\d.]+) GB", title).groups()
        assert label == consumer, f"segment {i} is labelled {label!r}, expected {consumer!r}"
        want = calculator_bytes(**{**kwargs, "zero_stage": stage})[consumer] / 1e9
        # the page prints GB with two decimals: it is right if it is the rounding of the model
        assert abs(float(gb) - want) <= 0.005 + 1e-9 * want, (
            f"{where}: the chart draws {consumer} at stage {stage} as "
            f"{gb} GB, labkit.widgets.calculator_bytes({kwargs}) gives {want:.4f} GB: "
            f"is the page's JavaScript out of step with labkit.lab6.parallel_memory?")
    # the summary repeats the selected stage's numbers
    total = sum(calculator_bytes(**kwargs).values()) / 1e9
    assert f"total {total:.2f} GB" in drawn["summary"], \
        f"{where}: summary {drawn['summary']!r} lacks total {total:.2f} GB"
    return len(titles)


def _set(tab, name, value):
    import json

    tab.evaluate(SET_JS % (json.dumps(name), json.dumps(value)))


@needs_chromium
def test_calculator_draws_what_labkit_parallel_memory_computes(calculator_tab):
    """Every control moved in turn, then four D×T×P×C layouts: the drawn bars and the summary
    equal the Python calculator (labkit.lab6.parallel_memory with LABKIT_SOLUTIONS)."""
    from labkit.widgets import calculator_bytes, settings

    try:
        calculator_bytes(**settings(world_size=64, tp=8))
    except NotImplementedError:
        pytest.skip("needs labkit.lab6.parallel_memory (exercise 6.4): run with LABKIT_SOLUTIONS")
    tab = calculator_tab
    controls = tab.evaluate(CONTROLS_JS)
    assert {"n_params", "recipe", "optimizer", "zero_stage", "world_size", "dp", "tp", "pp", "cp",
            "n_micro", "sequence_parallel", "checkpointing"} <= set(controls), controls
    checked = 0
    for name, value in [(None, None)] + list(_moves(controls)):
        if name is not None:
            _set(tab, name, value)
        checked += _check_drawn(tab, "at the page's defaults" if name is None
                                else f"after setting {name}={value}")
    for layout in LAYOUT_MOVES:
        for name, value in zip(LAYOUT, layout):
            _set(tab, name, str(value))
        checked += _check_drawn(tab, f"at (N, D, T, P, C) = {layout}")
    assert checked >= 16 * (len(controls) + len(LAYOUT_MOVES)), \
        f"only {checked} drawn numbers compared: did the controls move?"


VALID = {"world_size": "64", "dp": "64", "tp": "1", "pp": "1", "cp": "1", "n_layer": "80",
         "hidden": "10240", "n_head": "80", "seq_len": "2048"}  # the defaults' model shape


@needs_chromium
@pytest.mark.parametrize("changes, says", [
    ({"dp": "32"}, "must equal the GPUs N"),
    ({"world_size": "128", "dp": "16", "tp": "8", "n_head": "12", "hidden": "768"}, "must divide the heads"),
    ({"dp": "16", "pp": "4", "n_layer": "30"}, "must divide the layers"),
    ({"dp": "32", "cp": "2", "seq_len": "2047"}, "must divide the sequence"),
    ({"hidden": ""}, "hidden must be a positive"),
])
def test_calculator_shows_a_message_not_a_broken_chart(calculator_tab, changes, says):
    """An invalid combination empties the chart and says why; a valid one draws again."""
    tab = calculator_tab
    for name, value in {**VALID, **changes}.items():
        _set(tab, name, value)
    drawn = tab.evaluate(DRAWN_JS)
    assert says in drawn["msg"], f"after {changes} the page says {drawn['msg']!r}, expected {says!r}"
    assert drawn["titles"] == [], f"after {changes} the chart still draws {len(drawn['titles'])} bars"
    assert drawn["summary"].startswith("Nothing drawn"), drawn["summary"]
    for name, value in VALID.items():
        _set(tab, name, value)
    assert tab.evaluate(DRAWN_JS)["msg"] == "" and len(tab.evaluate(DRAWN_JS)["titles"]) == 16


def test_toc_globs_and_sections_are_followed(tmp_path):
    (tmp_path / "labs").mkdir()
    for name in ("labs/02_b.ipynb", "labs/01_a.ipynb", "labs/notes.txt", "book/x.md", "intro.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "_toc.yml").write_text(
        "format: jb-book\nroot: intro\nparts:\n  - chapters:\n"
        "      - file: book/x\n        sections:\n          - url: https://example.com\n"
        "      - glob: labs/*\n")
    assert site_check.toc_pages(tmp_path) == [
        "intro.html", "book/x.html", "labs/01_a.html", "labs/02_b.html"]
