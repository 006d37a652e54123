"""A simulator of PyTorch's CUDA caching allocator: why "reserved" is larger than "allocated".

``cudaMalloc`` and ``cudaFree`` are slow and synchronize the device, so PyTorch never frees GPU
memory back to the driver during training. Its caching allocator
(``c10/cuda/CUDACachingAllocator.cpp``) asks the driver for large *segments*, cuts them into
*blocks* for tensors, and keeps freed blocks cached for the next request of a similar size.
``torch.cuda.memory_allocated()`` counts the blocks in use; ``torch.cuda.memory_reserved()``
counts the segments. The difference is cached or unusable memory: fragmentation.

The rules this module reproduces (names of the C++ source in brackets):

* a request of 0 bytes touches no pool: it gets a null pointer (``allocate``: ``if (size != 0)``);
* every other request is rounded up to a multiple of 512 B [``kMinBlockSize``, ``round_size``];
* a rounded request ≤ 1 MiB [``kSmallSize``] goes to the *small pool*, larger to the *large pool*;
* a new segment is 2 MiB [``kSmallBuffer``] for the small pool, 20 MiB [``kLargeBuffer``] for a
  request < 10 MiB [``kMinLargeAlloc``], otherwise the request rounded up to 2 MiB
  [``kRoundLarge``] (``get_allocation_size``);
* a request takes the smallest cached block of its pool and stream that fits, lowest address
  first among equal sizes (``get_free_block``: ``lower_bound`` in a ``std::set`` ordered by
  ``BlockComparatorSize``, i.e. by (stream, size, address)); with ``max_split_size`` set, a
  request below it never takes a block ≥ it, and a request ≥ it takes a block only if it is
  less than 20 MiB larger;
* the block is split when the remainder is ≥ 512 B (small pool) or > 1 MiB (large pool, and only
  for requests below ``max_split_size``) (``should_split``);
* a freed block is cached and merged with its free neighbours in its segment (``free_block``,
  ``try_merge_blocks``: blocks are a doubly linked list, ``prev``/``next``);
* when a ``cudaMalloc`` fails: with ``max_split_size`` set, free oversize segments of the
  request's pool and stream are released first, just enough of them, and the ``cudaMalloc``
  retried (``release_available_cached_blocks``); then every fully free segment is released and
  it is retried once more (``release_cached_blocks``, counted in ``num_alloc_retries``); then
  out of memory. ``torch.cuda.empty_cache()`` also releases every fully free segment;
* ``expandable_segments``: instead of many fixed segments, one growing virtual range per pool
  and stream, mapped in pages of 2 MiB (small) or 20 MiB (large); every block splits down to
  512 B.

Why the search is a sorted set: a training step holds thousands of tensors, and the allocator
runs on every one of them, on the host, between kernel launches. A scan of every cached block
would cost O(n) per malloc; a lookup in a set sorted by (stream, size, address) costs O(log n),
and the first block at or after the key (stream, size, 0) *is* the best fit. ``FreeBlocks`` below
is that set (a sorted Python list searched with ``bisect``).

Chapter 6 (book/06_system.md); Lab 6, exercise 6.1 (labs/06_system.ipynb).
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass, field

from labkit.validate import boolean, non_negative_int

# ==== given: the course's code — read it, call it, don't change it ====

KiB, MiB = 1024, 1024 * 1024
MIN_BLOCK_SIZE = 512            # kMinBlockSize: every block is a multiple of it
SMALL_SIZE = 1 * MiB            # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MiB          # kSmallBuffer: segment size of the small pool
LARGE_BUFFER = 20 * MiB         # kLargeBuffer: segment for requests of 1 MiB to 10 MiB
MIN_LARGE_ALLOC = 10 * MiB      # kMinLargeAlloc: from here segments are sized to the request
ROUND_LARGE = 2 * MiB           # kRoundLarge: rounding of those segments


class SimulatedOOM(MemoryError):
    """The simulated device has no room for a segment even after releasing the cached ones."""


@dataclass(eq=False)
class Block:
    """A piece of a segment: ``[addr, addr + size)``; ``allocated`` while a tensor uses it.

    ``prev`` and ``next`` are its neighbours in the segment, in address order (None at the ends),
    as in the C++ ``Block``.
    """
    addr: int
    size: int
    pool: str
    segment: "Segment"
    stream: int = 0
    allocated: bool = False
    requested: int = 0
    prev: "Block | None" = field(default=None, repr=False)
    next: "Block | None" = field(default=None, repr=False)


@dataclass(eq=False)
class Segment:
    """One cudaMalloc (or, expandable, one growing mapped range); ``head`` is its first block."""
    addr: int
    size: int
    pool: str
    stream: int = 0
    head: Block | None = field(default=None, repr=False)
    expandable: bool = False

    def blocks(self) -> list[Block]:
        """The segment's blocks in address order (a walk of the linked list: for inspection)."""
        out, block = [], self.head
        while block is not None:
            out.append(block)
            block = block.next
        return out


