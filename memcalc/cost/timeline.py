"""Memory over a training step for one rank of one pipeline stage: the peak is a maximum over phases, not a sum
of components (DESIGN section 4, "Peak over a timeline").

Contract used by estimate.py and the planner (array-polymorphic like the rest of the cost model):
`stage_memory(run, stage) -> StageMemory` with one `Phase` per moment of the step, each giving the bytes live
per category at that moment. `allocated_peak` is the elementwise maximum of the phase totals.

Phases (docs/methodology.md, "Activations" sec. 7), each the highest of its candidate moments:
- forward: FSDP2's first layer copy-out (the root's all-gather output still live); the loss of the last
  forward before a backward (held activations + the logits and their fp32 upcast,
  or context-parallel ring buffers), the LM head matmul just before it (FSDP2's last all-gather still live), or
  the start or end of the last layer's forward (FSDP2 ZeRO-3's gathered layer buffers).
  Gradients only where the framework keeps them between steps (`ModelStates.grads_persistent`: Megatron's and
  DeepSpeed's contiguous buffers; torch's `zero_grad(set_to_none=True)` frees them).
- backward: the loss gradient; inside the first layer's backward (`activations.layer_backward_transient`, a
  re-materialised layer, the first weight gradients) and at its end (FSDP2's post-backward); the second and the
  last layer (each layer frees its activations and adds its gradients, linear in between); the start of a later
  micro-batch's backward, its first layer's backward, its LM head's backward (the head's new weight gradient
  beside `.grad`) and its end (the embedding's, and under torch pipelining with autocast every weight's); the end
  of backward (FSDP2's root reduce-scatter, a tied head's held gradient). FSDP2 also: a layer's backward copy-out
  (ZeRO-3), the end of a layer's backward with all its unsharded gradients, and the embedding's backward.
- optimizer: no activations (but lit-gpt's logits list, `loss_kept_bytes`); all gradients and the optimizer's
  temporaries (buffers).
Buffers (memcalc/cost/buffers.py) add their bytes to the phases each one names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memcalc.cost.activations import _NEVER, _autocast, loop_holds_graph, mixed_layers, stage_activations
from memcalc.cost.buffers import (
    amp_casts_after_last_core,
    amp_casts_after_last_mlp,
    amp_casts_freed_at_attention,
    amp_head_cast_freed,
    amp_layer_casts_freed,
    fsdp_backward_release_bytes,
    fsdp_root_shard_grad_bytes,
    pipelined_fsdp_grad_bytes,
    pipelined_fsdp_later_chunks_bytes,
    side_stream_pools,
    stage_buffers,
)
from memcalc.cost.params import (
    chunk_layers,
    early_chunks_trainable,
    first_attention_grad_elems,
    first_backward_grad_elems,
    first_grad_bytes,
    fsdp_sharded,
    interleave_rounds,
    layer_params,
    lora_first_grad_elems,
    lora_layer_params,
    pipelined_fsdp,
    stage_layers,
    stage_param_split,
    stage_params,
)
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
    # the highest allocated bytes of the compute stream alone, and the bytes held by side streams' allocator pools
    # (buffers.side_stream_pools); both feed reserved memory (fragmentation.reserved_bytes)
    compute_stream_peak: Num = 0
    side_stream_pools: dict[str, Num] = dataclasses.field(default_factory=dict)
    # the stranded logits block (activations.loss_stranded_bytes) as far as it raises compute_stream_peak
    loss_stranded_bytes: Num = 0
    # the compute stream's own highest moment of forward and backward, and its optimizer step (fragmentation.py:
    # what the first optimizer step finds reserved, and what it needs)
    compute_stream_fb_peak: Num = 0
    compute_stream_opt_peak: Num = 0
    # offloaded activations held in host memory for this rank (activations.StageActivations.host_bytes)
    host_activation_bytes: Num = 0

    @property
    def allocated_peak(self) -> Num:
        return _peak(self.phases)


def _total(live: dict[str, Num]) -> Num:
    t = 0
    for v in live.values():
        t = t + v
    return t


def _highest(*moments: dict[str, Num]) -> dict[str, Num]:
    """The moment with the most bytes live, elementwise (array-polymorphic; the first wins ties)."""
    totals = [_total(m) for m in moments]
    if all(isinstance(t, int) for t in totals):  # one configuration (the estimate): no elementwise choice
        return moments[totals.index(max(totals))]
    import numpy as np

    # the planner's bulk mode: per configuration the first moment of the highest total (argmax takes the first of
    # equal totals); few moments ever win, so each component is filled in per winning moment
    n = np.broadcast_shapes(*(np.shape(t) for t in totals))
    stacked = np.empty((len(totals), *n), dtype=np.int64)
    for i, t in enumerate(totals):
        stacked[i] = t
    best = np.argmax(stacked, axis=0)
    winners = np.unique(best)
    if winners.size == 1:
        return {k: np.broadcast_to(v, n) for k, v in moments[int(winners[0])].items()}
    out = {k: np.empty(n, dtype=np.int64) for k in moments[0]}
    for w in winners:
        sel = best == w
        for k, v in moments[int(w)].items():
            out[k][sel] = np.broadcast_to(v, n)[sel]
    return out


# gradient bytes made by a first backward at its first layer's MLP moment, its attention core's, its final norm's
_FirstGrads = tuple[Num, Num, Num]


def _first_grads(run: Run, stage: Num) -> _FirstGrads:
    """Gradient bytes allocated when the first layer's backward reaches its highest moment (the MLP's:
    params.first_backward_grad_elems) and its attention core's (params.first_attention_grad_elems), and before
    either, at the final norm's backward (the LM head's and the norm's own)."""
    gb = first_grad_bytes(run)
    if run.training.lora_rank is not None:  # the frozen base makes none: the adapters' (params.lora_first_grad_elems)
        down, after_core = lora_first_grad_elems(run)
        return gb * down, gb * after_core, 0 * gb
    head, down = first_backward_grad_elems(run, stage)
    return gb * (head + down), gb * first_attention_grad_elems(run, stage), gb * head


