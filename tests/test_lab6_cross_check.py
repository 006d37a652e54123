"""Labs 3–4's own implementations, measured on real gloo ranks, against the per-GPU memory model
of Chapter 6 (``labkit.lab6.parallel_memory``, exercise 6.4): infrastructure tests, not graded.

Issue 12 asks the model of a configuration to agree with the per-rank bytes of the course's
ZeRO-2 (exercise 4.3), ZeRO-3 (3.7), tensor parallelism (3.4) and the pipeline's stages (3.6)
within 5%. Those are exercise modules, so these checks run with the solutions
(``LABKIT_SOLUTIONS``); in a student's edition they skip until the student's Labs 3–4 are
written (6.4's own graders compare with PyTorch's implementations instead, and never need
Labs 3–4). The bytes are counted from the tensors each rank keeps after one fp32 Adam step
(``labkit.cross_check``), and the model is given the same Ψ and the fp32 recipe.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from labkit.models import GPT, GPTConfig, SyntheticData

TOLERANCE = 0.05  # the criterion; the reasons for each deviation are in each test


def needs_solutions(*names):
    """Skip when one of the exercise modules is still a stub (the student edition)."""
    import importlib

    for name in names:
        src = inspect.getsource(importlib.import_module(f"labkit.{name}"))
        if 'NotImplementedError("exercise' in src:
            pytest.skip(f"labkit.{name} is a stub: run with LABKIT_SOLUTIONS=solutions")


@pytest.fixture(scope="module")
def gpt():
    """A GPT whose blocks dominate its parameters (embeddings 3% of Ψ = 206,208)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=64)
    model = GPT(cfg)
    return cfg, model, sum(p.numel() for p in model.parameters())


def _compare(got, want, what, cause):
    for rank, g in enumerate(got):
        for c, w in want.items():
            assert abs(g[c] - w) <= TOLERANCE * w, (
                f"rank {rank}: {what} keeps {g[c]:,} B of {c}, labkit.lab6.parallel_memory predicts "
                f"{w:,.0f} B ({g[c] / w:.4f} ×, more than {TOLERANCE:.0%} off): {cause}")


def test_zero2_keeps_what_the_model_predicts(gpt):
    """ZeRO2Adam on 4 ranks: 4Ψ of parameters, 4Ψ/N of gradients, 8Ψ/N of Adam state per rank.
    Exact here (Ψ is a multiple of N: no padding); the flat partition pads at most N − 1
    elements otherwise."""
    needs_solutions("lab4.zero2", "lab6.parallel_memory")
    from labkit.cross_check import zero2_bytes
    from labkit.ranks import launch
    from labkit.lab6.parallel_memory import static_bytes

    _, model, psi = gpt
    n = 4
    batch = [SyntheticData(64, 32, 2, seed=r).batch(0) for r in range(n)]
    got = launch(zero2_bytes, n, model, batch, timeout=120.0)
    want = static_bytes(psi, world_size=n, dp=n, zero_stage=2, recipe="fp32")
    _compare(got, want, "ZeRO2Adam", "does stage 2 shard the gradients and states over D, and "
             "are the full gradients freed after their reduce-scatter?")


def test_zero3_keeps_what_the_model_predicts(gpt):
    """ZeRO3 on 4 ranks: 4Ψ/N of parameter shards (no gathered buffer left after the step),
    4Ψ/N of gradient slices after backward, 8Ψ/N of Adam state. Padding: at most N − 1
    elements per unit (none here)."""
    needs_solutions("lab3.zero3", "lab6.parallel_memory")
    from labkit.cross_check import zero3_bytes
    from labkit.ranks import launch
    from labkit.lab6.parallel_memory import static_bytes

    _, model, psi = gpt
    n = 4
    batch = [SyntheticData(64, 32, 2, seed=r).batch(0) for r in range(n)]
    got = launch(zero3_bytes, n, model, batch, timeout=120.0)
    want = static_bytes(psi, world_size=n, dp=n, zero_stage=3, recipe="fp32")
    _compare(got, want, "ZeRO3", "does stage 3 shard the parameters too, and is every "
             "gathered buffer freed after use?")


def test_tensor_parallelism_keeps_what_the_model_predicts(gpt):
    """TPAttention + TPMLP at T = 2: Ψ_block/T of parameters, gradients and 2× of Adam state per
    rank, where Ψ_block is the attention's and MLP's parameters. The row-parallel layers keep
    their whole bias on every rank: + 0.26% here."""
    needs_solutions("lab3.tensor_parallel", "lab6.parallel_memory")
    from labkit.cross_check import tensor_parallel_bytes
    from labkit.ranks import launch
    from labkit.lab6.parallel_memory import static_bytes

    _, model, _ = gpt
    got = launch(tensor_parallel_bytes, 2, model.h[0], torch.randn(2, 32, 64), timeout=120.0)
    want = static_bytes(got[0]["n_params"], world_size=2, tp=2, recipe="fp32")
    _compare(got, want, "the tensor-parallel block", "does T split every weight matrix?")


def test_pipeline_stages_keep_what_the_model_predicts(gpt):
    """Two pipeline stages of 2 blocks each: Ψ/P per stage within 5%. The model splits all
    parameters evenly; the real first stage also holds the embeddings (+2.9%) and the last the
    untied output layer (+1.1%), a rounding error at 100B but not at this size (at P = 4 the
    first stage is 9% over: this test stays at P = 2)."""
    needs_solutions("lab3.pipeline", "lab6.parallel_memory")
    from labkit.cross_check import pipeline_bytes
    from labkit.ranks import launch
    from labkit.lab6.parallel_memory import static_bytes

    cfg, model, psi = gpt
    x, y = SyntheticData(64, 32, 2).batch(0)
    got = launch(pipeline_bytes, 2, cfg, model.state_dict(), x, y, timeout=120.0)
    want = static_bytes(psi, world_size=2, pp=2, recipe="fp32")
    _compare(got, want, "the pipeline stage", "does P split the layers (Ψ/P per stage)?")


def test_storage_bytes_counts_each_storage_once():
    """Views of one storage count it once; a storage resized to 0 bytes counts 0; None skipped."""
    from labkit.cross_check import storage_bytes

    flat = torch.zeros(10)
    assert storage_bytes([flat[:4], flat[4:], None]) == 40
    assert storage_bytes([flat, torch.zeros(3, dtype=torch.float64)]) == 64
    freed = torch.zeros(5)
    freed.untyped_storage().resize_(0)
    assert storage_bytes([freed]) == 0
