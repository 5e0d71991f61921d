"""Assemble an `Estimate`: the one object the table, the JSON, the planner's reproduction check and the validator
read, so that they cannot disagree. The JSON schema is documented in docs/json.md; bump SCHEMA_VERSION on any
change to field names or meanings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict

from memcalc import __version__
from memcalc.cost.fragmentation import first_step_stranded_bytes, fragmentation_bytes, reserved_error_bytes, slack_bytes
from memcalc.cost.params import stage_layers, total_params, zero1_worst_dp_index
from memcalc.cost.timeline import CATEGORIES, StageMemory, stage_memory
from memcalc.specs import Run

SCHEMA_VERSION = "1.29"


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)


class PhaseOut(_Out):
    name: str
    allocated_bytes: int
    live: dict[str, int]
    note: str = ""


class StageOut(_Out):
    stage: int
    first_rank: int
    layers: int
    params: int
    components: dict[str, int]
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    peak_bytes: int
    peak_phase: str
    phases: list[PhaseOut]
    reserved_detail: dict[str, int]


class Advice(_Out):
    change: str
    flags: str
    saves_bytes: int
    peak_bytes_after: int
    fits_after: bool
    # the time model's tokens/s per GPU with the change (compute.py; 0.0 where the GPU's peak FLOP/s is unknown):
    # what the change costs in throughput, next to `compute.tokens_per_second / gpus` without it
    tokens_per_second_per_gpu_after: float = 0.0


class Memory(_Out):
    units: str = "bytes"
    components: dict[str, int]
    not_modelled: list[str]
    model_states_detail: dict[str, int]
    activations_detail: dict[str, int]
    buffers_detail: dict[str, int]
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    reserved_detail: dict[str, int]
    peak_bytes: int
    peak_phase: str
    worst_stage: int
    worst_rank: int
    reported_stage: int
    capacity_bytes: int
    headroom_bytes: int
    fits: bool
    cpu_offload_bytes: int
    host_activation_bytes: int
    phases: list[PhaseOut]
    stages: list[StageOut]
    advice: list[Advice]
    # the largest under-estimate of reserved memory measured on the GPU records for this allocator, scaled to the
    # worst rank's peak (fragmentation.reserved_error_bytes); `tight`: it fits with less headroom than that
    reserved_error_bytes: int = 0
    tight: bool = False
    # where it does not fit and no single change fits as cheaply: the cheapest changes stacked until it does, on
    # the same GPUs (advice.combine); None otherwise
    advice_combined: Advice | None = None


class CollectiveOut(_Out):
    op: str
    group: str
    group_size: int
    dtype: str
    bytes_per_call: int
    calls_per_micro_batch: float
    calls_per_step: int
    bytes_per_step: int
    seconds_per_step: float
    link: str
    overlapped: bool
    note: str = ""
    window: str = "none"  # the compute an overlapped collective hides behind (fwd, bwd, bwd_last, ...)


class Communication(_Out):
    modelled: bool
    collectives: list[CollectiveOut]
    bytes_per_step: int
    seconds_per_step: float
    exposed_seconds_per_step: float
    stage: int = 0  # the pipeline stage of the worst rank the collectives describe
    notes: list[str] = []


class Compute(_Out):
    modelled: bool
    flops_per_step: float
    flops_per_token: float
    tokens_per_step: int
    compute_seconds: float
    bubble_seconds: float
    exposed_comm_seconds: float
    step_seconds: float  # compute + bubble + exposed communication + the offloaded optimizer step
    tokens_per_second: float
    mfu: float
    assumed_mfu: float
    model_flops_per_step: float = 0.0  # without recompute: the numerator of `mfu`
    peak_flops_per_gpu: float = 0.0
    cpu_optimizer_seconds: float = 0.0  # the offloaded optimizer step on the host CPUs (compute.py), exposed
    # an eager attention core's memory-bound passes over its s x s scores, part of compute_seconds (compute.py)
    eager_attention_seconds: float = 0.0
    notes: list[str] = []


class Estimate(_Out):
    schema_version: str
    memcalc_version: str
    inputs: dict[str, Any]
    batch: dict[str, Any]
    memory: Memory
    communication: Communication
    compute: Compute


def rank_stride(run: Run, dim: str) -> int:
    """Rank distance between neighbouring indices of `dim` under the placement order (innermost first)."""
    sizes = {"tp": run.tp, "cp": run.cp, "pp": run.pp, "dp": run.dp}
    stride = 1
    for d in run.order:
        if d == dim:
            return stride
        stride *= sizes[d]
    return stride


def rank_of_stage(run: Run, stage: int) -> int:
    """Global rank of tp=cp=dp=0 on pipeline stage `stage`."""
    return stage * rank_stride(run, "pp")


def resolved_inputs(run: Run) -> dict[str, Any]:
    m = run.model
    return {
        "profile": run.profile,
        "model": {**m.model_dump(), "total_params": total_params(m), "assumed_shape": run.assumed_shape},
        "training": {
            **run.training.model_dump(),
            "micro_batch": run.micro_batch,
            "grad_accum": run.grad_accum,
            "global_batch": run.global_batch,
            "dropout": run.dropout,
            "tokens_per_step": run.global_batch * run.seq,
        },
        "parallel": {
            "gpus": run.gpus,
            "dp": run.dp,
            "tp": run.tp,
            "pp": run.pp,
            "vpp": run.vpp,
            "cp": run.cp,
            "ep": run.ep,
            "sp": run.sp,
            "zero": run.zero,
            "offload": run.offload,
            "schedule": run.schedule,
            "order": ",".join(run.order),
            "tp_overlap": run.tp_overlap,
            "dp_mode": run.dp_mode,
            "cp_comm": run.cp_comm,
            "shard_degree": run.shard_degree,
        },
        "hardware": run.hardware.model_dump(),
        "recipe": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(run.recipe).items()},
    }


def _phase_out(ph: Any) -> PhaseOut:
    live = {k: int(v) for k, v in ph.live.items()}
    return PhaseOut(name=ph.name, allocated_bytes=sum(live.values()), live=live, note=ph.note)


def _peak_phase(sm: StageMemory) -> Any:
    best = sm.phases[0]
    for ph in sm.phases[1:]:
        if ph.total > best.total:
            best = ph
    return best


def _totals(run: Run, sm: StageMemory) -> tuple[int, int, int, Any]:
    """(allocated peak, fragmentation, peak incl. fragmentation and runtime, peak phase)."""
    peak_ph = _peak_phase(sm)
    allocated = int(peak_ph.total)
    frag = int(fragmentation_bytes(run, sm))
    total = allocated + frag + int(runtime_bytes(run))
    return allocated, frag, total, peak_ph


def runtime_bytes(run: Run) -> Any:
    """Memory outside the caching allocator: the GPU preset's CUDA context + first NCCL communicator, plus one
    communicator per further process group the layout creates (memcalc/cost/buffers.py), unless the figure was
    given as the whole (`--runtime-overhead`). Array-polymorphic."""
    from memcalc.cost.buffers import extra_communicator_bytes

    if run.hardware.runtime_overhead_is_total:
        return run.hardware.runtime_overhead_bytes
    return run.hardware.runtime_overhead_bytes + extra_communicator_bytes(run)


def stage_report(run: Run, stage: int) -> tuple[StageMemory, StageOut]:
    sm = stage_memory(run, stage)
    allocated, frag, total, peak_ph = _totals(run, sm)
    comps = {k: int(peak_ph.live.get(k, 0)) for k in CATEGORIES}
    comps["fragmentation"] = frag
    comps["runtime"] = int(runtime_bytes(run))
    own = int(sm.compute_stream_peak)
    stranded = int(sm.loss_stranded_bytes)
    reserved_detail = {"compute_stream_allocated": own - stranded, "loss_stranded_logits": stranded,
                       "allocator_slack": int(slack_bytes(run, own)),
                       "first_step_optimizer_temporaries": int(first_step_stranded_bytes(run, sm))}
    reserved_detail.update({k: int(v) for k, v in sm.side_stream_pools.items()})
    out = StageOut(
        stage=stage,
        first_rank=rank_of_stage(run, stage),
        layers=int(stage_layers(run, stage)),
        params=int(sm.states.stage_params),
        components=comps,
        allocated_peak_bytes=allocated,
        reserved_peak_bytes=allocated + frag,
        peak_bytes=total,
        peak_phase=peak_ph.name,
        phases=[_phase_out(ph) for ph in sm.phases],
        reserved_detail=reserved_detail,
    )
    return sm, out


def peak_bytes(run: Run) -> int:
    """The worst stage's peak (allocated + fragmentation + runtime): what `fits` compares with capacity."""
    return max(stage_report(run, s)[1].peak_bytes for s in _stages_to_check(run))


