"""Published *measured* per-GPU peaks against `memcalc.cost.estimate.estimate` with the matching profile.

Every case, its source and its configuration are recorded in docs/published-measurements.md. The issue's bar is
3% of the measurement. A case that misses is marked xfail with the error measured when it was written and the term
that is missing; the tolerance is never widened.

What is compared:
- SimuMax B200 (Megatron-LM, TransformerEngine): "real alloc" = max over ranks of torch.cuda.max_memory_allocated()
  -> memcalc's allocated peak of the worst stage (no fragmentation, no runtime overhead).
- torchtitan H100 benchmarks: "Memory(GiB)" = max over ranks of torch.cuda.max_memory_reserved() (torchtitan's
  metrics log max_reserved_gib) -> memcalc's reserved peak under the allocator's default policy: the compute
  stream's peak (with the bf16 logits' block it holds but cannot use at the loss gradient) / (1 - f), the first
  optimizer step's stranded foreach temporaries, plus FSDP2's all-gather and reduce-scatter stream pools (no
  runtime overhead: it is outside the allocator). The default policy, not the `expandable_segments:True` of
  torchtitan's run_train.sh: the page does not say how its 8- to 512-GPU runs were launched, and replaying both
  policies over memcalc's harness run of the two eager rows lands the default within 0.5% and expandable segments
  3.6-4.4% low (tests/test_torchtitan_record.py).
"""

from __future__ import annotations

import pytest

from memcalc.cost.estimate import estimate
from memcalc.specs import HardwareSpec, ModelSpec, ParallelSpec, TrainingSpec, resolve

GIB = 2**30
TOLERANCE = 0.03

# --- models (dimensions from the launch scripts / model cards cited in docs/published-measurements.md) ----------


def llama3_70b(layers: int) -> ModelSpec:
    # SimuMax simu_tools/megatron_scripts/scripts/run_pretrain_llama3.sh, MODEL_TYPE=llama3_70b
    return ModelSpec(name=f"llama3-70b-{layers}l", hidden=8192, layers=layers, heads=64, kv_heads=8, ffn=28672,
                     vocab=128256)


def llama3_405b(layers: int) -> ModelSpec:
    # same script, MODEL_TYPE=llama3_405b
    return ModelSpec(name=f"llama3-405b-{layers}l", hidden=16384, layers=layers, heads=128, kv_heads=16,
                     ffn=53248, vocab=128256)


_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128)


def deepseek_v2(layers: int) -> ModelSpec:
    # run_pretrain_deepseekv2.sh MODEL_TYPE=deepseek_v2: MLA (MLA_ARGS), 160 experts of 1536, top 6, shared
    # intermediate 3072 (= 2 x 1536), --moe-layer-freq ([0]*1+[1]*(L-1)): the first layer dense (ffn 12288)
    return ModelSpec(name=f"deepseek-v2-{layers}l", hidden=5120, layers=layers, heads=128, ffn=12288, vocab=102400,
                     mla=_MLA, moe=dict(experts=160, top_k=6, expert_ffn=1536, shared_experts=2,
                                        first_dense_layers=1))


def deepseek_v3(layers: int) -> ModelSpec:
    # same script, MODEL_TYPE=deepseek_v3: 256 experts of 2048, top 8, shared 2048; first layer dense (ffn 18432;
    # the summary: "DeepSeekV3 formal rows use dense_layers=1")
    return ModelSpec(name=f"deepseek-v3-{layers}l", hidden=7168, layers=layers, heads=128, ffn=18432, vocab=129280,
                     mla=_MLA, moe=dict(experts=256, top_k=8, expert_ffn=2048, shared_experts=1,
                                        first_dense_layers=1))


# torchtitan llama3 flavors "8B" / "70B" (Llama 3.1 model cards): untied embeddings, RMSNorm, SwiGLU, RoPE
LLAMA31_8B = ModelSpec(name="llama-3.1-8b", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256)
LLAMA31_70B = ModelSpec(name="llama-3.1-70b", hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256)

B200 = HardwareSpec(name="b200", memory_bytes=192 * 10**9)  # capacity does not enter the allocated peak
H100_96 = HardwareSpec(name="h100-96gb-hbm2e", memory_bytes=96 * 10**9)  # Grand Teton H100, 96 GB HBM2e


