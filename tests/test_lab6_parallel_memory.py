"""Graders of Lab 6, exercise 6.4 (labs/06_system.ipynb): the per-GPU memory of a configuration.

References nobody in this course wrote:
* the ZeRO paper's table (Rajbhandari et al. 2019, https://arxiv.org/abs/1910.02054, Fig. 1:
  16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N) and the seed's worked numbers (Ψ = 100B, 64 GPUs);
* Korthikanti et al. 2022 (https://arxiv.org/abs/2205.05198), Table 2 and §4–5: activations per
  layer sbh(34 + 5as/h), with TP sbh(10 + 24/t + 5as/(ht)), with TP + SP sbh(34 + 5as/h)/t,
  selective recomputation sbh·34/t, full recomputation 2sbh; the first 1F1B stage holds p
  micro-batches; under context parallelism a rank's s/C queries attend to all s keys (the score
  term a·(s/C)·s·b); fused attention (Dao et al. 2022, https://arxiv.org/abs/2205.14135) stores no
  score tensor; a Llama-style layer's tensors listed one by one (``_llama_layer_bytes``);
* ``labkit.memory_model`` (infrastructure, data parallelism only) where the two overlap;
* per-rank bytes measured on real gloo ranks with PyTorch's own implementations:
  ``ZeroRedundancyOptimizer`` (ZeRO-1), FSDP2 ``fully_shard`` (ZeRO-3) and
  ``parallelize_module`` (T = 2).

The formulas are exact in Ψ (multiples of powers of two): compared with a relative tolerance of
1e-12 (float rounding of 1e11-sized numbers only). Measured bytes: within 5% (FSDP2's padding
and ZeroRedundancyOptimizer's whole-tensor partition and step counters; stated in each test).
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from labkit import memory_model

PSI = 100e9  # the seed's 100B-parameter model
REL = 1e-12  # float rounding only: every formula is exact


def close(got, want):
    return math.isclose(got, want, rel_tol=REL)


GPT3 = dict(n_layer=96, hidden=12288, n_head=96, seq_len=2048)  # Korthikanti's 175B model


@pytest.mark.exercise("6.4", points=1)
@pytest.mark.parametrize("n", [1, 2, 8, 64, 1024])
def test_zero_table_exactly(n):
    """Mixed-precision Adam, D = N, T = P = C = 1: the ZeRO paper's total per stage."""
    from labkit.lab6.parallel_memory import static_bytes

    want = {0: 16 * PSI, 1: 4 * PSI + 12 * PSI / n, 2: 2 * PSI + 14 * PSI / n, 3: 16 * PSI / n}
    names = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}
    for stage in range(4):
        got = sum(static_bytes(PSI, world_size=n, dp=n, zero_stage=stage).values())
        assert close(got, want[stage]), (
            f"ZeRO-{stage} on N = {n}: {got:,.0f} B per GPU, expected {names[stage]} = {want[stage]:,.0f}: "
            f"does stage {stage} shard exactly {['nothing', 'the optimizer states', 'states and gradients', 'all three'][stage]} over N?")


@pytest.mark.exercise("6.4", points=1)
@pytest.mark.parametrize("stage,consumer,want,cause", [
    (1, "optimizer states", 18.75e9, "12Ψ/N: the fp32 master copy and both moments, sharded"),
    (2, "gradients", 3.125e9, "2Ψ/N: 16-bit gradients sharded over the 64 ranks"),
    (3, None, 25e9, "16Ψ/N: all static state sharded"),
], ids=["zero1-optimizer-states", "zero2-gradients", "zero3-total"])  # ASCII ids: pytest escapes others
def test_seed_worked_numbers(stage, consumer, want, cause):
    """The seed's numbers for Ψ = 100B on 64 GPUs."""
    from labkit.lab6.parallel_memory import static_bytes

    out = static_bytes(PSI, world_size=64, dp=64, zero_stage=stage)
    got = sum(out.values()) if consumer is None else out[consumer]
    what = "total static bytes" if consumer is None else consumer
    assert close(got, want), f"ZeRO-{stage}, 100B on 64 GPUs: {what} {got / 1e9:.4g} GB, expected {want / 1e9:.4g} GB = {cause}"


