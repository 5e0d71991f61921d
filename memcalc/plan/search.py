"""Bulk evaluation, pruning and ranking for `memcalc plan`. DESIGN section 7.

How the search runs (no per-configuration Python object, log line or string in the hot loop):
1. memcalc/plan/space.py lists the valid (layout, micro-batch) pairs as numpy int64 columns and the valid
   categorical combos (ZeRO stage, recompute, SP, offload), counting what each validity rule rejects.
2. The pairs are split into groups by the categorical axes and the pipeline schedule (interleaved when vpp > 1).
   For each group one `Run` is made from the base run (`options.build_run` with the layout left at its defaults)
   with `dataclasses.replace`, its numeric layout fields (gpus, dp, tp, pp, vpp, cp, ep, micro_batch,
   grad_accum, global_batch) set to arrays. The stage kinds that bound a pipeline are stage 0 (the most layers,
   the embedding and, in the activation model, the most in-flight micro-batches), stage pp-1 (the LM head and
   the logits), and under torch stages 1 and pp-2 (the middle stages are monotone in the stage index: torch
   pipelining's receive buffers both ways, torch's interleaved schedule holding its sends); every other stage
   holds no more (tests/test_plan.py checks this against `estimate`, which walks every stage). Each
   (configuration, stage kind) pair whose stage is not already one of the others goes into one call of the cost
   model per group (`bulk_peak`): its cost is largely per call. Peak = allocated peak + fragmentation + runtime
   overhead, as in `memcalc.cost.estimate._totals`.
3. Memory first, and the micro-batch grows only while it fits: round 1 evaluates each layout's smallest
   micro-batch; round 2 evaluates the larger ones of the layouts that fitted, and a layout's micro-batches after
   the first one over the budget are dropped (`pruned_micro_batch`); layouts that failed round 1 are never
   evaluated again.
4. Step time, tokens/s and MFU are computed (in bulk, once per group) only for what fits, by the compute model's
   array-polymorphic `step_seconds` (compute + bubble + exposed communication + the CPU
   optimizer step under offload, memcalc/cost/compute.py).
5. Ranking by the objective and the memory-vs-throughput Pareto front are numpy sorts. Only the top K are turned
   into options, re-resolved by `build_run` and re-run through `estimate`, so that the plan's memory,
   communication and compute blocks are exactly what `memcalc estimate --json` prints for its command.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from memcalc.cost.estimate import runtime_bytes
from memcalc.cost.fragmentation import fragmentation_bytes, reserved_error_share
from memcalc.cost.timeline import stage_memory
from memcalc.errors import InputError
from memcalc.options import RunOptions, build_run
from memcalc.plan.space import RULES, Bounds, Combo, Space, divisors, enumerate_space
from memcalc.specs import DEEPSPEED_NO_RING, Run, check_op_recompute

PLAN_SCHEMA_VERSION = "1.4"
OBJECTIVES: tuple[str, ...] = ("throughput", "memory", "gpus")
# The options `plan` searches over or derives; everything else in memcalc.cli.RUN_OPTIONS is shared with estimate.
SEARCH_FIELDS: tuple[str, ...] = ("tp", "pp", "vpp", "cp", "micro_batch", "zero", "recompute", "sp", "offload",
                                  "dp", "grad_accum")

Progress = Callable[[int, int], None]


@dataclasses.dataclass
class Request:
    """What `plan` was asked: the shared run options (their search fields are ignored), bounds and ranking."""

    options: RunOptions
    bounds: Bounds = dataclasses.field(default_factory=Bounds)
    objective: str = "throughput"
    min_headroom: float = 0.0
    top: int = 5


@dataclasses.dataclass
class Columns:
    """Configurations as columns: index into the space's pairs and combos, and the figures of each."""

    pair: np.ndarray
    combo: np.ndarray
    peak: np.ndarray
    step: np.ndarray
    tps: np.ndarray
    mfu: np.ndarray

    @staticmethod
    def concat(parts: list["Columns"]) -> "Columns":
        if not parts:
            e_i, e_f = np.zeros(0, dtype=np.int64), np.zeros(0)
            return Columns(e_i, e_i, e_i, e_f, e_f, e_f)
        return Columns(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Columns)))

    def take(self, idx: np.ndarray) -> "Columns":
        return Columns(*(getattr(self, f.name)[idx] for f in dataclasses.fields(Columns)))

    @property
    def size(self) -> int:
        return int(self.pair.size)


