"""labkit.optimizer_states: the bytes an optimizer keeps, each storage counted once."""
from __future__ import annotations

import torch

from labkit import optimizer_states


def test_state_bytes_counts_each_meta_storage_once():
    """Check two meta tensors of 4 float32 are 32 bytes, and a view of one adds nothing: every
    meta storage has address 0, so they were counted as one (16 bytes)."""
    m = torch.empty(4, device="meta")

    class Optimizer:
        state = {"p": {"exp_avg": m, "exp_avg_sq": torch.empty(4, device="meta"), "view": m[:2]}}

    assert optimizer_states.state_bytes(Optimizer()) == 32
