"""Graders of Lab 5, exercise 5.8 (labs/05_activations.ipynb): Megatron sequence parallelism
(Korthikanti et al. 2022, §4.2.2) over T = 2 and 4 real gloo ranks (``labkit.ranks.launch``).

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

from _given import as_given
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


def kinds(calls: dict) -> dict:
    """Collective calls by kind: ``all_gather`` into a list and ``all_gather_into_tensor`` are one
    all-gather each, as the contract's "one collective call" allows either."""
    out: dict = {}
    for op, n in calls.items():
        kind = next((k for k in ("all_gather", "reduce_scatter") if op.startswith(k)), op)
        out[kind] = out.get(kind, 0) + n
    return out


ONE_EACH = {"all_gather": 1, "reduce_scatter": 1}


@functools.lru_cache(maxsize=None)
def run(T):
    from labkit.ranks import launch
    from labkit.harness.lab5 import run_sp

    ln, mlp, x, grad_out, ref, ref_xgrad, grads = setup()
    return launch(run_sp, T, ln, mlp, x, grad_out, timeout=90), ref, ref_xgrad, grads


def rows(t, rank, T, dim=1):
    per = t.shape[dim] // T
    return t.narrow(dim, rank * per, per)


MEASURED = " of the run whose collectives or bytes were measured"


def assert_output_and_input_gradient(T, measured=""):
    """Each rank's output and ∂L/∂x of ``run(T)`` are its slice of the single-device block's
    (TOL). ``measured``: said in the message when a test that measured this run checks it (its
    bytes and collectives count only for the right result)."""
    results, ref, ref_xgrad, _ = run(T)
    for r, res in enumerate(results):
        torch.testing.assert_close(res["out"], rows(ref, r, T), **TOL, msg=lambda m, r=r: (
            f"T={T} rank {r} output{measured} (its 1/T slice of the sequence): {m} — does g gather the slices "
            "in rank order, ḡ sum the partial products and keep rank r's slice, the bias added once?"))
        torch.testing.assert_close(res["x_grad"], rows(ref_xgrad, r, T), **TOL, msg=lambda m, r=r: (
            f"T={T} rank {r} input gradient{measured}: {m} — g's backward must SUM the ranks' gradients and keep "
            "rank r's slice; ḡ's backward must gather the whole sequence"))


@pytest.mark.exercise("5.8", points=2)
@pytest.mark.parametrize("T", [2, 4])
def test_output_and_input_gradient_equal_the_single_device_block(T):
    """Each rank's output and ∂L/∂x are its slice of the single-device block's."""
    assert_output_and_input_gradient(T)


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
    """Forward: one all-gather (g) and one reduce-scatter (ḡ); backward: the same; no all-reduce;
    and the counted run's output and ∂L/∂x are the single-device block's."""
    results, _, _, _ = run(T)
    want = ONE_EACH
    for r, res in enumerate(results):
        for phase in ("forward", "backward"):
            got = kinds(res[phase]["calls"])
            assert got == want, (f"T={T} rank {r} {phase} collectives: expected {want}, got {got} — "
                                 "g and ḡ each make exactly one collective call each way (an all-reduce "
                                 "means a tensor-parallel f/g pair, not sequence parallelism)")
    assert_output_and_input_gradient(T, MEASURED)


@pytest.mark.exercise("5.8", points=1)
@pytest.mark.parametrize("T", [2, 4])
def test_ring_bytes_equal_tensor_parallelism_all_reduce(T):
    """All-gather + reduce-scatter of the (B, S, C) activation move, each way, exactly the ring
    bytes of the one all-reduce tensor parallelism makes: 2(T−1)/T · B·S·C·4; and the counted
    run's output and ∂L/∂x are the single-device block's."""
    results, _, _, _ = run(T)
    for r, res in enumerate(results):
        want = res["all_reduce_ring_bytes"]
        for phase in ("forward", "backward"):
            got = sum(res[phase]["ring"].values())
            assert got == want, (f"T={T} rank {r} {phase} ring bytes: expected {want:,.0f} (one all-reduce of "
                                 f"(B, S, C) fp32), got {got:,.0f} — is the whole (B, S, C) activation gathered "
                                 "and reduce-scattered, in fp32, once each?")
    assert_output_and_input_gradient(T, MEASURED)


