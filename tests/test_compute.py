"""FLOPs, step time, tokens/s and MFU: published formulas (Narayanan et al. 2021 sec. 5.1, PaLM appendix B,
Kaplan et al. 2020), published active-parameter counts, and one step time computed by hand."""

from __future__ import annotations

import pytest

from memcalc.cost import comm, compute
from memcalc.cost.estimate import estimate
from memcalc.cost.states import model_states
from memcalc.errors import InputError
from memcalc.specs import HardwareSpec, ModelSpec, MoESpec, ParallelSpec, TrainingSpec, resolve

TRAIN_KEYS = set(TrainingSpec.model_fields)
PAR_KEYS = set(ParallelSpec.model_fields)

H100 = HardwareSpec(name="h100", memory_bytes=80 * 2**30, flops={"bf16": 989e12}, gpus_per_node=8,
                    intra_node_bytes_per_s=450e9, inter_node_bytes_per_s=50e9, latency_s=5e-6)


def make(model, profile="megatron", hw=H100, **kw):
    t = {k: v for k, v in kw.items() if k in TRAIN_KEYS}
    p = {k: v for k, v in kw.items() if k in PAR_KEYS}
    return resolve(model, TrainingSpec(**t), ParallelSpec(**p), hw, profile)


# GPT-3 175B (Brown et al. 2020 Table 2.1; Narayanan et al. 2021 Table 1): h 12288, 96 layers, 96 heads, s 2048,
# V 51200, GELU MLP with ffn = 4h.
GPT3 = ModelSpec(name="gpt3-175b", hidden=12288, layers=96, heads=96, ffn=4 * 12288, vocab=51200, mlp="gelu",
                 norm="layernorm", qkv_bias=True, linear_bias=True, positions="learned", max_positions=2048,
                 tied_embeddings=True)


def test_narayanan_formula_with_full_recompute():
    """Narayanan et al. 2021 sec. 5.1: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration with activation
    recomputation (4 passes over the layers, 3 over the LM head)."""
    B, s, l, h, V = 1536, 2048, 96, 12288, 51200
    r = make(GPT3, tp=8, pp=8, gpus=1536, seq=s, micro_batch=1, global_batch=B, recompute="full")
    want = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert compute.flops_per_step(r) == pytest.approx(want, rel=1e-12)
    # without recompute: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (the same paper's derivation, 3 passes)
    r0 = make(GPT3, tp=8, pp=8, gpus=1536, seq=s, micro_batch=1, global_batch=B)
    want0 = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert compute.flops_per_step(r0) == pytest.approx(want0, rel=1e-12)
    assert compute.model_flops_per_step(r) == compute.flops_per_step(r0)  # MFU excludes recompute


def test_palm_6n_plus_attention():
    """PaLM (Chowdhery et al. 2022) appendix B: model FLOPs per token 6N + 12 L H Q T (N the matmul parameters,
    H heads, Q head dim, T sequence); Kaplan et al. 2020 sec. 2.1: C_forward = 2N + 2 n_layer n_ctx d_attn."""
    llama7b = ModelSpec(name="llama-2-7b", hidden=4096, layers=32, heads=32, ffn=11008, vocab=32000)
    s = 4096
    r = make(llama7b, seq=s)
    h, f, V, L = 4096, 11008, 32000, 32
    n_matmul = L * (4 * h * h + 3 * h * f) + V * h  # q, k, v, o + gate, up, down, and the LM head
    assert compute.model_flops_per_token(r) == 6 * n_matmul + 12 * L * 32 * 128 * s
    assert compute.forward_flops_per_token(r) == 2 * n_matmul + 2 * L * s * (2 * h)


def test_gqa_shrinks_k_and_v():
    m = ModelSpec(name="gqa", hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000)
    r = make(m, seq=4096)
    h, d, g, f = 8192, 128, 8, 28672
    assert compute.matmul_weights_per_token(r) == 2 * h * h + 2 * h * g * d + 3 * h * f


