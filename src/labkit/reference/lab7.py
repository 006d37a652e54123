"""Lab 7's references: published training runs the course's cost model is checked against.

Typed from the papers (cited data, not computed here); chapter 7's calibration table and
``tests/test_lab7_calibration.py`` read them from this one place.

- ``ZERO_FIGURE_1``: Rajbhandari et al. 2019 (https://arxiv.org/abs/1910.02054), Figure 1: the
  per-GPU model-state memory of a 7.5B model on N_d = 64 GPUs with K = 12 (mixed-precision Adam)
  under the baseline and ZeRO's three stages, in GB as printed (one decimal).
- ``MEGATRON_TABLE_1``: Narayanan et al. 2021 (https://arxiv.org/abs/2104.04473), Table 1:
  parameters (billions), attention heads, hidden size, layers, tensor-parallel size,
  pipeline-parallel size, GPUs, batch size, achieved teraFLOP/s per GPU; sequence 2,048,
  vocabulary 51,200, A100 80 GB GPUs (Selene). §5.1: "we use the interleaved pipeline schedule
  with the scatter/gather optimization enabled" (the number of virtual stages and the
  micro-batch size are not given). Their FLOP count is ``megatron_flops``.
- ``LLAMA3_TABLE_4``: Grattafiori et al. 2024 (https://arxiv.org/abs/2407.21783), Table 4: GPUs,
  TP, CP, PP, DP, sequence length, batch size per DP rank, TFLOPs per GPU, BF16 MFU; H100 80 GB,
  8 a node. The 128k row prints DP 4, but its 16,384 GPUs = TP 8 × CP 16 × PP 16 × DP and its
  16M tokens a batch = DP × 16 × 131,072 both give DP 8: 8 is used. §3.3.2: FSDP that "shards
  optimizer states and gradients, but for model shards we do not reshard after forward
  computation"; "an interleaved schedule"; 8K sequences "without activation checkpointing".
- ``LLAMA3_405B``: the model of that table (the same report, Table 3): 126 layers, hidden 16,384,
  FFN 53,248, 128 heads, 8 key/value heads, vocabulary 128,256.
- ``BLOOM``: Le Scao et al. 2022 (https://arxiv.org/abs/2211.05100, §3.4) and the BigScience
  176B page (https://bigscience.notion.site/BigScience-176B-Model-ad073ca07cdf479398d5f95d88e218c4):
  176B parameters, 70 layers, hidden 14,336, 112 heads, sequence 2,048, vocabulary 250,880
  (padded), global batch 2,048, on 384 A100 80 GB as DP 8 × TP 4 × PP 12 with ZeRO stage 1 and
  bf16; "one copy of the model takes 48 GPUs (using 60 GB of memory on each GPU)", "about 150
  TFLOPs" per GPU.

- ``DEEPSEEK_V3_RUN``: DeepSeek-AI 2024 (https://arxiv.org/abs/2412.19437), the pre-training of
  DeepSeek-V3 (the model: ``labkit.moe_memory.DEEPSEEK_V3``, §4.2): 2,048 H800 GPUs, 8 a node,
  NVLink and InfiniBand (§3.1); "16-way Pipeline Parallelism (PP), 64-way Expert Parallelism (EP)
  spanning 8 nodes, and ZeRO-1 Data Parallelism (DP)", no tensor parallelism (§3.2); sequences
  of 4K tokens, a batch of 15,360 sequences after its first 469B tokens (§4.2); "NVLink offers a
  bandwidth of 160 GB/s, roughly 3.2 times that of IB (50 GB/s)" (§3.2.2); "training
  DeepSeek-V3 on each trillion tokens requires only 180K H800 GPU hours" (§1), i.e. 1e12 /
  (180e3 × 3600) = 1,543 tokens per second per GPU over the whole pre-training (restarts,
  evaluations and the smaller early batches included). As it ran: DualPipe, a bidirectional
  pipeline that hides the all-to-all behind computation ("both all-to-all and PP communication
  can be fully hidden", §3.2.1), FP8 GEMMs and FP8 activation caching (§3.3), recomputation of
  the RMSNorms and MLA's up-projections only (§3.2.3), multi-head latent attention, a
  multi-token-prediction module, each token sent to at most 4 nodes.

- ``KORTHIKANTI_TABLE_3_5``: Korthikanti et al. 2022 (https://arxiv.org/abs/2205.05198), Table 3
  (parameters, attention heads, hidden size, layers, tensor- and pipeline-parallel size, GPUs,
  global batch, micro-batch; no data parallelism) with Table 5's iteration times in seconds,
  with full recomputation and with "present work" (sequence parallelism and selective
  recomputation), and its model FLOPs utilisation; §6: sequence 2,048, vocabulary 51,200,
  A100 80 GB GPUs (Selene), "the interleaving schedule with three interleaving stages" for the
  175B and 530B models. §6.3 adds the 530B model on 2,240 GPUs (8-way data parallelism, the
  batch 8 × 280): 39.15 s an iteration, MFU 54.2%, "we do not use any overlapping of gradient
  all-reduces with back-propagation". Its model FLOPs are ``korthikanti_flops`` (Appendix A,
  eq. 7); MFU × 312 TFLOP/s matches them over the iteration time to 0.5%.
- ``MTNLG``: Smith et al. 2022 (https://arxiv.org/abs/2201.11990), Megatron-Turing NLG 530B: 105
  layers, hidden 20,480, 128 heads, sequence 2,048, global batch 1,920, "8-way tensor and 35-way
  pipeline parallelism" on A100 80 GB DGX nodes (Selene), DeepSpeed's pipeline engine with
  Megatron-LM's tensor slicing; §2.4: 280, 350 and 420 servers take 60.1, 50.2 and 44.4 s an
  iteration, "126, 121, and 113 teraFLOP/s per GPU" — Narayanan's eq. 3 (``megatron_flops``,
  vocabulary 51,200) over those times gives 126, 120 and 113.

``published_runs()`` turns each into what the cost model needs (``PublishedRun``): the model, the
cluster as its software ran (which attention kernel, whether data-parallel traffic overlapped),
the published layout and the choices the paper states, and the space the run's framework offered.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GB = 10**9

ZERO_FIGURE_1 = dict(n_params=7.5e9, n_gpus=64, gb={0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9})

MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
MEGATRON_SEQ, MEGATRON_VOCAB = 2048, 51200

LLAMA3_TABLE_4 = [(8192, 8, 1, 16, 64, 8192, 32, 430, 0.43),
                  (16384, 8, 1, 16, 128, 8192, 16, 400, 0.41),
                  (16384, 8, 16, 16, 8, 131072, 16, 380, 0.38)]
LLAMA3_405B = dict(n_params=405e9, n_layer=126, hidden=16384, n_head=128, n_kv_head=8,
                   ffn_hidden=53248, vocab_size=128256)

KORTHIKANTI_TABLE_3_5 = [  # size, parameters, heads, hidden, layers, T, P, GPUs, batch, micro-batch,
    # v (interleaved stages), seconds with full recompute, with SP + selective, MFU (SP + selective)
    ("22B", 22e9, 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10, 0.415),
    ("175B", 175e9, 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75, 0.514),
    ("530B", 530e9, 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83, 0.560),
    ("1T", 1e12, 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49, 0.563),
]
KORTHIKANTI_530B_DP8 = dict(n_gpus=2240, dp=8, global_batch=2240, seconds=39.15, mfu=0.542)
KORTHIKANTI_SEQ, KORTHIKANTI_VOCAB, A100_PEAK = 2048, 51200, 312e12

MTNLG = dict(n_params=530e9, n_layer=105, hidden=20480, n_head=128, seq_len=2048, vocab_size=51200,
             global_batch=1920, tp=8, pp=35, runs=[(280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113)])
"""(DGX A100 servers, seconds per iteration, published TFLOP/s per GPU) of §2.4."""

DEEPSEEK_V3_RUN = dict(n_gpus=2048, dp=128, tp=1, pp=16, cp=1, ep=64, zero_stage=1, seq_len=4096,
                       global_batch=15360, intra_bw=160 * GB, inter_bw=50 * GB,
                       gpu_hours_per_trillion_tokens=180e3, active_params=37e9, n_layer=61)
DEEPSEEK_V3_HIDDEN = 7168

BLOOM = dict(n_params=176.2e9, n_layer=70, hidden=14336, n_head=112, seq_len=2048,
             vocab_size=250880, global_batch=2048, n_gpus=384, dp=8, tp=4, pp=12,
             zero_stage=1, micro_batch=2, memory_gb=60, tflops=150)


def megatron_flops(batch: int, seq_len: int, n_layer: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, eq. 3: FLOPs of one step with full recomputation (four passes over
    each layer) and the logits, 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    return 96 * batch * seq_len * n_layer * hidden**2 * (
        1 + seq_len / (6 * hidden) + vocab / (16 * n_layer * hidden))


def korthikanti_flops(batch: int, seq_len: int, n_layer: int, hidden: int, vocab: int) -> float:
    """Korthikanti et al. 2022, eq. 7: the model FLOPs of one step (one forward, one backward, no
    recomputation), 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))."""
    return 72 * batch * seq_len * n_layer * hidden**2 * (
        1 + seq_len / (6 * hidden) + vocab / (12 * n_layer * hidden))


def palm_model_flops(batch: int, seq_len: int, n_params: float, n_layer: int, hidden: int) -> float:
    """The model FLOPs of one step by the MFU convention Llama 3 cites (Chowdhery et al. 2022,
    https://arxiv.org/abs/2204.02311, Appendix B): 6Ψ + 12·L·s·h per token, the attention over
    all s × s pairs (a causal kernel computes half of them), no recomputation."""
    return batch * seq_len * (6 * n_params + 12 * n_layer * seq_len * hidden)


def deepseek_v3_spec():
    """DeepSeek-V3 (``labkit.moe_memory.DEEPSEEK_V3``) as a ``ModelSpec`` of 64 equal slots for its
    16 stages: its 3 dense layers, 58 MoE layers (256 routed experts of width 2,048, 8 a token,
    one shared), and 3 slots of a dense layer's size for the multi-token-prediction layer, the
    embedding and the output head (as Llama 3's 126 layers are 128 slots here; the model's dense
    FFN, 18,432 = 9 × 2,048, costs what an MoE layer's 9 active experts do). Ψ the published
    671B of the main model; attention as multi-head attention of width h (MLA not modelled)."""
    from labkit.cost_model import ModelSpec
    from labkit.moe_memory import DEEPSEEK_V3 as m

    return ModelSpec(m.published_total, 64, m.hidden, 128, DEEPSEEK_V3_RUN["seq_len"], m.name,
                     ffn_hidden=m.dense_ffn, gated_mlp=True, dropout=False, n_expert=m.n_expert,
                     top_k=m.top_k, expert_ffn=m.expert_ffn, n_shared=m.n_shared, moe_layers=m.moe_layers)


@dataclass(frozen=True)
class PublishedRun:
    """One published run as the cost model sees it.

    ``layout`` is (dp, tp, pp, cp), or (dp, tp, pp, cp, ep) for an MoE run; ``as_ran`` the ``Config`` fields the paper states (the others
    — micro-batch size, virtual stages, recomputation where not stated — are left to the model:
    the run is scored by the fastest configuration of its layout that fits); ``space`` the
    ``plan`` arguments of what its framework offered; ``tflops`` the published TFLOP/s per GPU,
    whose FLOPs per step by the paper's own count are ``flops``."""

    name: str
    model: object
    cluster: object
    global_batch: int
    layout: tuple
    as_ran: dict
    space: dict
    tflops: float
    flops: float
    source: str
    notes: dict = field(default_factory=dict)


def published_runs() -> list[PublishedRun]:
    """Megatron-LM 2021's ten rows, Korthikanti et al. 2022's nine (``korthikanti_runs``),
    MT-NLG's three (``mtnlg_runs``), BLOOM, Llama 3 405B's three rows and DeepSeek-V3 (module
    docstring).

    As they ran: Megatron-LM of 2021 and Megatron-DeepSpeed (BLOOM) without sequence parallelism
    (2022) or data-parallel overlap (Megatron-LM's ``--overlap-grad-reduce`` came in 2023: its
    2021 data-parallel all-reduce followed the backward), naive attention with fused softmax,
    ZeRO-0 (Megatron-LM) and ZeRO-1 (BLOOM), full recomputation (Megatron-LM's FLOP count
    includes it); BLOOM on DeepSpeed's pipeline engine (no interleaving, micro-batch 2). Llama 3 on
    H100s with FlashAttention-2 (FlashAttention-3 was published after), sequence parallelism,
    FSDP without re-sharding after forward, an interleaved schedule, no recomputation at 8K.
    Uneven stages are equal slots here: Llama 3's 126 layers on 16 stages as 128 (one fewer on
    the first and last stage), BLOOM's 70 on 12 as 72, the embedding and the output layer in the
    two extra slots (no ``vocab_size``: no separate output layer); DeepSeek-V3's 61 as 64
    (``deepseek_v3_spec``). DeepSeek-V3 on H800s: the H100's chip (its compute, memory and HBM)
    with the link bandwidths its report gives, no sequence parallelism to choose (T = 1), its
    1F1B-shaped pipeline the model's nearest schedule, mixed precision (the model has no FP8);
    its published tokens per second are turned into TFLOP/s by PaLM's convention with the
    37B active parameters and the 61 real layers (the convention cancels in predicted/published)."""
    from labkit.cost_model import A100_SXM_80GB, FLASH_2_H100, H100_SXM, Cluster, ModelSpec

    runs = []
    megatron_stack = dict(zero_stages=(0,), checkpointing=("full",), attention=("naive",),
                          sequence_parallel=(False,), interleave=(False, True),
                          reshard_after_forward=(True,))
    for p_b, a, h, L, T, P, N, B, tflops in MEGATRON_TABLE_1:
        runs.append(PublishedRun(
            f"Megatron-LM {p_b:g}B", ModelSpec(p_b * 1e9, L, h, a, MEGATRON_SEQ, f"{p_b:g}B",
                                                 vocab_size=MEGATRON_VOCAB),
            Cluster.of(A100_SXM_80GB, N, overlap_share=0.0), B, (N // (T * P), T, P, 1),
            dict(zero_stage=0, checkpointing="full", attention="naive", sequence_parallel=False),
            megatron_stack, tflops, megatron_flops(B, MEGATRON_SEQ, L, h, MEGATRON_VOCAB),
            "Narayanan et al. 2021, Table 1"))
    runs += korthikanti_runs() + mtnlg_runs()
    b = BLOOM
    runs.append(PublishedRun(
        "BLOOM 176B", ModelSpec(b["n_params"], 72, b["hidden"], b["n_head"], b["seq_len"], "BLOOM"),
        Cluster.of(A100_SXM_80GB, b["n_gpus"], overlap_share=0.0), b["global_batch"],
        (b["dp"], b["tp"], b["pp"], 1),
        dict(zero_stage=b["zero_stage"], attention="naive", sequence_parallel=False,
             micro_batch=b["micro_batch"], virtual_stages=1),
        dict(zero_stages=(0, 1), checkpointing=("none", "selective", "full"), attention=("naive",),
             sequence_parallel=(False,), interleave=(False,), reshard_after_forward=(True,)),
        b["tflops"], megatron_flops(b["global_batch"], b["seq_len"], b["n_layer"], b["hidden"], b["vocab_size"]),
        "Le Scao et al. 2022, §3.4; the BigScience 176B page",
        notes=dict(memory_gb=b["memory_gb"])))
    m3 = LLAMA3_405B
    for N, T, C, P, D, seq, per_dp, tflops, mfu in LLAMA3_TABLE_4:
        runs.append(PublishedRun(
            f"Llama 3 405B, {N:,} GPUs, {seq // 1024}K",
            ModelSpec.llama(m3["n_params"], 128, m3["hidden"], m3["n_head"], m3["n_kv_head"],
                            m3["ffn_hidden"], seq, "Llama 3 405B"),
            Cluster.of(H100_SXM, N, attention_flops=H100_SXM["flops"] * FLASH_2_H100), D * per_dp,
            (D, T, P, C),
            dict(zero_stage=3, reshard_after_forward=False, attention="fused", sequence_parallel=True,
                 micro_batch=1) | (dict(checkpointing="none") if seq <= 8192 else {}),
            dict(zero_stages=(1, 2, 3), checkpointing=("none", "full"), attention=("fused",),
                 sequence_parallel=(True,), interleave=(False, True), reshard_after_forward=(True, False)),
            tflops, palm_model_flops(D * per_dp, seq, m3["n_params"], m3["n_layer"], m3["hidden"]),
            "Grattafiori et al. 2024, Table 4", notes=dict(mfu=mfu)))
    d = DEEPSEEK_V3_RUN
    tokens_per_s = 1e12 / (d["gpu_hours_per_trillion_tokens"] * 3600)
    per_token = palm_model_flops(1, d["seq_len"], d["active_params"], d["n_layer"], DEEPSEEK_V3_HIDDEN)
    runs.append(PublishedRun(
        "DeepSeek-V3 671B", deepseek_v3_spec(),
        Cluster.of(H100_SXM, d["n_gpus"], intra_bw=d["intra_bw"], inter_bw=d["inter_bw"]), d["global_batch"],
        (d["dp"], d["tp"], d["pp"], d["cp"], d["ep"]), dict(zero_stage=d["zero_stage"], attention="fused",
                                                          virtual_stages=1),
        dict(zero_stages=(1,), checkpointing=("none", "full"), attention=("fused",), sequence_parallel=(True,),
             interleave=(False,), reshard_after_forward=(True,)),
        tokens_per_s * per_token / d["seq_len"] / 1e12,
        palm_model_flops(d["global_batch"], d["seq_len"], d["active_params"], d["n_layer"], DEEPSEEK_V3_HIDDEN),
        "DeepSeek-AI 2024, §1, §3.1–3.2, §4.2", notes=dict(tokens_per_s=tokens_per_s)))
    return runs


def korthikanti_runs() -> list[PublishedRun]:
    """Korthikanti et al. 2022's Table 5 (module docstring) as it ran: Megatron-LM of 2022 on
    Selene, naive attention with fused softmax, no data parallelism but in the §6.3 row (whose
    all-reduce did not overlap: ZeRO-0, ``overlap_share=0``), the micro-batch and the
    interleaving Table 3 and §6 state. Each of the four configurations twice, as the table
    measured it: "present work" (sequence parallelism and selective recomputation) and "full
    recompute" (neither); the 530B model also on 2,240 GPUs with the present work. The
    published TFLOP/s is eq. 7's model FLOPs over the iteration time (for the present work, the
    printed MFU × 312 to 0.5%). Their framework offered every recomputation, sequence
    parallelism or not, and interleaving."""
    from labkit.cost_model import A100_SXM_80GB, Cluster, ModelSpec

    space = dict(zero_stages=(0,), checkpointing=("none", "selective", "full"), attention=("naive",),
                 sequence_parallel=(False, True), interleave=(False, True), reshard_after_forward=(True,))
    s, V = KORTHIKANTI_SEQ, KORTHIKANTI_VOCAB
    rows = [(size, n, a, h, L, T, P, N, B, b, v, t_sp, "SP + selective", True, "selective")
            for size, n, a, h, L, T, P, N, B, b, v, _, t_sp, _ in KORTHIKANTI_TABLE_3_5]
    d = KORTHIKANTI_530B_DP8
    size, n, a, h, L, T, P, _, B, b, v, *_ = KORTHIKANTI_TABLE_3_5[2]
    rows.append((size, n, a, h, L, T, P, d["n_gpus"], d["global_batch"], b, v, d["seconds"],
                 f"{d['n_gpus']:,} GPUs", True, "selective"))
    rows += [(size, n, a, h, L, T, P, N, B, b, v, t_full, "full recompute", False, "full")
             for size, n, a, h, L, T, P, N, B, b, v, t_full, _, _ in KORTHIKANTI_TABLE_3_5]
    runs = []
    for size, n, a, h, L, T, P, N, B, b, v, seconds, label, sp, ckpt in rows:
        flops = korthikanti_flops(B, s, L, h, V)
        runs.append(PublishedRun(
            f"Korthikanti {size}, {label}", ModelSpec(n, L, h, a, s, size, vocab_size=V),
            Cluster.of(A100_SXM_80GB, N, overlap_share=0.0), B, (N // (T * P), T, P, 1),
            dict(zero_stage=0, checkpointing=ckpt, attention="naive", sequence_parallel=sp,
                 micro_batch=b, virtual_stages=v),
            space, flops / (seconds * N) / 1e12, flops, "Korthikanti et al. 2022, Tables 3 and 5, §6",
            notes=dict(seconds=seconds)))
    return runs


def mtnlg_runs() -> list[PublishedRun]:
    """Megatron-Turing NLG 530B's three cluster sizes (module docstring) as they ran: DeepSpeed's
    pipeline engine (plain 1F1B, no interleaving) with Megatron-LM's tensor slicing of 2021, no
    sequence parallelism, naive attention, full recomputation (eq. 3's four passes are what
    its TFLOP/s count), no data-parallel overlap; the ZeRO stage and the micro-batch are not
    stated (the engine runs ZeRO-0 or 1 with a pipeline: both are searched). Its framework
    offered no selective recomputation (2022) and no interleaving."""
    from labkit.cost_model import A100_SXM_80GB, Cluster, ModelSpec

    m = MTNLG
    model = ModelSpec(m["n_params"], m["n_layer"], m["hidden"], m["n_head"], m["seq_len"], "MT-NLG",
                      vocab_size=m["vocab_size"])
    flops = megatron_flops(m["global_batch"], m["seq_len"], m["n_layer"], m["hidden"], m["vocab_size"])
    return [PublishedRun(
        f"MT-NLG 530B, {nodes * 8:,} GPUs", model, Cluster.of(A100_SXM_80GB, nodes * 8, overlap_share=0.0),
        m["global_batch"], (nodes * 8 // (m["tp"] * m["pp"]), m["tp"], m["pp"], 1),
        dict(attention="naive", sequence_parallel=False, checkpointing="full", virtual_stages=1),
        dict(zero_stages=(0, 1), checkpointing=("none", "full"), attention=("naive",), sequence_parallel=(False,),
             interleave=(False,), reshard_after_forward=(True,)),
        tflops, flops, "Smith et al. 2022, §2.4", notes=dict(seconds=seconds))
        for nodes, seconds, tflops in m["runs"]]


def as_ran(run: PublishedRun, margin: float = 0.0):
    """The cost model's estimate of ``run`` as it ran: the fastest configuration of its layout
    with the stated choices (``run.as_ran``) that fits with ``margin``, the unstated ones from
    ``run.space`` (every micro-batch size, number of virtual stages, recomputation); None if none
    fits. Margin 0 by default: the run happened, so it fitted in the GPU's whole memory."""
    import math

    from labkit.cost_model import Config, check_space, combinations, evaluate

    space = check_space(run.model, run.cluster, run.global_batch, margin=margin, n_runners_up=0,
                        **{"recipes": ("mixed",), "optimizers": ("adam",), "offload": (False,), **run.space})
    dp, tp, pp, cp, ep = (*run.layout, 1)[:5]
    per_rank = run.global_batch // dp
    best = None
    for choice in combinations(space, run.model, tp, pp, cp):
        if any(choice[k] != v for k, v in run.as_ran.items() if k in choice):
            continue
        for b in [k for k in range(1, per_rank + 1) if per_rank % k == 0]:
            if run.as_ran.get("micro_batch", b) != b:
                continue
            cfg = Config("mixed", "adam", dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=b,
                         n_micro=per_rank // b, ep=ep, **choice)
            e = evaluate(run.model, run.cluster, cfg, run.global_batch, margin)
            if e.fits and (best is None or (e.time.total, e.memory["total"], e.config) <
                           (best.time.total, best.memory["total"], best.config)):
                best = e
    return best if best is None or math.isfinite(best.time.total) else None
