"""Batch-size guidance: the batch arithmetic made explicit and, given a reference run, the learning rate under the
linear scaling rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD", sec. 2.1: lr proportional to batch, with
a gradual warm-up) and the square-root rule for adaptive optimizers (Malladi et al. 2022, "On the SDEs and Scaling
Rules for Adaptive Gradient Algorithms": Adam's lr scales with sqrt(batch); also Hoffer et al. 2017). Warm-up is
kept at the same number of samples as the reference: steps scale with base_batch / global_batch.
"""

from __future__ import annotations

import math
from typing import Any

from memcalc.specs import Run


def batch_guidance(run: Run) -> dict[str, Any]:
    t = run.training
    out: dict[str, Any] = {
        "micro_batch": run.micro_batch,
        "grad_accum": run.grad_accum,
        "dp": run.dp,
        "global_batch": run.global_batch,
        "formula": f"global batch = micro-batch {run.micro_batch} x grad-accum {run.grad_accum} x dp {run.dp}",
        "tokens_per_step": run.global_batch * run.seq,
        "base_lr": t.base_lr,
        "base_batch": t.base_batch,
        "lr_linear": None,
        "lr_sqrt": None,
        "recommended_rule": None,
        "warmup_steps": None,
    }
    if t.base_lr is not None and t.base_batch is not None:
        k = run.global_batch / t.base_batch
        out["lr_linear"] = t.base_lr * k
        out["lr_sqrt"] = t.base_lr * math.sqrt(k)
        adaptive = t.optimizer in ("adam", "adamw", "adam-8bit", "adafactor", "lion")
        out["recommended_rule"] = "sqrt" if adaptive else "linear"
        if t.base_warmup_steps is not None:
            out["warmup_steps"] = math.ceil(t.base_warmup_steps * t.base_batch / run.global_batch)
    return out
