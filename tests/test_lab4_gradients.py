"""Graders of Lab 4 (labs/04_gradients.ipynb): gradients — compute fast, drop fast, send as you go.

References nobody in this course wrote: the gradient of the whole batch in one backward (the
plain computation) for accumulation; ``torch.nn.parallel.DistributedDataParallel`` and
``torch.optim.Adam`` (run side by side on the same real gloo ranks, ``labkit.dist``) for ZeRO-2;
``labkit.comm_count`` (a dispatch mode that sees every c10d operator) for collective calls and
bytes; ``labkit.measure`` (PyTorch's ``MemTracker``) for activation bytes; the ``.grad`` tensors
that exist at each gradient-ready event (read by a hook the test registers) for gradient bytes.

Tolerances, each justified where it is used: float64 sums in another order differ by ~1e-16
relative, so accumulation is checked at atol 1e-12; fp32 Adam after the same gradients summed
in another order (a reduce-scatter vs an all-reduce) differs by a few ulps (atol 1e-6, rtol 1e-5);
byte and call counts are exact integers.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from labkit.dist import launch
from labkit.measure import peak_saved_bytes
from labkit.models import GPT, GPTConfig, SyntheticData

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


def full_batch_grads(model, x, y):
    """The reference: one forward and one backward over the whole batch."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    ref(x, y).backward()
    return {name: p.grad for name, p in ref.named_parameters()}


def assert_grads_equal(model, want, cause, **tol):
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}.grad is None after accumulation: {cause}"
        torch.testing.assert_close(p.grad, want[name], **tol,
                                   msg=lambda m, name=name: f"{name}.grad differs from the full batch's — {cause}\n{m}")


# =================================================================== 4.1 gradient accumulation

@pytest.mark.exercise("4.1", points=1)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_accumulation_equals_the_full_batch(k):
    """Check that k equal micro-batches of a batch of 8 leave the full batch's gradient in .grad
    (float64, atol 1e-12) and return the full batch's loss."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt(dtype=torch.float64)
    x, y = SyntheticData(64, 32, 8, seed=1).batch(0)
    want = full_batch_grads(model, x, y)
    loss = accumulate_gradients(model, x, y, k)
    assert_grads_equal(model, want, f"k = {k}: is each micro-batch's loss scaled by its share "
                       "(1/k here), and is every micro-batch's backward run once?", **F64_TOL)
    full_loss = float(copy.deepcopy(model)(x, y).detach())
    assert math.isclose(loss, full_loss, rel_tol=1e-12), (
        f"returned loss {loss!r}, the full batch's is {full_loss!r}: return the weighted sum of "
        "the micro-batch losses")


@pytest.mark.exercise("4.1", points=1)
@pytest.mark.parametrize("weight", ["tokens", "samples"])
@pytest.mark.parametrize("k", [3, 5])
def test_accumulation_with_uneven_micro_batches(k, weight):
    """Check a batch of 8 in k = 3 or 5 micro-batches (sizes 3,3,2 / 2,2,2,1,1): with equal
    sequence lengths both weightings equal the full batch's gradient (1/k would not)."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt(dtype=torch.float64)
    x, y = SyntheticData(64, 32, 8, seed=2).batch(0)
    want = full_batch_grads(model, x, y)
    accumulate_gradients(model, x, y, k, weight=weight)
    assert_grads_equal(model, want, f"k = {k} does not divide 8: weight each micro-batch by its "
                       f"share of the batch's {weight}, not by 1/k", **F64_TOL)


@pytest.mark.exercise("4.1", points=1)
def test_accumulation_weights_by_counted_tokens():
    """Check a batch whose samples have different numbers of counted targets (the rest are
    ignore_index = -100, as padding would be): weight="tokens" gives the full batch's gradient."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt(dtype=torch.float64)
    x, y = SyntheticData(64, 32, 8, seed=3).batch(0)
    y = y.clone()
    for i in range(8):  # sample i keeps 4·i + 3 counted targets
        y[i, 4 * i + 3:] = -100
    want = full_batch_grads(model, x, y)
    accumulate_gradients(model, x, y, 3, weight="tokens")
    assert_grads_equal(model, want, "samples have different numbers of counted tokens: scale "
                       "each micro-batch's loss by (its counted tokens) / (the batch's counted "
                       "tokens), counting only targets != -100", **F64_TOL)


@pytest.mark.exercise("4.1", points=1)
def test_accumulation_rejects_bad_input():
    """Check ValueError naming the argument for k = 0, k = -1, k = 2.0, k > batch size and an
    unknown weight, before any gradient is touched."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt()
    x, y = SyntheticData(64, 32, 4, seed=0).batch(0)
    for bad in (0, -1, 2.0, 5):
        with pytest.raises(ValueError, match="k"):
            accumulate_gradients(model, x, y, bad)
    with pytest.raises(ValueError, match="weight"):
        accumulate_gradients(model, x, y, 2, weight="mean")
    assert all(p.grad is None for p in model.parameters()), "a gradient was computed before the error"


