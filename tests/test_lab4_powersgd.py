"""Graders of Lab 4, exercise 4.5 (labs/04_gradients.ipynb): PowerSGD as a DDP communication hook.

The reference nobody in this course wrote: PyTorch's own
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook``, run next to the
student's hook on the same real gloo ranks (``labkit.ranks.launch``), both registered on a fresh
``DistributedDataParallel`` of the same model with one bucket, the same seed of the starting Q,
error feedback and warm start on, ``min_compression_rate=1`` (compress a matrix when its factors
are smaller than it, so vectors go uncompressed) and ``start_powerSGD_iter=2`` / ``start_iter=2``:
both all-reduce plainly in iterations 0 and 1, across DDP's bucket rebuild, and compress from
iteration 2 (the graders' "step 0"). Bytes and calls are counted
by ``labkit.comm_count`` (a dispatch mode that sees every c10d operator) and compared with the
formula (n + m)·r·4 B per compressed matrix plus 4 B per element of every vector.

Tolerance: the same fp32 algorithm; the two differ only in the order of the sums in norms and,
for r > 2, in PyTorch's QR against Gram–Schmidt (columns may flip sign in P and Q together, which
cancels in P Qᵀ). Measured: ≤ 2e-8 absolute on gradients of order 1e-2..1, so atol 1e-6,
rtol 1e-4; every planted bug (tools/mutants/lab4.py) is off by ≥ 1e-3.
"""
from __future__ import annotations

import functools

import pytest
import torch

from labkit.ranks import launch

TOL = dict(atol=1e-6, rtol=1e-4)
STEPS = 3  # compressed steps, after WARMUP plain ones
WARMUP = 2  # start_iter: the iterations before DDP's bucket rebuild is safely behind
RANKS = [2, 4]  # r = 2: Gram–Schmidt in PyTorch's hook; r = 4: its QR branch


def mlp(seed: int = 0) -> torch.nn.Sequential:
    """Two 48×48 matrices (the reference groups equal shapes), a 48×32, an 8×48, a 4×8 (compressed
    at r = 2, not at r = 4: (4 + 8)·4 ≥ 32), a 4×4 (never: (4 + 4)·2 = 16 is not < 16) and biases."""
    torch.manual_seed(seed)
    L = torch.nn.Linear
    return torch.nn.Sequential(L(32, 48), torch.nn.ReLU(), L(48, 48), torch.nn.ReLU(),
                               L(48, 48), torch.nn.ReLU(), L(48, 8), torch.nn.Tanh(), L(8, 4),
                               torch.nn.Tanh(), L(4, 4))


def conv_net(seed: int = 0) -> torch.nn.Sequential:
    """A conv weight 8×3×3×3 (PowerSGD views it as 8 × 27) before a 5×128 matrix."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(128, 5))


SETUPS = {2: (2, None), "2×2": (4, 2)}  # label -> (world size, group size): two groups of 2 in 4


@functools.lru_cache(maxsize=None)  # one launch per configuration (not cached if it raises)
def run(r: int, setup=2, model: str = "mlp"):
    from labkit.harness.lab4 import compare_with_torch

    world_size, group_size = SETUPS[setup]
    net = mlp() if model == "mlp" else conv_net()
    g = torch.Generator().manual_seed(1)
    shape_x, shape_y = ((32,), (4,)) if model == "mlp" else ((3, 6, 6), (5,))
    batches = [[(torch.randn(16, *shape_x, generator=g), torch.randn(16, *shape_y, generator=g))
                for _ in range(world_size)] for _ in range(WARMUP + STEPS)]
    results = launch(compare_with_torch, world_size, net, batches, r, group_size=group_size)
    for rank, res in enumerate(results):  # the plain iterations are the given code's: checked here
        for step in res[:WARMUP]:
            assert not step["compressed"] and all(torch.equal(step["ours"][n], step["torch"][n])
                                                  for n in step["torch"]), (
                f"rank {rank}: before start_iter the hook must be DDP's plain all-reduce")
    return net, [res[WARMUP:] for res in results]


def assert_step_equal(r, steps, cause, setup=2, model="mlp"):
    _, results = run(r, setup, model)
    for rank, res in enumerate(results):
        for step in steps:
            got, want = res[step]["ours"], res[step]["torch"]
            for name in want:
                torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, name=name, step=step, rank=rank: (
                    f"r = {r}, {model}, N = {setup}, rank {rank}, step {step}: {name}.grad differs "
                    f"from PyTorch's powerSGD_hook — {cause}\n{m}"))


MEASURED = ("the steps whose all-reduces were counted must return the compressed average: are "
            "the gradients replaced by P Qᵀ (and the vectors by their mean) after the all-reduces?")


@pytest.mark.exercise("4.5", points=1)
@pytest.mark.parametrize("r", RANKS)
def test_powersgd_first_step_equals_torchs_hook(r):
    """Check the first compressed step (no error kept yet, Q from ``initial_qs``) against
    PyTorch's hook: one power-iteration step, the averages of the vectors."""
    assert_step_equal(r, [0], "check the power-iteration step: orthonormalise Q, P = M Q, "
                      "all-reduce P, orthonormalise P, Q = Mᵀ P, all-reduce Q and divide by the "
                      "number of ranks, M̂ = P Qᵀ; vectors all-reduced and divided")


