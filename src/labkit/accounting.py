"""Where the memory goes: count the bytes of a training step before running it.

Four consumers share a GPU in training: the **parameters** (alive for the whole run), their
**gradients** (born in backward, dead after the update), the **optimizer states** (born at the
first update, alive from then on) and the **activations** (born in forward, kept until backward
has used them).  This module predicts each of them for the course's GPT from its config alone,
so that Lab 1 can hold the prediction against what ``labkit.measure`` sees in a real step:

* ``count_params``: Ψ of a ``GPTConfig`` in closed form (12·n_embd² + 13·n_embd per block);
* ``static_bytes``: parameters, gradients and optimizer states for a precision recipe and an
  optimizer (mixed-precision Adam: 2 + 2 + 12 = 16 bytes per parameter, the "16Ψ");
* ``activation_bytes``: what the forward pass leaves alive for backward, counted op by op;
* ``korthikanti_activation_bytes``: the per-layer formula s·b·h·(34 + 5·a·s/h) of
  Korthikanti et al. 2022 (https://arxiv.org/abs/2205.05198) for a GPT-3-style block;
* ``predict_peak``: the largest total of one real training step.

Chapter: book/01_where_the_memory_goes.md.  Lab: labs/01_where_the_memory_goes.ipynb.
"""
from __future__ import annotations

import math

import torch

from labkit.measure import StepMemory
from labkit.models import GPTConfig

RECIPES = ("fp32", "mixed", "bf16-fp32-moments", "bf16")
"""Precision recipes, with the bytes per parameter of (parameters, gradients, optimizer states)
under Adam:

* ``"fp32"``: everything in fp32: 4 + 4 + 8 = 16.
* ``"mixed"``: fp16 or bf16 parameters and gradients, plus fp32 master weights and fp32 Adam
  moments, the master weights counted with the optimizer states as ZeRO (and the book's source
  article) do: 2 + 2 + (4 + 4 + 4) = 16.
* ``"bf16-fp32-moments"``: bf16 parameters and gradients, fp32 moments, no master copy:
  2 + 2 + 8 = 12 (texts that quote "10 bytes per parameter" leave the gradients out).
* ``"bf16"``: bf16 everywhere, states included (what ``torch.optim`` does with bf16
  parameters: its states take the parameter's dtype): 2 + 2 + 4 = 8.
"""

PREDICTABLE_RECIPES = ("fp32", "bf16")
"""The recipes that a plain PyTorch step realises (``model.to(dtype)`` and a ``torch.optim``
optimizer), so ``predict_peak`` can be held against a measurement.  The master-weight recipes
need a training loop of their own (Chapter 3)."""

OPTIMIZERS = ("adam", "sgd", "sgd-momentum", "adafactor", "adam8bit")
"""Optimizers, with the state each keeps per parameter:

* ``"adam"``: first and second moments m and v (``torch.optim.Adam``; also AdamW);
* ``"sgd"``: nothing (``torch.optim.SGD(momentum=0)``);
* ``"sgd-momentum"``: one momentum buffer (``torch.optim.SGD(momentum=0.9)``);
* ``"adafactor"``: a factored second moment, one row and one column statistic per matrix,
  O(m + n) for an m×n matrix (``torch.optim.Adafactor``, Shazeer & Stern 2018,
  https://arxiv.org/abs/1804.04235).  Counted here as 0 bytes per parameter: for the matrices
  that hold nearly every parameter it is a fraction 1/m + 1/n of one state. Lab 2 counts it
  exactly;
* ``"adam8bit"``: m and v quantized to 8 bits in blocks of ``ADAM8BIT_BLOCK`` values, one fp32
  absolute maximum per block for each (bitsandbytes ``Adam8bit``, Dettmers et al. 2021,
  https://arxiv.org/abs/2110.02861): 2·Ψ + 2·4·⌈Ψ/256⌉ bytes.  bitsandbytes also keeps
  32-bit states for tensors of fewer than 4096 values and two 256-entry code tables, which this
  per-parameter convention leaves out.
"""

