"""The caching-allocator replay (memcalc/validate/allocator.py), rule by rule with hand-computed figures; its
agreement with an H100's `max_memory_reserved()` is in tests/test_cuda_record.py."""

from __future__ import annotations

from memcalc.validate.allocator import CachingAllocator, replay_log, round_size, segment_size

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    # kMinBlockSize 512; small pool <= 1 MiB from 2 MiB segments; < 10 MiB from 20 MiB; else rounded to 2 MiB
    assert (round_size(1), round_size(512), round_size(513)) == (512, 512, 1024)
    assert segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_small_blocks_share_a_segment():
    # 600 KiB = 614,400 B (a multiple of 512): the first carves a 2 MiB segment, leaving 1,482,752 B free; the
    # second fits there
    a = CachingAllocator()
    a.allocate("x", 600 * 1024)
    a.allocate("y", 600 * 1024)
    assert (a.reserved, a.allocated) == (2 * MiB, 2 * 614_400)


def test_large_remainder_of_one_mib_or_less_is_not_split():
    # 19.5 MiB -> a 20 MiB segment; the 0.5 MiB left is not split off (large pool: only > 1 MiB), so the whole block
    # counts as allocated, as `memory_allocated()` counts it
    a = CachingAllocator()
    a.allocate("x", 19 * MiB + MiB // 2)
    assert (a.reserved, a.allocated) == (20 * MiB, 20 * MiB)


def test_a_carved_block_strands_the_next_large_request():
    # A (12 MiB) gets a 12 MiB segment and is freed; B (8 MiB) is carved from it (4 MiB left, split off); C (12 MiB)
    # finds no free block that large and reserves a new segment: 24 MiB reserved for 20 MiB allocated. Freeing B
    # merges it with the 4 MiB remainder into the whole 12 MiB block again, which D (12 MiB) reuses.
    a = CachingAllocator()
    a.allocate("A", 12 * MiB)
    a.free("A")
    a.allocate("B", 8 * MiB)
    a.allocate("C", 12 * MiB)
    assert (a.reserved, a.allocated) == (24 * MiB, 20 * MiB)
    a.free("B")
    a.allocate("D", 12 * MiB)
    assert (a.reserved, a.allocated, a.peak_reserved) == (24 * MiB, 24 * MiB, 24 * MiB)


def test_best_fit_takes_the_smallest_free_block():
    # free blocks of 12 and 16 MiB (their own segments): a 12 MiB request takes the 12, not the 16
    a = CachingAllocator()
    a.allocate("s12", 12 * MiB)
    a.allocate("s16", 16 * MiB)
    a.free("s12")
    a.free("s16")
    a.allocate("x", 12 * MiB)
    a.allocate("y", 16 * MiB)
    assert a.reserved == 28 * MiB


def test_a_block_is_reused_only_on_its_stream():
    # FSDP2's all-gather output (stream "ag") is freed; the compute stream's next request of the same size cannot
    # use it and reserves a segment of its own; a later all-gather reuses it
    a = CachingAllocator()
    a.allocate("ag1", 12 * MiB, stream="ag")
    a.free("ag1")
    a.allocate("act", 12 * MiB, stream="compute")
    assert a.reserved == 24 * MiB
    a.allocate("ag2", 12 * MiB, stream="ag")
    assert a.reserved == 24 * MiB


def test_empty_cache_releases_only_free_segments():
    a = CachingAllocator()
    a.allocate("keep", 12 * MiB)
    a.allocate("gone", 14 * MiB)
    a.free("gone")
    a.release_free_segments()
    assert (a.reserved, a.allocated) == (12 * MiB, 12 * MiB)


def test_replay_of_a_log():
    """A tracker log: storage 1 (12 MiB) lives from init; storage 2 (30 MiB) is an init transient; the cache is
    emptied where the first step starts (the harness's empty_cache), so its 30 MiB segment is not counted; then the
    forward allocates cuBLAS's workspace (32 MiB, `extra`) and storage 3 (8 MiB, under 10 MiB: a new 20 MiB
    segment), and a resize of storage 1 to 0 frees it (FSDP2's resize_)."""
    events = [(1, 12 * MiB), (2, 30 * MiB), (2, -30 * MiB), (3, 8 * MiB), (1, -12 * MiB), (3, -8 * MiB)]
    marks = [(3, "w-forward")]
    out = replay_log(events, marks, {"forward": 32 * MiB, "backward": 32 * MiB})
    # after empty_cache: 12 (storage 1) + 32 (workspace) + 20 (storage 3's segment) = 64 MiB reserved at most;
    # allocated 12 + 32 + 8
    assert out == {"reserved_peak_bytes": 64 * MiB, "allocated_peak_bytes": 52 * MiB}


# --- expandable_segments:True (allocator.ExpandableAllocator) ---------------------------------------------------
def test_expandable_maps_whole_granules_and_extends_the_free_tail():
    from memcalc.validate.allocator import ExpandableAllocator

    a = ExpandableAllocator()
    a.allocate(1, 30 * MiB)  # the large pool maps 20 MiB granules: 40 MiB for 30
    assert a.reserved == 40 * MiB
    a.allocate(2, 5 * MiB)  # best fit in the 10 MiB left mapped: nothing new
    assert a.reserved == 40 * MiB
    a.free(1)  # [0, 30) free, [30, 35) used, [35, 40) free
    a.allocate(3, 31 * MiB)  # no free block fits: the free tail (5) plus 26 more, mapped as 40: 80 MiB
    assert a.reserved == 80 * MiB and a.allocated == (5 + 31) * MiB
    a.allocate(4, 30 * MiB)  # exactly the freed 30 MiB at the start (split at any remainder of 512 B or more)
    assert a.reserved == 80 * MiB
    a.free(4)
    a.release_free_segments()  # empty_cache: the one granule wholly inside [0, 30) is unmapped
    assert a.reserved == 60 * MiB


def test_expandable_small_requests_map_2_mib_granules_and_split_at_512_bytes():
    from memcalc.validate.allocator import ExpandableAllocator

    a = ExpandableAllocator()
    for k in range(5):
        a.allocate(k, 512 * 1024)  # 2.5 MiB in the small pool: two 2 MiB granules
    assert a.reserved == 4 * MiB
    a.allocate("big", 11 * MiB)  # the large pool is another range: one 20 MiB granule
    assert a.reserved == 24 * MiB
    a.free("big")
    a.allocate("big2", 19 * MiB + 512)  # fits the 20 MiB granule, 511.5 KiB left as a free block
    assert a.reserved == 24 * MiB


def test_expandable_varying_lengths_reuse_what_fixed_segments_strand():
    """The ratchet of tests/test_validate_seqlen.py in miniature: logits-sized blocks for 448 then 512 tokens (2 x L
    x 32,000 x 4 B). Without expandable segments the 512-token block cannot use the freed 448-token segment and
    reserves its own; with them the freed range and the tail merge, so the second block maps only the difference."""
    from memcalc.validate.allocator import ExpandableAllocator

    n448, n512 = 2 * 448 * 32000 * 4, 2 * 512 * 32000 * 4
    fixed, grown = CachingAllocator(), ExpandableAllocator()
    for a in (fixed, grown):
        a.allocate("w", 64 * MiB)  # something allocated before, as the weights are
        a.allocate("l448", n448)
        a.free("l448")
        a.allocate("l512", n512)
    assert fixed.reserved == 64 * MiB + segment_size(n448) + segment_size(n512)  # 64 + 110 + 126 MiB
    assert grown.reserved == 20 * MiB * -(-(64 * MiB + n512) // (20 * MiB))  # 64 MiB + 125 MiB in 20 MiB granules


def test_first_step_foreach_temporaries_measured_by_the_replay():
    """What foreach AdamW's first-step sqrt(v) list adds to memcalc's reserved figure, against the replay of the
    harness's own allocations, foreach minus fused AdamW, the same run otherwise (4 layers of h 2048, vocab 32,000,
    pure bf16, full recompute, 2 x 1024 tokens; arithmetic in tests/test_fragmentation.py): 673,222,656 B predicted
    (the list; 283,452,363 B of it as `first_step_optimizer_temporaries`, the rest inside the optimizer step, which is
    the peak), 708,837,376 B replayed (4,174 - 3,498 MiB). torch.optim creates AdamW's states in the first step():
    they take the blocks the first backward freed, the sqrt(v) list goes to new segments, and the later steps'
    activations do not fit there."""
    import pytest

    pytest.importorskip("torch")
    from memcalc.cost.estimate import estimate
    from memcalc.validate.api import validate
    from tests.conftest import run_of

    opts = dict(layers=4, hidden=2048, heads=16, ffn=5632, vocab=32000, seq=1024, micro_batch=2, recompute="full",
                precision="bf16", master_weights=False)
    replayed = {impl: validate(run_of(optimizer_impl=impl, **opts), device="meta", world="fake", timeout=600)
                ["measured"]["allocator_replay"]["reserved_peak_bytes"] for impl in ("foreach", "fused")}
    mem = {impl: estimate(run_of(optimizer_impl=impl, **opts), advice=False).memory for impl in ("foreach", "fused")}
    assert mem["foreach"].reserved_detail["first_step_optimizer_temporaries"] == 283_452_363
    predicted = mem["foreach"].reserved_peak_bytes - mem["fused"].reserved_peak_bytes
    assert predicted == 673_222_656
    assert abs(predicted - (replayed["foreach"] - replayed["fused"])) <= 0.06 * predicted, replayed
