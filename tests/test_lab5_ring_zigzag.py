"""Graders for exercise 5.7's causal balance: ring attention with the zigzag layout.

With contiguous chunks and a causal mask, rank r of N computes r + 1 blocks and the last rank
N times the first one's work. ``ring_attention(..., layout="zigzag")`` holds pieces r and
2N-1-r of the sequence cut into 2N pieces. The references here are ones no student writes:
PyTorch's SDPA over the whole sequence (rows picked by this file's own index arithmetic), the
exact count of causal score entries S(S+1)/2 per head, and the ring's byte formula. Every run is
on real gloo ranks (``labkit.dist.launch``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# float32 through PyTorch's fused attention and a few merges: ~1e-6 apart from SDPA on these
# unit-normal inputs; a wrong mask or a wrong block is off by ~1e-1.
ATTN_TOL = dict(atol=1e-5, rtol=1e-4)
B, H, D = 1, 2, 16
# (S, N, causal, layout): one launch each
RUNS = [(128, 2, True, "zigzag"), (128, 4, True, "zigzag"), (128, 4, False, "zigzag"),
        (128, 4, True, "contiguous")]


def zigzag_rows(seq_len: int, world_size: int, rank: int) -> torch.Tensor:
    """Rows of rank ``rank`` under zigzag, by hand: pieces r and 2N-1-r of 2N pieces."""
    piece = seq_len // (2 * world_size)
    first = list(range(rank * piece, (rank + 1) * piece))
    last = 2 * world_size - 1 - rank
    return torch.tensor(first + list(range(last * piece, (last + 1) * piece)))


@pytest.fixture(scope="module")
def runs():
    """One launch per case: the inputs and every rank's result."""
    from labkit.dist import launch
    from labkit.lab5.ring_attention import ring_worker

    out = {}
    for s, n, causal, layout in RUNS:
        torch.manual_seed(10 * s + n)
        q, k, v = (torch.randn(B, H, s, D) for _ in range(3))
        out[s, n, causal, layout] = (q, k, v, launch(ring_worker, n, q, k, v, causal,
                                                     layout=layout, timeout=60))
    return out


@pytest.mark.exercise("5.7", points=2)
@pytest.mark.parametrize("world_size, causal", [(2, True), (4, True), (4, False)])
def test_zigzag_ring_equals_sdpa_on_each_ranks_rows(runs, world_size, causal):
    """Check each rank's output equals SDPA over the whole sequence at the rows it holds
    (pieces r and 2N-1-r): the ranks' outputs, concatenated, are SDPA's on the re-ordered
    sequence."""
    q, k, v, results = runs[128, world_size, causal, "zigzag"]
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    for rank, r in enumerate(results):
        rows = zigzag_rows(128, world_size, rank)
        assert r["out"] is not None and r["out"].shape == (B, H, len(rows), D), (
            f"rank {rank} returned {None if r['out'] is None else tuple(r['out'].shape)}, "
            f"expected its chunk's shape {(B, H, len(rows), D)}")
        half = len(rows) // 2
        for name, got_rows, want_rows in (("early piece", slice(None, half), rows[:half]),
                                          ("late piece", slice(half, None), rows[half:])):
            torch.testing.assert_close(
                r["out"][:, :, got_rows], want[:, :, want_rows], **ATTN_TOL,
                msg=lambda m: f"rank {rank}'s {name} (positions {want_rows[0]}..{want_rows[-1]}, "
                              f"N={world_size}, causal={causal}): {m} — at a step with src < r, "
                              f"which half of the block do the queries see; with src > r, which "
                              f"query piece sees it?")


