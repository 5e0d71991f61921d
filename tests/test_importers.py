"""--deepspeed-config, --megatron-args, --torchtitan-config: each imported configuration resolves to exactly the
Run that the equivalent explicit flags give; flags typed on the command line win (and the report says so); every
key memcalc does not use is reported; bad inputs are one line and exit 2.

The configurations are written here, modelled on the frameworks' documented examples (cited per test)."""

from __future__ import annotations

import json

import pytest

from memcalc.cost.params import total_params
from memcalc.errors import InputError
from memcalc.importers import apply_imports
from memcalc.options import RunOptions, build_run
from tests.conftest import cli, cli_json


def unknown_keys(report) -> set[str]:
    return {i.key for i in report.ignored if i.reason == "unknown to memcalc"}


def knobs_applied(report) -> dict:
    """zero_optimization settings that became options (once RunOptions has fields for them): the explicit-flag
    side of an equivalence test passes them too."""
    from memcalc.importers.deepspeed import _ZERO_RECORD

    return {k: v for k, v in report.applied.items() if k in _ZERO_RECORD}


def knob(report, key):
    """A zero_optimization setting: applied when RunOptions has a field for it, else recorded as not modelled."""
    return report.applied.get(key, report.recorded.get(f"zero_optimization.{key}"))


# --- DeepSpeed -----------------------------------------------------------------------------------------------------

# Modelled on the DeepSpeed configuration reference (https://www.deepspeed.ai/docs/config-json/: batch size keys,
# bf16, optimizer, scheduler, zero_optimization with offload_optimizer and the bucket sizes, activation_checkpointing)
# and DeepSpeed's ZeRO-3 Offload tutorial config (https://www.deepspeed.ai/tutorials/zero/).
DS_ZERO3_OFFLOAD = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_gather_16bit_weights_on_model_save": True,
        "flux_capacitor": 3,
    },
    "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True,
                                 "number_checkpoints": 4},
    "frobnicate": {"on": True},
}


@pytest.fixture
def ds_file(tmp_path):
    def write(cfg, name="ds_config.json"):
        p = tmp_path / name
        p.write_text(json.dumps(cfg))
        return str(p)

    return write


def test_deepspeed_imports_exactly_the_equivalent_flags(ds_file):
    path = ds_file(DS_ZERO3_OFFLOAD)
    imported = build_run(RunOptions(model="llama-3.1-8b", gpus=8, deepspeed_config=path))
    knobs = knobs_applied(apply_imports(RunOptions(model="llama-3.1-8b", gpus=8, deepspeed_config=path)).import_report)
    explicit = build_run(RunOptions(model="llama-3.1-8b", gpus=8, profile="deepspeed", micro_batch=4, global_batch=256,
                                    precision="bf16", zero=3, offload="optimizer", optimizer="adamw",
                                    recompute="full", **knobs))
    assert imported == explicit
    assert imported.grad_accum == 8  # 256 / (4 * 8): DeepSpeed's own identity


