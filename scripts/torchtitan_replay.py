"""torchtitan's December 2024 H100 benchmark runs, replayed: memcalc's harness runs each layout on fake tensors (no
GPU, no compute; every allocation's size exact) and the CUDA caching allocator is replayed over what it allocates,
under both policies, beside memcalc's closed-form reserved figure.

    python scripts/torchtitan_replay.py --json docs/data/torchtitan-replay.json     # about 2 minutes on one core

Source of the published figures: pytorch/torchtitan `benchmarks/llama3_h100_202412_torchtitan.md` (torchtitan
9dec370, torch 1963fc8), "Memory(GiB)" = max over ranks of `max_memory_reserved` (docs/published-measurements.md,
section 2). The rows replayed are those the harness builds: Tables 1 and 3 (FSDP, selective op AC, eager), Table 2's
CP 1 row and Table 4 (FSDP 32 x TP 8); Table 2's CP > 1 rows use ring attention (torch `context_parallel`), which
the harness does not build. Tables 2 and 4 ran torch.compile and Float8 inside the blocks; the harness runs the
blocks eager in bf16 (memcalc's allocated figures are the same for fp8 and bf16 here: fp8 is modelled in bf16).

What the replay is: memcalc/validate/allocator.py, `CachingAllocator` (the default policy) and
`ExpandableAllocator` (`expandable_segments:True`), over the harness's allocation log, per stream (FSDP2's
all-gather and reduce-scatter streams apart), with cuBLAS's two workspaces. It was checked against an H100's
`max_memory_reserved()` to the byte on the FSDP2 runs of docs/validation.md ("On a GPU"). The harness's allocated
peak equals memcalc's (`tracked_peak_bytes`), so what differs between `replay_*` and `estimate_*` is the allocator.

`segments_at_peak`: the default policy's segments at the allocated peak of the measured step, by segment size
(count, bytes reserved, bytes allocated in them): where the reserved-minus-allocated gap sits.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# case id (as in tests/test_published_peaks.py), published GiB, memcalc's flags for the run (H100 96 GB, torch
# profile: FSDP2 with bf16 params and fp32 reduce, foreach AdamW)
ROWS: list[tuple[str, float, dict[str, Any]]] = [
    ("torchtitan-8b-fsdp8-lbs2-sac", 82.4,
     dict(model="llama-3.1-8b", gpus=8, zero=3, seq=8192, micro_batch=2, recompute="op")),
    ("torchtitan-8b-fsdp128-lbs2-sac", 67.0,
     dict(model="llama-3.1-8b", gpus=128, zero=3, seq=8192, micro_batch=2, recompute="op")),
    ("torchtitan-8b-fsdp8-cp1-32k-full-fp8-compile", 83.9,
     dict(model="llama-3.1-8b", gpus=8, zero=3, seq=32768, micro_batch=1, recompute="full")),
    ("torchtitan-70b-fsdp32-tp8-lbs16-full-fp8-compile", 71.9,
     dict(model="llama-3.1-70b", gpus=256, tp=8, sp=True, zero=3, seq=8192, micro_batch=16, recompute="full")),
]
COMMON = dict(precision="bf16", memory="96GB", profile="torch")
GIB = 2**30


def _flags(opts: dict[str, Any]) -> str:
    out = []
    for k, v in {**opts, **COMMON}.items():
        flag = "--" + k.replace("_", "-")
        out.append(flag if v is True else f"{flag} {v}")
    return " ".join(out)


def _census(log: dict[str, Any]) -> dict[str, list[int]]:
    """The default policy's segments at the measured step's allocated peak, by segment size: [count, reserved,
    allocated]. Two passes over the log (allocator.drive): the first finds the peak's event, the second stops
    there."""
    from memcalc.validate.allocator import CachingAllocator, drive

    args = (log["events"], log["marks"], log["extra"], log["streams"], log["compute_stream"])
    at = drive(CachingAllocator(), *args)
    a = CachingAllocator()
    drive(a, *args, stop=at)
    out: dict[str, list[int]] = {}
    for start, (size, _pool) in a._segments.items():
        used, b = 0, a._by_addr[start]
        while b is not None:
            used += 0 if b.free else b.size
            b = b.next
        row = out.setdefault(str(size), [0, 0, 0])
        row[0] += 1
        row[1] += size
        row[2] += used
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))


def replay_row(opts: dict[str, Any]) -> dict[str, Any]:
    import memcalc.validate.allocator as allocator
    from memcalc.cost.estimate import estimate
    from memcalc.options import RunOptions, build_run
    from memcalc.validate.api import validate

    run = build_run(RunOptions(**opts, **COMMON))
    est = {a: estimate(build_run(RunOptions(**opts, **COMMON, allocator=a)), advice=False).memory
           for a in ("default", "expandable")}
    # the harness replays its own log (allocator.replay_log); keep a copy of it for the census, from the process
    # that measures (a forked child)
    keep = Path(tempfile.mkdtemp()) / "log.pkl"
    original = allocator.replay_log

    def keeping(events, marks, extra=None, streams=None, compute_stream=0, expandable=False):  # noqa: ANN001
        if not expandable:
            keep.write_bytes(pickle.dumps(dict(events=events, marks=marks, extra=dict(extra or {}),
                                               streams=streams, compute_stream=compute_stream)))
        return original(events, marks, extra, streams, compute_stream, expandable)

    allocator.replay_log = keeping
    try:
        t0 = time.perf_counter()
        report = validate(run, device="meta", world="fake")
        seconds = time.perf_counter() - t0
    finally:
        allocator.replay_log = original
    log = pickle.loads(keep.read_bytes())
    rep = report["measured"]["allocator_replay"]
    return {
        "tracked_peak_bytes": int(report["measured"]["peak_bytes"]),
        "predicted_allocated_bytes": int(est["default"].allocated_peak_bytes),
        "replay_default_reserved_bytes": int(rep["reserved_peak_bytes"]),
        "replay_expandable_reserved_bytes": int(rep["expandable_reserved_peak_bytes"]),
        "estimate_default_reserved_bytes": int(est["default"].reserved_peak_bytes),
        "estimate_expandable_reserved_bytes": int(est["expandable"].reserved_peak_bytes),
        "segments_at_peak": _census(log),
        "seconds": round(seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the record here")
    ap.add_argument("--only", help="comma-separated case ids")
    args = ap.parse_args()
    os.environ.setdefault("MEMCALC_VALIDATE_START", "fork")  # the log is kept from the measuring process
    import torch

    rows = [r for r in ROWS if not args.only or r[0] in args.only.split(",")]
    out = {"source": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (9dec370)",
           "counter": "max over ranks of torch.cuda.max_memory_reserved(), GiB", "torch": torch.__version__,
           "rows": []}
    for case, published, opts in rows:
        r = {"case": case, "published_gib": published, "flags": _flags(opts), "options": {**opts, **COMMON},
             **replay_row(opts)}
        out["rows"].append(r)
        err = {k: (r[k] / GIB - published) / published for k in
               ("replay_default_reserved_bytes", "replay_expandable_reserved_bytes",
                "estimate_default_reserved_bytes", "estimate_expandable_reserved_bytes")}
        print(f"{case}: published {published} GiB; replay default {r['replay_default_reserved_bytes'] / GIB:.2f} "
              f"({err['replay_default_reserved_bytes']:+.1%}), expandable "
              f"{r['replay_expandable_reserved_bytes'] / GIB:.2f} ({err['replay_expandable_reserved_bytes']:+.1%}); "
              f"estimate default {r['estimate_default_reserved_bytes'] / GIB:.2f} "
              f"({err['estimate_default_reserved_bytes']:+.1%}), expandable "
              f"{r['estimate_expandable_reserved_bytes'] / GIB:.2f} "
              f"({err['estimate_expandable_reserved_bytes']:+.1%}); {r['seconds']} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
