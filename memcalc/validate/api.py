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


def resolve_seq_lengths(spec: str | None, run: Run, micro_batches: int) -> tuple[int, ...] | None:
    """The length of every micro-batch the harness runs, from `--seq-lengths`:
    - None: every micro-batch is `--seq` tokens (fixed shapes);
    - "L1,L2,...": the micro-batches take these lengths in turn (the list repeats);
    - "random:MIN": each micro-batch padded to the longest of its `--micro-batch` samples, whose lengths are drawn
      uniformly from MIN..--seq (a dataset's samples under a dynamic-padding collate such as torchtune's
      `padded_collate`); seeded, so a run is reproducible.
    Raises InputError naming the value."""
    from memcalc.errors import InputError

    if spec is None:
        return None
    seq = int(run.seq)
    text = spec.strip().lower()
    if text.startswith("random:"):
        try:
            low = int(text.removeprefix("random:"))
        except ValueError:
            raise InputError(f"--seq-lengths {spec!r}: after 'random:' give the shortest sample length, "
                             f"an integer in 1..{seq}") from None
        if not 1 <= low <= seq:
            raise InputError(f"--seq-lengths {spec!r}: the shortest sample length must be in 1..{seq} (--seq)")
        import random

        rng = random.Random(0)
        b = int(run.micro_batch)
        lengths = tuple(max(rng.randint(low, seq) for _ in range(b)) for _ in range(micro_batches))
    else:
        try:
            lengths = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise InputError(f"--seq-lengths {spec!r} is not valid; valid: comma-separated lengths (448,480,512) "
                             f"or random:MIN") from None
        bad = [n for n in lengths if not 1 <= n <= seq]
        if bad:
            raise InputError(f"--seq-lengths: {bad[0]} is not a length in 1..{seq} (--seq)")
        lengths = tuple(lengths[i % len(lengths)] for i in range(micro_batches))
    if run.pp > 1 or run.cp > 1:
        raise InputError("--seq-lengths runs in the harness without pipeline or context parallelism (pp = cp = 1): "
                         "their schedules and sequence chunks have fixed shapes")
    if run.sp and run.tp > 1 and any(n % run.tp for n in lengths):
        n = next(n for n in lengths if n % run.tp)
        raise InputError(f"--seq-lengths: {n} is not divisible by --tp {run.tp}, which sequence parallelism "
                         "needs")
    return lengths


def keep_lower_peak(first: dict[str, Any], again: Any) -> tuple[dict[str, Any], int | None]:
    """One rank's measurement, and the other run's peak in bytes where it was measured twice. A run whose peak
    counts bytes that gloo's worker thread had not yet let go of (`late_free_bytes`, measure.Tracker.late_frees)
    is measured again by `again()`; that lag only ever adds bytes, so the lower peak of the two is kept."""
    if not first.get("late_free_bytes"):
        return first, None
    second = again()
    kept, other = (second, first) if second["peak_bytes"] < first["peak_bytes"] else (first, second)
    return kept, int(other["peak_bytes"])


def validate(run: Run, *, device: str = "auto", world: str = "real", steps: int = 1, warmup: int = 2,
             rank: int | None = None, tolerance: float = 0.03, timeout: float = 300.0,
             seq_lengths: str | None = None) -> dict[str, Any]:
    """The report of one rank (None: the predicted worst). Raises parallelize.Unsupported (a configuration the
    harness cannot build) and runner.RankFailure. `seq_lengths`: `--seq-lengths` (resolve_seq_lengths); the
    prediction stays the one for --seq tokens."""
    reports = validate_ranks(run, ranks=None if rank is None else [rank], device=device, world=world, steps=steps,
                             warmup=warmup, tolerance=tolerance, timeout=timeout, seq_lengths=seq_lengths)
    return next(iter(reports.values()))


