"""Helpers the lab 6 graders share (not collected): byte formatting and the real GPT step's trace."""
from __future__ import annotations

KiB, MiB = 1024, 1024 * 1024


def mib(x):
    return f"{x / MiB:.4g} MiB"


def gpt_step_trace():
    """The allocation trace of one (first) training step (forward, backward, Adam) of the lab's GPT:
    the given ``gpt_training_step`` recorded by the given ``record_trace``."""
    from labkit.allocation_trace import gpt_training_step, record_trace

    return record_trace(gpt_training_step())[0]
