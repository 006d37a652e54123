"""A configuration scored (``evaluate``), a plan's answer (``PlanResult``) and how far to trust
its order (``sensitivity``).

Chapter 7 (book/07_panorama.md).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from .hardware import KNOBS, Cluster, scaled
from .memory import host_bytes, memory_estimate
from .space import DEFAULT_MARGIN
from .spec import Config, ModelSpec
from .step import StepTime, step_time

GB = 10**9
SENSITIVITY = (0.8, 1.0, 1.2)
"""The factors ``sensitivity`` applies to each knob of ``labkit.cost_model.hardware.KNOBS``."""


@dataclass(frozen=True)
class Estimate:
    """A configuration with its memory on the busiest GPU (bytes per consumer + "total"), the
    host bytes of its node (0 without offload) and the usable bytes of each."""

    config: Config
    memory: dict = field(compare=False)
    time: StepTime = field(compare=False)
    usable: float = field(compare=False)
    host: float = field(default=0.0, compare=False)
    host_usable: float = field(default=math.inf, compare=False)

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.usable and self.host <= self.host_usable


def evaluate(model: ModelSpec, cluster: Cluster, cfg: Config, global_batch: int,
             margin: float = DEFAULT_MARGIN) -> Estimate:
    """``cfg``'s memory and time; it fits if its GPU total is at most (1 − margin) of the GPU's
    memory and its node's host bytes at most (1 − margin) of the host's."""
    node = min(cluster.gpus_per_node, cluster.n_gpus)
    return Estimate(cfg, memory_estimate(model, cfg), step_time(model, cluster, cfg, global_batch),
                    cluster.memory_bytes * (1 - margin), host_bytes(model, node, cfg),
                    cluster.host_memory_bytes * (1 - margin))


def terms(e: Estimate) -> dict[str, float]:
    """The step's seconds by term: compute, bubble, then each communication term."""
    return {"compute": e.time.compute, "bubble": e.time.bubble,
            **{f"{a} comm" if a in ("dp", "tp", "pp", "cp", "ep") else a: v for a, v in e.time.comm.items()}}


def why_slower(best: Estimate, other: Estimate) -> str:
    """One line: how much slower ``other`` is than ``best`` and the terms that grew most."""
    a, b = terms(best), terms(other)
    diff = sorted(((b[k] - a[k], k) for k in a), reverse=True)
    grew = [f"{k} +{d:.3g} s" for d, k in diff if d > 0][:2]
    if other.time.total == best.time.total:
        return (f"as fast ({other.time.total:.3g} s), but lost the tie-break "
                f"({other.memory['total'] / GB:.3g} GB vs {best.memory['total'] / GB:.3g} GB, then field order)")
    slower = other.time.total / best.time.total - 1
    return f"{slower:.1%} slower ({other.time.total:.3g} s vs {best.time.total:.3g} s): " + ", ".join(grew)


@dataclass(frozen=True)
class PlanResult:
    """The fastest fitting configuration and the next ``n_runners_up`` in the planner's order."""

    best: Estimate
    runners_up: list

    def reasons(self) -> list[str]:
        return [why_slower(self.best, e) for e in self.runners_up]

    def table(self) -> list[dict]:
        """One row per configuration (the best first): layout, choices, GB, seconds, reason."""
        return [row(e) | {"why": why}
                for e, why in [(self.best, "chosen")] + list(zip(self.runners_up, self.reasons()))]


def row(e: Estimate) -> dict:
    """One configuration as a table row: layout, choices, GB per GPU, seconds per step."""
    c = e.config
    return {"D×T×P×C": f"{c.dp}×{c.tp}×{c.pp}×{c.cp}" + (f", E = {c.ep}" if c.ep > 1 else ""), "ZeRO": c.zero_label.removeprefix("ZeRO-"),
            "recipe": c.recipe, "optimizer": c.optimizer, "offload": c.offload,
            "recompute": c.checkpointing, "attention": c.attention, "SP": c.sequence_parallel,
            "v": c.virtual_stages, "b × m": f"{c.micro_batch} × {c.n_micro}",
            "GB/GPU": round(e.memory["total"] / GB, 2), "s/step": float(f"{e.time.total:.4g}")}


def rank_of_layout(ranked: list[Estimate], dp: int, tp: int, pp: int, cp: int = 1,
                   ep: int = 1) -> tuple[int, Estimate | None]:
    """The 1-based place of the first configuration with layout D×T×P×C (and expert-parallel E)
    in ``ranked`` (the planner's order) and that estimate; (0, None) if none of that layout fits."""
    for i, e in enumerate(ranked):
        c = e.config
        if (c.dp, c.tp, c.pp, c.cp, c.ep) == (dp, tp, pp, cp, ep):
            return i + 1, e
    return 0, None


def sensitivity(model: ModelSpec, cluster: Cluster, global_batch: int, ranked: list[Estimate],
                factors=SENSITIVITY) -> dict:
    """Re-rank ``ranked`` (the fitting configurations, best first) with each knob of ``KNOBS``
    (every kernel rate, NVLink, the network, PCIe) scaled by every factor of ``factors`` (3⁴ = 81
    combinations by default; memory does not change, only time). Returns ``{"winners": {Config:
    combinations where it is fastest}, "spread": {Config: (fastest, slowest) step time}}`` for the
    winners, most wins first: the configurations this model cannot tell apart within those
    factors. A step's time never grows as a rate grows (a faster kernel shrinks the window that
    hides traffic, but never by more than it saves), so a configuration is fastest at the top
    corner of the box and slowest at the bottom one: one whose fastest time exceeds the nominal
    best's slowest wins nowhere and is skipped."""
    lo, hi = min(factors), max(factors)
    slowest, fastest = scaled(cluster, **dict.fromkeys(KNOBS, lo)), scaled(cluster, **dict.fromkeys(KNOBS, hi))
    ceiling = step_time(model, slowest, ranked[0].config, global_batch).total
    floors = sorted(((step_time(model, fastest, e.config, global_batch).total, i) for i, e in enumerate(ranked)))
    candidates = [(t, ranked[i]) for t, i in floors if t <= ceiling]
    boxes = [scaled(cluster, **dict(zip(KNOBS, combo))) for combo in itertools.product(factors, repeat=len(KNOBS))]
    wins = {}
    for box in boxes:
        first = None
        for floor, e in candidates:  # by their fastest time: none after one slower than the leader
            if first is not None and floor > first[0]:
                break
            key = (step_time(model, box, e.config, global_batch).total, e.memory["total"], e.config)
            first = key if first is None or key < first else first
        wins[first[2]] = wins.get(first[2], 0) + 1
    spread = {cfg: (min(t), max(t)) for cfg in wins
              for t in [[step_time(model, box, cfg, global_batch).total for box in boxes]]}
    order = sorted(wins.items(), key=lambda kv: -kv[1])
    return {"winners": dict(order), "spread": {cfg: spread[cfg] for cfg, _ in order}}
