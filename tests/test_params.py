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
from memcalc.errors import InputError
from memcalc.specs import HardwareSpec, ParallelSpec, TrainingSpec, resolve
from tests.conftest import run_of

# DESIGN.md section 3 / issue 2: exact totals the tests must assert.
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,
    "gpt2-xl": 1_557_611_200,
    # EleutherAI/pythia README.md (dd90b79), "Total params": GPT-NeoX parallel blocks with two LayerNorms each
    "pythia-1b": 1_011_781_632,
    "pythia-6.9b": 6_857_302_016,
    "pythia-12b": 11_846_072_320,
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


def test_uneven_pipeline_split_follows_the_framework():
    """48 layers over 5 stages (base 9, 3 left over). Megatron and DeepSpeed (memcalc's convention): the extras on
    the first stages, 10, 10, 10, 9, 9. torch: torchtitan's generate_split_points gives the first stage the base,
    the middle stages one more while extras remain, the last the rest: 9, 10, 10, 10, 9. Llama 3.1 405B's 126
    layers over 8 stages: 15, 16 x 6, 15 (torchtitan's split points layers.15, .31, ..., .111)."""
    from memcalc.cost.params import stage_first_layer, stage_layers

    for profile, want in (("megatron", [10, 10, 10, 9, 9]), ("deepspeed", [10, 10, 10, 9, 9]),
                          ("torch", [9, 10, 10, 10, 9])):
        r = run_of(model="gpt2-xl", pp=5, gpus=5, profile=profile)
        assert [stage_layers(r, s) for s in range(5)] == want, profile
        assert [stage_first_layer(r, s) for s in range(5)] == [sum(want[:s]) for s in range(5)]
    r = run_of(model="llama-3.1-405b", pp=8, gpus=8)
    assert [stage_layers(r, s) for s in range(8)] == [15] + [16] * 6 + [15]
    assert [stage_first_layer(r, s) for s in range(1, 8)] == [15, 31, 47, 63, 79, 95, 111]


def test_tied_embedding_copy_on_last_stage():
    # tied embeddings with pp > 1: the last stage keeps its own copy of the V x h matrix
    r1 = run_of(model="gpt2", pp=1)
    r2 = run_of(model="gpt2", pp=2, gpus=2)
    assert sum(stage_params(r1, 0)) == 124_439_808
    total2 = sum(sum(stage_params(r2, s)) for s in range(2))
    assert total2 == 124_439_808 + 50257 * 768


# --- multi-head latent attention and first dense layers (DeepSeek) -------------------------------------------


def test_deepseek_presets_match_their_published_totals():
    """DeepSeek-V3 Technical Report sec. 4.2: 671B total, 37B activated per token; DeepSeek-V2 paper sec. 3.1.2:
    236B total, 21B activated; its appendix B: DeepSeek-V2-Lite 15.7B total, 2.4B activated. Activated = every
    parameter but the routed experts a token does not visit (top-k of E) and the input embedding table (a lookup):
    36.6B, 20.9B, 2.45B."""
    from memcalc.cost.params import dense_mlp_params

    cases = {"deepseek-v3": (671e9, 37e9), "deepseek-v2": (236e9, 21e9), "deepseek-v2-lite": (15.7e9, 2.4e9)}
    for name, (total, active) in cases.items():
        m = load_model(name)
        n = total_params(m)
        assert abs(n - total) / total < 0.005, name
        moe_layers = m.layers - m.moe.first_dense_layers
        idle = moe_layers * (m.moe.experts - m.moe.top_k) * dense_mlp_params(m, m.moe.expert_ffn)
        assert abs((n - idle - m.vocab * m.hidden) - active) / active < 0.025, name
    # the exact count: 671,026,404,352 (the checkpoint's further 58 x 256 routing-bias entries are not weights
    # the optimizer steps)
    assert total_params(load_model("deepseek-v3")) == 671_026_404_352


