"""Graders of Lab 3, exercise 3.4 (labs/03_parameters.ipynb): tensor-parallel MLP and attention
over T = 2 and 4 real gloo ranks (``labkit.ranks.launch``).

References nobody in this course wrote: the single-device ``labkit.models.MLP`` and
``CausalSelfAttention`` run here in the test process (outputs, input gradient, parameter
gradients sliced as Megatron splits them); ``torch.distributed.tensor.parallel.
parallelize_module`` (ColwiseParallel / RowwiseParallel) on the same weights; ``count_comm`` for
the collectives, against the formula one all-reduce of B·S·C·4 bytes per direction.

Tolerance: fp32, the same products summed in another order (T partial sums added by the
all-reduce instead of one long dot product): a few ulps of values ≤ ~1 → atol 1e-5, rtol 1e-5.
Byte and call counts are exact.
"""
from __future__ import annotations

import functools

import pytest
import torch

from labkit.models import MLP, CausalSelfAttention, GPTConfig

TOL = dict(atol=1e-5, rtol=1e-5)
B, S, C, H = 2, 8, 32, 4


def setup(kind, attention="naive"):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=S, n_layer=1, n_head=H, n_embd=C, attention=attention)
    module = MLP(cfg) if kind == "mlp" else CausalSelfAttention(cfg)
    x, grad_out = torch.randn(B, S, C), torch.randn(B, S, C)
    xr = x.clone().requires_grad_()
    ref = module(xr)
    ref.backward(grad_out)
    return module, x, grad_out, ref.detach(), xr.grad


@functools.lru_cache(maxsize=None)
def run(kind, T, attention="naive", groups=1):
    """The student's TP block on T·groups ranks (``groups`` tensor-parallel subgroups of T)."""
    from labkit.ranks import launch
    from labkit.harness.lab3 import run_tp

    module, x, grad_out, ref, ref_xgrad = setup(kind, attention)
    return module, launch(run_tp, T * groups, kind, module, x, grad_out, groups=groups,
                          timeout=90), ref, ref_xgrad


def shard_of_grad(kind, name, full_grad, rank, T):
    """The slice of a full gradient that rank r's parameter ``name`` owns (Megatron's split)."""
    layer, what = name.split(".")
    if kind == "mlp" and layer == "c_fc":
        per = full_grad.shape[0] // T
        return full_grad[rank * per:(rank + 1) * per]
    if kind == "attn" and layer == "c_attn":
        per = C // T
        rows = torch.cat([torch.arange(rank * per, (rank + 1) * per) + k * C for k in range(3)])
        return full_grad[rows]
    if what == "bias":  # row-parallel bias: whole
        return full_grad
    per = full_grad.shape[1] // T
    return full_grad[:, rank * per:(rank + 1) * per]


CASES = [("mlp", 2), ("mlp", 4), ("attn", 2), ("attn", 4)]


def assert_output_and_input_gradient(kind, T, measured=""):
    """Every rank's output and ∂L/∂x of ``run(kind, T)`` equal the single-device block's (TOL).
    ``measured``: said in the message when a test that measured this run checks it (its bytes
    and collectives count only for the right result)."""
    _, results, ref, ref_xgrad = run(kind, T)
    for r, res in enumerate(results):
        torch.testing.assert_close(res["out"], ref, **TOL, msg=lambda m, r=r: (
            f"{kind} T={T} rank {r} output{measured}: {m} — are the partial sums all-reduced once, and the "
            "row-parallel bias added once (not T times)?"))
        torch.testing.assert_close(res["x_grad"], ref_xgrad, **TOL, msg=lambda m, r=r, g=res["x_grad"]: (
            f"{kind} T={T} rank {r} input gradient{measured}: {m}{_factor_hint(g, ref_xgrad, T)}"))


@pytest.mark.exercise("3.4", points=2)
@pytest.mark.parametrize("kind,T", CASES)
def test_output_and_input_gradient_equal_the_single_device_block(kind, T):
    """Check every rank's output and ∂L/∂x equal the single-device block's."""
    assert_output_and_input_gradient(kind, T)


@pytest.mark.exercise("3.4", points=2)
@pytest.mark.parametrize("kind,T", CASES)
def test_every_parameter_gradient_equals_its_slice_of_the_full_gradient(kind, T):
    """Check each rank's parameter gradients equal the matching slices of the full gradients."""
    module, results, _, _ = run(kind, T)
    full = dict(module.named_parameters())
    for r, res in enumerate(results):
        assert set(res["grads"]) == set(full), f"rank {r} parameters {sorted(res['grads'])}, expected {sorted(full)}"
        for name, g in res["grads"].items():
            want = shard_of_grad(kind, name, full[name].grad, r, T)
            assert g is not None and g.shape == want.shape, (
                f"{kind} T={T} rank {r} {name}: gradient shape {None if g is None else tuple(g.shape)}, "
                f"expected {tuple(want.shape)}")
            _check_grad_slice(kind, T, f"rank {r}", name, g, want, full[name].grad, r)


