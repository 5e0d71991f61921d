"""`--explain`: each formula with its numbers, read from the Estimate and the Run (no recomputation of figures
that the Estimate already holds)."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from memcalc.cost.estimate import Estimate
from memcalc.cost.fragmentation import fraction
from memcalc.specs import DTYPE_BYTES, Run
from memcalc.units import format_bytes


def _line(con: Console, text: str) -> None:
    con.print(Text("  " + text))


def render_explain(est: Estimate, run: Run, con: Console, units: str) -> None:
    mem = est.memory
    r = run.recipe
    det = mem.model_states_detail
    n = det["stage_params"]
    d = run.shard_degree
    z = run.zero
    con.print()
    con.print(Text("How the figures are computed (sources: docs/methodology.md)", style="bold"))
    con.print(Text(f"Model states, stage {mem.reported_stage}: N = {n:,} parameters on this rank after TP/PP "
                   f"sharding; ZeRO-{z} shard group dp*cp = {d}", style="bold"))
    pb, gb = DTYPE_BYTES[r.param_dtype], DTYPE_BYTES[r.grad_dtype]

    def div(on: bool) -> str:
        return f" / {d}" if on and d > 1 else ""

    _line(con, f"params         = N x {pb} B ({r.param_dtype}){div(z >= 3)} = {format_bytes(det['params'], units)}")
    if r.master_weights:
        _line(con, f"master weights = N x 4 B (fp32){div(z >= 1)} = {format_bytes(det['master_weights'], units)}")
    _line(con, f"grads          = N x {gb} B ({r.grad_dtype}){div(z >= 2)} = {format_bytes(det['grads'], units)}")
    if r.fp32_grad_copy:
        _line(con, f"fp32 grad copy = N x 4 B{div(z >= 1)} = {format_bytes(det['grads_fp32_copy'], units)}")
    _line(con, f"optimizer      = N x state bytes ({run.training.optimizer}, {r.moment_dtype} moments){div(z >= 1)}"
               f" = {format_bytes(det['optimizer_moments'], units)}")
    if run.offload != "none":
        _line(con, f"offloaded to CPU: {format_bytes(mem.cpu_offload_bytes, units)}")
    if run.training.offload_activations:
        _line(con, f"activations offloaded to host memory: {format_bytes(mem.host_activation_bytes, units)} "
                   "(every layer's saved set of every micro-batch in flight; the last two layers run stay)")
    if mem.activations_detail:
        con.print(Text("Activations (bytes per named term; see memory.activations_detail in --json)", style="bold"))
        for k, v in mem.activations_detail.items():
            _line(con, f"{k:<40} {format_bytes(v, units)}")
    if mem.buffers_detail:
        con.print(Text("Buffers and temporaries", style="bold"))
        for k, v in mem.buffers_detail.items():
            _line(con, f"{k:<40} {format_bytes(v, units)}")
    con.print(Text("Phases (allocated bytes live at each phase's highest moment)", style="bold"))
    for ph in mem.phases:
        parts = ", ".join(f"{k} {format_bytes(v, units)}" for k, v in ph.live.items() if v)
        _line(con, f"{ph.name:<10} {format_bytes(ph.allocated_bytes, units)} = {parts}")
    frag = mem.components.get("fragmentation", 0)
    rt = mem.components.get("runtime", 0)
    rd = dict(mem.reserved_detail)
    own, stranded = rd.pop("compute_stream_allocated"), rd.pop("loss_stranded_logits")
    slack, first = rd.pop("allocator_slack"), rd.pop("first_step_optimizer_temporaries", 0)
    f = fraction(run)
    parts = [f"compute-stream peak {format_bytes(own, units)}"]
    if stranded:
        parts.append(f"the logits' block stranded at the loss gradient {format_bytes(stranded, units)}")
    parts.append(f"allocator slack f/(1-f) = {f:g}/{1 - f:g} x those = {format_bytes(slack, units)}")
    if first:
        parts.append(f"the first optimizer step's foreach sqrt(v) list left in its own segments "
                     f"{format_bytes(first, units)}")
    parts += [f"{k.replace('_', ' ')} pool {format_bytes(v, units)}" for k, v in rd.items()]
    _line(con, "reserved = " + " + ".join(parts) + f" = {format_bytes(mem.reserved_peak_bytes, units)}; "
               f"fragmentation = reserved - allocated = {format_bytes(frag, units)} (every micro-batch --seq tokens; "
               "batches of varying length strand more: memcalc validate --seq-lengths)")
    _line(con, f"peak = allocated {format_bytes(mem.allocated_peak_bytes, units)} + fragmentation "
               f"{format_bytes(frag, units)} + runtime {format_bytes(rt, units)} = {format_bytes(mem.peak_bytes, units)}")
    if est.communication.modelled and est.communication.collectives:
        con.print(Text("Collectives (ring volumes: all-reduce 2(n-1)/n*S, reduce-scatter/all-gather (n-1)/n*S)",
                       style="bold"))
        for c in est.communication.collectives:
            _line(con, f"{c.op} over {c.group}={c.group_size}: S = {c.bytes_per_call:,} B x {c.calls_per_step} "
                       f"calls -> {c.bytes_per_step:,} B sent per GPU, {c.seconds_per_step * 1e3:,.2f} ms"
                       + (f" ({c.note})" if c.note else ""))
    for note in est.compute.notes:
        _line(con, note)
