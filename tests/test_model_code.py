"""Model-code knobs (--norm-impl, --qkv-impl, --lora-dropout, --lora-targets qv): what each changes in the saved
activations, by hand. The harness measures the same layers op by op (docs/validation.md rows 60-64; row 60 runs in
tests/test_validation_matrix_subset.py).

Shape used throughout: Llama-2-7B (h = 4096, 32 heads = 32 KV heads, d = 128, f = 11008), pure bf16 (c = 2),
seq 1304, micro-batch 1: tok = 1304."""

from __future__ import annotations

import pytest

from memcalc.cost.activations import first_stage_terms, layer_terms
from memcalc.cost.params import lora_layer_params
from tests.conftest import cli, run_of

TOK, H, F = 1304, 4096, 11008
BF16 = dict(model="llama-2-7b", precision="bf16", master_weights=False, seq=TOK)


def test_lora_targets_qv_count_matches_litgpt_table():
    """lit-gpt's resource table prints 4,194,304 trainable parameters for Llama-2-7B LoRA r=8 on query and value:
    32 layers x 2 projections x (4096 x 8 + 8 x 4096) = 32 x 2 x 65,536."""
    run = run_of(lora_rank=8, lora_targets="qv", **BF16)
    assert 32 * lora_layer_params(run.model, "qv", 8) == 32 * 2 * (4096 * 8 + 8 * 4096) == 4_194_304


def test_fp32_norm_saves_an_fp32_copy():
    """Fused RMSNorm saves its bf16 input, 2 B x tok x h, plus rstd 4 B x tok; the eager fp32 RMSNorm saves x.float(),
    4 B x tok x h, plus rstd, and (the weight training) the normalized tensor cast back to bf16, 2 B x tok x h."""
    fused = layer_terms(run_of(**BF16))
    eager = layer_terms(run_of(norm_impl="fp32", **BF16))
    assert fused["attn_norm"] == 2 * TOK * H + 4 * TOK
    assert eager["attn_norm"] == 4 * TOK * H + 4 * TOK
    assert eager["attn_norm_normalized"] == eager["mlp_norm_normalized"] == 2 * TOK * H
    # under LoRA the norm weight is frozen: no normalized copy
    lora = layer_terms(run_of(norm_impl="fp32", lora_rank=8, **BF16))
    assert "attn_norm_normalized" not in lora and lora["attn_norm"] == 4 * TOK * H + 4 * TOK


def test_fp32_norm_is_a_no_op_under_autocast():
    """Under torch AMP the residual stream is fp32 already: x.float() is the input itself, so the saved input is the
    same 4 B per element either way (the weight multiply still saves the fp32 normalized tensor)."""
    amp = dict(model="llama-2-7b", precision="bf16", seq=TOK)
    assert layer_terms(run_of(**amp))["attn_norm"] == layer_terms(run_of(norm_impl="fp32", **amp))["attn_norm"]


def test_fused_qkv_keeps_the_whole_projection_through_v():
    """MHA: V is a view of the fused (q|k|v) output, so the whole 3 x tok x h bf16 buffer stays saved; q and k are
    separate after rotary: + (heads + kv) x d x tok x 2 B = 2 x 4096 x 1304 x 2 over separate projections."""
    sep = layer_terms(run_of(**BF16))
    fused = layer_terms(run_of(qkv_impl="fused", **BF16))
    assert fused["qkv_fused_buffer"] == 2 * TOK * (32 + 32) * 128 == 2 * TOK * 2 * H
    assert fused["q"] == sep["q"] and fused["k"] == sep["k"] and fused["v"] == sep["v"]
    # the o projection trains: it saves the head-major -> token-major copy of the flash output
    assert fused["attn_output_copy"] == 2 * TOK * H
    # under selective recompute the kernel's own output (SDPA's saved one) is inside the checkpoint: the copy only
    sel = layer_terms(run_of(qkv_impl="fused", recompute="selective", **BF16), "selective")
    assert sel["attn_output"] == 0 and sel["attn_output_copy"] == 2 * TOK * H


def test_fused_qkv_under_gqa_expands_k_and_v():
    """GQA (Llama-3.1-8B: 32 heads, 8 KV heads, d = 128): lit-gpt expands K and V to every query head before SDPA
    (expand + reshape copies), so k and v are saved at 32 heads, and nothing keeps the fused buffer."""
    sep = layer_terms(run_of(model="llama-3.1-8b", precision="bf16", seq=1024))
    fused = layer_terms(run_of(model="llama-3.1-8b", precision="bf16", seq=1024, qkv_impl="fused"))
    assert sep["k"] == 2 * 1024 * 8 * 128 and fused["k"] == fused["v"] == 2 * 1024 * 32 * 128
    assert "qkv_fused_buffer" not in fused


