"""Graders of Lab 3, exercise 3.7 (labs/03_parameters.ipynb): ZeRO-3 over N = 2 and 3 real gloo
ranks (``labkit.ranks.launch``).

References nobody in this course wrote: unsharded ``torch.optim.Adam`` on the same model, with
the gradient of the mean of the N ranks' losses (data parallelism), run here in the test
process; PyTorch's FSDP2 (``fully_shard`` on each block and on the model, ``torch.optim.Adam``)
on the same model and data over gloo; ``count_comm`` for the collectives, compared with FSDP2's
and with the formula; the formula Σ ceil(Ψ_unit/N)·4 for the persistent bytes.

Tolerance for parameters: fp32; the same gradients summed in another order (the reduce-scatter
adds N partial gradients, the reference differentiates the mean loss) differ by ulps, and Adam's
normalization m/(√v+ε) keeps them relative, except for elements whose gradient is near ε =
1e-8, where an ulp of the gradient moves the update by up to ~1e-6 (measured 1.5e-6 at N = 3).
atol 1e-5 = 1% of one step of lr 1e-3 covers that and still catches any wrong step.
No biases: attention's key bias gets a gradient of pure rounding noise that Adam would amplify
to full steps in either implementation. Byte and call counts are exact.
"""
from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

from labkit.models import GPT, GPTConfig, SyntheticData

TOL = dict(atol=1e-5, rtol=1e-5)
STEPS, LR = 3, 1e-3


def setup(N):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=36, bias=False)
    model = GPT(cfg)  # n_embd 36: unit sizes that N = 2 and 3 do not all divide (padding)
    data = SyntheticData(64, 16, 2, seed=1)
    batches = [[data.batch(s * N + r) for r in range(N)] for s in range(STEPS)]
    return model, batches


@functools.lru_cache(maxsize=None)
def zero3(N):
    from labkit.ranks import launch
    from labkit.harness.lab3 import train_zero3

    model, batches = setup(N)
    return launch(train_zero3, N, model, batches, lr=LR, after_eval=True, timeout=120)


@functools.lru_cache(maxsize=None)
def _zero3_prefetch(N):
    from labkit.ranks import launch
    from labkit.harness.lab3 import train_zero3

    model, batches = setup(N)
    return launch(train_zero3, N, model, batches, lr=LR, prefetch=True, timeout=120)


def zero3_prefetch(N):
    """ZeRO3(prefetch=True)'s run; a rank's error becomes a failure that names the likely cause."""
    from labkit.ranks import RankError, RankTimeout

    try:
        return _zero3_prefetch(N)
    except NotImplementedError:
        raise
    except (RankError, RankTimeout) as exc:
        if "NotImplementedError" in str(exc):
            raise
        pytest.fail(f"training with prefetch=True failed on a rank: {str(exc).strip().splitlines()[-1][-300:]} — is a "
                    "prefetched unit's storage given back before its all-gather starts, and is "
                    "u.pending waited for and cleared when the unit's turn comes (so that the "
                    "gather before backward gathers again)?")


@functools.lru_cache(maxsize=None)
def fsdp2(N):
    from labkit.ranks import launch
    from labkit.reference.lab3 import train_fsdp2

    model, batches = setup(N)
    return launch(train_fsdp2, N, model, batches, lr=LR, timeout=120)


@functools.lru_cache(maxsize=None)
def unsharded(N):
    model, batches = setup(N)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    for step_batches in batches:
        loss = sum(ref(x, y) for x, y in step_batches) / N
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ref


def unit_numels(model):
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.h]
    return blocks + [sum(p.numel() for p in model.parameters()) - sum(blocks)]


def unit_param_counts(model):
    """Parameters per unit: each rank's reduce-scatter chunk carries one presence count per
    parameter after its S gradient elements (a parameter no rank used is then left alone)."""
    blocks = [len(list(b.parameters())) for b in model.h]
    return blocks + [len(list(model.parameters())) - sum(blocks)]