def stage_memory(run: Run, stage: Num = 0) -> StageMemory:
    s = model_states(run, stage)
    act = stage_activations(run, stage)

    bufs = stage_buffers(run, stage)
    buffers_detail: dict[str, Num] = {}
    at: dict[str, Num] = {}
    side_at: dict[str, Num] = {}
    for name, b in bufs.items():
        buffers_detail[name] = b.bytes
        for ph in b.phases:
            at[ph] = at.get(ph, 0) + b.bytes
            side_at[ph] = side_at.get(ph, 0) + b.side_stream_bytes
    # a layer's backward and its end come after the LM head's, which freed its autocast copy; the first layer's
    # attention-core backward: less the copies its layer's later ops freed too
    for ph in ("backward_layer", "backward_post"):
        at[ph] = at.get(ph, 0) - amp_head_cast_freed(run)
    # (and beside it, FSDP2's unsharded grads of the layer's later weights, tagged "backward_attention")
    at["backward_attention"] = (at["backward_layer"] - amp_casts_freed_at_attention(run)
                                + at.get("backward_attention", 0))
    # the final norm's backward: after the LM head's, which freed its autocast copy and made its (FSDP2: unsharded)
    # gradient
    head_grads = bufs["fsdp_head_grads"] if "fsdp_head_grads" in bufs else None
    at["backward_final_norm"] = (at.get("backward", 0) - amp_head_cast_freed(run)
                                 + (head_grads.bytes if head_grads else 0))
    side_at["backward_final_norm"] = side_at.get("backward", 0) + (head_grads.side_stream_bytes if head_grads else 0)
    # the last layer's MLP in forward: its down projection and the LM head not yet cast (at the down projection:
    # the head)
    casts = bufs["amp_weight_casts"].bytes if "amp_weight_casts" in bufs else 0
    layer_end = at.get("forward_layer_end", 0)
    pending = amp_casts_after_last_mlp(run, stage, casts)
    for ph, p in zip(("forward_mlp", "forward_down"), pending):
        at[ph] = layer_end - p
        side_at[ph] = side_at.get("forward_layer_end", 0)
    # and at its eager attention core: its output projection, MLP and the LM head not yet cast; FSDP2's buffers
    # as at the layer's end (its copy-out, before, freed the previous unit's all-gather output: measured, a 1-layer
    # ZeRO-2 run's eager forward was +3.5% with it)
    at["forward_attention"] = layer_end - amp_casts_after_last_core(run, stage, casts)
    side_at["forward_attention"] = side_at.get("forward_layer_end", 0)
    # the layer's end itself (its down projection's output and collective) precedes the LM head's cast too
    at["forward_layer_end"] = layer_end - pending[1]
    grads = s.grads + s.grads_fp32
    first_grads, shares = _first_grads(run, stage), _layer_shares(run, stage)
    phases = _phases(run, s, act, at, grads, first_grads, shares)
    pools = side_stream_pools(run, stage, grads)
    stranded = act.loss_stranded_bytes
    if pools or not (isinstance(stranded, int) and stranded == 0):
        # what the compute stream reserves: its own blocks (without FSDP2's all-gather outputs and gradient
        # shards, which live in the side streams' pools) and, at the loss gradient ("backward"), the logits'
        # block it cannot reuse there
        own_at = {ph: v - side_at.get(ph, 0) for ph, v in at.items()}
        own_grads = where(run.shard_degree > 1, 0 * grads, grads) if pools else grads
        own, compute_stream_peak, fb_peak, opt_peak = _reserved_peak(run, s, act, own_at, own_grads, first_grads,
                                                                     shares, stranded)
        stranded = compute_stream_peak - own
    else:
        compute_stream_peak = _peak(phases)
        fb_peak, opt_peak = imax(phases[0].total, phases[1].total), phases[2].total
    return StageMemory(
        stage=stage,
        states=s,
        phases=phases,
        activations_detail=act.detail,
        buffers_detail=buffers_detail,
        not_modelled=NOT_MODELLED,
        compute_stream_peak=compute_stream_peak,
        side_stream_pools=pools,
        loss_stranded_bytes=stranded,
        compute_stream_fb_peak=fb_peak,
        compute_stream_opt_peak=opt_peak,
        host_activation_bytes=act.host_bytes,
    )


