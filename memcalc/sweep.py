"""`memcalc estimate --sweep KEY=V1,V2,...`: one estimate per value of one option, every other option as given.

A value that makes the configuration invalid (tp not dividing the heads, ...) gives a row with the reason rather
than stopping the sweep; a sweep in which no value is valid is an input error. Sweeping --gpus clears --dp (and
sweeping --dp clears --gpus) so that the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

from memcalc.cost.estimate import Estimate
from memcalc.errors import InputError
from memcalc.options import RunOptions

# name typed after --sweep -> (RunOptions field, value type)
SWEEP_KEYS: dict[str, tuple[str, type]] = {
    "micro-batch": ("micro_batch", int), "seq": ("seq", int), "gpus": ("gpus", int), "dp": ("dp", int),
    "tp": ("tp", int), "pp": ("pp", int), "vpp": ("vpp", int), "cp": ("cp", int), "ep": ("ep", int),
    "zero": ("zero", int), "recompute": ("recompute", str), "offload": ("offload", str),
    "precision": ("precision", str), "global-batch": ("global_batch", int), "grad-accum": ("grad_accum", int),
}
_ALIASES = {"mb": "micro-batch", "micro_batch": "micro-batch", "microbatch": "micro-batch", "seq-len": "seq",
            "seq_len": "seq", "sequence": "seq", "global_batch": "global-batch", "grad_accum": "grad-accum"}


@dataclasses.dataclass
class SweepPoint:
    key: str  # as typed, normalised: "micro-batch"
    field: str  # RunOptions field
    value: Any
    estimate: Estimate | None = None
    run: Any = None
    error: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.key


def parse_sweep(text: str) -> tuple[str, str, list[Any]]:
    """'micro-batch=1,2,4' -> ("micro-batch", "micro_batch", [1, 2, 4])."""
    valid = ", ".join(SWEEP_KEYS)
    if "=" not in text:
        raise InputError(f"--sweep {text!r} is not KEY=V1,V2,...; keys: {valid}")
    raw_key, raw_values = text.split("=", 1)
    key = raw_key.strip().lower().lstrip("-")
    key = _ALIASES.get(key, key)
    if key not in SWEEP_KEYS:
        raise InputError(f"--sweep key {raw_key.strip()!r} cannot be swept; valid: {valid}")
    field, typ = SWEEP_KEYS[key]
    items = [v.strip() for v in raw_values.split(",")]
    if not items or any(not v for v in items):
        raise InputError(f"--sweep {text!r} needs a comma-separated list of values, e.g. {key}=1,2,4")
    values: list[Any] = []
    for v in items:
        if typ is int:
            try:
                values.append(int(v))
            except ValueError:
                raise InputError(f"--sweep {key}: {v!r} is not a whole number") from None
        else:
            values.append(v.lower())
    return key, field, values


def run_sweep(opts: RunOptions, text: str, stage_of: Callable[[int], int | None] = lambda pp: None) -> list[SweepPoint]:
    from memcalc.cost.estimate import estimate
    from memcalc.options import build_run
    from memcalc.report.formats import attach_import_report

    key, field, values = parse_sweep(text)
    points: list[SweepPoint] = []
    for v in values:
        changes: dict[str, Any] = {field: v}
        if field == "gpus":
            changes["dp"] = None
        elif field == "dp":
            changes["gpus"] = None
        o = dataclasses.replace(opts, **changes)
        pt = SweepPoint(key=key, field=field, value=v)
        try:
            run = build_run(o)
            est = estimate(run, stage=stage_of(run.pp), advice=False)
            pt.estimate, pt.run = attach_import_report(est, opts.import_report), run
        except InputError as e:
            pt.error = str(e)
        points.append(pt)
    if all(p.error for p in points):
        raise InputError(f"--sweep {key}: no value gives a valid configuration ({points[0].error})")
    return points


# --- output ------------------------------------------------------------------------------------------------------

def sweep_json(points: list[SweepPoint]) -> str:
    import json

    out = []
    for p in points:
        item: dict[str, Any] = {"key": p.flag, "field": p.field, "value": p.value}
        if p.estimate is not None:
            item["estimate"] = p.estimate.model_dump(mode="json")
        else:
            item["error"] = p.error
        out.append(item)
    return json.dumps(out, indent=2) + "\n"


def sweep_csv(points: list[SweepPoint]) -> str:
    from memcalc.report.formats import csv_record, render_csv

    rows = []
    for p in points:
        rec = {"sweep_key": p.flag, "sweep_value": p.value}
        if p.estimate is not None:
            rec.update(csv_record(p.estimate))
        else:
            rec["error"] = p.error
        rows.append(rec)
    return render_csv(rows, lead=("sweep_key", "sweep_value"))


def _cells(p: SweepPoint, units: str) -> list[str]:
    from memcalc.units import UNIT_BYTES

    def n(b: int) -> str:
        return f"{b / UNIT_BYTES[units]:,.2f}"

    est = p.estimate
    assert est is not None
    mem, comp = est.memory, est.compute
    c = mem.components
    states = sum(c.get(k, 0) for k in ("params", "master_weights", "grads", "optimizer"))
    act = "n/a" if "activations" in mem.not_modelled else n(c.get("activations", 0))
    buf = "n/a" if "buffers" in mem.not_modelled else n(c.get("buffers", 0))
    step = f"{comp.step_seconds:,.2f}" if comp.modelled else "n/a"
    tps = f"{comp.tokens_per_second:,.0f}" if comp.modelled else "n/a"
    fits = ("tight" if mem.tight else "yes") if mem.fits else "NO"
    return [n(states), act, buf, n(mem.peak_bytes), n(mem.headroom_bytes), fits, step, tps]


_HEAD = ["states", "activ.", "buffers", "peak", "headroom", "fits", "step s", "tokens/s"]


def sweep_markdown(points: list[SweepPoint], units: str) -> str:
    p0 = next(p for p in points if p.estimate is not None)
    head = [p0.flag] + [f"{h} ({units})" if i < 5 else h for i, h in enumerate(_HEAD)]
    head[1:3] = [f"model states ({units})", f"activations ({units})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for p in points:
        cells = _cells(p, units) if p.estimate is not None else [f"invalid: {p.error}"] + [""] * (len(_HEAD) - 1)
        lines.append("| " + " | ".join([str(p.value), *cells]) + " |")
    return "\n".join(lines) + "\n"


def render_sweep_table(points: list[SweepPoint], units: str) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from memcalc.report.formats import render_import_notes

    con = Console(highlight=False)
    p0 = next(p for p in points if p.estimate is not None)
    est0 = p0.estimate
    assert est0 is not None
    render_import_notes(est0.inputs.get("import_report"), con)
    m, hw = est0.inputs["model"], est0.inputs["hardware"]
    con.print(Text(f"{m['display_name']} · {hw['display_name'] or hw['name']} "
                   f"({est0.memory.capacity_bytes / 2**30:,.2f} GiB) · profile {est0.inputs['profile']} · "
                   f"sweeping {p0.flag} · sizes in {units}", style="bold"))
    t = Table(box=None, header_style="bold", pad_edge=False)
    t.add_column(p0.flag)
    for h in _HEAD:
        t.add_column(h, justify="right")
    for p in points:
        if p.estimate is None:
            t.add_row(str(p.value), Text(f"invalid: {p.error}", style="yellow"), *[""] * (len(_HEAD) - 1))
            continue
        cells = _cells(p, units)
        style = ("yellow" if p.estimate.memory.tight else "green") if p.estimate.memory.fits else "red"
        t.add_row(str(p.value), *cells[:5], Text(cells[5], style=style), *cells[6:])
    con.print(t)
    if any(p.estimate and p.estimate.memory.tight for p in points):
        con.print(Text("tight: fits, with less headroom than the reserved-memory model's measured error "
                       "(`memory.tight`; docs/methodology.md, \"How far to trust the reserved figure\")",
                       style="yellow"))
    nm = sorted({x for p in points if p.estimate for x in p.estimate.memory.not_modelled})
    if nm:
        con.print(Text(f"(not yet modelled, so not in the peak: {', '.join(nm)})", style="yellow"))


def emit_sweep(points: list[SweepPoint], fmt: str, units: str) -> None:
    if fmt == "json":
        sys.stdout.write(sweep_json(points))
    elif fmt == "csv":
        sys.stdout.write(sweep_csv(points))
    elif fmt == "markdown":
        sys.stdout.write(sweep_markdown(points, units))
    else:
        render_sweep_table(points, units)