@dataclasses.dataclass
class SearchResult:
    request: Request
    options: RunOptions  # the request's options with any imported config merged in
    base: Run
    space: Space
    feasible: Columns
    closest: Columns  # evaluated configurations over the budget with the smallest peaks (for advice)
    rejected: dict[str, int]
    evaluated: int
    wall_seconds: float
    capacity: int
    budget: int

    @property
    def considered(self) -> int:
        return self.space.considered


# --- base run and per-configuration options ---------------------------------------------------------------------


def check_request(req: Request) -> RunOptions:
    """Check the plan-level inputs; return the options with any imported framework config merged in."""
    from memcalc.options import IMPORT_FIELDS, check_choice

    o = req.options
    if any(getattr(o, f) for f in IMPORT_FIELDS):
        from memcalc.importers import apply_imports

        o = apply_imports(o)
    o = dataclasses.replace(o, schedule=check_choice("schedule", o.schedule))
    if check_choice("dp_mode", o.dp_mode) != "collective":
        raise InputError(f"--dp-mode {o.dp_mode} fixes the layout (tp = pp = cp = 1, ZeRO-0): plan searches "
                         "collective data parallelism; use `memcalc estimate` for it")
    if req.objective not in OBJECTIVES:
        raise InputError(f"--objective {req.objective!r} is not valid; valid: {', '.join(OBJECTIVES)}")
    if o.gpus is None:
        raise InputError("plan needs --gpus N (the cluster to plan for)")
    if o.gpus < 1:
        raise InputError(f"--gpus {o.gpus} must be at least 1")
    if o.global_batch is None:
        raise InputError("plan needs --global-batch B (sequences per optimizer step)")
    if o.global_batch < 1:
        raise InputError(f"--global-batch {o.global_batch} must be at least 1")
    if not 0.0 <= req.min_headroom < 1.0:
        raise InputError(f"--min-headroom {req.min_headroom} must be a fraction in [0, 1)")
    if req.top < 1:
        raise InputError(f"--top {req.top} must be at least 1")
    return o


def base_options(o: RunOptions) -> RunOptions:
    """The user's options with the layout at its defaults: resolves for any model and batch."""
    return dataclasses.replace(
        o, gpus=None, dp=None, tp=1, pp=1, vpp=1, cp=1, ep=1, sp=None, zero=0, offload="none", schedule=None,
        micro_batch=1, global_batch=None, grad_accum=None,
        recompute="full" if o.recompute_every is not None else "selective" if o.recompute_layers is not None
        else "none",
    )


def config_options(res: SearchResult, pair: int, combo: int) -> RunOptions:
    """The RunOptions of one configuration: what `memcalc estimate` needs to reproduce it."""
    s, c, o = res.space, res.space.combos[combo], res.options
    tp, vpp = int(s.tp[pair]), int(s.vpp[pair])
    return dataclasses.replace(
        o, gpus=int(s.gpus[pair]), dp=None, tp=tp, pp=int(s.pp[pair]), vpp=vpp, cp=int(s.cp[pair]),
        micro_batch=int(s.micro_batch[pair]), global_batch=s.global_batch, grad_accum=None, zero=c.zero,
        recompute=c.recompute, sp=c.sp if tp > 1 else None, offload=c.offload,
        schedule=o.schedule if vpp == 1 else None,
    )


def _flag_names(field: str) -> tuple[str, str | None]:
    """(--flag, --no-flag or None) of a RUN_OPTIONS field, read from its typer.Option."""
    from memcalc.cli import RUN_OPTIONS

    opt = RUN_OPTIONS[field][2]
    names = [n for n in (opt.default, *opt.param_decls) if isinstance(n, str) and n.startswith("-")]
    long = next(n for n in names if n.startswith("--"))
    if "/" in long:
        on, off = long.split("/", 1)
        return on, off
    return long, None


_ALWAYS = ("model", "params", "gpus", "global_batch", "seq", "tp", "pp", "cp", "micro_batch", "zero", "recompute")


