"""Lab 5's rows of ``make bench``: FlashAttention, ring attention, checkpointing vs the library.

- FlashAttention toy (forward + backward, causal) vs naive attention and PyTorch's SDPA, over S.
- Ring attention's compute (contiguous and zigzag layouts), all ranks' blocks one after the other
  in this process (the transfers are measured by the graders, not here), and N times the slowest
  rank's (the ring's time on N devices), vs SDPA over the whole sequence.
- Checkpointing (per block, √L) on the lab's GPT against the work it does: a plain step plus
  one more forward of every recomputed block (target 1.1: the hooks' bookkeeping may add 10%),
  and against a plain step alone (context, with the FLOPs ratio beside the time ratio).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tools.bench.case import Case


def attention_cases(sizes=(256, 512, 1024, 2048), repeat=None, naive=True, lab=5):
    """Rows: the FlashAttention toy's forward + backward (causal, 1 × 4 heads × S × 64) vs SDPA
    and, if ``naive``, vs naive attention, at each S in ``sizes``."""
    from labkit.lab5.flash_attention import flash_attention, naive_attention

    cases = []
    for s in sizes:
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
        naive_step = step(lambda q, k, v: naive_attention(q, k, v, causal=True))
        reps = repeat if repeat is not None else 7 if s == 2048 else 11 if s > 256 else 21
        cases.append(Case(lab, f"FlashAttention fwd+bwd, S={s}, causal", ours, sdpa,
                          "F.scaled_dot_product_attention", repeat=reps))
        if naive:
            cases.append(Case(lab, f"FlashAttention fwd+bwd, S={s}, causal", ours, naive_step,
                              "naive attention (S×S in memory)", repeat=reps))
    return cases


def _ring_rank(parts, rank, n, layout):
    """Rank ``rank``'s causal compute over the N steps of the ring (the solution's blocks and
    merges, the transfers left out): parts[r] = rank r's (q, k, v) chunk under ``layout``."""
    from labkit.lab5.ring_attention import attention_with_lse, merge_attention

    q = parts[rank][0]
    half = q.shape[2] // 2
    out = lse = None
    for step in range(n):
        src = (rank - step) % n
        k, v = parts[src][1], parts[src][2]
        rows = None
        if src == rank:
            part = attention_with_lse(q, k, v, causal=True)
        elif layout == "contiguous":
            part = attention_with_lse(q, k, v) if src < rank else None
        elif src < rank:
            part = attention_with_lse(q, k[:, :, :half], v[:, :, :half])
        else:
            rows = slice(half, None)
            part = attention_with_lse(q[:, :, rows], k, v)
        if out is None:
            out, lse = part
        elif part is not None and rows is None:
            out, lse = merge_attention(out, lse, *part)
        elif part is not None:
            out[:, :, rows], lse[:, :, rows] = merge_attention(out[:, :, rows], lse[:, :, rows],
                                                               *part)
    return out


def ring_parts(q, k, v, n, layout):
    """Every rank's (q, k, v) chunk under ``layout``."""
    from labkit.lab5.ring_attention import rank_positions

    return [tuple(t[:, :, rank_positions(q.shape[2], n, r, layout)].contiguous()
                  for t in (q, k, v)) for r in range(n)]


