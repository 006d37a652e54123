"""Figures of Chapter 5 and Lab 5 (activations) that are more than a few lines of matplotlib."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labkit.plot import COLORS


def per_layer_breakdown(parts: dict[str, dict[str, float]], *, title: str = "",
                        unit: str = "sbh") -> Figure:
    """One horizontal stacked bar per region: ``{region: {tensor: coefficient}}``.

    E.g. Korthikanti et al.'s per-layer activations in units of sbh bytes, the attention
    region's 5as/h term included as one coefficient.
    """
    if not parts or any(not tensors for tensors in parts.values()):
        raise ValueError("parts must map each region to a non-empty {tensor: coefficient} dict")
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.55 * len(parts)))
    palette = plt.get_cmap("tab20").colors
    colour = 0
    for row, (region, tensors) in enumerate(parts.items()):
        left = 0.0
        for name, value in tensors.items():
            ax.barh(row, value, left=left, color=palette[colour % len(palette)],
                    edgecolor="white")
            if value >= 6:
                ax.text(left + value / 2, row, f"{name}\n{value:g}", ha="center", va="center",
                        fontsize=7)
            elif value >= 1.5:
                ax.text(left + value / 2, row, f"{value:g}", ha="center", va="center",
                        fontsize=7)
            left += value
            colour += 1
        ax.text(left + 0.5, row, f"{left:g}", va="center", fontsize=9, fontweight="bold")
    ax.set_yticks(range(len(parts)), list(parts))
    ax.invert_yaxis()
    ax.set(xlabel=f"bytes per layer (units of {unit})", title=title)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def ring_schedule_grid(n_ranks: int, *, causal: bool = True) -> Figure:
    """Rank × step grids of ring attention: which source block each rank attends to, and
    whether it computes it (full, diagonal-masked or skipped), for a contiguous and a zigzag
    split of the sequence."""
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, int) or not 2 <= n_ranks <= 32:
        raise ValueError(f"n_ranks must be an int in [2, 32] (the grid writes one label per rank and "
                         f"step), got {n_ranks!r}")
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(9, 0.9 + 0.45 * n_ranks), sharey=True)
    pieces = 2 * n_ranks
    for ax, zigzag in zip(axes, (False, True)):
        owned = [[r * 2, r * 2 + 1] if not zigzag else [r, pieces - 1 - r]
                 for r in range(n_ranks)]
        work = np.zeros((n_ranks, n_ranks))
        for rank in range(n_ranks):
            for step in range(n_ranks):
                src = (rank - step) % n_ranks
                tiles = 0.0
                for qp in owned[rank]:
                    for kp in owned[src]:
                        tiles += 1.0 if kp < qp else (0.5 if kp == qp else 0.0)
                work[rank, step] = tiles if causal else 4.0
                ax.text(step, rank, f"{src}", ha="center", va="center", fontsize=8)
        ax.imshow(work, cmap="Oranges", vmin=0, vmax=4, aspect="auto")
        totals = work.sum(axis=1)
        ax.set(xlabel="step t (number: the source rank of the key/value block)",
               title=f"{'zigzag' if zigzag else 'contiguous'} split: work per rank "
                     f"{'/'.join(f'{t:g}' for t in totals)}")
        ax.set_xticks(range(n_ranks))
        ax.set_yticks(range(n_ranks))
    axes[0].set_ylabel("rank r")
    fig.tight_layout()
    return fig


def _check_unit(unit: str) -> int:
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "MB": 10**6, "GB": 10**9}
    if unit not in units:
        raise ValueError(f"unit must be one of {tuple(units)}, got {unit!r}")
    return units[unit]


def schedule_timelines(steps, *, consumer: str = "activations", unit: str = "MiB",
                       budget: float | None = None, title: str = "") -> Figure:
    """Memory over time for several checkpointing schedules of one model, overlaid.

    ``steps`` maps a label to a ``labkit.measure.StepMemory`` (from ``measure_step``). One
    curve per step: the bytes of ``consumer`` after each operator, against the operator's index
    in the step (a recompute adds operators, so a checkpointed step is longer); a dot where
    forward ends, with its bytes. ``budget`` (bytes) draws a dashed line.
    """
    from labkit.measure import CONSUMERS, StepMemory

    div = _check_unit(unit)
    if not steps or any(not isinstance(s, StepMemory) for s in steps.values()):
        raise ValueError("steps must map each label to a labkit.measure.StepMemory "
                         "(from measure_step), at least one")
    if consumer not in CONSUMERS:
        raise ValueError(f"consumer must be one of {CONSUMERS}, got {consumer!r}")
    fig, ax = plt.subplots(figsize=(9, 3.8))
    palette = plt.get_cmap("tab10").colors
    for colour, (label, step) in zip(palette, steps.items()):
        ys = [p.bytes[consumer] / div for p in step.timeline]
        ax.plot(range(len(ys)), ys, color=colour, linewidth=1.3,
                label=f"{label}: peak {max(ys):.1f} {unit}")
        end = max((i for i, p in enumerate(step.timeline) if p.phase == "forward"), default=None)
        if end is not None:
            ax.plot(end, ys[end], "o", color=colour, markersize=5)
    if budget is not None:
        ax.axhline(budget / div, color="black", linestyle="--", linewidth=0.8)
        ax.text(0, budget / div, f" budget {budget / div:.1f} {unit}", va="bottom", fontsize=8)
    ax.set(xlabel="operator index in the step (dot: forward ends; then backward, recompute "
                  "included)", ylabel=f"{consumer} ({unit})", title=title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


_SPLIT_COLOURS = {"sequence": "#4C72B0", "tensor": "#DD8452"}


def sequence_parallel_regions(regions, *, t: int, unit: str = "MB", title: str = "") -> Figure:
    """A transformer layer drawn as regions, each split by sequence (SP) or by tensor (TP).

    ``regions``: ``(name, split, bytes_tp, bytes_sp)`` in the order data flows through the
    layer, ``split`` "sequence" or "tensor", the bytes one rank keeps for backward under
    tensor parallelism alone and under tensor + sequence parallelism. Entering a tensor region
    from a sequence region is Megatron's g (all-gather forward, reduce-scatter backward);
    leaving it is ḡ (reduce-scatter forward, all-gather backward): both are drawn between boxes.
    """
    div = _check_unit(unit)
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ValueError(f"t must be an int >= 1, got {t!r}")
    if not regions or any(len(r) != 4 or r[1] not in _SPLIT_COLOURS for r in regions):
        raise ValueError("regions must be (name, split, bytes_tp, bytes_sp) tuples with split "
                         f"in {tuple(_SPLIT_COLOURS)}, at least one")
    from matplotlib.patches import FancyBboxPatch, Patch

    n = len(regions)
    width, gap = 1.0, 0.45
    fig, ax = plt.subplots(figsize=(1.55 * n + 0.6, 3.2))
    for i, (name, split, tp_bytes, sp_bytes) in enumerate(regions):
        left = i * (width + gap)
        ax.add_patch(FancyBboxPatch((left, 0), width, 1, boxstyle="round,pad=0.02,rounding_size=0.06",
                                    facecolor=_SPLIT_COLOURS[split], alpha=0.22,
                                    edgecolor=_SPLIT_COLOURS[split], linewidth=1.5))
        ax.text(left + width / 2, 0.96, name, ha="center", va="top", fontsize=8.5,
                fontweight="bold")
        ax.text(left + width / 2, 0.44, "split by\nsequence (SP)" if split == "sequence"
                else "split by\ntensor (TP)", ha="center", va="center", fontsize=7.5)
        ax.text(left + width / 2, 0.15, f"TP: {tp_bytes / div:.3g} {unit}\n"
                f"TP+SP: {sp_bytes / div:.3g} {unit}", ha="center", va="center", fontsize=7.5)
        if i + 1 < n:
            mid = left + width + gap / 2
            nxt = regions[i + 1][1]
            ax.annotate("", xy=(left + width + gap, 0.5), xytext=(left + width, 0.5),
                        arrowprops=dict(arrowstyle="->", color="0.3"))
            if split != nxt:
                ax.text(mid, 0.5, "g" if nxt == "tensor" else "ḡ", ha="center", va="center",
                        fontsize=10, fontweight="bold",
                        bbox=dict(boxstyle="circle,pad=0.25", facecolor="white", edgecolor="0.3"))
    total_tp = sum(r[2] for r in regions)
    total_sp = sum(r[3] for r in regions)
    ax.set_xlim(-0.15, n * (width + gap) - gap + 0.15)
    ax.set_ylim(-0.32, 1.08)
    ax.text(0, -0.2, f"per rank, t = {t}: TP alone {total_tp / div:.3g} {unit}, "
            f"TP + SP {total_sp / div:.3g} {unit} per layer. g: all-gather forward, "
            f"reduce-scatter backward; ḡ: reduce-scatter forward, all-gather backward",
            fontsize=8, va="center")
    ax.axis("off")
    ax.legend(handles=[Patch(facecolor=c, alpha=0.4, edgecolor=c, label=f"split by {s}")
                       for s, c in _SPLIT_COLOURS.items()],
              loc="upper right", bbox_to_anchor=(1.0, 1.2), ncol=2, fontsize=8, frameon=False)
    ax.set_title(title, loc="left")
    fig.tight_layout()
    return fig


def curves_side_by_side(xs, panels, *, xlabel: str) -> Figure:
    """Panels of curves over the same x: ``panels`` maps a title to ``(ylabel, {label: ys})``.

    The first curve of each panel is drawn solid, the others alternate solid and dashed, so
    that two curves lying on each other stay visible.
    """
    if not (isinstance(panels, dict) and panels and all(
            isinstance(v, (tuple, list)) and len(v) == 2 and isinstance(v[1], dict) for v in panels.values())):
        raise ValueError("panels must map at least one title to (ylabel, {label: ys}), got "
                         + (f"{ {k: type(v).__name__ for k, v in panels.items()} }" if isinstance(panels, dict)
                            else type(panels).__name__))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (title, (ylabel, curves)) in zip(axes[0], panels.items()):
        for k, (label, ys) in enumerate(curves.items()):
            if len(ys) != len(xs):
                raise ValueError(f"{title}: curve {label!r} has {len(ys)} values for {len(xs)} xs")
            ax.plot(xs, ys, "--" if k == 2 else "-", label=label)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axes[0][-1].legend()
    fig.tight_layout()
    return fig


def recompute_frontier(budgets, recomputes, points, *, unit_label: str, title: str = "",
                       recompute_label: str = "recompute (block forwards)") -> Figure:
    """The least recompute that fits each budget (a step curve), with named schedules as dots.

    ``budgets`` and ``recomputes`` are in the units of the axes; ``points`` maps a schedule's
    name to its ``(peak, recompute)`` in the same units.
    """
    if len(budgets) != len(recomputes) or not budgets:
        raise ValueError(f"budgets and recomputes must have the same non-zero length, got "
                         f"{len(budgets)} and {len(recomputes)}")
    fig, ax = plt.subplots()
    ax.step(budgets, recomputes, where="post", color="black", label="optimal_schedule")
    for name, (peak, recompute) in points.items():
        ax.plot(peak, recompute, "o", markersize=8, label=name)
    ax.set(xlabel=f"activation budget ({unit_label})", ylabel=recompute_label, title=title)
    ax.legend()
    fig.tight_layout()
    return fig


def labelled_points(points, *, xlabel: str, ylabel: str, title: str = "") -> Figure:
    """A scatter of named points ``{name: (x, y)}``, each labelled beside its dot."""
    if not points:
        raise ValueError("points must map at least one name to (x, y)")
    fig, ax = plt.subplots()
    for name, (x, y) in points.items():
        ax.plot(x, y, "o")
        ax.annotate(name, (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    fig.tight_layout()
    return fig


def paired_bars(labels, left, right, *, left_label: str, right_label: str, ylabel: str,
                title: str = "") -> Figure:
    """Two bars per label (``left`` grey, ``right`` in the activations colour), side by side."""
    if not (len(labels) == len(left) == len(right)) or not labels:
        raise ValueError(f"labels, left and right must have the same non-zero length, got "
                         f"{len(labels)}, {len(left)}, {len(right)}")
    fig, ax = plt.subplots()
    ax.bar([i - 0.2 for i in range(len(labels))], left, 0.4, color="0.6", label=left_label)
    ax.bar([i + 0.2 for i in range(len(labels))], right, 0.4, color=COLORS["activations"],
           label=right_label)
    ax.set_xticks(range(len(labels)), labels)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the axes, never over a bar
    fig.tight_layout()
    return fig


def scaling_curves(xs, curves, *, xlabel: str, ylabel: str, title: str = "",
                   log: bool = False) -> Figure:
    """Measured quantities against a size: ``curves`` maps a label to its values at ``xs``.

    A label starting with "~" is a reference drawn dashed in black (e.g. "~ peak(1) / N");
    the others are measured, drawn with dots, in the colours of ``labkit.plot.COLORS``.
    ``log`` puts both axes on a log scale, the ticks at ``xs``.
    """
    if not curves or any(len(ys) != len(xs) for ys in curves.values()):
        raise ValueError(f"curves must map at least one label to {len(xs)} values (one per x)")
    fig, ax = plt.subplots()
    colours = iter([COLORS["activations"], COLORS["parameters"], "0.4", "#8172B2"])
    for label, ys in curves.items():
        if label.startswith("~"):
            ax.plot(xs, ys, "k--", label=label[1:].strip())
        else:
            ax.plot(xs, ys, "o-", color=next(colours), label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if log:
        ax.set(xscale="log", yscale="log")
        ax.minorticks_off()
    ax.set_xticks(list(xs), [str(x) for x in xs])
    ax.legend()
    fig.tight_layout()
    return fig