def command_for(o: RunOptions) -> str:
    """`memcalc estimate ...` with every option that differs from its default (and the layout, always)."""
    from memcalc.cli import RUN_OPTIONS

    parts = ["memcalc", "estimate"]
    for field, (_ann, default, _opt) in RUN_OPTIONS.items():
        value = getattr(o, field)
        if value is None or (value == default and field not in _ALWAYS):
            continue
        on, off = _flag_names(field)
        if isinstance(value, bool):
            parts.append(on if value else (off or on))
        else:
            parts += [on, shlex.quote(str(value))]
    return " ".join(parts)


# --- time model adapter -----------------------------------------------------------------------------------------


def times(run: Run) -> tuple[Any, Any, Any]:
    """(step seconds, tokens/s, MFU) from memcalc.cost.compute, with the step time computed once (the compute
    model's `tokens_per_second` and `achieved_mfu` each recompute it; tests check these equal estimate's)."""
    from memcalc.cost import compute

    step = compute.step_seconds(run)
    tps = compute.tokens_per_step(run) / step
    mfu = compute.model_flops_per_step(run) / (step * compute.peak_flops_per_gpu(run) * run.gpus)
    return step, tps, mfu


# --- the bulk search ---------------------------------------------------------------------------------------------


def _as_i64(x: Any, n: int) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind == "f":
        a = np.floor(a)
    return np.broadcast_to(a.astype(np.int64), (n,))


_LAYOUT_FIELDS = ("gpus", "dp", "tp", "pp", "vpp", "cp", "ep", "micro_batch", "grad_accum", "global_batch")


def bulk_peak(run: Run, n: int) -> np.ndarray:
    """Peak bytes (allocated + fragmentation + runtime) of the worst of stages 0, 1, pp-2 and pp-1, per element.
    On the middle stages every term is monotone in the stage index (in-flight units and the remainder layers
    fall; torch's interleaved schedule holds more sent tensors further down), so stage 1 or pp-2 bounds them.
    Every (configuration, stage) pair goes through one call of the cost model: much of its cost is per call."""
    pp = _as_i64(run.pp, n)
    # (stage kind, the elements where it is a stage of its own): a stage kind that is stage 0 or pp - 1 of an
    # element is not evaluated for it again
    kinds: list[tuple[Any, np.ndarray]] = [(0, np.ones(n, dtype=bool)), (pp - 1, pp > 1)]
    # torch only: its middle stages hold receive buffers both ways, and its interleaved schedule more sends
    # further down the pipeline; elsewhere stage 0 bounds the middle stages
    if run.profile == "torch":
        kinds.append((np.minimum(1, pp - 1), pp > 2))
        if run.schedule == "interleaved":
            kinds.append((np.maximum(pp - 2, 0), pp > 3))
    cols = [np.flatnonzero(sel) for _, sel in kinds]
    elem = np.concatenate(cols)
    stage = np.concatenate([_as_i64(st, n)[c] for (st, _), c in zip(kinds, cols)])
    sub = dataclasses.replace(run, **{f: _as_i64(getattr(run, f), n)[elem] for f in _LAYOUT_FIELDS})
    sm = stage_memory(sub, stage)
    m = elem.size
    total = (_as_i64(sm.allocated_peak, m) + _as_i64(fragmentation_bytes(sub, sm), m)
             + _as_i64(runtime_bytes(sub), m))  # the same functions estimate uses
    peak = total[:n].copy()  # stage 0: every element, in order
    at = n
    for c in cols[1:]:
        peak[c] = np.maximum(peak[c], total[at:at + c.size])
        at += c.size
    return peak


def _group_run(base: Run, space: Space, idx: np.ndarray, combo: Combo, training: Any, schedule: str,
               ep: int) -> Run:
    n = idx.size
    return dataclasses.replace(
        base, training=training, zero=combo.zero, offload=combo.offload, sp=combo.sp, schedule=schedule,
        gpus=space.gpus[idx], dp=space.dp[idx], tp=space.tp[idx], pp=space.pp[idx], vpp=space.vpp[idx],
        cp=space.cp[idx], ep=np.full(n, ep, dtype=np.int64), micro_batch=space.micro_batch[idx],
        grad_accum=space.grad_accum[idx], global_batch=np.full(n, space.global_batch, dtype=np.int64),
    )


