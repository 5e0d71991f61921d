"""FLOPs, step time, tokens/s and MFU. DESIGN.md section 6; derivations and sources in docs/methodology.md.

FLOPs are counted from the layer shapes in memcalc/cost/params.py (`attention_matrix_shapes`,
`mlp_matrix_shapes`), never from a blended 6N:
- matmuls: 2 FLOPs per weight element per token in the forward pass (one multiply-add), for every weight matrix a
  token passes through: q, k, v (GQA-sized), o, the MLP (2 or 3 matrices), for MoE the router plus `top_k` routed
  and the shared experts (only the active experts), and the LM head (2*h*V). The embedding lookup is not a matmul.
  Norms, biases, softmax and the loss are ignored (well under 1%).
- attention core: QK^T and AV, 2*s*(a*d) FLOPs each per token per layer in the forward pass, 4*s*a*d in all,
  counted over the full s x s square as in Narayanan et al. 2021 (sec. 5.1) and PaLM (Chowdhery et al. 2022,
  appendix B), even though causal kernels skip half of it.
- backward = 2 x forward (Kaplan et al. 2020 sec. 2.1; Narayanan et al. 2021 sec. 5.1): model FLOPs = 3 x forward;
  when fine-tuning, frozen weights skip the weight-gradient GEMM (`backward_flops_per_token`).
- recompute: full adds one more forward of the recomputed layers (Narayanan et al. 2021: 4 x forward, the
  `96 B s l h^2 (1 + s/(6h) + V/(16 l h))` formula); selective adds the attention-core forward of those layers
  (Korthikanti et al. 2022 sec. 5).
For a GPT layer (MHA, GELU MLP with ffn = 4h) this reproduces Narayanan's formula exactly (tests/test_compute.py).

Time (DESIGN section 6): compute = FLOPs incl. recompute / (gpus * peak * assumed efficiency), where the assumed
efficiency (`training.mfu`, else `hardware.default_mfu`) is the fraction of peak the kernels reach while busy;
+ pipeline bubble (pp-1)/(vpp*m) of the compute time (Narayanan et al. 2021 sec. 2.2); + the communication that
does not overlap (memcalc/cost/comm.py `exposed_comm_seconds`). The achieved MFU is model FLOPs (no recompute)
/ (step time * peak * gpus) (PaLM appendix B).

Every numeric layout field may be a numpy array (planner bulk mode): only arithmetic and memcalc.xp helpers are
applied to them, and FLOPs are carried as floats before multiplying by the token count (int64 would overflow).
"""

from __future__ import annotations

from typing import Any

from memcalc.cost.params import (
    attention_matrix_shapes,
    checkpointed_layers,
    dense_layer_run,
    first_dense_layers,
    lora_layer_params,
    mlp_matrix_shapes,
    mlp_width,
    stage_layers,
)
from memcalc.errors import InputError
from memcalc.specs import DTYPE_BYTES, Run, freeze_layers
from memcalc.xp import imax, imin

Num = Any


# ---------------------------------------------------------------------------------------------------- hardware


def peak_flops_per_gpu(run: Run) -> float:
    """Dense peak FLOP/s of one GPU for the run's matmul dtype: `hardware.flops[precision]` (fp8 recipes use the
    fp8 figure), else the compute dtype's, else (fp32 training) the tf32 tensor-core figure; 0.0 when unknown."""
    f = run.hardware.flops
    for key in (run.training.precision, run.recipe.compute_dtype, "tf32" if run.recipe.compute_dtype == "fp32" else ""):
        if key and f.get(key, 0.0) > 0:
            return float(f[key])
    return 0.0


def assumed_mfu(run: Run) -> float:
    """Fraction of peak the kernels reach while computing: `training.mfu`, else the GPU preset's default."""
    return float(run.training.mfu if run.training.mfu is not None else run.hardware.default_mfu)


def _rate(run: Run) -> float:
    """Sustained FLOP/s of one GPU while computing (0.0 when the peak is unknown)."""
    return peak_flops_per_gpu(run) * assumed_mfu(run)


# ---------------------------------------------------------------------------------------------------- FLOPs