def test_deepspeed_sequence_parallel_size_is_ulysses(ds_file):
    """`sequence_parallel_size` (deepspeed/runtime/config.py, DeepSpeed-Ulysses): --cp N with the all-to-all
    exchange; the data-parallel degree is what is left, 16 / 4 = 4; a size that does not divide the heads is
    refused as the flags are."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
           "sequence_parallel_size": 4}
    run = build_run(RunOptions(model="llama-3.1-8b", gpus=16, seq=32768, deepspeed_config=ds_file(cfg)))
    assert (run.cp, run.cp_comm, run.dp, run.profile) == (4, "a2a", 4, "deepspeed")
    r = apply_imports(RunOptions(model="llama-3.1-8b", gpus=16, deepspeed_config=ds_file(cfg))).import_report
    assert "--cp 4 --cp-comm a2a" in r.equivalent_flags and not unknown_keys(r)
    with pytest.raises(InputError, match="valid: 1, 2, 4, 8"):
        build_run(RunOptions(model="llama-3.1-8b", gpus=12, seq=32766,
                             deepspeed_config=ds_file({**cfg, "sequence_parallel_size": 3})))
    with pytest.raises(InputError, match="sequence_parallel_size = 0 must be at least 1"):
        build_run(RunOptions(model="llama-3.1-8b", gpus=8, deepspeed_config=ds_file({"sequence_parallel_size": 0})))


def test_deepspeed_report_records_buckets_and_lists_every_unknown_key(ds_file):
    o = apply_imports(RunOptions(model="llama-3.1-8b", gpus=8, deepspeed_config=ds_file(DS_ZERO3_OFFLOAD)))
    r = o.import_report
    assert r.framework == "deepspeed"
    assert unknown_keys(r) == {"zero_optimization.flux_capacitor", "frobnicate"}
    irrelevant = {i.key for i in r.ignored if i.reason != "unknown to memcalc"}
    assert {"gradient_clipping", "steps_per_print", "wall_clock_breakdown", "scheduler", "optimizer.params",
            "zero_optimization.stage3_gather_16bit_weights_on_model_save"} <= irrelevant
    for k, v in (("reduce_bucket_size", 500_000_000), ("allgather_bucket_size", 500_000_000),
                 ("stage3_prefetch_bucket_size", 50_000_000), ("stage3_max_live_parameters", 1_000_000_000)):
        assert knob(r, k) == v
    assert r.recorded["activation_checkpointing.partition_activations"] is True
    # the equivalent flags, as printed, give the same run
    assert r.equivalent_flags.startswith("--profile deepspeed")
    assert "--zero 3" in r.equivalent_flags and "--offload optimizer" in r.equivalent_flags


def test_deepspeed_command_line_wins_and_says_so(ds_file):
    path = ds_file(DS_ZERO3_OFFLOAD)
    # --micro-batch 1 is memcalc's default value: only the command line (click's parameter source) knows it was typed
    d = cli_json("estimate", "-m", "llama-3.1-8b", "--gpus", "8", "--deepspeed-config", path, "--micro-batch", "1",
                 "--zero", "2")
    assert d["inputs"]["training"]["micro_batch"] == 1
    assert d["inputs"]["training"]["grad_accum"] == 32  # 256 / (1 * 8): the imported global batch is kept
    assert d["inputs"]["parallel"]["zero"] == 2
    rep = d["inputs"]["import_report"]
    over = {o["field"]: o for o in rep["overridden"]}
    assert over["micro_batch"]["imported"] == 4 and over["micro_batch"]["used"] == 1
    assert over["zero"]["imported"] == 3 and over["zero"]["used"] == 2
    code, out, err = cli("estimate", "-m", "llama-3.1-8b", "--gpus", "8", "--deepspeed-config", path,
                         "--micro-batch", "1")
    assert code == 0, err
    assert "command line wins: --micro-batch 1 (the deepspeed config says 4)" in " ".join(out.split())


def test_deepspeed_auto_values_resolved_or_reported(ds_file):
    # The Hugging Face Trainer's ZeRO-3 template (transformers docs, "DeepSpeed" > "ZeRO-3 example"): "auto" everywhere
    cfg = {
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"},
                              "offload_param": {"device": "none"}, "overlap_comm": True,
                              "contiguous_gradients": True, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                              "stage3_max_live_parameters": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    path = ds_file(cfg)
    o = apply_imports(RunOptions(model="llama-3.1-8b", gpus=8, deepspeed_config=path))
    r = o.import_report
    needs = " ".join(r.needs_value)
    assert "train_micro_batch_size_per_gpu" in needs and "bf16 enabled" in needs
    h = 4096
    assert knob(r, "reduce_bucket_size") == h * h
    assert knob(r, "stage3_prefetch_bucket_size") == int(0.9 * h * h)
    assert knob(r, "stage3_param_persistence_threshold") == 10 * h
    assert build_run(o) == build_run(RunOptions(model="llama-3.1-8b", gpus=8, profile="deepspeed", zero=3,
                                                **knobs_applied(r)))
    # an "auto" resolved from a flag the user gave is a note, not a missing value
    o2 = apply_imports(RunOptions(model="llama-3.1-8b", gpus=8, micro_batch=2, deepspeed_config=path))
    assert not any("train_micro_batch_size_per_gpu" in n for n in o2.import_report.needs_value)
    assert o2.micro_batch == 2


def test_deepspeed_fp16_param_offload_nvme_and_legacy_keys(ds_file):
    cfg = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}},
           "data_types": {"grad_accum_dtype": "fp32"},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    run = build_run(RunOptions(model="llama-3.2-1b", gpus=4, deepspeed_config=ds_file(cfg)))
    assert run == build_run(RunOptions(model="llama-3.2-1b", gpus=4, profile="deepspeed", micro_batch=2,
                                       precision="fp16", zero=3, offload="params", grad_dtype="fp32",
                                       optimizer="sgd-momentum"))
    # no fp16/bf16 section: DeepSpeed trains in fp32
    run32 = build_run(RunOptions(model="llama-3.2-1b", deepspeed_config=ds_file({"zero_optimization": {"stage": 1}},
                                                                                 "fp32.json")))
    assert run32.training.precision == "fp32" and run32.zero == 1


def test_deepspeed_inconsistent_batch_is_rejected_like_deepspeed(ds_file):
    path = ds_file(DS_ZERO3_OFFLOAD)
    code, out, err = cli("estimate", "-m", "llama-3.1-8b", "--gpus", "16", "--deepspeed-config", path)
    assert code == 2 and err.count("\n") == 1 and "train_batch_size 256" in err


# --- Megatron-LM ---------------------------------------------------------------------------------------------------

# Modelled on Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh (bash arrays of arguments, torchrun line);
# --vocab-size added because the example takes the vocabulary from the GPT-2 BPE files.
GPT3_SCRIPT = r"""#!/bin/bash
GPUS_PER_NODE=8
NUM_NODES=16
DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
)
GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto # Can use (flash/fused/unfused/local)
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --rampup-batch-size 16 16 5859375
    --train-iters 500000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 430000
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
)
DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
    --vocab-size 50257
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --save $CHECKPOINT_PATH
    --eval-iters 10
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
    --quantum-entangle 7
    --use-teleporter
)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
"""


def test_megatron_gpt3_script_is_the_equivalent_flags_and_the_gpt3_preset(tmp_path):
    p = tmp_path / "train_gpt3_175b_distributed.sh"
    p.write_text(GPT3_SCRIPT)
    imported = build_run(RunOptions(megatron_args=str(p)))
    # Megatron defaults when a flag is absent (arguments.py): fp32 unless --fp16/--bf16 (here fp16), no SP, no
    # distributed optimizer, LayerNorm, GELU with ffn 4*hidden, biases, learned positions, tied embeddings, dropout 0.1
    explicit = build_run(RunOptions(
        profile="megatron", layers=96, hidden=12288, heads=96, kv_heads=96, ffn=4 * 12288, vocab=50257, mlp="gelu",
        norm="layernorm", positions="learned", max_positions=2048, bias=True, tied_embeddings=True, seq=2048,
        micro_batch=1, global_batch=1536, tp=8, pp=16, sp=False, zero=0, precision="fp16", dropout=0.1,
        recompute="none", gpus=8 * 16, overlap_grad_reduce=False, overlap_param_gather=False))
    assert imported == explicit
    # the custom model from the dims is GPT-3 175B exactly (Brown et al. 2020 Table 2.1 shape; presets/models)
    preset = build_run(RunOptions(model="gpt3-175b")).model
    assert total_params(imported.model) == total_params(preset)


def test_megatron_unknown_and_irrelevant_flags_are_all_reported(tmp_path):
    p = tmp_path / "train.sh"
    p.write_text(GPT3_SCRIPT)
    r = apply_imports(RunOptions(megatron_args=str(p))).import_report
    assert unknown_keys(r) == {"--quantum-entangle", "--use-teleporter"}
    irrelevant = {i.key for i in r.ignored if i.reason == "no effect on memory or step time"}
    assert {"--train-iters", "--lr", "--data-path", "--vocab-file", "--split", "--save", "--log-interval",
            "--rampup-batch-size", "--tensorboard-dir", "--clip-grad"} <= irrelevant
    assert r.recorded["--attention-backend"] == "auto"
    assert any("torchrun" in n for n in r.notes)


# Modelled on Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh (Llama-3 8B shape flags) with a 3D layout.
LLAMA3_ARGS = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --kv-channels 128 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --rotary-base 500000 --disable-bias-linear --untie-embeddings-and-output-weights "
    "--vocab-size 128256 --seq-length 8192 --max-position-embeddings 8192 --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --bf16 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    "--num-layers-per-virtual-pipeline-stage 4 --sequence-parallel --context-parallel-size 2 "
    "--use-distributed-optimizer --overlap-grad-reduce --recompute-granularity full --recompute-method block "
    "--recompute-num-layers 2 --micro-batch-size 1 --global-batch-size 128 --lr 3e-4"
)


def test_megatron_llama3_string_is_the_equivalent_flags_and_llama_3_1_8b():
    imported = build_run(RunOptions(megatron_args=LLAMA3_ARGS, gpus=64))
    explicit = build_run(RunOptions(
        profile="megatron", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, mlp="swiglu",
        norm="rmsnorm", positions="rotary", max_positions=8192, bias=False, tied_embeddings=False, seq=8192,
        dropout=0.0, precision="bf16", tp=2, pp=2, vpp=4, sp=True, cp=2, zero=1, recompute="full",
        recompute_layers=2, micro_batch=1, global_batch=128, gpus=64, overlap_grad_reduce=True,
        overlap_param_gather=False))
    assert imported == explicit
    assert imported.vpp == 32 // 2 // 4 and imported.schedule == "interleaved"
    # the dims are Llama-3.1-8B's: exact parameter count 8,030,261,248 (presets/models/llama-3.1-8b.toml)
    assert total_params(imported.model) == 8_030_261_248
    r = apply_imports(RunOptions(megatron_args=LLAMA3_ARGS, gpus=64)).import_report
    assert unknown_keys(r) == set()
    # Megatron's default for both overlap flags is off: the line's --overlap-grad-reduce turns one on
    assert (imported.training.overlap_grad_reduce, imported.training.overlap_param_gather) == (True, False)


def test_megatron_cp_exchange_and_fused_cross_entropy_are_imported():
    """--cp-comm-type a2a and TE's fused cross-entropy (--cross-entropy-loss-fusion --cross-entropy-fusion-impl te:
    the flags behind SimuMax's `_cef` CP rows) become --cp-comm a2a and --loss fused; Megatron's own fused
    cross-entropy (impl native, the default) keeps the fp32 softmax: --loss full, said in a note; a CP exchange
    memcalc does not model (allgather, a2a+p2p) is modelled as p2p, also said."""
    te = build_run(RunOptions(megatron_args=LLAMA3_ARGS + " --cp-comm-type a2a --cross-entropy-loss-fusion "
                              "--cross-entropy-fusion-impl te", gpus=64))
    assert te.cp_comm == "a2a" and te.training.loss == "fused"
    o = apply_imports(RunOptions(megatron_args=LLAMA3_ARGS + " --cp-comm-type allgather --cross-entropy-loss-fusion",
                                 gpus=64))
    run = build_run(o)
    assert run.cp_comm == "p2p" and run.training.loss == "full"
    notes = " ".join(o.import_report.notes)
    assert "--cp-comm-type allgather: modelled as p2p" in notes and "impl native" in notes
    assert unknown_keys(o.import_report) == set()


@pytest.mark.parametrize("modules,recompute,note", [
    ("core_attn", "selective", None),
    ("core_attn mlp moe_act", "selective", "mlp moe_act recompute is not modelled"),
    ("moe_act", "none", "the attention core is not recomputed"),
])
def test_megatron_recompute_modules(modules, recompute, note):
    """--recompute-modules takes a list (argparse nargs='*'; default core_attn): its words are read as one flag's
    value, not skipped as stray words. core_attn is memcalc's --recompute selective; the other modules are not
    modelled, which a note says (their activations are counted: an over-estimate)."""
    o = apply_imports(RunOptions(megatron_args=LLAMA3_ARGS + " --recompute-granularity selective "
                                 f"--recompute-modules {modules} --use-distributed-optimizer", gpus=64))
    assert build_run(o).training.recompute == recompute
    notes = " ".join(o.import_report.notes)
    assert "not --arguments" not in notes and unknown_keys(o.import_report) == set()
    assert (note in notes) if note else "--recompute-modules" not in notes


def test_megatron_with_model_keeps_the_preset_shape():
    o = apply_imports(RunOptions(megatron_args=LLAMA3_ARGS, gpus=64, model="llama-3.1-8b"))
    run = build_run(o)
    assert run.model.name == "llama-3.1-8b"  # no "+overrides": the shape flags were not applied over --model
    assert {x.field for x in o.import_report.overridden} >= {"layers", "hidden", "vocab"}


def test_megatron_ffn_default_with_swiglu():
    o = apply_imports(RunOptions(megatron_args="--num-layers 2 --hidden-size 1000 --num-attention-heads 10 "
                                               "--swiglu --vocab-size 1000"))
    assert o.ffn == int((4 * 1000 * 2 / 3) / 64) * 64 == 2624


# --- torchtitan ----------------------------------------------------------------------------------------------------

# torchtitan/models/llama3/train_configs/llama3_8b.toml as shipped ("a preset for 64 A100 GPUs"), plus two unknown
# keys.
TT_LLAMA3_8B = """
[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "8B"
tokenizer_path = "./assets/tokenizer/original/tokenizer.model"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200  # lr scheduler warm up

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 1000
compile = false
dataset = "c4"
turbo = true

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable_checkpoint = false
folder = "checkpoint"
interval = 500
model_weights_only = false
export_dtype = "float32"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[warp_drive]
engage = true
"""


def test_torchtitan_llama3_8b_toml_is_the_equivalent_flags(tmp_path):
    p = tmp_path / "llama3_8b.toml"
    p.write_text(TT_LLAMA3_8B)
    imported = build_run(RunOptions(torchtitan_config=str(p), gpus=64))
    explicit = build_run(RunOptions(model="llama-3.1-8b", profile="torch", gpus=64, zero=3, micro_batch=1,
                                    grad_accum=1, seq=8192, recompute="op", optimizer="adamw",
                                    precision="bf16", optimizer_impl="fused", allocator="expandable"))
    assert imported == explicit  # torchtitan's launcher sets expandable_segments:True
    r = apply_imports(RunOptions(torchtitan_config=str(p), gpus=64)).import_report
    assert unknown_keys(r) == {"training.turbo", "[warp_drive]"}
    assert {"[job]", "[profiling]", "[metrics]", "[checkpoint]", "[lr_scheduler]", "optimizer.lr",
            "training.steps"} <= {i.key for i in r.ignored}
    assert r.recorded["float8.filter_fqns"] == ["output"]


def test_torchtitan_optimizer_implementation(tmp_path):
    p = tmp_path / "llama3_8b.toml"
    for impl in ("for-loop", "foreach", "fused"):
        p.write_text(TT_LLAMA3_8B.replace('name = "AdamW"', f'name = "AdamW"\nimplementation = "{impl}"'))
        assert build_run(RunOptions(torchtitan_config=str(p), gpus=64)).recipe.optimizer_impl == impl
    # a --foreach / --no-foreach typed by the user wins over the file's implementation
    r = build_run(apply_imports(RunOptions(torchtitan_config=str(p), gpus=64, foreach=True), {"foreach", "gpus"}))
    assert r.recipe.optimizer_impl == "foreach"
    p.write_text(TT_LLAMA3_8B.replace('name = "AdamW"', 'name = "AdamW"\nimplementation = "apex"'))
    with pytest.raises(InputError, match="implementation = 'apex'; valid: for-loop, foreach, fused"):
        build_run(RunOptions(torchtitan_config=str(p), gpus=64))


def test_torchtitan_shard_minus_one_without_gpus_assumes_a_node(tmp_path):
    p = tmp_path / "llama3_8b.toml"
    p.write_text(TT_LLAMA3_8B)
    o = apply_imports(RunOptions(torchtitan_config=str(p)))
    assert o.gpus == 8 and any("--gpus" in n for n in o.import_report.needs_value)


# torchtitan llama3_70b.toml with 8-way TP, plus PP with an interleaved schedule and layer-wise AC every K-th layer
TT_70B_LAYER_AC = """
[model]
name = "llama3"
flavor = "70B"
[training]
local_batch_size = 8
global_batch_size = 64
seq_len = 8192
[parallelism]
data_parallel_shard_degree = 2
tensor_parallel_degree = 8
pipeline_parallel_degree = 4
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_microbatch_size = 2
pipeline_parallel_layers_per_stage = 10
enable_async_tensor_parallel = true
[activation_checkpoint]
mode = "selective"
selective_ac_option = "{k}"
"""


def test_torchtitan_70b_tp_pp_and_layer_ac(tmp_path):
    toml = TT_70B_LAYER_AC.format(k=2)
    p = tmp_path / "llama3_70b.toml"
    p.write_text(toml)
    imported = build_run(RunOptions(torchtitan_config=str(p)))
    # 80 layers / 10 per stage = 8 stages over pp 4 -> vpp 2; every 2nd layer of a rank checkpointed (chunks of 10);
    # FSDP with pp > 1 and the "default" reshard policy keeps params unsharded after forward -> ZeRO-2-like
    explicit = build_run(RunOptions(model="llama-3.1-70b", gpus=2 * 8 * 4, tp=8, pp=4, vpp=2, schedule="interleaved",
                                    sp=True, tp_overlap=True, zero=2, micro_batch=2, global_batch=64, seq=8192,
                                    recompute="full", recompute_every=2, optimizer="adamw", optimizer_impl="fused",
                                    allocator="expandable"))
    assert imported == explicit


def test_torchtitan_layer_ac_over_chunks_of_another_size(tmp_path):
    """selective_ac_option = 3 over interleaved chunks of 10 layers: torchtitan's count runs over a rank's chunks, so
    the chunks' patterns differ, which --recompute-every does not model; the importer falls back to the block
    method's count per chunk (10 // 3 = 3 layers) and says so."""
    toml = TT_70B_LAYER_AC.format(k=3)
    p = tmp_path / "llama3_70b.toml"
    p.write_text(toml)
    o = apply_imports(RunOptions(torchtitan_config=str(p)))
    assert o.recompute == "full" and o.recompute_layers == 3 and o.recompute_every is None
    assert any("approximated by the first 3" in n for n in o.import_report.notes)
    # pp 4 without interleaving (20 layers a stage): every 3rd layer, as torchtitan places them
    p.write_text(toml.replace('pipeline_parallel_schedule = "Interleaved1F1B"', 'pipeline_parallel_schedule = "1F1B"')
                 .replace("pipeline_parallel_layers_per_stage = 10\n", ""))
    o = apply_imports(RunOptions(torchtitan_config=str(p)))
    assert o.recompute_every == 3 and o.recompute_layers is None and o.vpp == 1


# --- errors --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,content,needle", [
    ("--deepspeed-config", None, "no such file"),
    ("--deepspeed-config", "{ not json", "not valid JSON"),
    ("--deepspeed-config", "[1, 2]", "not a DeepSpeed config object"),
    ("--deepspeed-config", '{"zero_optimization": {"stage": 5}}', "zero_optimization.stage"),
    ("--deepspeed-config", '{"fp16": {"enabled": true}, "bf16": {"enabled": true}}', "both enabled"),
    ("--torchtitan-config", None, "no such file"),
    ("--torchtitan-config", "[model\nname = ", "not valid TOML"),
    ("--torchtitan-config", '[model]\nname = "llama3"\nflavor = "debugmodel"', "no memcalc preset"),
    ("--torchtitan-config", '[activation_checkpoint]\nmode = "sometimes"', "mode"),
    ("--megatron-args", None, "no such file"),
    ("--megatron-args", "--group-query-attention --num-layers 2", "--num-query-groups"),
    ("--megatron-args", "--recompute-granularity partial", "--recompute-granularity"),
])
def test_bad_import_inputs_are_one_line_exit_2(tmp_path, kind, content, needle):
    p = tmp_path / "cfg"
    if content is not None:
        p.write_text(content)
    model = [] if kind == "--torchtitan-config" else ["-m", "llama-3.2-1b"]
    code, out, err = cli("estimate", *model, kind, str(p) if content is not None else str(tmp_path / "nope"))
    assert code == 2, (out, err)
    assert err.startswith("memcalc: error:") and err.count("\n") == 1 and needle in err, err
    assert "Traceback" not in err