@pytest.mark.exercise("4.1", points=1)
def test_accumulation_activation_peak_is_one_micro_batch():
    """Check that the peak bytes autograd holds saved for backward (activations) with k = 4 are
    at most 1/4 of the full batch's plus 10% (activations are linear in the batch; the margin
    covers per-step constants such as the position embedding's output)."""
    from labkit.lab4.grad_accumulation import accumulate_gradients

    model = tiny_gpt()
    x, y = SyntheticData(64, 32, 16, seed=0).batch(0)
    peaks = {k: peak_saved_bytes(lambda k=k: accumulate_gradients(copy.deepcopy(model), x, y, k))
             for k in (1, 4)}
    assert peaks[1] > 0, "no activation was saved for backward with k = 1"
    bound = peaks[1] / 4 * 1.10
    assert peaks[4] <= bound, (
        f"peak activation bytes with k = 4: {peaks[4]:,}, expected ≤ {bound:,.0f} (1/4 of the "
        f"full batch's {peaks[1]:,} + 10%): run backward after each micro-batch's forward, not "
        "once on the sum of the losses")


@pytest.mark.exercise("4.1", points=2)
def test_accumulation_under_ddp_all_reduces_once():
    """Check on 2 real gloo ranks with DistributedDataParallel: k = 4 makes as many all-reduce
    calls and bytes as k = 1 (one per DDP bucket, counted), and the same gradients (float64)."""
    from labkit.lab4.grad_accumulation import ddp_accumulation_worker

    model = tiny_gpt(dtype=torch.float64)
    data = SyntheticData(64, 32, 8, seed=4)
    results = launch(ddp_accumulation_worker, 2, model, [data.batch(0), data.batch(1)], (1, 4))
    for rank, res in enumerate(results):
        one, four = res[1], res[4]
        n1, n4 = one["calls"].get("all_reduce", 0), four["calls"].get("all_reduce", 0)
        assert n1 >= 1, f"rank {rank}: k = 1 made no all-reduce at all (DDP did not synchronise)"
        assert n4 == n1, (
            f"rank {rank}: k = 4 made {n4} all-reduce calls, DDP makes {n1} per synchronisation: "
            "the first k − 1 backward passes must run inside model.no_sync()")
        b1, b4 = one["bytes"].get("all_reduce", 0), four["bytes"].get("all_reduce", 0)
        assert b4 == b1, f"rank {rank}: all-reduce bytes with k = 4: {b4:,}, expected {b1:,}"
        for i, (g1, g4) in enumerate(zip(one["grads"], four["grads"])):
            torch.testing.assert_close(g4, g1, **F64_TOL, msg=lambda m, i=i: (
                f"rank {rank}, parameter {i}: the averaged gradient with k = 4 differs from "
                f"k = 1's — is the last micro-batch's backward outside no_sync?\n{m}"))


# =================================================================== 4.3 ZeRO-2

def zero2_gpt() -> GPT:
    """Ψ = 32,935 parameters: divisible by none of N = 2, 3, 4, so the last shard is padded.
    No biases: the attention key bias gets a gradient of pure rounding noise (softmax ignores
    it), which Adam's normalisation would turn into full-size steps that differ by order of sum."""
    model = tiny_gpt(vocab_size=64, n_head=5, n_embd=35, bias=False)
    psi = sum(p.numel() for p in model.parameters())
    assert psi % 2 and psi % 3 and psi % 4, psi
    return model


def run_zero2(world_size, steps=3, bucket_cap_bytes=16_384, **kwargs):
    model = zero2_gpt()
    data = SyntheticData(64, 32, 4, seed=1)
    batches = [[data.batch(s * world_size + r) for r in range(world_size)] for s in range(steps)]
    from labkit.lab4.zero2 import train_zero2

    return model, launch(train_zero2,
                         world_size, model, batches, lr=1e-3,
                         bucket_cap_bytes=bucket_cap_bytes, **kwargs)


