"""Inputs of the cost model: pydantic, frozen, validated. DESIGN.md section 3.

`ModelSpec`, `TrainingSpec`, `ParallelSpec`, `HardwareSpec` and the `Profile` name are what a user states (with
`None` meaning "the default"); `resolve()` turns them into a `Run` in which every default is explicit and every
cross-field rule (gpus = dp*tp*pp*cp, tp divides the heads, ...) has been checked. The cost model reads only
`Run`s. The numeric layout fields of a `Run` (dp, tp, pp, vpp, cp, ep, micro_batch, grad_accum) may be numpy
arrays when the planner evaluates many layouts at once (see memcalc/xp.py); `resolve()` builds scalar runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from memcalc.errors import InputError

Dtype = Literal["fp32", "bf16", "fp16", "fp8"]
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

Profile = Literal["torch", "megatron", "deepspeed"]
PROFILES: tuple[str, ...] = ("torch", "megatron", "deepspeed")
Optimizer = Literal["adam", "adamw", "sgd", "sgd-momentum", "adam-8bit", "adafactor", "lion"]
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd", "sgd-momentum", "adam-8bit", "adafactor", "lion")
Recompute = Literal["none", "selective", "op", "full"]
Offload = Literal["none", "optimizer", "params"]
Schedule = Literal["1f1b", "interleaved", "gpipe", "pipedream", "pipedream-2bw"]
BaseDtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "nf4"]
DpMode = Literal["collective", "ps", "dataparallel"]
# context parallelism's attention exchange: p2p (ring: K/V blocks passed around the cp ranks; TE
# AttnFuncWithCPAndKVP2P, torch context_parallel) or a2a (all-to-all of Q, K, V and the output between sequence
# and head sharding, Ulysses-style: TE AttnFuncWithCPAndQKVOA2A, Megatron-LM --cp-comm-type a2a; DeepSpeed-Ulysses
# `DistributedAttention`, the only sequence parallelism DeepSpeed has; the same exchange over FSDP/DDP in torch)
CpComm = Literal["p2p", "a2a"]
# the exchange a profile uses when --cp-comm is not given (DeepSpeed has no ring attention)
CP_COMM_DEFAULT: dict[str, str] = {"torch": "p2p", "megatron": "p2p", "deepspeed": "a2a"}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)


class MoESpec(_Frozen):
    experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    expert_ffn: int = Field(ge=1)
    shared_experts: int = Field(default=0, ge=0)
    # the first K layers keep a dense MLP of ModelSpec.ffn (DeepSeek-V2/V3 `first_k_dense_replace`; Megatron
    # `--moe-layer-freq "([0]*K+[1]*(L-K))"`)
    first_dense_layers: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.top_k > self.experts:
            raise ValueError(f"moe top_k {self.top_k} exceeds experts {self.experts}")
        return self


class MLASpec(_Frozen):
    """Multi-head latent attention (DeepSeek-V2, Liu et al. 2024 sec. 2.1): queries (optionally) and keys/values
    pass through low-rank latents (q_lora_rank, kv_lora_rank) with an RMSNorm each; every head's query and key is a
    `qk_nope_dim` part from the latent and a rotary `qk_rope_dim` part, the key's rotary part one projection shared
    by all heads; values have `v_head_dim` per head. Shapes: HF modeling_deepseek_v3.py DeepseekV3Attention and
    Megatron-LM megatron/core/transformer/multi_latent_attention.py."""

    q_lora_rank: int = Field(default=0, ge=0, description="0 = queries projected directly (DeepSeek-V2-Lite)")
    kv_lora_rank: int = Field(ge=1)
    qk_nope_dim: int = Field(ge=1)
    qk_rope_dim: int = Field(ge=1)
    v_head_dim: int = Field(ge=1)


class ModelSpec(_Frozen):
    """A decoder-only transformer. Parameter counts derived from it live in memcalc/cost/params.py."""

    name: str = "custom"
    display_name: str = ""
    hidden: int = Field(ge=1)
    layers: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(default=0, ge=0, description="0 = same as heads (MHA)")
    head_dim: int = Field(default=0, ge=0, description="0 = hidden // heads")
    ffn: int = Field(ge=1)
    vocab: int = Field(ge=1)
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    qkv_bias: bool = False
    linear_bias: bool = False
    tied_embeddings: bool = False
    head_bias: bool = False  # a bias on the LM head (phi-1.5: lm_head_bias)
    # sequential: x + attn(norm1(x)), then + mlp(norm2(.)); parallel: x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX
    # use_parallel_residual, Falcon-40B); parallel-shared-norm: both read one norm1(x) (GPT-J, phi-1.5, Falcon-7B)
    block: Literal["sequential", "parallel", "parallel-shared-norm"] = "sequential"
    # a norm on the attention output and one on the MLP output before their residual adds (Gemma 2/3's
    # post_attention_layernorm and post_feedforward_layernorm; modeling_gemma2.py Gemma2DecoderLayer): four per layer
    post_norms: bool = False
    # an RMSNorm over each head of q and of k (weight head_dim each) before rotary (Qwen3, Gemma 3:
    # modeling_qwen3.py Qwen3Attention q_norm / k_norm)
    qk_norm: bool = False
    # the logits pass tanh(x / cap) * cap before the loss (Gemma 2's final_logit_softcapping; modeling_gemma2.py
    # Gemma2ForCausalLM.forward): tanh saves its output, one more logit-sized tensor (the cap's value is immaterial)
    final_logit_softcap: bool = False
    # the attention scores pass tanh(x / cap) * cap before the mask and softmax (Gemma 2's attn_logit_softcapping;
    # modeling_gemma2.py eager_attention_forward): under --attention eager tanh saves them once more; flash-attn
    # >= 2.6 applies it inside the kernel (nothing saved)
    attn_softcap: bool = False
    positions: Literal["rotary", "learned"] = "rotary"
    max_positions: int = Field(default=0, ge=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    # `--params N` with no model: model states use exactly N parameters, dimensions come from the shape above.
    params_override: int | None = Field(default=None, ge=1)
    source: str = ""
    # what the source (a Hugging Face config.json) describes that the model above does not: each a plain sentence
    # naming the feature and its effect (presets.model_from_hf_config); shown with the estimate, never silently lost
    notes: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            heads = data.get("heads")
            mla = data.get("mla")
            if mla is not None and heads:
                # MLA: head_dim is the query/key width (every head has its own key and value: `_check`)
                mla = mla if isinstance(mla, dict) else mla.model_dump()
                data["head_dim"] = data.get("head_dim") or (mla.get("qk_nope_dim", 0) + mla.get("qk_rope_dim", 0))
            if not data.get("kv_heads") and heads:
                data["kv_heads"] = heads
            if not data.get("head_dim") and heads and data.get("hidden"):
                if data["hidden"] % heads:  # Megatron asserts it; HF's attention would not match the hidden size
                    raise ValueError(f"hidden {data['hidden']} is not a multiple of heads {heads}; valid: a "
                                     f"multiple of {heads}, or head_dim given (--head-dim)")
                data["head_dim"] = data["hidden"] // heads
            if not data.get("display_name"):
                data["display_name"] = data.get("name", "custom")
        return data

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.positions == "learned" and self.max_positions < 1:
            raise ValueError("learned positions need max_positions >= 1")
        if self.moe is not None and self.moe.first_dense_layers >= self.layers:
            raise ValueError(f"moe first_dense_layers {self.moe.first_dense_layers} leaves no MoE layer of "
                             f"{self.layers}; valid: 0..{self.layers - 1}")
        if self.head_bias and self.tied_embeddings:
            raise ValueError("--head-bias with --tied-embeddings is not modelled (a tied LM head has no bias of its "
                             "own); valid: --untied-embeddings or --no-head-bias")
        if self.qk_norm and self.mla is not None:
            raise ValueError("qk_norm (Qwen3, Gemma 3) is modelled for standard attention, not MLA")
        if self.post_norms and self.block != "sequential":
            raise ValueError(f"post_norms (Gemma 2/3) are modelled for the sequential layer, not block {self.block!r}")
        if self.block != "sequential" and (self.moe is not None or self.mla is not None):
            raise ValueError(f"block {self.block!r} is modelled for dense attention and MLP layers; a mixture of "
                             "experts or latent attention needs block 'sequential'")
        if self.mla is not None:
            if self.qkv_bias or self.linear_bias:
                raise ValueError("MLA layers have no biases (DeepSeek-V2/V3): set qkv_bias and linear_bias to false")
            if self.kv_heads != self.heads:
                raise ValueError(f"MLA has one key/value per head: kv_heads {self.kv_heads} must equal heads "
                                 f"{self.heads}")
            if self.head_dim != self.mla.qk_nope_dim + self.mla.qk_rope_dim:
                raise ValueError(f"MLA head_dim {self.head_dim} must be qk_nope_dim + qk_rope_dim = "
                                 f"{self.mla.qk_nope_dim + self.mla.qk_rope_dim}")
        return self


# --lora-targets: the projections of a layer that get adapters (Hu et al. 2021 sec. 7.1 adapts W_q and W_v: `qv`,
# PEFT's default target_modules for Llama). "gate" exists only in a SwiGLU MLP; a GELU MLP's fc is "up".
LORA_PROJECTION_ORDER: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
LORA_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "attn": ("q", "k", "v", "o"), "qv": ("q", "v"), "mlp": ("gate", "up", "down"),
    "all": LORA_PROJECTION_ORDER,
}
# module names as recipes spell them: PEFT `target_modules` on HF Llama/Mistral/Qwen (q_proj ... down_proj),
# torchtune `lora_attn_modules` (output_proj) and its MLP's w1 / w3 / w2 (gate / up / down)
LORA_ALIASES: dict[str, str] = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "output_proj": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down",
}


@functools.lru_cache(maxsize=256)
def lora_projections(targets: str) -> tuple[str, ...]:
    """The projections a --lora-targets value adapts, in layer order: a named set (attn, qv, mlp, all) or a comma
    list of projections and sets ("q,v,o,mlp", PEFT's "q_proj,v_proj"). Raises ValueError naming what is valid."""
    valid = (f"valid: a set ({', '.join(LORA_PROJECTIONS)}) or a comma list of {', '.join(LORA_PROJECTION_ORDER)} "
             "(or q_proj ... down_proj, output_proj, w1/w2/w3)")
    chosen: set[str] = set()
    for token in (x.strip().lower() for x in targets.split(",")):
        if not token:
            continue  # "q,v," as a pasted list may end
        if token in LORA_PROJECTIONS:
            chosen.update(LORA_PROJECTIONS[token])
        elif token in LORA_PROJECTION_ORDER or token in LORA_ALIASES:
            chosen.add(LORA_ALIASES.get(token, token))
        else:
            raise ValueError(f"--lora-targets {targets!r}: {token!r} is not a projection; {valid}")
    if not chosen:
        raise ValueError(f"--lora-targets {targets!r} names no projection; {valid}")
    return tuple(p for p in LORA_PROJECTION_ORDER if p in chosen)


def canonical_lora_targets(targets: str) -> str:
    """The one spelling of a --lora-targets value: its named set where there is one, else the comma list of its
    projections in layer order ("q,v,o,gate,up,down")."""
    projections = lora_projections(targets)
    for name, members in LORA_PROJECTIONS.items():
        if members == projections:
            return name
    return ",".join(projections)


class TrainingSpec(_Frozen):
    seq: int = Field(default=4096, ge=1)
    micro_batch: int = Field(default=1, ge=1)
    global_batch: int | None = Field(default=None, ge=1)
    grad_accum: int | None = Field(default=None, ge=1)
    precision: Dtype = "bf16"
    master_weights: bool | None = None  # None: True for mixed precision
    grad_dtype: Dtype | None = None  # None: the profile's default
    optimizer: Optimizer = "adamw"
    recompute: Recompute = "none"
    recompute_layers: int | None = Field(default=None, ge=0)  # None: every layer of the stage
    # torchtitan's layer-level selective AC (`selective_ac_option = K`): every K-th layer of the rank fully
    # checkpointed (its 1-based count over the rank's layers divisible by K); None: recompute_layers' block method
    recompute_every: int | None = Field(default=None, ge=1)
    attention: Literal["flash", "eager"] = "flash"
    # model code, not model shape (docs/methodology.md "Model code"): the RMSNorm kernel (fused: nn.RMSNorm /
    # Apex / TE, saving the input and rstd; fp32: the eager upcast of HF, torchtune and lit-gpt, saving an fp32 copy
    # of the input) and the QKV projection (separate q/k/v matrices, or one fused matrix whose output V views)
    norm_impl: Literal["fused", "fp32"] = "fused"
    qkv_impl: Literal["separate", "fused"] = "separate"
    # K/V under GQA: native (the attention kernel reads the g K/V heads: flash_attn, SDPA enable_gqa, torchtitan)
    # or expand (copied to every query head before SDPA, which saves the copies: torchtune's MultiHeadAttention,
    # HF `repeat_kv`); eager attention always expands
    gqa_impl: Literal["native", "expand"] = "native"
    loss: Literal["full", "fused", "chunked", "chunked-eager", "lit-gpt"] = "full"
    # the training loop's own reference to the model's output logits (`logits = model(x); loss = loss_fn(logits, y);
    # loss.backward()`): none (dropped before backward: HF Trainer, `del logits`), compute (kept in the compute
    # dtype until the next forward replaces them: nanoGPT's `logits, loss = model(X, Y)`) or fp32 (a model that
    # returns upcast logits: torchtune 0.1's `self.output(h).float()`); docs/methodology.md "The loop's logits"
    keep_logits: Literal["none", "compute", "fp32"] = "none"
    # which micro-batch's peak: steady (one in the middle of training, after another of the same shape: whatever
    # the loop keeps from the previous one is live) or first (the run's first, before any optimizer step: nothing
    # of an earlier micro-batch, and torch.optim's states not yet created; lit-gpt <= 2023 trains on the longest
    # sample first); docs/methodology.md "The first step"
    peak_step: Literal["steady", "first"] = "steady"
    # a rotary cos/sin table kept as a buffer by the model code (fp32, positions x rope_dim/2 x 2): 0 for none;
    # per layer (torchtune 0.1's deep-copied layers) or one for the model (torchtune >= 0.2); cost/buffers.py
    rope_cache_positions: int = Field(default=0, ge=0)
    rope_cache_per_layer: bool = False
    # the layers' saved activations live in host memory between their forward and backward, double-buffered one
    # layer at a time (docs/methodology.md "Activation offloading"); embedding, final norm, head and loss stay
    offload_activations: bool = False
    dropout: float | None = Field(default=None, ge=0.0, lt=1.0)  # None: the model's
    foreach: bool | None = None  # shorthand: True = optimizer_impl "foreach", False = "for-loop" (torch) / "fused"
    # the optimizer step's kernels: foreach (torch's multi-tensor default), for-loop (one parameter at a time) or
    # fused (one in-place kernel: torch `fused=True`, Apex / TE / DeepSpeed FusedAdam); None: the profile's
    optimizer_impl: Literal["foreach", "for-loop", "fused"] | None = None
    fragmentation: float | None = Field(default=None, ge=0.0, lt=1.0)  # None: the allocator model's figure
    # PyTorch's CUDA caching allocator: default (fixed segments) or expandable (PYTORCH_CUDA_ALLOC_CONF=
    # expandable_segments:True, torchtitan's launcher); sets the default fraction and which structural terms the
    # reserved figure carries (cost/fragmentation.py)
    allocator: Literal["default", "expandable"] = "default"
    mfu: float | None = Field(default=None, gt=0.0, le=1.0)  # None: the GPU preset's default
    # fine-tuning (issue 7): LoRA adapters on frozen (optionally quantized) base weights, partial freezing
    lora_rank: int | None = Field(default=None, ge=1)
    lora_targets: str = "attn"  # a named set or a comma list of projections; stored canonical (canonical_lora_targets)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)  # dropout on each adapter's input (PEFT default 0)
    lora_alpha: float | None = None  # accepted; it scales the update and does not change memory
    base_dtype: BaseDtype | None = None  # storage of frozen base weights; None: the compute dtype
    double_quant: bool = True  # QLoRA double quantization of the nf4 block scales
    # the library behind quantized (nf4 / int8) base linears: bitsandbytes' MatMul4Bit / MatMul8bitLt save their
    # input activation for backward; torchao's linear_nf4 (torchtune) saves only the weight
    quant_backend: Literal["bnb", "bnb-fp16", "torchao"] = "bnb"
    # the LM head's weight is quantized like the layers' linears (lit-gpt: Fabric's BitsandbytesPrecision replaces
    # every nn.Linear; HF's BitsAndBytesConfig skips the output embedding and torchtune keeps it in bf16)
    quantize_head: bool = False
    freeze: tuple[str, ...] = ()  # "embeddings", "head", "layers:K" (the first K layers)
    # framework buffer knobs (None: the framework's documented default; see memcalc/cost/buffers.py)
    bucket_cap_mb: float | None = Field(default=None, gt=0)  # DDP bucket_cap_mb
    gradient_as_bucket_view: bool | None = None  # DDP
    overlap_comm: bool | None = None  # DeepSpeed zero_optimization.overlap_comm
    # Megatron-LM --overlap-grad-reduce / --overlap-param-gather (None: on, memcalc's megatron profile; Megatron's
    # own argparse default is off, which an imported launch line without the flag gets)
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    contiguous_gradients: bool | None = None  # DeepSpeed
    reduce_bucket_size: int | None = Field(default=None, ge=1)  # DeepSpeed, elements
    allreduce_bucket_size: int | None = Field(default=None, ge=1)  # DeepSpeed ZeRO-0, elements
    allgather_bucket_size: int | None = Field(default=None, ge=1)  # DeepSpeed ZeRO-1/2, elements
    stage3_prefetch_bucket_size: int | None = Field(default=None, ge=0)  # DeepSpeed ZeRO-3, elements
    stage3_max_live_parameters: int | None = Field(default=None, ge=0)
    stage3_max_reuse_distance: int | None = Field(default=None, ge=0)
    # batch-size guidance: learning rate under linear / square-root scaling from a reference run
    base_lr: float | None = Field(default=None, gt=0)
    base_batch: int | None = Field(default=None, ge=1)
    base_warmup_steps: int | None = Field(default=None, ge=0)

    @field_validator("lora_targets")
    @classmethod
    def _canonical_targets(cls, v: str) -> str:
        return canonical_lora_targets(v)


class ParallelSpec(_Frozen):
    gpus: int | None = Field(default=None, ge=1)
    dp: int | None = Field(default=None, ge=1)
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    vpp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    sp: bool | None = None  # None: on with tp > 1 for megatron, off otherwise
    zero: int = Field(default=0, ge=0, le=3)
    offload: Offload = "none"
    schedule: Schedule | None = None  # None: interleaved when vpp > 1, else 1f1b
    order: str = "tp,cp,pp,dp"  # rank placement, innermost first (DESIGN section 5)
    tp_overlap: bool = False  # TP collectives overlapped with compute (e.g. TE userbuffers)
    dp_mode: DpMode = "collective"  # collective (DDP/ZeRO), ps (parameter server), dataparallel (torch DP)
    cp_comm: CpComm | None = None  # None: the profile's (CP_COMM_DEFAULT)


class HardwareSpec(_Frozen):
    name: str = "custom"
    display_name: str = ""
    memory_bytes: int = Field(ge=1)
    flops: dict[str, float] = Field(default_factory=dict)  # dense peak FLOP/s per dtype
    hbm_bytes_per_s: float = Field(default=0.0, ge=0)
    gpus_per_node: int = Field(default=8, ge=1)
    intra_node_bytes_per_s: float = Field(default=0.0, ge=0)
    inter_node_bytes_per_s: float = Field(default=0.0, ge=0)
    # GPU <-> host copies (pinned memory), bytes/s per direction: the GPU's PCIe x16 link (0: not timed)
    host_bytes_per_s: float = Field(default=0.0, ge=0)
    # offloaded optimizer step: AdamW parameters one node's host CPUs update per second with a vectorized one-pass
    # kernel (DeepSpeedCPUAdam; torch's fused CPU AdamW). Sources and the slower torch for-loop step:
    # cost/compute.py `cpu_optimizer_seconds`, docs/methodology.md "The CPU optimizer step"
    host_optimizer_params_per_s: float = Field(default=1.8e9, gt=0)
    latency_s: float = Field(default=5e-6, ge=0)
    runtime_overhead_bytes: int = Field(default=0, ge=0)
    # True when runtime_overhead_bytes is the whole figure outside the allocator (`--runtime-overhead`, a measured
    # value): no communicator is added for further process groups (cost/estimate.py runtime_bytes)
    runtime_overhead_is_total: bool = False
    default_mfu: float = Field(default=0.4, gt=0, le=1)
    # compute architecture: "sm80", "sm90", ... (NVIDIA compute capability), "gfx942" (AMD); "" when unknown.
    # It sizes the BLAS workspaces (cost/buffers.py blas_workspace_bytes).
    arch: str = Field(default="", pattern=r"^(sm[0-9]{2,3}|gfx[0-9a-f]{3,4})?$")
    source: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Recipe:
    """The dtype of every stored tensor, fixed by the profile and the precision flags (DESIGN section 3)."""

    param_dtype: str  # persistent parameters
    compute_dtype: str  # matmul inputs / activations
    grad_dtype: str  # gradients as accumulated in backward
    master_weights: bool  # a separate fp32 copy held by the optimizer
    fp32_grad_copy: bool  # the optimizer also keeps an fp32 copy of the (reduced) gradients
    moment_dtype: str  # optimizer moments
    compute_copy: bool  # a low-precision copy of the params is made for compute (AMP / FSDP2 mixed precision)
    foreach: bool  # optimizer_impl == "foreach" (kept for JSON 1.x readers)
    optimizer_impl: str  # foreach (temporaries of the size of the params) | for-loop | fused
    notes: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """A fully resolved configuration: what the cost model reads."""

    model: ModelSpec
    training: TrainingSpec
    hardware: HardwareSpec
    profile: str
    recipe: Recipe
    # parallel layout (ints, or numpy arrays in the planner's bulk mode)
    gpus: Any
    dp: Any
    tp: Any
    pp: Any
    vpp: Any
    cp: Any
    ep: Any
    sp: bool
    zero: int
    offload: str
    schedule: str
    order: tuple[str, ...]
    tp_overlap: bool
    dp_mode: str
    # batch
    micro_batch: Any
    grad_accum: Any
    global_batch: Any
    seq: int
    dropout: float
    assumed_shape: str | None = None  # set when --params chose a reference shape
    cp_comm: str = "p2p"  # ParallelSpec.cp_comm

    @property
    def shard_degree(self) -> Any:
        """Ranks that share one ZeRO / FSDP shard group: data parallel and context parallel together
        (Megatron's distributed optimizer and torchtitan's FSDP both shard over dp x cp)."""
        return self.dp * self.cp

    def replace(self, **changes: Any) -> "Run":
        return dataclasses.replace(self, **changes)


def _optimizer_impl(t: TrainingSpec, default: str, no_foreach: str) -> str:
    """--optimizer-impl, else --foreach/--no-foreach (no-foreach: torch's for-loop; Megatron's and DeepSpeed's
    own fused Adam), else the profile's default (torch.optim picks foreach on CUDA: `_default_to_fused_or_foreach`)."""
    if t.optimizer_impl is not None:
        return t.optimizer_impl
    if t.foreach is not None:
        return "foreach" if t.foreach else no_foreach
    return default


def _recipe(profile: str, t: TrainingSpec) -> Recipe:
    """Dtypes per profile. Sources: ZeRO paper sec. 3.1 (mixed precision: fp16 params and grads, fp32 master
    and moments); Megatron-LM docs/user-guide/features/dist_optimizer.md (bf16 params, fp32 main grads);
    DeepSpeed runtime/zero/stage_1_and_2.py and stage3.py (fp32 gradient partitions); PyTorch AMP and FSDP2
    MixedPrecisionPolicy (fp32 params are the master copy; a low-precision copy is cast for compute)."""
    p = t.precision
    mixed = p != "fp32"
    master = mixed if t.master_weights is None else (t.master_weights and mixed)
    low = "bf16" if p == "fp8" else p  # fp8 recipes keep bf16 weights and cast to fp8 per matmul
    notes: list[str] = []
    if profile == "torch":
        if not mixed:
            param, grad = "fp32", t.grad_dtype or "fp32"
            compute_copy = False
        elif master and (t.grad_dtype is None or t.grad_dtype == "fp32"):
            # AMP / FSDP2 MixedPrecisionPolicy: fp32 params double as the master copy, grads are fp32.
            param, grad, master = "fp32", "fp32", False
            compute_copy = True
            notes.append(f"params are kept in fp32 and serve as the master copy; a {low} copy is cast for compute")
        elif master:
            # low-precision grads imply low-precision params with a separate fp32 master in the optimizer
            param, grad = low, t.grad_dtype
            compute_copy = False
            notes.append(f"{low} params with a separate fp32 master copy (grads in {grad})")
        else:
            param, grad = low, t.grad_dtype or low
            compute_copy = False
            notes.append(f"pure {low} training: no fp32 master copy; optimizer moments in {low}")
        fp32_copy = False
        impl = _optimizer_impl(t, "foreach", "for-loop")
    elif profile == "megatron":
        param = low if mixed else "fp32"
        grad = t.grad_dtype or "fp32"  # --accumulate-allreduce-grads-in-fp32 (main_grad) by default
        compute_copy = False
        fp32_copy = master and grad != "fp32"
        impl = _optimizer_impl(t, "fused", "fused")  # fused Adam (Apex / TE) steps in place
        notes.append(f"{param} params, {grad} main grads" + (", fp32 master in the optimizer" if master else ""))
    else:  # deepspeed
        param = low if mixed else "fp32"
        grad = t.grad_dtype or param
        compute_copy = False
        fp32_copy = master and grad != "fp32"
        impl = _optimizer_impl(t, "fused", "fused")  # FusedAdam
        notes.append(f"{param} params and grads" + (", fp32 master and fp32 gradient partitions" if master else ""))
    if p == "fp8":
        notes.append("fp8: matmul inputs are cast to fp8; weights and saved activations are modelled in bf16")
    moment = "fp32" if (master or param == "fp32") else param
    return Recipe(
        param_dtype=param,
        compute_dtype=low if mixed else "fp32",
        grad_dtype=grad,
        master_weights=master,
        fp32_grad_copy=fp32_copy,
        moment_dtype=moment,
        compute_copy=compute_copy,
        foreach=impl == "foreach",
        optimizer_impl=impl,
        notes=tuple(notes),
    )


def a2a_cp_limit(model: ModelSpec, tp: int) -> int:
    """All-to-all CP shards the heads of a TP rank over the cp ranks: cp must divide this (the gcd of the query
    and KV heads per TP rank; the planner's `cp_a2a_heads` rule is its array form)."""
    return math.gcd(model.heads // tp, model.kv_heads // tp)


def every_fits_chunks(layers: int, pp: int, vpp: int, k: int) -> bool:
    """--recompute-every K over pp x vpp model chunks: a rank counts its layers over its chunks (torchtitan), so
    memcalc takes interleaving with whole chunks of a multiple of K layers only (each chunk's pattern the same)."""
    return vpp == 1 or (layers % (pp * vpp) == 0 and (layers // (pp * vpp)) % k == 0)


def _divisors_text(n: int, limit: int = 12) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, ds[:limit])) + (", ..." if len(ds) > limit else "")


# resolve()'s refusal of ring attention under DeepSpeed (cp > 1), which plan's search says before it searches
DEEPSPEED_NO_RING = ("--cp-comm p2p: DeepSpeed's sequence parallelism is DeepSpeed-Ulysses (all-to-all, "
                     "`sequence_parallel_size`), it has no ring attention; with --profile deepspeed valid: a2a")


def check_op_recompute(lora_rank: int | None, qkv_impl: str) -> None:
    """--recompute op is torchtitan's policy over torchtitan's layers: it keeps every other `aten.mm` output of a
    layer, counted in the order of separate q, k, v, o and MLP projections (`activations._op_sac_terms`). A fused
    QKV matrix or LoRA's adapter matmuls change that count, and which outputs are kept with it: not modelled (the
    harness measured -4.7% with a fused QKV and -10% to -19% with adapters on a toy's backward)."""
    what = ("--lora-rank (the adapters' matmuls)" if lora_rank is not None
            else "--qkv-impl fused (one QKV matmul)" if qkv_impl == "fused" else None)
    if what is not None:
        raise InputError(f"--recompute op with {what} is not modelled: torchtitan's op-level policy keeps every other "
                         "matmul output of separate q, k, v projections; valid: --recompute none, selective or full")


def resolve(
    model: ModelSpec,
    training: TrainingSpec,
    parallel: ParallelSpec,
    hardware: HardwareSpec,
    profile: str = "torch",
    assumed_shape: str | None = None,
) -> Run:
    """Check every cross-field rule and make every default explicit. Raises InputError (one line)."""
    if profile not in PROFILES:
        raise InputError(f"--profile {profile!r} is not one of: {', '.join(PROFILES)}")
    m, t, p = model, training, parallel
    tp, pp, cp, vpp, ep = p.tp, p.pp, p.cp, p.vpp, p.ep
    if m.block != "sequential" and profile == "megatron":
        raise InputError(f"--block {m.block} with --profile megatron: Megatron-LM's layer is sequential; use "
                         "--profile torch or deepspeed (GPT-NeoX, lit-gpt, Hugging Face)")
    if m.heads % tp:
        raise InputError(f"--tp {tp} does not divide the {m.heads} attention heads; valid: {_divisors_text(m.heads)}")
    if m.kv_heads % tp:
        raise InputError(
            f"--tp {tp} does not divide the {m.kv_heads} KV heads; valid: {_divisors_text(m.kv_heads)}"
        )
    if pp > m.layers:
        raise InputError(f"--pp {pp} exceeds the {m.layers} layers; valid: 1..{m.layers}")
    if vpp > 1 and m.layers % (pp * vpp) and (profile != "torch" or (m.moe is not None and m.moe.first_dense_layers)):
        # (torch pipelining splits unevenly as torchtitan does, params.stage_layers; Megatron's interleaving needs
        # whole chunks; an MoE model's first dense layers are placed chunk by chunk only for even chunks)
        why = "" if profile != "torch" else " (an MoE model's first dense layers need even chunks)"
        raise InputError(
            f"--vpp {vpp} with --pp {pp} needs layers ({m.layers}) divisible by pp*vpp = {pp * vpp}{why}; "
            + ("--profile torch splits them unevenly, as torchtitan does" if profile != "torch" else
               f"valid: --vpp {' or '.join(str(d) for d in range(2, m.layers // pp + 1) if m.layers % (pp * d) == 0) or '1'}")
        )
    if vpp > 1 and pp * vpp > m.layers:
        raise InputError(f"--pp {pp} x --vpp {vpp} = {pp * vpp} model chunks exceed the {m.layers} layers; valid: "
                         f"pp*vpp <= {m.layers}")
    if vpp > 1 and pp == 1:
        raise InputError("--vpp > 1 needs --pp > 1 (virtual stages interleave pipeline stages)")
    k = t.recompute_every
    if k is not None and not every_fits_chunks(m.layers, pp, vpp, k):
        raise InputError(f"--recompute-every {k} with --pp {pp} --vpp {vpp} is modelled for chunks of a multiple of "
                         f"{k} layers ({m.layers} layers over {pp * vpp} chunks); use --recompute-layers")
    if t.seq % cp:
        raise InputError(f"--cp {cp} does not divide the sequence length {t.seq}")
    if m.mla is not None and cp > 1:
        raise InputError(f"--cp {cp} with {m.name}: context parallelism over multi-head latent attention is not "
                         "modelled; valid: --cp 1")
    cp_comm = p.cp_comm or CP_COMM_DEFAULT[profile]
    if cp_comm == "p2p" and profile == "deepspeed" and cp > 1:
        raise InputError(DEEPSPEED_NO_RING)
    if cp_comm == "a2a":
        shared = a2a_cp_limit(m, tp)
        if shared % cp:
            raise InputError(f"--cp {cp} with --cp-comm a2a must divide the attention heads per TP rank "
                             f"({m.heads // tp} query, {m.kv_heads // tp} KV); valid: {_divisors_text(shared)}")
    if ep > 1:
        if m.moe is None:
            raise InputError(f"--ep {ep} needs a mixture-of-experts model; {m.name} is dense")
        if m.moe.experts % ep:
            raise InputError(
                f"--ep {ep} does not divide the {m.moe.experts} experts; valid: {_divisors_text(m.moe.experts)}"
            )
    inner = tp * pp * cp
    if p.gpus is None and p.dp is None:
        gpus, dp = inner, 1
    elif p.gpus is None:
        dp = p.dp
        gpus = dp * inner
    else:
        gpus = p.gpus
        if gpus % inner:
            raise InputError(
                f"--gpus {gpus} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {inner}; "
                f"use a multiple of {inner} or smaller degrees"
            )
        dp = gpus // inner
        if p.dp is not None and p.dp != dp:
            raise InputError(
                f"--dp {p.dp} disagrees with --gpus {gpus} / (tp*pp*cp = {inner}) = {dp}; give one or make them agree"
            )
    if ep > 1 and (dp * cp) % ep:
        raise InputError(f"--ep {ep} must divide dp*cp = {dp * cp} (experts are sharded across data-parallel ranks)")
    if p.zero and p.offload == "params" and p.zero < 3:
        raise InputError("--offload params needs --zero 3 (parameters are offloaded shard by shard)")
    if p.offload != "none" and p.zero == 0 and profile != "torch":
        raise InputError(f"--offload {p.offload} needs --zero 1 or higher with --profile {profile}")
    mb = t.micro_batch
    if t.global_batch is not None:
        per_step = mb * dp
        if t.global_batch % per_step:
            raise InputError(
                f"--global-batch {t.global_batch} is not a multiple of micro-batch*dp = {mb}*{dp} = {per_step}"
            )
        ga = t.global_batch // per_step
        if t.grad_accum is not None and t.grad_accum != ga:
            raise InputError(
                f"--grad-accum {t.grad_accum} disagrees with --global-batch {t.global_batch} / (micro-batch*dp) = {ga}"
            )
    else:
        ga = t.grad_accum or 1
    if t.recompute_layers is not None and t.recompute == "none":
        raise InputError("--recompute-layers needs --recompute selective, op or full")
    if t.recompute == "op":
        check_op_recompute(t.lora_rank, t.qkv_impl)
    if t.recompute_every is not None:
        k = t.recompute_every
        if t.recompute != "full":
            raise InputError(f"--recompute-every {k} needs --recompute full (every {k}-th layer is fully "
                             f"checkpointed; got --recompute {t.recompute})")
        if t.recompute_layers is not None:
            raise InputError(f"--recompute-every {k} and --recompute-layers {t.recompute_layers} both place the "
                             "checkpointed layers; give one of them")
        if t.offload_activations:
            raise InputError(f"--recompute-every {k} with --offload-activations is not modelled; use "
                             "--recompute-layers (the first K layers of each stage)")
        if m.moe is not None and m.moe.first_dense_layers:
            raise InputError(f"--recompute-every {k} with {m.moe.first_dense_layers} first dense MoE layers is not "
                             "modelled; use --recompute-layers (the first K layers of each stage)")
    if t.keep_logits == "compute" and t.loss == "lit-gpt":
        raise InputError("--keep-logits compute with --loss lit-gpt: lit-gpt's loop keeps the model's logits "
                         "already; valid there: none (the compute-dtype list) or fp32 (upcast by Fabric)")
    if t.keep_logits != "none":
        why = ("--loss " + t.loss if t.loss not in ("full", "lit-gpt") else "--profile megatron"
               if profile == "megatron" else f"--pp {pp}" if pp > 1 else "--dp-mode dataparallel"
               if p.dp_mode == "dataparallel" else None)
        if why:
            raise InputError(f"--keep-logits {t.keep_logits} is a training loop's reference to the logits of "
                             f"--loss full or lit-gpt without pipelining (got {why}); valid there: none")
    if m.final_logit_softcap and (t.loss != "full" or profile == "megatron"):
        why = f"--profile {profile}" if t.loss == "full" else f"--loss {t.loss}"
        raise InputError(f"--logit-softcap (Gemma 2's final_logit_softcapping) is modelled for the model's own "
                         f"forward with --loss full under --profile torch or deepspeed (got {why}); valid here: "
                         "--no-logit-softcap, which leaves its saved tanh output uncounted")
    if m.attn_softcap and t.attention == "eager" and profile == "megatron":
        raise InputError("--attn-softcap (Gemma 2's attn_logit_softcapping) with --attention eager is modelled on "
                         "Hugging Face's eager attention (--profile torch or deepspeed), not Megatron's fused "
                         "softmax; valid here: --attention flash, or --no-attn-softcap")
    if t.foreach is not None and t.optimizer_impl is not None and t.foreach != (t.optimizer_impl == "foreach"):
        flag = "--foreach" if t.foreach else "--no-foreach"
        raise InputError(f"{flag} contradicts --optimizer-impl {t.optimizer_impl}; give one of them")
    schedule = p.schedule or ("interleaved" if vpp > 1 else "1f1b")
    if schedule == "interleaved" and vpp == 1 and p.schedule is not None:
        raise InputError("--schedule interleaved needs --vpp > 1")
    if schedule != "interleaved" and vpp > 1:
        raise InputError(f"--vpp {vpp} needs --schedule interleaved (got {schedule})")
    _check_finetune(m, t)
    if p.dp_mode != "collective":
        what = "--dp-mode " + p.dp_mode
        if tp * pp * cp * ep != 1 or p.zero:
            raise InputError(f"{what} models plain data parallelism: use it with --tp/--pp/--cp/--ep 1 and --zero 0")
        if profile != "torch" and p.dp_mode == "dataparallel":
            raise InputError(f"{what} is torch.nn.DataParallel: use --profile torch")
    if schedule.startswith("pipedream") and pp == 1:
        raise InputError(f"--schedule {schedule} needs --pp > 1")
    sp = (profile == "megatron" and tp > 1) if p.sp is None else (p.sp and tp > 1)
    order = tuple(x.strip() for x in p.order.split(","))
    if sorted(order) != ["cp", "dp", "pp", "tp"]:
        raise InputError(f"--order {p.order!r} must name tp, cp, pp and dp once each, innermost first")
    return Run(
        model=m,
        training=t,
        hardware=hardware,
        profile=profile,
        recipe=_recipe(profile, t),
        gpus=gpus,
        dp=dp,
        tp=tp,
        pp=pp,
        vpp=vpp,
        cp=cp,
        ep=ep,
        sp=sp,
        zero=p.zero,
        offload=p.offload,
        schedule=schedule,
        order=order,
        tp_overlap=p.tp_overlap,
        dp_mode=p.dp_mode,
        cp_comm=cp_comm,
        micro_batch=mb,
        grad_accum=ga,
        global_batch=mb * ga * dp,
        seq=t.seq,
        dropout=m.dropout if t.dropout is None else t.dropout,
        assumed_shape=assumed_shape,
    )


QUANTIZED = ("nf4", "int8", "fp8")


def freeze_layers(t: TrainingSpec) -> int:
    """K from a `layers:K` freeze entry (0 when absent)."""
    for item in t.freeze:
        if item.startswith("layers:"):
            return int(item.split(":", 1)[1])
    return 0


def _check_finetune(m: ModelSpec, t: TrainingSpec) -> None:
    for item in t.freeze:
        if item in ("embeddings", "head"):
            continue
        k = item.split(":", 1)[1] if item.startswith("layers:") else ""
        if not k.isdigit() or not 0 < int(k) <= m.layers:
            raise InputError(
                f"--freeze {item!r} is not valid; valid: embeddings, head, layers:K with 1 <= K <= {m.layers}"
            )
    if t.base_dtype in QUANTIZED and t.lora_rank is None:
        raise InputError(f"--base-dtype {t.base_dtype} quantizes frozen weights: add --lora-rank R (QLoRA)")
    if t.quantize_head and (t.base_dtype not in QUANTIZED or t.lora_rank is None):
        raise InputError(f"--quantize-head quantizes the LM head like the base linears: it needs --lora-rank R and "
                         f"--base-dtype nf4, int8 or fp8 (got {t.base_dtype or 'none'})")
    if t.quantize_head and m.tied_embeddings:
        raise InputError(f"--quantize-head: {m.name} ties its LM head to the embedding, which stays unquantized; "
                         f"valid only for models with a separate head")
    if t.lora_rank is not None and m.mla is not None:
        raise InputError(f"--lora-rank with {m.name}: LoRA on multi-head latent attention (q_a/q_b/kv_a/kv_b) is not "
                         "modelled; valid: a model without MLA")
    if t.lora_rank is not None and m.moe is not None and set(lora_projections(t.lora_targets)) - {"q", "k", "v", "o"}:
        raise InputError(f"--lora-targets {t.lora_targets}: adapters on a mixture-of-experts model's MLP are not "
                         f"modelled; valid: attention projections only (attn, qv, or a list of q, k, v, o)")
    if (t.base_lr is None) != (t.base_batch is None):
        raise InputError("--base-lr and --base-batch go together (the reference run's learning rate and batch)")


def validation_message(err: ValidationError, prefix: str = "") -> str:
    """One line from a pydantic error: the field, the bad value and what is valid."""
    e = err.errors()[0]
    loc = ".".join(str(x) for x in e.get("loc", ()) if x != "__root__")
    value = e.get("input")
    msg = e.get("msg", "invalid value").removeprefix("Value error, ")
    if loc:
        return f"{prefix}{loc} = {value!r}: {msg}"
    return f"{prefix}{msg}"
