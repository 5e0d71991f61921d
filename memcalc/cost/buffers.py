"""Communication buffers, working sets and temporaries per framework profile. DESIGN.md section 4, "Buffers and
overheads"; derivations and sources in docs/methodology.md.

`stage_buffers(run, stage)` returns named `Buffer`s for one rank of pipeline stage `stage`: bytes held on the GPU
(inside the caching allocator, i.e. counted by `torch.cuda.max_memory_allocated`) that are neither model states
(memcalc/cost/states.py) nor saved activations (memcalc/cost/activations.py). `Buffer.phases` names the phases at
whose peak moment the buffer is live:
- "forward": the end of the forward pass (all saved activations live);
- "backward": the backward peak, which memcalc places at the start of backward (activations still live, the first
  gradients and the largest unit's working set being produced);
- "optimizer": the optimizer step, which also stands for the moment just before it (end of backward: every gradient
  live, activations freed), where the end-of-backward reduction buffers sit.

Nothing here double counts model states: Megatron's contiguous fp32 grad buffer and DeepSpeed's fp32 gradient
partitions (the "fused fp32 gradient buffer" of the ZeRO paper, sec. 3.2) are already `grads` / `grads_fp32` in
states.py, and the distributed optimizer all-gathers parameters in place into its parameter buffer.

Array-polymorphic like the rest of the cost model: the numeric layout fields of `run` and `stage` may be numpy
arrays; only categorical fields (profile, ZeRO stage, recompute, optimizer, offload) are branched on with `if`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memcalc.cost.params import (
    checkpointed_layers,
    chunk_layers,
    embedding_params,
    after_core_layer_elems,
    first_backward_grad_elems,
    head_params,
    dense_layer_params,
    first_dense_layers,
    fsdp_sharded,
    pipelined_fsdp,
    layer_norms,
    layer_params,
    layer_tensor_shapes,
    matmul_weight_elems,
    mlp_matrix_shapes,
    attention_matrix_shapes,
    norm_params,
    padded_shard_elems,
    replicated_embedding_grad,
    stage_tensor_shapes,
    steps_every_tensor,
    zero1_partition_applies,
    zero1_rank_elems,
    root_tensor_shapes,
    saved_cast_elems,
    scaled,
    stage_dense_layers,
    stage_layer_params,
    stage_layers,
    stage_param_split,
    stage_params,
)
from memcalc.specs import DTYPE_BYTES, HardwareSpec, Run
from memcalc.xp import muldiv, cdiv, imax, imin, where

Num = Any

# Moments of a step (memcalc/cost/timeline.py): "forward" (the loss of the last forward before a backward),
# "forward_head" (the LM head matmul just before it), "forward_layer" (the start of the last layer's forward, its
# parameters just gathered), "forward_layer_end" (its end, before FSDP2 reshards it), "backward" (the loss
# gradient, start of backward),
# "backward_layer" (inside the first layer's backward), "backward_post" (at its end), "backward_end" (the last unit's
# gradient reduction, FSDP2), "backward_root" (FSDP2: the root unit's backward, the embedding's gradient made, before
# its post-backward), "backward_copy_out" (FSDP2 ZeRO-3: the second layer of backward gathered, its pre-backward's
# copy-out), "backward_layer_end" (FSDP2: a layer's backward done, all its unsharded gradients made, before its
# post-backward), "optimizer" (the step). Two tags qualify backward moments rather than name one:
# "backward_layer_next" (from the second layer's backward on) and "backward_prefetch" (while a next unit exists to
# prefetch: every layer's backward moments but the stage's last layer's). "backward_attention" adds to the attention
# core's backward moments, which are otherwise "backward_layer"'s.
ALL_PHASES: frozenset[str] = frozenset(
    {"forward", "forward_head", "forward_layer", "forward_layer_end", "backward", "backward_layer", "backward_post",
     "backward_end", "backward_root", "backward_copy_out", "backward_layer_end", "optimizer",
     "forward_first_layer"}
)
FWD_BWD: frozenset[str] = frozenset({"forward", "forward_head", "forward_layer", "forward_layer_end", "backward",
                                     "backward_layer", "backward_post"})
BACKWARD: frozenset[str] = frozenset({"backward", "backward_layer", "backward_post"})
OPTIMIZER: frozenset[str] = frozenset({"optimizer"})

KiB = 1 << 10
MiB = 1 << 20

# --- framework defaults (each overridable by a same-named field on TrainingSpec once one exists; see _knob) ---
# torch DDP: bucket_cap_mb=25, first bucket 1 MiB (torch/nn/parallel/distributed.py, reducer.hpp
# kDefaultBucketBytesCap / kDefaultFirstBucketBytes). Bucket sizes change the number of buckets, not their total.
DDP_GRADIENT_AS_BUCKET_VIEW = False
# DeepSpeed runtime/zero/config.py DeepSpeedZeroConfig defaults (elements, not bytes).
DS_REDUCE_BUCKET_SIZE = 500_000_000
DS_ALLGATHER_BUCKET_SIZE = 500_000_000
DS_ALLREDUCE_BUCKET_SIZE = 500_000_000  # runtime/constants.py ALLREDUCE_BUCKET_SIZE_DEFAULT (ZeRO disabled)
DS_PREFETCH_BUCKET_SIZE = 50_000_000  # stage3_prefetch_bucket_size
DS_MAX_LIVE_PARAMETERS = 1_000_000_000  # stage3_max_live_parameters
DS_MAX_REUSE_DISTANCE = 1_000_000_000  # stage3_max_reuse_distance
DS_CONTIGUOUS_GRADIENTS = True
# cuBLAS workspace per (handle, stream), torch's default without CUBLAS_WORKSPACE_CONFIG
# (aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize): ":4096:8" = 32 MiB on compute capability
# 9.x-12.x (Hopper, Blackwell), ":4096:2:16:8" = 8.125 MiB before; ROCm's hipBLAS 32 MiB, 128 MiB on
# gfx942 / gfx950 / gfx1250. An unknown architecture is taken as Hopper.
CUBLAS_WORKSPACE_BYTES = 32 * MiB
CUBLAS_WORKSPACE_PRE_HOPPER_BYTES = 4096 * KiB * 2 + 16 * KiB * 8
HIPBLAS_WORKSPACE_BYTES = 32 * MiB
HIPBLAS_WORKSPACE_LARGE_BYTES = 128 * MiB
HIPBLAS_LARGE_ARCHS = ("gfx942", "gfx950", "gfx1250")
# TransformerEngine pytorch/module/base.py get_cublas_workspace_size_bytes(): 32 MiB on sm90+ (4 MiB before);
# get_multi_stream_cublas_workspace(): one more per cuBLAS stream (4) for grouped GEMM (MoE).
TE_WORKSPACE_BYTES = 32 * MiB
TE_WORKSPACE_PRE_HOPPER_BYTES = 4 * MiB
TE_GROUPED_GEMM_STREAMS = 4


def _sm_major(arch: str) -> int | None:
    """9 for "sm90", 10 for "sm100", None for "" or a non-NVIDIA architecture."""
    if arch.startswith("sm") and arch[2:].isdigit():
        return int(arch[2:]) // 10
    return None


def blas_workspace_bytes(hw: HardwareSpec) -> int:
    """torch's cuBLAS (hipBLAS on ROCm) workspace per (handle, stream) on this GPU, in bytes."""
    if hw.arch.startswith("gfx"):
        return HIPBLAS_WORKSPACE_LARGE_BYTES if hw.arch in HIPBLAS_LARGE_ARCHS else HIPBLAS_WORKSPACE_BYTES
    major = _sm_major(hw.arch)
    return CUBLAS_WORKSPACE_PRE_HOPPER_BYTES if major is not None and major < 9 else CUBLAS_WORKSPACE_BYTES


