"""Exact parameter counts against published totals (the preset files cite where each total was read)."""

from __future__ import annotations

import pytest

from memcalc.cost.params import (
    attention_params,
    dense_mlp_params,
    embedding_params,
    layer_params,
    padded_vocab,
    stage_params,
    total_params,
)
from memcalc.presets import load_model, model_names, model_preset_data
from tests.conftest import run_of

# DESIGN.md section 3 / issue 2: exact totals the tests must assert.
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,
    "gpt2-xl": 1_557_611_200,
}


@pytest.mark.parametrize("name,expected", sorted(PUBLISHED.items()))
def test_published_totals(name, expected):
    assert total_params(load_model(name)) == expected


@pytest.mark.parametrize("name", model_names())
def test_every_preset_matches_its_recorded_total(name):
    data = model_preset_data(name)
    if "expected_params" not in data:
        pytest.skip(f"{name}: no published exact total")
    assert total_params(load_model(name)) == data["expected_params"]


def test_llama2_7b_by_hand():
    m = load_model("llama-2-7b")
    h, f, V, L = 4096, 11008, 32000, 32
    attn = 4 * h * h  # q, k, v, o (MHA)
    mlp = 3 * h * f  # gate, up, down
    norms = 2 * h  # two RMSNorm weights
    assert attention_params(m) == attn == 67_108_864
    assert dense_mlp_params(m, f) == mlp == 135_266_304
    assert layer_params(m) == (attn + mlp + norms, 0)
    assert total_params(m) == L * (attn + mlp + norms) + V * h + h + V * h


def test_gpt2_xl_by_hand():
    # GPT-2 XL: h 1600, 48 layers, vocab 50257, 1024 learned positions, LayerNorm with bias, biases, tied head
    m = load_model("gpt2-xl")
    h, L, V, P = 1600, 48, 50257, 1024
    layer = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 2 * (2 * h)
    assert layer == 30_740_800
    assert total_params(m) == L * layer + V * h + P * h + 2 * h == 1_557_611_200


def test_gqa_llama2_70b_kv_projection():
    m = load_model("llama-2-70b")  # 64 heads, 8 KV heads, head_dim 128
    h = 8192
    assert attention_params(m) == h * h + 2 * h * (8 * 128) + h * h


def test_tp_shards_matrices_not_norms():
    m = load_model("llama-2-7b")
    full, _ = layer_params(m, tp=1)
    shard, _ = layer_params(m, tp=8)
    norms = 2 * 4096
    assert shard == (full - norms) // 8 + norms


def test_megatron_pads_vocab_to_128_times_tp():
    # Megatron-LM --make-vocab-size-divisible-by 128, times tp
    m = load_model("gpt2")  # vocab 50257
    assert padded_vocab(m, "megatron", 1) == 50304
    assert padded_vocab(m, "megatron", 8) == 51200  # multiple of 1024
    assert padded_vocab(m, "torch", 8) == 50257
    assert embedding_params(m, "megatron", 8) == 51200 // 8 * 768 + 1024 * 768


def test_pipeline_stages_sum_to_model_and_hold_embedding_and_head():
    r = run_of(model="llama-2-7b", pp=4, gpus=4)
    per_stage = [sum(stage_params(r, s)) for s in range(4)]
    assert sum(per_stage) == 6_738_415_616
    layer = sum(layer_params(r.model))
    assert per_stage[1] == per_stage[2] == 8 * layer
    assert per_stage[0] == 8 * layer + 32000 * 4096
    assert per_stage[3] == 8 * layer + 4096 + 32000 * 4096


def test_uneven_pipeline_puts_remainder_first():
    r = run_of(model="gpt2-xl", pp=5, gpus=5)  # 48 layers: 10, 10, 10, 9, 9
    from memcalc.cost.params import stage_layers

    assert [stage_layers(r.model, 5, s) for s in range(5)] == [10, 10, 10, 9, 9]


def test_tied_embedding_copy_on_last_stage():
    # tied embeddings with pp > 1: the last stage keeps its own copy of the V x h matrix
    r1 = run_of(model="gpt2", pp=1)
    r2 = run_of(model="gpt2", pp=2, gpus=2)
    assert sum(stage_params(r1, 0)) == 124_439_808
    total2 = sum(sum(stage_params(r2, s)) for s in range(2))
    assert total2 == 124_439_808 + 50257 * 768
