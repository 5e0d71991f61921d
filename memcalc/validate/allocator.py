"""A replay of PyTorch's CUDA caching allocator over the harness's allocation log: the reserved memory a GPU would
show for the same sequence of allocations and frees, computed without a GPU.

The policy mirrored is c10/cuda/CUDACachingAllocator.cpp's default (no `expandable_segments`, no
`max_split_size_mb`, no garbage collection), per stream:
- a request is rounded up to a multiple of 512 bytes (kMinBlockSize);
- requests of at most 1 MiB (kSmallSize) use the small pool, larger ones the large pool;
- a free block is chosen best fit (the smallest free block of the pool that is large enough, the lowest address
  among equals);
- with none, a segment is reserved: 2 MiB for the small pool, 20 MiB (kLargeBuffer) for requests under 10 MiB
  (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge);
- the chosen block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB (large pool);
  the remainder stays free in the same segment;
- a freed block merges with free neighbours of its segment; segments are kept (no `empty_cache` but the one the
  harness calls after building the model, `release_free_segments`).
`ExpandableAllocator` replays `expandable_segments:True` instead (its docstring). The log is the tracker's
(memcalc/validate/measure.py): every storage's allocation, resize and free in program order, which on one stream is
the order the GPU's allocator sees. What a GPU allocates beyond tensors (cuBLAS
workspaces, kernels' own scratch) is not in the log unless added (`allocate` / `free`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(n: int) -> int:
    return MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK


def segment_size(n: int) -> int:
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-n // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    addr: int
    size: int
    seg: int
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None


def _absorb(b: Any, n: Any, by_addr: dict[int, Any]) -> Any:
    """Merge block `b` with its neighbour `n` (its prev or next in the same segment); the lower-addressed block
    survives and is returned, the other leaves `by_addr`."""
    lo, hi = (n, b) if n is b.prev else (b, n)
    lo.size += hi.size
    lo.next = hi.next
    if hi.next is not None:
        hi.next.prev = lo
    del by_addr[hi.addr]
    return lo


@dataclass
class CachingAllocator:
    """The pools, per stream. `allocate(key, n, stream)` / `free(key)`; `reserved`, `allocated` and their peaks in
    bytes."""

    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    _next_addr: int = 0
    _pools: dict[tuple[object, bool], list[tuple[int, int]]] = field(default_factory=dict)
    _by_addr: dict[int, _Block] = field(default_factory=dict)
    _live: dict[object, _Block] = field(default_factory=dict)
    # segment start -> (size, pool): a pool is (stream, small); a block is reused only on its segment's stream
    _segments: dict[int, tuple[int, tuple[object, bool]]] = field(default_factory=dict)

    def _insert(self, b: _Block, pool: tuple[object, bool]) -> None:
        bisect.insort(self._pools.setdefault(pool, []), (b.size, b.addr))

    def _remove(self, b: _Block, pool: tuple[object, bool]) -> None:
        blocks = self._pools[pool]
        del blocks[bisect.bisect_left(blocks, (b.size, b.addr))]

    def allocate(self, key: object, nbytes: int, stream: object = 0) -> None:
        if nbytes <= 0:
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool_key = (stream, small)
        pool = self._pools.setdefault(pool_key, [])
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            _, addr = pool.pop(i)
            b = self._by_addr[addr]
        else:
            seg = segment_size(size)
            b = _Block(self._next_addr, seg, self._next_addr)
            self._segments[b.addr] = (seg, pool_key)
            self._by_addr[b.addr] = b
            self._next_addr += seg
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = b.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            r = _Block(b.addr + size, rest, b.seg, True, b, b.next)
            if b.next is not None:
                b.next.prev = r
            b.next, b.size = r, size
            self._by_addr[r.addr] = r
            self._insert(r, pool_key)
        b.free = False
        self._live[key] = b
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        b = self._live.pop(key, None)
        if b is None:
            return
        pool = self._segments[b.seg][1]
        self.allocated -= b.size
        b.free = True
        for n in (b.prev, b.next):
            if n is not None and n.free:
                self._remove(n, pool)
                b = _absorb(b, n, self._by_addr)
        self._insert(b, pool)

    def release_free_segments(self) -> None:
        """`torch.cuda.empty_cache()`: segments with nothing allocated go back to the device."""
        for start, (seg, pool) in list(self._segments.items()):
            b = self._by_addr.get(start)
            if b is not None and b.free and b.size == seg:
                self._remove(b, pool)
                del self._by_addr[start]
                del self._segments[start]
                self.reserved -= seg

    def reset_peaks(self) -> None:
        self.peak_reserved, self.peak_allocated = self.reserved, self.allocated


def replay_log(events: list[tuple[int, int]], marks: list[tuple[int, str]],
               extra: dict[str, int] | None = None, streams: list[object] | None = None,
               compute_stream: object = 0, expandable: bool = False) -> dict[str, int]:
    """Replay a tracker's log (`events`: (storage id, bytes delta) in program order; `marks`: (event index, phase)).
    The cache is emptied where the first phase after "init" starts (the harness's `empty_cache` after building
    the model), and the peaks are taken from there. `extra`: bytes allocated once, for good, when the first phase
    of that name starts (cuBLAS's workspaces: {"forward": 32 MiB, "backward": 32 MiB}). `streams`: the stream
    current at each event (the tracker's `streams`; FSDP2 allocates its all-gather buffers and reduce-scatter
    outputs on streams of its own, whose blocks no other stream reuses); `compute_stream` takes the extras.
    `expandable`: replay ExpandableAllocator (expandable_segments:True) instead.
    Returns the reserved and allocated peaks in bytes."""
    a: Any = ExpandableAllocator() if expandable else CachingAllocator()
    drive(a, events, marks, extra, streams, compute_stream)
    return {"reserved_peak_bytes": a.peak_reserved, "allocated_peak_bytes": a.peak_allocated}


def drive(a: Any, events: list[tuple[int, int]], marks: list[tuple[int, str]],
          extra: dict[str, int] | None = None, streams: list[object] | None = None,
          compute_stream: object = 0, stop: int | None = None) -> int:
    """Feed the log to allocator `a` as `replay_log` describes, up to event `stop` (excluded; all by default).
    Returns the index just past the last event at which, after the cache was emptied, the allocated bytes reached
    their highest (the latest moment at the peak: a diagnosis replays again to there and reads `a`'s segments)."""
    cur: dict[int, int] = {}
    starts: dict[int, list[str]] = {}
    for i, ph in marks:
        starts.setdefault(i, []).append(ph)
    emptied = False
    pending = dict(extra or {})
    best, at = -1, 0
    for i, (uid, d) in enumerate(events):
        for ph in starts.get(i, ()):
            if not emptied and ph != "init":
                a.release_free_segments()
                a.reset_peaks()
                emptied = True
            base = ph.removeprefix("w-")
            for name in list(pending):
                if name in base:  # "forward-backward" (pipelining) starts both
                    a.allocate(("extra", name), pending.pop(name), compute_stream)
        if i == stop:
            break
        old = cur.get(uid, 0)
        new = old + d
        if old > 0:
            a.free(uid)
        if new > 0:
            a.allocate(uid, new, streams[i] if streams is not None else 0)
            cur[uid] = new
        else:
            cur.pop(uid, None)
        if emptied and a.allocated >= best:
            best, at = a.allocated, i + 1
    return at


EXPANDABLE_VIRTUAL = 1 << 50  # an expandable segment reserves address space for the whole GPU: never the limit


@dataclass
class _XBlock:
    addr: int
    size: int
    state: str  # "free" (mapped), "used" (mapped, allocated) or "unmapped"
    prev: "_XBlock | None" = None
    next: "_XBlock | None" = None
    indexed: bool = False  # in its pool's free index (a free block being worked on is not)


@dataclass
class ExpandableAllocator:
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (CUDACachingAllocator.cpp, ExpandableSegment): each pool of a
    stream is one range of virtual addresses whose pages are mapped on demand, in granules of 2 MiB (small pool)
    or 20 MiB (large pool); reserved memory is what is mapped.
    - a request takes the best-fitting free mapped block (as without expandable segments);
    - with none, the lowest-addressed unmapped stretch (with the free block just before it, if any) long enough is
      mapped, granule by granule, as far as the request needs (`find_expandable_block`, `map_block`);
    - a block is split whenever 512 bytes or more remain (`should_split`);
    - freed blocks merge with free mapped neighbours; `empty_cache` unmaps the granules lying wholly inside free
      blocks."""

    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    _pools: dict[tuple[object, bool], _XBlock] = field(default_factory=dict)  # pool -> its first block
    _free: dict[tuple[object, bool], list[tuple[int, int]]] = field(default_factory=dict)  # (size, addr)
    _blocks: dict[int, _XBlock] = field(default_factory=dict)  # addr -> block (mapped free ones are looked up)
    _live: dict[object, tuple[_XBlock, tuple[object, bool]]] = field(default_factory=dict)
    _next_base: int = 0

    @staticmethod
    def _granule(small: bool) -> int:
        return SMALL_BUFFER if small else LARGE_BUFFER

    def _pool(self, key: tuple[object, bool]) -> _XBlock:
        if key not in self._pools:
            b = _XBlock(self._next_base, EXPANDABLE_VIRTUAL, "unmapped")
            self._next_base += EXPANDABLE_VIRTUAL
            self._pools[key] = b
            self._blocks[b.addr] = b
        return self._pools[key]

    def _add_free(self, b: _XBlock, key: tuple[object, bool]) -> None:
        bisect.insort(self._free.setdefault(key, []), (b.size, b.addr))
        b.indexed = True

    def _drop_free(self, b: _XBlock, key: tuple[object, bool]) -> None:
        if b.indexed:
            lst = self._free[key]
            del lst[bisect.bisect_left(lst, (b.size, b.addr))]
            b.indexed = False

    def _split(self, b: _XBlock, size: int, state: str) -> _XBlock:
        """Cut `b` after `size` bytes; the tail becomes a block of its own in state `state` (b keeps its own)."""
        r = _XBlock(b.addr + size, b.size - size, state, b, b.next)
        if b.next is not None:
            b.next.prev = r
        b.next, b.size = r, size
        self._blocks[r.addr] = r
        return r

    def _merge(self, b: _XBlock, key: tuple[object, bool]) -> _XBlock:
        """Merge `b` (already out of the free index) with neighbours of the same state; returns the result."""
        for n in (b.prev, b.next):
            if n is None or n.state != b.state:
                continue
            self._drop_free(n, key)
            b = _absorb(b, n, self._blocks)
        return b

    def _map(self, b: _XBlock, size: int, key: tuple[object, bool]) -> _XBlock:
        """Map the first `size` bytes of unmapped block `b` (whole granules); returns the merged free block."""
        g = self._granule(key[1])
        size = min(-(-size // g) * g, b.size)
        if size < b.size:
            self._split(b, size, "unmapped")
        b.state = "free"
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        b = self._merge(b, key)
        return b

    def _expand(self, size: int, key: tuple[object, bool]) -> _XBlock:
        b = self._pool(key)
        while b is not None:
            if b.state == "unmapped":
                c = b.prev if b.prev is not None and b.prev.state == "free" else b
                room, x = 0, c
                while x is not None and x.state != "used" and room < size:
                    room += x.size
                    x = x.next
                if room >= size:
                    # a free `c` is shorter than `size` (best fit found nothing): mapping what follows merges it
                    if c.state == "unmapped":
                        c = self._map(c, size, key)
                    else:
                        self._drop_free(c, key)
                    while c.size < size:
                        nxt = c.next
                        assert nxt is not None and nxt.state == "unmapped"
                        c = self._map(nxt, size - c.size, key)
                    return c
            b = b.next
        raise AssertionError("an expandable segment has unbounded address space")

    def allocate(self, key: object, nbytes: int, stream: object = 0) -> None:
        if nbytes <= 0:
            return
        size = round_size(nbytes)
        pool = (stream, size <= SMALL_SIZE)
        self._pool(pool)
        lst = self._free.setdefault(pool, [])
        i = bisect.bisect_left(lst, (size, -1))
        if i < len(lst):
            _, addr = lst.pop(i)
            b = self._blocks[addr]
            b.indexed = False
        else:
            b = self._expand(size, pool)
        if b.size - size >= MIN_BLOCK:
            r = self._split(b, size, "free")
            self._add_free(r, pool)
        b.state = "used"
        self._live[key] = (b, pool)
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        got = self._live.pop(key, None)
        if got is None:
            return
        b, pool = got
        self.allocated -= b.size
        b.state = "free"
        b = self._merge(b, pool)
        self._add_free(b, pool)

    def release_free_segments(self) -> None:
        """`torch.cuda.empty_cache()`: the granules lying wholly inside free blocks are unmapped."""
        for pool, first in list(self._pools.items()):
            g = self._granule(pool[1])
            b: _XBlock | None = first
            while b is not None:
                nxt = b.next
                if b.state == "free":
                    lo = -(-b.addr // g) * g
                    hi = (b.addr + b.size) // g * g
                    if hi > lo:
                        self._drop_free(b, pool)
                        mid = b if lo == b.addr else self._split(b, lo - b.addr, "free")
                        if mid is not b:
                            self._add_free(b, pool)
                        if hi < mid.addr + mid.size:
                            tail = self._split(mid, hi - mid.addr, "free")
                            self._add_free(tail, pool)
                            nxt = tail.next
                        mid.state = "unmapped"
                        self.reserved -= hi - lo
                        self._merge(mid, pool)
                b = nxt

    def reset_peaks(self) -> None:
        self.peak_reserved, self.peak_allocated = self.reserved, self.allocated
