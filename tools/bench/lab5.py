"""Lab 5's rows of ``make bench``: FlashAttention, ring attention, checkpointing vs the library.

- FlashAttention toy (forward + backward, causal) vs naive attention and PyTorch's SDPA, over S.
- Ring attention's compute, all ranks' blocks run one after the other in this process (the
  transfers are measured by the graders, not here) vs SDPA over the whole sequence.
- Checkpointing (per block, √L) vs none on the lab's GPT, with the FLOPs ratio beside the
  time ratio: recomputation costs time in proportion to the FLOPs it adds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tools.bench.case import Case


def _attention_cases():
    from labkit.flash_attention import flash_attention, naive_attention

    cases = []
    for s in (512, 1024, 2048):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 4, s, 64, requires_grad=True) for _ in range(3))
        g = torch.randn(1, 4, s, 64)

        def step(fn, q=q, k=k, v=v, g=g):
            def run():
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(g)
            return run

        ours = step(lambda q, k, v: flash_attention(q, k, v, causal=True))
        sdpa = step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        naive = step(lambda q, k, v: naive_attention(q, k, v, causal=True))
        repeat = 7 if s == 2048 else 11
        cases.append(Case(5, f"FlashAttention fwd+bwd, S={s}, causal", ours, sdpa,
                          "F.scaled_dot_product_attention", repeat=repeat))
        cases.append(Case(5, f"FlashAttention fwd+bwd, S={s}, causal", ours, naive,
                          "naive attention (S×S in memory)", repeat=repeat))
    return cases


def _ring_cases():
    from labkit.ring_attention import attention_with_lse, merge_attention

    cases = []
    s = 1024
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, s, 64) for _ in range(3))
    for n in (2, 4):
        chunk = s // n
        parts = [tuple(t[:, :, r * chunk:(r + 1) * chunk].contiguous() for t in (q, k, v))
                 for r in range(n)]

        def ring_compute(parts=parts, n=n):
            for rank in range(n):
                out = lse = None
                for step in range(n):
                    src = (rank - step) % n
                    if src > rank:
                        continue
                    o, l = attention_with_lse(parts[rank][0], parts[src][1], parts[src][2],
                                              causal=src == rank)
                    out, lse = (o, l) if out is None else merge_attention(out, lse, o, l)

        cases.append(Case(5, f"ring attention compute, S={s}, N={n}, causal", ring_compute,
                          lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                          "F.scaled_dot_product_attention", repeat=11,
                          note="all ranks' blocks in one process, transfers not included"))
    return cases


def _checkpoint_cases():
    from labkit.checkpointing import Schedule, apply_schedule, sqrt_schedule
    from labkit.measure import count_flops
    from labkit.models import GPT, lab_config
    from torch.utils.checkpoint import set_checkpoint_early_stop

    cases = []
    n_layer = 4
    cfg = lab_config(torch.device("cpu"), n_layer=n_layer)
    torch.manual_seed(0)
    idx = torch.randint(cfg.vocab_size, (4, cfg.block_size))

    def model_for(schedule):
        torch.manual_seed(0)
        model = GPT(cfg)
        return apply_schedule(model, schedule) if schedule is not None else model

    plain = model_for(None)

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(idx, idx).backward()
        return run

    def flops(model):
        with set_checkpoint_early_stop(False):
            return count_flops(step(model))[0]

    base = flops(plain)
    for label, schedule in (("per block", Schedule.every_layer(n_layer)),
                            ("√L segments", sqrt_schedule(n_layer))):
        model = model_for(schedule)
        ratio = flops(model) / base
        cases.append(Case(5, f"checkpointing {label}, lab GPT L={n_layer}", step(model),
                          step(plain), "no checkpointing", repeat=11,
                          note=f"FLOPs ratio {ratio:.2f} (early stop off)"))
    return cases


def cases():
    return _attention_cases() + _ring_cases() + _checkpoint_cases()