def test_mla_parameters_by_hand_and_under_tp():
    """DeepSeek-V2-Lite has no query latent: q is h x a(nope+rope). Per layer (h 2048, 16 heads): q 2048 x 3072,
    kv_a 2048 x 576, kv norm 512, kv_b 512 x 4096, o 2048 x 2048 = 13,763,072. Under tp 2 the head-split
    projections halve, kv_a and the latent norm stay whole (Megatron builds them `duplicated`)."""
    from memcalc.cost.params import attention_params

    m = load_model("deepseek-v2-lite")
    assert attention_params(m) == 2048 * 3072 + 2048 * 576 + 512 + 512 * 4096 + 2048 * 2048 == 13_763_072
    assert attention_params(m, 2) == (2048 * 3072 + 512 * 4096 + 2048 * 2048) // 2 + 2048 * 576 + 512


def test_first_dense_layers_sit_on_the_first_stage():
    """DeepSeek-V3 over pp 8, 61 layers: Megatron-style 8, 8, 8, 8, 8, 7, 7, 7, torchtitan's split 7, 8, 8, 8, 8, 8,
    7, 7. The 3 dense layers are all on stage 0, whose expert parameters are those of 5 (torch: 4) MoE layers against
    stage 1's 8; interleaved (pp 2 x vpp 2 of a 4-layer, 1-dense model: stage 0 holds chunks 0 and 2) the dense
    layer is stage 0's."""
    from memcalc.cost.params import stage_dense_layers, stage_layer_params

    m = load_model("deepseek-v3")
    for profile, moe_on_0 in (("megatron", 5), ("torch", 4)):
        r = resolve(m, TrainingSpec(), ParallelSpec(gpus=64, pp=8, ep=8), HardwareSpec(name="x", memory_bytes=1),
                    profile)
        assert [int(stage_dense_layers(r, s)) for s in range(8)] == [3, 0, 0, 0, 0, 0, 0, 0]
        _, e0 = stage_layer_params(r, 0)
        _, e1 = stage_layer_params(r, 1)
        assert e0 * 8 == e1 * moe_on_0, profile
    small = m.model_copy(update={"layers": 4, "moe": m.moe.model_copy(update={"first_dense_layers": 1})})
    r = resolve(small, TrainingSpec(grad_accum=2), ParallelSpec(gpus=2, pp=2, vpp=2, schedule="interleaved"),
                HardwareSpec(name="x", memory_bytes=1))
    assert [int(stage_dense_layers(r, s)) for s in range(2)] == [1, 0]


def test_hf_config_with_mla_and_dense_first_layers():
    """A DeepSeek-V3 config.json (the fields of deepseek-ai/DeepSeek-V3) gives the preset's model."""
    from memcalc.presets import model_from_hf_config

    cfg = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
           "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
           "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840, "hidden_act": "silu",
           "tie_word_embeddings": False}
    m = model_from_hf_config(cfg, "config.json")
    assert m.mla == load_model("deepseek-v3").mla and m.moe == load_model("deepseek-v3").moe
    assert m.head_dim == 192 and total_params(m) == 671_026_404_352


