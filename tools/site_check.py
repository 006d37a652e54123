"""Check the built site as readers see it: every page of the book in headless Chromium.

    python tools/site_check.py [--site _build/html] [--out _build/site-check] [--widths 1300,390]

Serves ``_build/html`` on 127.0.0.1 and opens every page of ``_toc.yml`` in headless Chromium
(Debian's ``chromium``; ``tools/ensure_chromium.sh`` installs it when missing) at a laptop
width and a phone width, with every other host unresolvable, then once more at the laptop
width in the theme's dark mode, and as printed on A4 paper. A page fails on:

- a request that fails (HTTP status >= 400, or a host that is not the local server);
- a console error or an uncaught exception;
- horizontal overflow: an element of the article (equation, table, output, figure...) that
  reaches past the article's column and is not inside a scrolling (or clipping) box, or a page
  wider than the window; in print, where nothing scrolls, one inside a scrolling box too;
- a box that scrolls sideways with no cue that it does (course.js fades the edge that has more);
- more than one search box on the screen;
- an image without alt text (an alt text that is the image's file name, as myst-nb writes for
  a cell's output, is a warning; ``--strict`` fails it too);
- a table cell squeezed below a readable width (under 6 em for more than 24 characters of
  text) or whose text runs past the cell's edge (clipped);
- (warning) a display equation that fits its column only by scrolling sideways;
- a broken internal link or anchor (the target file or the ``#id`` in it does not exist);
- math that MathJax did not typeset, an ipywidget or a calculator that did not draw;
- (dark mode) an image whose backdrop is dark (figures are drawn for white paper), or text
  whose contrast with its backdrop is below 3.

Screenshots go to ``_build/site-check/<page>@<width>[-dark|-print].png``; one summary line per page.
Exit status 1 when a page fails.

The browser is driven over the Chrome DevTools protocol on a pipe (tools/site_check_cdp.py), so
only the standard library is needed; the checks that run inside each page are
tools/site_check_page.js.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
import time
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path

from site_check_cdp import CDPError, Browser, Tab, find_chromium  # noqa: F401 (re-exported)

ROOT = Path(__file__).resolve().parents[1]
DESKTOP, PHONE = 1300, 390
PAPER = 718                   # CSS px of an A4 page's text at Chromium's default margins (0.4 in)
SETTLE_S = 10.0               # at most this long for MathJax and the widgets to draw
PAGE_CHECK_JS = (Path(__file__).with_name("site_check_page.js")).read_text(encoding="utf-8")

# ----------------------------------------------------------------------------- the site
class _IdParser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k == "id" or (k == "name" and tag == "a"):
                self.ids.add(v or "")


@functools.lru_cache(maxsize=None)
def _ids_of(path: Path) -> frozenset[str]:
    parser = _IdParser()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return frozenset(parser.ids)


def check_links(site: Path, links: list[str]) -> list[str]:
    """Links (absolute paths on the local server, with #fragment) that lead nowhere."""
    problems = []
    for link in links:
        path, _, fragment = link.partition("#")
        target = site / urllib.parse.unquote(path).lstrip("/")
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            problems.append(f"broken link: {link} (no such file)")
        elif fragment and target.suffix == ".html" and \
                urllib.parse.unquote(fragment) not in _ids_of(target):
            problems.append(f"broken anchor: {link} (no id {urllib.parse.unquote(fragment)!r} there)")
    return problems


def toc_pages(root: Path = ROOT) -> list[str]:
    """The pages of _toc.yml, root first, as paths inside _build/html."""
    import yaml

    toc = yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8"))
    files = [toc["root"]]

    def walk(entries):
        for entry in entries:
            if "file" in entry:
                files.append(entry["file"])
            elif "glob" in entry:  # e.g. "labs/*": every .md / .ipynb it matches, sorted
                files.extend(sorted(str(p.relative_to(root).with_suffix(""))
                                    for p in root.glob(entry["glob"])
                                    if p.suffix in (".md", ".ipynb")))
            walk(entry.get("sections", []))  # ("url" entries are other sites: not checked)

    for part in toc.get("parts", [{"chapters": toc.get("chapters", [])}]):
        walk(part.get("chapters", []))
    pages = [str(Path(f).with_suffix("")) + ".html" for f in files]
    return list(dict.fromkeys(pages))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def check_page(tab: Tab, base: str, site: Path, page: str, width: int, mode: str = "",
               shot: Path | None = None) -> list[str]:
    """The problems of one page at one width and mode ("", "dark" or "print"); saves its
    screenshot."""
    dark = mode == "dark"
    tab.set_view(width, dark, printed=mode == "print")
    problems = tab.visit(f"{base}/{page}")
    script = PAGE_CHECK_JS.replace("__SETTLE_MS__", str(int(SETTLE_S * 1000)))
    script = script.replace("__DARK__", "true" if dark else "false")
    found = tab.evaluate(script.replace("__PRINT__", "true" if mode == "print" else "false"),
                         timeout=SETTLE_S + 30)
    problems += found["problems"]
    if dark and not found["dark"]:
        problems.append("dark mode: the page did not switch to the dark theme "
                        "(prefers-color-scheme: dark)")
    problems += check_links(site, found["links"])
    if shot is not None:
        tab.screenshot(shot, width)
    problems += tab.late_problems()
    return list(dict.fromkeys(problems))  # once each, in order


def views(widths: list[int]) -> list[tuple[int, str]]:
    """(width, mode) of each visit: every width in light mode, the first width in dark mode,
    and the page printed (print media at the width of an A4 page's text)."""
    return [(w, "") for w in widths] + [(widths[0], "dark"), (PAPER, "print")]


def view_name(width: int, mode: str) -> str:
    return f"{width}-{mode}" if mode else str(width)


def _is_warning(problem: str) -> bool:
    return problem.split("] ", 1)[-1].startswith("warning: ")


def run(site: Path, out: Path, pages: list[str], widths: list[int], binary: str | None = None,
        screenshots: bool = True, echo=print, strict: bool = False) -> dict[str, list[str]]:
    """Check every page at every view; returns {page: [problem, ...]} and prints a line per page.

    Warnings (an image whose alt text is its file name, an equation that fits only by scrolling
    sideways) are printed, and count as problems only when strict.
    """
    server, base = serve(site)
    results: dict[str, list[str]] = {}
    try:
        with Browser(binary) as browser:
            tab = Tab(browser)
            for page in pages:
                t0 = time.monotonic()
                problems, views_of = [], {}
                if not (site / page).is_file():
                    problems.append(f"no {page} in {site}: is it in _toc.yml but not built?")
                else:
                    for width, mode in views(widths):
                        name = view_name(width, mode)
                        shot = out / f"{page.removesuffix('.html').replace('/', '__')}@{name}.png"
                        try:
                            found = check_page(tab, base, site, page, width, mode,
                                               shot if screenshots else None)
                        except CDPError as err:
                            found = [f"the browser failed: {err}"]
                        for p in found:  # the same problem at several views: one line
                            views_of.setdefault(p, []).append(name)
                problems += [f"[{', '.join(tags)}] {p}" for p, tags in views_of.items()]
                warnings = [] if strict else [p for p in problems if _is_warning(p)]
                problems = [p for p in problems if p not in warnings]
                results[page] = problems
                status = "ok  " if not problems else "FAIL"
                echo(f"{status} {page:<45} {len(problems):3d} problem(s)  "
                     f"{len(warnings):3d} warning(s)  {time.monotonic() - t0:5.1f} s")
                for p in problems + warnings:
                    echo(f"       {p}")
    finally:
        server.shutdown()
        server.server_close()
    return results


def _tags(widths):
    return [view_name(w, m) for w, m in views(widths)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", type=Path, default=ROOT / "_build" / "html")
    ap.add_argument("--out", type=Path, default=ROOT / "_build" / "site-check")
    ap.add_argument("--widths", default=f"{DESKTOP},{PHONE}",
                    help="comma-separated window widths in CSS px (dark mode at the first)")
    ap.add_argument("--pages", nargs="*", help="paths inside --site (default: every page of _toc.yml)")
    ap.add_argument("--chromium", help="the browser binary (default: chromium on PATH)")
    ap.add_argument("--no-screenshots", action="store_true", help="check only (faster)")
    ap.add_argument("--strict", action="store_true",
                    help="warnings (an image whose alt text is its file name, an equation "
                         "that scrolls sideways) fail the page")
    args = ap.parse_args(argv)
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        ap.error(f"--widths must be comma-separated integers, got {args.widths!r}")
    if not widths or min(widths) < 200:
        ap.error(f"--widths must be at least 200 px each, got {args.widths!r}")
    if not (args.site / "index.html").is_file() and not args.pages:
        print(f"site_check: no {args.site}/index.html: build the book first (make book)",
              file=sys.stderr)
        return 2
    pages = args.pages or toc_pages()
    t0 = time.monotonic()
    results = run(args.site, args.out, pages, widths, args.chromium,
                  screenshots=not args.no_screenshots, strict=args.strict)
    bad = [p for p, probs in results.items() if probs]
    print(f"site-check: {len(pages) - len(bad)}/{len(pages)} pages ok at "
          f"{', '.join(_tags(widths))} in {time.monotonic() - t0:.0f} s; "
          f"screenshots in {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
