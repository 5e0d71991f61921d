"""The human view of an Estimate: a rich table of components with bars, the timeline, communication, compute,
and a plain verdict with what would help. Reads only the Estimate (and the Run for labels)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from memcalc.cost.estimate import Advice, Estimate
from memcalc.report.formats import recompute_text, tight_note
from memcalc.specs import Run
from memcalc.units import UNIT_BYTES, format_bytes, format_count

LABELS = {
    "params": "parameters",
    "master_weights": "master weights",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "buffers": "buffers & temps",
    "fragmentation": "fragmentation",
    "runtime": "runtime (CUDA, NCCL)",
}

BAR_WIDTH = 20


def _bar(value: int, total: int) -> str:
    if total <= 0:
        return ""
    n = value / total * BAR_WIDTH
    full = int(n)
    return "█" * full + ("▌" if n - full >= 0.5 else "")


def _num(b: int, units: str) -> str:
    return f"{b / UNIT_BYTES[units]:,.2f}"


def _component_notes(est: Estimate, run: Run, units: str) -> dict[str, str]:
    r = run.recipe
    d = est.inputs["parallel"]["shard_degree"]
    z = run.zero
    de = d // run.ep  # experts shard over their own data-parallel group, dp*cp/ep

    def sh(on: bool) -> str:
        dense = f"sharded 1/{d}" if on and d > 1 else "replicated"
        if run.model.moe is None or de == d or not on:
            return dense
        return dense + (f", experts 1/{de}" if de > 1 else ", experts replicated (dp*cp/ep = 1)")

    notes = {
        "params": f"{r.param_dtype}, {sh(z >= 3)}" + (", also the master copy" if r.compute_copy else ""),
        "master_weights": f"fp32, {sh(z >= 1)}" if r.master_weights else "none kept separately",
        "grads": f"{r.grad_dtype}, {sh(z >= 2)}" + (" + fp32 copy" if r.fp32_grad_copy else ""),
        "optimizer": f"{run.training.optimizer} ({r.moment_dtype}), {sh(z >= 1)}",
    }
    t = run.training
    det = est.memory.model_states_detail
    if t.lora_rank is not None or t.freeze:
        lora = t.lora_rank is not None
        what = f"LoRA r={t.lora_rank} on {t.lora_targets}" if lora else "frozen " + ",".join(t.freeze)
        base = t.base_dtype or (r.compute_dtype if lora else r.param_dtype)
        base = f"{base}, LM head too" if t.quantize_head else base
        notes["params"] = (f"{what}: {det['trainable_params']:,} trainable; frozen base in {base} "
                           f"({det['frozen_params_bytes'] / UNIT_BYTES['GiB']:.2f} GiB)")
        notes["grads"] = f"{r.grad_dtype}, trainable params only"
        notes["optimizer"] = f"{t.optimizer} ({r.moment_dtype}), trainable params only"
    if run.dp_mode == "ps":
        notes["optimizer"] = (f"on the parameter server ({det['ps_server_bytes'] / UNIT_BYTES['GiB']:.2f} GiB "
                              "there), not on the workers")
    if run.offload != "none":
        notes["optimizer"] += f", offloaded to CPU ({run.offload})"
    if t.offload_activations:
        host = est.memory.host_activation_bytes / UNIT_BYTES["GiB"]
        notes["activations"] = f"layers' saved tensors offloaded: {host:.2f} GiB in host memory, 2 layers resident"
    notes["fragmentation"] = "caching allocator: reserved - allocated"
    first = est.memory.reserved_detail.get("first_step_optimizer_temporaries", 0)
    if first:
        notes["fragmentation"] += (f", incl. {first / UNIT_BYTES['GiB']:.2f} GiB left by the first optimizer step's "
                                   "foreach temporaries (not with --allocator expandable or a fused AdamW)")
    pools = sum(v for k, v in est.memory.reserved_detail.items() if k.endswith("_stream"))
    if pools:
        # the pools are reserved, and at the peak partly allocated (their blocks in use): not all of them is here
        notes["fragmentation"] += (f"; reserved holds {pools / UNIT_BYTES['GiB']:.2f} GiB of FSDP2's all-gather and "
                                   "reduce-scatter stream pools, partly in use at the peak")
    notes["runtime"] = "outside the allocator"
    # a state not (all) live at the peak: gradients before backward makes them (the loss gradient), or torch.optim's
    # moments before its first step (--peak-step first); the table's figures are what is live at the peak
    held = {"grads": det["grads"] + det["grads_fp32_copy"], "optimizer": det["optimizer_moments"]}
    for key, full in held.items():
        at_peak = est.memory.components.get(key, 0)
        if full > at_peak:
            notes[key] += (f"; {_num(full, units)} {units} once all made, {_num(at_peak, units)} live at the peak "
                           f"({est.memory.peak_phase})")
    return notes


def render_estimate(est: Estimate, run: Run, units: str = "GiB", explain: bool = False,
                    console: Console | None = None) -> None:
    con = console or Console(highlight=False)
    mem = est.memory
    inp = est.inputs
    model = inp["model"]
    par = inp["parallel"]
    tr = inp["training"]
    hw = inp["hardware"]

    block = {"parallel": " · parallel blocks", "parallel-shared-norm": " · parallel blocks (one norm)"}
    title = (f"{model['display_name']} · {format_count(model['total_params'])} params"
             f"{block.get(model.get('block', 'sequential'), '')} · "
             f"{par['gpus']} x {hw['display_name'] or hw['name']} · profile {inp['profile']}")
    con.print(Text(title, style="bold"))
    layout = (f"dp {par['dp']} · tp {par['tp']}{' +SP' if par['sp'] else ''} · pp {par['pp']}"
              + (f" (vpp {par['vpp']})" if par['vpp'] > 1 else "")
              + f" · cp {par['cp']}" + (f" ({par['cp_comm']})" if par['cp'] > 1 else "")
              + (f" · ep {par['ep']}" if par['ep'] > 1 else "")
              + f" · ZeRO-{par['zero']}" + (f" · offload {par['offload']}" if par['offload'] != "none" else ""))
    batch = (f"seq {tr['seq']} · micro-batch {tr['micro_batch']} · grad-accum {tr['grad_accum']} · "
             f"global batch {tr['global_batch']} ({tr['tokens_per_step']:,} tokens/step) · {tr['precision']} · "
             f"{tr['optimizer']} ({inp['recipe']['optimizer_impl']}) · recompute {recompute_text(tr)} · "
             f"attention {tr['attention']}" + (" · GQA K/V expanded" if tr.get("gqa_impl") == "expand" else ""))
    con.print(layout)
    con.print(batch)
    if model.get("assumed_shape"):
        con.print(Text(f"--params {format_count(model['total_params'])}: model states use exactly "
                       f"{model['total_params']:,} parameters; activations and compute assume the "
                       f"{model['assumed_shape']} shape (h {model['hidden']}, {model['layers']} layers, "
                       f"{model['heads']} heads). Use --model for another shape.", style="yellow"))
    for note in model.get("notes") or ():
        con.print(Text(f"· {model['display_name'] or model['name']}: {note}", style="yellow"))
    for note in inp["recipe"]["notes"]:
        con.print(Text(f"· {note}", style="dim"))

    stage_txt = (f"stage {mem.reported_stage} of {par['pp']}" if par["pp"] > 1 else "")
    table = Table(title=None, show_footer=False, pad_edge=False, box=None, header_style="bold")
    table.add_column("component")
    table.add_column(units, justify="right")
    table.add_column("", no_wrap=True)
    table.add_column("note", style="dim")
    total = mem.peak_bytes
    notes = _component_notes(est, run, units)
    for key, label in LABELS.items():
        b = mem.components.get(key, 0)
        if key in mem.not_modelled:
            table.add_row(label, Text("n/a", style="yellow"), "", Text("not modelled yet", style="yellow"))
            continue
        table.add_row(label, _num(b, units), Text(_bar(b, total), style="cyan"), notes.get(key, ""))
    table.add_section()
    table.add_row(Text("allocated peak", style="bold"), _num(mem.allocated_peak_bytes, units), "",
                  f"at {mem.peak_phase} (max_memory_allocated)")
    table.add_row(Text("peak per GPU", style="bold"), Text(_num(total, units), style="bold"), "",
                  f"worst rank {mem.worst_rank}" + (f" ({stage_txt})" if stage_txt else ""))
    table.add_row("capacity", _num(mem.capacity_bytes, units), "", hw["display_name"] or hw["name"])
    con.print(table)

    if len(mem.phases) > 1 and "activations" not in mem.not_modelled:
        tl = "timeline: " + "  →  ".join(f"{p.name} {_num(p.allocated_bytes, units)}" for p in mem.phases)
        con.print(Text(tl + f" {units} allocated", style="dim"))
    if par["pp"] > 1:
        st = "  ".join(f"s{s.stage} {_num(s.peak_bytes, units)}" for s in mem.stages)
        con.print(Text(f"per stage peak ({units}): {st}", style="dim"))

    b = est.batch
    con.print(Text(f"batch: {b['formula']} = {b['global_batch']} sequences, {b['tokens_per_step']:,} tokens/step",
                   style="dim"))
    if b["lr_linear"] is not None:
        rule = b["recommended_rule"]
        con.print(Text(f"learning rate from base {b['base_lr']:g} at batch {b['base_batch']}: linear rule "
                       f"{b['lr_linear']:.3g}, square-root rule {b['lr_sqrt']:.3g} (use {rule} for "
                       f"{run.training.optimizer})" + (f"; warm-up {b['warmup_steps']} steps"
                                                        if b["warmup_steps"] is not None else ""), style="dim"))
    _render_comm_compute(est, con, units)
    _render_verdict(est, con, units)
    if explain:
        from memcalc.report.explain import render_explain

        render_explain(est, run, con, units)


_PHASE_OF_WINDOW = {"fwd": "fwd", "bwd": "bwd", "fwd_first": "1st fwd", "bwd_last": "last bwd", "fwd_host": "fwd",
                    "bwd_host": "bwd", "bwd_last_host": "last bwd"}
_LINK = {"intra-node": "intra", "inter-node": "inter", "host": "pcie"}


def _purpose(note: str, window: str) -> str:
    """A short 'what and when' for the communication table (the full note is in --explain and JSON): the note's
    subject before its colon, parentheticals dropped, and the phase (the overlap window, else what the note says)."""
    import re

    subject, _, rest = note.partition(":") if ":" in note else ("", "", note)
    subject = re.sub(r"\s*\([^)]*\)", "", subject).strip()
    phase = _PHASE_OF_WINDOW.get(window, "")
    if not phase:
        words = set(re.findall(r"[a-z]+", rest.lower()))
        fwd, bwd = bool(words & {"fwd", "forward"}), bool(words & {"bwd", "backward"})
        phase = "fwd+bwd" if fwd and bwd else "fwd" if fwd else ("after bwd" if "after" in words else "bwd") if bwd \
            else ""
    return f"{subject} {phase}".strip()


def _render_comm_compute(est: Estimate, con: Console, units: str) -> None:
    comm, comp = est.communication, est.compute
    if comm.modelled and comm.collectives:
        t = Table(box=None, header_style="bold", pad_edge=False, title=None)
        # collectives that differ only in the size of one call (DDP's buckets, per-tensor broadcasts) share a
        # line, with the range of sizes; JSON and --explain keep them apart
        merged: dict[tuple[str, ...], list] = {}
        for c in comm.collectives:
            link = _LINK.get(c.link, c.link) + ("*" if c.overlapped else "")
            group = c.group if c.group == "host" else f"{c.group}×{c.group_size}"
            key = (c.op, group, link, _purpose(c.note, c.window))
            acc = merged.setdefault(key, [c.bytes_per_call, c.bytes_per_call, 0, 0, 0.0])
            acc[0], acc[1] = min(acc[0], c.bytes_per_call), max(acc[1], c.bytes_per_call)
            acc[2] += c.calls_per_step
            acc[3] += c.bytes_per_step
            acc[4] += c.seconds_per_step
        rows = []
        for (op, group, link, purpose), (lo, hi, calls, sent, sec) in merged.items():
            per_call = _num(hi, units) if lo == hi else f"{_num(lo, units)}–{_num(hi, units)}"
            rows.append([op, group, per_call, f"{calls:,}", _num(sent, units), f"{sec * 1e3:,.1f}", link, purpose])
        cols = (("collective", "left"), ("group", "left"), (f"{units}/call", "right"), ("calls", "right"),
                (f"sent {units}", "right"), ("ms", "right"), ("link", "left"), ("for", "left"))
        # the last column takes what the terminal leaves (at least 8 characters), the others never shrink
        fixed = sum(max(len(h), *(len(r[i]) for r in rows)) + 2 for i, (h, _) in enumerate(cols[:-1]))
        room = max(8, min(24, con.width - fixed))
        for col, just in cols:
            t.add_column(col, justify=just, no_wrap=True)
        for r in rows:
            r[-1] = r[-1] if len(r[-1]) <= room else r[-1][:room - 1] + "…"
            t.add_row(*r)
        con.print()
        con.print(t)
        con.print(Text("per step, worst rank: calls, bytes this GPU sends (ring factors) and time; link intra- or "
                       "inter-node (pcie: GPU <-> host copies), * overlapped with compute", style="dim"))
        con.print(Text(f"communication: {format_bytes(comm.bytes_per_step, units)} sent per GPU per step, "
                       f"{comm.seconds_per_step * 1e3:,.1f} ms on the wire, "
                       f"{comm.exposed_seconds_per_step * 1e3:,.1f} ms exposed", style="dim"))
    elif not comm.modelled:
        con.print(Text("communication: not modelled yet", style="yellow"))
    if comp.modelled:
        con.print(Text(f"compute: {comp.flops_per_step:.3g} FLOP/step · step {comp.step_seconds:,.2f} s "
                       f"(compute {comp.compute_seconds:,.2f} s"
                       + (f" incl. eager attention {comp.eager_attention_seconds:,.2f} s"
                          if comp.eager_attention_seconds else "")
                       + f", bubble {comp.bubble_seconds:,.2f} s, exposed comm {comp.exposed_comm_seconds:,.2f} s"
                       + (f", CPU optimizer step {comp.cpu_optimizer_seconds:,.2f} s" if comp.cpu_optimizer_seconds
                          else "") + f") · {comp.tokens_per_second:,.0f} tokens/s · MFU "
                       f"{comp.mfu:.1%} (assumed kernel efficiency {comp.assumed_mfu:.0%})", style="dim"))
    else:
        con.print(Text("compute: " + ("; ".join(comp.notes) or "not modelled yet"), style="yellow"))


def _render_verdict(est: Estimate, con: Console, units: str) -> None:
    mem = est.memory
    cap = mem.capacity_bytes
    worst = cap - mem.headroom_bytes
    con.print()
    if mem.fits:
        con.print(Text(f"FITS: worst rank {mem.worst_rank} peaks at {format_bytes(worst, units)} of "
                       f"{format_bytes(cap, units)}; headroom {format_bytes(mem.headroom_bytes, units)} "
                       f"({mem.headroom_bytes / cap:.0%}).", style="bold green"))
    else:
        con.print(Text(f"DOES NOT FIT: worst rank {mem.worst_rank} needs {format_bytes(worst, units)}, "
                       f"{format_bytes(-mem.headroom_bytes, units)} more than the {format_bytes(cap, units)} "
                       f"available.", style="bold red"))
    if mem.tight:
        con.print(Text(tight_note(est, units), style="yellow"))
    if mem.not_modelled:
        con.print(Text(f"(not yet modelled, so not in the peak: {', '.join(mem.not_modelled)})", style="yellow"))
    comp = est.compute
    per_gpu = comp.tokens_per_second / est.inputs["parallel"]["gpus"] if comp.modelled else 0.0

    def cost(a: Advice) -> str:
        # what the change costs, from the time model (kernel efficiency held at the assumed figure)
        after = a.tokens_per_second_per_gpu_after
        return f"; tokens/s per GPU {after / per_gpu - 1:+.0%}" if per_gpu > 0 and after > 0 else ""

    if mem.advice:
        head = "What would help:" if not mem.fits else "Ways to lower the peak:"
        con.print(head)
        width = max(len(a.flags) for a in mem.advice)
        for a in mem.advice:
            verdict = "fits" if a.fits_after else "still short"
            con.print(f"  {a.flags:<{width}}  {a.change}: saves {format_bytes(a.saves_bytes, units)} → "
                      f"{format_bytes(a.peak_bytes_after, units)} ({verdict}){cost(a)}", markup=False)
    c = mem.advice_combined
    if c is not None:
        how = "stacked, on the same" if " + " in c.change else "on the same"
        n = est.inputs['parallel']['gpus']
        where_ = f"{n} GPUs" if n != 1 else "GPU"
        con.print(f"Or, {how} {where_}: {c.flags}  ({c.change}): "
                  f"saves {format_bytes(c.saves_bytes, units)} → {format_bytes(c.peak_bytes_after, units)} "
                  f"(fits){cost(c)}", markup=False)
    elif not mem.fits and not any(a.fits_after for a in mem.advice):
        con.print(f"No single change fits, nor the cheaper ones stacked: `memcalc plan` with this model, --gpus "
                  f"{est.inputs['parallel']['gpus']} and --global-batch {est.inputs['training']['global_batch']} "
                  "searches every layout.", markup=False)
