"""A simulator of PyTorch's CUDA caching allocator: why "reserved" is larger than "allocated".

``cudaMalloc`` and ``cudaFree`` are slow and synchronize the device, so PyTorch never frees GPU
memory back to the driver during training. Its caching allocator
(``c10/cuda/CUDACachingAllocator.cpp``) asks the driver for large *segments*, cuts them into
*blocks* for tensors, and keeps freed blocks cached for the next request of a similar size.
``torch.cuda.memory_allocated()`` counts the blocks in use; ``torch.cuda.memory_reserved()``
counts the segments. The difference is cached or unusable memory: fragmentation.

The rules this module reproduces (names of the C++ source in brackets):

* every request is rounded up to a multiple of 512 B [``kMinBlockSize``, ``round_size``];
* a rounded request ≤ 1 MiB [``kSmallSize``] goes to the *small pool*, larger to the *large pool*;
* a new segment is 2 MiB [``kSmallBuffer``] for the small pool, 20 MiB [``kLargeBuffer``] for a
  request < 10 MiB [``kMinLargeAlloc``], otherwise the request rounded up to 2 MiB
  [``kRoundLarge``] (``get_allocation_size``);
* a request takes the smallest cached block of its pool that fits, lowest address first among
  equal sizes (``get_free_block``: ``lower_bound`` in a set ordered by (stream, size, address));
  with ``max_split_size`` set, a request below it never takes a block ≥ it, and a request ≥ it
  takes a block only if less than 20 MiB larger;
* the block is split when the remainder is ≥ 512 B (small pool) or > 1 MiB (large pool, and only
  for requests below ``max_split_size``) (``should_split``);
* a freed block is cached and merged with free neighbours of its segment (``free_block``,
  ``try_merge_blocks``);
* segments go back to the driver only when a ``cudaMalloc`` fails (then every fully free segment
  is released and the ``cudaMalloc`` retried; with ``max_split_size`` set, free oversize
  segments (≥ it) go first, a simplification of ``release_available_cached_blocks``) or on ``torch.cuda.empty_cache()`` (``release_cached_blocks``);
* ``expandable_segments``: instead of many fixed segments, one growing virtual range per pool,
  mapped in pages of 2 MiB (small) or 20 MiB (large); every block splits down to 512 B.

Chapter 6 (book/06_system.md); Lab 6, exercise 6.1 (labs/06_system.ipynb).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

KiB, MiB = 1024, 1024 * 1024
MIN_BLOCK_SIZE = 512            # kMinBlockSize: every block is a multiple of it
SMALL_SIZE = 1 * MiB            # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MiB          # kSmallBuffer: segment size of the small pool
LARGE_BUFFER = 20 * MiB         # kLargeBuffer: segment for requests of 1 MiB to 10 MiB
MIN_LARGE_ALLOC = 10 * MiB      # kMinLargeAlloc: from here segments are sized to the request
ROUND_LARGE = 2 * MiB           # kRoundLarge: rounding of those segments


class SimulatedOOM(MemoryError):
    """The simulated device has no room for a segment even after releasing the cached ones."""


def _check_size(size, name="size"):
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"{name} must be an int >= 0 (bytes), got {size!r}")


def round_size(size: int) -> int:
    """The bytes of the block that serves a request of ``size`` bytes (always ≥ 512 B)."""
    _check_size(size)
    # BEGIN SOLUTION 6.1: round up to the allocator's block granularity (never below one block)
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * math.ceil(size / MIN_BLOCK_SIZE)
    # END SOLUTION


def pool_of(size: int) -> str:
    """``"small"`` or ``"large"``: the pool that serves a request of ``size`` bytes."""
    _check_size(size)
    # BEGIN SOLUTION 6.1: which pool serves the (rounded) request
    return "small" if round_size(size) <= SMALL_SIZE else "large"
    # END SOLUTION


def segment_size(size: int) -> int:
    """The bytes of the new segment reserved when no cached block can serve ``size`` bytes."""
    _check_size(size)
    # BEGIN SOLUTION 6.1: the segment size of get_allocation_size for the rounded request
    size = round_size(size)
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(size / ROUND_LARGE)
    # END SOLUTION


@dataclass(eq=False)
class Block:
    """A piece of a segment: ``[addr, addr + size)``; ``allocated`` while a tensor uses it."""
    addr: int
    size: int
    pool: str
    segment: "Segment"
    allocated: bool = False
    requested: int = 0


@dataclass(eq=False)
class Segment:
    """One cudaMalloc (or, expandable, one growing mapped range): blocks in address order."""
    addr: int
    size: int
    pool: str
    blocks: list = field(default_factory=list)
    expandable: bool = False


class CachingAllocator:
    """Replays malloc/free requests under the rules of PyTorch's CUDA caching allocator.

    Args:
        capacity: device bytes available for segments (None: unlimited). When a new segment
            does not fit, cached segments are released and the request retried; if it still
            does not fit, ``SimulatedOOM``.
        max_split_size: ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb`` in bytes (None: off).
        expandable_segments: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.

    State: ``allocated_bytes`` (sum of the blocks in use), ``reserved_bytes`` (sum of the
    segments), ``requested_bytes`` (sum of the requests in use), ``segment_log`` (the size of
    every segment reserved, in order), ``num_alloc_retries``, ``num_ooms``.
    """

    def __init__(self, capacity: int | None = None, *, max_split_size: int | None = None,
                 expandable_segments: bool = False):
        if capacity is not None:
            _check_size(capacity, "capacity")
        if max_split_size is not None:
            _check_size(max_split_size, "max_split_size")
            if max_split_size < LARGE_BUFFER:  # as PyTorch's parser: max_split_size_mb >= 20
                raise ValueError(f"max_split_size must be >= 20 MiB ({LARGE_BUFFER} B), got {max_split_size}")
        if not isinstance(expandable_segments, bool):
            raise TypeError(f"expandable_segments must be a bool, got {expandable_segments!r}")
        self.capacity = capacity
        self.max_split_size = max_split_size
        self.expandable = expandable_segments
        self.segments: list[Segment] = []
        self.free_blocks: dict[str, set] = {"small": set(), "large": set()}
        self.in_use: dict[int, Block] = {}           # address → allocated block
        self.allocated_bytes = self.reserved_bytes = self.requested_bytes = 0
        self.segment_log: list[int] = []
        self.num_alloc_retries = self.num_ooms = 0
        self._next_addr = 0

    # ------------------------------------------------------------------ infrastructure
    def _new_address_range(self, size: int) -> int:
        addr = self._next_addr
        self._next_addr += ROUND_LARGE * math.ceil((size + 1) / ROUND_LARGE)  # never adjacent
        return addr

    def _device_alloc(self, size: int, pool: str) -> Segment | None:
        """cudaMalloc: a new segment of ``size`` bytes, or None when it would exceed capacity."""
        if self.capacity is not None and self.reserved_bytes + size > self.capacity:
            return None
        seg = Segment(self._new_address_range(size), size, pool)
        seg.blocks.append(Block(seg.addr, size, pool, seg))
        self.segments.append(seg)
        self.reserved_bytes += size
        self.segment_log.append(size)
        return seg

    def _device_free(self, seg: Segment) -> None:
        """cudaFree of a whole segment (it must hold one free block)."""
        (block,) = seg.blocks
        self.free_blocks[seg.pool].discard(block)
        self.segments.remove(seg)
        self.reserved_bytes -= seg.size

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool == "small" or self.expandable:
            return remaining >= MIN_BLOCK_SIZE
        limit = self.max_split_size if self.max_split_size is not None else math.inf
        return size < limit and remaining > SMALL_SIZE

    # ------------------------------------------------------------------ the rules
    def _best_fit(self, pool: str, size: int) -> Block | None:
        """The cached block of ``pool`` that serves ``size`` (rounded) bytes, or None.

        Smallest size first, then lowest address; the ``max_split_size`` limits apply.
        """
        # BEGIN SOLUTION 6.1: smallest fitting free block (ties: lowest address), honouring max_split_size
        candidates = [b for b in self.free_blocks[pool] if b.size >= size]
        if not candidates:
            return None
        block = min(candidates, key=lambda b: (b.size, b.addr))
        if self.max_split_size is not None:
            if size < self.max_split_size and block.size >= self.max_split_size:
                return None
            if size >= self.max_split_size and block.size >= size + LARGE_BUFFER:
                return None
        return block
        # END SOLUTION

    def _take(self, block: Block, size: int, requested: int) -> Block:
        """Mark ``block`` allocated for ``size`` bytes, splitting off the remainder if the rules say so."""
        # BEGIN SOLUTION 6.1: split off the remainder when _should_split allows, keep it cached; mark the block in use
        self.free_blocks[block.pool].discard(block)
        if self._should_split(block, size):
            rest = Block(block.addr + size, block.size - size, block.pool, block.segment)
            block.size = size
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, rest)
            self.free_blocks[block.pool].add(rest)
        block.allocated, block.requested = True, requested
        self.in_use[block.addr] = block
        self.allocated_bytes += block.size
        self.requested_bytes += requested
        return block
        # END SOLUTION

    def _grow_expandable(self, pool: str, size: int) -> Block | None:
        """Expandable segments: map whole pages at the end of the pool's range so that its
        trailing free block (or a new one) has ``size`` bytes; None if capacity forbids."""
        page = SMALL_BUFFER if pool == "small" else LARGE_BUFFER
        seg = next((s for s in self.segments if s.pool == pool), None)
        if seg is None:
            seg = Segment(self._new_address_range(1 << 50), 0, pool, expandable=True)
            self.segments.append(seg)
        tail = seg.blocks[-1] if seg.blocks and not seg.blocks[-1].allocated else None
        have = tail.size if tail is not None else 0
        extra = page * math.ceil((size - have) / page)
        if self.capacity is not None and self.reserved_bytes + extra > self.capacity:
            return None
        if tail is None:
            tail = Block(seg.addr + seg.size, 0, pool, seg)
            seg.blocks.append(tail)
        tail.size += extra
        seg.size += extra
        self.reserved_bytes += extra
        self.segment_log.append(extra)
        self.free_blocks[pool].add(tail)
        return tail

    def _release_cached(self, size: int | None = None) -> None:
        """Give cached memory back to the device: with ``size`` (an OOM retry under
        ``max_split_size``) only oversize free segments, otherwise every fully free segment
        (expandable: the free pages at the end of each range)."""
        # BEGIN SOLUTION 6.1: release every segment that is one free block (expandable: unmap the trailing free pages)
        for seg in list(self.segments):
            if seg.expandable:
                tail = seg.blocks[-1] if seg.blocks else None
                if tail is None or tail.allocated:
                    continue
                page = SMALL_BUFFER if seg.pool == "small" else LARGE_BUFFER
                start = tail.addr - seg.addr
                keep = page * math.ceil(start / page) - start  # the free part of a still-used page
                drop = tail.size - keep
                if drop <= 0:
                    continue
                tail.size = keep
                seg.size -= drop
                self.reserved_bytes -= drop
                if keep == 0:
                    self.free_blocks[seg.pool].discard(tail)
                    seg.blocks.pop()
                continue
            if len(seg.blocks) == 1 and not seg.blocks[0].allocated:
                if size is None or seg.size >= self.max_split_size:
                    self._device_free(seg)
        # END SOLUTION

    def malloc(self, size: int) -> int:
        """Serve a request of ``size`` bytes; returns the block's address (the handle for ``free``).

        Order: a cached block (best fit); else a new segment; else release cached segments and
        retry the new segment (``num_alloc_retries``); else ``SimulatedOOM`` (``num_ooms``).
        """
        _check_size(size)
        # BEGIN SOLUTION 6.1: round, pick the pool, best fit, else a new segment (expandable: grow), else release cached and retry, else OOM
        rounded = round_size(size)
        pool = pool_of(size)
        block = self._best_fit(pool, rounded)
        if block is None:
            block = self._new_block(pool, rounded)
        if block is None and self.max_split_size is not None and not self.expandable:
            self._release_cached(rounded)
            block = self._new_block(pool, rounded)
        if block is None:
            self.num_alloc_retries += 1
            self._release_cached()
            block = self._new_block(pool, rounded)
        if block is None:
            self.num_ooms += 1
            raise SimulatedOOM(
                f"cannot reserve a segment for {size:,} B: {self.reserved_bytes:,} B reserved, "
                f"{self.allocated_bytes:,} B allocated, capacity {self.capacity:,} B")
        return self._take(block, rounded, size).addr
        # END SOLUTION

    def _new_block(self, pool: str, rounded: int) -> Block | None:
        if self.expandable:
            return self._grow_expandable(pool, rounded)
        seg = self._device_alloc(segment_size(rounded), pool)
        if seg is None:
            return None
        self.free_blocks[pool].add(seg.blocks[0])
        return seg.blocks[0]

    def free(self, addr: int) -> None:
        """Return the block at ``addr`` to the cache, merged with its free neighbours."""
        if addr not in self.in_use:
            raise ValueError(f"free of an unknown block: address {addr!r} is not allocated")
        # BEGIN SOLUTION 6.1: unmark the block, merge it with a free previous and next block of its segment, cache it
        block = self.in_use.pop(addr)
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        block.allocated, block.requested = False, 0
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and not blocks[i + 1].allocated:
            nxt = blocks.pop(i + 1)
            self.free_blocks[block.pool].discard(nxt)
            block.size += nxt.size
        if i > 0 and not blocks[i - 1].allocated:
            prev = blocks[i - 1]
            self.free_blocks[block.pool].discard(prev)
            prev.size += block.size
            blocks.pop(i)
            block = prev
        self.free_blocks[block.pool].add(block)
        # END SOLUTION

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached segment that holds no tensor."""
        self._release_cached()

    def fragmentation(self) -> float:
        """1 − allocated / reserved: the share of reserved memory that holds no tensor (0 if none)."""
        return 0.0 if self.reserved_bytes == 0 else 1 - self.allocated_bytes / self.reserved_bytes


