"""Memory over a training step for one rank of one pipeline stage: the peak is a maximum over phases, not a sum
of components (DESIGN section 4, "Peak over a timeline").

Contract used by estimate.py and the planner (array-polymorphic like the rest of the cost model):
`stage_memory(run, stage) -> StageMemory` with one `Phase` per moment of the step, each giving the bytes live
per category at that moment. `allocated_peak` is the elementwise maximum of the phase totals.

Phases (docs/methodology.md, "Activations" sec. 7), each the highest of its candidate moments:
- forward: the loss of the last forward before a backward (held activations + the logits and their fp32 upcast,
  or context-parallel ring buffers), the LM head matmul just before it (FSDP2's last all-gather still live), or
  the start or end of the last layer's forward (FSDP2 ZeRO-3's gathered layer buffers).
  Gradients only where the framework keeps them between steps (`ModelStates.grads_persistent`: Megatron's and
  DeepSpeed's contiguous buffers; torch's `zero_grad(set_to_none=True)` frees them).
- backward: the loss gradient; inside the first layer's backward (`activations.layer_backward_transient`, a
  re-materialised layer, the first weight gradients) and at its end (FSDP2's post-backward); the second and the
  last layer (each layer frees its activations and adds its gradients, linear in between); the start of a later
  micro-batch's backward and its first layer's backward; the end of backward (FSDP2's root reduce-scatter).
- optimizer: no activations; all gradients and the optimizer's temporaries (buffers).
Buffers (memcalc/cost/buffers.py) add their bytes to the phases each one names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memcalc.cost.activations import stage_activations
from memcalc.cost.buffers import stage_buffers
from memcalc.cost.params import first_backward_grad_elems, layer_params, stage_params
from memcalc.cost.states import ModelStates, model_states
from memcalc.specs import DTYPE_BYTES, Run
from memcalc.xp import imax, imin, muldiv, where

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


def _total(live: dict[str, Num]) -> Num:
    t = 0
    for v in live.values():
        t = t + v
    return t


def _highest(*moments: dict[str, Num]) -> dict[str, Num]:
    """The moment with the most bytes live, elementwise (array-polymorphic; the first wins ties)."""
    best = moments[0]
    for m in moments[1:]:
        win = _total(m) > _total(best)
        best = {k: where(win, m[k], best[k]) for k in best}
    return best


def _first_grads(run: Run, stage: Num) -> Num:
    """Gradient bytes allocated when the first layer's backward reaches its highest moment, where gradients are
    not persistent (params.first_backward_grad_elems). Frozen weights (LoRA, --freeze) produce none; under FSDP2
    they are unsharded gradients, a buffer until their reduce-scatter (buffers.py), not a gradient state."""
    t = run.training
    if t.lora_rank is not None or t.freeze:
        return 0
    fsdp = 1 if (run.profile == "torch" and run.zero >= 2) else 0
    gb = DTYPE_BYTES[run.recipe.grad_dtype] * where(run.shard_degree > 1, 1 - fsdp, 1)
    head, down = first_backward_grad_elems(run, stage)
    return gb * (head + down)


def stage_memory(run: Run, stage: Num = 0) -> StageMemory:
    s = model_states(run, stage)
    act = stage_activations(run, stage)

    bufs = stage_buffers(run, stage)
    buffers_detail: dict[str, Num] = {}
    at: dict[str, Num] = {}
    for name, b in bufs.items():
        buffers_detail[name] = b.bytes
        for ph in b.phases:
            at[ph] = at.get(ph, 0) + b.bytes

    def buf(phase: str) -> Num:
        return at.get(phase, 0)

    grads = s.grads + s.grads_fp32
    params, master, opt = s.params, s.master_weights, s.optimizer
    zero = 0 * grads

    def moment(g: Num, a: Num, b: Num) -> dict[str, Num]:
        return {"params": params, "master_weights": master, "grads": g, "optimizer": opt, "activations": a,
                "buffers": b}

    fwd_grads = grads if s.grads_persistent else zero
    # a later micro-batch's loss (gradient accumulation, 1F1B pipelining) has the earlier ones' gradients live;
    # a GPipe pipeline runs every forward before the first backward
    all_forwards_first = where(run.pp > 1, True, False) if run.schedule == "gpipe" else False
    later_fwd_g = where(run.grad_accum > 1, where(all_forwards_first, fwd_grads, grads), fwd_grads)
    # forward: the loss (every saved activation + the logits and their fp32 upcast) or, just before it, the
    # LM head matmul (FSDP2 still holds the last unit's all-gather output there)
    fwd = _highest(
        moment(fwd_grads, act.forward_bytes, buf("forward")),
        moment(fwd_grads, act.forward_head_bytes, buf("forward_head")),
        moment(fwd_grads, act.forward_layer_bytes, buf("forward_layer")),
        moment(fwd_grads, act.forward_layer_end_bytes, buf("forward_layer_end")),
        moment(later_fwd_g, act.forward_bytes, buf("forward")),
    )
    # backward: the loss gradient (start of the first backward), the first layer's backward (loss terms freed,
    # the layer's gradient transients and the first weight gradients live), the start of a later backward
    # (fewer or as many activations, all gradients allocated), and the end of backward (FSDP2's root reduce)
    if s.grads_persistent:
        first_g, layer_g, later_g = grads, grads, grads
        later_act = act.backward_first_bytes
    else:
        first_g, layer_g, later_g = zero, imin(_first_grads(run, stage), grads), grads
        later_act = act.backward_later_bytes
    # later layers of the first backward: each frees one layer's activations (a) and adds one layer's gradients
    # (g; FSDP2: the sharded ones, plus the previous unit's reduce-scatter input held in flight,
    # "backward_layer_next"); linear in the layer index, so the second layer and the last bound them all, with
    # the last but one standing for the last layer that still prefetches
    # One layer's gradients: its share of the stage's elements (the embedding's and the head's are produced at
    # the ends of backward, not per layer; FSDP2 reduces the root's only at the end). FSDP2 prefetches the next
    # unit in every layer's backward but the stage's last layer's ("backward_prefetch").
    a, n_l = act.layer_freed_bytes, act.layers
    dense_l, expert_l = layer_params(run.model, run.tp, run.ep)
    dense_s, expert_s = stage_params(run, stage)
    g = 0 * grads if s.grads_persistent else muldiv(grads, dense_l + expert_l, imax(dense_s + expert_s, 1))
    more = n_l > 1
    k_last = imax(n_l - 1, 1)
    k_pen = imax(n_l - 2, 1)  # the last layer with a prefetch
    pre = buf("backward_prefetch")
    bwd = _highest(
        moment(first_g, act.backward_first_bytes, buf("backward")),
        moment(layer_g, act.backward_layer_bytes, buf("backward_layer") + where(more, pre, 0)),
        moment(layer_g, act.backward_post_bytes, buf("backward_post") + where(more, pre, 0)),
        moment(layer_g + where(more, g, 0), act.backward_layer_bytes - where(more, a, 0),
               buf("backward_layer") + where(more, buf("backward_layer_next"), 0) + where(n_l > 2, pre, 0)),
        moment(layer_g + where(more, k_pen * g, 0), act.backward_layer_bytes - where(more, k_pen * a, 0),
               buf("backward_layer") + where(more, buf("backward_layer_next"), 0) + where(n_l > 2, pre, 0)),
        moment(layer_g + where(more, k_last * g, 0), act.backward_layer_bytes - where(more, k_last * a, 0),
               buf("backward_layer") + where(more, buf("backward_layer_next"), 0)),
        moment(later_g, later_act, buf("backward")),
        moment(later_g, act.backward_later_layer_bytes, buf("backward_layer")),
        moment(grads, zero, buf("backward_end")),
    )
    phases = (
        Phase("forward", fwd, _FWD_NOTE),
        Phase("backward", bwd, _BWD_NOTE),
        Phase("optimizer", moment(grads, zero, buf("optimizer")), _OPT_NOTE),
    )
    return StageMemory(
        stage=stage,
        states=s,
        phases=phases,
        activations_detail=act.detail,
        buffers_detail=buffers_detail,
        not_modelled=NOT_MODELLED,
    )