def matmul_weights_per_token(run: Run) -> int:
    """Weight elements of one layer's matmuls that one token passes through (whole model, no TP split).
    The attention's matrices and one MLP's (for MoE one expert's, times the experts a token passes)."""
    m = run.model
    attn = sum(r * c * k for r, c, k in attention_matrix_shapes(m, 1))
    mlp = sum(r * c * k for r, c, k in mlp_matrix_shapes(m, mlp_width(m), 1))
    if m.moe is not None:
        # router (h x E) + the top-k routed experts + the shared experts (Fedus et al. 2021; Mixtral/DeepSeek-MoE)
        mlp = m.hidden * m.moe.experts + (m.moe.top_k + m.moe.shared_experts) * mlp
    return attn + mlp


def weights_per_token_from(run: Run, start: int) -> int:
    """Matmul weight elements one token passes through in layers start..L-1: MoE layers, and the model's first
    dense layers (MoESpec.first_dense_layers) where they fall in that range."""
    m = run.model
    k = first_dense_layers(m)
    n_dense = max(k - start, 0)
    dense = matmul_weights_per_token(dense_layer_run(run)) if n_dense else 0
    return (m.layers - max(start, k)) * matmul_weights_per_token(run) + n_dense * dense


def attention_core_flops_per_token(run: Run) -> int:
    """QK^T + AV of one layer, forward, per token: 2*s*(a*d) each (Narayanan et al. 2021 sec. 5.1); with MLA the
    scores use the query/key width (nope + rope) and AV the value width."""
    m = run.model
    v = m.mla.v_head_dim if m.mla is not None else m.head_dim
    return 2 * run.seq * m.heads * (m.head_dim + v)


def lora_flops_per_token(run: Run) -> int:
    """Forward FLOPs of one layer's LoRA adapters per token: 2 per adapter weight (Hu et al. 2021 sec. 4.1: the
    low-rank path x A^T B^T runs beside the frozen W)."""
    t = run.training
    if t.lora_rank is None:
        return 0
    return 2 * lora_layer_params(run.model, t.lora_targets, t.lora_rank, 1)


def layer_forward_flops_per_token(run: Run) -> int:
    return 2 * matmul_weights_per_token(run) + attention_core_flops_per_token(run) + lora_flops_per_token(run)


def head_forward_flops_per_token(run: Run) -> int:
    """LM head matmul: 2*h*V (the unpadded vocabulary: model FLOPs, not padding)."""
    return 2 * run.model.hidden * run.model.vocab


def forward_flops_per_token(run: Run) -> int:
    m = run.model
    return (2 * weights_per_token_from(run, 0) + m.layers * (attention_core_flops_per_token(run)
                                                          + lora_flops_per_token(run))
            + head_forward_flops_per_token(run))


def backward_flops_per_token(run: Run) -> int:
    """Backward = input gradients (as many FLOPs as the forward matmuls; the attention core twice its forward:
    dQ, dK from dS and dV, dP from dO) + weight gradients (as many FLOPs as the forward of the *trainable*
    matmuls). Full training: exactly 2 x forward. Fine-tuning (issue 7): frozen weights skip the weight-gradient
    GEMM; with the embeddings and the first K layers frozen, backward stops at layer K (nothing below needs a
    gradient); LoRA trains the adapters only."""
    m, t = run.model, run.training
    att = attention_core_flops_per_token(run)
    lora = lora_flops_per_token(run)
    head = head_forward_flops_per_token(run)
    L = m.layers
    if t.lora_rank is not None:
        return 2 * weights_per_token_from(run, 0) + L * (2 * att + lora) + head + L * lora
    k = freeze_layers(t)
    emb_frozen = "embeddings" in t.freeze
    head_trainable = not (emb_frozen if m.tied_embeddings else "head" in t.freeze)
    start = k if emb_frozen else 0
    return (2 * weights_per_token_from(run, start) + (L - start) * 2 * att + head
            + 2 * weights_per_token_from(run, k) + (head if head_trainable else 0))


def model_flops_per_token(run: Run) -> int:
    """Forward + backward, no recompute: the numerator of MFU (3 x forward for full training)."""
    return forward_flops_per_token(run) + backward_flops_per_token(run)


def recomputed_layers(run: Run) -> Num:
    """Layers whose forward is replayed in backward, summed over pipeline stages: all of them, or with
    `recompute_layers = k` the first k layers of every stage (Megatron `--recompute-method block`), with
    `recompute_every = k` every k-th layer of every stage (torchtitan; params.checkpointed_layers)."""
    t, m, pp = run.training, run.model, run.pp
    base = m.layers // pp
    extra = m.layers % pp  # `extra` stages hold base + 1 layers (params.stage_layers)
    return (extra * checkpointed_layers(t.recompute, t, base + 1)
            + (pp - extra) * checkpointed_layers(t.recompute, t, base))


