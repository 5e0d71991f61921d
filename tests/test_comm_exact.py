"""Collectives to the call and the byte: what `memcalc validate` measures for the torch profile, computed by hand.

Every figure below is derived in the docstring or the comment next to it, from the shapes of the layers and the
rules in docs/methodology.md ("Communication", sections 1 and 3). The first part needs only the cost model; the
last part runs the harness (torch, the validate extra) on small configurations and asserts that every collective
of the measured rank is exact (calls and bytes), as in docs/validation.md.

Shapes used (scripts/validation_matrix.py): LLAMA = 4 layers, h = 64, 4 heads (head dim 16), FFN 176 (SwiGLU),
vocab 512, seq 64, micro-batch 1, RMSNorm, untied. One layer: q, k, v, o 64 x 64 = 4,096 each; gate, up 176 x 64
and down 64 x 176 = 11,264 each; two norms of 64: 4 x 4,096 + 3 x 11,264 + 2 x 64 = 50,304 elements. Root (the
parameters outside the layers): embedding 512 x 64 = 32,768, final norm 64, head 512 x 64 = 32,768: 65,600.
One activation s x b x h = 64 x 1 x 64 = 4,096 elements (16,384 B fp32, 8,192 B bf16).
"""

from __future__ import annotations

import numpy as np
import pytest

from memcalc.cost import comm, compute
from tests.conftest import run_of

LLAMA = dict(layers=4, hidden=64, heads=4, ffn=176, vocab=512, seq=64)
GQA = dict(LLAMA, heads=8, kv_heads=4)
GPT2 = dict(layers=4, hidden=64, heads=4, ffn=256, vocab=512, seq=64, mlp="gelu", norm="layernorm",
            positions="learned", max_positions=64, bias=True, tied_embeddings=False)