def assert_params_equal_unsharded(N, results, measured=""):
    """Every rank's full parameters after the steps equal unsharded torch.optim.Adam's (TOL).
    ``measured``: said in the message when a test that measured this run checks it (its bytes
    and collectives count only for the right result)."""
    ref = unsharded(N)
    for r, res in enumerate(results):
        for (name, want), got in zip(ref.named_parameters(), res["params"]):
            torch.testing.assert_close(got, want.detach(), **TOL, msg=lambda m, r=r, name=name: (
                f"N={N} rank {r} {name} after {STEPS} steps{measured} vs unsharded Adam: {m} — is the "
                "reduce-scattered gradient divided by N, and is the shard gathered again after the step?"))


MEASURED = " of the run whose bytes or collectives were measured"


@pytest.mark.exercise("3.7", points=2)
@pytest.mark.parametrize("N", [2, 3])
def test_parameters_after_adam_steps_equal_unsharded_adam(N):
    """Check every rank's full parameters after 3 steps equal unsharded torch.optim.Adam on the
    mean of the N ranks' losses."""
    assert_params_equal_unsharded(N, zero3(N))


@pytest.mark.exercise("3.7", points=2)
@pytest.mark.parametrize("N", [2, 3])
def test_gradient_slices_are_the_data_parallel_average(N):
    """Check each rank's gradient slice of every unit after the first backward equals its slice
    of the gradient of the mean of the N ranks' losses (the padded flat gradient, unsharded).
    Tolerance: fp32 gradients of magnitude ≤ ~1 summed in another order: atol 1e-6."""
    from labkit.flat_params import flatten_padded, partition, shard_range

    model, batches = setup(N)
    ref = copy.deepcopy(model)
    (sum(ref(x, y) for x, y in batches[0]) / N).backward()
    in_blocks = {id(p) for b in ref.h for p in b.parameters()}
    units = [list(b.parameters()) for b in ref.h]
    units.append([p for p in ref.parameters() if id(p) not in in_blocks])
    for r, res in enumerate(zero3(N)):
        for i, params in enumerate(units):
            S, pad = partition(sum(p.numel() for p in params), N)
            want = flatten_padded([p.grad for p in params], pad, torch.float32)[shard_range(r, S)]
            got = res["first_grads"][i]
            assert got is not None, f"N={N} rank {r} unit {i}: no gradient slice after backward"
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m, r=r, i=i: (
                f"N={N} rank {r} unit {i} gradient slice vs the data-parallel mean: {m} — is the "
                "reduce-scattered sum divided by N, and is this rank's slice the r-th?"))


@pytest.mark.exercise("3.7", points=2)
def test_parameters_and_losses_equal_fsdp2():
    """Check parameters and losses equal FSDP2 fully_shard's on the same model and data (N = 2)."""
    for r, (mine, theirs) in enumerate(zip(zero3(2), fsdp2(2))):
        assert mine["losses"] == pytest.approx(theirs["losses"], rel=1e-6), (
            f"rank {r} losses {mine['losses']}, FSDP2's {theirs['losses']}")
        model, _ = setup(2)
        for (name, _), got, want in zip(model.named_parameters(), mine["params"], theirs["params"]):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, r=r, name=name: (
                f"rank {r} {name} vs FSDP2: {m}"))


@pytest.mark.exercise("3.7", points=1)
@pytest.mark.parametrize("N", [2, 3])
def test_persistent_parameter_bytes_are_the_padded_shards(N):
    """Check each rank's persistent parameter bytes = Σ_units ceil(Ψ_unit/N)·4 exactly."""
    model, _ = setup(N)
    want = sum(math.ceil(n / N) * 4 for n in unit_numels(model))
    for r, res in enumerate(zero3(N)):
        assert res["shard_bytes"] == want, (
            f"N={N} rank {r}: {res['shard_bytes']:,} B of parameter shards, expected Σ ceil(Ψ_unit/N)·4 "
            f"= {want:,}: is each unit padded to N·S and sliced into S = ceil(Ψ_unit/N)?")
        assert res["shard_storage_bytes"] == want, (
            f"N={N} rank {r}: the shards count {res['shard_bytes']:,} B but keep {res['shard_storage_bytes']:,} B "
            "of storage alive: a shard that is a view of the flat copy keeps the whole unit (clone the slice)")
    assert_params_equal_unsharded(N, zero3(N), MEASURED)


