"""What starting ranks costs, per start method: ``python tools/launch_cost.py [--sizes 2 4] [--launches 3]``.

A lab launches ranks from every distributed cell (lab 3 about 54 ranks, lab 5 about 43). Once
CUDA is initialised in the kernel (any lab on a GPU runtime), ``labkit.ranks.launch`` cannot
fork; it used to spawn, a fresh interpreter per rank importing torch again. It now forks each
rank from a zygote (multiprocessing's forkserver) that imported torch once. This script runs
``k`` launches of ``N`` ranks under each start method and prints, per rank, the CPU seconds it
spent before its function returned (start-up, imports, joining the gloo group: the rank's own
``getrusage``) and the wall seconds of each launch; and the zygote's one-time CPU cost.

All on CPU (gloo). Run it alone on an idle machine for steady figures: wall time on a loaded
machine measures the load; CPU seconds much less so.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


def _proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(method: str, world_size: int, launches: int) -> dict:
    from labkit import _rank_examples as ex
    from labkit import ranks

    walls, cpus = [], []
    for _ in range(launches):
        started = time.perf_counter()
        results = ranks.launch(ex.cpu_seconds_so_far, world_size, start_method=method, timeout=300)
        walls.append(time.perf_counter() - started)
        cpus += [r["cpu_s"] for r in results]
    zygote = ranks._zygote_pid() if method == "forkserver" else None
    return {"method": method, "world_size": world_size, "launches": launches,
            "wall_s": walls, "rank_cpu_s": cpus,
            "zygote_cpu_s": _proc_cpu_seconds(zygote) if zygote else 0.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["spawn", "forkserver", "fork"])
    args = parser.parse_args(argv)
    rows = [f"{'method':<11}{'N':>3}{'k':>3}{'CPU s/rank (median)':>21}{'CPU s, all ranks':>18}"
            f"{'one-time CPU s':>16}{'wall s/launch (1st, rest)':>27}"]
    for method in args.methods:
        for n in args.sizes:
            m = measure(method, n, args.launches)
            rest = statistics.median(m["wall_s"][1:]) if len(m["wall_s"]) > 1 else float("nan")
            rows.append(f"{method:<11}{n:>3}{args.launches:>3}{statistics.median(m['rank_cpu_s']):>21.2f}"
                        f"{sum(m['rank_cpu_s']):>18.1f}{m['zygote_cpu_s']:>16.1f}"
                        f"{m['wall_s'][0]:>15.2f}, {rest:<10.2f}")
            print(rows[-1] if len(rows) > 2 else "\n".join(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