def validate_ranks(run: Run, *, ranks: list[int] | None, device: str = "auto", world: str = "real",
                   steps: int = 1, warmup: int = 2, tolerance: float = 0.03, timeout: float = 300.0,
                   seq_lengths: str | None = None) -> dict[int, dict[str, Any]]:
    """`validate`'s report for each rank of `ranks` (None: the predicted worst), each against its own pipeline
    stage's prediction. A real world measures every rank in one run; a fake world runs each rank on its own."""
    from memcalc.cost.estimate import estimate, resolved_inputs
    from memcalc.errors import InputError
    from memcalc.validate.compare import compare
    from memcalc.validate.parallelize import check_supported, mesh_coords
    from memcalc.validate.runner import launched_by_torchrun, run_torchrun_rank, run_world

    device = resolve_device(device)
    check_supported(run, world, device)
    if world == "real" and device == "cuda" and not launched_by_torchrun():
        import torch

        if torch.cuda.device_count() < int(run.gpus):
            raise InputError(f"--world real needs {run.gpus} GPUs, this machine has {torch.cuda.device_count()}; "
                             "use --world fake")
    if ranks is None:
        ranks = [int(estimate(run, advice=False).memory.worst_rank)]
    for rank in ranks:
        if not 0 <= rank < int(run.gpus):
            raise InputError(f"--rank {rank} is not a rank of this layout; valid: 0..{int(run.gpus) - 1}")
    warmup = max(warmup, 2)  # DDP rebuilds its buckets at the second step
    if run.training.peak_step == "first":
        # the run's first micro-batch and first optimizer step: measured from the start, nothing before it
        if int(run.grad_accum) > 1:
            raise InputError(f"--peak-step first is validated with one micro-batch per step (got --grad-accum "
                             f"{run.grad_accum}): the harness's later micro-batches are as long as the first")
        warmup, steps = 0, 1
    lengths = resolve_seq_lengths(seq_lengths, run, (warmup + steps) * int(run.grad_accum))
    t0 = time.perf_counter()
    other_peaks: dict[int, int | None] = {r: None for r in ranks}
    if world == "real" and launched_by_torchrun():
        # torchrun on the user's own cluster: this process is one rank; every rank measures, all gather
        this_rank, results = run_torchrun_rank(run, device=device, steps=steps, warmup=warmup,
                                               seq_lengths=lengths)
        torchrun_rank: int | None = this_rank
    else:
        def measure() -> dict[int, dict[str, Any]]:
            return run_world(run, world=world, device=device, steps=steps, warmup=warmup, ranks=ranks,
                             timeout=timeout, seq_lengths=lengths)

        results = measure()
        second: list[dict[int, dict[str, Any]]] = []  # one more run at most, shared by the ranks

        def again(rank: int) -> dict[str, Any]:
            if not second:
                second.append(measure())
            return second[0][rank]

        for rank in ranks:
            kept, other_peaks[rank] = keep_lower_peak(results[rank], lambda rank=rank: again(rank))
            results = {**results, rank: kept}  # (the other ranks' figures stay the first run's)
        torchrun_rank = None
    wall = time.perf_counter() - t0
    estimates: dict[int, Any] = {}
    reports = {}
    for rank in ranks:
        stage = mesh_coords(run, rank)["pp"]
        if stage not in estimates:
            estimates[stage] = estimate(run, stage=stage, advice=False)
        extra = {
            "rank": rank,
            "stage": stage,
            "device": device,
            "world": world,
            "seconds": round(wall, 2),
            "all_ranks_peak_bytes": {str(r): v["peak_bytes"] for r, v in sorted(results.items())},
            "launcher": "torchrun" if torchrun_rank is not None else "memcalc",
            "this_process_rank": torchrun_rank,
            # the micro-batches' lengths, warm-up included (null: every one is --seq tokens)
            "seq_lengths": list(lengths) if lengths is not None else None,
            # the other run's peak where gloo's worker thread held bytes at the first run's peak and the run was
            # measured twice (keep_lower_peak); null: measured once
            "remeasured_other_peak_bytes": other_peaks[rank],
        }
        reports[rank] = compare(estimates[stage], results[rank], device, tolerance, inputs=resolved_inputs(run),
                                extra=extra, run=run)
    return reports