def test_megatron_string_that_is_neither_file_nor_args():
    code, out, err = cli("estimate", "--megatron-args", "tensor-model-parallel-size 2")
    assert code == 2 and "no such file" in err and err.count("\n") == 1


def test_two_imports_at_once_is_an_error(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text("{}")
    with pytest.raises(InputError, match="give one of"):
        apply_imports(RunOptions(deepspeed_config=str(p), megatron_args="--bf16"))


def test_import_flags_are_in_run_options_for_plan_and_validate():
    from memcalc.cli import RUN_OPTIONS

    assert {"deepspeed_config", "megatron_args", "torchtitan_config"} <= set(RUN_OPTIONS)


def test_table_shows_the_import_and_ignored_keys(ds_file):
    path = ds_file(DS_ZERO3_OFFLOAD)
    code, out, err = cli("estimate", "-m", "llama-3.1-8b", "--gpus", "8", "--deepspeed-config", path)
    assert code == 0, err
    flat = " ".join(out.split())
    # (rich may wrap the path anywhere, a long temporary directory inside it: compare without whitespace)
    assert "".join(f"imported from {path} (deepspeed)".split()) in "".join(out.split())
    assert "ignored (unknown to memcalc): zero_optimization.flux_capacitor, frobnicate" in flat
    assert ("zero_optimization.reduce_bucket_size=500000000" in flat  # recorded, not modelled yet
            or "--reduce-bucket-size 500000000" in flat)  # once RunOptions has the field


# DeepSeek-V3's shape as Megatron-LM spells it: the model arguments of Megatron-LM
# examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-R1.sh (the V3 architecture), with a training layout and
# --vocab-size 129280 (HF deepseek-ai/DeepSeek-V3 config.json vocab_size; that script reads it from the tokenizer)
DSV3_ARGS = (
    "--bf16 --disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope "
    "--normalization RMSNorm --swiglu --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 "
    "--num-attention-heads 128 --kv-channels 128 --multi-latent-attention --kv-lora-rank 512 --v-head-dim 128 "
    "--q-lora-rank 1536 --qk-head-dim 128 --qk-layernorm --qk-pos-emb-head-dim 64 --num-experts 256 "
    "--moe-layer-freq [0]*3+[1]*58 --moe-ffn-hidden-size 2048 --moe-router-dtype fp32 "
    "--moe-router-score-function sigmoid --moe-router-topk 8 --moe-router-num-groups 8 --moe-router-group-topk 4 "
    "--moe-shared-expert-overlap --moe-shared-expert-intermediate-size 2048 --moe-aux-loss-coeff 1e-4 "
    "--moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall --seq-length 4096 "
    "--max-position-embeddings 163840 --vocab-size 129280 --micro-batch-size 1 "
    "--pipeline-model-parallel-size 8 --expert-model-parallel-size 32 --use-distributed-optimizer"
)


def test_megatron_deepseek_v3_arguments_are_the_deepseek_v3_preset():
    run = build_run(RunOptions(megatron_args=DSV3_ARGS, gpus=256))
    preset = build_run(RunOptions(model="deepseek-v3")).model
    m = run.model
    # the shape: every architectural field of the preset (HF config.json of deepseek-ai/DeepSeek-V3), read from
    # the Megatron spelling: --moe-layer-freq [0]*3+[1]*58 = first_k_dense_replace 3; the shared expert's 2048 =
    # one expert of --moe-ffn-hidden-size; the MLA widths qk_head_dim 128 (nope) + qk_pos_emb_head_dim 64 (rope)
    for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "mlp", "norm", "qkv_bias",
              "linear_bias", "tied_embeddings", "positions", "moe", "mla"):
        assert getattr(m, f) == getattr(preset, f), f
    assert m.moe.first_dense_layers == 3 and m.moe.shared_experts == 1 and m.mla.q_lora_rank == 1536
    assert total_params(m) == total_params(preset) == 671_026_404_352  # DeepSeek-V3 paper: 671B
    assert (run.pp, run.ep, run.dp, run.zero, run.profile) == (8, 32, 32, 1, "megatron")
    r = run_report = apply_imports(RunOptions(megatron_args=DSV3_ARGS, gpus=256)).import_report
    routing = {i.key for i in r.ignored if i.reason.startswith("routing choice")}
    assert routing == {"--moe-router-dtype", "--moe-router-score-function", "--moe-router-num-groups",
                       "--moe-router-group-topk", "--moe-shared-expert-overlap", "--moe-aux-loss-coeff",
                       "--moe-router-load-balancing-type"}
    # read, not ignored: the dispatcher (alltoall, the one modelled), --qk-layernorm (MLA's latent norms), and
    # --kv-channels (not an MLA width: noted)
    keys = {i.key for i in run_report.ignored}
    assert not keys & {"--moe-token-dispatcher-type", "--qk-layernorm", "--kv-channels", "--num-experts"}
    assert any("--kv-channels is not used by multi-latent attention" in n for n in r.notes)


