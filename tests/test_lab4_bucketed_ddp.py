"""Graders of Lab 4, exercise 4.2 (labs/04_gradients.ipynb): bucketed data parallelism.

The reference nobody in this course wrote: ``torch.nn.parallel.DistributedDataParallel``, run on
the same real gloo ranks, group and batches (``labkit.reference.lab4.ddp_backward``), for the
starting parameters and the averaged gradients; the bucket formula (DDP's first assignment: the
trainable parameters in reverse order, a bucket closing when its fp32 bytes reach the cap; each
sent, in order, once its gradients are ready, with one presence count per parameter) for what
is sent. ``tests/test_conformance_data_parallel.py`` adds parameters used on some ranks only,
no_sync and every bucket cap.
What is sent, when and how is read from the c10d operators themselves (``labkit.harness.lab4
.EventLog``, a dispatch mode): the order of the gradient-ready events and the all-reduces,
their bytes, and each call's ``async_op`` — exact facts, not wall time.

Configurations: 2 ranks of the default group; 3 ranks on a GPT with biases and buckets of one
element each (a LayerNorm's weight is ready before its bias, which comes first in the buckets'
order: one gradient then lets two buckets go); a 4-rank world split into two groups of 2 with a
frozen parameter; 2 ranks in bf16; caps that a bucket reaches exactly. Two iterations of
backward + ``finish()`` each.

Tolerance: fp32 gradients averaged as DDP does (the same sums, divided before or after): a few
ulps, rtol 1e-5 / atol 1e-7. In bf16 on 2 ranks the fp32 sum of two bf16 values is exact, so
the average rounds exactly as DDP's bf16 all-reduce: compared at rtol 0 / atol 0... within one
bf16 ulp (rtol 2⁻⁸) to allow for the order of the halving.
"""
from __future__ import annotations

import functools

import pytest
import torch

from _lab4_helpers import (bucket_bytes, expected_events, first_difference, planned_buckets,
                          ready_order, tiny_gpt, zero2_gpt)
from labkit.ranks import launch
from labkit.models import SyntheticData

CAP = 16_384


def model_for(config: str):
    if config == "N=3":
        return tiny_gpt()  # with biases
    model = zero2_gpt(torch.bfloat16 if config == "bf16" else torch.float32)
    if config == "subgroups":
        model.wpe.weight.requires_grad_(False)  # a frozen parameter
    return model


def exact_cap(model, batch) -> int:
    """A cap that the first bucket reaches exactly: the fp32 bytes of the last two trainable
    parameters (the first two of the reversed order)."""
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    return 4 * (trainable[-1] + trainable[-2])


CONFIGS = {  # label -> (world size, group size)
    "N=2": (2, None), "N=3": (3, None), "subgroups": (4, 2), "bf16": (2, None)}


@functools.lru_cache(maxsize=None)  # one launch per configuration (not cached if it raises)
def run(config: str):
    from labkit.harness.lab4 import compare_with_ddp

    world_size, group_size = CONFIGS[config]
    model = model_for(config)
    data = SyntheticData(64, 32, 4, seed=1)
    batches = [data.batch(r) for r in range(world_size)]
    cap = {"N=2": CAP, "N=3": 4}.get(config) or exact_cap(model, batches[0])
    results = launch(compare_with_ddp, world_size, model, batches, bucket_cap_bytes=cap,
                     group_size=group_size, timeout=120)
    return model, batches, cap, results


def where(config, rank, res):
    return f"{config}, rank {rank}" + (f" (group {res['ranks']})" if config == "subgroups" else "")


@pytest.mark.exercise("4.2", points=1)
@pytest.mark.parametrize("config", ["N=2", "subgroups"])
def test_bucketed_ddp_starts_from_the_groups_first_rank(config):
    """Check that after wrapping, every rank's parameters equal those DistributedDataParallel
    leaves (its group's first rank's: global rank 0, or 2 in the second group of 2), although
    each rank's copy was perturbed first; exactly Ψ·4 B broadcast."""
    model, _, _, results = run(config)
    psi = sum(p.numel() for p in model.parameters())
    for rank, res in enumerate(results):
        for i, (got, want) in enumerate(zip(res["params"], res["ref_params"])):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, i=i, rank=rank, res=res: (
                f"{where(config, rank, res)}, parameter {i} after wrapping differs from DDP's — "
                f"replicas must start from the group's first rank's parameters (broadcast from "
                f"global rank {res['ranks'][0]})\n{m}"))
        assert res["init_bytes"].get("broadcast", 0) == 4 * psi, (
            f"{where(config, rank, res)}: {res['init_bytes']} sent at construction, expected one "
            f"broadcast of every parameter, 4Ψ = {4 * psi:,} B")


