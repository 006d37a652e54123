"""The course's cost model (``labkit.cost_model``), checked against the formulas it cites (not graded).

References: Korthikanti et al. 2022's activation count (``labkit.memory_model.
activation_bytes_per_layer`` and the paper's Table 2), Megatron-LM's interleaved in-flight factor
1 + (P − 1)/(P·v), the ZeRO paper's static bytes, ring-collective volumes, NVIDIA's wave
quantization, the roofline. Exact where the model is arithmetic (rel=1e-12: the same sums in
another order), never a wall-clock time.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from labkit import cost_model as cm
from labkit.cost_model import kernels, memory, step as st
from labkit.memory_model import activation_bytes_per_layer

GB = 10**9
SEED_100B = dict(n_params=100e9, n_layer=80, hidden=10240, n_head=80, seq_len=2048, name="100B")


def config(**kw):
    base = dict(recipe="mixed", optimizer="adam", zero_stage=1, offload=False, dp=1, tp=1, pp=1,
                cp=1, checkpointing="none", micro_batch=1, n_micro=1, attention="naive")
    return cm.Config(**{**base, **kw})


# ------------------------------------------------------------------------------------ memory

def test_activations_are_korthikantis_count():
    """GPT defaults, naive attention, no recomputation: sbh(34 + 5as/h) on one GPU (the chapter-1
    function), sbh(34 + 5as/h)/T with SP and sbh(10 + 24/T + 5as/(hT)) without (the paper's
    Table 2); full recomputation 2sbh (÷T with SP)."""
    m = cm.ModelSpec(1e9, 4, 1024, 16, 512)
    s, b, h, a = 512, 2, 1024, 16
    one = memory.activation_bytes_per_layer(m, config(micro_batch=b))
    assert one == activation_bytes_per_layer(s, b, h, a)
    for T in (2, 4, 8):
        sp = memory.activation_bytes_per_layer(m, config(micro_batch=b, tp=T, sequence_parallel=True))
        no = memory.activation_bytes_per_layer(m, config(micro_batch=b, tp=T))
        assert sp == pytest.approx(s * b * h * (34 + 5 * a * s / h) / T, rel=1e-12)
        assert no == pytest.approx(s * b * h * (10 + 24 / T + 5 * a * s / (h * T)), rel=1e-12)
        full = memory.activation_bytes_per_layer(m, config(micro_batch=b, tp=T, checkpointing="full",
                                                            sequence_parallel=True))
        assert full == pytest.approx(2 * s * b * h / T, rel=1e-12)


def test_interleaving_holds_megatrons_factor_more_in_flight():
    """With many micro-batches the first stage holds L·(1 + (P − 1)/(P·v)) layer-micro-batches
    (Megatron-LM's theoretical_memory_usage.py); plain 1F1B min(P, m)·L/P; no pipeline one."""
    m = cm.ModelSpec(1e9, 32, 1024, 16, 512)
    for P, v in [(2, 2), (4, 2), (4, 8), (8, 4)]:
        got = memory.layers_in_flight(m, config(pp=P, n_micro=64, virtual_stages=v))
        assert got == pytest.approx(32 * (1 + (P - 1) / (P * v)), rel=1e-12)
    assert memory.layers_in_flight(m, config(pp=4, n_micro=2)) == 16
    assert memory.layers_in_flight(m, config(pp=4, n_micro=64)) == 32
    assert memory.layers_in_flight(m, config(n_micro=64)) == 32


def test_static_state_by_zero_stage_and_no_reshard():
    """The ZeRO paper's 16Ψ split: parameters, gradients, states over the D·C ranks; ZeRO-3
    without re-sharding after forward keeps the 16-bit parameters whole, like ZeRO-2."""
    m = cm.ModelSpec(64e9, 8, 8192, 64, 1024)
    local = 64e9 / (2 * 4)
    for zero, reshard, want in [(0, True, (2, 2, 12)), (1, True, (2, 2, 12 / 8)), (2, True, (2, 2 / 8, 12 / 8)),
                                (3, True, (2 / 8, 2 / 8, 12 / 8)), (3, False, (2, 2 / 8, 12 / 8))]:
        got = memory.static_bytes(m, config(zero_stage=zero, dp=4, cp=2, tp=2, pp=4, attention="fused",
                                            reshard_after_forward=reshard))
        assert [got[c] for c in ("parameters", "gradients", "optimizer states")] == \
            pytest.approx([local * w for w in want], rel=1e-12), (zero, reshard)


def test_gqa_heads_replicated_when_tp_exceeds_them():
    """MQA on T = 4: every rank holds the one key/value head; GQA with T dividing the heads splits them."""
    mqa = cm.ModelSpec.llama(7e9, 32, 4096, 32, 1, 11008, 4096, "mqa")
    assert [cm.kv_heads_per_rank(mqa, t) for t in (1, 2, 4, 8)] == [1, 1, 1, 1]
    gqa = cm.ModelSpec.llama(7e9, 32, 4096, 32, 8, 11008, 4096, "gqa")
    assert [cm.kv_heads_per_rank(gqa, t) for t in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    odd = cm.ModelSpec(1e6, 2, 48, 12, 64, n_kv_head=4)  # groups of 3 queries, T = 6: 2 a rank
    assert cm.kv_heads_per_rank(odd, 6) == 2
    cfg = config(tp=4, attention="fused", sequence_parallel=True)
    head = 2 * 4096 * 4096 // 32  # one head's K or V of one layer, bf16
    diff = memory.activation_bytes_per_layer(mqa, cfg) - memory.activation_bytes_per_layer(
        dataclasses.replace(mqa, n_kv_head=4), cfg)
    assert diff == pytest.approx(2 * head * (1 - 1), abs=1e-6)  # 1 head a rank either way
    assert memory.activation_bytes_per_layer(gqa, cfg) - memory.activation_bytes_per_layer(mqa, cfg) == \
        pytest.approx(2 * head * (2 - 1), rel=1e-12)


def test_offload_moves_states_and_gradients_off_the_gpu():
    """ZeRO-Offload: no optimizer state on the GPU, one layer's 16-bit gradients (a bucket), the
    host holding 12 + 2 B per parameter of each of its 8 GPUs' shards, PCIe carrying 2 + 2 B per
    shard parameter and the CPU updating the node's shards at its rate."""
    model = cm.ModelSpec(**SEED_100B)
    cluster = cm.Cluster(64, host_adam_rate=2e9)
    on = config(dp=8, tp=8, checkpointing="full", n_micro=32)
    off = dataclasses.replace(on, offload=True)
    a, b = cm.memory_estimate(model, on), cm.memory_estimate(model, off)
    local = 100e9 / 8
    assert b["optimizer states"] == 0 and a["optimizer states"] == pytest.approx(12 * local / 8)
    assert a["gradients"] == pytest.approx(2 * local) and b["gradients"] == pytest.approx(2 * local / 80)
    shard = local / 8
    assert cm.host_bytes(model, 8, off) == pytest.approx(8 * 14 * shard)
    assert cm.host_bytes(model, 8, on) == 0
    t = cm.step_time(model, cluster, off, 256)
    assert t.comm["offload"] == pytest.approx(4 * shard / cluster.pcie_bw)
    assert t.comm["cpu adam"] == pytest.approx(8 * shard / 2e9)
    with pytest.raises(ValueError, match="host_adam_rate"):
        cm.step_time(model, cm.Cluster(64), off, 256)


# ------------------------------------------------------------------------------------ kernels

def test_wave_quantization_counts_tiles():
    """NVIDIA's example shape: 1 full wave of 108 tiles is 100%, 109 tiles need 2 waves (50.5%)."""
    T = kernels.TILE
    assert kernels.wave_efficiency(108 * T, T, 108) == 1.0
    assert kernels.wave_efficiency(109 * T, T, 108) == pytest.approx(109 / 216, rel=1e-12)
    assert kernels.wave_efficiency(T + 1, T, 108) == pytest.approx(2 / 108, rel=1e-12)  # tile quantization
    assert kernels.wave_efficiency(T, T, 108, batch=216) == 1.0


def test_gemm_roofline():
    """A fat GEMM runs at the matmul ceiling; a thin one (a few rows) at the HBM bandwidth."""
    c = cm.Cluster(1)
    fat = kernels.gemm_seconds(c, 12 * 128, 11 * 128, 8192, 2)  # exactly one wave of 132 tiles
    assert fat == pytest.approx(2 * 12 * 128 * 11 * 128 * 8192 / c.matmul_flops, rel=1e-12)
    thin = kernels.gemm_seconds(c, 1, 8192, 8192, 2, batch=1)
    assert thin == pytest.approx(2 * (8192 + 8192 * 8192 + 8192) / c.hbm_bw, rel=1e-12)


def test_the_gemms_are_the_models_weights(monkeypatch):
    """The forward GEMMs of one micro-batch do 2·tokens·(block weights / L)/T FLOPs per layer
    (``ModelSpec.block_weights``, written independently) plus the output layer's, and backward twice that."""
    flops = []
    real = kernels.gemm_seconds

    def counting(cluster, rows, cols, inner, e, batch=1, rate=None):
        flops.append(2 * batch * round(rows) * round(cols) * round(inner))
        return real(cluster, rows, cols, inner, e, batch, rate)

    monkeypatch.setattr(kernels, "gemm_seconds", counting)
    kernels._micro_batch_time.cache_clear()
    m = cm.ModelSpec.llama(7e9, 32, 4096, 32, 8, 11008, 4096, "7B", vocab_size=32000)
    kernels.micro_batch_time(m, cm.Cluster(8), config(tp=4, attention="fused", micro_batch=2,
                                                      sequence_parallel=True))
    tokens = 2 * 4096
    per_layer = 2 * tokens * m.block_weights / 32 / 4
    out = 2 * tokens * 32000 * 4096 / 4
    assert sum(flops[0:12:3]) == pytest.approx(per_layer, rel=1e-12)
    assert sum(flops[1:12:3]) + sum(flops[2:12:3]) == pytest.approx(2 * per_layer, rel=1e-12)
    assert flops[12] == pytest.approx(out, rel=1e-12)


def test_thin_shapes_are_slower_per_flop():
    """Context parallelism at 2k tokens and micro-batch 1 give smaller GEMMs and shorter
    attention blocks: the same work per GPU takes longer than one unsplit sequence."""
    m = cm.ModelSpec(100e9, 80, 10240, 80, 2048)
    c = cm.Cluster(64)
    whole = kernels.micro_batch_time(m, c, config(tp=8, attention="fused", sequence_parallel=True, pp=8))
    split = kernels.micro_batch_time(m, c, config(tp=8, cp=8, attention="fused", sequence_parallel=True, pp=8))
    assert 8 * split.total > 1.05 * whole.total


# ------------------------------------------------------------------------------------ time

def test_bubble_slots():
    """1F1B idles P − 1 slots; interleaved (P − 1)/v once m ≥ P, plus P − m rounds' wait below."""
    assert st.idle_slots(1, 1, 8) == 0
    assert st.idle_slots(8, 1, 2) == 7
    assert st.idle_slots(8, 4, 32) == pytest.approx(7 / 4)
    assert st.idle_slots(8, 4, 2) == pytest.approx(6 + 7 / 4)
    m = cm.ModelSpec(**SEED_100B)
    cfg = config(dp=2, tp=8, pp=4, n_micro=128, checkpointing="full")
    t = cm.step_time(m, cm.Cluster(64), cfg, 256)
    mb = kernels.micro_batch_time(m, cm.Cluster(64), cfg)
    assert t.compute == pytest.approx(128 * mb.total, rel=1e-12)
    assert t.bubble == pytest.approx(3 * (mb.total + t.comm["tp"] / 128), rel=1e-12)


def test_tensor_parallel_traffic():
    """TP inside a node: 4 all-reduces per layer and micro-batch (6 with full recomputation),
    2(T − 1)/T of the layer's activations each over NVLink, plus 2(T − 1) hops each."""
    m, c = cm.ModelSpec(**SEED_100B), cm.Cluster(64)
    for ckpt, n in (("none", 4), ("full", 6)):
        t = cm.step_time(m, c, config(dp=2, tp=8, pp=4, n_micro=128, checkpointing=ckpt), 256)
        act = 2048 * 10240 * 2
        want = 20 * 128 * n * (2 * 7 / 8 * act / c.intra_bw + 2 * 7 * c.intra_latency)
        assert t.comm["tp"] == pytest.approx(want, rel=1e-12)


def test_data_parallel_traffic_overlaps_its_window():
    """ZeRO-0's all-reduce of 2(n − 1)/n of the 16-bit gradients is all exposed with no overlap,
    and with overlap hides behind at most ``overlap_share`` of the last micro-batch's backward."""
    m = cm.ModelSpec(1e9, 8, 2048, 16, 2048)
    cfg = config(zero_stage=0, dp=16, n_micro=4)
    bare = cm.Cluster(16, overlap_share=0.0)
    t = cm.step_time(m, bare, cfg, 64)
    want = 2 * (15 / 16 * 1e9 * 2 / bare.inter_bw + 8 * 15 * bare.inter_latency)  # 2(n − 1) hops a layer
    assert t.comm["dp"] == pytest.approx(want, rel=1e-12) and t.hidden["dp"] == 0
    mb = kernels.micro_batch_time(m, bare, cfg)
    hid = cm.step_time(m, cm.Cluster(16), cfg, 64)
    assert hid.comm["dp"] == pytest.approx(max(0.0, want - 0.8 * (mb.backward + mb.recompute)), rel=1e-12)
    assert hid.comm["dp"] + hid.hidden["dp"] == pytest.approx(want, rel=1e-12)


def test_fsdp_without_resharding_gathers_once_per_micro_batch():
    """Across nodes with nothing to hide behind, ZeRO-3 gathers twice and reduce-scatters once per
    micro-batch; without re-sharding after forward it gathers once."""
    m = cm.ModelSpec(4e9, 8, 4096, 32, 2048)
    c = cm.Cluster(8, gpus_per_node=1, overlap_share=0.0)
    base = config(zero_stage=3, dp=8, n_micro=4, attention="fused")
    one = 7 / 8 * 4e9 * 2 / c.inter_bw + 8 * 7 * c.inter_latency
    assert cm.step_time(m, c, base, 32).comm["dp"] == pytest.approx(4 * 3 * one, rel=1e-12)
    no = dataclasses.replace(base, reshard_after_forward=False)
    assert cm.step_time(m, c, no, 32).comm["dp"] == pytest.approx(4 * 2 * one, rel=1e-12)


def test_small_messages_pay_latency():
    """A tiny model whose collectives carry a few bytes: its step time is the rings' hops."""
    tiny = cm.ModelSpec(1e4, 1, 16, 1, 8, "tiny")
    cluster = cm.Cluster(8, overlap_share=0.0)
    ring = config(zero_stage=2, cp=8, attention="fused")
    t = cm.step_time(tiny, cluster, ring, 1)
    assert t.comm["cp"] >= 2 * 7 * cluster.intra_latency, t.comm  # C − 1 steps forward and backward
    data = config(zero_stage=0, dp=8, attention="fused")
    assert cm.step_time(tiny, cluster, data, 8).comm["dp"] >= 2 * 7 * cluster.intra_latency


# ------------------------------------------------------------------------------------ ranking

def test_sensitivity_skips_only_configurations_that_win_nowhere():
    """Re-ranking every fitting configuration (no skipping) on the 81 scaled clusters gives the
    same winners and counts as ``sensitivity``."""
    from labkit.lab7 import planner
    model = cm.ModelSpec(2e9, 8, 2048, 16, 1024, "2B")
    cluster = cm.Cluster(16, host_adam_rate=1e9, memory_bytes=24 * GB)
    try:
        result = planner.plan(model, cluster, 32, offload=(False, True), zero_stages=(1, 3),
                              interleave=(False,), reshard_after_forward=(True,), n_runners_up=10**9)
    except NotImplementedError:
        pytest.skip("exercise 7.1 not written")
    ranked = [result.best] + result.runners_up
    sens = cm.sensitivity(model, cluster, 32, ranked)
    wins = {}
    for combo in itertools.product(cm.SENSITIVITY, repeat=len(cm.KNOBS)):
        box = cm.scaled(cluster, **dict(zip(cm.KNOBS, combo)))
        best = min((cm.step_time(model, box, e.config, 32).total, e.memory["total"], e.config) for e in ranked)
        wins[best[2]] = wins.get(best[2], 0) + 1
    assert sens["winners"] == dict(sorted(wins.items(), key=lambda kv: -kv[1]))
    assert sum(sens["winners"].values()) == 81


def test_why_slower_names_the_term_that_grew():
    model, cluster = cm.ModelSpec(**SEED_100B), cm.Cluster(64)
    fast = cm.evaluate(model, cluster, config(tp=8, pp=8, n_micro=256, checkpointing="selective"), 256)
    slow = cm.evaluate(model, cluster, config(tp=8, pp=8, n_micro=256, checkpointing="full"), 256)
    why = cm.why_slower(fast, slow)
    assert slow.time.total > fast.time.total and why.split(": ")[1].startswith("compute +"), why


def test_model_spec_counts_the_lab_model():
    from labkit.models import GPT, lab_config
    cfg = lab_config("cpu")
    spec = cm.ModelSpec.from_gpt_config(cfg)
    assert spec.n_params == sum(p.numel() for p in GPT(cfg).parameters())
    assert (spec.n_layer, spec.hidden, spec.n_head, spec.seq_len, spec.vocab_size) == (
        cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size)


@pytest.mark.parametrize("call,name", [
    (lambda: cm.ModelSpec(0, 2, 64, 2, 128), "n_params"),
    (lambda: cm.ModelSpec(100, 80, 10240, 80, 2048), "n_params"),
    (lambda: cm.ModelSpec(1e6, 2, 64, 3, 128), "n_head"),
    (lambda: cm.ModelSpec(float("nan"), 2, 64, 2, 128), "n_params"),
    (lambda: cm.ModelSpec(1e6, 2, 64, 4, 128, n_kv_head=3), "n_kv_head"),
    (lambda: cm.ModelSpec(1e6, 2, 64, 4, 128, vocab_size=0), "vocab_size"),
    (lambda: cm.Cluster(0), "n_gpus"),
    (lambda: cm.Cluster(8, matmul_flops=2e15), "matmul_flops"),
    (lambda: cm.Cluster(8, overlap_share=1.5), "overlap_share"),
    (lambda: cm.Cluster(8, host_adam_rate=0.0), "host_adam_rate"),
    (lambda: cm.Cluster(8, inter_bw=float("inf")), "inter_bw"),
    (lambda: cm.scaled(cm.Cluster(8), utilisation=1.2), "knob"),
])
def test_bad_arguments_are_named(call, name):
    with pytest.raises((ValueError, TypeError), match=name):
        call()


def test_bad_plan_arguments_are_named():
    """``check_space``: a wrong value names its argument; an empty space says why, not 'inf GB'."""
    from labkit.lab7 import planner
    model = cm.ModelSpec(1e6, 2, 64, 2, 128, "tiny")
    for kw, name in [(dict(zero_stages=(4,)), "zero_stages"), (dict(recipes=("fp8",)), "recipes"),
                     (dict(margin=1.0), "margin"), (dict(attention=("flash",)), "attention"),
                     (dict(offload=(False, True)), "host_adam_rate"),
                     (dict(sequence_parallel=(1,)), "sequence_parallel"),
                     (dict(interleave=()), "interleave"), (dict(reshard_after_forward=("no",)), "reshard")]:
        with pytest.raises(ValueError, match=name):
            planner.plan(model, cm.Cluster(2), 4, **kw)
    with pytest.raises(ValueError, match="global_batch"):
        planner.plan(model, cm.Cluster(2), 0)
    for kw, word in [(dict(zero_stages=(0,), offload=(True,)), "offload"),
                     (dict(checkpointing=("selective",), attention=("fused",)), "selective")]:
        with pytest.raises(ValueError) as err:
            planner.plan(model, cm.Cluster(2, host_adam_rate=1e9), 4, **kw)
        msg = str(err.value)
        assert "empty" in msg and word in msg and "inf" not in msg, msg


def test_memory_agrees_with_chapter_6_where_exercise_6_4_is_written():
    """The cost model's per-GPU bytes equal lab 6's ``parallel_memory.per_gpu_bytes`` (exercise
    6.4, chapter 6's model) on 6.4's domain: plain 1F1B, T dividing the key/value heads, no
    offload, ZeRO re-sharding as usual."""
    from labkit.lab6 import parallel_memory

    cases = [(cm.ModelSpec(1e8, 8, 256, 4, 128), dict(checkpointing="selective")),
             (cm.ModelSpec(1e8, 8, 256, 4, 128), dict(checkpointing="none", attention="naive")),
             (cm.ModelSpec.llama(1e8, 8, 256, 4, 2, 640, 128), dict(checkpointing="none", attention="fused"))]
    for model, extra in cases:
        cfg = config(**{**dict(zero_stage=2, dp=2, tp=2, pp=2, cp=2, micro_batch=2, n_micro=4,
                               sequence_parallel=True), **extra})
        try:
            want = parallel_memory.per_gpu_bytes(
                model.n_params, world_size=16, dp=2, tp=2, pp=2, cp=2, zero_stage=2, n_layer=8,
                hidden=256, n_head=4, seq_len=128, micro_batch=2, n_micro=4, sequence_parallel=True,
                n_kv_head=model.n_kv_head, ffn_hidden=model.ffn_hidden, gated_mlp=model.gated_mlp,
                dropout=model.dropout, **extra)
        except NotImplementedError:
            pytest.skip("exercise 6.4 not written")
        got = cm.memory_estimate(model, cfg)
        assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-12), extra


# ------------------------------------------------------------------------------------ experts

def moe_config(**kw):
    return config(**{**dict(attention="fused", checkpointing="none"), **kw})


@pytest.mark.parametrize("published", ["Mixtral 8x7B", "DeepSeek-V3"])
def test_expert_static_state_is_chapter_6s(published):
    """The static bytes of an MoE model under D × T × P with E carved out of D equal chapter 6's
    ``moe_memory.per_gpu_static_bytes`` (written independently): experts over E·T·P, ZeRO over
    D for the rest and D/E for the experts."""
    from labkit import moe_memory
    m = moe_memory.MODELS[published]
    spec = cm.ModelSpec.from_moe(m, 4096, 32, 8)
    for dp, ep, tp, pp, zero in [(8, 8, 1, 1, 1), (16, 4, 2, 2, 2), (4, 2, 1, 1, 3), (8, 1, 1, 1, 0)]:
        got = memory.static_bytes(spec, moe_config(dp=dp, ep=ep, tp=tp, pp=pp, zero_stage=zero))
        want = moe_memory.per_gpu_static_bytes(m, dp=dp, ep=ep, tp=tp, pp=pp, zero_stage=zero)
        assert got == pytest.approx(want, rel=1e-12), (dp, ep, tp, pp, zero)
    assert spec.n_params == moe_memory.param_counts(m)["total"]
    assert spec.active_params == pytest.approx(moe_memory.param_counts(m)["active"], rel=1e-12)


def test_moe_layer_activations_are_chapter_6s():
    """One MoE layer without tensor parallelism keeps the dense layer's attention and norms, and in
    place of the MLP's first matmul input and f-wide tensors ``moe_memory.layer_activation_bytes``
    for the rank's s·b/C tokens; E does not change a rank's buffers."""
    from labkit import moe_memory
    spec = cm.ModelSpec.from_moe(moe_memory.MIXTRAL_8X7B, 4096, 32, 8, capacity_factor=1.25)
    dense = dataclasses.replace(spec, n_expert=None, top_k=1, expert_ffn=None, moe_layers=None,
                                capacity_factor=1.0, ffn_hidden=14336)
    for cp, b in [(1, 1), (2, 2)]:
        cfg = moe_config(cp=cp, micro_batch=b, dp=8, ep=8)
        parts = moe_memory.layer_activation_bytes(moe_memory.MIXTRAL_8X7B, 4096 // cp * b, 1.25)
        mlp = 2 * 4096 // cp * b * 4096 + 3 * 2 * 4096 // cp * b * 14336  # first matmul input, SwiGLU
        want = memory.activation_bytes_per_layer(dense, cfg) - mlp + sum(parts.values())
        assert memory.moe_activation_bytes_per_layer(spec, cfg) == pytest.approx(want, rel=1e-12)
        assert memory.moe_activation_bytes_per_layer(spec, dataclasses.replace(cfg, ep=1)) == \
            memory.moe_activation_bytes_per_layer(spec, cfg)


def test_moe_gemms_do_the_active_parameters_flops(monkeypatch):
    """With capacity factor 1 and tokens·k a multiple of the experts, an MoE layer's forward GEMMs
    do 2·tokens·(its active weights) FLOPs whatever E — attention, router, k routed experts —
    the routed ones as one grouped GEMM of n_expert/E experts on E·C rows each."""
    calls = []
    real = kernels.gemm_seconds

    def counting(cluster, rows, cols, inner, e, batch=1, rate=None):
        calls.append((batch, round(rows), round(cols), round(inner)))
        return real(cluster, rows, cols, inner, e, batch, rate)

    monkeypatch.setattr(kernels, "gemm_seconds", counting)
    m = cm.ModelSpec.llama(1e11, 4, 4096, 32, 8, 14336, 4096, "8 experts", vocab_size=32000)
    m = dataclasses.replace(m, n_expert=8, top_k=2, n_params=4 * (m.block_weights / 4 - 3 * 4096 * 14336)
                            + 4 * (8 * 3 * 4096 * 14336 + 4096 * 8) + 32000 * 4096)
    layer_active = (m.active_params - 32000 * 4096) / 4
    for ep in (1, 2, 8):
        calls.clear()
        kernels._micro_batch_time.cache_clear()
        kernels.micro_batch_time(m, cm.Cluster(8), moe_config(dp=8, ep=ep))
        # (forward, backward, backward) triples: the dense layer's QKV, projection and MLP, the
        # output layer, then the MoE layer's router and its two grouped expert GEMMs
        qkv, proj, router, up, down = (calls[3 * k] for k in (0, 1, 5, 6, 7))
        fwd = sum(2 * b * r * c * i for b, r, c, i in (qkv, proj, router, up, down))
        assert fwd == pytest.approx(2 * 4096 * layer_active, rel=1e-12), ep
        assert up == (8 // ep, ep * 1024, 2 * 14336, 4096) and down == (8 // ep, ep * 1024, 4096, 14336)


def test_all_to_all_traffic():
    """Four all-to-alls of the n_expert·C·h buffer per MoE layer and micro-batch (six with full
    recomputation), (E − 1)/E of it leaving the GPU: over NVLink when the group fits in a node;
    across nodes, the node's share over NVLink and the rest over the network at once. None for E = 1."""
    from labkit.moe_memory import all_to_all_bytes
    m = cm.ModelSpec.llama(5e10, 8, 4096, 32, 8, 14336, 4096, "moe")
    m = dataclasses.replace(m, n_expert=16, top_k=2, n_params=1e12)
    m = dataclasses.replace(m, n_params=m.block_weights)
    buf = all_to_all_bytes(4096, 16, 2, 1.0, 4096, 2)
    c = cm.Cluster(64, overlap_share=0.0)
    inside = cm.step_time(m, c, moe_config(dp=16, ep=8, pp=4, n_micro=8), 128)
    assert inside.comm["ep"] == pytest.approx(8 * 2 * 4 * (7 / 8 * buf / c.intra_bw + 7 * c.intra_latency), rel=1e-12)
    across = cm.step_time(m, c, moe_config(dp=16, ep=16, pp=4, n_micro=8, checkpointing="full"), 128)
    one = max(7 / 16 * buf / c.intra_bw, 8 / 16 * buf / c.inter_bw) + 15 * c.inter_latency
    assert across.comm["ep"] == pytest.approx(8 * 2 * 6 * one, rel=1e-12)
    assert cm.step_time(m, c, moe_config(dp=16, pp=4, n_micro=8), 128).comm["ep"] == 0
    dense = cm.step_time(cm.ModelSpec(**SEED_100B), cm.Cluster(64), config(tp=8, pp=8, n_micro=8), 64)
    assert dense.comm["ep"] == 0


@pytest.mark.parametrize("make,name", [
    (lambda: cm.ModelSpec(1e9, 2, 64, 2, 128, top_k=2), "n_expert"),
    (lambda: cm.ModelSpec(1e9, 2, 64, 2, 128, n_expert=4, top_k=8), "top_k"),
    (lambda: cm.ModelSpec(1e6, 2, 64, 2, 128, n_expert=64, expert_ffn=4096), "n_params"),
    (lambda: cm.ModelSpec(1e9, 2, 64, 2, 128, n_expert=4, moe_layers=3), "moe_layers"),
    (lambda: cm.ModelSpec(1e9, 2, 64, 2, 128, n_expert=4, capacity_factor=0), "capacity_factor"),
    (lambda: cm.memory_estimate(cm.ModelSpec(1e9, 2, 64, 2, 128), moe_config(dp=4, ep=2)), "ep"),
    (lambda: cm.memory_estimate(cm.ModelSpec(1e9, 2, 64, 2, 128, n_expert=4), moe_config(dp=6, ep=3)), "ep"),
    (lambda: cm.step_time(cm.ModelSpec(1e9, 2, 64, 2, 128, n_expert=4), cm.Cluster(4), moe_config(dp=2, ep=4), 4), "ep"),
])
def test_bad_expert_arguments_are_named(make, name):
    with pytest.raises(ValueError, match=name):
        make()
