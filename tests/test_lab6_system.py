"""Graders of Lab 6 (labs/06_system.ipynb): the system view — allocator, memory planning, mesh.

References nobody in this course wrote:
* 6.1 the caching allocator: traces whose answers are derived by hand in each test from the
  rules of ``c10/cuda/CUDACachingAllocator.cpp`` (written out step by step); on a trace
  recorded from a real training step of the course GPT, the plain sums of the live requests
  (allocated bytes must equal the sum of the live requests rounded to 512 B at every event);
  on CUDA, PyTorch's own allocator on the same step (``torch.cuda.memory._snapshot``'s
  segment_alloc events and ``torch.cuda.memory_reserved``).
* 6.2 the static planner: an overlap checker and a brute-force optimum written here.
* 6.3 the device mesh: ``torch.distributed.device_mesh.init_device_mesh`` on 8 real gloo ranks,
  and ``torch.arange(world_size).view(shape)`` / ``torch.unravel_index`` without processes.

Every quantity compared here is an exact integer (bytes, addresses, ranks): no tolerances.
"""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from labkit.models import GPT, SyntheticData, lab_config

KiB, MiB = 1024, 1024 * 1024


def mib(x):
    return f"{x / MiB:.4g} MiB"


# =================================================================== 6.1 caching allocator

