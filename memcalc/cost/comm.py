"""Communication per optimizer step: every collective one GPU takes part in, its bytes and its time.
DESIGN.md section 5; every formula's derivation and source is collected in docs/methodology.md.

Volume (bytes *sent by one GPU*), with S the full buffer of one call and n the group size, are the ring
algorithms' figures, the bus-bandwidth factors of nccl-tests (NVIDIA/nccl-tests doc/PERFORMANCE.md):
all-reduce 2(n-1)/n*S, reduce-scatter and all-gather (n-1)/n*S, all-to-all (n-1)/n*S, broadcast and reduce S
(factor 1), send/recv S.

Time of one call: latency * ring steps + volume / B_eff (Hockney alpha-beta model; ring steps 2(n-1) for
all-reduce, n-1 for reduce-scatter / all-gather / all-to-all / broadcast, 1 for send/recv). B_eff is the
intra-node bandwidth when the group's ranks lie in one node, else the per-GPU inter-node (NIC) bandwidth times the
group's ranks per node (each node drives that many NICs in parallel; capped at the intra-node bandwidth); a
send/recv pair crossing nodes gets one NIC; an all-to-all across nodes sends (n-k)/n of its buffer through the
NIC (k = ranks per node). Placement: `run.order`, innermost first (default tp, cp, pp, dp, as Megatron's
`RankGenerator`); a dimension X of size n_X and stride s_X (the product of the sizes inside it) has
min(n_X, max(1, G // s_X)) of its ranks in one node of G GPUs (exact for power-of-two sizes).

Which collectives run, per profile (sources next to each builder below):
- data parallel (group dp x cp; expert parameters over dp x cp / ep): ZeRO-0 all-reduce once per step (no_sync
  while accumulating; torch DDP one call per rebuilt bucket, `_ddp_allreduce`); ZeRO-1 torch
  `ZeroRedundancyOptimizer` DDP's all-reduce + one broadcast per parameter tensor,
  megatron distributed optimizer / deepspeed reduce-scatter + all-gather once per step; ZeRO-2 reduce-scatter
  every micro-batch (+ torch FSDP2 `reshard_after_forward=False`: one all-gather per micro-batch; megatron /
  deepspeed: the all-gather once per step); ZeRO-3 all-gather in forward and again in backward + reduce-scatter,
  every micro-batch (torch FSDP2: the root module stays unsharded after forward). torch FSDP2 is counted call by
  call, one per `fully_shard` unit with FSDP2's dim-0 padding, and once per step under pipelining
  (`_fsdp2_terms`). Only trainable parameters are
  reduced (LoRA / --freeze); ZeRO-3 also gathers frozen weights. `dp_mode` ps: push grads + pull params through
  one server link; dataparallel (torch.nn.DataParallel): broadcast params + reduce grads every micro-batch.
- tensor parallel: megatron / deepspeed as Shoeybi et al. 2019 (sec. 3, Fig. 4): 2 all-reduces of s*b*h in
  forward and 2 in backward per layer per micro-batch, with SP the same volume as all-gather + reduce-scatter
  pairs (Korthikanti et al. 2022 sec. 4.2.2), +2 (one forward) under full recompute (ZeRO paper sec. 7.2.2);
  torch DTensor with unfused q/k/v and gate/up, as measured (memcalc validate): (2L+1) all-reduces forward,
  (5L+1) backward (4L+1 with a GELU MLP), loss_parallel's 3 fp32 all-reduces, +1 per layer under full
  recompute; with SP
  2 + 2 all-gathers and reduce-scatters per layer, and the Partial gradients of the SequenceParallel norms
  all-reduced by DTensor (`_sp_norm_grads_torch`); norm outputs and the residual stream in `_stream_dtype`.
- pipeline: send/recv of s*b*h (/t with SP) per micro-batch per stage boundary, both directions, vpp times as
  many with interleaving (Narayanan et al. 2021 sec. 2.2.2), each transfer counted by the rank that sends it;
  the tied embedding / LM-head gradient all-reduce between the first and last stage (Megatron
  `_allreduce_word_embedding_grads`).
- context parallel, a2a (--cp-comm a2a): all-to-all of Q, K, V and the attention output per layer in forward and of
  their gradients in backward (TE AttnFuncWithCPAndQKVOA2A, one call per layer each way; Jacobs et al. 2023,
  DeepSpeed-Ulysses sec. 3, `DistributedAttention`: one call per tensor).
- context parallel: ring exchange of the local K/V chunk, (cp-1) steps per layer in forward, K/V and dK/dV in
  backward (Transformer Engine `AttnFuncWithCPAndKVP2P`).
- expert parallel: token all-to-all dispatch + combine per MoE layer, forward and backward (Lepikhin et al. 2020
  GShard sec. 2; Megatron `MoEAlltoAllTokenDispatcher`).

The worst rank is chosen among the first, the second and the last pipeline stage (the middle stages are alike):
the one with the most exposed communication, then the most communication time.

Array-polymorphic like the rest of the cost model: `comm_seconds_per_step` and `exposed_comm_seconds` accept runs
whose layout fields are numpy arrays and agree exactly with the scalar `collectives()` (tests/test_comm.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from memcalc.cost.compute import overlap_windows, stage_recomputed_layers
from memcalc.cost.params import (
    grad_ready_elems,
    grad_ready_listed,
    head_params,
    largest_unit_params,
    layer_norms,
    layer_tensor_shapes,
    padded_shard_elems,
    pipelined_fsdp,
    root_tensor_shapes,
    scaled,
    shape_params,
    stage_first_layer,
    stage_dense_layers,
    stage_layer_params,
    stage_layers,
    stage_param_split,
    stage_params,
    stage_tensor_shapes,
)
from memcalc.specs import DTYPE_BYTES, Run
from memcalc.xp import as_int, cdiv, imax, imin, per_value_tuple, where

Num = Any

# torch DDP `bucket_cap_mb=25`, and with that default a first bucket of `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB)
# once the buckets are rebuilt (torch/nn/parallel/distributed.py `_BucketConfig`)
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
# DeepSpeed `reduce_bucket_size` default 5e8 elements (deepspeed/runtime/zero/config.py)
DEEPSPEED_REDUCE_BUCKET = 500_000_000
# Megatron-core DDP: bucket_size default max(40M, 1M * dp) parameters
# (megatron/core/distributed/distributed_data_parallel_config.py)
MEGATRON_BUCKET_MIN = 40_000_000

OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "broadcast", "reduce", "send/recv")
# *_host: GPU <-> host copies (PCIe) hide behind the same compute as fwd / bwd / bwd_last but on their own link,
# so they are summed apart from the network collectives of that window (`_totals`)
WINDOWS = ("none", "fwd", "bwd", "fwd_first", "bwd_last", "attn", "compute", "fwd_host", "bwd_host",
           "bwd_last_host")


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One kind of collective on the worst rank over one optimizer step (scalar values)."""

    op: str  # all-reduce | reduce-scatter | all-gather | all-to-all | broadcast | reduce | send/recv
    group: str  # dp | tp | pp | cp | ep
    group_size: int
    dtype: str
    bytes_per_call: int  # the full buffer S of one call
    calls_per_micro_batch: float  # calls_per_step / micro-batches (fractional for once-per-step collectives)
    calls_per_step: int
    bytes_per_step: int  # bytes sent by one GPU per step (ring factors)
    seconds_per_step: float
    link: str  # intra-node | inter-node
    overlapped: bool
    note: str = ""
    window: str = "none"  # the compute it overlaps with (see compute.overlap_windows)


