"""Activation memory (memcalc/cost/activations.py) against published formulas and figures, hand-computed cases and
invariants. Sources: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198) sec. 4-5 and Figure 1 / Figure 7 (values as in ../shared/reference-cases.json, ids
korthikanti_*); Rajbhandari et al. 2019, "ZeRO" sec. 3.2 and footnote 3 (id zero_gpt2_1p5B_activations_and_residuals).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from memcalc.cost.activations import (
    LOSS_CHUNKS,
    cp_ring_transients,
    first_stage_terms,
    in_flight,
    last_stage_terms,
    layer_bytes,
    layer_terms,
    loss_kept_bytes,
    loss_transients,
    recompute_transient_bytes,
    stage_activations,
)
from memcalc.specs import (
    HardwareSpec,
    InputError,
    ModelSpec,
    MoESpec,
    ParallelSpec,
    TrainingSpec,
    a2a_cp_limit,
    resolve,
)

GIB = 2**30
GB = 10**9
HW = HardwareSpec(memory_bytes=80 * GIB)

TRAINING_FIELDS = set(TrainingSpec.model_fields)


def make(model: ModelSpec, profile: str = "megatron", **kw):
    """A resolved Run from training and parallel keyword arguments (split by field name). Inside a hypothesis test, a
    parallel block under the megatron profile (refused: Megatron-LM's layer is sequential) is skipped."""
    if model.block != "sequential" and profile == "megatron":
        assume(False)
    tr = {k: v for k, v in kw.items() if k in TRAINING_FIELDS}
    par = {k: v for k, v in kw.items() if k not in TRAINING_FIELDS}
    return resolve(model, TrainingSpec(**tr), ParallelSpec(**par), HW, profile=profile)


def gpt(h: int, a: int, layers: int = 1, vocab: int = 51200, dropout: float = 0.1) -> ModelSpec:
    """Korthikanti's GPT layer: MHA, GELU MLP of width 4h, LayerNorm, biases, learned positions, dropout."""
    return ModelSpec(hidden=h, heads=a, layers=layers, ffn=4 * h, vocab=vocab, mlp="gelu", norm="layernorm",
                     qkv_bias=True, linear_bias=True, tied_embeddings=True, positions="learned",
                     max_positions=2048, dropout=dropout)


def korthikanti(model: ModelSpec, **kw):
    """Their setting: Megatron, fp16, eager attention with dropout."""
    return make(model, "megatron", precision="fp16", attention="eager", **kw)


# (h, a, s, b, t): the layers of the 22B, 175B, 530B and 1T models of Korthikanti Table 3, and a small one
SHAPES = [(6144, 64, 2048, 4, 8), (12288, 96, 2048, 1, 8), (20480, 128, 2048, 1, 8), (25600, 160, 2048, 1, 8),
          (1024, 16, 512, 2, 4)]


# ---------------------------------------------------------------------------------------------------------------
# Korthikanti sec. 4-5: per-layer formulas, exactly, with their conventions (no LayerNorm mean/rstd)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("h,a,s,b,t", SHAPES)
def test_korthikanti_per_layer_formulas_exact(h, a, s, b, t):
    m = gpt(h, a)
    sbh = s * b * h
    att = 5 * a * s * s * b  # 5as^2b: softmax 2as^2b + dropout mask as^2b + dropout output 2as^2b
    # sec. 4.1 eq. 1: sbh(34 + 5as/h)
    assert layer_bytes(korthikanti(m, seq=s, micro_batch=b), paper_terms=True) == 34 * sbh + att
    # sec. 4.2.1 eq. 2 (TP, no SP): sbh(10 + 24/t + 5as/(ht))
    tp = korthikanti(m, seq=s, micro_batch=b, tp=t, sp=False)
    assert layer_bytes(tp, paper_terms=True) == 10 * sbh + 24 * sbh // t + att // t
    # sec. 4.2.2 eq. 4 (TP + SP): sbh(34 + 5as/h)/t
    tpsp = korthikanti(m, seq=s, micro_batch=b, tp=t, sp=True)
    assert layer_bytes(tpsp, paper_terms=True) == (34 * sbh + att) // t
    # sec. 5 selective recompute: TP sbh(10 + 24/t), TP+SP 34sbh/t
    assert layer_bytes(tp, "selective", paper_terms=True) == 10 * sbh + 24 * sbh // t
    assert layer_bytes(tpsp, "selective", paper_terms=True) == 34 * sbh // t
    # full recompute: the layer input, 2sbh (/t with SP, where the input is already sequence-sharded)
    assert layer_bytes(tp, "full") == 2 * sbh
    assert layer_bytes(tpsp, "full") == 2 * sbh // t


@pytest.mark.parametrize("h,a,s,b,t", SHAPES[:2])
def test_korthikanti_breakdown_by_block(h, a, s, b, t):
    """Sec. 4.1: attention block 11sbh + 5as^2b, MLP 19sbh, the two LayerNorms 4sbh."""
    terms = layer_terms(korthikanti(gpt(h, a), seq=s, micro_batch=b), paper_terms=True)
    sbh = s * b * h
    attn = ("qkv_input", "q", "k", "v", "attn_softmax", "attn_dropout_mask", "attn_dropout_output", "attn_output",
            "attn_residual_dropout_mask")
    mlp = ("mlp_input", "mlp_fc_output", "mlp_act_output", "mlp_residual_dropout_mask")
    assert sum(terms[k] for k in attn) == 11 * sbh + 5 * a * s * s * b
    assert sum(terms[k] for k in mlp) == 19 * sbh
    assert terms["attn_norm"] + terms["mlp_norm"] == 4 * sbh
    assert terms["residual_adds"] == 0  # an add saves nothing for backward
    assert set(terms) == set(attn) | set(mlp) | {"attn_norm", "mlp_norm", "residual_adds"}


@pytest.mark.parametrize("h,a,s,b,t", SHAPES)
def test_terms_korthikanti_leaves_out_are_the_layernorm_statistics(h, a, s, b, t):
    """The default inventory adds each LayerNorm's fp32 mean and rstd: 2 norms x 8 bytes x s*b (/t with SP);
    1.9e-5 of the 22B layer unsharded or with TP+SP, 1.0e-4 with t = 8 without SP (the statistics are replicated
    while the rest is divided)."""
    for sp, div in ((False, 1), (True, t)):
        r = korthikanti(gpt(h, a), seq=s, micro_batch=b, tp=t, sp=sp)
        extra = layer_bytes(r) - layer_bytes(r, paper_terms=True)
        assert extra == 2 * 8 * s * b // div
        assert extra / layer_bytes(r, paper_terms=True) < 16 / (10 * h)  # the layer is at least 10sbh


# ---------------------------------------------------------------------------------------------------------------
# Korthikanti Figure 1 (per-GPU activations, GiB) and Figure 7 (% of the TP baseline)
# ---------------------------------------------------------------------------------------------------------------

# name: (h, a, L, micro_batch, global_batch, pp, vpp, Fig. 1 TP baseline GiB, Fig. 1 TP+SP+selective GiB, Fig. 7 %)
# t = 8, s = 2048, dp = 1. The 1T model is not interleaved: 128 layers do not split into pp*3 = 192 chunks, and
# its Figure 1 values are reproduced without the interleave factor.
FIG1 = {
    "22B": (6144, 64, 48, 4, 4, 1, 1, 59.25, 9.5625, {"seq": 66.84, "sel": 49.42, "seqsel": 16.18, "full": 7.64}),
    "175B": (12288, 96, 96, 1, 64, 8, 3, 66.84375, 12.3515625,
             {"seq": 62.04, "sel": 56.53, "seqsel": 18.49, "full": 8.71}),
    "530B": (20480, 128, 105, 1, 280, 35, 3, 114.0234375, 23.076171875,
             {"seq": 58.31, "sel": 62.04, "seqsel": 20.27, "full": 9.42}),
    "1T": (25600, 160, 128, 1, 512, 64, 1, 131.25, 26.5625,
           {"seq": 58.31, "sel": 62.04, "seqsel": 20.27, "full": 9.42}),
}


def fig1_run(name: str, sp: bool, recompute: str):
    h, a, L, mb, gb, pp, vpp, *_ = FIG1[name]
    return korthikanti(gpt(h, a, L), seq=2048, micro_batch=mb, global_batch=gb, tp=8, pp=pp, vpp=vpp, sp=sp,
                       gpus=8 * pp, recompute=recompute)


def layer_units(run, stage=0):
    """(layer, micro-batch) pairs held by the stage at its first backward."""
    units = in_flight(run, stage)
    per = run.model.layers // (run.pp * run.vpp)
    return units * per


@pytest.mark.parametrize("name", FIG1)
def test_korthikanti_interleaved_first_stage_holds_L_times_the_factor(name):
    """Sec. 4.2.3: the first stage holds p micro-batches x L/p layers = L layers' worth, times
    1 + (p-1)/(p*m) with interleaving (m model chunks)."""
    h, a, L, mb, gb, pp, vpp, *_ = FIG1[name]
    r = fig1_run(name, False, "none")
    factor_num, factor_den = (pp * vpp + pp - 1, pp * vpp) if vpp > 1 else (1, 1)  # 1 + (p-1)/(pm)
    assert layer_units(r) * factor_den == L * factor_num
    # 175B: 31 chunks of 4 layers = 124 = 96 * 31/24; 530B: 139 chunks of 1 layer = 105 * 139/105
    assert {"175B": 124, "530B": 139, "22B": 48, "1T": 128}[name] == layer_units(r)


@pytest.mark.parametrize("name", FIG1)
@pytest.mark.parametrize("case", ["baseline", "seqsel"])
def test_korthikanti_figure1_activations(name, case):
    h, a, L, mb, gb, pp, vpp, base_gib, seqsel_gib, _ = FIG1[name]
    sp, rec, fig = (False, "none", base_gib) if case == "baseline" else (True, "selective", seqsel_gib)
    r = fig1_run(name, sp, rec)
    # 1. Their conventions reproduce the figure to the byte: e.g. 22B baseline = 48 layers x 2048*4*6144 bytes
    #    x (10 + 24/8 + 5*64*2048/(6144*8)) = 63,619,203,072 B = 59.25 GiB.
    assert layer_bytes(r, rec, paper_terms=True) * layer_units(r) == fig * GIB
    # 2. The full inventory's layer part (with LayerNorm statistics) within 1% (in fact within 0.002%).
    sa = stage_activations(r, 0)
    layer_keys = set(layer_terms(r)) | set(layer_terms(r, rec))
    layers_part = sum(v for k, v in sa.detail.items() if k in layer_keys)
    assert layers_part == layer_bytes(r, rec) * layer_units(r)
    assert abs(layers_part / (fig * GIB) - 1) < 0.01
    # 3. Figure 1 counts the transformer layers only. What the stage holds besides them is the embedding's input
    #    ids (8sb) and dropout mask (sbh, /t with SP) per in-flight micro-batch of the first model chunk (sec. 4.3
    #    calls them small); for 22B (pp = 1) also the final norm, LM-head input and fp32 logits.
    s, t = 2048, 8
    n_first = {"22B": 1, "175B": 15, "530B": 69, "1T": 64}[name]  # interleaved: chunk-0 forwards, see below
    emb = n_first * (8 * s * mb + s * mb * h // (t if sp else 1))
    rest = sa.held_bytes - layers_part - emb
    if pp > 1:
        assert rest == 0
        assert sa.detail["embedding_dropout_mask"] == n_first * s * mb * h // (t if sp else 1)
    else:
        # 2sbh/t norm input (+ fp32 stats) + 2sbh/t LM-head input (no SP: 2sbh each) + 4sbV/t fp32 logits
        sbh = s * mb * h // (t if sp else 1)
        assert rest == 2 * sbh + 8 * s * mb // (t if sp else 1) + 2 * sbh + 4 * s * mb * 51200 // t
    if (name, case) in (("22B", "baseline"), ("175B", "baseline"), ("175B", "seqsel")):
        assert abs(sa.held_bytes / (fig * GIB) - 1) < 0.01  # the whole stage too
    # (22B TP+SP+selective: the fp32 logits alone, 4sbV/t = 0.195 GiB, are 2% of its 9.56 GiB)


def test_interleaved_first_chunk_micro_batches():
    """Megatron runs forwards in groups of pp micro-batches per model chunk. 175B (pp 8, 3 chunks): stage 0 runs
    31 forwards before its first backward: chunk 0 mb 0-7, chunk 1 mb 0-7, chunk 2 mb 0-7, chunk 0 mb 8-14, so
    15 micro-batches hold the embedding's terms; the last stage runs 17 (chunks 0 and 1 of mb 0-7, chunk 2 of
    mb 0), so one micro-batch holds the loss's. 530B (pp 35): 139 = 105 + 34 -> 35 + 34 = 69."""
    r = fig1_run("175B", False, "none")
    assert int(in_flight(r, 0)) == 31 and int(in_flight(r, 7)) == 17
    d0, d7 = stage_activations(r, 0).detail, stage_activations(r, 7).detail
    assert d0["embedding_input_ids"] == 15 * 8 * 2048
    assert d7["loss_logits_fp32"] == 1 * 4 * 2048 * 51200 // 8


@pytest.mark.parametrize("name", FIG1)
def test_korthikanti_figure7_percentages(name):
    """Figure 7: activation memory of SP only, selective only, both, and full recompute as % of the TP baseline,
    within 0.15 percentage point (ratios of the per-layer formulas; the percentages are read off the figure's
    bars, e.g. 530B selective 13/21 = 61.90% against 62.04%)."""
    h, a, L, mb, gb, pp, vpp, *_, fig7 = FIG1[name]
    base = layer_bytes(fig1_run(name, False, "none"), paper_terms=True)
    got = {
        "seq": layer_bytes(fig1_run(name, True, "none"), paper_terms=True),
        "sel": layer_bytes(fig1_run(name, False, "selective"), "selective", paper_terms=True),
        "seqsel": layer_bytes(fig1_run(name, True, "selective"), "selective", paper_terms=True),
        "full": layer_bytes(fig1_run(name, False, "full"), "full"),
    }
    for k, pct in fig7.items():
        assert abs(100 * got[k] / base - pct) < 0.15, (k, 100 * got[k] / base, pct)


def test_korthikanti_appendix_b_pipeline_output_deallocation():
    """Appendix B: Megatron frees each pipeline stage's output once sent; keeping it (torch pipelining, DeepSpeed)
    costs s*b*h*p fp16 bytes on the first stage of 530B (t 8, p 35, no SP): 2.734 GiB ("2.73 GB")."""
    m = gpt(20480, 128, 105)
    kw = dict(precision="fp16", attention="eager", seq=2048, micro_batch=1, global_batch=280, tp=8, pp=35,
              sp=False, gpus=280)
    mega = stage_activations(make(m, "megatron", **kw), 0)
    ds = stage_activations(make(m, "deepspeed", **kw), 0)
    # compare the pipeline-output term itself, 35 in-flight micro-batches of s*b*h fp16
    assert mega.detail.get("pipeline_output", 0) == 0
    assert ds.detail["pipeline_output"] == 2 * 2048 * 1 * 20480 * 35 == 2_936_012_800
    assert round(2_936_012_800 / GIB, 2) == 2.73
    # torch pipelining: pure fp16 the same; under AMP (fp32 weights, autocast) the stream between stages is fp32
    # (activations._stream_bytes; measured: pipelining sends fp32), twice the paper's figure
    pure = stage_activations(make(m, "torch", master_weights=False, **kw), 0)
    assert pure.detail["pipeline_output"] == 2_936_012_800
    amp = stage_activations(make(m, "torch", **kw), 0)
    assert amp.detail["pipeline_output"] == 2 * 2_936_012_800


# ---------------------------------------------------------------------------------------------------------------
# ZeRO sec. 3.2: GPT-2 1.5B, seq 1K, batch 32: "about 60 GB" of activations, "about 8 GB" with checkpointing
# ---------------------------------------------------------------------------------------------------------------

def test_zero_paper_gpt2_activations():
    L, h, a, s, b = 48, 1600, 16, 1024, 32  # ZeRO Table 4/5 dims for 1.5B
    sbh = s * b * h
    # The paper's figure is its footnote 3: about 12 x hidden x batch x seq x layers elements, fp16.
    footnote = 12 * h * b * s * L * 2
    assert footnote == 60_397_977_600 and abs(footnote / (60 * GB) - 1) < 0.01
    # Activation checkpointing "reduces the activation memory by approximately the square root" (Chen et al.
    # 2016): checkpoint every k ~ sqrt(L) layers, keep L/k layer inputs (2sbh each) and re-materialise one segment
    # of k layers (24sbh each in the footnote's convention). k = 6: 8*2sbh + 6*24sbh = 160sbh = 8.39 GB ~ 8 GB;
    # equivalently 60.4 GB / sqrt(48) = 8.7 GB.
    k = 6
    sqrt_scheme = (L // k) * 2 * sbh + k * 24 * sbh
    assert sqrt_scheme == 8_388_608_000 and abs(sqrt_scheme / (8 * GB) - 1) < 0.05
    assert abs(footnote / math.sqrt(L) / (8 * GB) - 1) < 0.1

    # memcalc's op-by-op inventory for the same layer (flash attention, no dropout, fp16 weights and activations,
    # as in the paper's Megatron setting): 16 elements per sbh (32 bytes) where the footnote says 12, plus
    # LayerNorm statistics and the fp32 log-sum-exp:
    m = ModelSpec(hidden=h, heads=a, layers=L, ffn=4 * h, vocab=50257, mlp="gelu", norm="layernorm",
                  qkv_bias=True, linear_bias=True, tied_embeddings=True, positions="learned", max_positions=1024)
    r = make(m, "torch", precision="fp16", seq=s, micro_batch=b, master_weights=False)
    per_layer = 32 * sbh + 2 * 8 * s * b + 4 * s * b * a
    assert layer_bytes(r) == per_layer
    assert L * per_layer == 80_656_465_920  # 80.7 GB: 4/3 of the footnote's 60.4 GB
    # With one checkpoint per layer (Megatron / DeepSpeed full recompute) the layers hold 48 x 2sbh = 5.03 GB and
    # one re-materialised layer (30sbh + stats + lse = 1.6 GB) during its backward: 6.6 GB, below the ~8 GB of
    # the sqrt(L) scheme the paper quotes.
    rf = make(m, "torch", precision="fp16", seq=s, micro_batch=b, recompute="full", master_weights=False)
    assert L * layer_bytes(rf, "full") == 48 * 2 * sbh == 5_033_164_800
    assert recompute_transient_bytes(rf) == per_layer - 2 * sbh
    assert round((L * 2 * sbh + per_layer - 2 * sbh) / GB, 1) == 6.6


# ---------------------------------------------------------------------------------------------------------------
# Modern layers, hand-computed
# ---------------------------------------------------------------------------------------------------------------

def llama3_8b(layers: int = 32, **kw) -> ModelSpec:
    base = dict(hidden=4096, heads=32, kv_heads=8, layers=layers, ffn=14336, vocab=128256, mlp="swiglu",
                norm="rmsnorm", positions="rotary")
    base.update(kw)
    return ModelSpec(**base)


def test_llama3_layer_flash_bf16_torch():
    T, h, a, g, d, f = 8192, 4096, 32, 8, 128, 14336
    r = make(llama3_8b(), "torch", seq=T, master_weights=False)  # bf16 weights (torchtitan / FSDP2 MP)
    terms = layer_terms(r)
    assert terms["k"] == terms["v"] == 2 * T * g * d  # GQA: K and V at 8 heads
    assert terms["attn_lse"] == 4 * T * a  # flash: fp32 log-sum-exp, no s x s tensor
    assert "attn_softmax" not in terms and "attn_residual_dropout_mask" not in terms  # flash; no dropout
    # 2 norms, QKV input, Q, attention output, MLP input: 6 x 2Th; RMSNorm rstd 4T each; K, V; LSE;
    # SwiGLU: gate and up outputs, silu output (unfused), down input: 4 x 2Tf
    expected = 6 * 2 * T * h + 2 * 4 * T + 2 * 2 * T * g * d + 4 * T * a + 4 * 2 * T * f
    assert layer_bytes(r) == expected == 1_376_845_824
    # Megatron's fused SwiGLU saves its input and recomputes silu: one 2Tf less
    assert layer_bytes(make(llama3_8b(), "megatron", seq=T)) == expected - 2 * T * f
    # torch AMP (autocast over fp32 weights, HF Trainer bf16=True): the residual stream stays fp32, so both norms
    # save 4Th instead of 2Th, and each of q/k/v (gate/up) saves its own bf16 cast of the norm output: QKV input
    # 3 x 2Th, MLP input 2 x 2Th (measured op by op by the harness, docs/validation.md rows "bf16 AMP")
    amp = make(llama3_8b(), "torch", seq=T)
    assert layer_bytes(amp) == expected + 2 * (4 - 2) * T * h + (3 - 1) * 2 * T * h + (2 - 1) * 2 * T * h
    assert layer_bytes(amp) == 1_376_845_824 + 335_544_320


def test_eager_attention_gqa_repeats_kv_and_keeps_scores():
    T, a, d = 2048, 32, 128
    r = make(llama3_8b(), "torch", seq=T, attention="eager")
    terms = layer_terms(r)
    assert terms["k"] == terms["v"] == 2 * T * a * d  # repeat_kv before the matmuls that save them
    # Hugging Face's eager attention, softmax(scores, dtype=float32).to(bf16): softmax saves its fp32 output and
    # the value matmul the bf16 copy, 4 + 2 bytes per score (docs/validation.md "eager attention" rows; before
    # this, a bf16 AMP eager step at seq 512 was predicted 27.6% below its measured forward peak)
    assert terms["attn_softmax"] == 4 * a * T * T == 536_870_912
    assert terms["attn_probs"] == 2 * a * T * T
    assert "attn_dropout_mask" not in terms
    # with dropout the bf16 copy is read by dropout only, which keeps its mask and output instead
    drop = layer_terms(make(llama3_8b(), "torch", seq=T, attention="eager", dropout=0.1))
    assert "attn_probs" not in drop and drop["attn_dropout_output"] == 2 * a * T * T
    # in fp32 the cast is the same tensor; Megatron's fused softmax runs in the compute dtype: saved once
    assert "attn_probs" not in layer_terms(make(llama3_8b(), "torch", seq=T, attention="eager", precision="fp32"))
    mega = layer_terms(make(llama3_8b(), "megatron", seq=T, attention="eager"))
    assert mega["attn_softmax"] == 2 * a * T * T and "attn_probs" not in mega


def test_gqa_expand_saves_all_head_kv_copies():
    # torchtune's MultiHeadAttention copies the 8 K/V heads of Llama-3-8B to all 32 query heads before SDPA
    # (`expand(...).flatten(1, 2)`), and SDPA saves the copies: K and V each 2 B x T x 32 x 128 instead of x 8
    T, a, g, d = 2048, 32, 8, 128
    native = layer_terms(make(llama3_8b(), "torch", seq=T))
    expand = layer_terms(make(llama3_8b(), "torch", seq=T, gqa_impl="expand"))
    assert native["k"] == native["v"] == 2 * T * g * d == 4_194_304
    assert expand["k"] == expand["v"] == 2 * T * a * d == 16_777_216
    assert {k: v for k, v in expand.items() if k not in ("k", "v")} == \
        {k: v for k, v in native.items() if k not in ("k", "v")}
    # under TP each rank expands its own 8/t K/V heads to its 32/t query heads
    tp = layer_terms(make(llama3_8b(), "torch", seq=T, gqa_impl="expand", tp=4, gpus=4))
    assert tp["k"] == 2 * T * (a // 4) * d
    # nothing to expand without GQA, and eager attention expands either way
    mha = llama3_8b(kv_heads=32)
    assert layer_terms(make(mha, "torch", seq=T, gqa_impl="expand")) == layer_terms(make(mha, "torch", seq=T))
    eager = dict(seq=T, attention="eager")
    assert layer_terms(make(llama3_8b(), "torch", gqa_impl="expand", **eager)) == \
        layer_terms(make(llama3_8b(), "torch", **eager))


def test_tp_sp_torch_saves_the_gathered_input_megatron_the_shard():
    T, h, t = 4096, 4096, 4
    kw = dict(seq=T, tp=t, sp=True, gpus=t)
    torch_t = layer_terms(make(llama3_8b(), "torch", master_weights=False, **kw))
    mega_t = layer_terms(make(llama3_8b(), "megatron", **kw))
    assert torch_t["attn_norm"] == mega_t["attn_norm"] == 2 * T // t * h + 4 * T // t  # sequence-sharded
    assert torch_t["qkv_input"] == torch_t["mlp_input"] == 2 * T * h  # DTensor: the all-gathered tensor
    assert mega_t["qkv_input"] == mega_t["mlp_input"] == 2 * T * h // t  # re-gathered in backward
    assert torch_t["q"] == mega_t["q"] == 2 * T * (32 // t) * 128


def test_moe_layer_terms_and_ep_independence():
    T, h, E, k, f = 4096, 4096, 8, 2, 14336
    m = llama3_8b(moe=MoESpec(experts=E, top_k=k, expert_ffn=f), vocab=32000)
    r = make(m, "torch", seq=T, gpus=2)
    terms = layer_terms(r)
    # HF MixtralSparseMoeBlock under AMP (fp32 weights, bf16 autocast: stream s = 4 B, compute c = 2 B), R = k T
    # routed copies; every term measured to the byte by the harness (tests/test_validate_moe.py)
    R = k * T
    assert terms["mlp_input"] == 2 * T * h  # the router's bf16 cast of the fp32 norm output (no shared experts)
    assert terms["moe_router_probs"] == 4 * T * E  # softmax(dtype=float) output
    # topk's int64 indices, the renormalised fp32 weights and their sum: 8 T k + 4 T k + 4 T = 114,688
    assert terms["moe_routing_metadata"] == 8 * T * k + 4 * T * k + 4 * T == 114_688
    assert terms["moe_token_indices"] == 16 * R  # torch.where's int64 (slot, token) pairs
    assert terms["moe_dispatched_input"] == 2 * (2 * R * h)  # gate and up each save their bf16 cast
    assert terms["moe_combine"] == 2 * R * h + 4 * R  # bf16 expert output + fp32 weight slice
    assert terms["moe_weighted_output"] == 4 * R * h  # index_add_'s fp32 source
    assert terms["moe_expert_gate_up_output"] == 2 * 2 * k * T * f
    assert terms["moe_expert_silu_output"] == terms["moe_expert_act_output"] == 2 * k * T * f
    assert "mlp_fc_output" not in terms and "mlp_gate_up_output" not in terms
    # balanced routing: each rank receives k*T token copies whatever ep is
    assert layer_bytes(make(m, "torch", seq=T, gpus=2, ep=2)) == layer_bytes(r)


def test_loss_terms_llama3_vocab():
    """DESIGN sec. 4: the fp32 logits of s = 4096, V = 128k, b = 1 are about 2 GiB."""
    T, V = 4096, 128256
    n = T * V
    r = make(llama3_8b(), "torch", seq=T)
    assert last_stage_terms(r)["loss_logits_fp32"] == 4 * n == 2_101_346_304  # 1.96 GiB
    # torch: bf16 logits + fp32 upcast at the loss; nll and log_softmax gradients (2 x fp32) in backward
    assert loss_transients(r) == (2 * n + 4 * n, 8 * n)
    # Megatron: upcast in place into the saved softmax, gradient in place, then its bf16 cast
    # (128256 = 1002 * 128: no padding at t = 1)
    assert loss_transients(make(llama3_8b(), "megatron", seq=T)) == (2 * n, 2 * n)
    # chunked-eager (torchtune CEWithChunkedOutputLoss without compile; lit-gpt): every chunk's fp32 log-softmax
    # is saved (the loss is their sum), so the saved part is the full loss's; forward adds the bf16 logits list
    # and one chunk's upcast, backward one chunk's nll and log_softmax gradients (fp32)
    g = (T // LOSS_CHUNKS) * V  # 512 tokens x 128256
    re = make(llama3_8b(), "torch", seq=T, loss="chunked-eager")
    assert last_stage_terms(re)["loss_logits_fp32"] == 4 * n
    assert last_stage_terms(re)["loss_logits_compute_dtype"] == 0
    assert loss_transients(re) == (2 * n + 4 * g, 8 * g)
    # chunked (compiled, as torchtune compiles it): the bf16 logits and two fp32 per token (row max and
    # log-sum-exp) are saved; nothing logit-sized in forward; one bf16 chunk gradient beside the logits
    rc = make(llama3_8b(), "torch", seq=T, loss="chunked")
    assert last_stage_terms(rc)["loss_logits_fp32"] == 8 * T == 32_768
    assert last_stage_terms(rc)["loss_logits_compute_dtype"] == 2 * n == 1_050_673_152  # 0.98 GiB
    assert loss_transients(rc) == (0, 2 * g)
    # at micro-batch 2 a chunk is 2 x ceil(s/8) tokens (tensor_split along the sequence): s = 4100 -> 513
    r2 = make(llama3_8b(), "torch", seq=4100, micro_batch=2, loss="chunked")
    assert loss_transients(r2) == (0, 2 * 2 * 513 * V)
    # lit-gpt, pure bf16: 128-token chunks, bf16 log-softmax saved (no upcast) beside the logits list the loop
    # keeps until the next forward; backward: one chunk's nll and log_softmax gradients in bf16
    rl = make(llama3_8b(), "torch", seq=T, loss="lit-gpt", precision="bf16", master_weights=False)
    g128 = 128 * V
    assert last_stage_terms(rl)["loss_logits_fp32"] == 0
    assert last_stage_terms(rl)["loss_logits_compute_dtype"] == 2 * n + 2 * n
    assert loss_transients(rl) == (0, 2 * 2 * g128)
    assert loss_kept_bytes(rl) == 2 * n == stage_activations(rl, 0).loss_kept_bytes
    # under torch AMP autocast runs the cross-entropy in fp32: the fp32 log-softmax is saved and one chunk's fp32
    # cast is a forward transient; the kept list stays bf16
    ra = make(llama3_8b(), "torch", seq=T, loss="lit-gpt")
    assert last_stage_terms(ra)["loss_logits_fp32"] == 4 * n
    assert last_stage_terms(ra)["loss_logits_compute_dtype"] == 2 * n
    assert loss_transients(ra) == (4 * g128, 2 * 4 * g128)


def test_loop_kept_logits_terms():
    """--keep-logits: a loop holding `logits` keeps them saved-like from the loss until the next forward. Llama 3 8B,
    4096 tokens, bf16 AMP: n = 4096 x 128256 logits. compute (nanoGPT): 2n kept, and the forward transient drops
    to the fp32 upcast alone (the bf16 logits are the kept ones); the stranded block is gone (the hole the loss
    gradient finds is the upcast's, fp32-sized). fp32 (torchtune 0.1's `.float()` in the model): 4n kept, no
    forward transient at the loss (the bf16 logits were freed by the upcast), the bf16 hole stays stranded."""
    from memcalc.cost.activations import loss_stranded_bytes

    T, V = 4096, 128256
    n = T * V
    none = make(llama3_8b(), "torch", seq=T)
    comp = make(llama3_8b(), "torch", seq=T, keep_logits="compute")
    up = make(llama3_8b(), "torch", seq=T, keep_logits="fp32")
    assert last_stage_terms(none)["loop_kept_logits"] == loss_kept_bytes(none) == 0
    assert last_stage_terms(comp)["loop_kept_logits"] == loss_kept_bytes(comp) == 2 * n == 1_050_673_152
    assert last_stage_terms(up)["loop_kept_logits"] == loss_kept_bytes(up) == 4 * n == 2_101_346_304
    assert loss_transients(none) == (2 * n + 4 * n, 8 * n)
    assert loss_transients(comp) == (4 * n, 8 * n)
    assert loss_transients(up) == (0, 8 * n)
    assert (loss_stranded_bytes(none), loss_stranded_bytes(comp), loss_stranded_bytes(up)) == (2 * n, 0, 2 * n)
    # the moment at the loss's forward holds the same bytes with `compute` (kept 2n + upcast 4n + log-softmax 4n)
    # as without (bf16 2n + upcast 4n + log-softmax 4n); backward and the optimizer step hold the kept bytes more
    a0, a1, a2 = (stage_activations(r, 0) for r in (none, comp, up))
    assert a1.forward_bytes == a0.forward_bytes and a2.forward_bytes == a0.forward_bytes - 2 * n
    assert a1.backward_first_bytes - a0.backward_first_bytes == 2 * n
    assert a2.backward_first_bytes - a0.backward_first_bytes == 4 * n
    assert (a1.loss_kept_bytes, a2.loss_kept_bytes) == (2 * n, 4 * n)
    # fp32: the upcast is made at the head while the previous micro-batch's fp32 logits are still held
    assert a2.forward_head_bytes - a0.forward_head_bytes == 4 * n + 4 * n


def test_embedding_terms_with_dropout_and_sp():
    T, h, t = 2048, 6144, 8
    r = make(gpt(h, 64), "megatron", seq=T, tp=t, gpus=t)
    assert first_stage_terms(r) == {"embedding_input_ids": 8 * T, "embedding_dropout_mask": T * h // t}


def test_context_parallel_divides_the_sequence_and_adds_ring_buffers():
    T, cp, g, d = 8192, 4, 8, 128
    m = llama3_8b(layers=4)
    r1 = make(m, "megatron", seq=T, gpus=cp, dp=cp)
    r4 = make(m, "megatron", seq=T, cp=cp, gpus=cp)
    assert layer_bytes(r4) * cp == layer_bytes(r1)  # every term is per token, flash: nothing s x s
    a4 = stage_activations(r4, 0)
    kv_local = 2 * 2 * (T // cp) * g * d  # K and V of the local sequence chunk, bf16
    assert a4.detail["cp_ring_kv_transient"] == 4 * kv_local  # K/V and dK/dV blocks in flight in backward
    assert stage_activations(r1, 0).detail["cp_ring_kv_transient"] == 0


def test_recompute_layers_and_transients():
    L, T, h = 8, 2048, 4096
    m = llama3_8b(layers=L)
    plain = layer_bytes(make(m, "megatron", seq=T))
    r = make(m, "megatron", seq=T, recompute="full", recompute_layers=3)
    sa = stage_activations(r, 0)
    ckpt = 2 * T * h
    assert layer_bytes(r, "full") == ckpt
    layers_part = 3 * ckpt + 5 * plain
    assert sa.held_bytes - layers_part == sum(first_stage_terms(r).values()) + sum(last_stage_terms(r).values()) \
        + 2 * 2 * T * 128  # rotary cos/sin
    # one layer re-materialised besides its input ...
    assert recompute_transient_bytes(r) == plain - ckpt
    # ... but with the block method backward reaches the 3 checkpointed layers after the 5 plain ones of this
    # micro-batch have freed theirs: nothing on top of the held activations
    assert sa.detail["recompute_transient"] == 0
    ra = make(m, "megatron", seq=T, recompute="full")  # every layer checkpointed
    assert stage_activations(ra, 0).detail["recompute_transient"] == plain - ckpt
    # selective with flash: only the log-sum-exp is dropped; recomputing brings back the output and the LSE
    # when the backward reaches the core, after the o-projection and MLP freed theirs (net negative)
    rs = make(m, "megatron", seq=T, recompute="selective")
    assert layer_bytes(rs, "selective") == plain - 4 * T * 32
    f = 14336
    after_core = 2 * T * h + (2 * T * h + 4 * T) + 2 * T * h + 3 * 2 * T * f  # o-proj in, norm, MLP in, SwiGLU
    assert recompute_transient_bytes(rs) == 4 * T * 32 + 2 * T * h - after_core < 0
    assert stage_activations(rs, 0).detail["recompute_transient"] == 0


def test_recompute_every_places_the_checkpointed_layers():
    """--recompute-every K (torchtitan's selective_ac_option = K): the K-th, 2K-th, ... layer of a stage is
    checkpointed, so the last layer may be, and backward re-runs it before any plain layer has freed its set; with
    --recompute-layers the same count is the first layers (Megatron's block method), reached after every plain one.
    fp32 (no autocast casts), torch profile, 4 layers, seq 2048."""
    from memcalc.cost.compute import stage_recomputed_layers

    m = llama3_8b(layers=4)
    T = 2048
    plain = layer_bytes(make(m, "torch", seq=T, precision="fp32"))
    every = make(m, "torch", seq=T, precision="fp32", recompute="full", recompute_every=2)
    block = make(m, "torch", seq=T, precision="fp32", recompute="full", recompute_layers=2)
    ckpt = 4 * T * 4096  # the fp32 layer input
    assert layer_bytes(every, "full") == ckpt
    se, sb = stage_activations(every, 0), stage_activations(block, 0)
    # the same two plain and two checkpointed layers held ...
    assert se.held_bytes == sb.held_bytes
    assert stage_recomputed_layers(every, 0) == stage_recomputed_layers(block, 0) == 2
    # ... but layer 4 (1-based) is checkpointed: re-run whole with nothing freed; the block method reaches its
    # checkpointed layers after both plain ones have freed theirs (2 x plain > plain - ckpt)
    assert se.detail["recompute_transient"] == plain - ckpt
    assert sb.detail["recompute_transient"] == 0
    # the k-th layer from the last (`mixed_at`): every-2 from the top is ck, plain, ck, plain; each moment holds
    # the sets above it freed: k = 1 (plain) finds one checkpoint freed, k = 2 (re-run) a plain set and a
    # checkpoint freed and its own re-run set (plain - ckpt) back, k = 3 (plain) one plain and two checkpoints
    e1, e2, e3 = (se.mixed_at(k, "layer") for k in (1, 2, 3))
    assert e2 - e1 == -plain + (plain - ckpt) == -ckpt
    assert e3 - e1 == -plain - ckpt
    # block from the top: plain, plain, ck, ck
    b1, b2, b3 = (sb.mixed_at(k, "layer") for k in (1, 2, 3))
    assert b2 - b1 == -plain + (plain - ckpt)
    assert b3 - b2 == -ckpt
    assert e1 - b1 == plain - ckpt  # k = 1 frees a checkpoint (every) or a plain set (block)
    # 6 layers over pp 2 every 2: a stage's layers 2 (its 3 layers give one), and the torch profile's counts
    six = make(llama3_8b(layers=6), "torch", seq=T, recompute="full", recompute_every=2, pp=2, gpus=2)
    assert [int(stage_recomputed_layers(six, s)) for s in (0, 1)] == [1, 1]


def test_amp_full_recompute_casts_in_the_saved_sets():
    """AMP (fp32 weights under autocast) with full recompute and no pipelining: the autocast cache goes with each
    micro-batch's forward region, so a plain layer keeps its weights' bf16 casts through its matmuls' saved tensors
    until its backward, and a checkpointed layer's re-run casts its weights again (activations._saved_cast_terms).
    Llama-3-8B shapes: q and o 4096 x 4096, k and v 1024 x 4096, gate, up and down 14336 x 4096 weights, 2 B
    each (no biases)."""
    m = llama3_8b(layers=4)
    T = 2048
    r = make(m, "torch", seq=T, precision="bf16", recompute="full", recompute_layers=1)
    terms = layer_terms(r)
    assert terms["amp_weight_casts_qkv"] == 2 * (4096 * 4096 + 2 * 1024 * 4096) == 50_331_648
    assert terms["amp_weight_casts_o_mlp"] == 2 * (4096 * 4096 + 2 * 14336 * 4096) == 268_435_456
    assert terms["amp_weight_casts_down"] == 2 * 14336 * 4096 == 117_440_512
    casts = 50_331_648 + 268_435_456 + 117_440_512  # one layer's: 436 MB
    # the three plain layers' casts are held among the saved sets, and leave the forward buffer
    sa = stage_activations(r, 0)
    assert sum(sa.detail[k] for k in terms if k.startswith("amp_weight_casts")) == 3 * casts
    from memcalc.cost.buffers import stage_buffers

    fwd = stage_buffers(r, 0)["amp_weight_casts"].bytes
    assert fwd == stage_buffers(make(m, "torch", seq=T, precision="bf16", recompute="full"), 0)[
        "amp_weight_casts"].bytes - 3 * casts
    # the re-run of a checkpointed layer makes its casts again (in its re-run set)
    ra = make(m, "torch", seq=T, precision="bf16", recompute="full")
    assert recompute_transient_bytes(ra) == sum(layer_terms(ra).values()) - layer_bytes(ra, "full")
    assert "amp_weight_casts_down" in layer_terms(ra)
    # none without autocast, without full recompute, or under pipelining (the step's cache keeps every cast)
    for kw in (dict(precision="fp32", recompute="full"), dict(precision="bf16"),
               dict(precision="bf16", recompute="full", pp=2, gpus=2)):
        assert not any(v for k, v in layer_terms(make(m, "torch", seq=T, **kw)).items() if k.startswith("amp_")), kw


def test_full_recompute_of_a_single_layer_rematerialises_it_whole():
    """One layer per stage and one micro-batch: full recompute re-runs the whole layer at the start of its
    backward, so the backward peak holds the full layer anyway; it only avoids stacking it on the logits gradient
    (freed before the layer's backward, with the rest of what the loss and the LM head saved: the re-run starts
    when the final norm's backward has run, measured by the harness at seq 512). The invariants below therefore
    use >= 2 layer-micro-batches per stage."""
    m = llama3_8b(layers=1, vocab=32000)
    T, h = 2048, 4096
    r_none, r_full = make(m, "megatron", seq=T), make(m, "megatron", seq=T, recompute="full")
    none, full = stage_activations(r_none, 0), stage_activations(r_full, 0)
    plain, ckpt = layer_bytes(r_none), 2 * T * h
    loss_bwd = loss_transients(r_none)[1]
    # Megatron's LM-head backward comes right after the loss gradient: the bf16 logits gradient (2Tv), the head's
    # input gradient (2Th) and gradient-accumulation fusion's dummy weight gradient (2vh) are live, the loss's
    # fp32 softmax (4Tv) is freed: 131,072,000 + 16,777,216 + 262,144,000 - 262,144,000 B
    V = 32000
    head_bwd = 2 * T * V + 2 * T * h + 2 * V * h - 4 * T * V
    assert head_bwd == 147_849_216 > loss_bwd == 2 * T * V
    assert plain - ckpt > head_bwd
    assert none.backward_first_bytes == none.held_bytes + head_bwd
    assert full.held_bytes == none.held_bytes - plain + ckpt
    loss_saved = sum(last_stage_terms(r_full).values())  # final norm, LM-head input, fp32 logits
    assert full.backward_first_bytes == full.held_bytes + max(head_bwd, plain - ckpt - loss_saved)
    # inside the layer's backward the re-run layer is whole, as without recompute
    assert full.backward_layer_bytes == none.backward_layer_bytes


def test_activation_offloading_keeps_two_layers_on_the_gpu():
    """--offload-activations (docs/methodology.md "Activation offloading"): every layer's saved set goes to host
    memory; the device keeps the last layer run and the one before it (its copy in flight in forward, reloaded
    ahead of its backward). Measured by the harness (docs/validation.md rows 72-78)."""
    m = llama3_8b(layers=8, vocab=32000)
    T, h = 2048, 4096
    base = make(m, "torch", seq=T)
    none, off = stage_activations(base, 0), stage_activations(make(m, "torch", seq=T, offload_activations=True), 0)
    layer = layer_bytes(base)
    assert off.host_bytes == 8 * layer and none.host_bytes == 0
    assert off.held_bytes == none.held_bytes - 7 * layer  # at the loss: the last layer's set
    assert off.forward_layer_end_bytes == none.forward_layer_end_bytes - 6 * layer  # the last two
    assert off.backward_layer_bytes == none.backward_layer_bytes - 6 * layer  # the layer and the reloaded one
    assert off.layer_freed_bytes == 0  # a finished layer's place is taken by the next one reloaded
    assert off.offloaded_layer_at(7) == off.backward_layer_bytes - layer  # the first layer: nothing to reload
    assert off.detail["layers_offloaded_to_host"] == -8 * layer
    assert off.detail["offload_resident_layers"] == 2 * layer
    # full recompute: what goes to the host is the checkpointed inputs, 4*T*h bytes each: the residual stream,
    # fp32 under autocast (`_stream_bytes`; measured, docs/validation.md row 122)
    full = stage_activations(make(m, "torch", seq=T, recompute="full", offload_activations=True), 0)
    assert full.host_bytes == 8 * 4 * T * h
    # 1F1B: the first of 2 stages holds 2 micro-batches; both micro-batches' 4 layers go to the host
    r_pp = make(m, "megatron", seq=T, pp=2, gpus=2, grad_accum=4, offload_activations=True)
    pp = stage_activations(r_pp, 0)
    assert pp.in_flight == 2 and pp.host_bytes == 2 * 4 * layer_bytes(r_pp)
    # one layer: nothing to gain (it is the layer being run)
    m1 = llama3_8b(layers=1, vocab=32000)
    one_off = stage_activations(make(m1, "torch", seq=T, offload_activations=True), 0)
    one = stage_activations(make(m1, "torch", seq=T), 0)
    assert (one_off.forward_bytes, one_off.backward_layer_bytes) == (one.forward_bytes, one.backward_layer_bytes)


def test_pipeline_micro_batches_in_flight():
    m = llama3_8b(layers=24)

    def flights(pp, ga, schedule=None, vpp=1):
        r = make(m, "megatron", seq=1024, pp=pp, gpus=pp, grad_accum=ga, vpp=vpp, schedule=schedule)
        return [int(in_flight(r, i)) for i in range(pp)]

    assert flights(4, 8) == [4, 3, 2, 1]  # 1F1B: min(m, pp - i)
    assert flights(4, 2) == [2, 2, 2, 1]
    assert flights(4, 8, "gpipe") == [8, 8, 8, 8]
    # interleaved: 2(pp-i-1) + (vpp-1)pp + 1 chunks; stage 0: 11 chunks of 3 layers = 24 * (1 + 3/8)
    assert flights(4, 8, "interleaved", 2) == [11, 9, 7, 5]
    assert flights(4, 4, "interleaved", 2) == [8, 8, 8, 8]  # m == pp: all forwards first (Megatron)
    assert flights(1, 8) == [1]  # gradient accumulation without a pipeline: one micro-batch at a time


# ---------------------------------------------------------------------------------------------------------------
# Array form (planner): elementwise equal to the scalar results
# ---------------------------------------------------------------------------------------------------------------

ARRAY_FIELDS = ("gpus", "dp", "tp", "pp", "vpp", "cp", "ep", "micro_batch", "grad_accum", "global_batch")


def _as_arrays(runs, stages):
    base = runs[0]
    arrays = {f: np.array([getattr(r, f) for r in runs], dtype=np.int64) for f in ARRAY_FIELDS}
    return base.replace(**arrays), np.array(stages, dtype=np.int64)


def _layouts(schedule):
    """(tp, pp, vpp, cp, micro_batch, grad_accum, stage) valid for a 24-layer model."""
    out = []
    for tp in (1, 2, 4):
        for pp in (1, 2, 3, 4):
            for cp in (1, 2):
                for mb, ga in ((1, 1), (2, 3), (1, 8)):
                    vpp = 2 if schedule == "interleaved" else 1
                    if schedule == "interleaved" and pp == 1:
                        continue
                    for stage in sorted({0, pp // 2, pp - 1}):
                        out.append((tp, pp, vpp, cp, mb, ga, stage))
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "gpipe"])
@pytest.mark.parametrize("profile,model,recompute,attention", [
    ("megatron", "llama", "selective", "flash"),
    ("torch", "llama", "full", "eager"),
    ("torch", "gpt", "none", "eager"),
    ("deepspeed", "moe", "full", "flash"),
    ("torch", "llama", "offload", "flash"),  # activation offloading with 2 of the layers checkpointed
    ("torch", "llama", "qlora", "flash"),  # nf4 base with its head (dequantized copies), LoRA on all, dropout
    ("torch", "llama", "qlora-full", "flash"),  # the same with 2 of the layers checkpointed
])
def test_array_form_equals_scalar(schedule, profile, model, recompute, attention):
    m = {"llama": llama3_8b(layers=24, vocab=32000), "gpt": gpt(1024, 16, 24),
         "moe": llama3_8b(layers=24, vocab=32000, moe=MoESpec(experts=8, top_k=2, expert_ffn=1024))}[model]
    runs, stages = [], []
    off = recompute == "offload"
    qlora = dict(lora_rank=8, lora_targets="all", lora_dropout=0.1, base_dtype="nf4", quantize_head=True) \
        if recompute.startswith("qlora") else {}
    recompute = {"offload": "full", "qlora": "none", "qlora-full": "full"}.get(recompute, recompute)
    for tp, pp, vpp, cp, mb, ga, stage in _layouts(schedule):
        r = make(m, profile, seq=2048, tp=tp, pp=pp, vpp=vpp, cp=cp, micro_batch=mb, grad_accum=ga, gpus=tp * pp * cp,
                 schedule=schedule, recompute=recompute, recompute_layers=2 if recompute == "full" else None,
                 attention=attention, sp=True, offload_activations=off, **qlora)
        runs.append(r.replace(sp=True))  # SP is categorical: one value for the whole array
        stages.append(stage)
    arr_run, arr_stage = _as_arrays(runs, stages)
    got = stage_activations(arr_run, arr_stage)
    for i, (r, s) in enumerate(zip(runs, stages)):
        want = stage_activations(r, s)
        for f in ("held_bytes", "forward_bytes", "backward_first_bytes", "backward_later_bytes", "in_flight",
                  "backward_layer_bytes", "host_bytes", "forward_head_bytes", "forward_layer_end_bytes",
                  "backward_later_layer_bytes", "loss_stranded_bytes", "forward_layer_bytes",
                  "forward_checkpointed_mlp_bytes", "forward_checkpointed_down_bytes"):
            assert int(np.broadcast_to(getattr(got, f), arr_stage.shape)[i]) == int(getattr(want, f)), (f, i)
        if off:
            for k in (1, 3, 5):
                assert int(np.broadcast_to(got.offloaded_layer_at(k), arr_stage.shape)[i]) == \
                    int(want.offloaded_layer_at(k)), (k, i)
        assert set(got.detail) == set(want.detail)
        for k, v in want.detail.items():
            assert int(np.broadcast_to(got.detail[k], arr_stage.shape)[i]) == int(v), (k, i)


# ---------------------------------------------------------------------------------------------------------------
# Invariants (hypothesis)
# ---------------------------------------------------------------------------------------------------------------

MODELS = st.sampled_from(["gpt", "llama", "moe", "neox", "phi"])
PROFILES = st.sampled_from(["torch", "megatron", "deepspeed"])


def _model(kind: str, layers: int = 8) -> ModelSpec:
    if kind == "gpt":
        return gpt(1024, 16, layers, vocab=50257)
    if kind in ("neox", "phi"):  # parallel blocks: two norms (GPT-NeoX) or one shared (phi)
        base = gpt(1024, 16, layers, vocab=50257, dropout=0.0).model_dump()
        return ModelSpec(**{**base, "positions": "rotary", "tied_embeddings": False, "head_bias": kind == "phi",
                            "block": "parallel" if kind == "neox" else "parallel-shared-norm"})
    if kind == "llama":
        return llama3_8b(layers=layers, hidden=2048, heads=16, kv_heads=8, ffn=5632, vocab=32000)
    return llama3_8b(layers=layers, hidden=2048, heads=16, kv_heads=8, ffn=5632, vocab=32000,
                     moe=MoESpec(experts=8, top_k=2, expert_ffn=1408))


def _peaks(r, stage=0):
    sa = stage_activations(r, stage)
    return (sa.held_bytes, sa.forward_bytes, max(sa.backward_first_bytes, sa.backward_later_bytes))


common = dict(
    kind=MODELS, profile=PROFILES, attention=st.sampled_from(["flash", "eager"]),
    loss=st.sampled_from(["full", "chunked", "chunked-eager", "lit-gpt"]), seq=st.sampled_from([512, 2048]),
)


@settings(max_examples=60, deadline=None)
@given(**common, tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]), ga=st.sampled_from([1, 3, 8]),
       mb=st.sampled_from([1, 2]))
def test_more_recompute_never_raises_activations(kind, profile, attention, loss, seq, tp, pp, ga, mb):
    prev = None
    for rec in ("none", "selective", "full"):
        r = make(_model(kind), profile, seq=seq, tp=tp, pp=pp, gpus=tp * pp, grad_accum=ga, micro_batch=mb,
                 recompute=rec, attention=attention, loss=loss)
        cur = [_peaks(r, s) for s in range(pp)]
        if prev is not None:
            for p_s, c_s in zip(prev, cur):
                assert all(c <= p for c, p in zip(c_s, p_s)), (rec, c_s, p_s)
        prev = cur


@settings(max_examples=60, deadline=None)
@given(**common, recompute=st.sampled_from(["none", "selective", "full"]))
def test_more_tp_with_sp_never_raises_activations(kind, profile, attention, loss, seq, recompute):
    prev = None
    for tp in (1, 2, 4, 8):
        r = make(_model(kind), profile, seq=seq, tp=tp, gpus=tp, sp=True, recompute=recompute, attention=attention,
                 loss=loss)
        cur = _peaks(r)
        if prev is not None:
            assert all(c <= p for c, p in zip(cur, prev)), (tp, cur, prev)
        prev = cur


@settings(max_examples=60, deadline=None)
@given(**common, recompute=st.sampled_from(["none", "selective", "full"]), tp=st.sampled_from([1, 2]))
def test_more_cp_never_raises_activations(kind, profile, attention, loss, seq, recompute, tp):
    prev = None
    for cp in (1, 2, 4, 8):
        if profile == "deepspeed" and a2a_cp_limit(_model(kind), tp) % cp:
            break  # DeepSpeed-Ulysses shards the heads: cp must divide them
        r = make(_model(kind), profile, seq=seq, tp=tp, cp=cp, gpus=tp * cp, recompute=recompute,
                 attention=attention, loss=loss)
        cur = _peaks(r)
        if prev is not None:
            assert all(c <= p for c, p in zip(cur, prev)), (cp, cur, prev)
        prev = cur


@settings(max_examples=60, deadline=None)
@given(**common, recompute=st.sampled_from(["none", "selective", "full"]), pp=st.sampled_from([1, 2, 4]),
       ga=st.sampled_from([1, 4, 8]))
def test_smaller_micro_batch_never_raises_activations(kind, profile, attention, loss, seq, recompute, pp, ga):
    prev = None
    for mb in (8, 4, 2, 1):
        r = make(_model(kind), profile, seq=seq, pp=pp, gpus=pp, micro_batch=mb, grad_accum=ga,
                 recompute=recompute, attention=attention, loss=loss)
        cur = [_peaks(r, s) for s in range(pp)]
        if prev is not None:
            for p_s, c_s in zip(prev, cur):
                assert all(c <= p for c, p in zip(c_s, p_s)), (mb, c_s, p_s)
        prev = cur


@settings(max_examples=60, deadline=None)
@given(kind=MODELS, profile=PROFILES, schedule=st.sampled_from(["1f1b", "interleaved", "gpipe"]),
       pp=st.sampled_from([2, 3, 4]), ga=st.sampled_from([1, 2, 4, 8, 16]),
       recompute=st.sampled_from(["none", "selective", "full"]))
def test_first_stage_holds_the_most(kind, profile, schedule, pp, ga, recompute):
    """Earlier stages hold at least as many in-flight layer activations per layer as later ones (Korthikanti sec.
    4.2.3: the first stage is the worst for the layers). Where the extra layers of an uneven split go to the first
    stages (megatron, deepspeed), the first stage also holds at least as much as any stage but the last (whose loss
    terms are its own); torch's split (torchtitan's) gives the first stage the fewest, so there only the per-layer
    order holds."""
    from memcalc.cost.params import stage_layers

    assume(not (schedule == "interleaved" and 24 % (pp * 2)))
    m = _model(kind, 25)  # 25 layers: uneven stages
    if schedule == "interleaved":
        m = _model(kind, 24)
    r = make(m, profile, seq=1024, pp=pp, gpus=pp, grad_accum=ga, recompute=recompute,
             schedule=schedule, vpp=2 if schedule == "interleaved" else 1)
    layer_keys = set(layer_terms(r)) | set(layer_terms(r, recompute))
    acts = [stage_activations(r, s) for s in range(pp)]
    layers = [sum(v for k, v in a.detail.items() if k in layer_keys) for a in acts]
    counts = [int(stage_layers(r, s)) for s in range(pp)]
    # per layer, as exact fractions: layers[s] / counts[s] non-increasing in s
    assert all(layers[s] * counts[s + 1] >= layers[s + 1] * counts[s] for s in range(pp - 1)), (layers, counts)
    if profile == "torch":
        return
    assert layers == sorted(layers, reverse=True), layers
    for a in acts[1:-1]:
        assert acts[0].held_bytes >= a.held_bytes
        assert acts[0].forward_bytes >= a.forward_bytes


def test_torchtitan_op_level_sac_terms():
    """--recompute op = torchtitan's selective_ac_option 'op' (torchtitan/distributed/activation_checkpoint.py):
    per layer it keeps the checkpoint input, every other matmul output (q, v, gate, down of q k v o gate up down)
    and the SDPA output + log-sum-exp. Llama 3.1 8B under FSDP2 bf16 (no autocast: the stream is bf16), local
    batch 2 x 8192 = 16,384 tokens: input, q, down and the attention output 2 x 16384 x 4096 = 134,217,728 B
    each; v 2 x 16384 x 1024 = 33,554,432; gate 2 x 16384 x 14336 = 469,762,048; lse 4 x 16384 x 32 = 2,097,152:
    1,042,284,544 B per layer (63,616 B per token). The forward terms are exact on the CPU harness
    (docs/validation.md rows 57-59)."""
    from memcalc.options import RunOptions, build_run

    r = build_run(RunOptions(model="llama-3.1-8b", gpus=8, zero=3, precision="bf16", seq=8192, micro_batch=2,
                             recompute="op"))
    terms = layer_terms(r, "op")
    assert terms == {"checkpoint_input": 134_217_728, "sac_q_output": 134_217_728, "sac_v_output": 33_554_432,
                     "sac_gate_output": 469_762_048, "sac_down_output": 134_217_728,
                     "sac_attn_output": 134_217_728, "attn_lse": 2_097_152}
    assert sum(terms.values()) == 1_042_284_544 == 63_616 * 16_384
    # between Megatron-style selective (everything but the attention core) and full recompute
    plain = sum(layer_terms(r, "selective").values())
    assert layer_terms(r, "full")["checkpoint_input"] < sum(terms.values()) < plain


def test_torch_interleaved_pipeline_holds_its_sends():
    """torch's ScheduleInterleaved1F1B (PP2, vpp 2, m 4, 4 layers: one per chunk) runs on rank 0
    0F0 0F1 2F0 2F1 0F2 | 2B0 0F3 2B1 2F2 0B0 2F3 0B1 | 2B2 2B3 0B2 0B3 (torch's pipeline_order) and waits for its
    sends only when the step ends. At its last steady-state backward (0B1) it holds 5 chunk forwards; the 3
    backwards already done (2B0, 2B1, 0B0) left their outputs (both chunks send forward) and 2 input gradients
    (chunk 0 is the global first stage: it sends none): 5 stream tensors of 64 x 64 x 4 = 16,384 B (measured,
    docs/validation.md row 54). Of the 5 chunk units held, the 2 on chunk 1 (global stage 2) have their input in a
    receive buffer, not a new allocation."""
    from memcalc.options import RunOptions, build_run

    r = build_run(RunOptions(layers=4, hidden=64, heads=4, ffn=176, vocab=512, seq=64, precision="fp32", gpus=2,
                             pp=2, vpp=2, grad_accum=4))
    a = stage_activations(r, 0)
    assert a.in_flight == 5
    assert a.detail["pipeline_sent_transient"] == 5 * 16_384
    assert a.detail["pipeline_input_in_recv_buffer"] == -2 * 16_384


def test_torch_interleaved_rounds_and_warm_up():
    """torch's ScheduleInterleaved1F1B (torch/distributed/pipelining/schedules.py): rounds = max(1, m // pp),
    `microbatches_per_round` g = m // rounds, warm-up (vpp - 1) * g + 2 * (pp - 1 - rank) chunk forwards (at most
    m * vpp), one more before the first backward. Megatron's groups stay pp, and it runs every forward first when
    m == pp. PP2 x vpp 2, 4 layers:
    m 2: g 2, one round; rank 1: 2 + 0 + 1 = 3 chunks (Megatron: all 4); rank 0: min(2 + 2 + 1, 4) = 4.
    m 3: g 3 (torch's flexible rounds), one round; rank 1: 3 + 1 = 4 of 6.
    m 6: g 2, three rounds; rank 1: 2 + 1 = 3."""
    from memcalc.cost.activations import in_flight
    from memcalc.cost.params import interleave_group, interleave_rounds
    from memcalc.options import RunOptions, build_run

    def run(m: int, profile: str = "torch"):
        return build_run(RunOptions(layers=4, hidden=64, heads=4, ffn=176, vocab=512, seq=64, precision="bf16",
                                    gpus=2, pp=2, vpp=2, grad_accum=m, profile=profile))

    assert [(int(interleave_group(run(m))), int(interleave_rounds(run(m)))) for m in (2, 3, 4, 6)] == [
        (2, 1), (3, 1), (2, 2), (2, 3)]
    assert [int(in_flight(run(m), 1)) for m in (2, 3, 6)] == [3, 4, 3]
    assert int(in_flight(run(2), 0)) == 4
    assert int(in_flight(run(2, "megatron"), 1)) == 4 and int(interleave_group(run(3, "megatron"))) == 2


def test_torch_one_round_interleaved_later_backward_finds_only_the_last_chunk_gradients():
    """In one round every chunk's backwards follow all of the later chunks': rank 1 of PP2 x vpp 2 (m 2) runs
    1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1, so at 3B1 only chunk 3's gradients exist (layer 3, final norm, head) and the
    first chunk's are not made yet: `_layer_shares` takes one layer's trainable elements (parameters of chunk 1)
    out of the later backward's gradients. Its first chunk's second backward (1B1) holds min(3, 2*2 - 3) = 1 chunk
    beside every gradient (`_late_chunk_moments`); with two rounds (m 4) neither applies."""
    from memcalc.cost import timeline
    from memcalc.cost.params import layer_params
    from memcalc.options import RunOptions, build_run

    def run(m: int):
        return build_run(RunOptions(layers=4, hidden=512, heads=8, kv_heads=2, ffn=1024, vocab=256, seq=32,
                                    precision="bf16", gpus=2, pp=2, vpp=2, grad_accum=m, optimizer="sgd"))

    dense, expert = layer_params(run(2).model)
    assert dense == 512 * 512 * 2 + 2 * 512 * 128 + 3 * 512 * 1024 + 2 * 512  # q, o, k, v, MLP, two norms
    early, trainable, first_chunk, resharded, gathered = timeline._layer_shares(run(2), 1)[8]
    assert early == first_chunk == dense and trainable == 2 * dense + 512 + 256 * 512
    assert resharded == gathered == 0  # (no FSDP2)
    a = stage_activations(run(2), 1)
    assert a.backward_late_chunk_layer_bytes > 0 and a.backward_late_chunk_end_bytes > 0
    assert timeline._layer_shares(run(4), 1)[8][0] == 0
    assert stage_activations(run(4), 1).backward_late_chunk_layer_bytes < 0  # (_NEVER)


def test_torch_splits_interleaved_chunks_unevenly_as_torchtitan():
    """torchtitan splits L over the pp*vpp virtual stages as over pp (`generate_split_points`: L // n, one more on
    stages 1..L % n): Llama 3.1 405B's 126 layers over pp 8 x vpp 2 = 16 are 7, 8 x 14, 7, so rank 0 holds global
    stages 0 and 8 (7 + 8 = 15 layers), rank 1 stages 1 and 9 (16), rank 7 stages 7 and 15 (8 + 7 = 15), 126 in
    all. Of rank 0's first 9 chunk forwards (groups of g = 8 micro-batches per chunk: 8 of chunk 0, then 1 of
    chunk 1) the 8-layer chunk 1 ran 1."""
    from memcalc.cost.params import chunk_forwards, chunk_layers, chunk_split, stage_layers
    from memcalc.options import RunOptions, build_run

    r = build_run(RunOptions(model="llama-3.1-405b", gpus=512, tp=8, pp=8, vpp=2, grad_accum=8))
    assert [int(stage_layers(r, s)) for s in range(8)] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert [int(chunk_layers(r, 0, k)) for k in (0, 1)] == [7, 8]
    assert [int(chunk_layers(r, 7, k)) for k in (0, 1)] == [8, 7]
    base, k_lo, k_hi = chunk_split(r, 0)
    assert (base, int(k_lo), int(k_hi)) == (7, 1, 1)
    assert int(chunk_forwards(r, 0, 9, k_lo, k_hi)) == 1 and int(chunk_forwards(r, 0, 16, k_lo, k_hi)) == 8
    # other profiles keep whole chunks
    from memcalc.errors import InputError

    with pytest.raises(InputError, match="divisible by pp\\*vpp = 16"):
        build_run(RunOptions(model="llama-3.1-405b", gpus=512, tp=8, pp=8, vpp=2, profile="megatron"))


def test_torch_1f1b_keeps_its_last_send_ops_and_a_warm_up_send():
    """torch's Schedule1F1B (PP2, m 4, 4 layers, fp32; one stream tensor 64 x 64 x 4 = 16,384 B). Stage 1 (the last;
    w = 1 warm-up forward): its `bwd_sends` list keeps the previous backward's input gradient through the next
    forward and backward. Stage 0 (the first, sends no gradient; w = 2): `send_work` keeps the works of warm-up
    forward 0, whose send holds that forward's output after its backward (m = 4 >= 2w - 1 = 3). Measured:
    docs/validation.md rows 41 and 44 (each within 0.01% with these terms; row 44 was -0.73% without)."""
    from memcalc.options import RunOptions, build_run

    one = build_run(RunOptions(layers=4, hidden=64, heads=4, ffn=176, vocab=512, seq=64, precision="fp32", gpus=2,
                               pp=2, grad_accum=4))
    s0, s1 = stage_activations(one, 0), stage_activations(one, 1)
    assert s0.detail["pipeline_sent_transient"] == s1.detail["pipeline_sent_transient"] == 16_384
    assert s0.steady_forward_sent_bytes == s1.steady_forward_sent_bytes == 16_384
    # the later backward's start holds it beside the units in flight (the first backward's does not)
    # (the last stage holds one unit in flight at both)
    assert s1.backward_later_bytes - s1.backward_first_bytes == 16_384
    # m = 2 < 2w - 1 on stage 0: warm-up forward 0's backward comes after the 1B1F loop, which frees send_work
    two = build_run(RunOptions(layers=4, hidden=64, heads=4, ffn=176, vocab=512, seq=64, precision="fp32", gpus=2,
                               pp=2, grad_accum=2))
    assert stage_activations(two, 0).detail["pipeline_sent_transient"] == 0
    # the stage's last layer gets its output gradient in the receive buffer: the MLP moment of the first layer of
    # backward has no new stream gradient on stage 0, and its later layers have one again
    assert s0.layer_k_extra_bytes == 16_384 and s1.layer_k_extra_bytes == 0
    # GPipe waits for its backward sends when the step ends: at its second backward the first one's input gradient
    # (stage 1; stage 0 sends none); and it keeps its forward sends' works to the end of the step, so stage 0 (the
    # last sends no output) still references the first micro-batch's output there; no forward follows a backward
    gp = build_run(RunOptions(layers=4, hidden=64, heads=4, ffn=176, vocab=512, seq=64, precision="fp32", gpus=2,
                              pp=2, grad_accum=4, schedule="gpipe"))
    assert stage_activations(gp, 1).detail["pipeline_sent_transient"] == 16_384
    assert stage_activations(gp, 0).detail["pipeline_sent_transient"] == 16_384
    assert stage_activations(gp, 1).steady_forward_sent_bytes == 0


def test_later_backward_end_under_autocast_holds_every_weight_gradient_waiting_for_its_cast():
    """torch pipelining with one autocast region around the step (PP2 1F1B, m 4, AMP bf16, full recompute; 8 layers
    of h 128, 4 MHA heads, f 352, V 512, 16 tokens per micro-batch). In a later backward each weight's cast node is
    older than the micro-batch's nodes, so every bf16 weight gradient waits until the stage's backward ends.
    Cast weights per layer: q, k, v, o 4 x 128 x 128 + gate, up, down 3 x 128 x 352 = 200,704 elements.
    Stage 1 (last): 4 layers + the head 512 x 128: 2 B x (4 x 200,704 + 65,536) = 1,736,704 B waiting; the newest
    cast (the head's) makes its fp32 gradient, 4 x 65,536 = 262,144 B, and the stage's input gradient (fp32 stream,
    16 x 128 x 4 = 8,192 B) waits to be sent: 2,007,040 B.
    Stage 0 (first): 2 x 4 x 200,704 = 1,605,632 B waiting; the embedding's node runs first (this micro-batch's):
    its fp32 gradient 4 x 512 x 128 = 262,144 B beside the stream's 8,192 B, more than the down projection's cast
    (4 x 128 x 352 = 180,224 B): 1,875,968 B. Measured: docs/validation.md row 124 (the harness's rank 0 holds
    1,935,360 B of activations at its peak, exactly the predicted figure; -1.64% on the peak without this moment)."""
    from memcalc.cost.timeline import stage_memory
    from memcalc.options import RunOptions, build_run

    kw = dict(layers=8, hidden=128, heads=4, ffn=352, vocab=512, seq=16, gpus=2, pp=2, grad_accum=4,
              recompute="full")
    amp = build_run(RunOptions(**kw, precision="bf16"))
    s0, s1 = stage_activations(amp, 0), stage_activations(amp, 1)
    assert s1.detail["later_backward_end_grads_transient"] == 1_736_704 + 262_144 + 8_192
    assert s0.detail["later_backward_end_grads_transient"] == 1_605_632 + 262_144 + 8_192
    # the moment's whole activations on stage 0: the other micro-batch in flight (4 fp32 checkpoint inputs and its
    # output, 5 x 8,192, and its rotary tables 2 x 2 x 16 x 32), the kept warm-up send's output and this one's
    # output (2 x 8,192), and the gradients above: the harness's figure
    assert s0.backward_later_end_bytes == 5 * 8_192 + 2_048 + 2 * 8_192 + 1_875_968 == 1_935_360
    # it is the stage's backward peak: the timeline's highest backward moment
    assert stage_memory(amp, 0).phases[1].live["activations"] == 1_935_360
    # without autocast (fp32, or pure bf16) each gradient goes to .grad as it is made: only the first stage's
    # embedding gradient is new at the end, beside the stream's (fp32: 262,144 + 8,192; pure bf16: 2 x 512 x 128 +
    # 16 x 128 x 2), and the last stage has no such moment; with one micro-batch there is no later backward
    fp32 = build_run(RunOptions(**kw, precision="fp32"))
    bf16 = build_run(RunOptions(**kw, precision="bf16", master_weights=False))
    assert stage_activations(fp32, 0).detail["later_backward_end_grads_transient"] == 262_144 + 8_192
    assert stage_activations(bf16, 0).detail["later_backward_end_grads_transient"] == 131_072 + 4_096
    assert stage_activations(fp32, 1).detail["later_backward_end_grads_transient"] == 0
    assert stage_activations(fp32, 1).backward_later_end_bytes < 0
    # LoRA: the embedding is frozen (no gradient at all)
    lora = build_run(RunOptions(**kw, precision="bf16", lora_rank=4))
    assert stage_activations(lora, 0).detail["later_backward_end_grads_transient"] == 0
    one = build_run(RunOptions(**{**kw, "grad_accum": 1}, precision="bf16"))
    assert stage_activations(one, 0).detail["later_backward_end_grads_transient"] == 0
    assert stage_activations(one, 0).backward_later_end_bytes < 0


def test_a_later_head_backward_and_a_tied_head_hold_a_second_head_gradient():
    """Gradient accumulation (torch, one rank, SGD; 2 layers of h 64, V 8192, 8 tokens). In a later micro-batch the
    LM head's backward makes a new weight gradient, 4 x 8192 x 64 = 2,097,152 B in fp32, which AccumulateGrad then
    adds in place to the `.grad` the first micro-batch made: a temporary beside all of the gradients. A tied head's
    gradient cannot be added yet: it waits in autograd's input buffer for the embedding's, to the end of backward,
    where the two are summed out of place: the held gradient, the embedding's and their sum, 3 x 2,097,152 B, or
    2 x in the first backward, where the sum becomes `.grad`. Measured: docs/validation.md rows 129-133 (tied, one
    micro-batch: -45.6% without these terms)."""
    from memcalc.cost.timeline import stage_memory
    from memcalc.options import RunOptions, build_run

    kw = dict(layers=2, hidden=64, heads=4, ffn=176, vocab=8192, seq=8, optimizer="sgd", precision="fp32")
    untied = stage_activations(build_run(RunOptions(**kw, grad_accum=2)), 0)
    assert untied.detail["later_head_weight_grad_transient"] == 2_097_152
    # (the end of backward, untied: the embedding's output gradient, 8 tokens x 64 x 4 B, beside its new dense
    # gradient, which becomes `.grad`: `_first_backward_end`)
    assert untied.backward_end_bytes == 8 * 64 * 4
    tied1 = build_run(RunOptions(**kw, grad_accum=1, tied_embeddings=True))
    tied2 = build_run(RunOptions(**kw, grad_accum=2, tied_embeddings=True))
    assert stage_activations(tied1, 0).backward_end_bytes == 2 * 2_097_152
    # the later end: max(the stream's gradient + held + embedding's, held + embedding's + sum) = 3 x 2,097,152
    assert stage_activations(tied2, 0).detail["later_backward_end_grads_transient"] == 3 * 2_097_152
    # the whole backward peak of the single-micro-batch run: params and grads (fp32, 2 x 2,499,840 B: the tied
    # matrix 524,288 + 2 layers of 4 x 4,096 + 3 x 11,264 + 2 x 64 + the final norm 64 elements) and the two
    # held gradients; the harness measured 9,194,120 B (136 B of scalars more). (Buffers: only the GPU's cuBLAS
    # workspaces, set aside on the CPU.)
    states = 4 * (524_288 + 2 * (4 * 4_096 + 3 * 11_264 + 2 * 64) + 64)
    assert states == 2_499_840
    live = stage_memory(tied1, 0).phases[1].live
    assert live["buffers"] == stage_memory(tied1, 0).buffers_detail["cublas_workspaces"]
    assert live["params"] + live["grads"] + live["activations"] == 2 * states + 2 * 2_097_152 == 9_193_984


def test_fused_cross_entropy_keeps_only_the_compute_dtype_logits():
    """--loss fused (TransformerEngine parallel_cross_entropy; Megatron-LM --cross-entropy-fusion-impl te): the
    kernel saves the bf16 logits and three fp32 statistics per token (gathered from the tp ranks), and writes the
    gradient into the saved logits. Llama-3-8B shape, 1 layer, seq 2048, tp 2 with SP (vocab shard 128,256 / 2 =
    64,128): saved 2 x 2048 x 64,128 B of logits + 12 x 2048 x 2 B of statistics, where the unfused loss saves
    4 x 2048 x 64,128 B of fp32 softmax. Forward transient: the per-token fp32 loss and this rank's statistics
    beside the gathered ones (4 + 12 B per token); backward: the LM head's input gradient, 2 x 2048 x 4096 B."""
    m = llama3_8b(layers=1)
    T, V_t, h = 2048, 64128, 4096
    fused = make(m, "megatron", seq=T, tp=2, gpus=2, loss="fused")
    full = make(m, "megatron", seq=T, tp=2, gpus=2)
    lf, lu = last_stage_terms(fused), last_stage_terms(full)
    assert lf["loss_logits_compute_dtype"] == 2 * T * V_t == 262_668_288
    assert lf["loss_logits_fp32"] == 12 * T * 2 == 49_152
    assert lu["loss_logits_fp32"] == 4 * T * V_t and lu["loss_logits_compute_dtype"] == 0
    assert loss_transients(fused) == (4 * T + 12 * T, 2 * T * h)
    # at the loss the fused kernel holds half the unfused one's saved bytes, and its backward never adds the
    # logit-sized cast
    assert stage_activations(fused, 0).forward_bytes < stage_activations(full, 0).forward_bytes


def test_all_to_all_context_parallelism_saves_the_output_twice():
    """--cp-comm a2a (TE AttnFuncWithCPAndQKVOA2A, >= 2.8): the kernel's head-sharded output is saved besides the
    sequence-sharded o-projection input it is exchanged into: one more 2 x (s/cp) x (a/t) x d B per layer. Llama-3-8B
    at seq 8192, tp 2, cp 4: 2 x 2048 x 16 x 128 = 8,388,608 B. The exchange buffers are transient: Q, K, V laid
    out, received and reordered while the projection's copies are live, 3 x 2 x 2048 x (16 + 2 x 4) x 128 B =
    37,748,736 B in forward and again for the gradients in backward. Not saved under selective recompute (inside
    the checkpointed core), and refused outside Megatron or where cp does not divide the heads per rank."""
    m = llama3_8b(layers=1)
    a2a = make(m, "megatron", seq=8192, tp=2, cp=4, gpus=8, cp_comm="a2a")
    p2p = make(m, "megatron", seq=8192, tp=2, cp=4, gpus=8)
    ta, tp_ = layer_terms(a2a), layer_terms(p2p)
    assert ta["attn_output_pre_a2a"] == 2 * 2048 * 16 * 128 == 8_388_608 and "attn_output_pre_a2a" not in tp_
    assert layer_bytes(a2a) - layer_bytes(p2p) == 8_388_608
    assert "attn_output_pre_a2a" not in layer_terms(a2a, "selective")
    assert cp_ring_transients(a2a) == (37_748_736, 37_748_736) == (3 * 2 * 2048 * 24 * 128,) * 2
    with pytest.raises(InputError, match="valid: 1, 2, 4"):
        make(m, "megatron", seq=8192, tp=2, cp=8, gpus=16, cp_comm="a2a")


def test_ulysses_all_to_all_under_torch_and_deepspeed():
    """DeepSpeed-Ulysses (DeepSpeed's only sequence parallelism, so its profile's default; the same exchange over
    FSDP/DDP under torch) saves what TE's a2a saves (the output twice) but exchanges one tensor at a time
    (deepspeed/sequence/layer.py `single_all_to_all`), so its buffers are measured against what the layer has not
    saved yet (forward) or has freed again (backward). Llama-3-8B, seq 8192, cp 4: 2048 tokens, Q = O =
    2 x 2048 x 32 x 128 = 16,777,216 B, K = V = 2 x 2048 x 8 x 128 = 4,194,304 B.
    - forward at V's exchange: Q, K, V before + V's send and receive = 16,777,216 + 4 x 4,194,304 = 33,554,432,
      less what the layer saves after V (the outputs alone are 2 x 16,777,216, the MLP more): 0;
    - backward: 3 x Q = 50,331,648 less the same: 0;
    - full recompute (nothing saved in forward): Q, K, V before and after, V's two buffers and the norm's output,
      2 x 25,165,824 + 2 x 4,194,304 + 2 x 2048 x 4096 = 75,497,472. The harness measures the exchange op by op
      (docs/validation.md, the Ulysses rows)."""
    m = llama3_8b(layers=1)
    uly = make(m, "torch", seq=8192, cp=4, gpus=4, cp_comm="a2a")
    assert layer_terms(uly)["attn_output_pre_a2a"] == 16_777_216
    assert cp_ring_transients(uly) == (0, 0)
    # op-level SAC saves the gate projection's output after the exchange alone, 2 x 2048 x 14336 = 58,720,256 B:
    # more than the 33,554,432 B of the exchange
    op = make(m, "torch", seq=8192, cp=4, gpus=4, cp_comm="a2a", recompute="op")
    assert layer_terms(op, "op")["sac_gate_output"] == 58_720_256 and cp_ring_transients(op) == (0, 0)
    full = make(m, "torch", seq=8192, cp=4, gpus=4, cp_comm="a2a", recompute="full")
    assert cp_ring_transients(full) == (75_497_472, 0)
    assert 2 * (16_777_216 + 2 * 4_194_304) + 2 * 4_194_304 + 2 * 2048 * 4096 == 75_497_472
    ds = make(m, "deepspeed", seq=8192, cp=4, gpus=4, zero=3)
    assert ds.cp_comm == "a2a" and layer_terms(ds)["attn_output_pre_a2a"] == 16_777_216
    assert make(m, "deepspeed", seq=8192, gpus=4, zero=3).cp_comm == "a2a"  # the profile's exchange, cp or not
    assert make(m, "torch", seq=8192, cp=4, gpus=4).cp_comm == "p2p"
    with pytest.raises(InputError, match="DeepSpeed-Ulysses .* valid: a2a"):
        make(m, "deepspeed", seq=8192, cp=4, gpus=4, cp_comm="p2p")
    with pytest.raises(InputError, match="valid: 1, 2, 4, 8"):
        make(m, "deepspeed", seq=8192, cp=16, gpus=16)


def test_parallel_block_terms_by_hand():
    """A GPT-NeoX-style layer (h 1024, 8 heads, GELU 4h, LayerNorm, biases), pure bf16, flash, T = 2048 tokens.
    Sequential: two norms each save their input (2Th) and fp32 mean/rstd (8T); the MLP saves its input (2Th).
    parallel (x + attn(ln1 x) + mlp(ln2 x)): the second norm reads the same x the first saved: 8T only.
    parallel-shared-norm (phi, GPT-J): no second norm, and the MLP's input is the norm output Q/K/V saved."""
    T, h = 2048, 1024
    m = dict(hidden=h, heads=8, layers=2, ffn=4 * h, vocab=1000, mlp="gelu", norm="layernorm", qkv_bias=True,
             linear_bias=True)
    seq, par, shared = (layer_terms(make(ModelSpec(**m, block=b), "torch", seq=T, master_weights=False))
                        for b in ("sequential", "parallel", "parallel-shared-norm"))
    assert seq["mlp_norm"] == 2 * T * h + 8 * T == 4_210_688
    assert par["mlp_norm"] == 8 * T == 16_384
    assert "mlp_norm" not in shared
    assert seq["mlp_input"] == par["mlp_input"] == 2 * T * h and shared["mlp_input"] == 0
    others = {k: v for k, v in seq.items() if k not in ("mlp_norm", "mlp_input")}
    assert {k: v for k, v in par.items() if k not in ("mlp_norm", "mlp_input")} == others
    assert {k: v for k, v in shared.items() if k != "mlp_input"} == others
    # under autocast (fp32 stream) each linear saves its own bf16 cast of the norm output: nothing is shared
    amp = layer_terms(make(ModelSpec(**m, block="parallel-shared-norm"), "torch", seq=T))
    assert amp["qkv_input"] == 3 * 2 * T * h and amp["mlp_input"] == 2 * T * h  # q, k, v casts; fc's cast


def test_parallel_block_first_lora_layer_mlp_saves_nothing():
    """LoRA on q, v only: the first layer's input comes from the frozen embedding, so a parallel block's MLP branch
    (frozen norm, frozen MLP) records nothing for autograd, unlike a sequential block's, whose MLP reads the
    attention's output. first_stage_terms takes the whole MLP branch off the first layer (measured by the harness,
    tests/test_validate_parallel.py)."""
    T, h = 1024, 512
    m = dict(hidden=h, heads=8, layers=4, ffn=4 * h, vocab=1000, mlp="gelu", norm="layernorm")
    kw = dict(seq=T, master_weights=False, lora_rank=8, lora_targets="qv")
    for block in ("parallel", "parallel-shared-norm"):
        r = make(ModelSpec(**m, block=block), "torch", **kw)
        terms = layer_terms(r)
        mlp = sum(v for k, v in terms.items() if k.startswith("mlp_"))
        assert mlp == 2 * T * 4 * h + (8 * T if block == "parallel" else 0)  # GELU input (+ ln2 statistics)
        assert first_stage_terms(r)["first_layer_frozen_input"] == -(terms["attn_norm"] + mlp)
    seq = make(ModelSpec(**m), "torch", **kw)
    assert first_stage_terms(seq)["first_layer_frozen_input"] == -layer_terms(seq)["attn_norm"]


def test_fabric_fp32_logits_with_lit_gpt_loss():
    """lit-gpt under Lightning Fabric: the model's chunk list comes back upcast to fp32 (`convert_output`), so the loop
    keeps 4 B per logit and the cross-entropy saves an fp32 log-softmax (4 B) where bf16-true alone holds 2 + 2."""
    V, T = 32000, 1304
    m = ModelSpec(hidden=4096, heads=32, layers=2, ffn=11008, vocab=V)
    kw = dict(seq=T, master_weights=False, lora_rank=8, loss="lit-gpt")
    plain = make(m, "torch", **kw)
    fabric = make(m, "torch", keep_logits="fp32", **kw)
    assert loss_kept_bytes(plain) == 2 * T * V and loss_kept_bytes(fabric) == 4 * T * V
    lp, lf = last_stage_terms(plain), last_stage_terms(fabric)
    assert lp["loss_logits_compute_dtype"] == 4 * T * V and lp["loss_logits_fp32"] == 0
    assert lf["loss_logits_fp32"] == 8 * T * V and lf["loss_logits_compute_dtype"] == 0
    with pytest.raises(InputError, match="keep-logits compute"):
        make(m, "torch", keep_logits="compute", **kw)


def test_full_recompute_keeps_the_stream_in_its_dtype():
    """A fully checkpointed layer keeps its input, the residual stream: in the compute dtype (Korthikanti's `2sbh`),
    but fp32 under torch autocast with fp32 weights, whose embedding lookup and residual adds stay fp32
    (`_stream_bytes`). Llama 3 8B shape, 2048 tokens: 2 x 2048 x 4096 = 16 MiB, or 32 MiB under AMP (measured:
    docs/validation.md row 122, the AMP full-recompute pipeline row, exact with it)."""
    m = llama3_8b(layers=2, vocab=32000)
    amp = layer_terms(make(m, "torch", seq=2048, precision="bf16"), "full")["checkpoint_input"]
    pure = layer_terms(make(m, "torch", seq=2048, precision="bf16", master_weights=False), "full")["checkpoint_input"]
    meg = layer_terms(make(m, "megatron", seq=2048, precision="bf16"), "full")["checkpoint_input"]
    assert amp == 4 * 2048 * 4096 == 32 * 2**20
    assert pure == meg == 2 * 2048 * 4096


def test_pipeline_x_tp_terms_measured_op_by_op():
    """PP2 x TP2 (torchtitan's layout), 4 layers of h 64, 4 heads, f 176, V 512, 64 tokens per micro-batch, m 4;
    stage 0 has 2 layers. Each term below was missing until the harness ran PP x TP (docs/validation.md rows
    156-163, now within 0.01%; before: -0.12% / -0.84% / -0.17% / -0.53% / -0.74%).
    - loss_parallel's backward (last stage): beside its 3 fp32 logit-sized tensors, 33 bytes a token of index and
      mask vectors: 12 x 64 x 256 + 33 x 64 = 196,608 + 2,112 = 198,720 (no such vectors without TP: 8 x 64 x 512).
    - SP, the end of a layer's forward: the reduce-scatter's concatenated copy (c tok h) and its output
      (c tok/t h): fp32 4 x (64 + 32) x 64 = 24,576 more than without SP; under AMP also the MLP's fp32 argument
      (4 tok h = 16,384) beside the bf16 copy and output 2 x 96 x 64 = 12,288.
    - GPipe keeps its forward sends' works to the step's end: stage 0 references micro-batch 0's output (fp32,
      64 x 64 x 4 = 16,384) at its second backward."""
    from conftest import run_of

    base = dict(layers=4, hidden=64, heads=4, ffn=176, vocab=512, seq=64, gpus=4, pp=2, tp=2, grad_accum=4)
    tp_fp32 = run_of(**base, precision="fp32")
    assert loss_transients(tp_fp32)[1] == 12 * 64 * 256 + 33 * 64 == 198_720
    one = run_of(**{**base, "gpus": 2, "tp": 1}, precision="fp32")
    assert loss_transients(one)[1] == 8 * 64 * 512
    # the forward end beyond the saved set, the down projection's output c tok h and the stage's layers: compare
    # with the moment's value without the new terms (the same run without SP has none of them in fp32)
    sp = run_of(**base, precision="fp32", sp=True)
    a_sp, a_tp = stage_activations(sp, 0), stage_activations(tp_fp32, 0)
    extra_sp = a_sp.forward_layer_end_bytes - a_sp.held_bytes
    extra_tp = a_tp.forward_layer_end_bytes - a_tp.held_bytes
    assert extra_tp == 4 * 64 * 64  # the down projection's output (measured: nothing more at its all-reduce)
    assert extra_sp == 4 * 64 * 64 + 4 * (64 + 32) * 64 == 40_960
    amp = run_of(**base, precision="bf16", sp=True)
    a_amp = stage_activations(amp, 0)
    assert a_amp.forward_layer_end_bytes - a_amp.held_bytes == 2 * 64 * 64 + 4 * 64 * 64 + 2 * 96 * 64 == 36_864
    gp = run_of(**base, precision="bf16", schedule="gpipe")
    assert stage_activations(gp, 0).detail["pipeline_sent_transient"] == 4 * 64 * 64


def test_rotary_cos_sin_is_per_sequence_not_per_sample():
    """cos and sin are made once per forward from positions (1, s): HF's default position ids
    (`cache_position.unsqueeze(0)`), torchtitan's freqs_cis, Megatron's rotary_pos_emb, the harness's
    `rotary_cos_sin(seq, d)`. Llama-2-7B (d = 128), bf16, seq 4096: 2 x 2 x 4096 x 128 = 2,097,152 B per
    micro-batch whatever its size; CP 2 halves the sequence. (memcalc counted it per sample until 2026-11-27: the
    torchtune layer's QLoRA toy rows were ~8 KB over at micro-batch 2, docs/validation.md rows 185-187.)"""
    from memcalc.cost.activations import every_stage_terms
    from tests.conftest import run_of

    for mb in (1, 2, 8):
        run = run_of(model="llama-2-7b", seq=4096, micro_batch=mb, precision="bf16")
        assert every_stage_terms(run, 0)["rotary_cos_sin"] == 2 * 2 * 4096 * 128 == 2_097_152
    run = run_of(model="llama-2-7b", seq=4096, micro_batch=2, precision="bf16", gpus=2, cp=2)
    assert every_stage_terms(run, 0)["rotary_cos_sin"] == 2 * 2 * 2048 * 128
