"""Time a reference solution next to the library's implementation of the same work.

``make bench`` (``tools/bench``) and the chapters' speed tables both use this module, so a ratio
in the book is measured the way the benchmark measures it:

- ``ours`` and ``ref`` are zero-argument callables that do the same work once (set-up done
  beforehand, outside them);
- one warm-up call of each, then ``repeat`` rounds *interleaved* (ours, ref, ours, ref, ...), so
  both run under the same machine load;
- the medians of CPU time (this process and the rank processes it waited for:
  ``cpu_seconds``) and of wall time; the ratio ours / ref of each.

CPU time is the number to read on a shared machine: other people's processes slow the wall
clock, not the CPU seconds this work needs. Time with one torch thread
(``torch.set_num_threads(1)``) for ratios that mean the same on any machine.

    cases = [Case(5, "FlashAttention fwd+bwd, S=1024", ours, sdpa, "SDPA")]
    markdown, rows = bench_table(cases, repeat=5)
"""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass
class Case:
    """One row: ``ours`` and ``ref`` do the same work once each call."""

    lab: int
    label: str
    """What is timed, e.g. ``"Adam8bit step, lab GPT"``."""
    ours: Callable[[], object]
    ref: Callable[[], object]
    ref_name: str
    """The library implementation, e.g. ``"bitsandbytes Adam8bit"``."""
    repeat: int = 15
    note: str = ""
    """Anything the reader needs to read the ratio (e.g. FLOPs ratio next to a time ratio)."""
    target: float | None = 1.5
    """The ratio ours / ref this row should stay within. 1.5 where both sides do the same work
    (a reference solution may cost at most half as much again as the library); ``None`` for a
    *context* row, which sets different work side by side to show what a technique costs (8-bit
    states against fp32 ones, a recompute against none): its note says what the ratio means."""

    def __post_init__(self) -> None:
        if self.target is not None and (isinstance(self.target, bool)
                                        or not isinstance(self.target, (int, float))
                                        or not self.target > 0):
            raise ValueError(f"Case.target must be None (a context row) or a ratio > 0, "
                             f"got {self.target!r}")


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of the child processes it has waited for
    (the ranks of ``labkit.ranks.launch``): the work done, whatever else the machine runs."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def time_case(case: Case, repeat: int | None = None) -> dict:
    """Time ``case``: a warm-up call of each side, then ``repeat`` (default ``case.repeat``)
    interleaved rounds. Returns the medians in seconds and the ratios ours / ref:
    ``{"lab", "label", "reference", "ours_s", "ref_s", "ratio", "ours_wall_s", "ref_wall_s",
    "wall_ratio", "repeat", "note", "target"}`` (``ours_s``, ``ref_s`` and ``ratio`` in CPU time).

    Raises:
        TypeError: ``case`` is not a Case or its sides are not callable.
        ValueError: ``repeat`` is not an int >= 1.
    """
    if not isinstance(case, Case):
        raise TypeError(f"case must be a labkit.bench.Case, got {type(case).__name__}")
    for name in ("ours", "ref"):
        if not callable(getattr(case, name)):
            raise TypeError(f"case.{name} must be a zero-argument callable, got "
                            f"{type(getattr(case, name)).__name__}")
    repeat = case.repeat if repeat is None else repeat
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
    case.ours(), case.ref()  # warm-up: first calls allocate, import, compile
    cpu = {"ours": [], "ref": []}
    wall = {"ours": [], "ref": []}
    for _ in range(repeat):
        for side in ("ours", "ref"):
            fn = getattr(case, side)
            c0, w0 = cpu_seconds(), time.perf_counter()
            fn()
            wall[side].append(time.perf_counter() - w0)
            cpu[side].append(cpu_seconds() - c0)
    med = {key: statistics.median(values) for key, values in
           (("ours_s", cpu["ours"]), ("ref_s", cpu["ref"]),
            ("ours_wall_s", wall["ours"]), ("ref_wall_s", wall["ref"]))}
    return {"lab": case.lab, "label": case.label, "reference": case.ref_name, **med,
            "ratio": med["ours_s"] / med["ref_s"] if med["ref_s"] > 0 else float("nan"),
            "wall_ratio": med["ours_wall_s"] / med["ref_wall_s"],
            "repeat": repeat, "note": case.note, "target": case.target}


def _cells(rows: Sequence[dict], ours_name: str, wall: bool) -> tuple[list, list]:
    head = ["what", f"{ours_name} (ms CPU)", "reference", "reference (ms CPU)", "ratio (CPU)"]
    body = [[r["label"], f"{r['ours_s'] * 1e3:.1f}", r["reference"], f"{r['ref_s'] * 1e3:.1f}",
             f"{r['ratio']:.2f}"] + ([f"{r['wall_ratio']:.2f}"] if wall else []) for r in rows]
    return head + (["ratio (wall)"] if wall else []), body


def markdown_table(rows: Sequence[dict], ours_name: str = "ours", wall: bool = True) -> str:
    """The rows of :func:`time_case` as a Markdown table (times in ms, ratios ours / reference;
    ``wall``: add the wall-time ratio, which a loaded machine makes noisy)."""
    head, body = _cells(rows, ours_name, wall)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def html_table(rows: Sequence[dict], ours_name: str = "ours", wall: bool = True) -> str:
    """The rows of :func:`time_case` as an HTML table, for pages whose cells cannot print
    Markdown tables (MyST-NB renders a cell's Markdown as CommonMark unless the page sets
    ``render_markdown_format: myst``)."""
    from html import escape

    head, body = _cells(rows, ours_name, wall)
    cells = lambda tag, row: "".join(f"<{tag}>{escape(str(c))}</{tag}>" for c in row)  # noqa: E731
    return ("<table>\n<thead><tr>" + cells("th", head) + "</tr></thead>\n<tbody>\n"
            + "\n".join("<tr>" + cells("td", row) + "</tr>" for row in body)
            + "\n</tbody>\n</table>")


def bench_table(cases: Sequence[Case], repeat: int | None = None, ours_name: str = "ours",
                wall: bool = True) -> tuple[str, list[dict]]:
    """Time every case (:func:`time_case`) and return (a Markdown table, the rows)."""
    if isinstance(cases, Case) or not all(isinstance(c, Case) for c in cases):
        raise TypeError("cases must be a sequence of labkit.bench.Case")
    rows = [time_case(case, repeat) for case in cases]
    return markdown_table(rows, ours_name, wall), rows
