"""Parallel transformer blocks (`ModelSpec.block`: GPT-NeoX `x + attn(ln1 x) + mlp(ln2 x)`, phi / GPT-J with one
shared norm), Lightning Fabric's fp32 model output under lit-gpt's chunked loss (`--keep-logits fp32`) and
a weight quantized from fp16 and dequantized through it (`--quant-backend bnb-fp16`: bitsandbytes <= 0.42), each
measured by the harness on the CPU.

A parallel block's prediction has no error of its own: its whole-step error equals the sequential block's of the
same shape to within 64 bytes (the CPU's LayerNorm keeps its statistics in the input dtype where CUDA keeps
fp32, so the runs here are fp32 or compare like with like)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memcalc.specs import ModelSpec, resolve  # noqa: E402
from memcalc.validate.api import validate  # noqa: E402
from tests.conftest import prediction_gap as _gap  # noqa: E402
from tests.conftest import run_of  # noqa: E402

GPT = dict(layers=4, hidden=64, heads=4, ffn=256, vocab=512)
GPT_MODEL = dict(mlp="gelu", norm="layernorm", positions="learned", qkv_bias=True, linear_bias=True)


def _run(block: str, **opts):
    model = dict(GPT_MODEL, max_positions=opts.get("seq", 64), **opts.pop("model", {}))
    run = run_of(**GPT, **opts)
    m = ModelSpec(**{**run.model.model_dump(), **model, "block": block})
    from memcalc.specs import ParallelSpec

    p = ParallelSpec(gpus=run.gpus, tp=run.tp, zero=run.zero, sp=run.sp)
    return resolve(m, run.training, p, run.hardware, run.profile)


@pytest.mark.parametrize("opts", [
    dict(precision="fp32", seq=256, micro_batch=2),
    dict(precision="bf16", seq=128, micro_batch=2, attention="eager"),  # AMP: fp32 stream, bf16 copies per linear
    dict(precision="fp32", seq=256, micro_batch=2, gpus=2, tp=2, sp=True, model=dict(tied_embeddings=False)),
], ids=["fp32", "amp-eager", "tp2-sp"])
def test_parallel_blocks_add_no_error(opts):
    # TP runs one rank of a fake process group: a real gloo world's worker thread makes its small buffers' lifetimes
    # vary from run to run by up to ~1 KB (docs/validation.md), more than the comparison's 64 bytes
    world = "fake" if opts.get("gpus", 1) > 1 else "real"
    reps = {b: validate(_run(b, **dict(opts)), device="cpu", world=world, steps=1, timeout=240)
            for b in ("sequential", "parallel", "parallel-shared-norm")}
    seq = _gap(reps["sequential"])
    for b in ("parallel", "parallel-shared-norm"):
        gap = _gap(reps[b])
        for k, v in seq.items():
            assert abs(gap[k] - v) <= 64, (b, k, gap[k], v)
        assert reps[b]["within_tolerance"]
        # every collective to the byte (under SP a shared norm has one Partial weight gradient fewer per layer)
        assert reps[b]["collectives"] or world == "real"
        for c in reps[b]["collectives"]:
            assert (c["predicted_calls"], c["predicted_bytes"]) == (c["measured_calls"], c["measured_bytes"]), c
    # the blocks differ for real: one norm's saved input and statistics less per layer (parallel), the MLP's
    # norm and its input less (shared norm: the MLP reads norm1's output, which Q/K/V saved)
    fwd = {b: reps[b]["measured"]["phases"]["forward"]["peak_bytes"] for b in reps}
    assert fwd["parallel-shared-norm"] < fwd["parallel"] < fwd["sequential"]


def test_lit_gpt_fabric_fp32_logits_and_parallel_lora():
    """lit-gpt's LoRA on q, v (fused QKV, adapter dropout) over a shared-norm block with an LM-head bias, its chunked
    head and loss, and Fabric's fp32 conversion of the chunks (kept by the loop): within 0.5% on the whole step and
    on forward, where the conversion is the moment (the compute-dtype chunks beside their fp32 copies)."""
    run = _run("parallel-shared-norm", precision="bf16", master_weights=False, seq=256, micro_batch=2, lora_rank=4,
               lora_targets="qv", lora_dropout=0.05, qkv_impl="fused", loss="lit-gpt", keep_logits="fp32",
               model=dict(positions="rotary", tied_embeddings=False, head_bias=True))
    rep = validate(run, device="cpu", world="real", steps=1, timeout=240)
    gap = _gap(rep)
    meas = rep["measured"]
    assert abs(gap["peak"]) / meas["peak_bytes"] < 0.005, gap
    assert abs(gap["forward"]) / meas["phases"]["forward"]["peak_bytes"] < 0.005, gap


def test_bnb_041_dequantizes_through_fp16():
    """A quantized LM head with a wide vocabulary and few tokens: the head's dequantization is the peak. bitsandbytes
    0.41 holds the fp16 and the bf16 copy of the head at once (8192 x 256 x 2 B = 4 MiB more than later versions at
    the cast); memcalc and the harness agree to within 0.01% with either backend."""
    opts = dict(layers=4, hidden=256, heads=4, ffn=192, vocab=8192, seq=32, precision="bf16", master_weights=False,
                lora_rank=4, lora_targets="qv", lora_dropout=0.05, qkv_impl="fused", base_dtype="nf4",
                quantize_head=True, loss="lit-gpt", keep_logits="fp32")
    peaks = {}
    for backend in ("bnb", "bnb-fp16"):
        rep = validate(run_of(**opts, quant_backend=backend), device="cpu", world="real", steps=1, timeout=240)
        assert abs(rep["error"]) < 1e-4, (backend, rep["error"])
        peaks[backend] = rep["measured"]["phases"]["backward"]["peak_bytes"]
    # backward's highest moment is the head's backward: with bnb its dequantized copy and its input gradient (32 x
    # 256 x 2 B), with bnb-fp16 the two copies just before that gradient is allocated (the step's peak, with bnb, is
    # the next forward: the previous graph's held inputs, `graph_held_layer_bytes`)
    assert peaks["bnb-fp16"] - peaks["bnb"] == 8192 * 256 * 2 - 32 * 256 * 2
