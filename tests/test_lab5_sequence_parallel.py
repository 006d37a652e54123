"""Graders of Lab 5, exercise 5.8 (labs/05_activations.ipynb): Megatron sequence parallelism
(Korthikanti et al. 2022, §4.2.2) over T = 2 and 4 real gloo ranks (``labkit.dist.launch``).

References nobody in this course wrote: the single-device ``x + MLP(LayerNorm(x))`` (a
``labkit.models.Block``'s second half) run here in the test process — outputs, input gradient,
parameter gradients sliced as Megatron splits the weights; ``saved_activation_bytes`` of the same
LayerNorm on the whole sequence; ``count_comm`` of one plain ``dist.all_reduce`` of the (B, S, C)
activation on the same ranks (the collective tensor parallelism would use); PyTorch's
``parallelize_module`` with ``SequenceParallel`` on the same weights.

Tolerance: fp32, the same products summed in another order (T partial sums added by the
reduce-scatter instead of one long dot product): a few ulps of values ≤ ~10 → atol 1e-5,
rtol 1e-5. Byte and call counts are exact.
"""
from __future__ import annotations

import functools

import pytest
import torch

from labkit.models import MLP, GPTConfig

TOL = dict(atol=1e-5, rtol=1e-5)
B, S, C = 2, 8, 32


def setup():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=S, n_layer=1, n_head=4, n_embd=C)
    ln, mlp = torch.nn.LayerNorm(C), MLP(cfg)
    with torch.no_grad():  # a LayerNorm that is not the identity, so its gradients matter
        ln.weight.normal_()
        ln.bias.normal_()
    x, grad_out = torch.randn(B, S, C), torch.randn(B, S, C)
    xr = x.clone().requires_grad_()
    ref = xr + mlp(ln(xr))
    ref.backward(grad_out)
    grads = {n: p.grad.clone() for n, p in [*ln.named_parameters("ln"), *mlp.named_parameters()]}
    return ln, mlp, x, grad_out, ref.detach(), xr.grad, grads


@functools.lru_cache(maxsize=None)
def run(T):
    from labkit.dist import launch
    from labkit.sequence_parallel import run_sp

    ln, mlp, x, grad_out, ref, ref_xgrad, grads = setup()
    return launch(run_sp, T, ln, mlp, x, grad_out, timeout=90), ref, ref_xgrad, grads


def rows(t, rank, T, dim=1):
    per = t.shape[dim] // T
    return t.narrow(dim, rank * per, per)


@pytest.mark.exercise("5.8", points=2)
@pytest.mark.parametrize("T", [2, 4])
def test_output_and_input_gradient_equal_the_single_device_block(T):
    """Each rank's output and ∂L/∂x are its slice of the single-device block's."""
    results, ref, ref_xgrad, _ = run(T)
    for r, res in enumerate(results):
        torch.testing.assert_close(res["out"], rows(ref, r, T), **TOL, msg=lambda m, r=r: (
            f"T={T} rank {r} output (its 1/T slice of the sequence): {m} — does g gather the slices "
            "in rank order, ḡ sum the partial products and keep rank r's slice, the bias added once?"))
        torch.testing.assert_close(res["x_grad"], rows(ref_xgrad, r, T), **TOL, msg=lambda m, r=r: (
            f"T={T} rank {r} input gradient: {m} — g's backward must SUM the ranks' gradients and keep "
            "rank r's slice; ḡ's backward must gather the whole sequence"))


@pytest.mark.exercise("5.8", points=2)
@pytest.mark.parametrize("T", [2, 4])
def test_parameter_gradients_equal_the_single_device_ones(T):
    """Weight shards get their slices of the full gradients; the LayerNorm's per-rank gradients
    (each from its slice of the sequence) sum to the full one."""
    results, _, _, grads = run(T)
    for name in ("ln.weight", "ln.bias"):
        got = sum(res["grads"][name] for res in results)
        torch.testing.assert_close(got, grads[name], **TOL, msg=lambda m, name=name: (
            f"T={T} {name}, summed over ranks: {m} — does the LayerNorm run on the rank's slice only "
            "(on the whole gathered sequence its gradient is counted T times)?"))
    for r, res in enumerate(results):
        for mine, full, dim in (("fc_weight", "c_fc.weight", 0), ("fc_bias", "c_fc.bias", 0),
                                ("proj_weight", "c_proj.weight", 1)):
            torch.testing.assert_close(res["grads"][mine], rows(grads[full], r, T, dim), **TOL,
                                       msg=lambda m, r=r, mine=mine: (
                f"T={T} rank {r} {mine}: {m} — the matmuls must see the whole gathered sequence"))
    got = sum(res["grads"]["proj_bias"] for res in results)
    torch.testing.assert_close(got, grads["c_proj.bias"], **TOL, msg=lambda m: (
        f"T={T} proj_bias, summed over ranks: {m} — is the bias added once, after ḡ, on the slice?"))


