"""Check the built site as readers see it: every page of the book in headless Chromium.

    python tools/site_check.py [--site _build/html] [--out _build/site-check] [--widths 1300,390]

Serves ``_build/html`` on 127.0.0.1 and opens every page of ``_toc.yml`` in headless Chromium
(Debian's ``chromium``; ``tools/ensure_chromium.sh`` installs it when missing) at a laptop
width and a phone width, with every other host unresolvable, then once more at the laptop
width in the theme's dark mode. A page fails on:

- a request that fails (HTTP status >= 400, or a host that is not the local server);
- a console error or an uncaught exception;
- horizontal overflow: an element of the article (equation, table, output, figure...) that
  reaches past the article's column and is not inside a scrolling (or clipping) box, or a page
  wider than the window;
- an image without alt text (an alt text that is the image's file name, as myst-nb writes for
  a cell's output, is a warning; ``--strict`` fails it too);
- (warning) a display equation that fits its column only by scrolling sideways;
- a broken internal link or anchor (the target file or the ``#id`` in it does not exist);
- math that MathJax did not typeset, an ipywidget or a calculator that did not draw;
- (dark mode) an image whose backdrop is dark (figures are drawn for white paper), or text
  whose contrast with its backdrop is below 3.

Screenshots go to ``_build/site-check/<page>@<width>[-dark].png``; one summary line per page.
Exit status 1 when a page fails.

The browser is driven over the Chrome DevTools protocol on a pipe (``--remote-debugging-pipe``:
NUL-terminated JSON on file descriptors 3 and 4), so only the standard library is needed.
"""
from __future__ import annotations

import argparse
import base64
import functools
import http.server
import itertools
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESKTOP, PHONE = 1300, 390
HEIGHT = 900                  # the window's height; screenshots cover the whole page
MAX_SHOT_HEIGHT = 16000       # px; a longer page is cut in its screenshot (not in the checks)
SETTLE_S = 10.0               # at most this long for MathJax and the widgets to draw


# ----------------------------------------------------------------------------- the browser
def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("no chromium on PATH: run tools/ensure_chromium.sh "
                            "(apt-get install -y chromium)")


class CDPError(RuntimeError):
    pass


