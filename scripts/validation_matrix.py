"""Run `memcalc validate` over a matrix of configurations and write docs/validation.md.

    .venv/bin/python scripts/validation_matrix.py            # the whole matrix, writes docs/validation.md
    .venv/bin/python scripts/validation_matrix.py --only 5,6 --out /tmp/v.md --json /tmp/v.json

Every layout of the torch profile (single rank, DDP, ZeRO-1, FSDP2 ZeRO-2/3, TP, TP+SP, FSDP2 x TP, PP GPipe/1F1B)
with fp32, AMP bf16, pure bf16 and bf16 grads + fp32 master, each recompute mode, GQA and MHA, SwiGLU and GELU, on
real gloo worlds of 1-8 ranks and fake worlds of up to 1024 ranks. The table shows the truth: rows that miss stay.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# tiny shapes: a Llama-style block (RMSNorm, SwiGLU, rotary) and a GPT-2-style block (LayerNorm, GELU, learned)
LLAMA = dict(layers=4, hidden=64, heads=4, ffn=176, vocab=512, seq=64)
GQA = dict(LLAMA, heads=8, kv_heads=4)
GPT2 = dict(model=None, layers=4, hidden=64, heads=4, ffn=256, vocab=512, seq=64)
BIG = dict(layers=4, hidden=1024, heads=16, kv_heads=8, ffn=2816, vocab=32000, seq=1024)


def _gpt2_model() -> dict[str, Any]:
    return {"mlp": "gelu", "norm": "layernorm", "positions": "learned", "max_positions": 64, "linear_bias": True,
            "qkv_bias": True, "tied_embeddings": True}


# (label, RunOptions kwargs, model field overrides, world, device)
def configurations() -> list[tuple[str, dict[str, Any], dict[str, Any], str, str]]:
    c: list[tuple[str, dict[str, Any], dict[str, Any], str, str]] = []
    L, G, P = LLAMA, GQA, {k: v for k, v in GPT2.items() if k != "model"}
    gpt = _gpt2_model()

    def add(label: str, opts: dict[str, Any], model: dict[str, Any] | None = None, world: str = "real",
            device: str = "cpu") -> None:
        c.append((label, opts, model or {}, world, device))

    # single rank
    add("single fp32", dict(L, precision="fp32"))
    add("single bf16 AMP", dict(L, precision="bf16"))
    add("single pure bf16", dict(L, precision="bf16", master_weights=False))
    add("single bf16 grads + fp32 master", dict(L, precision="bf16", grad_dtype="bf16"))
    add("single fp32 GPT-2 block", dict(P, precision="fp32"), gpt)
    # DDP
    add("DDP fp32", dict(L, precision="fp32", gpus=2))
    add("DDP bf16 AMP", dict(L, precision="bf16", gpus=4))
    add("DDP fp32 GPT-2 block", dict(P, precision="fp32", gpus=8), gpt)
    add("LoRA r=4 attn, bf16 base, single", dict(L, precision="bf16", lora_rank=4))
    add("LoRA r=4 all, bf16 base, DDP", dict(L, precision="bf16", lora_rank=4, lora_targets="all", gpus=2))
    add("DDP fp32 grad-accum 2", dict(L, precision="fp32", gpus=2, grad_accum=2))
    add("DDP fp32 SGD momentum", dict(L, precision="fp32", gpus=2, optimizer="sgd-momentum"))
    add("DDP fp32 SGD", dict(L, precision="fp32", gpus=2, optimizer="sgd"))
    add("DDP fp32 eager attention", dict(L, precision="fp32", gpus=2, attention="eager"))
    add("DDP fp32 GQA", dict(G, precision="fp32", gpus=2))
    add("DDP pure bf16", dict(L, precision="bf16", master_weights=False, gpus=2))
    add("DDP bf16 grads + fp32 master", dict(L, precision="bf16", grad_dtype="bf16", gpus=2))
    add("DDP fp32 full recompute", dict(L, precision="fp32", gpus=2, recompute="full"))
    add("DDP fp32 selective recompute", dict(L, precision="fp32", gpus=2, recompute="selective"))
    add("DDP bf16 full recompute, 2 of 4 layers", dict(L, precision="bf16", gpus=2, recompute="full",
                                                       recompute_layers=2))
    add("DDP fp32 no-foreach AdamW", dict(L, precision="fp32", gpus=2, foreach=False))
    # ZeRO-1
    add("ZeRO-1 fp32", dict(L, precision="fp32", gpus=2, zero=1))
    add("ZeRO-1 bf16 AMP", dict(L, precision="bf16", gpus=4, zero=1))
    add("ZeRO-1 fp32 GPT-2 block", dict(P, precision="fp32", gpus=8, zero=1), gpt)
    # FSDP2
    add("FSDP2 ZeRO-2 fp32", dict(L, precision="fp32", gpus=2, zero=2))
    add("FSDP2 ZeRO-2 bf16", dict(L, precision="bf16", gpus=4, zero=2))
    add("FSDP2 ZeRO-3 fp32", dict(L, precision="fp32", gpus=2, zero=3))
    add("FSDP2 ZeRO-3 bf16 GQA", dict(G, precision="bf16", gpus=4, zero=3))
    add("FSDP2 ZeRO-3 fp32 GELU", dict(P, precision="fp32", gpus=8, zero=3), dict(gpt, tied_embeddings=False))
    add("FSDP2 ZeRO-3 pure bf16", dict(L, precision="bf16", master_weights=False, gpus=2, zero=3))
    add("FSDP2 ZeRO-3 fp32 full recompute", dict(L, precision="fp32", gpus=2, zero=3, recompute="full"))
    add("FSDP2 ZeRO-3 bf16 selective recompute", dict(L, precision="bf16", gpus=2, zero=3, recompute="selective"))
    # TP / SP
    add("TP2 fp32", dict(L, precision="fp32", gpus=2, tp=2))
    add("TP2+SP fp32", dict(L, precision="fp32", gpus=2, tp=2, sp=True))
    add("TP4+SP bf16 GQA", dict(G, precision="bf16", gpus=4, tp=4, sp=True))
    add("TP2+SP fp32 full recompute", dict(L, precision="fp32", gpus=2, tp=2, sp=True, recompute="full"))
    add("TP2 fp32 selective recompute", dict(L, precision="fp32", gpus=2, tp=2, recompute="selective"))
    add("TP2 fp32 GELU + learned positions", dict(P, precision="fp32", gpus=2, tp=2, sp=True),
        dict(gpt, tied_embeddings=False))
    # FSDP2 x TP
    add("FSDP2 ZeRO-3 x TP2+SP fp32", dict(L, precision="fp32", gpus=4, tp=2, zero=3, sp=True))
    add("FSDP2 ZeRO-2 x TP2 bf16", dict(L, precision="bf16", gpus=4, tp=2, zero=2))
    # PP
    add("PP2 1F1B fp32", dict(L, precision="fp32", gpus=2, pp=2, grad_accum=4))
    add("PP2 GPipe fp32", dict(L, precision="fp32", gpus=2, pp=2, grad_accum=4, schedule="gpipe"))
    add("PP4 1F1B bf16", dict(L, precision="bf16", gpus=4, pp=4, grad_accum=8))
    add("PP2 1F1B fp32 full recompute", dict(L, precision="fp32", gpus=2, pp=2, grad_accum=4, recompute="full"))
    add("PP2 x FSDP2 ZeRO-3 fp32", dict(L, precision="fp32", gpus=4, pp=2, zero=3, grad_accum=2))
    # one rank of a large world, fake process group
    add("fake DDP fp32, world 16", dict(L, precision="fp32", gpus=16), world="fake")
    add("fake ZeRO-1 fp32, world 32", dict(L, precision="fp32", gpus=32, zero=1), world="fake")
    add("fake FSDP2 ZeRO-3 bf16, world 64", dict(L, precision="bf16", gpus=64, zero=3), world="fake", device="cpu")
    add("fake FSDP2 ZeRO-2 bf16, world 128 (meta)", dict(L, precision="bf16", gpus=128, zero=2), world="fake",
        device="meta")
    add("fake FSDP2 ZeRO-3 fp32, world 1024 (meta)", dict(L, precision="fp32", gpus=1024, zero=3), world="fake",
        device="meta")
    add("fake FSDP2 ZeRO-3 x TP4+SP bf16 GQA, world 8 (meta)", dict(G, precision="bf16", gpus=8, tp=4, sp=True, zero=3), world="fake",
        device="meta")
    add("fake FSDP2 ZeRO-3 x TP8+SP bf16, 1B-wide, world 256 (meta)", dict(BIG, precision="bf16", gpus=256, tp=8,
                                                                        sp=True, zero=3), world="fake",
        device="meta")
    add("fake FSDP2 ZeRO-3 bf16, 1B-wide, world 1024 (meta)", dict(BIG, precision="bf16", gpus=1024, zero=3),
        world="fake", device="meta")
    # interleaved 1F1B (ScheduleInterleaved1F1B, vpp model chunks per rank); appended to keep the numbering above
    add("PP2 interleaved vpp 2 fp32", dict(L, precision="fp32", gpus=2, pp=2, vpp=2, grad_accum=4))
    add("PP4 interleaved vpp 2 bf16, 8 layers", dict(L, layers=8, precision="bf16", gpus=4, pp=4, vpp=2,
                                                     grad_accum=8))
    add("PP2 interleaved vpp 2 fp32, 8 micro-batches, full recompute",
        dict(L, precision="fp32", gpus=2, pp=2, vpp=2, grad_accum=8, recompute="full"))
    # torchtitan's op-level selective activation checkpointing (--recompute op)
    add("DDP bf16 AMP op-level SAC, seq 512", dict(L, seq=512, precision="bf16", gpus=2, recompute="op"))
    add("FSDP2 ZeRO-3 bf16 op-level SAC, seq 512", dict(L, seq=512, precision="bf16", gpus=2, zero=3,
                                                        recompute="op"))
    add("TP2+SP bf16 op-level SAC, seq 512", dict(L, seq=512, precision="bf16", gpus=2, tp=2, sp=True,
                                                  recompute="op"))
    # model code (--norm-impl, --qkv-impl) and LoRA variants: lit-gpt's layer, adapter dropout, pure bf16 LoRA
    LIT = dict(norm_impl="fp32", qkv_impl="fused")
    add("LoRA r=4 q,v + dropout, lit-gpt layer, pure bf16, single",
        dict(L, **LIT, precision="bf16", master_weights=False, lora_rank=4, lora_targets="qv", lora_dropout=0.05))
    add("LoRA r=4 q,v + dropout, lit-gpt layer, pure bf16, GQA, single",
        dict(G, **LIT, precision="bf16", master_weights=False, lora_rank=4, lora_targets="qv", lora_dropout=0.05))
    add("lit-gpt layer (fused QKV, fp32 RMSNorm), bf16 AMP, DDP", dict(L, **LIT, precision="bf16", gpus=2))
    add("lit-gpt layer, pure bf16, GQA, FSDP2 ZeRO-3", dict(G, **LIT, precision="bf16", master_weights=False, gpus=2,
                                                         zero=3))
    add("LoRA r=4 all + dropout 0.1, bf16 AMP, DDP", dict(L, precision="bf16", lora_rank=4, lora_targets="all",
                                                          lora_dropout=0.1, gpus=2))
    # torchtune's layer: GQA K/V expanded to every query head before SDPA, fp32 RMSNorm; fused AdamW steps
    add("torchtune layer (expanded GQA K/V, fp32 RMSNorm), pure bf16, single",
        dict(G, norm_impl="fp32", gqa_impl="expand", precision="bf16", master_weights=False))
    add("torchtune layer, TP2+SP bf16 GQA", dict(G, norm_impl="fp32", gqa_impl="expand", precision="bf16", gpus=2,
                                               tp=2, sp=True))
    add("DDP fp32 fused AdamW", dict(L, precision="fp32", gpus=2, optimizer_impl="fused"))
    add("FSDP2 ZeRO-3 bf16 fused AdamW, full recompute", dict(G, precision="bf16", gpus=2, zero=3, recompute="full",
                                                             gqa_impl="expand", optimizer_impl="fused"))
    # ZeRO-2 (reshard_after_forward=False) with full recompute: each post-backward reshards its unit
    add("FSDP2 ZeRO-2 bf16 full recompute", dict(L, precision="bf16", gpus=2, zero=2, recompute="full"))
    # seq 512: activations dominate. Eager attention with dropout (bool masks, as CUDA's native_dropout), a full
    # recompute whose re-run starts after the loss terms are freed (grad-accum 2), and activation offloading
    # (memcalc/validate/offload.py: two blocks resident)
    S = dict(L, seq=512)
    add("eager attention + dropout 0.1 fp32, seq 512, single", dict(S, precision="fp32", attention="eager",
                                                                     dropout=0.1))
    add("DDP fp32 full recompute, grad-accum 2, seq 512", dict(S, precision="fp32", gpus=2, grad_accum=2,
                                                                 recompute="full"))
    add("offload activations fp32, seq 512, single", dict(S, precision="fp32", offload_activations=True))
    add("offload activations + full recompute fp32, grad-accum 2, seq 512", dict(
        S, precision="fp32", grad_accum=2, recompute="full", offload_activations=True))
    add("offload activations + selective recompute fp32, 6 layers, seq 512", dict(
        S, layers=6, precision="fp32", recompute="selective", offload_activations=True))
    add("offload activations + full recompute of 2 of 6 layers fp32, seq 512", dict(
        S, layers=6, precision="fp32", recompute="full", recompute_layers=2, offload_activations=True))
    add("offload activations, torchtune layer, pure bf16, seq 512", dict(
        G, seq=512, norm_impl="fp32", gqa_impl="expand", precision="bf16", master_weights=False,
        offload_activations=True))
    add("offload activations, FSDP2 ZeRO-3 bf16, seq 512", dict(S, precision="bf16", gpus=2, zero=3,
                                                                 offload_activations=True))
    add("offload activations, LoRA r=4 all, bf16 AMP, DDP, seq 512", dict(
        S, precision="bf16", gpus=2, lora_rank=4, lora_targets="all", offload_activations=True))
    # QLoRA: NF4 base linears (memcalc/validate/quant.py), dequantized around each matmul; a wide MLP and few
    # tokens, so the dequantized down projection (and head) set the peak. bitsandbytes keeps the linears' inputs,
    # torchao's linear_nf4 none; lit-gpt (Fabric) also quantizes the LM head
    Q = dict(layers=4, hidden=256, heads=4, ffn=1024, vocab=512, seq=32, precision="bf16", master_weights=False,
             base_dtype="nf4", lora_rank=4)
    add("QLoRA nf4 bnb r=4 q,v + dropout, lit-gpt layer, quantized head", dict(
        Q, **LIT, lora_targets="qv", lora_dropout=0.05, quantize_head=True))
    add("QLoRA nf4 torchao r=4 all, quantized head, vocab 8192", dict(Q, vocab=8192, lora_targets="all",
                                                                      quant_backend="torchao", quantize_head=True))
    add("QLoRA nf4 bnb r=4 q,v, full recompute", dict(Q, lora_targets="qv", recompute="full"))
    add("QLoRA nf4 bnb r=4 all + dropout 0.1, no double quant, DDP", dict(
        Q, lora_targets="all", lora_dropout=0.1, double_quant=False, gpus=2))
    # chunked losses (torchtune CEWithChunkedOutputLoss: the head applied to 8 sequence chunks): compiled (the
    # compute-dtype logits saved; model.CompiledChunkCE stands for inductor's kernels) or eager (every chunk's fp32
    # log-softmax saved); vocab 8192 so that the loss sets the peak. A trainable head sums its chunks' weight
    # gradients out of place (micro-batch 1), a micro-batch of 2 makes the chunks non-contiguous (copied)
    C = dict(GQA, vocab=8192, seq=256, norm_impl="fp32", gqa_impl="expand", precision="bf16", master_weights=False,
             recompute="full")
    add("chunked loss (compiled), torchtune layer, full recompute, micro-batch 2", dict(C, micro_batch=2,
                                                                                    loss="chunked"))
    add("chunked loss (compiled), head weight-gradient sum, micro-batch 1", dict(C, loss="chunked"))
    add("chunked loss (eager), fp32, seq 500, micro-batch 2", dict(GQA, vocab=8192, seq=500, micro_batch=2,
                                                                  precision="fp32", loss="chunked-eager"))
    add("chunked loss (compiled), LoRA r=4 all, offload activations, seq 512, micro-batch 2 (torchtune README)",
        dict(C, seq=512, micro_batch=2, lora_rank=4, lora_targets="all", offload_activations=True, loss="chunked"))
    # lit-gpt's loss: the head per 128-token piece (300 tokens: 128 + 128 + 44), bf16 cross-entropy without an
    # upcast, and the loop's `logits` kept until the next forward (through backward and the optimizer step)
    add("lit-gpt loss, lit-gpt layer, LoRA r=4 q,v + dropout, pure bf16, seq 300, micro-batch 2", dict(
        GQA, vocab=8192, seq=300, micro_batch=2, **LIT, precision="bf16", master_weights=False, lora_rank=4,
        lora_targets="qv", lora_dropout=0.05, loss="lit-gpt"))
    add("lit-gpt loss, full training fp32, seq 300, grad-accum 2", dict(GQA, vocab=8192, seq=300, precision="fp32",
                                                                      grad_accum=2, loss="lit-gpt"))
    # --lora-targets as a list: an adapted up projection keeps the MLP's input saved while the frozen gate and down
    # keep none (the down projection's input goes unsaved); an adapted down with dropout saves its dropped copy
    add("LoRA r=4 on q,v,o,up (gate, down frozen), GQA, pure bf16", dict(
        GQA, precision="bf16", master_weights=False, lora_rank=4, lora_targets="q,v,o,up"))
    add("LoRA r=4 on k_proj,down_proj + dropout 0.1, bf16 AMP, DDP", dict(
        L, precision="bf16", lora_rank=4, lora_targets="k_proj,down_proj", lora_dropout=0.1, gpus=2))
    # --keep-logits: the loop's `logits` live until the next forward's replace them (grad-accum 2: through the
    # second micro-batch's forward too); vocab 8192 so that the loss sets the peak
    add("loop keeps the logits (nanoGPT), bf16 AMP, vocab 8192, grad-accum 2", dict(
        GQA, vocab=8192, seq=256, precision="bf16", grad_accum=2, keep_logits="compute"))
    add("loop keeps fp32 logits (torchtune 0.1), LoRA r=4 q,v + dropout, pure bf16, full recompute, grad-accum 2",
        dict(GQA, vocab=8192, seq=256, micro_batch=2, precision="bf16", master_weights=False, recompute="full",
             norm_impl="fp32", lora_rank=4, lora_targets="qv", lora_dropout=0.05, grad_accum=2, keep_logits="fp32"))
    # all-to-all context parallelism (DeepSpeed-Ulysses' exchange, memcalc/validate/model.py _UlyssesExchange): each
    # rank holds seq/cp tokens; Q, K, V go to head sharding and the output back, one all-to-all per tensor
    U = dict(GQA, seq=512, cp_comm="a2a")
    add("Ulysses cp 2 (all-to-all), DDP bf16 AMP, GQA, seq 512", dict(U, precision="bf16", gpus=2, cp=2))
    add("Ulysses cp 2 x FSDP2 ZeRO-3 bf16, dp 2, seq 512", dict(U, precision="bf16", gpus=4, cp=2, zero=3))
    # MHA: fp32 GQA has no fused SDPA kernel on CUDA (the math fallback, row 182)
    add("Ulysses cp 2, full recompute, fp32 MHA, seq 512", dict(U, kv_heads=8, precision="fp32", gpus=2, cp=2,
                                                              recompute="full"))
    add("Ulysses cp 4, selective recompute, pure bf16, seq 512", dict(U, precision="bf16", master_weights=False,
                                                                       gpus=4, cp=4, recompute="selective"))
    add("fake Ulysses cp 4 x FSDP2 ZeRO-3 bf16, world 16", dict(U, precision="bf16", gpus=16, cp=4, zero=3),
        world="fake")
    # mixture of experts: Hugging Face's MixtralSparseMoeBlock (memcalc/validate/model.py MoE), balanced routing
    X = dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=192, vocab=1000, seq=512)
    moe = {"moe": {"experts": 4, "top_k": 2, "expert_ffn": 192, "shared_experts": 0}}
    add("MoE 4 experts top-2, single bf16 AMP, seq 512", dict(X, precision="bf16"), moe)
    add("MoE + shared expert, FSDP2 ZeRO-3 bf16, seq 512", dict(X, precision="bf16", gpus=2, zero=3),
        {"moe": dict(moe["moe"], shared_experts=1)})
    add("MoE 4 experts top-2, DDP fp32, full recompute", dict(X, precision="fp32", gpus=2, recompute="full"), moe)
    # vocab 64: a small loss gradient, with the layers' backward close behind (the final norm's backward measured
    # 5.5% above the prediction here until the harness's fused norm stopped counting its fp32 intermediates)
    add("MoE, vocab 64, pure bf16", dict(X, precision="bf16", master_weights=False, vocab=64), moe)
    # Hugging Face's eager attention in bf16: softmax in fp32 beside a bf16 copy, and the top layer's softmax
    # backward (8 bytes per score) the step's peak at vocab 64 (activations.py attention_backward)
    add("eager attention, bf16 AMP, GQA, vocab 64, seq 512: softmax backward the peak",
        dict(X, precision="bf16", attention="eager", vocab=64))
    add("eager attention + dropout 0.1, pure bf16, seq 512", dict(X, precision="bf16", master_weights=False,
                                                                  attention="eager", dropout=0.1))
    # multi-head latent attention (Hugging Face's DeepseekV3Attention, memcalc/validate/model.py LatentAttention)
    # and a DeepSeek-shaped model: MLA, the first layer dense, 8 routed experts top-2 and a shared expert
    A = dict(layers=2, hidden=128, heads=4, ffn=256, vocab=1000, seq=256, bias=False, kv_lora_rank=32,
             qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16)
    add("MLA (kv latent only), fp32, seq 256", dict(A, precision="fp32"))
    add("MLA (q and kv latents), HF fp32 norms, bf16 AMP, seq 256", dict(A, precision="bf16", q_lora_rank=48,
                                                                         norm_impl="fp32"))
    DS = dict(A, layers=3, ffn=384, q_lora_rank=48, norm_impl="fp32", experts=8, top_k=2, expert_ffn=64,
              shared_experts=1, first_dense_layers=1)
    add("DeepSeek-shaped (MLA, dense first layer, MoE + shared), bf16 AMP", dict(DS, precision="bf16"))
    add("DeepSeek-shaped, FSDP2 ZeRO-3 bf16, dp 2", dict(DS, precision="bf16", gpus=2, zero=3))
    add("DeepSeek-shaped, full recompute, pure bf16", dict(DS, precision="bf16", master_weights=False,
                                                           recompute="full"))
    # parallel blocks (GPT-NeoX: x + attn(ln1 x) + mlp(ln2 x); phi / GPT-J: one shared norm), GPT-2-style layers
    P2 = dict(P, seq=256, micro_batch=2)
    gpt256 = dict(gpt, max_positions=256)
    add("parallel block (GPT-NeoX), fp32, seq 256", dict(P2, precision="fp32", block="parallel"), gpt256)
    add("parallel block, shared norm (phi), bf16 AMP, eager", dict(P2, precision="bf16", attention="eager",
                                                                   block="parallel-shared-norm"), gpt256)
    add("parallel block, shared norm, TP 2 + SP, fp32", dict(P2, precision="fp32", gpus=2, tp=2, sp=True,
                                                             block="parallel-shared-norm"),
        dict(gpt256, tied_embeddings=False))
    add("parallel block, FSDP2 ZeRO-3 bf16, full recompute", dict(P2, precision="bf16", gpus=2, zero=3,
                                                                  recompute="full", block="parallel"), gpt256)
    # lit-gpt's phi-1.5 fine-tune in miniature: LoRA q,v on a fused QKV with dropout over a shared-norm block, an LM
    # head with a bias, the chunked head and loss, and Lightning Fabric's fp32 copy of the chunks kept by the loop
    add("lit-gpt LoRA q,v, shared-norm block, head bias, Fabric fp32 logits",
        dict(P2, precision="bf16", master_weights=False, lora_rank=4, lora_targets="qv", lora_dropout=0.05,
             qkv_impl="fused", loss="lit-gpt", keep_logits="fp32", block="parallel-shared-norm", head_bias=True),
        dict(gpt, positions="rotary", tied_embeddings=False))
    # a weight quantized from fp16 (bitsandbytes <= 0.42) dequantizes through fp16: the quantized LM head's two copies
    # are the peak at vocab 8192
    # (ffn 192: every matrix a whole number of 256 x 64-weight groups, the nf4 storage memcalc counts in total)
    add("QLoRA, bitsandbytes quantized from fp16 (bnb-fp16), quantized head, vocab 8192",
        dict(L, hidden=256, ffn=192, vocab=8192, seq=32, precision="bf16", master_weights=False, lora_rank=4,
             lora_targets="qv", lora_dropout=0.05, qkv_impl="fused", base_dtype="nf4", quant_backend="bnb-fp16",
             quantize_head=True, loss="lit-gpt", keep_logits="fp32"))
    # eager attention under recompute: the selectively re-run core's backward (38% low before it was a moment) and
    # the full-recompute forward's softmax (eager_attention_forward)
    add("eager attention, selective recompute, fp32 MHA, seq 512", dict(X, kv_heads=4, precision="fp32",
                                                                      attention="eager", recompute="selective"))
    add("eager attention, full recompute, pure bf16, seq 512", dict(X, precision="bf16", master_weights=False,
                                                                    attention="eager", recompute="full"))
    # the new presets at full size, one rank on the meta device: Pythia-1B's GPT-NeoX blocks under FSDP2 ZeRO-3 on 8,
    # and lit-gpt's phi-1.5 LoRA run of its resource table (docs/published-finetune.md row 22: mb 2, seq 1044)
    add("Pythia-1B (parallel blocks), FSDP2 ZeRO-3 bf16, world 8, seq 1024 (meta)",
        dict(model="pythia-1b", precision="bf16", gpus=8, zero=3, seq=1024), world="fake", device="meta")
    add("phi-1.5 lit-gpt LoRA q,v, Fabric fp32 logits, mb 2 x seq 1044 (meta)",
        dict(model="phi-1.5", precision="bf16", master_weights=False, lora_rank=8, lora_targets="qv",
             lora_dropout=0.05, qkv_impl="fused", loss="lit-gpt", keep_logits="fp32", seq=1044, micro_batch=2),
        world="fake", device="meta")
    # what outlives a backward: bitsandbytes keeps its linears' inputs on `ctx`, and lit-gpt's loop keeps `loss` (so
    # the graph) until the next micro-batch's loss: the steady-state forward holds the previous one's inputs
    # (graph_held_layer_bytes); and the run's first micro-batch (--peak-step first: no warm-up, no AdamW state yet)
    add("QLoRA nf4 bnb, lit-gpt loop: the previous graph's held inputs, seq 128", dict(
        Q, **LIT, seq=128, lora_targets="qv", lora_dropout=0.05, quantize_head=True, loss="lit-gpt",
        keep_logits="fp32"))
    add("first step (--peak-step first), single fp32: no AdamW state before its first step", dict(
        L, precision="fp32", peak_step="first"))
    add("first step, lit-gpt LoRA q,v, Fabric fp32 logits: no previous logits, pure bf16", dict(
        L, **LIT, precision="bf16", master_weights=False, lora_rank=4, lora_targets="qv", lora_dropout=0.05,
        loss="lit-gpt", keep_logits="fp32", peak_step="first"))
    # torch pipelining with one autocast region around `schedule.step()`: the weights' casts are cached from the
    # first micro-batch's forward, so their cast nodes run last in every later backward
    add("PP2 1F1B bf16 AMP full recompute", dict(L, precision="bf16", gpus=2, pp=2, grad_accum=4, recompute="full"))
    add("PP4 1F1B bf16 AMP full recompute, 8 micro-batches", dict(L, precision="bf16", gpus=4, pp=4, grad_accum=8,
                                                                  recompute="full"))
    # ... and where the weights outweigh the activations (short sequences, more layers): the end of a later
    # backward, every compute-dtype weight gradient waiting for its cast node, is the stage's highest moment
    W = dict(L, layers=8, hidden=128, ffn=352, seq=16)
    add("PP2 1F1B bf16 AMP full recompute, weight-heavy (seq 16)", dict(W, precision="bf16", gpus=2, pp=2,
                                                                        grad_accum=4, recompute="full"))
    add("PP2 1F1B bf16 AMP, weight-heavy (seq 16)", dict(W, precision="bf16", gpus=2, pp=2, grad_accum=4))
    add("PP4 1F1B bf16 AMP selective recompute, weight-heavy (seq 16), 8 micro-batches", dict(
        W, precision="bf16", gpus=4, pp=4, grad_accum=8, recompute="selective"))
    add("PP2 GPipe bf16 AMP, weight-heavy (seq 16)", dict(W, precision="bf16", gpus=2, pp=2, grad_accum=4,
                                                          schedule="gpipe"))
    add("PP2 interleaved vpp 2 bf16 AMP, weight-heavy (seq 16), 8 micro-batches", dict(
        W, precision="bf16", gpus=2, pp=2, vpp=2, grad_accum=8, schedule="interleaved"))
    # a later micro-batch's LM-head backward: the head's new weight gradient beside the accumulated .grad (a large
    # vocabulary, short sequences, plain SGD so that backward is the peak)
    V = dict(L, layers=2, vocab=8192, seq=8, grad_accum=2, optimizer="sgd")
    add("grad-accum 2, single fp32, vocab 8192, seq 8: the later LM head's weight gradient", dict(V, precision="fp32"))
    add("grad-accum 2, single bf16 AMP, vocab 8192, seq 8: and its cast", dict(V, precision="bf16"))
    add("grad-accum 2, DDP pure bf16, vocab 8192, seq 8", dict(V, precision="bf16", master_weights=False, gpus=2))
    # a tied LM head: its gradient waits in autograd's input buffer for the embedding's until backward ends
    add("tied embeddings, single fp32, vocab 8192, seq 8: the head's gradient held to the end of backward",
        dict(V, precision="fp32", grad_accum=1), {"tied_embeddings": True})
    add("tied embeddings, DDP bf16 AMP, grad-accum 2, vocab 8192, seq 8", dict(V, precision="bf16", gpus=2),
        {"tied_embeddings": True})
    # the first stage's embedding gradient at the end of a later backward, beside .grad (no autocast)
    add("PP2 1F1B fp32, vocab 8192, seq 16, SGD: the first stage's later embedding gradient", dict(
        W, vocab=8192, precision="fp32", gpus=2, pp=2, grad_accum=4, optimizer="sgd"))
    # FSDP2 ZeRO-3 with a root unit (embedding, head) far above a layer: the first layer's copy-out holds the
    # root's all-gather output beside its unsharded parameters; its reduce-scatter comes before its sharded grads
    add("fake FSDP2 ZeRO-3 fp32, world 2, vocab 8192, seq 8: the root's all-gather at the first layer",
        dict(V, precision="fp32", gpus=2, zero=3, grad_accum=1, optimizer="adamw"), world="fake", device="cpu")
    # FSDP2's root backward: the embedding's dense gradient beside the root's unsharded parameters and the head's
    # unsharded gradient (a tied head's held one and their out-of-place sum)
    add("fake FSDP2 ZeRO-3 fp32 SGD, tied embeddings, vocab 8192, seq 8: the embedding's backward", dict(
        V, precision="fp32", gpus=2, zero=3, grad_accum=1), {"tied_embeddings": True}, world="fake")
    add("fake FSDP2 ZeRO-3 bf16 AMP SGD, tied embeddings, grad-accum 2, vocab 8192, seq 8: a later one", dict(
        V, precision="bf16", gpus=2, zero=3), {"tied_embeddings": True}, world="fake")
    # the root's reduce-scatter output beside the head's gradient, which foreach_reduce's loop variable keeps
    add("fake FSDP2 ZeRO-3 bf16 AMP, world 2, vocab 8192, seq 8: the root's reduce-scatter output", dict(
        V, precision="bf16", gpus=2, zero=3, grad_accum=1, optimizer="adamw"), world="fake")
    # ZeRO-2 (reshard_after_forward=False) re-gathers every unit in each forward: the first layer's copy-out
    add("fake FSDP2 ZeRO-2 fp32 SGD, vocab 8192, seq 8: the first layer's copy-out", dict(
        V, precision="fp32", gpus=2, zero=2, grad_accum=1), world="fake")
    # weight-heavy layers (wide MLP, short sequences): a layer's backward copy-out and the end of its backward
    H = dict(L, layers=2, ffn=1024, vocab=256, seq=8)
    H3 = dict(L, layers=3, hidden=128, ffn=2048, vocab=256, seq=4)
    add("fake FSDP2 ZeRO-3 fp32 SGD, ffn 1024, seq 8: the second layer's backward copy-out", dict(
        H, precision="fp32", gpus=2, zero=3, optimizer="sgd"), world="fake")
    add("fake FSDP2 ZeRO-3 fp32 SGD, 3 layers, ffn 2048, seq 4: the end of a layer's backward", dict(
        H3, precision="fp32", gpus=2, zero=3, optimizer="sgd"), world="fake")
    add("fake FSDP2 ZeRO-2 fp32, grad-accum 2, 3 layers, ffn 2048, seq 4: the last layer's forward copy-out", dict(
        H3, precision="fp32", gpus=2, zero=2, grad_accum=2), world="fake")
    add("fake FSDP2 ZeRO-2 bf16 AMP, ffn 1024, seq 8: the post-backward reshards before its reduce-scatter", dict(
        H, precision="bf16", gpus=2, zero=2), world="fake")
    add("fake FSDP2 ZeRO-2 bf16 AMP, world 4, grad-accum 2, ffn 1024, seq 8: a later post-backward", dict(
        H, precision="bf16", gpus=4, zero=2, grad_accum=2), world="fake")
    # torch TP without FSDP2: the embedding's gradient is replicated at V x h (DTensor RowwiseParallel), and each
    # optimizer op that pairs it with the vocab-sharded parameter redistributes it to a fresh shard
    T = dict(V, precision="fp32", gpus=2, tp=2, grad_accum=1)
    add("fake TP2 fp32 SGD, vocab 8192, seq 8: the step's shard of the replicated embedding gradient", T,
        world="fake")
    add("fake TP2 fp32 fused AdamW, vocab 8192, seq 8: the fused step's shard", dict(
        T, optimizer="adamw", optimizer_impl="fused"), world="fake")
    add("fake TP2 fp32 SGD momentum, vocab 8192, seq 8: the replicated momentum buffer", dict(
        T, optimizer="sgd-momentum"), world="fake")
    add("fake TP2+SP bf16 AMP SGD, grad-accum 2, vocab 8192, seq 8: a later embedding gradient, whole", dict(
        T, precision="bf16", sp=True, grad_accum=2), world="fake")
    add("fake TP2 bf16 grads + fp32 master SGD, vocab 8192, seq 8: the replicated gradient's upcast", dict(
        T, precision="bf16", grad_dtype="bf16"), world="fake")
    add("fake TP2 ZeRO-3 fp32 AdamW on a TP-only mesh (no FSDP2), vocab 8192, seq 8: the replicated gradient",
        dict(T, zero=3, optimizer="adamw"), world="fake")
    # ... and FSDP2 x TP: the post-backward redistributes it to the shard, a clone beside the whole gradient
    add("fake FSDP2 ZeRO-3 x TP2 fp32 SGD, world 4, vocab 8192, seq 8: the root's replicated dense gradient", dict(
        T, gpus=4, zero=3), world="fake")
    # a later micro-batch's down projection: its new weight gradient beside .grad (wide MLP, 8 tokens)
    add("fake DDP fp32 SGD, grad-accum 2, ffn 1024, seq 8: a later layer's new weight gradient", dict(
        H, precision="fp32", gpus=2, optimizer="sgd", grad_accum=2), world="fake")
    add("single bf16 AMP SGD, grad-accum 2, ffn 1024, seq 8: and its fp32 cast", dict(
        H, precision="bf16", optimizer="sgd", grad_accum=2))
    add("fake TP2+SP bf16 AMP SGD, grad-accum 2, ffn 1024, seq 8: the same, sharded", dict(
        H, precision="bf16", gpus=2, tp=2, sp=True, optimizer="sgd", grad_accum=2), world="fake")
    # AMP: each finished layer of backward frees its autocast copies
    add("single bf16 AMP SGD, ffn 1024, seq 8: the last layer's backward, earlier layers' copies freed", dict(
        H, precision="bf16", optimizer="sgd"))
    # PP x TP (torchtitan's layout: each stage TP-sharded, loss_parallel on the last); `rank` picks the stage
    add("PP2 x TP2 1F1B fp32, last stage: loss_parallel's per-token indices", dict(
        L, precision="fp32", gpus=4, pp=2, tp=2, grad_accum=4, rank=2))
    add("PP2 x TP2+SP 1F1B fp32, first stage: the down projection's all-gathered gradient", dict(
        L, precision="fp32", gpus=4, pp=2, tp=2, sp=True, grad_accum=4, rank=0))
    add("PP2 x TP2+SP 1F1B bf16 AMP, first stage: the reduce-scatter's copy and the MLP's fp32 input", dict(
        L, precision="bf16", gpus=4, pp=2, tp=2, sp=True, grad_accum=4, rank=0))
    add("PP2 x TP2+SP 1F1B bf16 AMP selective recompute, first stage", dict(
        L, precision="bf16", gpus=4, pp=2, tp=2, sp=True, grad_accum=4, recompute="selective", rank=0))
    add("PP2 x TP2+SP 1F1B bf16 AMP full recompute, first stage: the embedding's gathered gradient", dict(
        L, precision="bf16", gpus=4, pp=2, tp=2, sp=True, grad_accum=4, recompute="full", rank=0))
    add("PP2 x TP2 GPipe bf16 AMP, first stage: the forward sends keep their outputs", dict(
        L, precision="bf16", gpus=4, pp=2, tp=2, grad_accum=4, schedule="gpipe", rank=0))
    add("PP2 x TP2+SP GPipe bf16 AMP, last stage", dict(
        L, precision="bf16", gpus=4, pp=2, tp=2, sp=True, grad_accum=4, schedule="gpipe", rank=3))
    add("PP2 GPipe bf16 AMP, first stage: the forward sends keep their outputs", dict(
        L, precision="bf16", gpus=2, pp=2, grad_accum=4, schedule="gpipe", rank=0))
    # PP x FSDP2: torch pipelining accumulates unsharded gradients over the step and reshards nothing after a
    # backward (PipelineStage.backward_maybe_with_nosync); m > 2 puts a forward between two backwards
    add("PP2 x FSDP2 ZeRO-3 fp32, m 4, first stage: the accumulated unsharded gradients", dict(
        L, precision="fp32", gpus=4, pp=2, zero=3, grad_accum=4, rank=0))
    add("PP2 x FSDP2 ZeRO-3 bf16, first stage: the fp32 accumulator beside the embedding's bf16 gradient", dict(
        L, precision="bf16", gpus=4, pp=2, zero=3, grad_accum=2, rank=0))
    add("PP2 x FSDP2 ZeRO-3 bf16 full recompute, m 4, last stage: the head's gradient waits for the root", dict(
        L, precision="bf16", gpus=4, pp=2, zero=3, grad_accum=4, recompute="full", rank=1))
    add("PP2 x FSDP2 ZeRO-2 fp32, m 4, first stage: no all-gather after the first backward", dict(
        L, precision="fp32", gpus=4, pp=2, zero=2, grad_accum=4, rank=0))
    add("PP2 GPipe x FSDP2 ZeRO-3 bf16, last stage: every unit still gathered from the previous backward", dict(
        L, precision="bf16", gpus=4, pp=2, zero=3, grad_accum=4, schedule="gpipe", rank=1))
    add("PP4 x FSDP2 ZeRO-3 bf16, m 8, first stage: a backward's copy-in", dict(
        L, precision="bf16", gpus=8, pp=4, zero=3, grad_accum=8, rank=0))
    add("PP2 x TP2+SP x FSDP2 ZeRO-3 bf16 (3-D), first stage: the replicated embedding gradient accumulated",
        dict(L, precision="bf16", gpus=8, pp=2, tp=2, sp=True, zero=3, grad_accum=4, rank=0))
    add("PP2 x TP2+SP x FSDP2 ZeRO-3 fp32 (3-D), last stage", dict(
        L, precision="fp32", gpus=8, pp=2, tp=2, sp=True, zero=3, grad_accum=4, rank=2))
    # DDP's rebuilt buckets, one all-reduce each, filled in gradient-ready order (comm._ddp_allreduce)
    add("DDP fp32 --bucket-cap-mb 0.1: 8 buckets in gradient-ready order", dict(
        L, precision="fp32", gpus=2, bucket_cap_mb=0.1))
    add("DDP bf16 AMP GQA, QKV biases, fused QKV, --bucket-cap-mb 0.05, grad-accum 2: 10 buckets", dict(
        GQA, precision="bf16", gpus=4, bucket_cap_mb=0.05, grad_accum=2, qkv_impl="fused"), {"qkv_bias": True})
    add("DDP pure bf16 GPT-2 block (tied, learned positions, biases), --bucket-cap-mb 0.05: 7 buckets", dict(
        P, precision="bf16", master_weights=False, gpus=2, bucket_cap_mb=0.05), gpt)
    add("ZeRO-1 fp32 --bucket-cap-mb 0.1: DDP's buckets under ZeroRedundancyOptimizer", dict(
        L, precision="fp32", gpus=2, zero=1, bucket_cap_mb=0.1))
    add("fake DDP fp32 SGD, h 512, vocab 16000: the default 1 MiB first bucket (the head alone), then 25 MiB: 4", dict(
        L, hidden=512, heads=8, ffn=2048, vocab=16000, seq=8, precision="fp32", gpus=8, optimizer="sgd"),
        world="fake")
    # PP x FSDP2 ZeRO-3, weight-heavy (wide MLP, 16 tokens): a backward's units stay gathered (timeline: the
    # copy-outs beside the finished units, 1F1B's cool-down with every unit gathered, a layer's compute-dtype
    # gradients before its post-backward adds them to the fp32 accumulator)
    WH = dict(L, hidden=128, ffn=1024, seq=16, gpus=4, pp=2, zero=3, recompute="full", rank=0)
    add("PP2 x FSDP2 ZeRO-3 fp32 full recompute, weight-heavy, m 4, first stage: a later backward's last copy-out",
        dict(WH, precision="fp32", grad_accum=4))
    add("PP2 x FSDP2 ZeRO-3 bf16 full recompute, weight-heavy, m 2, first stage: the cool-down, every unit gathered",
        dict(WH, precision="bf16", grad_accum=2))
    add("PP4 x FSDP2 ZeRO-3 bf16 full recompute, weight-heavy, 8 layers, m 4, first stage: the cool-down", dict(
        WH, layers=8, gpus=8, pp=4, precision="bf16", grad_accum=4))
    add("PP2 x FSDP2 ZeRO-3 bf16, weight-heavy, m 3, first stage: a steady-state backward, then the cool-down", dict(
        WH, precision="bf16", grad_accum=3, recompute="none"))
    add("LoRA r=4 all, bf16 base, DDP, --bucket-cap-mb 0.01: the adapters' buckets, B before A", dict(
        L, precision="bf16", lora_rank=4, lora_targets="all", gpus=2, bucket_cap_mb=0.01))
    # fp32 GQA runs SDPA's math fallback on CUDA (activations.eager_core; the harness runs its ops on the CPU,
    # model._sdpa_math): an eager core, which Ulysses runs on the whole sequence with half the heads (-40.1% while
    # its moments under CP were not derived; rows 240-241: two more eager cores under Ulysses)
    add("Ulysses cp 2, full recompute, fp32 GQA: SDPA's math fallback over the whole sequence",
        dict(U, precision="fp32", gpus=2, cp=2, recompute="full"))
    # a later layer's attention core under full recompute of an eager core: the step's peak (rows 100 and 116
    # were -3.4% and -0.7% before that moment was modelled)
    add("fp32 GQA (SDPA math fallback), full recompute, seq 512: the first layer's attention backward", dict(
        layers=2, hidden=128, heads=4, kv_heads=2, ffn=192, vocab=1000, seq=512, precision="fp32",
        recompute="full"))
    # interleaved, the last stage (the loss chunk) under autocast with a wide vocabulary: a later backward of the
    # loss chunk ends with its loss terms consumed and its logits counted once (+5.9% before; tests/test_validate.py)
    add("PP2 interleaved vpp 2 bf16 AMP, 1-layer chunks, vocab 8192: the loss chunk's later backward end", dict(
        layers=4, hidden=512, heads=8, kv_heads=2, ffn=1024, vocab=8192, seq=256, precision="bf16", gpus=2, pp=2,
        vpp=2, grad_accum=4, schedule="interleaved"))
    # torchtune's QLoRA layer (torchao's NF4 dequantization, eager: 8 n + 2 c n + c n / 64 bytes of temporaries
    # for n weights, activations.dequant_scratch; tests/test_torchao_nf4.py) under its recompute situations
    TQ = dict(Q, micro_batch=2, quant_backend="torchao")
    add("QLoRA nf4 torchao r=4 all + dropout, full recompute, fp32 norms: the re-run passes the down projection",
        dict(TQ, lora_targets="all", lora_dropout=0.05, recompute="full", norm_impl="fp32", keep_logits="fp32"))
    add("QLoRA nf4 torchao r=4 q,v, full recompute: the down projection's backward first, the re-run to the up one",
        dict(TQ, lora_targets="qv", recompute="full"))
    add("QLoRA nf4 torchao r=4 all, no recompute, fp32 norms: the down projection's dequantization",
        dict(TQ, lora_targets="all", norm_impl="fp32"))
    # torch's interleaved schedule in one round (m < 2 pp, params.interleave_rounds): every chunk's backwards
    # follow all of the later chunks' (tests/test_validate.py ONE_ROUND, INTERLEAVED_FSDP)
    IW = dict(layers=4, hidden=512, heads=8, kv_heads=2, ffn=1024, vocab=8192, seq=256, precision="bf16", gpus=2,
              pp=2, vpp=2, schedule="interleaved")
    add("PP2 interleaved vpp 2 bf16 AMP, m = pp (one round): the loss chunk's later backward, its gradients only",
        dict(IW, grad_accum=2))
    add("PP2 interleaved vpp 2 bf16 AMP, m 3 (torch's one round of 3 micro-batches)", dict(IW, grad_accum=3))
    add("PP2 interleaved vpp 2 bf16 SGD, weight-heavy, m = pp: the first chunk's later backward, every gradient",
        dict(IW, grad_accum=2, seq=32, vocab=256, optimizer="sgd"))
    add("PP4 interleaved vpp 2 bf16 AMP, m 2 < pp", dict(IW, layers=8, gpus=4, pp=4, grad_accum=2, seq=32,
                                                          vocab=256))
    add("PP2 interleaved vpp 2 bf16 SGD, weight-heavy (seq 256), m = pp: the first stage's later backward",
        dict(IW, grad_accum=2, vocab=256, optimizer="sgd"))
    add("PP2 interleaved vpp 2 bf16 SGD, weight-heavy, m 4: the first stage ends its steady state in the embedding's "
        "chunk", dict(IW, grad_accum=4, seq=32, vocab=256, optimizer="sgd"))
    add("PP2 interleaved vpp 2 x TP2 bf16, m 4", dict(IW, gpus=4, tp=2, grad_accum=4))
    add("PP2 interleaved vpp 2 x TP2+SP bf16, m 4", dict(IW, gpus=4, tp=2, sp=True, grad_accum=4))
    add("PP2 interleaved vpp 2 x TP2+SP x FSDP2 ZeRO-3 bf16 (3-D), m = pp", dict(IW, gpus=8, tp=2, sp=True, zero=3,
                                                                                  grad_accum=2))
    add("PP2 interleaved vpp 2 x FSDP2 ZeRO-2 bf16, m = pp", dict(IW, gpus=4, zero=2, grad_accum=2))
    add("PP2 interleaved vpp 2 x FSDP2 ZeRO-2 bf16 SGD, weight-heavy, m = pp: each chunk's REDUCE_GRAD",
        dict(IW, gpus=4, zero=2, grad_accum=2, seq=32, vocab=256, optimizer="sgd"))
    add("PP2 interleaved vpp 2 x FSDP2 ZeRO-3 bf16, m 4 (two rounds): the other chunk gathered",
        dict(IW, gpus=4, zero=3, grad_accum=4))
    add("PP2 interleaved vpp 2 x FSDP2 ZeRO-3 bf16 SGD, weight-heavy, m 8", dict(IW, gpus=4, zero=3, grad_accum=8,
                                                                                 seq=32, vocab=256, optimizer="sgd"))
    # torch TP with a tied LM head: the head's Shard(0) gradient and the embedding's Replicate one summed into a
    # shard at the end of backward (activations._tied_sum_bytes)
    TT = dict(layers=2, hidden=64, heads=4, ffn=176, vocab=512, seq=64, tied_embeddings=True, gpus=2, tp=2)
    add("TP2 fp32, tied head", dict(TT, precision="fp32"))
    add("TP2+SP bf16 AMP, tied head", dict(TT, precision="bf16", sp=True))
    add("TP2 fp32 SGD, tied head, weight-heavy (vocab 8192, seq 32), m 2: the tied sum", dict(
        TT, precision="fp32", vocab=8192, seq=32, optimizer="sgd", grad_accum=2))
    add("FSDP2 ZeRO-3 x TP2 bf16, tied head", dict(TT, precision="bf16", gpus=4, zero=3))
    # torch's uneven interleaved chunks (torchtitan's split over pp*vpp virtual stages, params.chunk_layers)
    add("PP2 interleaved vpp 2 bf16 AMP, 5 layers (chunks 1, 2, 1, 1), m = pp", dict(IW, layers=5, grad_accum=2))
    add("PP2 interleaved vpp 2 bf16 SGD, 6 layers (1, 2, 2, 1), weight-heavy, m = pp", dict(
        IW, layers=6, grad_accum=2, seq=32, vocab=256, optimizer="sgd"))
    add("PP2 interleaved vpp 2 bf16 AMP, 7 layers (1, 2, 2, 2), full recompute, m 4", dict(
        IW, layers=7, grad_accum=4, recompute="full"))
    add("PP2 interleaved vpp 2 x FSDP2 ZeRO-3 bf16, 7 layers, m 4", dict(IW, layers=7, gpus=4, zero=3, grad_accum=4))
    # --recompute-layers K: the first K layers of each stage (each model chunk when interleaved) checkpointed
    R = dict(IW, layers=8, grad_accum=4, recompute="full", recompute_layers=1)
    add("PP2 1F1B bf16 AMP, 8 layers, full recompute of 1 layer a stage, m 4, first stage",
        dict(R, schedule="1f1b", vpp=1, rank=0))
    add("PP2 1F1B bf16 AMP, 8 layers, full recompute of 1 layer a stage, m 4", dict(R, schedule="1f1b", vpp=1))
    add("PP2 interleaved vpp 2 bf16 AMP, 8 layers, full recompute of 1 layer a chunk, m 4", R)
    add("PP2 interleaved vpp 2 bf16 AMP, 7 layers (1, 2, 2, 2), selective recompute of 1 layer a chunk, m 4, first "
        "stage", dict(R, layers=7, recompute="selective", rank=0))
    # plain and checkpointed layers in one stage under AMP: the re-run's weight casts, the plain layers' kept ones,
    # each layer's moment with the sets above it freed; --recompute-every K (torchtitan's layer-level SAC)
    A = dict(layers=4, hidden=512, heads=8, kv_heads=2, ffn=1024, vocab=512, seq=1024, precision="bf16",
             recompute="full", optimizer="sgd")
    add("single bf16 AMP SGD, seq 1024, full recompute: the re-run's weight casts", A)
    add("single bf16 AMP SGD, seq 1024, full recompute of 3 of 4 layers", dict(A, recompute_layers=3))
    add("single fp32 SGD, seq 1024, full recompute of 3 of 4 layers", dict(A, recompute_layers=3, precision="fp32"))
    add("single bf16 AMP SGD, seq 1024, full recompute of every 2nd layer", dict(A, recompute_every=2))
    add("single bf16 AMP SGD, seq 1024, full recompute of every 3rd layer", dict(A, recompute_every=3))
    add("DDP bf16 AMP SGD, 6 layers, seq 1024, full recompute of every 2nd layer", dict(A, layers=6, gpus=2,
                                                                                       recompute_every=2))
    add("FSDP2 ZeRO-3 bf16 SGD, seq 1024, full recompute of every 2nd layer", dict(A, gpus=2, zero=3,
                                                                                  recompute_every=2))
    add("PP2 1F1B bf16 AMP, 8 layers, full recompute of every 2nd layer, m 4", dict(R, schedule="1f1b", vpp=1,
                                                                                    recompute_layers=None,
                                                                                    recompute_every=2))
    add("PP2 interleaved vpp 2 bf16 AMP, 8 layers, full recompute of every 2nd layer, m 4, first stage",
        dict(R, recompute_layers=None, recompute_every=2, rank=0))
    # a Gemma 2 layer (tied head, four norms a layer, GQA) with both of its softcaps, on eager attention as Hugging
    # Face trains it: the logits' and the scores' tanh outputs (tests/test_logit_softcap.py)
    G2 = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=2048, seq=256, precision="bf16",
              attention="eager", tied_embeddings=True, post_norms=True, final_logit_softcap=True,
              attn_softcap=True)
    add("single bf16 AMP, Gemma 2 layer: post norms, softcapped logits and eager scores", G2)
    add("TP2+SP bf16 AMP, Gemma 2 layer: post norms, softcapped logits and eager scores",
        dict(G2, gpus=2, tp=2, sp=True))
    add("FSDP2 ZeRO-3 bf16 AMP, Gemma 2 layer, selective recompute: softcapped logits and eager scores",
        dict(G2, gpus=2, zero=3, recompute="selective"))
    # activation-heavy: 3 layers of h 512 at 512 tokens, a 1000-token vocabulary and SGD, so that the step's peak is
    # a moment inside a layer's forward or backward (the rows above mostly peak at the loss or the optimizer step):
    # op-level SAC's re-run, autocast's casts beside TP's collectives, the LM head's backward on narrow vocabulary
    # shards, SDPA's math fallback for fp32 GQA (tests/test_validate_op_sac.py, test_validate_attention.py)
    AH = dict(layers=3, hidden=512, heads=8, ffn=1024, vocab=1000, seq=512, optimizer="sgd")
    add("activation-heavy: single fp32 GQA, op-level SAC", dict(AH, kv_heads=2, precision="fp32", recompute="op"))
    add("activation-heavy: single bf16 AMP GQA, op-level SAC", dict(AH, kv_heads=2, precision="bf16", recompute="op"))
    add("activation-heavy: single pure bf16 GQA, op-level SAC",
        dict(AH, kv_heads=2, precision="bf16", master_weights=False, recompute="op"))
    add("activation-heavy: TP2+SP bf16 AMP, op-level SAC", dict(AH, precision="bf16", recompute="op", gpus=2, tp=2,
                                                              sp=True))
    add("activation-heavy: TP2+SP pure bf16 GELU, op-level SAC",
        dict(AH, precision="bf16", master_weights=False, recompute="op", gpus=2, tp=2, sp=True), {"mlp": "gelu"})
    add("activation-heavy: TP4+SP bf16 AMP GQA, op-level SAC",
        dict(AH, kv_heads=4, precision="bf16", recompute="op", gpus=4, tp=4, sp=True))
    add("activation-heavy: TP4+SP fp32 GQA GELU (SDPA math), op-level SAC: the re-run core under SP",
        dict(AH, kv_heads=4, precision="fp32", recompute="op", gpus=4, tp=4, sp=True), {"mlp": "gelu"})
    add("activation-heavy: TP2+SP bf16 AMP, full recompute", dict(AH, precision="bf16", recompute="full", gpus=2, tp=2,
                                                                 sp=True))
    add("activation-heavy: TP2+SP bf16 AMP: the last layer's end before the head's cast",
        dict(AH, precision="bf16", gpus=2, tp=2, sp=True))
    add("activation-heavy: TP4+SP bf16 AMP GQA", dict(AH, kv_heads=4, precision="bf16", gpus=4, tp=4, sp=True))
    add("activation-heavy: TP4 bf16 AMP GQA GELU: the input projections' all-reduce",
        dict(AH, kv_heads=4, precision="bf16", gpus=4, tp=4), {"mlp": "gelu"})
    add("activation-heavy: single bf16 AMP GELU, V 256: the final norm beside the head's input gradient",
        dict(AH, vocab=256, precision="bf16"), {"mlp": "gelu"})
    add("activation-heavy: TP4 pure bf16 GQA, V 256: the head's backward on 64-token shards",
        dict(AH, kv_heads=4, vocab=256, precision="bf16", master_weights=False, gpus=4, tp=4))
    add("activation-heavy: single fp32 GQA (SDPA math), 1024 tokens", dict(AH, kv_heads=2, seq=1024, precision="fp32"))
    add("activation-heavy: single fp32 GQA (SDPA math) + dropout 0.1, 1024 tokens",
        dict(AH, kv_heads=2, seq=1024, precision="fp32", dropout=0.1))
    # eager cores under Ulysses (tests/test_validate_ulysses_eager.py): -10.8% / -38.5% before they were derived
    add("Ulysses cp 2, bf16 AMP eager attention + dropout 0.1", dict(U, precision="bf16", gpus=2, cp=2,
                                                                   attention="eager", dropout=0.1))
    add("Ulysses cp 2, fp32 GQA (SDPA math), op-level SAC", dict(U, precision="fp32", gpus=2, cp=2, recompute="op"))
    # moments found by a random search over validate's inputs (2026-11-29), each 0.5-12% off before
    # (tests/test_validate_attention.py, test_validate_mlp_backward.py)
    add("MQA, torchtune's expanded K/V: one KV head is a view, not a copy",
        dict(layers=3, hidden=128, heads=8, kv_heads=1, ffn=256, vocab=1000, seq=128, precision="bf16",
             optimizer="sgd", gqa_impl="expand"))
    add("lit-gpt fused QKV, GQA, selective recompute, 2 sequences: the o projection's copy alone",
        dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=176, vocab=256, seq=128, precision="fp32",
             recompute="selective", micro_batch=2, qkv_impl="fused"), {"norm": "layernorm"})
    RR = dict(layers=2, hidden=256, heads=4, kv_heads=2, ffn=176, vocab=256, seq=256, micro_batch=2, optimizer="sgd",
              recompute="full")
    add("bf16 AMP, full recompute, dropout 0.1: the re-run on through the output dropout", dict(RR, precision="bf16",
                                                                                            dropout=0.1))
    add("TP2+SP bf16 AMP, full recompute, dropout 0.1: the re-run's reduce-scatter", dict(
        RR, precision="bf16", dropout=0.1, gpus=2, tp=2, sp=True))
    add("TP2 fp32, full recompute, 512 tokens over h 256: SwiGLU up's input-gradient all-reduce", dict(
        RR, precision="fp32", gpus=2, tp=2))
    SR = dict(layers=3, hidden=256, heads=4, kv_heads=2, ffn=176, vocab=512, seq=128, precision="fp32",
              recompute="selective", optimizer="sgd")
    add("fp32 GQA (SDPA math), selective, 2 sequences: the re-run's own mask add", dict(SR, micro_batch=2))
    add("eager MHA fp32, selective + dropout, 2 sequences: the value matmul's copy of V", dict(
        SR, attention="eager", heads=8, kv_heads=8, seq=64, vocab=256, micro_batch=2, dropout=0.1))
    add("lit-gpt fused QKV fp32 MHA, full recompute: K's rotary in the forward", dict(
        layers=4, hidden=128, heads=4, kv_heads=4, ffn=176, vocab=256, seq=128, precision="fp32", recompute="full",
        micro_batch=2, optimizer="sgd", qkv_impl="fused"))
    return c


def build(opts: dict[str, Any], model: dict[str, Any]) -> Any:
    from memcalc.options import RunOptions, build_run

    run = build_run(RunOptions(**{k: v for k, v in opts.items() if k != "rank"}))
    if model:
        from memcalc.specs import ModelSpec, resolve

        m = ModelSpec(**{**run.model.model_dump(), **model})
        t = run.training
        from memcalc.specs import ParallelSpec

        p = ParallelSpec(gpus=run.gpus, tp=run.tp, pp=run.pp, zero=run.zero, sp=run.sp, schedule=run.schedule)
        run = resolve(m, t, p, run.hardware, run.profile)
    return run


def measure(run: Any, opts: dict[str, Any], world: str, device: str, timeout: float) -> tuple[dict[str, Any],
                                                                                          float | None]:
    """`validate` one row at the 2% bar: (report, the first run's error where the row was measured twice, else
    None). FSDP2 over a real gloo world is measured once more when it misses: gloo's worker thread may still hold
    the previous all-gather output when the next is allocated (the note at the top of docs/validation.md)."""
    from memcalc.validate.api import validate

    rank = opts.get("rank")  # default: the predicted worst rank
    rep = validate(run, device=device, world=world, tolerance=0.02, timeout=timeout, rank=rank)
    if abs(rep["error"] or 0) > 0.02 and world == "real" and opts.get("zero", 0) >= 2:
        return validate(run, device=device, world=world, tolerance=0.02, timeout=timeout, rank=rank), rep["error"]
    return rep, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "validation.md"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated row numbers (1-based)")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--from-json", default=None, help="re-render a previous --json dump without running")
    args = ap.parse_args(argv)

    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        if isinstance(data, list):  # older dumps: the rows alone
            tv = next((r["report"]["measured"]["torch_version"] for r in data if "report" in r), "?")
            data = {"results": data, "torch": tv, "seconds": sum(r["seconds"] for r in data)}
        Path(args.out).write_text(render(data["results"], data["torch"], data["seconds"]))
        print(f"wrote {args.out}")
        return 0

    import torch

    confs = configurations()
    picks = range(1, len(confs) + 1) if not args.only else [int(x) for x in args.only.split(",")]
    results = []
    t_all = time.perf_counter()
    for i in picks:
        label, opts, model, world, device = confs[i - 1]
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"id": i, "label": label, "world": world, "device": device, "opts": opts,
                                 "model": model}
        try:
            run = build(opts, model)
            entry["report"], first = measure(run, opts, world, device, args.timeout)
            if first is not None:
                entry["remeasured_from"] = first
        except Exception as e:  # noqa: BLE001 - a failed row is a result
            entry["failure"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        entry["seconds"] = time.perf_counter() - t0
        results.append(entry)
        rep = entry.get("report")
        status = (f"peak err {rep['error'] * 100:+.3f}%" if rep and rep["error"] is not None
                  else entry.get("failure", ""))
        print(f"[{i:2d}] {label:<58} {entry['seconds']:5.1f}s  {status}", flush=True)
    total = time.perf_counter() - t_all
    md = render(results, torch.__version__, total)
    Path(args.out).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "torch": torch.__version__, "seconds": total},
                                              indent=1, default=str))
    print(f"wrote {args.out} ({len(results)} rows, {total:.0f} s)")
    return 0


def _pct(e: float | None) -> str:
    return "n/a" if e is None else f"{e * 100:+.2f}%"


def _layout(opts: dict[str, Any], world: str) -> str:
    parts = [f"gpus {opts.get('gpus', 1)}"]
    for k in ("tp", "pp", "zero"):
        if opts.get(k):
            parts.append(f"{k} {opts[k]}")
    if opts.get("sp"):
        parts.append("sp")
    return ", ".join(parts)


def published_section() -> list[str]:
    """Every published measurement memcalc is compared with (the cases of tests/test_published_peaks.py and
    tests/test_published_finetune.py), its source and memcalc's error, recomputed from the current cost model."""
    from tests import test_published_finetune as ft
    from tests import test_published_peaks as pk

    def source(sources: dict[str, str], case_id: str) -> str:
        return next(v for k, v in sorted(sources.items(), key=lambda kv: -len(kv[0])) if case_id.startswith(k))

    rows = []  # (source, case, measured, unit, figure, predicted, tolerance)
    for p in pk.SIMUMAX + pk.TORCHTITAN:
        case, measured, predict = p.values if hasattr(p, "values") else p
        figure = "allocated" if case.startswith("simumax") else "reserved"
        rows.append((source(pk.SOURCES, case), case, measured, "GiB", figure, predict(), pk.TOLERANCE))
    for c in ft.CASES:
        rows.append((source(ft.SOURCES, c.id), c.id, c.published, c.unit, c.figure, ft.memcalc_value(c),
                     c.tolerance))
    within = sum(abs(pred - meas) / meas <= tol for *_, meas, _u, _f, pred, tol in rows)
    out = ["## Published measurements", "",
           f"Every published per-GPU figure memcalc is compared with, recomputed when this page was generated: "
           f"{within} of {len(rows)} within their bar (3% for measurements, 25% for the LLaMA-Factory estimates). "
           "Error = (memcalc - published) / published. Configurations, and what is missing where a row misses: "
           "docs/published-measurements.md (Megatron-LM, torchtitan) and docs/published-finetune.md (single-GPU "
           "fine-tuning); tests: tests/test_published_peaks.py, tests/test_published_finetune.py.", ""]
    last = None
    for src, case, meas, unit, figure, pred, tol in rows:
        if src != last:
            if last is not None:
                out.append("")
            out += [f"Source: {src}", "", "| case | counter | published | memcalc | error | within |",
                    "| --- | --- | ---: | ---: | ---: | --- |"]
            last = src
        err = (pred - meas) / meas
        out.append(f"| {case} | {figure} | {meas:g} {unit} | {pred:.2f} {unit} | {err * 100:+.2f}% | "
                   f"{'yes' if abs(err) <= tol else 'no'} |")
    out.append("")
    return out