@pytest.mark.exercise("5.8", points=1)
@pytest.mark.parametrize("T", [2, 4])
def test_one_all_gather_and_one_reduce_scatter_each_way_no_all_reduce(T):
    """Forward: one all-gather (g) and one reduce-scatter (ḡ); backward: the same; no all-reduce."""
    results, _, _, _ = run(T)
    want = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
    for r, res in enumerate(results):
        for phase in ("forward", "backward"):
            got = res[phase]["calls"]
            assert got == want, (f"T={T} rank {r} {phase} collectives: expected {want}, got {got} — "
                                 "g and ḡ each make exactly one collective call each way (an all-reduce "
                                 "means a tensor-parallel f/g pair, not sequence parallelism)")


@pytest.mark.exercise("5.8", points=1)
@pytest.mark.parametrize("T", [2, 4])
def test_ring_bytes_equal_tensor_parallelism_all_reduce(T):
    """All-gather + reduce-scatter of the (B, S, C) activation move, each way, exactly the ring
    bytes of the one all-reduce tensor parallelism makes: 2(T−1)/T · B·S·C·4."""
    results, _, _, _ = run(T)
    for r, res in enumerate(results):
        want = res["all_reduce_ring_bytes"]
        for phase in ("forward", "backward"):
            got = sum(res[phase]["ring"].values())
            assert got == want, (f"T={T} rank {r} {phase} ring bytes: expected {want:,.0f} (one all-reduce of "
                                 f"(B, S, C) fp32), got {got:,.0f} — is the whole (B, S, C) activation gathered "
                                 "and reduce-scattered, in fp32, once each?")


@pytest.mark.exercise("5.8", points=2)
@pytest.mark.parametrize("T", [2, 4])
def test_norm_region_activations_are_one_T_th(T):
    """The bytes the LayerNorm saves for backward on each rank, and the input the dropout sees,
    are exactly 1/T of the single-device ones."""
    from labkit.measure import saved_activation_bytes

    ln, mlp, x, *_ = setup()
    full_ln = saved_activation_bytes(lambda: ln(x.clone().requires_grad_()))
    results, _, _, _ = run(T)
    for r, res in enumerate(results):
        assert res["ln_saved_bytes"] * T == full_ln, (
            f"T={T} rank {r} LayerNorm saved bytes: expected {full_ln:,} / T = {full_ln // T:,}, got "
            f"{res['ln_saved_bytes']:,} — does the LayerNorm run on the rank's slice, before g?")
        want = x.numel() * x.element_size() // T
        assert res["dropout_input_bytes"] == want, (
            f"T={T} rank {r} dropout input bytes: expected B·S·C·4 / T = {want:,}, got "
            f"{res['dropout_input_bytes']:,} — does dropout run on the slice, after ḡ?")


@pytest.mark.exercise("5.8", points=1)
def test_sequence_not_divisible_by_T_refused():
    """ḡ on a sequence that does not split over T ranks → ValueError naming x and T."""
    from labkit.dist import launch

    results = launch(_reduce_scatter_bad, 2, timeout=60)
    for r, msg in enumerate(results):
        assert msg is not None and "x" in msg and "T" in msg, (
            f"rank {r}: reduce_scatter_to_sp on a (2, 5, 4) x with T = 2 should raise ValueError naming "
            f"x and T before communicating, got {msg!r}")


def _reduce_scatter_bad(rank, world_size):
    from labkit.sequence_parallel import reduce_scatter_to_sp

    try:
        reduce_scatter_to_sp(torch.zeros(2, 5, 4), 1)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("T", [2, 4])
def test_parallelize_module_sequence_parallel_agrees(T):
    """Not graded (infrastructure): PyTorch's SequenceParallel on the same weights gives the
    same slices with the same collectives in forward."""
    from labkit.dist import launch
    from labkit.sequence_parallel import run_sequence_parallel_module

    ln, mlp, x, _, ref, _, _ = setup()
    for r, res in enumerate(launch(run_sequence_parallel_module, T, ln, mlp, x, timeout=90)):
        torch.testing.assert_close(res["out"], rows(ref, r, T), **TOL)
        assert res["forward"]["calls"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