def _factor_hint(got, want, T):
    """A cause only when the values single it out: exactly T× too large (a gradient summed over
    the ranks once too often), exactly 1/T (f's all-reduce missing); else nothing."""
    if got is None:
        return " — x has no gradient"
    for k, cause in ((T, "exactly T× the single-device gradient: summed over the ranks once too "
                         "often (g's backward passes the gradient through unchanged)"),
                     (1 / T, "exactly 1/T of it: each rank's share is not summed (f's backward "
                             "all-reduces the gradient)")):
        if torch.allclose(got, want * k, **TOL):
            return f" — {cause}"
    return ""


def _check_grad_slice(kind, T, where, name, g, want, full_grad, tp_rank):
    """g must equal want; when not, say what the values single out: a constant factor (a
    collective once too often or missing), another rank's slice, or only where and how much."""
    if torch.allclose(g, want, **TOL):
        return
    ratio = (g.flatten() @ want.flatten() / (want.flatten() @ want.flatten())).item()
    if abs(ratio - round(ratio)) < 1e-3 and round(ratio) not in (0, 1) \
            and torch.allclose(g, want * round(ratio), **TOL):
        cause = (f"it is exactly {round(ratio)}× its slice of the full gradient: a gradient summed "
                 "over the ranks once too often (g's backward passes the gradient through unchanged)")
    else:
        other = [q for q in range(T) if q != tp_rank and torch.allclose(
            g, shard_of_grad(kind, name, full_grad, q, T), **TOL)]
        if other:
            cause = (f"it is exactly tensor-parallel rank {other[0]}'s slice: the rows/columns were picked "
                     "with another rank index than this rank's index in its group (dist.get_rank(group))")
        else:
            diff = (g - want).abs()
            idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
            cause = (f"{int((diff > TOL['atol'] + TOL['rtol'] * want.abs()).sum())} of {g.numel()} elements "
                     f"differ, the most at {idx}: {g[idx].item():.4g} vs {want[idx].item():.4g}")
    raise AssertionError(f"{kind} T={T} {where} {name}.grad differs from its slice of the full "
                         f"gradient: {cause}")


@pytest.mark.exercise("3.4", points=2)
@pytest.mark.parametrize("T", [2, 4])
def test_sdpa_attention_equals_the_single_device_block(T):
    """Check TPAttention with the config's attention="sdpa" (its other branch): output, ∂L/∂x and
    every parameter gradient equal the single-device SDPA block's (causal)."""
    module, results, ref, ref_xgrad = run("attn", T, "sdpa")
    full = dict(module.named_parameters())
    for r, res in enumerate(results):
        torch.testing.assert_close(res["out"], ref, **TOL, msg=lambda m, r=r: (
            f"sdpa attention T={T} rank {r} output vs the single-device block: {m}"))
        torch.testing.assert_close(res["x_grad"], ref_xgrad, **TOL, msg=lambda m, r=r: (
            f"sdpa attention T={T} rank {r} input gradient: {m}"))
        for name, g in res["grads"].items():
            _check_grad_slice("attn", T, f"rank {r} (sdpa)", name, g,
                              shard_of_grad("attn", name, full[name].grad, r, T), full[name].grad, r)


@pytest.mark.exercise("3.4", points=2)
@pytest.mark.parametrize("kind", ["mlp", "attn"])
def test_tensor_parallel_inside_subgroups_of_the_world(kind):
    """Check 4 ranks split into two tensor-parallel groups of T = 2 ({0, 1}, {2, 3}): on every
    rank the output, ∂L/∂x and the parameter gradients (the slice of its index in its group)
    equal the single-device block's, and each collective stays inside the group."""
    module, results, ref, ref_xgrad = run(kind, 2, "naive", 2)
    full = dict(module.named_parameters())
    for r, res in enumerate(results):
        where = f"world rank {r} (rank {res['tp_rank']} of its group of {res['tp_size']})"
        torch.testing.assert_close(res["out"], ref, **TOL, msg=lambda m, where=where: (
            f"{kind} {where} output vs the single-device block: {m}"))
        torch.testing.assert_close(res["x_grad"], ref_xgrad, **TOL, msg=lambda m, where=where: (
            f"{kind} {where} input gradient vs the single-device block: {m}"))
        for name, g in res["grads"].items():
            _check_grad_slice(kind, 2, where, name, g, shard_of_grad(kind, name, full[name].grad,
                                                                     res["tp_rank"], 2),
                              full[name].grad, res["tp_rank"])


