"""Buffers per profile (memcalc/cost/buffers.py): hand-computed cases with the arithmetic shown, DeepSpeed's own
estimator outputs reproduced to the printed digit, and arrays against scalars. Sources in
docs/methodology.md."""

from __future__ import annotations

import numpy as np
import pytest

from memcalc.cost import buffers as B
from memcalc.cost.buffers import ALL_PHASES, FWD_BWD, phase_total, stage_buffers, stage_units
from memcalc.cost.params import largest_unit_params, total_params
from memcalc.cost.states import model_states
from memcalc.specs import HardwareSpec, ModelSpec, ParallelSpec, TrainingSpec, resolve

GIB = 2**30
MIB = 2**20
HW = HardwareSpec(name="test", memory_bytes=80 * GIB)

# TINY: h=64, 4 layers, 4 heads (MHA, head_dim 16), SwiGLU ffn 256, vocab 1000, RMSNorm, untied, rotary.
# layer = attention 4*64*64 = 16384 + MLP 3*64*256 = 49152 + two norms 2*64 = 128 -> 65664
# model = 4*65664 + embedding 1000*64 + final norm 64 + head 1000*64 = 390720
TINY = ModelSpec(name="tiny", hidden=64, layers=4, heads=4, ffn=256, vocab=1000)
LAYER, EMB, N = 65664, 64000, 390720


def run(model=TINY, profile="torch", pp=1, tp=1, gpus=None, zero=0, offload="none", **training):
    gpus = gpus if gpus is not None else tp * pp
    t = TrainingSpec(seq=128, **training)
    return resolve(model, t, ParallelSpec(gpus=gpus, tp=tp, pp=pp, zero=zero, offload=offload), HW, profile)


def test_tiny_counts():
    assert total_params(TINY) == N == 4 * LAYER + EMB + 64 + EMB


# --- torch ------------------------------------------------------------------------------------------------------


def test_ddp_buckets_are_a_persistent_full_copy_of_the_grads():
    # reducer.cpp: one flat `gradients` tensor per bucket, buckets cover every trainable parameter: 4 B * 390720
    b = stage_buffers(run(gpus=2, precision="fp32"))
    assert b["ddp_buckets"].bytes == 4 * N == 1_562_880
    assert b["ddp_buckets"].phases == ALL_PHASES
    # ZeRO-1 (ZeroRedundancyOptimizer) still reduces through DDP; its broadcasts are in place (no entry)
    b1 = stage_buffers(run(gpus=2, precision="fp32", zero=1))
    assert b1["ddp_buckets"].bytes == 4 * N
    assert not any("broadcast" in k for k in b1)


def test_no_ddp_buckets_without_data_parallelism_or_with_bucket_views(monkeypatch):
    assert stage_buffers(run(gpus=1, precision="fp32"))["ddp_buckets"].bytes == 0
    monkeypatch.setattr(B, "DDP_GRADIENT_AS_BUCKET_VIEW", True)
    assert "ddp_buckets" not in stage_buffers(run(gpus=2, precision="fp32"))


def test_amp_weight_casts_exclude_the_embedding_and_follow_recompute():
    # bf16 AMP: fp32 params, a bf16 copy of every weight but the embedding table and the norm weights (norms run
    # in fp32 under autocast): 2 * (390720 - 64000 - 9 norms * 64)
    b = stage_buffers(run(precision="bf16"))["amp_weight_casts"]
    assert b.bytes == 2 * (N - EMB - 9 * 64) == 652_288
    assert b.phases == FWD_BWD
    # full (and op-level) recompute: the casts live through the forward only (its moments: the loss, the last
    # layer's start and end, and the LM head's matmul: the harness measured them all live at a chunked loss's last
    # chunk), re-cast layer by layer in backward
    fwd_moments = {"forward", "forward_head", "forward_layer", "forward_layer_end"}
    assert stage_buffers(run(precision="bf16", recompute="full"))["amp_weight_casts"].phases == fwd_moments
    assert stage_buffers(run(precision="bf16", recompute="op"))["amp_weight_casts"].phases == fwd_moments
    # pp=2: stage 0 holds layers 0-1 and the embedding (no cast), stage 1 layers 2-3, final norm and head
    assert stage_buffers(run(precision="bf16", pp=2), 0)["amp_weight_casts"].bytes == 2 * (2 * LAYER - 4 * 64)
    assert stage_buffers(run(precision="bf16", pp=2), 1)["amp_weight_casts"].bytes == 2 * (2 * LAYER - 4 * 64 + EMB)
    assert "amp_weight_casts" not in stage_buffers(run(precision="fp32"))


