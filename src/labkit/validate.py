"""Argument checks shared by every public function of the course (toolkit and labs).

One rule everywhere: bad input raises a ``ValueError`` (a wrong value) or ``TypeError`` (a wrong
kind of thing) that **names the argument and what is allowed**, before any work starts and before
any collective is entered, so a rank never waits on a peer that already failed. The checks follow
``torch.optim.Adam``'s where the course promises torch's behaviour (it refuses a negative lr, a β
outside [0, 1) and a negative ε or weight decay).

    from labkit.validate import positive_int, adam_args
    n_layers = positive_int("n_layers", n_layers)
    adam_args(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

An exercise module calls these outside the exercise blocks, so its first screen is the technique.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def is_number(x) -> bool:
    """An int or a float, not a bool (``True`` is an int to Python, never a learning rate here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_int(x) -> bool:
    """An int (Python's or numpy's integer types through ``__index__``), not a bool or a float."""
    if isinstance(x, bool) or isinstance(x, float):
        return False
    try:
        x.__index__()
    except (AttributeError, TypeError):
        return False
    return True


def positive_int(name: str, value) -> int:
    """``value`` as an int if it is an integer >= 1; else ValueError naming ``name``."""
    if not (is_int(value) and int(value) >= 1):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def non_negative_int(name: str, value) -> int:
    """``value`` as an int if it is an integer >= 0; else ValueError naming ``name``."""
    if not (is_int(value) and int(value) >= 0):
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def number(name: str, value, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float if it is a finite number in the stated range; else ValueError.

    ``low``/``high`` are inclusive unless ``low_open``/``high_open``: ``number("eps", eps, low=0)``
    is ε ≥ 0, ``number("beta", b, low=0, high=1, high_open=True)`` is β ∈ [0, 1).
    """
    ok = is_number(value) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
        where = f" in {lo or '(-inf'}, {hi or 'inf)'}" if (lo or hi) else ""
        raise ValueError(f"{name} must be a finite number{where}, got {value!r}")
    return float(value)


def positive_number(name: str, value) -> float:
    """A finite number > 0 (a bandwidth, a rate, a size in bytes per second)."""
    return number(name, value, low=0, low_open=True)


def non_negative_number(name: str, value) -> float:
    """A finite number >= 0 (a byte count, a learning rate, ε)."""
    return number(name, value, low=0)


def one_of(name: str, value, allowed: Iterable):
    """``value`` if it is one of ``allowed``; else ValueError listing them."""
    allowed = tuple(allowed)
    if not any(value == a and type(value) is type(a) for a in allowed):
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def boolean(name: str, value) -> bool:
    """A bool (not 1, not "yes"); else TypeError naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def tensor(name: str, value, *, floating: bool = False, ndim: int | None = None) -> torch.Tensor:
    """``value`` if it is a tensor (floating point, of ``ndim`` dimensions, when asked)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    return value


def process_group(name: str, value):
    """``value`` if it is None (the default group) or a ``torch.distributed.ProcessGroup``; else a
    TypeError naming ``name`` (a list of ranks or a backend name failed inside torch.distributed
    with "'list' object has no attribute ...")."""
    import torch.distributed as dist

    if value is not None and not (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        raise TypeError(f"{name} must be None (the default group) or a torch.distributed."
                        f"ProcessGroup (e.g. dist.new_group(ranks)), got {type(value).__name__}")
    return value


def adam_args(*, lr, betas, eps, weight_decay=0.0, n_betas: int = 2) -> None:
    """Refuse Adam hyperparameters ``torch.optim.Adam`` would refuse, naming the argument.

    ``n_betas=3`` for optimizers with a third β (CAME).
    """
    if not (is_number(lr) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == n_betas
            and all(is_number(b) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"betas must be {n_betas} numbers in [0, 1), got {betas!r}")
    if not (is_number(eps) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not (is_number(weight_decay) and math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")


def params(name: str, value) -> list:
    """An optimizer's ``params`` as a list: tensors, or dicts (param groups) with a "params" key.

    Refuses a single tensor (``torch.optim`` does too: it would iterate over its rows), an empty
    list, and anything that is neither, naming ``name``.
    """
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an iterable of tensors or of param-group dicts, got a "
                        "single Tensor (wrap it in a list: [tensor])")
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{name} must be an iterable of tensors or of param-group dicts, got "
                        f"{type(value).__name__}") from None
    if not items:
        raise ValueError(f"{name} is empty: the optimizer needs at least one parameter")
    for item in items:
        if isinstance(item, dict):
            if "params" not in item:
                raise ValueError(f"{name}: a param group must have a 'params' key, got keys "
                                 f"{sorted(item)}")
        elif not isinstance(item, torch.Tensor):
            raise TypeError(f"{name} must hold tensors or param-group dicts, got "
                            f"{type(item).__name__}")
    return items


def pair(name: str, value, *, optional_first: bool = False) -> tuple:
    """A pair of finite numbers >= 0 (``eps=(ε₁, ε₂)``); with ``optional_first``, ε₁ may be None."""
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise ValueError(f"{name} must be a pair (a tuple of two numbers >= 0"
                         f"{', the first may be None' if optional_first else ''}), got {value!r}")
    if not (optional_first and value[0] is None):
        non_negative_number(f"{name}[0]", value[0])
    non_negative_number(f"{name}[1]", value[1])
    return tuple(value)


def adafactor_args(*, lr, beta2_decay, eps, d, weight_decay) -> None:
    """Refuse what ``torch.optim.Adafactor`` refuses, naming the argument: lr >= 0, β₂ decay
    τ <= 0, eps = (ε₁ >= 0 or None, ε₂ >= 0), clipping threshold d >= 1, weight_decay >= 0."""
    non_negative_number("lr", lr)
    number("beta2_decay", beta2_decay, high=0)
    pair("eps", eps, optional_first=True)
    number("d (the clipping threshold)", d, low=1)
    non_negative_number("weight_decay", weight_decay)


def came_args(*, lr, betas, eps, d, weight_decay) -> None:
    """CAME's options: lr >= 0, betas = (β₁, β₂, β₃) in [0, 1), eps = (ε₁, ε₂) >= 0, d >= 1,
    weight_decay >= 0."""
    adam_args(lr=lr, betas=betas, eps=0.0, weight_decay=weight_decay, n_betas=3)
    pair("eps", eps)
    number("d (the clipping threshold)", d, low=1)