class Browser:
    """Headless Chromium and a DevTools-protocol connection to it over a pipe."""

    def __init__(self, binary: str | None = None, allow_host: str = "127.0.0.1"):
        binary = binary or find_chromium()
        self.profile = tempfile.mkdtemp(prefix="site-check-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire():  # in the child: the pipe ends on fds 3 (commands) and 4 (answers)
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        args = [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox",
                "--disable-gpu", "--hide-scrollbars", "--mute-audio", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage", "--force-color-profile=srgb",
                f"--user-data-dir={self.profile}",
                f"--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE {allow_host}",
                "about:blank"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=wire,
                                     close_fds=False)  # keeps fds 3 and 4 (dup2: inheritable)
        os.close(to_child_r)
        os.close(from_child_w)
        self._ids = itertools.count(1)
        self._waiting: dict[int, queue.Queue] = {}
        self.events: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        buf = b""
        with os.fdopen(self._from_child, "rb", buffering=0) as pipe:
            while True:
                chunk = pipe.read(1 << 20)
                if not chunk:
                    break
                buf += chunk
                *messages, buf = buf.split(b"\0")
                for raw in messages:
                    msg = json.loads(raw)
                    if "id" in msg and msg["id"] in self._waiting:
                        self._waiting.pop(msg["id"]).put(msg)
                    elif "method" in msg:
                        self.events.put(msg)
        for q in list(self._waiting.values()):
            q.put({"error": {"message": "chromium exited"}})

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict:
        msg_id = next(self._ids)
        answer: queue.Queue = queue.Queue()
        self._waiting[msg_id] = answer
        msg = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        with self._lock:
            os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        try:
            reply = answer.get(timeout=timeout)
        except queue.Empty:
            raise CDPError(f"{method}: no answer from chromium in {timeout} s") from None
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def close(self):
        try:
            self.send("Browser.close", timeout=5)
        except (CDPError, OSError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            os.close(self._to_child)
        except OSError:
            pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Tab:
    """One page target; collects the failed requests and console errors of each visit."""

    def __init__(self, browser: Browser):
        self.browser = browser
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = browser.send("Target.attachToTarget",
                                    {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.send(f"{domain}.enable")
        self.urls: dict[str, str] = {}

    def send(self, method, params=None, timeout=30.0):
        return self.browser.send(method, params, self.session, timeout)

    def set_view(self, width: int, dark: bool = False):
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": HEIGHT, "deviceScaleFactor": 1,
                   "mobile": width < 600})
        self.send("Emulation.setEmulatedMedia", {"features": [
            {"name": "prefers-color-scheme", "value": "dark" if dark else "light"}]})

    def _problem(self, ev: dict) -> list[str]:
        if ev["method"] == "Network.requestWillBeSent":
            self.urls[ev["params"]["requestId"]] = ev["params"]["request"]["url"]
        elif ev["method"] == "Network.loadingFailed":
            ev["params"]["url"] = self.urls.get(ev["params"]["requestId"], "?")
        return _event_problem(ev)

    def _drain(self):
        while True:
            try:
                self.browser.events.get_nowait()
            except queue.Empty:
                return

    def visit(self, url: str, timeout: float = 30.0) -> list[str]:
        """Load url; returns the failed requests and console errors seen until it has loaded."""
        self._drain()
        problems: list[str] = []
        self.send("Page.navigate", {"url": url})
        deadline = time.monotonic() + timeout
        loaded = False
        while time.monotonic() < deadline:
            try:
                ev = self.browser.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if ev.get("sessionId") != self.session:
                continue
            problems += self._problem(ev)
            if ev["method"] == "Page.loadEventFired":
                loaded = True
                break
        if not loaded:
            problems.append(f"the page did not finish loading in {timeout:.0f} s")
        return problems

    def evaluate(self, expression: str, timeout: float = 30.0):
        result = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, timeout=timeout)
        if "exceptionDetails" in result:
            raise CDPError(f"evaluate: {result['exceptionDetails'].get('exception', {}).get('description') or result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def late_problems(self) -> list[str]:
        """Failed requests and console errors since the page loaded (drawn widgets, fonts)."""
        problems = []
        while True:
            try:
                ev = self.browser.events.get_nowait()
            except queue.Empty:
                return problems
            if ev.get("sessionId") == self.session:
                problems += self._problem(ev)

    def screenshot(self, path: Path, width: int):
        """The whole page (up to MAX_SHOT_HEIGHT), as in a window as tall as the page.

        Growing the window and PNG's fast encoder: 3x faster than captureBeyondViewport with
        the default encoder on a 16000 px page (3.4 s against 10.6 s on the shared machine).
        """
        height = self.evaluate("Math.ceil(document.documentElement.scrollHeight)") or HEIGHT
        height = max(HEIGHT, min(int(height), MAX_SHOT_HEIGHT))
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1,
                   "mobile": width < 600})
        shot = self.send("Page.captureScreenshot", {"format": "png", "optimizeForSpeed": True},
                         timeout=60)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))


def _event_problem(ev: dict) -> list[str]:
    method, p = ev["method"], ev.get("params", {})
    if method == "Network.responseReceived":
        status, url = p["response"]["status"], p["response"]["url"]
        if status >= 400 and not url.endswith("/favicon.ico"):
            return [f"HTTP {status}: {_short(url)}"]
    elif method == "Network.loadingFailed":
        if p.get("canceled"):
            return []
        return [f"request failed ({p.get('errorText')}): {_short(p.get('url', '?'))}"]
    elif method == "Network.requestWillBeSent":
        url = p["request"]["url"]
        host = urllib.parse.urlsplit(url).hostname
        if host not in (None, "127.0.0.1") and not url.startswith(("data:", "blob:", "about:")):
            return [f"request to another host: {_short(url)}"]
    elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
        text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
        return [f"console error: {text[:200]}"]
    elif method == "Runtime.exceptionThrown":
        d = p.get("exceptionDetails", {})
        text = d.get("exception", {}).get("description") or d.get("text", "")
        return [f"uncaught exception: {text.splitlines()[0][:200] if text else '?'}"]
    elif method == "Log.entryAdded" and p["entry"].get("level") == "error":
        entry = p["entry"]
        if entry.get("source") == "network":
            return []  # already reported from the Network events, with the URL
        return [f"console error ({entry.get('source')}): {entry.get('text', '')[:200]}"]
    return []