def test_amp_head_cast_is_saved_past_the_forward_under_recompute():
    """Under full (or op-level) recompute the layers' autocast copies go when the autocast region exits, but the LM
    head is not checkpointed: its matmul saved its bf16 weight for the input gradient, live at the loss gradient
    ("backward"): 2 B x 1000 x 64 = 128,000 B for TINY, half on each TP rank; only on the last stage; none without
    recompute (the full casts already hold it), for LoRA (a frozen compute-dtype head) or in fp32. The harness
    measured the DDP op-level SAC row 0.69% below the prediction without it, 0.04% with it."""
    full = stage_buffers(run(precision="bf16", recompute="full"))["amp_head_cast_saved"]
    assert full.bytes == 2 * EMB == 128_000 and full.phases == frozenset({"backward"})
    assert stage_buffers(run(precision="bf16", recompute="op"))["amp_head_cast_saved"].bytes == 128_000
    assert stage_buffers(run(precision="bf16", recompute="full", tp=2))["amp_head_cast_saved"].bytes == 64_000
    assert stage_buffers(run(precision="bf16", recompute="full", pp=2), 0)["amp_head_cast_saved"].bytes == 0
    # pipelining: the step's autocast cache holds every copy to the step's end, the head's among them
    piped = stage_buffers(run(precision="bf16", recompute="full", pp=2), 1)
    assert piped["amp_head_cast_saved"].bytes == 0
    assert piped["amp_weight_casts_step_cache"].bytes == piped["amp_weight_casts"].bytes
    assert stage_buffers(run(precision="bf16"))["amp_head_cast_saved"].bytes == 0
    assert stage_buffers(run(precision="bf16", recompute="full", lora_rank=8))["amp_head_cast_saved"].bytes == 0
    assert "amp_head_cast_saved" not in stage_buffers(run(precision="fp32", recompute="full"))


def test_amp_casts_a_tied_head():
    """A tied LM head is the embedding matrix, and its matmul casts it under autocast (GPT-2, Llama 3.2 1B/3B): on the
    stage that holds both, only learned positions stay uncast. Tied TINY: 4*65664 + 64000 + 64 = 326720 params; the
    casts 2 * (326720 - 9 norms * 64) = 652,288, the untied model's figure (its head is the same size). The
    harness measured a tied GPT-2-style AMP step 0.33% above the prediction before (the head's 1000 x 64 cast
    missing), 0.02% after."""
    tied = TINY.model_copy(update={"tied_embeddings": True})
    assert total_params(tied) == 326_720
    assert stage_buffers(run(model=tied, precision="bf16"))["amp_weight_casts"].bytes == 2 * (326_720 - 9 * 64)
    # pp=2: the last stage holds its own copy of the head (cast), the first the embedding (looked up, not cast)
    assert stage_buffers(run(model=tied, precision="bf16", pp=2), 0)["amp_weight_casts"].bytes == 2 * (
        2 * LAYER - 4 * 64)
    assert stage_buffers(run(model=tied, precision="bf16", pp=2), 1)["amp_weight_casts"].bytes == 2 * (
        2 * LAYER - 4 * 64 + EMB)
    # learned positions (GPT-2) are looked up: never cast
    gpt = tied.model_copy(update={"positions": "learned", "max_positions": 128})
    assert stage_buffers(run(model=gpt, precision="bf16"))["amp_weight_casts"].bytes == 2 * (326_720 - 9 * 64)


def test_foreach_adam_temporaries():
    # _multi_tensor_adam: one sqrt(exp_avg_sq) tensor per stepped parameter, in the moment dtype
    assert stage_buffers(run(precision="fp32"))["foreach_adam_temporaries"].bytes == 4 * N
    b = stage_buffers(run(precision="fp32", gpus=4, zero=1))["foreach_adam_temporaries"]
    # ZeroRedundancyOptimizer steps whole tensors, assigned largest first to the least loaded rank: the two
    # 64000-element embedding/head to ranks 0, 1; twelve 16384 MLP matrices 2, 3, 2, 3, 2, 3, 0, 1, ... (ranks 0-3
    # at 80384, 80384, 81920, 81920); sixteen 4096 attention matrices two by two (96768, 96768, 98304, 98304);
    # nine 64-element norms to ranks 0 and 1. Rank 2 steps the most: 98304 elements (not ceil(390720/4) = 97680)
    assert b.bytes == 4 * 98_304
    assert b.phases == {"optimizer"}
    # AMP steps fp32 params with fp32 moments; pure bf16 keeps bf16 moments
    assert stage_buffers(run(precision="bf16"))["foreach_adam_temporaries"].bytes == 4 * N
    assert stage_buffers(run(precision="bf16", master_weights=False))["foreach_adam_temporaries"].bytes == 2 * N
    for kw in ({"foreach": False}, {"optimizer": "sgd-momentum"}):
        assert "foreach_adam_temporaries" not in stage_buffers(run(precision="fp32", **kw))
    assert "foreach_adam_temporaries" not in stage_buffers(run(precision="fp32", gpus=2, zero=1, offload="optimizer"))
    assert "foreach_adam_temporaries" not in stage_buffers(run(profile="megatron"))  # fused Adam by default


def test_single_tensor_adam_temporaries():
    # foreach=False: `_single_tensor_adam` steps one parameter at a time; `exp_avg_sq.sqrt() / bias_correction2_sqrt`
    # holds the sqrt and the quotient together, of the largest tensor: the 1000 x 64 embedding (or head), fp32
    b = stage_buffers(run(precision="fp32", foreach=False))
    assert b["adam_step_temporaries"].bytes == 2 * 4 * 64_000 and b["adam_step_temporaries"].phases == {"optimizer"}
    assert "foreach_adam_temporaries" not in b
    assert "adam_step_temporaries" not in stage_buffers(run(profile="megatron", precision="bf16"))  # fused Adam


