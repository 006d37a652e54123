"""The per-GPU memory of a parallel configuration: D × T × P × C GPUs, ZeRO, precision, recompute.

``labkit.memory_model`` counts the bytes of one data-parallel GPU. A 100B-parameter run
combines four parallelisms on ``world_size = D × T × P × C`` GPUs (Chapter 6, the device mesh
of exercise 6.3), and each divides a different consumer:

* **Static state** (parameters, gradients, optimizer states; bytes per parameter from
  ``memory_model.bytes_per_parameter``). Tensor parallelism (T) splits every weight matrix
  and pipeline parallelism (P) splits the layers, so one GPU holds Ψ/(T·P) parameters (this
  model splits *all* parameters evenly: embeddings and LayerNorms are a rounding error at
  100B). ZeRO then shards that state over the ranks that hold the same weights: the D
  data-parallel ranks times the C context-parallel ranks (Megatron-LM's distributed optimizer
  shards over the DP×CP group; with C = 1 that is the N = D of the ZeRO paper). Stage 1
  shards the optimizer states, stage 2 the gradients too, stage 3 the parameters too:
  16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N with mixed-precision Adam.
* **Activations** (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198; e bytes per
  activation element, 1-byte dropout masks; e = 2 gives the paper's numbers). Per layer and
  micro-batch of b sequences of s tokens, hidden h, a heads:
  - no recomputation: the parts TP does not split (LayerNorm inputs, the inputs of the QKV
    and first MLP matmuls, two dropout masks: (4e + 2)·sbh) plus the parts it splits
    (Q, K, V, the projection input, GELU in and out: 12e·sbh; scores, softmax-dropout mask
    and output: (2e + 1)·a·s²·b) divided by T. Sequence parallelism (SP) splits the first
    part by T as well. e = 2: sbh(10 + 24/T + 5as/(hT)), with SP sbh(34 + 5as/h)/T.
  - selective recomputation drops the a·s² terms (the attention core is recomputed).
  - full recomputation keeps only each layer's input, e·sbh (÷T with SP).
  Context parallelism gives each rank s/C tokens (the formulas with s → s/C: ring attention
  holds one (s/C)² block of scores at a time). With pipeline parallelism a GPU holds L/P layers;
  under 1F1B the first stage keeps min(P, m) micro-batches in flight (m micro-batches per
  step); without pipelining the micro-batches run one after another: one in flight.
  Embedding and logits activations are not counted.

Chapter 6 (book/06_system.md); Lab 6, exercise 6.4 (labs/06_system.ipynb).
"""
from __future__ import annotations

import math

import torch

from labkit.memory_model import CONSUMERS, OPTIMIZERS, RECIPES, ZERO_STAGES, bytes_per_parameter