def test_moe_and_mla_from_flags():
    """--experts/--top-k/... and --kv-lora-rank/... build the same model as a preset that has them, and turn a
    dense preset into an MoE one with the arithmetic shown."""
    from memcalc.options import RunOptions, build_model

    flags = dict(layers=27, hidden=2048, heads=16, ffn=10944, vocab=102400, tied_embeddings=False, experts=64,
                 top_k=6, expert_ffn=1408, shared_experts=2, first_dense_layers=1, kv_lora_rank=512,
                 qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128)
    m, _ = build_model(RunOptions(**flags))
    lite = load_model("deepseek-v2-lite")
    assert (m.moe, m.mla, m.head_dim, m.kv_heads) == (lite.moe, lite.mla, lite.head_dim, lite.kv_heads)
    assert total_params(m) == total_params(lite)
    # Llama-3-8B with 8 experts, top-2, each expert the model's own SwiGLU MLP (--expert-ffn defaults to --ffn):
    # per layer 7 more MLPs of 3 x 4096 x 14336 and a 4096 x 8 router, over 32 layers
    base = load_model("llama-3-8b")
    moe, _ = build_model(RunOptions(model="llama-3-8b", experts=8, top_k=2))
    assert moe.moe.expert_ffn == 14336 and moe.name == "llama-3-8b+overrides"
    assert total_params(moe) - total_params(base) == 32 * (7 * 3 * 4096 * 14336 + 4096 * 8)
    # --head-dim: q and o become 4096 x (32 x 96), k and v 4096 x (8 x 96): 2 x 4096 x 32 x (96 - 128) +
    # 2 x 4096 x 8 x (96 - 128) per layer
    narrow, _ = build_model(RunOptions(model="llama-3-8b", head_dim=96))
    assert total_params(narrow) - total_params(base) == 32 * (2 * 4096 * 32 * -32 + 2 * 4096 * 8 * -32)
    # overriding one MLA field of a preset keeps the others, and the query/key width follows
    wide, _ = build_model(RunOptions(model="deepseek-v2-lite", qk_rope_dim=128))
    assert wide.head_dim == 256 and wide.mla.kv_lora_rank == 512


def test_phi_and_stablelm_by_hand():
    """phi-1.5: 24 parallel-shared-norm layers of h 2048 (one LayerNorm 2h, fused-width q/k/v/o with biases
    4h^2 + 4h, GELU MLP 2 x 4h^2 + 4h + h), vocab 51200, final LayerNorm, untied head with a bias.
    StableLM-Base-Alpha-3B: 16 GPT-NeoX parallel layers of h 4096 (two LayerNorms), vocab 50688, untied head."""
    def layer(h, norms):
        return norms * 2 * h + (4 * h * h + 4 * h) + (8 * h * h + 4 * h + h)
    phi = 51200 * 2048 + 24 * layer(2048, 1) + 2 * 2048 + 51200 * (2048 + 1)
    assert layer(2048, 1) == 50_354_176
    assert total_params(load_model("phi-1.5")) == phi == 1_418_270_720
    slm = 50688 * 4096 + 16 * layer(4096, 2) + 2 * 4096 + 50688 * 4096
    assert layer(4096, 2) == 201_379_840
    assert total_params(load_model("stablelm-base-alpha-3b")) == slm == 3_637_321_728


def test_hf_configs_of_parallel_blocks():
    """GPT-NeoX (use_parallel_residual, default true), phi (one shared LayerNorm, biased head) and GPT-J map onto the
    parallel blocks; GPT-NeoX with use_parallel_residual false stays sequential."""
    from memcalc.presets import model_from_hf_config

    neox = {"model_type": "gpt_neox", "hidden_size": 4096, "num_hidden_layers": 16, "num_attention_heads": 32,
            "intermediate_size": 16384, "vocab_size": 50688, "hidden_act": "gelu"}
    assert model_from_hf_config(neox, "x").block == "parallel"
    assert total_params(model_from_hf_config(neox, "x")) == 3_637_321_728
    assert model_from_hf_config(dict(neox, use_parallel_residual=False), "x").block == "sequential"
    phi = {"model_type": "phi", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
           "intermediate_size": 8192, "vocab_size": 51200, "hidden_act": "gelu_new", "tie_word_embeddings": False}
    spec = model_from_hf_config(phi, "x")
    assert (spec.block, spec.head_bias, spec.mlp, spec.norm) == ("parallel-shared-norm", True, "gelu", "layernorm")
    assert total_params(spec) == 1_418_270_720
    gptj = {"model_type": "gptj", "n_embd": 4096, "n_layer": 28, "n_head": 16, "vocab_size": 50400,
            "n_positions": 2048, "activation_function": "gelu_new", "rotary_dim": 64}
    spec = model_from_hf_config(gptj, "x")
    assert (spec.block, spec.positions, spec.head_bias, spec.mlp) == ("parallel-shared-norm", "rotary", True, "gelu")


