"""Gemma 2/3's post norms (`ModelSpec.post_norms`: x + norm(attn(norm1 x)), then + norm(mlp(norm2 .))), measured
by the harness on the CPU. The prediction's whole-step error with them equals the same layer's without them to
within 64 bytes, in every phase, under fp32, AMP (whose fused norm runs in fp32 on CUDA: the harness casts the
linear's bf16 output first, as autocast does), pure bf16 with the eager fp32 RMSNorm, full recompute, TP 2 + SP
(their weight gradients all-reduced over TP, every collective to the byte) and a 2-stage 1F1B pipeline (whose peak
is a layer's MLP backward, after the MLP output's norm has freed what it saved)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memcalc.specs import ModelSpec, ParallelSpec, resolve  # noqa: E402
from memcalc.validate.api import validate  # noqa: E402
from tests.conftest import run_of  # noqa: E402

SHAPE = dict(layers=4, hidden=64, heads=4, ffn=176, vocab=512)


def _run(post: bool, **opts):
    run = run_of(**SHAPE, **opts)
    m = ModelSpec(**{**run.model.model_dump(), "post_norms": post})
    p = ParallelSpec(gpus=run.gpus, tp=run.tp, pp=run.pp, zero=run.zero, sp=run.sp)
    return resolve(m, run.training, p, run.hardware, run.profile)


def _gap(rep) -> dict[str, int]:
    out = {"peak": rep["predicted"]["peak_bytes"] - rep["measured"]["peak_bytes"]}
    for r in rep["rows"]:
        if r["section"] == "phases":
            out[r["name"]] = r["predicted"] - r["measured"]
    return out


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
    """One layer's post-norm terms for 2 x 4096 tokens of h = 3584 (Gemma 2 9B's width): AMP with the fused norm
    saves the fp32 cast of the linear's bf16 output and the fp32 rstd, 4 x 8192 x 3584 + 4 x 8192 = 117,473,280 B
    each; the eager fp32 RMSNorm in pure bf16 the fp32 copy, rstd and the bf16 normalized tensor, 4 x 8192 x 3584 +
    4 x 8192 + 2 x 8192 x 3584 = 176,193,536 B."""
    from memcalc.cost.activations import layer_terms

    gemma = dict(layers=42, hidden=3584, heads=16, kv_heads=8, head_dim=256, ffn=14336, vocab=256000)
    amp = _run_model(gemma, precision="bf16", seq=4096, micro_batch=2)
    t = layer_terms(amp)
    assert t["attn_post_norm"] == t["mlp_post_norm"] == 4 * 8192 * 3584 + 4 * 8192 == 117_473_280
    eager = _run_model(gemma, precision="bf16", master_weights=False, norm_impl="fp32", seq=4096, micro_batch=2)
    t = layer_terms(eager)
    assert t["attn_post_norm"] == 4 * 8192 * 3584 + 4 * 8192 + 2 * 8192 * 3584 == 176_193_536


def _run_model(shape, **opts):
    run = run_of(**shape, **opts)
    m = ModelSpec(**{**run.model.model_dump(), "post_norms": True})
    return resolve(m, run.training, ParallelSpec(gpus=1), run.hardware, run.profile)