def _stages_to_check(run: Run) -> list[int]:
    return list(range(run.pp))


def estimate(run: Run, stage: int | None = None, advice: bool = True) -> Estimate:
    """The full estimate. `stage` picks the stage the headline figures describe (default: the worst)."""
    from memcalc.cost import advice as advice_mod
    from memcalc.cost import comm, compute

    reports = [stage_report(run, s) for s in _stages_to_check(run)]
    worst_i = max(range(len(reports)), key=lambda i: (reports[i][1].peak_bytes, -i))
    if stage is None:
        chosen = worst_i
    else:
        if not 0 <= stage < run.pp:
            from memcalc.errors import InputError

            raise InputError(f"--stage {stage} is not a pipeline stage; valid: first, last, 0..{run.pp - 1}")
        chosen = stage
    sm, so = reports[chosen]
    worst = reports[worst_i][1]
    st = sm.states
    capacity = run.hardware.memory_bytes
    headline_peak = so.peak_bytes
    fits = worst.peak_bytes <= capacity
    error_bytes = reserved_error_bytes(run, worst.peak_bytes)
    singles = advice_mod.advise(run, worst.peak_bytes) if advice else []
    memory = Memory(
        components=so.components,
        not_modelled=list(sm.not_modelled),
        model_states_detail={
            "params": int(st.params),
            "master_weights": int(st.master_weights),
            "grads": int(st.grads),
            "grads_fp32_copy": int(st.grads_fp32),
            "optimizer_moments": int(st.optimizer),
            "stage_params": int(st.stage_params),
            "trainable_params": int(st.trainable_params),
            "frozen_params_bytes": int(st.frozen_params_bytes),
            "ps_server_bytes": int(st.ps_server),
            "trainable_expert_params": int(st.expert_params),
            "param_elems": int(st.param_elems),
            "grad_elems": int(st.grad_elems),
            "embedding_grad_extra_elems": int(st.embedding_grad_extra),
            "stepped_params": int(st.stepped_params),
            "weight_versions": int(st.weight_versions),
        },
        activations_detail={k: int(v) for k, v in sm.activations_detail.items()},
        buffers_detail={k: int(v) for k, v in sm.buffers_detail.items()},
        allocated_peak_bytes=so.allocated_peak_bytes,
        reserved_peak_bytes=so.reserved_peak_bytes,
        reserved_detail=so.reserved_detail,
        peak_bytes=headline_peak,
        peak_phase=so.peak_phase,
        worst_stage=worst.stage,
        worst_rank=worst.first_rank + zero1_worst_dp_index(run, worst.stage) * rank_stride(run, "dp"),
        reported_stage=so.stage,
        capacity_bytes=capacity,
        headroom_bytes=capacity - worst.peak_bytes,
        fits=fits,
        cpu_offload_bytes=int(st.cpu),
        host_activation_bytes=int(sm.host_activation_bytes),
        phases=so.phases,
        stages=[r[1] for r in reports],
        advice=singles,
        reserved_error_bytes=error_bytes,
        tight=fits and capacity - worst.peak_bytes < error_bytes,
        advice_combined=advice_mod.advise_combined(run, worst.peak_bytes, singles) if advice else None,
    )
    colls = comm.collectives(run)
    comm_out = comm.communication_out(run, colls)
    comp_out = compute.compute_out(run, colls)
    from memcalc.cost.batch import batch_guidance

    return Estimate(
        schema_version=SCHEMA_VERSION,
        memcalc_version=__version__,
        inputs=resolved_inputs(run),
        batch=batch_guidance(run),
        memory=memory,
        communication=comm_out,
        compute=comp_out,
    )
