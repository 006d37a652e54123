"""A warm Python: ``python -m MODULE ARGS`` in a fresh process that starts in a fraction of a second.

A check runs the graders in a new process, so that the code a student just saved is the code that
is graded. Most of that process's start-up is importing torch, pytest and matplotlib (about 3 s of
CPU of a 4–6 s check): here one server process (:mod:`labkit.self_check.server`, started on first
use, one per Python that uses it) imports them once and forks a child per run. A child imports
every labkit module itself, so it sees what is on disk now; it behaves as the command line would
(working directory, environment, ``sys.argv``, exit status, output), in its own session, killed
with everything it started when the time is up.

Where ``fork`` is not safe or not there (Windows; macOS, whose system frameworks refuse a fork
after they have started), and if the server cannot be reached, the run is an ordinary
``subprocess.run`` of the same command: the same result, only slower to start.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "torch.distributed._tools.mem_tracker", "torch.utils.checkpoint",
           "torch.utils.flop_counter", "numpy", "matplotlib.pyplot", "pytest")
"""What the server imports once: the libraries every grader run imports, never labkit itself."""

SERVER = Path(__file__).with_name("server.py")

_server: subprocess.Popen | None = None
_server_env: dict | None = None  # the environment the server was started with


def can_fork() -> bool:
    """True where a server may fork its children: POSIX, not macOS."""
    return hasattr(os, "fork") and sys.platform != "darwin"


def run_module(module: str, args: list[str], *, cwd: str | os.PathLike, env: dict,
               timeout: float) -> subprocess.CompletedProcess:
    """``python -m module *args`` run in ``cwd`` with environment ``env``: the returncode and the
    output (stdout and stderr together, in ``.stdout``).

    Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds, the process and everything it
    started killed; a KeyboardInterrupt kills them too before it goes on.
    """
    command = [sys.executable, "-m", module, *args]
    if can_fork():
        try:
            return _run_warm(module, args, cwd=str(cwd), env=dict(env), timeout=timeout)
        except (OSError, EOFError, ValueError):  # the server is gone or answered nonsense
            stop()
    proc = subprocess.run(command, cwd=cwd, env=env, timeout=timeout, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    return proc


def stop() -> None:
    """Stop the server (the next run starts another); also at exit, so that the server is waited
    for and its CPU time counts in this process's children's."""
    global _server
    if _server is not None:
        server, _server = _server, None
        try:
            server.stdin.close()  # end of requests: the server exits
            server.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            server.kill()
            server.wait()
        server.stdout.close()


atexit.register(stop)


def _ensure_server(env: dict) -> subprocess.Popen:
    """The running server, started again if it died or if ``env`` is not the one it started with
    (its preloaded modules read the environment when they were imported)."""
    global _server, _server_env
    env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's, per test
    if _server is not None and (_server.poll() is not None or env != _server_env):
        stop()
    if _server is None:
        _server = subprocess.Popen([sys.executable, str(SERVER), *PRELOAD], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   env=env, start_new_session=True)  # a notebook's Ctrl-C spares it
        _server_env = env
    return _server


def _reply(server: subprocess.Popen, deadline: float | None) -> dict:
    """The server's next JSON line; TimeoutError once ``deadline`` (time.monotonic()) passes."""
    while deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if select.select([server.stdout], [], [], min(left, 1.0))[0]:
            break
    line = server.stdout.readline()
    if not line:
        raise EOFError("the warm Python's server exited")
    return json.loads(line)


def _kill_group(pid: int) -> None:
    """Kill the child's session (it leads it) and so what it started; at least the child."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError):
            continue


def _run_warm(module: str, args: list[str], *, cwd: str, env: dict, timeout: float):
    server = _ensure_server(env)
    with tempfile.TemporaryDirectory(prefix="labkit-check-") as tmp:
        output = Path(tmp) / "output.txt"
        request = {"module": module, "args": list(args), "cwd": cwd, "env": env, "output": str(output)}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        pid = None
        try:
            # the server answers at once unless it is still importing (its first run)
            pid = _reply(server, time.monotonic() + 600)["pid"]
            end = _reply(server, time.monotonic() + timeout)
        except TimeoutError:
            if pid is None:
                raise  # the server never started the child: run_module falls back
            _kill_group(pid)
            _reply(server, None)  # the child's end, so the next request finds the server idle
            raise subprocess.TimeoutExpired([sys.executable, "-m", module, *args], timeout) from None
        except KeyboardInterrupt:
            if pid is not None:
                _kill_group(pid)
            stop()
            raise
        text = output.read_text(errors="replace") if output.exists() else ""
    done = subprocess.CompletedProcess([sys.executable, "-m", module, *args], end["returncode"], stdout=text,
                                       stderr="")
    done.cpu_seconds = end.get("cpu_seconds")  # the child's CPU time (what a check costs)
    return done
