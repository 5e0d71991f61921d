"""Exact parameter counts: per layer, per pipeline stage, per tensor-parallel rank. The one place they live.

Layer definition (Vaswani et al. 2017; GPT-2 / Llama / Mistral / Qwen2 / Mixtral modelling files in Hugging Face
transformers): attention with q (h x a*d), k and v (h x g*d each, GQA), o (a*d x h); MLP gate/up/down (SwiGLU)
or fc/proj (GELU); two norms per layer (RMSNorm: weight; LayerNorm: weight and bias); a final norm; embedding
V x h (+ learned positions); LM head V x h unless tied. Checked against published totals in tests/test_params.py.

Tensor parallelism (Shoeybi et al. 2019, Megatron-LM sec. 3): q/k/v and gate/up are column-parallel (weights and
biases split by t), o and down are row-parallel (weights split, biases replicated), norms and learned position
embeddings are replicated, the word embedding and LM head are vocab-parallel (split by t along V). Megatron pads
the vocabulary to a multiple of 128*t (megatron/training/tokenizer: `_vocab_size_with_padding`,
`--make-vocab-size-divisible-by 128`); torch and DeepSpeed do not pad (an uneven split rounds up).

Pipeline parallelism: stage i holds L//pp layers plus one more when i < L % pp (the remainder goes to the first
stages); the first stage holds the embedding, the last the final norm and the LM head; with tied embeddings and
pp > 1 the last stage keeps its own copy of the embedding (Megatron `shared_embedding`; torch pipelining splits
the module so the LM head owns a separate weight).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from memcalc.specs import DTYPE_BYTES, ModelSpec, Run, lora_projections
from memcalc.xp import cdiv, imax, imin, muldiv, per_value, where

Num = Any


def norm_params(m: ModelSpec) -> int:
    return m.hidden * (2 if m.norm == "layernorm" else 1)


def layer_norms(m: ModelSpec) -> int:
    """Norms per layer: two, or one where attention and MLP read the same norm (`block` parallel-shared-norm:
    GPT-J, phi-1.5, Falcon-7B; Hugging Face modeling_gptj.py / modeling_phi.py build one LayerNorm per layer), or
    four with `post_norms` (Gemma 2/3: a norm on the attention output and one on the MLP output as well)."""
    if m.block == "parallel-shared-norm":
        return 1
    return 4 if m.post_norms else 2


def qk_norm_params(m: ModelSpec) -> int:
    """The q and k norms' weights (`ModelSpec.qk_norm`: one norm of head_dim each, shared by the heads)."""
    return 2 * m.head_dim * (2 if m.norm == "layernorm" else 1) if m.qk_norm else 0


def attention_params(m: ModelSpec, tp: Num = 1) -> Num:
    """Q, K, V, O weights (and biases) on one TP rank, and the q/k norms (replicated)."""
    if m.mla is not None:
        return _mla_params(m, tp)
    h, a, g, d = m.hidden, m.heads, m.kv_heads, m.head_dim
    col = h * a * d + 2 * h * g * d  # q, k, v: split by tp
    if m.qkv_bias:
        col += a * d + 2 * g * d
    row = a * d * h  # o: split by tp
    rep = h if m.linear_bias else 0  # o bias: replicated
    return (col + row) // tp + rep + qk_norm_params(m)


def _mla_params(m: ModelSpec, tp: Num = 1) -> Num:
    """Multi-head latent attention on one TP rank (shapes: HF modeling_deepseek_v3.py DeepseekV3Attention, Megatron
    multi_latent_attention.py): q_a (h x q_lora) + its RMSNorm + q_b (q_lora x a*(nope+rope)), or one q
    (h x a*(nope+rope)) without a query latent; kv_a (h x (kv_lora + rope)) + its RMSNorm + kv_b
    (kv_lora x a*(nope+v)); o (a*v x h). The down projections and the latent norms are replicated across TP
    (Megatron builds them `duplicated`), the up projections split by heads (column-parallel), o row-parallel."""
    a, h, x = m.heads, m.hidden, m.mla
    assert x is not None
    qk = x.qk_nope_dim + x.qk_rope_dim
    rep = h * (x.kv_lora_rank + x.qk_rope_dim) + x.kv_lora_rank
    split = x.kv_lora_rank * a * (x.qk_nope_dim + x.v_head_dim) + a * x.v_head_dim * h
    if x.q_lora_rank:
        rep += h * x.q_lora_rank + x.q_lora_rank
        split += x.q_lora_rank * a * qk
    else:
        split += h * a * qk
    return split // tp + rep


def dense_mlp_params(m: ModelSpec, ffn: int, tp: Num = 1) -> Num:
    h = m.hidden
    n_in = 2 if m.mlp == "swiglu" else 1
    split = (n_in + 1) * h * ffn  # gate/up (or fc) columns and down rows split by tp
    if m.linear_bias:
        split += n_in * ffn
    rep = h if m.linear_bias else 0
    return split // tp + rep


