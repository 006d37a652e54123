"""Lab 6 benchmark rows: the allocator simulator, the fused GELU, Adam's three implementations.

The allocator rows measure how the simulator's cost grows with its work: events per second in a
steady state of L live blocks, L = 250 … 16,000 (each row replays the same number of events at L
live blocks against the same at 250; the ratio is the slowdown, flat within 2× by issue 29). The
best fit is a ``lower_bound`` in a sorted free set, O(log n) as ``std::set`` in the C++ allocator.
"""
from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from tools.bench.case import Case


ALLOCATOR_EVENTS = 4000
"""Frees and mallocs (half each) one allocator row replays per call."""


def allocator_steady_state(live: int, seed: int = 0):
    """A zero-argument callable: ``ALLOCATOR_EVENTS`` events (free a random live block, then malloc
    a new one) in a simulator that holds ``live`` blocks, after it has been filled. Sizes: 80%
    small (512 B … 1 MiB, log-uniform), 20% large (1 … 16 MiB). Each call continues the same
    steady state (the number of live blocks stays ``live``)."""
    from labkit.lab6.caching_allocator import CachingAllocator

    rng = random.Random(seed)

    def size():
        return int(2 ** rng.uniform(9, 20)) if rng.random() < 0.8 else int(2 ** rng.uniform(20, 24))

    alloc = CachingAllocator()
    handles = [alloc.malloc(size()) for _ in range(live)]
    plan = [(rng.randrange(live), size()) for _ in range(ALLOCATOR_EVENTS // 2)]

    def run():
        for j, n in plan:
            alloc.free(handles[j])
            handles[j] = alloc.malloc(n)
    return run


def allocator_rates(lives=(250, 1000, 4000, 16000), repeat: int = 3) -> dict[int, float]:
    """Events per second (CPU time, median of ``repeat`` calls) at each number of live blocks."""
    rates = {}
    for live in lives:
        run = allocator_steady_state(live)
        run()  # warm-up
        times = []
        for _ in range(repeat):
            t = time.process_time()
            run()
            times.append(time.process_time() - t)
        rates[live] = ALLOCATOR_EVENTS / sorted(times)[len(times) // 2]
    return rates


def cases() -> list[Case]:
    from labkit.allocation_trace import gpt_training_step, record_trace
    from labkit.harness.lab6 import replay
    from labkit.lab6.fusion import fused_gelu_tanh, gelu_tanh_unfused
    from labkit.models import GPT

    step = gpt_training_step()
    cfg, (x, y) = step.model.config, step.batch
    step()
    trace, _ = record_trace(step)

    xg = torch.randn(256, 1024, requires_grad=True)

    def fwd_bwd(f):
        return lambda: f(xg).sum().backward()

    def adam_step(**kw):
        torch.manual_seed(0)
        m = GPT(cfg)
        o = torch.optim.Adam(m.parameters(), **kw)
        m(x, y).backward()
        o.step()
        return o.step

    base = allocator_steady_state(250)
    rows = [Case(lab=6, label=f"allocator simulator, {ALLOCATOR_EVENTS:,} events at {live:,} live blocks",
                 ours=allocator_steady_state(live), ref=base, ref_name="the same at 250 live blocks",
                 target=2.0, note="the slowdown with the number of live blocks; flat means within 2x")
            for live in (1000, 4000, 16000)]
    rows += [
        Case(lab=6, label=f"replay one GPT step's trace ({len(trace)} events) in the simulator",
             ours=lambda: replay(trace), ref=step, ref_name="the training step itself (eager, CPU)",
             target=None, note="context: how much cheaper simulating a step is than running it"),
        Case(lab=6, label="GELU (tanh) forward + backward, 256×1024 fp32",
             ours=fwd_bwd(fused_gelu_tanh), ref=fwd_bwd(lambda t: F.gelu(t, approximate="tanh")),
             ref_name="F.gelu(approximate='tanh') (ATen's kernel)",
             target=None, note="context: ours is one autograd op whose body is still eager PyTorch "
             "(it saves one tensor instead of several: a memory fusion, not a kernel)"),
        Case(lab=6, label="GELU (tanh) as a chain of operators, forward + backward",
             ours=fwd_bwd(gelu_tanh_unfused), ref=fwd_bwd(lambda t: F.gelu(t, approximate="tanh")),
             ref_name="F.gelu(approximate='tanh') (ATen's kernel)", target=None,
             note="context: the unfused chain, what one kernel saves"),
    ]
    for impl, kw in (("for-loop", dict(foreach=False)), ("foreach", dict(foreach=True))):
        rows.append(Case(lab=6, label=f"Adam step, lab GPT: {impl}", ours=adam_step(**kw),
                         ref=adam_step(fused=True), ref_name="torch.optim.Adam(fused=True)",
                         target=None, note="context: both PyTorch's; the row shows what fusion buys"))
    return rows