def _peak(phases: tuple[Phase, ...]) -> Num:
    peak = phases[0].total
    for ph in phases[1:]:
        peak = imax(peak, ph.total)
    return peak


# `_layer_shares`: (one layer's elements, the stage's, the bytes a finished layer frees, the root's sharded gradient
# bytes, the pipelined accumulator's bytes, the copy-in bytes, whether a later backward re-gathers, whether one
# follows a backward with every unit gathered, and in a one-round interleaved step (trainable elements of the
# chunks but the last, of the stage, of the first chunk; the later chunks' unsharded bytes resharded before the
# first chunk's later backwards), and over ZeRO-3 in more rounds the other chunks' layers still gathered then)
_Shares = tuple[Num, Num, Num, Num, Num, Num, Num, Num, tuple[Num, Num, Num, Num, Num]]


def _layer_shares(run: Run, stage: Num) -> _Shares:
    """What each finished layer of backward changes: (elements of one layer, of the stage), i.e. one layer's share
    of the stage's gradients, and the buffer bytes it frees (`buffers.fsdp_backward_release_bytes`, the autocast
    copies of `buffers.amp_layer_casts_freed`); and FSDP2's root sharded gradient bytes, not yet made at the
    root's reduce-scatter (`buffers.fsdp_root_shard_grad_bytes`); and the unsharded gradients torch pipelining
    over FSDP2 accumulates from the first backward to the end of the step's backwards
    (`buffers.pipelined_fsdp_grad_bytes`); and there, under ZeRO-3, the copy-in that starts a backward on every stage
    but the last (whose LM head, in the root unit, runs first: its layers' moments bound it), 0 elsewhere; and 1
    where a later micro-batch's backward follows a forward, which resharded every unit, so that it gathers its
    layers again (0 where torch pipelining's later backwards all follow backwards, every unit still gathered); and 1
    where 1F1B's cool-down has such a backward that follows a backward (torch pipelining over ZeRO-3, every stage
    but the last), 0 elsewhere; and torch's one-round interleaved step (`interleave_rounds`): the trainable
    elements of the stage's chunks but the last (whose gradients the last chunk's later backwards precede), of the
    stage, and of its first chunk, and the bytes of `buffers.pipelined_fsdp_later_chunks_bytes` (0 but the stage's
    trainable elements elsewhere); and over ZeRO-3 in a step of more rounds, the bytes of the other chunks'
    layers, gathered by their last backward (no reshard after a pipelined backward) and not yet by a forward when a
    later round's backward runs (torch's order pairs each forward with a backward of another chunk; an upper bound
    beyond two chunks)."""
    dense_l, expert_l = layer_params(run.model, run.tp, run.ep)
    dense_s, expert_s = stage_params(run, stage)
    t = run.training
    if t.lora_rank is not None:
        # LoRA: only the adapters make gradients, the same in every layer (the embedding and head are frozen)
        dense_l, expert_l = lora_layer_params(run.model, t.lora_targets, t.lora_rank, run.tp), 0
        dense_s, expert_s = stage_param_split(run, stage).trainable, 0
    freed = fsdp_backward_release_bytes(run, stage) + amp_layer_casts_freed(run)
    acc = pipelined_fsdp_grad_bytes(run, stage)
    unit = -fsdp_backward_release_bytes(run, stage)  # a gathered layer, where `acc` is not 0
    regather = where((acc > 0) & (stage < run.pp - 1) & (run.zero >= 3), 2 * unit, 0)
    # torch's 1F1B (torch/distributed/pipelining/schedules.py `Schedule1F1B`): stage s runs min(pp - 1 - s, m)
    # warm-up forwards, then a forward before each backward until its forwards run out, then the cool-down's
    # backwards back to back; so the backwards after its first that follow a forward number m - warm-up - 1
    # (GPipe's later backwards all follow backwards)
    warm = imin(run.pp - 1 - stage, run.grad_accum)
    steady = where(run.grad_accum - warm >= 2, 1, 0) if run.schedule != "gpipe" else 0 * warm
    later_regathers = where(pipelined_fsdp(run) == 1, steady, 1)
    cool_down = where((pipelined_fsdp(run) == 1) & (stage < run.pp - 1), 1, 0) \
        if run.schedule != "gpipe" and run.zero >= 3 else 0 * warm
    one_round = (run.profile == "torch") & (run.schedule == "interleaved") & (interleave_rounds(run) == 1)
    # (interleaved: the layers of the chunks but the last)
    others = stage_layers(run, stage) - chunk_layers(run, stage, run.vpp - 1) if run.schedule == "interleaved" else 0
    early = where(one_round, early_chunks_trainable(run, stage), 0)
    not_yet = (early, imax(stage_param_split(run, stage).trainable, 1),
               where(one_round, early_chunks_trainable(run, stage, 1), 0),
               where(one_round, pipelined_fsdp_later_chunks_bytes(run, stage), 0),
               where(one_round | (acc == 0), 0, others * unit)
               if run.schedule == "interleaved" and run.zero >= 3 else 0 * acc)
    return (dense_l + expert_l, imax(dense_s + expert_s, 1), freed, fsdp_root_shard_grad_bytes(run, stage), acc,
            regather, later_regathers, cool_down, not_yet)