def moe_params(m: ModelSpec, tp: Num = 1, ep: Num = 1) -> tuple[Num, Num]:
    """(dense part, expert part) of one MoE layer's MLP on one rank: router replicated, routed experts split
    over ep (and each expert's FFN over tp), shared experts split over tp only."""
    assert m.moe is not None
    router = m.hidden * m.moe.experts
    expert = dense_mlp_params(m, m.moe.expert_ffn, tp)
    shared = m.moe.shared_experts * dense_mlp_params(m, m.moe.expert_ffn, tp)
    return router + shared, (m.moe.experts // ep) * expert


def layer_params(m: ModelSpec, tp: Num = 1, ep: Num = 1) -> tuple[Num, Num]:
    """(dense, expert) parameters of one transformer layer on one rank."""
    dense = attention_params(m, tp) + layer_norms(m) * norm_params(m)
    if m.moe is None:
        return dense + dense_mlp_params(m, m.ffn, tp), 0
    d, e = moe_params(m, tp, ep)
    return dense + d, e


def dense_variant(m: ModelSpec) -> ModelSpec:
    """The model as one of its first dense layers (MoESpec.first_dense_layers) is built: the same layer with a
    dense MLP of width m.ffn instead of the experts."""
    return m.model_copy(update={"moe": None})


def dense_layer_run(run: Run) -> Run:
    """The run as one of its MoE model's first dense layers sees it (`dense_variant`)."""
    return dataclasses.replace(run, model=dense_variant(run.model))


def dense_layer_params(m: ModelSpec, tp: Num = 1) -> Num:
    """Parameters of one of an MoE model's first dense layers on one TP rank."""
    return layer_params(dense_variant(m), tp)[0]


def first_dense_layers(m: ModelSpec) -> int:
    return m.moe.first_dense_layers if m.moe is not None else 0


def stage_dense_layers(run: Run, stage: Num) -> Num:
    """How many of the stage's layers (of one rank, all its model chunks) are the model's first dense layers of an
    MoE model (DeepSeek's `first_k_dense_replace`); 0 otherwise. Interleaved: stage s holds chunks s, s+pp, ... of
    L/(pp*vpp) layers each, so the K dense layers fill chunks 0..K//c-1 and part of chunk K//c."""
    m = run.model
    k = first_dense_layers(m)
    if not k:
        return 0 * stage
    if run.schedule == "interleaved":
        c = m.layers // (run.pp * run.vpp)
        q, r = k // c, k % c
        full = imax((q - stage + run.pp - 1) // run.pp, 0)  # chunks g < q with g = stage (mod pp)
        return full * c + where(q % run.pp == stage, r, 0)
    first = stage_first_layer(run, stage)
    return imax(imin(k - first, stage_layers(run, stage)), 0)


def stage_layer_params(run: Run, stage: Num) -> tuple[Num, Num]:
    """(dense, expert) parameters of the stage's transformer layers on one rank, after TP and EP sharding and
    before `--params` scaling: its MoE layers and, on the stages that hold them, the model's first dense layers."""
    m = run.model
    dense_l, expert_l = layer_params(m, run.tp, run.ep)
    n = stage_layers(run, stage)
    nd = stage_dense_layers(run, stage)
    if not first_dense_layers(m):
        return n * dense_l, n * expert_l
    return (n - nd) * dense_l + nd * dense_layer_params(m, run.tp), (n - nd) * expert_l


def padded_vocab(m: ModelSpec, profile: str, tp: Num = 1) -> Num:
    if profile == "megatron":
        mult = 128 * tp
        return cdiv(m.vocab, mult) * mult
    return m.vocab


def embedding_params(m: ModelSpec, profile: str = "torch", tp: Num = 1) -> Num:
    """Word embedding rows on one TP rank (vocab-parallel), plus replicated learned positions."""
    rows = cdiv(padded_vocab(m, profile, tp), tp)
    pos = m.max_positions * m.hidden if m.positions == "learned" else 0
    return rows * m.hidden + pos


def head_params(m: ModelSpec, profile: str = "torch", tp: Num = 1) -> Num:
    """LM head weight (and bias, `head_bias`: phi-1.5) on one TP rank (vocab-parallel: both split along V)."""
    rows = cdiv(padded_vocab(m, profile, tp), tp)
    return rows * (m.hidden + (1 if m.head_bias else 0))


def total_params(m: ModelSpec) -> int:
    """The model's exact parameter count (no padding, no sharding). `--params` overrides it."""
    if m.params_override is not None:
        return m.params_override
    return shape_params(m)


@functools.lru_cache(maxsize=256)
def shape_params(m: ModelSpec) -> int:
    """Exact count of the architecture itself, ignoring `params_override` (cached: ModelSpec is frozen)."""
    dense, expert = layer_params(m)
    emb = embedding_params(m)
    head = 0 if m.tied_embeddings else head_params(m)
    k = first_dense_layers(m)
    return (m.layers - k) * (dense + expert) + k * dense_layer_params(m) + emb + norm_params(m) + head


def stage_layers(run: Run, stage: Num, n_stages: Num | None = None) -> Num:
    """Layers on pipeline stage `stage` (0-based), as the profile's framework splits L over pp stages (or
    `n_stages`: the harness's pp*vpp model chunks) when they do not divide it: `stage_first_layer(stage + 1) -
    stage_first_layer(stage)`, which is L // pp plus one on stages 1..L % pp (torch) or 0..L % pp - 1 (others).
    Interleaved under the torch profile: the rank's model chunks together (`chunk_layers`), which torchtitan
    splits over the pp*vpp virtual stages the same way (126 layers over 16: 7, 8 x 14, 7)."""
    if n_stages is None and run.schedule == "interleaved" and run.profile == "torch":
        base, k_lo, k_hi = chunk_split(run, stage)
        return run.vpp * base + imax(k_hi - k_lo + 1, 0)
    n = run.pp if n_stages is None else n_stages
    base, extra = run.model.layers // n, run.model.layers % n
    if run.profile == "torch":
        return base + where((stage >= 1) & (stage <= extra), 1, 0)
    return base + where(stage < extra, 1, 0)


def checkpointed_layers(mode: str, tr: Any, layers: Num) -> Num:
    """Checkpointed layers of a unit of `layers`: `--recompute-layers` K per stage (per model chunk when
    interleaved), the first K (Megatron --recompute-method block); K None = all; none without recompute.
    `--recompute-every K`: every K-th (torchtitan's layer-level selective AC, `_apply_layer_sac`, counts the
    rank's blocks from 1 and wraps those divisible by K; resolve() keeps interleaved chunks whole multiples of K)."""
    if mode == "none":
        return 0 * layers
    if tr.recompute_every is not None:
        return layers // tr.recompute_every
    k = tr.recompute_layers
    return layers if k is None else imin(k, layers)


def plain_on_top(tr: Any, layers: Num, plain_layers: Num) -> Num:
    """The unit's plain layers after its last checkpointed one: backward frees their saved sets before that layer
    re-runs. All of them under the block method; `layers mod K` under --recompute-every K."""
    return plain_layers if tr.recompute_every is None else layers % tr.recompute_every


def saved_cast_elems(run: Run) -> tuple[Num, Num, Num]:
    """(q/k/v, output projection and gate/up (or fc), down) weight elements of one dense layer on one rank that
    autocast casts and whose matmuls save the cast for their backward (a bias's cast is not saved: addmm keeps its
    two matrices; activations._saved_cast_terms)."""
    m = run.model
    att = attention_matrix_shapes(m, run.tp)
    qkv = sum(r * c * n for r, c, n in att[:-1])
    (o_r, o_c, _), (up_r, up_c, up_n), (dn_r, dn_c, _) = att[-1], *mlp_matrix_shapes(m, m.ffn, run.tp)
    return scaled(run, qkv), scaled(run, o_r * o_c + up_r * up_c * up_n), scaled(run, dn_r * dn_c)


def interleave_group(run: Run) -> Num:
    """Micro-batches per model chunk in a row of the interleaved schedule: Megatron runs them in groups of pp
    (schedules.py `get_model_chunk_id`); torch's ScheduleInterleaved1F1B in rounds of m // max(1, m // pp)
    (`microbatches_per_round`; m a multiple of the rounds, any m >= 1), which is pp where pp divides m."""
    if run.profile == "torch":
        return run.grad_accum // imax(run.grad_accum // run.pp, 1)
    return run.pp


def interleave_rounds(run: Run) -> Num:
    """Rounds of the interleaved schedule: m // `interleave_group`. In one round every model chunk's backwards
    follow all of the later chunks' (the loss chunk's first), so a later backward of the last chunk finds only
    that chunk's gradients made."""
    return imax(run.grad_accum // interleave_group(run), 1)


def chunk_split(run: Run, stage: Num) -> tuple[Num, Num, Num]:
    """Interleaved, torch's split of L over pp*vpp virtual stages (`stage_layers`): (L // (pp*vpp), and the range
    k_lo..k_hi of this rank's chunks k (global stage stage + k*pp) that hold one layer more: those on global stages
    1..L % (pp*vpp); empty where k_hi < k_lo, always when pp*vpp divides L)."""
    n = run.pp * run.vpp
    base, extra = run.model.layers // n, run.model.layers % n
    k_lo = where(stage >= 1, 0, 1)
    k_hi = imin((extra - stage) // run.pp, run.vpp - 1)
    return base, k_lo + 0 * stage, where(extra - stage >= 0, k_hi, -1)


def chunk_layers(run: Run, stage: Num, k: Num) -> Num:
    """Interleaved: layers of this rank's k-th model chunk (global stage stage + k*pp of pp*vpp)."""
    base, k_lo, k_hi = chunk_split(run, stage)
    return base + where((k >= k_lo) & (k <= k_hi), 1, 0)


def chunk_forwards(run: Run, stage: Num, units: Num, k_lo: Num, k_hi: Num) -> Num:
    """Interleaved: of the first `units` chunk forwards, those of chunks k_lo..k_hi (the k-th forward runs chunk
    (k // g) mod vpp, g = `interleave_group`: groups of g micro-batches per chunk)."""
    v = run.vpp
    g = interleave_group(run)
    groups = units // (g * v)
    rem = units - groups * g * v
    q, r = rem // g, rem % g  # of this round: chunks < q ran g forwards, chunk q ran r
    n_k = imax(k_hi - k_lo + 1, 0)
    full = imax(imin(k_hi, q - 1) - k_lo + 1, 0)
    return groups * g * n_k + g * full + where((q >= k_lo) & (q <= k_hi), r, 0)


def stage_params(run: Run, stage: Num) -> tuple[Num, Num]:
    """(dense, expert) parameters held by one rank of pipeline stage `stage` (after TP and EP sharding),
    before any ZeRO sharding. With `--params N`, scaled so that the whole model has exactly N."""
    m = run.model
    tp, pp = run.tp, run.pp
    dense_layers, expert = stage_layer_params(run, stage)
    first = stage == 0
    last = stage == pp - 1
    emb = embedding_params(m, run.profile, tp)
    head = head_params(m, run.profile, tp)
    # tied embeddings share one matrix only when first and last stage are the same rank
    head_here = head if not m.tied_embeddings else where(first, 0, head)
    dense = dense_layers + where(first, emb, 0) + where(last, norm_params(m) + head_here, 0)
    if m.params_override is not None:
        scale_num, scale_den = m.params_override, shape_params(m)
        return muldiv(dense, scale_num, scale_den), muldiv(expert, scale_num, scale_den)
    return dense, expert


def largest_unit_params(run: Run) -> Num:
    """Unsharded parameters of the largest FSDP / ZeRO-3 unit on one TP rank: one transformer layer or the
    embedding (DeepSpeed's estimator calls it the largest layer; often the embedding)."""
    m = run.model
    dense_l, expert_l = layer_params(m, run.tp, run.ep)
    emb = embedding_params(m, run.profile, run.tp)
    layer = dense_l + expert_l
    if first_dense_layers(m):
        layer = imax(layer, dense_layer_params(m, run.tp))
    biggest = where(emb > layer, emb, layer)
    if m.params_override is not None:
        return muldiv(biggest, m.params_override, shape_params(m))
    return biggest


def attention_matrix_shapes(m: ModelSpec, tp: Num = 1) -> list[tuple[Num, Num, int]]:
    """(rows, cols, count per layer) of the attention's weight matrices on one TP rank: q; k and v; o, or MLA's
    q_a, q_b (or q), kv_a, kv_b, o (`_mla_params`; the down projections replicated)."""
    h, a, g, d = m.hidden, m.heads, m.kv_heads, m.head_dim
    x = m.mla
    if x is None:
        return [(a * d // tp, h, 1), (g * d // tp, h, 2), (h, a * d // tp, 1)]
    qk = x.qk_nope_dim + x.qk_rope_dim
    q = [(x.q_lora_rank, h, 1), (a * qk // tp, x.q_lora_rank, 1)] if x.q_lora_rank else [(a * qk // tp, h, 1)]
    return q + [(x.kv_lora_rank + x.qk_rope_dim, h, 1), (a * (x.qk_nope_dim + x.v_head_dim) // tp, x.kv_lora_rank, 1),
                (h, a * x.v_head_dim // tp, 1)]


def mlp_matrix_shapes(m: ModelSpec, ffn: int, tp: Num = 1) -> list[tuple[Num, Num, int]]:
    """(rows, cols, count) of one MLP's matrices (a dense MLP or one expert) on one TP rank: gate/up (or fc);
    down."""
    n_in = 2 if m.mlp == "swiglu" else 1
    return [(ffn // tp, m.hidden, n_in), (m.hidden, ffn // tp, 1)]


def mlp_width(m: ModelSpec) -> int:
    """The width of a layer's MLP: the dense MLP's, or for MoE one expert's."""
    return m.ffn if m.moe is None else m.moe.expert_ffn


# --- fine-tuning: LoRA adapters, frozen and quantized base weights (issue 7) ---------------------------------


def lora_adapters(m: ModelSpec, targets: str, rank: int, tp: Num = 1) -> list[tuple[str, Num, Num]]:
    """(projection, elements of A, elements of B) of one layer's LoRA adapters on one TP rank, in layer order
    (Hu et al. 2021, sec. 4: W + B A with A (r x in), B (out x r)). With TP the adapter follows its base matrix:
    for column-parallel q/k/v/gate/up, A is replicated and B split by t; for row-parallel o/down, A is split by t
    and B replicated (NeMo / Megatron-core LoRA)."""
    h, a, g, d = m.hidden, m.heads, m.kv_heads, m.head_dim
    # (in features, out features, row-parallel) of each projection
    shapes = {"q": (h, a * d, False), "k": (h, g * d, False), "v": (h, g * d, False), "o": (a * d, h, True),
              "gate": (h, m.ffn, False), "up": (h, m.ffn, False), "down": (m.ffn, h, True)}
    out: list[tuple[str, Num, Num]] = []
    for p in lora_projections(targets):
        if p == "gate" and m.mlp != "swiglu":
            continue  # a GELU MLP has fc ("up") and proj ("down") only
        n_in, n_out, row = shapes[p]
        out.append((p, n_in * rank // tp, rank * n_out) if row else (p, n_in * rank, rank * n_out // tp))
    return out


def lora_layer_params(m: ModelSpec, targets: str, rank: int, tp: Num = 1, only: tuple[str, ...] | None = None) -> Num:
    """Trainable LoRA parameters of one layer on one TP rank (`lora_adapters`). `only`: count the adapters of these
    projections alone."""
    total = 0
    for p, a_elems, b_elems in lora_adapters(m, targets, rank, tp):
        if only is None or p in only:
            total = total + a_elems + b_elems
    return total


def layer_matrix_stats(m: ModelSpec, tp: Num = 1, ep: Num = 1) -> tuple[Num, Num, int]:
    """(weight elements, weight rows, number of matrices) of one layer's linear weights on one rank: what a
    weight-only quantizer (bitsandbytes Linear4bit / Linear8bitLt) replaces; norms and biases stay unquantized."""
    n_mlps = 1 if m.moe is None else m.moe.experts // ep + m.moe.shared_experts
    elems, rows, count_total = 0, 0, 0
    for shapes, mult in ((attention_matrix_shapes(m, tp), 1), (mlp_matrix_shapes(m, mlp_width(m), tp), n_mlps)):
        for r, c, count in shapes:
            k = count * mult
            elems, rows, count_total = elems + k * r * c, rows + k * r, count_total + k
    return elems, rows, count_total


def stage_first_layer(run: Run, stage: Num, n_stages: Num | None = None) -> Num:
    """Index of the first layer held by pipeline stage `stage`, with `base = L // pp` layers a stage and the
    `extra = L % pp` left over placed as the profile's framework does:
    - torch: torchtitan's `generate_split_points` (torchtitan/parallelisms/pipelining_utils.py, Dec 2024): the first
      stage gets `base`, the middle stages `base + 1` while extras remain, the last stage the rest (126 layers over
      8 stages: 15, 16 x 6, 15; the embedding and the head are not counted);
    - megatron, deepspeed: the extras on the first stages (Megatron needs pp | L unless told otherwise)."""
    n = run.pp if n_stages is None else n_stages
    base, extra = run.model.layers // n, run.model.layers % n
    if run.profile == "torch":
        return stage * base + where(stage >= 1, imin(stage - 1, extra), 0)
    return stage * base + where(stage < extra, stage, extra)


@dataclasses.dataclass(frozen=True, slots=True)
class ParamSplit:
    trainable_dense: Num
    trainable_expert: Num
    frozen_linear: Num  # frozen linear weights of the layers (quantizable with --base-dtype nf4|int8|fp8)
    frozen_linear_rows: Num  # their output rows (int8 row-wise scales)
    frozen_linear_matrices: Num  # their count (fp8 per-tensor scales)
    frozen_other: Num  # frozen embeddings, head, norms, biases

    @property
    def trainable(self) -> Num:
        return self.trainable_dense + self.trainable_expert

    @property
    def frozen(self) -> Num:
        return self.frozen_linear + self.frozen_other


def stage_param_split(run: Run, stage: Num) -> ParamSplit:
    """Trainable and frozen parameters of one rank of `stage`. Without LoRA or --freeze everything trains."""
    m, t = run.model, run.training
    dense, expert = stage_params(run, stage)
    if t.lora_rank is None and not t.freeze:
        return ParamSplit(dense, expert, 0, 0, 0, 0)
    from memcalc.specs import freeze_layers

    n_layers = stage_layers(run, stage)
    scale_num, scale_den = (m.params_override, shape_params(m)) if m.params_override is not None else (1, 1)
    dense_l, expert_l = layer_params(m, run.tp, run.ep)
    lin, rows, mats = layer_matrix_stats(m, run.tp, run.ep)
    if t.lora_rank is not None:
        adapters = n_layers * lora_layer_params(m, t.lora_targets, t.lora_rank, run.tp)
        frozen_lin = muldiv(n_layers * lin, scale_num, scale_den)
        rows, mats = n_layers * rows, n_layers * mats
        if t.quantize_head:  # --quantize-head: the last stage's LM head is one more quantized matrix
            last = stage == run.pp - 1
            head_rows = cdiv(padded_vocab(m, run.profile, run.tp), run.tp)
            head_w = head_rows * m.hidden  # the weight only: a bias stays unquantized
            frozen_lin = frozen_lin + where(last, muldiv(head_w, scale_num, scale_den), 0)
            rows = rows + where(last, head_rows, 0)
            mats = mats + where(last, 1, 0)
        return ParamSplit(adapters, 0 * dense, frozen_lin, rows, mats, dense + expert - frozen_lin)
    k = freeze_layers(t)
    start = stage_first_layer(run, stage)
    frozen_here = imin(imax(k - start, 0), n_layers)
    frozen = frozen_here * (dense_l + expert_l)
    if first_dense_layers(m):  # the frozen layers that are the model's first dense ones replace MoE layers
        frozen_dense = imin(imax(imin(k, first_dense_layers(m)) - start, 0), n_layers)
        frozen = frozen + frozen_dense * (dense_layer_params(m, run.tp) - dense_l - expert_l)
        frozen_here = frozen_here - frozen_dense  # MoE layers frozen (their experts)
    if "embeddings" in t.freeze:
        frozen = frozen + where(stage == 0, embedding_params(m, run.profile, run.tp), 0)
    if "head" in t.freeze and not m.tied_embeddings:
        frozen = frozen + where(stage == run.pp - 1, head_params(m, run.profile, run.tp), 0)
    frozen = muldiv(frozen, scale_num, scale_den)
    frozen_expert = muldiv(frozen_here * expert_l, scale_num, scale_den)
    return ParamSplit(dense - (frozen - frozen_expert), expert - frozen_expert, 0 * dense, 0 * dense, 0 * dense,
                      frozen)


def early_chunks_trainable(run: Run, stage: Num, chunks: int | None = None) -> Num:
    """Interleaved schedule: trainable elements of the stage's first model chunk (`chunks` = 1; chunk 0 of stage 0
    holds the embedding), by default of all but its last, i.e. the gradients a later
    backward of the last chunk does not find made in a one-round step (`interleave_rounds`). 0 without
    interleaving. A --freeze'd first layers' share is not taken out (at most the trainable elements)."""
    if run.schedule != "interleaved":
        return 0 * stage
    m, t = run.model, run.training
    layers = (stage_layers(run, stage) - chunk_layers(run, stage, run.vpp - 1) if chunks is None
              else chunk_layers(run, stage, 0))  # (chunks: 1, the first)
    if t.lora_rank is not None:
        return layers * lora_layer_params(m, t.lora_targets, t.lora_rank, run.tp) + 0 * stage
    dense_l, expert_l = layer_params(m, run.tp, run.ep)
    emb = 0 if "embeddings" in t.freeze else embedding_params(m, run.profile, run.tp)
    early = scaled(run, layers * (dense_l + expert_l) + where(stage == 0, emb, 0))
    return imin(early, stage_param_split(run, stage).trainable)


def scaled(run: Run, x: Num) -> Num:
    """`--params N`: scale an element count of the reference shape to N, as stage_params does (the one helper for
    buffers, comm and activations)."""
    m = run.model
    return x if m.params_override is None else muldiv(x, m.params_override, shape_params(m))


def fsdp_sharded(run: Run) -> Num:
    """1 where FSDP2 shards the gradients (ZeRO-2/3 over more than one rank: unsharded gradient buffers reduced per
    unit, not `.grad` accumulated in place), else 0."""
    return where(run.shard_degree > 1, 1, 0) if run.zero >= 2 else 0


def pipelined_fsdp(run: Run) -> Num:
    """1 where torch pipelining runs over FSDP2 sharding (pp > 1, `fsdp_sharded`): every micro-batch's backward then
    skips the reduce-scatter and the reshard (`PipelineStage.backward_maybe_with_nosync`), and the step reduces
    once, after its last backward (`perform_reduce_grad`); else 0."""
    return where(run.pp > 1, fsdp_sharded(run), 0) if run.profile == "torch" else 0



def grads_persistent(run: Run) -> bool:
    """The framework keeps its gradient buffers allocated between steps (Megatron's contiguous grad buffer,
    DeepSpeed's partitioned gradients); torch's `.grad` tensors are made by each first backward."""
    return run.profile in ("megatron", "deepspeed")


def first_grad_bytes(run: Run) -> Num:
    """Bytes per parameter of the gradients a first backward allocates where gradients are not persistent (none
    with --freeze, whose first backward's weights may all be frozen); under FSDP2 they are unsharded gradients, a
    buffer until their reduce-scatter (buffers.py), not a gradient state."""
    t = run.training
    if t.freeze:
        return 0
    fsdp = 1 if (run.profile == "torch" and run.zero >= 2) else 0
    # (torch pipelining over FSDP2 keeps them unsharded, in the compute dtype, to the unit's post-backward, then
    # accumulates them: counted as gradients, `buffers.pipelined_fsdp_grad_bytes`)
    plain = DTYPE_BYTES[run.recipe.grad_dtype] * where(run.shard_degree > 1, 1 - fsdp, 1)
    return where(pipelined_fsdp(run) == 1, DTYPE_BYTES[run.recipe.compute_dtype], plain)

def steps_every_tensor(run: Run) -> Num:
    """1 where this rank's optimizer steps every parameter it holds (no ZeRO-1 partition over a larger group)."""
    return where(run.shard_degree > 1, 0, 1) if run.zero == 1 else 1


def word_embedding_elems(run: Run) -> Num:
    """The word embedding's rows on one TP rank (vocab-parallel) times h, scaled to `--params N`: the size of its
    gradient, and of a tied LM head's."""
    m = run.model
    return scaled(run, cdiv(padded_vocab(m, run.profile, run.tp), run.tp) * m.hidden)


def replicated_embedding_grad(run: Run, stage: Num, under_fsdp: bool = False) -> tuple[Num, Num]:
    """torch TP where FSDP2 does not shard the gradients: (elements the word embedding's gradient holds beyond its
    vocab shard, the shard's elements), both 0 where that does not happen. DTensor's RowwiseParallel shards the
    embedding along V, but `embedding_dense_backward` runs on the replicated token ids and gradient and returns a
    Replicate V x h gradient (with SP too); AccumulateGrad keeps it as `.grad`, and an optimizer op that pairs it
    with the Shard(0) parameter redistributes it to a fresh shard (`Shard._replicate_to_shard` clones its chunk).
    FSDP2 redistributes it itself in its post-backward (`FSDPParam._get_grad_inner_tensor`), so there it is a
    transient of the root's backward: `under_fsdp=True` counts it there too. Measured by the harness:
    docs/validation.md rows 145-151 (validation-findings.md found the replicated gradient itself)."""
    t = run.training
    if run.profile != "torch" or t.lora_rank is not None or "embeddings" in t.freeze:
        return 0, 0
    m = run.model
    shard = cdiv(padded_vocab(m, run.profile, run.tp), run.tp) * m.hidden
    extra = padded_vocab(m, run.profile, 1) * m.hidden - shard
    applies = (stage == 0) & (run.tp > 1)
    if not under_fsdp:
        applies = applies & (fsdp_sharded(run) == 0)
        if m.tied_embeddings:
            # a tied head on the same rank: its Shard(0) gradient waits for the embedding's, and their sum (the
            # replicated one's shard cloned and added out of place) becomes `.grad`, a shard (activations
            # `_tied_sum_bytes`)
            applies = applies & (run.pp > 1)
    return where(applies, scaled(run, extra), 0), where(applies, scaled(run, shard), 0)


def matmul_weight_elems(run: Run, stage: Num) -> Num:
    """Parameters of the stage that autocast casts for matmuls: everything but the input embedding, whose lookup
    is not an autocast op, and the norm weights (layer_norm / rms_norm run in fp32 under autocast; the casts
    of aten/src/ATen/autocast_mode.cpp are for the lower-precision ops: matmuls, linear, ...). A tied LM head on
    the embedding's stage is that same matrix, which the head's matmul casts: there only learned positions are
    left out (GPT-2, Llama 3.2 1B/3B under AMP; measured by the harness)."""
    m = run.model
    emb = scaled(run, embedding_params(m, run.profile, run.tp))
    if m.tied_embeddings:  # the word matrix, the head's (a tied head has no bias: ModelSpec._check)
        emb = emb - where(stage == run.pp - 1, scaled(run, head_params(m, run.profile, run.tp)), 0)
    n_norms = layer_norms(m) * stage_layers(run, stage) + where(stage == run.pp - 1, 1, 0)
    norms = scaled(run, norm_params(m) * n_norms + qk_norm_params(m) * stage_layers(run, stage))
    dense, expert = stage_params(run, stage)
    return dense + expert - where(stage == 0, emb, 0) - norms


def cast_grad_elems(run: Run, stage: Num) -> Num:
    """Of `matmul_weight_elems`, those whose casts produce gradients: all but --freeze'd layers and head (their
    casts need no gradient). The frozen layers' norms are counted as cast here (a few hidden-sized vectors)."""
    t, m = run.training, run.model
    if not t.freeze:
        return matmul_weight_elems(run, stage)
    frozen = stage_param_split(run, stage).frozen
    if "embeddings" in t.freeze:  # not cast in the first place
        frozen = frozen - where(stage == 0, scaled(run, embedding_params(m, run.profile, run.tp)), 0)
    return imax(matmul_weight_elems(run, stage) - frozen, 0)


def first_backward_grad_elems(run: Run, stage: Num) -> tuple[Num, Num]:
    """(head, down): parameters whose gradients a stage's backward produces first, per TP rank: the LM head and
    final norm (last stage only; the tied head's gradient is the embedding's) and one layer's down projection
    (the first weight gradient of a layer's backward). With `--params N` scaled to N like stage_params."""
    m = run.model
    head = where(stage == run.pp - 1, head_params(m, run.profile, run.tp) + norm_params(m), 0)
    down = m.hidden * cdiv(mlp_width(m), run.tp)
    if m.params_override is None:
        return head, down
    full = shape_params(m)
    return muldiv(head, m.params_override, full), muldiv(down, m.params_override, full)


def after_core_layer_elems(run: Run) -> tuple[Num, Num]:
    """(matrices, norm) of one layer, per rank, whose gradients its backward makes before the attention core's
    (`activations.attention_backward`): the output projection (with its bias) and the MLP (or router and experts);
    the MLP's norm (post-attention, or the parallel block's second; none where the block shares one norm). Its
    input norm and Q, K, V come later. Scaled to `--params N` like stage_params. Not used for MLA (the attention
    moment is not modelled there)."""
    m = run.model
    dense, expert = layer_params(m, run.tp, run.ep)
    o_rows, o_cols, _ = attention_matrix_shapes(m, run.tp)[-1]
    o = o_rows * o_cols + (m.hidden if m.linear_bias else 0)
    mats = dense + expert - (attention_params(m, run.tp) - o) - layer_norms(m) * norm_params(m)
    norm = (layer_norms(m) - 1) * norm_params(m)
    if m.params_override is None:
        return mats, norm
    full = shape_params(m)
    return muldiv(mats, m.params_override, full), muldiv(norm, m.params_override, full)


def lora_first_grad_elems(run: Run) -> tuple[Num, Num]:
    """LoRA's counterpart of (`first_backward_grad_elems`' down, `first_attention_grad_elems`), per TP rank: the
    adapter weights whose gradients a stage's first layer backward has made at its MLP's moment (the down (or
    proj) projection's adapter: autograd runs the adapter's branch before the frozen base's input gradient,
    `activations.layer_backward_transient`) and at its attention core's (the output projection's and the MLP's
    adapters). The base, embedding and head are frozen. MoE models take attention targets only. Measured by the
    harness (docs/validation.md, the QLoRA DDP row: the down adapter's 2 x 4 x (1024 + 256) B at its peak)."""
    t, m = run.training, run.model
    if t.lora_rank is None:
        return 0, 0
    mlp = () if m.moe is not None else ("gate", "up", "down")
    down = lora_layer_params(m, t.lora_targets, t.lora_rank, run.tp, only=mlp[-1:])
    return down, lora_layer_params(m, t.lora_targets, t.lora_rank, run.tp, only=("o",) + mlp)


def first_attention_grad_elems(run: Run, stage: Num) -> Num:
    """Parameters whose gradients a stage's backward has made when its first layer's backward reaches the attention
    core: the LM head and final norm (last stage, `first_backward_grad_elems`) and `after_core_layer_elems`."""
    head, _ = first_backward_grad_elems(run, stage)
    mats, norm = after_core_layer_elems(run)
    return head + mats + norm


def layer_tensor_shapes(run: Run) -> list[tuple[Num, Num, Num]]:
    """(dim0, elements per dim0 row, count) of the parameter tensors of one transformer layer after TP sharding."""
    m, tp = run.model, run.tp
    if m.moe is not None:  # MoE: one flat tensor per layer (an approximation: FSDP2 pads per tensor)
        dense_l, expert_l = layer_params(m, tp, run.ep)
        return [(dense_l + expert_l, 1, 1)]
    return _dense_layer_tensor_shapes(m, tp)


def _dense_layer_tensor_shapes(m: ModelSpec, tp: Num) -> list[tuple[Num, Num, Num]]:
    """layer_tensor_shapes of a layer with a dense MLP of width m.ffn (a dense model's, or an MoE model's first
    dense layers)."""
    h, a, g, d = m.hidden, m.heads, m.kv_heads, m.head_dim
    nrm = 2 if m.norm == "layernorm" else 1
    per_layer: list[tuple[Num, Num, Num]] = [*attention_matrix_shapes(m, tp), *mlp_matrix_shapes(m, m.ffn, tp)]
    per_layer.append((h, 1, layer_norms(m) * nrm))  # two norms, or one (weight, + bias for LayerNorm)
    if m.qk_norm:
        per_layer.append((d, 1, 2 * nrm))  # the q and k norms (replicated over TP)
    if m.mla is not None:
        per_layer.append((m.mla.kv_lora_rank, 1, 1))  # the latents' RMSNorms
        if m.mla.q_lora_rank:
            per_layer.append((m.mla.q_lora_rank, 1, 1))
    n_in = 2 if m.mlp == "swiglu" else 1
    if m.qkv_bias:
        per_layer += [(a * d // tp, 1, 1), (g * d // tp, 1, 2)]
    if m.linear_bias:
        per_layer += [(h, 1, 1), (m.ffn // tp, 1, n_in), (h, 1, 1)]
    return per_layer


def root_tensor_shapes(run: Run, stage: Num) -> list[tuple[Num, Num, Num]]:
    """The stage's tensors outside the layers (FSDP2's root unit): embedding (+ learned positions) on the first
    stage, final norm and LM head on the last (a count of 0 where the stage does not hold one)."""
    m, tp, h = run.model, run.tp, run.model.hidden
    nrm = 2 if m.norm == "layernorm" else 1
    rows_v = cdiv(padded_vocab(m, run.profile, tp), tp)
    first, last = where(stage == 0, 1, 0), where(stage == run.pp - 1, 1, 0)
    shapes: list[tuple[Num, Num, Num]] = [(rows_v, h, first)]
    if m.positions == "learned":
        shapes.append((m.max_positions, h, first))
    shapes.append((h, 1, nrm * last))
    head = last if not m.tied_embeddings else last * where(run.pp > 1, 1, 0)
    shapes.append((rows_v, h, head))
    if m.head_bias:
        shapes.append((rows_v, 1, head))
    return shapes


def stage_tensor_shapes(run: Run, stage: Num) -> list[tuple[Num, Num, Num]]:
    """(dim0, elements per dim0 row, count) of every parameter tensor held by one rank of `stage` after TP
    sharding (array-polymorphic: a count of 0 marks a tensor the stage does not hold). FSDP2 shards each tensor
    along dim 0 and pads dim 0 to a multiple of the shard group (torch/distributed/fsdp/_fully_shard/
    _fsdp_param.py `_init_sharded_param`), so its shards are sum(count * ceil(dim0 / D) * row) elements."""
    n_layers = stage_layers(run, stage)
    n_dense = stage_dense_layers(run, stage)
    shapes = [(d0, row, c * (n_layers - n_dense)) for d0, row, c in layer_tensor_shapes(run)]
    if first_dense_layers(run.model):
        shapes += [(d0, row, c * n_dense) for d0, row, c in _dense_layer_tensor_shapes(run.model, run.tp)]
    return shapes + root_tensor_shapes(run, stage)


def grad_ready_listed(run: Run) -> bool:
    """Whether `grad_ready_elems` lists the stage's tensors (categorical): dense models, every parameter trainable
    (standard or fused QKV attention) or LoRA on separate projections; not MoE, MLA or --freeze."""
    t = run.training
    lora_ok = t.lora_rank is None or t.qkv_impl == "separate"
    return run.model.moe is None and run.model.mla is None and lora_ok and not t.freeze


def grad_ready_elems(run: Run, stage: int) -> tuple[int, ...]:
    """Elements of each parameter tensor one rank of `stage` holds (after TP, before `--params` scaling), in the
    order autograd makes their gradients ready in backward (scalar run; `grad_ready_listed` runs only). That is
    the reverse of the order the forward uses them, a linear's bias before its weight: the LM head, the final norm,
    then from the last layer down, up, gate, norm2, o, v, k, q, norm1, and the embedding last (a tied head's
    gradient is summed into the embedding's, so it is ready there). Under LoRA only the adapters train: each
    layer's from down to q, an adapter's B (used last) before its A. Measured as DDP's rebuilt bucket order
    (`DistributedDataParallel._get_ddp_logging_data()['rebuilt_per_bucket_param_indices']`) on the harness's model:
    docs/methodology.md, "torch DDP, bucket by bucket"."""
    m, tp, t = run.model, run.tp, run.training
    if t.lora_rank is not None:
        per_layer = [x for _, a_elems, b_elems in lora_adapters(m, t.lora_targets, t.lora_rank, tp)
                     for x in (a_elems, b_elems)]
        return tuple(reversed(per_layer * stage_layers(run, stage)))
    h = m.hidden

    def linears(shapes: list[tuple[Num, Num, int]], bias: bool) -> list[int]:
        # each matrix (rows x cols), then its bias (rows: a row-parallel o / down keeps its whole h bias)
        return [x for rows, cols, count in shapes for _ in range(count) for x in [rows * cols] + [rows] * bias]

    norm = [h, h] if m.norm == "layernorm" else [h]
    rows_v = cdiv(padded_vocab(m, run.profile, tp), tp)
    attn = attention_matrix_shapes(m, tp)  # q; k and v; o
    q_kv, o = attn[:2], attn[2:]
    if t.qkv_impl == "fused":  # one QKV matrix (lit-gpt)
        q_kv = [(sum(rows * count for rows, _, count in q_kv), h, 1)]
    gate_up, down = mlp_matrix_shapes(m, m.ffn, tp)
    post = norm if m.post_norms else []  # Gemma 2/3: the attention output's norm, then the MLP output's
    qkv = linears(q_kv, m.qkv_bias)
    if m.qk_norm:  # Qwen3: q, its norm, k, its norm, v (a fused QKV matrix: both norms after it)
        qn = [m.head_dim] * (2 if m.norm == "layernorm" else 1)
        if t.qkv_impl == "fused":
            qkv = qkv + qn + qn
        else:
            (q_rows, _, _), (kv_rows, _, _) = q_kv
            k_or_v = linears([(kv_rows, h, 1)], m.qkv_bias)
            qkv = linears([(q_rows, h, 1)], m.qkv_bias) + qn + k_or_v + qn + k_or_v
    layer = norm + qkv + linears(o, m.linear_bias) + post
    if m.block != "parallel-shared-norm":
        layer += norm
    layer += linears([gate_up], m.linear_bias) + linears([down], m.linear_bias) + post
    fwd: list[int] = []
    if stage == 0:
        fwd += [rows_v * h] + ([m.max_positions * h] if m.positions == "learned" else [])
    fwd += layer * stage_layers(run, stage)
    if stage == run.pp - 1:
        fwd += norm
        if not m.tied_embeddings or run.pp > 1:
            fwd += linears([(rows_v, h, 1)], m.head_bias)
    return tuple(reversed(fwd))


def padded_shard_elems(shapes: list[tuple[Num, Num, Num]], degree: Num) -> Num:
    """Elements of one rank's FSDP2 shard of the given tensors: each dim 0 padded to a multiple of `degree`."""
    total = 0
    for d0, row, c in shapes:
        total = total + c * cdiv(d0, degree) * row
    return total


def fsdp_shard_elems(run: Run, stage: Num, degree: Num) -> Num:
    """Elements of one rank's FSDP2 shard of `stage` (per-tensor dim-0 padding; see stage_tensor_shapes).
    With `--params N` the padding is computed on the reference shape and the total scaled to N."""
    total = padded_shard_elems(stage_tensor_shapes(run, stage), degree)
    m = run.model
    if m.params_override is not None:
        return muldiv(total, m.params_override, shape_params(m))
    return total


def zero1_partition_applies(run: Run) -> bool:
    """torch's ZeRO-1 (ZeroRedundancyOptimizer) assigns whole tensors to ranks; modelled tensor by tensor for
    dense models with every parameter trainable and their real shapes (categorical tests only)."""
    t = run.training
    return (run.profile == "torch" and run.zero == 1 and run.model.moe is None and t.lora_rank is None
            and not t.freeze and run.model.params_override is None)


@functools.lru_cache(maxsize=256)
def _greedy_partition(sizes: tuple[tuple[int, int, int], ...], ranks: int) -> tuple[int, int]:
    """(largest per-rank total of local elements, first rank holding it) of ZeroRedundancyOptimizer.
    _partition_parameters: tensors largest first by `numel()` (a DTensor's is its global size), each to the rank
    with the smallest total so far (lowest index on ties). `sizes`: (global numel, local numel, count)."""
    import heapq

    heap = [(0, r) for r in range(ranks)]
    local = [0] * ranks
    for numel, loc, count in sizes:
        for _ in range(count):
            total, r = heapq.heappop(heap)
            heapq.heappush(heap, (total + numel, r))
            local[r] += loc
    best = max(local)
    return best, local.index(best)


def _zero1_sizes(run: Run, tp: int, pp: int, vpp: int, stage: int) -> tuple[tuple[int, int, int], ...]:
    local = stage_tensor_shapes(dataclasses.replace(run, tp=tp, pp=pp, vpp=vpp), stage)
    glob = stage_tensor_shapes(dataclasses.replace(run, tp=1, pp=pp, vpp=vpp), stage)
    counts: dict[tuple[int, int], int] = {}
    for (g0, grow, c), (l0, lrow, _) in zip(glob, local, strict=True):
        if c:
            key = (g0 * grow, l0 * lrow)
            counts[key] = counts.get(key, 0) + c
    # torch sorts by global numel (stable); tensors of one global size are grouped here, which changes nothing
    # unless a replicated tensor has the global size of a TP-sharded one
    return tuple((g, loc, c) for (g, loc), c in sorted(counts.items(), key=lambda kv: -kv[0][0]))


def zero1_rank_elems(run: Run, stage: Num) -> Num:
    """Elements stepped by the most loaded rank under ZeroRedundancyOptimizer (torch/distributed/optim/
    zero_redundancy_optimizer.py `_partition_parameters`, greedy largest-first), not P/N: whole tensors, so a
    rank that holds the embedding holds at least V*h/t."""
    memo: dict[tuple[int, int, int, int], tuple[tuple[int, int, int], ...]] = {}

    def worst(d: int, tp: int, pp: int, vpp: int, st: int) -> int:
        key = (tp, pp, vpp, st)  # (vpp: a stage's layers, torch's uneven interleaved chunks)
        if key not in memo:
            memo[key] = _zero1_sizes(run, tp, pp, vpp, st)
        return _greedy_partition(memo[key], d)[0]

    return per_value(worst, run.shard_degree, run.tp, run.pp, run.vpp, stage)


def zero1_worst_dp_index(run: Run, stage: int) -> int:
    """The data-parallel index of the most loaded ZeroRedundancyOptimizer rank (0 when the partition is P/N)."""
    if not zero1_partition_applies(run) or run.shard_degree <= 1:
        return 0
    return _greedy_partition(_zero1_sizes(run, run.tp, run.pp, run.vpp, stage), run.shard_degree)[1]
