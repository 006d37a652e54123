"""Graders of Lab 4, exercise 4.3 (labs/04_gradients.ipynb): ZeRO-2.

References nobody in this course wrote, run on the same real gloo ranks, group and batches
(``labkit.reference.lab4``): ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.Adam``
(``ddp_adam_steps``; several backward passes per step add up in ``.grad``) for fp32 parameters,
and for bf16 ones the plain mixed-precision computation (``master_adam_steps``: the gradients
summed over the ranks in fp32, ``torch.optim.Adam`` on an fp32 master copy). Adam's states are
compared slice by slice (this rank's [r·S, (r+1)·S) of the flat vector). Collective calls and bytes
by ``labkit.comm_count``; their order, bytes and ``async_op`` by ``labkit.harness.lab4.EventLog``
(a dispatch mode on the c10d operators); the bytes alive after backward by PyTorch's
``MemTracker``; the ``.grad`` tensors alive at each gradient-ready event by a probe hook.

Tolerances: fp32 Adam after the same gradients summed in another order (a reduce-scatter vs an
all-reduce) differs by a few ulps: parameters at atol 1e-6 / rtol 1e-5; Adam's moments at rtol
1e-5 with atol 1e-6 of their largest entry (a gradient counted twice is off by 2× or 4×). Byte
and call counts are exact integers.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from _lab4_helpers import (UPDATE_TOL, expected_events, first_difference, planned_buckets,
                          ready_order, tiny_gpt, zero2_gpt)
from labkit.ranks import launch
from labkit.models import SyntheticData

CAP = 16_384


def _batches(world_size, steps, backwards=1, seed=1, vocab=64, T=32):
    data = SyntheticData(vocab, T, 4, seed=seed)
    n = iter(range(10_000))

    def one():
        micro = [data.batch(next(n)) for _ in range(backwards)]
        return micro[0] if backwards == 1 else micro

    return [[one() for _ in range(world_size)] for _ in range(steps)]


@functools.lru_cache(maxsize=None)  # one launch per configuration (not cached if it raises)
def run_zero2(world_size, steps=3, bucket_cap_bytes=CAP, backwards=1, dtype="float32",
              group_size=None, frozen=False, reference=True, model="zero2"):
    from labkit.harness.lab4 import train_zero2

    if model == "zero2":
        m = zero2_gpt(getattr(torch, dtype))
    elif model == "odd":  # Ψ = 231 in sizes of 3: at N = 2 a shard boundary leaves a 1-element piece
        m = tiny_gpt(vocab_size=30, block_size=8, n_layer=1, n_head=1, n_embd=3, bias=False)
    elif model == "biased":  # LayerNorms' weights ready before their biases, which the buckets put first
        m = tiny_gpt()
    else:  # a model whose shard (4Ψ/N) dwarfs a small bucket and its largest gradient
        m = tiny_gpt(n_layer=4, n_embd=48, n_head=2, bias=False)
    if frozen:
        m.wpe.weight.requires_grad_(False)
    batches = _batches(world_size, steps, backwards, **(dict(vocab=30, T=8) if model == "odd" else {}))
    return m, batches, launch(train_zero2, world_size, m, batches, lr=1e-3,
                              bucket_cap_bytes=bucket_cap_bytes, reference=reference,
                              group_size=group_size, timeout=120)


def assert_params_match(model, results, what, cause, tol=UPDATE_TOL):
    names = [n for n, _ in model.named_parameters()]
    for rank, res in enumerate(results):
        for name, got, want in zip(names, res["params"], res["ref"]["params"]):
            torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name, rank=rank, res=res: (
                f"{what}, rank {rank} (group {res['ranks']}), {name} differs from the reference's — "
                f"{cause}\n{m}"))


BF16_PARAM_TOL = dict(rtol=2 ** -8, atol=1e-6)  # a bf16 parameter is its fp32 master rounded: one ulp


def check_measured(model, results, what):
    """A measurement counts only for the right result: the run whose bytes, collectives or events
    were measured must train to the reference's parameters (DDP + Adam; bf16: the fp32 master
    rounded, BF16_PARAM_TOL)."""
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    assert_params_match(model, results, f"{what} (the run whose bytes or events were measured)",
                        "is every bucket's reduce-scattered output added into grad_shard, "
                        "averaged, stepped and the parameters gathered back?",
                        tol=BF16_PARAM_TOL if bf16 else UPDATE_TOL)


def assert_moments_match(results, what, cause):
    """This rank's slice of Adam's exp_avg and exp_avg_sq after every step, against the reference's."""
    for rank, res in enumerate(results):
        S, r = res["shard_size"], res["rank"]
        for step, (m, v) in enumerate(zip(res["exp_avg"], res["exp_avg_sq"])):
            for key, got in (("exp_avg", m), ("exp_avg_sq", v)):
                ref = res["ref"][key][step]
                want = torch.zeros(len(res["ranks"]) * S)
                want[:ref.numel()] = ref
                want = want[r * S:(r + 1) * S]
                scale = float(want.abs().max())
                bad = ~((got - want).abs() <= 1e-6 * scale + 1e-5 * want.abs())  # NaN is bad too
                if bad.any():
                    i = int(bad.nonzero()[0])
                    ratio = float(got[i] / want[i]) if want[i] != 0 else float("inf")
                    raise AssertionError(
                        f"{what}, rank {rank} (group {res['ranks']}), step {step}: state[{key!r}] "
                        f"differs from torch.optim.Adam's in {int(bad.sum())} of {S} entries, first "
                        f"at shard index {i}: got {float(got[i]):.6g}, expected {float(want[i]):.6g} "
                        f"(ratio {ratio:.3g}) — {cause}")


