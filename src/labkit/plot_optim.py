"""Figures of Chapter 2 and Lab 2 (optimizer states) that take more than a few lines.

    fig = zero1_partition([("wte", 2048), ("h.0", 12_416), ...], world_size=4)
    fig = quantization_errors(block_sizes, {"linear code": [...]}, {"linear code": [...]})
    fig = loss_curves({"Adam": [...], "CAME": [...]}, ylim=(0, 6))
    fig = shard_deviation({2: {"ZeRO1": [...], "ZeroRedundancyOptimizer": [...]}}, {2: 8 * S})
    fig = offload_events(offload.events)
    fig = came_vs_adafactor(curves, {"Adam": bytes, "Adafactor": bytes, "CAME": bytes}, psi)

Every function returns the Figure and never calls ``plt.show()``.

Used in: Chapter 2 (book/02_optimizer_states.md) and Lab 2 (labs/02_optimizer_states.ipynb).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyArrowPatch, Rectangle

from labkit.validate import is_int

__all__ = ["zero1_partition", "code_entries", "quantization_errors", "loss_curves",
           "shard_deviation", "offload_events", "came_vs_adafactor"]


def zero1_partition(sizes, world_size: int, *, title: str | None = None):
    """ZeRO-1's flat partition: the tensors laid end to end, padded to N·S, cut into N shards.

    Args:
        sizes: ``[(name, numel), ...]`` of the trainable tensors, in flat order.
        world_size: N.

    Returns a Figure: the flat vector coloured by tensor (padding hatched) above the N rank
    shards, with the step's two collectives: reduce-scatter of the gradients into the shards,
    all-gather of the updated shards back to the full vector.
    """
    try:
        sizes = [(str(n), k) for n, k in sizes]
    except (TypeError, ValueError):
        raise ValueError(f"sizes must be a non-empty list of (name, numel >= 1) pairs, got {sizes!r}") from None
    if not sizes or not all(is_int(k) and k >= 1 for _, k in sizes):
        raise ValueError(f"sizes must be a non-empty list of (name, numel >= 1) pairs, got {sizes!r}")
    sizes = [(n, int(k)) for n, k in sizes]
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
    if not (isinstance(codes, dict) and codes and all(
            isinstance(c, torch.Tensor) and bool((c > 0).any()) for c in codes.values())):
        raise ValueError("codes must be a non-empty dict {label: code tensor with positive entries}, "
                         f"got {type(codes).__name__}")
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


def _check_curves(name: str, curves) -> None:
    """``curves`` must be a non-empty dict {label: [loss per step]} of numbers (NaN allowed: a
    diverged step)."""
    ok = isinstance(curves, dict) and curves and all(
        isinstance(v, Sequence) and all(isinstance(x, Real) and not isinstance(x, bool) for x in v)
        for v in curves.values())
    if not ok:
        raise ValueError(f"{name} must be a non-empty dict {{label: [loss per step]}} of numbers, got "
                         + (f"{ {k: type(v).__name__ for k, v in curves.items()} }" if isinstance(curves, dict)
                            else type(curves).__name__))


def _curves_on(ax, curves: dict, styles: dict | None = None) -> None:
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, **(styles or {}).get(name, {}))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")


def quantization_errors(block_sizes, errors: dict, flushed: dict):
    """Two panels: the mean relative error of a tensor stored in 8 bits against the block size
    (one line per code; a label containing "bitsandbytes" is dashed and may have fewer points),
    and the share (%) of its non-zero entries stored as 0.

    Args:
        block_sizes: the block sizes measured (x axis, log₂).
        errors: ``{label: [relative error per block size]}``.
        flushed: ``{label: [% of non-zero entries stored as 0, per block size]}``.
    """
    if not errors or not flushed:
        raise ValueError("errors and flushed must be non-empty dicts {label: [value per block size]}")
    fig, (ax, ax_zero) = plt.subplots(1, 2, figsize=(11, 3.6))
    for name, values in errors.items():
        ax.plot(list(block_sizes)[: len(values)], values,
                "o--" if "bitsandbytes" in name else "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (elements per absmax)")
    ax.set_ylabel("mean |v̂ − v| / mean |v|")
    ax.set_title("Adam's v of one MLP weight, stored in 8 bits")
    ax.legend()
    for name, shares in flushed.items():
        ax_zero.plot(list(block_sizes)[: len(shares)], shares, "o-", label=name)
    ax_zero.set_xscale("log", base=2)
    ax_zero.set_xlabel("block size (elements per absmax)")
    ax_zero.set_ylabel("% of non-zero v stored as 0")
    ax_zero.set_title("the danger: v = 0 leaves only ε under m", color="C3")
    ax_zero.legend()
    fig.tight_layout()
    return fig


def loss_curves(curves: dict, *, styles: dict | None = None, ylim=None, title: str = ""):
    """Training loss per step, one line per run.

    Args:
        curves: ``{label: [loss per step]}`` (a diverged run may be shorter).
        styles: optional ``{label: matplotlib kwargs}``.
        ylim: optional (bottom, top) of the loss axis.
    """
    _check_curves("curves", curves)
    fig, ax = plt.subplots()
    _curves_on(ax, curves, styles)
    if ylim is not None:
        ax.set_ylim(*ylim)
    if title:
        ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def shard_deviation(per_rank: dict, even_share: dict):
    """Each rank's optimizer-state bytes as a deviation (%) from the even share K·ceil(Ψ/N), one
    panel per world size: a label starting with "your" is drawn as markers (equal shards sit on
    the zero line), any other as bars (e.g. ``ZeroRedundancyOptimizer``'s whole tensors).

    Args:
        per_rank: ``{world_size: {label: [state bytes of rank 0, 1, ...]}}``.
        even_share: ``{world_size: K·ceil(Ψ/N)}``.
    """
    if not per_rank or set(per_rank) != set(even_share):
        raise ValueError("per_rank and even_share must be non-empty dicts with the same world sizes")
    fig, axes = plt.subplots(1, len(per_rank), figsize=(5.5 * len(per_rank), 3.4), squeeze=False)
    for ax, (world_size, runs) in zip(axes[0], per_rank.items()):
        share = even_share[world_size]
        for label, values in runs.items():
            deviation = [100 * (b / share - 1) for b in values]
            if label.startswith("your"):
                ax.plot(range(len(values)), deviation, "o", markersize=9, color="C0", label=label,
                        zorder=3)
            else:
                ax.bar(range(len(values)), deviation, 0.5, color="C1", label=label)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(world_size))
        ax.set_xlabel("rank")
        ax.set_ylabel("state bytes vs K·ceil(Ψ/N) (%)")
        ax.set_title(f"N = {world_size}: K·ceil(Ψ/N) = {share:,} bytes")
    axes[0][-1].legend()
    fig.tight_layout()
    return fig


def offload_events(events):
    """The order of events in one backward with ZeRO-Offload: when each block's backward starts
    and when each gradient reaches the host, on one axis of event order.

    Args:
        events: ``[(kind, name), ...]`` in order; kinds "backward starts" (name ``"h.k"``) and
            "grad to host" (a parameter name; ``"h.k. ..."`` belongs to block k).
    """
    events = list(events)
    if not events or any(not (isinstance(e, tuple) and len(e) == 2) for e in events):
        raise ValueError("events must be a non-empty list of (kind, name) pairs")
    fig, ax = plt.subplots(figsize=(10, 2.6))
    blocks = sorted({int(n.split(".")[1]) for _, n in events if n.startswith("h.")})
    colors = {b: f"C{b % 10}" for b in blocks}
    for k, (kind, name) in enumerate(events):
        block = int(name.split(".")[1]) if name.startswith("h.") else None
        color = colors.get(block, "grey")
        if kind == "backward starts":
            ax.axvline(k, color=color, linewidth=1.2, linestyle="--")
            ax.text(k + 0.3, 1.35, f"backward of {name}", rotation=90, fontsize=7, color=color,
                    va="bottom")
        else:
            ax.plot([k], [1], "s", color=color, markersize=5)
    ax.set_ylim(0.5, 2.6)
    ax.set_yticks([1], ["gradient copied\nto the host"])
    ax.set_xlabel("event (in the order backward made them)")
    ax.set_title("ZeRO-Offload: gradients leave the device while backward goes on "
                 "(colour = block; grey = embeddings, final norm)")
    fig.tight_layout()
    return fig


def came_vs_adafactor(curves: dict, state_bytes: dict, psi: int, *, styles: dict | None = None):
    """Two panels: the training loss of each optimizer, and its state in bytes per parameter.

    Args:
        curves: ``{name: [loss per step]}``.
        state_bytes: ``{name: bytes of optimizer state}`` (the same names).
        psi: the parameter count Ψ (bytes are shown per parameter).
    """
    if not curves or set(curves) != set(state_bytes):
        raise ValueError("curves and state_bytes must be non-empty dicts with the same names")
    if isinstance(psi, bool) or not isinstance(psi, int) or psi < 1:
        raise ValueError(f"psi must be a positive int, got {psi!r}")
    fig, (ax, ax_bytes) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    _curves_on(ax, curves, styles)
    ax.legend()
    ax.set_title("same model, same data, same steps")
    names = list(state_bytes)
    per_param = [state_bytes[n] / psi for n in names]
    bars = ax_bytes.bar(names, per_param, color=[f"C{i}" for i in range(len(names))])
    for bar, value in zip(bars, per_param):
        ax_bytes.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.2f}", ha="center",
                      va="bottom", fontsize=8)
    ax_bytes.set_ylabel("optimizer state, bytes per parameter")
    ax_bytes.set_title("what each keeps between steps")
    fig.tight_layout()
    return fig