def stage_recomputed_layers(run: Run, stage: Num) -> Num:
    """Recomputed layers of one pipeline stage (used by the TP/CP/EP collective counts)."""
    return checkpointed_layers(run.training.recompute, run.training, stage_layers(run, stage))


def recompute_flops_per_token(run: Run) -> Num:
    """Extra forward work in backward: full = a whole layer forward, selective = the attention core forward."""
    if run.training.recompute == "full":
        per_layer = layer_forward_flops_per_token(run)
    elif run.training.recompute == "op":
        # torchtitan's op-level SAC re-runs every second matmul of the layer: k, o and up (GELU: k, o, proj);
        # elementwise ops are not counted. Model FLOPs (tp does not divide per-token model FLOPs here)
        m = run.model
        up = m.hidden * m.ffn
        per_layer = 2 * (m.hidden * m.kv_heads * m.head_dim + m.heads * m.head_dim * m.hidden + up)
    elif run.training.recompute == "selective":
        per_layer = attention_core_flops_per_token(run)
    else:
        per_layer = 0
    return recomputed_layers(run) * per_layer


def tokens_per_step(run: Run) -> Num:
    return run.global_batch * run.seq


def model_flops_per_step(run: Run) -> Num:
    """6N-style model FLOPs of one optimizer step, without recompute (float)."""
    return tokens_per_step(run) * (model_flops_per_token(run) * 1.0)


def flops_per_step(run: Run) -> Num:
    """FLOPs executed in one optimizer step, including recompute (float)."""
    return tokens_per_step(run) * ((model_flops_per_token(run) + recompute_flops_per_token(run)) * 1.0)


# ---------------------------------------------------------------------------------------------------- time


def eager_score_bytes(run: Run) -> tuple[int, int]:
    """(forward, backward) bytes of HBM traffic per element of an eager attention core's s x s scores: one read or
    write of the whole tensor per pass, each pass a kernel of its own (0, 0 where the core is fused).

    Hugging Face's eager attention (the torch and DeepSpeed profiles; transformers models/llama/modeling_llama.py
    `eager_attention_forward`; SDPA's math fallback runs the same passes), c = compute-dtype bytes:
    - forward: `q @ k^T` writes the scores (c); `* scaling` and `+ causal_mask` each read and write them (2c + 2c;
      the mask, broadcast over the heads, is not counted); `softmax(dtype=float32)` reads them and writes fp32
      (c + 4) and `.to(dtype)` reads that and writes the copy (4 + c); the value matmul reads the probabilities
      (c): 8c + 8 bytes. In fp32 (c = 4) softmax writes c and there is no copy: 8c.
    - backward: the value matmul writes the probabilities' gradient and its weight-side gradient reads the
      probabilities (2c); `.to`'s backward reads c and writes 4; softmax's backward reads its gradient and its fp32
      output and writes the input's gradient in the input's dtype (8 + c); `* scaling` reads and writes (2c); the two
      gradient matmuls of `q @ k^T` read the scores' gradient (2c): 8c + 12 bytes; in fp32 9c.
    Megatron's fused scale-mask-softmax (megatron/core/fusions/fused_softmax.py, `--attention eager`): the scores
    (c), one kernel reading them and writing the probabilities (2c), the value matmul's read (c): 4c; backward 2c
    for the value matmul, 3c for the fused backward (gradient and output in, gradient out), 2c for the score
    matmuls: 7c.
    Dropout on the probabilities adds a pass each way: read c, write c, the bool mask 1 byte (2c + 1). Gemma 2's
    softcapping (`_attn_softcap`: `/ cap`, `tanh`, `* cap`) adds three forward passes (6c) and their backwards
    (the multiply's and the divide's 2c each, tanh's 3c: gradient and saved output in, gradient out)."""
    from memcalc.cost.activations import _attn_softcap, eager_core

    if not eager_core(run):
        return 0, 0
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    if run.profile == "megatron":
        fwd, bwd = 4 * c, 7 * c
    elif c < 4:
        fwd, bwd = 8 * c + 8, 8 * c + 12
    else:
        fwd, bwd = 8 * c, 9 * c
    if run.dropout > 0:
        fwd, bwd = fwd + 2 * c + 1, bwd + 2 * c + 1
    if _attn_softcap(run):
        fwd, bwd = fwd + 6 * c, bwd + 7 * c
    return fwd, bwd


