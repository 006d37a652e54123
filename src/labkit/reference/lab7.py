"""Lab 7's references: published training runs the planner is checked against.

Typed from the papers (cited data, not computed here); chapter 7's calibration table and
``tests/test_lab7_calibration.py`` read them from this one place.

- ``ZERO_FIGURE_1``: Rajbhandari et al. 2019 (https://arxiv.org/abs/1910.02054), Figure 1: the
  per-GPU model-state memory of a 7.5B model on N_d = 64 GPUs with K = 12 (mixed-precision Adam)
  under the baseline and ZeRO's three stages, in GB as printed (one decimal).
- ``MEGATRON_TABLE_1``: Narayanan et al. 2021 (https://arxiv.org/abs/2104.04473), Table 1:
  parameters (billions), attention heads, hidden size, layers, tensor-parallel size,
  pipeline-parallel size, GPUs, batch size, achieved teraFLOP/s per GPU; sequence 2,048,
  vocabulary 51,200, A100 80 GB GPUs (Selene). Their FLOP count is ``megatron_flops``.
- ``LLAMA3_TABLE_4``: Grattafiori et al. 2024 (https://arxiv.org/abs/2407.21783), Table 4: GPUs,
  TP, CP, PP, DP, sequence length, batch size per DP rank, TFLOPs per GPU, BF16 MFU; H100 80 GB,
  8 a node. The 128k row prints DP 4, but its 16,384 GPUs = TP 8 × CP 16 × PP 16 × DP and its
  16M tokens a batch = DP × 16 × 131,072 both give DP 8: 8 is used.
- ``LLAMA3_405B``: the model of that table (the same report, Table 3): 126 layers, hidden 16,384,
  FFN 53,248, 128 heads, 8 key/value heads, vocabulary 128,256.
- ``BLOOM``: Le Scao et al. 2022 (https://arxiv.org/abs/2211.05100, §3.4) and the BigScience
  176B page (https://bigscience.notion.site/BigScience-176B-Model-ad073ca07cdf479398d5f95d88e218c4):
  176B parameters, 70 layers, hidden 14,336, 112 heads, sequence 2,048, vocabulary 250,880
  (padded), global batch 2,048, on 384 A100 80 GB as DP 8 × TP 4 × PP 12 with ZeRO stage 1 and
  bf16; "one copy of the model takes 48 GPUs (using 60 GB of memory on each GPU)", "about 150
  TFLOPs" per GPU.
"""
from __future__ import annotations

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
                  (16384, 8, 16, 16, 8, 131072, 16, 380, 0.38)]
LLAMA3_405B = dict(n_params=405e9, n_layer=126, hidden=16384, n_head=128, n_kv_head=8,
                   ffn_hidden=53248, vocab_size=128256)

BLOOM = dict(n_params=176.2e9, n_layer=70, hidden=14336, n_head=112, seq_len=2048,
             vocab_size=250880, global_batch=2048, n_gpus=384, dp=8, tp=4, pp=12,
             zero_stage=1, memory_gb=60, tflops=150)

A100_80GB = dict(gpus_per_node=8, memory_bytes=80 * GB, flops=312e12, fp32_flops=19.5e12,
                 intra_bw=300 * GB, inter_bw=25 * GB)
"""An A100 80 GB node as ``labkit.lab7.planner.Cluster`` options: 312 TFLOP/s dense bf16
(19.5 fp32), NVLink 600 GB/s both ways, one 200 Gb/s HDR NIC per GPU (NVIDIA's datasheets)."""


def megatron_flops(batch: int, seq_len: int, n_layer: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, eq. 3: FLOPs of one step with full recomputation (four passes over
    each layer) and the logits, 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    return 96 * batch * seq_len * n_layer * hidden**2 * (
        1 + seq_len / (6 * hidden) + vocab / (16 * n_layer * hidden))
