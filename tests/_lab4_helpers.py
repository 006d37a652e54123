"""Helpers the lab 4 graders share (not collected: no test_ prefix)."""
from __future__ import annotations

import copy

import torch

from labkit.models import GPT, GPTConfig

# float64: the same sum in another order (k partial sums instead of one) differs by a few ulps
# of values of order 1e-2..1, far below 1e-12; a missed or doubled micro-batch is off by ≥ 1e-3.
F64_TOL = dict(atol=1e-12, rtol=1e-10)
# fp32 Adam on gradients reduced in another order: a few ulps of parameters of magnitude ≤ ~1.
UPDATE_TOL = dict(atol=1e-6, rtol=1e-5)


def tiny_gpt(seed: int = 0, dtype=torch.float32, **overrides) -> GPT:
    """A GPT small enough for a few steps in well under a second on a CPU."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg)).to(dtype)


def zero2_gpt(dtype=torch.float32) -> GPT:
    """Ψ = 32,935 parameters: divisible by none of N = 2, 3, 4, so the last shard is padded.
    No biases: the attention key bias gets a gradient of pure rounding noise (softmax ignores
    it), which Adam's normalisation would turn into full-size steps that differ by order of sum."""
    model = tiny_gpt(vocab_size=64, n_head=5, n_embd=35, bias=False, dtype=dtype)
    psi = sum(p.numel() for p in model.parameters())
    assert psi % 2 and psi % 3 and psi % 4, psi
    return model


def ready_order(model: torch.nn.Module, x, y) -> list[tuple[str, int]]:
    """(name, numel) of the trainable parameters in the order their gradients become ready in
    one local backward (autograd's order; the same in every rank for the same model)."""
    m = copy.deepcopy(model)
    names = {p: n for n, p in m.named_parameters()}
    order = []
    for p in m.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: order.append((names[p], p.numel())))
    m(x, y).backward()
    return order


def planned_buckets(model: torch.nn.Module, cap: int, element_size: int = 4) -> list[list[tuple[str, int]]]:
    """The formula for the fixed buckets (DDP's first assignment): the trainable parameters in
    reverse model order, a bucket closing when its bytes reach the cap. Returns each bucket's
    (name, numel) in order."""
    trainable = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    buckets, filling, size = [], [], 0
    for name, numel in reversed(trainable):
        filling.append((name, numel))
        size += element_size * numel
        if size >= cap:
            buckets.append(filling)
            filling, size = [], 0
    return buckets + ([filling] if filling else [])


def bucket_bytes(bucket, kind: str, ranks: int = 1, element_size: int = 4) -> int:
    """What one bucket's collective carries: its gradients and one presence count per parameter
    (an all-reduce); a reduce-scatter's inputs hold the counts once per rank."""
    counts = len(bucket) * (ranks if kind == "reduce_scatter" else 1)
    return element_size * (sum(n for _, n in bucket) + counts)


def expected_events(order: list[tuple[str, int]], buckets, kind: str, ranks: int = 1) -> list[tuple]:
    """The events one backward must log with fixed buckets sent in order: per gradient ("grad",
    name), preceded — in the hook of the gradient that completes the bucket whose turn it is,
    before the probe's own event — by one collective of ``kind`` per bucket it lets go, issued
    asynchronously with the bucket's bytes (``bucket_bytes``); the buckets left at the end of
    backward are sent then, in order."""
    out, ready, turn = [], set(), 0
    for name, _ in order:
        ready.add(name)
        while turn < len(buckets) and all(n in ready for n, _ in buckets[turn]):
            out.append((kind, bucket_bytes(buckets[turn], kind, ranks), True))
            turn += 1
        out.append(("grad", name, None))
    out += [(kind, bucket_bytes(b, kind, ranks), True) for b in buckets[turn:]]
    return out


def first_difference(got: list, want: list) -> str:
    """Where two event lists part, for a failure message."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return (f"event {i}: got {g}, expected {w} (the three before: {got[max(0, i - 3):i]})")
    return f"got {len(got)} events, expected {len(want)}; the extra: {(got[len(want):] or want[len(got):])[:3]}"
