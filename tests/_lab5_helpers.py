"""Helpers lab 5's graders share (not collected: no test here).

The small GPT the graders run, the tolerances (why each is what it is), the plain computations
the checkpointing graders compare against (a step-by-step walk of a checkpointed chain, every
schedule of a short chain), and byte counters built on autograd's saved-tensor hooks and
``MemTracker``.

Tolerances: the models here are fp32 on a CPU. Recomputation runs the same kernels on the same
inputs, so checkpointed gradients agree to rounding (atol 1e-6, rtol 1e-5 leave room for
kernels that reorder sums); tiled attention sums in a different order than SDPA, a few ulps
per element of fp32 (atol 1e-5, rtol 1e-4). Byte and FLOP counts are exact integers.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from labkit.measure import measure_step
from labkit.models import GPT, GPTConfig

aten = torch.ops.aten
GRAD_TOL = dict(atol=1e-6, rtol=1e-5)
ATTN_TOL = dict(atol=1e-5, rtol=1e-4)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: one intra-op thread is fastest and does not fight other jobs.
    (Autouse in every lab 5 grader file that imports it.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# A small GPT whose blocks dominate its activations; batch (B, T), hidden C.
B, T, C, V = 2, 32, 64, 64


def small_gpt(n_layer: int, n_head: int = 2, **overrides) -> GPT:
    """The graders' GPT (B, T, C, V above); ``n_head`` 2 gives head size d = 32 = T, so tests
    whose rule depends on d or on T (FLOPs per byte of q·kᵀ and softmax·v) also use 4 heads."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=n_head, n_embd=C,
                         **overrides))


# ---- the plain computations

def simulate_schedule(n_layers, segments, act, inp, flops):
    """Walk a checkpointed chain op by op: forward holding, then backward freeing/recomputing.

    Returns (peak bytes of activations, recompute flops).
    """
    owner = {}
    for start, stop in segments:
        for i in range(start, stop):
            owner[i] = (start, stop)
    held, peak = 0, 0
    for i in range(n_layers):  # forward
        if i not in owner:
            held += act[i]
        elif owner[i][0] == i:
            held += inp[i]
        peak = max(peak, held)
    i = n_layers - 1
    while i >= 0:  # backward, last layer first
        if i in owner:
            start, stop = owner[i]
            held += sum(act[start:stop]) - inp[start]  # recomputed; the kept input is reused
            peak = max(peak, held)
            held -= sum(act[start:stop])
            i = start - 1
        else:
            held -= act[i]
            i -= 1
    return peak, sum(flops[i] for i in owner)


def all_schedules(n_layers):
    """Every schedule of an L-layer chain: each layer kept, starting a segment, or continuing one."""
    for labels in itertools.product(("keep", "start", "continue"), repeat=n_layers):
        segments, ok = [], True
        for i, label in enumerate(labels):
            if label == "continue" and (i == 0 or labels[i - 1] == "keep"):
                ok = False
                break
            if label == "start":
                segments.append([i, i + 1])
            elif label == "continue":
                segments[-1][1] = i + 1
        if ok:
            yield tuple(tuple(s) for s in segments)


def least_recompute(act, inp, flops, budget):
    """The least recompute of any schedule whose simulated peak fits ``budget`` (None if none).

    The grader's own exact search, written from simulate_schedule's walk: the peak of a schedule
    is the larger of the bytes held at the end of forward and, for each segment (s, t), the
    bytes held before s plus the segment's activations; the bytes held grow along the chain. So
    a prefix is summed up by (held bytes, recompute so far), and of two prefixes one with no
    more held bytes and no more recompute is never worse: keep the Pareto front at each layer.
    Exact for integer costs (no rounding). O(L² · front) — milliseconds at L = 60.
    """
    n = len(act)
    fronts = [dict() for _ in range(n + 1)]  # fronts[i]: held bytes before layer i -> least recompute
    fronts[0][0] = 0

    def add(i, held, cost):
        if held <= budget and cost < fronts[i].get(held, math.inf):
            fronts[i][held] = cost

    for i in range(n):
        best, front = math.inf, {}
        for held in sorted(fronts[i]):  # drop dominated states: more bytes and no less recompute
            if fronts[i][held] < best:
                best = front[held] = fronts[i][held]
        for held, cost in front.items():
            add(i + 1, held + act[i], cost)  # layer i kept
            seg_act = seg_flops = 0
            for j in range(i, n):  # a segment i .. j
                seg_act, seg_flops = seg_act + act[j], seg_flops + flops[j]
                if held + seg_act > budget:
                    break
                add(j + 1, held + inp[i], cost + seg_flops)
    return min(fronts[n].values(), default=None)


def block_saved_bytes(block) -> int:
    """Bytes of the distinct storages one block saves for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(B, T, C, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


class _MatmulOutputBytes(TorchDispatchMode):
    """Sum the bytes of every mm/addmm/bmm output."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (aten.mm.default, aten.addmm.default, aten.bmm.default):
            self.nbytes += out.numel() * out.element_size()
        return out


def blocks_step(model, optimizer, batch):
    """Forward and backward through the blocks only: the tensors the schedule acts on."""
    x_in, probe = batch
    x = x_in * 1.0  # the stack's input, created (and so tracked) inside the step
    for layer in model.h:
        x = layer(x)
    loss = (x * probe).sum()
    loss.backward()
    return loss.detach()


def _blocks_batch():
    """The stack's input (requires grad) and the probe ``blocks_step`` takes."""
    torch.manual_seed(1)
    return torch.randn(B, T, C, requires_grad=True), torch.randn(B, T, C)


def blocks_input_grad(model):
    """The stack's input gradient of ``blocks_step`` on ``blocks_memory``'s batch, not measured:
    the reference a measured step's input gradient is checked against."""
    batch = _blocks_batch()
    blocks_step(model, None, batch)
    return batch[0].grad


def blocks_memory(model, input_grads=None):
    """(activation bytes held when forward ends, activation peak over the step), by MemTracker.
    ``input_grads``: a list that gets the measured step's gradient of the stack's input, for the
    grader to check the result of the run it measured."""
    batch = _blocks_batch()
    step = measure_step(model, None, batch, step_fn=blocks_step)
    if input_grads is not None:
        input_grads.append(batch[0].grad)
    forward = [p for p in step.timeline if p.phase == "forward"]
    return forward[-1].bytes["activations"], step.peak_of("activations")


class _FullCheckpointBlock(torch.nn.Module):
    """PyTorch's own per-block checkpointing, the reference for the selective policy."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def fully_checkpointed(model):
    for i, block in enumerate(model.h):
        model.h[i] = _FullCheckpointBlock(block)
    return model


def model_grads(model, idx, targets):
    model.zero_grad(set_to_none=True)
    model(idx, targets).backward()
    return model


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(V, (B, T), generator=g), torch.randint(V, (B, T), generator=g)



def refuses(cases) -> None:
    """Each (label, call, error, word): ``call()`` raises ``error`` with ``word`` in its message."""
    for label, call, error, word in cases:
        with pytest.raises(error, match=word):
            call()
