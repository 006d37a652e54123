"""One benchmark row: our reference solution next to the library doing the same work."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist


@dataclass
class Case:
    """``ours`` and ``ref`` are zero-argument callables that do the same work once (set-up done
    beforehand, outside them); the runner times them interleaved, in one process, one thread,
    and reports the median of each and ``ours / ref``."""

    lab: int
    label: str
    """What is timed, e.g. ``"Adam8bit step, lab GPT"``."""
    ours: Callable[[], object]
    ref: Callable[[], object]
    ref_name: str
    """The library implementation, e.g. ``"bitsandbytes Adam8bit"``."""
    repeat: int = 15
    note: str = ""
    """Anything the reader needs to read the ratio (e.g. FLOPs ratio next to a time ratio)."""


def one_rank_group() -> None:
    """A one-rank gloo group in this process (once), for rows that time a distributed mechanism
    (hooks, copies, collective calls) without a network: the runner is a single process."""
    if dist.is_initialized():
        return
    from labkit.dist import _free_port

    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{_free_port()}")