def megatron_alloc_gib(model: ModelSpec, tp: int, pp: int, dp: int, mbc: int, cp: int = 1, seq: int = 4096,
                       loss: str = "fused", ep: int = 1, stage: int | None = None) -> float:
    """run_pretrain_llama3.sh: seq 4096 (SEQ_LEN for the CP rows), micro-batch 1, bf16,
    --accumulate-allreduce-grads-in-fp32, --use-distributed-optimizer, --sequence-parallel, flash attention,
    TransformerEngine, `--recompute-num-layers 0` (no layer recomputed), num_microbatches = mbc; `_cef` =
    --cross-entropy-loss-fusion --cross-entropy-fusion-impl te (SimuMax docs/strategy.md): --loss fused; CP with
    --cp-comm-type a2a (the launcher's CP_COMM_TYPE default)."""
    t = TrainingSpec(seq=seq, micro_batch=1, grad_accum=mbc, precision="bf16", recompute="none", loss=loss)
    p = ParallelSpec(gpus=tp * pp * dp * cp, tp=tp, pp=pp, cp=cp, ep=ep, zero=1, sp=True,
                     cp_comm="a2a" if cp > 1 else "p2p")
    mem = estimate(resolve(model, t, p, B200, "megatron"), advice=False).memory
    if stage is not None:
        return mem.stages[stage].allocated_peak_bytes / GIB
    return max(s.allocated_peak_bytes for s in mem.stages) / GIB


def torchtitan_reserved_gib(model: ModelSpec, gpus: int, lbs: int, seq: int, recompute: str, tp: int = 1,
                            cp: int = 1, precision: str = "bf16") -> float:
    """torchtitan FSDP2: fp32 sharded params, MixedPrecisionPolicy(bf16, reduce fp32), AdamW (foreach); the
    allocator's default policy (module docstring)."""
    t = TrainingSpec(seq=seq, micro_batch=lbs, precision=precision, recompute=recompute)
    p = ParallelSpec(gpus=gpus, tp=tp, cp=cp, zero=3, sp=tp > 1)
    mem = estimate(resolve(model, t, p, H100_96, "torch"), advice=False).memory
    return max(s.reserved_peak_bytes for s in mem.stages) / GIB


# where each case was read, by case-id prefix (docs/validation.md lists every case with its source and error)
SOURCES = {
    "simumax": "MooreThreads/SimuMax `docs/b200/b200_release_v1.2_summary.md` (1b8ca90), \"real alloc GiB\" = max "
               "over ranks of `max_memory_allocated`; Megatron-LM on 8x B200",
    "torchtitan": "pytorch/torchtitan `benchmarks/llama3_h100_202412_torchtitan.md` (9dec370), \"Memory(GiB)\" = "
                  "max over ranks of `max_memory_reserved`; H100 96 GB",
}

