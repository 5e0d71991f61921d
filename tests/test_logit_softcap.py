"""Gemma 2's softcapping, `tanh(x / cap) * cap`, measured and predicted.

- Final logits (`ModelSpec.final_logit_softcap`, `--logit-softcap`): the LM head's output passes `logits / cap`,
  `tanh`, `* cap` (modeling_gemma2.py Gemma2ForCausalLM.forward) before the loss. tanh saves its output, one more
  logit-sized tensor in the compute dtype, from the head to its backward, which runs after the loss's; the divide
  and the multiply each write a new tensor beside the previous one.
- Attention scores (`ModelSpec.attn_softcap`, `--attn-softcap`) under --attention eager (eager_attention_forward:
  between the scaling and the mask): one more compute-dtype score tensor per layer, c*a/t*tok*s.

The harness builds the same steps (memcalc/validate/model.py `Head.project`, `Attention._core`) and measures every
phase on the CPU: with softcapping on, prediction and measurement move by the same bytes, and the error stays the
plain model's to within 64 bytes."""

from __future__ import annotations

import pytest

from memcalc.options import RunOptions, build_run
from memcalc.cost.estimate import estimate
from tests.conftest import cli, cli_json
from tests.conftest import prediction_gap as _gap

SHAPE = dict(layers=2, hidden=64, heads=4, ffn=176, vocab=4096)


def test_gemma2_9b_softcap_term_by_hand():
    """Gemma-2-9B, FSDP2 ZeRO-3 over 8, full recompute, seq 4096, micro-batch 1, bf16 AMP: the tanh output is
    2 bytes x 4096 tokens x 256,000 logits = 2,097,152,000 B, saved on the last (only) stage; the backward peak is
    the loss gradient, where it is still live, so the allocated peak rises by exactly that."""
    args = ("estimate", "--model", "gemma-2-9b", "--gpus", "8", "--zero", "3", "--seq", "4096", "--recompute", "full")
    on, off = cli_json(*args), cli_json(*args, "--no-logit-softcap")
    assert on["inputs"]["model"]["final_logit_softcap"] and not off["inputs"]["model"]["final_logit_softcap"]
    assert on["memory"]["activations_detail"]["logit_softcap_tanh"] == 2 * 4096 * 256_000 == 2_097_152_000
    assert off["memory"]["activations_detail"]["logit_softcap_tanh"] == 0
    assert on["memory"]["peak_phase"] == off["memory"]["peak_phase"] == "backward"
    assert on["memory"]["allocated_peak_bytes"] - off["memory"]["allocated_peak_bytes"] == 2_097_152_000
    # the model states are untouched: softcapping has no parameters
    assert on["memory"]["model_states_detail"] == off["memory"]["model_states_detail"]


def test_softcap_tp_shard_and_fp32():
    """The tanh output is the head's output: a vocab shard under TP (Megatron-style padding not applied by the
    torch profile: 256,000 / 4 = 64,000 logits a token), and 4 bytes each in fp32 training."""
    run = build_run(RunOptions(model="gemma-2-2b", seq=2048, gpus=4, tp=4, sp=True, precision="fp32"))
    assert estimate(run).memory.activations_detail["logit_softcap_tanh"] == 4 * 2048 * 64_000


