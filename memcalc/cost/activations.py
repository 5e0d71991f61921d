"""Activation memory: what autograd saves for backward, op by op, for the profile's layer. DESIGN section 4.

Every term is bytes for one layer and one micro-batch on one rank, after tensor (TP), sequence (SP) and context
(CP) parallel division. Each term's source is in docs/methodology.md; derivations in
docs/methodology.md.

Reference derivation: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), sec. 4.1 (GPT layer: `sbh(34 + 5as/h)`), 4.2 (TP eq. 2, TP+SP eq. 4), 4.2.3 (pipeline) and
sec. 5 (selective recompute). With `paper_terms=True` `layer_terms` uses their conventions (no LayerNorm mean/rstd)
and reproduces their per-layer formulas exactly; the default adds the small terms they leave out.

Symbols: s sequence, b micro-batch, h hidden, a heads, g KV heads, d head dim, f FFN width, V vocabulary,
t = tp, cp = context parallel. Tokens of one micro-batch on a rank: `tok = (s/cp)*b`; in the sequence-parallel
region (norms, dropout, residual stream) `tok_sp = (s/cp)/t * b` with SP, else `tok`.

Array-polymorphic (memcalc/xp.py): layout fields and `stage` may be numpy int64 arrays; only categorical fields
(profile, recompute, attention, loss, sp, schedule, model shape) are branched on with `if`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memcalc.cost.buffers import amp_copies_held, amp_head_cast_freed, fsdp_unsharded_grad_bytes
from memcalc.cost.params import (
    attention_matrix_shapes,
    cast_grad_elems,
    checkpointed_layers,
    chunk_forwards,
    chunk_layers,
    chunk_split,
    dense_layer_run,
    first_backward_grad_elems,
    first_dense_layers,
    first_grad_bytes,
    fsdp_sharded,
    grads_persistent,
    head_params,
    interleave_group,
    interleave_rounds,
    layer_params,
    lora_first_grad_elems,
    lora_layer_params,
    mlp_width,
    norm_params,
    padded_vocab,
    pipelined_fsdp,
    plain_on_top,
    replicated_embedding_grad,
    saved_cast_elems,
    scaled,
    stage_dense_layers,
    stage_layers,
    word_embedding_elems,
)
from memcalc.specs import DTYPE_BYTES, Run, lora_projections
from memcalc.xp import cdiv, imax, imin, muldiv, where

Num = Any

# Chunked loss: torchtune `CEWithChunkedOutputLoss(num_output_chunks=8)`: the model returns the logits as 8
# sequence chunks (`tensor_split(8, dim=1)`) and the loss upcasts and cross-entropies one chunk at a time.
LOSS_CHUNKS = 8
# lit-gpt's fine-tuning scripts call `model(input_ids, lm_head_chunk_size=128)`: the LM head per 128-token chunk
LITGPT_CHUNK_TOKENS = 128


def _fp32_norm_stats(run: Run) -> int:
    """fp32 statistics saved per token by a norm: LayerNorm mean and rstd (aten native_layer_norm), RMSNorm rstd
    (aten _fused_rms_norm; Apex/TE fused kernels save the same)."""
    return 8 if run.model.norm == "layernorm" else 4


def _norm_saved(run: Run, c: int, tok_sp: Num, stats: Num) -> tuple[Num, Num | None]:
    """(input, normalized or None) bytes one norm saves. Fused (`--norm-impl fused`: aten `_fused_rms_norm` behind
    nn.RMSNorm, native_layer_norm, Apex, TE): its input in the stream dtype plus the fp32 statistics. Eager fp32
    RMSNorm (`--norm-impl fp32`: HF LlamaRMSNorm, torchtune RMSNorm, lit-gpt RMSNorm): `x.float()` is saved by the
    square and by `x * rstd`, an fp32 copy of the input, plus rstd; the weight multiply saves the normalized tensor
    (cast back to the stream dtype, as HF and torchtune do) only when the weight trains, i.e. not under LoRA.
    LayerNorm is always the aten kernel."""
    h = run.model.hidden
    stream = _stream_bytes(run, c)
    if run.training.norm_impl == "fp32" and run.model.norm == "rmsnorm":
        normalized = stream * tok_sp * h if run.training.lora_rank is None else None
        return 4 * tok_sp * h + stats, normalized
    return stream * tok_sp * h + stats, None


def _output_norm_saved(run: Run, c: int, elems: Num, stats: Num) -> Num:
    """Bytes saved by a norm whose input is a linear's output in the compute dtype (`elems` elements), with the
    fp32 statistics `stats`: Gemma 2/3's post norms on the attention and MLP outputs (`ModelSpec.post_norms`) and
    Qwen3 / Gemma 3's per-head q and k norms (`qk_norm`).
    - nn.RMSNorm under torch AMP: the input is bf16 and the weight fp32, a pair aten's fused kernel refuses
      (aten/src/ATen/native/layer_norm.cpp, "Mismatch dtype between input and weight"; AutocastCUDA does not cast
      rms_norm), so torch's composite runs: it saves an fp32 copy of the input, rstd and the normalized fp32
      tensor (for the weight's gradient), and returns the compute dtype. Read on an H100 (torch 2.11,
      scripts/gpu_validation.py's probe: 3 x 64 MiB fp32 for a 4096-token Qwen3 q, one the rstd-sized pair).
    - LayerNorm under autocast: CUDA runs layer_norm in fp32 (aten/src/ATen/autocast_mode.cpp), saving an fp32
      cast of the input; elsewhere the input itself.
    - Eager fp32 RMSNorm (`--norm-impl fp32`, HF Qwen3RMSNorm): the fp32 copy and, when the weight trains, the
      normalized tensor cast back to the compute dtype; the fp32 weight times it returns fp32 under AMP
      (`_fp32_norm_output`).
    What follows the q/k norms (rotary, then SDPA's saved q and k) is as without them, but for that fp32 output."""
    if run.training.norm_impl == "fp32" and run.model.norm == "rmsnorm":
        return 4 * elems + stats + (c * elems if run.training.lora_rank is None else 0)
    composite = 4 * _autocast(run) * elems if run.model.norm == "rmsnorm" else 0
    return _stream_bytes(run, c) * elems + composite + stats


def _fp32_norm_output(run: Run) -> Num:
    """1 where a q/k norm returns fp32 (HF's eager Qwen3RMSNorm / Gemma3RMSNorm, `--norm-impl fp32`, under torch
    AMP: its fp32 weight times the normalized tensor cast back), else 0 (elementwise). nn.RMSNorm's composite
    returns the input's dtype (`_output_norm_saved`)."""
    if run.training.norm_impl != "fp32" or run.model.norm != "rmsnorm":
        return 0
    return _autocast(run)


def _shape(run: Run) -> tuple[int, Num, Num, Num]:
    """(compute-dtype bytes, tok, tok_sp, tok_in): tokens of one micro-batch on this rank, in the SP region, and
    saved as the input of the column-parallel linears (QKV, MLP in, LM head)."""
    c = DTYPE_BYTES[run.recipe.compute_dtype]  # fp8 recipes save bf16 activations (specs._recipe)
    s_loc = run.seq // run.cp  # CP splits the sequence (resolve() checks cp | seq)
    b = run.micro_batch
    tok = s_loc * b
    # SP shards the sequence dim over t (Korthikanti sec. 4.2.2); Megatron pads nothing: it requires t | s
    tok_sp = cdiv(s_loc, run.tp) * b if run.sp else tok
    # Megatron's column-parallel linear with SP saves its *sharded* input and all-gathers it again in backward
    # (megatron/core/tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication; Korthikanti
    # sec. 4.2.2). torch DTensor SP (ColwiseParallel(input_layouts=Shard(1))) all-gathers before the matmul,
    # which then saves the gathered tensor: the full `tok`.
    tok_in = tok if (run.sp and run.profile != "megatron") else tok_sp
    return c, tok, tok_sp, tok_in


def _autocast(run: Run) -> Num:
    """1 where the torch profile runs under autocast with fp32 parameters (AMP: `compute_copy`), else 0. FSDP2
    over a shard group of more than one rank uses MixedPrecisionPolicy instead (bf16 parameters, no autocast;
    memcalc/cost/buffers.py), and LoRA's frozen base is stored in the compute dtype already."""
    if run.profile != "torch" or not run.recipe.compute_copy or run.training.lora_rank is not None:
        return 0
    if run.zero >= 2:
        return where(run.shard_degree > 1, 0, 1)
    return 1


def _stream_bytes(run: Run, c: int) -> Num:
    """Bytes per element of the residual stream. Under autocast with fp32 weights the embedding lookup and the
    residual adds stay fp32 (autocast lowers matmuls only; aten/src/ATen/autocast_mode.cpp), so every norm saves
    an fp32 input (HF Trainer `bf16=True`, torch AMP); otherwise the compute dtype."""
    ac = _autocast(run)
    return c + (4 - c) * ac


def _input_copies(run: Run, consumers: int) -> Num:
    """Saved copies of one fp32 input read by `consumers` separate linears under autocast: autocast caches the
    casts of weights (leaf tensors that require grad) but casts an activation again for every op, and each matmul
    saves its own low-precision copy (HF LlamaAttention's q/k/v_proj, LlamaMLP's gate/up_proj). One copy
    otherwise (the input is already in the compute dtype)."""
    return 1 + (consumers - 1) * _autocast(run)


def _mlp_terms(run: Run, prefix: str, c: int, tokens: Num, ffn: int, out: dict[str, Num]) -> None:
    """Saved intermediates of one MLP (input excluded) on `tokens` tokens, FFN width split over tp."""
    f_t = cdiv(ffn, run.tp)  # column-parallel fc / gate+up (Shoeybi et al. 2019 sec. 3); uneven: biggest shard
    if run.model.mlp == "gelu":
        # fc output = GELU input (saved by gelu), GELU output = proj input (Korthikanti sec. 4.1: 8sbh + 8sbh)
        out[prefix + "fc_output"] = c * tokens * f_t
        out[prefix + "act_output"] = c * tokens * f_t
        return
    # SwiGLU y = silu(x W_g) * (x W_u): gate and up outputs are saved (silu's input, the product's other factor).
    out[prefix + "gate_up_output"] = 2 * c * tokens * f_t
    if run.profile != "megatron":
        # unfused (HF LlamaMLP, torchtitan): the product also saves silu's output. Megatron's fused SwiGLU saves
        # only its input and recomputes silu in backward (megatron/core/fusions/fused_bias_swiglu.py).
        out[prefix + "silu_output"] = c * tokens * f_t
    out[prefix + "act_output"] = c * tokens * f_t  # down-projection input


def _op_sac_terms(run: Run) -> dict[str, Num]:
    """torchtitan's op-level selective activation checkpointing (`selective_ac_option = "op"`,
    torchtitan/distributed/activation_checkpoint.py `_apply_op_sac`): each layer runs under
    `create_selective_checkpoint_contexts` with a policy that saves the outputs of `aten.mm` (all but every second
    one, counted within the layer), of the SDPA kernels and of SP's reduce-scatters, and recomputes the rest. The
    layer's matmuls in order: q, k, v, o, then gate, up, down (SwiGLU) or fc, proj (GELU): q, v, gate, down (fc)
    are saved, k, o, up (proj) recomputed. Plus the checkpoint's input (the residual stream) and the attention
    output with its log-sum-exp (eager attention uses bmm/softmax, not in the list: nothing of the core kept)."""
    m = run.model
    c, tok, tok_sp, _ = _shape(run)
    h, t, d = m.hidden, run.tp, m.head_dim
    if m.moe is not None:
        from memcalc.errors import InputError

        raise InputError("--recompute op is modelled for dense models; valid for MoE: none, selective, full")
    f_t = cdiv(m.ffn, t)
    heads, kv = m.heads // t, m.kv_heads // t
    mm_out = [tok * heads * d, tok * kv * d, tok * kv * d, tok * h]  # q, k, v, o (row-parallel: partial sums)
    mm_out += [tok * f_t, tok * f_t, tok * h] if m.mlp == "swiglu" else [tok * f_t, tok * h]
    names = ["q", "k", "v", "o", "gate", "up", "down"] if m.mlp == "swiglu" else ["q", "k", "v", "o", "fc", "proj"]
    out: dict[str, Num] = {"checkpoint_input": _stream_bytes(run, c) * tok_sp * h}
    for i, (name, n) in enumerate(zip(names, mm_out, strict=True)):
        if i % 2 == 0:  # the 1st, 3rd, ... matmul of the layer: saved
            out[f"sac_{name}_output"] = c * n
    if not eager_core(run):
        out["sac_attn_output"] = c * tok * heads * d
        out["attn_lse"] = 4 * tok * heads
    if run.sp:
        out["sac_reduce_scatter_outputs"] = where(t > 1, 2 * c * tok_sp * h, 0)  # o, down outputs reduce-scattered
    return out


def _op_sac_kept_beyond_plain(run: Run) -> Num:
    """Of op-level SAC's kept outputs (`_op_sac_terms`), those still held through the layer's re-run and backward
    that are no tensor a plain layer saves: the down projection's output (SwiGLU's 7th matmul; the residual add
    saves nothing). The re-run stops once the last tensor backward needs is made (torch.utils.checkpoint's early
    stop, at the down projection), so that kept output is never handed back. The layer's re-run remakes every
    plain-saved tensor but the kept ones that are the same tensor (the checkpoint's input, v, the gate's (fc's)
    output, the attention output and its statistics); the kept q projection's output (before rotary) is handed to
    the re-run and freed there. Under SP the down (GELU: proj) projection's kept reduce-scatter output likewise
    stays, `c*tok_sp*h`. So the re-run's net is `plain - kept` plus this. Measured by the harness op by op (a 2-layer
    pure-bf16 SwiGLU toy at 1024 tokens, h 512: one c*tok*h short in backward without it; TP 2 + SP on a real gloo
    world: one c*tok_sp*h short)."""
    if run.training.recompute != "op" or run.dropout > 0:
        # (with dropout the re-run goes on to the MLP output's dropout mask, through the down projection, whose kept
        # output it takes back and frees)
        return 0
    terms = _op_sac_terms(run)
    # under SP the re-run stops before the down projection's reduce-scatter too: its kept output (one of the two)
    # stays
    return terms.get("sac_down_output", 0) + terms.get("sac_reduce_scatter_outputs", 0) // 2


def _hf_moe_terms(run: Run, out: dict[str, Num]) -> None:
    """What Hugging Face's `MixtralSparseMoeBlock` (transformers models/mixtral/modeling_mixtral.py, read at
    00d4b3d) saves, op by op, for `tok` tokens and R = k * tok routed copies; the input xs is the norm output, in
    the stream dtype (fp32 under autocast). Measured to the byte by the harness (memcalc/validate/model.py `MoE`).
    - router: the gate's input (one compute-dtype cast under autocast), softmax(dtype=float) saves its fp32 output
      (tok x E), topk its int64 indices (tok x k); the k weights are renormalised in place, which saves them and
      their sum (fp32: tok x k, tok);
    - per expert, `torch.where` on the one-hot mask gives (slot, token) index pairs, one int64 (R_e, 2) storage,
      saved by the gather and by `index_add_`: 16 bytes per routed copy;
    - the gathered tokens `xs[top_x]` (stream dtype) are saved by the expert's first linears, cast per linear under
      autocast; the expert MLP saves what a dense one does (`_mlp_terms`) on R tokens;
    - `expert(x) * w[top_x, idx, None]` saves both factors: the expert output (compute dtype) and the weights (the
      stream dtype, `routing_weights.to(hidden_states.dtype)`);
    - `index_add_(0, top_x, source)` saves `source` whole (its derivative is written with `expand_as(source)`):
      the weighted output, in the stream dtype;
    - shared experts (HF `DeepseekV3MoE`): a dense MLP of width shared x expert_ffn on every token, reading the same
      input (two more autocast casts for SwiGLU)."""
    m = run.model
    moe = m.moe
    assert moe is not None
    c, tok, _, tok_in = _shape(run)
    h, k = m.hidden, moe.top_k
    mlp_in = 2 if m.mlp == "swiglu" else 1
    out["mlp_input"] = c * tok_in * h * _input_copies(run, 1 + (mlp_in if moe.shared_experts else 0))
    out["moe_router_probs"] = 4 * tok_in * moe.experts
    out["moe_routing_metadata"] = 8 * tok * k + 4 * tok * k + 4 * tok
    out.update(_hf_routed_terms(run, k * tok))
    if moe.shared_experts:
        _mlp_terms(run, "moe_shared_", c, tok, moe.shared_experts * moe.expert_ffn, out)


def _hf_routed_terms(run: Run, routed: Num) -> dict[str, Num]:
    """The terms of `_hf_moe_terms` that scale with the routed token copies: all of them for R = k tok, one
    expert's for R_e (what its backward frees)."""
    m = run.model
    c = _shape(run)[0]
    s = _stream_bytes(run, c)
    h = m.hidden
    out: dict[str, Num] = {"moe_token_indices": 16 * routed,
                           "moe_dispatched_input": c * routed * h * _input_copies(run, 2 if m.mlp == "swiglu" else 1)}
    _mlp_terms(run, "moe_expert_", c, routed, m.moe.expert_ffn, out)
    out["moe_combine"] = c * routed * h + s * routed
    out["moe_weighted_output"] = s * routed * h
    return out


def _qkv_terms(run: Run, out: dict[str, Num], fused_qkv: bool, gqa: bool, eager: bool) -> None:
    """Q, K, V of standard (MHA / GQA / MQA) attention and the projections' saved input."""
    m = run.model
    c, tok, _, tok_in = _shape(run)
    h, d = m.hidden, m.head_dim
    heads, kv = m.heads // run.tp, m.kv_heads // run.tp
    # norm output, input of the QKV projection (Korthikanti: 2sbh); one copy per projection under autocast (one
    # for a fused QKV matrix)
    out["qkv_input"] = c * tok_in * h * _input_copies(run, 1 if fused_qkv else 3)
    out["q"] = c * tok * heads * d
    # eager attention repeats K/V to all heads before the matmuls that save them (HF repeat_kv; Megatron
    # unfused DotProductAttention repeat_interleave); flash/SDPA kernels take g heads and save them as is.
    # Expanded before SDPA (--gqa-impl expand: torchtune modules/attention.py `k.unsqueeze(2).expand(...)
    # .flatten(1, 2)`, a copy since the expanded view is not contiguous; lit-gpt's fused QKV under GQA): SDPA saves
    # the all-head copies, and the g-head K/V they came from are freed.
    expand = eager or (gqa and (fused_qkv or run.training.gqa_impl == "expand"))
    kv_saved = heads if expand else kv
    out["k"] = c * tok * kv_saved * d
    out["v"] = c * tok * kv_saved * d
    one_kv = 0
    if gqa and not eager and expand:
        # one KV head per rank (MQA, or GQA under tp = KV heads): flattening its expansion merges a one-long dim
        # with the repeat's zero stride, a view, so SDPA saves the one-head K/V, not a copy (torch's view rules;
        # measured by the harness: 2 c tok (a/t - 1) d per layer over with the copies counted). Rotary makes
        # lit-gpt's K a new all-head tensor all the same (`q * cos` of the broadcast view)
        one_kv = where(kv == 1, 1, 0)
        out["v"] = c * tok * d * where(kv == 1, kv, heads)
        if not fused_qkv or m.positions != "rotary":
            out["k"] = out["v"]
    if fused_qkv and not gqa:
        # lit-gpt: q, k, v are views of the fused projection's output; rotary (torch.cat) makes q and k new
        # tensors, but V stays a view, so the attention's saved V keeps the whole (q|k|v) buffer alive
        out["qkv_fused_buffer"] = c * tok * (heads + kv) * d
    elif fused_qkv and not (isinstance(kv, int) and kv > 1):
        # (the same with one KV head per rank: V, a view of the buffer)
        out["qkv_fused_buffer"] = one_kv * c * tok * (heads + kv) * d


def _latent_norm(run: Run, c: int, tok: Num, w: int, whole: int | None = None) -> Num:
    """What the RMSNorm of an MLA latent of width w saves and leaves for its up projection (whose saved input it
    is): Megatron fuses it into TELayerNormColumnParallelLinear, which saves its input, the normalized output
    and the fp32 rstd (TE layernorm_linear.py); HF's DeepseekV3RMSNorm is the eager fp32 norm (`--norm-impl fp32`,
    `_norm_saved`): an fp32 copy of the input and rstd, the normalized tensor for the weight's gradient and the
    product the up projection saves. A fused norm otherwise: input + stats + output.
    `whole`: HF's kv latent is a `split` view of the down projection's output (kv_lora_rank + qk_rope_dim wide), so
    a norm that saves its input as given (fused, or the fp32 form in fp32, where `.float()` returns the input
    itself) keeps that whole output alive (measured: docs/validation.md, the MLA rows). A fused norm under torch
    AMP (fp32 weight, bf16 latent) runs torch's composite (`_output_norm_saved`): it saves an fp32 copy of the
    latent (not the view), rstd and the normalized fp32 tensor, and returns bf16, which the up projection saves."""
    whole = w if whole is None or run.profile == "megatron" else whole
    if run.profile != "megatron" and run.training.norm_impl == "fp32":
        return 4 * tok * (whole if c == 4 else w) + 4 * tok + 2 * c * tok * w
    fused = c * tok * whole + c * tok * w + 4 * tok
    return where(_autocast(run) == 1, 8 * tok * w + c * tok * w + 4 * tok, fused)


def _mla_terms(run: Run, out: dict[str, Num]) -> None:
    """Multi-head latent attention (ModelSpec.mla; DeepSeek-V2 sec. 2.1), H heads per TP rank, per token:
    - the norm output, saved by the down projections to the latents and the shared rotary key (one tensor; they
      are replicated over TP, so every TP rank holds all `tok` tokens);
    - each latent's RMSNorm and its up projection's input (`_latent_norm`); Megatron's TE linear saves a
      contiguous copy of the kv latent (a `split` view of the kv down projection's output);
    - the attention's saved Q and K, H x (nope + rope) each: the rotary key part, one per token, is broadcast to
      every head (Megatron's fused MLA rope kernel, or HF's `expand` + `torch.cat`, writes it into each head);
      V, H x v: Megatron's fused kernel writes a new value tensor; in HF it is a `split` view of kv_b's output,
      so the saved view keeps all H x (nope + v) alive;
    - the fp32 softmax statistics per head (4 H) and the attention output (H x v), the o projection's input.
    Megatron: megatron/core/transformer/multi_latent_attention.py, fused_mla_yarn_rope_apply.py, TE
    DotProductAttention (cuDNN fused attention: flash-attn does not take a value width different from the key's).
    HF: transformers models/deepseek_v3/modeling_deepseek_v3.py DeepseekV3Attention, built op by op by the harness
    (memcalc/validate/model.py LatentAttention) and measured to the byte on CPU; the Megatron form is read in the
    source, not measured."""
    m = run.model
    x = m.mla
    assert x is not None
    c, tok, _, tok_in = _shape(run)
    heads = m.heads // run.tp
    qk = x.qk_nope_dim + x.qk_rope_dim
    out["qkv_input"] = c * tok_in * m.hidden * _input_copies(run, 2)
    if x.q_lora_rank:
        out["mla_q_latent"] = _latent_norm(run, c, tok, x.q_lora_rank)
    out["mla_kv_latent"] = _latent_norm(run, c, tok, x.kv_lora_rank, x.kv_lora_rank + x.qk_rope_dim)
    out["q"] = c * tok * heads * qk
    out["k"] = c * tok * heads * qk
    v_width = x.v_head_dim if run.profile == "megatron" else x.qk_nope_dim + x.v_head_dim
    out["v"] = c * tok * heads * v_width


def _megatron_moe_terms(run: Run, out: dict[str, Num]) -> None:
    """Megatron-core's MoE layer with the all-to-all dispatcher, TE's fused permutation and grouped GEMM
    (`--moe-token-dispatcher-type alltoall --moe-permute-fusion --moe-grouped-gemm`), for R = k tok routed rows
    (balanced routing: every rank receives as many rows as it sends, whatever ep is), per tensor:
    - the pre-MLP norm's output, read by the router, the shared experts and the permutation (one tensor);
    - router (router.py): the fp32 softmax over the experts (tok x E) and the auxiliary loss's second one, two bool
      tok x E routing masks, the int64 top-k indices of the routing and of the auxiliary loss (tok x k each);
    - TE `moe_permute_with_probs` (permutation.py): the int32 row-id map, tok x (2E + 1), kept for the unpermute;
    - the experts (experts.py TEGroupedMLP): fc1's input (the dispatched rows, R x h), the weighted SwiGLU's input
      (R x 2f: the routing probabilities are applied inside the activation, `weighted_bias_swiglu_impl`, which also
      saves them, R) and fc2's input (R x f); the unpermute and the all-to-alls save nothing;
    - shared experts (shared_experts.py): a dense MLP of width shared x expert_ffn on every token.
    Read in Megatron-LM (megatron/core/transformer/moe/) and TransformerEngine at their late-2025 sources; not
    measured on CPU (the harness runs HF's block). Capacity padding (`--moe-pad-expert-input-to-capacity`) adds
    E ceil(k tok / E) - k tok rows (0.3% for DeepSeek-V2 at 4096 tokens); group-limited routing's int64 indices
    (tok x (groups x k/group_topk + group_topk)) are not counted."""
    m = run.model
    moe = m.moe
    assert moe is not None
    c, tok, _, tok_in = _shape(run)
    h, k, e = m.hidden, moe.top_k, moe.experts
    out["mlp_input"] = c * tok_in * h
    out["moe_router_probs"] = 2 * 4 * tok_in * e
    out["moe_routing_metadata"] = 2 * tok_in * e + 2 * 8 * tok_in * k + 4 * tok_in * (2 * e + 1)
    routed = k * tok
    out["moe_dispatched_input"] = c * routed * h
    _mlp_terms(run, "moe_expert_", c, routed, moe.expert_ffn, out)
    out["moe_expert_probs"] = c * routed
    if moe.shared_experts:
        _mlp_terms(run, "moe_shared_", c, tok, moe.shared_experts * moe.expert_ffn, out)


def megatron_moe_forward_transient(run: Run) -> Num:
    """The end of a Megatron MoE layer's forward, beyond what it saves: `MoELayer.forward` keeps the permuted rows
    and the dispatched rows referenced until it returns, beside fc2's output, its un-sorted copy and the combine
    all-to-all's output (R x h each), and the unpermuted output (tok x h): moe_layer.py / token_dispatcher.py."""
    m = run.model
    if m.moe is None or run.profile != "megatron":
        return 0
    c, tok, _, _ = _shape(run)
    return 4 * c * m.moe.top_k * tok * m.hidden + c * tok * m.hidden


def eager_core(run: Run) -> bool:
    """Whether the attention core keeps its s x s probabilities: `--attention eager`, or SDPA where no fused kernel
    takes its inputs. Under the torch profile, fp32 Q/K/V with fewer K/V heads than query heads passed natively
    (`enable_gqa`) have none on CUDA: FlashAttention and cuDNN need 16-bit inputs and the memory-efficient kernel
    has no GQA (torch 2.11, aten/src/ATen/native/transformers/sdp_utils), so torch runs its math fallback
    (`_scaled_dot_product_attention_math`), which saves what eager attention saves: Q (scaled), K and V repeated to
    every head, the fp32 softmax output (and with dropout its mask and output). Measured on an H100: +2.1 GiB over
    the fused kernel's figure for a 4-layer fp32 GQA model (docs/validation.md, "On a GPU", row 17)."""
    t = run.training
    if t.attention == "eager":
        return True
    m = run.model
    return (run.profile == "torch" and _shape(run)[0] == 4 and m.kv_heads < m.heads and m.mla is None
            and t.gqa_impl == "native" and t.qkv_impl == "separate")


# CUDA's softmax backward (aten `_softmax_backward_data`) over rows longer than this allocates, beside the input
# gradient, one more buffer of the output's size: read on an H100 (torch 2.11) for rows of 2048 and 4096 fp32
# scores (512 MiB and 8 GiB beyond the new gradient, docs/validation.md "On a GPU" rows 20-21); rows of up to 1024
# take the persistent kernel (aten/src/ATen/native/cuda/PersistentSoftmax.cuh), which writes the gradient alone
SOFTMAX_PERSISTENT_MAX = 1024


def softmax_backward_scratch(run: Run) -> Num:
    """Bytes CUDA's softmax backward allocates for itself in an eager core (the torch and deepspeed profiles' fp32
    softmax: Hugging Face's `softmax(dtype=float32)` or SDPA's math fallback): 4 S for scores rows longer than
    SOFTMAX_PERSISTENT_MAX keys, else 0. The harness's CPU softmax allocates the same (model._CudaSoftmax)."""
    m = run.model
    if run.seq <= SOFTMAX_PERSISTENT_MAX:
        return 0
    return 4 * (m.heads // run.tp) * _shape(run)[1] * run.seq


def _hf_softmax_copy(run: Run) -> bool:
    """Eager attention whose softmax runs in fp32 beside a compute-dtype copy of its output (Hugging Face's
    `softmax(dtype=float32).to(dtype)`, the torch and deepspeed profiles) rather than in the compute dtype (Megatron's
    fused scale-mask-softmax, saved once: Korthikanti sec. 4.1)."""
    return eager_core(run) and run.profile != "megatron" and _shape(run)[0] != 4


def layer_terms(run: Run, recompute: str = "none", paper_terms: bool = False) -> dict[str, Num]:
    """Bytes saved for backward by one transformer layer for one micro-batch on one rank, by named term.

    recompute: "none" (everything autograd saves), "selective" (the attention core is checkpointed: its scores,
    softmax and dropout are not kept; Korthikanti sec. 5) or "full" (only the checkpointed layer's input is kept).
    paper_terms: Korthikanti's conventions (no fp32 norm statistics) for reproducing their formulas exactly.
    """
    m = run.model
    c, tok, tok_sp, tok_in = _shape(run)
    h = m.hidden
    if recompute == "full":
        # the layer input, i.e. the residual stream (sharded with SP): Korthikanti sec. 5 `2sbh` (/t with SP); fp32
        # under autocast (`_stream_bytes`)
        return {"checkpoint_input": _stream_bytes(run, c) * tok_sp * h}
    if recompute == "op":
        return _op_sac_terms(run)
    t = run.tp
    d = m.head_dim
    heads = m.heads // t  # resolve() checks t | a and t | g
    eager = eager_core(run)
    dropout = run.dropout > 0
    stats = 0 if paper_terms else _fp32_norm_stats(run) * tok_sp
    # a norm saves its input (+ fp32 stats); replicated over t without SP; fp32 under autocast (_stream_bytes)
    norm, normalized = _norm_saved(run, c, tok_sp, stats)
    fused_qkv = run.training.qkv_impl == "fused"
    gqa = m.kv_heads < m.heads

    out: dict[str, Num] = {}
    out["attn_norm"] = norm
    if normalized is not None:
        out["attn_norm_normalized"] = normalized
    if m.mla is not None:
        _mla_terms(run, out)
    else:
        # a selectively recomputed eager core saves its inputs, K and V before their repetition
        _qkv_terms(run, out, fused_qkv, gqa, eager and recompute != "selective")
    if m.qk_norm:
        rows = tok * (heads + m.kv_heads // t)  # one rstd per head vector
        out["qk_norm"] = _output_norm_saved(run, c, rows * d, 4 * rows)
        if recompute == "selective":
            # the checkpointed core's saved inputs are q and k as the norms return them, through rotary: fp32
            # from HF's eager norm under autocast (the core's own matmuls or SDPA cast them inside); measured by
            # the harness
            for x in ("q", "k"):
                out[x] = out[x] + _fp32_norm_output(run) * out[x] * (4 - c) // c
    d_v = m.mla.v_head_dim if m.mla is not None else d
    # Rotary: q*cos + rotate_half(q)*sin saves only cos/sin (per micro-batch, shared by all layers; counted once
    # per stage in `stage_terms`), not the pre-rotary q/k: nothing per layer.
    if recompute != "selective":
        if eager:
            # scores: a/t heads x (s/cp) queries x s keys (Korthikanti sec. 4.1: softmax output 2as^2b, saved
            # once when there is no dropout: softmax backward and the matmul with V both use it)
            # Hugging Face's eager attention runs softmax(scores, dtype=float32).to(dtype) (transformers
            # models/llama/modeling_llama.py eager_attention_forward): softmax saves its fp32 output and the value
            # matmul (or dropout) reads the compute-dtype copy; in fp32 the cast is the same tensor
            scores = heads * tok * run.seq
            hf_copy = _hf_softmax_copy(run)
            out["attn_softmax"] = (4 if hf_copy else c) * scores
            if hf_copy and not dropout:
                out["attn_probs"] = c * scores  # saved by the value matmul
            if dropout:
                out["attn_dropout_mask"] = scores  # 1 byte per element (bool mask): as^2b
                out["attn_dropout_output"] = c * scores  # the dropped softmax, saved by the matmul with V
            if _attn_softcap(run):
                out["attn_softcap_tanh"] = c * scores
        else:
            # flash / SDPA: no s x s tensor; the fp32 log-sum-exp per head and query (Dao et al. 2022, FlashAttention
            # sec. 3.1; flash_attn softmax_lse). Attention dropout is regenerated from the saved RNG state.
            out["attn_lse"] = 4 * tok * heads
    # attention output = o-projection input (Korthikanti: 2sbh); flash's saved `out` is this same tensor
    out["attn_output"] = c * tok * heads * d_v
    tr = run.training
    if recompute == "selective" and tr.lora_rank is not None:
        # the checkpointed core's own output is not kept, and a frozen o projection saves no input: only an
        # undropped adapter on o (or a bitsandbytes base, `_keeps_inputs`) keeps it. Measured by the harness
        o_reads = ("o" in lora_projections(tr.lora_targets) and tr.lora_dropout == 0) or _keeps_inputs(tr)
        if not o_reads:
            out["attn_output"] = 0
    if run.cp_comm == "a2a" and recompute != "selective":
        # all-to-all CP (TE AttnFuncWithCPAndQKVOA2A): the kernel's output is head-sharded over the full sequence
        # and goes through a second all-to-all back to sequence sharding, so the o projection's input is a new
        # tensor; TE >= 2.8 saves the pre-exchange output for the backward as well (the same bytes once more).
        # Under selective recompute it is inside the checkpointed core. Source: SimuMax's model of TE's a2a path
        # (simumax/core/config.py `te_cp_a2a_save_pre_posta2a_min_version` = 2.8.0, core/transformer/
        # dense_module.py CoreAttention, e691807), which its B200 measurements bear out; TE's code was not read.
        # DeepSpeed-Ulysses over an eager core (torch and deepspeed profiles): nothing saves the value matmul's
        # output (measured by the harness: one c tok a/t d per layer over)
        kept = not (eager and run.profile != "megatron")
        out["attn_output_pre_a2a"] = where(run.cp > 1, c * tok * heads * d_v, 0) if kept else 0
    if fused_qkv and not eager:
        # lit-gpt's q and k come out of torch.cat head-major, so the flash output is head-major too and
        # `y.transpose(1, 2).reshape(B, T, C)` copies it: the o projection saves the copy (when it saves its input)
        out["attn_output_copy"] = c * tok * heads * d_v
        if recompute == "selective":
            # the kernel's own output, which SDPA saves, is inside the checkpointed core: only the copy is kept
            # (measured by the harness: one c tok a/t d per layer over with both counted)
            out["attn_output"] = 0
    if dropout:
        out["attn_residual_dropout_mask"] = tok_sp * h  # 1 byte per element (Korthikanti: sbh)
    if m.post_norms:
        out["attn_post_norm"] = _output_norm_saved(run, c, tok_sp * h, stats)
    out["residual_adds"] = 0  # an add saves nothing; the residual stream is kept by the next norm's saved input
    if m.block == "sequential":
        out["mlp_norm"] = norm
    elif m.block == "parallel":
        # x + attn(norm1(x)) + mlp(norm2(x)): the second norm reads the layer input the first one saved, so it
        # adds its statistics only (and its own fp32 copy where the eager fp32 RMSNorm upcasts a narrower stream)
        upcast = run.training.norm_impl == "fp32" and m.norm == "rmsnorm"
        # x.float() copies a narrower stream; an fp32 stream (autocast, or fp32 compute) is its own float()
        out["mlp_norm"] = stats + (where(_stream_bytes(run, c) < 4, 4 * tok_sp * h, 0) if upcast else 0)
    # parallel-shared-norm: the MLP reads norm1's output; there is no second norm
    if normalized is not None and m.block != "parallel-shared-norm":
        out["mlp_norm_normalized"] = normalized
    moe = m.moe
    if moe is None:
        # norm output, input of fc / gate+up; gate and up cast it separately under autocast
        out["mlp_input"] = c * tok_in * h * _input_copies(run, 2 if m.mlp == "swiglu" else 1)
        _mlp_terms(run, "mlp_", c, tok, m.ffn, out)
    elif run.profile != "megatron":
        _hf_moe_terms(run, out)
    else:
        _megatron_moe_terms(run, out)
    if dropout:
        out["mlp_residual_dropout_mask"] = tok_sp * h
    if m.post_norms:
        out["mlp_post_norm"] = _output_norm_saved(run, c, tok_sp * h, stats)
    if run.training.lora_rank is not None:
        _lora_terms(run, out, c, tok, tok_in, eager)
    if m.block == "parallel-shared-norm" and "mlp_input" in out:
        # one norm output read by Q/K/V and the MLP in the compute dtype: saved once, whichever saves it
        shared = imin(out["mlp_input"], out["qkv_input"])
        out["mlp_input"] = out["mlp_input"] - shared * _mlp_shares_qkv_input(run)
    out.update(_saved_cast_terms(run))
    return out


def _saved_cast_terms(run: Run) -> dict[str, Num]:
    """AMP (autocast over fp32 weights) with full (or op-level) recompute, without pipelining: the autocast cache is
    cleared when each micro-batch's forward region exits, so a plain layer (--recompute-layers, --recompute-every)
    keeps its weights' compute-dtype casts only through its matmuls' saved tensors, and a checkpointed layer's re-run
    casts its weights again, saved by the re-run matmuls until their backward (the re-run enters its own autocast
    region: torch.utils.checkpoint restores the autocast state; op-level SAC keeps no cast: `_to_copy` is not on its
    list). Counted here as part of one layer's saved set, so each plain layer frees them at its backward and
    `_remat_net` re-makes them; `buffers._amp_casts` leaves them out of its forward figure (op-level SAC without them:
    -1.1% to -3.8% of a 2-layer h 512 toy's backward at 256 to 1024 tokens). The q/k/v casts last to the attention
    core's moment (`_UP_TO_CORE`), the down projection's is freed by the MLP's (`layer_backward_transient`). Under
    pipelining the step's autocast cache keeps every cast anyway (`buffers._amp_casts_step_cache`). Dense layers
    only (an MoE layer's are not modelled). Measured by the harness (docs/validation.md)."""
    m, tr = run.model, run.training
    if tr.recompute not in ("full", "op") or m.moe is not None or run.profile != "torch":
        return {}
    f = _autocast(run) * where(run.pp == 1, 1, 0) * DTYPE_BYTES[run.recipe.compute_dtype]
    qkv, rest, down = saved_cast_elems(run)
    return {"amp_weight_casts_qkv": f * qkv, "amp_weight_casts_o_mlp": f * rest, "amp_weight_casts_down": f * down}


def _mlp_shares_qkv_input(run: Run) -> Num:
    """1 where the MLP's saved input is the very tensor Q/K/V saved (`block` parallel-shared-norm), else 0: not
    under autocast, where each linear casts the fp32 norm output to its own copy, nor under torch's sequence
    parallelism, where the attention and the MLP each all-gather the sequence-sharded norm output (one
    PrepareModuleInput per module)."""
    if run.model.block != "parallel-shared-norm" or run.sp:
        return 0
    return 1 - _autocast(run)


def _lora_terms(run: Run, out: dict[str, Num], c: int, tok: Num, tok_in: Num, eager: bool) -> None:
    """LoRA (Hu et al. 2021): a frozen linear saves no input for its weight gradient (autograd saves a matmul's
    input only for a weight that requires grad), while each adapter saves what its A reads and its low-rank
    intermediate x A (tok x r) for B's gradient. Without adapter dropout A reads the base linear's own input (no
    extra bytes); with `--lora-dropout p` each adapter module (PEFT, torchtune: one per projection; lit-gpt's fused
    QKV: one for q, k, v together) saves a dropped copy of it and the dropout's bool mask (aten native_dropout on
    CUDA: 1 byte per element), and the undropped input is kept only if something else saves it.
    bitsandbytes-quantized bases (`--base-dtype nf4|int8 --quant-backend bnb`) are the exception: MatMul4Bit /
    MatMul8bitLt keep their input A for backward (`ctx.tensors = (A, B)` when an input needs a gradient) even
    though the weight is frozen, so every base linear's input stays saved, as without LoRA. torchao's
    linear_nf4 (torchtune) saves only the weight.
    lit-gpt's fused-QKV adapter (`LoRAQKVLinear.zero_pad`) scatters the adapted projections' outputs into a
    zero qkv-wide tensor with `index_copy`, whose autograd keeps its source: tok x (adapted q/k/v widths)."""
    t = run.training
    m = run.model
    r = t.lora_rank
    h, d = m.hidden, m.head_dim
    heads, kv = m.heads // run.tp, m.kv_heads // run.tp
    targets = lora_projections(t.lora_targets)
    keeps_inputs = _keeps_inputs(t)
    dropped = t.lora_dropout > 0
    fused = t.qkv_impl == "fused"
    qkv_adapted = [p for p in ("q", "k", "v") if p in targets]
    n_attn = len(qkv_adapted) + (1 if "o" in targets else 0)
    if n_attn:
        out["lora_attn_low_rank"] = n_attn * c * tok * r  # x A for each adapted projection
    # the norm output read by q, k, v: saved by an adapter that reads it undropped, or by a bnb base
    if not keeps_inputs and not (qkv_adapted and not dropped):
        out["qkv_input"] = 0 * out["qkv_input"]
    if qkv_adapted and dropped:
        copies = 1 if fused else len(qkv_adapted)
        out["lora_dropout_qkv"] = copies * c * tok_in * h  # a dropped copy per dropout module
        out["lora_dropout_qkv_mask"] = copies * tok_in * h  # and its bool mask
    if qkv_adapted and fused:
        widths = {"q": heads * d, "k": kv * d, "v": kv * d}
        out["lora_qkv_zero_pad"] = c * tok * sum(widths[p] for p in qkv_adapted)
        # and its index, the adapted columns as int64: made per forward (`torch.tensor(self.lora_ind, ...)`, lit-gpt
        # 2023) or cached once per layer (`_lora_ind` buffer, litgpt 2024): the same bytes while one is in flight
        out["lora_qkv_zero_pad_index"] = 8 * sum(widths[p] for p in qkv_adapted)
    # the o projection's input: flash keeps the attention output for its own backward; eager does not
    o_reads = keeps_inputs or ("o" in targets and not dropped)
    if "o" in targets and dropped:
        out["lora_dropout_o"] = c * tok * heads * d
        out["lora_dropout_o_mask"] = tok * heads * d
    if "attn_output_copy" in out and not o_reads:
        out["attn_output_copy"] = 0 * out["attn_output_copy"]
    if eager and not o_reads:
        out["attn_output"] = 0 * out["attn_output"]
    if m.moe is not None:
        return  # MoE: LoRA on attention only (resolve() refuses mlp targets); expert terms unchanged
    n_in = len(_mlp_in_adapted(run))  # adapted gate / up (or fc): one adapter each, reading the MLP's input
    n_down = 1 if _down_adapted(run) else 0
    if n_in + n_down:
        out["lora_mlp_low_rank"] = (n_in + n_down) * c * tok * r
    if _mlp_input_unsaved(run):
        out["mlp_input"] = 0 * out["mlp_input"]  # input of the frozen gate/up (or fc) only
    if _down_input_unsaved(run):
        out["mlp_act_output"] = 0 * out["mlp_act_output"]  # input of the frozen down (or proj) only
    if (n_in + n_down) and dropped:
        f_t = cdiv(m.ffn, run.tp)
        out["lora_dropout_mlp"] = c * (n_in * tok_in * h + n_down * tok * f_t)  # a dropped copy per module
        out["lora_dropout_mlp_mask"] = n_in * tok_in * h + n_down * tok * f_t


def layer_bytes(run: Run, recompute: str = "none", paper_terms: bool = False) -> Num:
    """Sum of `layer_terms`."""
    total = 0
    for v in layer_terms(run, recompute, paper_terms).values():
        total = total + v
    return total


def first_stage_terms(run: Run) -> dict[str, Num]:
    """Saved per micro-batch on the first pipeline stage only (the embedding)."""
    c, tok, tok_sp, _ = _shape(run)
    # token ids kept by the embedding's backward (int64); Megatron theoretical_memory_usage.py counts 8sb; under
    # torch pipelining a view of the step's batch (buffers.py `pipeline_batch_tokens`)
    ids = where(run.pp > 1, 0, 8 * tok) if run.profile == "torch" else 8 * tok
    out: dict[str, Num] = {"embedding_input_ids": ids}
    t = run.training
    if run.dropout > 0 and t.lora_rank is None and "embeddings" not in t.freeze:
        # Korthikanti sec. 4.3: sbh/t per micro-batch; none where the embedding is frozen (LoRA, --freeze
        # embeddings): its output needs no gradient, so autograd records no dropout node to keep the mask
        # (measured by the harness: a LoRA run with dropout was one mask high in forward)
        out["embedding_dropout_mask"] = tok_sp * run.model.hidden
    if t.lora_rank is not None and t.recompute in ("none", "selective"):
        # LoRA freezes the embedding and the norms: the first layer's input needs no gradient, so its input norm
        # records nothing for autograd (and a LoRA dropout there keeps no mask); the adapters make the rest of
        # the layer require grad. Measured by the harness (docs/validation.md, LoRA rows).
        terms = layer_terms(run)
        frozen = terms["attn_norm"] + terms.get("lora_dropout_qkv_mask", 0)
        if run.model.block == "sequential" and not any(p in lora_projections(t.lora_targets)
                                                       for p in ("q", "k", "v", "o")):
            # no attention adapter (`--lora-targets mlp`): nothing in the first layer's attention requires grad,
            # so SDPA saves no q, k, v, output or statistics, and the MLP's norm reads a stream that needs no
            # gradient through a frozen weight: it saves nothing either (the adapters save their own input).
            # Measured by the harness (tests/test_validate_lora.py); it was +4.1% on a 4-layer model
            saved = layer_terms(run, t.recompute)
            frozen = frozen + sum(saved.get(k, 0) for k in _FIRST_LAYER_FROZEN_ATTENTION)
            tok_in = _shape(run)[3]
            mlp_in = len(_mlp_in_adapted(run))
            if t.lora_dropout > 0:
                # the gate / up adapters' dropout reads that no-grad norm output: it keeps no mask
                frozen = frozen + mlp_in * tok_in * run.model.hidden
            if not mlp_in:
                # the down projection's adapter alone trains: nothing before it in the MLP needs a gradient, so
                # the gate / up outputs and silu's input are not saved either (the activation is: the adapter's)
                frozen = frozen + sum(saved.get(k, 0) for k in ("mlp_gate_up_output", "mlp_silu_output",
                                                                 "mlp_fc_output"))
        if run.model.block != "sequential" and not (_mlp_in_adapted(run) or _down_adapted(run)):
            # a parallel block's MLP reads the layer input through a frozen norm, not the attention's output: with
            # no adapter of its own nothing in that branch requires grad, and it saves nothing (lit-gpt's phi and
            # GPT-NeoX blocks; measured by the harness)
            frozen = frozen + sum(v for k, v in terms.items() if k.startswith("mlp_"))
        frozen = frozen + _bnb_first_layer_unkept(run, terms)
        out["first_layer_frozen_input"] = 0 - frozen
    return out


def _bnb_first_layer_unkept(run: Run, terms: dict[str, Num]) -> Num:
    """LoRA with a bitsandbytes base (`_keeps_inputs`): the first layer's quantized linears that read the frozen
    embedding through a frozen norm keep no input (MatMul4Bit saves A only `if any(ctx.needs_input_grad[:2])`),
    so `layer_terms`' qkv input is not saved there unless an undropped adapter reads it (and, in a parallel block
    without MLP adapters, the MLP's inputs are not either: subtracted with its other terms by the caller).
    Returns the bytes to take off the first layer's saved set (0 without a bnb base)."""
    t = run.training
    if not _keeps_inputs(t):
        return 0
    qkv_adapted = any(p in lora_projections(t.lora_targets) for p in ("q", "k", "v"))
    return 0 if (qkv_adapted and t.lora_dropout == 0) else terms.get("qkv_input", 0)


def last_stage_terms(run: Run) -> dict[str, Num]:
    """Saved per micro-batch on the last stage only: final norm, LM-head input, the loss's fp32 probabilities."""
    m = run.model
    c, tok, tok_sp, tok_in = _shape(run)
    h = m.hidden
    stats = _fp32_norm_stats(run) * tok_sp
    norm_in, normalized = _norm_saved(run, c, tok_sp, stats)
    out = {
        "final_norm": norm_in if normalized is None else norm_in + normalized,
        # Korthikanti sec. 4.3: 2sbh/t (with SP); none for a frozen head (`_head_saves_input`)
        "output_layer_input": c * tok_in * h if _head_saves_input(run) else 0,
        **_loss_saved(run),
        "logit_softcap_tanh": _softcap_saved(run),
    }
    if run.profile != "megatron":
        # the labels (int64), kept by the cross-entropy for its backward (nll_loss saves its target); under torch
        # pipelining a view of the step's batch (buffers.py `pipeline_batch_tokens`). A chunked loss on a
        # micro-batch of several sequences reshapes each sequence chunk of them, a copy (torchtune's
        # CEWithChunkedOutputLoss `target_chunk.reshape(-1)`, lit-gpt's `chunked_cross_entropy`). Measured by the
        # harness (each was 8 bytes per token under; docs/validation.md). Megatron's batch is its own accounting.
        r = _gathered_replicas(run)
        out["loss_labels"] = (where(run.pp > 1, 0, 8 * tok) if run.profile == "torch" else 8 * tok) * r
        if run.training.loss in ("chunked", "chunked-eager", "lit-gpt"):
            out["loss_label_chunks"] = where(run.micro_batch > 1, 8 * tok, 0) * r
    if run.dp_mode == "dataparallel":
        # torch.nn.DataParallel (torch/nn/parallel/data_parallel.py): every replica's output is gathered onto
        # GPU 0 (`gather(outputs, output_device)`) and the loss runs there over the whole batch: GPU 0 holds the
        # gathered logits of all dp replicas and the loss's fp32 terms for all of them.
        out["dataparallel_gathered_logits"] = c * _logit_elems(run) * run.dp
    return out


def _loss_freed(run: Run) -> Num:
    """What the loss saved and its backward frees (all of it but lit-gpt's logits list, `loss_kept_bytes`), and the
    softcap's tanh output, freed by its backward before the LM head's."""
    return sum(_loss_saved(run).values()) - loss_kept_bytes(run) + _softcap_saved(run)


def _softcap_saved(run: Run) -> Num:
    """Gemma 2's final-logit softcapping (`ModelSpec.final_logit_softcap`; modeling_gemma2.py Gemma2ForCausalLM:
    `logits / cap`, `tanh`, `* cap` on the LM head's output): the scalar divide and multiply save nothing, tanh
    saves its output (TanhBackward0 `result`), one more logit-sized tensor in the head's output dtype (the
    compute dtype; tanh is not an autocast op) until its backward, which runs after the loss's and before the
    head's. Each replica's own (DataParallel gathers the capped logits). resolve() allows it with --loss full only."""
    return DTYPE_BYTES[run.recipe.compute_dtype] * _logit_elems(run) if run.model.final_logit_softcap else 0


def _head_trains(run: Run) -> bool:
    """The LM head's weight gets a gradient: no LoRA, not frozen. A tied head is the embedding: frozen with
    `--freeze embeddings`, and `--freeze head` alone leaves it training (as params.stage_param_split counts it)."""
    t = run.training
    tied = run.model.tied_embeddings
    frozen = ("embeddings" in t.freeze) if tied else ("head" in t.freeze)
    return t.lora_rank is None and not frozen


def _chunked_head_wgrad_transient(run: Run) -> Num:
    """A chunked loss with a trainable head, on top of everything held at the loss gradient: the head's backward
    for the sequence chunks. Every chunk's loss backward runs first (autograd takes the latest node first), then
    the head's, chunk after chunk; each makes a weight gradient, which autograd's input buffer sums out of place
    (`old + new`: torch/csrc/autograd/input_buffer.cpp), so at the second chunk the buffer, the new gradient and
    their sum are live (3 head weights in the compute dtype, the matmul's operand dtype) beside the other N - 2
    chunks' logit gradients and two chunks' input gradients; the saved logits and loss statistics are freed. With
    micro-batch > 1 the two chunks' saved inputs are copies (`_head_live`), freed with their nodes: the input
    gradients take their place."""
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    n_chunks, chunk_tok = _loss_chunking(run)
    w = c * head_params(run.model, run.profile, run.tp)
    pending = imax(n_chunks - 2, 0) * c * _loss_chunk_elems(run)
    grad_in = where(run.micro_batch > 1, 0, 2 * c * chunk_tok * run.model.hidden)
    return pending + 3 * w + grad_in - _loss_freed(run)


def _head_live(run: Run) -> Num:
    """Live at the LM head's matmul besides the layers' terms and the logits: the final norm's saved terms and the
    head's input (the norm output), saved or not (a frozen head saves none, but its matmul reads it). A chunked
    loss's model applies the head to sequence chunks (`tensor_split(8, dim=1)`); with micro-batch > 1 a chunk is
    not contiguous and the matmul copies it: a trainable head saves the copies (`output_layer_input`) while the
    norm output is still referenced, a frozen one frees each copy after its matmul (the largest chunk's).
    Under autocast (fp32 weights) the final norm's output is fp32, like the stream (`_stream_bytes`), and every
    matmul of the head casts its input: the whole input (full loss) or each chunk, contiguous or not, the same
    copies in the compute dtype (measured by the harness: AMP with a chunked loss and full recompute, the last
    chunk's matmul 0.7% above the forward's loss moment, which had counted the norm output in bf16)."""
    c, _, _, tok_in = _shape(run)
    h = run.model.hidden
    ac = _autocast(run)
    head_in = _stream_bytes(run, c) * tok_in * h
    saved_all = c * tok_in * h
    if run.training.loss not in ("full", "fused"):
        copies = saved_all if _head_saves_input(run) else c * run.micro_batch * _loss_chunking(run)[1] * h
        copies = where((run.micro_batch > 1) | (ac == 1), copies, 0)
    else:
        copies = where(ac == 1, saved_all, 0)
    return last_stage_terms(run)["final_norm"] + head_in + copies + _sp_head_input(run)


def _sp_head_input(run: Run) -> Num:
    """torch with SP (tp > 1): the final norm's sequence-sharded output, which the LM head's call references while
    its input is the all-gather of it, to the head's return (the stream's dtype); 0 elsewhere. Measured by the
    harness (the head's all-gather was the forward's peak of an fp32 model with an eager fp32 norm: -0.44%)."""
    if run.profile != "torch" or not run.sp:
        return 0
    c, _, tok_sp, _ = _shape(run)
    return where(run.tp > 1, _stream_bytes(run, c) * tok_sp * run.model.hidden, 0)


def _head_grad_end(run: Run) -> Num:
    """torch, the end of the LM head's backward and the final norm's backward, the loss's and the logits' terms freed,
    in the stream's dtype `s`: the head's input gradient over all the tokens and then, beside it, the final norm's
    input gradient (2 s tok h); with tp > 1 without SP (the head's input Replicate) the input gradient's all-reduce
    output stands in for it, the input freed first; under SP the input gradient is reduce-scattered: its
    concatenated copy (funcol's `reduce_scatter_tensor` over the sequence dimension copies the chunks into one
    tensor) and the sequence-sharded output stand beside it (2 s tok h + s tok_sp h). Measured by the harness op by
    op: a narrow fp32 model's backward peaked at the reduce-scatter under SP (-2.7% without it); GQA over tp 4
    under AMP without SP (-1.6% of the backward at 512 tokens, h 512) and a single GPU under AMP with a 256-token
    vocabulary (-0.3% at 1024 tokens) at the norm's backward."""
    if run.profile != "torch":
        return 0
    c, _, tok_sp, tok_in = _shape(run)
    stream = _stream_bytes(run, c)
    h = run.model.hidden
    if run.sp:
        return 2 * stream * tok_in * h + where(run.tp > 1, stream * tok_sp * h, 0)
    return 2 * stream * tok_in * h


def _sp_head_gather(run: Run) -> Num:
    """torch with SP (tp > 1), beyond the layers' terms: the LM head's input all-gather, whose raw output (rank-major)
    and, with several sequences per micro-batch, its reordering into the sequence dimension (`torch.cat` of the
    chunks) are both live beside the final norm's saved terms and its sharded output (`_sp_head_input`); 0
    elsewhere. Measured by the harness (tests/test_validate_sp_moments.py, micro-batches of 1 and 2)."""
    sharded = _sp_head_input(run)
    c, _, _, tok_in = _shape(run)
    gathered = _stream_bytes(run, c) * tok_in * run.model.hidden
    # (one sequence per micro-batch: the raw output is already sequence-ordered, no copy; under AMP the head's
    # weight cast, counted in the buffers at the head, is not made yet)
    copies = where(run.micro_batch > 1, 2, 1)
    moment = last_stage_terms(run)["final_norm"] + sharded + copies * gathered - amp_head_cast_freed(run)
    return where(sharded > 0, moment, 0)


def _head_moment(run: Run, logits: Num, dq_head_fwd: Num) -> Num:
    """Beyond the layers' terms, the LM head's forward moment on the last stage: the logits (with their fp32 copy
    where the model's output is upcast, `logits`) beside `_head_live` and a dequantized head. Lightning Fabric
    upcasts lit-gpt's chunks after the model has returned (`convert_output`), when the head's input is gone unless
    the head saved it: there the moment is the larger of the last chunk's matmul (compute-dtype logits) and the
    conversion (both lists, the final norm's saved terms)."""
    live = _head_live(run)
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    # the head's output at its (last) matmul: one chunk of a chunked loss's head, else all the logits
    out = c * (_loss_chunk_elems(run) if run.training.loss not in ("full", "fused") else _logit_elems(run))
    dq = dq_head_fwd + _dequant_cast(run, dq_head_fwd, out)
    scratch = dequant_scratch(run, dq_head_fwd)  # before the logits exist
    if run.training.loss != "lit-gpt" or run.training.keep_logits != "fp32":
        return imax(logits, scratch) + live + dq
    at_matmul = imax(c * _logit_elems(run), scratch) + live + dq
    kept_input = live if _head_saves_input(run) else last_stage_terms(run)["final_norm"]
    return imax(at_matmul, logits + kept_input)


def _final_norm_moment(run: Run) -> Num:
    """Beyond the layers' terms, the final norm's own forward moment on the last stage where it is an eager fp32
    RMSNorm (`--norm-impl fp32`: HF LlamaRMSNorm, torchtune's and lit-gpt's RMSNorm): at the weight multiply, its
    input (the last layer's output, which the caller references until the norm returns), the saved fp32 copy and
    rstd (`_norm_saved`), `x * rstd` in fp32 (freed once cast back), the cast back to the stream dtype (saved where
    the weight trains) and the product. In an fp32 stream (autocast) `x.float()` is x and the cast back is `x * rstd`
    itself. 0 for other norms, whose kernel allocates only its output and statistics (`_head_live` has them).
    Measured by the harness op for op: a pure-bf16 model's forward peaked here, 4 tok h above its LM head (-1.5%
    of a 2-layer h 1024 model's forward without this moment)."""
    m = run.model
    if run.training.norm_impl != "fp32" or m.norm != "rmsnorm":
        return 0
    c, _, tok_sp, _ = _shape(run)
    h = m.hidden
    stream = _stream_bytes(run, c)
    saved_in, normalized = _norm_saved(run, c, tok_sp, _fp32_norm_stats(run) * tok_sp)
    narrow = where(stream < 4, 1, 0)
    x_rstd = 4 * tok_sp * h
    if normalized is not None:  # (the weight trains: the cast back is saved; in fp32 it is `x * rstd`)
        saved_in = saved_in + normalized
        x_rstd = x_rstd * narrow
    else:  # (a frozen weight saves nothing: the cast back, a new tensor in a narrower stream, is live all the same)
        x_rstd = x_rstd + narrow * c * tok_sp * h
    return narrow * stream * tok_sp * h + saved_in + x_rstd + stream * tok_sp * h


def _eager_norm_backward(run: Run, merged: bool) -> Num:
    """The backward of an eager fp32 RMSNorm (`--norm-impl fp32`: `x.float()`, `pow(2).mean`, `rsqrt`, `x * rstd`,
    the cast back, the weight multiply) beyond its saved set (`_norm_saved`), from autograd's formulas
    (tools/autograd/derivatives.yaml: mul, pow, mean, rsqrt), whichever of two moments is higher:
    - the weight multiply's backward: the incoming gradient (the stream's dtype, o bytes an element), the cast back's
      gradient `grad * w` and, where the weight trains, `grad * normalized` before its sum: 2o or 3o an element;
    - the square's backward (`grad * 2 * x.pow(1)`, three fp32 tensors) beside the rstd product's input gradient and
      the mean's expanded gradient, five fp32 tensors, once the weight multiply's backward has freed the saved cast
      back and the rsqrt's the statistics: 20 bytes an element less those two. Where `x.float()` is x itself (an fp32
      stream) and x also feeds the residual add (`merged`: a layer's MLP norm), the rstd product's input gradient
      is summed into x's waiting residual gradient (autograd's input buffer) before the square's backward: 4 less.
    The same ops as torch's composite nn.RMSNorm (`composite_norm_backward`). Measured by the harness op for op
    (`_final_norm_backward`, `mlp_norm_backward`)."""
    c, _, tok_sp, _ = _shape(run)
    e = tok_sp * run.model.hidden
    stats = _fp32_norm_stats(run) * tok_sp
    stream = _stream_bytes(run, c)
    _, normalized = _norm_saved(run, c, tok_sp, stats)
    weight_mul = (3 if normalized is not None else 2) * stream * e
    kept = normalized if normalized is not None else 0
    # (not under TP without SP: there the rstd product's input gradient is still live at the square's backward,
    # measured by the harness: AMP, TP 2, full recompute, f = 0.34 h, -5.1% / -5.9% of the backward with it summed)
    summed = where((stream == 4) & ((run.tp == 1) | run.sp), 4 * e, 0)
    square = 20 * e - kept - stats - (summed if merged else 0)
    return imax(weight_mul, square)


def _final_norm_backward(run: Run) -> Num:
    """The final norm's backward where it is an eager fp32 RMSNorm (`_final_norm_moment`), beyond its saved set, once
    the LM head's backward has made the incoming gradient (`_eager_norm_backward`; the norm's input feeds nothing
    else). Measured by the harness op for op: a pure-bf16 model's backward peaked here (-2.2% of a 2-layer h 1024
    model's backward without this moment, -7.4% with LoRA). 0 for other norms."""
    m = run.model
    if run.training.norm_impl != "fp32" or m.norm != "rmsnorm":
        return 0
    return _eager_norm_backward(run, merged=False)


def _megatron_head_backward(run: Run) -> Num:
    """Megatron's LM-head backward (megatron/core/tensor_parallel/layers.py,
    LinearWithGradAccumulationAndAsyncCommunication.backward), on top of everything held at the loss gradient
    less what the loss frees: the logits' gradient in the compute dtype (under --loss fused the saved logits
    themselves, overwritten), the input gradient of all the micro-batch's tokens (c tok h) and, under SP, the
    re-gathered input for the weight gradient (c tok h) and the reduce-scattered gradient (c tok h / t). With
    gradient-accumulation fusion (Megatron's default) the weight gradient goes straight into the fp32 main_grad
    and the function returns a dummy weight-shaped gradient in the compute dtype (`torch.empty(main_grad.shape)`,
    so that DDP's hook runs on the main thread): c V/t h, freed by the hook. TE's layers cache theirs instead
    (buffers.py `te_dummy_wgrads`)."""
    c, tok, tok_sp, _ = _shape(run)
    h = run.model.hidden
    dgrad = c * tok * h + (c * tok * h + c * tok_sp * h if run.sp else 0)
    dummy = c * head_params(run.model, run.profile, run.tp) if _head_trains(run) else 0
    return c * _logit_elems(run) + dgrad + dummy - _loss_freed(run)


def _head_saves_input(run: Run) -> bool:
    """The LM head's matmul saves its input: for its weight gradient (`_head_trains`; Korthikanti sec. 4.3:
    2sbh/t), or a bitsandbytes-quantized head (--quantize-head: MatMul4Bit keeps its input). A frozen head (LoRA,
    tied or not; --freeze) saves none: autograd keeps a matmul's input only for a weight that requires grad."""
    t = run.training
    return _head_trains(run) or (_keeps_inputs(t) and t.quantize_head)


def _gathered_replicas(run: Run) -> Num:
    """Replicas whose loss runs on this GPU: dp on GPU 0 under torch.nn.DataParallel, else 1."""
    return run.dp if run.dp_mode == "dataparallel" else 1


def _logit_elems(run: Run) -> Num:
    _, tok, _, _ = _shape(run)
    # vocab-parallel LM head (Megatron pads V to 128*t; params.padded_vocab); uneven split: the biggest shard
    return tok * cdiv(padded_vocab(run.model, run.profile, run.tp), run.tp)


def _loss_chunking(run: Run) -> tuple[Num, Num]:
    """(chunks, tokens per sequence in the largest chunk) of a chunked loss's head: torchtune splits the sequence
    into 8 (`tensor_split(8, dim=1)`: ceil(s/8) tokens), lit-gpt into 128-token pieces (`split(128, dim=1)`)."""
    s_loc = run.seq // run.cp
    if run.training.loss == "lit-gpt":
        return cdiv(s_loc, LITGPT_CHUNK_TOKENS), imin(LITGPT_CHUNK_TOKENS, s_loc)
    return imin(LOSS_CHUNKS, s_loc), cdiv(s_loc, LOSS_CHUNKS)


def _loss_chunk_elems(run: Run) -> Num:
    """Logits in the largest chunk of a chunked loss (micro-batch x its tokens x the vocabulary shard)."""
    return run.micro_batch * _loss_chunking(run)[1] * cdiv(padded_vocab(run.model, run.profile, run.tp), run.tp)


def _litgpt_upcasts(run: Run) -> bool:
    """lit-gpt's cross-entropy calls no `.float()`: it runs in fp32 only under autocast (torch AMP, whose
    log_softmax is an fp32 op) or in fp32 training; in bf16-true it runs in bf16."""
    return run.recipe.compute_copy or DTYPE_BYTES[run.recipe.compute_dtype] == 4


def loss_kept_bytes(run: Run) -> Num:
    """The logits the training loop keeps referenced until the next forward's replace them: through the backward,
    the optimizer step and the next forward. lit-gpt's loop keeps `logits` (the model's list of chunks, in fp32
    under Lightning Fabric: `--keep-logits fp32`); `--keep-logits compute|fp32` is a loop that keeps the model's
    output under `--loss full` (nanoGPT's `logits, loss = model(X, Y)`; torchtune 0.1, whose model returns
    `self.output(h).float()`). 0 where the loop deletes or never holds them."""
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    t = run.training
    if t.loss == "lit-gpt":
        # Lightning Fabric's bf16-true / bitsandbytes precision returns the model's output upcast to the default
        # dtype (`convert_output`, lightning/fabric/plugins/precision/half.py, bitsandbytes.py): --keep-logits fp32
        return (4 if t.keep_logits == "fp32" else c) * _logit_elems(run) * _gathered_replicas(run)
    if t.keep_logits == "none":  # resolve() allows compute / fp32 with --loss full (and fp32 with lit-gpt)
        return 0
    return (4 if t.keep_logits == "fp32" else c) * _logit_elems(run)


def _loss_saved(run: Run) -> dict[str, Num]:
    """What the loss saves for backward, per micro-batch on the last stage.

    `loss_logits_fp32`: the fp32 terms. full: the log-softmax (torch) or softmax (Megatron vocab-parallel CE) of
    every logit, s*b*V/t fp32 (Korthikanti sec. 4.3: 4sbv/t). chunked-eager: the same, one chunk at a time but
    every chunk's log-softmax kept until backward (the loss is their sum). chunked (torch.compile of the per-chunk
    upcast + cross-entropy, as torchtune's `compile_loss` does): the row max and log-sum-exp, two fp32 per token.
    `loss_logits_compute_dtype`: the compiled chunked loss saves its input, the compute-dtype logits, and
    recomputes the softmax in backward (inductor's partition, read from its generated code: test
    `test_compiled_chunked_ce_saves_compute_dtype_logits`)."""
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    r = _gathered_replicas(run)  # DataParallel: GPU 0 runs the loss for all replicas
    if run.training.loss == "lit-gpt":
        # the logits list (kept by the loop, `loss_kept_bytes`) and each chunk's log-softmax, in fp32 where the
        # cross-entropy upcasts or the list is fp32 already (--keep-logits fp32), else in the compute dtype
        up = _litgpt_upcasts(run)
        kept32 = run.training.keep_logits == "fp32"
        n = _logit_elems(run) * r
        fp32 = (4 * n if up or kept32 else 0) + (4 * n if kept32 else 0)
        compute = (0 if kept32 else c * n) + (0 if up or kept32 else c * n)
        return {"loss_logits_fp32": fp32, "loss_logits_compute_dtype": compute, "loop_kept_logits": 0}
    if run.training.loss == "chunked":
        _, tok, _, _ = _shape(run)
        return {"loss_logits_fp32": 8 * tok * r, "loss_logits_compute_dtype": c * _logit_elems(run) * r,
                "loop_kept_logits": 0}
    if run.training.loss == "fused":
        # TransformerEngine's parallel_cross_entropy (Megatron-LM --cross-entropy-fusion-impl te): saves the
        # compute-dtype logits themselves and, per token, three fp32 statistics (max, sum of exp, target logit)
        # gathered from the tp ranks (3 x tp fp32 per token); backward overwrites the logits with their gradient
        _, tok, _, _ = _shape(run)
        return {"loss_logits_fp32": 12 * tok * run.tp * r, "loss_logits_compute_dtype": c * _logit_elems(run) * r,
                "loop_kept_logits": 0}
    return {"loss_logits_fp32": 4 * _logit_elems(run) * r, "loss_logits_compute_dtype": 0,
            "loop_kept_logits": loss_kept_bytes(run)}


def loss_transients(run: Run) -> tuple[Num, Num]:
    """(forward, backward) bytes live only around the loss of one micro-batch on the last stage, on top of what
    the loss saved (`_loss_saved`).

    full, forward: the compute-dtype logits (not saved by autograd: freed after the loss) plus, for
    torch/deepspeed (HF `ForCausalLMLoss`: `logits.float()` then `cross_entropy`), the fp32 upcast fed to
    log_softmax. Megatron's vocab-parallel cross-entropy upcasts and turns the copy into the saved softmax in place
    (megatron/core/tensor_parallel/cross_entropy.py).
    full, backward: torch's nll_loss backward makes a dense fp32 gradient of the log-probabilities and
    log_softmax's backward a second one for the logits while the saved output is still live (2 x 4 bytes);
    Megatron computes the gradient in place in the saved softmax, then the cast to the compute dtype (c bytes).
    torch with TP runs DTensor's `loss_parallel` (torch/distributed/tensor/parallel/loss.py, torchtitan's
    default) on the vocab shards: its log-softmax keeps the shifted logits and their exp together (one more fp32
    copy in forward), and its fused nll + log-softmax backward holds `zeros_like`, `exp(x)` and their sum (or the
    product) at once: 3 x 4 bytes, plus 33 bytes a token of indices and masks (measured op by op, `memcalc
    validate`).
    chunked-eager: in forward, all compute-dtype logits (the model's chunk list, deleted after the loss) and the
    last chunk's fp32 upcast; in backward, one chunk's two fp32 gradients (nll's and log_softmax's). The chunks'
    compute-dtype gradients then accumulate while their saved fp32 chunks are freed: never more.
    chunked (compiled): nothing logit-sized in forward (one fused kernel reads the saved compute-dtype chunk); in
    backward one chunk's compute-dtype gradient is written while that chunk's logits are still saved, and every
    chunk's loss backward runs before the LM head's (autograd runs the latest node first), so the gradients
    accumulate as the logits are freed: one chunk on top at most.
    """
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    n = _logit_elems(run)
    r = _gathered_replicas(run)
    loss = run.training.loss
    if loss == "chunked":
        return 0, c * _loss_chunk_elems(run) * r
    if loss == "chunked-eager":
        g = _loss_chunk_elems(run) * r
        return c * n + (0 if c == 4 else 4 * g), 8 * g
    if loss == "fused":
        # forward: the per-token fp32 loss and, with tp > 1, this rank's statistics beside the gathered ones;
        # backward: the gradient is written into the saved logits, so the next allocation is the LM head's input
        # gradient (all tokens of the micro-batch, before the SP reduce-scatter) while they are still live
        _, tok, _, _ = _shape(run)
        return (4 * tok + where(run.tp > 1, 12 * tok, 0)) * r, c * tok * run.model.hidden * r
    if loss == "lit-gpt":
        g = _loss_chunk_elems(run) * r
        kept32 = run.training.keep_logits == "fp32"
        up = _litgpt_upcasts(run) or kept32
        lp = 4 if up else c  # the log-probabilities' dtype
        # fp32 chunks (--keep-logits fp32) need no upcast: the compute-dtype list freed after Fabric's conversion
        # is counted at the LM head's moment (`forward_head_bytes`)
        return (4 * g if (up and c < 4 and not kept32) else 0), 2 * lp * g
    n32 = n * r
    inplace = run.profile == "megatron"
    dtensor_ce = where(run.tp > 1, 1, 0) if run.profile == "torch" else 0
    # with fp32 logits `.float()` returns the same tensor: no upcast copy
    fwd = c * n + (0 if (inplace or c == 4) else 4 * n32) + 4 * n32 * dtensor_ce
    # a loop that keeps the logits (`loop_kept_logits`, counted as saved): with `compute` the kept ones are the
    # compute-dtype logits, so only the upcast is transient; with `fp32` the model's `.float()` already freed the
    # compute-dtype logits and the upcast is the kept tensor, so at the log-softmax nothing logit-sized is
    if run.training.keep_logits == "compute":
        fwd = fwd - c * n
    elif run.training.keep_logits == "fp32":
        fwd = 4 * n32 * dtensor_ce
    bwd = (c * n if inplace else 0) + (0 if inplace else (8 + 4 * dtensor_ce) * n32)
    # and, beside them, its per-token index and weight vectors (`_nll_loss_and_log_softmax_backward`:
    # safe_target, the mask, masked_safe_target and arange_1d as int64 / bool, grad_update and the masked
    # grad_output in fp32): 8 + 1 + 8 + 8 + 4 + 4 = 33 bytes a token
    _, tok, _, _ = _shape(run)
    bwd = bwd + 33 * tok * r * dtensor_ce
    return fwd, bwd


def loss_stranded_bytes(run: Run) -> Num:
    """Bytes the caching allocator holds but cannot use at the loss gradient, on the last stage: the size of the
    compute-dtype logits. They and their fp32 upcast (`.float()`, in the model's output or in the loss function)
    are allocated one after the other, so they sit side by side, and both are freed before backward (the upcast
    after the log-softmax, the logits with `del pred` or earlier). The loss gradient then allocates two fp32
    logit-sized tensors (nll_loss's and log_softmax's gradients) while the log-softmax output is still live: the
    first takes the fp32 part of that 1.5x hole, and the remaining compute-dtype-sized part is too small for the
    second, which the allocator places in new memory (CUDACachingAllocator.cpp: best fit over free blocks, blocks
    split but never moved; with expandable segments new pages go at the segment's end). The part serves again
    the compute-dtype gradient cast after log_softmax's backward. None where the upcast is in place (Megatron),
    absent (fp32 logits), chunked (its fp32 parts are one chunk or none), or where torch pipelining keeps the logits
    cached."""
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    if run.profile == "megatron" or c == 4 or run.training.loss != "full" or run.dp_mode == "dataparallel":
        return 0
    if run.training.keep_logits == "compute":  # the loop keeps the compute-dtype logits: the hole is the upcast's
        return 0
    return where(run.pp > 1, 0, c * _logit_elems(run))


def every_stage_terms(run: Run, stage: Num) -> dict[str, Num]:
    """Saved per micro-batch on every stage (besides the layers)."""
    m = run.model
    c, tok, tok_sp, _ = _shape(run)
    out: dict[str, Num] = {}
    if m.positions == "rotary":
        # cos and sin, (s/cp, d) in the compute dtype, saved by the rotary multiplications of every layer: made
        # once per forward and shared by the layers and by the micro-batch's sequences (HF LlamaRotaryEmbedding
        # from position_ids of shape (1, s) unless the caller passes its own; torchtitan's freqs_cis; Megatron's
        # (s, 1, 1, d) rotary_pos_emb); MLA rotates only the qk_rope_dim part of each head
        width = m.mla.qk_rope_dim if m.mla is not None else m.head_dim
        out["rotary_cos_sin"] = 2 * c * (run.seq // run.cp) * width
    if run.profile != "megatron":
        # torch.distributed.pipelining (`fwd_cache`) and DeepSpeed's PipelineEngine keep each stage's output until
        # its backward; Megatron frees its data once sent (`deallocate_pipeline_outputs=True`, Korthikanti
        # appendix B: sbhp on the first stage of 530B). torch's last stage caches its output too: the logits
        # (`fwd_cache[chunk] = (output, inputs)` before `_maybe_compute_loss`), which are then no transient.
        last_out = c * _logit_elems(run) if run.profile == "torch" else 0
        out["pipeline_output"] = where(stage < run.pp - 1, _stream_bytes(run, c) * tok_sp * m.hidden,
                                       where(run.pp > 1, last_out, 0))
    return out


def cp_ring_transients(run: Run) -> tuple[Num, Num]:
    """(forward, backward) context-parallel attention buffers.

    p2p: the K/V block in flight besides the local one (double-buffered send/receive) in forward, and K/V plus
    their gradients in backward (TE AttnFuncWithCPAndKVP2P; torch context_parallel ring attention). Transient:
    nothing extra is saved.
    a2a (TE AttnFuncWithCPAndQKVOA2A): each of Q, K, V is laid out for the exchange (a send copy), received into a
    new buffer and reordered into the head-sharded tensor the kernel reads (saved, counted as q, k, v), while the
    projection's sequence-sharded Q, K, V are still referenced by the caller: three Q+K+V-sized buffers besides
    the saved ones; backward sends dQ, dK, dV back the same way. DeepSpeed-Ulysses (the deepspeed and torch
    profiles' a2a): `_ulysses_transients`."""
    m = run.model
    c, tok, _, _ = _shape(run)
    has = run.cp > 1
    if run.cp_comm == "a2a" and run.profile != "megatron":
        fwd, bwd = _ulysses_transients(run)
        return where(has, fwd, 0), where(has, bwd, 0)
    if run.cp_comm == "a2a":
        qkv = c * tok * (m.heads + 2 * m.kv_heads) // run.tp * m.head_dim
        return where(has, 3 * qkv, 0), where(has, 3 * qkv, 0)
    kv_local = 2 * c * tok * (m.kv_heads // run.tp) * m.head_dim
    return where(has, 2 * kv_local, 0), where(has, 4 * kv_local, 0)


def _ulysses_transients(run: Run) -> tuple[Num, Num]:
    """DeepSpeed-Ulysses' exchange (`deepspeed/sequence/layer.py` `single_all_to_all`; the harness runs the same op
    sequence, memcalc/validate/model.py): Q, K and V cross one after the other, each as a permuted send copy, a
    receive buffer and the permuted result; the caller keeps the sequence-sharded Q, K, V until the kernel runs.
    Relative to the moments the timeline has (the forward's end, the start of the first layer's backward), what
    the layer saves after the exchange (log-sum-exp, the outputs, the MLP) is not there yet in forward, and is
    freed again by the time the output's gradient crosses back in backward:
    forward, at V's exchange: Q, K, V pre-exchange + V's send and receive, less what the layer saves after V (under
    full recompute nothing is saved: the exchanged Q, K, V and the norm's output are live instead);
    backward, at the output gradient's exchange: its send, receive and result (3 x Q-sized), less the same."""
    m = run.model
    c, tok, _, _ = _shape(run)
    q = c * tok * (m.heads // run.tp) * m.head_dim
    kv = c * tok * (m.kv_heads // run.tp) * m.head_dim
    mode = run.training.recompute
    plain_after = _saved_after_exchange(layer_terms(run, "none"))
    if mode == "full":
        fwd = (q + 2 * kv) * 2 + 2 * kv + c * tok * m.hidden
    else:
        fwd = imax(q + 2 * kv + 2 * kv - _saved_after_exchange(layer_terms(run, mode)), 0)
    return fwd, imax(3 * q - plain_after, 0)


def _saved_after_exchange(terms: dict[str, Num]) -> Num:
    """What a layer saves after its Q, K, V cross to head sharding: all but the terms up to the core's inputs
    (`_UP_TO_CORE` less the core's own, `_CORE`; under op-level SAC the checkpointed input and the Q and V
    projections' outputs)."""
    total = 0
    for k, v in terms.items():
        if k not in _BEFORE_EXCHANGE:
            total = total + v
    return total


def in_flight(run: Run, stage: Num) -> Num:
    """Units of activations held by `stage` at the start of its first backward: micro-batches (1F1B, GPipe) or
    model chunks of L/(pp*vpp) layers (interleaved)."""
    m, pp = run.grad_accum, run.pp
    if run.schedule == "gpipe":
        return m + 0 * stage  # all forwards before any backward (Huang et al. 2019)
    if run.schedule == "interleaved":
        # megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving:
        # warmup = 2(pp-i-1) + (vpp-1)pp, capped at m*vpp, plus the first steady-state forward; all m*vpp when
        # m == pp. On stage 0 this is pp*vpp*(1 + (pp-1)/(pp*vpp)) chunks = pp micro-batches' worth of layers times
        # Korthikanti's factor (sec. 4.2.3; Narayanan et al. 2021 sec. 2.2).
        # torch's ScheduleInterleaved1F1B (torch/distributed/pipelining/schedules.py `_get_warmup_ops`): the same
        # with its round's micro-batches in place of pp (`interleave_group`) and no all-forwards case for m == pp
        v = run.vpp
        g = interleave_group(run)
        chunks = imin(2 * (pp - stage - 1) + (v - 1) * g + 1, m * v)
        if run.profile == "torch":
            return chunks
        return where(m == pp, m * v + 0 * stage, chunks)
    # 1F1B (PipeDream-Flush, Narayanan et al. 2021): pp-i-1 warmup forwards plus one; Megatron schedules.py
    # forward_backward_pipelining_without_interleaving
    return imin(m, pp - stage)


_NEVER = -(1 << 62)  # a moment that does not occur (a maximum ignores it)


@dataclasses.dataclass(frozen=True, slots=True)
class StageActivations:
    """Activation bytes on one rank of one pipeline stage at the moments the timeline needs."""

    held_bytes: Num  # saved by all in-flight micro-batches at the end of the last forward before a backward
    forward_bytes: Num  # held + the forward transient (logits at the loss, or ring-attention K/V)
    backward_first_bytes: Num  # held + the backward transient, at the start of the stage's first backward
    backward_later_bytes: Num  # at the start of a later backward (earlier ones have allocated the grads)
    # the end of the LM head's backward and the final norm's backward (`_head_grad_end`, `_final_norm_backward`),
    # first and later micro-batch: the loss and LM-head terms freed, the norm's saved set live; _NEVER where neither
    # is modelled (not the torch profile)
    backward_final_norm_bytes: Num
    backward_later_final_norm_bytes: Num
    # inside the first layer's backward of the stage's first backward: the loss terms freed, the layer's
    # activation-gradient transients live (`layer_backward_transient`), a checkpointed layer re-materialised
    backward_layer_bytes: Num
    # the same layer's attention-core backward (`attention_backward`; a large negative number where not modelled)
    backward_attention_bytes: Num
    # the same moment in a later micro-batch's backward (pipelining, gradient accumulation): as many units held
    # as at its start, the layer's transients on top (0 with one micro-batch)
    backward_later_layer_bytes: Num
    # the end of the first backward beyond what the loop keeps: a tied head's held gradient and the embedding's,
    # whose sum becomes `.grad`, or the embedding's output gradient beside its dense one (`_first_backward_end`)
    backward_end_bytes: Num
    # FSDP2 (pp = 1): the root unit's backward, before its post-backward: the embedding's dense gradient, and a
    # tied head's sum of it with the held one (`_fsdp_root_backward`; _NEVER elsewhere)
    backward_root_bytes: Num
    # the LM head's backward in a later micro-batch (torch, .grad accumulated in place): the head's new weight
    # gradient beside the accumulated one (`_later_head_backward`; _NEVER where not modelled)
    backward_later_head_bytes: Num
    # the end of a later micro-batch's backward under torch pipelining's step-wide autocast: every compute-dtype
    # weight gradient waits for its cast node (`_later_backward_end`; _NEVER where that does not happen)
    backward_later_end_bytes: Num
    # the same moment with the compute-dtype logits still live (end of forward, at the LM head matmul)
    forward_head_bytes: Num
    # eager attention's core in that last layer's forward (`eager_attention_forward`; _NEVER where not modelled)
    forward_attention_bytes: Num
    # a fully checkpointed last layer's MLP in its forward, which saves nothing: its working set on top of all held,
    # at the activation (the SwiGLU product) and at the down projection's output (`checkpointed_mlp_forward`;
    # _NEVER where the last layer keeps its saved set or where not modelled)
    forward_checkpointed_mlp_bytes: Num
    forward_checkpointed_down_bytes: Num
    # FSDP2 ZeRO-2 or 3 (pp = 1): the first layer's copy-out, the root's all-gather output still live; only the
    # embedding's output and saved terms exist yet (`_first_layer_copy_out`; _NEVER elsewhere)
    forward_first_layer_bytes: Num
    # the start of the last layer's forward of the last micro-batch before a backward: everything held but that
    # layer's activations and the loss / LM-head terms (FSDP2 has just gathered the layer's parameters)
    forward_layer_bytes: Num
    # the end of that layer's forward: all held but the loss / LM-head terms, plus the layer's not-saved output
    # projection result next to the residual add's output
    forward_layer_end_bytes: Num
    # the end of that layer's backward (FSDP2's post-backward): its activations freed, the gradient of its input
    # (the residual stream) live
    backward_post_bytes: Num
    # the same in a later micro-batch's backward (as `backward_later_layer_bytes` to `backward_layer_bytes`; _NEVER
    # with one). FSDP2's moments next to a post-backward hold these activations too: the next layer's copy-out
    # after it, and the end of the layer's backward before it (timeline)
    backward_later_post_bytes: Num
    layers: Num  # layers of the stage (of one model chunk when interleaved)
    layer_freed_bytes: Num  # what one layer's backward frees (one micro-batch; the average layer of the unit)
    host_bytes: Num  # offloaded activations held in host memory (0 without offloading)
    # offloading: what `offloaded_layer_at` needs (None without offloading)
    offload_parts: tuple[Num, ...] | None
    in_flight: Num  # units held (micro-batches; model chunks when interleaved)
    detail: dict[str, Num]  # named terms summed over layers and in-flight units; *_transient: extra at a phase
    # reserved, not allocated, at the loss gradient (`loss_stranded_bytes`), beyond backward_first_bytes
    loss_stranded_bytes: Num = 0
    # lit-gpt's logits list, live from the loss to the next forward's head (`loss_kept_bytes`): in every moment
    # but the first forward's, the optimizer step's and the end of backward's included
    # torch pipelining under the step's autocast region: one finished layer's compute-dtype weight gradients,
    # waiting for their cast nodes to the end of a later backward (`late_dw`; 0 elsewhere)
    late_layer_dw_bytes: Num = 0
    # the first layer's attention-core backward in a later micro-batch (as `backward_later_layer_bytes` to
    # `backward_layer_bytes`; _NEVER with one micro-batch or where the core's moment is not modelled)
    backward_later_attention_bytes: Num = _NEVER
    loss_kept_bytes: Num = 0
    # the end of a layer's backward, one step earlier: its Q projection's input gradient, the last of the layer's
    # weight gradients made, beside what the layer end holds (`qkv_dgrad_extra`; 0 where not modelled)
    qkv_dgrad_extra_bytes: Num = 0
    # one micro-batch's rotary cos and sin (every_stage_terms' `rotary_cos_sin`): freed by the stage's last layer
    # to run its backward (its rotary's), before that layer's Q projection makes its input gradient; 0 where the
    # layers are checkpointed (full, op-level): the checkpoint keeps its inputs to the end of the layer's backward
    rotary_bytes: Num = 0
    # the layer's input norm's backward, an eager fp32 RMSNorm's (`input_norm_backward`), beside what the layer end
    # holds; _NEVER for other norms
    input_norm_backward_bytes: Num = _NEVER
    # one micro-batch's bitsandbytes-held layer inputs (`graph_held_layer_bytes`), live from its backward to the
    # end of that backward, or, where the loop holds the graph (`loop_holds_graph`), to the next loss
    graph_held_bytes: Num = 0
    # torch's one-round interleaved step (`interleave_rounds`): the first model chunk's second backward, where every
    # gradient is made and fewer chunks are held: at its last layer's backward, that layer's end and the end of
    # the backward (`_late_chunk_moments`; _NEVER elsewhere)
    backward_late_chunk_layer_bytes: Num = _NEVER
    backward_late_chunk_post_bytes: Num = _NEVER
    backward_late_chunk_end_bytes: Num = _NEVER
    # torch 1F1B: the previous backward's input gradient, still referenced by the schedule's send ops, in every
    # forward that follows a backward (steady state) on a stage that sends gradients
    steady_forward_sent_bytes: Num = 0
    # the stage's later layers' backward moments, beyond `backward_layer_bytes - k * layer_freed_bytes`: the
    # incoming gradient that the first layer found in torch pipelining's receive buffer
    layer_k_extra_bytes: Num = 0
    # 1F1B's cool-down: what its first backward (one that follows a backward) holds less than a later steady-state
    # one (one that follows a forward): one micro-batch's saved set where the stage runs more micro-batches than it
    # holds, else 0 (every later backward is then a cool-down one, as `backward_later_bytes` counts)
    drain_less_bytes: Num = 0

    # --recompute-layers / --recompute-every (full or op): what `mixed_at` needs (None otherwise)
    mixed_parts: tuple[Any, ...] | None = None

    def mixed_at(self, k: Num, kind: str) -> Num:
        """Plain and checkpointed layers in one unit: activations at a moment of the backward of the unit's k-th
        layer from the last, `kind` "layer" (its MLP's), "attention" (its core's) or "post" (its end), with the
        layers above it freed layer by layer (`_mixed_at`). The "layer" moment of k = 0 is `backward_layer_bytes`
        (its incoming gradient may be in torch pipelining's receive buffer)."""
        assert self.mixed_parts is not None
        return _mixed_at(self.mixed_parts, k, kind)

    def offloaded_layer_at(self, k: Num) -> Num:
        """Offloading: activations inside the backward of the stage's k-th layer from the last (k = 0 is the first
        layer backward), the loss terms freed and no gradients counted."""
        assert self.offload_parts is not None
        return _offloaded_layer_at(self.offload_parts, k)

    def offloaded_post_at(self, k: Num) -> Num:
        """Offloading: activations at the end of the k-th layer's backward from the last: the next layer's set
        (reloaded while this one ran; plain or checkpointed, none past the stage's first layer) beside the input
        gradient. (`backward_post_bytes` holds the unit's second-to-last layer's: a plain set where checkpointed
        layers come next read up to 2.8% high, FSDP2 with --recompute-layers.)"""
        assert self.offload_parts is not None
        _, plain_n, n, plain, kept, _, _, post_base, casts = self.offload_parts
        nxt = k + 1
        return post_base + where(nxt < plain_n, plain, where(nxt < n, kept, 0)) + _cast_kept_at(plain_n, casts, k)


def _mixed_at(parts: tuple[Any, ...], k: Num, kind: str) -> Num:
    """base (everything held once the loss terms are freed) less the saved sets of the k layers above the k-th
    from the last, plus that layer's moment: a plain layer's transient, or a checkpointed one's re-run set (net of
    what it kept) and transient. Checkpointed: the first `ck` of the unit (block method), or those whose 1-based
    position is a multiple of `every` (--recompute-every)."""
    base, n, ck, every, plain, kept, moments = parts
    if every is None:
        ck_above = imax(k - (n - ck), 0)
        is_ck = k >= n - ck
    else:
        ck_above = n // every - (n - k) // every
        is_ck = (n - k) % every == 0
    tr_plain, tr_ck = moments[kind]
    return base - (k - ck_above) * plain - ck_above * kept + where(is_ck, tr_ck, tr_plain)


def mixed_layers(act: Any) -> tuple[Num, ...]:
    """--recompute-layers / --recompute-every: the layers (k from the unit's last, k >= 1, clipped to the unit)
    where the moments' slope changes: each run of plain layers and the checkpointed ones form arithmetic
    sequences in k, linear in between, so their ends bound them (with `timeline`'s 1, n-2 and n-1)."""
    _, n, ck, every, *_ = act.mixed_parts
    top = n - ck if every is None else n % every
    ks = (top - 1, top, top + 1)
    if every is not None:
        last_ck = top + (imax(ck, 1) - 1) * every
        ks = ks + (top + every - 1, last_ck, last_ck + 1)
    return tuple(imin(imax(x, 1), imax(n - 1, 1)) for x in ks)


def _offloaded_layer_at(parts: tuple[Num, ...], k: Num) -> Num:
    """base + the layer's saved set + the previous layer's (reloaded; none for the stage's first layer) + the
    layer's backward transient (a checkpointed layer's includes its re-run). The last `plain` layers are plain,
    the rest checkpointed (Megatron's block method checkpoints the first ones)."""
    base, plain_n, n, plain, kept, tr_plain, tr_ck, _, casts = parts
    nxt = k + 1
    prev_plain = where(nxt < plain_n, plain, where(nxt < n, kept, 0))
    prev_ck = where(nxt < n, kept, 0)
    return where(k < plain_n, base + plain + prev_plain + tr_plain + _cast_kept_at(plain_n, casts, k),
                 base + kept + prev_ck + tr_ck)


def _cast_kept_at(plain_n: Num, casts: Num, k: Num) -> Num:
    """Offloading under AMP with full recompute: the weight casts (`casts` bytes a layer) of the plain layers below
    the resident pair at the k-th layer's backward from the last, kept on the device (`stage_activations`)."""
    return casts * imax(plain_n - k - 2, 0)


# terms saved in forward up to and including the attention core; the rest of a layer (output projection, MLP,
# their norms and masks) is saved after it, so its backward runs (and frees them) before the core's
_UP_TO_CORE = ("attn_norm", "attn_norm_normalized", "qkv_input", "amp_weight_casts_qkv", "qk_norm", "mla_q_latent",
               "mla_kv_latent", "q", "k", "v", "qkv_fused_buffer", "attn_softcap_tanh", "attn_softmax", "attn_probs",
               "attn_dropout_mask", "attn_dropout_output", "attn_lse", "lora_attn_low_rank", "lora_dropout_qkv",
               "lora_dropout_qkv_mask", "lora_qkv_zero_pad")
_CORE = ("attn_softcap_tanh", "attn_softmax", "attn_probs", "attn_dropout_mask", "attn_dropout_output", "attn_lse")
# what a LoRA model's first layer does not save when no adapter is in its attention (`first_stage_terms`); the
# q/k/v input is the bitsandbytes rule's (`_bnb_first_layer_unkept`)
_FIRST_LAYER_FROZEN_ATTENTION = ("attn_norm_normalized", "qk_norm", "q", "k", "v", "qkv_fused_buffer", *_CORE,
                                 "attn_output", "attn_output_copy", "attn_output_pre_a2a",
                                 "attn_residual_dropout_mask", "attn_post_norm", "mlp_norm", "mlp_norm_normalized")
# saved before an all-to-all CP exchange of Q, K, V (`_saved_after_exchange`)
_BEFORE_EXCHANGE = frozenset(k for k in _UP_TO_CORE if k not in _CORE) | {"checkpoint_input", "sac_q_output",
                                                                         "sac_v_output"}


def recompute_transient_bytes(run: Run) -> Num:
    """Net bytes a checkpointed layer adds, while its recomputation is live in backward, to the activations held
    just before (0 without recompute; may be negative for selective).
    full: torch.utils.checkpoint / Megatron re-run the whole layer's forward at the start of its backward: all
    its saved activations except the checkpointed input (the same tensor).
    selective: the attention core (scores/softmax/dropout for eager; flash's output and log-sum-exp) and the
    recomputed attention output come back when the backward reaches the core, after the layer's output
    projection and MLP have freed what they saved (Korthikanti sec. 5; Megatron `--recompute-granularity
    selective`, core_attn)."""
    mode = run.training.recompute
    if mode == "none":
        return 0
    return _remat_net(mode, layer_terms(run, "none"), _remat_kept(run, layer_bytes(run, mode)))


def _remat_kept(run: Run, kept: Num) -> Num:
    """What of a checkpointed layer's kept bytes (`layer_terms(run, mode)`) its plain saved set counts too, so that
    its re-run does not make them again: all of them, but the checkpointed input where the layer's first norm is an
    eager fp32 RMSNorm on a narrower stream, which saves an fp32 copy of it (`_norm_saved`), made by the re-run
    beside the checkpoint. Measured by the harness: a bf16 layer with `--norm-impl fp32` under full recompute was
    one c*tok*h short in backward without this (-0.9% to -2.0% of 2-layer h 1024 toys)."""
    c, _, tok_sp, _ = _shape(run)
    stream = _stream_bytes(run, c)
    if run.training.norm_impl == "fp32" and run.model.norm == "rmsnorm":
        return kept - where(stream < 4, stream * tok_sp * run.model.hidden, 0)
    return kept


def _remat_net(mode: str, terms: dict[str, Num], kept: Num) -> Num:
    plain = 0
    for v in terms.values():
        plain = plain + v
    if mode in ("full", "op"):
        # the whole layer's forward is re-run in its backward; op-level SAC keeps part of it (net of what it kept)
        return plain - kept
    core = 0
    before = 0
    for k in _UP_TO_CORE:
        if k in terms:
            before = before + terms[k]
            if k in _CORE:
                core = core + terms[k]
    after = plain - before
    return core + terms["attn_output"] - after


def _keeps_inputs(t: Any) -> bool:
    """bitsandbytes' quantized linears save their input for backward (see `_lora_terms`)."""
    return t.base_dtype in ("nf4", "int8") and t.quant_backend in ("bnb", "bnb-fp16")


def loop_holds_graph(run: Run) -> bool:
    """The training loop keeps a reference into the step's autograd graph until the next micro-batch's loss
    replaces it: lit-gpt's loop (`logits = model(...)`, `loss = chunked_cross_entropy(...)`, both plain locals of
    the loop) and every loop that keeps its logits (`--keep-logits compute|fp32`: nanoGPT's `logits, loss =
    model(X, Y)`, torchtune 0.1's recipe). Backward frees what autograd saved, but not the graph's nodes, so
    whatever a custom autograd function stored on its `ctx` stays (`graph_held_layer_bytes`)."""
    t = run.training
    return t.loss == "lit-gpt" or t.keep_logits != "none"


def graph_held_layer_bytes(run: Run, terms: dict[str, Num]) -> Num:
    """Bytes of one plain (not checkpointed) layer's saved set that its backward does not free: bitsandbytes'
    quantized linears keep their input A as a `ctx` attribute (`ctx.tensors = (A, B)`,
    bitsandbytes/autograd/_functions.py MatMul4Bit and MatMul8bitLt), not through `save_for_backward`, and autograd
    releases only the latter after a node's backward (`release_variables`); a `ctx` attribute lives as long as the
    node, i.e. until the graph is dropped: at the end of backward, or, where the loop holds the graph
    (`loop_holds_graph`), when the next micro-batch's loss replaces it. Checked on torch 2.13: a tensor stored on
    `ctx` is alive after `loss.backward()` while `loss` is referenced. The tensors: the qkv input, the output
    projection's input, the MLP's input and the down (or proj) projection's input (`layer_terms`' names, so
    deduplicated as there: a shared norm's one output, an input also saved by something else). MoE experts: not
    counted (their inputs' lifetime is the dispatcher's). int8 (MatMul8bitLt): A only, its int8 transposed copy
    not counted. A checkpointed layer keeps none: its forward runs under no_grad with reentrant checkpointing
    (transformers' `gradient_checkpointing_enable` and PEFT's default), and the recomputed graph is dropped after
    the layer's backward. 0 without a bnb-quantized base."""
    if not _keeps_inputs(run.training) or run.training.lora_rank is None:
        return 0
    o_in = terms["attn_output_copy"] if "attn_output_copy" in terms else terms.get("attn_output", 0)
    held = terms.get("qkv_input", 0) + o_in
    if run.model.moe is None:
        held = held + terms.get("mlp_input", 0) + terms.get("mlp_act_output", 0)
    return held


def _graph_held_first_layer_fix(run: Run, terms: dict[str, Num]) -> Num:
    """The part of `graph_held_layer_bytes`' per-layer figure that a LoRA run's first layer does not hold: its
    quantized linears that read the frozen embedding store nothing (`_bnb_first_layer_unkept`), nor does a
    parallel block's MLP without adapters, which reads it through a frozen norm."""
    fix = _bnb_first_layer_unkept(run, terms)
    if run.model.block != "sequential" and not (_mlp_in_adapted(run) or _down_adapted(run)):
        fix = fix + terms.get("mlp_input", 0) + terms.get("mlp_act_output", 0)
    return fix


def _lora_input_unsaved(run: Run, adapted: bool) -> bool:
    """LoRA: nothing saves a frozen linear's input when no adapter reads it undropped and the base keeps no input
    (`_lora_terms`). MoE experts keep theirs (LoRA on attention only)."""
    t = run.training
    if t.lora_rank is None or run.model.moe is not None:
        return False
    return not _keeps_inputs(t) and not (adapted and t.lora_dropout == 0)


def _mlp_input_unsaved(run: Run) -> bool:
    """The MLP's input (the norm output that gate / up, or fc, read) is saved by nothing."""
    return _lora_input_unsaved(run, bool(_mlp_in_adapted(run)))


def _down_input_unsaved(run: Run) -> bool:
    """The down (or proj) projection's input is saved by nothing."""
    return _lora_input_unsaved(run, _down_adapted(run))


def _mlp_in_adapted(run: Run) -> tuple[str, ...]:
    """The MLP's input projections with an adapter: gate and up of a SwiGLU MLP, up (fc) of a GELU one."""
    t = run.training
    if t.lora_rank is None or run.model.moe is not None:
        return ()
    names = ("gate", "up") if run.model.mlp == "swiglu" else ("up",)
    return tuple(p for p in names if p in lora_projections(t.lora_targets))


def _down_adapted(run: Run) -> bool:
    """LoRA adapts the down (or proj) projection (MLP targets; MoE models take attention targets only)."""
    t = run.training
    return t.lora_rank is not None and run.model.moe is None and "down" in lora_projections(t.lora_targets)


def _down_adapter_saved(run: Run, tokens: Num, f_t: Num) -> Num:
    """What the down projection's LoRA adapter saves (`_lora_terms`): its low-rank intermediate and, with adapter
    dropout, the dropped copy of its input and the bool mask; 0 where the down projection has no adapter."""
    t = run.training
    if not _down_adapted(run):
        return 0
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    return c * tokens * t.lora_rank + ((c + 1) * tokens * f_t if t.lora_dropout > 0 else 0)


def _dequantizes(t: Any) -> bool:
    """Quantized base linears that materialise a compute-dtype weight copy (`dequant_bytes`)."""
    return t.lora_rank is not None and t.base_dtype in ("nf4", "int8")


def dequant_bytes(run: Run) -> tuple[Num, Num, Num, Num]:
    """(layer forward, layer backward, head forward, head backward): the compute-dtype copy of a quantized frozen
    weight that a quantized linear materialises around its matmul and frees after it, for the largest one at each
    moment. A layer's last matmul in forward and first in backward is its down (or proj) projection, h x f/t;
    the head's is V/t x h (`--quantize-head`).
    - nf4, bitsandbytes (`bnb.autograd._functions.MatMul4Bit`): forward `F.linear(A, dequantize_4bit(B).t())`,
      backward `matmul(grad_output, dequantize_4bit(B).t())`; torchao's `linear_nf4` (torchtune): forward
      `F.linear(input, weight.to(input.dtype))`, backward `grad_output @ weight.to(grad_output.dtype)`;
    - int8, bitsandbytes (`MatMul8bitLt`): forward runs the int8 GEMM on the int8 weight (no copy); backward
      casts and rescales the int8 weight (`CB.to(dtype).mul_(SCB / 127)`) before its matmul;
    - fp8 bases: not modelled (depends on the kernel; none counted)."""
    t, m = run.training, run.model
    if not _dequantizes(t):
        return 0, 0, 0, 0
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    layer = c * m.hidden * cdiv(mlp_width(m), run.tp)
    head = c * cdiv(padded_vocab(m, run.profile, run.tp), run.tp) * m.hidden if t.quantize_head else 0
    fwd = 1 if t.base_dtype == "nf4" else 0
    return fwd * layer, layer, fwd * head, head


def _dequant_cast(run: Run, dq: Num, out: Num) -> Num:
    """A weight quantized from fp16 (`--quant-backend bnb-fp16`: bitsandbytes <= 0.42's `Params4bit.cuda` takes a
    `.half()` copy, and so does Lightning Fabric's `_Linear4bit.quantize`) dequantizes to fp16 (`dequantize_4bit`),
    and MatMul4Bit's `.to(A.dtype)` makes the compute-dtype copy `dq` beside it: before the matmul's output `out`
    exists, the fp16 copy is live too. Returns what that moment holds beyond `dq + out` (0 for an fp16 compute
    dtype, other backends, int8)."""
    t = run.training
    if t.quant_backend != "bnb-fp16" or t.base_dtype != "nf4" or run.recipe.compute_dtype == "fp16":
        return 0
    fp16 = dq // DTYPE_BYTES[run.recipe.compute_dtype] * 2
    return imax(fp16 - out, 0)


def dequant_scratch(run: Run, dq: Num) -> Num:
    """What a dequantization holds beyond its compute-dtype output `dq` at its highest moment, before the matmul
    that reads it. torchao's NF4 (`--quant-backend torchao`, torchtune's QLoRA) dequantizes in eager PyTorch
    (`NF4Tensor.get_original_weight`, the same ops from torchao 0.1 to 0.18): each half of the packed bytes
    widened to int64 (8 bytes per weight in all), looked up in the level table and scaled by the block scalers
    repeated over the half-block (c bytes per weight each), the scalers themselves (c per 64 weights), all of them
    locals alive while `torch.stack` interleaves the halves into the output: 8 n + 2 c n + c n / 64 for n weights
    of c bytes. Measured by the harness op for op (memcalc/validate/quant.py) and on an H100 (docs/validation.md,
    the torchtune QLoRA row). bitsandbytes' kernel allocates only its output: 0."""
    t = run.training
    if t.quant_backend != "torchao" or t.base_dtype != "nf4":
        return 0
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    n = dq // c
    return where(n % 64 == 0, 8 * n + 2 * c * n + c * (n // 64), 0)


def _stream_unsaved(run: Run) -> Num:
    """The residual-stream tensors of a plain layer that are live at its down projection (and at the residual add
    after it) while nothing saves them: the layer's input (the caller's reference, as in lit-gpt's and HF's layer
    loops) and, in a sequential block, the attention half's sum (the MLP's residual operand). An eager fp32 RMSNorm
    (`--norm-impl fp32`) saves an fp32 copy of its input, not the stream tensor itself, when the stream is narrower
    than fp32; fused norms save the stream tensor (0 here). Measured by the harness (docs/validation.md, the
    held-graph QLoRA row, whose peak is this moment)."""
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    stream = _stream_bytes(run, c)
    if run.training.norm_impl != "fp32" or run.model.norm != "rmsnorm":
        return 0
    n = 2 if run.model.block == "sequential" else 1
    # (the stream's width is an array in plan's bulk evaluation: FSDP2 drops autocast where it shards)
    return where(stream == 4, 0, n * stream * _shape(run)[2] * run.model.hidden)


def _mlp_forward_extra(run: Run) -> Num:
    """torch, a plain layer's down projection output in forward, beyond that output: under autocast the MLP's
    argument, the norm's fp32 output, which no matmul saves (each saves its own compute-dtype cast,
    `_input_copies`), 4*tok_in*h; under SP the reduce-scatter of the row-parallel output, which concatenates the
    sequence chunks into a new tensor before scattering (torch/distributed/_functional_collectives.py,
    `reduce_scatter_tensor` with scatter_dim 1), c*tok*h, and its output c*tok_sp*h. Measured: docs/validation.md
    (the PP x TP rows, whose first stage peaks at this moment)."""
    if run.profile != "torch" or run.model.moe is not None:
        return 0
    _, _, _, tok_in = _shape(run)
    return _autocast(run) * 4 * tok_in * run.model.hidden + _row_parallel_collective(run, all_reduce=False)


def _row_parallel_collective(run: Run, all_reduce: bool) -> Num:
    """torch, the new tensors of a row-parallel projection's output collective, beside its partial output: under SP
    the reduce-scatter's concatenated input `c*tok*h` and its output `c*tok_sp*h`
    (torch/distributed/_functional_collectives.py `reduce_scatter_tensor`, scatter dim 1); without SP the
    all-reduce's output `c*tok*h` (funcol's out-of-place all_reduce), counted where `all_reduce`."""
    c, tok, tok_sp, _ = _shape(run)
    h = run.model.hidden
    if run.sp:
        return where(run.tp > 1, c * (tok + tok_sp) * h, 0)
    return where(run.tp > 1, c * tok * h, 0) if all_reduce else 0


def _down_matmul_moment(run: Run, mode: str, plain_layers: Num, down_out: Num, scratch: Num) -> Num:
    """At the last layer's down (or proj) projection's matmul, what is live beyond the saved set and its dequantized
    weight: the projection's output `down_out`, or just before it the dequantization's own `scratch`
    (`dequant_scratch`); the MLP's input (the norm output, an argument of the MLP's forward) and the down
    projection's input (an argument of its forward), where nothing saves them (a frozen linear that keeps no input,
    `_lora_terms`); less the down adapter's own terms, which its base matmul precedes. A checkpointed layer's
    no-grad forward saves nothing, so both inputs are extra there."""
    m = run.model
    c, tok, _, tok_in = _shape(run)
    f_t = cdiv(mlp_width(m), run.tp)
    mlp_input = c * tok_in * m.hidden if _mlp_input_unsaved(run) else 0
    down_input = c * tok * f_t if _down_input_unsaved(run) else 0
    plain = imax(down_out, scratch) + mlp_input + down_input - _down_adapter_saved(run, tok, f_t)
    if mode in ("full", "op"):
        # no-grad: the attention half's residual sum (the MLP's residual operand) and the MLP's input are live, and
        # one f/t-wide activation: the down projection's input, or silu(gate) at the up projection's matmul (the
        # same moment for a dequantization's scratch, before either output). With SwiGLU the up projection's
        # output (f/t wide) can exceed the down projection's (h wide)
        resid = _stream_bytes(run, c) * _shape(run)[2] * m.hidden
        ck = resid + c * tok_in * m.hidden + c * tok * f_t
        out = c * tok * (imax(f_t, m.hidden) if m.mlp == "swiglu" else m.hidden)
        ck = ck + imax(out - c * tok * m.hidden + down_out, scratch)
        return where(plain_layers == 0, ck, plain)
    return plain + 0 * plain_layers


def _recomputed_down_matmul(run: Run) -> Num:
    """A checkpointed QLoRA layer's re-run forward (grad enabled, non-reentrant `torch.utils.checkpoint`) at its
    last dequantization, beyond the recomputed saved set: the re-run starts at the first backward node that
    unpacks a saved tensor and stops once the last one is remade.
    - The down (or proj) projection's backward unpacks one (an adapter's terms, or the input bitsandbytes keeps):
      the re-run passes the down projection before any backward, with the incoming gradient of the residual
      stream, the dequantized weight and its output or, just before it, the dequantization's scratch
      (`dequant_scratch`), the inputs nothing saves (`_down_matmul_moment`), and, where an fp32 norm saves a copy
      instead, the attention half's residual sum (the layer's input is the checkpoint's, held); less the down
      adapter's terms, not made yet.
    - Otherwise (torchao's base keeps nothing, no down adapter) the down projection's backward runs first and the
      activation's backward triggers the re-run, which ends at the product's factors: its last dequantization is
      the up (or fc) projection's, beside the product's gradient (c tok f/t, in place of the up output, not made
      yet) and the same stream gradient, unsaved MLP input and residual sum.
    Measured by the harness op for op (torchao's dequantization inside the re-run)."""
    m, t = run.model, run.training
    c, tok, _, tok_in = _shape(run)
    dq = dequant_bytes(run)[0]
    scratch = dequant_scratch(run, dq)
    half_sum = _stream_unsaved(run) // 2 if m.block == "sequential" else 0
    common = _residual_grad_bytes(run) + dq + _dequant_cast(run, dq, c * tok * m.hidden) + half_sum
    if _down_adapted(run) or _keeps_inputs(t):
        return common + _down_matmul_moment(run, "none", 1, c * tok * m.hidden, scratch)
    f_t = cdiv(mlp_width(m), run.tp)
    mlp_input = c * tok_in * m.hidden if _mlp_input_unsaved(run) else 0
    return common + imax(scratch, c * tok * f_t) + mlp_input


def _recomputed_plain_end(run: Run) -> Num:
    """A checkpointed dense layer's re-run forward (non-reentrant `torch.utils.checkpoint`, full or op-level, torch
    profile, no LoRA; without dropout tp 1 or SP), beyond the recomputed saved set: the re-run stops as the down (or
    proj) projection saves its input (and, under autocast, its weight's cast). Live besides: the incoming gradient
    of the residual stream, an unsaved attention half's sum (`_stream_unsaved`) and, under autocast, the MLP's
    argument, the norm's fp32 output, which no matmul saves (each saves its own cast: `_mlp_forward_extra`), and the
    down projection's output gradient, which the residual add's backward has cast to the compute dtype before the
    down projection's backward unpacks its input and so starts the re-run (`layer_backward_transient`'s
    `out_grad`). The highest of the layer's backward moments where the MLP is narrow (f = h/2 under AMP: -2.1% of a
    toy's backward without it). Under SP also the norm output's shard, which the layer's call holds beside its
    all-gather, and the output gradient's all-gather (`_sp_grad_gather`, before the re-run) in place of the
    compute-dtype shard (AMP over TP 4: -2.2% of a toy's backward without them, tests/test_validate_op_sac.py).
    With dropout it runs on to the output dropout's mask (below). `_NEVER` elsewhere (TP without SP and without
    dropout: not measured)."""
    m = run.model
    if run.profile != "torch" or m.moe is not None or run.training.lora_rank is not None:
        return _NEVER
    c, _, tok_sp, tok_in = _shape(run)
    half_sum = _stream_unsaved(run) // 2 if m.block == "sequential" else 0
    end = _residual_grad_bytes(run) + half_sum + _autocast(run) * (4 * tok_in * m.hidden + c * tok_sp * m.hidden)
    if run.dropout > 0:
        # with dropout the re-run starts at the output dropout's backward (which unpacks its mask), before any
        # collective of the output gradient, and runs on through the down projection to that mask: at tp 1 its
        # output beside the dropout's output and mask; under SP the projection's full-sequence partial output, the
        # reduce-scatter's concatenated input and sharded output, with the norm output's shard held and the mask
        # not made yet. Measured by the harness op by op: -0.7% (fp32), -7.9% (AMP), -2.0% (pure bf16) of a toy's
        # backward without it; TP 2 + SP -2.6% / -12.5% (fp32 / AMP); TP 2 -2.9% / -7.6% / -5.3%
        sp_drop = (end + _stream_bytes(run, c) * tok_sp * m.hidden + 2 * c * tok_in * m.hidden
                   + c * tok_sp * m.hidden - tok_sp * m.hidden)
        # (TP without SP: the all-reduce's output in place of the projection's partial one, which it frees)
        return where((run.tp > 1) & run.sp, sp_drop, end + 2 * c * tok_sp * m.hidden)
    if run.sp:
        # under SP the MLP's argument is the all-gather of the norm's output, whose shard the layer's call holds, and
        # the output gradient is all-gathered before the re-run (`_sp_grad_gather`): that full-sequence copy in
        # place of the compute-dtype shard
        sp_end = (end + _stream_bytes(run, c) * tok_sp * m.hidden + c * tok_in * m.hidden
                  - _autocast(run) * c * tok_sp * m.hidden)
        return where(run.tp > 1, sp_end, end)
    return where(run.tp == 1, end, _NEVER)


def _recomputed_adapter_end(run: Run) -> Num:
    """A checkpointed layer's re-run forward (non-reentrant `torch.utils.checkpoint`) where the down (or proj)
    projection has a LoRA adapter on an unquantized base, beyond the recomputed saved set: the re-run stops as the
    last saved tensor is remade, the adapter's low-rank intermediate (saved by its second matmul). Live then besides:
    the incoming gradient of the residual stream, the base projection's output (c tok h, read by the adapter's sum,
    which is not re-run), the inputs nothing saves (the MLP's input and, with adapter dropout, the down projection's,
    `_lora_input_unsaved`) and an unsaved attention half's sum (`_stream_unsaved`). Measured by the harness op for op:
    -1.0% to -1.5% of a 2-layer h 1024 model's backward without this moment."""
    m = run.model
    c, tok, _, tok_in = _shape(run)
    f_t = cdiv(mlp_width(m), run.tp)
    half_sum = _stream_unsaved(run) // 2 if m.block == "sequential" else 0
    mlp_input = c * tok_in * m.hidden if _mlp_input_unsaved(run) else 0
    down_input = c * tok * f_t if _down_input_unsaved(run) else 0
    return _residual_grad_bytes(run) + half_sum + c * tok * m.hidden + mlp_input + down_input


def layer_backward_transient(run: Run, terms: dict[str, Num] | None = None, stream_in_buffer: Num = 0,
                             dw_made: Num = 0, dw_counted: Num = 0, later: bool = False) -> Num:
    """Bytes a layer's backward holds beyond the saved activations at its highest moment (the MLP's backward,
    which runs first): the incoming gradient of the residual stream (its dtype, sharded like it under SP), the
    down projection's input gradient and, for SwiGLU, the gradients of both factors of the product while the
    former is live (net of the down projection's saved input, freed by then): 2 c tok f/t; for GELU the GELU
    gradient, net c tok f/t. A quantized down projection holds its dequantized weight while it computes the
    c tok f/t input gradient (`dequant_bytes`). Derived from the op order of autograd's backward (aten mm / mul /
    silu_backward; measured op by op by the harness, docs/validation.md). The weight gradients are counted by the
    timeline. The attention core's backward (`attention_backward`, from the layer's `terms` where the caller has
    them), later in the layer, is the other candidate. `stream_in_buffer`: the part of the incoming gradient that
    is not a new allocation at the MLP's moment (torch pipelining's receive buffer), not at the core's (by then
    the MLP's input gradient has been added to it). `dw_made`: the down projection's weight gradient where the
    caller counts it as made by the layer's moment (a first micro-batch's: `_down_wgrad_bytes`); the MLP output's
    composite norm runs its backward before it. The down projection's own backward comes first: its input gradient
    beside its output's gradient, a new compute-dtype tensor where autocast casts the stream's gradient (the
    residual add's backward, `grad.to(dtype)`) or dropout's backward scales it, and under autocast its weight
    gradient in the compute dtype (the cast node makes the fp32 one only after the matmul's backward), in place of
    the `dw_counted` bytes the caller counts made there (`_down_dw_counted`). Measured by the harness: a GELU
    MLP under AMP was 2fh - c tok h above it without this. `later`: a later micro-batch's backward (its weight
    gradients are temporaries added to `.grad`, `_input_projection_wgrad`)."""
    m = run.model
    c, tok, _, _ = _shape(run)
    stream = _residual_grad_bytes(run)
    if m.moe is not None and run.profile != "megatron":
        return stream + imax(_hf_moe_backward_transient(run), attention_backward(run, terms))
    if run.profile == "megatron" and run.training.lora_rank is None and not _dequantizes(run.training):
        return stream + imax(_megatron_mlp_backward(run), megatron_attention_backward(run))
    terms = layer_terms(run) if terms is None else terms
    if m.moe is None:
        tokens, ffn = tok, m.ffn
    else:
        tokens, ffn = m.moe.top_k * tok, m.moe.expert_ffn
    f_t = cdiv(ffn, run.tp)
    factors = 2 if m.mlp == "swiglu" else 1
    # a quantized down projection: its input gradient is computed while its dequantized weight is live
    # (`dequant_bytes`), before the product's backward allocates the factors' gradients
    weight = dequant_bytes(run)[1]
    dq = weight + _dequant_cast(run, weight, c * tokens * f_t)
    ac = _autocast(run)
    out_grad = c * _shape(run)[2] * m.hidden * imax(ac, 1 if run.dropout > 0 else 0)
    # an adapted down projection (LoRA on the MLP): autograd runs the adapter's branch first (created later), so
    # its input gradient waits for the base's while the adapter's saved terms are freed; then autograd sums the two
    # out of place (the input buffer of the tensor both read), the base's output gradient and a dequantized weight
    # freed: 2 c tok f/t beside the adapter's. With adapter dropout, its backward first makes the masked gradient
    # beside the adapter's input gradient, its dropped copy and x A freed, its mask not yet
    adapter_saved = _down_adapter_saved(run, tokens, f_t)
    adapter, adapter_sum = 0, _NEVER
    if _down_adapted(run):
        adapter = c * tokens * f_t - adapter_saved
        if not _keeps_inputs(run.training) and run.training.lora_dropout == 0:
            # the undropped input is saved by the adapter alone (torchao's or a bf16 base keeps none): freed with it
            adapter = adapter - c * tokens * f_t
        adapter_sum = 2 * c * tokens * f_t + adapter
        if run.training.lora_dropout > 0:
            adapter_sum = imax(adapter_sum, out_grad + c * tokens * (f_t - run.training.lora_rank))
    # the input gradient is the matmul's output: a dequantization's own scratch comes before it
    grad_in = imax(c * tokens * f_t, dequant_scratch(run, weight))
    # the down projection's backward frees its saved weight cast: AMP under full recompute, in its saved set
    # (`_saved_cast_terms`), else in the autocast copies held through backward (buffers.py `_amp_casts`)
    down_cast = terms.get("amp_weight_casts_down", 0) + amp_copies_held(run) * c * saved_cast_elems(run)[2]
    dw = 0 if run.training.freeze else ac * c * first_backward_grad_elems(run, 0)[1] - dw_counted
    # (both after the output dropout's backward, which frees its saved mask)
    mask = terms.get("mlp_residual_dropout_mask", 0)
    # (a frozen down projection whose input nothing saves, `_down_input_unsaved`: its input gradient is not net of it)
    unsaved = 1 if _down_input_unsaved(run) else 0
    # (the product's backward comes after the down adapter's, which has freed its terms)
    mlp = imax(imax(imax((factors + unsaved) * c * tokens * f_t - down_cast - adapter_saved,
                         grad_in + dq + adapter + _sp_gathered_grad(run) + out_grad + dw), adapter_sum),
               _input_projection_wgrad(run, terms, tokens, f_t, later)) - mask
    if m.post_norms:
        # the MLP output's norm (Gemma 2/3) runs its backward first and frees what it saved (`mlp_post_norm`);
        # under AMP that backward is torch's composite (`composite_norm_backward`), a moment of its own
        mlp = imax(mlp - terms.get("mlp_post_norm", 0),
                   composite_norm_backward(run, _shape(run)[2] * m.hidden, _fp32_norm_stats(run) * _shape(run)[2])
                   - dw_made)
    if run.profile == "megatron":
        return stream + mlp
    return stream + imax(mlp - stream_in_buffer, attention_backward(run, terms))


def _down_wgrad_bytes(run: Run, stage: Num) -> Num:
    """A layer's down projection weight gradient as a first backward counts it made at the layer's MLP moment
    (timeline `_first_grads`: the gradient dtype, none with --freeze), where the composite post norm's backward
    (`composite_norm_backward`) runs before it. Only where that norm runs: torch AMP (no FSDP2 sharding, no
    LoRA: `_autocast`), so the gradients are plain."""
    if run.training.freeze or not run.model.post_norms:
        return 0
    # (less the norm's own weight gradient, made by then: its weight multiply's backward)
    down = first_backward_grad_elems(run, stage)[1] - scaled(run, norm_params(run.model))
    return _autocast(run) * DTYPE_BYTES[run.recipe.grad_dtype] * down


def _input_projection_wgrad(run: Run, terms: dict[str, Num], tokens: Num, f_t: Num, later: bool = False) -> Num:
    """Under autocast, the MLP's first input projection's backward (up, which autograd reaches before the gate's
    silu; GELU's fc), beyond the layer's saved set and the stream's gradient with the down projection's fp32 gradient
    made: the cast node's fp32 weight gradient made beside the matmul's compute-dtype one, and the input gradient
    upcast to the stream's fp32 (the input cast's backward), after the projection has freed its input and weight
    copies and the activation's backward the product's operands (SwiGLU: the down projection's input, up's and
    silu's outputs, silu's gradient live; GELU: the down projection's input and fc's output), and the down
    projection its weight copy: `(g - c)*h*f + (4 - c)*tok*h - 2c*tok*f` (g the gradient dtype's bytes, 4 in fp32);
    SwiGLU's gate after it, `2(g - c)*h*f + (4 - 2c)*tok*h - 4c*tok*f`. The higher where weights outweigh tokens
    (tok < about 2h/3).
    Any tp (without SP the gate's moment `4*tok*h` higher: both fp32 input gradients live; under SP the gathered
    input is one tensor, summed before the cast as at tp 1), and under TP then the last projection's fp32 input
    gradient at its collective, the compute-dtype weight gradient freed: `- c*h*f/t` plus the all-reduce's output
    `4*tok*h`, or SP's reduce-scatter's concatenated input and output `4*tok*h + 4*tok_sp*h`; pp 1 (the copies held
    through backward, in the autocast buffer or a fully recomputed layer's saved set), no LoRA or --freeze; else
    `_NEVER`. Measured by the harness op by op (toys at 128 tokens, h 256: -0.16% / -0.21% of the backward before;
    row 155 -1.25%; GQA over tp 4 at f/t 176: -1.1% / -1.7%: tests/test_validate_mlp_backward.py).
    Without autocast (and without FSDP2 sharding; any tp, SP too) the same op order ends at the first projection's
    input gradient (SwiGLU: the gate's, after silu's backward) with its weight gradient and, for SwiGLU, up's made
    (a first backward's `.grad`; a later micro-batch's are temporaries added to `.grad` as they come, one live),
    the down projection's input and the product's operands freed, silu's gradient and up's input gradient (under TP
    its all-reduced copy; under SP full-sequence, not yet reduce-scattered) live:
    `k g h f/t + k c tok h - (2k - 1) c tok f/t` for k input projections (2 for SwiGLU, GELU's fc 1; one weight
    gradient in a later micro-batch). The higher where the weights outweigh the
    attention's saved set and gradients (GQA over tp 4 at 512 tokens, h 2048: -0.50% without it,
    tests/test_validate_mlp_backward.py)."""
    m, t = run.model, run.training
    if run.profile != "torch" or m.moe is not None or t.freeze or t.lora_rank is not None or _dequantizes(t):
        return _NEVER
    held = amp_copies_held(run) + (1 if "amp_weight_casts_down" in terms else 0)
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    g = DTYPE_BYTES[run.recipe.grad_dtype]
    hf = first_backward_grad_elems(run, 0)[1]
    moment = (g - c) * hf + (4 - c) * tokens * m.hidden - 2 * c * tokens * f_t
    last = moment  # the last input projection's (GELU's fc, SwiGLU's gate)
    if m.mlp == "swiglu":
        # then the gate's, after silu's backward: up's fp32 gradient made, the gate's beside its compute-dtype one,
        # all three copies and the four c*tok*f operands freed, the two input gradients summed in fp32; under TP
        # (without SP) each projection's input is its own tensor, and the sum comes after the all-reduces, which
        # follow the weight gradient's cast: both fp32 input gradients live
        two = where((run.tp > 1) & (not run.sp), 4, 0)
        last = 2 * (g - c) * hf + (4 + two - 2 * c) * tokens * m.hidden - 4 * c * tokens * f_t
        moment = imax(moment, last)
    # under TP, then the last projection's fp32 input gradient (SwiGLU: the sum under SP) goes to its collective, the
    # compute-dtype weight gradient freed: the all-reduce's output, or under SP the reduce-scatter's concatenated
    # input and sharded output
    _, _, tok_sp, _ = _shape(run)
    coll = 4 * tokens * m.hidden + (4 * tok_sp * m.hidden if run.sp else 0)
    moment = imax(moment, where(run.tp > 1, last - c * hf + coll, _NEVER))
    amp = where((_autocast(run) == 1) & (held >= 1) & (run.pp == 1), moment, _NEVER)
    k = 2 if m.mlp == "swiglu" else 1
    plain = (1 if later else k) * g * hf + k * c * tokens * m.hidden - (2 * k - 1) * c * tokens * f_t
    if m.mlp == "swiglu":
        # under TP without SP, before silu's backward: up's input gradient at its own all-reduce (each column-parallel
        # projection's input is its own Replicate tensor), beside the all-reduce's output, with up's weight gradient
        # made (a first backward's `.grad`; a later micro-batch's is added to `.grad` and freed by then) and the
        # product's two operands freed: g h f/t + 2 c tok h - 2 c tok f/t, the higher where tok > h. Measured by
        # the harness op by op: TP 2, full recompute, 512 tokens at h 256: -1.07% of the backward without it
        up_all_reduce = (0 if later else 1) * g * hf + 2 * c * tokens * m.hidden - 2 * c * tokens * f_t
        plain = imax(plain, where((run.tp > 1) & (not run.sp), up_all_reduce, _NEVER))
    return where((_autocast(run) == 0) & (fsdp_sharded(run) == 0), plain, amp)


def _down_dw_counted(run: Run) -> Num:
    """A first micro-batch's down projection weight gradient as the timeline counts it made at the layer's MLP
    moment (`_first_grads`: the gradient dtype), where autocast makes it in the compute dtype first
    (`layer_backward_transient`); 0 without autocast, where the matmul's gradient is `.grad` itself."""
    if run.training.freeze:
        return 0
    return _autocast(run) * DTYPE_BYTES[run.recipe.grad_dtype] * first_backward_grad_elems(run, 0)[1]


def composite_norm_backward(run: Run, elems: Num, stats: Num) -> Num:
    """The backward of an nn.RMSNorm that runs torch's composite (a compute-dtype input, an fp32 weight: under
    torch AMP, `_output_norm_saved`) on `elems` elements, beyond what the layer saved and the residual stream's
    gradient: its highest moment is the square's backward (`grad * (2 * x.pow(1))`, three fp32 tensors), with the
    rstd product's input gradient and the mean's expanded gradient live beside them (5 x 4 bytes an element),
    after the weight multiply's backward has freed the saved normalized tensor (4 bytes an element) and the rsqrt's
    backward the statistics (`stats` bytes): 16 bytes an element less the statistics. From autograd's formulas
    (tools/autograd/derivatives.yaml: pow, mean, mul); measured by the harness, which runs the same aten ops on the
    CPU, to within 10 KB (tests/test_validate_extra_norms.py). On a GPU the kernels add scratch (docs/methodology.md,
    "Not modelled"). 0 where the norm runs a fused kernel."""
    if run.training.norm_impl == "fp32" or run.model.norm != "rmsnorm":
        return 0
    return _autocast(run) * (16 * elems - stats)


def attention_backward(run: Run, terms: dict[str, Num] | None = None, recomputed: bool = False) -> Num:
    """The attention core's backward moment beyond the layer's saved set and the residual stream's gradient (torch
    and deepspeed profiles; Megatron's is `megatron_attention_backward`). By then the output projection, the MLP
    and their norms and masks (the terms saved after the core) have run their backward and freed what they saved,
    and the output projection's input gradient dO (c tok a/t v) is live.
    - flash / SDPA: the kernel's dQ, dK, dV (the sizes of the saved Q, K, V) beside dO; the kernel's own output,
      which the output projection read, is saved until then.
    - eager (Hugging Face's `softmax(dtype=float32).to(dtype)`, `_hf_softmax_copy`): the value matmul's backward
      makes dV (the saved, repeated V's size) and the probabilities' gradient dP (c S, S = a/t tok s); its saved
      probabilities (the copy, or the dropped ones with their mask) and V are freed as the upcast dP (4 S) and
      softmax's fp32 gradient (4 S) are made beside softmax's saved output: 8 S + dV - V - (the core's terms but
      the softmax output); before that, the matmul itself with dO and dP live (c S + dO + dV).
    Derived from autograd's op order and measured to the byte by the harness's blocks on the CPU
    (tests/test_validate_attention.py). On a GPU the kernels'
    own workspaces come on top and are not counted: FlashAttention-2's backward (PyTorch flash_api.cpp mha_bwd)
    allocates an fp32 dQ accumulator (4 b s_128 a/t d_32, sequence rounded up to 128 and head width to 32), its
    fp32 softmax sum (4 b a/t s_128) and, under GQA, dK and dV expanded to every query head (2 c tok a/t d); none
    is visible to the CPU's tracker. The moment is the layer's highest only when the MLP's saved set is small
    next to it (ffn far below h, or eager attention at long sequences). `terms`: the layer's `layer_terms(run)`,
    where the caller has them. `recomputed`: the core of a selectively recomputed layer, back for its backward
    (the moment is then relative to the plain saved set, which the caller restores)."""
    m = run.model
    if run.profile == "megatron" or (run.training.recompute == "selective" and not recomputed) or m.mla is not None:
        return _NEVER
    c, tok, _, _ = _shape(run)
    terms = layer_terms(run, "none") if terms is None else terms
    d_o = terms["attn_output"]  # the output projection's input gradient: its input's size
    before = sum(x for k, x in terms.items() if k in _UP_TO_CORE)
    after = sum(terms.values()) - before  # freed by the output projection's, the MLP's and their norms' backward
    if not eager_core(run):
        # the kernel's output is the output projection's saved input (`attn_output`): still live
        moment = d_o + terms["q"] + terms["k"] + terms["v"] - (after - terms["attn_output"])
    else:
        scores = (m.heads // run.tp) * tok * run.seq
        # freed by the value matmul's backward; the softcap's tanh output lives on to its own, after the softmax's
        core_but_softmax = sum(terms.get(k, 0) for k in _CORE if k not in ("attn_softmax", "attn_softcap_tanh"))
        at_matmul = d_o + terms["v"] + c * scores - after
        at_softmax = 8 * scores - after - core_but_softmax + softmax_backward_scratch(run)
        if recomputed:
            # the value matmul's V gradient (V's size, its repetition's under GQA) is live beside softmax's backward;
            # under GQA the re-run's saved V repetition (which the caller adds) is freed by then
            # (MHA: the value matmul's copy of V, with more than one sequence, the same: `_qk_copied`)
            v_copy = _qk_copied(run) * terms["v"] if m.kv_heads == m.heads else 0
            at_softmax = at_softmax + terms["v"] - (terms["v"] if _core_repeats_kv(run) else 0) - v_copy
        moment = imax(at_matmul, at_softmax)
        if recomputed:
            # the re-run itself (with grad) at its mask add, before the core's saved tensors exist: two score tensors
            # and the causal bias beside dO; SDPA's math path also holds K's repetition, its local, beside the
            # scaled K^T it saves, and with more than one sequence its scaled Q beside the matmul's copy of it
            # (`_qk_copied`). Measured by the harness: fp32 GQA at 128 tokens, -0.6% (mb 2: -2.1%) of the
            # backward without it
            s_loc = _bias_len(run)
            head_bytes = c * tok * (m.heads // run.tp) * m.head_dim
            k_local = (head_bytes * (1 if _core_repeats_kv(run) else 0) + head_bytes * _qk_copied(run)
                       if _math_path(run) else 0)
            rerun = (d_o - after - sum(terms.get(k, 0) for k in _CORE) + 2 * c * scores + c * s_loc * s_loc
                     + k_local - v_copy)
            moment = imax(moment, rerun)
        if run.dropout > 0:
            # fp32 probabilities (`_fp32_core_inputs`): the value matmul's gradient of its compute-dtype cast is
            # upcast (4 S) and dropout's backward makes its fp32 gradient (4 S) while the mask and the softmax
            # output are still saved; the matmul's saved cast is freed. Measured by the harness
            mask = terms.get("attn_dropout_mask", 0)
            at_dropout = 8 * scores - after - (core_but_softmax - mask)
            moment = where(_fp32_core_inputs(run) == 1, imax(moment, at_dropout), moment)
    if m.block == "parallel-shared-norm":
        # the MLP branch's backward ran first and left its input's gradient in the shared norm's input buffer,
        # where it waits for Q/K/V's (the norm output's dtype, that of the stream)
        moment = moment + _residual_grad_bytes(run)
    return _cp_core(run, moment)


def _core_repeats_kv(run: Run) -> bool:
    """Whether an eager core repeats K and V to every query head itself (HF `repeat_kv`, SDPA's math fallback):
    GQA with K and V not expanded before it (lit-gpt's fused QKV and --gqa-impl expand expand them first)."""
    t = run.training
    return run.model.kv_heads < run.model.heads and t.qkv_impl != "fused" and t.gqa_impl != "expand"


def _bias_len(run: Run) -> Num:
    """The side of an eager core's (s, s) causal bias: the whole sequence under Ulysses (a2a), whose core sees it
    all; a ring's block (s/cp) otherwise."""
    return run.seq if run.cp_comm == "a2a" else run.seq // run.cp


def _cp_core(run: Run, moment: Num) -> Num:
    """An attention core's moment under context parallelism. DeepSpeed-Ulysses (a2a, torch and deepspeed profiles)
    runs the core on the whole sequence with a/(t cp) heads: the bytes of a/t heads over s/cp tokens (`_shape`), so
    the moment holds as derived. A ring's K/V exchange (p2p) or TE's a2a inside the core is not derived: `_NEVER`."""
    if run.cp_comm == "a2a" and run.profile != "megatron":
        return moment
    return where(run.cp > 1, _NEVER, moment)


# a layer's saved terms that outlive its MLP norm's backward (the attention half's, and that norm's own)
_THROUGH_MLP_NORM = frozenset(_UP_TO_CORE) | {"attn_output", "attn_output_copy", "attn_output_pre_a2a",
                                             "attn_residual_dropout_mask", "attn_post_norm", "lora_dropout_o",
                                             "lora_dropout_o_mask", "residual_adds", "mlp_norm"}


def mlp_norm_backward(run: Run, terms: dict[str, Num]) -> Num:
    """A layer's MLP norm's backward where it is an eager fp32 RMSNorm (`--norm-impl fp32`), beyond the layer's saved
    set and the residual stream's gradient: the MLP's backward has freed what the MLP saved, and the norm's own
    backward runs (`_eager_norm_backward`; its input, the attention half's sum, also feeds the residual add, whose
    gradient waits in its input buffer). Between the MLP's moment and the attention core's, so the timeline counts
    it with the core's gradients (the caller takes off the output projection's, not made yet). Its highest where the MLP is narrow next to the stream (without LoRA, f below about
    5h/3 in bf16). Measured by the harness op for op (-10.7% of a 2-layer h 1024, f 512 model's backward under full
    recompute without it). `_NEVER` for other norms, MoE or parallel blocks, and Megatron's fused layers."""
    m = run.model
    if (run.training.norm_impl != "fp32" or m.norm != "rmsnorm" or m.block != "sequential" or m.moe is not None
            or run.profile == "megatron"):
        return _NEVER
    freed = sum(v for k, v in terms.items() if k not in _THROUGH_MLP_NORM)
    # (the output projection's weight cast under AMP with full recompute is freed by its own backward, later)
    o_cast = 0
    if "amp_weight_casts_o_mlp" in terms:
        o_r, o_c, _ = attention_matrix_shapes(m, run.tp)[-1]
        o_cast = muldiv(terms["amp_weight_casts_o_mlp"], scaled(run, o_r * o_c), imax(saved_cast_elems(run)[1], 1))
    # (the norm's cast back, `mlp_norm_normalized`, is among the freed terms: `_eager_norm_backward` nets it too)
    return _eager_norm_backward(run, merged=True) - freed + terms.get("mlp_norm_normalized", 0) + o_cast


def _o_grad_bytes(run: Run, stage: Num) -> Num:
    """The output projection's weight gradient on one rank as a first backward counts it made at a layer's attention
    core (timeline `_first_grads`, or FSDP2's unsharded one in the core's buffers): made after the layer's MLP
    norm's backward (`mlp_norm_backward`). 0 where gradients persist between steps."""
    t, m = run.training, run.model
    if grads_persistent(run):
        return 0
    o_r, o_c, _ = attention_matrix_shapes(m, run.tp)[-1]
    o = scaled(run, o_r * o_c + (m.hidden if m.linear_bias else 0))
    own = lora_layer_params(m, t.lora_targets, t.lora_rank, run.tp, only=("o",)) if t.lora_rank is not None else o
    return first_grad_bytes(run) * own + fsdp_unsharded_grad_bytes(run, stage, o)


def checkpointed_mlp_forward(run: Run, plain: dict[str, Num]) -> tuple[Num, Num]:
    """A fully checkpointed layer's MLP in forward, beyond what is held when the layer starts (its input, the
    checkpoint, among it): (at the activation, at the down projection). The checkpoint's forward saves nothing, so
    each op's output lives only as long as the code references it (torch.utils.checkpoint, non-reentrant: its
    saved-tensor hooks keep no tensor). Throughout: the attention half's sum (the MLP norm's input; a fused norm's
    fp32 statistics with it: `plain["mlp_norm"]`) and the norm output, the MLP's argument, in the stream's dtype
    (fp32 under autocast, whose linears cast it for each matmul and free the cast); under SP its shard, held by the
    caller, and its all-gather. At the SwiGLU product `silu(gate(x)) * up(x)`: silu's output, up's and the product,
    3 c tok f/t (GELU, at the activation: its input and output, 2 c tok f/t). At the down projection: the product,
    the projection's output c tok h (partial under TP) and the collective's new tensor, an all-reduce's output
    c tok h or, under SP, the reduce-scatter's concatenated input c tok h and its output c tok_sp h
    (`_row_parallel_collective`). Under autocast the down projection's weight copy is made between the two
    (timeline, `buffers.amp_casts_after_last_mlp`); with post norms under AMP the output's composite norm
    after it. Derived from the harness's op order (Hugging Face's and torchtitan's MLPs have the same) and measured
    by it (tests/test_validate_forward.py). Without them the forward phase of a fully recomputed model whose loss is
    small was 1-12% low (a 4-layer toy, vocab 512), 59% at Llama-3.1-70B's width over TP 8 + SP. With dropout,
    the MLP output's dropout after the down projection. LoRA on the MLP: an adapted projection returns its base
    output plus its adapter's, summed out of place, so at the sum the three are live (up's beside silu's output:
    4 c tok f/t; the down projection's: 3 c tok h beside the product; the rank-wide x A is freed by then); with
    adapter dropout the down adapter's dropped copy of the product and its mask, after the base output. Measured
    by the harness (2-layer toys, LoRA on every projection: the forward was 14% low without it; on the down
    projection alone with dropout, GELU at f = 4h, 7.8%). `_NEVER` (not modelled) for MoE, MLA, parallel blocks,
    quantized bases, context parallelism, and the DeepSpeed and Megatron profiles (Megatron's MLP is fused; the
    harness runs the torch profile only)."""
    m, t = run.model, run.training
    adapted = _mlp_in_adapted(run)
    if (run.profile != "torch" or m.moe is not None or m.mla is not None or m.block != "sequential"
            or t.base_dtype is not None):
        return _NEVER, _NEVER
    c, tok, tok_sp, _ = _shape(run)
    h, f_t = m.hidden, cdiv(m.ffn, run.tp)
    stream = _stream_bytes(run, c)
    # the attention half's sum (with a fused norm's statistics), and the norm output: its shard and, under SP, the
    # all-gather the column-parallel linears read
    if t.norm_impl == "fp32" and m.norm == "rmsnorm":
        held = 2 * stream * tok_sp * h  # eager: its statistics and fp32 copies are freed; the output is cast back
    else:
        held = plain["mlp_norm"] + stream * tok_sp * h
    held = held + (where(run.tp > 1, stream * tok * h, 0) if run.sp else 0)
    width = c * tok * f_t
    if m.mlp == "swiglu":
        at_act = held + (4 if "up" in adapted else 3) * width
    else:
        at_act = held + (3 if "up" in adapted else 2) * width
    at_down = held + width + (3 if _down_adapted(run) else 1) * c * tok * h + _row_parallel_collective(run, True)
    if _down_adapted(run) and t.lora_dropout > 0:
        # its adapter's dropout, after the base output: the dropped copy of the product and the bool mask
        at_down = imax(at_down, held + width + c * tok * h + (c + 1) * tok * f_t)
    if run.dropout > 0:
        # the MLP's output dropout (native_dropout, after the collective: the product and the partial output freed):
        # its input, its output and its bool mask, on the sequence shard under SP
        tok_x = tok_sp if run.sp else tok
        at_down = imax(at_down, held + (2 * c + 1) * tok_x * h)
    if m.post_norms and m.norm == "rmsnorm" and t.norm_impl != "fp32":
        # Gemma 2/3: the MLP output's norm after the down projection, whose output (c tok_sp h) it reads beside the
        # attention half's sum (the MLP norm's output is freed): under AMP torch's composite holds its fp32 copy,
        # the normalized tensor and their weight product at once (`_output_norm_saved`), 12 bytes an element, and
        # rstd. Measured by the harness (a 3-layer model, full recompute: the forward was 7 bytes an element low)
        at_post = plain["mlp_norm"] + c * tok_sp * h + _autocast(run) * (12 * tok_sp * h + 4 * tok_sp)
        at_down = imax(at_down, at_post)
    return where(run.cp > 1, _NEVER, at_act), where(run.cp > 1, _NEVER, at_down)


def _op_sac_pending(run: Run) -> tuple[Num, Num]:
    """Op-level SAC, the last layer's MLP in forward (`checkpointed_mlp_forward`, whose no-grad moments the SAC'd
    forward shares: it saves nothing but the kept outputs): what those moments count that the layer's kept set
    (`_op_sac_terms`, held from the layer's start) also counts, at the activation and at the down projection. The
    kept outputs not made yet at the activation (SwiGLU's down projection output; under SP the row-parallel
    reduce-scatter's output) are not live there, and at the down projection the moment counts them itself; GELU's
    kept fc output is the activation's input, which the moment counts too. Measured by the harness (fp32 toys at
    1024 tokens, h 512: the forward was -4.9% (SwiGLU) and -1.7% (GELU) without it)."""
    t = run.training
    if t.recompute != "op":
        return 0, 0
    terms = _op_sac_terms(run)
    # (under SP the second of the two reduce-scatter outputs, the down projection's)
    pending = terms.get("sac_down_output", 0) + terms.get("sac_reduce_scatter_outputs", 0) // 2
    return pending + terms.get("sac_fc_output", 0), pending


def _checkpointed_attention_locals(run: Run, terms: dict[str, Num], fused: bool = False
                                   ) -> tuple[Num, Num, Num] | None:
    """A checkpointed layer's attention in forward (nothing saved but the kept set `terms`): (what it holds
    throughout beyond what is held when the layer starts, one of Q, K, V's bytes each): the checkpoint's input (or
    under op-level SAC the kept outputs made by then, which are the projections' q and v themselves), the norm output
    in the stream's dtype (under SP its shard too, held by the layer's call, beside the all-gather); Q and K/V
    `c tok a d / t` and `c tok g d / t`. None where not modelled: no rotary, q/k norms, MLA, MoE, parallel blocks,
    other profiles (and context parallelism: the callers' `_NEVER`); fused QKV: `fused=True` callers only, MHA."""
    m = run.model
    if (run.profile != "torch" or m.positions != "rotary" or (run.training.qkv_impl == "fused" and not fused)
            or m.qk_norm or m.mla is not None or m.moe is not None or m.block != "sequential"):
        return None
    c, tok, tok_sp, _ = _shape(run)
    stream = _stream_bytes(run, c)
    held = terms.get("checkpoint_input", 0) + stream * tok * m.hidden
    if run.sp:
        held = held + where(run.tp > 1, stream * tok_sp * m.hidden, 0)
    return held, c * tok * m.head_dim * (m.heads // run.tp), c * tok * m.head_dim * (m.kv_heads // run.tp)


def checkpointed_rotary_forward(run: Run, terms: dict[str, Num]) -> Num:
    """A checkpointed layer's attention in forward (full or op-level recompute), at Q's rotary embedding
    (`q * cos + rotate_half(q) * sin`, the harness's and Hugging Face's order, after the three projections), beyond
    what is held when the layer starts: its locals (`_checkpointed_attention_locals`), the q, k and v projections'
    outputs and three Q-sized tensors (`q * cos`, the rotated half's concatenation and its product with sin):
    `held + c tok (a + 2g) d / t + 3 c tok a d / t`. K's rotary after it is no higher (g <= a). The attention half's
    highest moment where the MLP is narrow or the stream wide: a fully recomputed fp32 layer at f = 1.375 h peaked
    there (the forward -0.9% to -1.3% without it). `_NEVER` where not modelled."""
    if run.training.qkv_impl == "fused":
        return _fused_rotary_forward(run, terms)
    loc = _checkpointed_attention_locals(run, terms)
    if loc is None:
        return _NEVER
    held, q, kv = loc
    return where(run.cp > 1, _NEVER, held + q + 2 * kv + 3 * q)


def _fused_rotary_forward(run: Run, terms: dict[str, Num]) -> Num:
    """`checkpointed_rotary_forward` for lit-gpt's fused QKV (MHA): q, k and v are views of the projection's one
    output, which V keeps whole (q + 2 kv); Q's rotary makes three Q-sized tensors, then K's three beside the
    rotated Q, then both are made contiguous (head-major) beside the rotated ones: the highest of `3q`, `q + 3kv`,
    `2q + 2kv` beyond the buffer and the locals. Measured by the harness: a fully recomputed fp32 MHA layer's forward
    peaked at K's rotary (-3.8% / -6.2% of the forward at 1 / 2 x 128 tokens without it). `_NEVER` under GQA (lit-gpt
    expands K and V into copies there), where not modelled."""
    loc = _checkpointed_attention_locals(run, terms, fused=True)
    if loc is None or run.model.kv_heads != run.model.heads:
        return _NEVER
    held, q, kv = loc
    buffer = q + 2 * kv
    return where(run.cp > 1, _NEVER, held + buffer + imax(imax(3 * q, q + 3 * kv), 2 * q + 2 * kv))


def checkpointed_o_forward(run: Run, terms: dict[str, Num]) -> Num:
    """A fully checkpointed layer's attention in forward (no-grad), at its output projection after a flash core,
    beyond what is held when the layer starts: its locals (`_checkpointed_attention_locals`), Q, K and V (rotated)
    and the core's output (its log-sum-exp, which nothing references without grad, freed), then the projection's
    output (partial under TP) and its collective's new tensors (SP's reduce-scatter: its concatenated input and
    sharded output; without SP the all-reduce's output: `_row_parallel_collective`). The attention half's highest
    moment under TP (TP 2 in fp32 at f = 1.375 h: the forward -1.6% (SP) and -0.14% without it). `_NEVER` where not
    modelled, and after eager or math-path cores."""
    loc = _checkpointed_attention_locals(run, terms)
    if loc is None or eager_core(run):
        return _NEVER
    held, q, kv = loc
    out = DTYPE_BYTES[run.recipe.compute_dtype] * _shape(run)[1] * run.model.hidden
    return where(run.cp > 1, _NEVER, held + q + 2 * kv + q + out + _row_parallel_collective(run, all_reduce=True))


def _math_path(run: Run) -> bool:
    """SDPA's math fallback: an eager core (`eager_core`) without `--attention eager` (a categorical test, also in
    plan's bulk evaluation, where `_math_scaled_q` is an array)."""
    return eager_core(run) and run.training.attention != "eager"


def _math_scaled_q(run: Run) -> Num:
    """SDPA's math fallback (`eager_core` without `--attention eager`) scales Q before its score matmul
    (`_scaled_dot_product_attention_math`: `q * scaling_factor`): with autograd the matmul saves that tensor (the `q`
    term); in a core run without grad (checkpointed) it is a local beside the scores to the core's end, c tok a/t d.
    Measured by the harness: one fp32 tok x h under at a checkpointed core's moments before (forward -0.5%)."""
    if not _math_path(run):
        return 0
    c, tok, _, _ = _shape(run)
    return c * tok * run.model.head_dim * (run.model.heads // run.tp)


def eager_attention_forward(run: Run, terms: dict[str, Num], mode: str) -> Num:
    """Eager attention's forward moment inside the last layer, beyond what is held when that layer starts: the
    terms before the core (`terms`, the layer's saved set in `mode`; its live locals norm output, Q, K, V where a
    checkpointed layer runs without grad) and the core's own tensors, of S = a/t tok s scores (torch and deepspeed
    profiles: Hugging Face's `matmul(q, k^T) * scale + mask`, `softmax(dtype=float32).to(dtype)`, dropout):
    - the scaling and the additive mask: two score tensors at once, and the harness's (s, s) bias (2 c S + c s^2);
    - the softmax: the masked scores, their fp32 upcast (none when they are fp32) and the fp32 output ((c + 8) S,
      or 8 S in fp32);
    - with dropout, its bool mask and output beside the scores, the softmax output and its compute-dtype copy
      ((3 c + 5) S; 13 S in fp32, where the copy is the output itself); without grad (a checkpointed core) the
      scores, the copy, the mask and the output ((3 c + 1) S).
    Beside them, the projections' Q and K (and V under GQA), which the matmuls copy or repeat.
    Derived from the op order and measured by the harness (tests/test_validate_attention.py). `_NEVER` for
    flash, Megatron (fused softmax), MLA, context parallelism."""
    m = run.model
    if not eager_core(run) or run.profile == "megatron" or m.mla is not None:
        return _NEVER
    c, tok, _, _ = _shape(run)
    heads, kv = m.heads // run.tp, m.kv_heads // run.tp
    scores = heads * tok * run.seq
    s_loc = _bias_len(run)
    fused = run.training.qkv_impl == "fused"
    # under GQA the projections' K and V stay referenced by the attention's forward beside their repetitions
    originals = c * tok * m.head_dim * 2 * kv if (m.kv_heads < m.heads and not fused) else 0
    f32 = _fp32_core_inputs(run)  # 1 or 0 (an array of them in plan's bulk evaluation)
    if mode in ("full", "op"):
        # a checkpointed layer: its saved input, and its norm output, Q, K, V as locals (the matmuls' copies of Q
        # and K^T are freed with the matmul when nothing saves them)
        plain = layer_terms(run, "none")
        before = sum(terms.values()) + sum(plain.get(k, 0) for k in ("q", "k", "v", "qkv_fused_buffer"))
        if mode == "op":
            # op-level SAC: of the layer's kept outputs only those made by now, the checkpoint's input and the q and
            # v projections' outputs; v is the V local itself (or, repeated under GQA, its original, `originals`),
            # and so is q but under rotary, which makes a new Q. Measured by the harness: the gate's and the down
            # projection's outputs and a second V counted before, +1.3% to +3.0% of eager toys' forward
            # Under Ulysses (a2a) the core reads the exchanged Q and V, new tensors beside the kept outputs
            # (measured by the harness: V's kept output, -0.26% of the forward without it)
            a2a = where(run.cp > 1, 1, 0) if run.cp_comm == "a2a" else 0
            new_q = 1 if m.positions == "rotary" else a2a
            before = (terms.get("checkpoint_input", 0) + sum(plain.get(k, 0) for k in ("q", "k", "v"))
                      + new_q * terms.get("sac_q_output", 0) + a2a * terms.get("sac_v_output", 0))
        before = before + _stream_bytes(run, c) * tok * m.hidden
        # q/k norms under AMP (`_fp32_core_inputs`): rotary's Q and K, and under GQA K's repetition, are fp32
        # locals, 4 - c bytes more per element than counted (the matmul's casts of them are freed with it, without
        # grad). Measured by the harness: 1,310,720 B for 4 x 512 tokens, 4 heads (2 KV) of 32
        # (tests/test_validate_attention.py)
        rep = heads if m.kv_heads < m.heads else 0
        before = before + f32 * (4 - c) * tok * m.head_dim * (heads + kv + rep)
        before = before + _math_scaled_q(run)
    elif mode == "selective":
        # the core runs checkpointed: its inputs Q, K, V are saved (`terms`), the matmuls' copies are not kept, and
        # under GQA the repetitions of K and V are its locals
        before = sum(x for k, x in terms.items() if k in _UP_TO_CORE and k not in _CORE)
        before = before + (2 * c * tok * m.head_dim * heads if m.kv_heads < m.heads else 0)
        # (q/k norms under AMP: the saved K is fp32, and so is its repetition, `_fp32_core_inputs`)
        before = before + (f32 * (4 - c) * tok * m.head_dim * heads if m.kv_heads < m.heads else 0)
        before = before + _math_scaled_q(run)
        originals = 0
    else:
        before = sum(x for k, x in terms.items() if k in _UP_TO_CORE and k not in _CORE)
        # the saved q and k terms are the matmul's copies where it makes them (`_qk_copied`; under GQA K's repetition
        # is batched as it is): the projections' Q (and MHA's K) are still referenced beside them (fp32 ones with
        # q/k norms under AMP: counted below)
        before = before + _qk_copied(run) * (1 - f32) * c * tok * m.head_dim * (
            heads + (kv if m.kv_heads == m.heads else 0))
        # SDPA's math fallback with autograd saves its scaled Q and its scaled K^T (the q and k terms), both new
        # tensors, while the rotated Q and K's repetition stay referenced as its locals: 2 c tok a/t d. Measured by
        # the harness: fp32 GQA, 3 layers of h 512 at 1024 tokens, the forward 4 MiB (-1.7%) under without them
        before = before + 2 * _math_scaled_q(run)
    before = before + originals
    if run.sp:
        # under SP the attention's input is the all-gather of the norm's sequence-sharded output, which the layer's
        # call still references (the stream's dtype). Measured by the harness: -0.5% to -1.6% of the forward
        # without it, every recompute mode (tests/test_validate_attention.py)
        before = before + where(run.tp > 1, _stream_bytes(run, c) * _shape(run)[2] * m.hidden, 0)
    if mode in ("none", "selective"):
        # under autocast the norm's output is fp32 and the q/k/v projections save their own casts of it
        # (`qkv_input`): the fp32 output stays referenced by the attention's forward beside them
        before = before + _autocast(run) * 4 * tok * m.hidden
    if mode == "none":
        # q/k norms under AMP return fp32 (`qk_norm`), so rotary's q and k are fp32: the score matmul saves its
        # autocast casts (the `q`, `k` terms) while the fp32 tensors stay referenced by the attention's forward,
        # under GQA with K's fp32 repetition (the `originals` counted K in the compute dtype). Measured by the harness
        q32 = 4 * tok * m.head_dim * heads
        k32 = 4 * tok * m.head_dim * kv if m.kv_heads == m.heads else (4 - c) * tok * m.head_dim * kv + q32
        before = before + f32 * (q32 + k32)
    up = 0 if c == 4 else 4 * scores  # softmax(dtype=float32)'s upcast of compute-dtype scores
    copy = 0 if c == 4 else c * scores  # `.to(dtype)` of the fp32 probabilities
    # softcapping (`_attn_softcap`): divide, tanh and multiply each beside the previous tensor (2 c S, as the
    # scaling), and a plain layer's saved tanh output through the rest; a checkpointed one saves none
    capped = c * scores if (_attn_softcap(run) and mode == "none") else 0
    at_mask = 2 * c * scores + c * s_loc * s_loc + capped
    at_softmax = c * scores + up + 4 * scores + capped
    moment = imax(at_mask, at_softmax)
    if run.dropout > 0:
        if mode == "none":
            # with autograd: the scores, the softmax output and its copy are saved or referenced beside dropout's
            # mask and output; fp32 q (`_fp32_core_inputs`): `.to(q.dtype)` keeps the fp32 probabilities (no
            # copy), dropout's output is fp32 and the value matmul's autocast cast of it (c S, the saved
            # `attn_dropout_output`) is made beside it, and the matmul's output (c tok a/t d) beside them all
            dropped = c * scores + 4 * scores + copy + scores + c * scores + capped
            at_value = (c + 4 + 1 + 4 + c) * scores + capped + c * tok * heads * m.head_dim
            dropped = where(f32 == 1, at_value, dropped)
        else:
            # a checkpointed core runs without grad: nothing is saved, so the fp32 softmax output is freed by its
            # `.to(dtype)` copy, and dropout's input is the copy (in fp32 training the output itself): the scores,
            # that input, the bool mask and the output, (3c + 1) S; with fp32 q the fp32 probabilities themselves
            # and an fp32 output, (c + 9) S. Measured: at (3c + 5) S the forward phase was 6-9% over (2 layers)
            dropped = where(f32 == 1, c * scores + 4 * scores + scores + 4 * scores, (3 * c + 1) * scores)
            if _math_path(run):
                # SDPA's math fallback rebinds one variable (`attn = softmax(attn)`, then dropout), so the scores
                # are gone by then: the probabilities, the mask and the output, (2c + 1) S, and its (s, s) causal
                # bias, a local to the end (measured by the harness: an fp32 GQA model with dropout under full
                # recompute was 15 of its 16 heads' s x s over, +14% of the forward)
                dropped = (2 * c + 1) * scores + c * s_loc * s_loc
        moment = imax(moment, dropped)
    # the value matmul: the probabilities it reads (and, with grad, what softmax and dropout saved) beside the
    # scores, its output (c tok a/t d) and, where V is in the projection's (b, s, a, d) layout (MHA; a repetition
    # is contiguous), the copy matmul makes of it. Above the softmax's moment in fp32, where no upcast precedes it
    # (measured by the harness: 1 MiB under for 4 fp32 heads of 32 at 2 x 4 x 512 tokens)
    head_out = c * tok * heads * m.head_dim
    v_copy = _qk_copied(run) * head_out if m.kv_heads == m.heads else 0
    if run.dropout > 0:
        # (dropout saves its mask, not its input: the compute-dtype copy is gone once its output is bound)
        probs_live = dropped - c * scores - copy if mode == "none" else c * scores  # (the tanh output in it)
    else:
        probs_live = (4 * scores + copy + capped) if mode == "none" else (4 if c == 4 else c) * scores
    at_value = c * scores + probs_live + v_copy + head_out
    if mode != "none" and _math_path(run):
        # SDPA's math fallback without grad (a checkpointed core) rebinds `attn` at the softmax and at dropout, and
        # nothing saves what it replaces: at the value matmul only its input (c S), the (s, s) causal bias and the
        # output. Measured by the harness: op-level SAC, fp32 GQA, 3 layers of h 512 at 1 and 2 x 256 tokens, the
        # forward +0.7% / +1.6% with the scores counted there (head_out - c s^2 over)
        at_value = c * scores + c * s_loc * s_loc + head_out
    moment = where(f32 == 1, moment, imax(moment, at_value))
    if mode == "none" and _math_path(run):
        # SDPA's math fallback (fp32 only: c = 4) rebinds one variable (`attn = softmax(attn)`, then dropout): the
        # softmax frees the scores, and its (s, s) causal bias is a local to the core's end. With autograd the
        # softmax output is saved, and with dropout so are its mask and its output (by the value matmul): at the
        # value matmul those, the bias and the matmul's output. Measured by the harness: an fp32 GQA model with
        # dropout 0.1 (3 layers of h 512, 1024 tokens), 28 MiB of scores counted there that were gone
        after = (2 * c + 1 if run.dropout > 0 else c) * scores + c * s_loc * s_loc + head_out
        moment = imax(at_mask, after)
    return _cp_core(run, before + moment)


def _fp32_core_inputs(run: Run) -> Num:
    """Hugging Face's eager attention under torch AMP with HF's eager q/k norms: the norms return fp32
    (`_fp32_norm_output`), so q and k reach the core in fp32, the score matmul casts them (its saved `q`, `k`), and
    `softmax(dtype=float32).to(q.dtype)` leaves the probabilities in fp32. 1 or 0 (elementwise)."""
    if not (run.model.qk_norm and run.training.attention == "eager" and run.profile == "torch"):
        return 0
    return _fp32_norm_output(run)


def _attn_softcap(run: Run) -> bool:
    """Gemma 2's attention softcapping (`ModelSpec.attn_softcap`) as Hugging Face's eager attention runs it
    (modeling_gemma2.py eager_attention_forward: `scores / cap`, `tanh`, `* cap` between the scaling and the mask):
    tanh saves its output, one more compute-dtype score tensor per layer, c S (S = a/t tok s), freed by its
    backward after the softmax's. Only under --attention eager: flash-attn (>= 2.6) caps inside the kernel and
    PyTorch's SDPA (whose math fallback is otherwise an eager core) does not apply it."""
    return run.model.attn_softcap and run.training.attention == "eager"


def _qk_copied(run: Run) -> Num:
    """1 where eager attention's matmuls copy Q, K (`matmul(q, k^T)`) and V (`matmul(probs, v)`), else 0
    (elementwise). They reach them in the projections' (b, s, a, d) memory viewed as (b, a, s, d); rotary keeps that
    layout (`q * cos` follows q's strides and the sum its first operand's: TensorIterator, read with torch 2.13).
    matmul folds the batch and head dimensions into one for bmm, which that layout allows only with one sequence
    per micro-batch: with more it clones the operand (aten.clone under its reshape), and bmm saves the clone. None
    for lit-gpt's fused QKV, made contiguous by the model itself; under GQA the repetitions of K and V are
    contiguous copies (only Q is copied). Measured by the harness (tests/test_validate_attention.py)."""
    if run.training.qkv_impl == "fused":
        return 0
    return where(run.micro_batch > 1, 1, 0)


def _megatron_mlp_backward(run: Run) -> Num:
    """Megatron's MLP backward beyond its saved set: a dense SwiGLU's 2 c tok f/t (GELU c tok f/t) as
    `layer_backward_transient` derives it; for MoE (`_megatron_moe_terms`) the unpermute's, combine all-to-all's
    and un-sort's gradients of the routed rows, two R x h at once (fc2's dgrad, R x f, and the SwiGLU's, R x 2f,
    come after, with fc2's saved input freed: smaller while f < h)."""
    m = run.model
    c, tok, _, _ = _shape(run)
    if m.moe is None:
        return (2 if m.mlp == "swiglu" else 1) * c * tok * cdiv(m.ffn, run.tp)
    routed = m.moe.top_k * tok
    f_t = cdiv(m.moe.expert_ffn, run.tp)
    return imax(2 * c * routed * m.hidden, c * routed * m.hidden + 2 * c * routed * f_t)


def megatron_attention_backward(run: Run) -> Num:
    """The attention core's backward in Megatron (TE fused attention), relative to the layer's saved set: the
    MLP's saved terms and norm are freed by then (its backward runs first); live are the output projection's input
    gradient (H v), the kernel's dQ, dK, dV (H (2 qk + v), K/V per KV head) and cuDNN's fp32 dQ accumulator
    (H qk) with its fp32 softmax sum (H): cudnn-frontend's SDPA backward node, TE backends.py FusedAttnFunc.
    Read in the source, not measured (no GPU here); it is the layer's highest moment only where the MLP's saved set
    is small next to these buffers (MLA's wide heads with a fine-grained MoE)."""
    m = run.model
    if eager_core(run):
        return _NEVER
    c, tok, _, _ = _shape(run)
    heads, kv = m.heads // run.tp, m.kv_heads // run.tp
    qk = m.head_dim
    v = m.mla.v_head_dim if m.mla is not None else m.head_dim
    # the MLP's norm, input and terms, all named mlp_* / moe_*
    mlp_saved = sum(x for k, x in layer_terms(run, "none").items() if k.startswith(("mlp_", "moe_")))
    buffers = c * tok * (heads * v + heads * qk + kv * (qk + v)) + 4 * tok * heads * (qk + 1)
    return buffers - mlp_saved


def _hf_moe_backward_transient(run: Run) -> Num:
    """Beyond the saved set and the incoming gradient, the highest moment of `MixtralSparseMoeBlock`'s backward
    (`_hf_moe_terms`), which walks the experts in reverse, each on R_e = k tok / E tokens (balanced routing), s the
    stream dtype, T = s tok h the block input's size. Three candidates, from autograd's op order (the harness
    measures each to the byte in fp32 and pure bf16; under autocast the third is an upper bound):
    - the first expert's combine: `index_add_`'s source gradient (s R_e h; the saved source is freed as the weights'
      gradient takes its place) and the product for the weights' gradient (s R_e h), then that gradient's sum
      (s R_e) or, under autocast, the expert output's gradient cast to the compute dtype (c R_e h);
    - its MLP: the weights' index gradient (s tok k, kept across experts) and the SwiGLU factors' gradients
      (2 c R_e f) after the down projection's input gradient freed its saved product and the output gradient
      (c R_e h), the saved source and weights gone (GELU: the down projection's input gradient, c R_e f);
    - the index backward `xs[top_x]` of the first and second experts: a zero buffer of the input's shape and the
      `index_put` result (2 T), beside the gradient accumulated so far (T from the second expert on), less what the
      walked experts freed (F per expert), the first expert's input gradient, indices and the weights' gradient
      still live.
    Shared experts' backward runs first (created last): a dense MLP's on tok tokens, whose input gradient (T) then
    waits for the routed experts'."""
    m = run.model
    moe = m.moe
    assert moe is not None
    c, tok, _, _ = _shape(run)
    h, k = m.hidden, moe.top_k
    s = _stream_bytes(run, c)
    f = moe.expert_ffn
    r_e = cdiv(k * tok, moe.experts)
    big = s * tok * h
    freed = sum(_hf_routed_terms(run, r_e).values())
    kept = s * r_e * h + 16 * r_e + s * tok * k
    combine = 2 * s * r_e * h + where(_autocast(run) > 0, c * r_e * h, s * r_e)
    after = s * tok * k - s * r_e * h - s * r_e
    mlp = after + (2 * c * r_e * f - c * r_e * h if m.mlp == "swiglu" else c * r_e * f)
    index = 2 * big - freed + kept + imax(0, big - freed)
    routed = imax(imax(combine, mlp), index)
    if not moe.shared_experts:
        return routed
    fs = moe.shared_experts * f
    shared = (2 if m.mlp == "swiglu" else 1) * c * tok * fs
    return imax(shared, big + routed)




def _layer_moment(mode: str, layer_tr: Num, remat: Num) -> Num:
    """A layer's backward moment beyond what is held: its transient, and a checkpointed layer's re-materialisation
    (full / op: re-run, then the backward starts; selective: the core comes back after the MLP's backward)."""
    if mode in ("full", "op"):
        return layer_tr + imax(remat, 0)
    if mode == "selective":
        return imax(layer_tr, remat)
    return layer_tr


def _replace_layers(detail: dict[str, Num], new: dict[str, Num], old: dict[str, Num], count: Num) -> None:
    """In a stage's per-term detail, `count` layers saving `old` replaced by layers saving `new` (in place)."""
    for key in set(new) | set(old):
        detail[key] = detail.get(key, 0) + (new.get(key, 0) - old.get(key, 0)) * count


def _sp_gathered_grad(run: Run) -> Num:
    """torch SP: the row-parallel down projection's output gradient all-gathered to the whole sequence (the backward
    of RowwiseParallel's Shard(1) output, a DTensor redistribute), c*tok*h, live while the projection makes its
    input and weight gradients. 0 elsewhere. Measured: docs/validation.md (PP x TP + SP rows)."""
    if run.profile != "torch" or not run.sp:
        return 0
    c, tok, _, _ = _shape(run)
    return where(run.tp > 1, c * tok * run.model.hidden, 0)


def _sp_grad_gather(run: Run, terms: dict[str, Num]) -> Num:
    """torch SP: a layer's backward starts with its output gradient's all-gather (the backward of the row-parallel
    output's reduce-scatter), whose raw output and sequence-ordered copy (`_sp_gathered_grad` each) are both live
    beside the incoming gradient, the saved set and, where the output dropout's backward ran first (its mask
    freed), its scaled gradient (`layer_backward_transient`'s `out_grad`, also autocast's cast): before the down
    projection's backward, so before its weight gradient and (without dropout) a checkpointed layer's re-run.
    The highest of the layer's moments where f/t is below h (measured by the harness under FSDP2: -1.0% of a
    toy's backward without it). 0 elsewhere."""
    gathered = _sp_gathered_grad(run)
    c, _, tok_sp, _ = _shape(run)
    dropped = run.dropout > 0
    out_grad = c * tok_sp * run.model.hidden * imax(_autocast(run), 1 if dropped else 0)
    return where(gathered > 0, 2 * gathered + out_grad - terms.get("mlp_residual_dropout_mask", 0), 0)


def _residual_grad_bytes(run: Run) -> Num:
    """The gradient of the residual stream flowing into a layer's backward: its dtype, sharded like it under SP."""
    c, _, tok_sp, _ = _shape(run)
    return _stream_bytes(run, c) * tok_sp * run.model.hidden


def _embedding_grad_in(run: Run) -> Num:
    """The embedding's output gradient, live while its dense weight gradient is made: the residual stream's
    gradient, under torch SP all-gathered to the whole sequence (the backward of its Shard(1) output; the shard is
    freed before the dense gradient is made)."""
    grad_in = _residual_grad_bytes(run)
    if not run.sp:
        return grad_in
    c, tok, _, _ = _shape(run)
    return where(run.tp > 1, _stream_bytes(run, c) * tok * run.model.hidden, grad_in)


def _first_backward_end(run: Run, stage: Num) -> Num:
    """Activations at the end of the first backward beyond what the loop keeps (torch, not FSDP2): a tied head's
    gradient held in autograd's input buffer with the embedding's and their out-of-place sum (`_tied_held_grad`,
    `_tied_sum_bytes`; the sum is `.grad`, a `grads` state), or, before that sum, on the first stage, the
    embedding's output gradient beside its new dense gradient (`_embedding_grad_in`; untied, that gradient becomes
    `.grad` itself; tied, it and the held one are live, `.grad` not yet). Measured by the harness: AMP with full
    recompute, the fp32 stream gradient, -0.6% of the backward (4 layers, seq 2048, SGD) before."""
    held = _tied_held_grad(run, stage)
    total = 2 * held + _tied_sum_bytes(run, stage)
    t = run.training
    if run.profile != "torch" or t.lora_rank is not None or "embeddings" in t.freeze:
        return total
    at_embedding = where((stage == 0) & (fsdp_sharded(run) == 0), held + _embedding_grad_in(run), 0)
    return imax(total, at_embedding)


def _tied_held_grad(run: Run, stage: Num) -> Num:
    """A tied LM head's weight gradient held by autograd until the embedding's arrives (pp = 1, torch, not FSDP2):
    the shared matrix's AccumulateGrad node has two inputs, so the head's gradient waits in its input buffer from
    the head's backward to the end of backward, where the embedding's dense gradient is added out of place (their
    sum goes to `.grad`). `p*V*h/t` bytes, 0 elsewhere. Measured: docs/validation.md rows 132-133."""
    m, t = run.model, run.training
    if run.profile != "torch" or not m.tied_embeddings or not _head_trains(run) or t.quantize_head:
        return 0
    p = DTYPE_BYTES[run.recipe.param_dtype]
    return where((run.pp == 1) & (fsdp_sharded(run) == 0), p * word_embedding_elems(run), 0)


def _tied_sum_bytes(run: Run, stage: Num) -> Num:
    """torch TP (pp = 1, not FSDP2) with a tied head: beyond the non-TP tied sum (`_tied_held_grad`), the bytes the
    embedding's backward adds: its dense gradient is Replicate V x h (`params.replicated_embedding_grad`), its
    vocab shard is cloned to meet the head's Shard(0) gradient (`Shard._replicate_to_shard`), and the two shards
    are added out of place into `.grad`: the clone and the replicated part beyond the shard, `p*(V/t + V - V/t)*h`.
    0 elsewhere. Measured: docs/validation.md (TP with tied embeddings rows)."""
    tied = _tied_held_grad(run, stage)
    m = run.model
    p = DTYPE_BYTES[run.recipe.param_dtype]
    extra = scaled(run, padded_vocab(m, run.profile, 1) * m.hidden) - word_embedding_elems(run)
    return where((tied > 0) & (run.tp > 1), tied + p * extra, 0)


def _fsdp_root_backward(run: Run) -> Num:
    """FSDP2 (pp = 1, torch): activations at the embedding's backward, or _NEVER: its dense gradient (unsharded,
    in the all-gather's parameter dtype) beside the root's unsharded parameters and the head's unsharded gradient
    (buffers), before the root's post-backward reshards it and reduce-scatters. A tied head's gradient waits in
    autograd's input buffer for it (`_tied_held_grad`) and the two are summed out of place: `2*c*V*h/t` bytes,
    else `c*V*h/t` beside the embedding's output gradient. _NEVER where the embedding is frozen (LoRA, `--freeze
    embeddings`): the moment is then below the head's backward. Measured: docs/validation.md rows 136-137."""
    t = run.training
    frozen = t.lora_rank is not None or "embeddings" in t.freeze
    if run.profile != "torch" or frozen:
        return _NEVER
    c = DTYPE_BYTES[run.recipe.compute_dtype]
    m = run.model
    grads = c * word_embedding_elems(run)
    if m.positions == "learned":
        # the position table's dense gradient, already its `.grad`: `x = wte(ids) + wpe(pos)` creates the position
        # lookup last, so autograd runs its backward first (GPT-2 at 2 ranks: 1024 x 768 x 2 B, the whole gap of
        # the end of backward)
        grads = grads + c * scaled(run, m.max_positions * m.hidden)
    # under TP the dense gradient is replicated (params.replicated_embedding_grad), and the post-backward's
    # redistribution to the vocab shard clones the shard beside it before freeing it (row 151)
    extra, shard = replicated_embedding_grad(run, 0, under_fsdp=True)
    grads = grads + c * extra
    # the embedding's output gradient is read while the dense gradient is made (`_embedding_grad_in`, as without
    # FSDP2: `_first_backward_end`) and freed before what comes after it: a tied head's sum, the shard's clone.
    # Measured by the harness: fp32 over 4 ranks, 128k vocabulary, 512 tokens of h 1024, the 2 MiB of the
    # backward's gap (-0.07%; the session-41 fuzz's -0.43% at shorter sequences)
    after = c * ((word_embedding_elems(run) if m.tied_embeddings else 0) + shard)
    return where((run.pp == 1) & (fsdp_sharded(run) == 1), grads + imax(_embedding_grad_in(run), after), _NEVER)


def _first_layer_copy_out(run: Run, stage: Num) -> Num:
    """FSDP2 (ZeRO-2 or 3) with pp = 1: activations at the first layer's copy-out, or _NEVER. The root unit's all-gather
    output is freed only by the next unit's copy-out (buffers `fsdp_root_gather_at_first_layer`), so the first
    layer's gather holds two copies of the root beside its own all-gather output and unsharded parameters; of the
    micro-batch only the embedding's output and what the embedding and the rotary tables saved exist. The moment
    dominates where the root outweighs a layer's working set and the activations (large vocabularies, short
    sequences)."""
    if run.profile != "torch" or run.zero < 2:
        return _NEVER
    c, _, tok_sp, _ = _shape(run)
    early = sum(first_stage_terms(run).values()) + every_stage_terms(run, stage).get("rotary_cos_sin", 0)
    early = early + _stream_bytes(run, c) * tok_sp * run.model.hidden
    return where((run.pp == 1) & (run.shard_degree > 1), early, _NEVER)


def qkv_dgrad_extra(run: Run, plain: dict[str, Num]) -> Num:
    """What a layer's backward holds, when its Q projection makes its input gradient (the last matmul of the layer's
    backward: every weight gradient made), beyond what its end holds (`backward_post_bytes`): the input norm's saved
    input and statistics and the Q/K/V input it saved (freed by the norm's backward, next), Q's gradient, and the two
    stream-sized input gradients, Q's and K's + V's sum (V's, then K's, then Q's). FSDP2 pairs it with the layer
    end's buffers (all of the layer's unsharded gradients): where weights outweigh activations it is the backward's
    peak (measured: 5 stream-sized tensors, tests/test_validate_fsdp_moments.py). Sequential dense layers with
    standard attention at tp = 1, and under the torch profile at any tp, SP too (torch TP: the Q/K/V input is the
    norm's replicated or, under SP, all-gathered output, Q sharded by heads, the input gradients full-sequence until
    their all-reduce or reduce-scatter; tests/test_validate_mlp_backward.py); 0 elsewhere: not measured there."""
    m = run.model
    if m.block != "sequential" or m.mla is not None or m.moe is not None or run.training.lora_rank is not None:
        return 0
    c, tok_all, _, _ = _shape(run)
    dx = c * tok_all * m.hidden
    applies = (run.tp == 1) | (run.profile == "torch")
    # (an eager fp32 RMSNorm, `--norm-impl fp32`, also holds its normalized tensor, saved for the weight's gradient:
    # the backward -0.5% to -1.5% without it, weight-heavy toys under FSDP2 and TP, tests/test_validate_mlp_backward.py)
    held = plain.get("attn_norm", 0) + plain.get("attn_norm_normalized", 0)
    return where(applies, held + plain.get("qkv_input", 0) + plain.get("q", 0) + 2 * dx, 0)


def input_norm_backward(run: Run, plain: dict[str, Num]) -> Num:
    """A layer's input (attention) norm's backward where it is an eager fp32 RMSNorm, beside what the layer's end
    holds (`backward_post_bytes`: the residual stream's gradient waiting in the input's buffer): the norm's saved
    set (its fp32 input, statistics and cast back) and its backward beyond that set (`_eager_norm_backward`, merged:
    the input also feeds the residual add). It follows the Q projection's input gradient, so every weight gradient
    of the layer is made: where weights outweigh tokens, the stage's last layer's is the backward's peak (pure bf16,
    h 2048 at 512 tokens: -1.0% to -1.5% without it; tests/test_validate_mlp_backward.py). Where `qkv_dgrad_extra`
    applies; _NEVER for other norms."""
    m = run.model
    if run.training.norm_impl != "fp32" or m.norm != "rmsnorm" or run.profile != "torch":
        return _NEVER
    return plain.get("attn_norm", 0) + plain.get("attn_norm_normalized", 0) + _eager_norm_backward(run, merged=True)


def _head_backward(run: Run) -> Num | None:
    """The LM head's backward beyond what is held at the loss gradient less what the loss saved (freed by its
    backward): at the input-gradient matmul, the logits' gradient in the compute dtype, the head's new weight
    gradient `dw` (the compute dtype under autocast, else the parameter's) and the input gradient, all tokens
    (`c*V/t*tok + dw + c*tok*h`); under autocast (pp 1) then the cast node's moment, the logits' gradient freed, the
    input gradient cast to the stream's dtype and the parameter-dtype gradient made in place of the freed weight
    copy (buffers' `amp_weight_casts`): the larger of the two. None where not modelled: other profiles, losses
    other than the full one, a frozen or quantized head."""
    t = run.training
    if run.profile != "torch" or t.loss != "full" or not _head_trains(run) or t.quantize_head:
        return None
    c, _, _, tok_in = _shape(run)
    p = DTYPE_BYTES[run.recipe.param_dtype]
    head = scaled(run, head_params(run.model, run.profile, run.tp))
    ac = _autocast(run)
    at_mm = c * _logit_elems(run) + where(ac == 1, c * head, p * head) + c * tok_in * run.model.hidden
    at_cast = where((ac == 1) & (run.pp == 1), _residual_grad_bytes(run) + p * head, _NEVER)
    return imax(at_mm, at_cast) - _loss_freed(run)


def _first_head_backward(run: Run) -> Num:
    """The LM head's backward in a first micro-batch (`_head_backward`; its new weight gradient is `.grad` itself
    without autocast, which the loss moment does not count), gradients not FSDP2's sharded ones; 0 elsewhere. It
    outweighs the loss's own fp32 gradients where the vocabulary shard is narrow next to the hidden size
    (vocab-parallel TP, small vocabularies). Measured op by op by the harness (GQA over tp 4 at 1024 tokens, h 512,
    V 256: -0.5% of the backward without it)."""
    moment = _head_backward(run)
    return 0 if moment is None else where(fsdp_sharded(run) == 0, moment, 0)


def _later_head_backward(run: Run, stage: Num, held: Num) -> tuple[Num, Num]:
    """(activations at the LM head's backward in a later micro-batch, on the last stage, or _NEVER; the head's new
    parameter-dtype weight gradient, 0 where the moment is not modelled). `held` (what the later backward holds at
    its loss gradient, without the loss's transients) plus `_head_backward`: the head's new weight gradient is a
    temporary that AccumulateGrad then adds in place to the `.grad` the earlier micro-batches made (beside all of
    the gradients: `p*V*h/t`); under autocast its cast node runs next (pp = 1: made by this micro-batch's forward).
    Under torch pipelining the cast node waits (`_later_backward_end`). The torch profile with gradients in `.grad`
    (not FSDP2's sharded ones), the full loss, a training, unquantized head. Measured: docs/validation.md rows
    129-131."""
    moment = _head_backward(run)
    if moment is None:
        return _NEVER, 0
    p = DTYPE_BYTES[run.recipe.param_dtype]
    head = scaled(run, head_params(run.model, run.profile, run.tp))
    occurs = (stage == run.pp - 1) & (fsdp_sharded(run) == 0)
    return where(occurs, held + moment, _NEVER), where(occurs, p * head, 0)


def _later_weight_grad(run: Run) -> Num:
    """A later micro-batch's first layer backward, at its down projection (torch profile, gradients accumulated
    in `.grad`, dense MLP, no LoRA): the bytes beyond what is held, or 0. Its weight gradient is a new tensor that
    AccumulateGrad adds to `.grad` in place, made beside the projection's input gradient `c*tok*f/t`: without
    autocast both live at once, `c*tok*f/t + p*h*f/t`. Under a per-micro-batch autocast region the matmul makes it
    in the compute dtype (`c*h*f/t`), and the cast node, made by this forward, turns it into fp32 once the node has
    freed its saved input and weight copy (the sizes of the input gradient and of that gradient): the larger of
    `c*(h + tok)*f/t` and `p*h*f/t`. Under torch pipelining's single region the cast node waits to the
    end of backward instead (`late_dw`, `_later_backward_end`). The residual stream's gradient is live beside it.
    Dominates the layer's MLP moment where the weights outweigh the tokens (wide MLPs, short sequences).
    Measured: docs/validation.md rows 152-154."""
    m, t = run.model, run.training
    if run.profile != "torch" or m.moe is not None or t.lora_rank is not None or _dequantizes(t):
        return 0
    c, tok, _, _ = _shape(run)
    # the new gradient's dtype: the parameter's, or under FSDP2 the unsharded parameter's (the compute dtype)
    fsdp = fsdp_sharded(run) == 1
    g = where(fsdp, c, DTYPE_BYTES[run.recipe.param_dtype])
    hf = first_backward_grad_elems(run, 0)[1]  # the down projection, h x f/t
    f_t = cdiv(m.ffn, run.tp)
    amp = _autocast(run)
    plain = c * tok * f_t + g * hf + _sp_gathered_grad(run)
    cast = imax(c * hf + c * tok * f_t, g * hf)
    tr = where(amp == 1, where(run.pp > 1, 0, cast), plain)
    # FSDP2 reduces each unit's gradients at its post-backward (nothing beside them then), except under torch
    # pipelining, whose backwards accumulate (`buffers.pipelined_fsdp_grad_bytes`): there the new unsharded
    # gradient waits for the unit's post-backward beside the input gradient
    return where(fsdp & (pipelined_fsdp(run) == 0), 0, _residual_grad_bytes(run) + tr)


def _later_backward_end(run: Run, stage: Num, others: Num, sent: Num, first_backward: bool = False,
                        first_chunk: bool = False) -> tuple[Num, Num]:
    """(activations at the end of a later micro-batch's backward under torch pipelining with autocast, or _NEVER;
    the weight gradients' part of them, 0 where the moment does not occur). The autocast region is the whole
    `schedule.step()`, so the step's first forward made every weight's cast node; in a later backward those nodes
    are older than all of that micro-batch's, and autograd (newest ready node first) runs them last: once the
    stage's other nodes are done, every compute-dtype weight gradient is live. The newest cast node then turns its
    gradient into the parameter's dtype for AccumulateGrad's in-place add: the LM head's on the last stage, else
    the last layer's down projection. On the first stage the embedding's node (made by this micro-batch, so newer)
    runs before them: its dense gradient beside the residual stream's. Also live: the other micro-batches in
    flight (`others`), this one's stage output (`fwd_cache`), the sends' references (`sent`) and, on a stage that
    sends one, this backward's input gradient. Without that region (no autocast, or pp = 1) only the first stage's
    new embedding gradient is there beside `.grad` (and a tied head's, `_tied_held_grad`). Interleaved: one model
    chunk's casts (the stage's / vpp; the head's on the last), taken with the most chunks held, an upper bound;
    `first_chunk`: the first model chunk's backward instead (no head; its output the residual stream).
    Measured: docs/validation.md rows 124-128, 134."""
    m = run.model
    if run.profile != "torch":
        return _NEVER, 0
    first, last = stage == 0, stage == run.pp - 1
    c, p = DTYPE_BYTES[run.recipe.compute_dtype], DTYPE_BYTES[run.recipe.param_dtype]
    frozen = run.training.freeze
    head = where(last, head_params(m, run.profile, run.tp), 0) if "head" not in frozen else 0
    down = m.hidden * cdiv(mlp_width(m), run.tp)
    head, down = scaled(run, head), scaled(run, down)
    # under torch TP the embedding's dense gradient is replicated at V x h (row 148)
    word = word_embedding_elems(run) + replicated_embedding_grad(run, stage)[0]
    waiting = c * cast_grad_elems(run, stage)
    if run.schedule == "interleaved":  # (the ending chunk's layers' share of the stage's)
        here = chunk_layers(run, stage, 0 if first_chunk else run.vpp - 1)
        waiting = (waiting - c * head) * here // imax(stage_layers(run, stage), 1) + (0 if first_chunk else c * head)
    newest = p * (down if first_chunk else where(head > 0, head, down))
    grad_in = _residual_grad_bytes(run)
    emb_in = _embedding_grad_in(run)
    emb = newest if "embeddings" in frozen else imax(emb_in + p * word, newest)
    tail = where(first, emb, grad_in + newest)
    if run.schedule == "interleaved" and not first_chunk:
        # the first stage's later chunks are not the model's first: they end sending their input gradient, and
        # only the first chunk's backward makes the embedding's (in a one-round step that one has its own moment,
        # `_late_chunk_moments`; otherwise the later backward held longest may be either)
        tail = where(first & (interleave_rounds(run) > 1), imax(emb, grad_in + newest), grad_in + newest)
    out_one = every_stage_terms(run, stage).get("pipeline_output", 0)
    if first_chunk:  # (on the last rank too its output is the residual stream, sent to the next stage)
        out_one = where(last, _stream_bytes(run, c) * _shape(run)[2] * m.hidden, out_one)
    occurs = (run.pp > 1) & (_autocast(run) == 1)
    # without that autocast region each gradient is added to `.grad` as it is made: at the end of the backward only
    # the embedding's new dense gradient beside the residual stream's, on the first stage (not under FSDP2, whose
    # gradients are unsharded buffers reduce-scattered per unit)
    # (LoRA: the embedding is frozen; the autocast case above never has LoRA, `_autocast`)
    plain = first & (fsdp_sharded(run) == 0) & ("embeddings" not in frozen) & (run.training.lora_rank is None)
    # a tied head's gradient waits for it (`_tied_held_grad`): then their sum, then added to `.grad` in place
    tied = _tied_held_grad(run, stage)
    tp_tied = _tied_sum_bytes(run, stage)  # (under TP: the replicated gradient and the shard's clone)
    plain_tail = where(tied > 0, imax(grad_in + 2 * tied + tp_tied - where(tp_tied > 0, tied, 0), 3 * tied + tp_tied),
                       emb_in + p * word)
    # torch pipelining over FSDP2 (no autocast: MixedPrecisionPolicy): the stage's first unit ends the backward.
    # Under the policy its post-backward moves the unit's compute-dtype gradients into the reduce-dtype
    # accumulator (the accumulator counted as gradients, `buffers.pipelined_fsdp_grad_bytes`): the copy is made
    # beside them, c x the unit's gradient elements (the embedding's on the first stage, a layer's elsewhere).
    # Without the policy `.grad` accumulates in place: the first stage's new dense embedding gradient beside it.
    # The other micro-batches in flight are held. Measured: docs/validation.md (PP x FSDP2 rows).
    piped = (pipelined_fsdp(run) == 1) & ("embeddings" not in frozen) & (run.training.lora_rank is None)
    if run.recipe.compute_copy:
        dense_l, expert_l = layer_params(m, run.tp, run.ep)
        piped_tail = c * where(first, word, scaled(run, dense_l + expert_l))
    else:  # (the first backward's dense gradient becomes `.grad` itself)
        piped_tail = where(first, p * word, 0) if not first_backward else 0
    piped_end = others + out_one + sent + piped_tail
    end = where(occurs, others + out_one + sent + waiting + tail,
                where(plain, others + out_one + sent + plain_tail, where(piped, piped_end, _NEVER)))
    return end, where(occurs, waiting + tail, where(plain, plain_tail, where(piped, piped_tail, 0)))


def _interleaved_sent(run: Run, stage: Num, j: Num, s_h: Num) -> Num:
    """torch's interleaved schedule (`_PipelineScheduleRuntime`) waits for its sends only when the step ends, so
    every output sent forward and input gradient sent backward stays referenced until then: after j backwards
    (0-indexed: at the start of backward j), each with its output (unless the global last stage's) and its input
    gradient (unless the global first stage's) still held. Backwards run the latest chunk first in groups of
    `interleave_group` micro-batches (torch's order; Megatron's groups are pp)."""
    v, gr = run.vpp, interleave_group(run)
    first, last = stage == 0, stage == run.pp - 1
    g2 = j // (gr * v)
    r2 = j - g2 * gr * v
    bw_last_chunk = g2 * gr + imin(r2, gr)
    bw_first_chunk = g2 * gr + imax(imin(r2 - (v - 1) * gr, gr), 0)
    return s_h * ((j - where(last, bw_last_chunk, 0)) + (j - where(first, bw_first_chunk, 0)))


def _interleaved_own(run: Run, stage: Num, s_h: Num, last_saved: Num) -> tuple[Num, Num]:
    """Interleaved: what one unit of the stage's last chunk and of its first chunk holds beyond its layers' saved
    sets (its output, its rotary tables, the first stage's input terms or the last stage's loss terms, less the
    receive buffer its input is under torch pipelining), i.e. what its backward frees or hands to its send."""
    first, last = stage == 0, stage == run.pp - 1
    ev = every_stage_terms(run, stage)
    rest = sum(x for key, x in ev.items() if key != "pipeline_output")
    recv = s_h if run.profile == "torch" else 0
    own_last = rest + ev.get("pipeline_output", 0) + where(last, last_saved, 0) - where(first & (run.vpp == 1), 0,
                                                                                          recv)
    own_first = (rest + where(last, s_h, ev.get("pipeline_output", 0))
                 + where(first, sum(first_stage_terms(run).values()), 0) - where(first, 0, recv))
    return own_last, own_first


def _interleaved_later_end(run: Run, stage: Num, held: Num, unit_bytes: tuple[Num, Num], j_star: Num, s_h: Num,
                           last_saved: Num) -> tuple[Num, Num]:
    """torch's interleaved schedule: the end of the steady state's last backward of the last chunk and of the
    first chunk (`_later_backward_end`; the first chunk's on the first stage makes the embedding's gradient, the
    last chunk's on the last stage waits for the head's cast), each at the latest backward of that chunk up to
    the steady state's last (j_star), so with as many chunks held and the sends of the backwards before it. The
    ending chunk's own terms (its output, rotary tables, the first stage's input terms or the last stage's loss
    terms, less the receive buffer its input is) are not among the others (`held` less the ending chunk's
    layers: `unit_bytes` of the last chunk and of the first). Returns `_later_backward_end`'s pair, the moment the
    higher of the two (_NEVER where neither occurs: one micro-batch, whose later moments do not exist), the
    weight gradients' part the last chunk's. With m >= 2 a round has g >= 2 micro-batches, so the last chunk's
    latest backward is a later one."""
    v, gr = run.vpp, interleave_group(run)
    own_last, own_first = _interleaved_own(run, stage, s_h, last_saved)
    # the latest backward of each kind at or before j_star (chunk of backward j: v-1 - (j // gr) mod v)
    base = (j_star // (gr * v)) * (gr * v)
    pos = j_star - base
    j_last = where(pos < gr, j_star, base + gr - 1)
    j_first = where(pos >= (v - 1) * gr, j_star, base - 1)
    end_last, cast_grads = _later_backward_end(run, stage, held - unit_bytes[0] - own_last,
                                               _interleaved_sent(run, stage, j_last, s_h))
    end_first, _ = _later_backward_end(run, stage, held - unit_bytes[1] - own_first,
                                       _interleaved_sent(run, stage, j_first, s_h), first_chunk=True)
    return imax(where(j_last >= 1, end_last, _NEVER), where(j_first >= 1, end_first, _NEVER)), cast_grads


def _late_chunk_moments(run: Run, stage: Num, units: Num, unit_bytes: Num, one_layer: Num, s_h: Num,
                        dw: tuple[Num, Num, Num], at_layer: tuple[Any, ...]) -> tuple[Num, Num, Num]:
    """torch's ScheduleInterleaved1F1B in one round (`interleave_rounds`, m >= 2): every chunk's backwards follow
    all of the later chunks' (the loss chunk's first), so the later backwards of the last chunk find only its
    gradients made (timeline `_layer_shares`) and every gradient is made only once the first chunk's backwards
    start. The first chunk's second backward (0-indexed j = (v-1)*m + 1) holds min(units, m - 1) of its chunks
    (fewer than a later backward of the last chunk) beside all of the gradients: (its last layer's backward, that
    layer's end, the end of its backward), or _NEVER each where the step is not such a one. Each chunk held counts
    its layers, its output (sent forward, the residual stream on the last rank too), the first stage's input
    terms, the per-chunk rotary tables, less the receive buffer its input is (not on the first stage); the sends
    of the j backwards done stay referenced to the step's end (outputs but the loss chunk's on the last rank,
    input gradients but the first chunk's on the first). Measured: docs/validation.md (interleaved one-round
    rows)."""
    if run.profile != "torch" or run.schedule != "interleaved":
        return _NEVER, _NEVER, _NEVER
    late_dw, later_dw, piped_dw = dw  # (as `stage_activations` names them)
    mode, plain, remat, dense_at, re_run = at_layer
    v, mm = run.vpp, run.grad_accum
    first, last = stage == 0, stage == run.pp - 1
    occurs = (interleave_rounds(run) == 1) & (mm >= 2)
    j = (v - 1) * mm + 1
    n_k = imin(units, mm * v - j)
    ev = every_stage_terms(run, stage)
    u0 = (unit_bytes + where(first, sum(first_stage_terms(run).values()), 0) - where(first, 0, s_h)
          + sum(x for key, x in ev.items() if key != "pipeline_output")
          + where(last, s_h, ev.get("pipeline_output", 0)))
    held_k = n_k * u0
    sent_k = s_h * ((j - where(last, mm, 0)) + (j - where(first, 1, 0)))
    grad_in = _residual_grad_bytes(run)
    # its last layer's output gradient arrives in the receive buffer on every rank (the chunk's output goes to the
    # next stage), as on a stage other than the last (`recv_stream`)
    # (the composite post norm's moment comes before the down projection's waiting gradient, `late_dw`)
    dw_made = late_dw if run.model.post_norms else 0
    at_first = imax(imax(_layer_moment(mode, layer_backward_transient(run, plain, grad_in, dw_made, late_dw, True),
                                       remat),
                         dense_at), re_run)
    at = imax(at_first + piped_dw, _layer_moment(mode, where(later_dw > 0, later_dw - grad_in, 0), remat))
    layer = held_k + at + sent_k + late_dw
    post = held_k - one_layer + grad_in + sent_k + late_dw
    end, _ = _later_backward_end(run, stage, held_k - u0, sent_k, first_chunk=True)
    return where(occurs, layer, _NEVER), where(occurs, post, _NEVER), where(occurs, end, _NEVER)


def stage_activations(run: Run, stage: Num = 0) -> StageActivations:
    """Activations of one rank of pipeline stage `stage` (int or numpy array)."""
    m = run.model
    tr = run.training
    mode = tr.recompute
    pp = run.pp
    units = in_flight(run, stage)
    corr = 0  # interleaved chunks of two sizes: in-flight units' layers beyond `units` x the representative's
    c_first = base = 0
    if run.schedule == "interleaved":
        v = run.vpp
        # the chunk the step's backwards start with stands for a unit (torch's split may give the rank's chunks
        # L // (pp*v) or one more layer, params.chunk_layers; resolve() has pp*vpp | L for the other profiles)
        unit_layers = chunk_layers(run, stage, v - 1)
        c_first = chunk_layers(run, stage, 0)
        base, k_lo, k_hi = chunk_split(run, stage)
        corr = chunk_forwards(run, stage, units, k_lo, k_hi) - where(unit_layers > base, units, 0)
        total_units = run.grad_accum * v
        # Megatron runs forwards in groups of pp micro-batches per model chunk (chunk id of the k-th forward:
        # (k mod pp*v) // pp; schedules.py get_model_chunk_id; torch in groups of `interleave_group`): of the
        # `units` forwards before the first backward, count those of chunk 0 (embedding, on stage 0) and of chunk
        # v-1 (loss, on the last stage)
        gr = interleave_group(run)
        groups = units // (gr * v)
        rem = units - groups * gr * v
        n_first = groups * gr + imin(rem, gr)
        n_last = groups * gr + imax(imin(rem - (v - 1) * gr, gr), 0)
        n_every = units  # rotary tables and pipeline outputs: one per model-chunk forward
    else:
        unit_layers = stage_layers(run, stage)
        total_units = run.grad_accum
        n_first = n_last = n_every = units
    ck = checkpointed_layers(mode, tr, unit_layers)
    plain_layers = unit_layers - ck
    top = plain_on_top(tr, unit_layers, plain_layers)
    last_plain = top >= 1  # the unit's last layer (the first in backward) keeps its saved set
    # (a chunk of one layer more than the smaller's: d_plain more plain and d_ck more checkpointed layers)
    d_ck = checkpointed_layers(mode, tr, base + 1) - checkpointed_layers(mode, tr, base)
    d_plain = 1 - d_ck

    plain = layer_terms(run, "none")
    ck_terms = plain  # a checkpointed layer's saved set (below)
    detail: dict[str, Num] = {}
    plain_bytes = 0
    mult = plain_layers * units + d_plain * corr
    for key, v in plain.items():
        detail[key] = v * mult
        plain_bytes = plain_bytes + v
    unit_bytes = plain_bytes * plain_layers
    kept_bytes = plain_bytes
    remat = 0
    off = tr.offload_activations
    if mode != "none":
        kept = layer_terms(run, mode)
        ck_terms = kept
        kept_bytes = 0
        mult = ck * units + d_ck * corr
        for key, v in kept.items():
            detail[key] = detail.get(key, 0) + v * mult
            kept_bytes = kept_bytes + v
        unit_bytes = unit_bytes + ck * kept_bytes
        # Megatron `--recompute-method block` checkpoints the first ck layers of the unit: backward reaches them
        # after the unit's plain layers of this micro-batch have freed their activations (offloaded: they were
        # never all resident, the window below stands for them); every K-th: after the `top` plain ones above the
        # last checkpointed layer, whose re-run is the highest (each lower one finds more freed)
        rerun_net = _remat_net(mode, plain, _remat_kept(run, kept_bytes)) + _op_sac_kept_beyond_plain(run)
        remat = where(ck > 0, rerun_net - (0 if off else top * plain_bytes), 0)
    one_more = d_plain * plain_bytes + d_ck * kept_bytes  # what one more layer adds to a unit
    first_unit = unit_bytes + (c_first - unit_layers) * one_more  # interleaved: a unit of the rank's first chunk
    # an MoE model's first dense layers (MoESpec.first_dense_layers) on this stage: the stage's first layers, so
    # checkpointed first (block method); their saved sets replace MoE ones. Interleaved: counted as MoE layers.
    dense_at = _NEVER  # a dense layer's backward moment, relative to everything held (its MoE layers freed)
    if first_dense_layers(m) and run.schedule != "interleaved":
        nd = stage_dense_layers(run, stage)
        nd_ck = imin(nd, ck)
        nd_plain = nd - nd_ck
        drun = dense_layer_run(run)
        d_plain = layer_terms(drun, "none")
        d_plain_bytes = sum(d_plain.values())
        _replace_layers(detail, d_plain, plain, nd_plain * units)
        unit_bytes = unit_bytes + nd_plain * (d_plain_bytes - plain_bytes)
        d_remat = 0
        if mode != "none":
            d_kept = layer_terms(drun, mode)
            d_kept_bytes = sum(d_kept.values())
            _replace_layers(detail, d_kept, kept, nd_ck * units)
            unit_bytes = unit_bytes + nd_ck * (d_kept_bytes - kept_bytes)
            # (the first is checkpointed)
            d_remat = where(nd_plain > 0, 0, _remat_net(mode, d_plain, _remat_kept(drun, d_kept_bytes)))
        # backward reaches the dense layers last: this micro-batch's MoE layers have freed their saved sets
        moe_freed = (plain_layers - nd_plain) * plain_bytes + (ck - nd_ck) * kept_bytes
        d_at = _layer_moment(mode, layer_backward_transient(drun, d_plain, dw_counted=_down_dw_counted(drun)),
                             d_remat)
        dense_at = where(nd > 0, d_at - moe_freed, _NEVER)
    # activation offloading (`offload_activations`): every layer's saved set goes to host memory; the GPU keeps
    # the last layer run (`w_last`) and the one before it (`w_prev`: in forward its copy to the host is in flight
    # until the next layer's forward ends; in backward it is reloaded while the current layer's backward runs).
    # The unit's last layers are its plain ones (checkpointing takes the first ck).
    w_last = w_prev = 0
    # AMP with full recompute of some layers: a plain layer's saved weight casts (`_saved_cast_terms`) are not
    # offloaded (autocast's copies of parameters: the saved-tensor hook returns them as they are), so they stay on
    # the device until that layer's backward frees them, beside the resident layers' sets: at the loss gradient
    # every plain layer's but the resident last one's, at the k-th layer's backward those below the pair
    # (`_cast_kept_at`). Measured by the harness: 2 plain of 4 layers, one layer's casts live at the loss gradient,
    # the backward was -1.5% without them (-3.0% with 3 plain), and the host copies high by the casts
    plain_casts = 0
    if off:
        w_last = where(plain_layers >= 1, plain_bytes, kept_bytes)
        w_prev = where(unit_layers >= 2, where(plain_layers >= 2, plain_bytes, kept_bytes), 0)
        plain_casts = sum(_saved_cast_terms(run).values())
    loss_casts = plain_casts * imax(plain_layers - 1, 0)  # (at the loss gradient)

    first = stage == 0
    last = stage == pp - 1
    extra = 0  # per micro-batch (non-interleaved): what one backward frees besides the layers
    layers_held = units * unit_bytes + corr * one_more
    host = layers_held if off else 0  # the layers' saved sets of every unit in flight, in host memory
    held = layers_held - host
    for key, x in first_stage_terms(run).items():
        x = where(first, x, 0)
        detail[key] = x * n_first
        if off and key == "first_layer_frozen_input":
            host = host + x * n_first  # a correction to the first layer's saved set, which is offloaded
            continue
        extra = extra + x
        held = held + x * n_first
    last_saved = 0  # what the loss and LM head of one micro-batch saved (freed before the first layer's backward)
    for key, x in last_stage_terms(run).items():
        x = where(last, x, 0)
        detail[key] = x * n_last
        extra = extra + x
        last_saved = last_saved + x
        held = held + x * n_last
    # one stage-boundary tensor: the residual stream of one micro-batch (its dtype; sequence-sharded with SP)
    s_h = _stream_bytes(run, DTYPE_BYTES[run.recipe.compute_dtype]) * _shape(run)[2] * m.hidden
    for key, x in every_stage_terms(run, stage).items():
        n_x = x * n_every
        if key == "pipeline_output" and run.schedule == "interleaved":
            # only the units of the last chunk of the last rank are on the global last stage (their output: the
            # logits); the rank's other chunks output the residual stream
            n_x = where(last, x * n_last + s_h * (n_every - n_last), n_x)
        detail[key] = n_x
        extra = extra + x
        held = held + n_x

    if run.profile == "torch":
        # the first layer's input of a unit on a later (global) stage is that micro-batch's pipelining receive
        # buffer (buffers.py `pipeline_recv_buffers`), saved by its norm or checkpoint without a new allocation
        n_recv = units - where(first, n_first, 0)
        detail["pipeline_input_in_recv_buffer"] = -s_h * n_recv
        held = held - s_h * n_recv
        extra = extra - where(first, 0, s_h)
    # torch's interleaved schedule (`_PipelineScheduleRuntime`) waits for its sends only when the step ends, so
    # every output sent forward and input gradient sent backward stays referenced until then: at the last
    # steady-state backward, j = F - units backwards are done (F chunk forwards in all), each with its output
    # (unless the global last stage) and its input gradient (unless the global first stage) still held.
    # Backwards run latest chunk first in groups of pp micro-batches (torch's order, as Megatron's).
    sent = 0
    j_star = 0  # (interleaved: the backward, 0-indexed, that ends the steady state)
    if run.profile == "torch" and run.schedule == "interleaved":
        j_star = imax(total_units - units, 1)  # (the second backward where all forwards come first)
        sent = _interleaved_sent(run, stage, j_star, s_h)
    # torch's Schedule1F1B builds a backward's send ops (`bwd_sends`, P2POps that reference the stage's input
    # gradient) and rebinds the list only after the next backward: on every stage but the first, the previous
    # backward's input gradient is live through the next forward and backward (any backend; measured, row 44)
    steady_sent = 0
    if run.profile == "torch" and run.schedule == "1f1b":
        # and its warm-up keeps the send works of its last but one warm-up forward (`send_work`, rebound only in the
        # cool-down; a send's work holds its tensor, gloo's and NCCL's alike): once that micro-batch's backward has
        # run (B_{w-2}, w = in_flight warm-up forwards, inside the 1B1F loop when m >= 2w - 1), its output is live
        # beside the w units in flight at every later backward and steady-state forward (measured, rows 41, 43)
        w = units
        kept_output = where(last, 0, where((w >= 2) & (run.grad_accum >= 2 * w - 1), s_h, 0))
        sent = where(first, 0, s_h) + kept_output
        steady_sent = sent
    if run.profile == "torch" and run.schedule == "gpipe":
        # ScheduleGPipe waits for its backward sends only when the step ends: at the second backward (the later
        # one with the most micro-batches held) the first one's input gradient is still referenced; and it keeps
        # the works of its forward sends (`fwd_sends_to_wait`, never cleared) to the step's end, so the first
        # micro-batch's output, out of the stage's forward cache since its backward, is still referenced too
        sent = where(first, 0, s_h) + where(last, 0, s_h)
    # torch pipelining under one autocast region (the step): the weight casts' nodes come from the step's first
    # forward, so in a later backward they run after everything else, and each weight's compute-dtype gradient
    # waits for its cast until the stage's backward ends; at the first layer's MLP moment, the down projection's
    # (buffers.py `_amp_casts_step_cache`; measured, row 43)
    late_down = where(run.pp > 1, _autocast(run) * DTYPE_BYTES[run.recipe.compute_dtype]
                      * first_backward_grad_elems(run, stage)[1], 0)
    late_dw = late_down
    # ... and every layer that backward has finished leaves all its weights' gradients so (biases aside; dense
    # layers without LoRA: `saved_cast_elems`), which the later layers' moments hold (timeline)
    late_layer_dw = 0
    if m.moe is None and tr.lora_rank is None:
        late_layer_dw = where(run.pp > 1, _autocast(run) * DTYPE_BYTES[run.recipe.compute_dtype]
                              * sum(saved_cast_elems(run)), 0)
    # torch pipelining over FSDP2 with MixedPrecisionPolicy: the last stage's root unit (final norm, LM head) runs
    # its post-backward only when the stage's backward ends, so a later micro-batch's compute-dtype head gradient
    # waits beside the accumulator through every layer's backward (measured: the PP x FSDP2 rows)
    if run.recipe.compute_copy and "head" not in tr.freeze and tr.lora_rank is None:
        head_wait = DTYPE_BYTES[run.recipe.compute_dtype] * first_backward_grad_elems(run, stage)[0]
        late_dw = late_dw + where((pipelined_fsdp(run) == 1) & last, head_wait, 0)
    # one backward frees one unit: a micro-batch (its layers and extras), or one model chunk when interleaved
    # (offloaded, the unit's layers are not resident: the window is counted per moment below)
    unit_gpu = 0 if off else unit_bytes
    freed = unit_gpu if run.schedule == "interleaved" else unit_gpu + extra
    later_units = imin(units, total_units - 1)  # held when a later backward starts (steady state or drain)
    held_later = held - (units - later_units) * freed
    if run.profile == "torch" and run.schedule == "interleaved" and not off:
        # (all forwards first: the first backward, the last chunk's, freed its unit's own terms too, its output
        # now referenced by its send)
        held_later = held_later - (units - later_units) * _interleaved_own(run, stage, s_h, last_saved)[0]
    # (torch interleaved: the last chunk's end and the first's, each without its own terms among the others held)
    # (offloaded: the layers' sets are gone by the end of backward, so a single stage's end is as without offloading;
    # measured, a tied head with grad-accum 2 was -12.7% without it; pipelined offloading not modelled)
    if off and run.schedule == "interleaved":
        later_end, cast_grads = _NEVER, 0
    elif run.profile == "torch" and run.schedule == "interleaved":
        later_end, cast_grads = _interleaved_later_end(run, stage, held_later, (freed, first_unit), j_star, s_h,
                                                       last_saved)
    else:
        later_end, cast_grads = _later_backward_end(run, stage, held_later - freed, sent)
        if off:
            later_end, cast_grads = where(run.pp > 1, _NEVER, later_end), where(run.pp > 1, 0, cast_grads)
    if run.profile == "torch" and run.zero >= 2 and not off:
        # torch pipelining over FSDP2: the first backward's end holds the other micro-batches in flight too, with the
        # same accumulated gradients and unsharded units as a later one's (`_later_backward_end`)
        first_end, _ = _later_backward_end(run, stage, held - freed, 0, first_backward=True)
        later_end = where(pipelined_fsdp(run) == 1, imax(later_end, first_end), later_end)

    loss_fwd, loss_bwd = loss_transients(run)
    # torch pipelining holds the last stage's logits in `fwd_cache` (every_stage_terms `pipeline_output`)
    cached = DTYPE_BYTES[run.recipe.compute_dtype] * _logit_elems(run) if run.profile == "torch" else 0
    loss_fwd = where(last, loss_fwd - where(pp > 1, cached, 0), 0)
    loss_bwd = where(last, loss_bwd, 0)
    ring_fwd, ring_bwd = cp_ring_transients(run)
    # different moments: the loss comes after the last layer's attention in forward and before the first
    # layer's backward; the ring buffers live inside a layer's attention (with its recompute)
    fwd_tr = imax(loss_fwd, ring_fwd)
    # quantized bases (`dequant_bytes`): the dequantized weight of the last layer's down projection at its matmul,
    # of the LM head (--quantize-head) at the logits' matmul and at the head's backward, which comes after the
    # loss gradient: the loss's saved fp32 terms freed, the compute-dtype logits' gradient, the dequantized head
    # and the head input's gradient (the gathered tokens under SP) live
    dq_fwd, dq_bwd, dq_head_fwd, dq_head_bwd = dequant_bytes(run)
    c, tok_all, _, tok_in = _shape(run)
    head_bwd_tr = 0
    if _dequantizes(tr) and tr.quantize_head:
        loss_saved = _loss_freed(run)
        head_dq = dq_head_bwd + _dequant_cast(run, dq_head_bwd, c * tok_in * m.hidden)
        head_grad_in = imax(c * tok_in * m.hidden, dequant_scratch(run, dq_head_bwd))  # (its matmul's output)
        head_bwd_tr = where(last, c * _logit_elems(run) + head_grad_in + head_dq - loss_saved, 0)
    # a recompute or CP ring runs inside the first layer's backward: the loss and LM-head terms are freed by then,
    # and with offloading the previous layer is being reloaded
    core_tr = remat + ring_bwd
    core_pair = 0  # offloading: the pair resident then beyond `w_last`, which `held_bytes` has
    if off:  # the first checkpointed layer (ck-1) and layer ck-2, or the plain pair (a CP ring alone)
        core_pair = where(ck >= 1, kept_bytes + where(ck >= 2, kept_bytes, 0), w_last + w_prev) - w_last
    # lit-gpt's loop keeps its logits list through backward, the optimizer step and the next forward
    kept = where(last, loss_kept_bytes(run), 0)
    # a bitsandbytes-quantized LM head keeps its input on `ctx` (`graph_held_layer_bytes`), which its backward keeps
    bnb_held = _keeps_inputs(tr) and tr.lora_rank is not None and not off
    head_held = where(last, last_stage_terms(run)["output_layer_input"], 0) if bnb_held and tr.quantize_head else 0
    head_freed = last_saved - kept - head_held  # what the loss and LM head hand back before the layers' backward
    core_tr = where(core_tr > 0, core_tr + core_pair - head_freed, 0)
    if tr.loss not in ("full", "fused") and _head_trains(run):
        head_bwd_tr = imax(head_bwd_tr, where(last, _chunked_head_wgrad_transient(run), 0))
    if run.profile == "megatron":
        head_bwd_tr = imax(head_bwd_tr, where(last, _megatron_head_backward(run), 0))
    head_bwd_tr = imax(head_bwd_tr, where(last, _first_head_backward(run), 0))
    bwd_tr = imax(imax(loss_bwd, core_tr), head_bwd_tr)
    # the end of the LM head's backward (under SP its input gradient's reduce-scatter) and the final norm's
    # backward: the loss's and the head's terms freed, the norm's own saved set live
    norm_bwd = imax(_final_norm_backward(run), _head_grad_end(run))
    has_norm_bwd = last & (norm_bwd > 0)
    norm_bwd = norm_bwd - (head_freed - last_stage_terms(run)["final_norm"])
    # (a first micro-batch's: each layer's down weight gradient is counted made at its moment, `_down_wgrad_bytes`)
    dw_first = _down_wgrad_bytes(run, stage)
    dw_counted = _down_dw_counted(run)
    layer_tr = layer_backward_transient(run, plain, dw_made=dw_first, dw_counted=dw_counted)
    # a checkpointed QLoRA layer's re-run forward, at its last dequantization
    re_run = 0
    if mode in ("full", "op") and _dequantizes(tr) and tr.base_dtype == "nf4":
        re_run = where(ck > 0, remat + _recomputed_down_matmul(run), 0)
    if mode == "full" and not off and _down_adapted(run):
        re_run = imax(re_run, where(ck > 0, remat + _recomputed_adapter_end(run), 0))
    if mode in ("full", "op") and not off:  # (a `_NEVER` end stays below every other moment)
        re_run = imax(re_run, where(ck > 0, remat + _recomputed_plain_end(run), 0))
    if mode in ("full", "op") and not off:
        # the re-run forward's eager core, with grad, beside the incoming gradient: a plain layer's forward moment
        # (`eager_attention_forward`), its saved set built up to the core and the core's locals; a fused norm saves
        # the layer's input, which is the checkpoint, already held, and so does an eager fp32 one where the stream is
        # fp32 (`x.float()` returns x)
        core_rerun = eager_attention_forward(run, plain, "none")
        if not (isinstance(core_rerun, int) and core_rerun == _NEVER):
            stream = _stream_bytes(run, DTYPE_BYTES[run.recipe.compute_dtype])
            shared = stream * _shape(run)[2] * m.hidden
            if tr.norm_impl == "fp32" and m.norm == "rmsnorm":
                shared = where(stream < 4, 0, shared)
            # (like the QLoRA moment above, relative to the re-run's whole set, `remat`, which holds the adjustments
            # for plain layers freed before it)
            x = _residual_grad_bytes(run) + core_rerun - shared - rerun_net
            # without dropout SP's output-gradient all-gather precedes the re-run (`_sp_grad_gather`): its output
            # is live through it
            x = x + where(run.dropout > 0, 0, _sp_gathered_grad(run))
            if mode == "op":
                # op-level SAC's re-run takes the q and v projections' outputs from its cache, held since forward
                # (the saved set): the core's V is that output again (a GQA repetition's original), and so is its Q,
                # or under rotary the kept output is freed once the rotated Q is made. Measured by the harness: fp32
                # GQA through SDPA's math fallback under TP 4 + SP, the re-run's score mask the step's peak, -2.4%
                # (512 tokens) and -0.7% (1024) of the backward without these three terms
                x = x - ck_terms.get("sac_q_output", 0) - ck_terms.get("sac_v_output", 0)
            re_run = imax(re_run, where(ck > 0, remat + x, 0))
    # under SP the output gradient's all-gather (`_sp_grad_gather`), before the down projection's backward and,
    # without the output dropout's mask to unpack first, before a checkpointed layer's re-run
    gather = _sp_grad_gather(run, plain)
    gather_remat = remat if mode in ("full", "op") and run.dropout > 0 else 0
    gather_at = where(gather > 0, _residual_grad_bytes(run) + gather + gather_remat, _NEVER)
    # (the re-run precedes the layer's own backward: on a first backward the down projection's (or its adapter's)
    # weight gradient, which the timeline counts made at the layer's moments (`_first_grads`, FSDP2's unsharded one
    # in the layer's buffers), is not made yet)
    down_elems = first_backward_grad_elems(run, stage)[1]
    own_down = lora_first_grad_elems(run)[0] if tr.lora_rank is not None else down_elems
    rerun_dw = 0 if grads_persistent(run) else (first_grad_bytes(run) * own_down
                                                 + fsdp_unsharded_grad_bytes(run, stage, down_elems))
    re_run_first = where(re_run > 0, re_run - rerun_dw, 0)
    at_layer = imax(imax(imax(_layer_moment(mode, layer_tr, remat), dense_at), re_run_first), gather_at - rerun_dw)
    # torch pipelining, every stage but the last: the stage's last layer (the first in backward) gets its output's
    # gradient in the receive buffer (`pipeline_recv_buffers`), not in a new tensor; the later layers' is new
    recv_stream = where(last, 0, _residual_grad_bytes(run)) if run.profile == "torch" and not off else 0
    at_first_layer = imax(imax(imax(_layer_moment(mode, layer_backward_transient(run, plain, recv_stream, dw_first,
                                                                                 dw_counted),
                                                  remat), dense_at), re_run_first),
                          gather_at - recv_stream - rerun_dw)
    # a later micro-batch's (every weight gradient held in `.grad` already; under torch pipelining the down
    # projection's compute-dtype gradient counted waiting, `late_dw`, is not made by the composite norm's moment)
    dw_later = where(m.post_norms, late_down, 0) if not off else 0
    at_later_layer = imax(imax(imax(_layer_moment(mode, layer_backward_transient(run, plain, recv_stream, dw_later,
                                                                                 0 if off else late_down, True),
                                                  remat), dense_at), re_run), gather_at - recv_stream)
    layer_k_extra = at_layer - at_first_layer  # added back for the stage's later layers (timeline `acts_at`)
    # the logits at the LM head's matmul; a model that returns them upcast (`--keep-logits fp32`) makes the fp32
    # copy right there, while the loop still holds the previous micro-batch's (in `base`)
    # softcapping's divide, tanh and multiply each write a new logit-sized tensor while the previous one is live
    # (`_softcap_saved`): one more, then the saved tanh output beside the capped logits (and their fp32 copy)
    logits = where(last, (c + (4 if tr.keep_logits == "fp32" and c < 4 else 0)) * _logit_elems(run)
                   + _softcap_saved(run), 0)
    # the end of the last layer's forward: its down (or proj) output, not saved, beside the residual add's output,
    # which the final norm saves on the last stage (a loss / LM-head term subtracted with `last_saved`); a
    # quantized down projection's matmul just before: its output and dequantized weight, and, when the layer is
    # checkpointed, its input (not saved in the no-grad forward)
    down_out = c * tok_all * m.hidden
    unsaved = where(last_plain, _stream_unsaved(run), 0) + where(
        last_plain | (mode == "selective"), _mlp_forward_extra(run), 0)
    layer_out = imax(down_out, megatron_moe_forward_transient(run)) + where(last, s_h, 0) + unsaved
    if _dequantizes(tr) and tr.base_dtype == "nf4":
        dq_down = dq_fwd + _dequant_cast(run, dq_fwd, down_out)
        at_matmul = _down_matmul_moment(run, mode, where(last_plain, 1, 0), down_out, dequant_scratch(run, dq_fwd))
        layer_out = imax(layer_out, dq_down + at_matmul + unsaved)
    elif tr.lora_rank is not None and not _dequantizes(tr) and m.moe is None:
        # an unquantized frozen base: its down projection's matmul beside the inputs nothing saves (as above)
        layer_out = imax(layer_out, _down_matmul_moment(run, mode, where(last_plain, 1, 0), down_out, 0) + unsaved)
    f_t = cdiv(mlp_width(m), run.tp)
    mlp_saves = last_plain | (mode == "selective")  # the last layer's MLP keeps its saved set
    if _down_adapted(run):
        # the down adapter's sum, base(x) + B(A(x)) (scaled): the base output, the adapter's output and their sum,
        # beside the inputs nothing saves, the adapter's own terms made
        at_add = _down_matmul_moment(run, "none", 1, 3 * down_out, 0) + _down_adapter_saved(run, tok_all, f_t)
        layer_out = imax(layer_out, where(mlp_saves, at_add + unsaved, 0))
    if "up" in _mlp_in_adapted(run):
        # the up (GELU: fc) adapter's sum, 3 c tok f/t, of which the sum is saved (the activation's input, a
        # factor): before the down projection's input (saved unless `_down_input_unsaved`) and adapter terms are made
        down_in = 0 if _down_input_unsaved(run) else c * tok_all * f_t
        at_up = 2 * c * tok_all * f_t - down_in - _down_adapter_saved(run, tok_all, f_t) + (
            c * tok_in * m.hidden if _mlp_input_unsaved(run) else 0)
        layer_out = imax(layer_out, where(mlp_saves, at_up + unsaved, 0))
    if off:
        detail["layers_offloaded_to_host"] = -host
        detail["offload_resident_layers"] = w_last + w_prev
    detail["logits_forward_transient"] = loss_fwd
    detail["logits_grad_transient"] = loss_bwd
    detail["recompute_transient"] = imax(remat, 0)
    if _dequantizes(tr):
        biggest = imax(imax(dq_fwd, dq_bwd), where(last, imax(dq_head_fwd, dq_head_bwd), 0))
        detail["dequantized_weight_transient"] = biggest + _dequant_cast(run, biggest, 0) + dequant_scratch(run,
                                                                                                         biggest)
    detail["cp_ring_kv_transient"] = ring_bwd
    detail["pipeline_sent_transient"] = sent
    detail["later_backward_end_grads_transient"] = where(total_units > 1, cast_grads, 0)
    later_head, head_dw = _later_head_backward(run, stage, held_later + w_last + sent)
    detail["later_head_weight_grad_transient"] = where(total_units > 1, head_dw, 0)
    one_layer = 0 if off else unit_bytes // imax(unit_layers, 1)  # a layer's share of what `held` counts
    # the forward's last layer, not yet run at its own moments: its saved set, plain or a checkpoint, where the unit
    # mixes them (--recompute-layers / --recompute-every), not the average layer's share
    last_layer = one_layer
    if mode in ("full", "op") and not off and (tr.recompute_layers is not None or tr.recompute_every is not None):
        last_layer = where(last_plain, plain_bytes, kept_bytes)
    # the last layer's input (the stream, s_h) is live at the start of its forward whether or not its saved set,
    # just taken off, holds it (a checkpoint is that input; a norm that upcasts first saves a copy); on a later
    # pipeline stage the only layer's input is the receive buffer, counted in `held` (measured: FSDP2 at the last
    # unit's copy-out, one s_h low, -0.2% to -1.2% of the forward, plain or recomputed, offloaded or not)
    x_last = where((unit_layers >= 2) | (pp == 1), s_h, 0)
    # FSDP2 with one layer: its copy-out is the first layer's (the root's all-gather output beside it, not a layer's
    # as `forward_layer`'s buffers have it; measured: +14% on the forward of a 1-layer ZeRO-3 run)
    first_copy_out = _first_layer_copy_out(run, stage)
    # offloading: the k-th layer backward (`StageActivations.offloaded_layer_at`) holds that layer's set and the
    # previous layer's, plain or checkpointed; the first (k = 0) is `backward_layer_bytes`
    # the layers' moments: everything held but what the loss and LM head free
    base = held - head_freed - head_held  # (forward: the head has not run)
    base_bwd = base + head_held
    post = base_bwd - one_layer + w_prev + _residual_grad_bytes(run)  # the end of a layer's backward
    # (offloading: the layer ends' base, without the resident layer, `offloaded_post_at`)
    parts = (base, plain_layers, unit_layers, plain_bytes, kept_bytes, layer_tr, at_layer, post - w_prev, plain_casts)
    layer_bwd = _offloaded_layer_at(parts, 0) if off else base_bwd + at_first_layer
    # a later micro-batch's: also the down projection's new weight gradient beside `.grad` (the pipelining receive
    # buffer holds the incoming gradient on all but the last stage)
    later_dw = _later_weight_grad(run)
    # (torch pipelining over FSDP2 with MixedPrecisionPolicy: that compute-dtype weight gradient stays to the unit's
    # post-backward, which adds it to the reduce-dtype accumulator, so past the MLP's moment; without the policy
    # AccumulateGrad adds it to `.grad` at once)
    piped_dw = where(pipelined_fsdp(run) == 1, c * first_backward_grad_elems(run, 0)[1], 0) if (
        m.moe is None and tr.lora_rank is None and run.recipe.compute_copy) else 0
    later_layer_bwd = layer_bwd if off else base_bwd + imax(
        at_later_layer + piped_dw, _layer_moment(mode, where(later_dw > 0, later_dw - recv_stream, 0), remat))
    attn = attention_backward(run, plain)
    # (offloaded: for an eager core only, whose s x s tensors can outweigh the rest; a fused one's moment is below
    # the layer's, `offloaded_layer_at`)
    modelled = not (isinstance(attn, int) and attn == _NEVER) and (not off or eager_core(run))
    # offloaded: the first backward layer's own set and the next one's, reloaded meanwhile, are resident (`held`
    # has neither). An upper bound: the harness frees each reloaded storage once all its references are unpacked,
    # so part of the pair is gone by the core (eager, 2 layers: +0.7% to +3.7%; 4 layers -0.4% to +0.5%; without
    # the moment, a selectively recomputed eager core read -34%)
    own_pair = 0
    if off:
        own_pair = where(plain_layers >= 1, plain_bytes, kept_bytes) + where(
            plain_layers >= 2, plain_bytes, where(unit_layers >= 2, kept_bytes, 0))
    attn_bwd = (base_bwd + own_pair + _cast_kept_at(plain_layers, plain_casts, 0)
                + _layer_moment(mode, _residual_grad_bytes(run) + attn, remat) if modelled else _NEVER)
    if mode == "selective" and eager_core(run):
        # the core comes back (its saved set, `plain`'s core terms) after the layer's MLP backward, and its backward
        # then runs as a plain layer's would (relative to the plain saved set); a plain last layer
        # (--recompute-layers) keeps its `attn` moment
        rec = attention_backward(run, plain, recomputed=True)
        if not (isinstance(rec, int) and rec == _NEVER):
            # the re-run core's own saved set (plain's core terms) beside the checkpoint's saved Q, K, V: its matmuls'
            # saved copies of Q, K^T and V (MHA, `_qk_copied`) or of Q and K's and V's repetitions (GQA: V's is freed
            # by the value matmul's backward, before the softmax's, `attention_backward`); no output (the re-run stops
            # once the value matmul has packed its inputs)
            gqa = m.kv_heads < m.heads
            # (SDPA's math fallback saves its scaled Q, always a new tensor: `_math_scaled_q`; K and V expanded
            # before the core, lit-gpt's fused QKV or --gqa-impl expand, are repeated by nothing in the re-run)
            q_copied = where(_math_scaled_q(run) > 0, 1, _qk_copied(run))
            copies = q_copied * plain["q"] + _qk_copied(run) * (0 if gqa else plain["k"] + plain["v"]) + (
                plain["k"] + plain["v"] if _core_repeats_kv(run) else 0)
            back = sum(plain.get(k, 0) for k in _CORE) + copies
            attn_bwd = where(plain_layers >= 1, attn_bwd, base_bwd + own_pair + _residual_grad_bytes(run) + back + rec)
    # the MLP norm's backward (an eager fp32 RMSNorm's), with the core's gradients less the output projection's on a
    # first backward
    o_dw = _o_grad_bytes(run, stage)
    norm_b = mlp_norm_backward(run, plain)
    attn_bwd_later = attn_bwd
    if not off and not (isinstance(norm_b, int) and norm_b == _NEVER):
        norm_at = (base_bwd + _cast_kept_at(plain_layers, plain_casts, 0)
                   + _layer_moment(mode, _residual_grad_bytes(run) + norm_b, remat))
        attn_bwd_later = imax(attn_bwd, norm_at)
        attn_bwd = imax(attn_bwd, norm_at - o_dw)
    # eager attention's core in the last layer's forward: a plain layer, unless all of the unit's are checkpointed
    # (offloaded: the previous layer's set, its copy to the host in flight, `w_prev`, beside the core's own)
    core_fwd = eager_attention_forward(run, plain, "none")
    if mode != "none":
        core_fwd = where(last_plain, core_fwd, eager_attention_forward(run, ck_terms, mode))
    if mode in ("full", "op") and not off:
        # (and, before any core, a checkpointed layer's rotary of Q; after a flash core, its output projection)
        rot = checkpointed_rotary_forward(run, ck_terms)
        if mode == "full":
            rot = imax(rot, checkpointed_o_forward(run, ck_terms))
        core_fwd = where(last_plain, core_fwd, imax(core_fwd, rot))
    attn_fwd = base - last_layer + w_prev + core_fwd
    # a fully checkpointed last layer's MLP (its no-grad forward), on top of everything held with its input
    ck_mlp_fwd = ck_down_fwd = _NEVER
    if mode in ("full", "op") and not off:
        at_act, at_down = checkpointed_mlp_forward(run, plain)
        if mode == "op":
            # op-level SAC: the layer's kept outputs are in `held` from its start; those the MLP makes are counted
            # there and in these moments (`_op_sac_pending`)
            act_less, down_less = _op_sac_pending(run)
            at_act, at_down = at_act - act_less, at_down - down_less
        ck_mlp_fwd = where(last_plain, _NEVER, base + w_prev + at_act)
        ck_down_fwd = where(last_plain, _NEVER, base + w_prev + at_down)
    pair = w_last + w_prev
    # bitsandbytes' quantized linears keep their inputs on `ctx` until the graph is dropped
    # (`graph_held_layer_bytes`): a layer's backward frees the rest of its set, and one micro-batch's held inputs
    # are live at the end of backward and, where the loop holds the graph, at the optimizer step and through the
    # next micro-batch's forward and loss. Not with offloading (not modelled).
    graph_held, layer_held = 0, 0
    if bnb_held:
        # a selectively recomputed layer runs its linears outside the checkpoint; a fully checkpointed one keeps none
        unit_held = graph_held_layer_bytes(run, plain) * plain_layers + (
            graph_held_layer_bytes(run, ck_terms) * ck if mode == "selective" else 0)
        layer_held = unit_held // imax(unit_layers, 1)
        # the stage's first layer is not fully checkpointed
        first_kept = (ck == 0) | (mode == "selective") | ((tr.recompute_every or 1) > 1)
        # and the quantized LM head's input, the final norm's output (lit-gpt's head chunks are views of it)
        graph_held = unit_held - where(first & first_kept, _graph_held_first_layer_fix(run, plain), 0) + head_held
    detail["graph_held_inputs_transient"] = graph_held
    mixed = None
    if mode in ("full", "op") and not off and (tr.recompute_layers is not None or tr.recompute_every is not None):
        # plain and checkpointed layers: each layer's moments from the saved sets above it (the average layer of
        # `layer_freed_bytes` is exact only where the unit's layers are alike)
        net = rerun_net
        plain_freed = plain_bytes - (graph_held_layer_bytes(run, plain) if bnb_held else 0)
        ck_layer = imax(layer_tr + net, where(re_run != 0, re_run_first - remat + net, 0))
        resid = _residual_grad_bytes(run)
        attn_plain = resid + attention_backward(run, plain) if modelled else _NEVER
        if not (isinstance(norm_b, int) and norm_b == _NEVER):
            attn_plain = imax(attn_plain, resid + norm_b - o_dw)
        moments = {"layer": (layer_tr, ck_layer), "attention": (attn_plain, attn_plain + net),
                   "post": (resid - plain_freed, resid - kept_bytes)}
        mixed = (base_bwd, unit_layers, ck, tr.recompute_every, plain_freed, kept_bytes, moments)
        post = _mixed_at(mixed, 0, "post")  # the first layer's end: its own set freed, plain or a checkpoint
    late = _late_chunk_moments(run, stage, units, first_unit, first_unit // imax(c_first, 1), s_h,
                               dw=(late_dw, later_dw, piped_dw),
                               at_layer=(mode, plain, remat, dense_at, re_run)) if not off else (_NEVER,) * 3
    return StageActivations(
        held_bytes=held + w_last,
        forward_bytes=held + w_last + fwd_tr,
        backward_first_bytes=held + w_last + loss_casts + bwd_tr,
        backward_later_bytes=held_later + w_last + loss_casts + where(total_units > 1, bwd_tr, 0) + sent,
        backward_final_norm_bytes=where(has_norm_bwd, held + w_last + loss_casts + norm_bwd, _NEVER),
        backward_later_final_norm_bytes=where(has_norm_bwd & (total_units > 1),
                                              held_later + w_last + loss_casts + norm_bwd + sent, _NEVER),
        backward_layer_bytes=layer_bwd,
        backward_attention_bytes=attn_bwd,
        backward_later_layer_bytes=where(total_units > 1, later_layer_bwd - held + held_later + sent + late_dw
                                         + _tied_held_grad(run, stage), 0),
        backward_later_attention_bytes=where(total_units > 1, attn_bwd_later - held + held_later + sent + late_dw
                                             + _tied_held_grad(run, stage), _NEVER),
        backward_end_bytes=_first_backward_end(run, stage),
        backward_root_bytes=_fsdp_root_backward(run),
        backward_later_end_bytes=where(total_units > 1, later_end, _NEVER),
        backward_later_head_bytes=where(total_units > 1, later_head, _NEVER),
        layer_k_extra_bytes=layer_k_extra,
        drain_less_bytes=where(total_units > units, freed, 0),
        forward_head_bytes=base + w_last + where(last, imax(imax(_head_moment(run, logits, dq_head_fwd),
                                                                 _final_norm_moment(run)), _sp_head_gather(run)), 0),
        forward_layer_bytes=where((unit_layers == 1) & (first_copy_out != _NEVER), _NEVER,
                                  base - last_layer + w_prev + x_last),
        forward_first_layer_bytes=first_copy_out,
        forward_attention_bytes=attn_fwd,
        forward_checkpointed_mlp_bytes=ck_mlp_fwd,
        forward_checkpointed_down_bytes=ck_down_fwd,
        forward_layer_end_bytes=base + pair + layer_out,
        backward_post_bytes=post,
        qkv_dgrad_extra_bytes=qkv_dgrad_extra(run, plain),
        input_norm_backward_bytes=input_norm_backward(run, plain),
        rotary_bytes=(every_stage_terms(run, stage).get("rotary_cos_sin", 0)
                      if run.training.recompute in ("none", "selective") else 0),
        backward_later_post_bytes=where(total_units > 1, post - held + held_later + sent + late_dw, _NEVER),
        backward_late_chunk_layer_bytes=late[0],
        backward_late_chunk_post_bytes=late[1],
        backward_late_chunk_end_bytes=late[2],
        loss_kept_bytes=kept,
        late_layer_dw_bytes=late_layer_dw,
        graph_held_bytes=graph_held,
        steady_forward_sent_bytes=steady_sent,
        layers=unit_layers,
        layer_freed_bytes=one_layer - layer_held,
        host_bytes=host - units * plain_layers * plain_casts,  # (the plain layers' weight casts stay)
        offload_parts=parts if off else None,
        mixed_parts=mixed,
        in_flight=units,
        detail=detail,
        # the loss gradient's moment is the "backward" one where the loss, not a recompute or CP ring, is its
        # transient; there the stranded block is reserved on top
        loss_stranded_bytes=where(last, imax(imax(loss_bwd + loss_stranded_bytes(run), core_tr) - bwd_tr, 0), 0),
    )