@pytest.mark.exercise("6.4", points=1)
@pytest.mark.parametrize("recipe", list(memory_model.RECIPES))
def test_agrees_with_memory_model_for_data_parallelism(recipe):
    """D = N only, no recomputation, one micro-batch: equal to labkit.memory_model."""
    from labkit.lab6.parallel_memory import per_gpu_bytes

    shape = dict(n_layer=4, hidden=256, n_head=8, seq_len=128)
    for optimizer, stage, n in itertools.product(memory_model.OPTIMIZERS, range(4), (1, 8)):
        want = memory_model.per_gpu_bytes(3e9, recipe, optimizer, stage, n, batch_size=2, **shape)
        got = per_gpu_bytes(3e9, world_size=n, dp=n, zero_stage=stage, recipe=recipe,
                            optimizer=optimizer, micro_batch=2, **shape)
        for c in memory_model.CONSUMERS:
            assert close(got[c], want[c]), (
                f"{c}, {recipe} {optimizer}, ZeRO-{stage}, N = {n}: {got[c]:,.0f} B, memory_model says "
                f"{want[c]:,.0f}: with T = P = C = 1 the two models must agree")


@pytest.mark.exercise("6.4", points=1)
def test_tensor_and_pipeline_parallelism_divide_the_static_state():
    """T = 8, P = 4, D = 16 (512 GPUs): each GPU holds Ψ/32 parameters; ZeRO shards them by D.
    Also for a Ψ that 32 does not divide (Ψ + 7): the model's share is the float Ψ/(T·P), not
    a floor (the contract: bytes as floats; REL allows float rounding only)."""
    from labkit.lab6.parallel_memory import static_bytes

    for psi in (PSI, PSI + 7):
        local = psi / 32
        for stage, want in [(0, 16 * local), (1, 4 * local + 12 * local / 16),
                            (3, 16 * local / 16)]:
            got = sum(static_bytes(psi, world_size=512, dp=16, tp=8, pp=4, zero_stage=stage).values())
            assert close(got, want), (f"ZeRO-{stage}, D×T×P = 16×8×4, Ψ = {psi:,.0f}: {got:,.0f} B, expected "
                                      f"{want:,.0f} (Ψ/(T·P) parameters per GPU, a float, ZeRO over D = 16): do "
                                      f"T and P split the parameters (no integer division), and does ZeRO shard "
                                      f"over the D ranks that hold the same weights (not all GPUs)?")


@pytest.mark.exercise("6.4", points=1)
@pytest.mark.parametrize("tp,sp,ckpt,coef,cause", [
    (1, False, "none", lambda s, h, a, t: 34 + 5 * a * s / h, "no parallelism: sbh(34 + 5as/h)"),
    (8, False, "none", lambda s, h, a, t: 10 + 24 / t + 5 * a * s / (h * t),
     "TP splits all but 10·sbh (LayerNorm and matmul inputs, two dropout masks)"),
    (8, True, "none", lambda s, h, a, t: (34 + 5 * a * s / h) / t, "TP + SP split everything by t"),
    (8, True, "selective", lambda s, h, a, t: 34 / t, "selective recomputation drops the a·s² terms"),
    (8, False, "selective", lambda s, h, a, t: 10 + 24 / t, "selective recomputation drops the a·s² terms"),
    (1, False, "full", lambda s, h, a, t: 2, "full recomputation keeps only each layer's 16-bit input"),
    (8, True, "full", lambda s, h, a, t: 2 / t, "full recomputation with SP keeps 2sbh/t"),
], ids=["t1", "t8", "t8-sp", "t8-sp-selective", "t8-selective", "t1-full", "t8-sp-full"])
def test_activations_match_korthikanti(tp, sp, ckpt, coef, cause):
    """GPT-3 175B, s = 2048, b = 1, 16-bit activations: Korthikanti et al.'s per-layer bytes."""
    from labkit.lab6.parallel_memory import activation_bytes_per_layer

    s, h, a, b = GPT3["seq_len"], GPT3["hidden"], GPT3["n_head"], 1
    want = s * b * h * coef(s, h, a, tp)
    got = activation_bytes_per_layer(s, b, h, a, tp=tp, sequence_parallel=sp, checkpointing=ckpt)
    assert close(got, want), (f"activations per layer, t = {tp}, SP {sp}, recompute {ckpt}: {got:,.0f} B, "
                              f"expected {want:,.0f}: {cause}")


