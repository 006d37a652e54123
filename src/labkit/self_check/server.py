"""The warm Python's server: a process that imported torch, pytest and matplotlib once, and forks
a fresh child for each ``python -m MODULE ARGS`` it is asked to run.

Run by :mod:`labkit.self_check.warm` as a script (``python server.py MODULE...``, the modules to
import first), never as ``-m``: it imports no part of labkit, so a child imports every labkit
module itself, fresh, and the code a student just saved is the code that runs. It reads one JSON
request a line on stdin, ``{"module", "args", "cwd", "env", "output"}``, and answers two JSON
lines on stdout: ``{"pid": P}`` when the child is started, ``{"returncode": R, "cpu_seconds": C}``
when it ends (a child killed by signal S ends with -S; C counts the child and what it waited
for). It exits when stdin closes.

Each child behaves as ``python -m MODULE ARGS`` started in ``cwd`` with environment ``env``: its own
session (the caller kills the whole group on a timeout), ``sys.path`` led by ``cwd``, ``sys.argv``
set, stdin from /dev/null, stdout and stderr into the file ``output``.
"""
import json
import os
import runpy
import signal
import sys
import traceback


def _child(request: dict, base_path: list[str]) -> None:
    """In the forked child: become ``python -m module args`` and exit with its status."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
        sys.path[:] = [request["cwd"], *base_path]
        sys.argv = [request["module"], *request["args"]]
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # SystemExit("message"): printed, status 1, as the interpreter does
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child reports anything, as an interpreter would
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream has nothing left to flush
                pass
        os._exit(code)


def main() -> None:
    for name in sys.argv[1:]:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a module preloaded only saves time; the child imports it
            pass
    loaded = sorted(m for m in sys.modules if m == "labkit" or m.startswith("labkit."))
    if loaded:  # a preload that pulled in labkit would serve stale student code
        raise SystemExit(f"labkit.self_check.server: preloading imported {loaded}")
    base_path = sys.path[1:]  # without this script's own folder
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, base_path)
        print(json.dumps({"pid": pid}), flush=True)
        _, status, usage = os.wait4(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                          "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3)}), flush=True)
    os._exit(0)  # at once: the caller waits for us at its exit (torch's teardown would take a second)


if __name__ == "__main__":
    main()