def assert_grads_equal_ddps(config, measured=""):
    """After the second backward and finish() every .grad of ``run(config)`` equals
    DistributedDataParallel's average over the group (frozen parameters: none). Tolerance: bf16,
    one bf16 rounding (rtol 2⁻⁸); fp32, the same sums in another order (rtol 1e-5, atol 1e-7).
    ``measured``: said in the message when a test that measured this run checks it."""
    model, _, _, results = run(config)
    names = [n for n, _ in model.named_parameters()]
    tol = dict(rtol=2 ** -8, atol=0) if config == "bf16" else dict(rtol=1e-5, atol=1e-7)
    for rank, res in enumerate(results):
        n = len(res["ranks"])
        for name, got, want in zip(names, res["grads"], res["ref_grads"]):
            if want is None:
                assert got is None, f"{where(config, rank, res)}: frozen {name} got a gradient"
                continue
            assert got is not None, f"{where(config, rank, res)}: {name}.grad is None after finish()"
            torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name, rank=rank, res=res: (
                f"{where(config, rank, res)}, {name}.grad{measured} differs from DDP's average over the "
                f"{n} ranks of the group (after a second iteration)\n{m}"))


MEASURED = " (of the run whose all-reduces were traced and counted)"


@pytest.mark.exercise("4.2", points=2)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_bucketed_ddp_gradients_equal_ddps(config):
    """Check that after the second backward and finish() every .grad equals
    DistributedDataParallel's average over the group (frozen parameters: none)."""
    assert_grads_equal_ddps(config)


@pytest.mark.exercise("4.2", points=2)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_each_bucket_is_sent_asynchronously_by_the_hook_that_fills_it(config):
    """Check the order of events of each backward: each bucket's all-reduce is issued
    (async_op=True), in bucket order, inside the hook of the gradient that completes it (or
    completes the one before it) — right before that gradient's own ready event — with the
    bucket's fp32 bytes and presence counts; the buckets left when backward ends are sent then;
    finish() sends nothing. The traced run's gradients must be DDP's: the events count only for
    the right result."""
    model, batches, cap, results = run(config)
    buckets = planned_buckets(model, cap)
    for rank, res in enumerate(results):
        want = expected_events(ready_order(model, *batches[rank]), buckets, "all_reduce")
        for it, events in enumerate(res["events"]):
            end = events.index(("backward_end", "", None))
            got = events[:end]
            assert got == want, (
                f"{where(config, rank, res)}, iteration {it}: backward's events differ from the "
                f"bucket formula (cap {cap:,} B): {first_difference(got, want)}"
                + (" — a blocking all-reduce cannot overlap the rest of backward: use async_op=True"
                   if any(e[2] is False for e in got) else ""))
            tail = [e for e in events[end:] if e[0] == "all_reduce"]
            assert not tail, (
                f"{where(config, rank, res)}, iteration {it}: finish() issued {tail}: every bucket "
                "must be sent by the end of backward (its last buckets by _end_of_backward)")
    assert_grads_equal_ddps(config, MEASURED)