def test_optimizer_impl():
    # --optimizer-impl names the step's kernels; --foreach/--no-foreach is its shorthand (no-foreach: torch's
    # for-loop, Megatron's and DeepSpeed's own fused Adam)
    names = {"foreach": "foreach_adam_temporaries", "for-loop": "adam_step_temporaries"}
    for impl, name in names.items():
        assert set(stage_buffers(run(precision="fp32", optimizer_impl=impl))) & {*names.values()} == {name}
    # fused (torch fused=True, Apex / TE / DeepSpeed FusedAdam): one in-place kernel, no temporaries (row 67)
    assert not {*names.values()} & set(stage_buffers(run(precision="fp32", optimizer_impl="fused")))
    assert run(precision="fp32").recipe.optimizer_impl == "foreach"
    assert run(precision="fp32", foreach=False).recipe.optimizer_impl == "for-loop"
    for profile in ("megatron", "deepspeed"):
        assert run(profile=profile).recipe.optimizer_impl == "fused"
        assert run(profile=profile, foreach=False).recipe.optimizer_impl == "fused"
        assert run(profile=profile, optimizer_impl="for-loop").recipe.optimizer_impl == "for-loop"
    r = run(precision="fp32", foreach=True, optimizer_impl="foreach")  # consistent: accepted
    assert r.recipe.foreach and r.recipe.optimizer_impl == "foreach"


def test_fsdp2_zero3_working_set():
    # bf16 params / fp32 reduce, dp=4. Units: each layer (65664; every dim 0 (64, 256) divides by 4: no padding)
    # and the root (embedding 64000 + final norm 64 + head 64000 = 128064; vocab 1000 divides by 4).
    b = stage_buffers(run(gpus=4, zero=3, precision="bf16"))
    root, layer = EMB + 64 + EMB, LAYER
    assert b["fsdp_unsharded_params"].bytes == 2 * root == 256_128  # root kept unsharded, all phases but the step
    assert "optimizer" not in b["fsdp_unsharded_params"].phases
    # backward: the current unit unsharded, resharded at its post-backward before the reduce-scatter input is
    # allocated; the next unit's flat all-gather output (prefetch of 1) is live through both moments of every
    # layer that has a next unit to prefetch (the timeline adds it there, not in the last layer's). bf16
    assert b["fsdp_backward_working_set"].bytes == 2 * layer == 131_328
    assert b["fsdp_backward_working_set"].phases == {"backward_layer", "backward_layer_end"}
    # the end of a layer's backward (before its post-backward): all its unsharded bf16 grads
    assert b["fsdp_layer_unsharded_grads"].bytes == 2 * layer
    assert b["fsdp_layer_unsharded_grads"].phases == {"backward_layer_end"}
    # a later layer's pre-backward copy-out: its prefetched all-gather output and its unsharded params
    assert b["fsdp_backward_copy_out"].bytes == 2 * 2 * layer
    assert b["fsdp_backward_copy_out"].phases == {"backward_copy_out"}
    # the embedding's backward: the root's unsharded params, until its post-backward
    assert b["fsdp_root_unsharded_at_root_backward"].bytes == 2 * root
    assert b["fsdp_root_unsharded_at_root_backward"].phases == {"backward_root"}
    assert b["fsdp_backward_prefetch"].bytes == 2 * layer
    assert b["fsdp_backward_prefetch"].phases == {"backward_prefetch"}
    # forward: an all-gather output is freed only by the next copy-out, so the last unit's is still live at the LM
    # head matmul, and the one before it at the last unit's copy-out, beside that unit's own all-gather output
    # and unsharded params (measured: fake world 1024, 3 x 2,301,952 B of padded fp32 layer buffers at once)
    assert b["fsdp_forward_gather"].bytes == 2 * layer
    assert b["fsdp_forward_gather"].phases == {"forward_head", "forward_layer"}
    assert b["fsdp_forward_working_set"].bytes == 2 * 2 * layer
    assert b["fsdp_forward_working_set"].phases == {"forward_layer", "forward_layer_end", "forward_first_layer"}
    # the first layer's copy-out (pp = 1) also holds the root's all-gather output (freed by that copy-out)
    assert b["fsdp_root_gather_at_first_layer"].bytes == 2 * root
    assert b["fsdp_root_gather_at_first_layer"].phases == {"forward_first_layer"}
    # torchtitan's default: the last layer is not resharded after its forward (its backward follows at once), so
    # it stays gathered through the loss; with pipelining every layer is resharded here (memcalc's ZeRO-3)
    assert b["fsdp_last_unit_kept"].bytes == 2 * layer
    assert b["fsdp_last_unit_kept"].phases == {"forward", "forward_head", "backward"}
    assert stage_buffers(run(gpus=8, pp=2, zero=3, precision="bf16"), 1)["fsdp_last_unit_kept"].bytes == 0
    # unsharded bf16 grads: head + final norm (64064) through the backward, the down projection (64*256) first
    assert b["fsdp_head_grads"].bytes == 2 * (EMB + 64)
    assert b["fsdp_unsharded_grads"].bytes == 2 * 64 * 256
    # a layer's post-backward: its unsharded bf16 grads + the fp32 reduce-scatter input; the previous unit's
    # reduce-scatter input stays in flight during the next unit's backward
    assert b["fsdp_layer_reduce_scatter"].bytes == 2 * layer + 4 * layer
    assert b["fsdp_reduce_scatter_in_flight"].bytes == 4 * layer
    # the previous unit's reduce-scatter input is recycled before the root's is allocated
    assert "backward_end" not in b["fsdp_reduce_scatter_in_flight"].phases
    # end of backward: the root's reduce-scatter input (fp32), beside its unsharded grads (bf16) at the copy-in or,
    # after foreach_reduce cleared them, its output (a quarter of the fp32 root) and the last grad, the head's
    # (64000 bf16, kept by the loop variable): max(2 * 128064, 128064 + 2 * 64000) = 256128, the copy-in
    assert b["fsdp_root_reduce_scatter"].bytes == 4 * root + max(2 * root, root + 2 * EMB) == 4 * root + 2 * root
    # over 2 ranks the output is half the fp32 root: 2 * 128064 + 2 * 64000 = 384128 > 256128
    b2 = stage_buffers(run(gpus=2, zero=3, precision="bf16"))
    assert b2["fsdp_root_reduce_scatter"].bytes == 4 * root + 2 * root + 2 * EMB == 896_384
    assert b["amp_weight_casts"].bytes == 0  # FSDP2's MixedPrecisionPolicy gathers bf16 params: no autocast
    assert "ddp_buckets" not in b
    # padding: vocab 1001 over 4 ranks pads dim 0 to 1004 rows in the flat all-gather / reduce-scatter buffers
    odd = TINY.model_copy(update={"vocab": 1001})
    bo = stage_buffers(run(model=odd, gpus=4, zero=3, precision="fp32"))
    root_odd = 1001 * 64 * 2 + 64
    assert bo["fsdp_root_reduce_scatter"].bytes == 4 * root_odd + 4 * (2 * 1004 * 64 + 64)
    # an unsharded parameter is a view of its own all-gather output (FSDPParam.init_unsharded_param): padded too
    assert bo["fsdp_unsharded_params"].bytes == 4 * (2 * 1004 * 64 + 64)
    assert stage_units(run(gpus=4, zero=3), 0) == (LAYER, LAYER)