def totals(run, stage=0, skip=None):
    """{(op, group): (calls, full-buffer bytes)} of one step, as `memcalc validate` compares them (without the
    collectives whose note contains `skip`)."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for c in comm.collectives(run, stage=stage):
        if skip and skip in c.note:
            continue
        calls, b = out.get((c.op, c.group), (0, 0))
        out[(c.op, c.group)] = (calls + c.calls_per_step, b + c.bytes_per_call * c.calls_per_step)
    return out


def dtypes(run, op, group, stage=0, skip=None):
    return {c.dtype for c in comm.collectives(run, stage=stage)
            if c.op == op and c.group == group and not (skip and skip in c.note)}


LP = "loss_parallel"  # torch TP's vocab-parallel loss: 3 fp32 all-reduces of one value per token per micro-batch


def test_loss_parallel_all_reduces():
    """Every TP row: loss_parallel all-reduces the max logit, the sum of exp and the target logit, one fp32 value
    per token: seq 64 x micro-batch 1 x 4 B = 256 B, 3 calls per micro-batch, in forward on the last stage."""
    t = totals(run_of(**LLAMA, precision="fp32", gpus=2, tp=2))
    assert t[("all-reduce", "tp")][0] - totals(run_of(**LLAMA, precision="fp32", gpus=2, tp=2), skip=LP)[
        ("all-reduce", "tp")][0] == 3
    ce = [c for c in comm.collectives(run_of(**LLAMA, precision="bf16", gpus=2, tp=2, grad_accum=2)) if LP in c.note]
    assert [(c.calls_per_step, c.bytes_per_call, c.dtype) for c in ce] == [(6, 256, "fp32")]


# ------------------------------------------------------------------------------------------ FSDP2 (dp)


def test_fsdp2_zero3_one_call_per_unit_no_padding():
    """Row 27 (FSDP2 ZeRO-3 fp32, 2 ranks): every dim 0 divides by 2, a layer's unit is 50,304 x 4 = 201,216 B and
    the root's 65,600 x 4 = 262,400 B. All-gather: 4 layers + the root in forward, 3 layers again in backward (the
    last is kept gathered from its forward, torchtitan's default) = 8 calls, 7 x 201,216 + 262,400 = 1,670,912 B.
    Reduce-scatter: 5 calls, 4 x 201,216 + 262,400 = 1,067,264 B."""
    run = run_of(**LLAMA, precision="fp32", gpus=2, zero=3)
    assert 50_304 * 4 == 201_216 and 65_600 * 4 == 262_400
    t = totals(run)
    assert t[("all-gather", "dp")] == (8, 7 * 201_216 + 262_400) == (8, 1_670_912)
    assert t[("reduce-scatter", "dp")] == (5, 4 * 201_216 + 262_400) == (5, 1_067_264)


def test_fsdp2_zero3_dim0_padding_world_64():
    """Row 48 (one rank of 64, bf16 gathers, fp32 reduce-scatters): gate and up have 176 rows, padded to
    ceil(176 / 64) x 64 = 192: +2 x 16 x 64 = 2,048 elements per layer, 52,352 in all; the root's dims (512, 64)
    divide by 64. All-gather (bf16): 7 x 52,352 x 2 + 65,600 x 2 = 732,928 + 131,200 = 864,128 B in 8 calls;
    reduce-scatter (fp32): 4 x 52,352 x 4 + 65,600 x 4 = 837,632 + 262,400 = 1,100,032 B in 5 calls."""
    run = run_of(**LLAMA, precision="bf16", gpus=64, zero=3)
    assert 50_304 + 2 * 16 * 64 == 52_352
    t = totals(run)
    assert t[("all-gather", "dp")] == (8, 7 * 52_352 * 2 + 65_600 * 2) == (8, 864_128)
    assert t[("reduce-scatter", "dp")] == (5, 4 * 52_352 * 4 + 65_600 * 4) == (5, 1_100_032)
    assert dtypes(run, "all-gather", "dp") == {"bf16"} and dtypes(run, "reduce-scatter", "dp") == {"fp32"}


def test_fsdp2_zero3_dim0_padding_world_1024():
    """Row 50 (one rank of 1024, fp32): every dim 0 pads to 1024 rows. Layer: q, k, v, o 4 x 1024 x 64 = 262,144;
    gate, up 2 x 1024 x 64 = 131,072; down 1024 x 176 = 180,224; norms 2 x 1024 = 2,048: 575,488 elements =
    2,301,952 B. Root: 1024 x 64 + 1024 + 1024 x 64 = 132,096 = 528,384 B. All-gather 7 x 2,301,952 + 528,384 =
    16,642,048 B in 8 calls (the last layer kept into its backward); reduce-scatter 4 x 2,301,952 + 528,384 =
    9,736,192 B in 5."""
    run = run_of(**LLAMA, precision="fp32", gpus=1024, zero=3)
    assert 262_144 + 131_072 + 180_224 + 2_048 == 575_488
    t = totals(run)
    assert t[("all-gather", "dp")] == (8, 7 * 575_488 * 4 + 132_096 * 4) == (8, 16_642_048)
    assert t[("reduce-scatter", "dp")] == (5, 4 * 575_488 * 4 + 132_096 * 4) == (5, 9_736_192)


def test_fsdp2_zero2_world_128_and_grad_accum():
    """Row 49 (ZeRO-2, one rank of 128, bf16): 176 -> 256 rows (+2 x 80 x 64 = 10,240 per layer: 60,544);
    64 -> 128 rows for q, k, v, o, down and the norms (+4 x 64 x 64 + 64 x 176 + 2 x 64 = 27,776: 88,320 per
    layer); root: 512 x 64 x 2 + 128 = 65,664. All-gather once per unit: 4 x 88,320 x 2 + 65,664 x 2 = 837,888 B
    in 5 calls; reduce-scatter (fp32) 1,675,776 B in 5. With 2 micro-batches every unit is gathered and reduced
    once per micro-batch: 10 calls each."""
    assert 50_304 + 10_240 + 27_776 == 88_320
    run = run_of(**LLAMA, precision="bf16", gpus=128, zero=2)
    t = totals(run)
    assert t[("all-gather", "dp")] == (5, 4 * 88_320 * 2 + 65_664 * 2) == (5, 837_888)
    assert t[("reduce-scatter", "dp")] == (5, 4 * 88_320 * 4 + 65_664 * 4) == (5, 1_675_776)
    t2 = totals(run_of(**LLAMA, precision="fp32", gpus=2, zero=2, grad_accum=2))
    assert t2[("all-gather", "dp")] == (10, 2 * (4 * 201_216 + 262_400))
    assert t2[("reduce-scatter", "dp")] == (10, 2 * (4 * 201_216 + 262_400))


def test_pipeline_fsdp2_zero3_gathers_m_plus_one_per_layer():
    """Row 45 (PP2 x FSDP2 ZeRO-3 fp32, 4 ranks, m = 2): 2 layers per stage. Under pipelining a layer stays
    gathered from a backward to the next forward and the grads are reduce-scattered once per step: each layer is
    gathered m + 1 = 3 times, the root once. Stage 0 (root: embedding 32,768 x 4 = 131,072 B): 6 x 201,216 +
    131,072 = 1,338,368 B in 7 calls; reduce-scatter 2 x 201,216 + 131,072 = 533,504 B in 3. Stage 1 (root: final
    norm + head 32,832 x 4 = 131,328 B): 1,338,624 B and 533,760 B. GPipe with m = 4: 2 x 5 + 1 = 11 gathers."""
    run = run_of(**LLAMA, precision="fp32", gpus=4, pp=2, zero=3, grad_accum=2)
    t0, t1 = totals(run, 0), totals(run, 1)
    assert t0[("all-gather", "dp")] == (7, 6 * 201_216 + 131_072) == (7, 1_338_368)
    assert t0[("reduce-scatter", "dp")] == (3, 2 * 201_216 + 131_072) == (3, 533_504)
    assert t1[("all-gather", "dp")] == (7, 6 * 201_216 + 131_328) == (7, 1_338_624)
    assert t1[("reduce-scatter", "dp")] == (3, 2 * 201_216 + 131_328) == (3, 533_760)
    gpipe = run_of(**LLAMA, precision="fp32", gpus=4, pp=2, zero=3, grad_accum=4, schedule="gpipe")
    assert totals(gpipe, 0)[("all-gather", "dp")] == (11, 10 * 201_216 + 131_072)
    # ZeRO-2 under pipelining: every unit once per step
    z2 = run_of(**LLAMA, precision="fp32", gpus=4, pp=2, zero=2, grad_accum=2)
    assert totals(z2, 0)[("all-gather", "dp")] == (3, 2 * 201_216 + 131_072)


def test_zero_redundancy_optimizer_one_broadcast_per_tensor():
    """Rows 22 and 47: `_sync_params` broadcasts each of the 4 x 9 + 3 = 39 parameter tensors from its owner:
    q, k, v, o 16 x 16,384 B; gate, up, down 12 x 45,056 B; norms 9 x 256 B; embedding and head 2 x 131,072 B:
    262,144 + 540,672 + 2,304 + 262,144 = 1,067,264 B (= 4P). Equal sizes are one line each."""
    for gpus in (2, 32):
        run = run_of(**LLAMA, precision="fp32", gpus=gpus, zero=1)
        assert totals(run)[("broadcast", "dp")] == (39, 16 * 16_384 + 12 * 45_056 + 9 * 256 + 2 * 131_072)
        lines = sorted((c.bytes_per_call, c.calls_per_step) for c in comm.collectives(run) if c.op == "broadcast")
        assert lines == [(256, 9), (16_384, 16), (45_056, 12), (131_072, 2)]
        assert totals(run)[("all-reduce", "dp")] == (1, 1_067_264)


# ------------------------------------------------------------------------------------------ TP (tp)


def test_tp_sp_norm_grads_all_reduced_per_optimizer_read():
    """Row 34 (TP2+SP fp32 AdamW, RMSNorm): the 2 x 4 + 1 = 9 SequenceParallel norm weights have Partial grads,
    all-reduced by each optimizer read: AdamW 3 (lerp_, addcmul_(grad, grad)) -> 27 calls x 64 x 4 B = 6,912 B.
    SGD reads the grad once: 9 calls, 2,304 B. Pure bf16: 27 x 128 B = 3,456 B in bf16; bf16 grads with an fp32
    master copy: the optimizer reads the fp32 copy, 27 x 256 B. Gradient accumulation changes nothing (the grad
    stays Partial until the step)."""
    base = dict(LLAMA, gpus=2, tp=2, sp=True)
    # with the loss's 3 x 256 B: 30 calls, 7,680 B; the norm grads alone below
    assert totals(run_of(**base, precision="fp32"))[("all-reduce", "tp")] == (30, 6_912 + 3 * 256)
    assert totals(run_of(**base, precision="fp32"), skip=LP)[("all-reduce", "tp")] == (27, 27 * 64 * 4) == (27, 6_912)
    assert totals(run_of(**base, precision="fp32", optimizer="sgd"), skip=LP)[("all-reduce", "tp")] == (9, 2_304)
    assert totals(run_of(**base, precision="fp32", optimizer="sgd-momentum"), skip=LP)[("all-reduce", "tp")] == (
        9, 2_304)
    pure = run_of(**base, precision="bf16", master_weights=False)
    assert totals(pure, skip=LP)[("all-reduce", "tp")] == (27, 27 * 64 * 2)
    assert dtypes(pure, "all-reduce", "tp", skip=LP) == {"bf16"}
    master = run_of(**base, precision="bf16", grad_dtype="bf16")
    assert totals(master, skip=LP)[("all-reduce", "tp")] == (27, 6_912)
    assert dtypes(master, "all-reduce", "tp") == {"fp32"}
    assert totals(run_of(**base, precision="fp32", grad_accum=2), skip=LP)[("all-reduce", "tp")] == (27, 6_912)


def test_tp_sp_layernorm_weight_and_bias():
    """Row 38 (GPT-2 block, LayerNorm with bias, TP2+SP, AdamW): 9 norms x 2 tensors x 3 reads = 54 calls x 256 B =
    13,824 B; the row-parallel biases and the learned positions have Replicate grads (no call)."""
    run = run_of(**GPT2, precision="fp32", gpus=2, tp=2, sp=True)
    assert totals(run, skip=LP)[("all-reduce", "tp")] == (54, 54 * 256) == (54, 13_824)


def test_tp_sp_norm_grads_under_fsdp2_once_per_micro_batch():
    """Rows 39 and 51: with FSDP2, `_get_grad_inner_tensor` redistributes each of the 9 norm grads once per
    micro-batch, in FSDP2's param dtype: fp32 9 x 256 = 2,304 B; 2 micro-batches 18 calls; bf16 (GQA, TP4) 9 x 128 =
    1,152 B."""
    fp32 = dict(LLAMA, precision="fp32", gpus=4, tp=2, sp=True, zero=3)
    assert totals(run_of(**fp32), skip=LP)[("all-reduce", "tp")] == (9, 2_304)
    assert totals(run_of(**fp32, grad_accum=2), skip=LP)[("all-reduce", "tp")] == (18, 4_608)
    bf16 = run_of(**GQA, precision="bf16", gpus=8, tp=4, sp=True, zero=3)
    assert totals(bf16, skip=LP)[("all-reduce", "tp")] == (9, 1_152)
    assert dtypes(bf16, "all-reduce", "tp", skip=LP) == {"bf16"}


def test_tp_sp_amp_norm_outputs_travel_in_fp32():
    """Row 35 (TP4+SP, AMP bf16, GQA): the residual stream is fp32 under autocast. All-gathers: 8 norm outputs
    (fwd) + LM-head input (fwd) + embedding grad (bwd) in fp32 = 10 x 16,384; 8 o / down output grads (bwd) in bf16
    = 8 x 8,192 (the logits stay vocab-sharded): 18 calls, 229,376 B. Reduce-scatters: 8 o / down outputs (fwd) bf16
    + 8 norm-output grads (bwd) + embedding output (fwd) + LM-head input grad (bwd) fp32: 18 calls,
    8 x 8,192 + 10 x 16,384 = 229,376 B."""
    run = run_of(**GQA, precision="bf16", gpus=4, tp=4, sp=True)
    t = totals(run)
    assert t[("all-gather", "tp")] == (18, 10 * 16_384 + 8 * 8_192) == (18, 229_376)
    assert t[("reduce-scatter", "tp")] == (18, 8 * 8_192 + 10 * 16_384) == (18, 229_376)
    assert dtypes(run, "all-gather", "tp") == dtypes(run, "reduce-scatter", "tp") == {"bf16", "fp32"}


def test_tp_amp_without_sp_and_full_recompute():
    """TP2 without SP under AMP bf16 (measured with the harness): forward 8 all-reduces of o / down outputs (bf16,
    8,192 B) + the embedding output (fp32, 16,384 B); backward 5 x 4 column-parallel input grads + the LM-head
    input grad (fp32): 30 calls, 8 x 8,192 + 22 x 16,384 = 425,984 B. Full recompute replays one bf16 all-reduce
    per layer: 34 calls, 458,752 B."""
    base = dict(LLAMA, precision="bf16", gpus=2, tp=2)
    assert totals(run_of(**base), skip=LP)[("all-reduce", "tp")] == (30, 8 * 8_192 + 22 * 16_384) == (30, 425_984)
    assert totals(run_of(**base, recompute="full"), skip=LP)[("all-reduce", "tp")] == (34, 425_984 + 4 * 8_192)


def test_tp_sp_full_recompute():
    """Row 36 (TP2+SP fp32, full recompute): +2 all-gathers and +1 reduce-scatter per layer: 19 + 8 = 27
    all-gathers less the logits (vocab-sharded): 26 x 16,384 = 425,984 B, 18 + 4 = 22 reduce-scatters (360,448 B)."""
    t = totals(run_of(**LLAMA, precision="fp32", gpus=2, tp=2, sp=True, recompute="full"))
    assert t[("all-gather", "tp")] == (26, 26 * 16_384) == (26, 425_984)
    assert t[("reduce-scatter", "tp")] == (22, 22 * 16_384) == (22, 360_448)


def test_full_recompute_with_dropout_replays_the_down_projections_collective():
    """With dropout a fully recomputed layer's re-run goes on through the down projection to the output dropout's
    mask, so it replays that projection's collective as well as the o projection's (docs/validation.md row 245,
    measured by the harness on a real gloo world: one reduce-scatter per layer short before). TP2 without SP, AMP:
    34 + 4 = 38 all-reduces (the 4 more bf16, 8,192 B); TP2 + SP, fp32: 22 + 4 = 26 reduce-scatters."""
    base = dict(LLAMA, precision="bf16", gpus=2, tp=2, recompute="full", dropout=0.1)
    assert totals(run_of(**base), skip=LP)[("all-reduce", "tp")] == (38, 425_984 + 8 * 8_192)
    t = totals(run_of(**LLAMA, precision="fp32", gpus=2, tp=2, sp=True, recompute="full", dropout=0.1))
    assert t[("reduce-scatter", "tp")] == (26, 26 * 16_384)


# ------------------------------------------------------------------------------------------ PP (pp)


def test_pipeline_send_recv_counts_the_senders_transfers_in_the_stream_dtype():
    """Row 43 (PP4 1F1B, AMP bf16, m = 8): the residual stream crosses the stages in fp32 (16,384 B). Stage 0 sends
    8 activations (131,072 B); a middle stage sends 8 activations and 8 gradients (16 calls); the last stage 8
    gradients. Receives are not counted (they are the neighbours' sends)."""
    run = run_of(**LLAMA, precision="bf16", gpus=4, pp=4, grad_accum=8)
    assert totals(run, 0)[("send/recv", "pp")] == (8, 8 * 16_384) == (8, 131_072)
    assert totals(run, 1)[("send/recv", "pp")] == (16, 16 * 16_384)
    assert totals(run, 3)[("send/recv", "pp")] == (8, 131_072)
    assert dtypes(run, "send/recv", "pp") == {"fp32"}
    fsdp = run_of(**LLAMA, precision="bf16", gpus=8, pp=4, zero=3, grad_accum=8)  # FSDP2 casts: bf16 stream
    assert totals(fsdp, 0)[("send/recv", "pp")] == (8, 8 * 8_192)


# ------------------------------------------------------------------------------------------ array form


def test_arrays_equal_scalars_on_the_exact_paths():
    """The planner's array form agrees with the scalar collectives on the new terms: FSDP2 on or off within one
    array (dp = 1 vs dp > 1 changes the stream dtype under AMP), pipelining on or off, SP norm grads."""
    layouts = [dict(gpus=8, tp=2, pp=1), dict(gpus=8, tp=2, pp=4), dict(gpus=8, tp=4, pp=1),
               dict(gpus=8, tp=4, pp=2), dict(gpus=8, tp=1, pp=2), dict(gpus=8, tp=1, pp=1)]
    fields = ["gpus", "dp", "tp", "pp", "vpp", "cp", "ep", "micro_batch", "grad_accum", "global_batch"]
    for zero in (0, 1, 2, 3):
        for extra in (dict(precision="bf16"), dict(precision="fp32", optimizer="sgd")):
            runs = [run_of(**LLAMA, sp=lay["tp"] > 1, zero=zero, grad_accum=4, **extra, **lay) for lay in layouts]
            arr = runs[0].replace(**{f: np.array([getattr(r, f) for r in runs], dtype=np.int64) for f in fields})
            for fn in (comm.comm_seconds_per_step, comm.exposed_comm_seconds, comm.comm_bytes_per_step,
                       compute.step_seconds):
                got = fn(arr)
                for i, r in enumerate(runs):
                    assert got[i] == fn(r), (fn.__name__, zero, extra, i)


# ------------------------------------------------------------------------------------------ measured (torch)

torch = pytest.importorskip("torch")

from memcalc.validate.api import validate  # noqa: E402

SMALL = dict(layers=2, hidden=64, heads=4, ffn=176, vocab=256, seq=32)


@pytest.mark.parametrize("kw,world,device", [
    (dict(precision="fp32", gpus=2, tp=2, sp=True), "real", "cpu"),
    (dict(precision="bf16", gpus=4, pp=2, zero=3, grad_accum=2), "real", "cpu"),
    (dict(precision="bf16", gpus=64, zero=3), "fake", "meta"),
    (dict(precision="fp32", gpus=4, zero=1), "fake", "cpu"),
])
def test_validate_collectives_exact(kw, world, device):
    """The harness measures what the model predicts, call for call and byte for byte (small shapes: 2 layers,
    FFN 176 so that world 64 pads gate and up)."""
    run = run_of(**SMALL, **kw)
    rep = validate(run, device=device, world=world, tolerance=1.0, timeout=120)
    assert rep["collectives"], rep["measured"]["collectives"]
    bad = [c for c in rep["collectives"] if not c["exact"]]
    assert not bad, bad