@dataclasses.dataclass(frozen=True, slots=True)
class _Term:
    """A collective with array-capable numbers (internal)."""

    op: str
    group: str
    dtype: str
    n: Num  # group size
    s: Num  # bytes per call
    calls: Num  # per step (0 when inactive)
    intra: Num  # bool
    bw: Num  # effective bytes/s
    window: str
    tail: Num  # minimum exposed fraction (the last bucket / first unit), float in [0, 1]
    note: str
    per_mb: bool  # repeats every micro-batch

    @property
    def bytes_per_step(self) -> Num:
        num, den = _factor(self.op, self.n)
        return self.calls * self.s * num // den

    def seconds(self, latency: float) -> Num:
        return self.calls * _steps(self.op, self.n) * latency + self.bytes_per_step / self.bw


def _factor(op: str, n: Num) -> tuple[Num, Num]:
    """Bus-bandwidth factor as (numerator, denominator) (nccl-tests doc/PERFORMANCE.md)."""
    if op == "all-reduce":
        return 2 * (n - 1), n
    if op in ("reduce-scatter", "all-gather", "all-to-all"):
        return n - 1, n
    return 1, 1  # broadcast, reduce, send/recv


def _steps(op: str, n: Num) -> Num:
    """Latency terms of one call: ring steps (Thakur et al. 2005; NCCL ring algorithms)."""
    if op == "all-reduce":
        return 2 * (n - 1)
    if op in ("send/recv", "host-copy"):
        return 1 + 0 * n
    return n - 1


# ---------------------------------------------------------------------------------------------------- placement


def strides(run: Run) -> dict[str, Num]:
    """Rank stride of each parallel dimension under `run.order` (innermost first)."""
    sizes = {"tp": run.tp, "cp": run.cp, "pp": run.pp, "dp": run.dp}
    out: dict[str, Num] = {}
    stride: Num = 1
    for dim in run.order:
        out[dim] = stride
        stride = stride * sizes[dim]
    return out


