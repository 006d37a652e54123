"""Gantt charts of pipeline schedules (lab 3's exercise 3.5, chapter 3).

``gantt(timeline)`` draws the ``Timeline`` that ``labkit.lab3.pipeline_schedule.simulate``
returns: one row per stage, forwards light, backwards dark (the weight-gradient passes W of
exercise 3.8 green), each box labelled with its micro-batch. It reads only the timeline's fields (``spans``, ``makespan``, ``bubble``), so it
belongs to the course's toolkit and imports no lab package.
"""
from __future__ import annotations

__all__ = ["gantt"]


def gantt(timeline, ax=None, title: str | None = None):
    """Draw a timeline: one row per stage (stage 0 on top), forwards light, backwards dark
    (weight-gradient passes W green), each box labelled with its micro-batch. Returns the Axes.
    Anything but a timeline (a schedule, say): TypeError naming ``timeline``."""
    import matplotlib.pyplot as plt

    if not all(hasattr(timeline, a) for a in ("spans", "makespan", "bubble")):
        raise TypeError(f"timeline must be what simulate(schedule) (or simulate_split) returns, a "
                        f"Timeline with spans, makespan and bubble; got {type(timeline).__name__}"
                        + (" (a schedule? draw gantt(simulate(schedule)))"
                           if isinstance(timeline, (list, tuple)) else ""))
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(timeline.spans)))
    for row in timeline.spans:
        for sp in row:
            colour = {"F": "#9ecae1", "W": "#a1d99b"}.get(sp.action.kind, "#3182bd")
            ax.barh(sp.stage, sp.end - sp.start, left=sp.start, color=colour, edgecolor="white")
            ax.text((sp.start + sp.end) / 2, sp.stage, str(sp.action.microbatch), ha="center",
                    va="center", fontsize=7, color="white" if sp.action.kind == "B" else "black")
    ax.set_yticks(range(len(timeline.spans)), [f"stage {s}" for s in range(len(timeline.spans))])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.makespan)
    ax.set_xlabel("time (unit costs)")
    ax.set_title(title or f"makespan {timeline.makespan}, bubble {float(timeline.bubble):.1%}")
    return ax
