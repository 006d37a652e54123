"""Figures of Chapter 2 and Lab 2 (optimizer states) that take more than a few lines.

    fig = zero1_partition([("wte", 2048), ("h.0", 12_416), ...], world_size=4)

Used in: Chapter 2 (book/02_optimizer_states.md).
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

__all__ = ["zero1_partition", "code_entries"]


def zero1_partition(sizes, world_size: int, *, title: str | None = None):
    """ZeRO-1's flat partition: the tensors laid end to end, padded to N·S, cut into N shards.

    Args:
        sizes: ``[(name, numel), ...]`` of the trainable tensors, in flat order.
        world_size: N.

    Returns a Figure: the flat vector coloured by tensor (padding hatched) above the N rank
    shards, with the step's two collectives: reduce-scatter of the gradients into the shards,
    all-gather of the updated shards back to the full vector.
    """
    sizes = [(str(n), int(k)) for n, k in sizes]
    if not sizes or any(k < 1 for _, k in sizes):
        raise ValueError("sizes must be a non-empty list of (name, numel >= 1) pairs")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    psi = sum(k for _, k in sizes)
    shard = math.ceil(psi / world_size)
    total = shard * world_size
    fig, ax = plt.subplots(figsize=(10, 3.2))
    cmap = plt.get_cmap("tab20")
    start = 0
    for i, (name, k) in enumerate(sizes):
        ax.add_patch(Rectangle((start, 2.0), k, 0.6, color=cmap(i % 20), linewidth=0))
        if k / total > 0.06:
            ax.text(start + k / 2, 2.3, name, ha="center", va="center", fontsize=7)
        start += k
    if total > psi:
        ax.add_patch(Rectangle((psi, 2.0), total - psi, 0.6, fill=False, hatch="////"))
    for r in range(world_size):
        lo = r * shard
        ax.add_patch(Rectangle((lo + 0.01 * shard, 0.2), 0.98 * shard, 0.6, color=f"C{r % 10}",
                               alpha=0.35))
        ax.text(lo + shard / 2, 0.5, f"rank {r}: m, v, master\nof [{lo:,}, {lo + shard:,})",
                ha="center", va="center", fontsize=7)
        ax.axvline(lo, color="black", linewidth=0.6, linestyle=":")
        ax.add_patch(FancyArrowPatch((lo + 0.3 * shard, 1.95), (lo + 0.3 * shard, 0.85),
                                     arrowstyle="-|>", mutation_scale=10, color="C3"))
        ax.add_patch(FancyArrowPatch((lo + 0.7 * shard, 0.85), (lo + 0.7 * shard, 1.95),
                                     arrowstyle="-|>", mutation_scale=10, color="C2"))
    ax.text(total * 1.01, 1.6, "reduce-scatter\nof gradients ↓", color="C3", fontsize=8, va="center")
    ax.text(total * 1.01, 1.1, "all-gather of\nparameters ↑", color="C2", fontsize=8, va="center")
    ax.set_xlim(0, total * 1.16)
    ax.set_ylim(0, 2.8)
    ax.set_yticks([0.5, 2.3], ["shards (S each)", f"flat Ψ = {psi:,}\n+ {total - psi} padding"])
    ax.set_xlabel("element of the flat parameter vector")
    ax.set_title(title or f"ZeRO-1 on N = {world_size}: S = ceil(Ψ/N) = {shard:,}")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def code_entries(codes: dict):
    """The positive entries of 8-bit codes on a log axis: where each code can store a value.

    Args:
        codes: ``{label: 256-entry tensor}``.
    """
    fig, ax = plt.subplots(figsize=(9, 2.6))
    for i, (label, code) in enumerate(codes.items()):
        positive = code[code > 0]
        ax.plot(positive.tolist(), [i] * positive.numel(), "|", markersize=14, label=label)
        ax.text(float(positive.min()), i + 0.3, f"smallest {float(positive.min()):.2g}", fontsize=7)
    ax.set_xscale("log")
    ax.set_yticks(range(len(codes)), list(codes))
    ax.set_ylim(-0.6, len(codes) - 0.2)
    ax.set_xlabel("positive code entries (fraction of the block's absmax), log scale")
    fig.tight_layout()
    return fig