@pytest.mark.exercise("5.8", points=2)
@pytest.mark.parametrize("T", [2, 4])
def test_norm_region_activations_are_one_T_th(T):
    """The bytes the LayerNorm saves for backward on each rank, and the input the dropout sees,
    are exactly 1/T of the single-device ones; and the measured run's output and ∂L/∂x are the
    single-device block's."""
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
    assert_output_and_input_gradient(T, MEASURED)


@pytest.mark.exercise("5.8", points=1)
def test_sequence_not_divisible_by_T_refused():
    """ḡ on a sequence that does not split over T ranks → ValueError naming x and T."""
    from labkit.ranks import launch

    results = launch(_reduce_scatter_bad, 2, timeout=60)
    for r, msg in enumerate(results):
        assert msg is not None and "x" in msg and "T" in msg, (
            f"rank {r}: reduce_scatter_to_sp on a (2, 5, 4) x with T = 2 should raise ValueError naming "
            f"x and T before communicating, got {msg!r}")


def _reduce_scatter_bad(rank, world_size):
    from labkit.lab5.sequence_parallel import reduce_scatter_to_sp

    try:
        reduce_scatter_to_sp(torch.zeros(2, 5, 4), 1)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("T", [2, 4])
def test_parallelize_module_sequence_parallel_agrees(T):
    """Not graded (infrastructure): PyTorch's SequenceParallel on the same weights gives the
    same slices with the same collectives in forward."""
    from labkit.ranks import launch
    from labkit.reference.lab5 import run_sequence_parallel_module

    ln, mlp, x, _, ref, _, _ = setup()
    for r, res in enumerate(launch(run_sequence_parallel_module, T, ln, mlp, x, timeout=90)):
        torch.testing.assert_close(res["out"], rows(ref, r, T), **TOL)
        assert res["forward"]["calls"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}


# ---------------------------------------------------------------- the attention sub-block, the whole block
#
# Reference: a ``labkit.models.Block`` run here on one device, its attention and MLP in eval mode
# (PyTorch's own causal softmax attention, no attention-probability dropout, which SPAttnBlock
# documents it does not apply), with the residual-branch dropout written out as the plain
# computation of the seed scheme ``slice_dropout`` documents: position s's keep-mask is
# ``torch.rand(B, C, generator=Generator().manual_seed(seed·2³² + s)) >= p``, kept values × 1/(1−p).
# Tolerance: as above (fp32, T partial sums in another order; the softmax of values ≤ ~10):
# atol = rtol = 1e-5. Byte and call counts are exact.

P, SEED = 0.25, 7


def keep_mask(seed, shape):
    B_, S_, C_ = shape
    return torch.stack([torch.rand(B_, C_, generator=torch.Generator().manual_seed(seed * 2**32 + s)) >= P
                        for s in range(S_)], dim=1)


def setup_block(seq_len=S):
    from labkit.models import Block

    torch.manual_seed(1)
    cfg = GPTConfig(vocab_size=64, block_size=seq_len, n_layer=1, n_head=4, n_embd=C, dropout=P)
    block = Block(cfg)
    with torch.no_grad():
        for ln in (block.ln_1, block.ln_2):
            ln.weight.normal_()
            ln.bias.normal_()
    x, grad_out = torch.randn(B, seq_len, C), torch.randn(B, seq_len, C)
    block.eval()  # the reference: PyTorch's modules without their own dropout; ours written out
    xa = x.clone().requires_grad_()
    attn_out = xa + block.attn(block.ln_1(xa)) * keep_mask(SEED, x.shape) / (1 - P)
    attn_out.backward(grad_out)
    named = [*block.ln_1.named_parameters("ln"), *block.attn.named_parameters("attn")]
    attn_grads = {n: p.grad.clone() for n, p in named}
    block.zero_grad()
    xb = x.clone().requires_grad_()
    y = xb + block.attn(block.ln_1(xb)) * keep_mask(SEED, x.shape) / (1 - P)
    y = y + block.mlp(block.ln_2(y)) * keep_mask(SEED + 1, x.shape) / (1 - P)
    y.backward(grad_out)
    block.zero_grad()
    block.train()
    return block, x, grad_out, (attn_out.detach(), xa.grad), (y.detach(), xb.grad), attn_grads