def test_megatron_moe_and_mla_defaults():
    # Megatron-LM arguments.py defaults: --moe-router-topk 2, --moe-ffn-hidden-size = --ffn-hidden-size, the
    # allgather dispatcher; MLA: kv_lora_rank 32, qk_head_dim 128, qk_pos_emb_head_dim 64, v_head_dim 128, no q latent
    args = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --ffn-hidden-size 2816 --swiglu "
            "--vocab-size 32000 --num-experts 8 --multi-latent-attention --disable-bias-linear")
    r = apply_imports(RunOptions(megatron_args=args))
    m = build_run(r).model
    assert (m.moe.experts, m.moe.top_k, m.moe.expert_ffn, m.moe.shared_experts, m.moe.first_dense_layers) == (
        8, 2, 2816, 0, 0)
    assert (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_nope_dim, m.mla.qk_rope_dim, m.mla.v_head_dim) == (
        0, 32, 128, 64, 128)
    assert m.head_dim == 192 and m.kv_heads == 8
    notes = " | ".join(r.import_report.notes)
    for said in ("Megatron's default 2", "the --ffn-hidden-size 2816", "--moe-token-dispatcher-type allgather "
                 "(Megatron's default)", "without --kv-lora-rank: Megatron's default 32"):
        assert said in notes