# ====================================================================== traces (infrastructure)

@dataclass
class ReplayResult:
    """Bytes after every event of a replayed trace."""
    allocated: list[int]
    reserved: list[int]
    requested: list[int]
    segment_log: list[int]
    allocator: CachingAllocator

    @property
    def peak_allocated(self) -> int:
        return max(self.allocated, default=0)

    @property
    def peak_reserved(self) -> int:
        return max(self.reserved, default=0)


def check_trace(trace) -> None:
    """A trace is a list of ``("alloc", id, nbytes)`` and ``("free", id, 0)``; each id is
    allocated once and freed at most once, after its allocation."""
    live = set()
    seen = set()
    for k, event in enumerate(trace):
        if not (isinstance(event, tuple) and len(event) == 3 and event[0] in ("alloc", "free")):
            raise ValueError(f"trace[{k}] must be ('alloc'|'free', id, nbytes), got {event!r}")
        op, ident, nbytes = event
        if op == "alloc":
            _check_size(nbytes, f"trace[{k}] nbytes")
            if ident in seen:
                raise ValueError(f"trace[{k}]: id {ident!r} allocated twice")
            seen.add(ident)
            live.add(ident)
        else:
            if ident not in live:
                raise ValueError(f"trace[{k}]: free of id {ident!r}, which is not allocated")
            live.remove(ident)


