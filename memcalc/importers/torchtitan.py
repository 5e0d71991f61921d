"""`--torchtitan-config job.toml`: a torchtitan job TOML into RunOptions fields (profile torch).

Sections and keys: torchtitan torchtitan/config/job_config.py (older: torchtitan/config_manager.py) and the shipped
torchtitan/models/llama3/train_configs/llama3_8b.toml / llama3_70b.toml / llama3_405b.toml. Mapping:
- [model] name "llama3" with flavor 8B / 70B / 405B -> the llama-3.1-8b / -70b / -405b presets (torchtitan's
  llama3 flavours have the Llama 3.1 shapes); converters = ["float8"] (or the older [float8]
  enable_float8_linear) -> --precision fp8.
- [parallelism] data_parallel_shard_degree (-1: every GPU left over) and data_parallel_replicate_degree -> dp;
  tensor / pipeline / context / expert_parallel_degree -> tp / pp / cp / ep; torchtitan applies FSDP2
  (fully_shard) when the shard degree or cp is > 1 -> --zero 3 (fsdp_reshard_after_forward "default" keeps
  params unsharded between forward and backward with pp > 1, and "never" always: ZeRO-2-like, --zero 2);
  TP > 1 uses sequence parallel on the norms (--sp); enable_async_tensor_parallel -> --tp-overlap;
  pipeline_parallel_schedule, pipeline_parallel_microbatch_size, pipeline_parallel_layers_per_stage.
- [training] local_batch_size (older: batch_size), global_batch_size, seq_len, mixed_precision_param (bfloat16 ->
  bf16 with fp32 sharded params as the master copy), dtype bfloat16 (pure bf16, no master copy),
  enable_cpu_offload (FSDP CPUOffloadPolicy -> --offload params).
- [activation_checkpoint] mode none | selective | full; selective_ac_option "op" (per-op policy) or an integer k
  (every k-th layer fully checkpointed: --recompute-every k).
- [optimizer] name Adam / AdamW, implementation for-loop | foreach | fused (default "fused") -> --optimizer-impl.
"""

from __future__ import annotations

import tomllib
from typing import Any

from memcalc.errors import InputError
from memcalc.importers import Imported, as_int, read_text
from memcalc.options import RunOptions
from memcalc.specs import every_fits_chunks

FLAG = "--torchtitan-config"

FLAVOURS = {("llama3", "8b"): "llama-3.1-8b", ("llama3", "70b"): "llama-3.1-70b",
            ("llama3", "405b"): "llama-3.1-405b"}

_IRRELEVANT_SECTIONS = {"job", "profiling", "metrics", "lr_scheduler", "checkpoint", "comm", "validation",
                        "fault_tolerance", "memory_estimation", "debug"}
