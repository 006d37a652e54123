"""Bytes per GPU of data-parallel training, by consumer, under ZeRO stages 0–3.

The arithmetic behind the calculator widget (``labkit.widgets``) and the book's tables.  It is
infrastructure, not an exercise: the widget must work before anyone has written Lab 1.

Static state.  A recipe fixes the bytes per parameter of the parameters, the gradients, an
fp32 master copy and each optimizer moment; the optimizer fixes how many moments there are.
Mixed-precision Adam keeps 2 + 2 + (4 + 4 + 4) = 16 bytes per parameter, so Ψ = 100B needs
16Ψ = 1.6 TB before any activation (Rajbhandari et al. 2019, https://arxiv.org/abs/1910.02054).
ZeRO shards that state over the N data-parallel ranks:

=========  ====================================  ======================  ====================
stage      parameters                            gradients               optimizer states
=========  ====================================  ======================  ====================
0 (DDP)    2Ψ                                    2Ψ                      12Ψ
1          2Ψ                                    2Ψ                      12Ψ/N
2          2Ψ                                    2Ψ/N                    12Ψ/N
3          2Ψ/N                                  2Ψ/N                    12Ψ/N
=========  ====================================  ======================  ====================

(the mixed-precision Adam numbers; ZeRO-2 is 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N).  For Ψ = 100B on 64
GPUs ZeRO-1 leaves 12Ψ/64 = 18.75 GB ≈ 19 GB of optimizer state per GPU.

Frameworks keep more than the 16 bytes.  ``grad_buffer`` adds a persistent fp32 gradient
buffer: Megatron-LM's ``main_grad`` replaces the 16-bit gradients (``"fp32"``: 18 bytes per
parameter with mixed-precision Adam), DeepSpeed keeps both (``"16bit+fp32"``: 20 bytes).  The
buffer is a gradient and is sharded with the gradients.

Activations.  Korthikanti et al. 2022 (https://arxiv.org/abs/2205.05198) count
s·b·h·(34 + 5·a·s/h) bytes per GPT-3-style layer with 16-bit activations and 1-byte dropout
masks; ``activation_bytes_per_layer`` keeps the masks at one byte and scales the other tensors
with the element size.  Data parallelism and
ZeRO do not shard activations: each GPU keeps those of its own micro-batch.  The output layer
comes on top: with ``fp32_logits=True`` the logits, cast to fp32 for a stable softmax
cross-entropy, add 4·s·b·V bytes (V = ``vocab_size``), more than several layers at a large
vocabulary.

Chapter: book/01_where_the_memory_goes.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from labkit import validate

CONSUMERS = ("parameters", "gradients", "optimizer states", "activations")
"""The four consumers, in the order the calculator stacks them."""


@dataclass(frozen=True)
class Recipe:
    """Bytes per element of each kind of state under one precision recipe."""

    label: str
    parameter: int
    """Bytes of one parameter as the model computes with it."""
    gradient: int
    master: int
    """Bytes of the fp32 master copy of one parameter (0: no master copy)."""
    moment: int
    """Bytes of one optimizer moment (m or v) of one parameter."""
    activation: int
    """Bytes of one activation element."""


RECIPES = {
    "mixed": Recipe("mixed: fp16/bf16 + fp32 master, m, v (2 + 2 + 12)", 2, 2, 4, 4, 2),
    "fp32": Recipe("fp32 everywhere (4 + 4 + 8)", 4, 4, 0, 4, 4),
    "bf16-fp32-moments": Recipe("bf16, fp32 moments (2 + 2 + 8)", 2, 2, 0, 4, 2),
    "bf16": Recipe("bf16 everywhere, moments too (2 + 2 + 4)", 2, 2, 0, 2, 2),
}
"""Precision recipes by name; the bytes in each label are for Adam."""

OPTIMIZERS = {
    "adam": "Adam / AdamW: moments m and v",
    "sgd": "SGD: no state",
    "sgd-momentum": "SGD with momentum: one moment",
    "adafactor": "Adafactor: factored second moment, O(m+n) ≈ 0 per parameter",
    "adam8bit": "8-bit Adam: m and v in 1 byte each + an fp32 scale per 256 values",
}
"""Optimizers by name."""

ADAM8BIT_BLOCK = 256
ZERO_STAGES = (0, 1, 2, 3)

GRAD_BUFFERS = {
    "none": "gradients in the parameters' dtype",
    "fp32": "fp32 main_grad instead (Megatron-LM)",
    "16bit+fp32": "16-bit gradients + an fp32 copy (DeepSpeed)",
}
"""Where the gradients live, by name (see ``labkit.lab1.accounting.GRAD_BUFFERS``)."""


def _choice(name: str, value, allowed) -> None:
    validate.one_of(name, value, tuple(allowed))


def _positive(name: str, value, kind=int) -> None:
    if kind is float:
        validate.positive_number(name, value)
    else:
        validate.positive_int(name, value)


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):  # ValueError, as the calculator's other checks
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


def bytes_per_parameter(recipe: str = "mixed", optimizer: str = "adam",
                        grad_buffer: str = "none") -> dict[str, float]:
    """Bytes per parameter of parameters, gradients and optimizer states (master copy included).

    >>> bytes_per_parameter("mixed", "adam")
    {'parameters': 2, 'gradients': 2, 'optimizer states': 12}
    >>> bytes_per_parameter("mixed", "adam", "fp32")["gradients"]  # Megatron's main_grad
    4
    """
    _choice("recipe", recipe, RECIPES)
    _choice("optimizer", optimizer, OPTIMIZERS)
    _choice("grad_buffer", grad_buffer, GRAD_BUFFERS)
    return dict(_bytes_per_parameter(recipe, optimizer, grad_buffer))


@functools.lru_cache(maxsize=None)
def _bytes_per_parameter(recipe: str, optimizer: str, grad_buffer: str) -> tuple:
    """``bytes_per_parameter`` of checked arguments, cached: planners call it for every configuration."""
    r = RECIPES[recipe]
    states = {"adam": 2 * r.moment, "sgd": 0, "sgd-momentum": r.moment, "adafactor": 0,
              "adam8bit": 2 + 2 * 4 / ADAM8BIT_BLOCK}[optimizer]
    gradient = {"none": r.gradient, "fp32": 4, "16bit+fp32": r.gradient + 4}[grad_buffer]
    return (("parameters", r.parameter), ("gradients", gradient), ("optimizer states", r.master + states))


def static_bytes_per_gpu(n_params: float, recipe: str = "mixed", optimizer: str = "adam",
                         zero_stage: int = 0, world_size: int = 1,
                         grad_buffer: str = "none") -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer states on one of ``world_size`` GPUs.

    ZeRO stage 1 shards the optimizer states, stage 2 the gradients too, stage 3 the
    parameters too (``world_size`` = N data-parallel ranks; stage 0 is plain data parallelism).
    """
    _positive("n_params", n_params, float)
    _choice("zero_stage", zero_stage, ZERO_STAGES)
    _positive("world_size", world_size)
    per = bytes_per_parameter(recipe, optimizer, grad_buffer)
    sharded = {"optimizer states": zero_stage >= 1, "gradients": zero_stage >= 2,
               "parameters": zero_stage >= 3}
    return {c: n_params * k / (world_size if sharded[c] else 1) for c, k in per.items()}


