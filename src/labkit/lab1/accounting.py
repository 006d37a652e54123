"""Where the memory goes: count the bytes of a training step before running it.

Four consumers share a GPU in training: the **parameters** (alive for the whole run), their
**gradients** (born in backward, dead after the update), the **optimizer states** (born at the
first update, alive from then on) and the **activations** (born in forward, kept until backward
has used them).  This module predicts each of them for the course's GPT from its config alone,
so that Lab 1 can hold the prediction against what ``labkit.measure`` sees in a real step:

* ``count_params``: Ψ of a ``GPTConfig`` in closed form, exact;
* ``static_bytes``: parameters, gradients and optimizer states for a precision recipe, an
  optimizer and a gradient buffer (mixed-precision Adam is the "16Ψ" of the ZeRO paper);
* ``activation_bytes``: what the forward pass leaves alive for backward, counted op by op;
* ``korthikanti_activation_bytes``: the per-layer count of Korthikanti et al. 2022
  (https://arxiv.org/abs/2205.05198) for a GPT-3-style block, for any element size, with or
  without dropout;
* ``predict_peak``: the largest total of one real training step.

Chapter: book/01_where_the_memory_goes.md.  Lab: labs/01_where_the_memory_goes.ipynb.
"""
from __future__ import annotations

import torch

from labkit.measure import StepMemory
from labkit.models import GPTConfig
from labkit.validate import boolean, non_negative_int, number, one_of, positive_int

# ==== given: the course's code — read it, call it, don't change it ====

RECIPES = ("fp32", "mixed", "bf16-fp32-moments", "bf16")
"""Precision recipes: the dtype of each kind of state.

* ``"fp32"``: parameters, gradients and optimizer moments in fp32; no master copy (the
  parameters are their own master).
* ``"mixed"``: fp16 or bf16 parameters and gradients, an fp32 master copy of the weights and
  fp32 optimizer moments.  The master copy is counted with the optimizer states, as the ZeRO
  paper does, whatever the optimizer (SGD included).
* ``"bf16-fp32-moments"``: bf16 parameters and gradients, fp32 moments, no master copy.
* ``"bf16"``: bf16 everywhere, moments included (what ``torch.optim`` does with bf16
  parameters: its states take the parameter's dtype).
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
* ``"adam8bit"``: m and v quantized to one byte per value, in blocks of ``ADAM8BIT_BLOCK``
  consecutive values of the whole flattened model (a last block may be partial), each block
  of each moment with one fp32 absolute maximum (bitsandbytes ``Adam8bit``, Dettmers et al.
  2021, https://arxiv.org/abs/2110.02861).  bitsandbytes also keeps 32-bit states for tensors
  of fewer than 4096 values and two 256-entry code tables, which this per-parameter
  convention leaves out.
"""

GRAD_BUFFERS = ("none", "fp32", "16bit+fp32")
"""Where the gradients live, a choice of the training framework:

* ``"none"``: one gradient per parameter, in the parameters' dtype (plain PyTorch);
* ``"fp32"``: a persistent fp32 gradient buffer that backward accumulates into, instead of
  16-bit gradients (Megatron-LM's ``main_grad``);
* ``"16bit+fp32"``: the gradients in the parameters' dtype *and* an fp32 copy of them for the
  update (DeepSpeed's fp32 gradient partitions). Under every recipe: under ``"fp32"`` the copy
  duplicates gradients that are fp32 already, and the buffer costs 4 + 4 bytes per parameter.

Both buffers count as gradients.  With mixed-precision Adam they make the 16 bytes per
parameter 18 and 20, what frameworks report in practice."""