@pytest.mark.exercise("6.1", points=1)
@pytest.mark.parametrize("size,rounded,pool,segment", [
    (0, 512, "small", 2 * MiB),             # below one block: one block of 512 B
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
    alloc.malloc(15 * MiB)
    assert alloc.allocated_bytes == 16 * MiB, \
        f"allocated {mib(alloc.allocated_bytes)} after malloc(15 MiB), expected 16 MiB: a large block is split only if the remainder is > 1 MiB"
    b = alloc.malloc(2 * MiB)
    c = alloc.malloc(17 * MiB)
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
    assert d == c + 2 * MiB, f"malloc(3 MiB) at {d}, expected the tail at {c + 2 * MiB}: the 2 MiB hole is too small"
    alloc.free(a)
    e = alloc.malloc(3 * MiB)
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
    assert alloc.allocated_bytes == 0


@pytest.fixture(scope="module")
def gpt_trace():
    """The allocation trace of one training step (forward, backward, Adam) of the lab's GPT."""
    from labkit.lab6.caching_allocator import record_trace

    cfg = lab_config("cpu")
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters())
    x, y = SyntheticData(cfg.vocab_size, cfg.block_size, 16).batch(0)

    def step():
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    trace, _ = record_trace(step)
    return trace


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
        assert alloc.allocated_bytes == sum(live_rounded.values())
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


def _cuda_step_trace():
    """On CUDA: a course-GPT step under torch.cuda.memory._record_memory_history."""
    cfg = lab_config("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if torch.cuda.memory_reserved() != 0:
        pytest.skip("other tests still hold CUDA memory: run this test alone")
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        torch.manual_seed(0)
        model = GPT(cfg).cuda()
        opt = torch.optim.Adam(model.parameters(), foreach=False)
        x, y = SyntheticData(cfg.vocab_size, cfg.block_size, 8, device="cuda").batch(0)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        reserved = torch.cuda.memory_reserved()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return snap["device_traces"][torch.cuda.current_device()], reserved


@pytest.mark.exercise("6.1", points=1)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_simulator_matches_the_real_cuda_allocator():
    """On CUDA, replay PyTorch's own allocation events of a GPT step: the simulator's segment
    sizes equal the snapshot's segment_alloc events, its reserved bytes torch.cuda.memory_reserved."""
    from labkit.lab6.caching_allocator import CachingAllocator

    events, reserved = _cuda_step_trace()
    alloc = CachingAllocator()
    by_addr = {}
    real_segments = []
    for e in events:
        if e["action"] == "alloc":
            by_addr[e["addr"]] = alloc.malloc(int(e["size"]))
        elif e["action"] == "free_requested":
            alloc.free(by_addr.pop(e["addr"]))
        elif e["action"] == "segment_alloc":
            real_segments.append(int(e["size"]))
    assert alloc.segment_log == real_segments, \
        f"segments {[mib(s) for s in alloc.segment_log]} vs the real allocator's {[mib(s) for s in real_segments]}"
    assert alloc.reserved_bytes == reserved, f"reserved {alloc.reserved_bytes:,} vs torch.cuda.memory_reserved() {reserved:,}"


# =================================================================== 6.2 static planner

def overlapping_pairs(tensors, offsets):
    """The checker: pairs of tensors alive at the same event whose byte ranges intersect."""
    bad = []
    for a, b in itertools.combinations(tensors, 2):
        alive_together = a.start <= b.end and b.start <= a.end
        disjoint = offsets[a.id] + a.size <= offsets[b.id] or offsets[b.id] + b.size <= offsets[a.id]
        if alive_together and not disjoint and a.size and b.size:
            bad.append((a, b))
    return bad


def brute_force_arena(tensors):
    """The optimum, written independently: every order, each tensor at the lowest offset that
    is free of all conflicting tensors placed before it (candidates: 0 and every end of a
    placed conflicting tensor); the smallest arena over all orders."""
    best = None
    for order in itertools.permutations(tensors):
        off = {}
        for t in order:
            others = [u for u in order if u.id in off and u.start <= t.end and t.start <= u.end]
            for cand in sorted({0} | {off[u.id] + u.size for u in others}):
                if all(cand + t.size <= off[u.id] or off[u.id] + u.size <= cand for u in others):
                    off[t.id] = cand
                    break
        size = max(off[t.id] + t.size for t in tensors)
        best = size if best is None else min(best, size)
    return best


def random_instance(seed, n=6, horizon=10):
    from labkit.lab6.memory_planner import TensorLife

    rng = random.Random(seed)
    out = []
    for i in range(n):
        start = rng.randrange(horizon)
        out.append(TensorLife(i, rng.choice([1, 2, 3, 5, 8]) * 512, start, start + rng.randrange(1, 5)))
    return out


def check_plan(tensors, offsets, what):
    assert set(offsets) == {t.id for t in tensors}, f"{what}: offsets for ids {sorted(offsets)[:5]}..., expected every tensor's id"
    assert all(isinstance(o, int) and o >= 0 for o in offsets.values()), f"{what}: offsets must be ints >= 0"
    bad = overlapping_pairs(tensors, offsets)
    assert not bad, (f"{what}: {len(bad)} pairs of tensors alive at the same time overlap, e.g. "
                     f"{bad[0][0]} at {offsets[bad[0][0].id]} and {bad[0][1]} at {offsets[bad[0][1].id]}: "
                     f"a placed tensor whose lifetime intersects must be avoided")


@pytest.mark.exercise("6.2", points=1)
@pytest.mark.parametrize("planner", ["place_in_given_order", "plan_greedy_by_size", "plan_in_order_of_allocation"])
def test_plans_never_overlap_live_tensors(planner):
    """Check with the overlap checker on 30 random instances of 6 tensors and 2 of 40."""
    from labkit.lab6 import memory_planner as mp

    for seed in range(32):
        tensors = random_instance(seed, n=6 if seed < 30 else 40, horizon=10 if seed < 30 else 30)
        if planner == "place_in_given_order":
            offsets = mp.place(tensors, [t.id for t in reversed(tensors)])
        else:
            offsets = getattr(mp, planner)(tensors)
        check_plan(tensors, offsets, f"{planner}, instance {seed}")


@pytest.mark.exercise("6.2", points=1)
def test_place_takes_the_lowest_gap():
    """Hand-derived: A (4 KiB, events 0–9), B (1 KiB, 0–2), C (1 KiB, 3–5), D (2 KiB, 1–4) in
    order A, B, C, D. A at 0; B conflicts with A → 4096; C conflicts with A only (B ended at
    2) → 4096; D conflicts with A, B and C → the lowest gap of 2 KiB is above them: 5120."""
    from labkit.lab6.memory_planner import TensorLife, place

    A, B, C, D = (TensorLife(0, 4096, 0, 9), TensorLife(1, 1024, 0, 2),
                  TensorLife(2, 1024, 3, 5), TensorLife(3, 2048, 1, 4))
    got = place([A, B, C, D], [0, 1, 2, 3])
    assert got == {0: 0, 1: 4096, 2: 4096, 3: 5120}, \
        f"place gave {got}, expected {{0: 0, 1: 4096, 2: 4096, 3: 5120}}: C may reuse B's bytes (their lifetimes do not intersect)"
    # An exact gap: P (1 KiB, 0–3) at 0, Q (2 KiB, 0–9) at 1024; R (1 KiB, 5–9) conflicts
    # only with Q, and the gap [0, 1024) below Q is exactly R's size → R at 0.
    P, Q, R = TensorLife(10, 1024, 0, 3), TensorLife(11, 2048, 0, 9), TensorLife(12, 1024, 5, 9)
    got = place([P, Q, R], [10, 11, 12])
    assert got == {10: 0, 11: 1024, 12: 0}, f"place gave {got}, expected {{10: 0, 11: 1024, 12: 0}}: a gap exactly as large as the tensor fits"


@pytest.mark.exercise("6.2", points=1)
def test_greedy_by_size_orders_largest_first():
    """Hand-derived: greedy by size places A (4 KiB) at 0, then D (2 KiB) at 4096, then B and C
    (1 KiB, B first: longer-lived ties are equal, lower id) at 6144: arena 7 KiB. In
    allocation order (A, B, D, C) the arena is also 7 KiB; the lower bound is 7 KiB (A+B+D
    alive at events 1–2)."""
    from labkit.lab6.memory_planner import TensorLife, arena_size, peak_live, plan_greedy_by_size

    tensors = [TensorLife(0, 4096, 0, 9), TensorLife(1, 1024, 0, 2), TensorLife(2, 1024, 3, 5),
               TensorLife(3, 2048, 1, 4)]
    got = plan_greedy_by_size(tensors)
    assert got == {0: 0, 3: 4096, 1: 6144, 2: 6144}, f"greedy by size gave {got}, expected A 0, D 4096, B 6144, C 6144: largest first"
    assert arena_size(tensors, got) == peak_live(tensors) == 7168


@pytest.mark.exercise("6.2", points=1)
def test_order_of_allocation_places_by_start():
    """Hand-derived, the same A, B, C, D: by start (then id) the order is A, B, D, C: A at 0,
    B at 4096, D (alive with A and B) at 5120, C (alive with A and D; B has ended) in the
    1 KiB gap at 4096. (By end of life it would be B, D, C, A: a different plan.)"""
    from labkit.lab6.memory_planner import TensorLife, plan_in_order_of_allocation

    tensors = [TensorLife(0, 4096, 0, 9), TensorLife(1, 1024, 0, 2), TensorLife(2, 1024, 3, 5),
               TensorLife(3, 2048, 1, 4)]
    got = plan_in_order_of_allocation(tensors)
    assert got == {0: 0, 1: 4096, 3: 5120, 2: 4096}, \
        f"order of allocation gave {got}, expected A 0, B 4096, D 5120, C 4096: place in order of start, ties by id"


@pytest.mark.exercise("6.2", points=2)
def test_plan_optimal_matches_brute_force():
    """On 12 random instances of 6 tensors, plan_optimal's arena equals an independent brute
    force, and greedy by size is never smaller than that optimum (sanity)."""
    from labkit.lab6.memory_planner import TensorLife, arena_size, plan_greedy_by_size, plan_optimal

    # Hand-derived first: X (1 KiB, 0–1), Y (1 KiB, 0–9), Z (2 KiB, 2–9). In the given order
    # X 0, Y 1024, Z 2048 (the 1 KiB hole under Y is too small): 4 KiB. Optimal: Y 0, X and Z
    # at 1024 (they never live together): 3 KiB.
    xyz = [TensorLife(0, 1024, 0, 1), TensorLife(1, 1024, 0, 9), TensorLife(2, 2048, 2, 9)]
    got = arena_size(xyz, plan_optimal(xyz))
    assert got == 3072, f"plan_optimal's arena for X, Y, Z is {got:,} B, expected 3,072: is every order tried?"
    for seed in range(12):
        tensors = random_instance(100 + seed)
        want = brute_force_arena(tensors)
        offsets = plan_optimal(tensors)
        check_plan(tensors, offsets, f"plan_optimal, instance {seed}")
        got = arena_size(tensors, offsets)
        assert got == want, f"instance {seed}: plan_optimal's arena {got:,} B, brute force {want:,} B: is every order tried?"
        assert arena_size(tensors, plan_greedy_by_size(tensors)) >= want


@pytest.mark.exercise("6.2", points=2)
def test_greedy_plan_of_the_real_step_is_near_the_lower_bound(gpt_trace):
    """On the real GPT step (sizes rounded to 512 B): a valid plan whose arena is within 2% of
    the peak of live bytes. 2%: Pisarchyk & Lee (2020) report greedy by size within a few % of
    the bound on real networks; on this trace it is within 0.01%."""
    from labkit.lab6.memory_planner import arena_size, lifetimes, peak_live, plan_greedy_by_size

    tensors = lifetimes(gpt_trace, round_to=512)
    offsets = plan_greedy_by_size(tensors)
    check_plan(tensors, offsets, "greedy by size on the GPT step")
    bound = peak_live(tensors)
    got = arena_size(tensors, offsets)
    assert bound <= got <= 1.02 * bound, f"arena {got:,} B vs the peak of live bytes {bound:,} B (ratio {got / bound:.3f}), expected ≤ 1.02"


# =================================================================== 6.3 device mesh

MESH_SHAPES = [
    ((8,), ("dp",)),
    ((2, 4), ("dp", "tp")),
    ((2, 2, 2), ("dp", "pp", "tp")),
    ((4, 2, 2, 8), ("dp", "pp", "cp", "tp")),
    ((8, 16, 8), ("dp", "pp", "tp")),       # 1024 ranks
    ((3, 5, 7), ("a", "b", "c")),           # sizes with no common factor
]


@pytest.mark.exercise("6.3", points=1)
@pytest.mark.parametrize("shape,names", MESH_SHAPES, ids=lambda v: "x".join(map(str, v)) if isinstance(v[0], int) else None)
def test_coords_match_torch_unravel_index(shape, names):
    """Check coords_of(rank) against torch.unravel_index and rank_of as its inverse, all ranks."""
    from labkit.lab6.device_mesh import coords_of, rank_of

    n = math.prod(shape)
    ref = torch.stack(torch.unravel_index(torch.arange(n), shape), dim=1).tolist()
    for rank in range(n):
        got = coords_of(rank, shape)
        assert list(got) == ref[rank], \
            f"coords_of({rank}, {shape}) = {got}, expected {tuple(ref[rank])}: the LAST dimension (tp) is innermost"
        back = rank_of(tuple(ref[rank]), shape)
        assert back == rank, f"rank_of({tuple(ref[rank])}, {shape}) = {back}, expected {rank}"


@pytest.mark.exercise("6.3", points=1)
@pytest.mark.parametrize("shape,names", MESH_SHAPES, ids=lambda v: "x".join(map(str, v)) if isinstance(v[0], int) else None)
def test_axis_groups_match_the_mesh_tensor(shape, names):
    """Check every axis' groups against the mesh tensor torch's DeviceMesh builds,
    ``arange(world_size).view(shape)``: the groups along dim d are its rows after moving d last."""
    from labkit.lab6.device_mesh import axis_groups

    mesh = torch.arange(math.prod(shape)).view(shape)
    for d, axis in enumerate(names):
        ref = sorted(mesh.movedim(d, -1).reshape(-1, shape[d]).tolist())
        got = axis_groups(shape, names, axis)
        assert got == ref, (f"groups along {axis!r} of {shape}: first {got[:2]}..., expected {ref[:2]}...: "
                            f"ranks that differ only in the {axis!r} coordinate, in coordinate order, sorted by first rank")


def test_bad_meshes_raise():
    """Not graded (the checks are infrastructure, in the stub too): a shape whose product is not
    the world size, a dimension name twice, an unknown axis, a rank outside."""
    from labkit.lab6.device_mesh import axis_groups, check_mesh, coords_of

    with pytest.raises(ValueError, match="world_size"):
        check_mesh((2, 3), ("dp", "tp"), world_size=8)
    with pytest.raises(ValueError, match="distinct"):
        axis_groups((2, 2), ("dp", "dp"), "dp")
    with pytest.raises(ValueError, match="axis"):
        axis_groups((2, 2), ("dp", "tp"), "pp")
    with pytest.raises(ValueError, match="rank"):
        coords_of(8, (2, 4))


@pytest.fixture(scope="module")
def mesh_ranks():
    from labkit.harness.lab6_parallel import mesh_worker
    from labkit.dist import launch

    try:
        return launch(mesh_worker, 8, (2, 2, 2), ("dp", "pp", "tp"), timeout=120.0)
    except NotImplementedError:
        raise
    except Exception as exc:  # a stub's NotImplementedError arrives wrapped in RankError
        if "NotImplementedError" in str(exc):
            raise NotImplementedError(f"exercise 6.3: {exc}") from exc
        raise


@pytest.mark.exercise("6.3", points=2)
def test_groups_match_init_device_mesh_on_8_gloo_ranks(mesh_ranks):
    """On 8 real gloo ranks (2×2×2, dp, pp, tp): every rank's group along each axis equals the
    ranks of init_device_mesh's group for that dimension, and the mesh layouts agree."""
    from labkit.lab6.device_mesh import rank_of

    want_mesh = [[[rank_of((d, p, t), (2, 2, 2)) for t in range(2)] for p in range(2)] for d in range(2)]
    for rank, out in enumerate(mesh_ranks):
        assert out["torch_mesh"] == want_mesh, f"init_device_mesh's mesh {out['torch_mesh']} vs rank_of's {want_mesh}"
        for axis in ("dp", "pp", "tp"):
            assert out["ours"][axis] == out["torch_groups"][axis], \
                f"rank {rank}, axis {axis!r}: our group {out['ours'][axis]} vs init_device_mesh's {out['torch_groups'][axis]}"


@pytest.mark.exercise("6.3", points=1)
def test_all_reduce_along_each_axis_sums_the_groups_members(mesh_ranks):
    """An all-reduce of rank + 1 in our gloo group along each axis gives the sum over the
    members PyTorch's mesh puts in that group."""
    for rank, out in enumerate(mesh_ranks):
        for axis in ("dp", "pp", "tp"):
            want = float(sum(r + 1 for r in out["torch_groups"][axis]))
            assert out["sums"][axis] == want, \
                f"rank {rank}, axis {axis!r}: all-reduce gave {out['sums'][axis]}, expected {want} (members {out['torch_groups'][axis]})"
            assert out["torch_sums"][axis] == want


# =================================================================== 6.5 fusion

# The fused operator and F.gelu evaluate the same formula in another order: a few fp32 ulps of
# outputs of magnitude ≤ ~12 (atol 1e-6, rtol 1e-5). Gradients: the factor 1 − t² cancels
# for |x| ≳ 2, so its fp32 error ~6e-8 is multiplied by 0.5·|x|·k·(1 + 3a·x²)·|g| ≤ ~50 for
# |x| ≤ 12: up to ~3e-6 absolute (atol 1e-5).
FUSION_TOL = dict(atol=1e-6, rtol=1e-5)
FUSION_GRAD_TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.exercise("6.5", points=1)
def test_fused_gelu_matches_torch_gelu_tanh():
    """Outputs and input gradients equal torch.nn.functional.gelu(x, approximate="tanh")."""
    import torch.nn.functional as F

    from labkit.lab6.fusion import fused_gelu_tanh

    torch.manual_seed(0)
    x = (3 * torch.randn(37, 129)).requires_grad_()
    g = torch.randn(37, 129)
    y = fused_gelu_tanh(x)
    (gx,) = torch.autograd.grad(y, x, g)
    ref = F.gelu(x, approximate="tanh")
    (gref,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(y, ref, **FUSION_TOL, msg=lambda m: f"output: {m} — is the formula (k, a, 0.5) right?")
    torch.testing.assert_close(gx, gref, **FUSION_GRAD_TOL,
                               msg=lambda m: f"input gradient: {m} — dy/dx = 0.5(1+t) + 0.5·x·(1−t²)·k·(1+3a·x²)")


@pytest.mark.exercise("6.5", points=1)
def test_fused_gelu_gradcheck_in_float64():
    """torch.autograd.gradcheck (finite differences in float64) on the fused backward."""
    from labkit.lab6.fusion import fused_gelu_tanh

    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fused_gelu_tanh, (x,)), "gradcheck failed: the backward is not the derivative of the forward"


@pytest.mark.exercise("6.5", points=1)
def test_fused_gelu_saves_only_its_input():
    """Saved bytes (saved_tensors_hooks, distinct storages): the unfused chain saves x, tanh's
    output t, 0.5·x and 1 + t — 16 bytes per fp32 element (measured here on the chain); the
    fused operator only x: 4 bytes per element, 12 fewer."""
    from labkit.lab6.fusion import fused_gelu_tanh, gelu_tanh_unfused
    from labkit.measure import saved_activation_bytes

    x = torch.randn(64, 1000, requires_grad=True)
    n = x.numel()
    unfused = saved_activation_bytes(lambda: gelu_tanh_unfused(x))
    assert unfused == 16 * n  # the chain itself: 4 tensors of 4n bytes
    fused = saved_activation_bytes(lambda: fused_gelu_tanh(x))
    assert fused == unfused - 12 * n, \
        f"the fused operator saves {fused:,} B, expected {unfused - 12 * n:,} = the chain's {unfused:,} − 12·{n:,}: save only the input x"


@pytest.mark.exercise("6.5", points=1)
def test_fused_gelu_lowers_held_and_peak_bytes_by_the_prediction():
    """Six layers of GELU in a row, forward then backward, under MemTracker (labkit.measure):
    after forward the fused chain holds 12 B per element per layer less (exact: outputs +
    saved tensors); the peak of forward + backward is lower by at least 12·n·(L − 2): at the
    peak both hold all layers' saved tensors, and a fused backward may allocate up to 3
    temporaries of n elements more than the chain's (12·n of slack)."""
    from labkit.lab6.fusion import fused_gelu_tanh, gelu_tanh_unfused, retained_bytes
    from labkit.measure import peak_bytes

    x = torch.randn(64, 1000, requires_grad=True)
    n, L = x.numel(), 6

    def stack(f):
        def run(x):
            for _ in range(L):
                x = f(x)
            return x
        return run

    held_unfused, held_fused = retained_bytes(stack(gelu_tanh_unfused), x), retained_bytes(stack(fused_gelu_tanh), x)
    assert held_unfused - held_fused == 12 * n * L, \
        f"after forward the fused chain holds {held_fused:,} B vs {held_unfused:,} B: expected {12 * n * L:,} B less (12 per element per layer)"

    def forward_backward(f):
        stack(f)(x).sum().backward()

    peak_unfused, _ = peak_bytes(forward_backward, gelu_tanh_unfused)
    peak_fused, _ = peak_bytes(forward_backward, fused_gelu_tanh)
    assert peak_unfused - peak_fused >= 12 * n * (L - 2), \
        f"peak {peak_fused:,} B fused vs {peak_unfused:,} B unfused: expected at least {12 * n * (L - 2):,} B lower"
