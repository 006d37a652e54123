"""The torch gate: ``import labkit`` refuses a torch older than the newest API the course uses.

It reads the installed version from the package metadata, before anything imports torch, so an old
torch is named with what it lacks and how to upgrade, instead of failing deep inside a lab.
"""
from __future__ import annotations

import re

MIN_TORCH = (2, 7)
"""The oldest torch labkit runs on: the newest of the APIs the course uses (``TORCH_APIS``)."""

TORCH_APIS = {
    "torch.distributed._tools.mem_tracker.MemTracker (labkit.measure)": (2, 5),
    "torch.optim.Adafactor (lab 2)": (2, 5),
    "torch.distributed.tensor: DTensor, parallelize_module (tensor parallelism)": (2, 5),
    "torch.distributed.fsdp.fully_shard, FSDP2's public import path (ZeRO-3)": (2, 6),
    "torch.utils.checkpoint.create_selective_checkpoint_contexts (lab 5)": (2, 4),
    "torch.distributed.pipelining (pipeline parallelism)": (2, 4),
    "Tensor.register_post_accumulate_grad_hook (LOMO)": (2, 1),
    "torch._scaled_mm on CPU (FP8, mixed precision)": (2, 7),
}
"""Each API the course relies on and the torch release that first has it. Two newer names are
shimmed on older releases by ``labkit.torch_compat`` rather than raising the minimum:
``SelectiveCheckpointContext.op_output`` (lab 5; torch 2.13) and ``dist.all_gather_single``
(lab 4; torch 2.13). Known gap: torch 2.9's own ``torch.distributed.pipelining`` aborts a gloo
rank ("Received data size doesn't match expected size"), so lab 3's comparison with it needs a
newer torch."""


def release(version: str) -> tuple[int, ...]:
    """(2, 7, 1) from "2.7.1+cu126"; (2, 8, 0) from "2.8.0a0+git1234" or "2.8.0.dev20250101"."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    return tuple(int(g) for g in match.groups() if g is not None) if match else ()


def check_torch_version(version: str) -> None:
    """Raise ImportError, naming what is missing, if ``version`` is older than ``MIN_TORCH``."""
    have = release(version)
    if have and have < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        missing = "; ".join(api for api, since in TORCH_APIS.items() if have < since)
        raise ImportError(
            f"labkit needs torch >= {need}, and this Python has torch {version}, which lacks: "
            f"{missing}. Upgrade with:  pip install -U 'torch>={need}'  (on Colab: restart the "
            "runtime afterwards)"
        )


def check_installed_torch() -> None:
    """:func:`check_torch_version` of the installed torch (nothing if torch is not installed)."""
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return
    check_torch_version(version)
