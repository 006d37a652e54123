"""Graders of Lab 6, exercise 6.1 (labs/06_system.ipynb): the caching-allocator simulator.

References nobody in this course wrote:
* traces whose answers are derived by hand in each test from the rules of
  ``c10/cuda/CUDACachingAllocator.cpp`` (written out step by step in the docstrings);
* invariants any allocator must keep, checked here from the addresses alone (a block handed out
  never overlaps a live one; everything freed merges back), on random traces and on a trace
  recorded from a real training step of the course GPT (allocated bytes equal the sum of the
  live requests rounded to 512 B);
* on CUDA, PyTorch's own allocator on the same kind of step (``torch.cuda.memory._snapshot``'s
  segment_alloc events and ``torch.cuda.memory_reserved``), run in a fresh subprocess.

Every quantity compared here is an exact integer (bytes, addresses): no tolerances.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from _lab6_helpers import MiB, gpt_step_trace, mib


@pytest.mark.exercise("6.1", points=1)
@pytest.mark.parametrize("size,rounded,pool,segment", [
    (0, 512, "small", 2 * MiB),             # round_size(0) is 512 in the C++ too (malloc(0) never calls it)
    (1, 512, "small", 2 * MiB),
    (512, 512, "small", 2 * MiB),           # a multiple of 512 stays as it is
    (513, 1024, "small", 2 * MiB),          # one byte over: the next multiple
    (MiB, MiB, "small", 2 * MiB),           # 1 MiB is the largest small request (≤ kSmallSize)
    (MiB + 1, MiB + 512, "large", 20 * MiB),  # rounded above 1 MiB: large pool, 20 MiB segment
    (10 * MiB - 512, 10 * MiB - 512, "large", 20 * MiB),  # < 10 MiB: still a 20 MiB segment
    (10 * MiB - 1, 10 * MiB, "large", 10 * MiB),  # rounds up to 10 MiB: segment = request
    (11 * MiB, 11 * MiB, "large", 12 * MiB),   # ≥ 10 MiB: rounded up to 2 MiB
    (15 * MiB + 3, 15 * MiB + 512, "large", 16 * MiB),
])
def test_round_size_pool_and_segment_size_follow_the_source(size, rounded, pool, segment):
    """Check round_size, pool_of and segment_size at the edges of every rule (kMinBlockSize 512,
    kSmallSize 1 MiB, kSmallBuffer 2 MiB, kLargeBuffer 20 MiB, kMinLargeAlloc 10 MiB,
    kRoundLarge 2 MiB)."""
    from labkit.lab6.caching_allocator import pool_of, round_size, segment_size

    got = round_size(size)
    assert got == rounded, f"round_size({size:,}) = {got:,}, expected {rounded:,}: blocks are multiples of 512 B, at least 512 B"
    got = pool_of(size)
    assert got == pool, f"pool_of({size:,}) = {got!r}, expected {pool!r}: the small pool serves rounded requests ≤ 1 MiB"
    got = segment_size(size)
    assert got == segment, (f"segment_size({size:,}) = {mib(got)}, expected {mib(segment)}: 2 MiB (small), "
                            f"20 MiB (rounded < 10 MiB), else the rounded request up to a multiple of 2 MiB")


@pytest.mark.exercise("6.1", points=1)
def test_small_pool_splits_caches_and_reuses_the_best_fit():
    """A hand-derived small-pool trace.

    1. a = malloc(1000): rounded 1024; no cached block → new 2 MiB segment [0, 2 MiB); the
       remainder 2 MiB − 1024 ≥ 512 → split. allocated 1024, reserved 2 MiB.
    2. b = malloc(3000): rounded 3072, taken from the cached remainder (at a + 1024), split
       again. allocated 4096, reserved still 2 MiB, one segment.
    3. free(a): [a, a + 1024) is cached; its next neighbour b is in use → no merge.
    4. c = malloc(500): rounded 512. Best fit is the smallest cached block that fits: the
       1024 B hole at a (not the ~2 MiB remainder) → c == a; remainder 512 ≥ 512 → split.
       allocated 4096 − 1024 + 512 = 3584.
    (3b. empty_cache now releases nothing: the segment still holds b.)
    5. free(b), free(c): everything merges back into one 2 MiB free block; still reserved
       (the allocator caches) until empty_cache → reserved 0.
    """
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator()
    a = alloc.malloc(1000)
    assert (alloc.allocated_bytes, alloc.reserved_bytes) == (1024, 2 * MiB), \
        f"after malloc(1000): allocated {alloc.allocated_bytes:,}, reserved {alloc.reserved_bytes:,}; expected 1,024 and 2 MiB: round to 512 B, one 2 MiB small segment"
    b = alloc.malloc(3000)
    not_live(b, "malloc(3000)", a=a)
    assert b == a + 1024, f"malloc(3000) at {b}, expected right after a at {a + 1024}: the segment's remainder must be split off and reused"
    assert alloc.reserved_bytes == 2 * MiB and len(alloc.segment_log) == 1, \
        f"reserved {mib(alloc.reserved_bytes)} in {len(alloc.segment_log)} segments after two small requests, expected one 2 MiB segment: was the remainder cached?"
    alloc.free(a)
    alloc.empty_cache()
    assert alloc.reserved_bytes == 2 * MiB, \
        f"empty_cache while b is in use left {mib(alloc.reserved_bytes)} reserved, expected 2 MiB: a segment with a block in use must stay"
    c = alloc.malloc(500)
    assert c == a, f"malloc(500) got address {c}, expected the 1,024 B hole at {a}: best fit is the SMALLEST cached block that fits"
    assert alloc.allocated_bytes == 3584, \
        f"allocated {alloc.allocated_bytes:,} B, expected 3,584 = 3,072 + 512: the 1,024 B hole must be split (remainder 512 ≥ 512)"
    alloc.free(b)
    alloc.free(c)
    assert alloc.allocated_bytes == 0 and alloc.reserved_bytes == 2 * MiB, \
        f"after freeing all: allocated {alloc.allocated_bytes:,}, reserved {mib(alloc.reserved_bytes)}; expected 0 and 2 MiB (freed blocks stay cached)"
    alloc.empty_cache()
    assert alloc.reserved_bytes == 0, \
        f"after empty_cache reserved {mib(alloc.reserved_bytes)}, expected 0: the freed blocks must merge back into one whole free segment, which empty_cache releases"


@pytest.mark.exercise("6.1", points=1)
def test_large_pool_splits_only_remainders_above_1_mib():
    """A hand-derived large-pool trace.

    1. a = malloc(15 MiB): ≥ 10 MiB → segment of 16 MiB; remainder 1 MiB is not > 1 MiB → no
       split: the block is the whole 16 MiB (allocated 16 MiB).
    2. b = malloc(2 MiB): no cached block → 20 MiB segment; remainder 18 MiB > 1 MiB → split.
    3. c = malloc(17 MiB): best fit is the 18 MiB remainder; remainder 1 MiB → no split, c's
       block is 18 MiB. allocated 16 + 2 + 18 = 36 MiB = reserved; segments [16, 20] MiB.
    """
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator()
    a = alloc.malloc(15 * MiB)
    assert alloc.allocated_bytes == 16 * MiB, \
        f"allocated {mib(alloc.allocated_bytes)} after malloc(15 MiB), expected 16 MiB: a large block is split only if the remainder is > 1 MiB"
    b = alloc.malloc(2 * MiB)
    not_live(b, "malloc(2 MiB)", a=a)
    c = alloc.malloc(17 * MiB)
    not_live(c, "malloc(17 MiB)", a=a, b=b)
    assert c == b + 2 * MiB, f"malloc(17 MiB) at {c}, expected the cached remainder of the 20 MiB segment at {b + 2 * MiB}: split when the remainder is > 1 MiB"
    assert alloc.segment_log == [16 * MiB, 20 * MiB], \
        f"segments {[mib(s) for s in alloc.segment_log]}, expected [16 MiB, 20 MiB]"
    assert (alloc.allocated_bytes, alloc.reserved_bytes) == (36 * MiB, 36 * MiB), \
        f"allocated {mib(alloc.allocated_bytes)}, reserved {mib(alloc.reserved_bytes)}; expected 36 MiB and 36 MiB: c's block is the whole 18 MiB (remainder 1 MiB is not split)"


@pytest.mark.exercise("6.1", points=1)
def test_freed_blocks_merge_with_free_neighbours():
    """A hand-derived merge.

    a, b, c = malloc(2 MiB) × 3: one 20 MiB segment, blocks [0,2) [2,4) [4,6), free [6,20).
    free(b): a 2 MiB hole. d = malloc(3 MiB): the hole is too small → [6, 9) from the tail.
    free(a): a merges with the hole of b → one free 4 MiB block at 0 (the free blocks are now
    4 MiB at 0 and 11 MiB at 9). e = malloc(3 MiB): best fit is the 4 MiB block → e == a;
    its remainder 1 MiB is not split, so e's block is 4 MiB.
    """
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator()
    a, b, c = (alloc.malloc(2 * MiB) for _ in range(3))
    alloc.free(b)
    d = alloc.malloc(3 * MiB)
    not_live(d, "malloc(3 MiB)", a=a, c=c)
    assert d == c + 2 * MiB, f"malloc(3 MiB) at {d}, expected the tail at {c + 2 * MiB}: the 2 MiB hole is too small"
    alloc.free(a)
    e = alloc.malloc(3 * MiB)
    not_live(e, "malloc(3 MiB)", c=c, d=d)
    assert e == a, (f"malloc(3 MiB) at {e}, expected {a}: after free(a) the blocks of a and b must merge "
                    f"into one 4 MiB free block, the best fit")
    assert alloc.allocated_bytes == (2 + 3 + 4) * MiB, \
        f"allocated {mib(alloc.allocated_bytes)}, expected 9 MiB = c 2 + d 3 + e 4 (1 MiB remainder not split)"
    assert alloc.reserved_bytes == 20 * MiB, f"reserved {mib(alloc.reserved_bytes)}, expected one 20 MiB segment"


@pytest.mark.exercise("6.1", points=1)
def test_best_fit_prefers_the_smallest_hole_over_the_lowest_address():
    """Hand-derived: a = 3 MiB, b = c = d = 2 MiB in one 20 MiB segment ([0,3) [3,5) [5,7)
    [7,9), free [9,20)). free(a) and free(c) leave holes of 3 MiB at 0 and 2 MiB at 5 MiB.
    malloc(2 MiB): best fit is the 2 MiB hole at c (first fit would take the 3 MiB hole at 0).
    """
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator()
    a = alloc.malloc(3 * MiB)
    b, c, d = (alloc.malloc(2 * MiB) for _ in range(3))
    alloc.free(a)
    alloc.free(c)
    e = alloc.malloc(2 * MiB)
    assert e == c, f"malloc(2 MiB) at {e}, expected c's 2 MiB hole at {c}: best fit is the smallest block that fits, not the lowest address ({a})"


@pytest.mark.exercise("6.1", points=1)
def test_oom_releases_cached_segments_and_retries():
    """A hand-derived OOM retry with capacity 24 MiB.

    a = malloc(15 MiB) → 16 MiB segment; free(a) → cached. malloc(20 MiB): the cached 16 MiB
    is too small; a new 20 MiB segment would make 36 > 24 MiB → release every cached segment
    (16 MiB), retry: 20 MiB fits. num_alloc_retries 1, reserved 20 MiB, segment_log [16, 20].
    Then malloc(8 MiB): no cached block, a 20 MiB segment would make 40 > 24 MiB, nothing
    cached to release → SimulatedOOM, num_ooms 1.
    """
    from labkit.lab6.caching_allocator import CachingAllocator, SimulatedOOM

    alloc = CachingAllocator(24 * MiB)
    alloc.free(alloc.malloc(15 * MiB))
    alloc.malloc(20 * MiB)
    assert alloc.num_alloc_retries == 1, f"num_alloc_retries {alloc.num_alloc_retries}, expected 1: the first segment attempt fails"
    assert alloc.reserved_bytes == 20 * MiB, \
        f"reserved {mib(alloc.reserved_bytes)}, expected 20 MiB: the cached 16 MiB segment must be released before the retry"
    assert alloc.segment_log == [16 * MiB, 20 * MiB], f"segments {[mib(s) for s in alloc.segment_log]}, expected [16, 20] MiB"
    with pytest.raises(SimulatedOOM):
        alloc.malloc(8 * MiB)
    assert alloc.num_ooms == 1, f"num_ooms {alloc.num_ooms}, expected 1"


@pytest.mark.exercise("6.1", points=1)
def test_max_split_size_keeps_oversize_blocks_whole():
    """max_split_size = 24 MiB (PyTorch requires at least 20 MiB), hand-derived.

    a = malloc(30 MiB) → 30 MiB segment (≥ 24 MiB: oversize); free(a). malloc(4 MiB) may not
    take an oversize block (request < 24 MiB, block ≥ 24 MiB) → a new 20 MiB segment:
    reserved 50 MiB (without max_split_size it would split the cached 30 MiB: reserved 30).
    Then malloc(25 MiB) (≥ 24 MiB) may take the cached 30 MiB block (30 < 25 + 20): no new
    segment, and no split (requests ≥ max_split_size are never split): block of 30 MiB.
    """
    from labkit.lab6.caching_allocator import CachingAllocator

    plain = CachingAllocator()
    plain.free(plain.malloc(30 * MiB))
    plain.malloc(4 * MiB)
    assert plain.reserved_bytes == 30 * MiB, \
        f"without max_split_size: reserved {mib(plain.reserved_bytes)}, expected 30 MiB (the cached 30 MiB block is split)"
    alloc = CachingAllocator(max_split_size=24 * MiB)
    alloc.free(alloc.malloc(30 * MiB))
    alloc.malloc(4 * MiB)
    assert alloc.reserved_bytes == 50 * MiB, \
        f"max_split_size 24 MiB: reserved {mib(alloc.reserved_bytes)}, expected 50 MiB: a request below max_split_size must not take an oversize block"
    alloc.malloc(25 * MiB)
    assert alloc.reserved_bytes == 50 * MiB and alloc.allocated_bytes == 34 * MiB, \
        (f"reserved {mib(alloc.reserved_bytes)}, allocated {mib(alloc.allocated_bytes)}; expected 50 and 34 MiB "
         f"(4 + the whole 30 MiB block): an oversize request may take a block < 20 MiB larger, unsplit")
    with pytest.raises(ValueError, match="max_split_size"):
        CachingAllocator(max_split_size=19 * MiB)


@pytest.mark.exercise("6.1", points=1)
def test_expandable_segments_grow_by_pages():
    """expandable_segments, hand-derived: one range per pool, mapped in 20 MiB pages (large).

    a = malloc(15 MiB): map one 20 MiB page; split (any remainder ≥ 512 B) → free 5 MiB.
    b = malloc(6 MiB): the free 5 MiB tail is too small → map one more page; b starts right
    after a (the tail grows instead of a new segment). reserved 40 MiB, allocated 21 MiB.
    free(b), empty_cache: the free tail runs from 15 MiB to 40 MiB; the page [20, 40) is
    wholly free and is unmapped, the page [0, 20) still holds a → reserved 20 MiB.
    free(a), empty_cache → every page unmapped, reserved 0.
    """
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator(expandable_segments=True)
    a = alloc.malloc(15 * MiB)
    assert alloc.allocated_bytes == 15 * MiB, \
        f"allocated {mib(alloc.allocated_bytes)}, expected 15 MiB: with expandable segments every remainder ≥ 512 B is split"
    b = alloc.malloc(6 * MiB)
    assert b == a + 15 * MiB, f"b at {b}, expected {a + 15 * MiB}: the range must grow at its end, contiguous with a"
    assert (alloc.reserved_bytes, alloc.allocated_bytes) == (40 * MiB, 21 * MiB), \
        f"reserved {mib(alloc.reserved_bytes)}, allocated {mib(alloc.allocated_bytes)}; expected 40 and 21 MiB (two 20 MiB pages)"
    alloc.free(b)
    alloc.empty_cache()
    assert alloc.reserved_bytes == 20 * MiB, \
        f"reserved {mib(alloc.reserved_bytes)} after free(b) and empty_cache, expected 20 MiB: only wholly free pages are unmapped (a still uses the first)"
    alloc.free(a)
    alloc.empty_cache()
    assert alloc.reserved_bytes == 0, f"reserved {mib(alloc.reserved_bytes)} after empty_cache, expected 0"


@pytest.mark.exercise("6.1", points=1)
def test_bad_requests_raise():
    """Check a negative size and a free of an unknown block raise ValueError before any work."""
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator()
    with pytest.raises(ValueError, match="size"):
        alloc.malloc(-1)
    a = alloc.malloc(100)
    with pytest.raises(ValueError, match="unknown block"):
        alloc.free(a + 1)
    alloc.free(a)
    with pytest.raises(ValueError, match="unknown block"):
        alloc.free(a)  # a double free
    assert alloc.allocated_bytes == 0, (
        f"after malloc(100), a refused free of an unknown address, free and a refused double free: "
        f"allocated {alloc.allocated_bytes:,} B, expected 0: does a refused free change the counts?")


@pytest.mark.parametrize("trace,error,word", [
    ([("free", 0, 0)], ValueError, "not allocated"),
    ([("alloc", 0, 10), ("alloc", 0, 10)], ValueError, "twice"),
    ([("alloc", 0, 10), ("free", 0, "x")], ValueError, "nbytes"),
    ([("alloc", 0, -1)], ValueError, "nbytes"),
    ([("alloc", 0, 2.5)], ValueError, "nbytes"),
    ([["alloc", 0, 10]], ValueError, "trace\\[0\\]"),
    ([("alloc", [0], 10)], TypeError, "hashable"),
    ("alloc", TypeError, "trace"),
])
def test_bad_traces_raise_before_any_replay(trace, error, word):
    """Not graded (the toolkit's check_trace): a malformed trace is refused by name and index
    before the allocator sees any event."""
    from labkit.allocation_trace import peak_live_bytes
    from labkit.harness.lab6 import replay

    for fn in (replay, peak_live_bytes):
        with pytest.raises(error, match=word):
            fn(trace)


def not_live(addr, what, **live):
    """Assert that ``addr`` (returned by ``what``) is none of the live blocks' addresses: a block
    still in use handed out again can only come from a free set that still holds it."""
    for name, other in live.items():
        assert addr != other, (f"{what} returned {addr}, the address of {name}, which is still allocated: a block "
                               f"in use was handed out again (is a block taken out of the free set when it is "
                               f"handed out, and a merged neighbour when it is merged?)")


@pytest.fixture(scope="module")
def gpt_trace():
    return gpt_step_trace()


@pytest.mark.exercise("6.1", points=2)
def test_replay_of_a_real_step_tracks_allocated_exactly(gpt_trace):
    """Replay the real GPT step: after every event, allocated bytes ≥ the live requests rounded
    to 512 B (plain sum, computed here), equal to it when no block was left unsplit (small
    pool); reserved ≥ allocated; every segment a size the rules allow; then free all and
    empty_cache → reserved 0."""
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator()
    handles, live_rounded, live_req = {}, {}, {}
    allowed = {2 * MiB, 20 * MiB}
    for k, (op, ident, nbytes) in enumerate(gpt_trace):
        if op == "alloc":
            handles[ident] = alloc.malloc(nbytes)
            live_rounded[ident] = max(512, -(-nbytes // 512) * 512)
            live_req[ident] = nbytes
        else:
            alloc.free(handles.pop(ident))
            del live_rounded[ident], live_req[ident]
        want = sum(live_rounded.values())
        assert alloc.requested_bytes == sum(live_req.values()), \
            f"event {k}: requested {alloc.requested_bytes:,} B, expected the live requests' sum {sum(live_req.values()):,}"
        assert alloc.allocated_bytes >= want, \
            f"event {k} ({op} of {nbytes:,} B): allocated {alloc.allocated_bytes:,} < live requests rounded to 512 B {want:,}"
        assert alloc.reserved_bytes >= alloc.allocated_bytes, f"event {k}: reserved < allocated"
    small = [n for op, _, n in gpt_trace if op == "alloc"]
    if max(small) <= MiB:  # all in the small pool: every remainder ≥ 512 B is split → exact
        assert alloc.allocated_bytes == sum(live_rounded.values()), (
            f"end of the step: allocated {alloc.allocated_bytes:,} B, expected the live requests "
            f"rounded to 512 B, {sum(live_rounded.values()):,}: in the small pool every remainder of "
            f"512 B or more is split off, so a block is exactly its rounded request")
    for s in alloc.segment_log:
        assert s in allowed or (s >= 10 * MiB and s % (2 * MiB) == 0), f"segment of {s:,} B is not a size the rules allow"
    for h in list(handles.values()):
        alloc.free(h)
    alloc.empty_cache()
    assert alloc.reserved_bytes == 0, \
        f"after freeing everything and empty_cache, reserved {alloc.reserved_bytes:,} B: some freed block did not merge back into its segment"


@pytest.mark.exercise("6.1", points=1)
def test_replay_of_a_real_step_reserves_the_fewest_small_segments_needed(gpt_trace):
    """On the real trace, every segment the simulator reserves in the small pool is needed:
    whenever a new 2 MiB segment appears, no cached small block could hold the request
    (checked by inspecting the allocator's cached blocks just before each malloc)."""
    from labkit.lab6.caching_allocator import CachingAllocator, round_size

    alloc = CachingAllocator()
    handles = {}
    for op, ident, nbytes in gpt_trace:
        if op == "alloc":
            before = len(alloc.segment_log)
            size = round_size(nbytes)
            fits = [b for b in alloc.free_blocks["small" if size <= MiB else "large"] if b.size >= size]
            handles[ident] = alloc.malloc(nbytes)
            grew = len(alloc.segment_log) > before
            assert not (grew and fits), \
                f"a new segment for {nbytes:,} B although a cached block of {fits[0].size:,} B fits: is the cache searched?"
            assert grew or fits, f"{nbytes:,} B served without a new segment and without a fitting cached block"
        else:
            alloc.free(handles.pop(ident))


@pytest.mark.exercise("6.1", points=1)
def test_a_zero_byte_request_touches_no_pool():
    """PyTorch's ``allocate`` calls ``malloc`` only ``if (size != 0)``: a 0-byte tensor gets a null
    pointer, no block and no segment. So malloc(0) returns None and reserves nothing, free(None)
    does nothing, and a trace with 0-byte tensors reserves what it reserves without them."""
    from labkit.harness.lab6 import replay
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator()
    handle = alloc.malloc(0)
    assert handle is None, f"malloc(0) returned {handle!r}, expected None (a null pointer: no block for 0 bytes)"
    assert (alloc.allocated_bytes, alloc.reserved_bytes, alloc.segment_log) == (0, 0, []), \
        (f"after malloc(0): allocated {alloc.allocated_bytes:,} B, reserved {alloc.reserved_bytes:,} B, segments "
         f"{alloc.segment_log}; expected 0, 0, []: a 0-byte request must not round up to a block nor reserve a segment")
    alloc.free(handle)
    alloc.malloc(1)
    assert (alloc.allocated_bytes, alloc.reserved_bytes) == (512, 2 * MiB), \
        f"malloc(1) after malloc(0): allocated {alloc.allocated_bytes:,}, reserved {mib(alloc.reserved_bytes)}; expected 512 and 2 MiB"
    trace = [("alloc", 0, 0), ("alloc", 1, 1000), ("alloc", 2, 0), ("free", 0, 0), ("free", 1, 0), ("free", 2, 0)]
    got = replay(trace).reserved
    assert got == [0, 2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB], f"reserved after each event {got}, expected [0, 2 MiB, ...]"


@pytest.mark.exercise("6.1", points=1)
def test_equal_holes_go_lowest_address_first():
    """Hand-derived: a … e = malloc(2 MiB) × 5 in one 20 MiB segment ([0,2) … [8,10), free
    [10,20)). free(b), then free(d): two 2 MiB holes, at 2 MiB and 6 MiB (c between them, so they
    do not merge). Best fit ties go to the lower address (the set is ordered by size, then
    address): malloc(2 MiB) gets b's hole although d was freed last, the next one d's."""
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator()
    a, b, c, d, e = (alloc.malloc(2 * MiB) for _ in range(5))
    alloc.free(b)
    alloc.free(d)
    got = alloc.malloc(2 * MiB), alloc.malloc(2 * MiB)
    assert got == (b, d), (f"two malloc(2 MiB) with equal 2 MiB holes at {b} and {d} got {got}, expected ({b}, {d}): "
                           f"among blocks of the same size the lowest address comes first")


@pytest.mark.exercise("6.1", points=1)
def test_oversize_blocks_serve_requests_less_than_20_mib_smaller():
    """max_split_size = 24 MiB. A request ≥ it may take a cached block only if the block is less
    than kLargeBuffer = 20 MiB larger (``get_free_block``: refuse when block ≥ request + 20 MiB).

    * cached 46 MiB block, malloc(26 MiB): 46 ≥ 26 + 20 → refused, a new 26 MiB segment
      (reserved 72 MiB);
    * cached 46 MiB block, malloc(26 MiB + 512 B): 46 < 46 MiB + 512 → taken whole (reserved 46).
    """
    from labkit.lab6.caching_allocator import CachingAllocator

    at = CachingAllocator(max_split_size=24 * MiB)
    at.free(at.malloc(46 * MiB))
    at.malloc(26 * MiB)
    assert at.segment_log == [46 * MiB, 26 * MiB], \
        (f"segments {[mib(s) for s in at.segment_log]}, expected [46, 26] MiB: a block exactly 20 MiB larger than an "
         f"oversize request is refused (block >= request + 20 MiB)")
    below = CachingAllocator(max_split_size=24 * MiB)
    below.free(below.malloc(46 * MiB))
    below.malloc(26 * MiB + 512)
    assert (below.segment_log, below.allocated_bytes) == ([46 * MiB], 46 * MiB), \
        (f"segments {[mib(s) for s in below.segment_log]}, allocated {mib(below.allocated_bytes)}; expected [46 MiB] "
         f"and 46 MiB: a block less than 20 MiB larger serves the request, unsplit")


@pytest.mark.exercise("6.1", points=1)
def test_a_block_of_exactly_max_split_size_is_oversize():
    """max_split_size = 24 MiB: a block ≥ 24 MiB is oversize and never serves a request below it.

    * cached 24 MiB block, malloc(12 MiB): refused → a new 12 MiB segment (reserved 36 MiB);
    * cached 22 MiB block, malloc(12 MiB): taken and split (12 < 24, remainder 10 > 1 MiB):
      reserved 22 MiB, allocated 12 MiB.
    """
    from labkit.lab6.caching_allocator import CachingAllocator

    at = CachingAllocator(max_split_size=24 * MiB)
    at.free(at.malloc(24 * MiB))
    at.malloc(12 * MiB)
    assert at.segment_log == [24 * MiB, 12 * MiB], \
        (f"segments {[mib(s) for s in at.segment_log]}, expected [24, 12] MiB: a cached block of exactly "
         f"max_split_size is oversize (>=) and may not serve a smaller request")
    under = CachingAllocator(max_split_size=24 * MiB)
    under.free(under.malloc(22 * MiB))
    under.malloc(12 * MiB)
    assert (under.reserved_bytes, under.allocated_bytes) == (22 * MiB, 12 * MiB), \
        (f"reserved {mib(under.reserved_bytes)}, allocated {mib(under.allocated_bytes)}; expected 22 and 12 MiB: a "
         f"22 MiB block is below max_split_size, so it serves and is split")


@pytest.mark.exercise("6.1", points=1)
def test_oom_under_max_split_size_releases_the_smallest_oversize_block_that_suffices():
    """capacity 80 MiB, max_split_size 24 MiB, hand-derived (``release_available_cached_blocks``).

    a = 30 MiB, b = 40 MiB segments, both freed (cached, oversize); reserved 70 MiB.
    c = malloc(4 MiB): no cached block may serve it (both oversize); a 20 MiB segment would make
    90 > 80 → release oversize blocks of the pool for max(4, 24) = 24 MiB: lower_bound finds the
    30 MiB block, only it is released; retry: reserved 60 MiB, num_alloc_retries still 0 (only
    the release-everything retry counts). d = malloc(35 MiB) then takes the cached 40 MiB block
    (40 < 35 + 20): no new segment.
    """
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator(80 * MiB, max_split_size=24 * MiB)
    a, b = alloc.malloc(30 * MiB), alloc.malloc(40 * MiB)
    alloc.free(a)
    alloc.free(b)
    alloc.malloc(4 * MiB)
    assert alloc.reserved_bytes == 60 * MiB, \
        (f"reserved {mib(alloc.reserved_bytes)} after the retry, expected 60 MiB: only the smallest oversize block "
         f"that covers max(request, max_split_size) = 24 MiB (the 30 MiB one) is released, the 40 MiB one stays cached")
    assert alloc.num_alloc_retries == 0, \
        f"num_alloc_retries {alloc.num_alloc_retries}, expected 0: releasing oversize blocks is not the counted retry"
    alloc.malloc(35 * MiB)
    assert alloc.segment_log == [30 * MiB, 40 * MiB, 20 * MiB], \
        f"segments {[mib(s) for s in alloc.segment_log]}, expected [30, 40, 20] MiB: malloc(35 MiB) reuses the cached 40 MiB"


@pytest.mark.exercise("6.1", points=1)
def test_oom_under_max_split_size_releases_the_largest_oversize_blocks_until_enough():
    """capacity 130 MiB, max_split_size 24 MiB, hand-derived.

    Cached: a 20 MiB segment (from malloc(2 MiB), merged back: not oversize) and oversize
    segments of 40, 30 and 26 MiB; reserved 116 MiB. malloc(50 MiB): nothing cached fits, a
    50 MiB segment would make 166 > 130; no single oversize block ≥ 50 MiB, so release the
    largest ones, one by one, until they add up to 50: 40, then 30 (70 ≥ 50): stop. The 26 and
    the 20 MiB stay cached; retry: reserved 96 MiB, num_alloc_retries 0.
    """
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator(130 * MiB, max_split_size=24 * MiB)
    handles = [alloc.malloc(n * MiB) for n in (2, 40, 30, 26)]
    for h in handles:
        alloc.free(h)
    alloc.malloc(50 * MiB)
    cached = sorted(b.size // MiB for b in alloc.free_blocks["large"])
    assert (alloc.reserved_bytes, alloc.num_alloc_retries) == (96 * MiB, 0), \
        (f"reserved {mib(alloc.reserved_bytes)}, num_alloc_retries {alloc.num_alloc_retries}; expected 96 MiB and 0 "
         f"(cached blocks left, MiB: {cached}): release oversize blocks largest first, only until they cover 50 MiB")
    assert cached == [20, 26], f"cached large blocks {cached} MiB, expected [20, 26]"


@pytest.mark.exercise("6.1", points=1)
def test_oom_under_max_split_size_falls_back_to_releasing_everything():
    """capacity 100 MiB, max_split_size 24 MiB: cached 30 MiB (oversize) and 20 MiB (not). malloc(60
    MiB): the oversize blocks add up to 30 < 60 → not enough (the 30 MiB is released all the same,
    as in the C++); then every free segment is released and the request retried:
    num_alloc_retries 1, reserved 60 MiB, segments [30, 20, 60] MiB."""
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator(100 * MiB, max_split_size=24 * MiB)
    a, x = alloc.malloc(30 * MiB), alloc.malloc(2 * MiB)
    alloc.free(a)
    alloc.free(x)
    alloc.malloc(60 * MiB)
    got = (alloc.reserved_bytes, alloc.num_alloc_retries, alloc.segment_log)
    assert got == (60 * MiB, 1, [30 * MiB, 20 * MiB, 60 * MiB]), \
        (f"reserved {mib(got[0])}, num_alloc_retries {got[1]}, segments {[mib(s) for s in got[2]]}; expected 60 MiB, 1, "
         f"[30, 20, 60] MiB: when the oversize blocks cannot cover the request, release every free segment and retry")


@pytest.mark.exercise("6.1", points=1)
def test_a_request_of_exactly_max_split_size_is_oversize_too():
    """max_split_size = 24 MiB, hand-derived from ``get_free_block``: a request ≥ max_split_size
    may take an oversize block less than 20 MiB larger. A cached 30 MiB block and malloc(24 MiB):
    24 is not below 24, and 30 < 24 + 20 → taken whole (no split: ``should_split`` needs a
    request below max_split_size): one segment, 30 MiB allocated."""
    from labkit.lab6.caching_allocator import CachingAllocator

    at = CachingAllocator(max_split_size=24 * MiB)
    at.free(at.malloc(30 * MiB))
    at.malloc(24 * MiB)
    assert (at.segment_log, at.allocated_bytes) == ([30 * MiB], 30 * MiB), \
        (f"segments {[mib(s) for s in at.segment_log]}, allocated {mib(at.allocated_bytes)}; expected [30 MiB] and "
         f"30 MiB: a request of exactly max_split_size is not 'below' it (<, not <=), so the cached oversize block "
         f"serves it")


@pytest.mark.exercise("6.1", points=1)
def test_oom_under_max_split_size_releases_only_the_requests_stream():
    """capacity 60 MiB, max_split_size 24 MiB, hand-derived: stream 0 caches an oversize 30 MiB
    segment and a 20 MiB one (reserved 50 MiB). malloc(4 MiB) on stream 1: nothing of stream 1
    is cached, a 20 MiB segment would make 70 > 60; ``release_available_cached_blocks`` looks
    at stream 1's oversize blocks only (there are none) and fails; then every free segment is
    released and the request retried: reserved 20 MiB, num_alloc_retries 1."""
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator(60 * MiB, max_split_size=24 * MiB)
    a, x = alloc.malloc(30 * MiB), alloc.malloc(2 * MiB)
    alloc.free(a)
    alloc.free(x)
    alloc.malloc(4 * MiB, stream=1)
    got = (alloc.reserved_bytes, alloc.num_alloc_retries)
    hint = (": stream 0's oversize block was released for a stream-1 request (release only the request's stream)"
            if got == (40 * MiB, 0) else "")
    assert got == (20 * MiB, 1), (f"reserved {mib(got[0])}, num_alloc_retries {got[1]}; expected 20 MiB and 1{hint}")


@pytest.mark.exercise("6.1", points=1)
def test_blocks_are_reused_only_on_their_own_stream():
    """The free set is ordered by (stream, size, address) and ``get_free_block`` refuses a block of
    another stream: a block freed on stream 1 is not reused on stream 0 (a new 2 MiB segment) but
    is reused on stream 1."""
    from labkit.lab6.caching_allocator import CachingAllocator

    alloc = CachingAllocator()
    a = alloc.malloc(1000, stream=1)
    alloc.free(a)
    b = alloc.malloc(1000, stream=0)
    assert b != a and alloc.segment_log == [2 * MiB, 2 * MiB], \
        (f"malloc on stream 0 got {b} (stream 1's freed block is at {a}), segments {[mib(s) for s in alloc.segment_log]}; "
         f"expected a new 2 MiB segment: a cached block serves only its own stream")
    c = alloc.malloc(1000, stream=1)
    assert c == a and len(alloc.segment_log) == 2, f"malloc on stream 1 got {c}, expected its cached block at {a}"


def _random_requests(rng):
    """Mostly small requests, some large ones up to 40 MiB (both pools, every segment rule)."""
    if rng.random() < 0.7:
        return int(2 ** rng.uniform(0, 20.5))
    return int(2 ** rng.uniform(20, 25.3))


@pytest.mark.exercise("6.1", points=2)
@pytest.mark.parametrize("config", [{}, {"max_split_size": 24 * MiB}, {"expandable_segments": True},
                                    {"capacity": 160 * MiB}, {"capacity": 160 * MiB, "max_split_size": 20 * MiB}],
                         ids=["default", "max_split_size", "expandable", "capacity", "capacity+max_split_size"])
def test_random_traces_never_hand_out_live_memory_and_merge_back(config):
    """1,500 random mallocs and frees (seeded). Checked here from the addresses alone: every
    block handed out ([address, address + request rounded to 512 B)) overlaps no live block;
    allocated ≥ the live requests rounded to 512 B and requested = their sum after every event;
    reserved never exceeds the capacity; after freeing everything, empty_cache leaves 0."""
    import bisect

    from labkit.lab6.caching_allocator import CachingAllocator, SimulatedOOM

    rng = random.Random(0)
    alloc = CachingAllocator(**config)
    live, starts, born = {}, [], {}  # address → (rounded, request); sorted addresses; address → event
    for k in range(1500):
        if live and rng.random() < 0.45:
            addr = starts[rng.randrange(len(starts))]
            alloc.free(addr)
            del live[addr], born[addr]
            starts.pop(bisect.bisect_left(starts, addr))
        else:
            size = _random_requests(rng)
            try:
                addr = alloc.malloc(size)
            except SimulatedOOM:
                assert "capacity" in config, f"event {k}: SimulatedOOM for {size:,} B without a capacity"
                continue
            rounded = max(512, -(-size // 512) * 512)
            i = bisect.bisect_left(starts, addr)
            clash = [s for s in starts[max(i - 1, 0):i + 1]
                     if s < addr + rounded and addr < s + live[s][0]]
            assert not clash, (
                f"event {k}: malloc({size:,}) returned [{addr:,}, {addr + rounded:,}), which overlaps the live block "
                f"[{clash[0]:,}, {clash[0] + live[clash[0]][0]:,}) handed out at event {born[clash[0]]}: memory still in "
                f"use was handed out again (a block left in the free set when it was taken or merged into a "
                f"neighbour, or a remainder split off at the wrong address)")
            live[addr], born[addr] = (rounded, size), k
            starts.insert(i, addr)
        want = sum(r for r, _ in live.values())
        assert alloc.allocated_bytes >= want, \
            f"event {k}: allocated {alloc.allocated_bytes:,} B < the live requests rounded to 512 B, {want:,} B"
        assert alloc.requested_bytes == sum(n for _, n in live.values()), \
            f"event {k}: requested {alloc.requested_bytes:,} B, expected the live requests' sum {sum(n for _, n in live.values()):,}"
        if "capacity" in config:
            assert alloc.reserved_bytes <= config["capacity"], f"event {k}: reserved {mib(alloc.reserved_bytes)} > capacity"
    for addr in list(live):
        alloc.free(addr)
    alloc.empty_cache()
    assert (alloc.allocated_bytes, alloc.reserved_bytes) == (0, 0), \
        (f"after freeing everything and empty_cache: allocated {alloc.allocated_bytes:,} B, reserved "
         f"{alloc.reserved_bytes:,} B; expected 0 and 0: some freed block did not merge back into its segment")


_CUDA_STEP = textwrap.dedent("""
    import json, torch
    from labkit.models import GPT, SyntheticData, lab_config
    cfg = lab_config("cuda")
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    x, y = SyntheticData(cfg.vocab_size, cfg.block_size, 8, device="cuda").batch(0)
    model(x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    events = [{k: e.get(k, 0) for k in ("action", "addr", "size", "stream")}
              for e in snap["device_traces"][torch.cuda.current_device()]]
    print(json.dumps({"events": events, "reserved": torch.cuda.memory_reserved()}))
""")


def _cuda_step_trace():
    """A course-GPT step on CUDA under ``torch.cuda.memory._record_memory_history``, in a fresh
    process: the allocator starts empty there. In this process earlier tests may hold memory
    ``empty_cache()`` cannot release (cuBLAS keeps its workspaces in the caching allocator until
    ``torch._C._cuda_clearCublasWorkspaces()``), and a replay that starts from a non-empty
    allocator cannot match it. The step's own cuBLAS workspace is in the trace (an alloc, never freed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", _CUDA_STEP], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, f"the CUDA step failed in its subprocess:\n{out.stderr[-3000:]}"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["events"], result["reserved"]


@pytest.mark.exercise("6.1", points=1)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_simulator_matches_the_real_cuda_allocator():
    """On CUDA, replay PyTorch's own allocation events of a GPT step (their requested sizes and
    streams): the simulator's segment sizes equal the snapshot's segment_alloc events, its
    reserved bytes ``torch.cuda.memory_reserved()``."""
    from labkit.lab6.caching_allocator import CachingAllocator

    events, reserved = _cuda_step_trace()
    alloc = CachingAllocator()
    by_addr = {}
    real_segments = []
    for e in events:
        if e["action"] == "alloc":
            by_addr[e["addr"]] = alloc.malloc(int(e["size"]), stream=int(e["stream"]))
        elif e["action"] == "free_requested":
            alloc.free(by_addr.pop(e["addr"]))
        elif e["action"] == "segment_alloc":
            real_segments.append(int(e["size"]))
    assert alloc.segment_log == real_segments, \
        f"segments {[mib(s) for s in alloc.segment_log]} vs the real allocator's {[mib(s) for s in real_segments]}"
    assert alloc.reserved_bytes == reserved, f"reserved {alloc.reserved_bytes:,} vs torch.cuda.memory_reserved() {reserved:,}"