def _phases(run: Run, s: ModelStates, act: Any, at: dict[str, Num], grads: Num, first_grads: _FirstGrads,
            shares: _Shares) -> tuple[Phase, ...]:
    """The phases of the step: each the highest of its moments (`_moments`)."""
    fwd, bwd, opt, _ = _moments(run, s, act, at, grads, first_grads, shares)
    return (
        Phase("forward", _highest(*fwd), _FWD_NOTE),
        Phase("backward", _highest(*bwd), _BWD_NOTE),
        Phase("optimizer", opt, _OPT_NOTE),
    )


def _reserved_peak(run: Run, s: ModelStates, act: Any, at: dict[str, Num], grads: Num, first_grads: _FirstGrads,
                   shares: _Shares, stranded: Num) -> tuple[Num, Num, Num, Num]:
    """(highest total over every moment of the step, the same with `stranded` bytes added at the loss gradient:
    the first backward's, and a later micro-batch's where there is one; the highest forward or backward moment
    with them; the optimizer step's total)."""
    fwd, bwd, opt, losses = _moments(run, s, act, at, grads, first_grads, shares)
    fb = 0
    for m in fwd + bwd:
        fb = imax(fb, _total(m))
    at_loss = imax(_total(losses[0]) + stranded, _total(losses[1]) + where(run.grad_accum > 1, stranded, 0))
    peak = imax(fb, _total(opt))
    return peak, imax(peak, at_loss), imax(fb, at_loss), _total(opt)


