"""`--plot FILE.png`: per-GPU memory by component (stacked bars) against the swept value, with the GPU's capacity
as a line. Needs the optional `plot` extra (matplotlib); without it, one line and exit 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memcalc.errors import InputError
from memcalc.report.formats import COMPONENTS, LABELS
from memcalc.units import UNIT_BYTES


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib, which is not installed: pip install 'memcalc[plot]'") from None
    return plt


def plot_points(points: list[Any], path: str, units: str = "GiB") -> Path:
    """points: memcalc.sweep.SweepPoint (or anything with .value, .estimate, .flag). Invalid points are left out."""
    plt = _pyplot()
    target = Path(path).expanduser()
    if not target.parent.exists():
        raise InputError(f"--plot {path!r}: folder {str(target.parent)!r} does not exist")
    valid = [p for p in points if p.estimate is not None]
    if not valid:
        raise InputError("--plot: no valid configuration to draw")
    div = UNIT_BYTES[units]
    labels = [str(p.value) for p in valid]
    xs = list(range(len(valid)))
    fig, ax = plt.subplots(figsize=(max(7.5, 3.5 + 0.8 * len(valid)), 4.5))
    bottom = [0.0] * len(valid)
    for c in COMPONENTS:
        vals = [p.estimate.memory.components.get(c, 0) / div if c not in p.estimate.memory.not_modelled else 0.0
                for p in valid]
        if not any(vals):
            continue
        ax.bar(xs, vals, bottom=bottom, label=LABELS[c], width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    # what the peak holds beyond the itemised components (components not modelled yet but already counted)
    rest = [max(0.0, p.estimate.memory.peak_bytes / div - b) for p, b in zip(valid, bottom)]
    if any(r > 1e-3 for r in rest):
        ax.bar(xs, rest, bottom=bottom, label="other (not itemised)", width=0.6, color="lightgrey")
    caps = [p.estimate.memory.capacity_bytes / div for p in valid]
    ax.axhline(max(caps), color="red", linestyle="--", linewidth=1.2, label=f"capacity ({max(caps):,.1f} {units})")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels)
    flag = valid[0].flag if hasattr(valid[0], "flag") else ""
    ax.set_xlabel(flag or "configuration")
    ax.set_ylabel(f"per-GPU memory ({units})")
    est0 = valid[0].estimate
    ax.set_title(f"{est0.inputs['model']['display_name']} · profile {est0.inputs['profile']}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    try:
        fig.savefig(target)
    except (OSError, ValueError) as e:
        raise InputError(f"--plot {path!r} cannot be written: {' '.join(str(e).split())}") from None
    finally:
        plt.close(fig)
    return target