@pytest.mark.exercise("3.7", points=2)
@pytest.mark.parametrize("N", [2, 3])
def test_peak_gathered_bytes_are_the_root_and_one_block(N):
    """Check the measured peak of gathered parameter buffers = the root unit + the largest block
    (N·S·4 each): blocks are freed after forward and after backward."""
    model, _ = setup(N)
    sizes = [math.ceil(n / N) * N * 4 for n in unit_numels(model)]
    want = sizes[-1] + max(sizes[:-1])
    for r, res in enumerate(zero3(N)):
        assert res["peak_live_bytes"] == want, (
            f"N={N} rank {r}: peak gathered parameters {res['peak_live_bytes']:,} B, expected root + "
            f"largest block = {want:,}: is each block's full buffer freed (storage resized to 0) "
            "after its forward and after its gradients are reduce-scattered?")
    assert_params_equal_unsharded(N, zero3(N), MEASURED)


@pytest.mark.exercise("3.7", points=2)
@pytest.mark.parametrize("N", [2, 3])
def test_collectives_per_step_two_all_gathers_and_one_reduce_scatter_per_block(N):
    """Check count_comm per step: all-gathers 2 per block + 1 for the root, one reduce-scatter
    per unit, with bytes Σ N·S·4 of each all-gather and Σ N·(S + P)·4 of each reduce-scatter
    (the gradients and one presence count per parameter: the formula), every step; and no
    all-gather of the root when a forward under ``torch.no_grad()`` left it gathered."""
    model, _ = setup(N)
    padded = [math.ceil(n / N) * N * 4 for n in unit_numels(model)]
    counts = [N * P * 4 for P in unit_param_counts(model)]
    blocks = len(padded) - 1
    want = {"calls": {"all_gather_into_tensor": 2 * blocks + 1, "reduce_scatter_tensor": blocks + 1},
            "bytes": {"all_gather_into_tensor": 2 * sum(padded[:-1]) + padded[-1],
                      "reduce_scatter_tensor": sum(padded) + sum(counts)}}
    for r, res in enumerate(zero3(N)):
        for step, got in enumerate(res["comm"]):
            assert got == want, (
                f"N={N} rank {r} step {step}: collectives {got}, expected {want}: is each block gathered "
                "before forward and again before backward (and not more), and its gradient "
                "reduce-scattered once?")
        # after an evaluation forward (no_grad) the root is still gathered (the given hooks free
        # it at the end of a backward): a training step then gathers the blocks only
        got = res["comm_after_eval"]["calls"].get("all_gather_into_tensor", 0)
        assert got == 2 * blocks, (
            f"N={N} rank {r}: a forward and backward right after a forward under torch.no_grad() "
            f"issued {got} all-gathers, expected {2 * blocks} (2 per block): the root was still "
            "gathered — is a unit that is already gathered gathered again?")
    assert_params_equal_unsharded(N, zero3(N), MEASURED)


@pytest.mark.exercise("3.7", points=1)
def test_collectives_equal_fsdp2s():
    """Check the collectives per step (calls, and bytes) equal what FSDP2 does on the same model,
    the reduce-scatters carrying N·P·4 bytes more: one presence count per parameter per rank
    (FSDP2 reduce-scatters the gradients that exist, so it needs every rank to use the same
    parameters; the counts let a parameter used on some ranks only be averaged as DDP does)."""
    model, _ = setup(2)
    extra = sum(2 * P * 4 for P in unit_param_counts(model))
    for r, (mine, theirs) in enumerate(zip(zero3(2), fsdp2(2))):
        for step, (got, want) in enumerate(zip(mine["comm"], theirs["comm"])):
            want = {"calls": want["calls"],
                    "bytes": {**want["bytes"], "reduce_scatter_tensor":
                              want["bytes"]["reduce_scatter_tensor"] + extra}}
            assert got == want, f"rank {r} step {step}: {got} vs FSDP2's (+ the counts) {want}"
    assert_params_equal_unsharded(2, zero3(2), MEASURED)


# ---------------------------------------------------------------- prefetch of the next unit

