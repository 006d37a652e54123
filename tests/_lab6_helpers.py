"""Helpers the lab 6 graders share (not collected): byte formatting and the real GPT step's trace."""
from __future__ import annotations

import torch

from labkit.models import GPT, SyntheticData, lab_config

KiB, MiB = 1024, 1024 * 1024


def mib(x):
    return f"{x / MiB:.4g} MiB"


def gpt_step_trace():
    """The allocation trace of one training step (forward, backward, Adam) of the lab's GPT."""
    from labkit.lab6.caching_allocator import record_trace

    cfg = lab_config("cpu")
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters())
    x, y = SyntheticData(cfg.vocab_size, cfg.block_size, 16).batch(0)

    def step():
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    trace, _ = record_trace(step)
    return trace