def _after_first_failure(layout: np.ndarray, fail: np.ndarray) -> np.ndarray:
    """For pairs sorted by layout then micro-batch: True from each layout's first failing pair onwards."""
    if layout.size == 0:
        return np.zeros(0, dtype=bool)
    start = np.r_[True, layout[1:] != layout[:-1]]
    seg = np.cumsum(start) - 1
    cs = np.cumsum(fail)
    before_seg = (cs - fail)[np.flatnonzero(start)]
    return (cs - before_seg[seg]) > 0


def search(req: Request, progress: Progress | None = None, keep_closest: int = 3) -> SearchResult:
    """The bulk search: counts per rule, every feasible configuration with its figures, the closest misses."""
    t0 = time.perf_counter()
    o = check_request(req)
    base = build_run(base_options(o))
    m, hw = base.model, base.hardware
    if req.bounds.recompute is not None and "op" in req.bounds.recompute:
        check_op_recompute(base.training.lora_rank, base.training.qkv_impl)
    if base.profile == "deepspeed" and base.cp_comm == "p2p" and (req.bounds.cp is None or max(req.bounds.cp) > 1):
        # resolve() refuses it at cp > 1, so the search would return layouts `estimate` rejects
        raise InputError(DEEPSPEED_NO_RING + " (or --cp 1)")
    if o.ep > 1 and (m.moe is None or m.moe.experts % o.ep):
        build_run(dataclasses.replace(base_options(o), ep=o.ep, dp=o.ep))  # raises resolve()'s one-line error
    gpus = divisors(o.gpus) if req.objective == "gpus" else [o.gpus]
    space = enumerate_space(
        layers=m.layers, heads=m.heads, kv_heads=m.kv_heads, seq=base.seq, global_batch=o.global_batch, gpus=gpus,
        gpus_per_node=hw.gpus_per_node, profile=base.profile, ep=o.ep, schedule=o.schedule,
        recompute_layers=o.recompute_layers, bounds=req.bounds, keep_logits=base.training.keep_logits,
        cp_comm=base.cp_comm, mla=m.mla is not None, recompute_every=o.recompute_every,
    )
    rejected = dict(space.rejected)
    capacity = hw.memory_bytes
    budget = capacity - int(np.ceil(req.min_headroom * capacity))
    trainings = {rc: base.training.model_copy(update={"recompute": rc}) for rc in {c.recompute for c in space.combos}}
    flat_sched = o.schedule if o.schedule not in (None, "interleaved") else "1f1b"

    tp1 = space.tp == 1
    inter = space.vpp > 1
    groups: list[tuple[int, str, np.ndarray]] = []
    for ci, combo in enumerate(space.combos):
        allowed = ~tp1 if combo.sp else np.ones(space.pairs, dtype=bool)
        for sched, sel in (("interleaved", inter), (flat_sched, ~inter)):
            idx = np.flatnonzero(allowed & sel)
            if idx.size:
                groups.append((ci, sched, idx))

    if not groups:
        hits = ", ".join(f"{k} {v:,}" for k, v in rejected.items() if v)
        raise InputError(f"no configuration within the bounds is valid for --gpus {o.gpus}: of {space.considered:,} "
                         f"considered, rejected by {hits or 'nothing'} (rules: docs/plan.md)")
    feasible: list[Columns] = []
    closest: list[Columns] = []
    evaluated = 0
    n_layouts = int(space.layout.max()) + 1 if space.pairs else 0
    for gi, (ci, sched, idx) in enumerate(groups):
        combo = space.combos[ci]
        training = trainings[combo.recompute]
        # round 1: each layout's smallest micro-batch
        r0 = idx[space.rank[idx] == 0]
        p0 = bulk_peak(_group_run(base, space, r0, combo, training, sched, o.ep), r0.size)
        alive = np.zeros(n_layouts, dtype=bool)
        alive[space.layout[r0[p0 <= budget]]] = True
        rest = idx[space.rank[idx] > 0]
        keep = alive[space.layout[rest]]
        rejected["pruned_micro_batch"] += int((~keep).sum())
        r1 = rest[keep]
        p1 = bulk_peak(_group_run(base, space, r1, combo, training, sched, o.ep), r1.size) if r1.size else \
            np.zeros(0, dtype=np.int64)
        # pairs sorted by layout then micro-batch: stop each layout at its first micro-batch over the budget
        order = np.argsort(np.concatenate([r0, r1]), kind="stable")
        ev = np.concatenate([r0, r1])[order]
        peak = np.concatenate([p0, p1])[order]
        evaluated += int(ev.size)
        over_cap = peak > capacity
        over_budget = peak > budget
        stopped = _after_first_failure(space.layout[ev], over_budget)
        rejected["out_of_memory"] += int(over_cap.sum())
        rejected["below_min_headroom"] += int((over_budget & ~over_cap).sum())
        rejected["pruned_micro_batch"] += int((stopped & ~over_budget).sum())
        ok = ~stopped
        if keep_closest and over_budget.any():
            miss = np.flatnonzero(over_budget)
            miss = miss[np.argsort(peak[miss], kind="stable")[:keep_closest]]
            nan = np.full(miss.size, np.nan)
            closest.append(Columns(ev[miss], np.full(miss.size, ci, dtype=np.int64), peak[miss], nan, nan, nan))
        if ok.any():
            fi = ev[ok]
            step, tps, mfu = times(_group_run(base, space, fi, combo, training, sched, o.ep))
            n = fi.size
            feasible.append(Columns(fi, np.full(n, ci, dtype=np.int64), peak[ok],
                                    *(np.broadcast_to(np.asarray(x, dtype=np.float64), (n,)) for x in (step, tps, mfu))))
        if progress is not None:
            progress(gi + 1, len(groups))
    close = Columns.concat(closest)
    close = close.take(np.argsort(close.peak, kind="stable")[:keep_closest])
    return SearchResult(
        request=req, options=o, base=base, space=space, feasible=Columns.concat(feasible), closest=close, rejected=rejected,
        evaluated=evaluated, wall_seconds=time.perf_counter() - t0, capacity=capacity,
        budget=budget,
    )