# (id, measured GiB, predictor) -- SimuMax docs/b200/b200_release_v1.2_summary.md, "real alloc GiB"
SIMUMAX = [
    ("simumax-llama3-70b-l12-tp1-pp2-dp4", 66.55, lambda: megatron_alloc_gib(llama3_70b(12), 1, 2, 4, 4)),
    ("simumax-llama3-70b-l12-tp2-pp1-dp4", 60.68, lambda: megatron_alloc_gib(llama3_70b(12), 2, 1, 4, 4)),
    ("simumax-llama3-70b-l12-tp4-pp1-dp2", 39.07, lambda: megatron_alloc_gib(llama3_70b(12), 4, 1, 2, 4)),
    ("simumax-llama3-70b-l12-tp8-pp1-dp1", 28.29, lambda: megatron_alloc_gib(llama3_70b(12), 8, 1, 1, 4)),
    ("simumax-llama3-405b-l4-tp1-pp2-dp4", 87.08, lambda: megatron_alloc_gib(llama3_405b(4), 1, 2, 4, 4)),
    ("simumax-llama3-405b-l4-tp2-pp1-dp4", 81.59, lambda: megatron_alloc_gib(llama3_405b(4), 2, 1, 4, 4)),
    ("simumax-llama3-405b-l4-tp4-pp1-dp2", 52.89, lambda: megatron_alloc_gib(llama3_405b(4), 4, 1, 2, 4)),
    ("simumax-llama3-405b-l4-tp8-pp1-dp1", 38.57, lambda: megatron_alloc_gib(llama3_405b(4), 8, 1, 1, 4)),
    # the long-context rows: context parallelism with --cp-comm-type a2a, dp 1, seq 32K / 128K
    ("simumax-llama3-70b-l12-tp2-cp4-32k", 68.43,
     lambda: megatron_alloc_gib(llama3_70b(12), 2, 1, 1, 4, cp=4, seq=32768)),
    ("simumax-llama3-70b-l12-tp1-cp8-32k", 104.51,
     lambda: megatron_alloc_gib(llama3_70b(12), 1, 1, 1, 4, cp=8, seq=32768)),
    ("simumax-llama3-405b-l4-tp2-cp4-32k", 87.03,
     lambda: megatron_alloc_gib(llama3_405b(4), 2, 1, 1, 4, cp=4, seq=32768)),
    ("simumax-llama3-405b-l4-tp1-cp8-32k", 139.22,
     lambda: megatron_alloc_gib(llama3_405b(4), 1, 1, 1, 4, cp=8, seq=32768)),
    ("simumax-llama3-70b-l12-tp2-cp4-128k", 112.67,
     lambda: megatron_alloc_gib(llama3_70b(12), 2, 1, 1, 4, cp=4, seq=131072)),
    ("simumax-llama3-70b-l12-tp1-cp8-128k", 147.99,
     lambda: megatron_alloc_gib(llama3_70b(12), 1, 1, 1, 4, cp=8, seq=131072)),
    ("simumax-llama3-405b-l4-tp2-cp4-128k", 118.13,
     lambda: megatron_alloc_gib(llama3_405b(4), 2, 1, 1, 4, cp=4, seq=131072)),
    # the MoE rows: run_pretrain_deepseekv2.sh (MLA, alltoall dispatcher, grouped GEMM, permute fusion), ep x dp
    # over 8 GPUs, 4 layers. The pp = 2 rows also per stage, from docs/b200/b200_release_v1.2_summary.json
    # `peak_memory_by_rank_mb` (ranks 0-3 are stage 0: 32,342.7 and 72,948.3 MiB)
    ("simumax-deepseekv2-l4-tp1-ep8-pp1-dp8", 45.63, lambda: megatron_alloc_gib(deepseek_v2(4), 1, 1, 8, 4, ep=8)),
    ("simumax-deepseekv2-l4-tp1-ep4-pp2-dp4", 44.70, lambda: megatron_alloc_gib(deepseek_v2(4), 1, 2, 4, 4, ep=4)),
    ("simumax-deepseekv2-l4-ep4-pp2-stage0", round(32342.72216796875 / 1024, 2),
     lambda: megatron_alloc_gib(deepseek_v2(4), 1, 2, 4, 4, ep=4, stage=0)),
    ("simumax-deepseekv3-l4-tp1-ep8-pp1-dp8", 104.30, lambda: megatron_alloc_gib(deepseek_v3(4), 1, 1, 8, 4, ep=8)),
    ("simumax-deepseekv3-l4-tp1-ep4-pp2-dp4", 114.00, lambda: megatron_alloc_gib(deepseek_v3(4), 1, 2, 4, 4, ep=4)),
    ("simumax-deepseekv3-l4-ep4-pp2-stage0", round(72948.29345703125 / 1024, 2),
     lambda: megatron_alloc_gib(deepseek_v3(4), 1, 2, 4, 4, ep=4, stage=0)),
]

_TP_2D = ("the caching allocator's, not a missing tensor: memcalc's harness allocates memcalc's allocated peak for "
          "this layout and the default policy replayed over its allocations reserves 71.85 GiB (-0.1%); the "
          "closed form's slack leaves out the layers' 2 GiB blocks (SP all-gathered inputs, row-parallel outputs: "
          "16 segments, 8.5 GiB of them free at the loss gradient) that the loss's 7.8 GiB logit-sized blocks "
          "cannot use (docs/data/torchtitan-replay.json); the run with AsyncTP, which changes how those in-block "
          "collectives allocate, measured 4.3 GiB less")


def _xfail(reason: str):
    return pytest.mark.xfail(reason=reason, strict=False)


