"""FSDP2 moments where a layer's weights outweigh its activations (short sequences, full recompute, offloading), each
measured by the harness on one rank of a fake world of 8 (`--device meta`: fake tensors, every allocation's size
exact). Every phase is predicted to within 16 KiB or 0.15% (what is left is a few small tensors: the loss's
scalars, norm statistics; 15 KB and 31 KB (+0.11%) on the one-layer backwards). Before the fixes these rows missed
by:

- the last layer's copy-out in forward: its input (the stream, 2 x 256 x 512 x 2 B = 524,288 B) was taken off with
  its saved set though it is live before the layer runs (forward -0.8% to -1.2%; plain layers at seq 64 -0.2%);
- ZeRO-2 with offloaded activations and full recompute: the offloaded layer moments paired the first backward layer
  (k = 0) with the previous unit's reduce-scatter input, which exists from the second on (backward +6.6%);
- one layer: its copy-out is the first layer's, beside the root's all-gather output, not a layer's (forward
  +14%);
- the last layer's eager attention core: the previous unit's all-gather output, freed by the layer's copy-out, was
  held beside it (forward +3.5% with one layer);
- the attention core's backward: the layer's unsharded grads of its output projection and MLP, made before it, were
  not counted (a selectively recomputed eager core, ZeRO-3: backward -3.1%);
- the end of a layer's backward, one matmul earlier: the Q projection's input gradient, with the input norm's saved
  tensors, Q's gradient and the K + V input gradients' sum still live (5 stream-sized tensors: -1.0% at seq 64,
  -1.5% in fp32);
- offloaded with checkpointed layers below plain ones (--recompute-layers): a layer's end held the plain set of the
  layer next in backward where a checkpointed one comes (+2.8%);
- a later micro-batch (grad-accum 2), every sharded gradient of the earlier one made: its layers' backward lacked
  the previous unit's reduce-scatter input in flight (-0.2% here, -1.4% at h 2048), and its attention cores and
  its layer ends one matmul early (the Q projection's input gradient) were not candidates (eager selective fp16
  -5.4%, seq 64 -1.0%);
- the embedding's backward (fp32, a 32k vocabulary): its output gradient, read while the unsharded dense gradient is
  made, was not counted (-0.07%, 131,072 B)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memcalc.validate.api import validate  # noqa: E402
from tests.conftest import prediction_gap, run_of  # noqa: E402

SHAPE = dict(layers=4, hidden=512, heads=8, ffn=1408, vocab=1024, seq=256, micro_batch=2, gpus=8)

CASES = {
    "zero3-full": dict(zero=3, recompute="full"),
    "zero2-full": dict(zero=2, recompute="full"),
    "zero2-full-offloaded": dict(zero=2, recompute="full", offload_activations=True),
    "zero2-selective-offloaded": dict(zero=2, recompute="selective", offload_activations=True),
    "zero3-full-offloaded": dict(zero=3, recompute="full", offload_activations=True),
    "zero2-seq64": dict(zero=2, seq=64),
    "zero3-one-layer-seq64": dict(zero=3, seq=64, layers=1),
    "zero2-one-layer-full-seq64": dict(zero=2, seq=64, layers=1, recompute="full"),
    "zero2-one-layer-eager-selective": dict(zero=2, seq=128, layers=1, recompute="selective", attention="eager"),
    "zero3-eager-selective": dict(zero=3, seq=128, recompute="selective", attention="eager"),
    "zero3-seq64": dict(zero=3, seq=64),
    "zero3-fp32-seq128-mb1": dict(zero=3, seq=128, micro_batch=1, precision="fp32", ffn=704, vocab=4096),
    "zero3-offloaded-full-2-of-4-seq64": dict(zero=3, seq=64, offload_activations=True, recompute="full",
                                              recompute_layers=2),
    "zero3-grad-accum-fp32-h1024": dict(zero=3, hidden=1024, ffn=2816, vocab=8192, seq=512, micro_batch=1,
                                        grad_accum=2, precision="fp32"),
    "zero3-grad-accum-eager-selective-fp16": dict(zero=3, grad_accum=2, recompute="selective", attention="eager",
                                                  precision="fp16"),
    "zero3-grad-accum-seq64": dict(zero=3, seq=64, grad_accum=2),
}


@pytest.mark.parametrize("opts", CASES.values(), ids=CASES.keys())
def test_fsdp2_moments_of_weight_heavy_layers(opts):
    rep = validate(run_of(**{**SHAPE, **opts}), device="meta", world="fake", steps=1, timeout=240)
    gap = prediction_gap(rep)
    measured = {r["name"]: r["measured"] for r in rep["rows"] if r["section"] == "phases"}
    for phase in ("forward", "backward", "optimizer"):
        assert abs(gap[phase]) <= max(16384, 0.0015 * measured[phase]), (phase, gap)


@pytest.mark.parametrize("opts", [dict(), dict(recompute="selective"), dict(recompute="full")],
                         ids=["plain", "selective", "full"])
def test_offloaded_eager_attention(opts):
    """Eager attention with offloaded activations (ZeRO-3, 2 layers of 8 heads, 256 tokens: s x s scores outweigh the
    layer). Forward: the last layer's core moment was not modelled under offloading (-13% plain, -34% selective);
    now within 0.05%. Backward: the first layer's core moment with its own set and the next one's resident, an
    upper bound (the harness frees a reloaded storage once its references are unpacked): within -0.1% .. +4%
    (selective was -34%)."""
    run = run_of(**{**SHAPE, "layers": 2, "hidden": 128, "ffn": 128, "seq": 256, "micro_batch": 1,
                    "attention": "eager", "offload_activations": True, "zero": 3, **opts})
    rep = validate(run, device="meta", world="fake", steps=1, timeout=240)
    err = {r["name"]: (r["predicted"] - r["measured"]) / r["measured"] for r in rep["rows"] if r["section"] == "phases"}
    assert abs(err["forward"]) < 0.0005, err
    assert -0.001 < err["backward"] < 0.04, err



def test_the_embeddings_backward_holds_its_output_gradient():
    """FSDP2 ZeRO-3, fp32, a 32k vocabulary at 128 tokens: the backward's peak is the embedding's backward, its
    unsharded dense gradient (32000 x 256 x 4 B) made while the embedding's output gradient (128 x 256 x 4 B =
    131,072 B) is read (`activations._fsdp_root_backward`). Within 4 KiB (the loss's scalars); 133,228 B low before."""
    opts = dict(zero=3, layers=2, hidden=256, heads=4, ffn=704, vocab=32000, seq=128, micro_batch=1, precision="fp32")
    rep = validate(run_of(**{**SHAPE, **opts}), device="meta", world="fake", steps=1, timeout=240)
    assert abs(prediction_gap(rep)["backward"]) <= 4096, prediction_gap(rep)


def test_the_last_prefetching_layers_attention_core():
    """FSDP2 ZeRO-3, fp32, full recompute of a 2048-token eager core (CUDA's math path for fp32 GQA): the backward's
    peak is the attention core of the last layer that prefetches the next unit (the last but one), its earlier
    layers' sharded gradients (6,619,648 B each over 8 ranks) outweighing their checkpoints (2048 x 512 x 4 B).
    The first and last layers' cores bound it only without the prefetch: 2,441,920 B low before (-2.0% for Llama
    3.2 1B at 16 layers); within an int64 token tensor (2048 x 8 B) and the loss's scalars after."""
    opts = dict(model="llama-3.2-1b", zero=3, recompute="full", precision="fp32", layers=4, hidden=512, heads=32,
                kv_heads=8, ffn=8192, vocab=32000, seq=2048, micro_batch=1)
    rep = validate(run_of(**{**SHAPE, **opts}), device="meta", world="fake", steps=1, timeout=240)
    assert abs(prediction_gap(rep)["backward"]) <= 2048 * 8 + 4096, prediction_gap(rep)