def test_fsdp2_zero2_keeps_all_params_unsharded_beyond_the_resident_shard():
    # fp32, dp=2: FSDP2 keeps the shard between steps (4*ceil(390720/2) = 781440, a model state) and the
    # whole stage unsharded from forward to backward (4*390720), not at the optimizer step
    r = run(gpus=2, zero=2, precision="fp32")
    assert model_states(r).params == 4 * N // 2 == 781_440
    b = stage_buffers(r)
    assert b["fsdp_unsharded_params"].bytes == 4 * N and "optimizer" not in b["fsdp_unsharded_params"].phases
    assert "fsdp_backward_working_set" not in b  # everything is gathered already
    assert b["fsdp_forward_gather"].bytes == 4 * LAYER
    assert b["fsdp_forward_gather"].phases == {"forward_head", "forward_layer", "forward_layer_end"}
    assert "fsdp_forward_working_set" not in b  # ZeRO-2: the unsharded stage is fsdp_unsharded_params
    # bf16 AMP (MixedPrecisionPolicy): fp32 shard + a bf16 unsharded copy
    r16 = run(gpus=2, zero=2, precision="bf16")
    assert model_states(r16).params == 4 * N // 2
    assert stage_buffers(r16)["fsdp_unsharded_params"].bytes == 2 * N


def test_fsdp_is_not_applied_to_a_shard_group_of_one():
    b = stage_buffers(run(gpus=1, zero=3, precision="bf16"))
    assert b["fsdp_unsharded_params"].bytes == b["fsdp_root_reduce_scatter"].bytes == 0
    assert b["amp_weight_casts"].bytes == 2 * (N - EMB - 9 * 64)


def test_lora_buffers_follow_the_trainable_parameters():
    r = run(gpus=2, precision="bf16", lora_rank=8)
    from memcalc.cost.params import stage_param_split

    adapters = stage_param_split(r, 0).trainable
    b = stage_buffers(r)
    assert b["ddp_buckets"].bytes == 4 * adapters
    assert b["amp_weight_casts"].bytes == 2 * adapters  # the frozen base is stored in bf16 already
    assert b["foreach_adam_temporaries"].bytes == 4 * adapters


def test_cublas_workspaces():
    # CublasHandlePool: 32 MiB per (handle, stream) on sm90+; forward and backward threads use two handles
    assert stage_buffers(run())["cublas_workspaces"].bytes == 64 * MIB


# --- megatron ---------------------------------------------------------------------------------------------------


def test_megatron_adds_no_gradient_buffer_and_one_dummy_wgrad_per_weight_shape():
    r = run(profile="megatron", tp=2, gpus=4, zero=1)
    b = stage_buffers(r)
    # one layer's linear weights per TP rank: q 32x64 + k,v 2*32x64 + o 64x32 + gate,up 2*128x64 + down 64x128
    # = 2048 + 4096 + 2048 + 16384 + 8192 = 32768 elements, bf16 -> 65536 bytes
    assert b["te_dummy_wgrads"].bytes == 2 * 32_768 and b["te_dummy_wgrads"].phases == ALL_PHASES
    assert b["te_cublas_workspace"].bytes == 32 * MIB
    # the contiguous fp32 main-grad buffer is states.grads; the distributed optimizer gathers in place
    assert set(b) == {"te_dummy_wgrads", "te_cublas_workspace", "cublas_workspaces"}
    assert "te_dummy_wgrads" not in stage_buffers(run(profile="megatron", lora_rank=8))