# torchtitan benchmarks/llama3_h100_202412_torchtitan.md. Tables 1 and 3 are the eager "FSDP" rows; Table 2's
# compile + Float8 act inside the (fully recomputed) blocks, below the loss gradient where the peak is.
TORCHTITAN = [
    ("torchtitan-8b-fsdp8-lbs2-sac", 82.4, lambda: torchtitan_reserved_gib(LLAMA31_8B, 8, 2, 8192, "op")),
    ("torchtitan-8b-fsdp128-lbs2-sac", 67.0, lambda: torchtitan_reserved_gib(LLAMA31_8B, 128, 2, 8192, "op")),
    ("torchtitan-8b-fsdp8-cp1-32k-full-fp8-compile", 83.9,
     lambda: torchtitan_reserved_gib(LLAMA31_8B, 8, 1, 32768, "full", precision="fp8")),
    ("torchtitan-8b-fsdp4-cp2-64k-full-fp8-compile", 84.2,
     lambda: torchtitan_reserved_gib(LLAMA31_8B, 8, 1, 65536, "full", cp=2, precision="fp8")),
    ("torchtitan-8b-fsdp2-cp4-128k-full-fp8-compile", 84.0,
     lambda: torchtitan_reserved_gib(LLAMA31_8B, 8, 1, 131072, "full", cp=4, precision="fp8")),
    ("torchtitan-8b-fsdp1-cp8-256k-full-fp8-compile", 84.5,
     lambda: torchtitan_reserved_gib(LLAMA31_8B, 8, 1, 262144, "full", cp=8, precision="fp8")),
    pytest.param("torchtitan-70b-fsdp32-tp8-lbs16-full-fp8-compile", 71.9,
                 lambda: torchtitan_reserved_gib(LLAMA31_70B, 256, 16, 8192, "full", tp=8, precision="fp8"),
                 marks=_xfail("-9.7% (-18.5% before FSDP2's stream pools and the stranded logits block): "
                              + _TP_2D)),
]


@pytest.mark.parametrize("case,measured_gib,predict", SIMUMAX + TORCHTITAN)
def test_published_measured_peak(case, measured_gib, predict):
    predicted = predict()
    error = (predicted - measured_gib) / measured_gib
    assert abs(error) <= TOLERANCE, f"{case}: predicted {predicted:.2f} GiB, measured {measured_gib} GiB ({error:+.1%})"


def test_te_dummy_wgrads_are_needed_for_the_megatron_cases():
    """TransformerEngine's dummy wgrad cache (one layer's linear weights in bf16, 1.59 GiB at 70B width and tp=1:
    855,638,016 elements * 2 B) brings the tp1-pp2 case closer to the measurement than it would be without."""
    from memcalc.cost.buffers import stage_buffers

    t = TrainingSpec(seq=4096, micro_batch=1, grad_accum=4, precision="bf16")
    r = resolve(llama3_70b(12), t, ParallelSpec(gpus=8, tp=1, pp=2, zero=1, sp=True), B200, "megatron")
    dummy = stage_buffers(r, 0)["te_dummy_wgrads"].bytes
    assert dummy == 2 * (8192 * (8192 + 2 * 1024) + 8192 * 8192 + 2 * 28672 * 8192 + 8192 * 28672) == 1_711_276_032
    predicted = megatron_alloc_gib(llama3_70b(12), 1, 2, 4, 4)
    assert abs((predicted - 66.55) / 66.55) <= TOLERANCE
    assert abs(predicted - 66.55) < abs(predicted - dummy / GIB - 66.55)


