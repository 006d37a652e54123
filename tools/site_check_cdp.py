"""Headless Chromium driven over the Chrome DevTools protocol on a pipe, standard library only.

``--remote-debugging-pipe``: the browser reads NUL-terminated JSON commands on file descriptor 3
and writes answers and events on 4. ``Browser`` starts Chromium with every host but 127.0.0.1
unresolvable; ``Tab`` loads a page, collects its failed requests and console errors, evaluates
JavaScript in it and takes screenshots. Used by tools/site_check.py and tests/test_site_check.py.
"""
from __future__ import annotations

import base64
import fcntl
import itertools
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

HEIGHT = 900                  # the window's height; screenshots cover the whole page
MAX_SHOT_HEIGHT = 16000       # px; a longer page is cut in its screenshot (not in the checks)


def _above_4(fd: int) -> int:
    """``fd`` moved to a number above 4 (the original closed; the copy close-on-exec).

    The child puts the pipe's ends on fds 3 and 4 with dup2. Where fds 3 and 4 were free, as in
    a shell with nothing else open, os.pipe() returns 3 and 4 themselves: dup2(3, 3) does
    nothing, the fd keeps its close-on-exec flag, Chromium starts without its pipe and exits
    (the first command then fails with a broken pipe), and dup2(4, 3) would overwrite the other
    end before it is copied. From above 4, both copies are made, and both are inheritable.
    """
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5)
    os.close(fd)
    return moved


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
        to_child_r, from_child_w = _above_4(to_child_r), _above_4(from_child_w)

        def wire():  # in the child: the pipe ends on fds 3 (commands) and 4 (answers)
            os.dup2(to_child_r, 3)  # dup2 onto another number: the copy is inheritable
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

    def set_view(self, width: int, dark: bool = False, printed: bool = False):
        """The window's width, its colour scheme and, printed, the print media type."""
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": HEIGHT, "deviceScaleFactor": 1,
                   "mobile": width < 600})
        self.send("Emulation.setEmulatedMedia", {"media": "print" if printed else "", "features": [
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