def ranks_per_node(run: Run, segments: list[tuple[Num, Num]]) -> Num:
    """Ranks of a group in one node; the group spans the given (stride, size) segments of the rank space."""
    g = run.hardware.gpus_per_node
    k: Num = 1
    for stride, size in segments:
        k = k * imin(size, imax(1, g // stride))
    return k


def _bandwidth(run: Run, kind: str, n: Num, k: Num) -> tuple[Num, Num]:
    """(intra-node?, effective bytes/s) for a group of n ranks with k per node. A missing (0) bandwidth is
    treated as infinite: those collectives are timed by their latency alone (said in the notes)."""
    hw = run.hardware
    b_in = hw.intra_node_bytes_per_s if hw.intra_node_bytes_per_s > 0 else float("inf")
    b_out = hw.inter_node_bytes_per_s if hw.inter_node_bytes_per_s > 0 else float("inf")
    intra = k >= n
    if b_out == float("inf"):  # no inter-node figure: inter-node collectives are timed by latency alone
        return intra, where(intra, b_in + 0.0 * k, b_out + 0.0 * k)
    if kind == "ring":
        inter_bw = imin(b_in, b_out * k)
    elif kind == "a2a":
        inter_bw = imin(b_in, b_out * (n - 1) / imax(n - k, 1))
    elif kind == "server":  # every worker talks to one server endpoint: its link carries n workers' traffic
        return intra, where(intra, b_in + 0.0 * k, imin(b_in, b_out + 0 * k)) / n
    else:  # one pair of ranks: one NIC each
        inter_bw = imin(b_in, b_out + 0 * k)
    return intra, where(intra, b_in + 0.0 * k, inter_bw)


def _term(run: Run, op: str, group: str, dtype: str, n: Num, s: Num, calls: Num, segments: list[tuple[Num, Num]],
          window: str = "none", tail: Num = 0.0, note: str = "", per_mb: bool = False, kind: str = "ring") -> _Term:
    active = n > 1
    calls = where(active, calls, 0 * calls)
    k = ranks_per_node(run, segments)
    intra, bw = _bandwidth(run, kind, n, k)
    return _Term(op=op, group=group, dtype=dtype, n=n, s=s, calls=calls, intra=intra, bw=bw, window=window,
                 tail=tail, note=note, per_mb=per_mb)


def _tail(bucket_bytes: Num, s: Num) -> Num:
    """Fraction of a buffer of S bytes that is the last (or first) bucket: cannot overlap."""
    return imin(1.0, bucket_bytes / imax(s, 1))


# ---------------------------------------------------------------------------------------------------- torch DDP


@functools.lru_cache(maxsize=512)
def _ddp_bucket_layout(elems: tuple[int, ...], num: int, den: int, grad_bytes: int, first_cap: int,
                       cap: int) -> tuple[int, ...]:
    """torch DDP's buckets from the second step on: after the first backward the reducer rebuilds them in the order
    the gradients became ready (c10d `Reducer::rebuild_buckets` -> `compute_bucket_assignment_by_size` with the
    limits [first_cap, cap]): each gradient joins the open bucket, which closes once it holds at least its limit
    (the first bucket's, then every later one's); what is left is the last bucket. `elems` are the tensors in
    ready order (params.grad_ready_elems), scaled by num/den for `--params N` on the running total (so the buckets
    add up to the scaled stage exactly). Returns (last bucket's bytes, size_0, count_0, size_1, count_1, ...): the
    other buckets by size, in order of first appearance."""
    sizes: list[int] = []
    cum, start, limit = 0, 0, first_cap
    for e in elems:
        cum += e
        end = cum * num // den * grad_bytes
        if end - start >= limit:
            sizes.append(end - start)
            start, limit = end, cap
    end = cum * num // den * grad_bytes
    if end > start or not sizes:
        sizes.append(end - start)
    counts: dict[int, int] = {}
    for b in sizes[:-1]:
        counts[b] = counts.get(b, 0) + 1
    return (sizes[-1], *(x for kv in counts.items() for x in kv))


def _ddp_allreduce(run: Run, stage: Num, n: Num, seg: list[tuple[Num, Num]], grads: Num, gb: int, one: Num,
                   pre: str, note: str) -> list[_Term]:
    """The gradient all-reduce of torch DDP (also under ZeroRedundancyOptimizer), once per step over the last
    micro-batch's backward. Where the tensors are listed (params.grad_ready_listed) it is counted bucket by
    bucket: every bucket but the last overlaps the backward; the last (the embedding's gradient on the first
    stage) is reduced after it. Else one logical call of the whole buffer, whose last 25 MiB is exposed."""
    m, cap_mb = run.model, run.training.bucket_cap_mb
    # a bucket_cap_mb of the user's (even 25) sets the first bucket's limit too (torch `_BucketConfig`)
    cap = DDP_BUCKET_BYTES if cap_mb is None else int(cap_mb * 2**20)
    first = DDP_FIRST_BUCKET_BYTES if cap_mb is None else cap
    if not grad_ready_listed(run):
        return [_term(run, "all-reduce", "dp", run.recipe.grad_dtype, n, grads, one, seg, window="bwd_last",
                      tail=_tail(cap + 0 * grads, grads),
                      note=f"{pre}: {note} (overlaps the last backward except the last bucket)")]
    # `--params N` scales the reference shape's tensors (not LoRA's adapters, params.stage_param_split)
    scale = m.params_override is not None and run.training.lora_rank is None
    num, den = (m.params_override, shape_params(m)) if scale else (1, 1)

    def layout(tp: int, pp: int, vpp: int, st: int) -> tuple[int, ...]:
        return _ddp_bucket_layout(grad_ready_elems(run.replace(tp=tp, pp=pp, vpp=vpp), st), num, den, gb, first,
                                  cap)

    last, *pairs = per_value_tuple(layout, run.tp, run.pp, run.vpp, stage)
    dtype = run.recipe.grad_dtype
    out = [_term(run, "all-reduce", "dp", dtype, n, s, c * one, seg, window="bwd_last",
                 note=f"{pre}: {note}, one DDP bucket a call (buckets filled in gradient-ready order to "
                      f"{first / 2**20:g} MiB, then {cap / 2**20:g} MiB each)")
           for s, c in zip(pairs[::2], pairs[1::2], strict=True)]
    out.append(_term(run, "all-reduce", "dp", dtype, n, last, one, seg,
                     note=f"{pre}: DDP's last bucket, reduced after the backward"))
    return out


# ---------------------------------------------------------------------------------------------------- groups


def _dp_segments(run: Run, st: dict[str, Num]) -> list[tuple[Num, Num]]:
    return [(st["cp"], run.cp), (st["dp"], run.dp)]


def _ep_split(run: Run, st: dict[str, Num]) -> tuple[list[tuple[Num, Num]], list[tuple[Num, Num]]]:
    """The expert-parallel group takes the innermost `ep` ranks of the dp x cp ranks (in placement order);
    the expert-data-parallel group the rest (Megatron `RankGenerator` for expert groups)."""
    dims = [d for d in run.order if d in ("cp", "dp")]
    sizes = {"cp": run.cp, "dp": run.dp}
    inner, outer = dims[0], dims[1]
    e1 = imin(run.ep, sizes[inner])
    e2 = run.ep // e1
    ep_seg = [(st[inner], e1), (st[outer], e2)]
    edp_seg = [(st[inner] * e1, sizes[inner] // e1), (st[outer] * e2, sizes[outer] // e2)]
    return ep_seg, edp_seg


# ---------------------------------------------------------------------------------------------------- torch helpers


def _label(cond: Any, a: str, b: str) -> str:
    """The dtype label of a term whose bytes are `where(cond, bytes of a, bytes of b)`: exact for a scalar run;
    for the planner's arrays (labels unused there) `b`."""
    if isinstance(cond, bool):
        return a if cond else b
    import numpy as np

    return a if np.ndim(cond) == 0 and bool(cond) else b


def _fsdp_on(run: Run) -> Num:
    """torch profile: FSDP2 wraps the model when ZeRO >= 2 and the shard group dp x cp has more than one rank
    (torchtitan; memcalc/validate/harness.py); otherwise AMP runs under torch.autocast."""
    if run.zero < 2:
        return False
    return run.dp * run.cp > 1


def _stream_dtype(run: Run) -> tuple[str, Num]:
    """(dtype, bytes) of the residual stream, i.e. of the embedding output, the norm outputs and what flows between
    pipeline stages. torch AMP (fp32 params, torch.autocast): the embedding lookup is not an autocast op
    (aten/src/ATen/autocast_mode.cpp lists no embedding among the lower-precision ops), so the stream, the norms'
    outputs and their gradients stay in the param dtype; only linear outputs are in the compute dtype (measured:
    TP+SP bf16 all-gathers the norm outputs in fp32, pipelining sends fp32). Under FSDP2's MixedPrecisionPolicy
    the params themselves are cast: everything is in the compute dtype. Other profiles: the compute dtype."""
    r = run.recipe
    act = r.compute_dtype
    if run.profile != "torch" or not r.compute_copy or r.param_dtype == act:
        return act, DTYPE_BYTES[act]
    fsdp = _fsdp_on(run)
    return _label(fsdp, act, r.param_dtype), where(fsdp, DTYPE_BYTES[act], DTYPE_BYTES[r.param_dtype])


# ---------------------------------------------------------------------------------------------------- builders


def _root_params(run: Run, stage: Num, total: Num) -> Num:
    """Parameters of the stage outside the transformer layers (embedding, final norm, LM head): FSDP2's root
    module when every layer is its own `fully_shard` unit."""
    m = run.model
    dense_s, expert_s = stage_layer_params(run, stage)
    return imax(total - scaled(run, dense_s + expert_s), 0)


def _data_parallel(run: Run, stage: Num, st: dict[str, Num]) -> list[_Term]:
    """Gradient reduction and parameter gathering over the data-parallel (ZeRO shard) group. Only trainable
    parameters have gradients (LoRA adapters, unfrozen layers: params.stage_param_split); frozen weights are
    gathered by ZeRO-3 / FSDP2 like any parameter, in their stored (possibly quantized) form."""
    from memcalc.cost.states import frozen_bytes

    r, z, prof = run.recipe, run.zero, run.profile
    ga = run.grad_accum
    split = stage_param_split(run, stage)
    dense, expert = split.trainable_dense, split.trainable_expert
    frozen = frozen_bytes(run, split.frozen_linear, split.frozen_linear_rows, split.frozen_linear_matrices,
                          split.frozen_other)
    gb, pb = DTYPE_BYTES[r.grad_dtype], DTYPE_BYTES[r.param_dtype]
    one = 1 + 0 * ga  # once per step (array-shaped)
    # Megatron `--overlap-grad-reduce` / `--overlap-param-gather` (megatron/core/distributed/
    # distributed_data_parallel_config.py): off, the gradients are reduced in `finalize_model_grads` after the last
    # backward and the updated parameters gathered right after the step, both exposed; memcalc's default is on
    overlap_grads = run.training.overlap_grad_reduce is not False
    overlap_params = run.training.overlap_param_gather is not False
    if run.dp_mode != "collective":
        return _dp_mode_terms(run, st, dense + expert, gb, pb)
    # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) gathers the low-precision copy
    # (validation-findings: "FSDP2 with bf16 params: all-gathers in bf16, reduce-scatter in fp32")
    ag_dtype = r.compute_dtype if (prof == "torch" and r.compute_copy) else r.param_dtype
    agb = DTYPE_BYTES[ag_dtype]
    unit = largest_unit_params(run)
    # torch, dense and fully trainable: per-tensor shapes are known, so the collectives are counted call by call
    # (the same categorical test as states.model_states' FSDP2 padding)
    per_tensor = prof == "torch" and run.training.lora_rank is None and not run.training.freeze \
        and run.model.moe is None
    groups: list[tuple[str, Num, Num, list[tuple[Num, Num]], str]] = [
        ("", dense, run.dp * run.cp, _dp_segments(run, st), "dense")
    ]
    if run.model.moe is not None:
        _, edp = _ep_split(run, st)
        groups.append(("expert ", expert, run.dp * run.cp // run.ep, edp, "expert"))
    out: list[_Term] = []
    for label, p, n, seg, which in groups:
        grads, params = p * gb, p * pb
        gathered = p * agb + (frozen if which == "dense" else 0 * p)  # ZeRO-3 gathers frozen weights too
        if which == "dense":
            # FSDP2's root (embedding, final norm, LM head) is not gathered again in backward
            full = stage_params(run, stage)[0]
            # float ratio, then round: gathered * (full - root) overflows int64 in the planner's bulk mode
            bwd_gathered = as_int(gathered * ((full - _root_params(run, stage, full)) / imax(full, 1)))
        else:
            bwd_gathered = gathered
        if prof == "megatron":
            bucket = imax(MEGATRON_BUCKET_MIN, 1_000_000 * run.dp * run.cp) * gb
        else:  # deepspeed; torch DDP is bucketed tensor by tensor in _ddp_allreduce
            bucket = DEEPSPEED_REDUCE_BUCKET * gb
        unit_tail = _tail(unit * agb, gathered)
        pre = f"{label}grads" if label else "grads"
        if z == 0 and prof == "torch":
            # torch DDP all-reduce once per step; no_sync during accumulation
            out += _ddp_allreduce(run, stage, n, seg, grads, gb, one, pre, "all-reduce once per step")
        elif z == 0:
            # DDP all-reduce once per step; no_sync during accumulation (Megatron DDP, DeepSpeed engine
            # `allreduce_gradients` at the accumulation boundary)
            ovl = prof == "megatron" and overlap_grads
            out.append(_term(run, "all-reduce", "dp", r.grad_dtype, n, grads, one, seg,
                             window="bwd_last" if ovl else "none", tail=_tail(bucket, grads),
                             note=f"{pre}: all-reduce once per step ("
                                  + ("overlaps the last backward except the last bucket" if ovl else
                                     "after backward; DeepSpeed overlap_comm is off below ZeRO-3") + ")"))
        elif z == 1 and prof == "torch":
            # torch ZeroRedundancyOptimizer: DDP all-reduce, then each rank broadcasts its updated partition
            # (torch/distributed/optim/zero_redundancy_optimizer.py `_sync_params`; measured 4P + 4P in fp32)
            out += _ddp_allreduce(run, stage, n, seg, grads, gb, one, pre, "DDP all-reduce once per step")
            if per_tensor and run.model.params_override is None:
                # `_sync_params` -> `_broadcast_params_from_rank`: with parameters_as_bucket_view=False (the
                # default) every parameter tensor is broadcast on its own from the rank that owns it: one call per
                # tensor (tensors of one shape are one term; collectives() merges equal ones)
                for d0, row, count in stage_tensor_shapes(run, stage):
                    out.append(_term(run, "broadcast", "dp", r.param_dtype, n, d0 * row * pb, count * one, seg,
                                     note="params: ZeroRedundancyOptimizer broadcasts every parameter tensor from "
                                          "its owner after the step (one call per tensor; factor 1)"))
            else:
                out.append(_term(run, "broadcast", "dp", r.param_dtype, n, params, one, seg,
                                 note=f"{label}params: ZeroRedundancyOptimizer broadcasts every rank's partition "
                                      "after the step (one logical call of the whole buffer; factor 1)"))
        elif z in (1, 2) and prof in ("megatron", "deepspeed"):
            # Megatron distributed optimizer (docs/user-guide/features/dist_optimizer.md): reduce-scatter grads,
            # all-gather updated params; DeepSpeed stage_1_and_2.py: ZeRO-1 reduces at the accumulation boundary,
            # ZeRO-2 every micro-batch (grads are partitioned), all-gather of params after the step.
            per_mb = z == 2
            ovl = prof == "megatron" and overlap_grads
            ovl_params = prof == "megatron" and overlap_params
            out.append(_term(run, "reduce-scatter", "dp", r.grad_dtype, n, grads, ga if per_mb else one, seg,
                             window=("bwd" if per_mb else "bwd_last") if ovl else "none",
                             tail=_tail(bucket, grads), per_mb=per_mb,
                             note=f"{pre}: reduce-scatter " + ("every micro-batch" if per_mb else "once per step")))
            out.append(_term(run, "all-gather", "dp", r.param_dtype, n, params, one, seg,
                             window="fwd_first" if ovl_params else "none", tail=_tail(bucket * pb // gb, params),
                             note=f"{label}params: all-gather of the updated shards once per step"
                                  + (" (--overlap-param-gather)" if ovl_params else "")))
        elif per_tensor:  # torch FSDP2, ZeRO-2 or 3, counted call by call
            out += _fsdp2_terms(run, stage, n, seg, ag_dtype, unit)
        elif z == 2:  # torch FSDP2 fully_shard(reshard_after_forward=False)
            # under pipelining once per step (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`:
            # set_reshard_after_backward(False), set_requires_gradient_sync(False) until `perform_reduce_grad`)
            per = where(run.pp > 1, one, ga)
            out.append(_term(run, "all-gather", "dp", ag_dtype, n, gathered, per, seg, window="fwd",
                             tail=unit_tail, per_mb=True,
                             note=f"{label}params: FSDP2 all-gather in forward, kept for backward, every micro-batch"
                                  " (one logical call of the whole buffer)"))
            out.append(_term(run, "reduce-scatter", "dp", r.grad_dtype, n, grads, per, seg, window="bwd",
                             tail=_tail(unit * gb, grads), per_mb=True,
                             note=f"{pre}: FSDP2 reduce-scatter every micro-batch (one logical call)"))
        else:  # ZeRO-3: FSDP2 default / DeepSpeed stage3.py / Megatron FSDP
            bwd_gather = bwd_gathered if prof == "torch" else gathered
            rs_tail = _tail(bucket, grads) if prof == "deepspeed" else _tail(unit * gb, grads)
            # torch under pipelining (see _fsdp2_terms): one gather of every unit per step plus one more of the
            # layers per micro-batch, and one reduce-scatter per step
            first_calls = where(run.pp > 1, one, ga) if prof == "torch" else ga
            out.append(_term(run, "all-gather", "dp", ag_dtype, n, gathered, first_calls, seg, window="fwd",
                             tail=unit_tail, per_mb=True,
                             note=f"{label}params: all-gather in forward every micro-batch (prefetched)"
                                  + (" (one logical call of the whole buffer)" if prof == "torch" else "")))
            out.append(_term(run, "all-gather", "dp", ag_dtype, n, bwd_gather, ga, seg, window="bwd",
                             tail=_tail(unit * agb, bwd_gather), per_mb=True,
                             note=f"{label}params: all-gather again in backward every micro-batch"
                                  + (" (FSDP2 root stays unsharded after forward)" if prof == "torch" else "")))
            out.append(_term(run, "reduce-scatter", "dp", r.grad_dtype, n, grads, first_calls, seg, window="bwd",
                             tail=rs_tail, per_mb=True, note=f"{pre}: reduce-scatter every micro-batch"))
    return out


def _fsdp2_terms(run: Run, stage: Num, n: Num, seg: list[tuple[Num, Num]], ag_dtype: str, unit: Num) -> list[_Term]:
    """torch FSDP2, one `fully_shard` unit per transformer layer plus the root unit (embedding, final norm, LM
    head; memcalc/validate/parallelize.py `apply_fsdp`, torchtitan), counted call by call.

    Bytes of one call: FSDP2 all-gathers (reduce-scatters) one flat buffer per unit holding every tensor of the
    unit with dim 0 padded to a multiple of the shard group n (torch/distributed/fsdp/_fully_shard/
    _fsdp_param.py `_init_sharded_param`, _fsdp_collectives.py `foreach_all_gather` / `foreach_reduce`):
    n * sum(ceil(dim0 / n) * row) elements.
    Calls, with m micro-batches and L_s layers on the stage:
    - pp = 1, ZeRO-3: each layer is gathered in forward and again in backward (reshard_after_forward=True) but
      the last, which stays gathered into its backward (torchtitan's default policy), the root once per
      micro-batch (reshard_after_forward=None: False for the root; re-gathered after the
      post-backward reshard); one reduce-scatter per unit per micro-batch (no no_sync in the torch recipe).
    - pp = 1, ZeRO-2 (reshard_after_forward=False): one gather and one reduce-scatter per unit per micro-batch.
    - pp > 1 (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`): every backward runs with
      set_reshard_after_backward(False) and set_requires_gradient_sync(False); `perform_reduce_grad` reshards and
      reduce-scatters once per step. A layer stays gathered from a backward to the next forward, so under
      ZeRO-3 it is gathered m + 1 times per step whatever the schedule (2m forward/backward passes, m - 1 of them
      right after a backward); ZeRO-2 and the root unit once per step. Measured (memcalc validate, PP2 x FSDP2,
      m = 2 and 4, 1F1B and GPipe)."""
    r = run.recipe
    ga = run.grad_accum
    agb, gb = DTYPE_BYTES[ag_dtype], DTYPE_BYTES[r.grad_dtype]
    layers = stage_layers(run, stage)
    blk = scaled(run, padded_shard_elems(layer_tensor_shapes(run), n) * n)
    root = scaled(run, padded_shard_elems(root_tensor_shapes(run, stage), n) * n)
    has_root = where(root > 0, 1, 0)
    pp_on = run.pp > 1
    per_step = where(pp_on, 1 + 0 * ga, ga)  # units gathered / reduced once per micro-batch (pp = 1) or step
    z3 = run.zero >= 3
    # exposure as for the whole buffer: the first (largest) unit cannot overlap (see _totals)
    ag_tail = _tail(unit * agb, (layers * blk + root) * agb)
    rs_tail = _tail(unit * gb, (layers * blk + root) * gb)
    out = [
        _term(run, "all-gather", "dp", ag_dtype, n, blk * agb, layers * (ga if z3 else per_step), seg,
              window="fwd", tail=ag_tail, per_mb=True,
              note="params: all-gather of each layer's fully_shard unit in forward, one call per layer per "
                   "micro-batch" + ("" if z3 else " (kept for backward; pp > 1: once per step)")),
        _term(run, "all-gather", "dp", ag_dtype, n, root * agb, has_root * per_step, seg, window="fwd",
              tail=ag_tail, per_mb=True,
              note="root params (the embedding, final norm, LM head unit): one all-gather per micro-batch (pp > 1: "
                   "per step), kept for backward"),
        _term(run, "reduce-scatter", "dp", r.grad_dtype, n, blk * gb, layers * per_step, seg, window="bwd",
              tail=rs_tail, per_mb=True,
              note="grads: reduce-scatter of each layer's unit every micro-batch (pp > 1: once per step)"),
        _term(run, "reduce-scatter", "dp", r.grad_dtype, n, root * gb, has_root * per_step, seg, window="bwd",
              tail=rs_tail, per_mb=True,
              note="root grads: reduce-scatter every micro-batch (pp > 1: once per step)"),
    ]
    if z3:
        # pp = 1: the last layer is not resharded after its forward (its backward follows at once)
        out.insert(1, _term(run, "all-gather", "dp", ag_dtype, n, blk * agb,
                            where(pp_on, layers * (1 + 0 * ga), imax(layers - 1, 0) * ga),
                            seg, window="bwd", tail=ag_tail, per_mb=True,
                            note="params: all-gather of each layer's unit again in backward every micro-batch, "
                                 "the last layer kept from its forward (pp > 1: m + 1 gathers per layer per step "
                                 "in all)"))
    return out


def _dp_mode_terms(run: Run, st: dict[str, Num], p: Num, gb: int, pb: int) -> list[_Term]:
    """Data parallelism without collectives among the workers (tp = pp = cp = ep = 1, ZeRO 0)."""
    r = run.recipe
    n = run.dp
    seg = _dp_segments(run, st)
    one = 1 + 0 * run.grad_accum
    if run.dp_mode == "ps":
        # parameter server (Li et al. 2014, OSDI, sec. 3-4): each worker pushes its gradients and pulls the updated
        # parameters once per step; one server endpoint serves all n workers, so its link is shared n ways.
        return [
            _term(run, "send/recv", "dp", r.grad_dtype, n, p * gb, one, seg, kind="server",
                  note="push gradients to the parameter server once per step (server link shared by n workers)"),
            _term(run, "send/recv", "dp", r.param_dtype, n, p * pb, one, seg, kind="server",
                  note="pull updated parameters from the server once per step (bytes received)"),
        ]
    # torch.nn.DataParallel (torch/nn/parallel/data_parallel.py, replicate.py, _functions.py): every forward call
    # broadcasts the parameters from GPU 0 (`Broadcast` / comm.broadcast_coalesced) and backward sums the replicas'
    # gradients onto GPU 0 (`ReduceAddCoalesced`); one process, so one node.
    ga = run.grad_accum
    return [
        _term(run, "broadcast", "dp", r.param_dtype, n, p * pb, ga, seg, per_mb=True,
              note="DataParallel replicates the parameters from GPU 0 every forward"),
        _term(run, "reduce", "dp", r.grad_dtype, n, p * gb, ga, seg, per_mb=True,
              note="DataParallel sums the replicas' gradients onto GPU 0 every backward"),
    ]


def _tensor_parallel(run: Run, stage: Num, st: dict[str, Num]) -> list[_Term]:
    m, t = run.model, run.tp
    ga = run.grad_accum
    act = run.recipe.compute_dtype
    ab = DTYPE_BYTES[act]
    s_h = (run.seq // run.cp) * run.micro_batch * m.hidden * ab  # one s*b*h activation (s/cp with CP)
    layers = stage_layers(run, stage)
    rc = stage_recomputed_layers(run, stage) if run.training.recompute in ("full", "op") else 0 * layers
    first = where(stage == 0, 1, 0)
    last = where(stage == run.pp - 1, 1, 0)
    seg = [(st["tp"], t)]
    win = "compute" if run.tp_overlap else "none"
    out: list[_Term] = []

    def add(op: str, s: Num, per_mb: Num, note: str, dtype: str = act) -> None:
        out.append(_term(run, op, "tp", dtype, t, s, per_mb * ga, seg, window=win, note=note, per_mb=True))

    if run.profile == "torch":
        # DTensor ColwiseParallel / RowwiseParallel with unfused q, k, v and gate, up (validation-findings;
        # memcalc/validate/parallelize.py `apply_tp`, torchtitan's plan). Dtypes (`_stream_dtype`): a linear's output
        # is in the compute dtype C, the embedding output, the norms' outputs and their gradients in the
        # residual-stream dtype S (the param dtype under torch.autocast). Measured per layer and micro-batch:
        # - no SP: forward, the o and down outputs are all-reduced (2, C); backward, the input gradient of every
        #   column-parallel linear (3 + 2 SwiGLU or 3 + 1 GELU, S: the reduction runs at the module boundary,
        #   after the autocast cast's backward); non-reentrant checkpointing replays one forward all-reduce per
        #   layer (the o output: it stops early once the saved tensors are rebuilt);
        # - SP: forward, the norm outputs are all-gathered (2, S) and the o / down outputs reduce-scattered (2, C);
        #   backward the reverse (2 all-gathers C, 2 reduce-scatters S); recompute replays 2 all-gathers (S) and
        #   1 reduce-scatter (C) per layer, none under op-level SAC (it saves reduce-scatter outputs).
        n_col = 3 + (2 if m.mlp == "swiglu" else 1)
        sdt, sb = _stream_dtype(run)
        s_s = (run.seq // run.cp) * run.micro_batch * m.hidden * sb  # one activation in the stream dtype
        rec = run.training.recompute in ("full", "op")
        rs_rc = 0 * rc if run.training.recompute == "op" else rc
        # with dropout a fully recomputed layer's re-run goes on through the down projection to the output dropout's
        # mask (activations `_recomputed_plain_end`), so it replays that projection's collective too (measured:
        # docs/validation.md row 245, one reduce-scatter per layer short without it)
        drop = run.training.recompute == "full" and run.dropout > 0
        drop_rc = rc if drop else 0 * rc
        if not run.sp:
            add("all-reduce", s_h, layers * 2 + rc + drop_rc,
                "layers: 2 fwd all-reduces per layer (o, down outputs)" + (
                    ", +2 per recomputed layer (dropout: the re-run reaches the down projection)" if drop
                    else ", +1 per recomputed layer" if rec else ""))
            add("all-reduce", s_s, layers * n_col,
                f"column-parallel input grads: {n_col} bwd all-reduces per layer", sdt)
            add("all-reduce", s_s, first + last, "embedding output (fwd) and LM-head input grad (bwd)", sdt)
        else:
            add("all-gather", s_s, layers * 2 + rc * 2,
                "layers (SP): 2 fwd all-gathers per layer (norm outputs)" + (", +2 per recomputed layer" if rec
                                                                             else ""), sdt)
            add("all-gather", s_h, layers * 2, "layers (SP): 2 bwd all-gathers per layer (o, down output grads)")
            add("reduce-scatter", s_h, layers * 2 + rs_rc + drop_rc,
                "layers (SP): 2 fwd reduce-scatters per layer (o, down outputs)" + (
                    ", +2 per recomputed layer (dropout: the re-run reaches the down projection)" if drop
                    else ", +1 per recomputed layer" if rec and rs_rc is rc else ""))
            add("reduce-scatter", s_s, layers * 2, "layers (SP): 2 bwd reduce-scatters per layer (norm output grads)",
                sdt)
            add("reduce-scatter", s_s, first + last, "emb, head (SP): embedding output (fwd), LM-head input grad (bwd)", sdt)
            add("all-gather", s_s, first + last, "emb, head (SP): embedding grad (bwd), LM-head input (fwd)", sdt)
            out.append(_sp_norm_grads_torch(run, stage, seg))
        # DTensor loss_parallel on the vocab-sharded logits (torch/distributed/tensor/parallel/loss.py,
        # torchtitan's default): all-reduces of the max logit, the sum of exp and the target logit (fp32, forward);
        # the fused nll + log-softmax backward communicates nothing
        ce = (run.seq // run.cp) * run.micro_batch * 4
        add("all-reduce", ce, 3 * last, "loss (loss_parallel): max, sum of exp, target logit (fp32, forward)", "fp32")
    else:
        # Megatron-LM (Shoeybi et al. 2019 sec. 3): f/g operators, 2 all-reduces forward + 2 backward per layer;
        # full recompute replays the forward: +2 (ZeRO paper sec. 7.2.2: 6 all-reduces per block).
        # With SP (Korthikanti et al. 2022 sec. 4.2.2): each all-reduce becomes all-gather + reduce-scatter.
        if not run.sp:
            add("all-reduce", s_h, layers * 4 + rc * 2,
                "layers: 2 fwd + 2 bwd all-reduces per layer" + (" + 2 replayed in recompute" if
                                                                 run.training.recompute == "full" else ""))
            add("all-reduce", s_h, first + last, "emb, head: vocab-parallel embedding output (fwd), LM-head input grad (bwd)")
        else:
            add("all-gather", s_h, layers * 4 + rc * 2, "layers (SP): 2 fwd + 2 bwd all-gathers per layer")
            add("reduce-scatter", s_h, layers * 4 + rc * 2, "layers (SP): 2 fwd + 2 bwd reduce-scatters per layer")
            add("reduce-scatter", s_h, first + last, "emb, head (SP): embedding output (fwd), LM-head input grad (bwd)")
            add("all-gather", s_h, first + last, "emb, head (SP): embedding grad (bwd), LM-head input (fwd)")
        # vocab_parallel_cross_entropy: all-reduce of the max logit, the target logit and the sum of exp (fp32)
        ce = (run.seq // run.cp) * run.micro_batch * 4
        add("all-reduce", ce, 3 * last, "loss (vocab-parallel CE): max, target logit, sum of exp (fp32, forward)", "fp32")
    return out


_OPT_GRAD_READS = {"adam": 3, "adamw": 3, "adam-8bit": 3, "adafactor": 3, "sgd": 1, "sgd-momentum": 1, "lion": 2}


def _sp_norm_grads_torch(run: Run, stage: Num, seg: list[tuple[Num, Num]]) -> _Term:
    """torch SP: the norms run under `SequenceParallel` (Replicate weights, Shard(1) inputs), so the weight (and
    bias) gradient is a Partial DTensor: a sum over this rank's sequence shard. Without FSDP2 nothing reduces it
    in backward; every optimizer op that reads the grad redistributes it to Replicate, one all-reduce each
    (measured: AdamW / Adam 3 per tensor, foreach or not: lerp_(grad) and addcmul_(grad, grad); SGD with or
    without momentum 1; torch.optim.Adafactor 3; Lion 2 and 8-bit Adam 3 by the same reads, not measured),
    in the dtype the optimizer sees (the fp32 master copy's grad when there is one). Under FSDP2
    (`FSDPParam._get_grad_inner_tensor`, torch/distributed/fsdp/_fully_shard/_fsdp_param.py) the unsharded grad is
    redistributed to the param's TP placement once per micro-batch before the reduce-scatter, in FSDP2's param
    dtype; once per step under torch pipelining, in the reduce dtype. Tensors: 2 norms per trainable layer (1
    where a parallel block shares it, `params.layer_norms`) + the final norm on the last stage, weight (+ bias
    for LayerNorm)."""
    m, t = run.model, run.training
    r = run.recipe
    ga = run.grad_accum
    nrm = 2 if m.norm == "layernorm" else 1
    layers = stage_layers(run, stage)
    if t.freeze:
        from memcalc.specs import freeze_layers

        start = stage_first_layer(run, stage)
        layers = layers - imin(imax(freeze_layers(t) - start, 0), layers)
    tensors = nrm * (layer_norms(m) * layers + where(stage == run.pp - 1, 1, 0))
    if t.lora_rank is not None:  # LoRA: the norms are frozen, no grads
        tensors = 0 * tensors
    fsdp = _fsdp_on(run)
    opt_dtype = "fp32" if r.master_weights else r.grad_dtype
    fsdp_dtype = r.compute_dtype if r.compute_copy else r.param_dtype
    # torch pipelining over FSDP2 accumulates the unsharded grads and reduces once per step (`perform_reduce_grad`):
    # one redistribution per tensor, of the accumulator (the reduce dtype under MixedPrecisionPolicy)
    piped = fsdp & (pipelined_fsdp(run) == 1)
    fsdp_b = where(piped, DTYPE_BYTES[r.grad_dtype], DTYPE_BYTES[fsdp_dtype])
    b = where(fsdp, fsdp_b, DTYPE_BYTES[opt_dtype]) * m.hidden
    calls = tensors * where(fsdp, where(piped, 1, ga), _OPT_GRAD_READS[t.optimizer] + 0 * ga)
    return _term(run, "all-reduce", "tp", _label(fsdp, fsdp_dtype, opt_dtype), run.tp, b, calls, seg,
                 note="norm grads (SP): Partial grads of the replicated norm weights, all-reduced by DTensor (per optimizer "
                      "read of the grad; under FSDP2 once per micro-batch)")


def _pipeline(run: Run, stage: Num, st: dict[str, Num]) -> list[_Term]:
    m, pp, v = run.model, run.pp, run.vpp
    ga = run.grad_accum
    # the residual stream crosses the stage boundary: the param dtype under torch.autocast (`_stream_dtype`;
    # measured: PP with AMP bf16 sends fp32), else the compute dtype
    act, ab = _stream_dtype(run)
    s = (run.seq // run.cp) * run.micro_batch * m.hidden * ab
    if run.sp:
        s = s // run.tp
    first = where(stage == 0, 1, 0)
    last = where(stage == pp - 1, 1, 0)
    # device d holds model chunks d, d+pp, ...: it sends activations forward for every chunk but the model's
    # last and gradients backward for every chunk but the model's first (Narayanan et al. 2021 sec. 2.2.2).
    # A transfer is counted once, by the rank that sends it (its `bytes_per_step` are bytes sent); the matching
    # receives are the neighbours' sends (torch.distributed.pipelining: one isend per activation / gradient,
    # `_batch_p2p`; measured).
    sends = 2 * v - first - last
    seg = [(st["pp"], pp)]
    out = [_term(run, "send/recv", "pp", act, pp, s, sends * ga, seg, kind="pair", per_mb=True,
                 note="stage boundary: activations forward + grads backward per micro-batch and model chunk (2 sends per "
                      "chunk, one fewer on the first and on the last stage)" + (" (SP: /tp)" if run.sp else ""))]
    if m.tied_embeddings:
        # Megatron `_allreduce_word_embedding_grads` (megatron/core/distributed/finalize_model_grads.py); torch
        # pipelining keeps separate copies, so the training loop has to do the same.
        g = run.recipe.grad_dtype
        emb = head_params(m, run.profile, run.tp) * DTYPE_BYTES[g]
        on = (pp > 1) & (where(stage == 0, True, False) | where(stage == pp - 1, True, False))
        n = where(on, 2, 1)
        out.append(_term(run, "all-reduce", "pp", g, n, emb, 1 + 0 * ga, seg, kind="pair",
                         note="tied embedding / LM-head grads between the first and last stage, once per step"))
    return out


def _context_parallel(run: Run, stage: Num, st: dict[str, Num]) -> list[_Term]:
    m, c = run.model, run.cp
    act = run.recipe.compute_dtype
    layers = stage_layers(run, stage)
    rc = stage_recomputed_layers(run, stage) if run.training.recompute == "full" else 0 * layers
    tok = (run.seq // c) * run.micro_batch
    if run.cp_comm == "a2a":
        if run.training.recompute == "op":
            # op-level SAC keeps matmul and attention outputs, not the exchange's: the re-run forward exchanges
            # Q, K, V and the output again (measured by the harness: 3 x 4 calls per layer)
            rc = stage_recomputed_layers(run, stage)
        calls = (2 * layers + rc) * run.grad_accum  # per layer: forward (and its recompute) and backward
        note = "all-to-all attention: Q, K, V and the output per layer forward, their gradients backward"
        if run.profile == "megatron":
            # TE AttnFuncWithCPAndQKVOA2A (>= 2.8): forward all-to-alls Q, K, V (sequence -> head sharding) and
            # the output back; backward the output gradient and dQ, dK, dV: Q+K+V+O bytes per layer each way
            qkvo = tok * (2 * m.heads + 2 * m.kv_heads) // run.tp * m.head_dim * DTYPE_BYTES[act]
            return [_term(run, "all-to-all", "cp", act, c, qkvo, calls, [(st["cp"], c)], kind="a2a", window="attn",
                          per_mb=True, note=note)]
        # DeepSpeed-Ulysses DistributedAttention (and the harness): one all-to-all per tensor, Q and the output
        # (a/t heads), K and V (g/t heads), each way
        qo = tok * (m.heads // run.tp) * m.head_dim * DTYPE_BYTES[act]
        kv = tok * (m.kv_heads // run.tp) * m.head_dim * DTYPE_BYTES[act]
        return [_term(run, "all-to-all", "cp", act, c, qo, 2 * calls, [(st["cp"], c)], kind="a2a", window="attn",
                      per_mb=True, note=note + " (Q, O)"),
                _term(run, "all-to-all", "cp", act, c, kv, 2 * calls, [(st["cp"], c)], kind="a2a", window="attn",
                      per_mb=True, note=note + " (K, V)")]
    # K and V of the local sequence chunk on one TP rank (GQA: kv_heads / tp heads)
    kv = 2 * tok * (m.kv_heads // run.tp) * m.head_dim * DTYPE_BYTES[act]
    # TE AttnFuncWithCPAndKVP2P: forward (cp-1) K/V sends; backward (cp-1) K/V + (cp-1) dK/dV sends
    per_mb = (3 * layers + rc) * (c - 1)
    return [_term(run, "send/recv", "cp", act, c, kv, per_mb * run.grad_accum, [(st["cp"], c)], kind="pair",
                  window="attn", per_mb=True,
                  note="ring attention: (cp-1) K/V chunks per layer forward, K/V + dK/dV backward")]


def _expert_parallel(run: Run, stage: Num, st: dict[str, Num]) -> list[_Term]:
    m = run.model
    assert m.moe is not None
    act = run.recipe.compute_dtype
    # MoE layers only: the model's first dense layers (the stage's first, so the first recomputed) have no experts
    dense = stage_dense_layers(run, stage)
    layers = stage_layers(run, stage) - dense
    rc = imax(stage_recomputed_layers(run, stage) - dense, 0) if run.training.recompute == "full" else 0 * layers
    tokens = (run.seq // run.cp) * run.micro_batch
    if run.sp:
        tokens = tokens // run.tp
    s = tokens * m.moe.top_k * m.hidden * DTYPE_BYTES[act]
    ep_seg, _ = _ep_split(run, st)
    return [_term(run, "all-to-all", "ep", act, run.ep, s, (4 * layers + 2 * rc) * run.grad_accum, ep_seg,
                  kind="a2a", per_mb=True,
                  note="token dispatch + combine per MoE layer, forward and backward (top-k copies per token)")]


def _host(run: Run, dtype: str, s: Num, calls: Num, window: str, note: str, per_mb: bool) -> _Term:
    """A GPU <-> host copy over the GPU's PCIe link (`host_bytes_per_s` per direction; untimed when 0)."""
    bw = run.hardware.host_bytes_per_s
    return _Term(op="host-copy", group="host", dtype=dtype, n=1 + 0 * calls, s=s, calls=calls, intra=True,
                 bw=bw if bw > 0 else float("inf"), window=window, tail=0.0, note=note, per_mb=per_mb)


def _host_copies(run: Run, stage: Num) -> list[_Term]:
    """GPU <-> host traffic of one rank per step (array-capable; none without offloading).

    Activation offloading (`--offload-activations`): every layer's saved set goes to the host during its forward
    and comes back ahead of its backward, one layer at a time on a side stream (torchtune `OffloadActivations`,
    Megatron/TE `--cpu-offloading`): hidden behind the forward and the backward (with its recompute) unless the
    copies take longer. The last layer's set is copied out but never back (its originals are still on the GPU
    when its backward starts); measured to the byte by the harness (memcalc/validate/offload.py).
    Optimizer offload (ZeRO-Offload, Ren et al. 2021 sec. 4): the rank's gradient shard goes to the host for the
    CPU step, overlapped with the last backward, and the updated parameter shard comes back before the next
    forward, exposed; `--offload params` (ZeRO-Infinity) also brings the parameter shard in for every forward and
    backward of every micro-batch, prefetched behind them. The CPU optimizer step itself is compute.py's
    `cpu_optimizer_seconds`."""
    from memcalc.cost.activations import stage_activations
    from memcalc.cost.states import model_states

    out: list[_Term] = []
    ga = run.grad_accum
    if run.training.offload_activations:
        sa = stage_activations(run, stage)
        unit = sa.host_bytes // imax(sa.in_flight, 1)  # one micro-batch's (model chunk's) offloaded layers
        # the last layer's set (plain, or checkpointed when all are) never comes back: its originals are still on
        # the GPU when its backward starts
        _, plain_n, _, plain, kept, *_, casts = sa.offload_parts
        # (its weight casts under AMP never left: `host_bytes` has none of the plain layers')
        last = where(plain_n >= 1, plain - casts, kept)
        # one call per micro-batch (model chunk when interleaved) standing for its per-layer copies, so that the
        # bytes are exact (the first layer's set may be smaller than the rest)
        units_step = ga * (run.vpp if run.schedule == "interleaved" else 1)
        act = run.recipe.compute_dtype
        out.append(_host(run, act, unit, units_step, "fwd_host", "activation offload: every layer's saved set to "
                         "the host in its forward (one call per micro-batch)", per_mb=True))
        out.append(_host(run, act, unit - last, units_step, "bwd_host", "activation offload: every layer's "
                         "saved set but the last back ahead of its backward (one call per micro-batch)",
                         per_mb=True))
    if run.offload in ("optimizer", "params"):
        ms = model_states(run, stage)
        d = run.shard_degree if run.zero >= 1 else 1
        shard = cdiv(ms.trainable_params, d)
        r = run.recipe
        out.append(_host(run, r.grad_dtype, shard * DTYPE_BYTES[r.grad_dtype], 1 + 0 * ga, "bwd_last_host",
                         "optimizer offload: the gradient shard to the host for the CPU step", per_mb=False))
        out.append(_host(run, r.compute_dtype, shard * DTYPE_BYTES[r.compute_dtype], 1 + 0 * ga, "none",
                         "optimizer offload: the updated parameter shard back from the host", per_mb=False))
        if run.offload == "params":
            full = cdiv(ms.stage_params, run.shard_degree) * DTYPE_BYTES[r.compute_dtype]
            for window, phase in (("fwd_host", "forward"), ("bwd_host", "backward")):
                out.append(_host(run, r.compute_dtype, full, ga, window, f"parameter offload: the parameter shard "
                                 f"in for every {phase}", per_mb=True))
    return out


def stage_terms(run: Run, stage: Num) -> list[_Term]:
    """All collectives of one rank of pipeline stage `stage`, and its GPU <-> host copies (array-capable;
    inactive ones have 0 calls)."""
    st = strides(run)
    terms = _data_parallel(run, stage, st) + _tensor_parallel(run, stage, st) + _pipeline(run, stage, st)
    terms += _context_parallel(run, stage, st)
    if run.model.moe is not None:
        terms += _expert_parallel(run, stage, st)
    return terms + _host_copies(run, stage)


# ---------------------------------------------------------------------------------------------------- totals


def _totals(run: Run, terms: list[_Term]) -> tuple[Num, Num]:
    """(communication seconds, exposed seconds) of a list of terms. Overlapped collectives that share a compute
    window are summed; the group is exposed by max(its non-overlappable tail, its time - the window)."""
    lat = run.hardware.latency_s
    windows = overlap_windows(run)
    total: Num = 0.0
    by_window: dict[str, list[Num]] = {w: [0.0, 0.0] for w in WINDOWS}
    for term in terms:
        sec = term.seconds(lat)
        total = total + sec
        acc = by_window[term.window]
        acc[0] = acc[0] + sec
        acc[1] = acc[1] + sec * term.tail
    exposed: Num = by_window["none"][0]
    for w in WINDOWS[1:]:
        t, tail = by_window[w]
        exposed = exposed + imax(tail, t - windows[w.removesuffix("_host")])
    return total, exposed


def candidate_stages(run: Run) -> list[Num]:
    """The stages that can be a pipeline's worst: the first, the second and the last (array-capable)."""
    cands = [0 * run.pp, imin(1, run.pp - 1), run.pp - 1]
    if type(run.pp) is int:  # scalar run: evaluate each distinct stage once (order kept for tie-breaking)
        return list(dict.fromkeys(cands))
    return cands


def worst_stage(run: Run) -> tuple[Num, Num, Num]:
    """(stage, communication seconds, exposed seconds) of the worst rank: most exposed, then most total."""
    cands = candidate_stages(run)
    best = cands[0]
    b_tot, b_exp = _totals(run, stage_terms(run, best))
    for s in cands[1:]:
        tot, exp = _totals(run, stage_terms(run, s))
        better = (exp > b_exp) | ((exp == b_exp) & (tot > b_tot))
        best = where(better, s, best)
        b_tot = where(better, tot, b_tot)
        b_exp = where(better, exp, b_exp)
    return best, b_tot, b_exp


def comm_seconds_per_step(run: Run) -> Num:
    """Time of all collectives of the worst rank per step, overlapped or not (array-capable)."""
    return worst_stage(run)[1]


def exposed_comm_seconds(run: Run) -> Num:
    """Communication time per step that does not hide behind compute, worst rank (array-capable)."""
    return worst_stage(run)[2]


def comm_bytes_per_step(run: Run) -> Num:
    """Bytes sent by the worst rank per step (array-capable)."""
    stage = worst_stage(run)[0]
    total: Num = 0
    for term in stage_terms(run, stage):
        total = total + term.bytes_per_step
    return total


# ---------------------------------------------------------------------------------------------------- scalar API


def collectives(run: Run, stage: int | None = None) -> list[Collective]:
    """The collectives of the worst rank (or of `stage`) over one optimizer step, scalar run only."""
    if stage is None:
        stage = int(worst_stage(run)[0])
    lat = run.hardware.latency_s
    ga = int(run.grad_accum)
    out: list[Collective] = []
    seen: dict[tuple[Any, ...], int] = {}
    for t in stage_terms(run, stage):
        calls = int(t.calls)
        if calls == 0:
            continue
        # terms that differ only in their calls (ZeroRedundancyOptimizer's per-tensor broadcasts of equal size)
        # are one line
        key = (t.op, t.group, int(t.n), t.dtype, int(t.s), t.note, t.window, bool(t.intra))
        if key in seen:
            i = seen[key]
            c = out[i]
            out[i] = dataclasses.replace(c, calls_per_step=c.calls_per_step + calls,
                                         calls_per_micro_batch=(c.calls_per_step + calls) / ga,
                                         bytes_per_step=c.bytes_per_step + int(t.bytes_per_step),
                                         seconds_per_step=c.seconds_per_step + t.seconds(lat))
            continue
        seen[key] = len(out)
        out.append(Collective(
            op=t.op,
            group=t.group,
            group_size=int(t.n),
            dtype=t.dtype,
            bytes_per_call=int(t.s),
            calls_per_micro_batch=calls / ga,
            calls_per_step=calls,
            bytes_per_step=int(t.bytes_per_step),
            seconds_per_step=t.seconds(lat),
            link="host" if t.group == "host" else ("intra-node" if bool(t.intra) else "inter-node"),
            overlapped=t.window != "none",
            note=t.note,
            window=t.window,
        ))
    return out


def comm_notes(run: Run) -> list[str]:
    hw = run.hardware
    notes = [
        "bytes_per_step: bytes sent by one GPU (ring factors: all-reduce 2(n-1)/n, reduce-scatter / all-gather / "
        "all-to-all (n-1)/n, broadcast and send/recv 1)",
        f"time: latency x ring steps + bytes / bandwidth; placement {','.join(run.order)} (innermost first), "
        f"{hw.gpus_per_node} GPUs per node",
        "dp collectives run over dp x cp (ZeRO shard group); torch DDP's all-reduce is listed bucket by bucket "
        "(its buckets rebuilt in gradient-ready order after the first step), Megatron's and DeepSpeed's bucketed "
        "collectives as one call of the whole buffer",
    ]
    if hw.intra_node_bytes_per_s <= 0 or hw.inter_node_bytes_per_s <= 0:
        notes.append("hardware lacks an intra- or inter-node bandwidth: collectives on that link are timed by "
                     "latency only")
    if run.profile == "torch" and run.tp > 1:
        notes.append("torch TP: measured DTensor counts with unfused q/k/v and gate/up; vocab-parallel loss "
                     "(loss_parallel)")
    if run.profile == "megatron" and run.tp > 1 and run.sp:
        notes.append("megatron SP: the paper's volume; Megatron also re-gathers column-parallel inputs in backward "
                     "(overlapped with the input-grad GEMM), not counted")
    if run.offload != "none" or run.training.offload_activations:
        notes.append("host copies (offload): over the GPU's PCIe link at host_bytes_per_s per direction"
                     + ("" if hw.host_bytes_per_s > 0 else " (unknown for this GPU: not timed; --host-bw)")
                     + "; they overlap the forward / backward on their own link")
    if run.offload != "none":
        notes.append("optimizer offload: the CPU optimizer step is timed in compute (cpu_optimizer_seconds)")
    if run.model.moe is not None and run.tp > 1 and not run.sp:
        notes.append("MoE with TP and no SP: every TP rank dispatches all its tokens (no token split over TP)")
    return notes


def communication_out(run: Run, colls: list[Collective]) -> Any:
    """The `communication` section of the Estimate."""
    from memcalc.cost.estimate import CollectiveOut, Communication

    stage, _, exposed = worst_stage(run)
    outs = [CollectiveOut(**{f.name: getattr(c, f.name) for f in dataclasses.fields(Collective)}) for c in colls]
    seconds = 0.0
    for c in colls:
        seconds = seconds + c.seconds_per_step
    return Communication(
        modelled=True,
        collectives=outs,
        bytes_per_step=sum(c.bytes_per_step for c in colls),
        seconds_per_step=seconds,
        exposed_seconds_per_step=float(exposed),
        stage=int(stage),
        notes=comm_notes(run),
    )


__all__ = [
    "OPS",
    "Collective",
    "collectives",
    "comm_bytes_per_step",
    "comm_seconds_per_step",
    "communication_out",
    "exposed_comm_seconds",
    "ranks_per_node",
    "stage_terms",
    "strides",
    "worst_stage",
]
