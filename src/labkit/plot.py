"""One figure style for the whole course: the same colour means the same consumer everywhere.

    from labkit import plot
    plot.stacked_bars({"fp32 Adam": bytes_by_consumer, ...})     # bars stacked by consumer
    plot.timeline(step_memory)                                  # bytes by consumer over one step

Every function returns the matplotlib Figure (the notebook displays it) and never calls
``plt.show()``, so the same code works in the book build, nbval and Colab.
"""
from __future__ import annotations

import textwrap
from typing import Mapping

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labkit.measure import CONSUMERS, StepMemory

COLORS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer states": "#55A868",
    "activations": "#C44E52",
    "temporaries": "#8172B3",
    "other": "#937860",
}
"""Consumer → colour, fixed across chapters."""

PHASE_SHADES = {"forward": "#f2f2f2", "backward": "#e3e3e3", "optimizer": "#d2d2d2"}

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "GB": 10**9, "TB": 10**12}


def style() -> None:
    """Apply the course's matplotlib style (called on import)."""
    plt.rcParams.update({
        "figure.figsize": (7.5, 3.6), "figure.dpi": 110, "axes.spines.top": False,
        "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
        "legend.frameon": False, "font.size": 10,
    })


style()


def _unit(unit: str) -> int:
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {tuple(UNITS)}, got {unit!r}")
    return UNITS[unit]


def fit_bar_labels(ax, *, min_size: float = 7.0) -> None:
    """Make the x tick labels of a bar chart fit their bars: wrap each label at spaces to the
    width of one bar's slot, then shrink the font (down to ``min_size``), and, if a single word
    is still wider than its slot, slant the labels. Measured with the figure's renderer, so call
    it again after resizing the figure."""
    fig = ax.figure
    ticks = ax.get_xticks()
    labels = [t.get_text() for t in ax.get_xticklabels()]
    if len(ticks) == 0 or not any(labels):
        return
    renderer = fig.canvas.get_renderer()
    slot = ax.get_window_extent(renderer).width / len(ticks) * 0.92  # pixels of one bar's room

    def widest(texts, size):
        ax.set_xticks(ticks, texts, fontsize=size, rotation=0, ha="center")
        return max(t.get_window_extent(renderer).width for t in ax.get_xticklabels())

    size = ax.get_xticklabels()[0].get_fontsize()
    longest = max(len(line) for label in labels for line in label.split("\n"))
    while True:
        for chars in range(longest, 3, -1):  # the widest wrapping that fits, at this size
            texts = ["\n".join(textwrap.fill(line, chars, break_long_words=False) or line
                                for line in label.split("\n")) for label in labels]
            if widest(texts, size) <= slot:
                return
        if size <= min_size:
            break
        size = max(min_size, size - 1)
    ax.set_xticks(ticks, texts, fontsize=size, rotation=30, ha="right", rotation_mode="anchor")


def stacked_bars(bars: Mapping[str, Mapping[str, float]], *, unit: str = "MiB",
                 title: str = "", limit: float | None = None, limit_label: str = "",
                 ax=None, figsize: tuple[float, float] | None = None) -> Figure:
    """Bars stacked by consumer, one bar per label.

    Args:
        bars: label → {consumer: bytes}; consumers missing from a bar count as 0.
        unit: the y axis unit (B, KiB, MiB, GiB, GB, TB).
        limit: bytes of a horizontal line to draw (e.g. one GPU's 80 GB).
        figsize: (width, height) in inches of a new figure (the course's default when None).
    Labels that are wider than their bar are wrapped (``fit_bar_labels``); the legend stands
    to the right of the axes, never over a bar.
    """
    div = _unit(unit)
    if not isinstance(bars, Mapping) or not bars:
        raise ValueError(f"bars must be a non-empty mapping label -> {{consumer: bytes}}, "
                         f"got {type(bars).__name__}")
    for label, parts in bars.items():
        if not isinstance(parts, Mapping):
            raise ValueError(f"bar {label!r} must map consumer -> bytes, got {type(parts).__name__}")
        unknown = set(parts) - set(COLORS)
        if unknown:
            raise ValueError(f"bar {label!r}: unknown consumers {sorted(unknown)}; "
                             f"allowed: {list(COLORS)}")
        for consumer, nbytes in parts.items():
            if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not 0 <= nbytes < float("inf"):
                raise ValueError(f"bar {label!r}: bytes of {consumer!r} must be a finite number >= 0, "
                                 f"got {nbytes!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                              or limit < 0):
        raise ValueError(f"limit must be None or bytes >= 0, got {limit!r}")
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=figsize)
    labels = list(bars)
    bottom = [0.0] * len(labels)
    for consumer in CONSUMERS:
        heights = [bars[label].get(consumer, 0) / div for label in labels]
        if any(heights):
            ax.bar(labels, heights, bottom=bottom, color=COLORS[consumer], label=consumer)
            bottom = [b + h for b, h in zip(bottom, heights)]
    if limit is not None:
        ax.axhline(limit / div, color="black", linestyle="--", linewidth=1)
        if limit_label:
            ax.text(len(labels) - 0.5, limit / div, f" {limit_label}", va="bottom", ha="right")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fit_bar_labels(ax)
    fig.tight_layout()
    return fig


def timeline(step: StepMemory, *, unit: str = "MiB", title: str = "", ax=None) -> Figure:
    """Bytes by consumer after each operator of a measured step, phases shaded behind."""
    div = _unit(unit)
    if not isinstance(step, StepMemory):
        raise ValueError(f"step must be a labkit.measure.StepMemory (from measure_step), "
                         f"got {type(step).__name__}")
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots()
    xs = [p.op for p in step.timeline]
    stacks = [[p.bytes[c] / div for p in step.timeline] for c in CONSUMERS]
    ax.stackplot(xs, *stacks, colors=[COLORS[c] for c in CONSUMERS], labels=CONSUMERS,
                 linewidth=0)
    start = 0
    for i in range(1, len(step.timeline) + 1):  # shade each run of one phase
        if i == len(step.timeline) or step.timeline[i].phase != step.timeline[start].phase:
            phase = step.timeline[start].phase
            ax.axvspan(start, i, color=PHASE_SHADES[phase], zorder=-1, linewidth=0)
            ax.text((start + i) / 2, 0.99, phase, transform=ax.get_xaxis_transform(),
                    ha="center", va="top", fontsize=8)
            start = i
    for b in step.step_boundaries[1:]:
        ax.axvline(b, color="black", linewidth=0.8)
    ax.set_xlabel("operator index in the step")
    ax.set_ylabel(unit)
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    used = [i for i, c in enumerate(CONSUMERS) if any(stacks[i])]
    ax.legend([handles[i] for i in used], [labels[i] for i in used], loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    ax.set_xlim(0, max(xs) if xs else 1)
    fig.tight_layout()
    return fig