@pytest.mark.parametrize("impl", ["fused", "expand"])
def test_one_kv_head_per_rank_is_not_copied(impl):
    """MQA (Falcon-7B: 71 heads, 1 KV head, d = 64), and GQA under tp = KV heads: flattening the expansion of one
    KV head merges a one-long dim with the repeat's zero stride, a view, so SDPA saves the one-head K and V
    (measured by the harness: 2 c tok (a/t - 1) d per layer over with copies counted). lit-gpt's fused QKV: rotary
    makes K a new all-head tensor from the broadcast view, and V, a view, keeps the fused buffer alive."""
    flags = dict(precision="bf16", seq=1024, **({"qkv_impl": "fused"} if impl == "fused" else {"gqa_impl": "expand"}))
    t = layer_terms(run_of(model="falcon-7b", **flags))
    assert t["v"] == 2 * 1024 * 1 * 64
    if impl == "fused":
        assert t["k"] == 2 * 1024 * 71 * 64 and t["qkv_fused_buffer"] == 2 * 1024 * (71 + 1) * 64
    else:
        assert t["k"] == t["v"] and "qkv_fused_buffer" not in t
    # Llama-3.1-8B's 8 KV heads over tp 8: one per rank (4 query heads), no copies; over tp 4 (2 per rank) copied
    tp8 = layer_terms(run_of(model="llama-3.1-8b", gpus=8, tp=8, **flags))
    tp4 = layer_terms(run_of(model="llama-3.1-8b", gpus=4, tp=4, **flags))
    assert tp8["v"] == 2 * 1024 * 1 * 128 and tp4["v"] == 2 * 1024 * 8 * 128


def test_lora_dropout_copies_and_masks():
    """LoRA r=8 on q,v with dropout 0.05, separate projections (PEFT): each adapter owns a dropout, so two dropped
    bf16 copies and two bool masks of the qkv input: 2 x (2 + 1) x tok x h; the undropped input is no longer saved
    (the frozen base does not save it). Fused QKV (lit-gpt): one dropout, (2 + 1) x tok x h, plus the zero-pad
    source of the q and v adapter outputs, 2 B x tok x (h + h)."""
    nodrop = layer_terms(run_of(lora_rank=8, lora_targets="qv", **BF16))
    sep = layer_terms(run_of(lora_rank=8, lora_targets="qv", lora_dropout=0.05, **BF16))
    fused = layer_terms(run_of(lora_rank=8, lora_targets="qv", lora_dropout=0.05, qkv_impl="fused", **BF16))
    assert nodrop["qkv_input"] == 2 * TOK * H and "lora_dropout_qkv" not in nodrop
    assert sep["qkv_input"] == 0 and sep["lora_dropout_qkv"] + sep["lora_dropout_qkv_mask"] == 2 * 3 * TOK * H
    assert sep["lora_dropout_qkv_mask"] == 2 * TOK * H  # 1 byte per element, one mask per module
    assert fused["lora_dropout_qkv"] + fused["lora_dropout_qkv_mask"] == 3 * TOK * H
    assert fused["lora_qkv_zero_pad"] == 2 * TOK * (H + H)
    assert sep["lora_attn_low_rank"] == 2 * 2 * TOK * 8  # x A for q and v
    # the frozen o projection saves nothing of its (copied) input
    assert fused["attn_output_copy"] == 0


def test_litgpt_layer_total_per_token():
    """lit-gpt's Llama-2-7B layer with LoRA r=8 on q,v, dropout 0.05, fp32 RMSNorm, fused QKV, per token, in units
    of h = 4096 bytes: two fp32 norm inputs 8 h (+ 2 x 4 B rstd), fused qkv buffer 4 h + q, k, v 6 h, SDPA output
    2 h (+ 32 x 4 B log-sum-exp), dropout copy and mask 3 h, zero-pad source 4 h, gate, up and SiLU outputs
    3 x 2 f = 16.125 h, x A 2 x 8 x 2 B = 32 B: 43.125 h + 8 + 128 + 32 = 176,808 B. Per layer and micro-batch,
    not per token: the zero pad's index, the 4096 q and 4096 v columns as int64, 8 x 8192 = 65,536 B (lit-gpt 2023
    makes it in every forward with `torch.tensor(self.lora_ind, ...)` and index_copy saves it)."""
    run = run_of(lora_rank=8, lora_targets="qv", lora_dropout=0.05, norm_impl="fp32", qkv_impl="fused", **BF16)
    total = sum(layer_terms(run).values())
    per_token = 8 * H + 8 + 4 * H + 6 * H + 2 * H + 128 + 3 * H + 4 * H + 3 * 2 * F + 32
    assert per_token == 176_808
    assert total == TOK * per_token + 8 * (H + H)


def test_lora_first_layer_input_needs_no_gradient():
    """LoRA freezes the embedding: layer 0's input norm records nothing, and its dropout keeps no mask (one copy's
    1 B per element of the fused qkv input)."""
    run = run_of(lora_rank=8, lora_targets="qv", lora_dropout=0.05, norm_impl="fp32", qkv_impl="fused", **BF16)
    assert first_stage_terms(run)["first_layer_frozen_input"] == -((4 * TOK * H + 4 * TOK) + TOK * H)
    assert "first_layer_frozen_input" not in first_stage_terms(run_of(**BF16))


def test_model_code_bad_input():
    code, _, err = cli("estimate", "--model", "llama-2-7b", "--norm-impl", "apex")
    assert code == 2 and "--norm-impl 'apex' is not valid; valid: fused, fp32" in err
    code, _, err = cli("estimate", "--model", "llama-2-7b", "--lora-rank", "8", "--lora-dropout", "-0.1")
    assert code == 2 and "--lora-dropout -0.1 must be in [0, 1)" in err