@pytest.mark.exercise("4.3", points=1)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero2_matches_ddp_and_adam(world_size):
    """Check that 3 steps of ZeRO2Adam on N real gloo ranks give, on every rank, the parameters
    of DistributedDataParallel + torch.optim.Adam run on the same ranks and batches."""
    model, results = run_zero2(world_size)
    names = [n for n, _ in model.named_parameters()]
    for rank, res in enumerate(results):
        for name, got, want in zip(names, res["params"], res["ref_params"]):
            torch.testing.assert_close(got, want, **UPDATE_TOL, msg=lambda m, name=name, rank=rank: (
                f"rank {rank}, {name} after 3 steps on {world_size} ranks differs from DDP + "
                "Adam's — is every bucket reduce-scattered (the last, partial one too), each "
                f"piece added at its place in grad_shard, and the sum divided by N?\n{m}"))


@pytest.mark.exercise("4.3", points=2)
def test_zero2_holds_a_shard_and_one_bucket_of_gradients():
    """Check on 4 ranks, by reading the .grad tensors alive after every gradient-ready event:
    at most bucket_cap_bytes + the largest gradient's bytes of full gradients at any moment (the
    bucket that is filling and the gradient that fills it), beside grad_shard of exactly 4·S
    bytes; DDP (ZeRO-1's gradients) holds all 4Ψ."""
    cap = 16_384
    model, results = run_zero2(4, steps=1, bucket_cap_bytes=cap, reference=True)
    psi = sum(p.numel() for p in model.parameters())
    shard = 4 * math.ceil(psi / 4)
    for rank, res in enumerate(results):
        assert res["shard_bytes"] == shard, (
            f"rank {rank}: grad_shard holds {res['shard_bytes']:,} B, expected 4·S = {shard:,} "
            "(float32, S = ceil(Ψ/N) elements)")
        bound = cap + res["largest_grad_bytes"]
        assert res["peak_grad_bytes"] <= bound, (
            f"rank {rank}: up to {res['peak_grad_bytes']:,} B of full gradients were alive during "
            f"backward, expected ≤ bucket cap + largest gradient = {bound:,} (4Ψ = {4 * psi:,}): "
            "send a bucket as soon as it reaches the cap, and set its parameters' .grad to None")
        assert res["ref_peak_grad_bytes"] == 4 * psi, (
            f"rank {rank}: DDP held {res['ref_peak_grad_bytes']:,} B of gradients, 4Ψ = {4 * psi:,}")


@pytest.mark.exercise("4.3", points=1)
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero2_sends_what_data_parallelism_sends(world_size):
    """Check the collectives of one step (counted by labkit.comm_count): reduce-scatters of
    exactly 4Ψ bytes in all (each fp32 gradient element once), one all-gather of N·4S bytes,
    no all-reduce: the volume of DDP's all-reduce."""
    model, results = run_zero2(world_size, steps=2, reference=False)
    psi = sum(p.numel() for p in model.parameters())
    shard = math.ceil(psi / world_size)
    for rank, res in enumerate(results):
        for step, comm in enumerate(res["comm"]):
            sent, calls = comm["bytes_sent"], comm["calls"]
            where = f"rank {rank}, step {step}"
            assert "all_reduce" not in calls, (
                f"{where}: {calls['all_reduce']} all-reduce call(s): ZeRO-2 reduce-scatters")
            got = sent.get("reduce_scatter", 0) + sent.get("reduce_scatter_tensor", 0)
            assert got == 4 * psi, (
                f"{where}: reduce-scatters carried {got:,} B, expected 4Ψ = {4 * psi:,}: every "
                "fp32 gradient element once (is a bucket sent twice, or a gradient in two buckets?)")
            gathered = sent.get("all_gather_into_tensor", 0)
            assert gathered == 4 * world_size * shard, (
                f"{where}: all-gather of {gathered:,} B, expected N·4S = {4 * world_size * shard:,}")


def test_zero2_rejects_a_bad_bucket_cap():
    """Not graded (the check is given): bucket_cap_bytes must be an int > 0."""
    from labkit.lab4.zero2 import ZeRO2Adam

    params = list(torch.nn.Linear(3, 2).parameters())
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="bucket_cap_bytes"):
            ZeRO2Adam(params, bucket_cap_bytes=bad)


# =================================================================== 4.2 bucketed DDP

import functools  # noqa: E402


@functools.lru_cache(maxsize=None)  # one launch per world size for all 4.2 tests (not cached if it raises)
def run_bucketed(world_size, bucket_cap_bytes=16_384):
    from labkit.lab4.bucketed_ddp import compare_with_ddp

    model = zero2_gpt()
    data = SyntheticData(64, 32, 4, seed=1)
    return model, launch(compare_with_ddp, world_size, model,
                         [data.batch(r) for r in range(world_size)],
                         bucket_cap_bytes=bucket_cap_bytes)


