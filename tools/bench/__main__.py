"""``make bench``: every reference solution next to the library doing the same work, as ratios.

Each lab lists its rows in ``tools/bench/labN.py`` as ``def cases() -> list[Case]``
(``tools/bench/case.py``). The runner times each case's ``ours`` and ``ref`` interleaved (ours,
ref, ours, ref, ...) after one warm-up call of each, in this one process with one torch thread,
and reports the medians and ``ours / ref`` in CPU time (this process plus the rank processes it
waited for) and in wall time (``labkit.bench.time_case``: the chapters' speed tables use the
same code). Interleaving puts both under the same machine load, and CPU time leaves out the
time other processes take from it, so the ratio means something on a shared machine even when
the absolute times do not. The target applies to the CPU-time ratio.

Each row has its own target (``Case.target``): 1.5 where both sides do the same work; another
bound where the row says so (the allocator's slowdown with live blocks: 2; checkpointing against
a plain step plus the forward it recomputes: 1.1); none for a *context* row, which sets
different work side by side to show what a technique costs (8-bit optimizer states against
fp32 ones, a file-backed optimizer against one in memory, what fusion buys). Context rows are
printed and tabled with "context" in the target column and never count as above target.

    .venv/bin/python -m tools.bench              # every lab
    .venv/bin/python -m tools.bench --lab 2      # one lab
    .venv/bin/python -m tools.bench --strict     # exit 1 if a row is above its target
Writes ``_build/bench/bench.json`` and ``_build/bench/bench.md`` (a table the book can include).
"""
from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch

from labkit.bench import time_case

ROOT = Path(__file__).resolve().parents[2]


def available_labs() -> list[int]:
    """The labs that have rows: one ``tools/bench/labN.py`` each."""
    return sorted(int(p.stem[3:]) for p in (ROOT / "tools" / "bench").glob("lab*.py"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lab", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "_build" / "bench"))
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if a row is above its target (default: only mark it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    labs = available_labs()
    if args.lab is not None:
        if args.lab not in labs:
            raise SystemExit(f"--lab {args.lab}: no tools/bench/lab{args.lab}.py (have {labs})")
        labs = [args.lab]
    rows = []
    for lab in labs:
        for case in importlib.import_module(f"tools.bench.lab{lab}").cases():
            row = time_case(case)
            rows.append(row)
            print(f"lab {lab}  {row['label']:<44} {row['ours_s'] * 1e3:9.2f} ms  vs "
                  f"{row['reference']:<32} {row['ref_s'] * 1e3:9.2f} ms  ratio {row['ratio']:5.2f}"
                  f" (wall {row['wall_ratio']:5.2f})  {_target(row)}"
                  + ("  ABOVE TARGET" if _above(row) else "")
                  + (f"  ({row['note']})" if row["note"] else ""), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(rows, indent=1))
    lines = ["| lab | what | ours (ms CPU) | reference | reference (ms CPU) | ratio (CPU) | "
             "ratio (wall) | target |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['lab']} | {r['label']} | {r['ours_s'] * 1e3:.2f} | {r['reference']} | "
              f"{r['ref_s'] * 1e3:.2f} | {r['ratio']:.2f} | {r['wall_ratio']:.2f} | "
              f"{_target(r)} |" for r in rows]
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    above = [r for r in rows if _above(r)]
    targeted = sum(r["target"] is not None for r in rows)
    print(f"{targeted - len(above)} of {targeted} targeted rows within their target; "
          f"{len(rows) - targeted} context rows")
    if above:
        print(f"{len(above)} row(s) above their target: "
              + "; ".join(f"lab {r['lab']} {r['label']} ({r['ratio']:.2f} > {r['target']:g})"
                          for r in above))
    return 1 if above and args.strict else 0


def _target(row: dict) -> str:
    return "context" if row["target"] is None else f"≤ {row['target']:g}"


def _above(row: dict) -> bool:
    return row["target"] is not None and row["ratio"] > row["target"]

if __name__ == "__main__":
    raise SystemExit(main())
