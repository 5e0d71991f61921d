"""`--explain`: each formula with its numbers, read from the Estimate and the Run (no recomputation of figures
that the Estimate already holds)."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from memcalc.cost.estimate import Estimate
from memcalc.cost.fragmentation import fraction
from memcalc.cost.params import zero1_partition_applies
from memcalc.cost.states import ADAM8BIT_BLOCK, optimizer_state_bytes
from memcalc.specs import DTYPE_BYTES, Run
from memcalc.xp import cdiv
from memcalc.units import format_bytes


def _line(con: Console, text: str) -> None:
    con.print(Text("  " + text))


def render_explain(est: Estimate, run: Run, con: Console, units: str) -> None:
    mem = est.memory
    con.print()
    con.print(Text("How the figures are computed (sources: docs/methodology.md)", style="bold"))
    head, lines = _model_state_lines(est, run, units)
    con.print(Text(head, style="bold"))
    for text in lines:
        _line(con, text)
    if run.offload != "none":
        _line(con, f"offloaded to CPU: {format_bytes(mem.cpu_offload_bytes, units)}")
    if run.training.offload_activations:
        _line(con, f"activations offloaded to host memory: {format_bytes(mem.host_activation_bytes, units)} "
                   "(every layer's saved set of every micro-batch in flight; the last two layers run stay)")
    if mem.activations_detail:
        det = mem.activations_detail
        held = {k: v for k, v in det.items() if v and not k.endswith("_transient")}
        moments = {k: v for k, v in det.items() if v and k.endswith("_transient")}
        con.print(Text("Activations held for backward on this stage (memory.activations_detail in --json); "
                       "'x N': one layer's bytes for one micro-batch times the N (layer, micro-batch) pairs held",
                       style="bold"))
        per_layer = _per_layer_terms(run)
        for k, v in held.items():
            one = per_layer.get(k, 0)
            times = f"  = {one:,} B per layer x {v // one}" if one and v % one == 0 and v // one > 1 else ""
            _line(con, f"{k:<40} {format_bytes(v, units)}{times}")
        _line(con, f"{'sum':<40} {format_bytes(sum(held.values()), units)}")
        if moments:
            con.print(Text("Transients: each live only at its own moment, not summed (the phases below add the one "
                           "live at each)", style="bold"))
            for k, v in moments.items():
                _line(con, f"{k:<40} {format_bytes(v, units)}")
        zero = [k for k, v in det.items() if not v]
        if zero:
            _line(con, "0 in this configuration: " + ", ".join(zero))
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
    if mem.reserved_error_bytes:
        share = mem.reserved_error_bytes / max(1, mem.peak_bytes)
        verdict = "tight" if mem.tight else ("room to spare" if mem.fits else "does not fit")
        _line(con, f"reserved-memory error = {share:.1%} x worst peak (the most max_memory_reserved exceeded "
                   "memcalc's reserved figure on the GPU records, this allocator) = "
                   f"{format_bytes(mem.reserved_error_bytes, units)}; headroom "
                   f"{format_bytes(mem.headroom_bytes, units)}: {verdict}")
    if est.communication.modelled and est.communication.collectives:
        con.print(Text("Collectives (ring volumes: all-reduce 2(n-1)/n*S, reduce-scatter/all-gather (n-1)/n*S)",
                       style="bold"))
        for c in est.communication.collectives:
            _line(con, f"{c.op} over {c.group}={c.group_size}: S = {c.bytes_per_call:,} B x {c.calls_per_step} "
                       f"calls -> {c.bytes_per_step:,} B sent per GPU, {c.seconds_per_step * 1e3:,.2f} ms"
                       + (f" ({c.note})" if c.note else ""))
    for note in est.compute.notes:
        _line(con, note)


def _per_layer_terms(run: Run) -> dict[str, int]:
    """One layer's saved bytes per term for one micro-batch (`activations.layer_terms`), the checkpointed input
    from the full-recompute set: what the stage's totals are multiples of."""
    from memcalc.cost.activations import layer_terms

    out = {k: int(v) for k, v in layer_terms(run, "none").items()}
    out["checkpoint_input"] = int(layer_terms(run, "full").get("checkpoint_input", 0))
    return {k: v for k, v in out.items() if v > 0}


def _shard_rule(run: Run, det: dict[str, int], elems: int, sharded: bool) -> str:
    """How a rank's element count follows from the trainable count T: the ZeRO rule that produced it. Experts
    shard over their own data-parallel group (dp*cp/ep); FSDP2 pads each tensor's dim 0 and torch's ZeRO-1 hands out
    whole tensors, so their counts sit a little above T / d (memcalc/cost/states.py `model_states`)."""
    d = run.shard_degree
    if not sharded or d == 1:
        return "T"
    t_all, t_exp = det["trainable_params"], det["trainable_expert_params"]
    de = d // run.ep
    rule = f"T / {d}"
    if t_exp and de != d:
        rule = f"dense {t_all - t_exp:,} / {d} + experts {t_exp:,} / {de} (their group dp*cp/ep)"
    if elems != cdiv(t_all - t_exp, d) + cdiv(t_exp, de):
        rule += (", whole tensors per rank, this rank's share" if zero1_partition_applies(run)
                 else f", each tensor's dim 0 padded to a multiple of {d}")
    return rule


