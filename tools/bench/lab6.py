"""Lab 6 benchmark rows: the allocator simulator, the fused GELU, Adam's three implementations."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tools.bench.case import Case


def cases() -> list[Case]:
    from labkit.lab6.caching_allocator import record_trace, replay
    from labkit.lab6.fusion import fused_gelu_tanh, gelu_tanh_unfused
    from labkit.models import GPT, SyntheticData, lab_config

    cfg = lab_config("cpu")
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters())
    x, y = SyntheticData(cfg.vocab_size, cfg.block_size, 16).batch(0)

    def step():
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

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

    rows = [
        Case(lab=6, label=f"replay one GPT step's trace ({len(trace)} events) in the simulator",
             ours=lambda: replay(trace), ref=step, ref_name="the training step itself (eager, CPU)",
             note="not the same work: how much cheaper simulating a step is than running it"),
        Case(lab=6, label="GELU (tanh) forward + backward, 256×1024 fp32",
             ours=fwd_bwd(fused_gelu_tanh), ref=fwd_bwd(lambda t: F.gelu(t, approximate="tanh")),
             ref_name="F.gelu(approximate='tanh') (ATen's kernel)",
             note="ours is one autograd op whose body is still eager PyTorch"),
        Case(lab=6, label="GELU (tanh) as a chain of operators, forward + backward",
             ours=fwd_bwd(gelu_tanh_unfused), ref=fwd_bwd(lambda t: F.gelu(t, approximate="tanh")),
             ref_name="F.gelu(approximate='tanh') (ATen's kernel)", note="the unfused chain"),
    ]
    for impl, kw in (("for-loop", dict(foreach=False)), ("foreach", dict(foreach=True))):
        rows.append(Case(lab=6, label=f"Adam step, lab GPT: {impl}", ours=adam_step(**kw),
                         ref=adam_step(fused=True), ref_name="torch.optim.Adam(fused=True)",
                         note="both PyTorch's; the row shows what fusion buys"))
    return rows