def replay(trace, **allocator_kwargs) -> ReplayResult:
    """Replay a trace in a fresh ``CachingAllocator(**allocator_kwargs)``."""
    check_trace(trace)
    alloc = CachingAllocator(**allocator_kwargs)
    handles = {}
    allocated, reserved, requested = [], [], []
    for op, ident, nbytes in trace:
        if op == "alloc":
            handles[ident] = alloc.malloc(nbytes)
        else:
            alloc.free(handles.pop(ident))
        allocated.append(alloc.allocated_bytes)
        reserved.append(alloc.reserved_bytes)
        requested.append(alloc.requested_bytes)
    return ReplayResult(allocated, reserved, requested, list(alloc.segment_log), alloc)


def record_trace(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and record every storage it creates and frees, in order.

    A ``TorchDispatchMode`` sees every tensor an operator returns (forward, backward and the
    optimizer alike); a storage that is not one of the operator's inputs' (in-place results
    and views are not allocations) and not already recorded is an allocation of its ``nbytes``,
    and a ``weakref.finalize`` on it records the free. Storages that existed before (the
    parameters) are not in the trace; zero-byte storages are skipped (the CUDA allocator does
    not allocate them either). Returns ``(trace, result of fn)``; ids are consecutive ints.
    """
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    events, live = [], {}
    counter = [0]

    def on_free(key, ident):
        if live.get(key) == ident:
            del live[key]
        events.append(("free", ident, 0))

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = {(t.untyped_storage().device.type, t.untyped_storage().data_ptr())
                      for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                key = (st.device.type, st.data_ptr())
                if st.nbytes() == 0 or key in live or key in inputs:  # in-place results and views
                    continue
                ident = counter[0]
                counter[0] += 1
                live[key] = ident
                events.append(("alloc", ident, st.nbytes()))
                weakref.finalize(st, on_free, key, ident)
            return out

    with _Recorder():
        result = fn(*args, **kwargs)
    return list(events), result  # frees after the mode exits are not part of the recording


def peak_live_bytes(trace, rounded: bool = False) -> int:
    """The peak of the bytes alive at once (requests, or rounded to 512 B with ``rounded``)."""
    check_trace(trace)
    sizes, live, peak = {}, 0, 0
    for op, ident, nbytes in trace:
        if op == "alloc":
            sizes[ident] = round_size(nbytes) if rounded else nbytes
            live += sizes[ident]
            peak = max(peak, live)
        else:
            live -= sizes.pop(ident)
    return peak
