"""`--deepspeed-config ds_config.json`: a DeepSpeed configuration JSON into RunOptions fields.

Keys and meanings: DeepSpeed configuration reference (https://www.deepspeed.ai/docs/config-json/): batch size
keys (`train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * data-parallel size`),
`fp16` / `bf16` / `amp`, `zero_optimization` (stage, offload_optimizer / offload_param with device cpu | nvme,
bucket sizes), `optimizer`, `activation_checkpointing`, `data_types.grad_accum_dtype`, `sequence_parallel_size`
(DeepSpeed-Ulysses: --cp N, all-to-all). "auto" values are the
Hugging Face Trainer integration's (transformers integrations/deepspeed.py `HfTrainerDeepSpeedConfig`): batch
sizes come from the Trainer's arguments, and `reduce_bucket_size = hidden^2`,
`stage3_prefetch_bucket_size = 0.9 * hidden^2`, `stage3_param_persistence_threshold = 10 * hidden` from the model.
Here "auto" takes the value of the matching memcalc flag when given, else is listed under `needs_value` with the
value assumed. The model itself is not in a DeepSpeed config: give --model (or --params).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from memcalc.errors import InputError
from memcalc.importers import Imported, as_int, flag_text, read_text
from memcalc.options import RunOptions

FLAG = "--deepspeed-config"

# top-level keys with no effect on memory or step time
_IRRELEVANT = {
    "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
    "gradient_predivide_factor", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
    "monitor_config", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "memory_breakdown",
    "checkpoint", "elasticity", "autotuning", "sparse_gradients", "seed", "disable_allgather", "load_universal",
}
# top-level keys read and shown, but not modelled yet
_RECORD = {"communication_data_type", "aio", "pipeline", "compression_training", "data_efficiency",
           "sparse_attention", "tensor_parallel", "seq_parallel_communication_data_type", "torch_autocast"}

_ZERO_RECORD = {
    "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_param_persistence_threshold", "sub_group_size", "overlap_comm",
    "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "mics_shard_size", "mics_hierarchical_params_gather",
    "memory_efficient_linear", "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "zeropp_loco_param", "pipeline_loading_checkpoint", "override_module_apply",
}
_ZERO_IRRELEVANT = {
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save", "elastic_checkpoint",
    "load_from_fp32_weights", "ignore_unused_parameters", "legacy_stage1", "log_trace_cache_warnings",
    "gather_16bit_weights_on_model_save",
}
_OFFLOAD_KEYS = {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory", "pipeline",
                 "pipeline_read", "pipeline_write", "fast_init", "ratio"}
_FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}
_BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
              "bf16_optimizer_states"}
_AC_KEYS = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints",
            "synchronize_checkpoint_boundary", "profile"}

# DeepSpeed optimizer "type" (case-insensitive) -> memcalc --optimizer, and a note when it is an approximation
_OPTIMIZERS = {
    "adam": ("adam", ""), "adamw": ("adamw", ""), "fusedadam": ("adam", ""), "cpuadam": ("adam", ""),
    "deepspeedcpuadam": ("adam", ""),
    "lamb": ("adam", "LAMB keeps Adam's two moments; modelled as adam"),
    "fusedlamb": ("adam", "LAMB keeps Adam's two moments; modelled as adam"),
    "onebitadam": ("adam", "1-bit Adam keeps Adam's moments (plus error-feedback buffers, not modelled)"),
    "zerooneadam": ("adam", "0/1 Adam keeps Adam's moments (plus error-feedback buffers, not modelled)"),
    "onebitlamb": ("adam", "1-bit LAMB keeps Adam's moments (plus error-feedback buffers, not modelled)"),
    "lion": ("lion", ""), "fusedlion": ("lion", ""), "cpulion": ("lion", ""),
    "adafactor": ("adafactor", ""),
}


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.strip().lower() == "auto"


def load_config(ref: str) -> tuple[dict[str, Any], str]:
    text, source = read_text(ref, FLAG)
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{FLAG} {ref!r} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{FLAG} {ref!r} holds a JSON {type(cfg).__name__}, not a DeepSpeed config object")
    return cfg, source


def _enabled(section: Any, name: str, source: str) -> bool | str | None:
    """True / False / "auto" / None (section absent)."""
    if section is None:
        return None
    if not isinstance(section, dict):
        raise InputError(f"{source}: {name} must be an object, e.g. {{\"enabled\": true}}")
    v = section.get("enabled", False)
    if _is_auto(v):
        return "auto"
    if not isinstance(v, bool):
        raise InputError(f"{source}: {name}.enabled = {v!r} must be true, false or \"auto\"")
    return v


def _sub_keys(imp: Imported, section: dict[str, Any], prefix: str, known: set[str]) -> None:
    for k in section:
        if k not in known:
            imp.ignore(f"{prefix}.{k}")


def import_deepspeed(ref: str, o: RunOptions, explicit: set[str]) -> Imported:
    cfg, source = load_config(ref)
    imp = Imported(framework="deepspeed", source=source)
    imp.set("profile", "deepspeed", default=True)

    def batch_key(key: str, field: str, default_text: str) -> None:
        if key not in cfg:
            return
        v = cfg[key]
        if _is_auto(v):
            if field in explicit:
                imp.notes.append(f"{key} = \"auto\" resolved from the command line: "
                                 f"{flag_text(field, getattr(o, field))}")
            else:
                imp.needs_value.append(f"{key} = \"auto\": {default_text}; give {flag_text(field, 'N')} to set it")
            return
        n = as_int(v, key, source)
        if n < 1:
            raise InputError(f"{source}: {key} = {v!r} must be at least 1")
        imp.set(field, n)

    batch_key("train_micro_batch_size_per_gpu", "micro_batch", f"assumed micro-batch {o.micro_batch}")
    batch_key("train_batch_size", "global_batch", "derived as micro-batch * grad-accum * dp")
    batch_key("gradient_accumulation_steps", "grad_accum", "derived from the global batch (or 1)")
    if "global_batch" in imp.values and "grad_accum" in imp.values:
        # DeepSpeed derives one of the three from the other two; keeping the global batch lets --micro-batch
        # on the command line change the accumulation steps instead of contradicting them
        ga = imp.values.pop("grad_accum")
        imp.from_config.discard("grad_accum")
        imp.recorded["gradient_accumulation_steps"] = ga
        imp.notes.append(f"gradient_accumulation_steps {ga} follows from train_batch_size / (micro-batch * dp); "
                         "memcalc derives it from --global-batch")
        if not {"micro_batch", "global_batch", "grad_accum"} & explicit:
            def check_batch(model: Any, merged: RunOptions, imp: Imported) -> None:
                inner = merged.tp * merged.pp * merged.cp
                dp = merged.dp or (merged.gpus // inner if merged.gpus else 1)
                mb, gb = merged.micro_batch, merged.global_batch
                if mb * ga * dp != gb:
                    raise InputError(f"{source}: train_batch_size {gb} != train_micro_batch_size_per_gpu {mb} * "
                                     f"gradient_accumulation_steps {ga} * dp {dp} (DeepSpeed rejects this); "
                                     "check --gpus, or give --micro-batch / --global-batch")

            imp.deferred.append(check_batch)

    # precision: fp16 / bf16 / amp sections (DeepSpeed rejects fp16 and bf16 both enabled)
    fp16 = _enabled(cfg.get("fp16"), "fp16", source)
    bf16 = _enabled(cfg.get("bf16", cfg.get("bfloat16")), "bf16", source)
    amp = _enabled(cfg.get("amp"), "amp", source)
    for name, known in (("fp16", _FP16_KEYS), ("bf16", _BF16_KEYS), ("bfloat16", _BF16_KEYS)):
        if isinstance(cfg.get(name), dict):
            _sub_keys(imp, cfg[name], name, known)
            for k in ("fp16_master_weights_and_grads", "bf16_master_weights_and_grads", "bf16_optimizer_states"):
                if k in cfg[name]:
                    imp.recorded[f"{name}.{k}"] = cfg[name][k]
    if fp16 is True and bf16 is True:
        raise InputError(f"{source}: fp16 and bf16 are both enabled; DeepSpeed allows one")
    if fp16 is True or amp is True:
        imp.set("precision", "fp16")
        if amp is True:
            imp.notes.append("amp (apex) enabled: modelled as fp16 mixed precision")
    elif bf16 is True:
        imp.set("precision", "bf16")
    elif "auto" in (fp16, bf16):
        if "precision" in explicit:
            imp.notes.append(f"fp16/bf16 enabled = \"auto\" resolved from the command line: --precision {o.precision}")
        else:
            imp.needs_value.append(f"fp16/bf16 enabled = \"auto\": assumed --precision {o.precision}; give "
                                   "--precision fp16|bf16|fp32 to set it")
    else:
        imp.set("precision", "fp32", default=fp16 is None and bf16 is None)
        imp.notes.append("no fp16/bf16 section enabled: DeepSpeed trains in fp32")

    dt = cfg.get("data_types")
    if isinstance(dt, dict):
        for k, v in dt.items():
            if k == "grad_accum_dtype" and v is not None:
                g = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16",
                     "bfloat16": "bf16"}.get(str(v).lower())
                if g is None:
                    raise InputError(f"{source}: data_types.grad_accum_dtype = {v!r}; valid: fp32, fp16, bf16")
                imp.set("grad_dtype", g)
            else:
                imp.ignore(f"data_types.{k}")

    _zero(cfg, imp, source)
    _optimizer(cfg, imp, source)
    _checkpointing(cfg, imp, o, explicit, source)
    if "sequence_parallel_size" in cfg:
        # DeepSpeed-Ulysses (deepspeed/runtime/config.py `sequence_parallel_size`, default 1): the sequence is
        # split over this many ranks and attention exchanges Q, K, V and its output all-to-all
        n = as_int(cfg["sequence_parallel_size"], "sequence_parallel_size", source)
        if n < 1:
            raise InputError(f"{source}: sequence_parallel_size = {cfg['sequence_parallel_size']!r} must be at "
                             "least 1")
        imp.set("cp", n)
        imp.set("cp_comm", "a2a")

    handled = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "fp16", "bf16",
               "bfloat16", "amp", "data_types", "zero_optimization", "optimizer", "activation_checkpointing",
               "sequence_parallel_size"}
    for k, v in cfg.items():
        if k in handled:
            continue
        if k in _RECORD:
            imp.recorded[k] = v
        elif k in _IRRELEVANT:
            imp.ignore(k, "no effect on memory or step time")
        else:
            imp.ignore(k)
    return imp


def _offload_device(sec: Any, name: str, imp: Imported, source: str) -> bool:
    if sec is None:
        return False
    if not isinstance(sec, dict):
        raise InputError(f"{source}: zero_optimization.{name} must be an object, e.g. {{\"device\": \"cpu\"}}")
    _sub_keys(imp, sec, f"zero_optimization.{name}", _OFFLOAD_KEYS)
    dev = str(sec.get("device", "none")).lower()
    if dev not in ("none", "cpu", "nvme"):
        raise InputError(f"{source}: zero_optimization.{name}.device = {sec.get('device')!r}; valid: none, cpu, nvme")
    if dev == "nvme":
        imp.notes.append(f"{name} to NVMe: modelled like CPU offload (both leave GPU memory)")
    for k in ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "ratio"):
        if k in sec:
            imp.recorded[f"zero_optimization.{name}.{k}"] = sec[k]
    return dev != "none"


def _zero(cfg: dict[str, Any], imp: Imported, source: str) -> None:
    z = cfg.get("zero_optimization")
    if z is None:
        imp.set("zero", 0, default=True)
        return
    if not isinstance(z, dict):
        raise InputError(f"{source}: zero_optimization must be an object with a \"stage\"")
    stage = z.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise InputError(f"{source}: zero_optimization.stage = {stage!r}; valid: 0, 1, 2, 3")
    imp.set("zero", stage)
    opt_off = _offload_device(z.get("offload_optimizer"), "offload_optimizer", imp, source)
    par_off = _offload_device(z.get("offload_param"), "offload_param", imp, source)
    if z.get("cpu_offload") is True:  # legacy spelling (DeepSpeed < 0.3.16)
        opt_off = True
    if z.get("cpu_offload_params") is True:
        par_off = True
    if par_off:
        imp.set("offload", "params")
        if not opt_off:
            imp.notes.append("offload_param without offload_optimizer: modelled as --offload params (memcalc "
                             "offloads the optimizer with the params)")
    elif opt_off:
        imp.set("offload", "optimizer")
    hidden_auto: list[str] = []
    for k, v in z.items():
        if k in ("stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params"):
            continue
        if k in _ZERO_RECORD:
            if _is_auto(v) and k in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                                     "stage3_param_persistence_threshold"):
                hidden_auto.append(k)
                imp.recorded[f"zero_optimization.{k}"] = "auto"
            else:
                _knob(imp, k, int(v) if isinstance(v, float) and v.is_integer() else v)
        elif k in _ZERO_IRRELEVANT:
            imp.ignore(f"zero_optimization.{k}", "no effect on memory or step time")
        else:
            imp.ignore(f"zero_optimization.{k}")
    if hidden_auto:
        def resolve_auto(model: Any, merged: RunOptions, imp: Imported) -> None:
            h = model.hidden
            rule = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                    "stage3_param_persistence_threshold": 10 * h}
            for k in hidden_auto:
                imp.recorded.pop(f"zero_optimization.{k}", None)
                _knob(imp, k, rule[k])
            imp.notes.append(f"\"auto\" {', '.join(hidden_auto)} resolved from hidden {h} as the Hugging Face "
                             "Trainer does (hidden^2, 0.9*hidden^2, 10*hidden)")

        imp.deferred.append(resolve_auto)


_RUN_FIELDS = {f.name for f in dataclasses.fields(RunOptions)}


def _knob(imp: Imported, key: str, value: Any) -> None:
    """A zero_optimization setting: set as an option when RunOptions has a field of that name (bucket sizes,
    overlap_comm, ...), else recorded in the report as read but not modelled."""
    if key in _RUN_FIELDS:
        imp.set(key, value)
    else:
        imp.recorded[f"zero_optimization.{key}"] = value


def _optimizer(cfg: dict[str, Any], imp: Imported, source: str) -> None:
    opt = cfg.get("optimizer")
    if opt is None:
        return
    if not isinstance(opt, dict) or "type" not in opt:
        raise InputError(f"{source}: optimizer must be an object with a \"type\", e.g. {{\"type\": \"AdamW\"}}")
    t = str(opt["type"])
    params = opt.get("params") or {}
    key = t.lower().replace("_", "").replace("-", "")
    if key == "sgd":
        mom = params.get("momentum", 0) if isinstance(params, dict) else 0
        imp.set("optimizer", "sgd-momentum" if (not _is_auto(mom) and float(mom or 0) > 0) else "sgd")
    elif key in _OPTIMIZERS:
        name, note = _OPTIMIZERS[key]
        imp.set("optimizer", name)
        if note:
            imp.notes.append(note)
    else:
        imp.ignore(f"optimizer.type = {t}", "optimizer memcalc does not model; --optimizer keeps its value")
    for k in opt:
        if k not in ("type", "params"):
            imp.ignore(f"optimizer.{k}")
    if isinstance(params, dict) and params:
        imp.ignore("optimizer.params", "hyper-parameters: no effect on memory or step time")


def _checkpointing(cfg: dict[str, Any], imp: Imported, o: RunOptions, explicit: set[str], source: str) -> None:
    ac = cfg.get("activation_checkpointing")
    if ac is None:
        return
    if not isinstance(ac, dict):
        raise InputError(f"{source}: activation_checkpointing must be an object")
    _sub_keys(imp, ac, "activation_checkpointing", _AC_KEYS)
    for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints"):
        if k in ac:
            imp.recorded[f"activation_checkpointing.{k}"] = ac[k]
    for k in ("synchronize_checkpoint_boundary", "profile"):
        if k in ac:
            imp.ignore(f"activation_checkpointing.{k}", "no effect on memory or step time")
    imp.set("recompute", "full")
    if "recompute" not in explicit:
        imp.needs_value.append("activation_checkpointing: the section configures deepspeed.checkpointing, which "
                               "the model code must call; assumed every layer is checkpointed (--recompute full). "
                               "Give --recompute none if it is not (e.g. Hugging Face Trainer without "
                               "--gradient_checkpointing)")
    if ac.get("cpu_checkpointing"):
        imp.notes.append("cpu_checkpointing moves checkpointed activations to CPU: not modelled (the GPU figure "
                         "is an upper bound)")
