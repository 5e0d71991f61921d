"""Turn command-line option values into a resolved `Run`. Shared by estimate, plan and validate so that the same
flags mean the same thing everywhere. Every bad value raises InputError with one line naming it and what is valid.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import ValidationError

from memcalc.errors import InputError
from memcalc.specs import (
    OPTIMIZERS,
    PROFILES,
    HardwareSpec,
    ModelSpec,
    ParallelSpec,
    Run,
    TrainingSpec,
    canonical_lora_targets,
    resolve,
    validation_message,
)
from memcalc.units import parse_bytes, parse_count

DEFAULT_GPU = "h100-sxm-80gb"

# spec field -> the flag a user typed, for error messages
FLAG_OF = {
    "hidden": "--hidden", "layers": "--layers", "heads": "--heads", "kv_heads": "--kv-heads", "ffn": "--ffn",
    "vocab": "--vocab", "seq": "--seq", "micro_batch": "--micro-batch", "global_batch": "--global-batch",
    "grad_accum": "--grad-accum", "precision": "--precision", "grad_dtype": "--grad-dtype",
    "optimizer": "--optimizer", "recompute": "--recompute", "recompute_layers": "--recompute-layers",
    "recompute_every": "--recompute-every",
    "attention": "--attention", "norm_impl": "--norm-impl", "qkv_impl": "--qkv-impl",
    "gqa_impl": "--gqa-impl", "optimizer_impl": "--optimizer-impl", "offload_activations": "--offload-activations",
    "quantize_head": "--quantize-head", "lora_dropout": "--lora-dropout", "loss": "--loss", "dropout": "--dropout",
    "keep_logits": "--keep-logits", "peak_step": "--peak-step", "rope_cache": "--rope-cache",
    "fragmentation": "--fragmentation", "allocator": "--allocator",
    "mfu": "--mfu", "gpus": "--gpus", "dp": "--dp", "tp": "--tp", "pp": "--pp", "vpp": "--vpp", "cp": "--cp",
    "ep": "--ep", "zero": "--zero", "offload": "--offload", "schedule": "--schedule",
    "mlp": "--mlp", "norm": "--norm", "tied_embeddings": "--tied-embeddings", "positions": "--positions",
    "bias": "--bias", "qkv_bias": "--qkv-bias", "head_bias": "--head-bias", "block": "--block",
    "post_norms": "--post-norms", "qk_norm": "--qk-norm",
    "final_logit_softcap": "--logit-softcap", "attn_softcap": "--attn-softcap",
    "max_positions": "--max-positions", "head_dim": "--head-dim",
    "experts": "--experts", "top_k": "--top-k", "expert_ffn": "--expert-ffn", "shared_experts": "--shared-experts",
    "first_dense_layers": "--first-dense-layers", "q_lora_rank": "--q-lora-rank", "kv_lora_rank": "--kv-lora-rank",
    "qk_nope_dim": "--qk-nope-dim", "qk_rope_dim": "--qk-rope-dim", "v_head_dim": "--v-head-dim",
    "deepspeed_config": "--deepspeed-config", "megatron_args": "--megatron-args",
    "torchtitan_config": "--torchtitan-config",
}

CHOICES = {
    "precision": ("fp32", "bf16", "fp16", "fp8"),
    "grad_dtype": ("fp32", "bf16", "fp16"),
    "optimizer": OPTIMIZERS,
    "recompute": ("none", "selective", "op", "full"),
    "attention": ("flash", "eager"),
    "loss": ("full", "fused", "chunked", "chunked-eager", "lit-gpt"),
    "keep_logits": ("none", "compute", "fp32"),
    "peak_step": ("steady", "first"),
    "allocator": ("default", "expandable"),
    "offload": ("none", "optimizer", "params"),
    "schedule": ("1f1b", "interleaved", "gpipe", "pipedream", "pipedream-2bw"),
    "profile": PROFILES,
    "units": ("GiB", "GB"),
    "mlp": ("swiglu", "gelu"),
    "norm": ("rmsnorm", "layernorm"),
    "block": ("sequential", "parallel", "parallel-shared-norm"),
    "positions": ("rotary", "learned"),
    "norm_impl": ("fused", "fp32"),
    "qkv_impl": ("separate", "fused"),
    "gqa_impl": ("native", "expand"),
    "optimizer_impl": ("foreach", "for-loop", "fused"),
    "base_dtype": ("nf4", "int8", "fp8", "bf16", "fp16", "fp32"),
    "dp_mode": ("collective", "ps", "dataparallel"),
    "cp_comm": ("p2p", "a2a"),
    "quant_backend": ("bnb", "bnb-fp16", "torchao"),
}


def check_choice(field: str, value: str | None) -> str | None:
    if value is None:
        return None
    if field == "lora_targets":  # a named set or a comma list of projections
        try:
            return canonical_lora_targets(value)
        except ValueError as e:
            raise InputError(str(e)) from None
    valid = CHOICES[field]
    low = value.strip().lower()
    if field == "units":
        for v in valid:
            if v.lower() == low:
                return v
    elif low in valid:
        return low
    flag = FLAG_OF.get(field, f"--{field.replace('_', '-')}")
    raise InputError(f"{flag} {value!r} is not valid; valid: {', '.join(valid)}")


def check_positive(flag: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise InputError(f"{flag} {value} must be at least {minimum}")


@dataclasses.dataclass
class RunOptions:
    """Every flag that describes a configuration (None = default). One field per flag."""

    model: str | None = None
    params: str | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    ffn: int | None = None
    vocab: int | None = None
    # model-shape choices (None = the preset's; for a custom model: ModelSpec's defaults)
    mlp: str | None = None
    norm: str | None = None
    tied_embeddings: bool | None = None
    positions: str | None = None
    bias: bool | None = None  # biases on every linear layer (Megatron --add-bias-linear): sets qkv_bias too
    qkv_bias: bool | None = None
    head_bias: bool | None = None
    post_norms: bool | None = None
    qk_norm: bool | None = None
    final_logit_softcap: bool | None = None
    attn_softcap: bool | None = None
    block: str | None = None
    max_positions: int | None = None
    head_dim: int | None = None
    # mixture of experts (specs.MoESpec) and multi-head latent attention (specs.MLASpec): each overrides the
    # preset's value, or, on a model without them, makes it MoE / MLA (build_model says what is required)
    experts: int | None = None
    top_k: int | None = None
    expert_ffn: int | None = None
    shared_experts: int | None = None
    first_dense_layers: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_dim: int | None = None
    qk_rope_dim: int | None = None
    v_head_dim: int | None = None
    seq: int | None = None  # None: DEFAULT_SEQ, or a learned-position table's length where shorter (`_seq_of`)
    micro_batch: int = 1
    global_batch: int | None = None
    grad_accum: int | None = None
    precision: str = "bf16"
    master_weights: bool | None = None
    grad_dtype: str | None = None
    optimizer: str = "adamw"
    recompute: str = "none"
    recompute_layers: int | None = None
    recompute_every: int | None = None
    attention: str = "flash"
    norm_impl: str = "fused"
    qkv_impl: str = "separate"
    gqa_impl: str = "native"
    loss: str = "full"
    keep_logits: str = "none"
    peak_step: str = "steady"
    rope_cache: str = "none"
    offload_activations: bool = False
    dropout: float | None = None
    foreach: bool | None = None
    optimizer_impl: str | None = None
    fragmentation: float | None = None
    allocator: str = "default"
    mfu: float | None = None
    lora_rank: int | None = None
    lora_targets: str = "attn"
    lora_dropout: float = 0.0
    lora_alpha: float | None = None
    base_dtype: str | None = None
    double_quant: bool = True
    quant_backend: str = "bnb"
    quantize_head: bool = False
    freeze: str | None = None
    base_lr: float | None = None
    base_batch: int | None = None
    base_warmup_steps: int | None = None
    dp_mode: str = "collective"
    cp_comm: str | None = None  # None: the profile's (specs.CP_COMM_DEFAULT)
    # framework buffer knobs (None: the framework default); names match TrainingSpec and DeepSpeed's config keys
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool | None = None
    overlap_comm: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    contiguous_gradients: bool | None = None
    # DeepSpeed's element counts: an int, or a count as typed ("5e8", "500M", "500000000": units.parse_count)
    reduce_bucket_size: int | str | None = None
    allreduce_bucket_size: int | str | None = None
    allgather_bucket_size: int | str | None = None
    stage3_prefetch_bucket_size: int | str | None = None
    stage3_max_live_parameters: int | str | None = None
    stage3_max_reuse_distance: int | str | None = None
    gpus: int | None = None
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool | None = None
    zero: int = 0
    offload: str = "none"
    schedule: str | None = None
    order: str = "tp,cp,pp,dp"
    tp_overlap: bool = False
    profile: str = "torch"
    gpu: str = DEFAULT_GPU
    gpus_per_node: int | None = None
    intra_bw: float | None = None
    host_bw: float | None = None
    cpu_optimizer_rate: float | None = None
    inter_bw: float | None = None
    latency: float | None = None
    memory: str | None = None
    runtime_overhead: str | None = None
    # import a framework's own configuration (memcalc/importers); explicit flags win over imported values
    deepspeed_config: str | None = None
    megatron_args: str | None = None
    torchtitan_config: str | None = None
    # not a flag: what the import did (memcalc.importers.ImportReport), set by memcalc.importers.apply_imports
    import_report: Any = dataclasses.field(default=None, repr=False, compare=False)


BUFFER_KNOBS = ("bucket_cap_mb", "gradient_as_bucket_view", "overlap_comm", "overlap_grad_reduce",
                "overlap_param_gather", "contiguous_gradients",
                "reduce_bucket_size", "allreduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_max_live_parameters", "stage3_max_reuse_distance")
# the knobs DeepSpeed's config counts in elements (its own defaults are written 5e8, 1e9)
ELEMENT_COUNT_KNOBS = ("reduce_bucket_size", "allreduce_bucket_size", "allgather_bucket_size",
                       "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance")
IMPORT_FIELDS = ("deepspeed_config", "megatron_args", "torchtitan_config")
SHAPE_CHOICE_FIELDS = ("mlp", "norm", "tied_embeddings", "positions", "bias", "qkv_bias", "head_bias", "post_norms",
                       "qk_norm", "final_logit_softcap", "attn_softcap", "block",
                       "max_positions")
MOE_FIELDS = ("experts", "top_k", "expert_ffn", "shared_experts", "first_dense_layers")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim")
ARCH_FIELDS = ("head_dim", *MOE_FIELDS, *MLA_FIELDS)


def _buffer_knob(o: RunOptions, field: str) -> Any:
    """A framework buffer knob's value; DeepSpeed's element counts as typed (5e8, 500M) parsed to an int."""
    v = getattr(o, field)
    if field in ELEMENT_COUNT_KNOBS and isinstance(v, str):
        return parse_count(v, "--" + field.replace("_", "-"), examples="5e8, 500M, 500000000")
    return v


def _shape_choices(o: RunOptions) -> dict[str, Any]:
    """ModelSpec fields set by the shape-choice flags (--mlp, --norm, --tied-embeddings, --positions, --bias,
    --qkv-bias, --head-bias, --post-norms, --qk-norm, --logit-softcap, --attn-softcap, --block, --max-positions)."""
    out: dict[str, Any] = {}
    for field in ("mlp", "norm", "positions", "block"):
        v = check_choice(field, getattr(o, field))
        if v is not None:
            out[field] = v
    if o.bias is not None:
        out["linear_bias"] = out["qkv_bias"] = o.bias
    # the on/off flags that set the model field of their name (--qkv-bias after --bias, which sets it too)
    for field in ("tied_embeddings", "qkv_bias", "head_bias", "post_norms", "qk_norm", "final_logit_softcap",
                  "attn_softcap"):
        v = getattr(o, field)
        if v is not None:
            out[field] = v
    if o.max_positions is not None:
        check_positive("--max-positions", o.max_positions)
        out["max_positions"] = o.max_positions
    return out


def _architecture(o: RunOptions, data: dict[str, Any], explicit_kv: bool) -> list[str]:
    """Apply --head-dim and the MoE / MLA flags to the model's fields (in place); returns the fields given.
    On a model that has experts (a latent attention) each flag overrides that field; on one that has none,
    --experts with --top-k makes it MoE (--expert-ffn defaults to its --ffn, as Megatron's --moe-ffn-hidden-size
    does) and --kv-lora-rank with --qk-nope-dim, --qk-rope-dim and --v-head-dim makes its attention MLA."""
    given = {f: getattr(o, f) for f in ARCH_FIELDS if getattr(o, f) is not None}
    for f, v in given.items():
        check_positive(FLAG_OF[f], v, minimum=0 if f in ("shared_experts", "first_dense_layers", "q_lora_rank") else 1)
    name = data.get("name", "custom")
    moe = {f: given[f] for f in MOE_FIELDS if f in given}
    if moe:
        base = data.get("moe")
        if base is None:
            if "experts" not in moe:
                flags = " ".join(FLAG_OF[f] for f in moe)
                raise InputError(f"{flags} with {name}: it has no experts; give --experts E and --top-k K to make it "
                                 "a mixture of experts")
            if "top_k" not in moe:
                raise InputError(f"--experts {moe['experts']} with {name}: give --top-k K (experts per token) too")
            base = {"expert_ffn": data.get("ffn")}
        data["moe"] = {**dict(base), **moe}
    mla = {f: given[f] for f in MLA_FIELDS if f in given}
    if mla:
        base = data.get("mla")
        if base is None:
            missing = [FLAG_OF[f] for f in ("kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim")
                       if f not in mla]
            if missing:
                flags = " ".join(FLAG_OF[f] for f in mla)
                raise InputError(f"{flags} with {name}: multi-head latent attention needs all of --kv-lora-rank "
                                 f"--qk-nope-dim --qk-rope-dim --v-head-dim (missing: {' '.join(missing)})")
            if explicit_kv and data.get("kv_heads") not in (None, 0, data.get("heads")):
                raise InputError(f"--kv-heads {data['kv_heads']} with multi-head latent attention: every head has its "
                                 f"own key and value; valid: {data.get('heads')} (the heads) or leave it out")
            data["kv_heads"] = data.get("heads")
        data["mla"] = {**dict(base or {}), **mla}
        data["head_dim"] = 0  # MLA: the query/key width, nope + rope (ModelSpec._defaults)
    if "head_dim" in given:
        if data.get("mla") is not None:
            raise InputError(f"--head-dim {given['head_dim']} with multi-head latent attention: its query/key width "
                             "is --qk-nope-dim + --qk-rope-dim and its value width --v-head-dim")
        data["head_dim"] = given["head_dim"]
    return list(given)


DEFAULT_SEQ = 4096


def _seq_of(o: RunOptions, model: ModelSpec) -> int:
    """--seq, or its default: DEFAULT_SEQ, shortened to a learned-position table (GPT-2's 1024 rows), which no
    longer sequence can index. A longer --seq there is an input error (--max-positions models a longer table)."""
    table = model.max_positions if model.positions == "learned" else 0
    if o.seq is None:
        return min(DEFAULT_SEQ, table) if table else DEFAULT_SEQ
    if table and o.seq > table:
        name = model.display_name or model.name
        raise InputError(f"--seq {o.seq} exceeds the {table} learned positions of {name} (its position table has "
                         f"{table} rows); valid: --seq 1..{table}, or --max-positions {o.seq} for a longer table")
    return o.seq


def build_model(o: RunOptions) -> tuple[ModelSpec, str | None]:
    """The model and, with --params alone, the name of the reference shape assumed."""
    from memcalc.presets import load_model, reference_shape

    if o.model and o.params:
        base = load_model(o.model)
        model = base.model_copy(update={"params_override": parse_count(o.params)})
        assumed = None
    elif o.model:
        model, assumed = load_model(o.model), None
    elif o.params:
        model = reference_shape(parse_count(o.params))
        assumed = model.name
    else:
        model, assumed = None, None
    overrides = {k: getattr(o, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    for k, v in overrides.items():
        check_positive(FLAG_OF[k], v)
    overrides.update(_shape_choices(o))
    if model is None:
        missing = [FLAG_OF[k] for k in ("layers", "hidden", "heads", "ffn", "vocab") if k not in overrides]
        if overrides.get("positions") == "learned" and "max_positions" not in overrides:
            overrides["max_positions"] = o.seq or DEFAULT_SEQ  # learned positions need a table: the sequence's
        if missing:
            raise InputError(
                "give --model NAME|PATH, or --params N (e.g. 7B), or all of --layers --hidden --heads --ffn --vocab "
                f"(missing: {' '.join(missing)})"
            )
        data: dict[str, Any] = {"name": "custom", **overrides}
    else:
        data = model.model_dump()
        if (overrides.get("positions") == "learned" and not data.get("max_positions")
                and "max_positions" not in overrides):
            overrides["max_positions"] = o.seq or DEFAULT_SEQ
        data.update(overrides)
        if "heads" in overrides and "kv_heads" not in overrides:
            data["kv_heads"] = overrides["heads"] if model.kv_heads == model.heads else model.kv_heads
        if {"hidden", "heads"} & set(overrides):
            data["head_dim"] = 0
        if "heads" in overrides or "kv_heads" in overrides:
            if data["heads"] % data["kv_heads"]:
                raise InputError(f"--heads {data['heads']} is not a multiple of --kv-heads {data['kv_heads']}")
    arch = _architecture(o, data, explicit_kv="kv_heads" in overrides)
    if model is not None and (overrides or arch):
        data["name"] = f"{model.name}+overrides"
        data["display_name"] = f"{model.display_name} (overridden: {', '.join(sorted({*overrides, *arch}))})"
    try:
        return ModelSpec(**data), assumed
    except ValidationError as e:
        raise InputError(_spec_error(e)) from None


def build_hardware(o: RunOptions) -> HardwareSpec:
    from memcalc.presets import load_gpu

    hw = load_gpu(o.gpu)
    upd: dict[str, Any] = {}
    check_positive("--gpus-per-node", o.gpus_per_node)
    if o.gpus_per_node is not None:
        upd["gpus_per_node"] = o.gpus_per_node
    for flag, field, val in (("--intra-bw", "intra_node_bytes_per_s", o.intra_bw),
                             ("--inter-bw", "inter_node_bytes_per_s", o.inter_bw),
                             ("--host-bw", "host_bytes_per_s", o.host_bw), ("--latency", "latency_s", o.latency),
                             ("--cpu-optimizer-rate", "host_optimizer_params_per_s", o.cpu_optimizer_rate)):
        if val is not None:
            if val < 0 or (val == 0 and field != "latency_s"):
                raise InputError(f"{flag} {val} must be positive")
            upd[field] = val
    if o.memory is not None:
        upd["memory_bytes"] = parse_bytes(o.memory, "--memory")
        if upd["memory_bytes"] < 1:
            raise InputError(f"--memory {o.memory!r} must be positive")
    if o.runtime_overhead is not None:
        upd["runtime_overhead_bytes"] = parse_bytes(o.runtime_overhead, "--runtime-overhead")
        upd["runtime_overhead_is_total"] = True  # the flag gives the whole figure, NCCL included
    return hw.model_copy(update=upd) if upd else hw


_OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(RunOptions))


def _spec_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ())]
    field = loc[-1] if loc else ""
    # a field of RunOptions is the option of the same name (--bucket-cap-mb for bucket_cap_mb)
    flag = FLAG_OF.get(field) or (f"--{field.replace('_', '-')}" if field in _OPTION_FIELDS else field)
    msg = err.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if field in ("moe", "mla"):  # a check across the section's fields: its message names them
        return msg
    if flag:
        return f"{flag} {err.get('input')!r}: {msg}"
    return validation_message(e)


def _freeze_items(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    return tuple(x.strip().lower() for x in text.split(",") if x.strip())


def _rope_cache(text: str) -> tuple[int, bool]:
    """`--rope-cache`: none | N | N/layer -> (positions, one table per layer)."""
    t = (text or "none").strip().lower()
    if t == "none":
        return 0, False
    n, sep, per = t.partition("/")
    if n.isdigit() and int(n) > 0 and (not sep or per == "layer"):
        return int(n), bool(sep)
    raise InputError(f"--rope-cache {text!r} is not valid; valid: none, N (one table of N positions, e.g. 131072), "
                     "N/layer (one per layer, e.g. 4096/layer)")


def build_run(o: RunOptions) -> Run:
    if any(getattr(o, f) for f in IMPORT_FIELDS):
        from memcalc.importers import apply_imports

        o = apply_imports(o)  # explicit = every field that differs from its default
    profile = check_choice("profile", o.profile)
    for field in ("precision", "grad_dtype", "optimizer", "recompute", "attention", "loss", "keep_logits", "peak_step",
                  "offload", "schedule", "lora_targets", "base_dtype", "dp_mode", "cp_comm", "quant_backend",
                  "norm_impl", "qkv_impl", "gqa_impl", "optimizer_impl", "allocator"):
        setattr(o, field, check_choice(field, getattr(o, field)))
    for flag, v in (("--gpus", o.gpus), ("--dp", o.dp), ("--tp", o.tp), ("--pp", o.pp), ("--vpp", o.vpp),
                    ("--cp", o.cp), ("--ep", o.ep), ("--seq", o.seq), ("--micro-batch", o.micro_batch),
                    ("--global-batch", o.global_batch), ("--grad-accum", o.grad_accum)):
        check_positive(flag, v)
    if o.zero not in (0, 1, 2, 3):
        raise InputError(f"--zero {o.zero} is not a ZeRO stage; valid: 0, 1, 2, 3")
    check_positive("--recompute-layers", o.recompute_layers, minimum=0)
    check_positive("--recompute-every", o.recompute_every)
    check_positive("--lora-rank", o.lora_rank)
    check_positive("--base-batch", o.base_batch)
    check_positive("--base-warmup-steps", o.base_warmup_steps, minimum=0)
    if o.base_lr is not None and not o.base_lr > 0:
        raise InputError(f"--base-lr {o.base_lr} must be positive")
    for flag, v, hi in (("--dropout", o.dropout, 1.0), ("--fragmentation", o.fragmentation, 1.0),
                        ("--lora-dropout", o.lora_dropout, 1.0)):
        if v is not None and not 0.0 <= v < hi:
            raise InputError(f"{flag} {v} must be in [0, 1)")
    if o.mfu is not None and not 0.0 < o.mfu <= 1.0:
        raise InputError(f"--mfu {o.mfu} must be in (0, 1]")
    rope_positions, rope_per_layer = _rope_cache(o.rope_cache)
    model, assumed = build_model(o)
    if rope_positions and model.positions != "rotary":
        name = model.display_name or model.name
        raise InputError(f"--rope-cache {o.rope_cache} needs a model with rotary positions; {name} has "
                         f"{model.positions} positions (valid here: none)")
    hardware = build_hardware(o)
    try:
        training = TrainingSpec(
            seq=_seq_of(o, model), micro_batch=o.micro_batch, global_batch=o.global_batch, grad_accum=o.grad_accum,
            precision=o.precision, master_weights=o.master_weights, grad_dtype=o.grad_dtype, optimizer=o.optimizer,
            recompute=o.recompute, recompute_layers=o.recompute_layers,
            recompute_every=o.recompute_every, attention=o.attention, loss=o.loss,
            keep_logits=o.keep_logits, peak_step=o.peak_step,
            rope_cache_positions=rope_positions, rope_cache_per_layer=rope_per_layer,
            offload_activations=o.offload_activations,
            norm_impl=o.norm_impl, qkv_impl=o.qkv_impl, gqa_impl=o.gqa_impl, lora_dropout=o.lora_dropout,
            dropout=o.dropout, foreach=o.foreach, optimizer_impl=o.optimizer_impl, fragmentation=o.fragmentation,
            allocator=o.allocator, mfu=o.mfu,
            lora_rank=o.lora_rank, lora_targets=o.lora_targets, lora_alpha=o.lora_alpha, base_dtype=o.base_dtype,
            double_quant=o.double_quant, quant_backend=o.quant_backend, quantize_head=o.quantize_head,
            freeze=_freeze_items(o.freeze), base_lr=o.base_lr, base_batch=o.base_batch,
            base_warmup_steps=o.base_warmup_steps,
            **{k: _buffer_knob(o, k) for k in BUFFER_KNOBS},
        )
        parallel = ParallelSpec(
            gpus=o.gpus, dp=o.dp, tp=o.tp, pp=o.pp, vpp=o.vpp, cp=o.cp, ep=o.ep, sp=o.sp, zero=o.zero,
            offload=o.offload, schedule=o.schedule, order=o.order, tp_overlap=o.tp_overlap, dp_mode=o.dp_mode,
            cp_comm=o.cp_comm,
        )
    except ValidationError as e:
        raise InputError(_spec_error(e)) from None
    if o.recompute_layers is not None and o.recompute_layers > model.layers:
        raise InputError(f"--recompute-layers {o.recompute_layers} exceeds the model's {model.layers} layers")
    return resolve(model, training, parallel, hardware, profile, assumed_shape=assumed)
