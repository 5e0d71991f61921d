"""`memcalc validate`: the same configuration flags as `estimate`, run for real in torch and compared.

Importing this module must not import torch (`memcalc --help` stays fast): torch is imported inside the command.
Exit status: 0 within tolerance, 1 when the total peak misses it, 2 for bad input, a configuration the harness
cannot build, a missing torch, or a failed rank.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, Optional

import typer

from memcalc.errors import InputError

_V = "Validation"


def _fmt_bytes(n: int) -> str:
    a = abs(n)
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if a >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,} B"


def _fmt_err(e: float | None) -> str:
    if e is None:
        return "n/a"
    return f"{e * 100:+.2f}%" if abs(e) < 10 else ("+>999%" if e > 0 else "->999%")


def render(report: dict[str, Any]) -> str:
    lines = []
    m, p = report["measured"], report["predicted"]
    lines.append(f"memcalc validate: rank {report['rank']} (pipeline stage {report['stage']}), world "
                 f"{report['world']} of {m['world_size']}, device {report['device']}, torch {m['torch_version']}, "
                 f"{m['steps']} measured step(s) after {m['warmup']} warm-up, {report['seconds']:.1f} s")
    lengths = report.get("seq_lengths")
    if lengths:
        lines.append(f"micro-batch lengths (dynamic padding): {len(lengths)} micro-batches, {min(lengths)} to "
                     f"{max(lengths)} tokens; the prediction is for the longest, --seq")
    lines.append(f"{'section':<16} {'name':<18} {'predicted':>16} {'measured':>16} {'error':>9}  verdict")
    for r in report["rows"]:
        lines.append(f"{r['section']:<16} {r['name']:<18} {r['predicted']:>16,} {r['measured']:>16,} "
                     f"{_fmt_err(r['error']):>9}  {r['verdict']}")
    lines.append(f"tracked peak: predicted {_fmt_bytes(p['peak_bytes'])} ({p['peak_phase']}), measured "
                 f"{_fmt_bytes(m['peak_bytes'])} ({m['peak_phase']})")
    other = report.get("remeasured_other_peak_bytes")
    if other is not None:
        lines.append(f"measured twice: gloo's worker thread had not yet freed a collective's tensors at one run's "
                     f"peak; the lower peak is kept (the other run's: {_fmt_bytes(other)})")
    if report.get("peak_moments_differ"):
        lines.append(f"the two peaks are different moments (activations live: predicted "
                     f"{_fmt_bytes(p['components'].get('activations', 0))}, measured "
                     f"{_fmt_bytes(m['components'].get('activations', 0))}): the `moment` rows compare two moments, "
                     "not one; the phase and total rows compare each phase's highest moment")
    if report.get("peak_split_differs"):
        lines.append("both peaks hold the same gradients and optimizer state, within the tolerance: the `split` rows "
                     "are one moment filed two ways. memcalc counts layer transients, a recomputed layer's set and "
                     "weight casts as activations, which the tracker files as buffers (backward temporaries, compute "
                     "copies); and a weight gradient still in the compute dtype as made, under gradients, with the "
                     "difference taken off activations")
    if p["set_aside"]:
        lines.append("set aside from the tracked figures (GPU-only terms, not tensor bytes): "
                     + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in p["set_aside"].items()))
    if report["collectives"]:
        lines.append(f"{'collective':<16} {'group':<6} {'pred calls':>10} {'meas calls':>10} {'pred bytes':>14} "
                     f"{'meas bytes':>14} {'error':>9}")
        for c in report["collectives"]:
            lines.append(f"{c['op']:<16} {c['group']:<6} {c['predicted_calls']:>10} {c['measured_calls']:>10} "
                         f"{c['predicted_bytes']:>14,} {c['measured_bytes']:>14,} {_fmt_err(c['error']):>9}"
                         + ("  exact" if c["exact"] else ""))
        lines.append("(collective bytes: the full buffer of every call in one step, summed; not ring-scaled)")
    rep = next((r for r in report["rows"] if r["section"] == "allocator_replay"), None)
    if rep:
        replay = m.get("allocator_replay", {})
        allocator = report.get("inputs", {}).get("training", {}).get("allocator", "default")
        default, expandable = replay.get("reserved_peak_bytes"), replay.get("expandable_reserved_peak_bytes")
        lines.append(f"caching allocator replayed over these allocations (per stream): reserved "
                     f"{_fmt_bytes(default)}"
                     + (f" ({_fmt_bytes(expandable)} with expandable_segments:True)" if expandable else "")
                     + f"; memcalc's allocated + fragmentation {_fmt_bytes(rep['predicted'])} "
                     f"({_fmt_err(rep['error'])} against the {allocator} allocator's)")
    cuda = report.get("cuda")
    if cuda:
        lines.append(f"on the GPU: max_memory_allocated {_fmt_bytes(cuda['measured_peak_bytes'])} "
                     f"({cuda['measured_peak_phase']}) against {_fmt_bytes(cuda['predicted_peak_bytes'])} predicted "
                     f"({cuda['predicted_peak_phase']}); max_memory_reserved "
                     f"{_fmt_bytes(cuda['measured_reserved_bytes'])} against "
                     f"{_fmt_bytes(cuda['predicted_reserved_bytes'])}")
    verdict = "within" if report["within_tolerance"] else "OUTSIDE"
    lines.append(f"total peak error {_fmt_err(report['error'])}: {verdict} the tolerance of "
                 f"{report['tolerance'] * 100:.1f}%")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    from memcalc.cli import RUN_OPTIONS, run_options_from, with_options

    @app.command()
    @with_options(RUN_OPTIONS)
    def validate(
        *,
        device: Annotated[str, typer.Option("--device", help="auto | cuda | cpu | meta (meta: fake tensors, no "
                                            "compute, needs --world fake).", rich_help_panel=_V)] = "auto",
        steps: Annotated[int, typer.Option("--steps", help="Measured steps, after 2 warm-up steps (DDP rebuilds "
                                           "its buckets at the second).", rich_help_panel=_V)] = 1,
        rank: Annotated[Optional[int], typer.Option("--rank", help="Rank to measure (default: the predicted worst "
                                                    "rank).", rich_help_panel=_V)] = None,
        world: Annotated[str, typer.Option("--world", help="real (one process per rank: gloo on CPU, NCCL on GPUs) "
                                           "| fake (one process = one rank of the full world on a fake process "
                                           "group).", rich_help_panel=_V)] = "real",
        tolerance: Annotated[float, typer.Option("--tolerance", help="Allowed relative error of the total peak "
                                                 "(exit 1 beyond it).", rich_help_panel=_V)] = 0.03,
        timeout: Annotated[float, typer.Option("--timeout", help="Seconds allowed per run (every rank).",
                                               rich_help_panel=_V)] = 300.0,
        json_out: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.",
                                               rich_help_panel=_V)] = False,
        seq_lengths: Annotated[Optional[str], typer.Option(
            "--seq-lengths", help="Micro-batches of varying length (dynamic padding), for the allocator replay's "
            "reserved figure: comma-separated lengths taken in turn (448,480,512), or random:MIN (each micro-batch "
            "padded to the longest of its samples, drawn uniformly from MIN..--seq; seeded). The prediction stays "
            "the one for --seq.", rich_help_panel=_V)] = None,
        **kwargs: Any,
    ) -> None:
        """Run the configuration in torch, measure it exactly (live bytes per component and phase, bytes of every
        collective) and compare with the estimate. Needs the validate extra (torch)."""
        from memcalc.options import build_run

        device = device.strip().lower()
        world = world.strip().lower()
        if device not in ("auto", "cuda", "cpu", "meta"):
            raise InputError(f"--device {device!r} is not valid; valid: auto, cuda, cpu, meta")
        if world not in ("real", "fake"):
            raise InputError(f"--world {world!r} is not valid; valid: real, fake")
        if steps < 1:
            raise InputError(f"--steps {steps} must be at least 1")
        if not 0 <= tolerance < 1:
            raise InputError(f"--tolerance {tolerance} must be in [0, 1)")
        if timeout <= 0:
            raise InputError(f"--timeout {timeout} must be positive")
        opts = run_options_from(kwargs)
        if (opts.profile or "torch").strip().lower() != "torch":
            raise InputError(f"--profile {opts.profile} cannot be run by the harness; only --profile torch is "
                             "runnable")
        run = build_run(opts)
        try:
            import torch  # noqa: F401
        except ImportError:
            raise InputError("memcalc validate needs torch: pip install 'memcalc[validate]' (CI pins "
                             "torch==2.13.0)") from None
        from memcalc.validate.api import validate as run_validate
        from memcalc.validate.parallelize import Unsupported
        from memcalc.validate.runner import RankFailure

        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise InputError("--device cuda: no CUDA device is available; valid here: cpu, meta")
        try:
            report = run_validate(run, device=device, world=world, steps=steps, rank=rank, tolerance=tolerance,
                                  timeout=timeout, seq_lengths=seq_lengths)
        except Unsupported as e:
            raise InputError(str(e)) from None
        except RankFailure as e:
            first = str(e).strip().splitlines()[0]
            raise InputError(f"the run failed: {first}") from None
        # under torchrun every process holds the gathered report: only global rank 0 prints it
        quiet = _this_process_rank(report) not in (None, 0)
        if quiet:
            pass
        elif json_out:
            sys.stdout.write(json.dumps(report, indent=2, default=_json_default) + "\n")
        else:
            sys.stdout.write(render(report) + "\n")
        if not report["within_tolerance"]:
            raise typer.Exit(1)


def _this_process_rank(report: dict[str, Any]) -> int | None:
    for key in ("extra", "run"):
        block = report.get(key)
        if isinstance(block, dict) and "this_process_rank" in block:
            return block["this_process_rank"]
    return report.get("this_process_rank")


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, tuple)):
        return sorted(o)
    raise TypeError(type(o).__name__)