# ---------------------------------------------------------------- the update

@pytest.mark.exercise("4.3", points=1)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero2_matches_ddp_and_adam(world_size):
    """Check that 3 steps of ZeRO2Adam on N real gloo ranks give, on every rank, the parameters
    of DistributedDataParallel + torch.optim.Adam run on the same ranks and batches, and this
    rank's slice of Adam's moments after every step; grad_shard is zero right after step()."""
    model, _, results = run_zero2(world_size)
    cause = ("is every bucket reduce-scattered (the last, partial one too), each piece added at "
             "its place in grad_shard, the sum divided by N, and grad_shard zeroed after the step?")
    for rank, res in enumerate(results):
        left = [step for step, m in enumerate(res["shard_left"]) if m != 0]
        assert not left, (f"N = {world_size}, rank {rank}: grad_shard is not zero right after step() "
                          f"at step {left[0]} (largest |entry| {res['shard_left'][left[0]]:.3g}): "
                          "step() must reset it, whether or not zero_grad() is called")
    assert_moments_match(results, f"N = {world_size}", cause)
    assert_params_match(model, results, f"N = {world_size}", cause)


@pytest.mark.exercise("4.3", points=2)
@pytest.mark.parametrize("bucket_cap_bytes", [CAP, 25 * 2**20])
def test_zero2_accumulates_several_backwards_exactly(bucket_cap_bytes):
    """Check 3 backward passes per step (2 steps, N = 2), with small buckets (a parameter is sent
    once per backward) and with the default 25 MiB bucket (it waits in the bucket across the
    backwards): Adam's moments and the parameters equal DDP + Adam's, where ``.grad`` sums the
    three backwards — every gradient counted exactly once."""
    model, _, results = run_zero2(2, steps=2, bucket_cap_bytes=bucket_cap_bytes, backwards=3)
    cause = ("with several backwards before step(), a parameter still waiting in the bucket must "
             "not be added again (its .grad already holds the sum), and a piece that arrives twice "
             "must be added to grad_shard, not written over it")
    assert_moments_match(results, f"3 backwards per step, cap {bucket_cap_bytes:,} B", cause)
    assert_params_match(model, results, f"3 backwards per step, cap {bucket_cap_bytes:,} B", cause)


@pytest.mark.exercise("4.3", points=1)
def test_zero2_pieces_of_one_element_at_shard_boundaries():
    """Check a GPT whose parameter sizes (multiples of 3, Ψ = 231) put N = 2's shard boundary one
    element before a parameter's end, and another two elements into one, with 40-byte buckets
    (most hold one gradient) and 2 backwards per step: the moments and parameters of DDP + Adam
    after 2 steps — every piece, whatever its length, lands at its place in grad_shard."""
    model, _, results = run_zero2(2, steps=2, bucket_cap_bytes=40, backwards=2, model="odd")
    cause = ("a parameter cut by a shard boundary into pieces of 1 and 2 elements: is every piece "
             "(owned_pieces gives them all) sent to its owner, and read back at its offset?")
    assert_moments_match(results, "pieces of 1 element", cause)
    assert_params_match(model, results, "pieces of 1 element", cause)