class FreeBlocks:
    """The cached blocks of one pool, sorted by (stream, size, address): C++'s ``BlockPool::blocks``,
    a ``std::set<Block*>`` ordered by ``BlockComparatorSize``.

    ``add`` and ``discard`` keep the order (a block's key is taken when it is added: discard a
    block *before* changing its size, add it again after); ``lower_bound(key)`` is the index of
    the first block whose key is ≥ ``key`` (``len(self)`` if none), in O(log n); ``self[i]`` is
    the block at index i. Iteration yields the blocks in key order.
    """

    def __init__(self):
        self._keys: list[tuple[int, int, int]] = []
        self._by_key: dict[tuple[int, int, int], Block] = {}
        self._key_of: dict[Block, tuple[int, int, int]] = {}

    @staticmethod
    def key(block: Block) -> tuple[int, int, int]:
        return (block.stream, block.size, block.addr)

    def add(self, block: Block) -> None:
        self.discard(block)
        key = self.key(block)
        insort(self._keys, key)
        self._by_key[key] = block
        self._key_of[block] = key

    def discard(self, block: Block) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._keys[bisect_left(self._keys, key)]
            del self._by_key[key]

    def lower_bound(self, key: tuple[int, int, int]) -> int:
        return bisect_left(self._keys, key)

    def __getitem__(self, i: int) -> Block:
        return self._by_key[self._keys[i]]

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, block: Block) -> bool:
        return block in self._key_of

    def __iter__(self):
        return (self._by_key[k] for k in list(self._keys))


def _size(size, name="size") -> int:
    """``size`` checked as an integer >= 0 (ValueError naming ``name`` otherwise). A plain int
    takes the fast path: malloc and free run this on every event, thousands of times a step."""
    if type(size) is int and size >= 0:  # exactly what non_negative_int accepts, minus its cost
        return size
    return non_negative_int(name, size)


# ==== exercise 6.1: your code ====

def round_size(size: int) -> int:
    """The bytes of the block that serves a request of ``size`` bytes (always ≥ 512 B)."""
    size = _size(size)
    raise NotImplementedError("exercise 6.1: round up to the allocator's block granularity (never below one block) (labs/06_system.ipynb)")


def pool_of(size: int) -> str:
    """``"small"`` or ``"large"``: the pool that serves a request of ``size`` bytes."""
    size = _size(size)
    raise NotImplementedError("exercise 6.1: which pool serves the (rounded) request (labs/06_system.ipynb)")


def segment_size(size: int) -> int:
    """The bytes of the new segment reserved when no cached block can serve ``size`` bytes."""
    size = _size(size)
    raise NotImplementedError("exercise 6.1: the segment size of get_allocation_size for the rounded request (labs/06_system.ipynb)")


