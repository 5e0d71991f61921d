"""Memory over a training step for one rank of one pipeline stage: the peak is a maximum over phases, not a sum
of components (DESIGN section 4, "Peak over a timeline").

Contract used by estimate.py and the planner (array-polymorphic like the rest of the cost model):
`stage_memory(run, stage) -> StageMemory` with one `Phase` per moment of the step, each giving the bytes live
per category at that moment. `allocated_peak` is the elementwise maximum of the phase totals.

Phases (docs/methodology.md, "Timeline"):
- forward: the end of the last forward before a backward. Model states; gradients only where the framework keeps
  them allocated between steps (`ModelStates.grads_persistent`: Megatron's and DeepSpeed's contiguous buffers;
  torch's `zero_grad(set_to_none=True)` frees them); the activations saved by every in-flight micro-batch plus the
  forward transient (the logits at the loss on the last stage, or context-parallel ring buffers).
- backward: the highest moment of backward. Within one micro-batch's backward, activations fall and gradients
  rise roughly linearly, so the maximum is at its start or its end. Candidates: the start of the stage's first
  backward (all in-flight activations + logits gradient / recompute re-materialisation; gradients only if
  persistent) and the start of a later backward (fewer or as many activations, all gradients allocated), which
  also bounds the end of the first one. With persistent gradients the first start is the maximum.
- optimizer: no activations; all gradients and the optimizer's temporaries (buffers).
Buffers (memcalc/cost/buffers.py) add their bytes to the phases each one names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memcalc.cost.activations import stage_activations
from memcalc.cost.buffers import stage_buffers
from memcalc.cost.states import ModelStates, model_states
from memcalc.specs import Run
from memcalc.xp import imax, where

Num = Any

CATEGORIES: tuple[str, ...] = ("params", "master_weights", "grads", "optimizer", "activations", "buffers")

# Components the cost model does not cover (said in table and JSON, never a silent zero). Activations, buffers
# (cost/buffers.py) and fragmentation (cost/fragmentation.py) are all modelled.
NOT_MODELLED: tuple[str, ...] = ()

_FWD_NOTE = "end of the last forward before a backward"
_BWD_NOTE = "highest moment of backward"
_OPT_NOTE = "optimizer step"


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
    act = stage_activations(run, stage)

    buf_fwd = buf_bwd = buf_opt = 0
    buffers_detail: dict[str, Num] = {}
    for name, b in stage_buffers(run, stage).items():
        buffers_detail[name] = b.bytes
        if "forward" in b.phases:
            buf_fwd = buf_fwd + b.bytes
        if "backward" in b.phases:
            buf_bwd = buf_bwd + b.bytes
        if "optimizer" in b.phases:
            buf_opt = buf_opt + b.bytes

    grads = s.grads + s.grads_fp32
    params, master, opt = s.params, s.master_weights, s.optimizer
    if s.grads_persistent:
        fwd_grads = grads
        bwd_grads = grads
        bwd_act = act.backward_first_bytes
    else:
        fwd_grads = 0 * grads
        # first backward starts with no gradients; a later one with all of them (see module docstring)
        first_wins = act.backward_first_bytes >= act.backward_later_bytes + grads
        bwd_act = where(first_wins, act.backward_first_bytes, act.backward_later_bytes)
        bwd_grads = where(first_wins, 0 * grads, grads)

    phases = (
        Phase(
            "forward",
            {"params": params, "master_weights": master, "grads": fwd_grads, "optimizer": opt,
             "activations": act.forward_bytes, "buffers": buf_fwd},
            _FWD_NOTE,
        ),
        Phase(
            "backward",
            {"params": params, "master_weights": master, "grads": bwd_grads, "optimizer": opt,
             "activations": bwd_act, "buffers": buf_bwd},
            _BWD_NOTE,
        ),
        Phase(
            "optimizer",
            {"params": params, "master_weights": master, "grads": grads, "optimizer": opt,
             "activations": 0 * grads, "buffers": buf_opt},
            _OPT_NOTE,
        ),
    )
    return StageMemory(
        stage=stage,
        states=s,
        phases=phases,
        activations_detail=act.detail,
        buffers_detail=buffers_detail,
        not_modelled=NOT_MODELLED,
    )
