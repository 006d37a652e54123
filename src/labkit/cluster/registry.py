"""The demos by name: ``DEMOS``, :func:`demo` (its module imported when asked for),
:func:`run_demos` (what every rank runs) and :func:`table` (rank 0's report)."""
from __future__ import annotations

import importlib
import json

from labkit.cluster.common import Demo, UsageError

DEMOS = ("zero1", "ring_attention", "tensor_parallel", "zero2", "zero3", "pipeline",
         "sequence_parallel", "plan")
"""Every demo, in the order ``--help`` lists them; each is the module ``labkit.cluster.<name>``."""


def demo(name: str) -> Demo:
    """The demo called ``name`` (its module imported now); UsageError if there is none."""
    if name not in DEMOS:
        raise UsageError(f"unknown demo {name!r}: choose one of {', '.join(DEMOS)}")
    return importlib.import_module(f"labkit.cluster.{name}").DEMO


def run_demos(rank: int, world_size: int, calls: list) -> list[dict]:
    """Run the demos ``calls = [(name, options or their keyword arguments), ...]`` one after
    another on this rank (what ``launch`` runs, inside torchrun or from a test)."""
    out = []
    for name, options in calls:
        d = demo(name)
        out.append(d.run(rank, world_size, options if isinstance(options, d.options) else d.options(**options)))
    return out


def table(name: str, results: list[dict], world_size: int, backend: str, device: str) -> str:
    """Rank 0's report: the demo's rows, then ``json: {...}``."""
    lines = [f"{name} on {world_size} rank(s), {backend} on {device.split(':')[0]}"]
    lines += demo(name).rows(results)
    lines.append("json: " + json.dumps({"demo": name, "world_size": world_size, "ranks": results}))
    return "\n".join(lines)