def eager_attention_seconds(run: Run) -> Num:
    """Time one GPU spends per step moving an eager attention core's s x s scores through HBM, at the GPU's peak
    bandwidth (`hardware.hbm_bytes_per_s`; a lower bound): those elementwise passes are memory-bound (Dao et al.
    2022, FlashAttention, sec. 1 and 3: fusing them is its speed-up), and the matmul FLOPs of the core are already
    in `flops_per_step`. Per sequence and layer the core materialises a x s x s scores, the whole square under a
    causal mask (`eager_score_bytes` per element, forward and backward, and a forward again for each layer whose core
    a recompute re-runs); spread evenly over the GPUs as the FLOPs are. 0 for a fused core, or where the preset has
    no bandwidth."""
    bw = float(run.hardware.hbm_bytes_per_s)
    fwd, bwd = eager_score_bytes(run)
    if bw <= 0 or fwd == 0:
        return 0.0 * run.gpus
    m = run.model
    per_seq_layer = 1.0 * m.heads * run.seq * run.seq
    passes = m.layers * (fwd + bwd) + recomputed_layers(run) * fwd
    return run.global_batch * per_seq_layer * passes / (run.gpus * bw)


def compute_seconds(run: Run) -> Num:
    """Busy compute time of one GPU per step: FLOPs incl. recompute spread evenly over all GPUs, at peak times
    the assumed efficiency, plus an eager attention core's memory-bound passes (`eager_attention_seconds`).
    Stage imbalance (LM head on the last stage) is not modelled separately."""
    rate = _rate(run)
    if rate <= 0:
        return 0.0 * run.gpus
    return flops_per_step(run) / (run.gpus * rate) + eager_attention_seconds(run)


def bubble_seconds(run: Run) -> Num:
    """Pipeline fill and drain: (pp-1)/(vpp*m) of the compute time, m = micro-batches per step
    (Narayanan et al. 2021 sec. 2.2.1 for 1F1B and GPipe, sec. 2.2.2 for the interleaved schedule). PipeDream and
    PipeDream-2BW never flush the pipeline (Narayanan et al. 2019 sec. 3; 2021 "Memory-Efficient Pipeline-Parallel
    DNN Training" sec. 3): no bubble in steady state."""
    if run.schedule.startswith("pipedream"):
        return compute_seconds(run) * 0
    return compute_seconds(run) * (run.pp - 1) / (run.vpp * run.grad_accum)


def overlap_windows(run: Run) -> dict[str, Num]:
    """Compute time per step (seconds, one GPU) that each kind of overlapped collective can hide behind:
    fwd / bwd: the forward / backward of all micro-batches; fwd_first / bwd_last: of one micro-batch (the first
    forward after the optimizer step, the last backward before it); attn: the attention core (fwd + bwd +
    recompute); compute: all compute (TP overlap). All zero when the peak FLOP/s is unknown."""
    rate = _rate(run)
    zero = 0.0 * run.gpus
    if rate <= 0:
        return {k: zero for k in ("fwd", "bwd", "fwd_first", "bwd_last", "attn", "compute")}
    tokens = tokens_per_step(run)
    per_gpu = run.gpus * rate
    fwd = tokens * (forward_flops_per_token(run) * 1.0) / per_gpu
    bwd = tokens * ((backward_flops_per_token(run) + recompute_flops_per_token(run)) * 1.0) / per_gpu
    attn_tok = 3 * run.model.layers * attention_core_flops_per_token(run) + recomputed_layers(run) * (
        attention_core_flops_per_token(run)
    )
    attn = tokens * (attn_tok * 1.0) / per_gpu
    return {
        "fwd": fwd,
        "bwd": bwd,
        "fwd_first": fwd / run.grad_accum,
        "bwd_last": bwd / run.grad_accum,
        "attn": attn,
        "compute": compute_seconds(run),
    }


def _require_peak(run: Run) -> None:
    if peak_flops_per_gpu(run) <= 0:
        raise InputError(
            f"hardware {run.hardware.name!r} has no peak FLOP/s for {run.recipe.compute_dtype}; "
            f"set flops.{run.recipe.compute_dtype} (known: {', '.join(sorted(run.hardware.flops)) or 'none'})"
        )


