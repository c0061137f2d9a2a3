"""The caching allocator of the simulated device (worker/memory/simdevice.py): blocks and segments as
PyTorch's CUDA caching allocator keeps them. Pure bookkeeping: no torch, no ledger, no locks
(the device holds its lock around every call).

The rules, from c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x, DeviceCachingAllocator):
- `round_size`: a request is rounded up to a multiple of kMinBlockSize (512 B).
- Two pools: requests of at most kSmallSize (1 MiB) come from the small pool, whose segments
  are kSmallBuffer (2 MiB); larger ones from the large pool, whose segments
  (`get_allocation_size`) are kLargeBuffer (20 MiB) for requests under kMinLargeAlloc (10 MiB),
  else the request rounded up to kRoundLarge (2 MiB).
- `get_free_block`: the smallest cached free block of the pool that holds the request (best fit).
- `should_split`: a block larger than the request is split when the rest is at least
  kMinBlockSize (small pool) or more than kSmallSize (large pool); otherwise the whole block
  is handed out (and counted as allocated).
- `free_block`: a freed block goes back to its pool and merges with free neighbours of its
  segment; the segment stays reserved (cached) until `empty_cache` (`release_cached_blocks`),
  which returns only segments with no live block in them.
- A new segment is a cudaMalloc: only then does the per-process fraction apply (the device
  checks it; cached blocks are reused without any check).
Expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), modelled: the large
pool is one segment that grows by pages of kLargeBuffer at its end (its free tail is extended
instead of a new segment being taken), and `empty_cache` unmaps the free pages at its end. The
per-process fraction is checked as `alloc_block` checks it before `try_allocate_expandable_block`
maps anything: `total_allocated_memory + p.alloc_size > allowed_memory_maximum` refuses, where
alloc_size is the whole request's segment size (`get_allocation_size`, as above), not the pages
still to map. So a request is refused even when its free tail would need fewer new pages, and
one that passes may map up to one page more than alloc_size: reserved can pass the cap by less
than kLargeBuffer.
PyTorch also unmaps whole free pages in the middle of the segment; the model keeps those mapped,
so it overstates expandable segments' reserved memory a little, never understates it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MIB = 1024 * 1024
MIN_BLOCK_SIZE = 512  # kMinBlockSize
SMALL_SIZE = 1 * MIB  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: a large-pool segment for requests under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge: large segments are rounded up to this


def round_size(nbytes: int) -> int:
    """The block size for a request of `nbytes` (bytes, >= 0): a multiple of 512 B, at least 512 B."""
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * ((nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def segment_size(size: int) -> int:
    """The cudaMalloc size of a new segment for a block of `size` (already rounded) bytes."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


def is_small(size: int) -> bool:
    return size <= SMALL_SIZE


@dataclass(eq=False)
class Segment:
    """One cudaMalloc'ed range (bytes); its blocks cover it in address order."""

    size: int
    small: bool
    blocks: list[Block] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return all(not b.live for b in self.blocks)


@dataclass(eq=False)
class Block:
    """A piece of a segment; `live` while a tensor (or a caller of `allocate`) holds it."""

    segment: Segment
    size: int
    live: bool = False


# Asked to map `nbytes` more on the device, for a request whose segment size (alloc_size, the
# figure the per-process fraction is checked with) is the second argument; returns False when
# the fraction or the device refuses, as a failing cudaMalloc.
DeviceMalloc = Callable[[int, int], bool]


