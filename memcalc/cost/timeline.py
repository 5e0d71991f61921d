"""Memory over a training step for one rank of one pipeline stage: the peak is a maximum over phases, not a sum
of components (DESIGN section 4, "Peak over a timeline").

Contract used by estimate.py and the planner (array-polymorphic like the rest of the cost model):
`stage_memory(run, stage) -> StageMemory` with one `Phase` per moment of the step, each giving the bytes live
per category at that moment. `allocated_peak` is the elementwise maximum of the phase totals.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memcalc.cost.states import ModelStates, model_states
from memcalc.specs import Run
from memcalc.xp import imax

Num = Any

CATEGORIES: tuple[str, ...] = ("params", "master_weights", "grads", "optimizer", "activations", "buffers")


@dataclasses.dataclass(frozen=True, slots=True)
class Phase:
    name: str  # "forward" (end of forward), "backward" (peak during backward), "optimizer" (optimizer step)
    live: dict[str, Num]  # category (CATEGORIES) -> bytes live at this phase's highest moment
    note: str = ""

    @property
    def total(self) -> Num:
        t = 0
        for v in self.live.values():
            t = t + v
        return t


@dataclasses.dataclass(frozen=True, slots=True)
class StageMemory:
    stage: Num
    states: ModelStates
    phases: tuple[Phase, ...]
    activations_detail: dict[str, Num]  # named terms, bytes
    buffers_detail: dict[str, Num]  # named buffers, bytes
    not_modelled: tuple[str, ...]  # components the model does not yet cover (said explicitly, never a silent 0)

    @property
    def allocated_peak(self) -> Num:
        peak = self.phases[0].total
        for ph in self.phases[1:]:
            peak = imax(peak, ph.total)
        return peak


def stage_memory(run: Run, stage: Num = 0) -> StageMemory:
    s = model_states(run, stage)
    grads = s.grads + s.grads_fp32
    base = {"params": s.params, "master_weights": s.master_weights, "optimizer": s.optimizer}
    fwd_grads = grads if s.grads_persistent else 0 * grads
    phases = (
        Phase("forward", {**base, "grads": fwd_grads, "activations": 0, "buffers": 0}),
        Phase("backward", {**base, "grads": grads, "activations": 0, "buffers": 0}),
        Phase("optimizer", {**base, "grads": grads, "activations": 0, "buffers": 0}),
    )
    return StageMemory(
        stage=stage,
        states=s,
        phases=phases,
        activations_detail={},
        buffers_detail={},
        not_modelled=("activations", "buffers", "fragmentation"),
    )