@pytest.mark.exercise("4.5", points=1)
def test_powersgd_in_subgroups_and_on_a_conv_weight():
    """Check all 3 steps against PyTorch's hook (r = 2) in a 4-rank world split into two groups
    of 2 (each DDP and hook over its group: sums and sizes are the group's), and on a network
    with a conv weight (viewed as out_channels × the rest)."""
    cause = ("in a subgroup, every all-reduce goes over state.process_group and the mean divides "
             "by its size")
    assert_step_equal(2, list(range(STEPS)), cause, setup="2×2")
    assert_step_equal(2, list(range(STEPS)), "a conv weight is an n×m matrix with n = its first "
                      "dimension and m = the product of the others", model="conv")


@pytest.mark.exercise("4.5", points=2)
@pytest.mark.parametrize("r", RANKS)
def test_powersgd_later_steps_equal_torchs_hook(r):
    """Check steps 2 and 3 against PyTorch's hook: error feedback (what the approximation left out
    is added to the next gradient) and the warm start (the next step starts from this Q)."""
    assert_step_equal(r, list(range(1, STEPS)), "the first step matched: is the error "
                      "(gradient + old error − M̂) kept and added next step, and the last "
                      "all-reduced Q (divided by the ranks) kept as the next starting Q?")
    # the kept error itself, over the whole bucket: the averaged vectors' error (own − mean)
    # cancels in the next mean, so only state.error shows whether it is kept there too
    _, results = run(r)
    for rank, res in enumerate(results):
        for step in range(STEPS):
            ours, theirs = res[step]["error"]["ours"], res[step]["error"]["torch"]
            assert set(ours) == set(theirs), (f"r = {r}, rank {rank}, step {step}: state.error has "
                                              f"buckets {sorted(ours)}, PyTorch's error_dict {sorted(theirs)}")
            for i in theirs:
                torch.testing.assert_close(ours[i], theirs[i], **TOL, msg=lambda m, i=i, step=step, rank=rank: (
                    f"r = {r}, rank {rank}, step {step}: state.error[{i}] differs from PyTorch's "
                    f"error_dict[{i}] — it is (gradients + old error) − what the hook returned, over "
                    f"the whole bucket, the uncompressed vectors included\n{m}"))


def expected_bytes(model, r):
    """The formula: (n + m)·min(n, m, r)·4 B per matrix whose factors are smaller, else 4 B per element."""
    total = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        k = min(n, m, r)
        total += 4 * ((n + m) * k if (n + m) * k < n * m else n * m)
    return total


@pytest.mark.exercise("4.5", points=1)
def test_powersgd_sends_the_factors():
    """Check the bytes all-reduced per step: (n + m)·r·4 per compressed matrix plus the vectors;
    and that the steps whose bytes were counted gave PyTorch's hook's gradients."""
    for r in RANKS:
        assert_step_equal(r, list(range(STEPS)), MEASURED)
        model, results = run(r)
        want = expected_bytes(model, r)
        full = 4 * sum(p.numel() for p in model.parameters())
        for rank, res in enumerate(results):
            for step, st in enumerate(res):
                assert st["bytes"] == want, (
                    f"r = {r}, rank {rank}, step {step}: {st['bytes']:,} B all-reduced, expected "
                    f"{want:,} B ((n + m)·r·4 per matrix, 4 B per vector element; uncompressed "
                    f"{full:,} B): are vectors compressed, a matrix sent whole, or a factor sent twice?")


@pytest.mark.exercise("4.5", points=1)
def test_powersgd_makes_three_all_reduces():
    """Check the number of all-reduces per step: one for the vectors, one for all P's, one for all
    Q's; and that the steps whose calls were counted gave PyTorch's hook's gradients."""
    assert_step_equal(RANKS[0], list(range(STEPS)), MEASURED)
    _, results = run(RANKS[0])
    for rank, res in enumerate(results):
        for step, st in enumerate(res):
            assert st["calls"] == 3, (
                f"rank {rank}, step {step}: {st['calls']} all-reduce calls, expected 3 (vectors, "
                f"all P's in one flat tensor, all Q's in one): is one matrix sent per call?")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_powersgd_state_rejects_a_bad_rank(bad):
    from labkit.lab4.powersgd import PowerSGDState

    with pytest.raises(ValueError, match="rank"):
        PowerSGDState(bad)


@pytest.mark.parametrize("a, eps, error, name", [
    ([[1.0, 0.0]], 0.0, TypeError, "a"), (torch.ones(3), 0.0, ValueError, "a"),
    (torch.ones(3, 2, dtype=torch.int64), 0.0, TypeError, "a"), (torch.ones(3, 2), -1.0, ValueError, "eps")])
def test_orthogonalize_rejects_bad_input(a, eps, error, name):
    """Not graded (given code): a 2-D floating tensor and eps >= 0, else an error naming them."""
    from labkit.lab4.powersgd import orthogonalize_

    with pytest.raises(error, match=name):
        orthogonalize_(a, eps)


def test_orthogonalize_gives_orthonormal_columns():
    from labkit.lab4.powersgd import orthogonalize_

    a = torch.randn(20, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q = orthogonalize_(a.clone())
    torch.testing.assert_close(q.T @ q, torch.eye(4, dtype=torch.float64))
    ref, _ = torch.linalg.qr(a)  # the same subspace: the projections agree
    torch.testing.assert_close(q @ q.T, ref @ ref.T)
