"""Output formats of `estimate` besides the rich table: `--format json | markdown | csv`, the `--check` /
`--min-headroom` gate, and the import notes shown above the table. Reads only Estimates (and ImportReports).

CSV is one row per configuration (one for `estimate`, one per value for `--sweep`) with every size in integer
bytes, so rows from many runs can be concatenated; markdown is for pasting into a PR or an issue.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any, Iterable

from memcalc.cost.estimate import Estimate
from memcalc.errors import InputError
from memcalc.units import UNIT_BYTES, format_bytes, format_count, parse_bytes

FORMATS = ("table", "json", "markdown", "csv")

COMPONENTS = ("params", "master_weights", "grads", "optimizer", "activations", "buffers", "fragmentation", "runtime")
LABELS = {
    "params": "parameters", "master_weights": "master weights", "grads": "gradients",
    "optimizer": "optimizer state", "activations": "activations", "buffers": "buffers & temps",
    "fragmentation": "fragmentation", "runtime": "runtime (CUDA, NCCL)",
}


def output_format(fmt: str | None, json_out: bool) -> str:
    """The format asked for: --format, with --json meaning --format json."""
    if fmt is None:
        return "json" if json_out else "table"
    f = fmt.strip().lower()
    if f == "md":
        f = "markdown"
    if f not in FORMATS:
        raise InputError(f"--format {fmt!r} is not valid; valid: {', '.join(FORMATS)}")
    if json_out and f != "json":
        raise InputError(f"--json and --format {f} disagree; give one")
    return f


def tight_note(est: Estimate, units: str) -> str:
    """The line under a fit whose headroom is inside the reserved-memory model's measured error (`memory.tight`;
    fragmentation.RESERVED_SHORTFALL_FRACTION)."""
    mem = est.memory
    expandable = est.inputs["training"]["allocator"] == "expandable"
    share = mem.reserved_error_bytes / max(1, mem.peak_bytes)
    line = (f"Tight: the headroom is within the reserved-memory model's error (the H100/H200 records reserved up to "
            f"{share:.1%} more than memcalc's figure: {format_bytes(mem.reserved_error_bytes, units)} here). `memcalc "
            "validate` with these flags and `--device meta --world fake` replays the allocator")
    if not expandable:
        line += "; `--allocator expandable` narrows the error to 5%"
    return line + "."


# --- --check / --min-headroom ------------------------------------------------------------------------------------

def share_of_capacity(text: str, flag: str) -> float | None:
    """A share of memory as typed: '10%' or a bare number below 1 ('0.1') -> 0.1; None for anything else (a size:
    '5GiB', '4e9'). A share outside [0, 1) is an InputError naming the value."""
    t = text.strip()
    pct = t.endswith("%")
    try:
        v = float(t[:-1] if pct else t)
    except ValueError:
        if pct:
            raise InputError(f"{flag} {text!r} is not valid; use e.g. 10% or 0.1") from None
        return None
    if pct:
        if not 0 <= v < 100:
            raise InputError(f"{flag} {text!r} must be a percentage in [0, 100)")
        return v / 100
    if v < 0:
        raise InputError(f"{flag} {text!r} must not be negative; use e.g. 10% or 0.1")
    return v if v < 1 else None


class Headroom:
    """--min-headroom: a share of the GPU's capacity (10%, or a bare number below 1: 0.1, as `plan` takes it) or
    bytes (5GiB, 4GB, 4e9: a bare number of 1 or more)."""

    def __init__(self, text: str) -> None:
        self.text = text
        t = text.strip()
        self.fraction: float | None = None
        self.bytes: int | None = None
        share = share_of_capacity(text, "--min-headroom")
        if share is not None:
            self.fraction = share
            return
        try:
            self.bytes = parse_bytes(t, "--min-headroom")
        except InputError:
            raise InputError(f"--min-headroom {text!r} is not valid; use e.g. 10%, 0.1, 5GiB or 4GB") from None

    def required(self, capacity: int) -> int:
        return int(self.fraction * capacity) if self.fraction is not None else int(self.bytes or 0)


def check_estimate(est: Estimate, min_headroom: Headroom | None, units: str = "GiB") -> tuple[bool, str]:
    """(passes, one-line reason when it does not) for --check: it fits, with at least --min-headroom left."""
    mem = est.memory
    if not mem.fits:
        return False, (f"does not fit: worst rank {mem.worst_rank} needs "
                       f"{format_bytes(mem.capacity_bytes - mem.headroom_bytes, units)} of "
                       f"{format_bytes(mem.capacity_bytes, units)}")
    if min_headroom is not None:
        need = min_headroom.required(mem.capacity_bytes)
        if mem.headroom_bytes < need:
            return False, (f"headroom {format_bytes(mem.headroom_bytes, units)} is below --min-headroom "
                           f"{min_headroom.text} ({format_bytes(need, units)})")
    return True, ""


# --- import report -----------------------------------------------------------------------------------------------

def import_lines(report: Any) -> list[str]:
    """Plain lines describing an ImportReport (table and markdown outputs)."""
    if report is None:
        return []
    r = report if isinstance(report, dict) else report.model_dump(mode="json")
    lines = [f"imported from {r['source']} ({r['framework']}): {r['equivalent_flags'] or 'nothing applied'}"]
    for ov in r["overridden"]:
        lines.append(f"command line wins: {ov['flag']} {_v(ov['used'])} (the {r['framework']} config says "
                     f"{_v(ov['imported'])})")
    for nv in r["needs_value"]:
        lines.append(f"needs a value: {nv}")
    if r["recorded"]:
        lines.append("recorded, not modelled yet: " + ", ".join(f"{k}={_v(v)}" for k, v in r["recorded"].items()))
    for note in r["notes"]:
        lines.append(f"note: {note}")
    by_reason: dict[str, list[str]] = {}
    for i in r["ignored"]:
        by_reason.setdefault(i["reason"], []).append(i["key"])
    for reason, keys in sorted(by_reason.items(), key=lambda kv: kv[0] != "unknown to memcalc"):
        lines.append(f"ignored ({reason}): " + ", ".join(keys))
    return lines


def _v(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def render_import_notes(report: Any, console: Any) -> None:
    from rich.text import Text

    for i, line in enumerate(import_lines(report)):
        style = "bold" if i == 0 else ("yellow" if line.startswith(("command line wins", "needs a value")) else "dim")
        console.print(Text(("" if i == 0 else "  ") + line, style=style))


def attach_import_report(est: Estimate, report: Any) -> Estimate:
    """The estimate with `inputs.import_report` set (an optional key; no existing JSON field changes)."""
    if report is None:
        return est
    data = report.model_dump(mode="json") if hasattr(report, "model_dump") else report
    return est.model_copy(update={"inputs": {**est.inputs, "import_report": data}})


# --- JSON --------------------------------------------------------------------------------------------------------

def estimate_json(est: Estimate) -> str:
    return est.model_dump_json(indent=2) + "\n"


def estimate_schema_json() -> str:
    """The JSON schema of `estimate --json` (pydantic), as `memcalc schema` prints it."""
    return json.dumps(Estimate.model_json_schema(), indent=2, sort_keys=False) + "\n"


# --- CSV ---------------------------------------------------------------------------------------------------------

CSV_COLUMNS = (
    "model", "total_params", "profile", "gpu", "gpus", "dp", "tp", "pp", "vpp", "cp", "ep", "sp", "zero", "offload",
    "precision", "optimizer", "recompute", "seq", "micro_batch", "grad_accum", "global_batch",
    *(f"{c}_bytes" for c in COMPONENTS),
    "allocated_peak_bytes", "peak_bytes", "capacity_bytes", "headroom_bytes", "fits", "peak_phase", "worst_rank",
    "comm_bytes_per_step", "step_seconds", "tokens_per_second", "mfu",
)


def csv_record(est: Estimate) -> dict[str, Any]:
    inp, mem, par, tr = est.inputs, est.memory, est.inputs["parallel"], est.inputs["training"]
    rec: dict[str, Any] = {
        "model": inp["model"]["name"], "total_params": inp["model"]["total_params"], "profile": inp["profile"],
        "gpu": inp["hardware"]["name"],
        **{k: par[k] for k in ("gpus", "dp", "tp", "pp", "vpp", "cp", "ep", "sp", "zero", "offload")},
        **{k: tr[k] for k in ("precision", "optimizer", "recompute", "seq", "micro_batch", "grad_accum",
                              "global_batch")},
    }
    for c in COMPONENTS:
        rec[f"{c}_bytes"] = "" if c in mem.not_modelled else mem.components.get(c, 0)
    rec.update(allocated_peak_bytes=mem.allocated_peak_bytes, peak_bytes=mem.peak_bytes,
               capacity_bytes=mem.capacity_bytes, headroom_bytes=mem.headroom_bytes, fits=mem.fits,
               peak_phase=mem.peak_phase, worst_rank=mem.worst_rank)
    comm, comp = est.communication, est.compute
    rec["comm_bytes_per_step"] = comm.bytes_per_step if comm.modelled else ""
    rec["step_seconds"] = comp.step_seconds if comp.modelled else ""
    rec["tokens_per_second"] = comp.tokens_per_second if comp.modelled else ""
    rec["mfu"] = comp.mfu if comp.modelled else ""
    return rec


def render_csv(records: Iterable[dict[str, Any]], lead: tuple[str, ...] = ()) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=[*lead, *CSV_COLUMNS, *(("error",) if lead else ())], lineterminator="\n",
                       extrasaction="ignore")
    w.writeheader()
    for r in records:
        w.writerow({k: (str(v).lower() if isinstance(v, bool) else v) for k, v in r.items()})
    return buf.getvalue()


# --- markdown ----------------------------------------------------------------------------------------------------

def ordinal(n: int) -> str:
    """2nd, 3rd, 4th, 11th, 21st."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def recompute_text(tr: dict[str, Any]) -> str:
    """`full`, or with the checkpointed layers placed: `full (first 2 layers of each stage)`, `full (every 2nd
    layer)`."""
    k, every = tr.get("recompute_layers"), tr.get("recompute_every")
    if every is not None:
        return f"{tr['recompute']} (every {ordinal(every) + ' ' if every > 1 else ''}layer)"
    if k is not None and tr["recompute"] != "none":
        return f"{tr['recompute']} (first {'layer' if k == 1 else f'{k} layers'} of each stage)"
    return str(tr["recompute"])


