"""A cluster as the cost model sees it: GPUs, their links, their host.

Two kinds of numbers describe a GPU here. The **datasheet** ones (dense 16-bit peak FLOP/s,
memory, HBM bandwidth, streaming multiprocessors, link bandwidths) come from NVIDIA's
datasheets. The **achieved** ones are measured by others and cited. ``matmul_flops``: the
highest rate a large, well-shaped bf16 matrix multiplication reaches on that GPU — Bekman's
*Maximum Achievable Matmul FLOPS* (MAMF, ``mamf-finder.py``; the table "Maximum Achievable Matmul
FLOPS comparison table" in https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md):
267.9 TFLOP/s on an A100 SXM (85.9% of its 312), 792.1 TFLOP/s on an H100 SXM (80.1% of 989),
CUDA 12.1 — times the share of it a GPU sustains at its power limit (``SUSTAINED``). No GEMM of
a training run beats it; ``labkit.cost_model.kernels`` says how much less the thin ones reach.
``attention_flops``: what a fused attention kernel of the GPU's generation reaches on long
sequences (``FLASH_2_A100``, ``FLASH_2_H100``, ``FLASH_3_H100``).

Bandwidths are bytes per second per GPU, one direction, at the datasheet's rate: NVLink
``intra_bw`` inside a node, the GPU's network card ``inter_bw`` across nodes, ``pcie_bw`` to the
host. Real collectives reach 70–90% of them (NCCL's bus bandwidth); the sensitivity box of chapter 7
moves them by ±20%. ``intra_latency`` and ``inter_latency`` are the seconds one ring step (hop)
costs beyond its bytes: assumed orders of magnitude (NCCL's small-message all-reduce time over
its 2(n − 1) hops; Thakur et al. 2005's α), which decide only for small messages.

Chapter 7 (book/07_panorama.md).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from labkit import validate

GB = 10**9

SUSTAINED = 0.85
"""The share of its burst matmul ceiling (MAMF) a GPU sustains at its power limit, as a training
step keeps it: Bekman's *Maximum Sustainable Matmul FLOPS* (MSMF) over MAMF, measured 702.9 / 828.0
on an H200 and 1455.7 / 1732.6 on a B200 ("What we measured", compute/accelerator/benchmarks/README.md
of the same repository); assumed the same for the A100 and H100, whose MSMF is not published."""

FLASH_2_A100, FLASH_2_H100, FLASH_3_H100 = 0.6, 0.3, 0.6
"""Fused attention's long-sequence share of the peak, forward and backward together (backward has
2.5× the forward's FLOPs and runs at a lower rate than forward). FlashAttention-2 reaches 50–73% of
an A100's peak (Dao 2023, https://arxiv.org/abs/2307.08691) and "only 35%" of an H100's in
forward; FlashAttention-3 75% of an H100's in forward (Shah et al. 2024,
https://arxiv.org/abs/2407.08608). 0.6, 0.3 and 0.6 are read from these statements, not fitted."""

H100_SXM = dict(gpus_per_node=8, memory_bytes=80 * GB, flops=989e12, fp32_flops=67e12,
                matmul_flops=792.1e12 * SUSTAINED, attention_flops=989e12 * FLASH_3_H100,
                hbm_bw=3.35e12, n_sm=132, intra_bw=450 * GB, inter_bw=50 * GB, pcie_bw=64 * GB)
"""An H100 SXM 80 GB in a DGX H100 (NVIDIA's datasheets): 989 TFLOP/s dense bf16 (67 fp32), 3.35
TB/s HBM3, 132 SMs, NVLink 900 GB/s both ways, one 400 Gb/s NIC per GPU, PCIe 5.0 x16; matmuls at
MAMF 792.1 sustained (``SUSTAINED``), FlashAttention-3."""

A100_SXM_80GB = dict(gpus_per_node=8, memory_bytes=80 * GB, flops=312e12, fp32_flops=19.5e12,
                     matmul_flops=267.9e12 * SUSTAINED, attention_flops=312e12 * FLASH_2_A100,
                     hbm_bw=2.039e12, n_sm=108, intra_bw=300 * GB, inter_bw=25 * GB, pcie_bw=32 * GB)
"""An A100 SXM 80 GB in a DGX A100 (NVIDIA's datasheets): 312 TFLOP/s dense bf16 (19.5 fp32),
2.04 TB/s HBM2e, 108 SMs, NVLink 600 GB/s both ways, one 200 Gb/s HDR NIC per GPU, PCIe 4.0 x16;
matmuls at MAMF 267.9 sustained, FlashAttention-2."""