def exposed_comm_seconds(run: Run) -> Num:
    """Communication per step that does not overlap with compute (worst rank); see comm.py."""
    from memcalc.cost import comm

    return comm.exposed_comm_seconds(run)


def comm_seconds_per_step(run: Run) -> Num:
    from memcalc.cost import comm

    return comm.comm_seconds_per_step(run)


# The offloaded optimizer step runs on the host CPUs between the last backward and the next forward, exposed:
# DeepSpeed's ZeRO optimizer runs its CPU Adam inside step(), as FSDP2's CPUOffloadPolicy and Megatron's
# HybridDeviceOptimizer (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py) run theirs; ZeRO-Offload's
# one-step delayed parameter update (Ren et al. 2021 sec. 5), which would overlap it, is not assumed.
# Every rank of a node steps its shard at the same time, so they share the node's CPUs and memory bandwidth: the
# rate is per node (`hardware.host_optimizer_params_per_s`, default 1.8e9 AdamW parameters/s). Published rates of
# DeepSpeedCPUAdam: 11.6B parameters in 8.2 s on one host (1.4e9/s; DeepSpeed PR #735), Qwen-72B over 4 A100
# nodes in ~10 s (1.8e9/s per node; DeepSpeed issue #6834), GLM-4.5-Air (106B) over 4 H100 nodes in 9.6 s under
# the profiler (2.8e9/s per node; THUDM/slime issue #1139). torch.optim on CPU tensors picks the for-loop step
# (`_default_to_fused_or_foreach` offers foreach and fused on accelerators only): 56 s where DeepSpeedCPUAdam took
# 8.2 s (PR #735, torch 1.7), and 5.0x slower than `fused=True` measured here with torch 2.13 (AdamW, 128M fp32
# parameters, 2 cores: 0.47e9 vs 2.34e9/s). So the torch and megatron profiles run at a fifth of the rate unless
# `--optimizer-impl fused`. Other optimizers are timed like AdamW (an upper bound: they touch fewer bytes).
TORCH_CPU_FORLOOP_SLOWDOWN = 5.0


def cpu_optimizer_rate(run: Run) -> float:
    """Parameters per second one node's CPUs step for this run's offloaded optimizer."""
    rate = float(run.hardware.host_optimizer_params_per_s)
    vectorized = run.profile == "deepspeed" or run.training.optimizer_impl == "fused"
    return rate if vectorized else rate / TORCH_CPU_FORLOOP_SLOWDOWN


def cpu_optimizer_seconds(run: Run) -> Num:
    """Time of the offloaded optimizer step (0 without offload): the largest stage's stepped shard times the
    ranks sharing a node, at the node's rate (array-capable)."""
    if run.offload == "none":
        return 0.0 * run.gpus
    from memcalc.cost.comm import candidate_stages
    from memcalc.cost.states import model_states

    shard: Num = 0
    for stage in candidate_stages(run):
        shard = imax(shard, model_states(run, stage).stepped_params)
    ranks_per_node = imin(run.hardware.gpus_per_node, run.gpus)
    return shard * ranks_per_node / cpu_optimizer_rate(run)


def step_seconds(run: Run) -> Num:
    """compute + pipeline bubble + exposed communication + the offloaded optimizer step (DESIGN section 6)."""
    _require_peak(run)
    return compute_seconds(run) + bubble_seconds(run) + exposed_comm_seconds(run) + cpu_optimizer_seconds(run)


def tokens_per_second(run: Run) -> Num:
    return tokens_per_step(run) / step_seconds(run)


def achieved_mfu(run: Run) -> Num:
    """Model FLOPs (no recompute) / (step time * peak * gpus) (Chowdhery et al. 2022, appendix B)."""
    return model_flops_per_step(run) / (step_seconds(run) * peak_flops_per_gpu(run) * run.gpus)


mfu = achieved_mfu  # the name the planner looks up (memcalc/plan/search.py `time_model`)


# ---------------------------------------------------------------------------------------------------- output


