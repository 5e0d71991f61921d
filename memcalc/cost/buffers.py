"""Buffers and temporaries per profile (placeholder until the buffer model lands)."""

from __future__ import annotations

import dataclasses
from typing import Any

from memcalc.specs import Run

Num = Any


@dataclasses.dataclass(frozen=True, slots=True)
class Buffer:
    bytes: Num
    phases: frozenset[str]  # subset of {"forward", "backward", "optimizer"}: live at that phase's peak moment
    note: str = ""


def stage_buffers(run: Run, stage: Num = 0) -> dict[str, Buffer]:
    return {}