@dataclass(frozen=True)
class Cluster:
    """``n_gpus`` GPUs, ``gpus_per_node`` to a node (an H100 SXM node by default: ``H100_SXM``).

    ``host_memory_bytes`` is one node's CPU memory (2 TB: a DGX H100); ``host_adam_rate`` the
    parameters per second one node's CPUs update with Adam — no default: offload needs it
    measured (chapter 7 measures it on the machine that builds the page).
    """

    n_gpus: int
    gpus_per_node: int = 8
    memory_bytes: float = 80 * GB
    flops: float = 989e12
    """Dense 16-bit tensor-core peak, FLOP/s (the datasheet's: what MFU divides by)."""
    fp32_flops: float = 67e12
    matmul_flops: float = 792.1e12 * SUSTAINED
    """The sustained ceiling of a large bf16 matmul (MAMF × ``SUSTAINED``), FLOP/s; the fp32
    recipe scales every rate by fp32_flops / flops."""
    attention_flops: float = 989e12 * FLASH_3_H100
    """Fused attention's rate on long sequences, forward and backward, FLOP/s (``FLASH_3_H100``)."""
    hbm_bw: float = 3.35e12
    """GPU memory bandwidth, bytes/s: the roof of memory-bound kernels and thin GEMMs."""
    n_sm: int = 132
    """Streaming multiprocessors: a GEMM runs in waves of one output tile per SM."""
    intra_bw: float = 450 * GB
    inter_bw: float = 50 * GB
    pcie_bw: float = 64 * GB
    host_memory_bytes: float = 2000 * GB
    host_adam_rate: float | None = None
    intra_latency: float = 2e-6
    inter_latency: float = 8e-6
    overlap_share: float = 0.8
    """Of the compute a data-parallel or ZeRO collective runs beside, the share the software stack
    lets it hide behind (``labkit.cost_model.step``); 0 for a stack that overlaps none."""

    def __post_init__(self) -> None:
        for name in ("n_gpus", "gpus_per_node", "n_sm"):
            validate.positive_int(name, getattr(self, name))
        for name in ("memory_bytes", "flops", "fp32_flops", "matmul_flops", "attention_flops", "hbm_bw", "intra_bw",
                     "inter_bw", "pcie_bw", "host_memory_bytes"):
            validate.positive_number(name, getattr(self, name))
        if self.host_adam_rate is not None:
            validate.positive_number("host_adam_rate", self.host_adam_rate)
        for name in ("intra_latency", "inter_latency"):
            validate.number(name, getattr(self, name), low=0)
        validate.number("overlap_share", self.overlap_share, low=0, high=1)
        for name in ("matmul_flops", "attention_flops"):
            if getattr(self, name) > self.flops:
                raise ValueError(f"{name}={getattr(self, name):.4g} (an achieved rate) cannot "
                                 f"exceed flops={self.flops:.4g} (the peak)")

    @classmethod
    def of(cls, gpu: dict, n_gpus: int, **overrides) -> "Cluster":
        """``n_gpus`` GPUs of a preset (``H100_SXM``, ``A100_SXM_80GB``), fields overridden."""
        return cls(n_gpus, **{**gpu, **overrides})


KNOBS = ("kernels", "intra_bw", "inter_bw", "pcie_bw")
"""The inputs ``scaled`` moves for chapter 7's sensitivity box: every kernel rate at once (the
matmul and attention rates, the peak and the HBM bandwidth), NVLink, the network, PCIe."""
KERNEL_RATES = ("flops", "fp32_flops", "matmul_flops", "attention_flops", "hbm_bw")


def scaled(cluster: Cluster, **factors: float) -> Cluster:
    """``cluster`` with each knob of ``KNOBS`` multiplied by its factor (``kernels`` scales
    every rate of ``KERNEL_RATES`` together). A scaled matmul rate
    may exceed the peak here: the box moves a model input, not the hardware."""
    changes = {}
    for knob, f in factors.items():
        validate.one_of("knob", knob, KNOBS)
        validate.positive_number(knob, f)
        names = KERNEL_RATES if knob == "kernels" else (knob,)
        for name in names:
            changes[name] = getattr(cluster, name) * f
    return _unchecked(cluster, changes)


def _unchecked(cluster: Cluster, changes: dict) -> Cluster:
    """A copy with ``changes`` set without ``__post_init__`` (a scaled matmul rate may pass the peak)."""
    new = object.__new__(Cluster)
    for f in fields(Cluster):
        object.__setattr__(new, f.name, changes.get(f.name, getattr(cluster, f.name)))
    return new