def test_preset_checker_agrees_with_the_library():
    """scripts/check_presets.py counts parameters with its own stdlib-only formula (MLA, dense first layers, parallel
    blocks and head biases included): every preset passes its checks and gets the library's exact total."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "check_presets.py"
    spec = importlib.util.spec_from_file_location("check_presets", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import tomllib

    for name in model_names():
        p = path.parent.parent / "presets" / "models" / f"{name}.toml"
        data = tomllib.loads(p.read_text())
        errors, _ = mod.check_model(p, data)
        assert not errors, errors
        assert mod.param_count(data) == total_params(load_model(name)), name


def test_hf_config_gemma2_gated_gelu_tied_post_norms_and_its_unmodelled_parts_named():
    """Gemma 2 9B's config.json (the fields of google/gemma-2-9b; transformers' Gemma2Config): a gated GELU MLP
    (gate_proj, up_proj, down_proj: three matrices, as SwiGLU), the head tied to the embedding by the config class's
    default (a saved config.json leaves tie_word_embeddings out), head_dim 256 != 3584 / 16, and four RMSNorms per
    layer (post_norms). Per layer: q 3584 x 16*256 + k, v 2 x 3584 x 8*256 + o 16*256 x 3584 = 44,040,192; MLP
    3 x 3584 x 14336 = 154,140,672; four norms 4 x 3584 = 14,336 -> 198,195,200. x 42 = 8,324,198,400, + embedding
    256000 x 3584 = 917,504,000 + final norm 3584 = 9,241,705,984: Gemma 2 9B's published count."""
    from memcalc.presets import model_from_hf_config

    cfg = {"model_type": "gemma2", "hidden_size": 3584, "num_hidden_layers": 42, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336, "vocab_size": 256000,
           "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
           "max_position_embeddings": 8192, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
           "sliding_window": 4096, "query_pre_attn_scalar": 256}
    spec = model_from_hf_config(cfg, "config.json")
    assert (spec.mlp, spec.tied_embeddings, spec.head_dim, spec.post_norms, spec.final_logit_softcap) == (
        "swiglu", True, 256, True, True)
    layer = 3584 * 16 * 256 + 2 * 3584 * 8 * 256 + 16 * 256 * 3584 + 3 * 3584 * 14336 + 4 * 3584
    assert layer == 198_195_200
    assert total_params(spec) == 42 * layer + 256000 * 3584 + 3584 == 9_241_705_984
    notes = " ".join(spec.notes)
    # the final softcap is modelled (tests/test_logit_softcap.py); the attention's is a kernel question, named
    assert "final_logit_softcapping" not in notes and "attn_logit_softcapping" in notes and "RMSNorms" not in notes
    # an explicit key wins over the class default
    assert model_from_hf_config(dict(cfg, tie_word_embeddings=False), "x").tied_embeddings is False


def test_hf_config_qwen2_moe_shared_expert_width_and_qkv_bias():
    """Qwen1.5-MoE-A2.7B's config.json (model_type qwen2_moe): 60 experts of 1408, top-4, one shared expert MLP of
    5632 = 4 x 1408 (memcalc: 4 shared experts of expert_ffn, one MLP of their summed width; it was counted as one of
    1408), and Qwen2's q/k/v biases. Per layer: attention 4 x 2048^2 + 3 x 2048 = 16,783,360; experts 60 x 3 x 2048 x
    1408 = 519,045,120; shared 3 x 2048 x 5632 = 34,603,008; router 60 x 2048 = 122,880; norms 4,096 ->
    570,558,464. x 24 + embedding and untied head 2 x 151936 x 2048 + final norm 2048 = 14,315,735,040 (14.3B on
    the model card; the shared expert's gate, 2048 weights per layer, is noted as not counted)."""
    from memcalc.presets import model_from_hf_config

    cfg = {"model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
           "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
           "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
           "vocab_size": 151936, "hidden_act": "silu", "tie_word_embeddings": False}
    spec = model_from_hf_config(cfg, "config.json")
    assert spec.qkv_bias and spec.moe.shared_experts == 4 and spec.moe.expert_ffn == 1408
    layer = 4 * 2048**2 + 3 * 2048 + 60 * 3 * 2048 * 1408 + 3 * 2048 * 5632 + 60 * 2048 + 2 * 2048
    assert layer == 570_558_464
    assert total_params(spec) == 24 * layer + 2 * 151936 * 2048 + 2048 == 14_315_735_040
    assert any("shared expert's sigmoid gate" in n for n in spec.notes)


