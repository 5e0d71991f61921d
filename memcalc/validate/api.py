"""`validate(run, ...)`: predict, run, measure, compare. Used by the CLI, the tests and scripts/validation_matrix.py."""

from __future__ import annotations

import time
from typing import Any

from memcalc.specs import Run


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def validate(run: Run, *, device: str = "auto", world: str = "real", steps: int = 1, warmup: int = 2,
             rank: int | None = None, tolerance: float = 0.03, timeout: float = 300.0) -> dict[str, Any]:
    """Raises parallelize.Unsupported (a configuration the harness cannot build) and runner.RankFailure."""
    from memcalc.cost.estimate import estimate
    from memcalc.errors import InputError
    from memcalc.validate.compare import compare
    from memcalc.validate.parallelize import check_supported, mesh_coords
    from memcalc.validate.runner import run_world

    device = resolve_device(device)
    check_supported(run, world, device)
    from memcalc.validate.runner import launched_by_torchrun as _under_torchrun

    if world == "real" and device == "cuda" and not _under_torchrun():
        import torch

        if torch.cuda.device_count() < int(run.gpus):
            raise InputError(f"--world real needs {run.gpus} GPUs, this machine has {torch.cuda.device_count()}; "
                             "use --world fake")
    head = estimate(run, advice=False)
    if rank is None:
        rank = int(head.memory.worst_rank)
    if not 0 <= rank < int(run.gpus):
        raise InputError(f"--rank {rank} is not a rank of this layout; valid: 0..{int(run.gpus) - 1}")
    stage = mesh_coords(run, rank)["pp"]
    est = estimate(run, stage=stage, advice=False)
    warmup = max(warmup, 2)  # DDP rebuilds its buckets at the second step
    if run.training.peak_step == "first":
        # the run's first micro-batch and first optimizer step: measured from the start, nothing before it
        if int(run.grad_accum) > 1:
            raise InputError(f"--peak-step first is validated with one micro-batch per step (got --grad-accum "
                             f"{run.grad_accum}): the harness's later micro-batches are as long as the first")
        warmup, steps = 0, 1
    t0 = time.perf_counter()
    from memcalc.validate.runner import launched_by_torchrun, run_torchrun_rank

    if world == "real" and launched_by_torchrun():
        # torchrun on the user's own cluster: this process is one rank; every rank measures, all gather
        this_rank, results = run_torchrun_rank(run, device=device, steps=steps, warmup=warmup)
        torchrun_rank: int | None = this_rank
    else:
        results = run_world(run, world=world, device=device, steps=steps, warmup=warmup, ranks=[rank],
                            timeout=timeout)
        torchrun_rank = None
    wall = time.perf_counter() - t0
    meas = results[rank]
    extra = {
        "rank": rank,
        "stage": stage,
        "device": device,
        "world": world,
        "seconds": round(wall, 2),
        "all_ranks_peak_bytes": {str(r): v["peak_bytes"] for r, v in sorted(results.items())},
        "launcher": "torchrun" if torchrun_rank is not None else "memcalc",
        "this_process_rank": torchrun_rank,
    }
    from memcalc.cost.estimate import resolved_inputs

    return compare(est, meas, device, tolerance, inputs=resolved_inputs(run), extra=extra, run=run)