# --- deepspeed --------------------------------------------------------------------------------------------------

# Shapes whose largest unit, scaled by `--params`, is exactly DeepSpeed's largest layer (tied embedding, MHA 16 heads,
# GELU): largest_unit_params = vocab*1024 * params // shape_params. Found by search; the arithmetic is checked below.
T5_3B_COLD = ModelSpec(name="t5-3b-cold", hidden=1024, layers=100, heads=16, ffn=11750, vocab=31328, mlp="gelu",
                       tied_embeddings=True, params_override=2_851_000_000)  # largest layer 32,000,000
T5_3B_LIVE = ModelSpec(name="t5-3b-live", hidden=1024, layers=112, heads=16, ffn=10453, vocab=32693, mlp="gelu",
                       tied_embeddings=True, params_override=2_851_000_000)  # 32,899,072 = 32128 * 1024
T5_LARGE = ModelSpec(name="t5-large", hidden=1024, layers=144, heads=16, ffn=658, vocab=36394, mlp="gelu",
                     tied_embeddings=True, params_override=737_670_000)  # largest layer 32,900,000


def _ds_gpu_bytes(model, gpus, offload="none"):
    r = run(model=model, profile="deepspeed", gpus=gpus, zero=3, precision="fp16", offload=offload)
    b = stage_buffers(r)
    return model_states(r).total + b["zero3_largest_layer"].bytes, b


@pytest.mark.parametrize("model,ll", [(T5_3B_COLD, 32_000_000), (T5_3B_LIVE, 32_899_072), (T5_LARGE, 32_900_000)])
def test_ds_shapes_have_the_stated_largest_layer(model, ll):
    assert largest_unit_params(run(model=model, profile="deepspeed")) == ll


def test_deepspeed_estimator_t5_3b_8_gpus():
    # DeepSpeed docs/code-docs/source/memory.rst, estimate_zero3_model_states_mem_needs_all_{cold,live} for t5-3b
    # (2851M params) on 1 node x 8 GPUs: largest_layer_memory = 4 * LL; no offload 4*LL + 18*P/8;
    # offload optimizer 4*LL + 2*P/8; offload params and optimizer 4*LL.
    cold, _ = _ds_gpu_bytes(T5_3B_COLD, 8)
    assert cold == 4 * 32_000_000 + 18 * 2_851_000_000 // 8 == 6_542_750_000
    assert f"{cold / GIB:.2f}" == "6.09"
    live, _ = _ds_gpu_bytes(T5_3B_LIVE, 8)
    assert live == 4 * 32_899_072 + 18 * 2_851_000_000 // 8 and f"{live / GIB:.2f}" == "6.10"
    assert f"{_ds_gpu_bytes(T5_3B_COLD, 8, 'optimizer')[0] / GIB:.2f}" == "0.78"
    assert f"{_ds_gpu_bytes(T5_3B_LIVE, 8, 'optimizer')[0] / GIB:.2f}" == "0.79"
    assert f"{_ds_gpu_bytes(T5_3B_COLD, 8, 'params')[0] / GIB:.2f}" == "0.12"


def test_deepspeed_estimator_t5_large_4_gpus():
    # memory.rst worked example (t5-large, 737.67M params, largest layer 32.9M, 4 GPUs), in MiB (>> 20):
    # no offload 3291, full offload 125, optimizer offload 477
    assert _ds_gpu_bytes(T5_LARGE, 4)[0] >> 20 == 3291
    assert _ds_gpu_bytes(T5_LARGE, 4, "params")[0] >> 20 == 125
    assert _ds_gpu_bytes(T5_LARGE, 4, "optimizer")[0] >> 20 == 477


def test_deepspeed_zero3_buffers_beyond_the_estimator():
    _, b = _ds_gpu_bytes(T5_3B_COLD, 8)
    # stage3.py: persistent flat bucket of reduce_bucket_size = 5e8 fp16 elements
    assert b["zero3_ipg_bucket"].bytes == 1_000_000_000 and b["zero3_ipg_bucket"].phases == ALL_PHASES
    assert b["zero3_prefetch"].bytes == 2 * 50_000_000  # stage3_prefetch_bucket_size
    assert b["zero3_reuse_window"].bytes == 2 * 500_000_000  # max_reuse_distance / 2 elements kept gathered
    small = stage_buffers(run(profile="deepspeed", gpus=2, zero=3, precision="bf16"))
    assert small["zero3_prefetch"].bytes == small["zero3_reuse_window"].bytes == 2 * N  # capped by the model


