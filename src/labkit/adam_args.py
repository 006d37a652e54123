"""Argument checks shared by the course's Adam variants (ZeRO-Offload, NVMe offload).

    check_adam_args(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

Each bad value raises a ``ValueError`` that names the argument and what it may be, before the
optimizer does any work, the same rules as ``torch.optim.Adam``'s (which also refuses a negative
lr, a β outside [0, 1) and a negative ε or weight decay).
"""
from __future__ import annotations


def is_number(x) -> bool:
    """An int or a float, not a bool (``True`` is an int to Python, never a learning rate here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_adam_args(*, lr, betas, eps, weight_decay=0.0) -> None:
    """Refuse Adam hyperparameters ``torch.optim.Adam`` would refuse, naming the argument."""
    if not (is_number(lr) and lr >= 0):
        raise ValueError(f"lr must be a number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(is_number(b) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not (is_number(eps) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if not (is_number(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