def expected_buckets(grad_order_bytes, cap):
    """The formula: gradients join a bucket in ready order; a bucket closes when it reaches cap."""
    buckets, filling = [], 0
    for nbytes in grad_order_bytes:
        filling += nbytes
        if filling >= cap:
            buckets.append(filling)
            filling = 0
    return buckets + ([filling] if filling else [])


@pytest.mark.exercise("4.2", points=1)
def test_bucketed_ddp_starts_from_rank_0s_parameters():
    """Check that after wrapping, every rank's parameters equal those DistributedDataParallel
    leaves (rank 0's), although each rank's copy was perturbed first; exactly Ψ·4 B broadcast."""
    model, results = run_bucketed(2)
    psi = sum(p.numel() for p in model.parameters())
    for rank, res in enumerate(results):
        for i, (got, want) in enumerate(zip(res["params"], res["ref_params"])):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, i=i, rank=rank: (
                f"rank {rank}, parameter {i} after wrapping differs from DDP's — replicas must "
                f"start from rank 0's parameters (broadcast them in __init__)\n{m}"))
        assert res["init_bytes"].get("broadcast", 0) == 4 * psi, (
            f"rank {rank}: {res['init_bytes']} sent at construction, expected one broadcast "
            f"of every parameter, 4Ψ = {4 * psi:,} B")


@pytest.mark.exercise("4.2", points=2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_bucketed_ddp_gradients_equal_ddps(world_size):
    """Check that after backward and finish() every .grad equals DistributedDataParallel's
    (fp32; the same sums, divided before or after: a few ulps, atol 1e-7)."""
    model, results = run_bucketed(world_size)
    names = [n for n, _ in model.named_parameters()]
    for rank, res in enumerate(results):
        for name, got, want in zip(names, res["grads"], res["ref_grads"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m, name=name, rank=rank: (
                f"rank {rank}, {name}.grad differs from DDP's average over {world_size} ranks — "
                f"is every bucket sent (the last one in finish()), and divided by N?\n{m}"))


@pytest.mark.exercise("4.2", points=2)
def test_bucketed_ddp_sends_during_backward():
    """Check the recorded order of events (deterministic, unlike times): all-reduces of all
    buckets but the last start before backward ends, the first one before the last gradient is
    ready — communication overlaps the rest of backward."""
    _, results = run_bucketed(2)
    for rank, res in enumerate(results):
        kinds = [k for k, _, _ in res["events"]]
        end = kinds.index("backward_end")
        during = kinds[:end].count("all_reduce")
        assert during >= res["n_buckets"] - 1 and during >= 1, (
            f"rank {rank}: {during} of {res['n_buckets']} all-reduces started during backward "
            f"(events: {kinds}): start a bucket's all-reduce (async_op=True) in the hook that "
            "fills it, not in finish()")
        last_grad = max(i for i, k in enumerate(kinds) if k == "grad")
        assert kinds.index("all_reduce") < last_grad, (
            f"rank {rank}: the first all-reduce came after the last gradient: no overlap")


@pytest.mark.exercise("4.2", points=1)
def test_bucketed_ddp_bytes_and_calls_follow_the_cap():
    """Check the counted all-reduces of one backward: 4Ψ bytes in all, and as many calls, of the
    sizes, that the cap gives when gradients join buckets in the order they became ready."""
    cap = 16_384
    model, results = run_bucketed(2, cap)
    psi = sum(p.numel() for p in model.parameters())
    sizes = {n: 4 * p.numel() for n, p in model.named_parameters()}
    for rank, res in enumerate(results):
        assert res["bytes_sent"].get("all_reduce", 0) == 4 * psi, (
            f"rank {rank}: all-reduces carried {res['bytes_sent'].get('all_reduce', 0):,} B, "
            f"expected 4Ψ = {4 * psi:,}: each fp32 gradient exactly once")
        order = [sizes[d] for k, d, _ in res["events"] if k == "grad"]
        want = expected_buckets(order, cap)
        got = [int(d) for k, d, _ in res["events"] if k == "all_reduce"]
        assert got == want, (
            f"rank {rank}: bucket sizes sent {got}, expected {want} (cap {cap:,} B, gradients "
            "in the order they became ready): close a bucket as soon as it reaches the cap")


def test_bucketed_ddp_rejects_a_bad_bucket_cap():
    """Not graded (the check is given): bucket_cap_bytes must be an int > 0."""
    from labkit.lab4.bucketed_ddp import BucketedDDP

    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="bucket_cap_bytes"):
            BucketedDDP(torch.nn.Linear(2, 2), bucket_cap_bytes=bad)
