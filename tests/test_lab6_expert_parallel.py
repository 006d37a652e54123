"""Graders of lab 6's exercise 6.6 (labs/06_system.ipynb): expert parallelism over gloo ranks.

References nobody in this course wrote: plain Python loops over the (token, choice) pairs for
GShard's slot order, the dispatch buffer and the combine (written here); the single-device
mixture-of-experts layer computed token by token (``labkit.reference.lab6.moe_reference``: the
same capacity per group of T tokens) and, with a capacity no token can exceed, the dropless
``labkit.moe.MoELayer`` itself, with gradients through autograd; ``count_comm`` for the
all-to-alls, against the formula: per rank and direction, one exchange of the (E, C, n_embd)
buffer, E·C·n_embd·4 bytes, C = ⌈capacity_factor · T · k / E⌉.

Tolerance: float32, the same products summed in another order (a token's k weighted outputs,
an expert's gradient summed over W ranks' slots instead of one pass): a few ulps of values of
order 1, measured ≤ 1e-6 → atol 1e-5, rtol 1e-4. A token in the wrong slot, a wrong weight or
a lost gradient is off by 0.01 or more. Slots, buffers, calls and bytes are exact.
"""
from __future__ import annotations

import copy
import functools
import re

import pytest
import torch

from _given import as_given, given
from labkit.moe import MoELayer, capacity
from labkit.reference.lab6 import moe_reference

TOL = dict(atol=1e-5, rtol=1e-4)
D, E, K, HIDDEN, T = 16, 8, 2, 32, 12  # width, experts, top-k, expert width, tokens per rank


def plain_slots(expert_ids, n_expert, cap):
    """GShard's order by hand: choice 0 of tokens 0..T−1, then choice 1, ...; −1 past cap."""
    T_, k = expert_ids.shape
    taken, out = [0] * n_expert, [[-1] * k for _ in range(T_)]
    for j in range(k):
        for t in range(T_):
            e = int(expert_ids[t, j])
            if taken[e] < cap:
                out[t][j] = taken[e]
            taken[e] += 1
    return torch.tensor(out, dtype=torch.int64).reshape(T_, k)