@pytest.mark.exercise("4.3", points=1)
def test_zero2_updates_bf16_parameters_through_the_fp32_master():
    """Check bf16 parameters (N = 2, 3 steps): state["master"] equals the fp32 master of the plain
    mixed-precision computation (torch.optim.Adam on fp32 copies, gradients summed in fp32), and
    every bf16 parameter is its master rounded (within one bf16 ulp: rtol 2⁻⁸)."""
    model, _, results = run_zero2(2, dtype="bfloat16")
    for rank, res in enumerate(results):
        assert res["master"] is not None, f"rank {rank}: no state['master'] for bf16 parameters"
        S, r = res["shard_size"], res["rank"]
        want = torch.zeros(2 * S)
        want[:res["ref"]["master"].numel()] = res["ref"]["master"]
        torch.testing.assert_close(res["master"], want[r * S:(r + 1) * S], **UPDATE_TOL, msg=lambda m, rank=rank: (
            f"rank {rank}: state['master'] after 3 steps differs from the fp32 master of "
            f"torch.optim.Adam — is Adam applied to the fp32 master slice (not to a copy "
            f"of the bf16 parameters), and the bf16 parameters gathered from it?\n{m}"))
    assert_params_match(model, results, "bf16", "the parameters must be the master rounded to bf16",
                        tol=BF16_PARAM_TOL)


def run_subgroups():
    """Two groups of 2 in a 4-rank world, a frozen parameter, a cap the first bucket reaches
    exactly (the fp32 bytes of the last two trainable parameters: the first two of the buckets'
    reversed order)."""
    m = zero2_gpt()
    m.wpe.weight.requires_grad_(False)
    trainable = [p.numel() for p in m.parameters() if p.requires_grad]
    cap = 4 * (trainable[-1] + trainable[-2])
    return cap, run_zero2(4, bucket_cap_bytes=cap, group_size=2, frozen=True)


@pytest.mark.exercise("4.3", points=1)
def test_zero2_in_subgroups_with_a_frozen_parameter():
    """Check a 4-rank world split into two groups of 2, each training its own ZeRO2Adam over its
    group (a frozen parameter, skipped: torch.optim.Adam skips it too): the parameters and moments
    of DDP + Adam over the same group; the frozen one unchanged."""
    _, (model, _, results) = run_subgroups()
    cause = "in a subgroup, ranks, sizes and peers are the group's (dist.get_rank(group)), not the world's"
    assert_moments_match(results, "subgroups", cause)
    assert_params_match(model, results, "subgroups", cause)


# ---------------------------------------------------------------- memory

@pytest.mark.exercise("4.3", points=1)
def test_zero2_holds_a_shard_and_one_bucket_of_gradients():
    """Check on 4 ranks, by reading the .grad tensors alive after every gradient-ready event:
    at most bucket_cap_bytes + the largest gradient's bytes of full gradients at any moment (the
    bucket that is filling and the gradient that fills it), beside grad_shard of exactly 4·S
    bytes; DDP (ZeRO-1's gradients) holds all 4Ψ."""
    model, _, results = run_zero2(4)
    psi = sum(p.numel() for p in model.parameters())
    shard = 4 * math.ceil(psi / 4)
    for rank, res in enumerate(results):
        assert res["shard_bytes"] == shard, (
            f"rank {rank}: grad_shard holds {res['shard_bytes']:,} B, expected 4·S = {shard:,} "
            "(float32, S = ceil(Ψ/N) elements)")
        bound = CAP + res["largest_grad_bytes"]
        assert res["peak_grad_bytes"] <= bound, (
            f"rank {rank}: up to {res['peak_grad_bytes']:,} B of full gradients were alive during "
            f"backward, expected ≤ bucket cap + largest gradient = {bound:,} (4Ψ = {4 * psi:,}): "
            "send a bucket as soon as it reaches the cap, and set its parameters' .grad to None")
        assert res["ref"]["peak_grad_bytes"] == 4 * psi, (
            f"rank {rank}: DDP held {res['ref']['peak_grad_bytes']:,} B of gradients, 4Ψ = {4 * psi:,}")
    check_measured(model, results, "N = 4")