def te_workspace_bytes(hw: HardwareSpec) -> int:
    """TransformerEngine's cuBLAS workspace on this GPU, in bytes."""
    major = _sm_major(hw.arch)
    return TE_WORKSPACE_PRE_HOPPER_BYTES if major is not None and major < 9 else TE_WORKSPACE_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class Buffer:
    bytes: Num
    phases: frozenset[str]  # subset of {"forward", "backward", "optimizer"}: live at that phase's peak moment
    note: str = ""
    # the part of `bytes` allocated on a side stream (FSDP2's all-gather copy-in stream): counted in the allocated
    # peak, but held in that stream's own pool of the caching allocator (see side_stream_pools)
    side_stream_bytes: Num = 0


def _gathered(nbytes: Num, phases: set[str], note: str) -> Buffer:
    """An FSDP2 all-gather output alone: allocated on the copy-in stream, so all of it is side-stream bytes."""
    return Buffer(nbytes, frozenset(phases), note, side_stream_bytes=nbytes)


def _knob(run: Run, name: str, default: Any) -> Any:
    """A framework setting: the TrainingSpec field of that name when present and set, else the default."""
    value = getattr(run.training, name, None)
    return default if value is None else value



def stage_units(run: Run, stage: Num) -> tuple[Num, Num]:
    """(largest, layer): unsharded parameters per TP rank of the largest FSDP / ZeRO-3 unit held by this stage
    (a transformer layer, the embedding on the first stage, final norm + LM head on the last) and of one layer.
    With pp = 1 `largest` equals params.largest_unit_params (the tied head shares the embedding's unit)."""
    m = run.model
    tp = run.tp
    dense_l, expert_l = layer_params(m, tp, run.ep)
    layer = dense_l + expert_l
    emb = embedding_params(m, run.profile, tp)
    head = head_params(m, run.profile, tp) + norm_params(m)
    first = stage == 0
    last = stage == run.pp - 1
    if m.tied_embeddings:
        # one shared matrix when first and last stage are the same rank (params.stage_params)
        head_unit = where(first, 0, head)
    else:
        head_unit = head
    largest = imax(layer, imax(where(first, emb, 0), where(last, head_unit, 0)))
    if first_dense_layers(m):  # an MoE model's first dense layers, on the stages that hold them
        largest = imax(largest, where(stage_dense_layers(run, stage) > 0, dense_layer_params(m, tp), 0))
    return scaled(run, largest), scaled(run, layer)


def _stage_elems(run: Run, stage: Num) -> Num:
    dense, expert = stage_params(run, stage)
    return dense + expert