# --- ranking ------------------------------------------------------------------------------------------------------


_OFFLOAD_RANK = {"none": 0, "optimizer": 1, "params": 2}


# Throughputs within this share of each other rank as equal where it matters: the time model (assumed kernel
# efficiency, overlap windows) does not resolve finer, so within it a fit with room to spare and no offload ranks
# first (docs/plan.md, "Ranking").
THROUGHPUT_TIE = 0.01


def _tight(res: SearchResult) -> np.ndarray:
    """Per feasible configuration: the headroom is inside the reserved-memory model's measured error (estimate's
    `memory.tight`)."""
    share = reserved_error_share(res.options.allocator, res.options.fragmentation)
    peak = res.feasible.peak
    return (res.capacity - peak) < (peak * share).astype(np.int64)


def parallel_dims(space: Space, pair: np.ndarray) -> np.ndarray:
    """How many ways beyond data parallelism a layout splits the model: one each for tp, pp, cp > 1 and for an
    interleaved schedule (vpp > 1). Within a 1% throughput band, where the time model cannot tell the layouts apart,
    the one with fewer process groups, collectives and schedule knobs to get right ranks first."""
    return ((space.tp[pair] > 1).astype(np.int64) + (space.pp[pair] > 1) + (space.cp[pair] > 1)
            + (space.vpp[pair] > 1))