def activation_bytes_per_layer(seq_len: int, batch_size: int, hidden: int, n_head: int,
                               element_bytes: int = 2) -> int:
    """Activation bytes of one GPT-3-style layer (Korthikanti et al. 2022, no recomputation).

    16-bit activations (``element_bytes=2``) give their s·b·h·(34 + 5·a·s/h): the tensors are
    16·s·b·h + 2·a·s²·b elements and the three dropout masks 2·s·b·h + a·s²·b bytes.
    """
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("hidden", hidden),
                        ("n_head", n_head), ("element_bytes", element_bytes)):
        _positive(name, value)
    if hidden % n_head:
        raise ValueError(f"n_head={n_head} must divide hidden={hidden}")
    s, b, h, a, e = seq_len, batch_size, hidden, n_head, element_bytes
    return s * b * h * (16 * e + 2) + a * s * s * b * (2 * e + 1)


def logits_bytes(seq_len: int, batch_size: int, vocab_size: int) -> int:
    """Bytes of the output logits kept in fp32 for the loss: 4·s·b·V."""
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size),
                        ("vocab_size", vocab_size)):
        _positive(name, value)
    return 4 * seq_len * batch_size * vocab_size


def per_gpu_bytes(n_params: float, recipe: str = "mixed", optimizer: str = "adam",
                  zero_stage: int = 0, world_size: int = 1, *, n_layer: int, hidden: int,
                  n_head: int, batch_size: int, seq_len: int, grad_buffer: str = "none",
                  vocab_size: int = 50257, fp32_logits: bool = False) -> dict[str, float]:
    """Bytes per GPU of the four consumers (keys: ``CONSUMERS``) for data-parallel training.

    ``batch_size`` is the micro-batch of one GPU; activations are not sharded by ZeRO.
    ``grad_buffer`` (``GRAD_BUFFERS``) adds a persistent fp32 gradient buffer;
    ``fp32_logits`` adds the fp32 logits of the output layer (``logits_bytes``) to the
    activations.
    """
    _positive("n_layer", n_layer)
    _flag("fp32_logits", fp32_logits)
    logits = logits_bytes(seq_len, batch_size, vocab_size)  # checks vocab_size either way
    out = static_bytes_per_gpu(n_params, recipe, optimizer, zero_stage, world_size, grad_buffer)
    out["activations"] = n_layer * activation_bytes_per_layer(
        seq_len, batch_size, hidden, n_head, RECIPES[recipe].activation)
    if fp32_logits:
        out["activations"] += logits
    return out