@pytest.mark.exercise("3.7", points=1)
def test_prefetch_trains_to_the_same_parameters_bit_for_bit():
    """Check ZeRO3(prefetch=True) gives exactly the parameters and losses of prefetch=False after
    3 steps (N = 2): prefetching changes when a unit is gathered, never what is computed."""
    for r, (plain, early) in enumerate(zip(zero3(2), zero3_prefetch(2))):
        assert early["losses"] == plain["losses"], (
            f"rank {r} losses with prefetch {early['losses']}, without {plain['losses']}: does the "
            "block wait for its prefetched all-gather before it computes?")
        model, _ = setup(2)
        for (name, _), got, want in zip(model.named_parameters(), early["params"], plain["params"]):
            assert torch.equal(got, want), (
                f"rank {r} {name}: with prefetch max |diff| {(got - want).abs().max():.3g} vs without: "
                "is a prefetched buffer used before its all-gather completed?")


@pytest.mark.exercise("3.7", points=1)
def test_prefetch_peak_is_the_root_plus_the_current_and_the_next_block():
    """Check the peak of gathered buffers with prefetch is at most the root + two largest blocks
    (the current one and the prefetched one) and more than without (N = 2)."""
    model, _ = setup(2)
    sizes = [math.ceil(n / 2) * 2 * 4 for n in unit_numels(model)]
    bound = sizes[-1] + 2 * max(sizes[:-1])
    for r, (plain, early) in enumerate(zip(zero3(2), zero3_prefetch(2))):
        got = early["peak_live_bytes"]
        assert got <= bound, (
            f"rank {r}: peak gathered with prefetch {got:,} B, expected at most root + 2 blocks = "
            f"{bound:,}: is a block freed after its forward and after its backward, and only the "
            "NEXT block prefetched?")
        assert got > plain["peak_live_bytes"], (
            f"rank {r}: peak gathered with prefetch {got:,} B, no more than without "
            f"({plain['peak_live_bytes']:,}): is the next block's all-gather started before this "
            "block's compute?")
    assert_params_equal_unsharded(2, zero3_prefetch(2), " with prefetch" + MEASURED)


@pytest.mark.exercise("3.7", points=1)
def test_prefetch_issues_the_next_all_gather_before_the_current_block_ends():
    """Check the first step's event order (N = 2): in forward, block i+1's all-gather is issued,
    asynchronously, before block i's forward ends; in backward, block i−1's before block i's
    backward ends."""
    for r, res in enumerate(zero3_prefetch(2)):
        ev = res["events"]
        blocks = 1 + max(e[1] for e in ev if e[0] == "forward_end")
        fwd_done = ev.index(("forward_end", blocks - 1))
        gathers = [(k, e) for k, e in enumerate(ev) if e[0] == "all_gather"]
        for i in range(blocks - 1):
            k, e = next((k, e) for k, e in gathers if e[1] == i + 1)
            assert k < ev.index(("forward_end", i)), (
                f"rank {r}: block {i + 1}'s forward all-gather issued after block {i}'s forward "
                f"ended (events {ev}): prefetch the next block before this one computes")
            assert e[2], (f"rank {r}: block {i + 1}'s prefetch all-gather is synchronous: it must "
                          f"be issued without waiting so that it overlaps block {i}'s compute")
        for i in range(blocks - 1, 0, -1):
            k, e = next((k, e) for k, e in gathers if e[1] == i - 1 and k > fwd_done)
            assert k < ev.index(("backward_end", i)), (
                f"rank {r}: block {i - 1}'s backward all-gather issued after block {i}'s backward "
                f"ended (events {ev}): prefetch the block that runs next in backward")
    assert_params_equal_unsharded(2, zero3_prefetch(2), " with prefetch, of the run whose events were traced")


@pytest.mark.exercise("3.7", points=1)
def test_prefetch_makes_the_same_collectives():
    """Check the collectives per step (calls and bytes) with prefetch equal those without: each
    block still gathered twice and reduce-scattered once (N = 2)."""
    for r, (plain, early) in enumerate(zip(zero3(2), zero3_prefetch(2))):
        assert early["comm"] == plain["comm"], (
            f"rank {r}: with prefetch {early['comm'][0]}, without {plain['comm'][0]}: a prefetched "
            "block must not be gathered again when its turn comes")
    assert_params_equal_unsharded(2, zero3_prefetch(2), " with prefetch" + MEASURED)


def test_without_prefetch_the_next_all_gather_waits_for_the_current_block():
    """The control: prefetch=False issues block i+1's all-gather only after block i's forward."""
    ev = zero3(2)[0]["events"]
    k = next(k for k, e in enumerate(ev) if e[0] == "all_gather" and e[1] == 1)
    assert k > ev.index(("forward_end", 0)), ev


