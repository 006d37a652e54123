"""The parent's side after the start: wait for every rank's report, blame the right rank, clean up."""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from multiprocessing.connection import wait
from pathlib import Path

from labkit.ranks.errors import RankError, RankTimeout, _is_collective_timeout, _is_peer_failure, _ranks_text


def _read_stacks(procs, ranks, stack_dir) -> dict:
    """Ask each still-running rank for its Python stack (faulthandler, on SIGUSR1)."""
    if not (ranks and hasattr(signal, "SIGUSR1")):
        return {}
    for r in ranks:
        with contextlib.suppress(OSError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.3)
    paths = {r: os.path.join(stack_dir, f"rank{r}.stack") for r in ranks}
    return {r: Path(p).read_text().strip() for r, p in paths.items() if os.path.getsize(p)}


def _kill_all(procs) -> None:
    """Kill each child's process group (the child and anything it started), then reap it."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        with contextlib.suppress(OSError, AttributeError):  # no such group (yet, any more); Windows
            os.killpg(p.pid, signal.SIGKILL)  # group id == child pid after its setsid()
        if p.exitcode is None:
            p.kill()
    for p in started:
        p.join(timeout=10)


def _receive(conn, proc, rank, sentinel_ready: bool):
    """The rank's report, a made-up one if it died without a word, or None if not there yet."""
    with contextlib.suppress(EOFError, OSError):
        if conn.poll(0.1):
            return conn.recv()
    if not sentinel_ready:
        return None
    proc.join(timeout=1)
    return ("error", None, f"exit code {proc.exitcode}",
            f"rank {rank} died (exit code {proc.exitcode}) without reporting (killed by a "
            "signal if negative: -9 by the out-of-memory killer or a kill, -6 an abort such as "
            "gloo's \"Is there a distributed collective mismatch in your code?\" (ranks calling "
            "different collectives or sizes: its message is on stderr), -11 a segfault; or it "
            "called os._exit)")


def _collect(procs, conns, fn, world_size, deadline, timeout, pg_timeout, stack_dir) -> list:
    """Wait for every rank's report; raise on the first real error or at the deadline."""
    results, errors, stuck = {}, {}, {}  # rank -> value | (exc_type, message, traceback)
    pending, give_up_at = set(range(world_size)), deadline
    while pending and time.monotonic() < give_up_at:
        ready = set(wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending],
                         timeout=max(0.0, give_up_at - time.monotonic())))
        for r in sorted(pending):
            if conns[r] in ready or procs[r].sentinel in ready:
                message = _receive(conns[r], procs[r], r, procs[r].sentinel in ready)
                if message is None:
                    continue
                pending.discard(r)
                if message[0] == "ok":
                    results[r] = pickle.loads(message[1])
                elif _is_collective_timeout(message[1], message[2]):
                    stuck[r] = message[1:]  # gave up waiting for a peer: a hang, not a bug here
                else:  # wait a moment for the other ranks' errors, longer if this one is an echo
                    errors[r] = message[1:]
                    grace = 1.0 if _is_peer_failure(message[1], message[2]) else 0.2
                    give_up_at = min(give_up_at, time.monotonic() + grace)
    fn_name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    pids = [p.pid for p in procs]
    if errors:
        first = next((r for r in errors if not _is_peer_failure(*errors[r][:2])), next(iter(errors)))
        exc_type, child_tb = errors[first][0], errors[first][2]
        lines = [f"rank {first} of {world_size} "
                 f"{'raised ' + exc_type if exc_type else 'died'} in {fn_name}"]
        lines += [f"  rank {r} also failed: {e[0]}: {e[1].strip()[:300]}"
                  for r, e in errors.items() if r != first]
        lines += [f"  rank {r} gave up waiting in a collective" for r in stuck]
        if pending:
            lines.append(f"  {_ranks_text(pending)} were still running and have been stopped")
        lines += ["", f"Traceback of rank {first}:", child_tb]
        raise RankError("\n".join(lines), rank=first, ranks=sorted(errors), exc_type=exc_type,
                        child_traceback=child_tb, pids=pids)
    if pending or stuck:
        stacks = _read_stacks(procs, sorted(pending), stack_dir)
        unfinished = sorted(pending | set(stuck))
        lines = [f"{_ranks_text(unfinished)} of {world_size} had not finished {fn_name} after "
                 f"{timeout:g} s (launch timeout); every rank has been killed"]
        if results:
            lines.append(f"  {_ranks_text(results)} had returned and waited for the others in "
                         "launch's closing barrier")
        lines += [f"  rank {r} gave up waiting in a collective after the {pg_timeout:g} s "
                  f"process-group timeout (a peer never joined it):\n{stuck[r][2]}" for r in sorted(stuck)]
        lines += [f"  rank {r} was still running; its stack, most recent call first:\n"
                  f"{stacks.get(r, '(no stack: the rank did not answer)')}" for r in sorted(pending)]
        # blame a rank busy in its own code before one waiting for it in a collective
        waiting = {r for r in pending if "distributed_c10d" in stacks.get(r, "")}
        first = min(pending - waiting or pending) if pending else unfinished[0]
        child_tb = stacks.get(first, "") if pending else stuck[first][2]
        raise RankTimeout("\n".join(lines), rank=first, ranks=unfinished, exc_type=None,
                          child_traceback=child_tb, pids=pids)
    return [results[r] for r in range(world_size)]