@pytest.mark.exercise("4.3", points=2)
def test_zero2_after_backward_holds_the_shard_plus_one_bucket_in_flight():
    """Check the bytes of every tensor alive after backward (PyTorch's MemTracker, from the
    optimizer's construction; the parameters and Adam's moments excluded) on 2 ranks with 4 KiB
    buckets: at most the chapter's 4Ψ/N (grad_shard) + the bucket that is filling (< cap) + one
    bucket in flight (its fp32 input and this rank's output: 2·(cap + largest gradient)). A
    reduce-scatter's output is added into grad_shard when the next bucket is sent, not kept
    until step()."""
    cap = 4096
    model, _, results = run_zero2(2, steps=1, bucket_cap_bytes=cap, model="deep")
    psi = sum(p.numel() for p in model.parameters())
    for rank, res in enumerate(results):
        shard, largest = res["shard_bytes"], res["largest_grad_bytes"]
        bound = shard + cap + 2 * (cap + largest)
        held = res["held_after_backward"]
        assert shard <= held <= bound, (
            f"rank {rank}: {held:,} B alive after backward, expected at most 4Ψ/N = {shard:,} + "
            f"a filling bucket (< {cap:,}) + one in flight (≤ {2 * (cap + largest):,}) = {bound:,} "
            f"(DDP holds 4Ψ = {4 * psi:,}; {held - shard:,} beyond the shard): are the outputs of "
            "earlier reduce-scatters kept until step() instead of being added into grad_shard "
            "when the next bucket is sent, or full gradients kept after their bucket was sent?")
    check_measured(model, results, f"N = 2, {cap:,} B buckets")


# ---------------------------------------------------------------- communication

@pytest.mark.exercise("4.3", points=1)
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero2_sends_what_data_parallelism_sends(world_size):
    """Check the collectives of one step (counted by labkit.comm_count): reduce-scatters of
    exactly 4Ψ bytes of gradients in all (each fp32 gradient element once) plus, per parameter,
    one 4-byte presence count in each of the N inputs; one all-gather of N·4S bytes; no
    all-reduce: the volume of DDP's all-reduce."""
    model, _, results = run_zero2(world_size)
    psi = sum(p.numel() for p in model.parameters())
    n_params = len(list(model.parameters()))
    shard = math.ceil(psi / world_size)
    for rank, res in enumerate(results):
        for step, comm in enumerate(res["comm"]):
            sent, calls = comm["bytes_sent"], comm["calls"]
            where = f"rank {rank}, step {step}"
            assert "all_reduce" not in calls, (
                f"{where}: {calls['all_reduce']} all-reduce call(s): ZeRO-2 reduce-scatters")
            got = sent.get("reduce_scatter", 0) + sent.get("reduce_scatter_tensor", 0)
            want = 4 * psi + 4 * world_size * n_params
            assert got == want, (
                f"{where}: reduce-scatters carried {got:,} B, expected 4Ψ + 4·N·P = {want:,}: every "
                "fp32 gradient element once, and each parameter's presence count in each input")
            gathered = sent.get("all_gather_into_tensor", 0)
            assert gathered == 4 * world_size * shard, (
                f"{where}: all-gather of {gathered:,} B, expected N·4S = {4 * world_size * shard:,}")
    check_measured(model, results, f"N = {world_size}")


@pytest.mark.exercise("4.3", points=2)
@pytest.mark.parametrize("config", ["one-element buckets, biases", "exact cap, subgroups", "bf16"])
def test_each_bucket_is_reduce_scattered_asynchronously_by_the_hook_that_fills_it(config):
    """Check the order of events of the first backward: each bucket's reduce-scatter is issued
    (async_op=True), in bucket order, inside the hook of the gradient that completes it (or the
    one before it) — right before that gradient's own ready event — with the bucket's fp32 bytes
    and presence counts; the buckets left when backward ends are sent then; nothing else.
    Configurations: N = 2, a GPT with biases and buckets of one element (a LayerNorm's weight is
    ready before its bias, which comes first in the buckets' order: one gradient then lets two
    buckets go); two groups of 2 in a 4-rank world, a frozen parameter, and a cap that the first
    bucket reaches exactly; bf16 parameters (the cap counts fp32 bytes). The traced runs must
    train to the reference's parameters (the events count only for the right result)."""
    if config == "one-element buckets, biases":
        cap = 4
        model, batches, results = run_zero2(2, steps=1, bucket_cap_bytes=cap, model="biased")
    elif config == "bf16":
        model, batches, results = run_zero2(2, dtype="bfloat16")
        cap = CAP
    else:
        cap, (model, batches, results) = run_subgroups()
    for rank, res in enumerate(results):
        buckets = planned_buckets(model, cap)
        want = expected_events(ready_order(model, *batches[0][rank]), buckets, "reduce_scatter",
                               ranks=len(res["ranks"]))
        got = res["events"]
        assert got == want, (
            f"{config}, rank {rank}: the first backward's events differ from the bucket formula "
            f"(cap {cap:,} fp32 bytes): {first_difference(got, want)}"
            + (" — a blocking reduce-scatter cannot overlap the rest of backward: use async_op=True"
               if any(e[2] is False for e in got) else ""))
    check_measured(model, results, config)