def render(results: list[dict[str, Any]], torch_version: str, total_s: float) -> str:
    comps = ("params", "grads", "optimizer", "activations", "buffers")
    out = ["# Validation: predicted vs measured", "",
           "Generated by `scripts/validation_matrix.py` (do not edit by hand). Each row builds the configuration in",
           "torch with the `torch` profile's APIs (memcalc/validate), runs 2 warm-up steps and 1 measured step, and",
           "compares the exact live bytes of the measured rank (a TorchDispatchMode over every storage, with",
           "`UntypedStorage.resize_` wrapped for FSDP2) with `memcalc estimate` for that rank's stage.",
           "The tracker skips what owns no memory: wrapper tensor subclasses (functional collectives'",
           "`AsyncCollectiveTensor`, whose placeholder storage has no data) and the global-shape fake tensors DTensor",
           "builds to propagate shapes (visible under `--device meta`). Under `--device meta` a functional",
           "collective's `wait_tensor` returns a new tensor where a device returns its input: the tracker carries the",
           "input's allocation over to it (before 2026-11-27 a fake run held each collective's output twice for a",
           "moment: TP 2 + SP, forward 0.3% above the same run over gloo). TP runs use DTensor's `loss_parallel` on",
           "vocab-sharded logits (torchtitan's default), pipelined or not (the last stage's output is a DTensor and",
           "the schedule's step runs inside `loss_parallel()`, as torchtitan's does). gloo's reduce-scatter copies its input internally (NCCL does not): that copy is not",
           "counted. Real gloo worlds are not fully deterministic: gloo's worker thread may still hold the previous",
           "FSDP2 all-gather output when the next one is allocated, so an FSDP2 ZeRO-3 row can measure one flat",
           "all-gather buffer more from run to run (seen on row 27: 3,809,324 or 3,875,372 bytes; row 63: "
           "2,201,036 or 2,227,916). Since 2026-11-28 the tracker notes every storage freed off the main thread,",
           "and `validate` measures a run again where such bytes are live at its peak, keeping the lower peak",
           "(`late_free_bytes`, docs/json.md). Under `--device meta` functional collectives wait at once (torch",
           "waits on them when a FakeTensorMode is active), where a device defers the wait to the output's first use",
           "and the process group keeps the collective's input until then: under AMP with SP and a checkpointed",
           "layer, autocast's cast of the output gradient, all-gathered before the layer's re-run, lives through the",
           "re-run over gloo (+256 KiB, -0.6% on the activation-heavy rows with recompute) and is freed at once on",
           "meta, which memcalc follows. NCCL's work stashes its inputs until the wait (ProcessGroupNCCL's",
           "`stashed_for_allocator_safety_`), so a GPU run is expected to measure what gloo does: not measured yet.",
           "Activation offloading (`--offload-activations`, memcalc/validate/offload.py) copies each block's saved",
           "storages to untracked host memory (pinned on CUDA) and reloads them one block ahead in backward.",
           "",
           f"- Device: CPU ({platform.machine()}, {platform.system()}), torch {torch_version}, Python "
           f"{platform.python_version()}; every row below ran on the CPU (real gloo worlds, or one rank of a fake "
           "process group; `meta` = FakeTensorMode, no real memory).",
           "- GPU rows: the section \"On a GPU (CUDA)\" below, from the records of `scripts/gpu_validation.py` "
           "(`memcalc validate --device cuda` on an H100 and an H200: `max_memory_allocated` / `max_memory_reserved` per "
           "phase beside the tracked bytes).",
           "- Set aside on CPU (GPU-only terms of the prediction): fragmentation, runtime overhead, cuBLAS "
           "workspaces.",
           "- Errors are (predicted - measured) / measured. Component errors compare the breakdown at each side's "
           "own peak moment; `states` says whether params, master weights, grads and optimizer state (measured "
           "directly) equal the prediction to the byte; `comm` whether every collective's bytes per step do, and "
           "with activation offloading the bytes copied to and from the host (counted by the harness's "
           "BlockOffload, one row per direction).",
           f"- Wall time for the matrix: {total_s:.0f} s (2 CPU cores).",
           "",
           "Run one configuration: `memcalc validate --layers 4 --hidden 64 --heads 4 --ffn 176 --vocab 512 --seq 64 "
           "--precision fp32 --gpus 2 --zero 3 --device cpu` (add `--world fake --gpus 1024 --device meta` for one "
           "rank of a large job; `--json` for the machine-readable comparison). Regenerate this page: "
           "`.venv/bin/python scripts/validation_matrix.py` (CI pins torch==2.13.0).",
           "",
           "What the harness builds (memcalc/validate/model.py): embedding (+ learned positions), per block "
           "norm -> separate q/k/v -> rotary (rotate-half, cos/sin in the activation dtype) -> SDPA (is_causal, "
           "enable_gqa) or eager softmax attention (additive causal bias) -> o -> residual -> norm -> SwiGLU or "
           "GELU(tanh) MLP, or a mixture of experts (Hugging Face's MixtralSparseMoeBlock, round-robin "
           "routing for balance, optional shared experts; ep = tp = 1) -> residual (parallel blocks: "
           "mlp(norm2 x or the shared norm's output) + attn(norm1 x) + x, GPT-NeoX's order); dropout as CUDA's "
           "native_dropout (bool masks); attention dropout inside SDPA as CUDA's fused kernels do it, saving "
           "nothing s x s (on the CPU, whose flash kernel takes no dropout, the kernel runs without it rather than "
           "SDPA's math fallback); "
           "final norm, LM head, fp32 cross-entropy. Layouts: DDP, DDP + ZeroRedundancyOptimizer (ZeRO-1), FSDP2 "
           "fully_shard per block (ZeRO-2: reshard_after_forward=False; ZeRO-3: default) with "
           "MixedPrecisionPolicy(bf16, reduce fp32), DTensor TP (+SequenceParallel), FSDP2 x TP, "
           "torch.distributed.pipelining GPipe / 1F1B / interleaved 1F1B, PP x TP (+SP, x FSDP2: torchtitan's 3-D "
           "layout; interleaved, each model chunk parallelized on its own), all-to-all context parallelism (DeepSpeed-Ulysses' "
           "exchange of Q, K, V and the output with gloo's all_to_all_single, over DDP or FSDP2 on dp x cp); "
           "AMP autocast, pure bf16, bf16 params with an fp32 master "
           "copy; AdamW / Adam / SGD; non-reentrant checkpointing per block (full) or around the attention core "
           "(selective); block-by-block activation offloading; LoRA adapters on bf16 or NF4 base linears (packed "
           "4-bit codes and absmax as QLoRA stores them, dequantized around each matmul with bitsandbytes' or "
           "torchao's autograd semantics, and through fp16 for bnb-fp16); the full loss, torchtune's "
           "chunked loss eager or compiled (the "
           "compiled per-chunk cross-entropy stands in for inductor's kernels: it saves what they save, "
           "tests/test_chunked_loss.py) and lit-gpt's loss (128-token head pieces, logits kept by the loop, "
           "upcast to fp32 as Lightning Fabric returns them with --keep-logits fp32); a loop that keeps the full "
           "loss's logits to the next forward (--keep-logits).",
           "",
           "Measured kinds (`components_detail`): params, master_weights, grads, optimizer (moments and step "
           "scalars), activations (allocated in forward), compute_copies (autocast casts of weights), "
           "sharded_buffers (FSDP2 unsharded parameters), persistent_buffers (live since before the step: DDP "
           "buckets, pipeline receive buffers), backward_temporaries, optimizer_temporaries. The last five are "
           "compared with the prediction's `buffers`.",
           ""]
    ok = [r for r in results if "report" in r]
    errs = [abs(r["report"]["error"]) for r in ok if r["report"]["error"] is not None]
    states_exact = sum(all(x["verdict"] == "exact" for x in r["report"]["rows"] if x["section"] == "model_states")
                       for r in ok)
    comm_exact = sum(all(c["bytes_exact"] for c in r["report"]["collectives"]) for r in ok)
    out.append("## Summary")
    out.append("")
    out.append(f"- Configurations: {len(results)}; ran: {len(ok)}; failed to run: {len(results) - len(ok)}.")
    if errs:
        out.append(f"- Total peak |error|: max {max(errs) * 100:.2f}%, median {statistics.median(errs) * 100:.2f}%, "
                   f"mean {statistics.mean(errs) * 100:.2f}%; within 2%: {sum(e <= 0.02 for e in errs)} of "
                   f"{len(errs)}; within 0.5%: {sum(e <= 0.005 for e in errs)}.")
    out.append(f"- Model states equal to the byte: {states_exact} of {len(ok)}. Collective bytes equal to the byte: "
               f"{comm_exact} of {len(ok)}.")
    for comp in comps:
        ce = []
        for r in ok:
            row = next(x for x in r["report"]["rows"] if x["section"] == "peak_components" and x["name"] == comp)
            if row["error"] is not None:
                ce.append(abs(row["error"]))
        if ce:
            out.append(f"- `{comp}` at the peak: max |error| {max(ce) * 100:.2f}%, median "
                       f"{statistics.median(ce) * 100:.2f}% ({sum(e == 0 for e in ce)} exact).")
    out.append("")
    out.append("## Rows")
    out.append("")
    head = ["#", "configuration", "layout", "world", "device", "rank", "predicted peak", "measured peak", "error",
            "peak phase (pred / meas)"] + [f"{c} err" for c in comps] + ["states", "comm", "s"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for r in results:
        if "report" not in r:
            out.append(f"| {r['id']} | {r['label']} | {_layout(r['opts'], r['world'])} | {r['world']} | "
                       f"{r['device']} | - | - | - | failed: {r['failure'].replace('|', '/')} |" + " |" * (len(head) - 9))
            continue
        rep = r["report"]
        rows = {(x["section"], x["name"]): x for x in rep["rows"]}
        cells = [str(r["id"]), r["label"], _layout(r["opts"], r["world"]), r["world"], r["device"], str(rep["rank"]),
                 f"{rep['predicted']['peak_bytes']:,}", f"{rep['measured']['peak_bytes']:,}", _pct(rep["error"]),
                 f"{rep['predicted']['peak_phase']} / {rep['measured']['peak_phase']}"]
        for comp in comps:
            x = rows[("peak_components", comp)]
            cells.append("exact" if x["verdict"] == "exact" else _pct(x["error"]))
        st = all(x["verdict"] == "exact" for x in rep["rows"] if x["section"] == "model_states")
        cm = all(c["bytes_exact"] for c in rep["collectives"])
        cells += ["exact" if st else "differs", "exact" if cm else "differs",
                  f"{r['seconds']:.1f}" + (" (2 runs)" if "remeasured_from" in r else "")]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    from gpu_validation import record_section  # scripts/ (this script's folder)

    cuda = record_section()
    out += cuda + ([""] if cuda else [])
    out += published_section()
    out.append("## Details of the rows that differ")
    out.append("")
    for r in results:
        if "report" not in r:
            continue
        rep = r["report"]
        # (the allocator replay's reserved figure is informative, not a measurement: not listed)
        bad = [x for x in rep["rows"] if x["verdict"] != "exact" and x["section"] != "allocator_replay"]
        # host copies: memcalc counts one call per micro-batch, the harness one per storage; bytes are compared
        badc = [c for c in rep["collectives"] if not c["bytes_exact"]
                or (c["predicted_calls"] != c["measured_calls"] and c["op"] != "host-copy")]
        if not bad and not badc:
            continue
        out.append(f"**{r['id']}. {r['label']}** (rank {rep['rank']}, stage {rep['stage']})")
        out.append("")
        for x in bad:
            out.append(f"- {x['section']} `{x['name']}`: predicted {x['predicted']:,}, measured {x['measured']:,} "
                       f"({_pct(x['error'])})")
        for c in badc:
            out.append(f"- {c['op']} on {c['group']}: predicted {c['predicted_calls']} calls / "
                       f"{c['predicted_bytes']:,} B, measured {c['measured_calls']} calls / {c['measured_bytes']:,} B "
                       f"(dtypes {','.join(c['predicted_dtypes']) or '-'} / {','.join(c['measured_dtypes']) or '-'})")
        if "remeasured_from" in r:
            out.append(f"- measured twice: the first run gave {_pct(r['remeasured_from'])} (gloo's worker thread "
                       "held one more all-gather output; the note at the top of the page)")
        md = rep["measured"]["components_detail"]
        out.append("- measured at the peak, by kind: " + ", ".join(f"{k} {v:,}" for k, v in md.items() if v))
        out.append("")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