class CachingAllocator:
    """Replays malloc/free requests under the rules of PyTorch's CUDA caching allocator.

    Args:
        capacity: device bytes available for segments (None: unlimited). When a new segment
            does not fit, cached segments are released and the request retried; if it still
            does not fit, ``SimulatedOOM``.
        max_split_size: ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb`` in bytes (None: off;
            PyTorch accepts no value below 20 MiB).
        expandable_segments: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.

    State: ``allocated_bytes`` (sum of the blocks in use), ``reserved_bytes`` (sum of the
    segments), ``requested_bytes`` (sum of the requests in use), ``segment_log`` (the size of
    every segment reserved, in order), ``num_alloc_retries``, ``num_ooms``; ``free_blocks``
    (one ``FreeBlocks`` per pool), ``segments``, ``in_use`` (address → allocated block).
    """

    # ==== given: the course's code — read it, call it, don't change it ====

    def __init__(self, capacity: int | None = None, *, max_split_size: int | None = None,
                 expandable_segments: bool = False):
        if capacity is not None:
            capacity = _size(capacity, "capacity")
        if max_split_size is not None:
            max_split_size = _size(max_split_size, "max_split_size")
            if max_split_size < LARGE_BUFFER:  # as PyTorch's parser: max_split_size_mb >= 20
                raise ValueError(f"max_split_size must be None or >= 20 MiB ({LARGE_BUFFER} B), "
                                 f"got {max_split_size}")
        self.capacity = capacity
        self.max_split_size = max_split_size
        self.expandable = boolean("expandable_segments", expandable_segments)
        self.segments: list[Segment] = []
        self.free_blocks: dict[str, FreeBlocks] = {"small": FreeBlocks(), "large": FreeBlocks()}
        self.in_use: dict[int, Block] = {}           # address → allocated block
        self.allocated_bytes = self.reserved_bytes = self.requested_bytes = 0
        self.segment_log: list[int] = []
        self.num_alloc_retries = self.num_ooms = 0
        self._next_addr = 0

    def _new_address_range(self, size: int) -> int:
        addr = self._next_addr
        self._next_addr += ROUND_LARGE * math.ceil((size + 1) / ROUND_LARGE)  # never adjacent
        return addr

    def _device_alloc(self, size: int, pool: str, stream: int) -> Segment | None:
        """cudaMalloc: a new segment of ``size`` bytes, or None when it would exceed capacity."""
        if self.capacity is not None and self.reserved_bytes + size > self.capacity:
            return None
        seg = Segment(self._new_address_range(size), size, pool, stream)
        seg.head = Block(seg.addr, size, pool, seg, stream)
        self.segments.append(seg)
        self.reserved_bytes += size
        self.segment_log.append(size)
        return seg

    def _device_free(self, seg: Segment) -> None:
        """cudaFree of a whole segment (it must be one free block)."""
        block = seg.head
        assert block.next is None and not block.allocated, "only a wholly free segment can be released"
        self.free_blocks[seg.pool].discard(block)
        self.segments.remove(seg)
        self.reserved_bytes -= seg.size

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool == "small" or self.expandable:
            return remaining >= MIN_BLOCK_SIZE
        limit = self.max_split_size if self.max_split_size is not None else math.inf
        return size < limit and remaining > SMALL_SIZE

    def _new_block(self, pool: str, stream: int, rounded: int) -> Block | None:
        """A fresh free block of at least ``rounded`` bytes from the device, or None (capacity)."""
        if self.expandable:
            return self._grow_expandable(pool, stream, rounded)
        seg = self._device_alloc(segment_size(rounded), pool, stream)
        if seg is None:
            return None
        self.free_blocks[pool].add(seg.head)
        return seg.head

    def _grow_expandable(self, pool: str, stream: int, size: int) -> Block | None:
        """Expandable segments: map whole pages at the end of the pool's range so that its
        trailing free block (or a new one) has ``size`` bytes; None if capacity forbids."""
        page = SMALL_BUFFER if pool == "small" else LARGE_BUFFER
        seg = next((s for s in self.segments if s.expandable and s.pool == pool and s.stream == stream), None)
        if seg is None:
            seg = Segment(self._new_address_range(1 << 50), 0, pool, stream, expandable=True)
            self.segments.append(seg)
        last = seg.blocks()[-1] if seg.head is not None else None
        tail = last if last is not None and not last.allocated else None
        extra = page * math.ceil((size - (tail.size if tail is not None else 0)) / page)
        if self.capacity is not None and self.reserved_bytes + extra > self.capacity:
            return None
        if tail is None:
            tail = Block(seg.addr + seg.size, 0, pool, seg, stream, prev=last)
            if last is None:
                seg.head = tail
            else:
                last.next = tail
        self.free_blocks[pool].discard(tail)
        tail.size += extra
        seg.size += extra
        self.reserved_bytes += extra
        self.segment_log.append(extra)
        self.free_blocks[pool].add(tail)
        return tail

    def _unmap_free_pages(self, seg: Segment) -> None:
        """Expandable: unmap the wholly free pages at the end of ``seg``'s range."""
        last = seg.blocks()[-1] if seg.head is not None else None
        if last is None or last.allocated:
            return
        page = SMALL_BUFFER if seg.pool == "small" else LARGE_BUFFER
        start = last.addr - seg.addr
        keep = page * math.ceil(start / page) - start  # the free part of a still-used page
        drop = last.size - keep
        if drop <= 0:
            return
        self.free_blocks[seg.pool].discard(last)
        seg.size -= drop
        self.reserved_bytes -= drop
        if keep:
            last.size = keep
            self.free_blocks[seg.pool].add(last)
        elif last.prev is None:
            seg.head = None
        else:
            last.prev.next = None

    # ==== exercise 6.1: your code ====

    def _best_fit(self, pool: str, stream: int, size: int) -> Block | None:
        """The cached block of ``pool`` and ``stream`` that serves ``size`` (rounded) bytes, or None.

        Smallest size first, then lowest address (``FreeBlocks.lower_bound``); the
        ``max_split_size`` limits apply.
        """
        raise NotImplementedError("exercise 6.1: the smallest cached block of this pool and stream that fits (ties: lowest address), honouring max_split_size (labs/06_system.ipynb)")

    def _take(self, block: Block, size: int, requested: int) -> Block:
        """Mark ``block`` allocated for ``size`` bytes, splitting off the remainder if the rules say so."""
        raise NotImplementedError("exercise 6.1: uncache the block; split off the remainder when _should_split allows (link it in, cache it); mark the block in use (labs/06_system.ipynb)")

    def _release_available(self, pool: str, stream: int, size: int) -> bool:
        """``release_available_cached_blocks``, with ``max_split_size`` set: release free oversize
        segments of ``pool`` and ``stream``, just enough for a request of ``size`` (rounded)
        bytes. True when it released enough, False otherwise (and always without
        ``max_split_size``)."""
        raise NotImplementedError("exercise 6.1: the smallest oversize free block that covers the target; else the largest ones down until enough (labs/06_system.ipynb)")

    def _release_cached(self) -> None:
        """``release_cached_blocks``: give every wholly free segment back to the device
        (expandable: unmap the wholly free pages at the end of each range)."""
        raise NotImplementedError("exercise 6.1: release every segment that is one free block (expandable: _unmap_free_pages) (labs/06_system.ipynb)")

    def malloc(self, size: int, stream: int = 0) -> int | None:
        """Serve a request of ``size`` bytes on ``stream``; returns the block's address (the
        handle for ``free``), or None for 0 bytes (a null pointer: no pool is touched).

        Order: a cached block (best fit); else a new segment; else (``max_split_size`` set, not
        expandable) release just enough oversize cached segments and retry; else release every
        cached segment and retry (``num_alloc_retries``); else ``SimulatedOOM`` (``num_ooms``).
        """
        size = _size(size)
        stream = _size(stream, "stream")
        raise NotImplementedError("exercise 6.1: 0 bytes → None; round, pick the pool, best fit, else a new segment, else release and retry (twice), else OOM (labs/06_system.ipynb)")

    def free(self, addr: int | None) -> None:
        """Return the block at ``addr`` to the cache, merged with its free neighbours
        (``free(None)``, the null pointer of a 0-byte request, does nothing)."""
        if addr is None:
            return
        addr = _size(addr, "addr")
        if addr not in self.in_use:
            raise ValueError(f"free of an unknown block: address {addr!r} is not allocated")
        raise NotImplementedError("exercise 6.1: unmark the block, merge it with a free next and previous block (relink), cache it (labs/06_system.ipynb)")

    # ==== given: the course's code — read it, call it, don't change it ====

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached segment that holds no tensor."""
        self._release_cached()

    def fragmentation(self) -> float:
        """1 − allocated / reserved: the share of reserved memory that holds no tensor (0 if none)."""
        return 0.0 if self.reserved_bytes == 0 else 1 - self.allocated_bytes / self.reserved_bytes