@pytest.mark.parametrize("freq,dense", [("1", 0), ("([0]*1+[1]*3)", 1), ("[0]*3+[1]", 3), ("'([0]+[1]*3)'", 1)])
def test_megatron_moe_layer_freq_dense_first(freq, dense):
    args = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 1024 --vocab-size 1000 "
            f"--num-experts 4 --moe-router-topk 1 --moe-layer-freq {freq}")
    assert build_run(RunOptions(megatron_args=args)).model.moe.first_dense_layers == dense


@pytest.mark.parametrize("extra,names", [
    ("--moe-layer-freq 2", "one MoE layer every 2 is not modelled"),
    ("--moe-layer-freq ([1]*3+[0]*1)", "only the first layers may be dense"),
    ("--moe-layer-freq [0]*3+[1]*3", "gives 6 layers, --num-layers is 4"),
    ("--moe-layer-freq __import__('os')", "is not a list of 0 (dense) and 1 (MoE)"),
    ("--moe-layer-freq [1]*99999999", "is not a list of 0 (dense) and 1 (MoE)"),
    ("--moe-shared-expert-intermediate-size 1500", "not a multiple of the expert width 1024"),
    ("--multi-latent-attention", "add --disable-bias-linear"),
])
def test_megatron_moe_arguments_memcalc_cannot_model_are_refused(extra, names):
    args = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 1024 --vocab-size 1000 "
            f"--num-experts 4 --moe-router-topk 1 {extra}")
    code, out, err = cli("estimate", "--megatron-args", args)
    assert code == 2 and names in err and len(err.strip().splitlines()) == 1, err