def _moments(run: Run, s: ModelStates, act: Any, at: dict[str, Num], grads: Num, first_grads: _FirstGrads,
             shares: _Shares
             ) -> tuple[list[dict[str, Num]], list[dict[str, Num]], dict[str, Num],
                                               tuple[dict[str, Num], dict[str, Num]]]:
    """The candidate moments of forward and backward and the optimizer step, from the states, the activations, the
    buffer bytes live per moment (`at`) and the gradient bytes counted (all of them for the allocated timeline;
    none of FSDP2's shards for the compute stream's own); `first_grads` is `_first_grads`, `shares` the elements
    of one layer and of the stage and the buffer bytes each finished layer frees (`_layer_shares`). Last: the two
    loss-gradient moments (first and later micro-batch), also among the backward ones."""

    def buf(phase: str) -> Num:
        return at.get(phase, 0)

    params, master, opt = s.params, s.master_weights, s.optimizer
    zero = 0 * grads
    first_step = run.training.peak_step == "first"
    # the run's first micro-batch: torch.optim creates its states in its first step() (DeepSpeed's ZeRO optimizers
    # and Megatron's allocate or load theirs before training: kept)
    opt_fb = 0 * opt if first_step and run.profile == "torch" else opt

    def moment(g: Num, a: Num, b: Num, o: Num = opt_fb) -> dict[str, Num]:
        return {"params": params, "master_weights": master, "grads": g, "optimizer": o, "activations": a,
                "buffers": b}

    fwd_grads = grads if s.grads_persistent else zero
    # a forward that runs after a backward of the same step (gradient accumulation, 1F1B's steady state) has the
    # earlier backwards' gradients live: there is one when the stage runs more forwards (micro-batches, or model
    # chunks when interleaved) than it holds at its first backward (GPipe: none)
    forwards = run.grad_accum * (run.vpp if run.schedule == "interleaved" else 1)
    # (`--peak-step first`: the first micro-batch, whose forward follows no backward; the step's later micro-batches
    # are taken as no longer than it, so their moments are not candidates)
    # torch pipelining over FSDP2 (`_layer_shares`): the whole unsharded gradients accumulated so far instead;
    # the sharded ones are made only after the step's last backward
    acc = shares[4]
    piped = pipelined_fsdp(run) == 1
    # (torch's one-round interleaved step: every forward after a backward is the last chunk's, and only its
    # gradients are made, `_layer_shares`)
    not_yet = shares[8]
    made = where(piped, acc, grads)
    made = made - muldiv(made, not_yet[0], not_yet[1])
    later_fwd_g = fwd_grads if first_step else where(forwards > act.in_flight, imax(made, fwd_grads), fwd_grads)
    # forward: the loss (every saved activation + the logits and their fp32 upcast) or, just before it, the
    # LM head matmul (FSDP2 still holds the last unit's all-gather output there)
    # Every such forward holds as many activations as the last one before the first backward, so each moment is
    # taken with the gradients of the latest forward (at least the first one's).
    # a loop that holds the previous micro-batch's graph until this one's loss (`loop_holds_graph`) holds the
    # bitsandbytes inputs stored on its nodes (`graph_held_bytes`) through this forward and the optimizer step
    # The run's first micro-batch (`--peak-step first`) has no previous one: neither its graph nor the logits the
    # loop keeps from it (`loss_kept_bytes`, in every forward moment before the loss replaces them)
    prev = act.graph_held_bytes if loop_holds_graph(run) else 0
    old_logits = 0
    if first_step:
        prev, old_logits = 0, act.loss_kept_bytes
    # a steady-state forward of torch's 1F1B also has the previous backward's input gradient referenced
    f_prev = prev if first_step else prev + where(forwards > act.in_flight, act.steady_forward_sent_bytes, 0)
    fwd = [
        moment(later_fwd_g, act.forward_bytes + f_prev, buf("forward")),
        moment(later_fwd_g, act.forward_head_bytes + f_prev - old_logits, buf("forward_head")),
        moment(later_fwd_g, act.forward_layer_bytes + f_prev - old_logits, buf("forward_layer")),
        moment(later_fwd_g, act.forward_attention_bytes + f_prev - old_logits, buf("forward_attention")),
        # (inside the stage's last layer: FSDP2 prefetches no further unit there)
        moment(later_fwd_g, act.forward_checkpointed_mlp_bytes + f_prev - old_logits, buf("forward_mlp")),
        moment(later_fwd_g, act.forward_checkpointed_down_bytes + f_prev - old_logits, buf("forward_down")),
        moment(later_fwd_g, act.forward_layer_end_bytes + f_prev - old_logits, buf("forward_layer_end")),
        # FSDP2: the first layer's copy-out, the root's all-gather output still live
        moment(later_fwd_g, act.forward_first_layer_bytes + f_prev - old_logits, buf("forward_first_layer")),
    ]
    # backward: the loss gradient (start of the first backward), the first layer's backward (loss terms freed,
    # the layer's gradient transients and the first weight gradients live), the start of a later backward
    # (fewer or as many activations, all gradients allocated), and the end of backward (FSDP2's root reduce)
    # (torch's one-round interleaved step: a later backward of the last chunk precedes every earlier chunk's, whose
    # gradients are not made yet, `_layer_shares`; the step's other later backwards hold fewer chunks)
    layer_elems, stage_elems, rel, root_shard, _, copy_in, later_regathers, cool_down, _ = shares
    if s.grads_persistent:
        first_g, layer_g, attn_g, all_g, later_g, norm_g = grads, grads, grads, grads, grads, grads
        later_act = act.backward_first_bytes
    else:
        all_g = where(piped, acc, grads)
        later_g = all_g - muldiv(all_g, not_yet[0], not_yet[1])
        first_g, layer_g, attn_g = zero, imin(first_grads[0], later_g), imin(first_grads[1], later_g)
        norm_g = imin(first_grads[2], later_g)
        later_act = act.backward_later_bytes
    # ... and where every gradient is made (the first chunk's later backwards), torch pipelining over FSDP2 has
    # reduced the later chunks' (`REDUCE_GRAD` after a stage's last backward, torch/distributed/pipelining/
    # schedules.py `_add_reduce_grad`): their sharded gradients beside the first chunk's accumulator
    late_g = where(piped, muldiv(acc, not_yet[2], not_yet[1]) + grads - muldiv(grads, not_yet[2], not_yet[1]),
                   all_g)
    # (the step's last REDUCE_GRAD, the first chunk's, likewise)
    end_g = where(interleave_rounds(run) == 1, late_g, all_g) if run.schedule == "interleaved" else all_g
    # later layers of the first backward: each frees one layer's activations (a) and adds one layer's gradients
    # (g; FSDP2: the sharded ones, plus the previous unit's reduce-scatter input held in flight,
    # "backward_layer_next"); linear in the layer index, so the second layer and the last bound them all, with
    # the last but one standing for the last layer that still prefetches
    # One layer's gradients: its share of the stage's elements (the embedding's and the head's are produced at
    # the ends of backward, not per layer; FSDP2 reduces the root's only at the end). FSDP2 prefetches the next
    # unit in every layer's backward but the stage's last layer's ("backward_prefetch").
    a, n_l = act.layer_freed_bytes, act.layers
    # rel: buffer bytes a finished layer frees (FSDP2 ZeRO-2's reshard, or the layer's autocast copies; minus a
    # layer under torch pipelining's ZeRO-3, whose finished units stay gathered)
    # (the word embedding's replicated gradient beyond its vocab shard, `params.replicated_embedding_grad`, is no
    # layer's: it is made at the end of backward)
    emb_extra = muldiv(s.grads, s.embedding_grad_extra, imax(s.grad_elems, 1))
    g = 0 * grads if s.grads_persistent else muldiv(all_g - emb_extra, layer_elems, stage_elems)
    more = n_l > 1
    k_last = imax(n_l - 1, 1)
    k_pen = imax(n_l - 2, 1)  # the last layer with a prefetch
    pre = buf("backward_prefetch")
    first_loss = moment(first_g, act.backward_first_bytes, buf("backward"))
    # a later micro-batch's backward exists only with several micro-batches per step (grad-accum, or the
    # pipeline's micro-batches); with one, its moments would pair all gradients with a layer's working set
    later = (run.grad_accum > 1) & (not first_step)

    def if_later(m: dict[str, Num]) -> dict[str, Num]:
        m = {**m, "buffers": m["buffers"] + not_yet[4]}
        # (where there is none, a moment that does not occur: `_NEVER` activations)
        return {**m, "activations": where(later, m["activations"], _NEVER)}

    # torch pipelining over FSDP2 leaves every unit unsharded after a backward (`rel` is minus a unit under ZeRO-3):
    # GPipe's backwards follow one another, so a later one finds them all gathered (1F1B's forward in between
    # reshards them; its cool-down below)
    all_units = where(piped & (run.schedule == "gpipe"), -n_l * rel, 0)
    later_loss = if_later(moment(later_g, later_act, buf("backward") + all_units))
    # ... 1F1B's cool-down (every stage but the last): a backward that follows a backward finds every unit
    # gathered, with one micro-batch fewer held than a steady-state backward (`drain_less_bytes`; none fewer where
    # every later backward is such a one): its start, its first layer's backward and that layer's end (its
    # unsharded gradients made), each above the same moment of its later layers
    drains = later & (cool_down == 1)
    gathered = -n_l * rel
    less = act.drain_less_bytes

    def drain(a_k: Num, b_k: Num) -> dict[str, Num]:
        # (one-round interleaved: the last chunk's second backward, only its gradients made, `later_g`)
        return moment(later_g, where(drains, a_k - less, _NEVER), b_k + gathered)
    # ... and under ZeRO-3 every unit was resharded after its forward, the stage's last one too: a backward starts
    # with that unit's copy-out, its all-gather output beside its unsharded parameters (GPipe's later ones excepted)
    regather = copy_in > 0
    first_copy_in = moment(first_g, where(regather, act.backward_first_bytes, _NEVER), buf("backward") + copy_in)
    later_copy_in = if_later(moment(later_g, where(regather & (later_regathers == 1), later_act, _NEVER),
                                    buf("backward") + copy_in))

    # FSDP2's moments beside a layer's post-backward hold its activations (`backward_post_bytes`, less a layer's
    # per later layer): the end of the layer's backward just before it, and (ZeRO-3, which gathers each layer
    # again for its backward) the next layer's copy-out just after it
    fsdp = (run.profile == "torch") & (fsdp_sharded(run) == 1)
    # the Q input-gradient moment without FSDP2 (and without autocast, whose weight copies the layer moments free
    # as their nodes run: there a layer's MLP moment is the higher)
    qkv_alone = (fsdp == 0) & (_autocast(run) == 0) & (act.qkv_dgrad_extra_bytes > 0)
    gathers = fsdp & (run.zero >= 3) & more

    def layer_end(k: Num, g_k: Num, a_k: Num) -> dict[str, Num]:
        # FSDP2: the end of layer k's backward (its unsharded gradients live, `g_k` of the sharded ones made;
        # `a_k` the activations then, `post_at`);
        # the previous unit's reduce-scatter input in flight from the second layer on, the next unit prefetched
        # but in the stage's last layer; linear in k between those steps
        return moment(g_k, where(fsdp & (k < n_l), a_k, _NEVER), buf("backward_layer_end")
                      - k * rel + where(k >= 1, buf("backward_layer_next"), 0) + where(k < n_l - 1, pre, 0))

    q_extras = (act.qkv_dgrad_extra_bytes, act.input_norm_backward_bytes)

    def q_end(k: Num, g_k: Num, a_k: Num) -> dict[str, Num]:
        # without FSDP2 (`qkv_alone`): layer k's Q input gradient or input norm's backward (`a_k`), in the stage's
        # first layer to run or, with more than one, its last, which has freed the micro-batch's rotary cos and sin
        return moment(g_k, where(qkv_alone & ((k == 0) | more), a_k - where(k == n_l - 1, act.rotary_bytes, 0),
                                 _NEVER),
                      buf("backward_layer") + where(k >= 1, buf("backward_layer_next") - k * rel, 0))

    def copy_out(k: Num, g_k: Num, a_k: Num, exists: Any = True) -> dict[str, Num]:
        # FSDP2 ZeRO-3: layer k's copy-out after layer k-1's post-backward (`a_k`: the activations at that end;
        # under torch pipelining the k finished units stay gathered beside it: `rel` is minus a unit)
        return moment(g_k, where(gathers & exists, a_k, _NEVER), buf("backward_copy_out") - k * rel)

    offloaded = act.offload_parts is not None

    mixed = act.mixed_parts is not None

    def acts_at(k: Num) -> Num:
        if offloaded:  # the resident pair changes with the layer (plain or checkpointed; none left to reload)
            return where(more, act.offloaded_layer_at(k), act.backward_layer_bytes)
        if mixed:  # plain and checkpointed layers: the saved sets above layer k, each its own
            return where(more, act.mixed_at(k, "layer"), act.backward_layer_bytes)
        return act.backward_layer_bytes - where(more, k * a - act.layer_k_extra_bytes, 0)

    def attn_at(k: Num) -> Num:
        if mixed:
            return where(more, act.mixed_at(k, "attention"), act.backward_attention_bytes)
        return act.backward_attention_bytes - where(more, k * a, 0)

    def post_at(k: Num) -> Num:  # layer k's end (k layers before it done), as `layer_end` and `copy_out` take it
        if offloaded:
            return act.offloaded_post_at(k)
        if mixed:
            return act.mixed_at(k, "post")
        return act.backward_post_bytes - k * a

    # the layers to look at beyond the first, second, last but one and last: where the resident pair of
    # offloading changes, or where plain layers give way to checkpointed ones
    switch = _switch_layers(act) if offloaded else mixed_layers(act) if mixed else ()

    bwd = [
        first_loss,
        # the end of the LM head's backward under SP and the final norm's (an eager fp32 RMSNorm's; _NEVER
        # elsewhere), first and later micro-batch
        moment(norm_g, act.backward_final_norm_bytes, buf("backward_final_norm")),
        if_later(moment(later_g, act.backward_later_final_norm_bytes, buf("backward_final_norm"))),
        moment(layer_g, act.backward_layer_bytes, buf("backward_layer") + where(more, pre, 0)),
        # the first layer's attention core (its output projection's and MLP's gradients made by then)
        moment(attn_g, act.backward_attention_bytes, buf("backward_attention") + where(more, pre, 0)),
        # ... and a later layer's: k layers' activations freed and their gradients made (linear in k like the
        # layers' own moments); where the checkpoints are small next to a layer's gradients (full recompute of
        # eager attention) the last layer's is the highest (docs/validation.md rows 100, 116), or the last but
        # one's where FSDP2 ZeRO-3's prefetch of the next unit, which the last lacks, outweighs a layer's sharded
        # gradients less its checkpoint (Llama 3.2 1B, fp32, 2048 tokens over 8 ranks: -2.0% without it)
        *[moment(attn_g + where(more, k * g, 0), attn_at(k),
                 buf("backward_attention") + where(more, buf("backward_layer_next") - k * rel, 0)
                 + where(k < n_l - 1, pre, 0)) for k in (1, k_pen, k_last, *(switch if mixed else ()))],
        # (its post-backward reshards the layer before the reduce-scatter: ZeRO-2's release)
        moment(layer_g, act.backward_post_bytes, buf("backward_post") - rel + where(more, pre, 0)),
        if_later(moment(later_g, act.backward_later_post_bytes, buf("backward_post") - rel + where(more, pre, 0))),
        # FSDP2 ZeRO-3: a layer's copy-out after the previous one's post-backward, k layers' sharded gradients
        # made (under torch pipelining their unsharded ones; none of the layer's own yet): linear in k, so the
        # second layer's and the last's bound the others
        *[copy_out(k, k * g, post_at(k - 1)) for k in (1, k_last)],
        moment(layer_g + where(more, g, 0), acts_at(1),
               buf("backward_layer") + where(more, buf("backward_layer_next") - rel, 0) + where(n_l > 2, pre, 0)),
        moment(layer_g + where(more, k_pen * g, 0), acts_at(k_pen),
               buf("backward_layer") + where(more, buf("backward_layer_next") - k_pen * rel, 0)
               + where(n_l > 2, pre, 0)),
        moment(layer_g + where(more, k_last * g, 0), acts_at(k_last),
               buf("backward_layer") + where(more, buf("backward_layer_next") - k_last * rel, 0)),
        *[moment(layer_g + where(more, k * g, 0), acts_at(k),
                 buf("backward_layer") + where(more, buf("backward_layer_next") - k * rel, 0)
                 + where(k < n_l - 1, pre, 0))
          for k in switch],
        later_loss,
        first_copy_in,
        later_copy_in,
        if_later(moment(later_g, act.backward_later_layer_bytes, buf("backward_layer") + where(
            all_units > 0, all_units + rel, where(more, pre, 0)))),
        # ... its later layers: each finished layer freed its activations but, under torch pipelining's step-wide
        # autocast, left its weights' compute-dtype gradients waiting to the end of this backward
        # (`late_layer_dw_bytes`): the higher where the weights outweigh a layer's activations
        # (FSDP2: the previous unit's reduce-scatter input in flight, as in the first backward's; measured: ZeRO-3
        # with grad-accum 2 was -1.4% without it, tests/test_validate_fsdp_moments.py)
        *[if_later(moment(later_g, where(more, act.backward_later_layer_bytes - k * (a - act.late_layer_dw_bytes),
                                         _NEVER),
                          buf("backward_layer") + buf("backward_layer_next") - k * rel
                          + where(all_units > 0, all_units + rel, where(k < n_l - 1, pre, 0))))
          for k in (1, k_last)],
        # ... and its attention cores, every sharded gradient made by the earlier micro-batches (FSDP2 with an eager
        # core: -4.7% without them, tests/test_validate_fsdp_moments.py)
        *[if_later(moment(later_g, where(more | (k == 0), act.backward_later_attention_bytes
                                         - k * (a - act.late_layer_dw_bytes), _NEVER),
                          buf("backward_attention") + where(k >= 1, buf("backward_layer_next"), 0) - k * rel
                          + where(all_units > 0, all_units + rel, where(k < n_l - 1, pre, 0))))
          for k in (0, 1, k_last)],
        *[if_later(copy_out(k, later_g, act.backward_later_post_bytes - (k - 1) * a, later_regathers == 1))
          for k in (1, k_last)],
        # (offloaded: also where the resident next layer changes from plain to checkpointed)
        *[layer_end(k, layer_g + k * g, post_at(k)) for k in (0, 1, k_pen, k_last, *(switch if offloaded else ()))],
        # ... and one step before its end, at its Q projection's input gradient (`qkv_dgrad_extra`)
        *[layer_end(k, layer_g + k * g, post_at(k) + act.qkv_dgrad_extra_bytes)
          for k in (0, 1, k_pen, k_last, *(switch if offloaded else ()))],
        *[if_later(layer_end(k, later_g, act.backward_later_post_bytes - k * a + extra))
          for k in (0, 1, k_pen, k_last) for extra in (0, act.qkv_dgrad_extra_bytes)],
        # without FSDP2 the same moment, k layers done and the layer's own weight gradients all made (the head's
        # and k + 1 layers'): where weights outweigh activations, the stage's last layer's is the backward's peak
        # (pure bf16, h 2048 at 512 tokens: -0.5% to -1.0% without it, tests/test_validate_mlp_backward.py); and
        # next, an eager fp32 input norm's backward (`input_norm_backward`); first and later micro-batch
        *[q_end(k, imin(norm_g + (k + 1) * g, later_g), post_at(k) + extra)
          for k in (0, k_last) for extra in q_extras],
        *[if_later(q_end(k, later_g, act.backward_later_post_bytes - k * a + extra))
          for k in (0, k_last) for extra in q_extras],
        drain(later_act, buf("backward")),
        drain(act.backward_later_layer_bytes, buf("backward_layer") + rel),
        drain(act.backward_later_post_bytes, buf("backward_layer_end") + rel),
        # its LM head's backward: the head's new weight gradient beside the accumulated ones
        if_later(moment(later_g, act.backward_later_head_bytes, buf("backward"))),
        # its end under torch pipelining's step-wide autocast (the weights' compute-dtype gradients waiting); over
        # FSDP2 the stage's first unit's post-backward, every unit left unsharded (no reshard after a pipelined
        # backward: `rel` is minus a unit), no reduce-scatter before the step's last backward
        if_later(moment(later_g, act.backward_later_end_bytes,
                        where(piped, buf("backward_layer") - (n_l - 1) * rel, buf("backward_end")))),
        # torch's one-round interleaved step: the first chunk's second backward, every gradient made, fewer chunks
        # held (activations `_late_chunk_moments`)
        # (and over FSDP2 the later chunks resharded by their REDUCE_GRAD)
        if_later(moment(late_g, act.backward_late_chunk_layer_bytes, buf("backward_layer") + where(more, pre, 0)
                        - not_yet[3])),
        if_later(moment(late_g, act.backward_late_chunk_post_bytes,
                        buf("backward_post") - rel + where(more, pre, 0) - not_yet[3])),
        if_later(moment(late_g, act.backward_late_chunk_end_bytes,
                        where(piped, buf("backward_layer") - (n_l - 1) * rel, buf("backward_end")) - not_yet[3])),
        # FSDP2: the root's reduce-scatter, whose output makes the root's sharded gradients (none yet in the step's
        # first micro-batch)
        moment(where(later, end_g, grads - root_shard), act.loss_kept_bytes + act.graph_held_bytes
               + act.backward_end_bytes, buf("backward_end")),
        # FSDP2: the embedding's backward, before the root's post-backward (its gradient, and with a tied head the
        # sum with the held one, beside the root's unsharded parameters)
        moment(where(later, end_g, grads - root_shard), act.loss_kept_bytes
               + act.graph_held_bytes + act.backward_root_bytes, buf("backward_root")),
    ]
    # the optimizer step follows this micro-batch's backward, whose graph the loop still holds (the first step's too)
    held = act.graph_held_bytes if loop_holds_graph(run) else 0
    return fwd, bwd, moment(grads, act.loss_kept_bytes + held, buf("optimizer"), opt), (first_loss, later_loss)


def _switch_layers(act: Any) -> tuple[Num, ...]:
    """Offloading: where the resident pair changes, counted from the stage's last layer (clipped to the stage's
    layers): the last plain layer whose previous one is plain, the last plain layer, the first checkpointed one.
    Between these and the other moments (first, second, last but one and last layer) the total is linear.
    k >= 1, as in `mixed_layers`: the first layer's (k = 0) is the `backward_layer` moment, and the moments these
    index hold the previous unit's reduce-scatter input (`backward_layer_next`), which k = 0 has not (FSDP2
    ZeRO-2, offloaded and fully recomputed: its backward read one unit's unsharded gradients high, +6.6%)."""
    plain_n, n = act.offload_parts[1], act.offload_parts[2]
    return tuple(imin(imax(plain_n - d, 1), imax(n - 1, 1)) for d in (2, 1, 0))