@pytest.mark.exercise("3.4", points=2)
@pytest.mark.parametrize("kind,T", CASES)
def test_one_all_reduce_forward_and_one_backward_of_the_activation_bytes(kind, T):
    """Check count_comm: exactly one all-reduce in forward and one in backward, each of
    B·S·C·4 bytes (the (B, S, C) fp32 activation), and nothing else; and that the run whose
    collectives were counted gave the single-device block's output and ∂L/∂x."""
    _, results, _, _ = run(kind, T)
    want = {"calls": {"all_reduce": 1}, "bytes": {"all_reduce": B * S * C * 4}}
    for r, res in enumerate(results):
        for phase in ("forward", "backward"):
            assert res[phase] == want, (
                f"{kind} T={T} rank {r} {phase}: {res[phase]}, expected {want} (one all-reduce of "
                f"B·S·C·4 = {B * S * C * 4:,} B): is each of f and g applied exactly once per block?")
    assert_output_and_input_gradient(kind, T, " of the run whose collectives were counted")


@pytest.mark.exercise("3.4", points=1)
@pytest.mark.parametrize("kind,T", CASES)
def test_per_rank_parameter_bytes_are_one_over_t_of_the_split_weights(kind, T):
    """Check each rank's parameter bytes = (all split weights and column biases)/T + the
    row-parallel layer's whole bias, counted twice: as the parameters' own sizes, and as the bytes
    of the storages behind them (a view of the full weight or bias has the right size but keeps
    the full module's storage: the memory is not split, and the shard aliases the original);
    and that the measured shards computed the single-device block's output and ∂L/∂x."""
    module, results, _, _ = run(kind, T)
    p = dict(module.named_parameters())
    split = sum(t.numel() * 4 for n, t in p.items() if n != "c_proj.bias")
    want = split // T + p["c_proj.bias"].numel() * 4
    for r, res in enumerate(results):
        assert res["param_bytes"] == want, (
            f"{kind} T={T} rank {r}: {res['param_bytes']:,} B of parameters, expected split/T + the "
            f"row bias = {want:,}: does each rank keep 1/T of every split weight and the whole row bias?")
        assert not res["shares_storage"], (
            f"{kind} T={T} rank {r}: {res['shares_storage']} share(s) storage with the full module's "
            f"parameters: views, not copies (a shard must be its own tensor: .clone() it)")
        assert res["storage_bytes"] == want, (
            f"{kind} T={T} rank {r}: the storages behind the parameters hold {res['storage_bytes']:,} B, "
            f"expected {want:,}: is a shard a view (a slice or .detach()) of a larger tensor that keeps "
            f"all of it alive? Copy the slice")
    assert_output_and_input_gradient(kind, T, " of the run whose parameter bytes were measured")


@pytest.mark.exercise("3.4", points=1)
@pytest.mark.parametrize("T", [2, 4])
def test_tp_mlp_equals_parallelize_module(T):
    """Check the TP MLP's output equals PyTorch's parallelize_module (ColwiseParallel c_fc,
    RowwiseParallel c_proj) on the same weights, and that both do one forward all-reduce."""
    from labkit.ranks import launch
    from labkit.reference.lab3 import run_parallelize_module

    module, results, _, _ = run("mlp", T)
    _, x, _, _, _ = setup("mlp")
    theirs = launch(run_parallelize_module, T, module, x, timeout=90)
    for r, (mine, ref) in enumerate(zip(results, theirs)):
        torch.testing.assert_close(mine["out"], ref["out"], **TOL, msg=lambda m, r=r: (
            f"T={T} rank {r}: TPMLP output vs parallelize_module: {m}"))
        assert mine["forward"]["calls"] == ref["forward"]["calls"], (
            f"rank {r}: forward collectives {mine['forward']['calls']}, parallelize_module's "
            f"{ref['forward']['calls']}")


def _build(rank, world_size, kind, cfg):
    from labkit.lab3.tensor_parallel import TPAttention, TPMLP

    module = MLP(cfg) if kind == "mlp" else CausalSelfAttention(cfg)
    try:
        (TPMLP if kind == "mlp" else TPAttention)(module)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind,name", [("attn", "n_head"), ("mlp", "features")])
def test_t_that_does_not_divide_raises_value_error(kind, name):
    """T = 3 does not divide 4 heads nor the 4C = 128 hidden width: ValueError naming it."""
    from labkit.ranks import launch

    cfg = GPTConfig(vocab_size=64, block_size=S, n_layer=1, n_head=H, n_embd=C)
    messages = launch(_build, 3, kind, cfg)
    assert all(m is not None and name in m for m in messages), messages


@pytest.mark.parametrize("layer", ["ColumnParallelLinear", "RowParallelLinear"])
def test_a_layer_that_is_not_linear_raises_type_error(layer):
    """Given check: the parallel layers split an nn.Linear; anything else is a TypeError naming
    full, before the process group is touched (no launch needed)."""
    import labkit.lab3.tensor_parallel as tp

    with pytest.raises(TypeError, match="full"):
        getattr(tp, layer)(torch.nn.Conv1d(4, 4, 1))
