"""The options of the demos of :mod:`labkit.cluster`, one dataclass per shape of run: each field
is a command-line option (``n_layer`` ← ``--n-layer``), filled from the command line, else the
demo's default, else the lab's sizes (:func:`labkit.cluster.cli.demo_options`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTSizes:
    """The course GPT's sizes and ``batch`` sequences of ``seq`` tokens."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq: int
    batch: int


@dataclass(frozen=True)
class GPTRun(GPTSizes):
    """The course GPT trained for ``steps`` steps on ``batch`` sequences per rank."""

    steps: int
    device: str


@dataclass(frozen=True)
class ZeRO2Run(GPTRun):
    bucket_kb: int = 25 * 1024  # DDP's 25 MiB buckets


@dataclass(frozen=True)
class PlanRun(GPTRun):
    config: str = "zero3"  # ZeRO-3 over every rank


@dataclass(frozen=True)
class PipelineRun(GPTSizes):
    """One step of the GPT cut into one stage per rank, ``microbatches`` micro-batches of ``batch``."""

    microbatches: int
    schedule: str
    device: str


@dataclass(frozen=True)
class LayerRun:
    """Forward and backward of one GPT layer (``layer``: "mlp" or "attn") on (batch, seq, n_embd)."""

    layer: str
    n_embd: int
    n_head: int
    seq: int
    batch: int
    device: str


@dataclass(frozen=True)
class BlockHalfRun:
    """x + MLP(LayerNorm(x)) on (batch, seq, n_embd)."""

    n_embd: int
    seq: int
    batch: int
    device: str


@dataclass(frozen=True)
class RingRun:
    """Attention over (batch, heads, seq, head_dim), the sequence split over the ranks."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool
    device: str