@functools.lru_cache(maxsize=None)
def run_attn(T):
    from labkit.ranks import launch
    from labkit.harness.lab5 import run_sp_attn

    block, x, grad_out, *refs = setup_block()
    return launch(run_sp_attn, T, block, x, grad_out, SEED, timeout=90), *refs


def assert_attention_output_and_input_gradient(T, measured=""):
    """Each rank's attention sub-block output and ∂L/∂x of ``run_attn(T)`` are its slice of the
    single-device sub-block's (TOL); ``measured`` as for assert_output_and_input_gradient."""
    results, (ref, ref_xgrad), _, _ = run_attn(T)
    for r, res in enumerate(results):
        torch.testing.assert_close(res["attn"]["out"], rows(ref, r, T), **TOL, msg=lambda m, r=r: (
            f"T={T} rank {r} attention sub-block output{measured} (rows r·S/T…): {m} — does every rank attend over the "
            "WHOLE gathered sequence with a causal mask, with its own heads' q, k, v rows, the bias added "
            "once after ḡ, and the dropout mask of ITS rows (start = r·S/T)?"))
        torch.testing.assert_close(res["attn"]["x_grad"], rows(ref_xgrad, r, T), **TOL, msg=lambda m, r=r: (
            f"T={T} rank {r} attention sub-block ∂L/∂x{measured}: {m} — g's backward must sum the ranks' partial "
            "gradients; the residual and the dropout mask must be this rank's rows"))


@pytest.mark.exercise("5.8", points=2)
@pytest.mark.parametrize("T", [2, 4])
def test_attention_sub_block_output_and_input_gradient_equal_the_single_device_one(T):
    """x + dropout(Attn(LN(x))), dropout p > 0: each rank's output and ∂L/∂x are its slice of the
    single-device sub-block's run with the one mask the seed scheme draws."""
    assert_attention_output_and_input_gradient(T)


@pytest.mark.exercise("5.8", points=2)
@pytest.mark.parametrize("T", [2, 4])
def test_attention_weight_shard_gradients_are_slices_of_the_full_ones(T):
    """q, k, v rows and c_proj columns of the rank's heads get their slices of the full gradients;
    the LayerNorm's and the proj bias's per-rank gradients sum to the full ones."""
    results, _, _, grads = run_attn(T)
    per = C // T
    for r, res in enumerate(results):
        g = res["attn"]["grads"]
        qkv = [slice(k * C + r * per, k * C + (r + 1) * per) for k in range(3)]
        for mine, full in (("qkv_weight", "attn.c_attn.weight"), ("qkv_bias", "attn.c_attn.bias")):
            want = torch.cat([grads[full][s] for s in qkv])
            torch.testing.assert_close(g[mine], want, **TOL, msg=lambda m, r=r, mine=mine: (
                f"T={T} rank {r} {mine} (its heads' q rows, then k rows, then v rows): {m} — are the heads "
                "split as q|k|v blocks of C rows each, and does attention see the whole sequence?"))
        torch.testing.assert_close(g["proj_weight"], rows(grads["attn.c_proj.weight"], r, T, 1), **TOL,
                                   msg=lambda m, r=r: f"T={T} rank {r} proj_weight: {m} — row-parallel c_proj "
                                   "must get its heads' columns of the whole sequence's product")
    for mine, full in (("ln.weight", "ln.weight"), ("ln.bias", "ln.bias"), ("proj_bias", "attn.c_proj.bias")):
        got = sum(res["attn"]["grads"][mine] for res in results)
        torch.testing.assert_close(got, grads[full], **TOL, msg=lambda m, mine=mine: (
            f"T={T} {mine}, summed over ranks: {m} — LayerNorm, bias and dropout run on the rank's slice "
            "only (on the gathered sequence their gradient counts T times)"))