def ranked(res: SearchResult) -> np.ndarray:
    """Indices into res.feasible, best first by the objective. Throughput: configurations within THROUGHPUT_TIE
    (1%) of the fastest, then of each next 1% band, count as equal; within a band a configuration whose headroom is
    inside the reserved-memory model's error (`tight`) goes after those with room, offload (its CPU step runs
    at an assumed host rate, memcalc/cost/compute.py) after no offload, and a layout that splits the model more
    ways (`parallel_dims`) after a simpler one; then the highest tokens/s, the lowest peak. GPUs: the fewest GPUs
    among the fits with room, then the tight fits, each by fewest GPUs."""
    f, s = res.feasible, res.space
    if f.size == 0:
        return np.zeros(0, dtype=np.int64)
    gpus = s.gpus[f.pair]
    off = np.asarray([_OFFLOAD_RANK[c.offload] for c in s.combos], dtype=np.int64)[f.combo]
    tie = np.arange(f.size)
    if res.request.objective == "memory":
        keys = (tie, off, -f.tps, f.peak)
    elif res.request.objective == "gpus":
        # a tight fit is a maybe: every fit with room ranks first, the fewest GPUs among them on top
        keys = (tie, f.peak, off, -f.tps, gpus, _tight(res))
    else:
        best = float(f.tps.max())
        if best > 0:
            ratio = best / np.maximum(f.tps, best * 1e-12)
            band = np.floor(np.log(ratio) / np.log1p(THROUGHPUT_TIE)).astype(np.int64)
        else:  # no time model for this hardware: throughput cannot rank
            band = np.zeros(f.size, dtype=np.int64)
        keys = (tie, gpus, f.peak, -f.tps, parallel_dims(s, f.pair), off, _tight(res), band)
    return np.lexsort(keys)


def pareto(res: SearchResult) -> np.ndarray:
    """Indices into res.feasible on the memory-vs-throughput front (lower peak, higher tokens/s), by peak."""
    f = res.feasible
    if f.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((-f.tps, f.peak))
    tps = f.tps[order]
    best_before = np.r_[-np.inf, np.maximum.accumulate(tps)[:-1]]
    return order[tps > best_before]


# --- the plan: search + reproduction of the top K + advice -------------------------------------------------------


def layout_of(res: SearchResult, pair: int, combo: int) -> dict[str, Any]:
    s, c = res.space, res.space.combos[combo]
    tp, vpp = int(s.tp[pair]), int(s.vpp[pair])
    sched = "interleaved" if vpp > 1 else (res.options.schedule or "1f1b")
    return {
        "gpus": int(s.gpus[pair]), "dp": int(s.dp[pair]), "tp": tp, "pp": int(s.pp[pair]), "vpp": vpp,
        "cp": int(s.cp[pair]), "ep": res.options.ep, "sp": bool(c.sp and tp > 1), "zero": c.zero,
        "offload": c.offload, "recompute": c.recompute, "schedule": sched,
        "micro_batch": int(s.micro_batch[pair]), "grad_accum": int(s.grad_accum[pair]),
        "global_batch": s.global_batch,
    }


def _figures(res: SearchResult, cols: Columns, i: int) -> dict[str, Any]:
    peak = int(cols.peak[i])
    # within the reserved-memory model's measured error (estimate's `memory.tight`; fragmentation.py)
    share = reserved_error_share(res.options.allocator, res.options.fragmentation)
    return {
        "peak_bytes": peak, "headroom_bytes": res.capacity - peak, "step_seconds": float(cols.step[i]),
        "tokens_per_second": float(cols.tps[i]), "mfu": float(cols.mfu[i]),
        "tight": res.capacity - peak < int(peak * share),
    }


def _row(res: SearchResult, cols: Columns, i: int) -> dict[str, Any]:
    pair, combo = int(cols.pair[i]), int(cols.combo[i])
    return {"command": command_for(config_options(res, pair, combo)), "layout": layout_of(res, pair, combo),
            "search": _figures(res, cols, i)}


def _apply_flags(o: RunOptions, flags: str) -> RunOptions:
    """Apply an advice's flags (e.g. `--zero 2`, `--recompute selective`) to options."""
    from memcalc.cli import RUN_OPTIONS

    by_flag: dict[str, tuple[str, bool | None]] = {}  # flag -> (field, the value a switch sets; None: takes one)
    for f in RUN_OPTIONS:
        on, off = _flag_names(f)
        by_flag[on] = (f, True if off else None)
        if off:
            by_flag[off] = (f, False)
    words = shlex.split(flags)
    upd: dict[str, Any] = {}
    i = 0
    while i < len(words):
        field, switch = by_flag[words[i]]
        if switch is not None:
            upd[field], i = switch, i + 1
        else:
            value = words[i + 1]
            upd[field], i = (int(value) if value.isdigit() else value), i + 2
    return dataclasses.replace(o, **upd)