def test_megatron_head_backward_and_the_long_context_terms():
    """What moved the Megatron cases: the LM head's backward after the loss gradient, and, at long context, the
    run's fused cross-entropy and all-to-all CP. 405B, 4 layers, tp 2 (vocab shard 64,128 x hidden 16,384, 4,096
    tokens): the head's backward allocates gradient-accumulation fusion's dummy weight gradient, 2 x 64,128 x
    16,384 = 2,101,346,304 B, which no other moment of the step holds beside all the saved activations; less that
    copy, the case would be more than 2% low. 70B at 128K with tp 2 x cp 4 (32,768 tokens per rank): the unfused
    loss's fp32 softmax, 4 x 32,768 x 64,128 B = 7.8 GiB where the fused kernel keeps the 3.9 GiB of bf16 logits,
    would put the prediction 5% high; all-to-all CP saves each layer's pre-exchange output once more, 2 x 32,768 x
    4,096 B x 12 layers = 3 GiB (with p2p's saved set the prediction is 2.7% low)."""
    from memcalc.cost.activations import _megatron_head_backward

    t = TrainingSpec(seq=4096, micro_batch=1, grad_accum=4, precision="bf16", loss="fused")
    r = resolve(llama3_405b(4), t, ParallelSpec(gpus=8, tp=2, zero=1, sp=True), B200, "megatron")
    tok, h, v_t = 4096, 16384, 64128
    dummy = 2 * v_t * h
    assert dummy == 2_101_346_304
    # logits gradient (the saved logits, overwritten) + input gradient, re-gathered input and reduce-scattered
    # gradient under SP + the dummy, less what the loss frees (the logits and 3 x tp fp32 statistics per token)
    assert _megatron_head_backward(r) == (2 * tok * v_t + 2 * tok * h * 2 + 2 * (tok // 2) * h + dummy
                                          - (2 * tok * v_t + 12 * tok * 2))
    with_dummy = megatron_alloc_gib(llama3_405b(4), 2, 1, 4, 4)
    assert abs(with_dummy - 81.59) / 81.59 <= 0.005
    assert (with_dummy - dummy / GIB - 81.59) / 81.59 < -0.02

    full = megatron_alloc_gib(llama3_70b(12), 2, 1, 1, 4, cp=4, seq=131072, loss="full")
    fused = megatron_alloc_gib(llama3_70b(12), 2, 1, 1, 4, cp=4, seq=131072)
    assert (full - 112.67) / 112.67 > 0.04 and abs(fused - 112.67) / 112.67 <= 0.005
    pre_a2a = 2 * 32768 * (64 // 2) * 128 * 12
    assert pre_a2a == 3 * GIB
    t = TrainingSpec(seq=131072, micro_batch=1, grad_accum=4, precision="bf16", loss="fused")
    p2p = resolve(llama3_70b(12), t, ParallelSpec(gpus=8, tp=2, cp=4, zero=1, sp=True), B200, "megatron")
    p2p_gib = max(s.allocated_peak_bytes for s in estimate(p2p, advice=False).memory.stages) / GIB
    assert (p2p_gib - 112.67) / 112.67 < -0.02


def test_deepseek_rows_model_states_and_the_moe_terms():
    """The DeepSeek-V2 ep8 case, piece by piece (hand arithmetic; docs/published-measurements.md).
    Per layer: MLA 149,227,520 parameters (q_down 1536 x 5120 + q_up 24,576 x 1536 + kv_down 576 x 5120 + kv_up
    32,768 x 512 + proj 5120 x 16,384 + latent norms 1536 + 512) and two RMSNorms of 5120; an MoE layer adds 160
    experts x 3 x 5120 x 1536 (split over ep 8: 20 per rank) + 2 shared x 3 x 5120 x 1536 + router 160 x 5120; the
    dense first layer 3 x 5120 x 12,288. Megatron's distributed optimizer: bf16 params and fp32 grads on every rank,
    12 B of master + Adam per parameter over the data-parallel group (dp 8 for dense parameters, dp / ep = 1 for
    experts)."""
    from memcalc.cost.activations import layer_terms
    from memcalc.cost.params import attention_params, stage_params

    t = TrainingSpec(seq=4096, micro_batch=1, grad_accum=4, precision="bf16", loss="fused")
    r = resolve(deepseek_v2(4), t, ParallelSpec(gpus=8, ep=8, zero=1, sp=True), B200, "megatron")
    assert attention_params(r.model) == 1536 * 5120 + 24576 * 1536 + 576 * 5120 + 32768 * 512 + 5120 * 16384 + 2048 \
        == 149_227_520
    dense, expert = stage_params(r, 0)
    norms = 2 * 5120
    assert expert == 3 * 20 * 3 * 5120 * 1536
    moe_dense = 149_227_520 + norms + 2 * 3 * 5120 * 1536 + 160 * 5120
    assert dense == 3 * moe_dense + (149_227_520 + norms + 3 * 5120 * 12288) + 2 * 102400 * 5120 + 5120
    mem = estimate(r, advice=False).memory.stages[0].components
    assert mem["params"] == 2 * (dense + expert) and mem["grads"] == 4 * (dense + expert)
    assert mem["optimizer"] + mem["master_weights"] == 12 * expert + 12 * (-(-dense // 8))
    # one MoE layer's saved set (tok = 4096, R = 6 x 4096 routed rows, h 5120, f 1536, E 160, k 6)
    tok, R, h, f, E, k = 4096, 6 * 4096, 5120, 1536, 160, 6
    terms = layer_terms(r)
    mla = (2 * h + 4) + 2 * h + (4 * 1536 + 4) + (4 * 512 + 4) + 2 * 2 * 128 * 192 + 2 * 128 * 128 + 4 * 128 \
        + 2 * 128 * 128
    assert mla == 193_036  # bytes per token
    # the pre-MLP norm (input + rstd), its output, two fp32 softmaxes, two bool masks + two int64 top-k + the int32
    # row-id map, the shared experts' SwiGLU input (2 x 3072) and fc2 input (3072)
    moe = (2 * h + 4) + 2 * h + 8 * E + (2 * E + 16 * k + 4 * (2 * E + 1)) + 2 * 3 * 3072
    routed = 2 * h + 2 * 2 * f + 2 + 2 * f  # fc1 input, weighted SwiGLU input and its probability, fc2 input
    assert sum(terms.values()) == tok * (mla + moe) + R * routed