def ring_cases(s=1024, ranks=(2, 4), repeat=11, lab=5):
    """Rows: the ring's causal compute, all ranks one after the other, vs SDPA over the whole
    sequence (the same work: how fast the fused per-block kernel and the merges are); and N ×
    the slowest rank's compute vs SDPA (the ring's time on N devices against a perfect 1/N
    split of SDPA: what the causal imbalance costs), for the contiguous and zigzag layouts."""
    from labkit.lab5.ring_attention import count_attention_work

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, s, 64) for _ in range(3))

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    cases = []
    for n in ranks:
        for layout in ("contiguous", "zigzag"):
            parts = ring_parts(q, k, v, n, layout)
            work = []
            for r in range(n):
                with count_attention_work() as w:
                    _ring_rank(parts, r, n, layout)
                work.append(w[0])
            slowest = max(range(n), key=work.__getitem__)

            def all_ranks(parts=parts, n=n, layout=layout):
                for r in range(n):
                    _ring_rank(parts, r, n, layout)

            def critical_path(parts=parts, n=n, layout=layout, slowest=slowest):
                for _ in range(n):
                    _ring_rank(parts, slowest, n, layout)

            share = max(work) / sum(work)
            cases.append(Case(lab, f"ring attention, {layout}, all ranks' compute, S={s}, N={n}",
                              all_ranks, sdpa, "SDPA, whole sequence", repeat=repeat,
                              note="one process, transfers not included"))
            cases.append(Case(lab, f"ring attention, {layout}, N × slowest rank, S={s}, N={n}",
                              critical_path, sdpa, "SDPA, whole sequence", repeat=repeat,
                              target=None,
                              note=f"context: the causal imbalance; the slowest rank does "
                                   f"{share:.0%} of the work (1/N = {1 / n:.0%}), so about "
                                   f"{n * share:.2f}× is expected"))
    return cases


def _checkpoint_cases():
    """Checkpointing's rows. What a recompute costs is one more forward of each recomputed block,
    with autograd recording (the recompute builds the graph backward then walks). On a CPU that
    forward is ~0.4 of a plain step, not the 1/3 the FLOPs say: backward is less than twice a
    forward here, and the recompute reruns the elementwise ops (softmax, GELU, layer norm,
    dropout) that FLOP counts leave out. So the targeted row sets the checkpointed step against
    a plain step plus that forward, timed in the same run: what is left is the overhead of the
    checkpoint's hooks and bookkeeping (goal ≤ 10%)."""
    from labkit.lab5.checkpointing import Schedule, apply_schedule, sqrt_schedule
    from labkit.measure import count_flops
    from labkit.models import GPT, lab_config
    from torch.utils.checkpoint import set_checkpoint_early_stop

    cases = []
    n_layer = 9  # issue 29's depth: √L = 3 segments of 3 blocks
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

    torch.manual_seed(1)
    block_input = torch.randn(idx.shape[0], cfg.block_size, cfg.n_embd, requires_grad=True)

    def step_and_recompute(layers):
        """A plain step, then the recompute's work: the recomputed blocks' forward again, from
        a kept input, with autograd recording (the graph is dropped, as early stop would)."""
        plain_step = step(plain)

        def run():
            plain_step()
            h = block_input
            for i in layers:
                h = plain.h[i](h)
        return run

    base = flops(plain)
    for label, schedule in (("per block", Schedule.every_layer(n_layer)),
                            ("√L segments", sqrt_schedule(n_layer))):
        model = model_for(schedule)
        ratio = flops(model) / base
        cases.append(Case(5, f"checkpointing {label}, lab GPT L={n_layer}", step(model),
                          step_and_recompute(schedule.recomputed_layers),
                          "plain step + the recomputed blocks' forward", repeat=11, target=1.1,
                          note="the overhead beyond recomputation: hooks and saved-tensor "
                               "bookkeeping"))
        cases.append(Case(5, f"checkpointing {label}, lab GPT L={n_layer}", step(model),
                          step(plain), "no checkpointing", repeat=11, target=None,
                          note=f"context: FLOPs ratio {ratio:.2f} (early stop off); the time "
                               f"ratio is higher on a CPU, where a forward is ~0.4 of a step "
                               f"and the recompute reruns the elementwise ops FLOPs leave out"))

    class Wrapped(torch.nn.Module):  # the library's own per-block recipe, written by hand
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)

    by_hand = model_for(None)
    by_hand.h = torch.nn.ModuleList(Wrapped(b) for b in by_hand.h)
    cases.append(Case(5, f"checkpointing per block, lab GPT L={n_layer}",
                      step(model_for(Schedule.every_layer(n_layer))), step(by_hand),
                      "torch.utils.checkpoint around each block", repeat=11,
                      note="the same work: the schedule machinery's overhead"))
    return cases

def cases():
    return attention_cases() + ring_cases() + _checkpoint_cases()