def _n(b: int, units: str) -> str:
    return f"{b / UNIT_BYTES[units]:,.2f}"


def render_markdown(est: Estimate, units: str = "GiB") -> str:
    inp, mem = est.inputs, est.memory
    m, par, tr, hw = inp["model"], inp["parallel"], inp["training"], inp["hardware"]
    out = [f"### {m['display_name']} · {format_count(m['total_params'])} params · {par['gpus']} x "
           f"{hw['display_name'] or hw['name']} · profile {inp['profile']}", ""]
    out.append(f"dp {par['dp']} · tp {par['tp']}{' +SP' if par['sp'] else ''} · pp {par['pp']}"
               + (f" (vpp {par['vpp']})" if par["vpp"] > 1 else "") + f" · cp {par['cp']}"
               + (f" ({par['cp_comm']})" if par["cp"] > 1 else "") + f" · ZeRO-{par['zero']}"
               + (f" · offload {par['offload']}" if par["offload"] != "none" else "")
               + f" · seq {tr['seq']} · micro-batch {tr['micro_batch']} · grad-accum {tr['grad_accum']} · "
               f"{tr['precision']} · {tr['optimizer']} · recompute {recompute_text(tr)}")
    out += ["", f"| component | {units} |", "|---|---:|"]
    for c in COMPONENTS:
        val = "n/a (not modelled yet)" if c in mem.not_modelled else _n(mem.components.get(c, 0), units)
        out.append(f"| {LABELS[c]} | {val} |")
    out.append(f"| allocated peak (at {mem.peak_phase}) | {_n(mem.allocated_peak_bytes, units)} |")
    out.append(f"| **peak per GPU** (worst rank {mem.worst_rank}) | **{_n(mem.peak_bytes, units)}** |")
    out.append(f"| capacity | {_n(mem.capacity_bytes, units)} |")
    out.append("")
    if mem.fits:
        out.append(f"**FITS**: headroom {format_bytes(mem.headroom_bytes, units)} "
                   f"({mem.headroom_bytes / mem.capacity_bytes:.0%}).")
        if mem.tight:
            out.append(tight_note(est, units))
    else:
        out.append(f"**DOES NOT FIT**: {format_bytes(-mem.headroom_bytes, units)} short.")
    comm, comp = est.communication, est.compute
    if comm.modelled:
        out.append(f"Communication: {format_bytes(comm.bytes_per_step, units)} sent per GPU per step, "
                   f"{comm.exposed_seconds_per_step * 1e3:,.1f} ms exposed.")
    if comp.modelled:
        out.append(f"Compute: step {comp.step_seconds:,.2f} s · {comp.tokens_per_second:,.0f} tokens/s · "
                   f"MFU {comp.mfu:.1%}.")
    notes = import_lines(inp.get("import_report"))
    if notes:
        out.append("")
        out += [f"> {line}  " for line in notes]
    model_notes = inp["model"].get("notes") or ()
    if model_notes:
        out.append("")
        out += [f"- {inp['model']['display_name'] or inp['model']['name']}: {n}" for n in model_notes]
    if mem.not_modelled:
        out += ["", f"_Not yet modelled, so not in the peak: {', '.join(mem.not_modelled)}._"]
    return "\n".join(out) + "\n"


def emit_estimate(est: Estimate, run: Any, fmt: str, units: str, explain: bool) -> None:
    import sys

    if fmt == "json":
        sys.stdout.write(estimate_json(est))
    elif fmt == "markdown":
        sys.stdout.write(render_markdown(est, units))
    elif fmt == "csv":
        sys.stdout.write(render_csv([csv_record(est)]))
    else:
        from rich.console import Console

        from memcalc.report.table import render_estimate

        con = Console(highlight=False)
        render_import_notes(est.inputs.get("import_report"), con)
        render_estimate(est, run, units=units, explain=explain, console=con)


def json_dumps(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"