def test_mixtral_active_parameters():
    """Mixtral 8x7B (Jiang et al. 2024 sec. 1 and 2): 47B parameters, 13B active per token (12.9B in Mistral's
    announcement): router + top-2 of 8 SwiGLU experts + attention per layer, plus embedding and LM head."""
    mix = ModelSpec(name="mixtral", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                    moe=MoESpec(experts=8, top_k=2, expert_ffn=14336))
    r = make(mix, seq=4096)
    per_layer = compute.matmul_weights_per_token(r)
    assert per_layer == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 8 + 2 * 3 * 4096 * 14336
    active = 32 * (per_layer + 2 * 4096) + 2 * 32000 * 4096 + 4096  # + norms, embedding, LM head
    assert active == pytest.approx(12.9e9, rel=0.01)


def test_selective_recompute_adds_the_attention_core_forward():
    """Korthikanti et al. 2022 appendix A: selective recompute adds one forward of the attention matrix (2Bs^2h)
    and of the attention over values (2Bs^2h) per layer: 4 s h per token per layer. (Their Eq. 8,
    72BLsh^2(1 + s/(3h) + ...), and the 2.7% quoted in sec. 5 for GPT-3 add 12Bs^2h instead, three times the
    text's own count; we follow the text: 0.9% for GPT-3.)"""
    s, h, L, V = 2048, 12288, 96, 51200
    base = make(GPT3, tp=8, pp=8, gpus=64, seq=s)
    sel = make(GPT3, tp=8, pp=8, gpus=64, seq=s, recompute="selective")
    extra = compute.recompute_flops_per_token(sel)
    assert extra == L * 4 * s * h
    ratio = (4 * s * h * L) / (72 * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L)))
    assert extra / compute.model_flops_per_token(base) == pytest.approx(ratio, rel=1e-12)
    assert ratio == pytest.approx(0.0090, abs=1e-4)
    # recompute_layers: the first k layers of every stage
    k = make(GPT3, tp=8, pp=8, gpus=64, seq=s, recompute="full", recompute_layers=3)
    assert compute.recomputed_layers(k) == 8 * 3


def test_bubble_fraction():
    """Narayanan et al. 2021 sec. 2.2: bubble = (p-1)/(v m) of the ideal compute time."""
    for vpp, sched in ((1, None), (2, "interleaved")):
        r = make(GPT3, tp=8, pp=8, vpp=vpp, gpus=512, seq=2048, global_batch=512, schedule=sched)
        m = 512 // 8
        assert compute.bubble_seconds(r) == pytest.approx(compute.compute_seconds(r) * 7 / (vpp * m))


