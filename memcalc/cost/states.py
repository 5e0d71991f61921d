"""Model states per rank: parameters, master weights, gradients and optimizer state. DESIGN section 4.

Bytes per parameter come from the profile's `Recipe` (memcalc/specs.py). Sharding (Rajbhandari et al. 2019,
"ZeRO", sec. 5.1-5.3): stage 1 shards the optimizer state, including fp32 master weights and any fp32 gradient
copy the optimizer keeps; stage 2 also the gradients; stage 3 also the parameters. The shard group is dp x cp
(`Run.shard_degree`); expert parameters shard over dp x cp / ep. Every shard is rounded up to whole elements (FSDP
and DeepSpeed pad flat buffers to equal shards).

Profile specifics:
- megatron: ZeRO-1 is the distributed optimizer; bytes per parameter 18 (bf16 params, fp32 main grads, fp32
  master and Adam moments) or 6 + 12/dp distributed; with fp16 grads an fp32 gradient copy is kept in the
  optimizer: 20 or 4 + 16/dp (Megatron-LM docs/user-guide/features/dist_optimizer.md).
- deepspeed: low-precision grads plus an fp32 gradient partition held by the optimizer
  (runtime/zero/stage_1_and_2.py `single_partition_of_fp32_groups`); under ZeRO-3 the reduced gradient lives only
  in the fp32 partition (`fp32_partitioned_groups_flat`), so no persistent low-precision gradient shard. This is
  the accounting of DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`: 2P + 18P/N;
  `estimate_zero3_model_states_mem_needs`: 18P/N plus the largest layer).
- torch: AMP and FSDP2 `MixedPrecisionPolicy` keep fp32 parameters that double as the master copy and fp32
  gradients; ZeroRedundancyOptimizer is ZeRO-1, FSDP2 `fully_shard(reshard_after_forward=False)` ZeRO-2-like
  and the default ZeRO-3.

Offload (ZeRO-Offload, Ren et al. 2021): `optimizer` moves master weights, moments and the fp32 gradient copy to
CPU memory (DeepSpeed also the reduced gradient partitions); `params` (ZeRO-3 only) also the parameter shards.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memcalc.cost.params import (
    attention_matrix_shapes,
    grads_persistent,
    mlp_matrix_shapes,
    mlp_width,
    replicated_embedding_grad,
    stage_layers,
    stage_params,
    steps_every_tensor,
)
from memcalc.specs import DTYPE_BYTES, Run
from memcalc.xp import cdiv, muldiv, where

Num = Any

# bitsandbytes 8-bit blockwise optimizers: one fp32 absmax per block of 256 values per state
# (bitsandbytes/functional.py, optimizer blocksize 256; Dettmers et al. 2022 "8-bit Optimizers", sec. 2).
ADAM8BIT_BLOCK = 256


@dataclasses.dataclass(frozen=True, slots=True)
class ModelStates:
    """Bytes held on one GPU (and offloaded to its host) by one rank of one pipeline stage."""

    params: Num
    master_weights: Num
    grads: Num  # gradients in the grad dtype (as accumulated in backward)
    grads_fp32: Num  # the fp32 gradient copy kept by the optimizer (megatron/deepspeed with low-precision grads)
    optimizer: Num  # moments (and 8-bit scales / Adafactor factors)
    cpu: Num  # offloaded bytes on the host
    stage_params: Num  # parameters of this rank's stage after TP/EP sharding (elements, before ZeRO)
    grads_persistent: bool  # gradient buffers stay allocated between steps (megatron/deepspeed buffers)
    trainable_params: Num = 0  # elements that receive gradients on this rank (before ZeRO)
    frozen_params_bytes: Num = 0  # frozen (possibly quantized) weights, included in `params`
    ps_server: Num = 0  # parameter-server mode: bytes on the server per worker's model (not on this GPU)
    stepped_params: Num = 0  # elements this rank's optimizer steps (its ZeRO shard of the trainable ones)
    # the element counts behind the byte figures (`--explain` multiplies them out; JSON model_states_detail):
    param_elems: Num = 0  # trainable elements whose parameters this rank holds (its ZeRO-3 / FSDP2 shard, else all)
    grad_elems: Num = 0  # elements of the gradients this rank holds, incl. a TP-replicated embedding gradient
    embedding_grad_extra: Num = 0  # of which: the word embedding's gradient beyond its vocab shard
    expert_params: Num = 0  # trainable expert elements among `trainable_params` (sharded over dp*cp/ep by ZeRO)
    weight_versions: Num = 1  # PipeDream's stashed weight versions (params = versions x one copy)

    @property
    def total(self) -> Num:
        return self.params + self.master_weights + self.grads + self.grads_fp32 + self.optimizer


def optimizer_state_bytes(run: Run, n_elems: Num, stage: Num) -> Num:
    """Optimizer state (without master weights) for `n_elems` parameters of `stage` on one rank, unsharded."""
    opt = run.training.optimizer
    mb = DTYPE_BYTES[run.recipe.moment_dtype]
    if opt in ("adam", "adamw"):
        return 2 * mb * n_elems  # exp_avg, exp_avg_sq (Kingma & Ba 2015)
    if opt in ("lion", "sgd-momentum"):
        return mb * n_elems  # one momentum buffer (Chen et al. 2023; torch.optim.SGD momentum_buffer)
    if opt == "sgd":
        return 0 * n_elems
    if opt == "adam-8bit":
        return 2 * n_elems + 2 * 4 * cdiv(n_elems, ADAM8BIT_BLOCK)
    # adafactor (Shazeer & Stern 2018, sec. 3): factored second moment, one row and one column statistic per
    # matrix, full second moment for vectors, no first moment (beta1 = None, the paper's default).
    return mb * _adafactor_elems(run, n_elems, stage)


def _adafactor_elems(run: Run, n_elems: Num, stage: Num) -> Num:
    """Adafactor statistics for the stage: rows + cols per weight matrix (embedding and LM head included),
    every element for vectors (norms, biases); scaled to the `n_elems` this rank holds under ZeRO."""
    from memcalc.cost.params import layer_params, padded_vocab

    m = run.model
    h = m.hidden
    attn = attention_matrix_shapes(m, run.tp)  # q; k and v; o (MLA: five)
    mlp = mlp_matrix_shapes(m, mlp_width(m), run.tp)  # gate/up (or fc); down (MoE: one expert)

    def stats(group: list) -> tuple[Num, Num]:
        f, e = 0, 0
        for rows, cols, count in group:
            f, e = f + count * (rows + cols), e + count * rows * cols
        return f, e

    fa, ea = stats(attn)
    fm, em = stats(mlp)
    if m.moe is not None:
        n_mlps = m.moe.experts // run.ep + m.moe.shared_experts
        fm, em = fm * n_mlps + m.moe.experts + h, em * n_mlps + m.moe.experts * h  # + the router matrix
    factored, matrix_elems = fa + fm, ea + em
    dense_l, expert_l = layer_params(m, run.tp, run.ep)
    vectors = dense_l + expert_l - matrix_elems  # norms and biases
    n_layers = stage_layers(run, stage)
    rows_v = cdiv(padded_vocab(m, run.profile, run.tp), run.tp)
    emb = rows_v + h + (m.max_positions + h if m.positions == "learned" else 0)
    head = where(stage == 0, 0, rows_v + h) if m.tied_embeddings else rows_v + h + (rows_v if m.head_bias else 0)
    stage_total = n_layers * (factored + vectors) + where(stage == 0, emb, 0) + where(
        stage == run.pp - 1, head + h * (2 if m.norm == "layernorm" else 1), 0
    )
    dense, expert = stage_params(run, stage)
    full = dense + expert
    return -muldiv(-stage_total, n_elems, where(full > 0, full, 1))  # ceil(stage_total * n / full), int64-safe


def frozen_bytes(run: Run, linear: Num, rows: Num, mats: Num, other: Num) -> Num:
    """Bytes of frozen weights. Quantized storage (--base-dtype) applies to the layers' linear weights:
    - nf4 (QLoRA, Dettmers et al. 2023, sec. 2-3): 4 bits per weight plus one absmax per block of 64; with double
      quantization the absmax is 8-bit and each 256 blocks share one fp32 second-level constant
      (8/64 + 32/(64*256) = 0.127 bits per parameter), else an fp32 absmax (0.5 bits);
    - int8 (LLM.int8, bitsandbytes Int8Params): 1 byte per weight plus an fp32 scale per output row;
    - fp8: 1 byte per weight plus an fp32 scale per tensor.
    Other frozen tensors (embeddings, norms, head) and unquantized linears use --base-dtype when it is a float
    type, else the compute dtype with LoRA (PEFT loads the base model in bf16) or the param dtype with --freeze."""
    t, r = run.training, run.recipe
    float_dtype = t.base_dtype if t.base_dtype in DTYPE_BYTES and t.base_dtype != "fp8" else None
    if float_dtype is None:
        float_dtype = r.compute_dtype if t.lora_rank is not None else r.param_dtype
    fb = DTYPE_BYTES[float_dtype]
    if t.base_dtype == "nf4":
        scales = cdiv(linear, 64) + 4 * cdiv(linear, 64 * 256) if t.double_quant else 4 * cdiv(linear, 64)
        lin_bytes = cdiv(linear, 2) + scales
    elif t.base_dtype == "int8":
        lin_bytes = linear + 4 * rows
    elif t.base_dtype == "fp8":
        lin_bytes = linear + 4 * mats
    else:
        lin_bytes = fb * linear
    return lin_bytes + fb * other


def model_states(run: Run, stage: Num = 0) -> ModelStates:
    """Per-GPU model-state bytes of one rank of pipeline stage `stage`."""
    from memcalc.cost.params import stage_param_split, zero1_partition_applies, zero1_rank_elems

    r, m = run.recipe, run.model
    split = stage_param_split(run, stage)
    finetune = run.training.lora_rank is not None or bool(run.training.freeze)
    dense, expert = split.trainable_dense, split.trainable_expert
    n = dense + expert
    d = run.shard_degree
    de = d // run.ep  # expert data-parallel group

    def shard(x_dense: Num, x_expert: Num) -> Num:
        return cdiv(x_dense, d) + cdiv(x_expert, de)

    def param_shard(x_dense: Num, x_expert: Num) -> Num:
        """ZeRO-2/3 shard of the parameters and grads. torch (FSDP2) shards tensor by tensor, padding dim 0
        (params.fsdp_shard_elems); a flat buffer (DeepSpeed, Megatron) pads once."""
        if fsdp_shard is not None:
            return fsdp_shard
        return shard(x_dense, x_expert)

    fsdp_shard = None
    if run.zero >= 2 and run.profile == "torch" and not finetune and m.moe is None:  # categorical tests only
        from memcalc.cost.params import fsdp_shard_elems

        fsdp_shard = fsdp_shard_elems(run, stage, d)

    z = run.zero
    pb, gb = DTYPE_BYTES[r.param_dtype], DTYPE_BYTES[r.grad_dtype]

    # FSDP2's ZeRO-2-like mode (reshard_after_forward=False) also keeps only the parameter shard between steps;
    # the unsharded copy is a forward/backward buffer (memcalc/cost/buffers.py `fsdp_unsharded_params`)
    param_elems = param_shard(dense, expert) if (z >= 3 or (z == 2 and run.profile == "torch")) else n
    params = pb * param_elems
    frozen = frozen_bytes(run, split.frozen_linear, split.frozen_linear_rows, split.frozen_linear_matrices,
                          split.frozen_other)
    # frozen weights have nothing for ZeRO-1/2 to shard; ZeRO-3 / FSDP2 shards them like any parameter
    frozen = cdiv(frozen, d) if z >= 3 else frozen
    if run.schedule in ("pipedream", "pipedream-2bw"):
        # weight stashing (Narayanan et al. 2019, PipeDream sec. 3.3): one weight version per in-flight
        # micro-batch, pp - stage on stage `stage`; PipeDream-2BW keeps two (Narayanan et al. 2021, sec. 3.1)
        versions = run.pp - stage if run.schedule == "pipedream" else 2 + 0 * stage
        params = params + (versions - 1) * params
    else:
        versions = 1
    if run.profile == "deepspeed" and z >= 3 and r.fp32_grad_copy:
        grad_elems = 0 * n  # reduced straight into the fp32 partition (stage3.py)
    else:
        grad_elems = param_shard(dense, expert) if z >= 2 else n
    # FSDP2 keeps the optimizer state on its per-tensor shards; ZeRO-1 and flat-buffer frameworks pad once
    # DTensor RowwiseParallel on nn.Embedding (torchtitan's plan): the weight is vocab-sharded but its gradient
    # comes back replicated at full V x h on every TP rank (validation-findings.md, measured to the byte)
    emb_extra, _ = replicated_embedding_grad(run, stage)
    grad_elems = grad_elems + emb_extra
    grads = gb * grad_elems
    opt_elems = (param_shard(dense, expert) if z >= 2 else shard(dense, expert)) if z >= 1 else n
    if zero1_partition_applies(run):
        opt_elems = zero1_rank_elems(run, stage)  # whole tensors per rank, greedy largest-first
    master = 4 * opt_elems if r.master_weights else 0 * n
    grads_fp32 = 4 * opt_elems if r.fp32_grad_copy else 0 * n
    optimizer = optimizer_state_bytes(run, opt_elems, stage)
    if run.training.optimizer == "sgd-momentum" and run.profile == "torch":
        # torch SGD's first step clones each gradient into its momentum buffer (`torch.clone(grad).detach()`), so
        # the embedding's is replicated like its gradient (measured: docs/validation.md row 147). A ZeRO-1 rank
        # steps only its partition: left at the shard there.
        optimizer = optimizer + DTYPE_BYTES[r.moment_dtype] * emb_extra * steps_every_tensor(run)
    ps_server = 0 * n
    if run.dp_mode == "ps":
        # parameter server (Li et al. 2014): workers push gradients and pull parameters; the server holds the
        # master parameters, the accumulated gradients and the optimizer state, the workers only params + grads.
        ps_server = pb * n + gb * n + master + grads_fp32 + optimizer
        master, grads_fp32, optimizer = 0 * n, 0 * n, 0 * n

    cpu = 0 * n
    if run.offload in ("optimizer", "params"):
        cpu = cpu + master + grads_fp32 + optimizer
        master, grads_fp32, optimizer = 0 * n, 0 * n, 0 * n
        if run.profile == "deepspeed" and z >= 2:
            cpu = cpu + grads
            grads = 0 * n
    if run.offload == "params":
        cpu = cpu + params + grads + frozen
        params, grads, frozen = 0 * n, 0 * n, 0 * n

    persistent = grads_persistent(run)
    return ModelStates(
        params=params + frozen,
        master_weights=master,
        grads=grads,
        grads_fp32=grads_fp32,
        optimizer=optimizer,
        cpu=cpu,
        stage_params=n + split.frozen,
        grads_persistent=persistent,
        trainable_params=n,
        frozen_params_bytes=frozen,
        ps_server=ps_server,
        stepped_params=opt_elems,
        param_elems=param_elems,
        grad_elems=grad_elems,
        embedding_grad_extra=emb_extra,
        expert_params=expert,
        weight_versions=versions,
    )