@pytest.mark.exercise("5.7", points=1)
@pytest.mark.parametrize("world_size", [2, 4])
def test_zigzag_ring_work_is_equal_on_every_rank(runs, world_size):
    """Check the score entries each rank computes (counted by ``count_attention_work``): under
    zigzag every rank computes B·H·S(S+1)/(2N), its share of the S(S+1)/2 causal entries per head,
    exactly — nothing the mask hides, and the same on every rank."""
    s = 128
    want = B * H * s * (s + 1) // (2 * world_size)
    work = [r["work"] for r in runs[s, world_size, True, "zigzag"][3]]
    for rank, got in enumerate(work):
        assert got == want, (
            f"zigzag, S={s}, N={world_size}: rank {rank} computed {got:,} score entries, expected "
            f"B·H·S(S+1)/(2N) = {want:,} (all ranks: {work}): "
            + ("no call to attention_with_lse? " if got == 0 else "")
            + ("more than its share: a block, or a query piece, the mask hides entirely is "
               "computed and thrown away?" if got > want else "fewer: a part is skipped?"))


@pytest.mark.exercise("5.7", points=1)
def test_contiguous_ring_work_skips_the_blocks_after_the_queries(runs):
    """Check the contiguous causal ring's work per rank: rank r computes r whole blocks and its
    own block causally, B·H·(r·c² + c(c+1)/2) entries with c = S/N: the last rank does the most."""
    s, n = 128, 4
    c = s // n
    work = [r["work"] for r in runs[s, n, True, "contiguous"][3]]
    for rank, got in enumerate(work):
        want = B * H * (rank * c * c + c * (c + 1) // 2)
        assert got == want, (
            f"contiguous, S={s}, N={n}: rank {rank} computed {got:,} score entries, expected "
            f"B·H·(r·c² + c(c+1)/2) = {want:,} (all ranks: {work}): a block from src > r lies "
            f"after every query: skipped?")


@pytest.mark.exercise("5.7", points=1)
def test_zigzag_ring_bytes_per_rank_match_the_formula(runs):
    """Check count_comm under zigzag: each rank sends and receives 2(N-1) blocks of B·H·(S/N)·D
    floats, as the contiguous ring does (the layout changes the work, not the traffic)."""
    for (s, n, causal, layout), (_, _, _, results) in runs.items():
        if layout != "zigzag":
            continue
        want = 2 * (n - 1) * B * H * (s // n) * D * 4
        for rank, r in enumerate(results):
            for op in ("send", "recv"):
                got = r["bytes_sent"].get(op, 0)
                assert got == want, (
                    f"zigzag, S={s}, N={n}, causal={causal}: rank {rank} {op} {got:,} B, "
                    f"expected 2(N-1)·B·H·(S/N)·D·4 = {want:,}: does a step send only a part of "
                    f"the block, or one transfer too many?")


# ------------------------------------------------------------------ given code (not graded)

def test_rank_positions_cut_the_sequence_into_the_layouts_pieces():
    from labkit.lab5.ring_attention import rank_positions

    for n in (1, 2, 4):
        for layout in ("contiguous", "zigzag"):
            held = [rank_positions(64, n, r, layout) for r in range(n)]
            assert sorted(torch.cat(held).tolist()) == list(range(64)), (layout, n)
        for r in range(n):
            assert torch.equal(rank_positions(64, n, r, "zigzag"), zigzag_rows(64, n, r))
            assert torch.equal(rank_positions(64, n, r), torch.arange(r * 64 // n, (r + 1) * 64 // n))


@pytest.mark.parametrize("call, exc, word", [
    (lambda r: r.rank_positions(64, 4, 0, "striped"), ValueError, "layout"),
    (lambda r: r.rank_positions(60, 4, 0, "zigzag"), ValueError, "seq_len"),
    (lambda r: r.rank_positions(64, 4, 4), ValueError, "rank"),
    (lambda r: r.rank_positions(64, 0, 0), ValueError, "world_size"),
    (lambda r: r.ring_worker(0, 2, *(torch.zeros(1, 1, 8, 4),) * 3, True, layout="zig"),
     ValueError, "layout"),
    (lambda r: r.ring_worker(0, 4, *(torch.zeros(1, 1, 12, 4),) * 3, True, layout="zigzag"),
     ValueError, "seq_len"),
    (lambda r: r.ring_attention(*(torch.zeros(1, 1, 3, 4),) * 3, layout="zigzag"), ValueError,
     "zigzag"),
])
def test_zigzag_refuses_bad_input_before_any_work(call, exc, word):
    from labkit.lab5 import ring_attention

    with pytest.raises(exc, match=word):
        call(ring_attention)
