"""Communication per step (placeholder until the communication model lands)."""

from __future__ import annotations

from typing import Any

from memcalc.specs import Run


def collectives(run: Run) -> list[Any]:
    return []


def communication_out(run: Run, colls: list[Any]) -> Any:
    from memcalc.cost.estimate import Communication

    return Communication(modelled=False, collectives=[], bytes_per_step=0, seconds_per_step=0.0,
                         exposed_seconds_per_step=0.0)