def random_routing(T_, k, n_expert, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most tokens want expert 0 first: many drops
        scores = torch.rand(T_, n_expert, generator=g) + torch.nn.functional.one_hot(
            torch.zeros(T_, dtype=torch.int64), n_expert) * 2
    else:
        scores = torch.rand(T_, n_expert, generator=g)
    return scores.topk(k, dim=1).indices


@pytest.mark.exercise("6.6", points=2)
def test_assign_slots_follows_gshard_order_and_drops_past_capacity():
    """Check assign_slots against a loop over (choice, token) pairs written here, on balanced and
    skewed routings (T up to 40, k 1–3, E 2–8, capacities 1 to T·k)."""
    from labkit.lab6.expert_parallel import assign_slots
    assign_slots = as_given(assign_slots)

    for seed, (T_, k, n_expert) in enumerate([(10, 1, 4), (40, 2, 8), (17, 3, 5), (6, 2, 2)]):
        for skew in (False, True):
            ids = random_routing(T_, k, n_expert, seed, skew)
            for cap in sorted({1, 2, capacity(T_, n_expert, k, 1.0), T_ * k}):
                got = assign_slots(ids, n_expert, cap)
                want = plain_slots(ids, n_expert, cap)
                assert got.dtype == torch.int64, (
                    f"assign_slots returned {got.dtype} slots, the contract says int64 "
                    "(torch.equal would compare the values across dtypes)")
                assert torch.equal(got, want), (
                    f"T={T_} k={k} E={n_expert} C={cap} skew={skew}: slots\n{got.T}\nexpected\n{want.T}\n"
                    "(choice-major order: every token's first choice before any second choice; "
                    "slots 0..C−1 per expert, −1 beyond)")


def own_python_events(fn, *args):
    """Python trace events (calls, lines, each loop iteration) run in ``fn``'s own source file
    while ``fn(*args)`` runs; torch's kernels and other modules are not counted."""
    import inspect
    import sys

    target = inspect.unwrap(fn).__code__.co_filename
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename != target:
            return None  # no line events in other files' frames
        count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(previous)
    return count


@pytest.mark.exercise("6.6", points=1)
def test_no_python_loop_over_tokens():
    """Check the contract's "no Python loop over tokens" of assign_slots, dispatch and combine:
    with E, k, C and d fixed, 16 times the tokens (16 → 256) must not run more Python in their
    module (trace events: lines, calls and loop iterations; torch's kernels are not counted). A
    loop over the experts, the k choices or the C slots is fine; one over the tokens (or over
    their .tolist()) adds at least one event per token: 240 here, the limit is 60."""
    from labkit.lab6.expert_parallel import assign_slots, combine, dispatch

    n_expert, k, cap, d = 4, 2, 8, 6
    events = {}
    for T_ in (16, 256):
        ids = random_routing(T_, k, n_expert, 7)
        slots = plain_slots(ids, n_expert, cap)
        x, out = torch.randn(T_, d), torch.randn(n_expert, cap, d)
        w = torch.softmax(torch.randn(T_, k), -1)
        events[T_] = {"assign_slots": own_python_events(assign_slots, ids, n_expert, cap),
                      "dispatch": own_python_events(dispatch, x, ids, slots, n_expert, cap),
                      "combine": own_python_events(combine, out, ids, slots, w)}
    for name, small in events[16].items():
        large = events[256][name]
        assert large - small < 60, (
            f"{name} runs {small} Python trace events in its module for 16 tokens and {large} for "
            f"256 (E = {n_expert}, k = {k}, C = {cap}): the contract says no Python loop over "
            "tokens — express it with tensor operations (one_hot, cumsum, gather, index)")


@pytest.mark.exercise("6.6", points=1)
def test_dispatch_fills_claimed_slots_and_sums_the_gradient_of_copies():
    """Check the (E, C, d) buffer against a loop written here (zeros in unclaimed slots, nothing
    for dropped choices) and x's gradient: the sum of the gradients of its copies."""
    from labkit.lab6.expert_parallel import dispatch

    T_, k, n_expert, d = 20, 2, 4, 6
    ids = random_routing(T_, k, n_expert, 3, skew=True)
    cap = capacity(T_, n_expert, k, 1.0)
    slots = plain_slots(ids, n_expert, cap)
    x = torch.randn(T_, d, requires_grad=True)
    buffer = as_given(dispatch)(x, ids, slots, n_expert, cap)
    assert buffer.shape == (n_expert, cap, d), f"buffer shape {tuple(buffer.shape)}, expected {(n_expert, cap, d)}"
    want = torch.zeros(n_expert, cap, d)
    for t in range(T_):
        for j in range(k):
            if slots[t, j] >= 0:
                want[ids[t, j], slots[t, j]] = x[t].detach()
    assert torch.equal(buffer.detach(), want), "the buffer's rows differ from the tokens' claimed slots"
    g = torch.randn_like(buffer)
    with given("dispatch's backward", x=x, ids=ids, slots=slots, buffer=buffer, grad_out=g):
        buffer.backward(g)
    want_grad = torch.zeros(T_, d)
    for t in range(T_):
        for j in range(k):
            if slots[t, j] >= 0:
                want_grad[t] += g[ids[t, j], slots[t, j]]
    torch.testing.assert_close(x.grad, want_grad, **TOL, msg=lambda m: (
        f"d x through dispatch: {m} — each copy's gradient must reach its token"))


@pytest.mark.exercise("6.6", points=1)
def test_combine_weights_each_kept_slot_and_ignores_dropped_ones():
    """Check combine against a loop written here, and its gradients with respect to the experts'
    outputs and the router weights."""
    from labkit.lab6.expert_parallel import combine

    T_, k, n_expert, d = 20, 2, 4, 6
    ids = random_routing(T_, k, n_expert, 4, skew=True)
    cap = capacity(T_, n_expert, k, 1.0)
    slots = plain_slots(ids, n_expert, cap)
    assert (slots < 0).any(), "the skewed routing must drop some choices"
    out = torch.randn(n_expert, cap, d, requires_grad=True)
    w = torch.softmax(torch.randn(T_, k), -1).requires_grad_()
    got = as_given(combine)(out, ids, slots, w)
    rows = []
    for t in range(T_):
        row = torch.zeros(d)
        for j in range(k):
            if slots[t, j] >= 0:
                row = row + w[t, j] * out[ids[t, j], slots[t, j]]
        rows.append(row)
    want = torch.stack(rows)
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"combine: {m}")
    g = torch.randn(T_, d)
    with given("combine's backward", out=out, ids=ids, slots=slots, w=w, grad_out=g):
        mine = torch.autograd.grad(got, (out, w), g)
    ref = torch.autograd.grad(want, (out, w), g)
    for name, a, b in zip(("d expert outputs", "d weights"), mine, ref):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")


