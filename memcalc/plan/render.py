"""The human view of a plan: reads only the `plan --json` object (memcalc.plan.search.plan), so the table and
the JSON cannot disagree."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from memcalc.plan.space import INVALID_LAYOUT_RULES, RULES
from memcalc.units import UNIT_BYTES


def _b(n: int, units: str) -> str:
    return f"{n / UNIT_BYTES[units]:,.1f}"


def _k(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else (f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}")


def _layout(lay: dict[str, Any]) -> str:
    s = f"dp{lay['dp']} tp{lay['tp']} pp{lay['pp']}"
    if lay["vpp"] > 1:
        s += f" vpp{lay['vpp']}"
    if lay["cp"] > 1:
        s += f" cp{lay['cp']}"
    return s


_RC = {"none": "", "selective": "rc-sel", "op": "rc-op", "full": "rc-full"}
_OFF = {"none": "", "optimizer": "off-opt", "params": "off-par"}


def _opts(lay: dict[str, Any]) -> str:
    parts = [f"z{lay['zero']}", _RC[lay["recompute"]], "sp" if lay["sp"] else "", _OFF[lay["offload"]]]
    return " ".join(p for p in parts if p)


def _config_table(title: str, rows: list[dict[str, Any]], units: str, ranked: bool, gpus: bool = False) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold", padding=(0, 1), box=None)
    if ranked:
        t.add_column("#", justify="right")
    show_gpus = gpus or any(r["layout"]["gpus"] != rows[0]["layout"]["gpus"] for r in rows)
    if show_gpus:
        t.add_column("gpus", justify="right")
    t.add_column("layout")
    t.add_column("options")
    for name in ("mb x acc", "peak", "free", "step s", "tok/s", "MFU"):
        t.add_column(name, justify="right", no_wrap=True)
    for i, r in enumerate(rows, start=1):
        lay, f = r["layout"], r["search"]
        cells = [str(i)] if ranked else []
        if show_gpus:
            cells.append(str(lay["gpus"]))
        free = _b(f["headroom_bytes"], units) + ("*" if f.get("tight") else "")
        cells += [_layout(lay), _opts(lay), f"{lay['micro_batch']}x{lay['grad_accum']}", _b(f["peak_bytes"], units),
                  free, f"{f['step_seconds']:,.2f}", _k(f["tokens_per_second"]), f"{f['mfu']:.1%}"]
        t.add_row(*cells)
    return t


PARETO_ROWS = 12
TIGHT_NOTE = ("* free memory within the reserved-memory model's measured error (12.5% of the peak with the default "
              "allocator, 5% with expandable segments; docs/methodology.md): `memcalc validate` with the row's flags "
              "and `--device meta --world fake` replays the allocator")
OFFLOAD_NOTE = ("offload (off-opt, off-par): step s includes the CPU optimizer step at an assumed host rate "
                "(--cpu-optimizer-rate, parameters/s per node)")


def render_plan(result: dict[str, Any], units: str = "GiB", console: Console | None = None) -> None:
    c = console or Console()
    inp, s = result["inputs"], result["search"]
    model = inp["model"].get("display_name") or inp["model"]["name"]
    hw = inp["hardware"].get("display_name") or inp["hardware"]["name"]
    up_to = "up to " if inp["objective"] == "gpus" else ""
    cap = _b(s["capacity_bytes"], units)
    c.print(f"[bold]memcalc plan[/bold]: {model} on {up_to}{inp['gpus']} x {hw} ({cap} {units}), "
            f"global batch {inp['training']['global_batch']} x seq {inp['training']['seq']}, profile "
            f"{inp['profile']}, objective {inp['objective']}"
            + (f", keeping {inp['min_headroom']:.0%} free" if inp["min_headroom"] else ""))
    rate = s["considered"] / s["wall_seconds"] if s["wall_seconds"] > 0 else 0.0
    c.print(f"searched {s['considered']:,} configurations in {s['wall_seconds']:.2f} s ({rate:,.0f}/s): "
            f"{s['evaluated']:,} evaluated by the cost model, {s['feasible']:,} feasible")
    rej = s["rejected"]
    invalid = sum(rej[k] for k in INVALID_LAYOUT_RULES)
    parts = [f"invalid layout {invalid:,}"] + [f"{k.replace('_', ' ')} {rej[k]:,}" for k in RULES
                                               if k not in INVALID_LAYOUT_RULES and rej.get(k)]
    c.print("rejected: " + ", ".join(parts))
    if result["plans"]:
        c.print(_config_table(f"Top {len(result['plans'])} by {inp['objective']} (peak and free in {units} per GPU, "
                              "worst stage, incl. fragmentation and runtime)", result["plans"], units, ranked=True,
                              gpus=inp["objective"] == "gpus"))
        c.print("Reproduce:")
        for i, p in enumerate(result["plans"], start=1):
            c.print(f"  {i}. {p['command']}", soft_wrap=True, highlight=False, markup=False)
    front = result["pareto"]
    if front:
        if len(front) > PARETO_ROWS:  # the ends and an even spread
            step = (len(front) - 1) / (PARETO_ROWS - 1)
            front = [front[round(i * step)] for i in range(PARETO_ROWS)]
        c.print(_config_table(f"Pareto front, peak memory ({units}) vs throughput ({len(front)} of "
                              f"{len(result['pareto'])} shown)",
                              front, units, ranked=False))
    shown = result["plans"] + front
    if any(r["search"].get("tight") for r in shown):
        c.print(TIGHT_NOTE, highlight=False, markup=False)
    if any(r["layout"]["offload"] != "none" for r in shown):
        c.print(OFFLOAD_NOTE, highlight=False, markup=False)
    if not result["advice"]:
        return
    c.print(f"[bold red]Nothing fits[/bold red] within {_b(s['budget_bytes'], units)} {units} per GPU.")
    for a in result["advice"]:
        if a["kind"] == "closest":
            c.print(f"Closest: {_layout(a['layout'])} {_opts(a['layout'])} mb {a['layout']['micro_batch']}: peak "
                    f"{_b(a['peak_bytes'], units)} {units}, short by {_b(a['shortfall_bytes'], units)} {units}")
            for ch in a["changes"]:
                verdict = "fits" if ch["fits_after"] else "still short"
                c.print(f"  {ch['change']} ({ch['flags']}): peak {_b(ch['peak_bytes_after'], units)} {units}, "
                        f"{verdict}", highlight=False)
            fix = next((ch for ch in a["changes"] if ch["fits_after"]), None)
            if fix is not None:
                c.print(f"    {fix['command']}", soft_wrap=True, highlight=False, markup=False)
        else:
            f = a["search"]
            c.print(f"With {a['gpus']} GPUs {a['feasible']:,} configurations fit; the best: {_layout(a['layout'])} "
                    f"{_opts(a['layout'])}, peak {_b(f['peak_bytes'], units)} {units}, "
                    f"{f['tokens_per_second']:,.0f} tokens/s")
            c.print(f"    {a['command']}", soft_wrap=True, highlight=False, markup=False)
