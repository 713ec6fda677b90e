"""PyTorch's CUDA caching allocator, simulated: what a sequence of allocations and frees reserves on a GPU.

`allocated` (torch.cuda.memory_allocated) counts blocks, `reserved` (memory_reserved) the segments the
allocator took from the device with cudaMalloc and keeps cached: a block freed goes back to its
segment's free list, never to the device (until empty_cache or an OOM retry), and a later request is
served from a cached block only where one is large enough, so reserved exceeds allocated by the
segments' unused rounding and by fragmentation. This follows c10/cuda/CUDACachingAllocator.cpp (torch
2.13) at its defaults (no max_split_size_mb, no roundup_power2_divisions, expandable_segments off):

  round_size             a request rounded up to a multiple of kMinBlockSize = 512 bytes (at least 512)
  pools                  requests up to kSmallSize = 1 MiB from the small pool, larger ones from the large
  get_allocation_size    a new segment: kSmallBuffer = 2 MiB for a small request, kLargeBuffer = 20 MiB
                         below kMinLargeAlloc = 10 MiB, else the request rounded up to kRoundLarge = 2 MiB
  get_free_block         best fit: the smallest cached free block of the pool at least the size
                         (BlockComparatorSize: size, then address)
  should_split           a block larger than the request is split where the rest is at least 512 bytes
                         (small pool) or more than kSmallSize (large pool); the rest stays cached
  free_block             a freed block merges with free neighbours of its segment (try_merge_blocks)

One stream is simulated: a block an NCCL stream used (record_stream) is freed later on a GPU, which can
only hold more. Not simulated: the OOM path (free cached blocks, retry), expandable segments.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the small pool's largest request
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a large pool segment for requests below kMinLargeAlloc
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * -(-size // MIN_BLOCK)


def allocation_size(size: int) -> int:
    """The segment cudaMalloc'd for a (rounded) request no cached block serves."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    size: int
    addr: int  # the segment's base + offset: an address order among blocks
    small: bool
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None


@dataclass
class CachingAllocator:
    """The allocator's state: malloc(key, size), free(key); allocated / reserved now and at their peaks."""
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments: int = 0
    _pools: dict = field(default_factory=lambda: {True: [], False: []})  # small? -> sorted (size, addr, block)
    _used: dict = field(default_factory=dict)  # key -> its block
    _next_addr: int = 0

    def malloc(self, key, size: int) -> None:
        if key in self._used:
            self.free(key)
        if size <= 0:  # a zero-byte storage gets no block (CUDACachingAllocator allocate: size 0)
            return
        size = round_size(size)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            _s, _a, block = pool.pop(i)
        else:  # a new segment
            seg = allocation_size(size)
            block = _Block(seg, self._next_addr, small)
            self._next_addr += seg + (1 << 40)  # segments never adjacent
            self.reserved += seg
            self.segments += 1
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = _Block(rest, block.addr + size, small, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            bisect.insort(pool, (tail.size, tail.addr, tail))
        block.free = False
        self._used[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key) -> None:
        block = self._used.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        pool = self._pools[block.small]
        for nb in (block.prev, block.next):  # try_merge_blocks
            if nb is not None and nb.free:
                pool.pop(bisect.bisect_left(pool, (nb.size, nb.addr)))
                if nb is block.prev:
                    block.addr, block.prev = nb.addr, nb.prev
                    if nb.prev is not None:
                        nb.prev.next = block
                else:
                    block.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = block
                block.size += nb.size
        bisect.insort(pool, (block.size, block.addr, block))

    def resize(self, key, size: int) -> None:
        """A storage's new size (FSDP2's resize_ to 0 and back): its block freed, a new one allocated."""
        self.free(key)
        self.malloc(key, size)

    def keys(self):
        return self._used.keys()

    def reset_peaks(self) -> None:
        """torch.cuda.reset_peak_memory_stats: the peaks restart from now."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def stats(self) -> dict:
        return {"allocated_bytes": self.allocated, "reserved_bytes": self.reserved,
                "peak_allocated_bytes": self.peak_allocated, "peak_reserved_bytes": self.peak_reserved,
                "segments": self.segments}
