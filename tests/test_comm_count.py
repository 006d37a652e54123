"""labkit.comm_count: the calls and bytes a rank sends, counted inside real gloo ranks, against
the ring formulas (2(N-1)/N·B for an all-reduce of B bytes, (N-1)/N·(N·B) for an all-gather or
a reduce-scatter of N·B) and against torch's two spellings of the same collective."""
from __future__ import annotations

import pytest

from labkit import _rank_examples as ex
from labkit.ranks import launch


@pytest.mark.parametrize("world_size", [2, 4])
def test_count_comm_counts_calls_and_bytes_exactly(world_size):
    """Check calls and bytes of one all-reduce of 1000 float32 (B = 4000 bytes), one all-gather
    and one reduce-scatter of N·1000 (N·B), one send/recv of B, against the ring formulas
    2(N-1)/N·B (all-reduce) and (N-1)/N·(N·B) (all-gather, reduce-scatter)."""
    n, B = 1000, 4000
    results = launch(ex.count_basic_comm, world_size, n=n)
    for rank, counts in enumerate(results):
        p2p = {0: {"send": B}, 1: {"recv": B}}.get(rank, {})
        collectives = {"all_reduce": B, "all_gather_into_tensor": world_size * B,
                       "reduce_scatter_tensor": world_size * B}
        assert counts["calls"] == {op: 1 for op in collectives | p2p}
        assert counts["bytes_sent"] == collectives | p2p
        ring = counts["ring_bytes"]
        assert ring["all_reduce"] == pytest.approx(2 * (world_size - 1) / world_size * B)
        assert ring["all_gather_into_tensor"] == pytest.approx((world_size - 1) * B)
        assert ring["reduce_scatter_tensor"] == pytest.approx((world_size - 1) * B)
        assert ring.get("send", 0) == (B if rank == 0 else 0) and ring.get("recv", 0) == 0


def test_both_spellings_of_gather_and_scatter_are_counted_the_same():
    """Check that torch 2.13's new names (all_gather_single, reduce_scatter_single) and the old
    ones (all_gather_into_tensor, reduce_scatter_tensor) count as the same op with the same bytes."""
    old, new = launch(ex.count_both_spellings, 2)
    assert old == new, f"old names counted {old}, new names {new}"
    assert old["calls"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
