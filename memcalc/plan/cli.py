"""The `plan` command: the shared run options of `estimate` (memcalc.cli.RUN_OPTIONS) minus the axes it searches,
plus a bound per search axis, the objective and the output. Registered by memcalc.cli on demand."""

from __future__ import annotations

import sys
import time
from typing import Annotated, Any

import typer

from memcalc.errors import InputError
from memcalc.plan.search import SEARCH_FIELDS

_S = "Search"
_O = "Output"


def _bound(flag: str, what: str, *alias: str) -> Any:
    return typer.Option(flag, *alias, help=f"{what}: a comma-separated list or auto (every valid value).",
                        rich_help_panel=_S)


class _LazyProgress:
    """A rich progress bar on stderr that appears only once the search has run for a second (and only on a
    terminal); called once per search group, never per configuration."""

    def __init__(self, delay: float = 1.0) -> None:
        self.t0 = time.perf_counter()
        self.delay = delay
        self.bar: Any = None
        self.task: Any = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if time.perf_counter() - self.t0 < self.delay or not sys.stderr.isatty():
                return
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("planning"), BarColumn(), TextColumn("{task.completed}/{task.total} groups"),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("plan", total=total)
        self.bar.update(self.task, completed=done, total=total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def plan_command(
    *,
    tp: Annotated[str, _bound("--tp", "Tensor-parallel degrees")] = "auto",
    pp: Annotated[str, _bound("--pp", "Pipeline-parallel degrees")] = "auto",
    vpp: Annotated[str, _bound("--vpp", "Virtual pipeline stages (interleaved schedule)")] = "auto",
    cp: Annotated[str, _bound("--cp", "Context-parallel degrees")] = "auto",
    micro_batch: Annotated[str, _bound("--micro-batch", "Micro-batch sizes", "--mb")] = "auto",
    zero: Annotated[str, _bound("--zero", "ZeRO stages 0-3", "-z")] = "auto",
    recompute: Annotated[str, _bound("--recompute", "Recompute modes (none, selective, full)")] = "auto",
    sp: Annotated[str, _bound("--sp", "Sequence parallel (on, off)")] = "auto",
    offload: Annotated[str, _bound("--offload", "Offload modes (none, optimizer, params)")] = "auto",
    min_headroom: Annotated[str, typer.Option("--min-headroom", help="Share of GPU memory to keep free (10% or "
                                              "0.1).", rich_help_panel=_S)] = "0",
    objective: Annotated[str, typer.Option("--objective", help="throughput (tokens/s) | memory (lowest peak) | "
                                           "gpus (fewest GPUs, a divisor of --gpus).", rich_help_panel=_S)]
    = "throughput",
    top: Annotated[int, typer.Option("--top", help="How many configurations to show.", rich_help_panel=_O)] = 5,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON (schema: docs/plan.md).",
                                           rich_help_panel=_O)] = False,
    units: Annotated[str, typer.Option("--units", help="GiB (2^30) or GB (10^9) in tables.",
                                       rich_help_panel=_O)] = "GiB",
    **kwargs: Any,
) -> None:
    """Search every valid layout (dp, tp, pp, vpp, cp, ZeRO, recompute, SP, offload, micro-batch) for a cluster:
    the fastest that fit, the memory-vs-throughput Pareto front, and what would make it fit when nothing does."""
    import json

    from memcalc.cli import run_options_from
    from memcalc.options import check_choice
    from memcalc.plan.search import Request, plan
    from memcalc.plan.space import parse_bounds
    from memcalc.report.formats import share_of_capacity

    units = check_choice("units", units) or "GiB"
    bounds = parse_bounds(tp=tp, pp=pp, vpp=vpp, cp=cp, micro_batch=micro_batch, zero=zero, recompute=recompute,
                          sp=sp, offload=offload)
    share = share_of_capacity(min_headroom, "--min-headroom")
    if share is None:
        raise InputError(f"--min-headroom {min_headroom!r}: plan keeps a share of each GPU's memory free; give e.g. "
                         "10% or 0.1")
    req = Request(options=run_options_from(kwargs), bounds=bounds, objective=objective.strip().lower(),
                  min_headroom=share, top=top)
    progress = _LazyProgress()
    try:
        result = plan(req, progress=progress)
    finally:
        progress.close()
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        from memcalc.plan.render import render_plan

        render_plan(result, units=units)


def register(app: typer.Typer) -> None:
    from memcalc.cli import RUN_OPTIONS, with_options

    shared = {k: v for k, v in RUN_OPTIONS.items() if k not in SEARCH_FIELDS}
    app.command("plan")(with_options(shared)(plan_command))