def test_megatron_kv_channels_sets_the_head_width():
    # --kv-channels 128 with hidden 2048 and 32 heads (hidden/heads = 64): q and o are 2048 x (32 x 128), k and v
    # 2048 x (8 x 128) per layer; the rest as without it
    base = "--num-layers 2 --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 8 " \
           "--ffn-hidden-size 5632 --swiglu --vocab-size 32000 --disable-bias-linear --normalization RMSNorm"
    wide = build_run(RunOptions(megatron_args=base + " --kv-channels 128")).model
    narrow = build_run(RunOptions(megatron_args=base)).model
    assert wide.head_dim == 128 and narrow.head_dim == 64
    per_layer = 2 * 2048 * (32 * 128 - 32 * 64) + 2 * 2048 * (8 * 128 - 8 * 64)
    assert total_params(wide) - total_params(narrow) == 2 * per_layer


def test_megatron_moe_flags_on_a_dense_model_are_reported_not_applied():
    r = apply_imports(RunOptions(megatron_args="--num-layers 2 --hidden-size 512 --num-attention-heads 8 "
                                               "--vocab-size 1000 --moe-router-topk 4")).import_report
    assert any(i.key == "--moe-router-topk" and "no --num-experts" in i.reason for i in r.ignored)
    assert "top_k" not in r.applied