ADAM8BIT_BLOCK = 256
"""Values per quantization block of 8-bit Adam's states (bitsandbytes' block-wise default)."""

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes ``activation_bytes`` supports: the dtype of the whole model (``model.to(dtype)``)."""


# ---------------------------------------------------------------- checks you can call

def check_choice(name: str, value, allowed: tuple) -> None:
    """Raise ValueError naming the argument and the allowed values unless ``value in allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_positive_int(name: str, value) -> None:
    """Raise ValueError naming the argument unless ``value`` is an int ≥ 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_model_config(cfg: GPTConfig) -> None:
    """Raise ValueError unless ``cfg`` is a valid ``GPTConfig`` (positive sizes, n_head | n_embd)."""
    if not isinstance(cfg, GPTConfig):
        raise ValueError(f"cfg must be a labkit.models.GPTConfig, got {type(cfg).__name__}")
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        check_positive_int(f"cfg.{name}", getattr(cfg, name))
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"cfg.n_head={cfg.n_head} must divide cfg.n_embd={cfg.n_embd}; "
                         f"allowed: the divisors of {cfg.n_embd}")


def measured_activation_bytes(step: StepMemory) -> int:
    """Activation bytes alive when backward begins in a measured step: what ``activation_bytes``
    predicts.  Read from the timeline at the last operator before the first backward operator.
    """
    first = next((i for i, p in enumerate(step.timeline) if p.phase == "backward"), None)
    if not first:
        raise ValueError("step has no backward phase after a forward phase")
    return step.timeline[first - 1].bytes["activations"]


# ---------------------------------------------------------------- exercises

def count_params(cfg: GPTConfig) -> int:
    """Ψ, the number of parameters of ``GPT(cfg)``, in closed form.

    The token embedding (vocab_size × n_embd) is shared with the output head, so it counts
    once; the position embedding is block_size × n_embd.  Each block holds two LayerNorms,
    the attention's fused qkv projection (n_embd → 3·n_embd) and output projection, and the
    MLP (n_embd → 4·n_embd → n_embd): 12·n_embd² + 13·n_embd with biases, 12·n_embd² + 2·n_embd
    without.  A final LayerNorm closes the stack.

    Args:
        cfg: the model's ``GPTConfig``.
    Returns:
        the exact ``sum(p.numel() for p in GPT(cfg).parameters())``.
    Raises:
        ValueError: for an invalid config (non-positive sizes, n_head not dividing n_embd).
    """
    raise NotImplementedError("exercise 1.1: count embeddings, 12·C² + 13·C per block (biases: cfg.bias), final LayerNorm (labs/01_where_the_memory_goes.ipynb)")


def static_bytes(n_params: int, recipe: str = "mixed", optimizer: str = "adam") -> dict[str, int]:
    """Bytes of the state that lives across steps: parameters, gradients, optimizer states.

    Mixed-precision Adam, the article's example, keeps 2 bytes of fp16/bf16 parameter,
    2 bytes of gradient and 12 bytes of fp32 optimizer state (master weight, m, v) per
    parameter: 16Ψ, 1.6 TB for Ψ = 100B before a single activation.  ``RECIPES`` and
    ``OPTIMIZERS`` say what each name counts; the master weights of ``"mixed"`` are counted
    with the optimizer states whatever the optimizer (SGD included).  Counters such as Adam's
    ``step`` are not counted.

    Args:
        n_params: Ψ, a non-negative int.
        recipe: one of ``RECIPES``.
        optimizer: one of ``OPTIMIZERS``.
    Returns:
        ``{"parameters": bytes, "gradients": bytes, "optimizer states": bytes}`` (ints).
    Raises:
        ValueError: naming the argument and its allowed values.
    """
    raise NotImplementedError("exercise 1.2: bytes per parameter of each consumer for the recipe, times n_params (labs/01_where_the_memory_goes.ipynb)")


def activation_bytes(cfg: GPTConfig, batch_size: int, seq_len: int,
                     dtype: torch.dtype = torch.float32) -> int:
    """Bytes of activations alive when backward begins: what the forward pass kept for it.

    Counted for the course's GPT op by op, in ``dtype`` (the model's dtype, ``model.to(dtype)``).
    With B = batch_size, T = seq_len, C = n_embd, a = n_head, each block keeps 16·B·T·C
    elements (LayerNorm inputs and outputs, the copies of q, k and v that the batched matmuls
    make, the attention output, the MLP's 4C-wide GELU input and output) plus the a·T×T
    softmax of naive attention per sequence, the norms' statistics and the causal mask.  The
    head keeps the log-probabilities (B·T·vocab_size).  The result is compared with
    ``measured_activation_bytes(measure_step(...))`` (MemTracker counts every tensor made in
    forward as an activation).

    Args:
        cfg: a ``GPTConfig`` with ``attention="naive"`` and ``dropout=0.0``.
        batch_size: B ≥ 1.
        seq_len: T, 1 ≤ T ≤ cfg.block_size.
        dtype: one of ``ACTIVATION_DTYPES``.
    Returns:
        bytes (int).
    Raises:
        ValueError: naming the argument and its allowed values.
    """
    raise NotImplementedError("exercise 1.3: add up, op by op, the tensors the forward pass leaves for backward (labs/01_where_the_memory_goes.ipynb)")


def korthikanti_activation_bytes(seq_len: int, batch_size: int, hidden: int, n_head: int,
                                 n_layer: int = 1) -> int:
    """Korthikanti et al. 2022's activation bytes of GPT-3-style blocks: s·b·h·(34 + 5·a·s/h) each.

    The count assumes 16-bit activations and 1-byte dropout masks and is already in bytes:
    per layer, 11·s·b·h + 5·a·s²·b in attention (QKV input, Q and K, V, softmax output, its
    dropout mask and output, projection input, dropout mask), 19·s·b·h in the MLP and 4·s·b·h
    in the two LayerNorms.  "Reducing Activation Recomputation in Large Transformer Models",
    https://arxiv.org/abs/2205.05198, eq. (1).

    Args:
        seq_len: s; batch_size: b; hidden: h; n_head: a (must divide h); n_layer: L.  All ints ≥ 1.
    Returns:
        L·(34·s·b·h + 5·a·s²·b) bytes (int).
    Raises:
        ValueError: naming the argument and its allowed values.
    """
    raise NotImplementedError("exercise 1.4: L·s·b·h·(34 + 5·a·s/h), in exact integer arithmetic (labs/01_where_the_memory_goes.ipynb)")


def predict_peak(cfg: GPTConfig, batch_size: int, seq_len: int, recipe: str = "fp32",
                 optimizer: str = "adam", step: int = 2) -> int:
    """The largest total bytes of training step number ``step`` (1, 2, ...).

    Two moments compete.  When backward begins, the parameters, the optimizer states left by
    earlier steps and all the activations are alive, and the first backward ops add the
    gradients of the log-probabilities and of the logits (B·T·vocab_size each).  At the update
    the activations are gone but every gradient and every state exists, plus the optimizer's
    working memory: ``torch.optim``'s single-tensor (for-loop) Adam holds two temporaries the
    size of the largest parameter, Adafactor one, SGD and bitsandbytes' 8-bit Adam none.  States
    appear at the first update, so step 1 can fit where step 2 does not.

    Args:
        cfg: as for ``activation_bytes``.
        batch_size, seq_len: as for ``activation_bytes``.
        recipe: one of ``PREDICTABLE_RECIPES`` (the model's dtype: fp32 or bf16).
        optimizer: one of ``OPTIMIZERS``, run with ``foreach=False`` where torch offers it.
        step: which step, an int ≥ 1.
    Returns:
        bytes (int), to compare with ``measure_step(..., steps=step)`` 's peak.
    Raises:
        ValueError: naming the argument and its allowed values.
    """
    raise NotImplementedError("exercise 1.5: the largest of three moments: backward begins, backward ends, the update (labs/01_where_the_memory_goes.ipynb)")