def _short(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return parts.path + (f"?{parts.query}" if parts.query else "") if parts.hostname == "127.0.0.1" else url


# ----------------------------------------------------------------------------- in the page
# Runs in the page after it has loaded; returns {problems: [...], links: [...]}. The links are
# checked in Python against the files of the site.
PAGE_CHECK_JS = r"""
(async () => {
  const SETTLE_MS = %(settle_ms)d, DARK = %(dark)s, WARN = "warning: ";
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const start = performance.now();
  const problems = [];
  const describe = (el) => {
    let what = el.tagName.toLowerCase();
    if (el.closest("mjx-container")) what = "equation";
    else if (el.closest("table")) what = "table";
    else if (el.closest(".cell_output, .output")) what = "output";
    else if (el.closest("pre, .highlight")) what = "code";
    else if (el.closest("figure, img, svg")) what = "figure";
    else if (el.closest(".wtmg-calculator")) what = "calculator";
    const section = el.closest("section[id]");
    let text = (el.getAttribute("alt") || el.textContent || "").replace(/\s+/g, " ").trim();
    if (el.closest("mjx-container")) {
      const c = el.closest("mjx-container");
      const tex = c.querySelector("mjx-assistive-mml") ? "" : "";
      text = (c.getAttribute("aria-label") || c.textContent || "").replace(/\s+/g, " ").trim();
    }
    return `${what} <${el.tagName.toLowerCase()}${el.className && typeof el.className === "string" ? "." + el.className.trim().split(/\s+/).join(".") : ""}>` +
           (section ? ` in #${section.id}` : "") + (text ? ` "${text.slice(0, 60)}"` : "");
  };

  // 1. wait for MathJax, then for the widgets and calculators to draw
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await Promise.race([MathJax.startup.promise, sleep(SETTLE_MS)]);
  }
  const widgetScripts = () => [...document.querySelectorAll(
    "script[type='application/vnd.jupyter.widget-view+json']")];
  const drawn = (s) => {
    const box = s.parentElement;
    const views = box ? box.querySelectorAll(".jupyter-widgets, .widget-container, .lm-Widget") : [];
    return [...views].some((v) => v.getBoundingClientRect().height > 0);
  };
  const calculators = () => [...document.querySelectorAll(".wtmg-calculator")];
  const calcDrawn = (c) => {
    const svg = c.querySelector("svg");
    return svg && svg.childElementCount > 0 && svg.getBoundingClientRect().height > 0;
  };
  while (performance.now() - start < SETTLE_MS &&
         (widgetScripts().some((s) => !drawn(s)) || calculators().some((c) => !calcDrawn(c)))) {
    await sleep(100);
  }
  await sleep(150);  // fonts, last reflows
  if (document.fonts) await Promise.race([document.fonts.ready, sleep(2000)]);

  widgetScripts().forEach((s, i) => {
    if (!drawn(s)) problems.push(`widget ${i + 1} did not draw`);
    const error = s.parentElement && /Error displaying widget[^\n]*/.exec(s.parentElement.textContent);
    if (error) problems.push(`widget ${i + 1}: ${error[0].slice(0, 120)}`);
  });
  calculators().forEach((c) => {
    if (!calcDrawn(c)) problems.push(`calculator #${c.id} did not draw its chart`);
    const msg = c.querySelector(".wtmg-msg");
    if (msg && msg.textContent.trim()) problems.push(`calculator #${c.id} says: ${msg.textContent.trim()}`);
  });

  // 2. math: every TeX source typeset, no MathJax error
  document.querySelectorAll("mjx-merror, .MathJax_Error").forEach((e) =>
    problems.push(`equation error: ${(e.getAttribute("data-mjx-error") || e.textContent).slice(0, 100)}`));
  document.querySelectorAll(".math").forEach((m) => {
    if (!m.querySelector("mjx-container") && /\\\(|\\\[|\$\$/.test(m.textContent))
      problems.push(`equation not typeset: ${m.textContent.trim().slice(0, 60)}`);
  });

  // 3. images: alt text; in dark mode, a light backdrop behind each figure
  const lum = (rgb) => {
    const v = rgb.match(/[\d.]+/g).map(Number);
    return v.length === 4 && v[3] === 0 ? null : (0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2]) / 255;
  };
  const backdrop = (el) => {
    for (let e = el; e && e.nodeType === 1; e = e.parentElement) {
      const l = lum(getComputedStyle(e).backgroundColor);
      if (l !== null) return l;
    }
    return lum(getComputedStyle(document.documentElement).backgroundColor) ?? 1;
  };
  document.querySelectorAll("img").forEach((img) => {
    const r = img.getBoundingClientRect();
    const src = img.getAttribute("src") || "";
    const name = src.startsWith("data:") ? `${src.slice(0, 22)}… (inline)` : src.split("/").pop();
    const alt = (img.getAttribute("alt") || "").trim();
    if (!alt && img.getAttribute("role") !== "presentation" && img.getAttribute("aria-hidden") !== "true")
      problems.push(`image without alt text: ${name}`);
    else if (alt && (alt === src || /\.(png|jpe?g|svg|gif|webp)$/i.test(alt)))
      problems.push(`${WARN}image whose alt text is its file name: ${name} ` +
                    `(give the figure an alt text: cell metadata mystnb.image.alt)`);
    if (!img.complete || (img.naturalWidth === 0 && r.width > 0))
      problems.push(`image did not load: ${name}`);
    if (DARK && r.width > 0 && img.closest("article") && backdrop(img) < 0.6)
      problems.push(`dark mode: image ${name} sits on a dark backdrop (luminance ${backdrop(img).toFixed(2)} < 0.6)`);
  });
  if (DARK) {
    document.querySelectorAll("article svg").forEach((svg) => {
      if (svg.closest("mjx-container, button, .fa, i, a, label, .headerlink")) return;
      const r = svg.getBoundingClientRect();
      if (r.width >= 100 && backdrop(svg) < 0.6)
        problems.push(`dark mode: figure <svg> sits on a dark backdrop (luminance ${backdrop(svg).toFixed(2)} < 0.6)`);
    });
  }

  // (dark mode) text against its backdrop: contrast ratio at least 3 (WCAG's floor, large text)
  if (DARK) {
    const rel = (rgb) => {
      const v = rgb.match(/[\d.]+/g).map(Number);
      if (v.length === 4 && v[3] === 0) return null;
      const c = v.slice(0, 3).map((x) => (x /= 255) <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4);
      return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2];
    };
    const behind = (el) => {
      for (let e = el; e && e.nodeType === 1; e = e.parentElement) {
        const l = rel(getComputedStyle(e).backgroundColor);
        if (l !== null) return l;
      }
      return rel(getComputedStyle(document.body).backgroundColor) ?? 1;
    };
    const seen = new Set(), walker = document.createTreeWalker(
      document.querySelector("article") || document.body, NodeFilter.SHOW_TEXT);
    let low = 0;
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      const el = n.parentElement;
      if (!n.data.trim() || !el || seen.has(el)) continue;
      seen.add(el);
      if (el.closest(".headerlink, mjx-assistive-mml, script, style") || !el.getClientRects().length) continue;
      const fg = rel(getComputedStyle(el).color);
      if (fg === null) continue;
      const bg = behind(el), ratio = (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
      if (ratio < 3 && low++ < 5)
        problems.push(`dark mode: text with contrast ${ratio.toFixed(2)} < 3 against its backdrop: ${describe(el)}`);
    }
  }

  // 4. horizontal overflow: past the article's column and not inside a scrolling/clipping box
  const W = document.documentElement.clientWidth;
  if (document.documentElement.scrollWidth > W + 1)
    problems.push(`the page is wider than the window: ${document.documentElement.scrollWidth} px > ${W} px`);
  const article = document.querySelector("article.bd-article") ||
                  document.querySelector("article") || document.querySelector("main");
  if (article) {
    const col = article.getBoundingClientRect();
    // Past the column, el is fine inside a box that scrolls x; a box that clips x (hidden)
    // and that el reaches past cuts it off; with neither up to the article, it sticks out.
    const fate = (el, r) => {
      for (let e = el.parentElement; e && e !== article; e = e.parentElement) {
        const ox = getComputedStyle(e).overflowX;
        if (ox === "auto" || ox === "scroll") return "scrolls";
        if (ox !== "visible") {
          const b = e.getBoundingClientRect();
          if (r.right > b.right + 1 || r.left < b.left - 1) return "cut";
        }
      }
      return "sticks out";
    };
    const reported = new Set();
    for (const el of article.querySelectorAll("*")) {
      if (el.closest("mjx-assistive-mml, .visually-hidden, .sr-only")) continue;
      const r = el.getBoundingClientRect();
      if (r.width === 0 || r.height === 0) continue;
      if (r.right <= col.right + 1 && r.left >= col.left - 1) continue;
      const how = fate(el, r);
      if (how === "scrolls") continue;
      let parentReported = false;
      for (let p = el.parentElement; p && p !== article; p = p.parentElement)
        if (reported.has(p)) { parentReported = true; break; }
      reported.add(el);
      if (parentReported) continue;
      const over = Math.round(Math.max(r.right - col.right, col.left - r.left));
      problems.push(`${describe(el)} reaches ${over} px past its column (${Math.round(col.width)} px) and ` +
                    (how === "cut" ? `is cut off (a box with overflow-x: hidden, not a scrolling one)` : `does not scroll`));
    }
  }

  // An equation that fits only by scrolling sideways is readable but awkward: a warning, so that
  // the chapter can break it (aligned) where it is too wide.
  document.querySelectorAll("article mjx-container[display='true']").forEach((m) => {
    if (m.scrollWidth > m.clientWidth + 1 && m.clientWidth > 0)
      problems.push(`${WARN}equation scrolls sideways (${m.scrollWidth} px in ${m.clientWidth} px): ` +
                    describe(m.firstElementChild || m));
  });

  // 5. CJK text must have a web font of the site (a reader may have no CJK font installed)
  const CJK = /[\u2E80-\u2FDF\u3000-\u303F\u3040-\u30FF\u3100-\u31FF\u3200-\u4DBF\u4E00-\u9FFF\uAC00-\uD7AF\uF900-\uFAFF\uFE30-\uFE4F\uFF00-\uFFEF]+/;
  const loaded = new Set([...(document.fonts || [])].filter((f) => f.status === "loaded")
                           .map((f) => f.family.replace(/^["']|["']$/g, "")));
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const noFont = new Set();
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const m = n.data.match(CJK);
    if (!m || !n.parentElement || n.parentElement.closest("script, style, mjx-assistive-mml")) continue;
    if (!n.parentElement.getClientRects().length) continue;
    const families = getComputedStyle(n.parentElement).fontFamily.split(",")
                       .map((f) => f.trim().replace(/^["']|["']$/g, ""));
    if (!families.some((f) => loaded.has(f))) noFont.add(m[0]);
  }
  noFont.forEach((t) => problems.push(`CJK text "${t}" has no web font of the site: boxes where no CJK font is installed`));

  // 6. links: same-page anchors here; other pages of the site in Python
  const links = [];
  for (const a of document.querySelectorAll("a[href]")) {
    const href = a.getAttribute("href");
    if (!href || href.startsWith("javascript:") || href === "#") continue;
    const url = new URL(href, location.href);
    if (url.origin !== location.origin) continue;
    if (url.pathname === location.pathname && url.hash) {
      const id = decodeURIComponent(url.hash.slice(1));
      if (!document.getElementById(id) && !document.getElementsByName(id).length)
        problems.push(`broken anchor: ${href}`);
    } else {
      links.push(url.pathname + url.hash);
    }
  }
  return {problems, links: [...new Set(links)],
          dark: document.documentElement.dataset.theme === "dark"};
})()
"""


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


def check_page(tab: Tab, base: str, site: Path, page: str, width: int, dark: bool = False,
               shot: Path | None = None) -> list[str]:
    """The problems of one page at one width (and colour scheme); saves its screenshot."""
    tab.set_view(width, dark)
    problems = tab.visit(f"{base}/{page}")
    found = tab.evaluate(PAGE_CHECK_JS % {"settle_ms": int(SETTLE_S * 1000),
                                          "dark": "true" if dark else "false"},
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


def views(widths: list[int]) -> list[tuple[int, bool]]:
    """(width, dark) of each visit: every width in light mode, the first width in dark mode."""
    return [(w, False) for w in widths] + [(widths[0], True)]


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
                    for width, dark in views(widths):
                        tag = f"{width}{'-dark' if dark else ''}"
                        shot = out / f"{page.removesuffix('.html').replace('/', '__')}@{tag}.png"
                        try:
                            found = check_page(tab, base, site, page, width, dark,
                                               shot if screenshots else None)
                        except CDPError as err:
                            found = [f"the browser failed: {err}"]
                        for p in found:  # the same problem at several views: one line
                            views_of.setdefault(p, []).append(tag)
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
    return [f"{w}{'-dark' if d else ''}" for w, d in views(widths)]


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
