"""Gemma 2/3's post norms (`ModelSpec.post_norms`: x + norm(attn(norm1 x)), then + norm(mlp(norm2 .))) and
Qwen3 / Gemma 3's q and k norms (`ModelSpec.qk_norm`), measured by the harness on the CPU.

Post norms: The prediction's whole-step error with them equals the same layer's without them to
within 64 bytes, in every phase, under fp32, AMP (where nn.RMSNorm gets the linear's bf16 output and an fp32 weight
and runs torch's composite, on CUDA as on the CPU: read on an H100, docs/validation.md), pure bf16 with the eager
fp32 RMSNorm, full recompute, TP 2 + SP (their weight gradients all-reduced over TP, every collective to the
byte) and a 2-stage 1F1B pipeline under AMP (whose peak is the MLP output's norm's composite backward, before the
down projection's compute-dtype weight gradient waits: `activations.composite_norm_backward`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memcalc.specs import ModelSpec, ParallelSpec, resolve  # noqa: E402
from memcalc.validate.api import validate  # noqa: E402
from tests.conftest import prediction_gap as _gap  # noqa: E402
from tests.conftest import run_of  # noqa: E402

SHAPE = dict(layers=4, hidden=64, heads=4, ffn=176, vocab=512)


def _run(post: bool, field: str = "post_norms", **opts):
    run = run_of(**{**SHAPE, **opts.pop("shape", {})}, **opts)
    m = ModelSpec(**{**run.model.model_dump(), field: post})
    p = ParallelSpec(gpus=run.gpus, tp=run.tp, pp=run.pp, zero=run.zero, sp=run.sp)
    return resolve(m, run.training, p, run.hardware, run.profile)


@pytest.mark.parametrize("opts", [
    dict(precision="fp32", seq=256),
    dict(precision="bf16", seq=512),  # AMP
    dict(precision="bf16", seq=512, master_weights=False, norm_impl="fp32"),
    dict(precision="bf16", seq=512, recompute="full"),
    dict(precision="bf16", seq=256, gpus=2, tp=2, sp=True),
    dict(precision="bf16", seq=256, gpus=2, pp=2, grad_accum=4),
], ids=["fp32", "amp", "pure-bf16-eager-norm", "amp-full-recompute", "tp2-sp", "pp2-1f1b"])
def test_post_norms_add_no_error(opts):
    world = "fake" if opts.get("gpus", 1) > 1 and opts.get("tp", 1) > 1 else "real"
    reps = {post: validate(_run(post, **dict(opts)), device="cpu", world=world, steps=1, timeout=240)
            for post in (False, True)}
    base, post = _gap(reps[False]), _gap(reps[True])
    for k, v in base.items():
        assert abs(post[k] - v) <= 64, (k, post[k], v)
    assert reps[True]["within_tolerance"]
    for c in reps[True]["collectives"]:
        assert (c["predicted_calls"], c["predicted_bytes"]) == (c["measured_calls"], c["measured_bytes"]), c
    # and they are there: each layer saves two more norm inputs, measured
    fwd = {p: reps[p]["measured"]["phases"]
           [("forward-backward" if opts.get("pp", 1) > 1 else "forward")]["peak_bytes"] for p in reps}
    assert fwd[True] > fwd[False]


def test_post_norm_terms_by_hand():
    """One layer's post-norm terms for 2 x 4096 tokens of h = 3584 (Gemma 2 9B's width): AMP with nn.RMSNorm (a bf16
    input, an fp32 weight: torch's composite, read on an H100, docs/validation.md) saves an fp32 copy of the
    linear's bf16 output, the fp32 normalized tensor and the fp32 rstd, 8 x 8192 x 3584 + 4 x 8192 = 234,913,792 B
    each; the eager fp32 RMSNorm in pure bf16 the fp32 copy, rstd and the bf16 normalized tensor, 4 x 8192 x 3584 +
    4 x 8192 + 2 x 8192 x 3584 = 176,193,536 B."""
    from memcalc.cost.activations import layer_terms

    gemma = dict(layers=42, hidden=3584, heads=16, kv_heads=8, head_dim=256, ffn=14336, vocab=256000)
    amp = _run_model(gemma, precision="bf16", seq=4096, micro_batch=2)
    t = layer_terms(amp)
    assert t["attn_post_norm"] == t["mlp_post_norm"] == 8 * 8192 * 3584 + 4 * 8192 == 234_913_792
    eager = _run_model(gemma, precision="bf16", master_weights=False, norm_impl="fp32", seq=4096, micro_batch=2)
    t = layer_terms(eager)
    assert t["attn_post_norm"] == 4 * 8192 * 3584 + 4 * 8192 + 2 * 8192 * 3584 == 176_193_536


def _run_model(shape, **opts):
    run = run_of(**shape, **opts)
    m = ModelSpec(**{**run.model.model_dump(), "post_norms": True})
    return resolve(m, run.training, ParallelSpec(gpus=1), run.hardware, run.profile)


@pytest.mark.parametrize("opts", [
    dict(precision="fp32", seq=256),
    dict(precision="bf16", seq=512),  # AMP: torch's composite norms (fp32 inside, bf16 out)
    dict(precision="bf16", seq=512, master_weights=False, norm_impl="fp32"),
    dict(precision="bf16", seq=512, recompute="full"),
    dict(precision="bf16", seq=512, recompute="selective"),  # the core's saved q, k as the norms return them
    dict(precision="bf16", seq=512, master_weights=False, lora_rank=4, lora_targets="attn"),
    dict(precision="bf16", seq=256, gpus=2, tp=2, sp=True),
    dict(precision="bf16", seq=256, gpus=2, pp=2, grad_accum=4),
    dict(precision="bf16", seq=256, gpus=2, zero=3),
], ids=["fp32", "amp", "pure-bf16-eager-norm", "amp-full-recompute", "amp-selective", "lora", "tp2-sp", "pp2-1f1b",
        "fsdp2-zero3"])
def test_qk_norms_add_no_error(opts):
    """Q and k norms over each head (GQA: 4 query heads, 2 KV heads) with SDPA: the whole-step error in every phase
    equals the plain layer's to within 64 bytes."""
    opts = dict(opts, shape=dict(kv_heads=2))
    # (FSDP2 over a real gloo world frees a unit's buffers when its asynchronous collective completes, so its
    # measured peak varies by up to ~90 KB from run to run under load: a fake world is deterministic)
    several = opts.get("gpus", 1) > 1 and (opts.get("tp", 1) > 1 or opts.get("zero", 0) >= 2)
    world = "fake" if several else "real"
    reps = {q: validate(_run(q, "qk_norm", **dict(opts)), device="cpu", world=world, steps=1, timeout=240)
            for q in (False, True)}
    base, qk = _gap(reps[False]), _gap(reps[True])
    for k, v in base.items():
        assert abs(qk[k] - v) <= 64, (k, qk[k], v)
    for c in reps[True]["collectives"]:
        assert (c["predicted_calls"], c["predicted_bytes"]) == (c["measured_calls"], c["measured_bytes"]), c
    assert reps[True]["measured"]["peak_bytes"] > reps[False]["measured"]["peak_bytes"]


@pytest.mark.parametrize("norm_impl", ["fp32", "fused"], ids=["hf-eager-norm", "nn-rmsnorm"])
@pytest.mark.parametrize("kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_qk_norms_with_eager_attention_under_amp(kv, dropout, norm_impl):
    """Eager attention (HF's eager_attention_forward) under AMP with q/k norms. HF's eager Qwen3RMSNorm (`--norm-impl
    fp32`) returns fp32 (its fp32 weight times the normalized tensor), so q and k reach the core in fp32 (the score
    matmul saves its casts while the fp32 tensors stay referenced, under GQA K's fp32 repetition with them) and
    `softmax(dtype=float32).to(q.dtype)` keeps fp32 probabilities (dropout's output fp32, cast again by the value
    matmul; in backward its gradient upcast beside dropout's). Without those the forward was 2.0-2.2% low and, with
    dropout, the forward 15% and the backward 6.4% low (the peak 7.3%). nn.RMSNorm's composite returns bf16, and
    the core is as without the norms. 2 layers, seq 512: every phase and the peak within 0.05%."""
    opts = dict(precision="bf16", seq=512, attention="eager", dropout=dropout, norm_impl=norm_impl,
                shape=dict(layers=2, kv_heads=kv))
    rep = validate(_run(True, "qk_norm", **opts), device="cpu", world="real", steps=1, timeout=240)
    for r in rep["rows"]:
        if r["section"] == "phases":
            assert abs(r["error"]) < 0.0005, r
    assert abs(rep["error"]) < 0.0005, _gap(rep)


def test_qk_norm_terms_and_qwen3_params_by_hand():
    """Qwen3-8B's config.json (hidden 4096, 36 layers, 32 query and 8 KV heads of 128, MLP 12288, vocab 151936,
    untied): per layer q 4096^2 + k, v 2 x 4096 x 1024 + o 4096^2 = 41,943,040, q/k norms 2 x 128, MLP 3 x 4096 x
    12288 = 150,994,944, two norms 8192 -> 192,946,432; x 36 + embedding and head 2 x 151936 x 4096 + final norm
    4096 = 8,190,735,360 (8.2B on the model card). One layer's q/k norms for 4096 tokens under AMP (torch's
    composite: an fp32 copy and the fp32 normalized tensor of 40 head vectors of 128 per token, and their rstd):
    8 x 4096 x 40 x 128 + 4 x 4096 x 40 = 168,427,520 B (the H100 row 49 measured the 4 x 4096 x 40 x 128 of the
    normalized tensor per layer that the fused kernel's model missed: docs/validation.md)."""
    from memcalc.cost.activations import layer_terms
    from memcalc.cost.params import total_params
    from memcalc.presets import model_from_hf_config

    cfg = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
           "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False}
    spec = model_from_hf_config(cfg, "config.json")
    assert spec.qk_norm and not spec.qkv_bias and spec.notes == ()
    layer = 2 * 4096**2 + 2 * 4096 * 1024 + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096
    assert layer == 192_946_432
    assert total_params(spec) == 36 * layer + 2 * 151936 * 4096 + 4096 == 8_190_735_360
    run = run_of(layers=36, hidden=4096, heads=32, kv_heads=8, ffn=12288, vocab=151936, precision="bf16", seq=4096)
    run = resolve(ModelSpec(**{**run.model.model_dump(), "qk_norm": True}), run.training, ParallelSpec(gpus=1),
                  run.hardware, run.profile)
    assert layer_terms(run)["qk_norm"] == 8 * 4096 * 40 * 128 + 4 * 4096 * 40 == 168_427_520


@pytest.mark.parametrize("opts, phase", [
    (dict(layers=4, ffn=768, vocab=256), "backward"),
    (dict(layers=4, ffn=768, vocab=256, grad_accum=2), "backward"),
    (dict(layers=3, ffn=256, vocab=128, recompute="full"), "forward"),
], ids=["first-micro-batch", "later-micro-batch", "full-recompute-forward"])
def test_post_norms_composite_moments_under_amp(opts, phase):
    """Gemma 2's post norms under AMP run torch's composite RMSNorm (a bf16 input, an fp32 weight). Its backward
    peaks at the square's backward, three fp32 tensors beside the rstd product's input gradient and the mean's
    expanded gradient, 16 bytes an element beyond the saved set less the freed normalized tensor and rstd, before the
    down projection makes its weight gradient (`activations.composite_norm_backward`, `_down_wgrad_bytes`): h 512,
    1024 tokens, ffn 768, vocab 256, where it is the backward's peak (+0.62% while the down gradient was counted
    made; a later micro-batch's likewise). Under full recompute the re-run forward's MLP output norm holds the
    composite's fp32 copy, normalized tensor and product at once (`checkpointed_mlp_forward`: -4.7% without). Each
    within 0.01% of the harness's measurement."""
    from memcalc.cost import activations

    shape = dict(hidden=512, heads=4, **{k: opts.pop(k) for k in ("layers", "ffn", "vocab")})
    run = _run(True, shape=shape, precision="bf16", seq=1024, **opts)
    rep = validate(run, device="cpu", world="real", steps=1, timeout=240)
    row = next(r for r in rep["rows"] if r["section"] == "phases" and r["name"] == phase)
    assert abs(row["predicted"] - row["measured"]) <= 0.0001 * row["measured"], row
    if phase == "backward":
        # the layer's highest moment is the composite's: the residual stream's fp32 gradient, 16 B an element less
        # the statistics, less the down projection's fp32 weight gradient not made yet (h (f - 1) x 4 B)
        tok, h, f = 1024, 512, 768
        dw = activations._down_wgrad_bytes(run, 0)
        assert dw == 4 * h * (f - 1)
        assert activations.layer_backward_transient(run, dw_made=dw) == 4 * tok * h + 16 * tok * h - 4 * tok - dw