def _shard_elems(run: Run, stage: Num) -> Num:
    """All elements (trainable and frozen) of this rank's FSDP shard."""
    dense, expert = stage_params(run, stage)
    d = run.shard_degree
    return cdiv(dense, d) + cdiv(expert, d // run.ep)


def _trainable_elems(run: Run, stage: Num) -> Num:
    """Elements that receive gradients (LoRA adapters only, or all but --freeze'd parts): params.stage_param_split."""
    return stage_param_split(run, stage).trainable


def _trainable_shard_elems(run: Run, stage: Num) -> Num:
    """Trainable elements of this rank's ZeRO/FSDP shard (as states.model_states shards them)."""
    if zero1_partition_applies(run):
        return zero1_rank_elems(run, stage)
    split = stage_param_split(run, stage)
    d = run.shard_degree
    return cdiv(split.trainable_dense, d) + cdiv(split.trainable_expert, d // run.ep)


def _te_dummy_wgrad_elems(run: Run, stage: Num = 0) -> Num:
    """One dummy wgrad per distinct weight shape: TE caches `get_dummy_wgrad(shape, dtype)` per (shape, dtype)
    (transformer_engine/pytorch/module/base.py), so the cache holds one of each TE linear weight the stage runs
    (per TP rank): the fused qkv (or MLA's five projections) and proj, fc1 and fc2 of the MLP; with MoE those of
    an expert (TE GroupedLinear), of the shared experts when their width differs, and of the first dense layers'
    MLP on the stages that hold one. Shapes come from the model's dimensions (not scaled by `--params`)."""
    m = run.model

    def elems(shapes: list) -> Num:  # q + 2 kv = the fused qkv's elements, gate + up = fc1's
        return sum(rows * cols * count for rows, cols, count in shapes)

    total = elems(attention_matrix_shapes(m, run.tp))
    if m.moe is None:
        return total + elems(mlp_matrix_shapes(m, m.ffn, run.tp))
    widths = {m.moe.expert_ffn, m.moe.shared_experts * m.moe.expert_ffn} - {0}
    total = total + sum(elems(mlp_matrix_shapes(m, w, run.tp)) for w in widths)
    if m.moe.first_dense_layers and m.ffn not in widths:
        total = total + where(stage_dense_layers(run, stage) > 0, elems(mlp_matrix_shapes(m, m.ffn, run.tp)), 0)
    return total


def _step_embedding_shard_copies(run: Run, stage: Num) -> tuple[Num, Num]:
    """(bytes of one copy, copies live at once) of the replicated embedding gradient's shard that a torch optimizer
    step makes under TP (params.replicated_embedding_grad): each op that pairs the Shard(0) parameter or its state
    with the Replicate gradient (or SGD's Replicate momentum buffer) redistributes that argument to a new shard,
    freed when the op returns. SGD's `add_` and fused Adam's kernel take one; foreach Adam's `_foreach_addcmul_
    (exp_avg_sqs, grads, grads)` two, as does the single-tensor `addcmul_(grad, grad.conj())`. The dtype is the
    stepped gradient's: fp32 with a master copy (its upcast), the moment dtype for SGD's momentum buffer.
    Measured: docs/validation.md rows 145-147 and 149."""
    _, shard = replicated_embedding_grad(run, stage)
    r, opt = run.recipe, run.training.optimizer
    if opt not in ("sgd", "sgd-momentum", "adam", "adamw") or run.offload != "none" or run.dp_mode == "ps":
        return 0, 0
    upcast = r.master_weights and r.grad_dtype != "fp32" and not r.fp32_grad_copy
    dtype = r.moment_dtype if opt == "sgd-momentum" else ("fp32" if upcast else r.grad_dtype)
    n = 2 if opt in ("adam", "adamw") and r.optimizer_impl != "fused" else 1
    return DTYPE_BYTES[dtype] * shard * steps_every_tensor(run), n


def _foreach_temporaries(run: Run, stage: Num) -> dict[str, Buffer]:
    """torch/optim/adam.py `_multi_tensor_adam` (torch >= 2.1): `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`
    allocates one tensor per parameter stepped (moment dtype), then updates it in place; AdamW decays weights in
    place, Adam's L2 decay (`weight_decay != 0`, default 0) would add a grad copy. All tensors of one device/dtype
    group are stepped at once, so the list covers every element this rank steps. Under torch TP the step's copies
    of the replicated embedding gradient's shard come at their own ops (`_step_embedding_shard_copies`): alone
    for SGD and fused Adam, the larger of the two moments for the other Adams."""
    if run.offload != "none" or run.dp_mode == "ps":
        return {}  # offloaded optimizer or parameter server: the step does not run on this GPU
    copy, n_copies = _step_embedding_shard_copies(run, stage) if run.profile == "torch" else (0, 0)
    alone = {"tp_embedding_grad_shard_copy": Buffer(
        copy, OPTIMIZER, "the step's shard of the TP-replicated embedding gradient (DTensor redistribute)")}
    alone = alone if n_copies else {}
    impl = run.recipe.optimizer_impl
    if run.training.optimizer not in ("adam", "adamw") or impl == "fused":
        # fused: one in-place kernel per tensor group (torch `_fused_adamw_`; Apex / TE / DeepSpeed FusedAdam), no
        # temporaries (measured: row 67 of docs/validation.md)
        return alone
    if impl == "for-loop":
        # torch/optim/adam.py `_single_tensor_adam`, one parameter at a time: `denom = (exp_avg_sq.sqrt() /
        # bias_correction2_sqrt).add_(eps)` holds the sqrt and the quotient at once: two tensors of the largest
        # parameter this rank steps (measured: 2 x the 512 x 64 fp32 embedding, row 21)
        largest = 0
        for d0, row, cnt in stage_tensor_shapes(run, stage):
            largest = imax(largest, where(cnt > 0, d0 * row, 0))
        mb = DTYPE_BYTES[run.recipe.moment_dtype]
        return {"adam_step_temporaries": Buffer(imax(2 * mb * scaled(run, largest), n_copies * copy), OPTIMIZER,
                                                "single-tensor Adam: sqrt(v) and its quotient for the largest tensor")}
    elems = _trainable_shard_elems(run, stage) if run.zero >= 1 else _trainable_elems(run, stage)
    mb = DTYPE_BYTES[run.recipe.moment_dtype]
    return {
        "foreach_adam_temporaries": Buffer(
            imax(mb * elems, n_copies * copy), OPTIMIZER,
            "foreach Adam's sqrt(v) intermediate list, one per stepped parameter"
        )
    }


def _workspaces(run: Run) -> dict[str, Buffer]:
    out = {
        # forward runs on the Python thread, backward on autograd's device thread: two cuBLAS handles, each with
        # its own workspace on the compute stream (CublasHandlePool.cpp keys workspaces by (handle, stream)).
        "cublas_workspaces": Buffer(2 * blas_workspace_bytes(run.hardware), ALL_PHASES,
                                    "cuBLAS workspaces (fwd and bwd threads)"),
    }
    if run.profile == "megatron":
        te = te_workspace_bytes(run.hardware)
        if run.model.moe is not None:
            te += TE_GROUPED_GEMM_STREAMS * te_workspace_bytes(run.hardware)
        out["te_cublas_workspace"] = Buffer(te, ALL_PHASES, "TransformerEngine cuBLAS workspace(s)")
    return out


def _amp_casts(run: Run, stage: Num, n_train: Num) -> Buffer:
    """AMP autocast: each weight is cast once per forward (autocast weight cache) and the low-precision copy is
    saved by the matmul for its backward, freed as backward passes each op. Under full (or op-level) recompute the
    saved copies are dropped when the autocast region exits and re-cast one layer at a time (with activation
    offloading the cache still holds the offloaded plain layers' copies on the device). Autocast casts fp32
    tensors only: LoRA's frozen base is already stored in the compute dtype (states.frozen_bytes), so only the fp32
    adapters are cast; --freeze keeps fp32 weights, all cast."""
    cb = DTYPE_BYTES[run.recipe.compute_dtype]
    # (the autocast cache holds every copy until the region exits after the loss: the LM head's matmul included)
    fwd_only = frozenset({"forward", "forward_head", "forward_layer", "forward_layer_end"})
    phases = fwd_only if run.training.recompute in ("full", "op") else FWD_BWD
    t = run.training
    elems = n_train if t.lora_rank is not None else matmul_weight_elems(run, stage)
    if t.recompute in ("full", "op") and run.model.moe is None and t.lora_rank is None and run.profile == "torch":
        # the plain layers' copies are in their saved sets (activations._saved_cast_terms), without pipelining
        n = stage_layers(run, stage)
        plain = n - checkpointed_layers(t.recompute, t, n)
        if t.offload_activations:
            # offloaded, a plain layer's saved copies are autocast's weight casts, which the offloading hook keeps on
            # the device (no host copy) until that layer's backward; in forward they are counted here, but for the
            # resident last one's, in a saved set on the device (in backward: activations `_cast_kept_at`)
            plain = imin(plain, 1)
        elems = elems - where(run.pp == 1, plain * sum(saved_cast_elems(run)), 0)
    return Buffer(cb * elems, phases, "autocast low-precision copies of the weights")


def _amp_casts_step_cache(run: Run, casts: Buffer) -> Buffer:
    """torch pipelining: the autocast region is the whole `schedule.step()` (every forward and backward runs inside
    it), so its weight cache keeps each copy made by the step's first forward until the step ends, through every
    backward and its end whatever the recompute; `_amp_casts` covers the moments where they are live anyway.
    Measured: docs/validation.md, the PP AMP rows (all of a stage's copies live at a later micro-batch's loss
    gradient under full recompute)."""
    late = frozenset({"backward_end"})
    if run.training.recompute in ("full", "op"):
        late = late | BACKWARD
    return Buffer(where(run.pp > 1, casts.bytes, 0), late,
                  "the same copies, kept to the end of the step by the autocast cache around torch pipelining's step")


def _amp_head_cast_saved(run: Run) -> Buffer:
    """Under full (or op-level) recompute the layers' autocast copies are dropped when the autocast region exits
    (`_amp_casts`), but the LM head is not checkpointed: its matmul saved its low-precision weight (and bias) for
    the input gradient, which is live at the loss gradient until the head's backward. Without pipelining only (its
    one stage is the last; under pipelining the step's cache holds every copy, `_amp_casts_step_cache`); none for
    LoRA (its head is frozen in the compute dtype). Measured by the harness (docs/validation.md, the DDP op-level
    SAC row: one `c*V*h` copy at its loss-gradient peak)."""
    t = run.training
    if t.recompute not in ("full", "op") or t.lora_rank is not None:
        return Buffer(0, frozenset({"backward"}), "")
    head = where(run.pp == 1, scaled(run, head_params(run.model, run.profile, run.tp)), 0)
    return Buffer(DTYPE_BYTES[run.recipe.compute_dtype] * head, frozenset({"backward"}),
                  "the LM head's autocast weight copy, saved by its matmul until its backward (recompute)")


def amp_copies_held(run: Run) -> Num:
    """1 where `_amp_casts`' saved copies are held through backward and freed op by op, else 0: not under full or
    op-level recompute (re-cast per layer), FSDP2's sharded units, LoRA (casts of the adapters only) or
    pipelining (the step's autocast cache keeps them, `_amp_casts_step_cache`)."""
    r, t = run.recipe, run.training
    if run.profile != "torch" or not r.compute_copy or t.lora_rank is not None or t.recompute in ("full", "op"):
        return 0
    return where((fsdp_sharded(run) == 1) | (run.pp > 1), 0, 1)


def amp_casts_freed_at_attention(run: Run) -> Num:
    """Of `_amp_casts`' saved copies, those of the first layer's output projection and MLP (router, experts), which
    their backward frees before the attention core's (`activations.attention_backward`)."""
    return amp_copies_held(run) * DTYPE_BYTES[run.recipe.compute_dtype] * after_core_layer_elems(run)[0]


def amp_layer_casts_freed(run: Run) -> Num:
    """Of `_amp_casts`' saved copies, one layer's (its matrices and biases; not the norms, which autocast leaves in
    fp32), which that layer's backward frees: each finished layer of backward lowers the buffer by this much
    (timeline `rel`). Without it the last layers' moments of a long AMP backward kept every layer's copy: +7.9% on
    a weight-heavy single-GPU shape (docs/validation.md row 155)."""
    m = run.model
    dense, expert = layer_params(m, run.tp, run.ep)
    mats = scaled(run, dense + expert - layer_norms(m) * norm_params(m))
    return amp_copies_held(run) * DTYPE_BYTES[run.recipe.compute_dtype] * mats


def amp_casts_after_last_mlp(run: Run, stage: Num, casts: Num) -> tuple[Num, Num]:
    """Of the forward's autocast copies (`_amp_casts`, `casts` bytes on this stage), those not yet made (at the
    stage's last layer's MLP activation, at its down projection): its down projection's weight (and bias), made
    between the two, and, on the last stage, the LM head's, made after both (`activations.checkpointed_mlp_forward`).
    Without pipelining only: each micro-batch's forward is an autocast region of its own, whose cache starts empty;
    torch pipelining's step-wide region has them all from the first forward on (`_amp_casts_step_cache`), so a
    later forward finds them made (counted there for every forward: at most these bytes high on the last stage's
    first). LoRA: autocast casts the fp32 adapters only, and the checkpointed MLP's moments are modelled only where
    the MLP has none (`activations.checkpointed_mlp_forward`): nothing pending. Measured by the harness
    (tests/test_validate_forward.py)."""
    m = run.model
    down = saved_cast_elems(run)[2] + scaled(run, m.hidden if m.linear_bias else 0)
    head = where(stage == run.pp - 1, scaled(run, head_params(m, run.profile, run.tp)), 0)
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    own = (casts > 0) & (run.pp == 1) & (run.training.lora_rank is None)
    return where(own, c * (down + head), 0), where(own, c * head, 0)


def amp_casts_after_last_core(run: Run, stage: Num, casts: Num) -> Num:
    """Of the forward's autocast copies (`_amp_casts`, `casts` bytes on this stage), those not yet made at the stage's
    last layer's attention core (its eager forward moment, `activations.eager_attention_forward`): that layer's
    output projection and MLP and, on the last stage, the LM head. Without pipelining only, as
    `amp_casts_after_last_mlp`. Measured by the harness (tests/test_validate_attention.py)."""
    head = where(stage == run.pp - 1, scaled(run, head_params(run.model, run.profile, run.tp)), 0)
    own = (casts > 0) & (run.pp == 1)
    return where(own, DTYPE_BYTES[run.recipe.compute_dtype] * (after_core_layer_elems(run)[0] + head), 0)


def amp_head_cast_freed(run: Run) -> Num:
    """Of `_amp_casts`' saved copies, the LM head's (its weight and bias), which the head's backward frees before
    any layer's backward moment; 0 where the head is frozen or quantized. Measured: docs/validation.md rows
    153-155 (the layer moments under AMP)."""
    t = run.training
    if "head" in t.freeze or t.quantize_head:
        return 0
    head = scaled(run, head_params(run.model, run.profile, run.tp))
    return amp_copies_held(run) * DTYPE_BYTES[run.recipe.compute_dtype] * head


def _pipeline_recv_buffers(run: Run, stage: Num) -> Num:
    """torch.distributed.pipelining: `PipelineStage._prepare_forward_infra` / `_setup_backward_recv_info`
    allocate, once and for the life of the stage, a receive buffer per micro-batch for the activation coming
    from the previous stage and one for the gradient coming from the next (stage.py `_make_tensor_from_meta`):
    m buffers of one stage boundary tensor (the residual stream, s/t tokens with SP) each way, per local stage
    (vpp of them when interleaved; none into the first stage or back into the last)."""
    from memcalc.cost.comm import _stream_dtype

    s_loc = run.seq // run.cp
    tok = (cdiv(s_loc, run.tp) if run.sp else s_loc) * run.micro_batch
    _, sb = _stream_dtype(run)
    ends = where(stage == 0, 1, 0) + where(stage == run.pp - 1, 1, 0)
    return where(run.pp > 1, run.grad_accum * (2 * run.vpp - ends) * sb * tok * run.model.hidden, 0)


def _fsdp_flat_units(run: Run, stage: Num) -> tuple[Num, Num]:
    """(layer, root): elements of one FSDP2 unit's flat all-gather output, D x its padded shard (dim 0 of every
    tensor padded to a multiple of D = dp*cp, _fsdp_param.py), for a transformer layer and for this stage's root
    unit (embedding, final norm, LM head; 0 on a middle pipeline stage)."""
    d = run.shard_degree
    layer_flat = scaled(run, d * padded_shard_elems(layer_tensor_shapes(run), d))
    root_flat = scaled(run, d * padded_shard_elems(root_tensor_shapes(run, stage), d))
    return layer_flat, root_flat


def _root_elems(run: Run, stage: Num) -> Num:
    """Unpadded elements of the stage's FSDP2 root unit: all but its layers (embedding, final norm, LM head)."""
    dense_s, expert_s = stage_layer_params(run, stage)
    return imax(_stage_elems(run, stage) - scaled(run, dense_s + expert_s), 0)


def _root_last_elems(run: Run, stage: Num) -> Num:
    """Elements of the stage's root unit's last-registered parameter (`root_tensor_shapes` follows the harness's
    and torchtitan's registration order: embedding, positions, final norm, LM head, its bias)."""
    last: Num = 0
    for dim0, row, count in root_tensor_shapes(run, stage):
        last = where(count > 0, dim0 * row, last)
    return scaled(run, last)


def fsdp_root_shard_grad_bytes(run: Run, stage: Num) -> Num:
    """FSDP2 (ZeRO-2/3 over more than one rank): this rank's sharded gradients of the stage's root unit
    (embedding, final norm, LM head), made from the root's reduce-scatter output at the end of backward: not yet
    allocated when that reduce-scatter starts in the step's first micro-batch (timeline, the end of backward;
    measured, docs/validation.md row 135). Trainable share only (LoRA / --freeze); 0 elsewhere."""
    if run.profile != "torch" or run.zero < 2:
        return 0
    d = run.shard_degree
    n = _stage_elems(run, stage)
    share = muldiv(_root_elems(run, stage), _trainable_elems(run, stage), imax(n, 1))
    return where(d > 1, DTYPE_BYTES[run.recipe.grad_dtype] * cdiv(share, d), 0)


def fsdp_backward_release_bytes(run: Run, stage: Num) -> Num:
    """Bytes freed by each finished layer of backward under FSDP2 reshard_after_forward=False (ZeRO-2): the unit
    stays unsharded from its forward to its post-backward, which reshards it (`FSDPParamGroup.post_backward`:
    `reshard()` before `foreach_reduce`), so `fsdp_unsharded_params` shrinks by one layer's padded unsharded
    storage per layer done (measured: docs/validation.md row 69). 0 elsewhere (ZeRO-3 reshards after forward), but
    under torch pipelining (below)."""
    if run.profile != "torch" or run.zero < 2:
        return 0
    layer_flat, _ = _fsdp_flat_units(run, stage)
    unit = DTYPE_BYTES[run.recipe.compute_dtype] * layer_flat
    # torch pipelining runs its backwards with `set_reshard_after_backward(False)`: a finished unit stays unsharded,
    # so under ZeRO-3 (gathered again for backward) each one adds a layer, under ZeRO-2 none is freed
    released = where(run.pp > 1, -unit if run.zero >= 3 else 0 * unit, unit if run.zero == 2 else 0 * unit)
    return where(run.shard_degree > 1, released, 0)


def side_stream_pools(run: Run, stage: Num, grads_bytes: Num) -> dict[str, Num]:
    """Bytes the caching allocator holds for FSDP2's side streams on one rank of `stage` (empty elsewhere).

    c10/cuda/CUDACachingAllocator.cpp (header comment): "Allocations are associated with a stream. Once freed,
    blocks can be re-allocated on the same stream, but not on any other stream"; with expandable_segments each
    stream grows its own segment. FSDP2 allocates on two side streams (torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py, the same since mid-2024):
    - `foreach_all_gather` runs on the all-gather copy-in stream (forward and pre-backward prefetch): the cast of
      the unit's sharded params to param_dtype and its flat all-gather output. In forward a unit's output is
      freed only at the next unit's copy-out (`comm_ctx.all_gather_state`), after that unit's all-gather was
      allocated, so the pool holds two outputs at once: the root's and the first layer's (or two layers').
    - `foreach_reduce` allocates the reduce-scatter output in the reduce-scatter stream; the sharded gradients are
      views of it (`torch.as_strided(reduce_output, ...)`) until `zero_grad`, so the pool keeps every gradient
      shard (`grads_bytes`, the gradient state), plus one unit's new output while a later micro-batch accumulates
      into them (`grad += new`). The reduce-scatter input is allocated on the compute stream (a buffer).
    The compute stream cannot reuse these blocks: reserved memory is the compute stream's peak plus both pools
    (fragmentation.reserved_bytes)."""
    if run.profile != "torch" or run.zero < 2:
        return {}
    r = run.recipe
    d = run.shard_degree
    sharded = d > 1
    cb = DTYPE_BYTES[r.compute_dtype]
    rb = DTYPE_BYTES[r.grad_dtype]  # reduce dtype = the sharded gradient's dtype (buffers: `rb`)
    layer_flat, root_flat = _fsdp_flat_units(run, stage)
    first = imax(layer_flat, root_flat)  # the stage's first unit (its root when it has one), also its largest
    casts = 0 if r.param_dtype == r.compute_dtype else 1  # `all_gather_inputs`: the shards cast to param_dtype
    # the first unit's cast and output, or its output kept while the next layer casts and gathers
    gather = imax(first + casts * cdiv(first, d), first + layer_flat + casts * cdiv(layer_flat, d))
    accumulate = (run.grad_accum > 1) & (run.pp == 1)  # with pipelining FSDP2 reduces once per step
    return {
        "fsdp_all_gather_stream": where(sharded, cb * gather, 0),
        "fsdp_reduce_scatter_stream": where(sharded, grads_bytes + where(accumulate, rb * cdiv(first, d), 0), 0),
    }


def pipelined_fsdp_later_chunks_bytes(run: Run, stage: Num) -> Num:
    """torch pipelining over FSDP2, interleaved: the unsharded parameter bytes of the stage's model chunks but the
    first (each chunk its own FSDP2 root, as torchtitan shards each model part), which their `REDUCE_GRAD` reshards
    after their last backward (`perform_reduce_grad` sets `reshard_after_backward`): in a one-round step that comes
    before the first chunk's later backwards (timeline). ZeRO-2 keeps every unit gathered until then (L/(pp*vpp)
    layers a chunk, and the last stage's final norm and head); ZeRO-3 only the last chunk's root. 0 elsewhere."""
    if run.profile != "torch" or run.schedule != "interleaved" or run.zero < 2:
        return 0 * stage
    cb = DTYPE_BYTES[run.recipe.compute_dtype]
    layer_flat, root_flat = _fsdp_flat_units(run, stage)
    last = stage == run.pp - 1
    later = stage_layers(run, stage) - chunk_layers(run, stage, 0)  # (the chunks but the first)
    layers = later if run.zero == 2 else 0
    return where(pipelined_fsdp(run) == 1, cb * (layers * layer_flat + where(last, root_flat, 0)), 0)


def pipelined_fsdp_grad_bytes(run: Run, stage: Num) -> Num:
    """torch pipelining over FSDP2 (pp > 1, a shard group of more than one rank): the stage's unsharded gradients,
    accumulated over the step's micro-batches. `PipelineStage.backward_maybe_with_nosync` runs every micro-batch's
    backward with `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)`, and
    `perform_reduce_grad` reduce-scatters once, after the last one (torch/distributed/pipelining/stage.py): from
    the first backward to the end of the step's backwards each parameter's whole gradient is live. Under
    MixedPrecisionPolicy each unit's post-backward moves its compute-dtype gradients into an accumulator of the
    reduce dtype (`FSDPParam.to_accumulated_grad_if_needed` / `accumulate_unsharded_grad_if_needed`); without it
    `.grad` accumulates in place: `g * trainable elements of the stage`, g the reduce (gradient) dtype. Under TP
    the first stage's word embedding accumulates its replicated V x h gradient (no post-backward redistributes it
    to the vocab shard before the step's end: `params.replicated_embedding_grad`). 0 elsewhere."""
    if run.profile != "torch" or run.zero < 2:
        return 0
    elems = _trainable_elems(run, stage) + replicated_embedding_grad(run, stage, under_fsdp=True)[0]
    return where(pipelined_fsdp(run) == 1, DTYPE_BYTES[run.recipe.grad_dtype] * elems, 0)


def fsdp_unsharded_grad_bytes(run: Run, stage: Num, elems: Num) -> Num:
    """FSDP2 (ZeRO-2/3 over a shard group of more than one rank, no torch pipelining): the unsharded gradient bytes
    of `elems` parameter elements between their backward and their unit's reduce-scatter, in the compute dtype,
    for the trainable share of the stage's parameters (as `_torch_buffers` counts them); 0 elsewhere."""
    if run.profile != "torch" or run.zero < 2:
        return 0
    per_unit = (run.shard_degree > 1) & (pipelined_fsdp(run) == 0)
    cb = DTYPE_BYTES[run.recipe.compute_dtype]
    return where(per_unit, muldiv(cb * elems, _trainable_elems(run, stage), imax(_stage_elems(run, stage), 1)), 0)


def _torch_buffers(run: Run, stage: Num) -> dict[str, Buffer]:
    r = run.recipe
    d = run.shard_degree
    n = _stage_elems(run, stage)
    n_train = _trainable_elems(run, stage)
    cb = DTYPE_BYTES[r.compute_dtype]
    gb = DTYPE_BYTES[r.grad_dtype]
    out: dict[str, Buffer] = {}
    out["pipeline_recv_buffers"] = Buffer(_pipeline_recv_buffers(run, stage), ALL_PHASES,
                                          "torch pipelining: a receive buffer per micro-batch, each way")
    # `schedule.step(inputs, target=labels)` splits the step's whole batch into micro-batch views, and the loop
    # moves it to every rank (torchtitan's train step): its int64 token ids and labels, s/cp tokens per sequence
    micro = 2 * 8 * run.micro_batch * (run.seq // run.cp)
    out["pipeline_batch_tokens"] = Buffer(where(run.pp > 1, run.grad_accum * micro, 0), ALL_PHASES,
                                          "torch pipelining: the step's token ids and labels (int64)")
    # without pipelining the last micro-batch's ids and labels (activations until its backward, as the embedding
    # and the loss keep them) are still the loop's batch during the optimizer step; measured by the harness
    out["loop_batch_tokens"] = Buffer(where(run.pp > 1, 0, micro), OPTIMIZER,
                                      "the loop's last micro-batch of token ids and labels (int64)")
    if run.zero <= 1:
        # DDP (ZeRO-1 = ZeroRedundancyOptimizer over DDP). reducer.cpp initialize_buckets: every bucket gets
        # `bucket.gradients = at::empty({numel of its params}, param options)`; the buckets cover every parameter
        # that requires grad, so together they are a persistent copy of the grads (rebuilt after the first step,
        # validation-findings: 4P for fp32, live in all phases). gradient_as_bucket_view=True makes the grads views
        # of the buckets instead (no extra copy). ZeroRedundancyOptimizer broadcasts parameters in place
        # (`_broadcast_params_from_rank`: param.data or its bucket view): no extra buffer. Parameter-server and
        # nn.DataParallel modes (dp_mode != "collective") have no DDP reducer; one rank (shard group 1) no DDP.
        if run.dp_mode == "collective" and not _knob(run, "gradient_as_bucket_view", DDP_GRADIENT_AS_BUCKET_VIEW):
            out["ddp_buckets"] = Buffer(
                where(d > 1, gb * n_train, 0), ALL_PHASES, "DDP gradient buckets: a persistent flat copy of the grads"
            )
        if r.compute_copy:
            out["amp_weight_casts"] = _amp_casts(run, stage, n_train)
            out["amp_weight_casts_step_cache"] = _amp_casts_step_cache(run, out["amp_weight_casts"])
            out["amp_head_cast_saved"] = _amp_head_cast_saved(run)
        return out
    # FSDP2 fully_shard. _fsdp_collectives.py: foreach_all_gather allocates the unit's flat all-gather output
    # (param_dtype), copy-out fills the unsharded parameters; the next unit's all-gather is issued while the current
    # one computes (implicit forward prefetch, explicit backward prefetch of 1). foreach_reduce copies the unit's
    # unsharded grads (param_dtype) into a reduce-scatter input of reduce_dtype, then frees them.
    # With a shard group of one rank nothing is wrapped (torchtitan applies fully_shard only when dp_shard > 1 and
    # uses autocast otherwise), so the FSDP terms apply where dp*cp > 1 and the AMP casts where it is 1.
    rb = gb  # reduce dtype = the sharded grad dtype (MixedPrecisionPolicy(reduce_dtype=fp32) under AMP)
    sharded = d > 1
    # the FSDP2 units of this stage: each layer, and the root (embedding, final norm, LM head; apply_fsdp in
    # memcalc/validate/parallelize.py, torchtitan's parallelize_llama). A unit's all-gather output is one flat
    # buffer of D x its padded shard (dim 0 of every tensor padded to a multiple of D, _fsdp_param.py); copy-out
    # then fills each parameter's own all-gather output, also D x its padded shard: the unsharded parameter is an
    # `as_strided` view of it (`FSDPParam.init_unsharded_param`), so unsharded parameters hold padded storage
    # while their gradients (allocated by autograd in the parameter's shape) do not.
    m = run.model
    layer = scaled(run, padded_shard_elems(layer_tensor_shapes(run), 1))
    layer_flat, root_flat = _fsdp_flat_units(run, stage)
    root = _root_elems(run, stage)
    stage_flat = scaled(run, d * padded_shard_elems(stage_tensor_shapes(run, stage), d))
    share_num, share_den = n_train, imax(n, 1)  # only trainable parameters produce gradients (LoRA / --freeze)
    layer_out = where(sharded, cb * layer_flat, 0)  # one layer's flat all-gather output (copy-in stream)
    # not at backward_end: the root's post-backward reshards it before its reduce-scatter, like every unit's
    keep = frozenset({"forward", "forward_head", "forward_layer", "forward_layer_end", "backward", "backward_layer",
                      "backward_post", "backward_copy_out", "backward_layer_end", "forward_first_layer"})
    # the root's backward: every layer has been resharded by its post-backward (ZeRO-2 too); the root's unsharded
    # parameters are live until its own (activations `_fsdp_root_backward`)
    out["fsdp_root_unsharded_at_root_backward"] = Buffer(
        where(sharded, cb * root_flat, 0), frozenset({"backward_root"}),
        "FSDP2 root unit's unsharded params at its backward (every layer resharded)")
    steady = (run.grad_accum > imin(run.grad_accum, run.pp - stage)) if run.schedule != "gpipe" else False
    piped_steady = (pipelined_fsdp(run) == 1) & steady
    if run.zero == 2:
        # reshard_after_forward=False: every unit stays unsharded from its forward to its post-backward
        # ... but every unit's post-backward reshards it, so a forward gathers each unit again: at the first
        # layer's copy-out only the root and that layer are unsharded (beside the root's all-gather output, below)
        out["fsdp_unsharded_params"] = Buffer(where(sharded, cb * stage_flat, 0), keep - {"forward_first_layer"},
                                              "FSDP2 reshard_after_forward=False: the stage's unsharded params")
        out["fsdp_first_layer_unsharded"] = Buffer(
            where(sharded, cb * (root_flat + 2 * layer_flat), 0), frozenset({"forward_first_layer"}),
            "FSDP2 at the first layer's copy-out: the root unsharded, the layer's all-gather output and params",
            side_stream_bytes=layer_out)
        # the last layer's copy-out: the previous unit's all-gather output is freed only by it (as under ZeRO-3,
        # `fsdp_forward_working_set`), beside the last unit's own (`fsdp_forward_gather`). Measured:
        # docs/validation.md row 142.
        # Under torch pipelining no backward reshards (`set_reshard_after_backward(False)`), so once the stage has
        # run a backward its forwards gather nothing; those forwards (1F1B's steady state) hold the accumulated
        # gradients, more than a unit's all-gather output, so they bound the forward phase: no gathers counted.
        out["fsdp_forward_prev_gather"] = _gathered(
            where(piped_steady, 0, layer_out), {"forward_layer"},
            "FSDP2 previous unit's all-gather output, freed by the last unit's copy-out")
    else:
        # ZeRO-3: the root is gathered first and kept (reshard_after_forward=None on the root); each layer is
        # gathered for its forward and again for its backward, resharded after each
        out["fsdp_unsharded_params"] = Buffer(where(sharded, cb * root_flat, 0), keep,
                                              "FSDP2 root unit (embedding, final norm, head), kept unsharded")
        # backward: the current unit unsharded plus the next one's all-gather output (explicit backward
        # prefetch of 1, _fsdp_param_group.py `_backward_prefetch`); the post-backward reshards (frees) the
        # current unit before it allocates the reduce-scatter input (`post_backward`: reshard, then foreach_reduce)
        out["fsdp_backward_working_set"] = Buffer(
            layer_out, frozenset({"backward_layer", "backward_layer_end"}),
            "FSDP2 current unit unsharded (resharded at its post-backward)")
        out["fsdp_backward_prefetch"] = _gathered(
            layer_out, {"backward_prefetch"},
            "FSDP2 next unit's all-gather output (backward prefetch of 1; none in the last layer's backward)")
        # the next unit's pre-backward, after the previous one's post-backward: the copy-out fills its unsharded
        # parameters while its prefetched all-gather output is still live (the post-backward's activations,
        # timeline; its own prefetch is issued after the copy-out). Measured: docs/validation.md row 140.
        out["fsdp_backward_copy_out"] = Buffer(
            2 * layer_out, frozenset({"backward_copy_out"}),
            "FSDP2 a layer's backward copy-out: its all-gather output and unsharded params",
            side_stream_bytes=layer_out)
    # forward: the all-gather output of the last unit is kept (`comm_ctx.all_gather_state`, freed at the next
    # copy-out or at the root's post-forward), i.e. still live at the LM head
    if run.zero >= 3:
        # without pipelining the last layer is not resharded after its forward (torchtitan's default policy; its
        # backward follows at once): gathered through the loss until its own backward, where it is the current
        # unit of fsdp_backward_working_set
        out["fsdp_last_unit_kept"] = Buffer(where(sharded, where(run.pp > 1, 0, cb * layer_flat), 0),
                                            frozenset({"forward", "forward_head", "backward"}),
                                            "FSDP2 last layer kept gathered from its forward to its backward")
        # forward, from the last unit's copy-out to the end of its forward: its flat all-gather output and its
        # unsharded parameters (padded storage); at the copy-out also the previous unit's all-gather output
        # (below, freed only by this copy-out); the previous unit itself was resharded after its forward
        # (torch pipelining's steady state: the unit is still unsharded from its backward, no all-gather output)
        out["fsdp_forward_working_set"] = Buffer(where(piped_steady, layer_out, 2 * layer_out),
                                                 frozenset({"forward_layer", "forward_layer_end",
                                                            "forward_first_layer"}),
                                                 "FSDP2 last unit's all-gather output and unsharded params",
                                                 side_stream_bytes=where(piped_steady, 0, layer_out))
    # the first layer's copy-out: the root's all-gather output is still live (freed by the next copy-out),
    # beside the root's unsharded parameters and the first layer's working set (timeline: a forward moment
    # with only the embedding's output; measured, docs/validation.md rows 135 and 139)
    out["fsdp_root_gather_at_first_layer"] = _gathered(
        where(piped_steady, 0, where(sharded, cb * root_flat, 0)), {"forward_first_layer"},
        "FSDP2 root unit's all-gather output, freed by the first layer's copy-out")
    gather_at = {"forward_head", "forward_layer"} | ({"forward_layer_end"} if run.zero == 2 else set())
    out["fsdp_forward_gather"] = _gathered(where(piped_steady, 0, layer_out), gather_at,
                                           "FSDP2 all-gather output of the last unit, freed after the forward")
    # the first unsharded gradients of backward: the LM head's and final norm's (the root reduce-scatters only
    # at its post-backward, after the embedding: they stay unsharded all through backward) and the first
    # layer's down projection (the first weight gradient of a layer's backward)
    # (torch pipelining reduces once per step, after the last backward: its unsharded gradients accumulate and are
    # counted as the timeline's gradients, `pipelined_fsdp_grad_bytes`, and no reduce-scatter runs in between)
    per_unit = sharded & (pipelined_fsdp(run) == 0)
    head_g, down_g = first_backward_grad_elems(run, stage)
    out["fsdp_head_grads"] = Buffer(
        fsdp_unsharded_grad_bytes(run, stage, head_g),
        frozenset({"backward_layer", "backward_post", "backward_root", "backward_copy_out", "backward_layer_end"}),
        "unsharded grads of the LM head and final norm (reduced with the root, at the end of backward)")
    out["fsdp_unsharded_grads"] = Buffer(
        fsdp_unsharded_grad_bytes(run, stage, down_g), frozenset({"backward_layer"}),
        "unsharded grad of the down projection, the first weight gradient of a layer's backward")
    # the attention core's backward: the unsharded grads its layer's backward made before it (output projection,
    # MLP, the MLP's norm), the down projection's counted above; `timeline` adds this tag to the core's moments.
    # Measured: FSDP2 ZeRO-3 with a selectively recomputed eager core was -3.1% without it
    # (tests/test_validate_fsdp_moments.py)
    mats, mlp_norm = after_core_layer_elems(run)
    out["fsdp_after_core_unsharded_grads"] = Buffer(
        fsdp_unsharded_grad_bytes(run, stage, imax(mats + mlp_norm - down_g, 0)),
        frozenset({"backward_attention"}),
        "unsharded grads of a layer's output projection and MLP, live at its attention core's backward")
    # the end of a layer's backward: all its unsharded grads, before its post-backward (weight-heavy layers: short
    # sequences, wide MLPs). Measured: docs/validation.md row 141.
    # (torch pipelining with MixedPrecisionPolicy too: its post-backward adds them to the reduce-dtype accumulator
    # then, `FSDPParam.accumulate_unsharded_grad_if_needed`; without the policy AccumulateGrad adds each to `.grad`)
    piped_mp = sharded & (pipelined_fsdp(run) == 1) if run.recipe.compute_copy else 0 * sharded
    out["fsdp_layer_unsharded_grads"] = Buffer(
        where(per_unit | (piped_mp == 1), muldiv(cb * layer, share_num, share_den), 0),
        frozenset({"backward_layer_end"}),
        "a layer's unsharded grads at the end of its backward, before its post-backward")
    # the layer's post-backward: all its unsharded grads, copied into the reduce-scatter input (reduce dtype)
    out["fsdp_layer_reduce_scatter"] = Buffer(
        where(per_unit, muldiv(cb * layer + rb * layer_flat, share_num, share_den), 0), frozenset({"backward_post"}),
        "a layer's unsharded grads and their reduce-scatter input (its post-backward)")
    # from the second unit on, the previous unit's reduce-scatter input stays in flight until the next unit's
    # post-backward (comm_ctx.reduce_scatter_states, reduce_scatter_max_input_buffers = 1, _fsdp_param_group.py)
    out["fsdp_reduce_scatter_in_flight"] = Buffer(
        where(per_unit, muldiv(rb * layer_flat, share_num, share_den), 0), frozenset({"backward_layer_next",
                                                                                      "backward_root",
                                                                                      "backward_copy_out"}),
        "previous unit's reduce-scatter input, in flight during the next unit's backward and the root's")
    # end of backward: the root's reduce-scatter input (flat, padded, reduce dtype) beside, at the copy-in, all its
    # unsharded grads, or, once `foreach_reduce` has cleared their list and allocated the reduce-scatter output
    # (one padded shard), its last gradient: the loop variable of foreach_reduce's per-parameter loop (run where
    # the shard group has more than one rank) keeps the unit's last-registered parameter's gradient until it
    # returns (the LM head's, or its bias, on the last stage). The output becomes the root's sharded gradient
    # (fsdp_root_shard_grad_bytes) or, in a later micro-batch, is added to it. Measured: docs/validation.md row 138.
    last = _root_last_elems(run, stage)
    rs_out = rb * cdiv(root_flat, imax(d, 1)) + cb * last
    # (pipelined: `perform_reduce_grad` reduces each unit in turn after the last backward, every unsharded gradient
    # still live beside the first one's reduce-scatter input; `foreach_reduce` drops the unit's accumulated
    # gradients, all but the loop's last one, before it allocates the output, a 1/d of the input: that moment is
    # lower wherever the unit's other gradients outweigh the output)
    piped_rs = rb * imax(root_flat, layer_flat)
    out["fsdp_root_reduce_scatter"] = Buffer(
        where(sharded, muldiv(where(per_unit, rb * root_flat + imax(cb * root, rs_out), piped_rs), share_num,
                              share_den), 0),
        frozenset({"backward_end"}),
        "root unit's reduce-scatter input, beside its unsharded grads or its output and last grad (end of backward)")
    if r.compute_copy:
        casts = _amp_casts(run, stage, n_train)
        out["amp_weight_casts"] = Buffer(where(sharded, 0, casts.bytes), casts.phases, casts.note + " (no FSDP)")
        out["amp_weight_casts_step_cache"] = _amp_casts_step_cache(run, out["amp_weight_casts"])
        head = _amp_head_cast_saved(run)
        out["amp_head_cast_saved"] = Buffer(where(sharded, 0, head.bytes), head.phases, head.note)
    return out


def _megatron_buffers(run: Run, stage: Num) -> dict[str, Buffer]:
    # The contiguous grad buffer (_ParamAndGradBuffer, fp32 main_grad) is `grads` in states.py; the distributed
    # optimizer reduce-scatters and all-gathers in place in the grad and param buffers (no extra copy).
    # TransformerEngine with gradient-accumulation fusion accumulates wgrad into main_grad and hands autograd a
    # cached dummy wgrad per weight shape (SimuMax measured ~2 GiB of these on a 70B-wide stage).
    pb = DTYPE_BYTES[run.recipe.param_dtype]
    if run.training.lora_rank is not None:
        return {}  # frozen base weights compute no wgrad; adapters are not TE linears
    return {
        "te_dummy_wgrads": Buffer(
            pb * _te_dummy_wgrad_elems(run, stage), ALL_PHASES, "TE dummy wgrad cache, one per weight shape"
        )
    }


def _deepspeed_buffers(run: Run, stage: Num) -> dict[str, Buffer]:
    r = run.recipe
    d = run.shard_degree
    n = _stage_elems(run, stage)
    pb = DTYPE_BYTES[r.param_dtype]  # DeepSpeed's `self.dtype`: the low-precision parameter dtype
    gb = DTYPE_BYTES[r.grad_dtype]
    out: dict[str, Buffer] = {}
    z = run.zero
    overlap = _knob(run, "overlap_comm", z == 3)  # zero/config.py overlap_comm_valid: True only for stage 3
    contiguous = _knob(run, "contiguous_gradients", DS_CONTIGUOUS_GRADIENTS)
    reduce_bucket = _knob(run, "reduce_bucket_size", DS_REDUCE_BUCKET_SIZE)
    if z == 0:
        # engine.allreduce_gradients -> buffered_allreduce_fallback: grads flattened into buckets of up to
        # allreduce_bucket_size elements, all-reduced and copied back, at the end of backward.
        bucket = _knob(run, "allreduce_bucket_size", DS_ALLREDUCE_BUCKET_SIZE)
        out["allreduce_bucket"] = Buffer(
            where(d > 1, gb * imin(n, bucket), 0), OPTIMIZER, "flattened all-reduce bucket (end of backward)"
        )
    elif z in (1, 2):
        # stage_1_and_2.py backward(): with contiguous_gradients, ipg_buffer = [torch.empty(reduce_bucket_size,
        # dtype=self.dtype)] (+ a second one when overlap_comm), allocated at backward start, released by
        # _release_ipg_buffers at the end of backward. Not clamped to the model size. The all-gather of updated
        # params after the step works in place on the flat fp16 partitions (allgather_bucket_size only chunks it).
        if contiguous:
            count = 2 if overlap else 1
            out["zero_ipg_buffers"] = Buffer(
                count * pb * reduce_bucket, BACKWARD, f"{count} x reduce_bucket_size gradient bucket(s)"
            )
    else:
        largest, _layer = stage_units(run, stage)
        cb = pb
        # DeepSpeed's own estimator (estimate_zero3_model_states_mem_needs): largest_layer_memory =
        # 4 * largest_layer_params, i.e. the unsharded fp16 param + fp16 grad of the largest layer.
        out["zero3_largest_layer"] = Buffer(
            2 * cb * largest, FWD_BWD, "unsharded params + grads of the largest layer (DeepSpeed estimator)"
        )
        # stage3.py _setup_for_real_optimizer: __ipg_bucket_flat_buffer = torch.empty(reduce_bucket_size,
        # dtype=self.dtype) when contiguous_gradients, allocated once and kept.
        if contiguous:
            out["zero3_ipg_bucket"] = Buffer(
                pb * reduce_bucket, ALL_PHASES, "persistent reduce_bucket_size gradient bucket"
            )
        prefetch = _knob(run, "stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET_SIZE)
        out["zero3_prefetch"] = Buffer(
            cb * imin(prefetch, n), FWD_BWD, "parameters prefetched ahead (stage3_prefetch_bucket_size)"
        )
        # partitioned_param_coordinator.py __params_to_release: once the trace is recorded, a module's params are
        # kept if they are used again within max_reuse_distance elements of the trace. At the forward/backward
        # turn the last layers are reused after 2x the params in between, so about max_reuse_distance / 2
        # elements stay gathered, bounded by stage3_max_live_parameters and the stage itself.
        reuse = _knob(run, "stage3_max_reuse_distance", DS_MAX_REUSE_DISTANCE)
        live = _knob(run, "stage3_max_live_parameters", DS_MAX_LIVE_PARAMETERS)
        kept = imin(imin(reuse // 2, live), n)
        out["zero3_reuse_window"] = Buffer(
            cb * kept, FWD_BWD, "params kept gathered across the forward/backward turn (max_reuse_distance)"
        )
    return out


def stage_buffers(run: Run, stage: Num = 0) -> dict[str, Buffer]:
    """Named buffers of one rank of pipeline stage `stage` (bytes; see the module docstring for the phases)."""
    if run.profile == "torch":
        out = _torch_buffers(run, stage)
        r = run.recipe
        if r.master_weights and r.grad_dtype != "fp32" and not r.fp32_grad_copy and run.offload == "none":
            # low-precision grads stepped on fp32 masters (apex amp O2 `master_params_to_model_params`, the
            # harness's MasterOptimizer): each grad is upcast to fp32 for the step and dropped after it
            elems = _trainable_shard_elems(run, stage) if run.zero >= 1 else _trainable_elems(run, stage)
            # under torch TP the embedding's gradient, and so its upcast, is replicated (row 149)
            elems = elems + replicated_embedding_grad(run, stage)[0] * steps_every_tensor(run)
            out["master_grad_upcast"] = Buffer(4 * elems, OPTIMIZER, "fp32 copies of the grads for the master step")
    elif run.profile == "megatron":
        out = _megatron_buffers(run, stage)
    else:
        out = _deepspeed_buffers(run, stage)
    out.update(_foreach_temporaries(run, stage))
    out.update(_workspaces(run))
    out.update(_rope_cache(run, stage))
    return out


def _rope_cache(run: Run, stage: Num) -> dict[str, Buffer]:
    """A rotary table the model code registers as a buffer (`--rope-cache`): torchtune's
    RotaryPositionalEmbeddings.build_rope_cache stacks cos and sin of positions x rope_dim/2 angles in fp32.
    torchtune 0.1 keeps one per layer (`_get_clones` deep-copies the first layer, its RoPE module with it); its
    builders since 0.2 pass one module to every layer. Buffers are neither sharded by FSDP nor split by TP; a
    pipeline stage holds the tables of its own layers (or the one shared table)."""
    t, m = run.training, run.model
    if not t.rope_cache_positions:
        return {}
    width = m.mla.qk_rope_dim if m.mla is not None else m.head_dim
    one = 4 * t.rope_cache_positions * (width // 2) * 2
    tables = stage_layers(run, stage) if t.rope_cache_per_layer else 1
    return {"rope_cache": Buffer(one * tables, ALL_PHASES, "the model's rotary cos/sin table(s), fp32")}


# NCCL communicator memory (outside the caching allocator, so part of the runtime overhead, not of `stage_buffers`).
# NVIDIA/nccl issue #964: one communicator of 2 ranks took 544 MiB, of 3-4 ranks 688 MiB (4x A100, NVLink, after an
# all-reduce); issue #986 (NCCL maintainer): memory grows with channels, ring needs 2 connections at any scale, more
# communicators = more memory. GPU presets' runtime_overhead_bytes hold the CUDA context plus one communicator.
NCCL_COMM_BYTES_2_RANKS = 544 * MiB
NCCL_COMM_BYTES = 688 * MiB


def _comm_bytes(size: Num) -> Num:
    return where(size > 2, NCCL_COMM_BYTES, where(size == 2, NCCL_COMM_BYTES_2_RANKS, 0))


def communicator_bytes(run: Run) -> tuple[Num, Num]:
    """(all, largest): NCCL memory of the process groups one rank joins -- TP, PP, CP, EP and the data-parallel /
    shard group (dp x cp) -- each of size > 1 holding its own communicator, and the largest single one."""
    sizes = [run.tp, run.pp, run.cp, run.ep, run.shard_degree]
    total, largest = 0, 0
    for size in sizes:
        b = _comm_bytes(size)
        total = total + b
        largest = imax(largest, b)
    return total, largest


def extra_communicator_bytes(run: Run) -> Num:
    """NCCL memory beyond the one communicator a GPU preset's runtime_overhead_bytes already includes."""
    total, largest = communicator_bytes(run)
    return total - largest


def phase_total(buffers: dict[str, Buffer], phase: str) -> Num:
    """Sum of the buffers live at `phase`'s peak moment."""
    total = 0
    for b in buffers.values():
        if phase in b.phases:
            total = total + b.bytes
    return total