def test_hand_computed_step_time():
    """torch DDP on 4 GPUs of one node, bf16 AMP (fp32 grads), 4 micro-batches of 2 x 1024 tokens per GPU."""
    m = ModelSpec(name="small", hidden=512, layers=4, heads=8, ffn=2048, vocab=8192, mlp="gelu", norm="layernorm")
    hw = HardwareSpec(name="toy", memory_bytes=2**34, flops={"bf16": 100e12}, gpus_per_node=8,
                      intra_node_bytes_per_s=100e9, inter_node_bytes_per_s=10e9, latency_s=1e-5, default_mfu=0.5)
    r = make(m, profile="torch", hw=hw, dp=4, seq=1024, micro_batch=2, grad_accum=4)
    # FLOPs: W = 4h^2 + 2hf = 1,048,576 + 2,097,152 = 3,145,728 matmul weights per layer
    # layer forward per token = 2W + 4 s h = 6,291,456 + 2,097,152 = 8,388,608; LM head 2hV = 8,388,608
    fwd_tok = 4 * 8_388_608 + 8_388_608  # 41,943,040
    tokens = 2 * 4 * 4 * 1024  # 32,768
    flops = tokens * 3 * fwd_tok  # 4,123,168,604,160
    assert compute.flops_per_step(r) == flops
    rate = 100e12 * 0.5
    comp = flops / (4 * rate)  # 0.0206158 s
    assert compute.compute_seconds(r) == pytest.approx(comp)
    assert compute.bubble_seconds(r) == 0
    # DDP all-reduce of fp32 grads: P = 4 * (4h^2 + 2hf + 4h) + 2 V h + 2h = 20,980,736 params, S = 4P bytes
    P = 4 * (4 * 512**2 + 2 * 512 * 2048 + 4 * 512) + 2 * 8192 * 512 + 2 * 512
    assert P == 20_980_736
    S = 4 * P  # 83,922,944 bytes
    # DDP's rebuilt buckets, in gradient-ready order (LM head, final norm, layers from the last, embedding): the
    # head's 16,777,216 B closes the 1 MiB first bucket alone; a layer is 12,591,104 B (down and fc 4 MiB each,
    # o/v/k/q 1 MiB each, two LayerNorms 4,096 B each); the final norm, layer 3 and layer 2 reach 25,186,304 B,
    # layer 1's down projection closes the second at 29,380,608 B; the rest with the embedding is the last,
    # 37,765,120 B
    sizes = [16_777_216, 29_380_608, 37_765_120]
    assert sum(sizes) == S
    t = [2 * 3 * 1e-5 + b * 2 * 3 // 4 / 100e9 for b in sizes]  # ring all-reduce over 4 ranks on NVLink
    colls = comm.collectives(r)
    assert [(c.bytes_per_call, c.bytes_per_step, c.link, c.overlapped) for c in colls] == [
        (16_777_216, 25_165_824, "intra-node", True), (29_380_608, 44_070_912, "intra-node", True),
        (37_765_120, 56_647_680, "intra-node", False)]
    assert [c.seconds_per_step for c in colls] == pytest.approx(t)
    # the first two overlap the last micro-batch's backward (2 x forward / 4 micro-batches = 3.436e-3 s); the last
    # bucket follows it: exposed = 6e-5 + 56,647,680 / 1e11 = 6.2648e-4 s
    bwd_last = 2 * (tokens * fwd_tok / (4 * rate)) / 4
    assert compute.overlap_windows(r)["bwd_last"] == pytest.approx(bwd_last)
    exposed = t[2] + max(0.0, t[0] + t[1] - bwd_last)
    assert exposed == pytest.approx(6.2648e-4, rel=1e-4)
    step = comp + exposed  # 0.021242 s
    assert compute.step_seconds(r) == pytest.approx(step)
    assert compute.tokens_per_second(r) == pytest.approx(tokens / step)  # ~1.543e6 tokens/s
    assert compute.achieved_mfu(r) == pytest.approx(flops / (step * 100e12 * 4))  # ~0.485
    out = estimate(r, advice=False).compute
    assert out.modelled and out.step_seconds == pytest.approx(step) and out.mfu == pytest.approx(0.4853, abs=1e-4)


def test_offloaded_optimizer_step_is_timed_per_node():
    """The CPU optimizer step (compute.cpu_optimizer_seconds): the rank's stepped shard x the ranks sharing its
    node / the node's rate. The small model of test_hand_computed_step_time over 16 GPUs, 8 per node, ZeRO-2 with
    optimizer offload. P = 20,980,736 trainable parameters (test_hand_computed_step_time); DeepSpeed's flat
    partition steps ceil(P / 16) = 1,311,296 per rank; 8 ranks per node at DeepSpeedCPUAdam's 1.8e9/s:
    1,311,296 x 8 / 1.8e9 = 5.828e-3 s."""
    m = ModelSpec(name="small", hidden=512, layers=4, heads=8, ffn=2048, vocab=8192, mlp="gelu", norm="layernorm")
    hw = HardwareSpec(name="toy", memory_bytes=2**34, flops={"bf16": 100e12}, gpus_per_node=8,
                      intra_node_bytes_per_s=100e9, inter_node_bytes_per_s=10e9, latency_s=1e-5)
    kw = dict(hw=hw, dp=16, seq=1024, micro_batch=2, grad_accum=4, zero=2, precision="bf16")
    ds = make(m, profile="deepspeed", offload="optimizer", **kw)
    shard = -(-20_980_736 // 16)
    assert shard == 1_311_296
    assert compute.cpu_optimizer_seconds(ds) == pytest.approx(shard * 8 / 1.8e9)
    # the step adds it, exposed; without offload it is 0 and the step is the rest
    base = compute.compute_seconds(ds) + compute.bubble_seconds(ds) + compute.exposed_comm_seconds(ds)
    assert compute.step_seconds(ds) == pytest.approx(base + shard * 8 / 1.8e9)
    assert compute.cpu_optimizer_seconds(make(m, profile="deepspeed", **kw)) == 0
    out = estimate(ds, advice=False).compute
    assert out.cpu_optimizer_seconds == pytest.approx(shard * 8 / 1.8e9)
    assert out.step_seconds == pytest.approx(out.compute_seconds + out.bubble_seconds + out.exposed_comm_seconds
                                             + out.cpu_optimizer_seconds)
    # torch.optim on CPU tensors takes its for-loop step, 5x slower, unless fused
    torch_r = make(m, profile="torch", offload="optimizer", **kw)
    torch_shard = model_states(torch_r).stepped_params  # FSDP2's per-tensor shards, each padded on dim 0
    assert shard <= torch_shard < shard + 16 * 100
    assert compute.cpu_optimizer_seconds(torch_r) == pytest.approx(torch_shard * 8 / (1.8e9 / 5))
    fused = make(m, profile="torch", offload="optimizer", optimizer_impl="fused", **kw)
    assert compute.cpu_optimizer_seconds(torch_r) == pytest.approx(5 * compute.cpu_optimizer_seconds(fused))
    # a faster host halves it; one GPU alone has the node to itself
    fast = make(m, profile="deepspeed", offload="optimizer", **{**kw, "hw": hw.model_copy(
        update={"host_optimizer_params_per_s": 3.6e9})})
    assert compute.cpu_optimizer_seconds(fast) == pytest.approx(compute.cpu_optimizer_seconds(ds) / 2)
    one = make(m, profile="deepspeed", offload="optimizer", **{**kw, "dp": 1, "zero": 1})
    assert compute.cpu_optimizer_seconds(one) == pytest.approx(20_980_736 / 1.8e9)


def test_unknown_peak_is_said_not_guessed():
    hw = H100.model_copy(update={"flops": {}})
    m = ModelSpec(name="t", hidden=256, layers=2, heads=4, ffn=1024, vocab=1000)
    r = make(m, hw=hw, dp=2)
    out = estimate(r, advice=False).compute
    assert not out.modelled and out.step_seconds == 0.0 and out.notes
    with pytest.raises(InputError, match="peak FLOP/s"):
        compute.step_seconds(r)


def test_fp8_uses_the_fp8_peak():
    hw = H100.model_copy(update={"flops": {"bf16": 989e12, "fp8": 1979e12}})
    m = ModelSpec(name="t", hidden=256, layers=2, heads=4, ffn=1024, vocab=1000)
    assert compute.peak_flops_per_gpu(make(m, hw=hw, precision="fp8")) == 1979e12
    assert compute.peak_flops_per_gpu(make(m, hw=hw, precision="bf16")) == 989e12


def test_mfu_setting_scales_compute_time():
    m = ModelSpec(name="t", hidden=1024, layers=4, heads=8, ffn=4096, vocab=1000)
    a = make(m, dp=8, mfu=0.5)
    b = make(m, dp=8, mfu=0.25)
    assert compute.compute_seconds(b) == pytest.approx(2 * compute.compute_seconds(a))


# ------------------------------------------------------------------------------------------ fine-tuning, schedules


LLAMA7B = ModelSpec(name="llama-2-7b", hidden=4096, layers=32, heads=32, ffn=11008, vocab=32000)


def test_lora_skips_weight_gradients_of_the_frozen_base():
    """LoRA (Hu et al. 2021): the frozen W still runs forward and propagates input gradients (2 FLOPs per weight
    each) but computes no weight gradient: ~4N instead of 6N, plus the adapters' 6 FLOPs per adapter weight."""
    s, r_ = 4096, 16
    full = make(LLAMA7B, seq=s)
    lora = make(LLAMA7B, seq=s, lora_rank=r_, lora_targets="all")
    h, f, L, V = 4096, 11008, 32, 32000
    w, att = 4 * h * h + 3 * h * f, 4 * s * h
    adapters = (3 * h * r_ + r_ * 3 * h) + (h * r_ + r_ * h) + 2 * (h * r_ + r_ * f) + (f * r_ + r_ * h)
    fwd = L * (2 * w + att + 2 * adapters) + 2 * h * V
    bwd = L * (2 * w + 2 * att + 2 * adapters) + 2 * h * V + L * 2 * adapters
    assert compute.model_flops_per_token(lora) == fwd + bwd
    assert compute.model_flops_per_token(full) == 3 * (L * (2 * w + att) + 2 * h * V)
    ratio = compute.model_flops_per_token(lora) / compute.model_flops_per_token(full)
    assert 0.66 < ratio < 0.73  # 2/3 for the matmuls; the attention core (12 s h per layer) is unchanged


def test_frozen_bottom_layers_stop_the_backward():
    s, k = 2048, 8
    h, f, L, V = 4096, 11008, 32, 32000
    w2, att = 2 * (4 * h * h + 3 * h * f), 4 * s * h
    r = make(LLAMA7B, seq=s, freeze=("embeddings", f"layers:{k}"))
    fwd = L * (w2 + att) + 2 * h * V
    # input grads through the top L-k layers and the head; weight grads of the top L-k layers and the head
    bwd = (L - k) * (w2 + 2 * att) + 2 * h * V + (L - k) * w2 + 2 * h * V
    assert compute.model_flops_per_token(r) == fwd + bwd
    # with trainable embeddings the backward must reach layer 0 (input grads only below layer k)
    r2 = make(LLAMA7B, seq=s, freeze=(f"layers:{k}",))
    assert compute.backward_flops_per_token(r2) == L * (w2 + 2 * att) + 2 * h * V + (L - k) * w2 + 2 * h * V


def test_pipedream_has_no_bubble():
    """PipeDream / PipeDream-2BW never flush the pipeline (Narayanan et al. 2019 sec. 3; 2021 sec. 3)."""
    m = ModelSpec(name="t", hidden=1024, layers=8, heads=8, ffn=4096, vocab=1000)
    for sched in ("pipedream", "pipedream-2bw"):
        r = make(m, pp=4, dp=2, grad_accum=8, schedule=sched)
        assert compute.bubble_seconds(r) == 0
        assert compute.step_seconds(r) == compute.compute_seconds(r) + compute.exposed_comm_seconds(r)
    assert compute.bubble_seconds(make(m, pp=4, dp=2, grad_accum=8)) > 0


def test_planner_names():
    """memcalc/plan/search.py looks up step_seconds, tokens_per_second, flops_per_step and mfu."""
    for name in ("step_seconds", "tokens_per_second", "flops_per_step", "mfu", "exposed_comm_seconds"):
        assert callable(getattr(compute, name))
    r = make(LLAMA7B, dp=8, tp=1)
    assert compute.mfu(r) == compute.achieved_mfu(r) == pytest.approx(estimate(r, advice=False).compute.mfu)


# ------------------------------------------------------------------------------------------ eager attention

GEMMA_LIKE = ModelSpec(name="eager-test", hidden=3584, layers=42, heads=16, kv_heads=8, head_dim=256, ffn=14336,
                       vocab=256000, mlp="swiglu", norm="rmsnorm", positions="rotary", max_positions=8192)
H100_BW = H100.model_copy(update={"hbm_bytes_per_s": 3.35e12})


def test_eager_score_bytes_count_the_passes():
    """HBM bytes per score element, one read or write per pass (compute.eager_score_bytes), bf16 (c = 2):
    Hugging Face's eager core, forward: matmul writes c, scaling 2c, mask 2c, softmax(fp32) c + 4, .to(bf16) 4 + c,
    value matmul reads c = 8c + 8 = 24; backward: 2c (value matmul) + c + 4 (cast) + 8 + c (softmax) + 2c (scaling)
    + 2c (score matmuls) = 8c + 12 = 28. fp32: 8c = 32 and 9c = 36. Megatron's fused softmax: 4c = 8 and 7c = 14.
    Dropout adds 2c + 1 = 5 each way; Gemma 2's softcap 6c = 12 forward and 7c = 14 backward."""
    base = dict(gpus=8, seq=4096, micro_batch=1, attention="eager")
    assert compute.eager_score_bytes(make(GEMMA_LIKE, "torch", precision="bf16", **base)) == (24, 28)
    assert compute.eager_score_bytes(make(GEMMA_LIKE, "torch", precision="fp32", **base)) == (32, 36)
    assert compute.eager_score_bytes(make(GEMMA_LIKE, "megatron", precision="bf16", **base)) == (8, 14)
    assert compute.eager_score_bytes(make(GEMMA_LIKE, "torch", precision="bf16", dropout=0.1, **base)) == (29, 33)
    capped = GEMMA_LIKE.model_copy(update={"attn_softcap": True})
    assert compute.eager_score_bytes(make(capped, "torch", precision="bf16", **base)) == (36, 42)
    # a fused kernel makes no pass over an s x s tensor
    assert compute.eager_score_bytes(make(GEMMA_LIKE, "torch", precision="bf16", gpus=8, seq=4096)) == (0, 0)


def test_eager_attention_time_by_hand():
    """8 GPUs, ZeRO-3, global batch 8 x 4096 tokens, 42 layers of 16 heads, full recompute, bf16 on 3.35 TB/s:
    8 sequences x 16 x 4096^2 scores x (42 x (24 + 28) + 42 x 24 recomputed) B / (8 x 3.35e12 B/s) = 0.2558 s per
    GPU, which is what eager adds to the compute time of the same run with a fused kernel."""
    kw = dict(gpus=8, zero=3, seq=4096, micro_batch=1, precision="bf16", recompute="full")
    eager = make(GEMMA_LIKE, "torch", hw=H100_BW, attention="eager", **kw)
    flash = make(GEMMA_LIKE, "torch", hw=H100_BW, **kw)
    want = 8 * 16 * 4096**2 * (42 * (24 + 28) + 42 * 24) / (8 * 3.35e12)
    assert want == pytest.approx(0.2558, abs=1e-4)
    assert compute.eager_attention_seconds(eager) == pytest.approx(want, rel=1e-12)
    assert compute.compute_seconds(eager) - compute.compute_seconds(flash) == pytest.approx(want, rel=1e-9)
    # selective recompute re-runs the core of every layer too: the same passes; without recompute, none again
    sel = make(GEMMA_LIKE, "torch", hw=H100_BW, attention="eager", **{**kw, "recompute": "selective"})
    assert compute.eager_attention_seconds(sel) == pytest.approx(want, rel=1e-12)
    none = make(GEMMA_LIKE, "torch", hw=H100_BW, attention="eager", **{**kw, "recompute": "none"})
    assert compute.eager_attention_seconds(none) == pytest.approx(want * 52 / 76, rel=1e-12)
    # no bandwidth in the preset: not timed (and said in the notes), not guessed
    assert compute.eager_attention_seconds(make(GEMMA_LIKE, "torch", attention="eager", **kw)) == 0
    assert any("not timed" in n for n in compute.compute_notes(make(GEMMA_LIKE, "torch", attention="eager", **kw)))


def test_fused_attention_advice_is_faster():
    """An eager run is told about a fused kernel with the throughput it gains (it used to read +0%)."""
    from memcalc.options import RunOptions, build_run

    run = build_run(RunOptions(model="gemma-2-9b", gpus=8, zero=3, seq=4096, attention="eager"))
    est = estimate(run)
    flash = next(a for a in est.memory.advice if a.flags == "--attention flash")
    now = est.compute.tokens_per_second / run.gpus
    assert flash.tokens_per_second_per_gpu_after > 1.3 * now
    assert est.compute.eager_attention_seconds > 0