def test_deepspeed_zero12_ipg_and_zero0_allreduce_buckets():
    for z in (1, 2):
        b = stage_buffers(run(profile="deepspeed", gpus=2, zero=z, precision="bf16"))["zero_ipg_buffers"]
        # one bucket (overlap_comm off for 1/2), live through the whole backward
        assert b.bytes == 2 * 500_000_000 and b.phases == {"backward", "backward_layer", "backward_post"}
    b0 = stage_buffers(run(profile="deepspeed", gpus=2, zero=0, precision="fp16"))["allreduce_bucket"]
    assert b0.bytes == 2 * N and b0.phases == {"optimizer"}  # min(390720, 5e8) fp16 elements
    assert stage_buffers(run(profile="deepspeed", gpus=1, zero=0, precision="fp16"))["allreduce_bucket"].bytes == 0


def test_phase_total():
    b = stage_buffers(run(gpus=2, precision="fp32"))
    assert phase_total(b, "forward") == 4 * N + 64 * MIB
    # + the loop's last micro-batch of token ids and labels (int64, 128 tokens), live through the step
    assert phase_total(b, "optimizer") == 4 * N + 4 * N + 64 * MIB + 2 * 8 * 128


# --- arrays ------------------------------------------------------------------------------------------------------

LAYOUTS = [(1, 1, 0), (2, 2, 1), (8, 4, 0), (4, 1, 1), (2, 4, 1)]  # (dp, tp, stage) with pp = 2


@pytest.mark.parametrize("profile,zero,precision", [
    ("torch", 0, "fp32"), ("torch", 1, "bf16"), ("torch", 2, "fp32"), ("torch", 3, "bf16"),
    ("megatron", 1, "bf16"), ("deepspeed", 0, "fp16"), ("deepspeed", 2, "bf16"), ("deepspeed", 3, "fp16"),
])
def test_arrays_equal_scalars(profile, zero, precision):
    base = run(profile=profile, zero=zero, precision=precision, pp=2, gpus=2)
    dp = np.array([x[0] for x in LAYOUTS], dtype=np.int64)
    tp = np.array([x[1] for x in LAYOUTS], dtype=np.int64)
    stage = np.array([x[2] for x in LAYOUTS], dtype=np.int64)
    arr = base.replace(dp=dp, tp=tp, gpus=dp * tp * 2, micro_batch=np.ones_like(dp), grad_accum=np.ones_like(dp))
    got = stage_buffers(arr, stage)
    for i, (d, t, s) in enumerate(LAYOUTS):
        want = stage_buffers(run(profile=profile, zero=zero, precision=precision, pp=2, tp=t, gpus=d * t * 2), s)
        assert set(got) == set(want)
        for name, buf in want.items():
            assert int(np.broadcast_to(got[name].bytes, dp.shape)[i]) == buf.bytes, (name, i)
            assert got[name].phases == buf.phases


def test_extra_nccl_communicators():
    # NVIDIA/nccl #964: 544 MiB for a 2-rank communicator, 688 MiB for larger ones; the preset holds one
    from memcalc.cost.buffers import communicator_bytes, extra_communicator_bytes

    assert communicator_bytes(run(gpus=1)) == (0, 0)
    assert extra_communicator_bytes(run(gpus=8)) == 0  # DP only: the preset's one communicator
    r = run(tp=2, pp=2, gpus=16)  # tp 2 (544), pp 2 (544), dp 4 (688)
    assert communicator_bytes(r) == ((544 + 544 + 688) * MIB, 688 * MIB)
    assert extra_communicator_bytes(r) == (544 + 544) * MIB
    arr = r.replace(tp=np.array([1, 2, 4]), gpus=np.array([8, 16, 32]))
    assert [int(x) for x in extra_communicator_bytes(arr)] == [
        extra_communicator_bytes(run(tp=t, pp=2, gpus=8 * t)) for t in (1, 2, 4)
    ]


def test_runtime_overhead_given_as_the_whole_adds_no_communicator():
    """`--runtime-overhead` states everything outside the allocator (its help: CUDA context and every NCCL
    communicator), so a measured figure is not topped up with the further groups' communicators: 0 means 0."""
    from memcalc.cost.estimate import runtime_bytes
    from memcalc.options import RunOptions, build_run

    tp2 = dict(params="7B", gpus=16, tp=2, pp=2)
    preset = build_run(RunOptions(**tp2))
    assert runtime_bytes(preset) == preset.hardware.runtime_overhead_bytes + (544 + 544) * MIB
    assert runtime_bytes(build_run(RunOptions(**tp2, runtime_overhead="0"))) == 0
    assert runtime_bytes(build_run(RunOptions(**tp2, runtime_overhead="3GiB"))) == 3 * 1024 * MIB