def _advice(res: SearchResult) -> list[dict[str, Any]]:
    """When nothing fits: the closest configurations with the single changes that make them fit (each re-run
    through the cost model from its command), then the smallest multiple of the GPU count on which one fits."""
    from memcalc.cost.advice import advise
    from memcalc.cost.estimate import peak_bytes

    out: list[dict[str, Any]] = []
    for i in range(res.closest.size):
        pair, combo = int(res.closest.pair[i]), int(res.closest.combo[i])
        opts = config_options(res, pair, combo)
        run = build_run(dataclasses.replace(opts))
        peak = int(res.closest.peak[i])
        budget_run = run.replace(hardware=run.hardware.model_copy(update={"memory_bytes": res.budget}))
        changes = []
        for adv in advise(budget_run, peak, limit=8):
            try:
                new = _apply_flags(opts, adv.flags)
                after = peak_bytes(build_run(dataclasses.replace(new)))
            except InputError:
                continue
            changes.append({"change": adv.change, "flags": adv.flags, "command": command_for(new),
                            "saves_bytes": peak - after, "peak_bytes_after": after, "fits_after": after <= res.budget})
        changes.sort(key=lambda c: (not c["fits_after"], -c["saves_bytes"]))
        out.append({"kind": "closest", "command": command_for(opts), "layout": layout_of(res, pair, combo),
                    "peak_bytes": peak, "budget_bytes": res.budget, "shortfall_bytes": peak - res.budget,
                    "changes": changes})
    o = res.options
    for factor in (2, 4, 8, 16):
        sub = dataclasses.replace(res.request, options=dataclasses.replace(o, gpus=o.gpus * factor))
        try:
            r2 = search(sub, progress=None, keep_closest=0)
        except InputError:
            continue
        if r2.feasible.size:
            best = int(ranked(r2)[0])
            out.append({"kind": "more_gpus", "gpus": o.gpus * factor, "feasible": r2.feasible.size,
                        **_row(r2, r2.feasible, best)})
            break
    return out


def plan(req: Request, progress: Progress | None = None, max_pareto: int = 50,
         res: SearchResult | None = None) -> dict[str, Any]:
    """The whole `plan --json` object (docs/plan.md); `res`: `search(req)`'s result where it was already run."""
    from memcalc.cost.estimate import estimate, resolved_inputs

    if res is None:
        res = search(req, progress=progress)
    order = ranked(res)
    plans = []
    for rank, i in enumerate(order[: req.top], start=1):
        row = _row(res, res.feasible, int(i))
        run = build_run(config_options(res, int(res.feasible.pair[i]), int(res.feasible.combo[i])))
        est = estimate(run)
        plans.append({"rank": rank, **row, "memory": est.memory.model_dump(mode="json"),
                      "communication": est.communication.model_dump(mode="json"),
                      "compute": est.compute.model_dump(mode="json")})
    front = pareto(res)
    if front.size > max_pareto:  # keep the ends and an even spread
        front = front[np.unique(np.linspace(0, front.size - 1, max_pareto).round().astype(int))]
    inputs = resolved_inputs(res.base)
    inputs.pop("parallel")
    for k in ("micro_batch", "grad_accum", "recompute"):
        inputs["training"].pop(k, None)
    inputs["training"]["global_batch"] = res.options.global_batch
    inputs["training"]["tokens_per_step"] = res.options.global_batch * res.base.seq
    inputs["gpus"] = res.options.gpus
    inputs["ep"] = res.options.ep
    inputs["schedule"] = res.options.schedule
    inputs["bounds"] = req.bounds.as_dict()
    inputs["objective"] = req.objective
    inputs["min_headroom"] = req.min_headroom
    inputs["top"] = req.top
    feasible = res.feasible.size
    return {
        "schema_version": PLAN_SCHEMA_VERSION,
        "kind": "plan",
        "inputs": inputs,
        "search": {
            "considered": res.considered,
            "rejected": res.rejected,
            "evaluated": res.evaluated,
            "feasible": feasible,
            "wall_seconds": res.wall_seconds,
            "capacity_bytes": res.capacity,
            "budget_bytes": res.budget,
            "rules": RULES,
        },
        "plans": plans,
        "pareto": [_row(res, res.feasible, int(i)) for i in front],
        "advice": [] if feasible else _advice(res),
    }