def test_zero2_rejects_bad_arguments():
    """Not graded (the checks are given): what torch.optim.Adam refuses (negative eps, betas
    outside [0, 1), a negative lr, also a group's own), a single tensor,
    bucket_cap_bytes <= 0, and no trainable parameter — each a ValueError/TypeError naming the
    argument, before any collective (these run without a process group)."""
    from labkit.lab4.zero2 import ZeRO2Adam

    params = list(torch.nn.Linear(3, 2).parameters())
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="bucket_cap_bytes"):
            ZeRO2Adam(params, bucket_cap_bytes=bad)
    for kwargs, name in ((dict(eps=-1e-8), "eps"), (dict(betas=(0.9, 1.0)), "betas"),
                         (dict(lr=-1.0), "lr")):
        with pytest.raises(ValueError, match=name):
            ZeRO2Adam(params, **kwargs)
    with pytest.raises(TypeError, match="params"):
        ZeRO2Adam(params[0])
    with pytest.raises(ValueError, match="lr"):
        ZeRO2Adam([{"params": params, "lr": -1.0}])
    frozen = [torch.nn.Parameter(torch.ones(2), requires_grad=False)]
    with pytest.raises(ValueError, match="params"):
        ZeRO2Adam(frozen)


# ---------------------------------------------------------------- conditional computation

def _unused_worker(rank, world_size):
    """On 2 ranks, the toy of tests/_conformance_helpers.py: DDP(find_unused_parameters=True) +
    Adam and ZeRO2Adam (buckets of a few parameters) on the same plans."""
    from _conformance_helpers import ddp_run, dp_plans, optimizer_run, plan_gradients

    out = {}
    for name, plan in dp_plans(2).items():
        G = plan_gradients(plan, [0, 1])
        out[name] = optimizer_run("ZeRO2Adam", G, rank, None, 200), ddp_run(G, rank, None, adam=True)[1]
    return out


def _after_step_worker(rank, world_size):
    """ZeRO2Adam on a tiny GPT: one backward and step() (no zero_grad); what grad_shard and
    present hold afterwards."""
    from labkit.lab4.zero2 import ZeRO2Adam

    model = tiny_gpt()
    opt = ZeRO2Adam(list(model.parameters()), lr=1e-3, bucket_cap_bytes=CAP)
    x, y = SyntheticData(64, 32, 4, seed=1 + rank).batch(0)
    model(x, y).backward()
    opt.step()
    return {"present": opt.present.clone(), "grad_shard": opt.grad_shard.clone()}


@pytest.mark.exercise("4.3", points=1)
def test_zero2_step_leaves_grad_shard_and_presence_counts_zero():
    """Check, on 2 ranks, that step() itself zeroes ``grad_shard`` and ``present`` (the class
    docstring: "zeros after step()"), not only the given zero_grad(): counts left over would give
    a parameter no rank uses in the next backward a zero gradient, and Adam would move it."""
    for rank, out in enumerate(launch(_after_step_worker, 2, timeout=120)):
        for name in ("present", "grad_shard"):
            left = out[name]
            assert not bool(left.any()), (
                f"rank {rank}: after step() {name} still holds {int((left != 0).sum())} non-zero "
                f"entries of {left.numel()}: step() must zero grad_shard and present for the next "
                f"step (a parameter missing from the next backward must get no gradient)")


@pytest.mark.exercise("4.3", points=1)
def test_zero2_parameters_used_on_some_ranks_only_match_ddp_and_adam():
    """Check, on 2 ranks, a block that runs on rank 0 only, a parameter used on rank 0 only, one
    used on no rank, a block first run at step 2, two backwards per step: the parameters after
    each step equal DistributedDataParallel(find_unused_parameters=True) + torch.optim.Adam's
    (a parameter no rank used is not stepped and counts its own steps), and no rank aborts in
    gloo. Tolerance: fp64 at atol 1e-9 (Adam divides an exactly-zero-or-ulps gradient by ε)."""
    from _conformance_helpers import ADAM64, assert_runs_close

    for rank, out in enumerate(launch(_unused_worker, 2, timeout=120)):
        for name, (got, want) in out.items():
            assert_runs_close(got, want, f"rank {rank}, plan {name!r}: is every bucket sent once "
                              "per backward, in order, with each parameter's presence count, and "
                              "a piece given no gradient where no rank had one?", **ADAM64)