@pytest.mark.exercise("4.2", points=1)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_bucketed_ddp_bytes_and_calls_follow_the_cap(config):
    """Check the counted all-reduces of each iteration: 4Ψ bytes of gradients in all (fp32, also
    for bf16 parameters; frozen ones excluded) plus 4 bytes of presence count per parameter, in
    the bucket sizes the cap gives, and ``buckets_sent`` = every bucket by the end of backward,
    reset by finish() (which also forgets the all-reduces it waited for: ``in_flight`` empty);
    and the counted run's gradients are DDP's."""
    model, batches, cap, results = run(config)
    buckets = planned_buckets(model, cap)
    psi = sum(n for b in buckets for _, n in b)
    n_params = sum(len(b) for b in buckets)
    want = [bucket_bytes(b, "all_reduce") for b in buckets]
    for rank, res in enumerate(results):
        for it in range(len(res["events"])):
            sent = res["bytes_sent"][it].get("all_reduce", 0)
            assert sent == 4 * (psi + n_params), (
                f"{where(config, rank, res)}, iteration {it}: all-reduces carried {sent:,} B, "
                f"expected 4·(Ψ + P) = {4 * (psi + n_params):,} (each trainable gradient once, "
                "in fp32, and one presence count per parameter)")
            got = [e[1] for e in res["events"][it] if e[0] == "all_reduce"]
            assert got == want, (
                f"{where(config, rank, res)}, iteration {it}: bucket sizes sent {got}, expected "
                f"{want} (cap {cap:,} B, fp32 bytes, the parameters in reverse order)")
            assert res["sent_before_finish"][it] == len(buckets) and res["sent_after_finish"][it] == 0, (
                f"{where(config, rank, res)}, iteration {it}: buckets_sent was "
                f"{res['sent_before_finish'][it]} before finish() and {res['sent_after_finish'][it]} "
                f"after, expected {len(buckets)} (every bucket, by the end of backward) and 0")
            assert res["held_after_finish"][it] == 0, (
                f"{where(config, rank, res)}, iteration {it}: in_flight still holds "
                f"{res['held_after_finish'][it]} all-reduce(s) after finish(): each keeps its "
                "bucket's buffer alive, and they pile up step after step")
    assert_grads_equal_ddps(config, MEASURED)


def test_bucketed_ddp_rejects_bad_arguments():
    """Not graded (the checks are given): bucket_cap_bytes must be an int > 0, module a Module."""
    from labkit.lab4.bucketed_ddp import BucketedDDP

    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="bucket_cap_bytes"):
            BucketedDDP(torch.nn.Linear(2, 2), bucket_cap_bytes=bad)
    with pytest.raises(TypeError, match="module"):
        BucketedDDP([torch.nn.Parameter(torch.ones(2))])


# ---------------------------------------------------------------- conditional computation

def _unused_worker(rank, world_size):
    """On 2 ranks, a toy whose loss is linear in its parameters (tests/_conformance_helpers.py):
    DDP(find_unused_parameters=True) and BucketedDDP (cap: a few parameters) on the same plans."""
    from _conformance_helpers import ALL, bucketed_run, ddp_run, dp_plans, plan_gradients

    out = {}
    for name, plan in dp_plans(2).items():
        G = plan_gradients(plan, [0, 1])
        out[name] = bucketed_run(G, rank, None, 200), ddp_run(G, rank, None, adam=False)[0]
    G = plan_gradients([[[set(ALL), set(ALL) - {"head"}, {"h.0.weight"}]] * 2] * 2, [0, 1])
    out["no_sync"] = (bucketed_run(G, rank, None, 200, no_sync=True),
                      ddp_run(G, rank, None, adam=False, no_sync=True)[0])
    return out


@pytest.mark.exercise("4.2", points=2)
def test_parameters_used_on_some_ranks_only_match_ddp_find_unused_parameters():
    """Check, on 2 ranks, a block that runs on rank 0 only, a parameter used on rank 0 only, one
    used on no rank, a block no rank runs, two backwards per step, and no_sync() (three
    backwards, the first two inside it): after finish() every .grad equals
    DistributedDataParallel(find_unused_parameters=True)'s — the average with zeros from the
    rank that did not use it, None where no rank did — and no rank aborts inside gloo (every rank
    sends every bucket, in the same order). Tolerance: fp64, rtol 1e-9 / atol 1e-12 (the same
    sums, divided before or after)."""
    from _conformance_helpers import F64, assert_runs_close

    for rank, out in enumerate(launch(_unused_worker, 2, timeout=120)):
        for name, (got, want) in out.items():
            assert_runs_close(got, want, f"rank {rank}, {name}: does every rank send every bucket "
                              "once per backward, in order (the given _end_of_backward sends what "
                              "is left), a missing gradient as zeros with presence 0, and finish() "
                              "leave None where no rank had one?", **F64)