def test_torch_pipelining_receive_buffers():
    # PipelineStage allocates a receive buffer per micro-batch for the activation from the previous stage and
    # one for the gradient from the next, for its lifetime, in the stream dtype. TINY, seq 128, mb 1, m = 8,
    # pp = 4. fp32: one buffer 128 x 64 x 4 = 32,768 B; stage 0 receives gradients only (8 buffers), a middle
    # stage both ways (16), the last stage activations only (8). bf16 AMP keeps an fp32 stream (the same);
    # FSDP2's MixedPrecisionPolicy a bf16 one (half).
    r = run(precision="fp32", pp=4, grad_accum=8)
    got = [stage_buffers(r, s)["pipeline_recv_buffers"] for s in range(4)]
    assert [b.bytes for b in got] == [8 * 32_768, 16 * 32_768, 16 * 32_768, 8 * 32_768]
    assert got[0].phases == ALL_PHASES
    assert stage_buffers(run(precision="bf16", pp=4, grad_accum=8), 1)["pipeline_recv_buffers"].bytes == 16 * 32_768
    fsdp = stage_buffers(run(precision="bf16", pp=4, gpus=8, zero=3, grad_accum=8), 1)["pipeline_recv_buffers"]
    assert fsdp.bytes == 16 * 16_384
    # interleaved, vpp 2: rank 0 holds global stages 0 and 4 of 8: 2 x 2 - 1 = 3 buffers per micro-batch
    inter = resolve(TINY.model_copy(update={"layers": 8}), TrainingSpec(seq=128, precision="fp32", grad_accum=8),
                    ParallelSpec(gpus=4, pp=4, vpp=2), HW, "torch")
    assert stage_buffers(inter, 0)["pipeline_recv_buffers"].bytes == 8 * 3 * 32_768
    assert stage_buffers(run(precision="fp32"))["pipeline_recv_buffers"].bytes == 0  # no pipeline


def test_pipelining_keeps_the_autocast_copies_and_the_batch_for_the_step():
    """torch pipelining runs the whole step inside one autocast region: the copies made by the first forward stay
    in its cache to the end of the step. TINY pp=2, last stage: 2 layers and the head, 2 B x (2 x 65,664 - 4 norm
    weights x 64 + 64,000) = 390,144 B, beside `amp_weight_casts` at the end of backward, and in all of backward
    under full recompute (whose layers save no copy). The step's int64 ids and labels: 2 x 8 B x 4 micro-batches x
    128 tokens = 8,192 B on every rank. Measured: docs/validation.md rows 122-123 and 41-45."""
    plain = stage_buffers(run(precision="bf16", pp=2, grad_accum=4), 1)
    assert plain["amp_weight_casts"].bytes == 2 * (2 * LAYER - 4 * 64 + EMB) == 390_144
    assert plain["amp_weight_casts_step_cache"].bytes == 390_144
    assert plain["amp_weight_casts_step_cache"].phases == frozenset({"backward_end"})
    full = stage_buffers(run(precision="bf16", pp=2, grad_accum=4, recompute="full"), 1)
    assert full["amp_weight_casts_step_cache"].phases == frozenset({"backward", "backward_layer", "backward_post",
                                                                    "backward_end"})
    assert stage_buffers(run(precision="bf16", grad_accum=4))["amp_weight_casts_step_cache"].bytes == 0  # pp = 1
    assert plain["pipeline_batch_tokens"].bytes == 2 * 8 * 4 * 128 == 8_192
    assert stage_buffers(run(precision="bf16", grad_accum=4))["pipeline_batch_tokens"].bytes == 0


def test_fsdp2_root_reduce_scatter_precedes_its_sharded_grads():
    """FSDP2 ZeRO-3 over 2 ranks, fp32, 2 layers of h 64, V 8192 (untied): the root unit is the embedding and the
    head, 2 x 8192 x 64 = 1,048,576 elements, and the final norm's 64. At the root's reduce-scatter (the end of the
    step's first backward) its sharded gradients, 4 B x 1,048,640 / 2 = 2,097,280 B, come only from that
    reduce-scatter's output: the moment holds the other units' shards only. Measured: docs/validation.md row 135
    (+12.1% on the backward phase before)."""
    from memcalc.cost.buffers import fsdp_root_shard_grad_bytes
    from memcalc.cost.timeline import stage_memory
    from memcalc.options import RunOptions, build_run

    kw = dict(layers=2, hidden=64, heads=4, ffn=176, vocab=8192, seq=8, precision="fp32", gpus=2, zero=3)
    r = build_run(RunOptions(**kw))
    assert fsdp_root_shard_grad_bytes(r, 0) == 4 * (2 * 8192 * 64 + 64) // 2 == 2_097_280
    sm = stage_memory(r, 0)
    assert sm.states.grads - 2_097_280 == 201_216  # the two layers' shards: 2 x 100,608 B
    # DDP and ZeRO-1 keep no such unit
    assert fsdp_root_shard_grad_bytes(build_run(RunOptions(**{**kw, "zero": 1})), 0) == 0