ADAM8BIT_BLOCK = 256
"""Values per quantization block of 8-bit Adam's states (bitsandbytes' block-wise default)."""

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes ``activation_bytes`` supports: the dtype of the whole model (``model.to(dtype)``)."""


# Argument checks: ``labkit.validate`` (``positive_int``, ``one_of``, ``boolean``, ...) and the one
# below; each raises a ValueError/TypeError that names the argument and what is allowed.

def check_model_config(cfg: GPTConfig) -> None:
    """Raise ValueError unless ``cfg`` is a valid ``GPTConfig`` (positive sizes, n_head | n_embd)."""
    if not isinstance(cfg, GPTConfig):
        raise ValueError(f"cfg must be a labkit.models.GPTConfig, got {type(cfg).__name__}")
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        positive_int(f"cfg.{name}", getattr(cfg, name))
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"cfg.n_head={cfg.n_head} must divide cfg.n_embd={cfg.n_embd}; "
                         f"allowed: the divisors of {cfg.n_embd}")


def measured_activation_bytes(step: StepMemory) -> int:
    """Activation bytes alive when backward begins in a measured step: what ``activation_bytes``
    predicts.  Read from the timeline at the last operator before the first backward operator.
    """
    if not isinstance(step, StepMemory):
        raise ValueError(f"step must be a labkit.measure.StepMemory (from measure_step), "
                         f"got {type(step).__name__}")
    first = next((i for i, p in enumerate(step.timeline) if p.phase == "backward"), None)
    if not first:
        raise ValueError("step has no backward phase after a forward phase")
    return step.timeline[first - 1].bytes["activations"]


# ==== exercise 1.1, 1.2, 1.3, 1.4, 1.5: your code ====

def count_params(cfg: GPTConfig) -> int:
    """Ψ, the number of parameters of ``GPT(cfg)``, in closed form (no model is built).

    Every parameter tensor of the model counts once: a weight shared by two modules is one
    tensor.  Read ``labkit/models.py`` for the layers and what ``cfg.bias`` changes.

    Args:
        cfg: the model's ``GPTConfig``.
    Returns:
        the exact ``sum(p.numel() for p in GPT(cfg).parameters())``.
    Raises:
        ValueError: for an invalid config (non-positive sizes, n_head not dividing n_embd).
    """
    raise NotImplementedError("exercise 1.1: count every parameter tensor of GPT(cfg) from the config alone (labs/01_where_the_memory_goes.ipynb)")


def static_bytes(n_params: int, recipe: str = "mixed", optimizer: str = "adam",
                 grad_buffer: str = "none") -> dict[str, int]:
    """Bytes of the state that lives across steps: parameters, gradients, optimizer states.

    ``RECIPES``, ``OPTIMIZERS`` and ``GRAD_BUFFERS`` say what each name keeps and in which
    dtype; the bytes follow from the dtypes.  Counters such as Adam's ``step`` are not counted.
    Exact integer arithmetic: the result is exact for any Ψ, 100 billion included.

    Args:
        n_params: Ψ, a non-negative int.
        recipe: one of ``RECIPES``.
        optimizer: one of ``OPTIMIZERS``.
        grad_buffer: one of ``GRAD_BUFFERS``.
    Returns:
        ``{"parameters": bytes, "gradients": bytes, "optimizer states": bytes}`` (ints).
    Raises:
        ValueError: naming the argument and its allowed values, before any work.
    """
    raise NotImplementedError("exercise 1.2: bytes of each consumer from the dtypes the recipe, optimizer and buffer imply (labs/01_where_the_memory_goes.ipynb)")


def activation_bytes(cfg: GPTConfig, batch_size: int, seq_len: int,
                     dtype: torch.dtype = torch.float32) -> int:
    """Bytes of activations alive when backward begins: what the forward pass kept for it.

    Counted for the course's GPT from its config alone, operator by operator, for a model
    whose floating-point tensors are all ``dtype`` (``model.to(dtype)``); integer and bool
    tensors keep their own sizes.  The result must equal, to within a few bytes,
    ``measured_activation_bytes(measure_step(model, None, batch))``: every tensor that
    MemTracker counts as an activation at the last operator before backward starts (what
    autograd saved, plus whatever else the forward pass left alive, the loss included).

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
                                 n_layer: int = 1, *, element_bytes: int = 2,
                                 dropout: bool = True) -> int:
    """Activation bytes of ``n_layer`` GPT-3-style blocks, as Korthikanti et al. 2022 count them.

    With the paper's assumptions (``element_bytes=2``: 16-bit activations; ``dropout=True``:
    the three dropout layers of a block, with 1-byte masks) the result is their eq. (1) times
    L: s·b·h·(34 + 5·a·s/h) bytes per layer.  The other settings keep the same list of stored
    tensors (§4.1 of "Reducing Activation Recomputation in Large Transformer Models",
    https://arxiv.org/abs/2205.05198): ``element_bytes`` is the size of one activation element
    (a dropout mask stays one byte per element), and ``dropout=False`` removes whatever exists
    only because of dropout.  Exact integer arithmetic.

    Args:
        seq_len: s; batch_size: b; hidden: h; n_head: a (must divide h); n_layer: L.  All ints ≥ 1.
        element_bytes: bytes of one activation element, 1, 2, 4 or 8.
        dropout: whether the blocks have dropout (a bool).
    Returns:
        bytes (int).
    Raises:
        ValueError: naming the argument and its allowed values, before any work.
    """
    raise NotImplementedError("exercise 1.4: sort the paper's stored tensors into masks, activations and dropout-only ones (labs/01_where_the_memory_goes.ipynb)")


def predict_peak(cfg: GPTConfig, batch_size: int, seq_len: int, recipe: str = "fp32",
                 optimizer: str = "adam", step: int = 2) -> int:
    """The largest total bytes of training step number ``step`` (1, 2, ...).

    Two moments compete.  When backward begins, the parameters, the optimizer states left by
    earlier steps and all the activations are alive, and the first backward ops add the
    gradients of the log-probabilities and of the logits (B·T·vocab_size each).  At the update
    the activations are gone but every gradient and every state exists, plus the optimizer's
    working memory: ``torch.optim``'s single-tensor (for-loop) Adam holds two temporaries the
    size of the parameter tensor it is updating, Adafactor one, SGD and bitsandbytes' 8-bit Adam
    none, and while it updates a tensor the last temporary of the tensor before it (in
    ``model.parameters()`` order) is still alive: Python frees it only when the loop assigns the
    new one.  States appear at the first update, so step 1 can fit where step 2 does not.

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