@pytest.mark.exercise("6.4", points=1)
@pytest.mark.parametrize("pp,n_micro", [(1, 8), (4, 2), (4, 16), (8, 64)])
def test_first_pipeline_stage_holds_min_p_m_micro_batches(pp, n_micro):
    """1F1B: the first of P stages has L/P layers and min(P, m) micro-batches in flight."""
    from labkit.lab6.parallel_memory import activation_bytes_per_layer, per_gpu_bytes

    per_layer = activation_bytes_per_layer(2048, 1, 12288, 96, tp=8, sequence_parallel=True)
    want = GPT3["n_layer"] // pp * min(pp, n_micro) * per_layer
    got = per_gpu_bytes(175e9, world_size=8 * pp, tp=8, pp=pp, micro_batch=1, n_micro=n_micro,
                        sequence_parallel=True, **GPT3)["activations"]
    assert close(got, want), (f"activations of stage 0, P = {pp}, m = {n_micro}: {got:,.0f} B, expected "
                              f"L/P · min(P, m) · per layer = {want:,.0f}: does a stage hold L/P layers, and how many micro-batches does 1F1B keep in flight?")


@pytest.mark.exercise("6.4", points=1)
@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("ckpt", ["none", "selective", "full"])
def test_context_parallelism_splits_the_sequence(cp, ckpt):
    """C ranks, naive attention: each rank holds s/C tokens, and its s/C queries attend to all s
    keys, so every sbh term is the s/C layer's and the score term is a·(s/C)·s·b·5 (e = 2): the
    s² term divided by C, not C² (an (s/C)² block is what a *fused* ring holds at one moment,
    and it stores none of them for backward). Under every recomputation mode: selective keeps
    sbh·34 at s/C, full keeps the layer's input of its s/C tokens, 2·(s/C)·b·h."""
    from labkit.lab6.parallel_memory import activation_bytes_per_layer

    s, b, h, a = 8192, 1, 4096, 32
    local = s // cp
    want = {"none": local * b * h * 34 + 5 * a * local * s * b,  # Korthikanti's sbh(34 + 5as/h) at s/C queries
            "selective": local * b * h * 34, "full": 2 * local * b * h}[ckpt]
    got = activation_bytes_per_layer(s, b, h, a, cp=cp, checkpointing=ckpt)
    over_c2 = memory_model.activation_bytes_per_layer(local, b, h, a)
    whole = activation_bytes_per_layer(s, b, h, a, checkpointing=ckpt)
    hint = (": the score term divided by C², as if a rank's queries attended to its own s/C keys only"
            if close(got, over_c2) else ": the whole sequence's count (C not applied)" if close(got, whole)
            else ": is the sequence split by C, and do the s/C queries see all s keys?")
    assert close(got, want), (f"activations per layer with C = {cp}, s = {s}, naive attention, recompute "
                              f"{ckpt}: {got:,.0f} B, expected {want:,.0f} (s/C = {local} tokens){hint}")


@pytest.mark.exercise("6.4", points=1)
@pytest.mark.parametrize("tp,sp,cp", [(1, False, 1), (8, False, 1), (8, True, 4), (1, False, 8)])
def test_fused_attention_stores_no_scores(tp, sp, cp):
    """Fused attention (FlashAttention, and every context-parallel ring) keeps no a·s² tensor for
    backward: the layer is Korthikanti's without the score terms (selective recomputation's count,
    without recomputing anything), at s/C tokens."""
    from labkit.lab6.parallel_memory import activation_bytes_per_layer

    s, b, h, a = 8192, 2, 4096, 32
    sbh = s // cp * b * h
    want = sbh * 34 / tp if sp else sbh * (10 + 24 / tp)
    got = activation_bytes_per_layer(s, b, h, a, tp=tp, cp=cp, sequence_parallel=sp, attention="fused")
    naive = activation_bytes_per_layer(s, b, h, a, tp=tp, cp=cp, sequence_parallel=sp)
    hint = ": the scores are still counted" if close(got, naive) else ""
    assert close(got, want), (f"fused attention, T = {tp}, SP {sp}, C = {cp}: {got:,.0f} B per layer, "
                              f"expected {want:,.0f} (no s² term){hint}")


def _llama_layer_bytes(s, b, h, a, g, f, e, tp, sp):
    """A Llama-style layer's saved tensors, listed one by one (RMSNorm, GQA, SwiGLU, no dropout,
    no biases): the inputs of the two norms, of the QKV and first MLP matmuls (not split by TP);
    Q, K and V (K and V g/a of Q), the attention output, the gate, up and product tensors of the
    MLP, and the naive softmax output a·s²·b (split by TP)."""
    unsplit = [s * b * h] * 4
    split = [s * b * h, s * b * h * g // a, s * b * h * g // a, s * b * h, s * b * f, s * b * f,
             s * b * f, a * s * s * b]
    n_unsplit, n_split = e * sum(unsplit), e * sum(split)
    return (n_unsplit + n_split) / tp if sp else n_unsplit + n_split / tp