CHECKPOINTING = ("none", "selective", "full")
"""Activation recomputation: none, selective (the attention core), full (every layer)."""


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_config(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> None:
    """Validate a parallel layout: positive ints whose product D·T·P·C is ``world_size``."""
    for name, value in (("world_size", world_size), ("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        _positive_int(name, value)
    if dp * tp * pp * cp != world_size:
        raise ValueError(f"dp·tp·pp·cp = {dp}·{tp}·{pp}·{cp} = {dp * tp * pp * cp} "
                         f"must equal world_size = {world_size}")


def static_bytes(n_params: float, *, world_size: int, dp: int = 1, tp: int = 1, pp: int = 1,
                 cp: int = 1, zero_stage: int = 0, recipe: str = "mixed",
                 optimizer: str = "adam") -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer states on one GPU of the configuration.

    Returns ``{"parameters", "gradients", "optimizer states"}`` in bytes (floats): the
    parameters one GPU holds after tensor and pipeline parallelism, with the consumers that
    ZeRO stage ``zero_stage`` shards divided among the ranks that hold the same weights
    (the module docstring says which). Raises ``ValueError`` for bad input before any work.
    """
    if isinstance(n_params, bool) or not isinstance(n_params, (int, float)) or n_params <= 0:
        raise ValueError(f"n_params must be a positive number, got {n_params!r}")
    check_config(world_size, dp, tp, pp, cp)
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    per = bytes_per_parameter(recipe, optimizer)  # raises for an unknown recipe or optimizer
    # BEGIN SOLUTION 6.4: this GPU's bytes of each static consumer
    local = n_params / (tp * pp)
    n = dp * cp
    sharded = {"optimizer states": zero_stage >= 1, "gradients": zero_stage >= 2,
               "parameters": zero_stage >= 3}
    return {c: local * k / (n if sharded[c] else 1) for c, k in per.items()}
    # END SOLUTION


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, n_head: int, *,
                               tp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                               checkpointing: str = "none", element_bytes: int = 2) -> float:
    """Activation bytes one GPU keeps for one transformer layer and one micro-batch.

    ``tp`` and ``cp`` are the tensor- and context-parallel sizes; ``element_bytes`` the bytes
    of one activation element (dropout masks are 1 byte). With ``tp=cp=1``,
    ``checkpointing="none"`` this equals ``memory_model.activation_bytes_per_layer``.
    Raises ``ValueError`` if tp does not divide n_head, cp does not divide seq_len, or an
    argument is out of range.
    """
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("hidden", hidden),
                        ("n_head", n_head), ("tp", tp), ("cp", cp), ("element_bytes", element_bytes)):
        _positive_int(name, value)
    if hidden % n_head:
        raise ValueError(f"n_head={n_head} must divide hidden={hidden}")
    if n_head % tp:
        raise ValueError(f"tp={tp} must divide n_head={n_head} (each rank keeps whole heads)")
    if seq_len % cp:
        raise ValueError(f"cp={cp} must divide seq_len={seq_len}")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    # BEGIN SOLUTION 6.4: the bytes one layer keeps for backward on this GPU
    s, b, h, a, e = seq_len // cp, micro_batch, hidden, n_head, element_bytes
    sbh = s * b * h
    unsplit = sbh * e if checkpointing == "full" else sbh * (4 * e + 2)
    if checkpointing == "full":
        return unsplit / tp if sequence_parallel else unsplit
    split = sbh * 12 * e
    if checkpointing == "none":
        split += a * s * s * b * (2 * e + 1)
    return (unsplit + split) / tp if sequence_parallel else unsplit + split / tp
    # END SOLUTION


def per_gpu_bytes(n_params: float, *, world_size: int, dp: int = 1, tp: int = 1, pp: int = 1,
                  cp: int = 1, zero_stage: int = 0, recipe: str = "mixed", optimizer: str = "adam",
                  n_layer: int, hidden: int, n_head: int, seq_len: int, micro_batch: int,
                  n_micro: int = 1, checkpointing: str = "none",
                  sequence_parallel: bool = False) -> dict[str, float]:
    """Bytes of the four consumers (keys ``memory_model.CONSUMERS``) on the busiest GPU.

    Static state from ``static_bytes``; activations of the first pipeline stage: its layers
    times the micro-batches it holds at once (the module docstring's schedule) times
    ``activation_bytes_per_layer``. Raises ``ValueError`` (pp not dividing n_layer, a layout
    whose product is not world_size, ...) before any work.
    """
    _positive_int("n_layer", n_layer)
    _positive_int("n_micro", n_micro)
    check_config(world_size, dp, tp, pp, cp)
    if n_layer % pp:
        raise ValueError(f"pp={pp} must divide n_layer={n_layer}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {tuple(RECIPES)}, got {recipe!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {optimizer!r}")
    per_layer = activation_bytes_per_layer(seq_len, micro_batch, hidden, n_head, tp=tp, cp=cp,
                                           sequence_parallel=sequence_parallel,
                                           checkpointing=checkpointing,
                                           element_bytes=RECIPES[recipe].activation)
    out = static_bytes(n_params, world_size=world_size, dp=dp, tp=tp, pp=pp, cp=cp,
                       zero_stage=zero_stage, recipe=recipe, optimizer=optimizer)
    # BEGIN SOLUTION 6.4: the activations of the busiest GPU, added to out
    in_flight = min(pp, n_micro)
    out["activations"] = (n_layer // pp) * in_flight * per_layer
    return out
    # END SOLUTION



# ---------------------------------------------------------------- per-rank workers (infrastructure)

def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def fsdp2_step(rank: int, world_size: int, model: torch.nn.Module, batch) -> dict:
    """One Adam step of ``model`` under FSDP2 ``fully_shard`` (ZeRO-3) on ``world_size`` gloo ranks.

    Every block and then the root are sharded over a 1-D CPU mesh. Returns this rank's bytes
    of parameters, gradients and optimizer states (the local shards of the DTensors; Adam's
    step counters excluded) after the step, before ``zero_grad``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch
    model(x, y).backward()
    opt.step()
    params = list(model.parameters())
    states = [v for st in opt.state.values() for k, v in st.items()
              if k != "step" and isinstance(v, torch.Tensor)]
    return {"parameters": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer states": sum(_local_bytes(v) for v in states)}


def tensor_parallel_mlp_step(rank: int, world_size: int, model: torch.nn.Module, x: torch.Tensor) -> dict:
    """One Adam step of the MLPs of ``model``'s blocks under tensor parallelism on gloo ranks.

    ``parallelize_module`` shards each block's ``mlp.c_fc`` column-wise and ``mlp.c_proj``
    row-wise (Megatron's MLP: one all-reduce in forward) over a 1-D CPU mesh of ``world_size``;
    the MLPs run on the hidden states ``x`` (the same on every rank) and take one Adam step.
    Returns this rank's bytes of the MLPs' parameters, gradients and optimizer states (local
    shards; Adam's step counters excluded) and the number of MLP parameters.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world_size,))
    mlps = [block.mlp for block in model.h]
    n_params = sum(p.numel() for m in mlps for p in m.parameters())
    for mlp in mlps:
        parallelize_module(mlp, mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    params = [p for m in mlps for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    h = x
    for mlp in mlps:
        h = h + mlp(h)
    h.pow(2).mean().backward()
    opt.step()
    states = [v for st in opt.state.values() for k, v in st.items()
              if k != "step" and isinstance(v, torch.Tensor)]
    return {"n_params": n_params,
            "parameters": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer states": sum(_local_bytes(v) for v in states)}