class CachingAllocator:
    """Segments, blocks and the counters torch.cuda reports (bytes): `allocated` (live blocks, as
    memory_allocated), `reserved` (segments, as memory_reserved), `peak` (max_memory_allocated),
    `max_reserved` (max_memory_reserved)."""

    def __init__(self, expandable_segments: bool = False) -> None:
        self.expandable_segments = expandable_segments
        self.segments: list[Segment] = []
        self.allocated = 0
        self.reserved = 0
        self.peak = 0
        self.max_reserved = 0

    def malloc(self, nbytes: int, device_malloc: DeviceMalloc) -> Block | None:
        """A live block for `nbytes`, or None when no cached block fits and the device refuses a
        new segment even after the cache is released (the caller raises OutOfMemoryError)."""
        size = round_size(nbytes)
        block = self._free_block(size) or self._new_block(size, device_malloc)
        if block is None:
            self.release_cached()
            block = self._new_block(size, device_malloc)
        if block is None:
            return None
        self._split(block, size)
        block.live = True
        self.allocated += block.size
        self.peak = max(self.peak, self.allocated)
        return block

    def free(self, block: Block) -> None:
        """Return `block` to its pool, merged with its free neighbours; its segment stays cached."""
        if not block.live:
            raise ValueError("block freed twice")
        block.live = False
        self.allocated -= block.size
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and not blocks[i + 1].live:
            block.size += blocks.pop(i + 1).size
        if i > 0 and not blocks[i - 1].live:
            blocks[i - 1].size += blocks.pop(i).size

    def release_cached(self) -> int:
        """empty_cache: give every segment without a live block back to the device (and, with
        expandable segments, the free pages at the end of the growing one). Returns the bytes."""
        released = 0
        for segment in [s for s in self.segments if s.empty]:
            self.segments.remove(segment)
            released += segment.size
        grown = self._grown_segment()
        if grown is not None and not grown.blocks[-1].live:
            tail = grown.blocks[-1]
            pages = (tail.size // LARGE_BUFFER) * LARGE_BUFFER
            tail.size -= pages
            grown.size -= pages
            released += pages
            if tail.size == 0:
                grown.blocks.pop()
        self.reserved -= released
        return released

    def largest_free_block(self) -> int:
        """The largest cached free block (bytes): what one request can get without a new segment."""
        return max((b.size for s in self.segments for b in s.blocks if not b.live), default=0)

    def _free_block(self, size: int) -> Block | None:
        small = is_small(size)
        fits = [b for s in self.segments if s.small == small for b in s.blocks if not b.live and b.size >= size]
        return min(fits, key=lambda b: b.size, default=None)

    def _new_block(self, size: int, device_malloc: DeviceMalloc) -> Block | None:
        if self.expandable_segments and not is_small(size):
            return self._grow(size, device_malloc)
        nbytes = segment_size(size)
        if not device_malloc(nbytes, nbytes):
            return None
        segment = Segment(nbytes, is_small(size))
        segment.blocks.append(Block(segment, nbytes))
        self.segments.append(segment)
        self.reserved += nbytes
        self.max_reserved = max(self.max_reserved, self.reserved)
        return segment.blocks[0]

    def _grown_segment(self) -> Segment | None:
        if not self.expandable_segments:
            return None
        return next((s for s in self.segments if not s.small), None)

    def _grow(self, size: int, device_malloc: DeviceMalloc) -> Block | None:
        segment = self._grown_segment()
        if segment is None:
            segment = Segment(0, small=False)
            self.segments.append(segment)
        tail = segment.blocks[-1] if segment.blocks and not segment.blocks[-1].live else None
        have = tail.size if tail is not None else 0
        pages = LARGE_BUFFER * ((size - have + LARGE_BUFFER - 1) // LARGE_BUFFER)
        if not device_malloc(pages, segment_size(size)):  # the whole request against the fraction
            if not segment.blocks:
                self.segments.remove(segment)
            return None
        if tail is None:
            tail = Block(segment, 0)
            segment.blocks.append(tail)
        tail.size += pages
        segment.size += pages
        self.reserved += pages
        self.max_reserved = max(self.max_reserved, self.reserved)
        return tail

    def _split(self, block: Block, size: int) -> None:
        rest = block.size - size
        keep_whole = rest < MIN_BLOCK_SIZE if block.segment.small else rest <= SMALL_SIZE
        if keep_whole:
            return
        blocks = block.segment.blocks
        block.size = size
        blocks.insert(blocks.index(block) + 1, Block(block.segment, rest))
