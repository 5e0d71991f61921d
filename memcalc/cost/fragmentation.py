"""Caching-allocator fragmentation: reserved minus allocated memory. DESIGN.md section 4; derivation and data in
docs/methodology.md ("Fragmentation").

PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp; docs "CUDA semantics / Memory management")
rounds every request up to 512 bytes, serves requests <= 1 MiB from 2 MiB segments, requests < 10 MiB from 20 MiB
segments and larger ones from their own segment rounded to 2 MiB, and later carves smaller blocks out of cached
segments. Memory freed by one stream is reused by another only after its recorded events complete. Reserved memory
(`memory_reserved`, what the GPU actually lends the process) therefore exceeds allocated memory
(`memory_allocated`, what memcalc's allocated peak models). `expandable_segments:True` maps physical pages into one
growing segment per stream, which removes most of the carving gap; pages go back only on `empty_cache` or an
out-of-memory retry, so a stream's segment keeps its own peak.

The slack: a fraction f of what the compute stream reserves is not allocated (rounding, block carving), slack =
compute_peak * f / (1 - f). `training.fragmentation` sets f; otherwise `default_fraction(run)` gives the documented
figure for the profile and layout. The compute stream's peak includes, at the loss gradient, the logits' block it
holds but cannot use there (activations.loss_stranded_bytes).

Side streams: the allocator associates every block with the stream that allocated it and never hands a freed block
to another stream (CUDACachingAllocator.cpp). Where a framework allocates on side streams (FSDP2:
buffers.side_stream_pools) reserved memory is the compute stream's own peak / (1 - f) plus each side stream's pool,
which the compute stream cannot reuse: reserved = compute_peak / (1 - f) + sum(pools) >= allocated.

The first optimizer step (default allocator, torch.optim, foreach Adam): torch.optim creates its states in its
first `step()`, after a forward and backward that reserved segments for activations only. The states take those
blocks first; what the step needs beyond them, foreach Adam's sqrt(v) list first among it, comes from new
segments cut to the per-parameter sizes of that list. Those segments stay reserved, and the later steps'
activation requests are larger than their blocks: `first_step_stranded_bytes`. Every later optimizer step reuses
them, so where the step is the compute stream's peak they are already in it: the list adds to reserved memory only
what a later forward or backward, beside them, holds above that peak.
"""

from __future__ import annotations

from typing import Any

from memcalc.cost.timeline import StageMemory
from memcalc.specs import Run
from memcalc.xp import as_int, imax, imin

Num = Any