def _elsewhere(run: Run, held: int, formula: int) -> str:
    """Where a state the formula counts went when this GPU does not hold it."""
    if held == formula:
        return ""
    if held == 0 and run.dp_mode == "ps":
        return " (on the parameter server, not this GPU)"
    if held == 0 and run.offload != "none":
        return f" (in host memory: --offload {run.offload})"
    return ""


def _optimizer_state_words(run: Run) -> str:
    """The optimizer state per stepped element, in words (the bytes: states.optimizer_state_bytes)."""
    opt = run.training.optimizer
    md = run.recipe.moment_dtype
    mb = DTYPE_BYTES[md]
    if opt in ("adam", "adamw"):
        return f"2 moments x {mb} B ({md})"
    if opt in ("lion", "sgd-momentum"):
        return f"1 momentum x {mb} B ({md})"
    if opt == "sgd":
        return "no state"
    if opt == "adam-8bit":
        return f"2 x 1 B + 2 fp32 absmax per {ADAM8BIT_BLOCK} elements"
    return f"row and column statistics per matrix, the whole second moment of vectors, {mb} B ({md})"


def _model_state_lines(est: Estimate, run: Run, units: str) -> tuple[str, list[str]]:
    """The model states' heading, and their lines as element counts times bytes, each product equal to the figure
    it explains."""
    det = est.memory.model_states_detail
    r, t = run.recipe, run.training
    z, d = run.zero, run.shard_degree
    fb = lambda b: format_bytes(b, units)  # noqa: E731
    n, trainable = det["stage_params"], det["trainable_params"]
    head = (f"Model states, stage {est.memory.reported_stage}: N = {n:,} parameters on this rank after TP/PP"
            f"{'/EP' if run.ep > 1 else ''} sharding")
    if trainable != n:
        head += f", of which T = {trainable:,} train"
    else:
        head += " (T = N: all train)"
    head += f"; ZeRO-{z} shard group dp*cp = {d}"
    lines: list[str] = []
    pb, gb = DTYPE_BYTES[r.param_dtype], DTYPE_BYTES[r.grad_dtype]
    pe, frozen = det["param_elems"], det["frozen_params_bytes"]
    versions = det["weight_versions"]
    formula = pb * pe * versions + frozen
    text = f"params         = {pe:,} ({_shard_rule(run, det, pe, pe != trainable)}) x {pb} B ({r.param_dtype})"
    if versions > 1:
        text += f" x {versions} weight versions (PipeDream stash)"
    if frozen:
        base = t.base_dtype or (r.compute_dtype if t.lora_rank is not None else r.param_dtype)
        text += f" + frozen base {fb(frozen)} ({base}{', LM head too' if t.quantize_head else ''})"
    lines.append(text + f" = {fb(formula)}{_elsewhere(run, det['params'], formula)}")
    stepped = det["stepped_params"]
    rule = _shard_rule(run, det, stepped, z >= 1)
    if r.master_weights:
        lines.append(f"master weights = {stepped:,} ({rule}) x 4 B (fp32) = {fb(4 * stepped)}"
                     + _elsewhere(run, det["master_weights"], 4 * stepped))
    ge, extra = det["grad_elems"], det["embedding_grad_extra_elems"]
    own = ge - extra
    text = f"grads          = {own:,} ({_shard_rule(run, det, own, z >= 2)}) x {gb} B ({r.grad_dtype})"
    if extra:
        text += f" + the word embedding's gradient beyond its vocab shard, replicated over tp: {extra:,} x {gb} B"
    if run.profile == "deepspeed" and z >= 3 and r.fp32_grad_copy:
        text = "grads          = 0 (ZeRO-3 reduces each gradient straight into the fp32 partition)"
    lines.append(text + f" = {fb(gb * ge)}{_elsewhere(run, det['grads'], gb * ge)}")
    if r.fp32_grad_copy:
        lines.append(f"fp32 grad copy = {stepped:,} ({rule}) x 4 B = {fb(4 * stepped)}"
                     + _elsewhere(run, det["grads_fp32_copy"], 4 * stepped))
    held = det["optimizer_moments"]
    formula = int(optimizer_state_bytes(run, stepped, est.memory.reported_stage))
    text = (f"optimizer      = {stepped:,} stepped ({rule}) x {_optimizer_state_words(run)} ({t.optimizer}) = "
            f"{fb(formula)}")
    if held > formula:  # torch SGD clones the replicated embedding gradient into its momentum
        text += f" + {fb(held - formula)} of momentum cloned from the replicated embedding gradient"
        formula = held
    lines.append(text + _elsewhere(run, held, formula))
    return head, lines
