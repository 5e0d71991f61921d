"""Fine-tuning and the classic systems (issue 7): LoRA, QLoRA, frozen parts, parameter server, PipeDream, batch
guidance. Hand-computed cases with the arithmetic in the test."""

from __future__ import annotations

import math

import pytest

from memcalc.cost.estimate import estimate
from memcalc.cost.params import lora_layer_params, stage_param_split
from memcalc.cost.states import model_states
from tests.conftest import cli, cli_json, run_of

N_7B = 6_738_415_616


def test_llama2_7b_lora_r8_attention_trainable_count():
    # 4 projections (q, k, v, o) x 32 layers x (4096 x 8 for A + 8 x 4096 for B) = 8,388,608
    r = run_of(model="llama-2-7b", lora_rank=8)
    assert stage_param_split(r, 0).trainable == 4 * 32 * (4096 * 8 + 8 * 4096) == 8_388_608
    assert model_states(r).trainable_params == 8_388_608


def test_lora_targets_mlp_and_all():
    m = run_of(model="llama-2-7b").model
    h, f, r = 4096, 11008, 16
    mlp = 2 * (h * r + r * f) + (f * r + r * h)  # gate, up: h->f ; down: f->h
    assert lora_layer_params(m, "mlp", r) == mlp
    assert lora_layer_params(m, "all", r) == mlp + 4 * (h * r + r * h)


@pytest.mark.parametrize("given,canonical", [
    ("q,v", "qv"), ("Q, V ,", "qv"), ("q_proj,k_proj,v_proj,o_proj", "attn"), ("w1,w2,w3", "mlp"),
    ("attn,mlp", "all"), ("o,q,v,mlp", "q,v,o,gate,up,down"), ("output_proj,down_proj", "o,down"),
])
def test_lora_targets_lists_read_as_projections(given, canonical):
    # a comma list of projections (or named sets; PEFT and torchtune module names read as the projection they
    # name: torchtune's w1/w3/w2 are gate/up/down) is stored as its named set where it is one, else in layer order
    assert run_of(model="llama-2-7b", lora_rank=8, lora_targets=given).training.lora_targets == canonical


def test_torchtune_llama32_3b_lora_config_trainable_count():
    # torchtune llama3_2/3B_lora_single_device.yaml: lora_attn_modules [q_proj, v_proj, output_proj] and
    # apply_lora_to_mlp, r=64; Llama-3.2-3B: h 3072, 8 K/V heads x 128 = 1024, ffn 8192, 28 layers.
    # per layer, r x (in + out) each: q 64 x 6144 = 393,216; v 64 x 4096 = 262,144; o 393,216;
    # gate, up, down 64 x 11264 = 720,896 each -> 3,211,264; x 28 = 89,915,392
    r = run_of(model="llama-3.2-3b", lora_rank=64, lora_targets="q,v,o,mlp")
    assert model_states(r).trainable_params == 28 * (2 * 393_216 + 262_144 + 3 * 720_896) == 89_915_392
    # a list is the sum of its parts
    m = r.model
    assert lora_layer_params(m, "q,v,o,mlp", 64) == (lora_layer_params(m, "qv", 64) + lora_layer_params(m, "o", 64)
                                                      + lora_layer_params(m, "mlp", 64))


def test_lora_partial_mlp_targets_save_only_what_an_adapter_reads():
    from memcalc.cost.activations import layer_terms

    tok, h, f, r, c = 2048, 4096, 11008, 8, 2
    # up adapted, gate and down frozen: the up adapter's A reads the MLP's input (saved, tok x h); nothing reads
    # the down projection's input for a weight gradient (not saved); one low-rank intermediate (tok x r)
    up = layer_terms(run_of(model="llama-2-7b", seq=2048, lora_rank=8, lora_targets="q,up"))
    assert up["mlp_input"] == c * tok * h and up["mlp_act_output"] == 0
    assert up["lora_mlp_low_rank"] == c * tok * r
    # down adapted with dropout 0.1: the MLP's input unsaved; the down adapter saves its dropped copy of the
    # down input (tok x f, bf16) and the bool mask (tok x f), not the undropped input
    down = layer_terms(run_of(model="llama-2-7b", seq=2048, lora_rank=8, lora_targets="down", lora_dropout=0.1))
    assert down["mlp_input"] == 0 and down["mlp_act_output"] == 0
    assert down["lora_dropout_mlp"] == c * tok * f and down["lora_dropout_mlp_mask"] == tok * f
    assert down["lora_mlp_low_rank"] == c * tok * r and "lora_attn_low_rank" not in down