# Published allocated/reserved pairs and the validation simulation put f between 1% and 6% for steady-state
# training with the default allocator (docs/methodology.md table); these are the documented defaults.
BASE_FRACTION = 0.03  # single compute stream: 512 B rounding (+0.02-0.05%) + block carving (+1.3-2.0%) + slack
SIDE_STREAM_FRACTION = 0.05  # DeepSpeed ZeRO-3: prefetch and reduce on side streams, not modelled as pools
MEGATRON_FRACTION = 0.06  # SimuMax models Megatron-LM's reserved memory as allocated / 0.94
EXPANDABLE_SEGMENTS_FRACTION = 0.02  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (e.g. torchtitan's launcher)


# How far `max_memory_reserved()` exceeded memcalc's reserved figure at worst on the GPU records, as a share of
# memcalc's figure (docs/data/validation-cuda*.json: torch on an H100 and an H200; tests/test_cuda_record.py holds
# it): default allocator, 49 of 50 runs within +12.1% (memcalc -10.8%; the 50th, an MoE run whose routing cannot be
# replayed, +22.4%); expandable segments, all 24 within +4.6% (memcalc -4.4%). A headroom below this share of the
# peak is inside the model's measured error (`memory.tight`). The fourth record's three runs beyond it (one fp32
# FSDP2 outlier, offloading, CUDA's own softmax scratch): tests/test_cuda_record_4.py, docs/methodology.md.
RESERVED_SHORTFALL_FRACTION = {"default": 0.125, "expandable": 0.05}


def reserved_error_share(allocator: str, fragmentation: float | None) -> float:
    """RESERVED_SHORTFALL_FRACTION for the allocator; 0 where `--fragmentation` gives the fraction: a measured
    figure of the user's own, to which the records' error does not apply."""
    return 0.0 if fragmentation is not None else RESERVED_SHORTFALL_FRACTION[allocator]


def reserved_error_bytes(run: Run, peak_bytes: int) -> int:
    """The largest under-estimate of reserved memory measured on the GPU records for this allocator, scaled to a
    peak: share x peak_bytes (`reserved_error_share`). A headroom below it is `tight`."""
    return int(peak_bytes * reserved_error_share(run.training.allocator, run.training.fragmentation))


def default_fraction(run: Run) -> Any:
    """Fraction f of reserved memory that is not allocated (a float, or an array of floats when the shard degree
    is an array): EXPANDABLE_SEGMENTS_FRACTION with `--allocator expandable`, else the profile's."""
    if run.training.allocator == "expandable":
        return EXPANDABLE_SEGMENTS_FRACTION
    if run.profile == "megatron":
        return MEGATRON_FRACTION
    if run.profile == "torch":
        # FSDP2's side-stream blocks are pools of their own (buffers.side_stream_pools), not part of f
        return BASE_FRACTION
    # deepspeed: ZeRO-3 fetches and reduces on side streams (overlap_comm on by default); ZeRO-0/1/2 copy into
    # persistent contiguous buckets on the compute stream.
    return SIDE_STREAM_FRACTION if run.zero == 3 else BASE_FRACTION


def fraction(run: Run) -> Any:
    f = run.training.fragmentation
    return default_fraction(run) if f is None else f


def slack_bytes(run: Run, compute_peak: Any) -> Any:
    """The allocator's slack over the compute stream's peak: compute_peak * f / (1 - f) bytes (elementwise)."""
    f = fraction(run)
    return as_int(compute_peak * (f / (1.0 - f)))


def first_step_stranded_bytes(run: Run, sm: StageMemory) -> Any:
    """Bytes of foreach Adam's first-step sqrt(v) list left in segments of their own, as far as they raise
    reserved memory above the compute stream's peak / (1 - f) (elementwise on arrays).

    Measured by replaying the caching allocator over the harness's allocation log (memcalc/validate/allocator.py,
    `memcalc validate --world fake --device meta`): foreach minus fused AdamW, the same run otherwise, is 3.29 GiB
    for Llama-2-7B under FSDP2 ZeRO-3 over 8 ranks with full recompute (the list: 3.14 GiB) and 6.01 GiB for
    Llama-3.2-3B on one GPU, pure bf16, full recompute (5.96 GiB); nothing where the activations' segments hold the
    states and the list (Llama-2-7B, ZeRO-3 over 8, no recompute). docs/methodology.md, "Fragmentation".

    The first step reserved `before` = (highest forward or backward moment of the compute stream, less the
    optimizer states it did not hold yet) / (1 - f). Its optimizer step needs `compute_stream_opt_peak`; the excess
    comes from new segments, the states taking the old blocks first, so up to the whole list is in the new ones.
    The later optimizer steps reuse those segments, so the list raises reserved memory only as far as a later
    forward or backward (`compute_stream_fb_peak`), which cannot use them, plus the list exceeds the step's own
    peak: reserved = max(step / (1 - f), fb / (1 - f) + list). Where the step without the list is below fb, that
    is fused AdamW's reserved figure plus the list, as the replays have it (foreach minus fused: 11.82 GiB for a
    12.55 GiB list on the H200's TP 2 + SP row 35, 15.08 GiB for 14.96 on its 8B row 36). Added on top of a step
    that is itself the peak, the list was counted twice: rows 35 and 42-47 were +10% to +21%.

    Only the default allocator (expandable segments map just the missing pages and merge the freed range), torch's
    optimizers (DeepSpeed and Megatron create their states before training) and the steady-state reading. An upper
    bound where later activations fit some of the list's blocks (small models: the H100's DDP and 4-layer rows
    replay 0.08-0.58 GiB of a 0.91-0.95 GiB list; block sizes are not checked)."""
    t = run.training
    temps = sm.buffers_detail.get("foreach_adam_temporaries", 0)
    if t.allocator != "default" or run.profile != "torch" or t.peak_step == "first":
        return 0 * temps
    f = fraction(run)
    before = as_int((sm.compute_stream_fb_peak - sm.states.optimizer) * (1.0 / (1.0 - f)))
    in_new = imin(temps, imax(0 * temps, sm.compute_stream_opt_peak - before))
    # every later optimizer step reuses those segments: they add only what a later forward or backward holds
    # beside them above the step's own peak
    above_fb = as_int((sm.compute_stream_peak - sm.compute_stream_fb_peak) * (1.0 / (1.0 - f)))
    return imax(0 * temps, in_new - above_fb)


def reserved_bytes(run: Run, sm: StageMemory) -> Any:
    """What `torch.cuda.max_memory_reserved()` would show for a stage (elementwise on arrays): the compute
    stream's peak (with the blocks it holds but cannot use there, `loss_stranded_bytes`) / (1 - f), the first
    optimizer step's stranded sqrt(v) list and the side streams' pools."""
    own = sm.compute_stream_peak
    reserved = own + slack_bytes(run, own) + first_step_stranded_bytes(run, sm)
    for pool in sm.side_stream_pools.values():
        reserved = reserved + pool
    return reserved


def fragmentation_bytes(run: Run, sm: StageMemory) -> Any:
    """Reserved minus allocated at the allocated peak (elementwise on arrays); never negative: every moment's
    allocated bytes are the compute stream's plus side-stream blocks that lie inside their pools."""
    return reserved_bytes(run, sm) - sm.allocated_peak