def test_hf_config_notes_name_what_is_not_modelled_and_presets_have_none():
    from memcalc.presets import model_from_hf_config

    llama = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False}
    assert model_from_hf_config(llama, "x").notes == ()
    assert load_model("llama-2-7b").notes == ()
    # Qwen3's per-head q/k norms are modelled (`qk_norm`); OLMo 2's whole-width ones are named
    qwen3 = model_from_hf_config(dict(llama, model_type="qwen3", head_dim=128), "x")
    assert qwen3.qk_norm and qwen3.notes == ()
    assert any("q_norm and k_norm over the whole" in n for n in model_from_hf_config(dict(llama, model_type="olmo2"),
                                                                                     "x").notes)
    other = model_from_hf_config(dict(llama, model_type="falcon_mamba"), "x")
    assert any("model_type 'falcon_mamba'" in n for n in other.notes)


def test_hf_multimodal_config_reads_its_text_config():
    """A multimodal checkpoint's config.json (Gemma 3 27B: Gemma3ForConditionalGeneration) keeps the language model
    in text_config: memcalc reads that, the same model as the text config alone, and notes the vision tower it
    leaves out."""
    from memcalc.presets import model_from_hf_config

    text = {"model_type": "gemma3_text", "hidden_size": 5376, "num_hidden_layers": 62, "num_attention_heads": 32,
            "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 21504, "vocab_size": 262208,
            "hidden_activation": "gelu_pytorch_tanh"}
    full = {"model_type": "gemma3", "text_config": text,
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "num_hidden_layers": 27}}
    alone, mm = model_from_hf_config(text, "x"), model_from_hf_config(full, "x")
    assert mm.model_copy(update={"notes": alone.notes}) == alone
    assert mm.notes[0] == "the language model read from text_config; the vision tower(s) and projector are not counted"
    assert mm.notes[1:] == alone.notes
    # without text_config, no hidden size is still a clear error
    with pytest.raises(InputError, match="has no hidden_size"):
        model_from_hf_config({"model_type": "gemma3", "vision_config": {}}, "config.json")


def test_model_from_a_checkpoint_directory_or_the_hub_cache(tmp_path, monkeypatch):
    """`--model DIR` reads DIR/config.json; `--model org/name` reads the config.json that huggingface_hub cached
    (HF_HUB_CACHE/models--org--name/snapshots/<refs/main>/), named after the repository; nothing is downloaded, and
    a repository not in the cache is one line saying how to fetch its config."""
    import json as _json

    from tests.conftest import cli

    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False}
    ckpt = tmp_path / "my-7b"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(_json.dumps(cfg))
    spec = load_model(str(ckpt))
    assert spec.name == "my-7b" and total_params(spec) == total_params(load_model("llama-2-7b"))
    repo = tmp_path / "hub" / "models--meta-llama--Llama-2-7b-hf"
    (repo / "snapshots" / "old").mkdir(parents=True)
    (repo / "snapshots" / "old" / "config.json").write_text(_json.dumps(dict(cfg, num_hidden_layers=2)))
    (repo / "snapshots" / "c0ffee").mkdir()
    (repo / "snapshots" / "c0ffee" / "config.json").write_text(_json.dumps(cfg))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    spec = load_model("meta-llama/Llama-2-7b-hf")
    assert spec.name == "llama-2-7b-hf" and spec.layers == 32  # the revision refs/main names
    code, _, err = cli("estimate", "--model", "Qwen/Qwen2.5-7B")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "not a preset, a file, or a repository in the Hugging Face cache" in err
    assert "huggingface-cli download Qwen/Qwen2.5-7B config.json" in err
    code, _, err = cli("estimate", "--model", str(tmp_path))
    assert code == 2 and "is a directory without a config.json" in err