@functools.lru_cache(maxsize=None)
def run(world_size, capacity_factor, groups=1):
    """The student's ExpertParallelMoE on world_size gloo ranks, with the single-device reference
    on the same tokens: (layer copy with reference grads, x, reference out, x grad, per-rank results)."""
    from labkit.ranks import launch
    from labkit.harness.lab6 import run_expert_parallel

    torch.manual_seed(world_size * 10 + groups)
    layer = MoELayer(D, E, K, HIDDEN)
    x, grad_out = torch.randn(world_size * T, D), torch.randn(world_size * T, D)
    results = launch(run_expert_parallel, world_size, layer, x, capacity_factor, grad_out, groups,
                     timeout=120)
    ref_layer = copy.deepcopy(layer)
    xr = x.clone().requires_grad_()
    out = moe_reference(ref_layer, xr, capacity_factor, groups=world_size)
    out.backward(grad_out)
    return ref_layer, x, out.detach(), xr.grad, results


def _check_equal_to_reference(world_size, capacity_factor, groups=1):
    ref_layer, x, out, x_grad, results = run(world_size, capacity_factor, groups)
    where = f"W={world_size // groups} ({groups} group(s)), capacity factor {capacity_factor}"
    torch.testing.assert_close(torch.cat([r["out"] for r in results]), out, **TOL, msg=lambda m: (
        f"outputs, {where}: {m} — are slots filled in GShard's order with C per rank's T tokens, and "
        "do the outputs come back to the slots they were sent from?"))
    torch.testing.assert_close(torch.cat([r["x_grad"] for r in results]), x_grad, **TOL,
                               msg=lambda m: f"input gradients, {where}: {m}")
    router = sum(r["router_grad"] for r in results)  # the replicated router: data-parallel sum
    torch.testing.assert_close(router, ref_layer.router.weight.grad, **TOL, msg=lambda m: (
        f"router gradient summed over ranks, {where}: {m} — does the gradient reach the router "
        "through the combine weights?"))
    for e, expert in enumerate(ref_layer.experts):
        holders = [r["expert_grads"][e] for r in results if e in r["expert_grads"]]
        assert len(holders) == groups, f"expert {e} is held by {len(holders)} ranks, expected {groups}"
        for name, p in expert.named_parameters():
            got = sum(h[name] for h in holders)
            want = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, e=e, name=name: (
                f"expert {e} {name} gradient, {where}: {m} — does every rank's slot for this expert "
                "reach it, and its output gradient come back?"))


@pytest.mark.exercise("6.6", points=3)
@pytest.mark.parametrize("world_size,capacity_factor", [(2, 1.0), (4, 1.25)])
def test_expert_parallel_equals_the_single_device_layer_with_capacity(world_size, capacity_factor):
    """Check outputs, input gradients, the router's gradient (summed over ranks) and every
    expert's gradient against the single-device layer with the same capacity per rank's T
    tokens (some tokens dropped at these capacity factors)."""
    _check_equal_to_reference(world_size, capacity_factor)


@pytest.mark.exercise("6.6", points=1)
def test_expert_parallel_without_drops_equals_the_dropless_layer():
    """Check a capacity no token can exceed (capacity factor E/k: C = T) against the dropless
    ``MoELayer`` forward, and the gradients as above."""
    ref_layer, x, out, _, results = run(2, E / K)
    layer = copy.deepcopy(ref_layer)
    torch.testing.assert_close(torch.cat([r["out"] for r in results]), layer(x).detach(), **TOL,
                               msg=lambda m: f"outputs with C = T: {m}")
    _check_equal_to_reference(2, E / K)


@pytest.mark.exercise("6.6", points=1)
def test_expert_parallel_runs_inside_its_group():
    """Check 4 ranks as 2 expert-parallel groups of 2 (each group holds all experts): rank and
    world size come from the group, and the all-to-alls stay inside it."""
    _check_equal_to_reference(4, 1.0, groups=2)


@pytest.mark.exercise("6.6", points=2)
@pytest.mark.parametrize("world_size,capacity_factor,groups", [(2, 1.0, 1), (4, 1.25, 1), (2, E / K, 1),
                                                                (4, 1.0, 2)])