@pytest.mark.exercise("6.4", points=1)
@pytest.mark.parametrize("tp,sp", [(1, False), (8, False), (8, True)])
def test_llama_style_layer(tp, sp):
    """Llama-2/3-70B's shape (h 8192, 64 heads, 8 KV heads, SwiGLU of 28,672, no dropout) at
    s = 4096, 16-bit: every saved tensor listed by hand (``_llama_layer_bytes``)."""
    from labkit.lab6.parallel_memory import activation_bytes_per_layer

    s, b, h, a, g, f = 4096, 1, 8192, 64, 8, 28672
    want = _llama_layer_bytes(s, b, h, a, g, f, 2, tp, sp)
    got = activation_bytes_per_layer(s, b, h, a, tp=tp, sequence_parallel=sp, n_kv_head=g,
                                     ffn_hidden=f, gated_mlp=True, dropout=False)
    gpt = activation_bytes_per_layer(s, b, h, a, tp=tp, sequence_parallel=sp)
    hint = (": the GPT layer's count, the model's shape ignored" if close(got, gpt) else
            f": {got - want:+,.0f} B: K and V are g/a of Q's size, a gated MLP keeps three f-wide "
            "tensors, and without dropout there are no masks and no dropped copy of the scores")
    assert close(got, want), (f"Llama-style layer, T = {tp}, SP {sp}: {got:,.0f} B, expected {want:,.0f}{hint}")


@pytest.mark.exercise("6.4", points=1)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_shards_over_data_and_context_ranks(stage):
    """D = 4, C = 2, T = 2, P = 2 (32 GPUs): the 8 ranks of one D×C group hold the same weights,
    so ZeRO shards over D·C = 8 (Megatron-LM's distributed optimizer; torchtitan's FSDP over
    dp × cp)."""
    from labkit.lab6.parallel_memory import static_bytes

    local, n = PSI / 4, 8
    per = memory_model.bytes_per_parameter("mixed", "adam")
    sharded = {"optimizer states": stage >= 1, "gradients": stage >= 2, "parameters": stage >= 3}
    got = static_bytes(PSI, world_size=32, dp=4, tp=2, pp=2, cp=2, zero_stage=stage)
    for c, k in per.items():
        want = local * k / (n if sharded[c] else 1)
        by_d = local * k / (4 if sharded[c] else 1)
        hint = ": sharded over D alone; the C context ranks hold the same weights too" if close(got[c], by_d) else ""
        assert close(got[c], want), (f"ZeRO-{stage}, D×T×P×C = 4×2×2×2: {c} {got[c]:,.0f} B, expected "
                                     f"{want:,.0f} (ZeRO over D·C = 8){hint}")


@pytest.mark.parametrize("kwargs,word", [
    (dict(world_size=64, dp=8, tp=4), "world_size"),          # 32 ≠ 64
    (dict(world_size=32, dp=2, tp=8, pp=1, cp=2, n_head=12), "n_head"),  # 8 does not divide 12
    (dict(world_size=8, pp=8, n_layer=12), "n_layer"),         # 8 does not divide 12
    (dict(world_size=4, cp=4, seq_len=30), "seq_len"),         # 4 does not divide 30
    (dict(world_size=4, dp=4, zero_stage=4), "zero_stage"),
    (dict(recipe="fp8"), "recipe"),
    (dict(checkpointing="some"), "checkpointing"),
    (dict(world_size=0, dp=0), "world_size"),
    (dict(n_micro=0), "n_micro"),
    (dict(attention="flash"), "attention"),
    (dict(n_kv_head=5), "n_kv_head"),                          # 5 does not divide 12
    (dict(world_size=4, tp=4, n_kv_head=2), "n_kv_head"),      # 4 ranks cannot split 2 K/V heads
    (dict(ffn_hidden=0), "ffn_hidden"),
    (dict(gated_mlp=1), "gated_mlp"),
])
def test_bad_configurations_raise(kwargs, word):
    """Not graded (the checks are infrastructure, in the stub too): a layout whose product is not
    the world size, T not dividing the heads, P not dividing the layers, C not dividing the
    sequence, an unknown stage, recipe or recomputation mode."""
    from labkit.lab6.parallel_memory import per_gpu_bytes

    args = dict(world_size=1, n_layer=12, hidden=768, n_head=12, seq_len=1024, micro_batch=1)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=word):
        per_gpu_bytes(1e9, **args)