_IRRELEVANT = {
    "model": {"tokenizer_path", "hf_assets_path", "norm_type", "print_after_conversion"},
    "optimizer": {"lr", "eps", "weight_decay", "beta1", "beta2", "early_step_in_backward"},
    "training": {"max_norm", "steps", "dataset", "dataset_path", "seed", "deterministic", "gc_freq",
                 "gc_debug", "warmup_steps"},
    "parallelism": {"pipeline_parallel_split_points", "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_schedule_csv",
                    "pipeline_parallel_degree_split_points", "module_fqns_per_model_part"},
    "activation_checkpoint": {"preserve_rng_state", "determinism_check", "debug", "early_stop"},
}
_RECORD = {
    "training": {"mixed_precision_reduce", "compile"},
    "parallelism": {"disable_loss_parallel", "enable_loss_parallel", "context_parallel_rotate_method",
                    "enable_compiled_autograd", "expert_tensor_parallel_degree"},
    "float8": None,  # every key
    "compile": None,
    "mx": None,
}
_ACCEPTED = {
    "model": {"name", "flavor", "converters"},
    "optimizer": {"name", "implementation"},
    "training": {"local_batch_size", "batch_size", "global_batch_size", "seq_len", "mixed_precision_param", "dtype",
                 "enable_cpu_offload"},
    "parallelism": {"data_parallel_shard_degree", "data_parallel_replicate_degree", "tensor_parallel_degree",
                    "pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree",
                    "fsdp_reshard_after_forward", "enable_async_tensor_parallel", "pipeline_parallel_schedule",
                    "pipeline_parallel_microbatch_size", "pipeline_parallel_layers_per_stage"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "experimental": {"pipeline_parallel_degree", "context_parallel_degree", "enable_async_tensor_parallel",
                     "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                     "pipeline_parallel_split_points"},
}


def load_config(ref: str) -> tuple[dict[str, Any], str]:
    text, source = read_text(ref, FLAG)
    try:
        return tomllib.loads(text), source
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{FLAG} {ref!r} is not valid TOML: {e}") from None


def import_torchtitan(ref: str, o: RunOptions, explicit: set[str]) -> Imported:
    cfg, source = load_config(ref)
    imp = Imported(framework="torchtitan", source=source)
    imp.set("profile", "torch", default=True)
    # torchtitan's launcher (run_train.sh) exports PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"
    imp.set("allocator", "expandable", default=True)
    imp.notes.append("allocator: expandable segments, as torchtitan's run_train.sh launches (--allocator default "
                     "if you launch otherwise)")

    def sec(name: str) -> dict[str, Any]:
        v = cfg.get(name, {})
        if not isinstance(v, dict):
            raise InputError(f"{source}: [{name}] must be a table")
        return v

    model, par, train, ac, opt = sec("model"), sec("parallelism"), sec("training"), sec("activation_checkpoint"), \
        sec("optimizer")
    exp = sec("experimental")
    for k in ("pipeline_parallel_degree", "context_parallel_degree", "enable_async_tensor_parallel",
              "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size"):
        if k in exp and k not in par:  # older torchtitan kept these under [experimental]
            par = {**par, k: exp[k]}

    def integer(table: dict[str, Any], key: str, default: int, minimum: int = 1, allow_minus_one: bool = False) -> int:
        if key not in table:
            return default
        n = as_int(table[key], key, source)
        if allow_minus_one and n == -1:
            return -1
        if n < minimum:
            raise InputError(f"{source}: {key} = {table[key]!r} must be at least {minimum}"
                             + (" (or -1)" if allow_minus_one else ""))
        return n

    # model
    name, flavor = model.get("name"), model.get("flavor")
    if name is not None:
        preset = FLAVOURS.get((str(name).lower(), str(flavor).lower()))
        if preset is None:
            if "model" not in explicit and "params" not in explicit:
                valid = ", ".join(f"{n} {f.upper()}" for n, f in FLAVOURS)
                raise InputError(f"{source}: [model] name {name!r} flavor {flavor!r} has no memcalc preset "
                                 f"(known: {valid}); give --model")
            imp.ignore(f"model.name = {name} / flavor = {flavor}", "no memcalc preset; --model is used")
        else:
            imp.set("model", preset)
    converters = model.get("converters", [])
    f8 = sec("float8")
    if "float8" in [str(c).lower() for c in converters] or f8.get("enable_float8_linear") is True:
        imp.set("precision", "fp8")

    # parallel degrees
    tp = integer(par, "tensor_parallel_degree", 1)
    pp = integer(par, "pipeline_parallel_degree", 1)
    cp = integer(par, "context_parallel_degree", 1)
    ep = integer(par, "expert_parallel_degree", 1)
    rep = integer(par, "data_parallel_replicate_degree", 1)
    shard = integer(par, "data_parallel_shard_degree", -1, allow_minus_one=True)
    for field, v, key in (("tp", tp, "tensor_parallel_degree"), ("pp", pp, "pipeline_parallel_degree"),
                          ("cp", cp, "context_parallel_degree"), ("ep", ep, "expert_parallel_degree")):
        imp.set(field, v, default=key not in par)
    eff = {f: (getattr(o, f) if f in explicit else v) for f, v in (("tp", tp), ("pp", pp), ("cp", cp))}
    inner = eff["tp"] * eff["pp"] * eff["cp"] * rep
    if shard == -1:
        if "gpus" in explicit:
            if o.gpus % inner:
                raise InputError(f"--gpus {o.gpus} is not divisible by replicate*tp*pp*cp = {inner} "
                                 f"({source} data_parallel_shard_degree = -1)")
            shard = o.gpus // inner
        else:
            from memcalc.presets import load_gpu

            per_node = o.gpus_per_node or load_gpu(o.gpu).gpus_per_node
            gpus = max(per_node, inner)
            gpus -= gpus % inner
            shard = gpus // inner
            imp.needs_value.append(f"data_parallel_shard_degree = -1 uses every GPU left over: assumed one node, "
                                   f"--gpus {gpus}; give --gpus N")
            imp.set("gpus", gpus, default=True)
    else:
        imp.set("gpus", shard * inner)
    fsdp = shard > 1 or eff["cp"] > 1
    if fsdp:
        policy = str(par.get("fsdp_reshard_after_forward", "default")).lower()
        if policy not in ("default", "always", "never"):
            raise InputError(f"{source}: fsdp_reshard_after_forward = {policy!r}; valid: default, always, never")
        zero = 3 if policy == "always" or (policy == "default" and eff["pp"] == 1) else 2
        imp.set("zero", zero)
        if zero == 2:
            imp.notes.append(f"fsdp_reshard_after_forward {policy} with pp {eff['pp']}: parameters stay unsharded "
                             "between forward and backward (ZeRO-2-like, --zero 2)")
        if rep > 1:
            imp.notes.append(f"HSDP (replicate {rep} x shard {shard}): memcalc shards over all of dp*cp; model "
                             f"states per GPU are {rep}x lower here than on the real run")
    else:
        imp.set("zero", 0, default=True)
        if rep > 1:
            imp.notes.append(f"data_parallel_replicate_degree {rep} with no sharding: DDP (--zero 0)")
    if eff["tp"] > 1:
        imp.set("sp", True)
        imp.notes.append("torchtitan's TP plan shards the norms' activations along the sequence: --sp")
    if par.get("enable_async_tensor_parallel") is True:
        imp.set("tp_overlap", True)

    # pipeline schedule and micro-batches
    sched = par.get("pipeline_parallel_schedule")
    if sched is not None and eff["pp"] > 1:
        s = str(sched).lower()
        if s in ("1f1b",):
            imp.set("schedule", "1f1b")
        elif s in ("gpipe",):
            imp.set("schedule", "gpipe")
        else:
            imp.set("schedule", "interleaved")
            lps = par.get("pipeline_parallel_layers_per_stage")
            if s not in ("interleaved1f1b",):
                imp.notes.append(f"pipeline_parallel_schedule {sched}: modelled as interleaved 1F1B")

            def vpp_rule(model: Any, merged: RunOptions, imp: Imported) -> None:
                if lps is not None:
                    n = as_int(lps, "pipeline_parallel_layers_per_stage", source)
                    stages = -(-model.layers // n)
                    if stages % merged.pp:
                        raise InputError(f"{source}: {model.layers} layers in stages of {n} do not spread evenly "
                                         f"over pp {merged.pp}")
                    imp.set("vpp", stages // merged.pp)
                else:
                    imp.set("vpp", 2)
                    imp.notes.append("multi-stage schedule without pipeline_parallel_layers_per_stage: assumed 2 "
                                     "stages per rank (--vpp 2)")

            imp.deferred.append(vpp_rule)

    # batch
    local = integer(train, "local_batch_size", integer(train, "batch_size", 8))
    if "local_batch_size" not in train and "batch_size" not in train:
        imp.notes.append("no [training] local_batch_size: torchtitan's default 8")
    seq = integer(train, "seq_len", 2048)
    imp.set("seq", seq, default="seq_len" not in train)
    mbs = integer(par, "pipeline_parallel_microbatch_size", 1) if eff["pp"] > 1 else local
    if local % mbs:
        raise InputError(f"{source}: local_batch_size {local} is not a multiple of "
                         f"pipeline_parallel_microbatch_size {mbs}")
    imp.set("micro_batch", mbs)
    gb = integer(train, "global_batch_size", -1, allow_minus_one=True)
    if gb > 0:
        imp.set("global_batch", gb)
    else:
        imp.set("grad_accum", local // mbs, default=eff["pp"] == 1)
        if eff["pp"] > 1:
            imp.notes.append(f"local_batch_size {local} / pipeline_parallel_microbatch_size {mbs}: "
                             f"{local // mbs} micro-batches per step (--grad-accum)")

    # precision
    mpp = str(train.get("mixed_precision_param", "bfloat16")).lower()
    if "precision" not in imp.values:
        if mpp in ("bfloat16", "bf16"):
            imp.set("precision", "bf16", default="mixed_precision_param" not in train)
        elif mpp in ("float32", "fp32"):
            imp.set("precision", "fp32")
        elif mpp in ("float16", "fp16"):
            imp.set("precision", "fp16")
        else:
            raise InputError(f"{source}: mixed_precision_param = {mpp!r}; valid: bfloat16, float32")
    if str(train.get("dtype", "float32")).lower() in ("bfloat16", "bf16"):
        imp.set("precision", "bf16")
        imp.set("master_weights", False)
        imp.notes.append("[training] dtype bfloat16: params, grads and optimizer state all in bf16")
    if train.get("enable_cpu_offload") is True:
        if fsdp:
            imp.set("offload", "params")
        else:
            imp.ignore("training.enable_cpu_offload", "takes effect with FSDP only (shard degree or cp > 1)")

    # activation checkpointing
    mode = str(ac.get("mode", "none")).lower()
    if mode == "none":
        imp.set("recompute", "none", default="mode" not in ac)
    elif mode == "full":
        imp.set("recompute", "full")
    elif mode in ("selective", "memory_budget"):
        option = str(ac.get("selective_ac_option", "op")).strip()
        if mode == "memory_budget":
            imp.notes.append("activation_checkpoint mode memory_budget: modelled as selective")
        if mode == "memory_budget":
            imp.set("recompute", "selective")
        elif option.lower() == "op":
            imp.set("recompute", "op")  # op-level SAC, modelled as such (activations._op_sac_terms)
        else:
            try:
                every = int(option)
            except ValueError:
                raise InputError(f"{source}: selective_ac_option = {option!r}; valid: op or a positive "
                                 "integer") from None
            if every < 1:
                raise InputError(f"{source}: selective_ac_option = {option!r} must be op or at least 1")
            imp.set("recompute", "full")

            def layers_rule(model: Any, merged: RunOptions, imp: Imported) -> None:
                # torchtitan counts a rank's blocks over its model chunks (`_apply_layer_sac`); memcalc places them
                # so for whole stages, and for interleaved chunks of a multiple of K layers (specs.resolve)
                vpp = imp.values.get("vpp", merged.vpp)  # (the schedule's rule, above, has run)
                dense = model.moe is not None and model.moe.first_dense_layers
                if not dense and not merged.offload_activations and every_fits_chunks(model.layers, merged.pp,
                                                                                       vpp, every):
                    imp.set("recompute_every", every)
                    imp.notes.append(f"selective_ac_option {every}: every {every}-th layer fully checkpointed: "
                                     f"--recompute full --recompute-every {every}")
                    return
                per_unit = -(-model.layers // (merged.pp * vpp)) // every
                imp.set("recompute_layers", per_unit)
                imp.notes.append(f"selective_ac_option {every}: every {every}-th layer fully checkpointed, "
                                 f"approximated by the first {per_unit} of each stage or chunk (--recompute-layers "
                                 f"{per_unit}): --recompute-every is not modelled for this layout")

            imp.deferred.append(layers_rule)
    else:
        raise InputError(f"{source}: [activation_checkpoint] mode = {mode!r}; valid: none, selective, full")

    # optimizer
    if "name" in opt:
        oname = str(opt["name"]).lower()
        if oname in ("adam", "adamw"):
            imp.set("optimizer", oname)
        else:
            imp.ignore(f"optimizer.name = {opt['name']}", "optimizer memcalc does not model; --optimizer keeps "
                                                           "its value")
    impl = str(opt.get("implementation", "fused")).lower()
    if impl not in ("for-loop", "foreach", "fused"):
        raise InputError(f"{source}: [optimizer] implementation = {opt['implementation']!r}; valid: for-loop, "
                         "foreach, fused")
    if "foreach" not in explicit:  # --foreach/--no-foreach typed by the user wins over the file
        imp.set("optimizer_impl", impl, default="implementation" not in opt)

    # compile, and everything else
    compiled = train.get("compile") is True or sec("compile").get("enable") is True
    if compiled:
        imp.notes.append("torch.compile enabled: fused kernels may save fewer activations than modelled")
    for section, table in cfg.items():
        if not isinstance(table, dict):
            imp.ignore(section)
            continue
        if section in _IRRELEVANT_SECTIONS:
            imp.ignore(f"[{section}]", "no effect on memory or step time")
            continue
        if section in _RECORD and _RECORD[section] is None:
            for k, v in table.items():
                imp.recorded[f"{section}.{k}"] = v
            continue
        accepted = _ACCEPTED.get(section)
        if accepted is None:
            imp.ignore(f"[{section}]")
            continue
        for k, v in table.items():
            if k in accepted:
                continue
            if k in (_RECORD.get(section) or set()):
                imp.recorded[f"{section}.{k}"] = v
            elif k in _IRRELEVANT.get(section, set()):
                imp.ignore(f"{section}.{k}", "no effect on memory or step time")
            else:
                imp.ignore(f"{section}.{k}")
    return imp
