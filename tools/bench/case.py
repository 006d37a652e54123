"""One benchmark row: our reference solution next to the library doing the same work.

``Case`` lives in ``labkit.bench`` (the chapters' speed tables use it too); it is re-exported
here for the rows in ``tools/bench/labN.py``.
"""
from __future__ import annotations

import torch.distributed as dist

from labkit.bench import Case

__all__ = ["Case", "one_rank_group"]


def one_rank_group() -> None:
    """A one-rank gloo group in this process (once), for rows that time a distributed mechanism
    (hooks, copies, collective calls) without a network: the runner is a single process."""
    if dist.is_initialized():
        return
    from labkit.ranks import reserved_port

    with reserved_port() as port:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