def test_all_to_all_bytes_equal_the_capacity_buffer(world_size, capacity_factor, groups):
    """Check each rank's communication: in forward exactly two all_to_all_single calls of
    E·C·n_embd·4 bytes each, C = ⌈capacity_factor · T · k / E⌉, and in backward the same two
    (the reverse exchanges); nothing else (no all-gather of the tokens, no all-reduce); and the
    counted run's outputs and gradients are the single-device layer's."""
    _, _, _, _, results = run(world_size, capacity_factor, groups)
    C = capacity(T, E, K, capacity_factor)
    want = {"calls": {"all_to_all_single": 2}, "bytes": {"all_to_all_single": 2 * E * C * D * 4}}
    for rank, r in enumerate(results):
        for phase in ("forward", "backward"):
            assert r[phase] == want, (
                f"rank {rank} {phase}, W={world_size // groups}, capacity factor {capacity_factor}: "
                f"{r[phase]}, expected two all-to-alls of E·C·d·4 = {E}·{C}·{D}·4 = {E * C * D * 4:,} "
                "bytes each and nothing else")
    _check_equal_to_reference(world_size, capacity_factor, groups)


# ---------------------------------------------------------------- given code (not graded)

def test_layer_refuses_bad_arguments_naming_them():
    from labkit.moe import route
    import torch.nn as nn

    with pytest.raises(ValueError, match="top_k"):
        MoELayer(8, 4, 5, 16)
    with pytest.raises(ValueError, match="capacity_factor"):
        capacity(8, 4, 2, 0)
    with pytest.raises(ValueError, match="top_k"):
        route(nn.Linear(8, 4, bias=False), torch.randn(3, 8), 0)


_IDS = torch.tensor([[0, 1], [1, 2], [2, 0]])  # T = 3 tokens, k = 2, E = 3
_SLOTS = torch.tensor([[0, 0], [0, 0], [0, 1]])


@pytest.mark.parametrize("call,error,words", [
    (lambda f: f.assign_slots([[0, 1]], 3, 2), TypeError, "expert_ids must be a torch.Tensor"),
    (lambda f: f.assign_slots(torch.tensor([0, 1, 2]), 3, 2), ValueError, "expert_ids must have 2 dim"),
    (lambda f: f.assign_slots(_IDS.int(), 3, 2), TypeError, "expert_ids must be a (T, k) int64"),
    (lambda f: f.assign_slots(_IDS, 3, 0), ValueError, "capacity must be an integer >= 1"),
    (lambda f: f.assign_slots(_IDS, 3, 1.5), ValueError, "capacity must be an integer >= 1"),
    (lambda f: f.assign_slots(_IDS, 0, 2), ValueError, "n_expert must be an integer >= 1"),
    (lambda f: f.dispatch(torch.randn(2, 4), _IDS, _SLOTS, 3, 2), ValueError, "x must have one row per token"),
    (lambda f: f.dispatch(torch.ones(3, 4, dtype=torch.int64), _IDS, _SLOTS, 3, 2), TypeError, "x must be a floating"),
    (lambda f: f.dispatch(torch.randn(3, 4), _IDS, _SLOTS[:, :1], 3, 2), ValueError, "slots must have expert_ids' shape"),
    (lambda f: f.combine(torch.randn(3, 2, 4), _IDS, _SLOTS, torch.ones(3, 1, 2)), ValueError, "weights must have 2 dim"),
    (lambda f: f.combine(torch.randn(3, 2, 4), _IDS, _SLOTS, torch.ones(2, 2)), ValueError, "weights must have expert_ids' shape"),
    (lambda f: f.combine(torch.randn(3, 2, 4), _IDS, _SLOTS.float(), torch.ones(3, 2)), TypeError, "slots must be a (T, k) int64"),
])
def test_assign_dispatch_and_combine_refuse_bad_input_naming_it(call, error, words):
    """Given checks, before the exercise's code: a wrong routing is named, not an IndexError deep
    in torch or a silently wrong buffer (x with fewer rows than tokens read the zero row)."""
    import labkit.lab6.expert_parallel as f

    with pytest.raises(error, match=re.escape(words)):
        call(f)

def test_capacity_is_the_ceiling_of_the_even_share():
    assert capacity(8, 4, 2, 1.0) == 4 and capacity(8, 4, 2, 1.25) == 5 and capacity(12, 8, 2, 1.25) == 4
    assert capacity(12, 8, 2, 8 / 2) == 12


def test_reference_without_capacity_is_the_dropless_layer():
    torch.manual_seed(1)
    layer = MoELayer(D, E, K, HIDDEN)
    x = torch.randn(30, D)
    torch.testing.assert_close(moe_reference(layer, x), layer(x), **TOL)


def test_each_rank_keeps_only_its_experts():
    """ExpertParallelMoE's given constructor keeps E/W experts: E/W of the layer's expert bytes."""
    ref_layer, _, _, _, results = run(4, 1.25)
    per_expert = sum(p.numel() * 4 for p in ref_layer.experts[0].parameters())
    assert [r["expert_bytes"] for r in results] == [E // 4 * per_expert] * 4