def test_pipelined_fsdp_accumulates_unsharded_gradients():
    """torch pipelining over FSDP2 (PipelineStage.backward_maybe_with_nosync: no reduce-scatter and no reshard after
    any micro-batch's backward; perform_reduce_grad once per step). Model: 4 layers of h 64, 4 heads, f 176, V 512.
    One layer: attention 4 x 64 x 64 = 16,384 + SwiGLU 3 x 64 x 176 = 33,792 + 2 RMSNorms 128 = 50,304 elements;
    stage 0 of PP2: 2 layers + the embedding 512 x 64 = 32,768 -> 133,376 elements.
    - fp32, dp 2: the accumulated unsharded gradients 4 x 133,376 = 533,504 B; bf16 under MixedPrecisionPolicy
      accumulates in the reduce dtype (fp32): the same 533,504 B.
    - PP2 x TP2 x dp 2: a layer is 8,192 + 16,896 + 128 = 25,216 per rank; the embedding's replicated V x h
      gradient accumulates whole (32,768): 4 x (2 x 25,216 + 32,768) = 332,800 B.
    - ZeRO-3: each finished unit stays gathered (fp32, padded flat 50,304 elements): release -201,216 B.
    - without pipelining: nothing accumulates (0)."""
    from conftest import run_of

    base = dict(layers=4, hidden=64, heads=4, ffn=176, vocab=512, seq=64, gpus=4, pp=2, zero=3, grad_accum=4)
    assert B.pipelined_fsdp_grad_bytes(run_of(**base, precision="fp32"), 0) == 4 * 133_376 == 533_504
    assert B.pipelined_fsdp_grad_bytes(run_of(**base, precision="bf16"), 0) == 533_504
    three_d = run_of(**{**base, "gpus": 8}, tp=2, sp=True, precision="bf16")
    assert B.pipelined_fsdp_grad_bytes(three_d, 0) == 4 * (2 * 25_216 + 32_768) == 332_800
    assert B.fsdp_backward_release_bytes(run_of(**base, precision="fp32"), 0) == -4 * 50_304
    flat = run_of(**{**base, "pp": 1, "gpus": 2}, precision="fp32")
    assert B.pipelined_fsdp_grad_bytes(flat, 0) == 0
    # no micro-batch's backward reduce-scatters: the per-unit gradient buffers are gone, the step's reduction stays
    bufs = stage_buffers(run_of(**base, precision="fp32"), 0)
    for name in ("fsdp_head_grads", "fsdp_unsharded_grads", "fsdp_layer_unsharded_grads", "fsdp_layer_reduce_scatter",
                 "fsdp_reduce_scatter_in_flight"):
        assert bufs[name].bytes == 0, name
    assert bufs["fsdp_root_reduce_scatter"].bytes > 0


# --- BLAS workspaces by architecture (aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize) -----------
@pytest.mark.parametrize("gpu,cublas,te", [
    ("a100-80gb", 4096 * 1024 * 2 + 16 * 1024 * 8, 4 << 20),  # ":4096:2:16:8" before Hopper = 8,519,680 B
    ("v100-32gb", 8_519_680, 4 << 20),
    ("rtx-4090", 8_519_680, 4 << 20),  # Ada (8.9) is before Hopper
    ("h100", 32 << 20, 32 << 20),  # ":4096:8" on 9.x
    ("b200", 32 << 20, 32 << 20),  # and on Blackwell (10.x)
    ("mi300x", 128 << 20, 32 << 20),  # hipBLAS on gfx942
])
def test_blas_workspaces_follow_the_architecture(gpu, cublas, te):
    from memcalc.presets import load_gpu

    hw = load_gpu(gpu)
    assert B.blas_workspace_bytes(hw) == cublas and B.te_workspace_bytes(hw) == te
    from tests.conftest import run_of

    est_buffers = stage_buffers(run_of(model="llama-2-7b", gpu=gpu), 0)
    assert est_buffers["cublas_workspaces"].bytes == 2 * cublas  # forward and backward threads


def test_an_unknown_architecture_is_taken_as_hopper_and_a_bad_one_is_refused():
    assert B.blas_workspace_bytes(HardwareSpec(memory_bytes=1 << 30)) == 32 << 20
    with pytest.raises(Exception, match="arch"):
        HardwareSpec(memory_bytes=1 << 30, arch="ampere")


# --- --rope-cache: the model code's rotary tables (torchtune RotaryPositionalEmbeddings.build_rope_cache) ---------
def test_rope_cache_tables():
    from tests.conftest import run_of

    # Llama-2-7B, head_dim 128: a table of 4096 positions x 64 angles x (cos, sin) x 4 B = 2 MiB
    one = 4096 * 64 * 2 * 4
    assert one == 2 << 20
    per_layer = stage_buffers(run_of(model="llama-2-7b", rope_cache="4096/layer"), 0)["rope_cache"]
    assert per_layer.bytes == 32 * one and per_layer.phases == ALL_PHASES  # torchtune 0.1: 64 MiB
    # one table shared by the layers (torchtune >= 0.2), Llama 3.2's 131072 positions: 131072 x 64 x 2 x 4 = 64 MiB
    assert stage_buffers(run_of(model="llama-3.2-3b", rope_cache="131072"), 0)["rope_cache"].bytes == 64 << 20
    # pipeline stage 3 of 4 holds its 8 layers' tables; tp does not split them
    assert stage_buffers(run_of(model="llama-2-7b", rope_cache="4096/layer", gpus=8, pp=4, tp=2), 3)[
        "rope_cache"].bytes == 8 * one
    assert "rope_cache" not in stage_buffers(run_of(model="llama-2-7b"), 0)


@pytest.mark.parametrize("bad", ["banana", "4096/lay", "0", "-5", "4096/layer/x"])
def test_rope_cache_bad_values_exit_2(bad):
    from tests.conftest import cli

    code, out, err = cli("estimate", "--model", "llama-2-7b", "--rope-cache", bad)
    assert code == 2 and "--rope-cache" in err and "valid: none, N" in err and len(err.strip().splitlines()) == 1


def test_rope_cache_needs_rotary_positions():
    from tests.conftest import cli

    code, _, err = cli("estimate", "--model", "gpt2", "--rope-cache", "1024")
    assert code == 2 and "needs a model with rotary positions" in err and len(err.strip().splitlines()) == 1