@pytest.mark.exercise("5.8", points=1)
@pytest.mark.parametrize("T", [2, 4])
def test_attention_sub_block_one_all_gather_one_reduce_scatter_each_way(T):
    """Attention sub-block: forward one all-gather (g) + one reduce-scatter (ḡ); backward the same;
    no all-reduce; and the counted run's output and ∂L/∂x are the single-device sub-block's."""
    results, *_ = run_attn(T)
    want = ONE_EACH
    for r, res in enumerate(results):
        for phase in ("forward", "backward"):
            got = kinds(res["attn"][phase]["calls"])
            assert got == want, (f"T={T} rank {r} attention sub-block {phase} collectives: expected {want}, got "
                                 f"{got} — exactly g and ḡ, one call each way (an all-reduce is tensor "
                                 "parallelism's f/g, not sequence parallelism)")
    assert_attention_output_and_input_gradient(T, MEASURED)


@pytest.mark.exercise("5.8", points=1)
@pytest.mark.parametrize("T", [2, 4])
def test_attention_sub_block_ring_bytes_equal_the_formula(T):
    """Each way: all-gather + reduce-scatter of the (B, S, C) fp32 activation, (T−1)/T · B·S·C·4
    ring bytes each, 2(T−1)/T · B·S·C·4 in all (one all-reduce's); and the counted run's output
    and ∂L/∂x are the single-device sub-block's."""
    results, *_ = run_attn(T)
    want = 2 * (T - 1) / T * B * S * C * 4
    for r, res in enumerate(results):
        for phase in ("forward", "backward"):
            got = sum(res["attn"][phase]["ring"].values())
            assert got == want, (f"T={T} rank {r} attention sub-block {phase} ring bytes: expected 2(T−1)/T·B·S·C·4 "
                                 f"= {want:,.0f}, got {got:,.0f} — is the (B, S, C) activation gathered and "
                                 "reduce-scattered once each, in fp32 (not q, k, v separately)?")
    assert_attention_output_and_input_gradient(T, MEASURED)


@pytest.mark.exercise("5.8", points=1)
@pytest.mark.parametrize("T", [2, 4])
def test_attention_layernorm_saved_bytes_are_one_T_th(T):
    """The bytes ln_1 saves for backward on each rank are exactly 1/T of the single-device ones;
    and the measured run's output and ∂L/∂x are the single-device sub-block's."""
    from labkit.measure import saved_activation_bytes

    block, x, *_ = setup_block()
    full_ln = saved_activation_bytes(lambda: block.ln_1(x.clone().requires_grad_()))
    results, *_ = run_attn(T)
    for r, res in enumerate(results):
        assert res["attn"]["ln_saved_bytes"] * T == full_ln, (
            f"T={T} rank {r} attention LayerNorm saved bytes: expected {full_ln:,} / T = {full_ln // T:,}, got "
            f"{res['attn']['ln_saved_bytes']:,} — does ln_1 run on the rank's slice, before g?")
    assert_attention_output_and_input_gradient(T, MEASURED)


@pytest.mark.exercise("5.8", points=2)
@pytest.mark.parametrize("T", [2, 4])
def test_whole_block_with_dropout_equals_the_single_device_block(T):
    """A whole block (attention then MLP sub-block, dropout p > 0, seeds SEED and SEED + 1): each
    rank's output and ∂L/∂x are its slice of the single device's with the same masks."""
    results, _, (ref, ref_xgrad), _ = run_attn(T)
    for r, res in enumerate(results):
        torch.testing.assert_close(res["block"]["out"], rows(ref, r, T), **TOL, msg=lambda m, r=r: (
            f"T={T} rank {r} whole-block output: {m} — is each rank's dropout mask its slice of the single "
            "device's (slice_dropout: a generator per position, seed·2³² + s, rows from r·S/T)?"))
        torch.testing.assert_close(res["block"]["x_grad"], rows(ref_xgrad, r, T), **TOL, msg=lambda m, r=r: (
            f"T={T} rank {r} whole-block ∂L/∂x: {m} — the masks, scaled by 1/(1−p), must be the same in "
            "backward as in forward"))
        calls = kinds(res["block"]["forward"]["calls"])
        assert calls == {"all_gather": 2, "reduce_scatter": 2}, (
            f"T={T} rank {r} whole-block forward collectives: expected 2 all-gathers + 2 reduce-scatters "
            f"(g and ḡ per sub-block), got {calls}")