def test_model_without_blocks_raises_value_error():
    from labkit.ranks import launch

    with pytest.raises(Exception, match="'h'"):
        launch(_build_bad, 1)


def test_prefetch_that_is_not_a_bool_raises_type_error():
    from labkit.ranks import launch

    with pytest.raises(Exception, match="prefetch must be True or False"):
        launch(_build_bad_prefetch, 1)


def _build_bad_prefetch(rank, world_size):
    from labkit.lab3.zero3 import ZeRO3

    model, _ = setup(1)
    ZeRO3(model, prefetch="yes")


def _build_bad(rank, world_size):
    from labkit.lab3.zero3 import ZeRO3

    ZeRO3(torch.nn.Linear(2, 2))


def _train(N, *, groups=1, backwards=1, freeze=()):
    """The student's ZeRO-3 and data-parallel Adam computed on one device
    (labkit.reference.lab3.train_adam) on the same model and batches."""
    from labkit.ranks import launch
    from labkit.harness.lab3 import train_zero3
    from labkit.reference.lab3 import train_adam

    model, _ = setup(N)
    for name, p in model.named_parameters():
        if name in freeze:
            p.requires_grad_(False)
    data = SyntheticData(64, 16, 2, seed=3)
    batches = [[[data.batch((s * N + r) * backwards + k) for k in range(backwards)] if backwards > 1
                else data.batch(s * N + r) for r in range(N)] for s in range(STEPS)]
    want = train_adam(model, batches, lr=LR, backwards=backwards)
    got = launch(train_zero3, N * groups, model, batches, lr=LR, groups=groups, backwards=backwards,
                 timeout=120)
    return model, want, got


def _compare(model, want, got, what):
    for r, res in enumerate(got):
        for (name, _), w, g in zip(model.named_parameters(), want, res["params"]):
            torch.testing.assert_close(g, w, **TOL, msg=lambda m, r=r, name=name: (
                f"{what}: world rank {r}, {name} after {STEPS} steps vs data-parallel Adam: {m}"))


@pytest.mark.exercise("3.7", points=2)
def test_two_backwards_per_step_accumulate_like_adam_on_their_sum():
    """Check N = 2 with two micro-batches backpropagated before each step(): the parameters equal
    Adam on the sum of both micro-batches' gradients (averaged over the ranks) — the second
    backward's gradient slice adds to the first's."""
    model, want, got = _train(2, backwards=2)
    _compare(model, want, got, "2 backwards per step")


@pytest.mark.exercise("3.7", points=2)
def test_zero3_inside_subgroups_of_the_world():
    """Check 4 ranks as two ZeRO-3 groups of N = 2 ({0, 1} and {2, 3}): every rank's parameters
    equal data-parallel Adam over its group's two ranks (shards picked by the rank in the group,
    gradients averaged over the group's size)."""
    model, want, got = _train(2, groups=2)
    _compare(model, want, got, "two groups of 2")


@pytest.mark.exercise("3.7", points=1)
def test_frozen_parameters_are_accepted_and_left_unchanged():
    """Check a model with frozen parameters (requires_grad False: wpe and block 0's attention
    projection), N = 2: the frozen ones are unchanged, the others equal Adam over the trainable
    parameters (FSDP2 and torch's optimizers accept frozen parameters too)."""
    freeze = ("wpe.weight", "h.0.attn.c_attn.weight")
    model, want, got = _train(2, freeze=freeze)
    start = dict(setup(2)[0].named_parameters())
    for r, res in enumerate(got):
        for (name, _), g in zip(model.named_parameters(), res["params"]):
            if name in freeze:
                assert torch.equal(g, start[name].detach()), f"rank {r}: frozen {name} changed"
    _compare(model, want, got, "frozen wpe and h.0.attn.c_attn.weight")


@pytest.mark.parametrize("kwargs", [dict(eps=-1e-8), dict(betas=(0.9, 1.5)), dict(betas=(0.9,)),
                                    dict(lr=float("nan"))])
