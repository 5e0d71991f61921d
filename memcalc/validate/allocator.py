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
The log is the tracker's (memcalc/validate/measure.py): every storage's allocation, resize and free in program
order, which on one stream is the order the GPU's allocator sees. What a GPU allocates beyond tensors (cuBLAS
workspaces, kernels' own scratch) is not in the log unless added (`allocate` / `free`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

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
                if n is b.prev:
                    n.size += b.size
                    n.next = b.next
                    if b.next is not None:
                        b.next.prev = n
                    del self._by_addr[b.addr]
                    b = n
                else:
                    b.size += n.size
                    b.next = n.next
                    if n.next is not None:
                        n.next.prev = b
                    del self._by_addr[n.addr]
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
               compute_stream: object = 0) -> dict[str, int]:
    """Replay a tracker's log (`events`: (storage id, bytes delta) in program order; `marks`: (event index, phase)).
    The cache is emptied where the first phase after "init" starts (the harness's `empty_cache` after building
    the model), and the peaks are taken from there. `extra`: bytes allocated once, for good, when the first phase
    of that name starts (cuBLAS's workspaces: {"forward": 32 MiB, "backward": 32 MiB}). `streams`: the stream
    current at each event (the tracker's `streams`; FSDP2 allocates its all-gather buffers and reduce-scatter
    outputs on streams of its own, whose blocks no other stream reuses); `compute_stream` takes the extras.
    Returns the reserved and allocated peaks in bytes."""
    a = CachingAllocator()
    cur: dict[int, int] = {}
    starts: dict[int, list[str]] = {}
    for i, ph in marks:
        starts.setdefault(i, []).append(ph)
    emptied = False
    pending = dict(extra or {})
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
        old = cur.get(uid, 0)
        new = old + d
        if old > 0:
            a.free(uid)
        if new > 0:
            a.allocate(uid, new, streams[i] if streams is not None else 0)
            cur[uid] = new
        else:
            cur.pop(uid, None)
    return {"reserved_peak_bytes": a.peak_reserved, "allocated_peak_bytes": a.peak_allocated}