def test_lora_with_tp_splits_the_sharded_side():
    m = run_of(model="llama-2-7b").model
    h, r = 4096, 8
    # q,k,v: A (h x r) replicated, B (r x h/t) split; o: A (h/t x r) split, B (r x h) replicated
    assert lora_layer_params(m, "attn", r, tp=4) == 3 * h * r + r * 3 * h // 4 + h * r // 4 + r * h


def test_frozen_base_has_no_grads_or_optimizer_state():
    s = model_states(run_of(model="llama-2-7b", lora_rank=8, precision="bf16"))
    n_lora = 8_388_608
    # torch AMP recipe on the adapters: fp32 params (master) + fp32 grads + 2 fp32 Adam moments
    assert s.grads == 4 * n_lora
    assert s.optimizer == 8 * n_lora
    assert s.master_weights == 0
    # the frozen base is stored in the compute dtype (bf16): 2 bytes per base parameter
    assert s.frozen_params_bytes == 2 * N_7B
    assert s.params == 2 * N_7B + 4 * n_lora


def test_qlora_nf4_about_half_a_byte_per_weight_plus_scales():
    r = run_of(model="llama-2-7b", lora_rank=64, base_dtype="nf4")
    split = stage_param_split(r, 0)
    lin = split.frozen_linear  # the layers' linear weights: 32 x (4*4096^2 + 3*4096*11008)
    assert lin == 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) == 6_476_005_376
    s = model_states(r)
    # nf4: 4 bits per weight; double quantization: 1 byte absmax per 64 weights + fp32 per 256 blocks
    nf4 = lin // 2 + lin // 64 + 4 * math.ceil(lin / (64 * 256))
    other = 2 * (N_7B - lin)  # embeddings, head, norms in bf16
    assert s.frozen_params_bytes == nf4 + other
    bits_per_param = (nf4 - lin // 2) * 8 / lin
    assert bits_per_param == pytest.approx(0.127, abs=0.001)  # QLoRA paper sec. 2: 0.127 bits per parameter
    no_dq = model_states(run_of(model="llama-2-7b", lora_rank=64, base_dtype="nf4", double_quant=False))
    assert no_dq.frozen_params_bytes - other == lin // 2 + 4 * (lin // 64)  # 0.5 bits per parameter of scales


def test_int8_base_row_scales():
    r = run_of(model="llama-2-7b", lora_rank=8, base_dtype="int8")
    split = stage_param_split(r, 0)
    rows = 32 * (4096 * 4 + 11008 * 2 + 4096)  # output rows: q,k,v,o = 4096 each; gate/up 11008; down 4096
    assert split.frozen_linear_rows == rows
    assert model_states(r).frozen_params_bytes == split.frozen_linear + 4 * rows + 2 * split.frozen_other


def test_zero3_shards_frozen_weights_zero2_does_not():
    z2 = model_states(run_of(model="llama-2-7b", lora_rank=8, zero=2, gpus=8))
    z3 = model_states(run_of(model="llama-2-7b", lora_rank=8, zero=3, gpus=8))
    assert z2.frozen_params_bytes == 2 * N_7B
    assert z3.frozen_params_bytes == math.ceil(2 * N_7B / 8)


def test_freeze_embeddings_and_first_layers():
    full = model_states(run_of(model="llama-2-7b", precision="fp32"))
    part = model_states(run_of(model="llama-2-7b", precision="fp32", freeze="embeddings,layers:16"))
    layer = 202_383_360  # 4*4096^2 + 3*4096*11008 + 2*4096
    frozen = 32000 * 4096 + 16 * layer
    assert part.trainable_params == N_7B - frozen
    # fp32 frozen weights keep their 4 bytes, but lose 4 (grad) + 8 (Adam) bytes each
    assert full.total - part.total == 12 * frozen


def test_freeze_is_per_pipeline_stage():
    r = run_of(model="llama-2-7b", precision="fp32", freeze="layers:12", pp=4, gpus=4)
    # 8 layers per stage: stage 0 freezes 8, stage 1 freezes 4, stages 2-3 none
    layer = 202_383_360
    frozen = [stage_param_split(r, s).frozen for s in range(4)]
    assert frozen == [8 * layer, 4 * layer, 0, 0]


def test_parameter_server_workers_hold_no_optimizer():
    r = run_of(model="gpt2-xl", precision="fp32", dp_mode="ps", gpus=8)
    s = model_states(r)
    n = 1_557_611_200
    assert (s.params, s.grads, s.optimizer, s.master_weights) == (4 * n, 4 * n, 0, 0)
    assert s.ps_server == 4 * n + 4 * n + 8 * n  # full params, accumulated grads, Adam


def test_pipedream_weight_stashing_versions():
    base = model_states(run_of(model="llama-2-7b", pp=4, gpus=4, precision="fp32"), 0).params
    pd = run_of(model="llama-2-7b", pp=4, gpus=4, precision="fp32", schedule="pipedream")
    two = run_of(model="llama-2-7b", pp=4, gpus=4, precision="fp32", schedule="pipedream-2bw")
    assert model_states(pd, 0).params == 4 * base  # pp - 0 = 4 versions on the first stage
    assert model_states(pd, 3).params == model_states(run_of(model="llama-2-7b", pp=4, gpus=4, precision="fp32"),
                                                      3).params  # 1 version on the last
    assert model_states(two, 0).params == 2 * base


def test_batch_guidance_linear_and_sqrt():
    d = cli_json("estimate", "--model", "llama-2-7b", "--gpus", "8", "--micro-batch", "2", "--global-batch", "512",
                 "--base-lr", "3e-4", "--base-batch", "128", "--base-warmup-steps", "2000", "--optimizer", "sgd")
    b = d["batch"]
    assert b["global_batch"] == 512 and b["grad_accum"] == 512 // (2 * 8) == 32
    assert b["tokens_per_step"] == 512 * 4096
    assert b["lr_linear"] == pytest.approx(3e-4 * 4)
    assert b["lr_sqrt"] == pytest.approx(3e-4 * 2)
    assert b["recommended_rule"] == "linear"  # SGD: Goyal et al.; Adam: square root
    assert b["warmup_steps"] == 500  # same samples: 2000 x 128 / 512


@pytest.mark.parametrize("args,needle", [
    (["--base-dtype", "nf4"], "--lora-rank"),
    (["--freeze", "layers:99"], "--freeze"),
    (["--freeze", "lm"], "--freeze"),
    (["--lora-rank", "0"], "--lora-rank"),
    (["--lora-targets", "ffn"], "--lora-targets"),
    (["--lora-rank", "8", "--lora-targets", "q,banana"], "--lora-targets"),
    (["--lora-rank", "8", "--lora-targets", ","], "--lora-targets"),
    (["--dp-mode", "ps", "--tp", "2", "--gpus", "2"], "--dp-mode"),
    (["--base-lr", "1e-4"], "--base-batch"),
    (["--schedule", "pipedream"], "--pp"),
    (["--quantize-head"], "--quantize-head"),
    (["--quantize-head", "--lora-rank", "8", "--base-dtype", "bf16"], "--quantize-head"),
])
def test_finetune_bad_input(args, needle):
    code, _, err = cli("estimate", "--model", "llama-2-7b", *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_lora_fits_on_24gb_with_bf16_base():
    est = estimate(run_of(model="llama-2-7b", lora_rank=8, gpu="rtx-4090", seq=512, recompute="full"))
    assert est.memory.fits


def test_lora_activations_drop_frozen_linear_inputs_and_add_low_rank():
    from memcalc.cost.activations import layer_terms

    # bf16 weights for both (the LoRA base is stored in bf16; AMP over fp32 weights would add fp32 norm inputs
    # and per-projection input casts, activations._autocast)
    full = layer_terms(run_of(model="llama-2-7b", seq=2048, master_weights=False))
    lora = layer_terms(run_of(model="llama-2-7b", seq=2048, lora_rank=8))
    tok, h, f, r, c = 2048, 4096, 11008, 8, 2
    # attention targeted: q/k/v/o adapters each save x A (tok x r); the MLP is frozen, so neither the gate/up
    # input (tok x h) nor the down input (tok x f) is saved for a weight gradient
    assert lora["lora_attn_low_rank"] == 4 * c * tok * r
    assert full["mlp_input"] == c * tok * h and lora["mlp_input"] == 0
    assert full["mlp_act_output"] == c * tok * f and lora["mlp_act_output"] == 0
    assert sum(full.values()) - sum(lora.values()) == c * tok * h + c * tok * f - 4 * c * tok * r


def test_dataparallel_gpu0_holds_every_replicas_logits():
    # torch.nn.DataParallel gathers the outputs of all replicas on GPU 0 and computes the loss there
    from memcalc.cost.activations import last_stage_terms

    dp = run_of(model="gpt2", gpus=4, dp_mode="dataparallel", seq=1024)
    ddp = run_of(model="gpt2", gpus=4, seq=1024)
    tok, V = 1024, 50257
    assert last_stage_terms(dp)["dataparallel_gathered_logits"] == 4 * tok * V * 2  # 4 replicas, bf16
    assert last_stage_terms(dp)["loss_logits_fp32"] == 4 * last_stage_terms(ddp)["loss_logits_fp32"]
    assert estimate(dp).memory.peak_bytes > estimate(ddp).memory.peak_bytes


def test_bitsandbytes_quantized_linears_keep_their_inputs():
    """bitsandbytes MatMul4Bit saves its input A for backward (`ctx.tensors = (A, B)`) although the nf4 weight is
    frozen; torchao's linear_nf4 (torchtune) saves only the weight. Llama-2-7B, LoRA on attention, bf16, seq 1024:
    the frozen rule drops the MLP input (h = 4096) and the down projection's input (f = 11008); bnb keeps both:
    2 B x 1024 x (4096 + 11008) = 30,932,992 B more per layer."""
    from memcalc.cost.activations import layer_terms

    base = dict(model="llama-2-7b", precision="bf16", master_weights=False, seq=1024, lora_rank=8,
                base_dtype="nf4")
    bnb = layer_terms(run_of(**base, quant_backend="bnb"))
    ao = layer_terms(run_of(**base, quant_backend="torchao"))
    assert sum(bnb.values()) - sum(ao.values()) == 2 * 1024 * (4096 + 11008) == 30_932_992
    assert ao == layer_terms(run_of(**{**base, "base_dtype": "bf16"}))  # torchao: the frozen bf16 rule
    code, _, err = cli("estimate", "--model", "llama-2-7b", "--lora-rank", "8", "--base-dtype", "nf4",
                       "--quant-backend", "gptq")
    assert code == 2 and "--quant-backend" in err and "bnb" in err


def test_quantized_bases_dequantize_around_each_matmul():
    """An nf4 linear (bitsandbytes MatMul4Bit, torchao linear_nf4) dequantizes its weight into a compute-dtype
    copy for the forward and the backward matmul. Llama-2-7B, LoRA q,v, pure bf16, seq 1304 (lit-gpt's row):
    - the largest copy at a layer moment is the down projection's: 2 B x 4096 x 11008 = 90,177,536 B;
    - --quantize-head: the head's, 2 B x 32000 x 4096 = 262,144,000 B; its storage goes nf4 (double-quant):
      262,144,000 B bf16 -> 65,536,000 (4 bits) + 2,048,000 (8-bit absmax per 64) + 32,000 (fp32 per 16384),
      saving 194,528,000 B; a bitsandbytes head keeps its input: 2 B x 1304 x 4096 = 10,682,368 B;
    - the layer backward's transient: the residual gradient 10,682,368 + max(the SwiGLU factors' gradients
      2 x 2 x 1304 x 11008 = 57,417,728, the down projection's input gradient 28,708,864 + its copy 90,177,536)
      = 10,682,368 + 118,886,400 = 129,568,768 B; int8 (MatMul8bitLt) copies in backward only."""
    from memcalc.cost.activations import dequant_bytes, last_stage_terms, layer_backward_transient

    base = dict(model="llama-2-7b", precision="bf16", master_weights=False, seq=1304, lora_rank=8,
                lora_targets="qv", base_dtype="nf4")
    plain, head = run_of(**base), run_of(**base, quantize_head=True)
    assert dequant_bytes(plain) == (90_177_536, 90_177_536, 0, 0)
    assert dequant_bytes(head) == (90_177_536, 90_177_536, 262_144_000, 262_144_000)
    assert dequant_bytes(run_of(**{**base, "base_dtype": "int8"}, quantize_head=True)) == (
        0, 90_177_536, 0, 262_144_000)
    assert dequant_bytes(run_of(**{**base, "base_dtype": "bf16"})) == (0, 0, 0, 0)
    assert model_states(plain).params - model_states(head).params == 194_528_000
    assert last_stage_terms(head)["output_layer_input"] == 10_682_368
    assert last_stage_terms(run_of(**base, quantize_head=True, quant_backend="torchao"))["output_layer_input"] == 0
    assert layer_backward_transient(plain) == 129_568_768
    # a bf16 base copies nothing: the SwiGLU factors' gradients set the transient, beside the down projection's
    # input gradient, which nothing saved before it frees (the frozen down keeps no input): 3 x 28,708,864
    assert layer_backward_transient(run_of(**{**base, "base_dtype": "bf16"})) == 10_682_368 + 86_126_592
    data = cli_json("estimate", "--model", "llama-2-7b", "--precision", "bf16", "--no-master-weights", "--seq",
                    "1304", "--lora-rank", "8", "--lora-targets", "qv", "--base-dtype", "nf4", "--quantize-head")
    assert data["inputs"]["training"]["quantize_head"] is True
    assert data["memory"]["activations_detail"]["dequantized_weight_transient"] == 262_144_000


def test_frozen_head_saves_no_input():
    """Autograd keeps a matmul's input only for a weight that requires grad: `--freeze head` on an untied model
    drops the LM head's saved input, 2 B x 2048 tokens x 4096 = 16,777,216 B in bf16 (Korthikanti sec. 4.3: 2sbh).
    A tied head is the embedding: `--freeze head` alone leaves it training (params.stage_param_split), and
    `--freeze embeddings` freezes it."""
    from memcalc.cost.activations import last_stage_terms

    untied = dict(model="llama-2-7b", precision="bf16", seq=2048)
    assert last_stage_terms(run_of(**untied))["output_layer_input"] == 2 * 2048 * 4096
    assert last_stage_terms(run_of(freeze="head", **untied))["output_layer_input"] == 0
    tied = dict(model="gpt2", precision="bf16", seq=1024)
    assert last_stage_terms(run_of(freeze="head", **tied))["output_layer_input"] == 2 * 1024 * 768
    assert last_stage_terms(run_of(freeze="embeddings", **tied))["output_layer_input"] == 0


def test_lora_mlp_targets_on_moe_refused_in_one_line():
    code, _, err = cli("estimate", "--model", "mixtral-8x7b", "--lora-rank", "8", "--lora-targets", "q,v,o,mlp")
    assert code == 2 and "--lora-targets" in err and len(err.strip().splitlines()) == 1
    assert cli("estimate", "--model", "mixtral-8x7b", "--lora-rank", "8", "--lora-targets", "q_proj,o_proj",
               "--gpus", "8", "--zero", "3")[0] == 0
