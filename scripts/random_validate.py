"""Random configurations through `memcalc validate`: where the matrix (scripts/validation_matrix.py) holds the cases
someone thought of, this draws tiny models across precision, recompute, attention, dropout, LoRA, model-code knobs
and layouts, measures each on fake tensors (a fake process group; CPU tensors for Ulysses) and prints those whose
predicted phases miss the measured ones. Each line it prints is a `{"opts": ...}` record that
`memcalc.options.RunOptions(**opts)` rebuilds, to trace op by op.

    .venv/bin/python scripts/random_validate.py --seed 1 --draws 200 [--bar 0.5] [--jsonl out.jsonl]

A draw the harness cannot run (`Unsupported`) or that `estimate` refuses (`InputError`) is skipped; a run that
fails otherwise is printed as FAIL. In session 50 (2026-11-29) such rounds found the moments now in
docs/validation.md rows 242-249 and two crashes of `estimate`/`plan`."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYOUTS = {
    "single": {}, "tp": dict(gpus=2, tp=2), "tp-sp": dict(gpus=2, tp=2, sp=True), "fsdp2": dict(gpus=2, zero=2),
    "fsdp3": dict(gpus=4, zero=3), "pp": dict(gpus=2, pp=2, grad_accum=2), "fsdp3-tp": dict(gpus=4, zero=3, tp=2),
    "ulysses": dict(gpus=2, cp=2, cp_comm="a2a"),
}


def draw(rng: random.Random) -> tuple[dict[str, Any], str]:
    """One configuration (RunOptions fields) and the device its harness run takes."""
    heads = rng.choice((4, 8))
    o: dict[str, Any] = dict(
        layers=rng.choice((2, 3, 4)), hidden=rng.choice((64, 128, 256, 512)), heads=heads,
        kv_heads=rng.choice([g for g in (1, 2, 4, 8) if heads % g == 0]), ffn=rng.choice((176, 256, 512, 1024)),
        vocab=rng.choice((256, 512, 1000)), seq=rng.choice((64, 128, 256, 512, 1024)),
        precision=rng.choice(("fp32", "bf16")), recompute=rng.choice(("none", "selective", "full", "op")),
        attention=rng.choice(("flash", "flash", "eager")), micro_batch=rng.choice((1, 1, 2)),
        optimizer=rng.choice(("adamw", "sgd")))
    for field, value, p in (("master_weights", False, 0.3), ("dropout", 0.1, 0.25), ("mlp", "gelu", 0.2),
                            ("norm", "layernorm", 0.2), ("norm_impl", "fp32", 0.2), ("qkv_impl", "fused", 0.15),
                            ("gqa_impl", "expand", 0.15), ("tied_embeddings", True, 0.15), ("grad_accum", 2, 0.2),
                            ("loss", rng.choice(("chunked", "chunked-eager")), 0.15)):
        if rng.random() < p:
            o[field] = value
    if rng.random() < 0.15:
        o.update(lora_rank=4, lora_targets=rng.choice(("attn", "all", "qv")), lora_dropout=rng.choice((0.0, 0.1)))
    layout = rng.choice(sorted(LAYOUTS))
    o.update(LAYOUTS[layout])
    return o, "cpu" if layout == "ulysses" else "meta"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--bar", type=float, default=0.5, help="print runs whose worst phase misses by more (percent)")
    ap.add_argument("--jsonl", help="also write every run's record here")
    args = ap.parse_args()

    from memcalc.errors import InputError
    from memcalc.options import RunOptions, build_run
    from memcalc.validate.api import validate
    from memcalc.validate.parallelize import Unsupported

    rng = random.Random(args.seed)
    out = open(args.jsonl, "w") if args.jsonl else None
    ran = shown = 0
    t0 = time.perf_counter()
    for _ in range(args.draws):
        opts, device = draw(rng)
        try:
            run = build_run(RunOptions(**opts))
            rep = validate(run, device=device, world="fake", tolerance=0.02, timeout=120)
        except (InputError, Unsupported):
            continue
        except Exception as e:  # a crash is a finding too
            print(json.dumps({"opts": opts, "device": device, "fail": f"{type(e).__name__}: {e}"[:300]}), flush=True)
            shown += 1
            continue
        ran += 1
        phases = {r["name"]: (r["predicted"], r["measured"]) for r in rep["rows"] if r["section"] == "phases"}
        worst = max(abs(p - m) / m for p, m in phases.values())
        record = {"opts": opts, "device": device, "worst_phase_pct": round(100 * worst, 3),
                  "phases": {k: {"predicted": p, "measured": m} for k, (p, m) in phases.items()}}
        if out:
            out.write(json.dumps(record) + "\n")
        if 100 * worst > args.bar:
            print(json.dumps(record), flush=True)
            shown += 1
    print(f"{ran} runs, {shown} shown, {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
