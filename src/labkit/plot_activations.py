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
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, int) or n_ranks < 2:
        raise ValueError(f"n_ranks must be an int >= 2, got {n_ranks!r}")
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