def test_bad_adam_hyperparameters_raise_before_any_collective(kwargs):
    from labkit.lab3.zero3 import ZeRO3

    model, _ = setup(2)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ZeRO3(model, **kwargs)  # no process group exists: it must refuse before asking for one


def test_a_model_of_two_dtypes_raises_value_error_before_any_collective():
    """Given check: one dtype for the whole model (its units' buffers are flat; fp32 and 16-bit
    models keep fp32 shards, fp64 ones fp64: ``labkit.flat_params.master_dtype``). A model with
    bf16 and fp32 parameters is refused, naming the dtypes, before the process group is touched
    (no launch needed)."""
    from labkit.lab3.zero3 import ZeRO3
    from labkit.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    model.h[0].bfloat16()
    with pytest.raises(ValueError, match="bfloat16"):
        ZeRO3(model)


# ---------------------------------------------------------------- parameters not used everywhere

def _unused_worker(rank, world_size):
    """On 2 ranks, the toy of tests/_conformance_helpers.py (two blocks and a root):
    DDP(find_unused_parameters=True) + Adam and ZeRO3 on the plan that runs every unit on every
    rank or on none."""
    from _conformance_helpers import ddp_run, dp_plans, optimizer_run, plan_gradients

    G = plan_gradients(dp_plans(2)["units"], [0, 1])
    return optimizer_run("ZeRO3", G, rank, None), ddp_run(G, rank, None, adam=True)[1]


@pytest.mark.exercise("3.7", points=1)
def test_a_block_first_run_later_and_a_parameter_used_on_one_rank_match_ddp_and_adam():
    """Check, on 2 ranks: block h.1 runs on no rank at step 1 (its parameters first move at step
    2, with bias corrections of their own first step), h.1.weight is used on rank 0 only at step
    2, h.0.bias on no rank at step 3 (two backwards): every parameter after every step equals
    DistributedDataParallel(find_unused_parameters=True) + torch.optim.Adam's. Tolerance: fp64 at
    atol 1e-9 (Adam divides an exactly-zero-or-ulps gradient by ε)."""
    from _conformance_helpers import ADAM64, assert_runs_close
    from labkit.ranks import launch

    for rank, (got, want) in enumerate(launch(_unused_worker, 2, timeout=120)):
        assert_runs_close(got, want, f"rank {rank}: are the gradients packed with one presence "
                          "count per parameter, u.present kept, and a piece given no gradient "
                          "where no rank (or no forward) had one?", **ADAM64)


def _bf16_worker(rank, world_size):
    """On 2 ranks, ZeRO3 on the toy of tests/_conformance_helpers.py in bf16."""
    from _conformance_helpers import gradients, optimizer_run, plan_of

    G = gradients(plan_of(3, 2), torch.bfloat16)
    return optimizer_run("ZeRO3", G, rank, None, dtype=torch.bfloat16)


@pytest.mark.exercise("3.7", points=1)
def test_a_bf16_model_trains_through_fp32_shards():
    """Check a bf16 model on 2 ranks, 3 steps: every parameter stays bf16 and equals Adam on an
    fp32 master copy rounded to bf16 (the gradients averaged over the ranks): the shards and
    Adam's states are fp32, what is gathered is their bf16 rounding. Tolerance: one bf16 ulp
    (rtol 2⁻⁷, atol 2⁻⁸: the master rounded either way, and a step that cancels most of a
    parameter leaves the rounding of its operands)."""
    from _conformance_helpers import Toy, assert_histories_close, gradients, plan_of, reference_run
    from labkit.ranks import launch

    G = gradients(plan_of(3, 2), torch.bfloat16)
    want = reference_run(Toy(torch.bfloat16), lambda ps: torch.optim.Adam(ps, lr=0.05), G, 2,
                         master=True)
    for rank, got in enumerate(launch(_bf16_worker, 2, timeout=120)):
        for step in got:
            bad = [n for n, p in step.items() if p.dtype != torch.bfloat16]
            assert not bad, f"rank {rank}: {bad} are no longer bf16: gather the shards' bf16 rounding"
        assert_histories_close(got, want, f"rank {rank}, bf16 model: are the shards fp32 "
                               "(u.master_dtype), the gathered buffer bf16 (u.dtype), the "
                               "gradients reduce-scattered in fp32?", rtol=2 ** -7, atol=2 ** -8)
