"""FLOPs and step time (placeholder until the compute model lands)."""

from __future__ import annotations

from typing import Any

from memcalc.specs import Run


def compute_out(run: Run, colls: list[Any]) -> Any:
    from memcalc.cost.estimate import Compute

    return Compute(modelled=False, flops_per_step=0.0, flops_per_token=0.0, tokens_per_step=run.global_batch * run.seq,
                   compute_seconds=0.0, bubble_seconds=0.0, exposed_comm_seconds=0.0, step_seconds=0.0,
                   tokens_per_second=0.0, mfu=0.0, assumed_mfu=run.training.mfu or run.hardware.default_mfu)