def compute_notes(run: Run) -> list[str]:
    m, t = run.model, run.training
    notes = [
        "FLOPs: 2 per matmul weight per token forward (attention q/k/v/o, MLP"
        + (", router + top-k and shared experts" if m.moe is not None else "")
        + ", LM head) + attention core 4*s*heads*head_dim per token per layer; backward = 2 x forward"
        + (" for trained weights, 1 x for frozen ones" if (t.lora_rank is not None or t.freeze) else ""),
        f"compute time: FLOPs incl. recompute / (gpus x peak x assumed efficiency {assumed_mfu(run):g}); "
        "stage imbalance is not modelled separately",
        "pipeline bubble: " + ("none (PipeDream does not flush)" if run.schedule.startswith("pipedream")
                               else "(pp-1)/(vpp*micro-batches) of the compute time"),
        "exposed communication: overlapped collectives hide behind their compute window (see communication); "
        "TP collectives are exposed" + (" (here overlapped: tp_overlap)" if run.tp_overlap else "") +
        ", pipeline send/recv is on the critical path",
    ]
    fwd, bwd = eager_score_bytes(run)
    if fwd:
        bw = run.hardware.hbm_bytes_per_s
        notes.append(
            f"eager attention: the s x s scores pass through HBM {fwd} bytes per score forward and {bwd} backward "
            "(+ a forward per recomputed core), " + (f"at the peak {bw / 1e12:g} TB/s: "
                                                      f"{eager_attention_seconds(run):,.2f} s of the compute time"
                                                      if bw > 0 else "not timed (no hbm_bytes_per_s)")
            + "; a fused kernel (--attention flash) makes none of these passes")
    if t.recompute != "none":
        extra = {"full": "one layer forward", "op": "the k, o and up (GELU: proj) matmuls"}.get(
            t.recompute, "attention core forward")
        notes.append(f"recompute {t.recompute}: +{extra} per recomputed layer; not counted in the achieved MFU")
    if t.precision == "fp8" and "fp8" in run.hardware.flops:
        notes.append("fp8: all matmuls timed at the fp8 peak")
    if run.offload != "none":
        rate = cpu_optimizer_rate(run)
        kind = ("DeepSpeedCPUAdam" if run.profile == "deepspeed" else "torch.optim fused on CPU"
                if t.optimizer_impl == "fused" else "torch.optim's for-loop step on CPU, 5x slower than fused")
        notes.append(f"offloaded optimizer step: the node's CPUs update {rate:.3g} parameters/s ({kind}; "
                     "--cpu-optimizer-rate sets the vectorized rate), shared by its ranks, exposed")
    return notes


def compute_out(run: Run, colls: list[Any]) -> Any:
    """The `compute` section of the Estimate (scalar runs)."""
    from memcalc.cost.estimate import Compute

    peak = peak_flops_per_gpu(run)
    tokens = int(tokens_per_step(run))
    flops = float(flops_per_step(run))
    model_flops = float(model_flops_per_step(run))
    if peak <= 0:
        return Compute(
            modelled=False, flops_per_step=flops, flops_per_token=flops / tokens, tokens_per_step=tokens,
            compute_seconds=0.0, bubble_seconds=0.0, exposed_comm_seconds=float(exposed_comm_seconds(run)),
            cpu_optimizer_seconds=float(cpu_optimizer_seconds(run)),
            step_seconds=0.0, tokens_per_second=0.0, mfu=0.0, assumed_mfu=assumed_mfu(run),
            model_flops_per_step=model_flops, peak_flops_per_gpu=0.0,
            notes=[f"no peak FLOP/s for {run.recipe.compute_dtype} in hardware {run.hardware.name!r}: "
                   "step time not modelled"
                   + ("; it has fp16 (--precision fp16)" if run.recipe.compute_dtype == "bf16"
                      and run.hardware.flops.get("fp16", 0) > 0 else "")],
        )
    comp = float(compute_seconds(run))
    bubble = float(bubble_seconds(run))
    exposed = float(exposed_comm_seconds(run))
    cpu_step = float(cpu_optimizer_seconds(run))
    step = comp + bubble + exposed + cpu_step
    return Compute(
        modelled=True,
        flops_per_step=flops,
        flops_per_token=flops / tokens,
        tokens_per_step=tokens,
        compute_seconds=comp,
        bubble_seconds=bubble,
        exposed_comm_seconds=exposed,
        cpu_optimizer_seconds=cpu_step,
        eager_attention_seconds=float(eager_attention_seconds(run)),
        step_seconds=step,
        tokens_per_second=tokens / step,
        mfu=model_flops / (step * peak * run.gpus),
        assumed_mfu=assumed_mfu(run),
        model_flops_per_step=model_flops,
        peak_flops_per_gpu=peak,
        notes=compute_notes(run),
    )
