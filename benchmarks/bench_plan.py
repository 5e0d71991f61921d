"""How fast is `memcalc plan`? Configurations per second and wall time of whole searches (DESIGN section 7;
docs/plan.md). Calculon's exhaustive search of GPT-3 175B on 4096 A100-80GB evaluated about 300 configurations
per second (research/peers.md); the target here is each whole search under 2 s on one core.

    python benchmarks/bench_plan.py            # one core: run it under `taskset -c 0` to be sure
    python benchmarks/bench_plan.py --repeat 5

Cases:
  (a) GPT-3 175B on 4096 A100-80GB, global batch 2048, seq 2048, Megatron profile, every axis auto;
  (b) Llama-2-70B on 1024 H100-SXM, global batch 1024, seq 4096, every axis auto.
"search" is the bulk search alone (enumeration, memory, time, counts); "plan" adds ranking, the Pareto front and
the re-run of the top 5 through `estimate` (what `memcalc plan --json` does, minus printing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

from memcalc.options import RunOptions  # noqa: E402
from memcalc.plan.search import Request, plan, search  # noqa: E402

CASES = {
    "gpt3-175b x 4096 a100-80gb": RunOptions(model="gpt3-175b", gpus=4096, gpu="a100-80gb", global_batch=2048,
                                             seq=2048, profile="megatron"),
    "llama-2-70b x 1024 h100-sxm": RunOptions(model="llama-2-70b", gpus=1024, gpu="h100-sxm-80gb", global_batch=1024,
                                              seq=4096),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    print(f"CPU cores available to this process: {cores}")
    search(Request(next(iter(CASES.values()))))  # warm imports
    for name, opts in CASES.items():
        s_times, p_times = [], []
        res = None
        for _ in range(args.repeat):
            t = time.perf_counter()
            res = search(Request(opts))
            s_times.append(time.perf_counter() - t)
            t = time.perf_counter()
            plan(Request(opts, top=5))
            p_times.append(time.perf_counter() - t)
        assert res is not None
        s, p = statistics.median(s_times), statistics.median(p_times)
        print(f"{name}: considered {res.considered:,}, evaluated {res.evaluated:,}, feasible {res.feasible.size:,}")
        print(f"  search {s:.3f} s (median of {args.repeat}): {res.evaluated / s:,.0f} evaluated/s, "
              f"{res.considered / s:,.0f} considered/s")
        print(f"  plan (search + top 5 through estimate + Pareto) {p:.3f} s; "
              f"{'within' if p < 2.0 else 'OVER'} the 2 s target")


if __name__ == "__main__":
    main()