@pytest.mark.parametrize("args, why", [
    (("--loss", "chunked"), "--loss chunked"),
    (("--loss", "fused", "--profile", "megatron"), "--loss fused"),
    (("--profile", "megatron"), "--profile megatron"),
    (("--loss", "lit-gpt"), "--loss lit-gpt"),
])
def test_softcap_outside_the_modelled_loss_is_one_line_exit_2(args, why):
    code, out, err = cli("estimate", "--model", "gemma-2-9b", *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert why in err and "--no-logit-softcap" in err
    # and the user's explicit choice goes through, without the term
    code, _, err = cli("estimate", "--model", "gemma-2-9b", *args, "--no-logit-softcap")
    assert code in (0, 1), err


def test_hf_config_softcapping_field():
    """Gemma2Config's final_logit_softcapping defaults to 30.0 (a config.json that omits it gets it); null turns it
    off; Gemma 3 configs set it null; other models have none."""
    from memcalc.presets import model_from_hf_config

    g2 = {"model_type": "gemma2", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "vocab_size": 1024}
    assert model_from_hf_config(g2, "x").final_logit_softcap
    assert model_from_hf_config({**g2, "final_logit_softcapping": 30.0}, "x").final_logit_softcap
    assert not model_from_hf_config({**g2, "final_logit_softcapping": None}, "x").final_logit_softcap
    g3 = {**g2, "model_type": "gemma3_text", "final_logit_softcapping": None}
    assert not model_from_hf_config(g3, "x").final_logit_softcap
    llama = {**g2, "model_type": "llama"}
    assert not model_from_hf_config(llama, "x").final_logit_softcap
    # the attention's: Gemma2Config's default 50.0 as well, named in the notes (a kernel question under flash)
    assert model_from_hf_config(g2, "x").attn_softcap
    assert not model_from_hf_config({**g2, "attn_logit_softcapping": None}, "x").attn_softcap
    assert not model_from_hf_config(g3, "x").attn_softcap and not model_from_hf_config(llama, "x").attn_softcap
    notes = " ".join(model_from_hf_config(g2, "x").notes)
    assert "final_logit_softcapping" not in notes and "attn_logit_softcapping" in notes


def test_gemma2_9b_attention_softcap_by_hand():
    """Gemma-2-9B under --attention eager, seq 4096, micro-batch 1, bf16 AMP: each layer's tanh output is 2 bytes x
    16 heads x 4096 queries x 4096 keys = 536,870,912 B; 42 layers, 22,548,578,304 B. Under flash nothing is
    saved (the kernel caps inside), and selective recompute recomputes it with the core."""
    base = ("estimate", "--model", "gemma-2-9b", "--gpus", "8", "--zero", "3", "--seq", "4096")
    eager = cli_json(*base, "--attention", "eager")
    assert eager["memory"]["activations_detail"]["attn_softcap_tanh"] == 42 * 2 * 16 * 4096 * 4096 == 22_548_578_304
    off = cli_json(*base, "--attention", "eager", "--no-attn-softcap")
    assert "attn_softcap_tanh" not in off["memory"]["activations_detail"]
    assert eager["memory"]["allocated_peak_bytes"] - off["memory"]["allocated_peak_bytes"] == 22_548_578_304
    for extra in (("--attention", "flash"), ("--attention", "eager", "--recompute", "selective")):
        assert cli_json(*base, *extra)["memory"]["activations_detail"].get("attn_softcap_tanh", 0) == 0
    code, _, err = cli("estimate", "--model", "gemma-2-9b", "--attention", "eager", "--profile", "megatron",
                       "--no-logit-softcap")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--no-attn-softcap" in err


# --- measured by the harness ---------------------------------------------------------------------------------------

CASES = [
    dict(precision="fp32", seq=256),
    dict(precision="bf16", seq=512),  # AMP
    dict(precision="bf16", seq=512, keep_logits="fp32"),  # the model's .float() after the cap
    dict(precision="bf16", seq=512, recompute="full", micro_batch=2),
    dict(precision="bf16", seq=512, lora_rank=8),  # a frozen head: nothing else saved there
    dict(precision="bf16", seq=256, gpus=2, tp=2, sp=True),  # DTensor shards of the logits, loss_parallel
    dict(precision="bf16", seq=256, gpus=2, pp=2, grad_accum=4),  # torch pipelining's cached stage output
    dict(precision="bf16", seq=256, gpus=2, zero=3),  # FSDP2
]
IDS = ["fp32", "amp", "amp-keep-fp32", "amp-full-recompute-mb2", "lora", "tp2-sp", "pp2-1f1b", "fsdp2"]


@pytest.mark.parametrize("opts", CASES, ids=IDS)
def test_softcap_measured(opts):
    pytest.importorskip("torch")
    from memcalc.validate.api import validate

    world = "fake" if opts.get("tp", 1) > 1 else "real"
    runs = {sc: build_run(RunOptions(**SHAPE, **opts, final_logit_softcap=sc)) for sc in (False, True)}
    reps = {sc: validate(runs[sc], device="cpu", world=world, steps=1, timeout=240) for sc in runs}
    base, capped = _gap(reps[False]), _gap(reps[True])
    for k, v in base.items():
        assert abs(capped[k] - v) <= 64, (k, capped[k], v)
    assert reps[True]["within_tolerance"]
    # what it adds, measured: the tanh output of this rank's logits (its vocab shard under TP), c*tok*V/t bytes
    c = 4 if opts["precision"] == "fp32" else 2
    tok = opts["seq"] * opts.get("micro_batch", 1)
    added = c * tok * SHAPE["vocab"] // opts.get("tp", 1)
    peaks = {sc: reps[sc]["measured"]["peak_bytes"] for sc in reps}
    assert peaks[True] - peaks[False] == added


ATTN_SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=512)
ATTN_CASES = [
    dict(precision="fp32", seq=256, dropout=0.1),
    dict(precision="bf16", seq=512, micro_batch=2),  # AMP: the scores are bf16, the softmax's fp32
    dict(precision="bf16", seq=512, recompute="selective"),  # the core recomputed: its tanh output comes back
    dict(precision="bf16", seq=512, recompute="full"),
    dict(precision="bf16", seq=512, lora_rank=8, lora_targets="mlp"),  # the first layer's attention saves nothing
    dict(precision="bf16", seq=256, gpus=2, tp=2, sp=True),
    dict(precision="bf16", seq=256, gpus=2, pp=2, grad_accum=4),
]
ATTN_IDS = ["fp32-dropout", "amp-mb2", "amp-selective", "amp-full", "lora-mlp", "tp2-sp", "pp2-1f1b"]


@pytest.mark.parametrize("opts", ATTN_CASES, ids=ATTN_IDS)
def test_attention_softcap_measured(opts):
    pytest.importorskip("torch")
    from memcalc.validate.api import validate

    world = "fake" if opts.get("tp", 1) > 1 else "real"
    runs = {sc: build_run(RunOptions(**ATTN_SHAPE, **opts, attention="eager", attn_softcap=sc)) for sc in (0, 1)}
    reps = {sc: validate(runs[sc], device="cpu", world=world, steps=1, timeout=240) for sc in runs}
    base, capped = _gap(reps[0]), _gap(reps[1])
    for k, v in base.items():
        assert abs(capped[k] - v) <= 64, (k, capped[k], v)
    # measured: the layers that save it (the checkpointed core's one at a time; LoRA's first layer none; a 1F1B
    # first stage's one layer for each of its 2 micro-batches in flight) hold c x a/t x tok x s bytes each more
    c = 4 if opts["precision"] == "fp32" else 2
    tok = opts["seq"] * opts.get("micro_batch", 1)
    one = c * ATTN_SHAPE["heads"] // opts.get("tp", 1) * tok * opts["seq"]
    layers = 1 if ("recompute" in opts or "lora_rank" in opts) else ATTN_SHAPE["layers"]
    assert reps[1]["measured"]["peak_bytes"] - reps[0]["measured"]["peak_bytes"] == layers * one