def test_hf_config_falcon_layouts():
    """Falcon's configs (transformers FalconConfig, modeling_falcon.py), by hand:
    - Falcon-7B (multi_query, parallel_attn, one input_layernorm): per layer query_key_value 4544 x (71 + 2) x 64 =
      21,229,568, dense 4544^2 = 20,647,936, MLP 2 x 4544 x 18176 = 165,183,488, one LayerNorm 2 x 4544 = 9,088:
      207,070,080; x 32 = 6,626,242,560 + embedding 65024 x 4544 = 295,469,056 (the head tied) + final LayerNorm
      9,088 = 6,921,720,704. The first checkpoint's RefinedWebModel config (n_layer, n_head) reads the same.
    - Falcon-40B (new_decoder_architecture: 8 K/V heads, ln_attn and ln_mlp): 8192 x (128 + 16) x 64 = 75,497,472
      + 8192^2 = 67,108,864 + 2 x 8192 x 32768 = 536,870,912 + 4 x 8192 = 32,768 -> 679,510,016; x 60 =
      40,770,600,960 + 65024 x 8192 = 532,676,608 + 16,384 = 41,303,293,952.
    - falcon-rw-1b (sequential, MHA, biases, ALiBi): read as such, ALiBi named in the notes."""
    from memcalc.presets import model_from_hf_config

    f7 = {"model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
          "multi_query": True, "parallel_attn": True, "new_decoder_architecture": False, "bias": False,
          "vocab_size": 65024, "alibi": False}
    s = model_from_hf_config(f7, "x")
    assert (s.kv_heads, s.head_dim, s.block, s.norm, s.mlp, s.ffn, s.tied_embeddings, s.qkv_bias, s.linear_bias) == (
        1, 64, "parallel-shared-norm", "layernorm", "gelu", 18176, True, False, False)
    layer = 4544 * 73 * 64 + 4544 ** 2 + 2 * 4544 * 18176 + 2 * 4544
    assert layer == 207_070_080
    assert total_params(s) == 32 * layer + 65024 * 4544 + 2 * 4544 == 6_921_720_704
    assert not s.notes
    old = {"model_type": "RefinedWebModel", "hidden_size": 4544, "n_layer": 32, "n_head": 71, "multi_query": True,
           "parallel_attn": True, "bias": False, "vocab_size": 65024}
    assert total_params(model_from_hf_config(old, "x")) == 6_921_720_704
    f40 = {"model_type": "falcon", "hidden_size": 8192, "num_hidden_layers": 60, "num_attention_heads": 128,
           "num_kv_heads": 8, "new_decoder_architecture": True, "parallel_attn": True, "bias": False,
           "vocab_size": 65024}
    s = model_from_hf_config(f40, "x")
    assert (s.kv_heads, s.block) == (8, "parallel")
    layer = 8192 * 144 * 64 + 8192 ** 2 + 2 * 8192 * 32768 + 4 * 8192
    assert layer == 679_510_016
    assert total_params(s) == 60 * layer + 65024 * 8192 + 2 * 8192 == 41_303_293_952
    old40 = {"model_type": "RefinedWeb", "hidden_size": 8192, "n_layer": 60, "n_head": 128, "n_head_kv": 8,
             "parallel_attn": True, "bias": False, "vocab_size": 65024}
    assert total_params(model_from_hf_config(old40, "x")) == 41_303_293_952
    # and the presets, from the same fields
    assert total_params(load_model("falcon-7b")) == 6_921_720_704
    assert total_params(load_model("falcon-40b")) == 41_303_293_952
    rw = {"model_type": "falcon", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
          "multi_query": False, "parallel_attn": False, "bias": True, "vocab_size": 50304, "alibi": True}
    s = model_from_hf_config(rw, "x")
    assert (s.kv_heads, s.block, s.qkv_bias, s.linear_bias) == (32, "sequential", True, True)
    assert "alibi" in " ".join(s.notes)