@pytest.mark.exercise("5.8", points=1)
def test_whole_block_runs_inside_a_subgroup():
    """Check a 4-rank world split into two groups of T = 2 ({0, 1} and {2, 3}, ``group=`` given):
    each rank's whole-block output (dropout p > 0) and ∂L/∂x are its group's slice of the single
    device's. Every rank and position follow the group's ranks, not the global ones; S = 6
    splits over the group's 2 ranks, not over the world's 4."""
    from labkit.ranks import launch
    from labkit.harness.lab5 import run_sp_attn

    block, x, grad_out, _, (ref, ref_xgrad), _ = setup_block(seq_len=6)
    results = launch(run_sp_attn, 4, block, x, grad_out, SEED, True, 2, timeout=90)
    for r, res in enumerate(results):
        g = r % 2
        torch.testing.assert_close(res["block"]["out"], rows(ref, g, 2), **TOL, msg=lambda m, r=r: (
            f"rank {r} (rank {r % 2} of its group of 2): whole-block output: {m}"))
        torch.testing.assert_close(res["block"]["x_grad"], rows(ref_xgrad, g, 2), **TOL,
                                   msg=lambda m, r=r: f"rank {r} (rank {r % 2} of its group): ∂L/∂x: {m}")


@pytest.mark.exercise("5.8", points=1)
def test_slice_dropout_masks_do_not_depend_on_the_split():
    """slice_dropout of rows [a, b) equals rows [a, b) of slice_dropout of the whole sequence,
    and follows the documented seed scheme; bad p / seed / start → ValueError naming them."""
    from labkit.lab5.sequence_parallel import slice_dropout
    slice_dropout = as_given(slice_dropout)

    h = torch.randn(B, S, C)
    want = h * keep_mask(SEED, h.shape) / (1 - P)
    for a, b in ((0, S), (0, S // 2), (S // 2, S), (3, 5)):
        torch.testing.assert_close(slice_dropout(h[:, a:b], P, SEED, a), want[:, a:b], rtol=0, atol=0,
                                   msg=lambda m, a=a, b=b: (f"slice_dropout rows [{a}, {b}): {m} — position s's "
                                                            "mask comes from its own generator seeded seed·2³² + s, "
                                                            "kept values × 1/(1−p)"))
    for kw, name in ((dict(p=1.0), "p"), (dict(p=-0.1), "p"), (dict(seed=-1), "seed"), (dict(start=-2), "start")):
        args = dict(p=P, seed=SEED, start=0) | kw
        with pytest.raises(ValueError, match=rf"^{name} must"):
            slice_dropout(h, **args)
    h16 = h.bfloat16()  # a 16-bit h keeps its dtype: the mask must not promote it
    got = slice_dropout(h16, P, SEED, 0)
    assert got.dtype == torch.bfloat16, f"slice_dropout of a bfloat16 h returned {got.dtype}"
    torch.testing.assert_close(got, h16 * keep_mask(SEED, h.shape) / (1 - P), rtol=0, atol=0,
                               msg=lambda m: f"slice_dropout of a bfloat16 h: {m}")
    for bad, error in ((h[0], ValueError), (h.long(), TypeError)):
        with pytest.raises(error, match="^h must"):
            slice_dropout(bad, P, SEED, 0)
    assert slice_dropout(h[:, :0], P, SEED, 0).shape == (B, 0, C), "an empty slice stays empty"


@pytest.mark.exercise("5.8", points=1)
def test_heads_not_divisible_by_T_refused():
    """SPAttnBlock with 4 heads on T = 3 ranks → ValueError naming attn.n_head and T."""
    from labkit.ranks import launch

    results = launch(_attn_bad, 3, timeout=60)
    for r, msg in enumerate(results):
        assert msg is not None and "n_head" in msg and "T" in msg, (
            f"rank {r}: SPAttnBlock with n_head = 4 on T = 3 should raise ValueError naming attn.n_head and T "
            f"before any communication, got {msg!r}")


def _attn_bad(rank, world_size):
    from labkit.models import CausalSelfAttention
    from labkit.lab5.sequence_parallel import SPAttnBlock

    cfg = GPTConfig(vocab_size=8, block_size=6, n_layer=1, n_head=4, n_embd=12)
    try:
        SPAttnBlock(torch.nn.LayerNorm(12), CausalSelfAttention(cfg))
    except ValueError as e:
        return str(e)
    return None