@pytest.mark.parametrize("n_params", [float("nan"), float("inf"), -1.0, 0, "1e9", True])
def test_static_bytes_refuses_a_bad_parameter_count(n_params):
    """Not graded (the check is in the stub too): NaN, ∞, ≤ 0 or a non-number is refused by name."""
    from labkit.lab6.parallel_memory import static_bytes

    with pytest.raises(ValueError, match="n_params"):
        static_bytes(n_params, world_size=1)


# ---------------------------------------------------------------- measured on real gloo ranks

N = 4


@pytest.fixture(scope="module")
def small_gpt():
    from labkit.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32))
    return model, sum(p.numel() for p in model.parameters())


@pytest.mark.exercise("6.4", points=1)
def test_zero1_matches_zero_redundancy_optimizer_on_gloo_ranks(small_gpt):
    """fp32 Adam, ZeRO-1 on 4 ranks: PyTorch's ZeroRedundancyOptimizer keeps 8Ψ/N per rank within 5%
    (it gives each rank whole tensors, so ranks differ by up to about one tensor, and it counts
    the step counters)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401 (slow import, once)

    from labkit.ranks import launch
    from labkit.models import SyntheticData
    from labkit.lab6.parallel_memory import static_bytes
    from labkit.harness.lab2 import train_data_parallel

    model, psi = small_gpt
    want = static_bytes(psi, world_size=N, dp=N, zero_stage=1, recipe="fp32")["optimizer states"]
    batches = [[SyntheticData(64, 32, 2, seed=r).batch(0) for r in range(N)]]
    got = [r["state_bytes"] for r in launch(train_data_parallel, N, model, batches,
                                            optimizer="zero_redundancy", timeout=120.0)]
    for rank, g in enumerate(got):
        assert abs(g - want) <= 0.05 * want, (
            f"rank {rank}: ZeroRedundancyOptimizer keeps {g:,} B of Adam state, your model predicts "
            f"{want:,.0f} B (8Ψ/N, Ψ = {psi:,}, N = {N}): does stage 1 shard the optimizer states over D?")


@pytest.mark.exercise("6.4", points=1)
def test_zero3_matches_fsdp2_fully_shard_on_gloo_ranks(small_gpt):
    """fp32 Adam, ZeRO-3 on 4 ranks: FSDP2's local shards of parameters, gradients and Adam's
    moments, per rank, within 5% of 4Ψ/N, 4Ψ/N, 8Ψ/N (FSDP2 pads dim 0 to a multiple of N)."""
    from labkit.ranks import launch
    from labkit.models import SyntheticData
    from labkit.lab6.parallel_memory import static_bytes
    from labkit.reference.lab6 import fsdp2_step

    model, psi = small_gpt
    want = static_bytes(psi, world_size=N, dp=N, zero_stage=3, recipe="fp32")
    got = launch(fsdp2_step, N, model, SyntheticData(64, 32, 2).batch(0), timeout=120.0)
    for rank, g in enumerate(got):
        for c, w in want.items():
            assert abs(g[c] - w) <= 0.05 * w, (
                f"rank {rank}: FSDP2 keeps {g[c]:,} B of {c}, your model predicts {w:,.0f} B "
                f"(Ψ = {psi:,}, N = {N}, fp32 Adam): does stage 3 shard {c} over D?")


@pytest.mark.exercise("6.4", points=1)
def test_tensor_parallelism_matches_parallelize_module_on_gloo_ranks(small_gpt):
    """fp32 Adam, T = 2 on 2 ranks: PyTorch's ``parallelize_module`` (c_fc column-wise, c_proj
    row-wise) keeps, per rank, the MLPs' parameters, gradients and Adam moments within 5% of
    your model for those parameters (the row-wise biases stay whole on every rank: +0.4%)."""
    from labkit.ranks import launch
    from labkit.lab6.parallel_memory import static_bytes
    from labkit.reference.lab6 import tensor_parallel_mlp_step

    model, _ = small_gpt
    got = launch(tensor_parallel_mlp_step, 2, model, torch.randn(2, 32, 32), timeout=120.0)
    want = static_bytes(got[0]["n_params"], world_size=2, tp=2, recipe="fp32")
    for rank, g in enumerate(got):
        for c, w in want.items():
            assert abs(g[c] - w) <= 0.05 * w, (
                f"rank {rank}: tensor-parallel MLPs keep {g[c]:,} B of {c}, your model predicts {w:,.0f} B "
                f"(Ψ_MLP = {got[0]['n_params']:,}, T = 2, fp32 Adam): does T split every weight matrix?")
