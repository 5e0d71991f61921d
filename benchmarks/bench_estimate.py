"""Prints how long `memcalc estimate` takes: the whole process (what a shell loop or CI pays) and one in-process
estimate (what the planner and library users pay). Targets (issue 2): whole process under 150 ms, in-process
cost evaluation under 100 microseconds.

    python benchmarks/bench_estimate.py
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time


# An installed package has its bytecode compiled (pip compiles it at install time; an editable install writes it
# on first import). PYTHONDONTWRITEBYTECODE=1, set on some CI images and sandboxes, leaves an editable install
# recompiling every module on every run (+70-150 ms here): measure what a user's install pays, after one warm run.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def whole_process(cmd: list[str], repeats: int = 10) -> list[float]:
    subprocess.run(cmd, check=True, capture_output=True, env=ENV)  # writes the bytecode cache
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=ENV)
        times.append(time.perf_counter() - t)
    return times


def in_process(repeats: int = 2000) -> dict[str, float]:
    from memcalc.cost import compute
    from memcalc.cost.estimate import estimate
    from memcalc.cost.timeline import stage_memory
    from memcalc.options import RunOptions, build_run

    run = build_run(RunOptions(params="7B", zero=3, gpus=64))
    out = {}
    for name, fn in (
        ("cost model: stage_memory (memory timeline of one stage)", lambda: stage_memory(run, 0)),
        ("cost model: step_seconds (collectives + compute)",
         lambda: getattr(compute, "step_seconds", lambda r: None)(run)),
        ("full Estimate object (pydantic, all stages, comm, advice)", lambda: estimate(run)),
        ("full Estimate object without advice", lambda: estimate(run, advice=False)),
    ):
        fn()
        n = repeats if "Estimate" not in name else repeats // 10
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t) / n
    return out


def main() -> None:
    exe = shutil.which("memcalc")
    memcalc = [exe] if exe else [sys.executable, "-m", "memcalc"]
    args = ["estimate", "--params", "7B", "--zero", "3", "--gpus", "64"]
    for label, a in (("table", args), ("--json", args + ["--json"])):
        ts = whole_process(memcalc + a)
        print(f"whole process, memcalc {' '.join(a)}: median {statistics.median(ts) * 1e3:.0f} ms, "
              f"min {min(ts) * 1e3:.0f} ms  [target < 150 ms] ({label})")
    # the floor under it on this machine: the interpreter, and the three libraries the CLI is built on
    for label, code in (("python -c pass", "pass"),
                        ("import pydantic, typer, rich.console", "import pydantic, typer, rich.console")):
        ts = whole_process([sys.executable, "-c", code])
        print(f"whole process, {label}: median {statistics.median(ts) * 1e3:.0f} ms (floor)")
    for name, sec in in_process().items():
        print(f"in-process, {name}: {sec * 1e6:.1f} us")
    print("in-process target: the cost evaluation (stage_memory + step_seconds) under 100 us")


if __name__ == "__main__":
    main()
