"""`memcalc validate --device cuda` over real-size configurations on one GPU, and the CUDA section of
docs/validation.md.

    python scripts/gpu_validation.py --json $OUT/cuda.json --budget 300      # on a machine with a GPU
    python scripts/gpu_validation.py --from-json docs/data/validation-cuda.json   # print the markdown section

Each configuration runs 2 warm-up steps and 1 measured step in the harness (memcalc/validate) on CUDA: one real
rank for single-GPU runs, or one rank of a fake process group of the full world (real CUDA tensors, collectives
that move nothing) for a multi-GPU layout. Per phase it records `torch.cuda.max_memory_allocated()` (the peak is
reset as the phase starts) and `max_memory_reserved()`, beside the harness's exact tracked tensor bytes; the
prediction is `memcalc estimate` for the same run, GPU terms included (cuBLAS workspaces; fragmentation for the
reserved figure). A probe first records the facts of this GPU and torch build that the cost model assumes.

The JSON written on the GPU machine is kept as docs/data/validation-cuda.json (H100; rows 32-47 and reruns of 4, 8
and 11 as docs/data/validation-cuda-h200.json, run on an H200 with `--only`; rows 48-59 as
docs/data/validation-cuda-3.json, an H100 again); scripts/validation_matrix.py renders them into docs/validation.md
(`record_section`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from memcalc.validate.compare import phase_allocated  # noqa: E402
RECORD = ROOT / "docs" / "data" / "validation-cuda.json"

# torchtune's LoRA tutorial recipe (tests/test_published_finetune.py TT7), with grad-accum 2 instead of 64: the
# peak is a micro-batch's, the figure the same, the run 32 times shorter
TT7 = dict(model="llama-2-7b", precision="bf16", master_weights=False, optimizer="adamw", gpu="h100-sxm", seq=512,
           micro_batch=2, recompute="full", loss="full", norm_impl="fp32", grad_accum=2, lora_dropout=0.05,
           keep_logits="fp32")
# lit-gpt finetune/lora.py on Alpaca's longest sample (tests/test_published_finetune.py LIT)
LIT = dict(precision="bf16", master_weights=False, optimizer="adamw", lora_rank=8, lora_targets="qv",
           lora_dropout=0.05, norm_impl="fp32", qkv_impl="fused", gpu="h100-sxm", seq=1304, loss="lit-gpt",
           recompute="none", keep_logits="fp32", peak_step="first")
# torchtune's llama3_2/3B_full_single_device recipe (tests/test_published_finetune.py TT3)
TT3 = dict(model="llama-3.2-3b", precision="bf16", master_weights=False, optimizer="adamw", gpu="h100-sxm", seq=4096,
           micro_batch=2, norm_impl="fp32", gqa_impl="expand")
# a Llama-shaped 4-layer model, wide enough that allocator rounding is noise
MID = dict(layers=4, hidden=2048, heads=16, kv_heads=8, ffn=5632, vocab=32000, seq=2048, micro_batch=2,
           gpu="h100-sxm")
MID_H200 = dict(MID, gpu="h200")
# the same layers with a 512-token vocabulary and one sequence of 2048: the loss no longer hides the layers' own
# moments (forward and backward)
SMALL_VOCAB = dict(MID, vocab=512, micro_batch=1)
LORA_ALL = dict(precision="bf16", master_weights=False, lora_rank=16, lora_targets="all")


def configurations() -> list[tuple[str, dict[str, Any], str, str | None]]:
    """(label, RunOptions kwargs, world, published case it reproduces or None), most telling first: the script
    stops starting new ones when its budget runs out."""
    return [
        ("torchtune Llama-2-7B LoRA r=8 q,v, bf16, full AC, mb 2 x seq 512", dict(TT7, lora_rank=8, lora_targets="qv"),
         "real", "torchtune-llama2-7b-lora-qv-r8"),
        ("Llama-2-7B FSDP2 ZeRO-3 bf16 mixed precision, 8 GPUs, seq 4096, full AC",
         dict(model="llama-2-7b", gpus=8, zero=3, precision="bf16", seq=4096, recompute="full", gpu="h100-sxm"),
         "fake", None),
        ("lit-gpt Llama-2-7B LoRA r=8 q,v, bf16, mb 1 x seq 1304", dict(LIT, model="llama-2-7b", micro_batch=1),
         "real", "litgpt-llama2-7b-lora-mb1"),
        ("4-layer h2048 GQA, single GPU, bf16 AMP (fp32 params, autocast)", dict(MID, precision="bf16"), "real", None),
        ("4-layer h2048 GQA, single GPU, pure bf16", dict(MID, precision="bf16", master_weights=False), "real", None),
        ("4-layer h2048 GQA, single GPU, bf16 AMP, selective recompute", dict(MID, precision="bf16",
                                                                                recompute="selective"), "real", None),
        ("4-layer h2048 GQA, single GPU, pure bf16, eager attention + dropout 0.1",
         dict(MID, precision="bf16", master_weights=False, attention="eager", dropout=0.1), "real", None),
        ("Llama-2-7B TP 4 + SP, bf16 AMP, seq 4096", dict(model="llama-2-7b", gpus=4, tp=4, sp=True, precision="bf16",
                                                        seq=4096, gpu="h100-sxm"), "fake", None),
        ("4-layer h2048 GQA, DDP bf16 AMP, 8 GPUs", dict(MID, precision="bf16", gpus=8), "fake", None),
        ("4-layer h2048 GQA, ZeRO-1 bf16 AMP, 8 GPUs", dict(MID, precision="bf16", gpus=8, zero=1), "fake", None),
        ("torchtune Llama-3.2-3B full fine-tune, pure bf16, mb 2 x seq 4096", dict(TT3, recompute="none", loss="full"),
         "real", "torchtune-llama3.2-3b-full-packed"),
        ("Llama-2-7B FSDP2 ZeRO-2 bf16 mixed precision, 8 GPUs, seq 2048",
         dict(model="llama-2-7b", gpus=8, zero=2, precision="bf16", seq=2048, gpu="h100-sxm"), "fake", None),
        ("Llama-2-7B FSDP2 ZeRO-3 x TP 2 + SP, 16 GPUs, seq 4096, full AC",
         dict(model="llama-2-7b", gpus=16, tp=2, sp=True, zero=3, precision="bf16", seq=4096, recompute="full",
              gpu="h100-sxm"), "fake", None),
        ("Llama-3.1-8B FSDP2 ZeRO-3, 8 GPUs, seq 8192, full AC (128k vocabulary)",
         dict(model="llama-3.1-8b", gpus=8, zero=3, precision="bf16", seq=8192, recompute="full",
              gpu="h100-sxm"), "fake", None),
        ("GPT-2 XL, bf16 AMP, eager attention + dropout 0.1, mb 2 x seq 1024",
         dict(model="gpt2-xl", precision="bf16", attention="eager", dropout=0.1, micro_batch=2, seq=1024,
              gpu="h100-sxm"), "real", None),
        ("4-layer h2048 MHA, single GPU, fp32", dict(MID, kv_heads=16, precision="fp32"), "real", None),
        ("4-layer h2048 GQA, single GPU, fp32", dict(MID, precision="fp32"), "real", None),
        ("4-layer h2048 GQA, 8 experts top-2, single GPU, bf16 AMP",
         dict(MID, experts=8, top_k=2, expert_ffn=1408, precision="bf16"), "real", None),
        ("4-layer h2048 GQA, pure bf16, full recompute, activation offloading",
         dict(MID, precision="bf16", master_weights=False, recompute="full", offload_activations=True),
         "real", None),
        # a lower layer's attention backward under full recompute (timeline: a later layer's attention core)
        ("Llama-3.2-1B, pure bf16, eager attention, full recompute, mb 4 x seq 4096",
         dict(model="llama-3.2-1b", precision="bf16", master_weights=False, attention="eager", recompute="full",
              micro_batch=4, seq=4096, gpu="h100-sxm"), "real", None),
        ("4-layer h2048 GQA, single GPU, fp32, full recompute", dict(MID, precision="fp32", recompute="full"),
         "real", None),
        # rows 22-31: what the first GPU session did not run. GPT-2's attention dropout inside SDPA: CUDA's fused
        # kernels keep their RNG state, nothing s x s (the assumption the CPU harness mirrors)
        ("GPT-2 124M, bf16 AMP, flash attention + dropout 0.1, mb 8 x seq 1024",
         dict(model="gpt2", precision="bf16", micro_batch=8, seq=1024, gpu="h100-sxm"), "real", None),
        # torchtune's QLoRA tutorial recipe (published-finetune D) with grad-accum 2: the training step alone
        ("torchtune Llama-2-7B QLoRA (NF4, torchao) r=8 all, bf16, full AC, mb 2 x seq 512",
         dict(TT7, lora_rank=8, lora_targets="all", base_dtype="nf4", quant_backend="torchao"), "real",
         "torchtune-llama2-7b-qlora"),
        # torchtune README rows 14-15 (Llama 3.2 3B, packed 4096, compiled chunked loss, fused AdamW)
        ("torchtune Llama-3.2-3B full, fused AdamW, chunked loss, full AC, mb 2 x seq 4096",
         dict(TT3, recompute="full", loss="chunked", optimizer_impl="fused"), "real",
         "torchtune-llama3.2-3b-full-compile-chunkedce-ac"),
        ("torchtune Llama-3.2-3B LoRA r=64 q,v,o + MLP, chunked loss, full AC, activation offloading",
         dict(TT3, recompute="full", loss="chunked", optimizer_impl="fused", lora_rank=64,
              lora_targets="q_proj,v_proj,output_proj,mlp", offload_activations=True), "real",
         "torchtune-llama3.2-3b-lora-r64"),
        ("4-layer h2048 GQA, Ulysses CP 2 (all-to-all), bf16 AMP, seq 8192", dict(MID, precision="bf16", gpus=2,
                                                                                 cp=2, cp_comm="a2a", seq=8192,
                                                                                 micro_batch=1), "fake", None),
        ("4-layer h2048 GQA, single GPU, bf16 AMP, fused AdamW", dict(MID, precision="bf16", optimizer_impl="fused"),
         "real", None),
        ("DeepSeek-V2-Lite, 3 layers (MLA, 1 dense + 2 MoE of 64 experts top-6), pure bf16, seq 2048",
         dict(model="deepseek-v2-lite", layers=3, precision="bf16", master_weights=False, seq=2048,
              gpu="h100-sxm"), "real", None),
        ("Llama-2-7B TP 4 without SP, bf16 AMP, seq 4096", dict(model="llama-2-7b", gpus=4, tp=4, sp=False,
                                                                precision="bf16", seq=4096, gpu="h100-sxm"),
         "fake", None),
        ("Llama-3.2-1B, pure bf16, SGD momentum, selective recompute, mb 4 x seq 4096",
         dict(model="llama-3.2-1b", precision="bf16", master_weights=False, optimizer="sgd", recompute="selective",
              micro_batch=4, seq=4096, gpu="h100-sxm"), "real", None),
        # lit-gpt's QLoRA (bitsandbytes nf4-dq through fp16, the head quantized too; published-finetune row 4)
        ("lit-gpt Llama-2-7B QLoRA (bnb.nf4-dq) r=8 q,v, bf16, mb 1 x seq 1304",
         dict(LIT, model="llama-2-7b", micro_batch=1, base_dtype="nf4", quantize_head=True,
              quant_backend="bnb-fp16"), "real", "litgpt-llama2-7b-qlora-nf4-dq"),
        # rows 32-41: first run on an H200 (docs/data/validation-cuda-h200.json): what sessions without a GPU added
        # (mixed recompute, a checkpointed last layer's forward, TP under full recompute), fp16 with a GradScaler,
        # the GPT-NeoX layer, a 152k vocabulary with QKV biases, and a run too large for an 80 GB card
        ("4-layer h2048 GQA, bf16 AMP, full recompute on 2 of 4 layers", dict(MID_H200, precision="bf16",
                                                                             recompute="full", recompute_layers=2),
         "real", None),
        ("4-layer h2048 GQA, pure bf16, fp32 norms, full recompute",
         dict(MID_H200, precision="bf16", master_weights=False, norm_impl="fp32", recompute="full"), "real", None),
        ("4-layer h2048 GQA, fp16 AMP (GradScaler)", dict(MID_H200, precision="fp16"), "real", None),
        ("Llama-2-7B TP 2 + SP, bf16 AMP, seq 4096, full AC",
         dict(model="llama-2-7b", gpus=2, tp=2, sp=True, precision="bf16", seq=4096, recompute="full", gpu="h200"),
         "fake", None),
        ("Llama-3.1-8B full fine-tune, pure bf16, full AC, mb 1 x seq 8192 (over 80 GB)",
         dict(model="llama-3.1-8b", precision="bf16", master_weights=False, recompute="full", seq=8192,
              micro_batch=1, gpu="h200"), "real", None),
        ("Llama-2-7B FSDP2 ZeRO-3, 8 GPUs, seq 4096, full AC on 16 of 32 layers",
         dict(model="llama-2-7b", gpus=8, zero=3, precision="bf16", seq=4096, recompute="full", recompute_layers=16,
              gpu="h200"), "fake", None),
        ("Qwen2.5-7B, 4 layers (QKV bias, 152k vocabulary), pure bf16, seq 4096",
         dict(model="qwen2.5-7b", layers=4, precision="bf16", master_weights=False, seq=4096, micro_batch=1,
              gpu="h200"), "real", None),
        ("Pythia-1B (GPT-NeoX parallel residual, partial rotary), bf16 AMP, mb 4 x seq 2048",
         dict(model="pythia-1b", precision="bf16", micro_batch=4, seq=2048, gpu="h200"), "real", None),
        ("4-layer h2048 GQA, bf16 AMP, K/V expanded to every head", dict(MID_H200, precision="bf16",
                                                                        gqa_impl="expand"), "real", None),
        ("4-layer h2048 GQA, pure bf16, eager attention + dropout 0.1, selective recompute",
         dict(MID_H200, precision="bf16", master_weights=False, attention="eager", dropout=0.1,
              recompute="selective"), "real", None),
        # rows 42-47 (H200): whole models under full or selective recompute on one GPU, where the optimizer step is
        # the compute stream's peak: how the first step's segments serve the later steps (fragmentation.py)
        ("Llama-2-7B full fine-tune, pure bf16, full AC, mb 1 x seq 4096",
         dict(model="llama-2-7b", precision="bf16", master_weights=False, recompute="full", seq=4096, micro_batch=1,
              gpu="h200"), "real", None),
        ("Llama-3.2-3B, bf16 AMP (fp32 params), full AC, mb 1 x seq 4096",
         dict(model="llama-3.2-3b", precision="bf16", recompute="full", seq=4096, micro_batch=1, gpu="h200"),
         "real", None),
        ("Llama-3.1-8B full fine-tune, pure bf16, full AC, mb 1 x seq 2048",
         dict(model="llama-3.1-8b", precision="bf16", master_weights=False, recompute="full", seq=2048,
              micro_batch=1, gpu="h200"), "real", None),
        ("Qwen2.5-7B full fine-tune, pure bf16, full AC, mb 1 x seq 4096",
         dict(model="qwen2.5-7b", precision="bf16", master_weights=False, recompute="full", seq=4096, micro_batch=1,
              gpu="h200"), "real", None),
        ("Llama-3.2-1B, bf16 AMP (fp32 params), full AC, mb 2 x seq 2048",
         dict(model="llama-3.2-1b", precision="bf16", recompute="full", seq=2048, micro_batch=2, gpu="h200"),
         "real", None),
        ("Mistral-7B full fine-tune, pure bf16, selective recompute, mb 1 x seq 4096",
         dict(model="mistral-7b", precision="bf16", master_weights=False, recompute="selective", seq=4096,
              micro_batch=1, gpu="h200"), "real", None),
        # rows 48-59 (a third GPU session, docs/data/validation-cuda-3*.json): what sessions without a GPU modelled
        # since: Gemma 2's post norms and softcaps, Qwen3's q/k norms, MLA's latent norms under AMP, the later
        # micro-batches of gradient accumulation (FSDP2, offloading, a single GPU), AMP with a chunked loss, and
        # fp32 GQA's math fallback re-run under selective recompute
        ("Gemma-2-2B, 4 layers (post norms, attention and logit softcaps, 256k vocabulary), pure bf16, eager, seq 2048",
         dict(model="gemma-2-2b", layers=4, precision="bf16", master_weights=False, attention="eager", seq=2048,
              micro_batch=1, gpu="h100-sxm"), "real", None),
        ("Qwen3-8B, 4 layers (q/k norms), bf16 AMP, seq 4096",
         dict(model="qwen3-8b", layers=4, precision="bf16", seq=4096, micro_batch=1, gpu="h100-sxm"), "real", None),
        ("Llama-2-7B FSDP2 ZeRO-3, 8 GPUs, seq 2048, full AC, 2 micro-batches accumulated",
         dict(model="llama-2-7b", gpus=8, zero=3, precision="bf16", seq=2048, recompute="full", grad_accum=2,
              gpu="h100-sxm"), "fake", None),
        ("Llama-3.2-1B, bf16 AMP (fp32 params), chunked loss, full AC, mb 2 x seq 4096",
         dict(model="llama-3.2-1b", precision="bf16", loss="chunked", recompute="full", seq=4096, micro_batch=2,
              gpu="h100-sxm"), "real", None),
        ("4-layer h2048 GQA, pure bf16, full recompute, activation offloading, 2 micro-batches accumulated",
         dict(MID, precision="bf16", master_weights=False, recompute="full", offload_activations=True,
              grad_accum=2), "real", None),
        ("4-layer h2048 GQA, single GPU, fp32, selective recompute", dict(MID, precision="fp32",
                                                                          recompute="selective"), "real", None),
        ("DeepSeek-V2-Lite, 3 layers (MLA, 1 dense + 2 MoE of 64 experts top-6), bf16 AMP, seq 2048",
         dict(model="deepseek-v2-lite", layers=3, precision="bf16", seq=2048, micro_batch=1, gpu="h100-sxm"),
         "real", None),
        ("Gemma-2-9B FSDP2 ZeRO-3, 8 GPUs, bf16 mixed precision, eager attention, seq 4096, full AC",
         dict(model="gemma-2-9b", gpus=8, zero=3, precision="bf16", attention="eager", seq=4096, recompute="full",
              gpu="h100-sxm"), "fake", None),
        ("Qwen3-8B TP 2 + SP, pure bf16, seq 4096, full AC",
         dict(model="qwen3-8b", gpus=2, tp=2, sp=True, precision="bf16", master_weights=False, seq=4096,
              recompute="full", gpu="h100-sxm"), "fake", None),
        ("4-layer h2048 GQA, single GPU, bf16 AMP, 2 micro-batches accumulated", dict(MID, precision="bf16",
                                                                                      grad_accum=2), "real", None),
        # rows 58-59: AMP with nn.RMSNorm on a linear's bf16 output (an fp32 weight): torch's composite norm, found by
        # row 49 (its forward was -0.90%) and the probe's `rms_norm_autocast_*` readings
        ("Gemma-2-2B, 4 layers (post norms, both softcaps), bf16 AMP, eager, seq 2048",
         dict(model="gemma-2-2b", layers=4, precision="bf16", attention="eager", seq=2048, micro_batch=1,
              gpu="h100-sxm"), "real", None),
        ("Qwen3-8B, 4 layers (q/k norms), bf16 AMP, selective recompute, seq 4096",
         dict(model="qwen3-8b", layers=4, precision="bf16", recompute="selective", seq=4096, micro_batch=1,
              gpu="h100-sxm"), "real", None),
        # rows 60-72 (a fourth GPU session, docs/data/validation-cuda-4*.json): what sessions without a GPU modelled
        # since, mostly the layers' own moments, which a 512-token vocabulary leaves as the peak (the MLP's backward
        # under AMP, dropout, LoRA's frozen projections and adapters, SDPA's math fallback with dropout), AMP under
        # partial recompute with offloading, FSDP2's fp32 embedding backward, and torchtune's LoRA recipe shape
        ("4-layer h2048 GQA, 512-token vocabulary, bf16 AMP, seq 2048", dict(SMALL_VOCAB, precision="bf16"),
         "real", None),
        ("4-layer h2048 GQA, 512-token vocabulary, bf16 AMP, seq 512 (weight-heavy)",
         dict(SMALL_VOCAB, precision="bf16", seq=512), "real", None),
        ("4-layer h2048 GELU MLP + LayerNorm, 512-token vocabulary, bf16 AMP, eager attention + dropout 0.1",
         dict(SMALL_VOCAB, kv_heads=16, ffn=8192, mlp="gelu", norm="layernorm", bias=True, precision="bf16",
              attention="eager", dropout=0.1), "real", None),
        ("4-layer h2048 GQA, 512-token vocabulary, fp16 AMP, dropout 0.1, full recompute",
         dict(SMALL_VOCAB, precision="fp16", dropout=0.1, recompute="full"), "real", None),
        ("4-layer h2048 GQA, 512-token vocabulary, bf16 AMP, LoRA r=16 q,v, full recompute",
         dict(SMALL_VOCAB, precision="bf16", lora_rank=16, lora_targets="qv", recompute="full"), "real", None),
        ("4-layer h2048 GQA, 512-token vocabulary, pure bf16, LoRA r=16 all", dict(SMALL_VOCAB, **LORA_ALL),
         "real", None),
        ("4-layer h2048 GQA, 512-token vocabulary, fp32, dropout 0.1, selective recompute",
         dict(SMALL_VOCAB, precision="fp32", dropout=0.1, recompute="selective"), "real", None),
        ("4-layer h2048 GQA, bf16 AMP, full recompute on 2 of 4 layers, activation offloading",
         dict(MID, precision="bf16", recompute="full", recompute_layers=2, offload_activations=True), "real", None),
        ("Llama-3.2-1B FSDP2 ZeRO-3 fp32, 8 GPUs, seq 2048, full AC (128k vocabulary)",
         dict(model="llama-3.2-1b", gpus=8, zero=3, precision="fp32", seq=2048, recompute="full", gpu="h100-sxm"),
         "fake", None),
        ("4-layer h2048 GQA, 512-token vocabulary, pure bf16, LoRA r=16 all, adapter dropout 0.1",
         dict(SMALL_VOCAB, **LORA_ALL, lora_dropout=0.1), "real", None),
        ("4-layer h2048 GQA, 512-token vocabulary, pure bf16, LoRA r=16 all, full recompute",
         dict(SMALL_VOCAB, **LORA_ALL, recompute="full"), "real", None),
        ("4-layer h2048 GELU MLP + LayerNorm, 512-token vocabulary, pure bf16, LoRA r=16 all",
         dict(SMALL_VOCAB, kv_heads=16, ffn=8192, mlp="gelu", norm="layernorm", bias=True, **LORA_ALL), "real", None),
        ("Llama-3.2-1B, pure bf16, LoRA r=16 all, adapter dropout 0.05, chunked loss, full AC, mb 2 x seq 2048",
         dict(model="llama-3.2-1b", **LORA_ALL, lora_dropout=0.05, loss="chunked", recompute="full", seq=2048,
              micro_batch=2, gpu="h100-sxm"), "real", None),
    ]


def probe() -> dict[str, Any]:
    """The facts of this GPU and torch build that the cost model assumes (memcalc/cost/buffers.py workspaces,
    activations.py kernels)."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "device": torch.cuda.get_device_name(0),
                           "capability": list(torch.cuda.get_device_capability(0)),
                           "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory}

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.names.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    def alloc() -> int:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    try:
        bf = torch.bfloat16
        # the first matmul on this thread allocates its cuBLAS workspace through the caching allocator
        a = torch.randn(1024, 1024, device="cuda", dtype=bf)
        m0 = alloc()
        c = a @ a
        out["cublas_workspace_first_matmul_bytes"] = alloc() - m0 - c.nbytes
        del c
        # a backward matmul runs on autograd's device thread: a second workspace
        w = torch.randn(1024, 1024, device="cuda", dtype=bf, requires_grad=True)
        y = (a @ w).sum()
        m1 = alloc()
        y.backward()
        out["cublas_workspace_backward_thread_bytes"] = alloc() - m1 - w.grad.nbytes
        del w, y
        # RMSNorm on CUDA: which aten ops nn.RMSNorm runs, and what it saves
        x = torch.randn(2, 1024, 4096, device="cuda", dtype=bf, requires_grad=True)
        g = torch.ones(4096, device="cuda", dtype=bf, requires_grad=True)
        saved: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.nbytes), t)[1], lambda t: t):
            with Ops() as o:
                r = F.rms_norm(x, (4096,), g, 1e-6)
        out["rms_norm_ops"] = o.names
        out["rms_norm_saved_bytes"] = saved
        with Ops() as o:
            r.sum().backward()
        out["rms_norm_backward_ops"] = o.names
        del x, g, r
        # nn.RMSNorm under CUDA autocast (AutocastCUDA lists rms_norm as fp32) on a bf16 input with an fp32 weight:
        # Qwen3's per-head q norm (4-d), a Gemma post norm (a linear's output), MLA's latent norm: ops, output dtype,
        # and what autograd saves (bytes, dtype, shape)
        for key, shape in (("per_head", (1, 4096, 32, 128)), ("hidden", (1, 4096, 4096)), ("latent", (1, 2048, 512))):
            x = torch.randn(*shape, device="cuda", dtype=bf, requires_grad=True)
            norm = torch.nn.RMSNorm(shape[-1], eps=1e-6, device="cuda")
            held: list[Any] = []
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: (held.append([t.nbytes, str(t.dtype), list(t.shape)]), t)[1], lambda t: t):
                with torch.autocast("cuda", dtype=bf), Ops() as o:
                    r = norm(x)
            out[f"rms_norm_autocast_{key}_ops"] = o.names
            out[f"rms_norm_autocast_{key}_saved"] = held
            out[f"rms_norm_autocast_{key}_out_dtype"] = str(r.dtype)
            del x, norm, r
        # SDPA, bf16, causal, GQA (32 query heads, 8 KV heads): the backend, what it saves, the backward's scratch
        b, s, hq, hk, d = 1, 4096, 32, 8, 128
        q = torch.randn(b, hq, s, d, device="cuda", dtype=bf, requires_grad=True)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=bf, requires_grad=True)
        v = torch.randn(b, hk, s, d, device="cuda", dtype=bf, requires_grad=True)
        for gqa in (False, True):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(4, 1).detach().requires_grad_(),
                                         v.repeat_interleave(4, 1).detach().requires_grad_())
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append((t.nbytes, str(t.dtype),
                                                                                   list(t.shape))), t)[1],
                                                          lambda t: t):
                with Ops() as o:
                    y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
            key = "sdpa_gqa" if gqa else "sdpa_mha"
            out[key + "_ops"] = o.names
            out[key + "_saved"] = saved
            gy = torch.randn_like(y)
            base = alloc()
            torch.cuda.reset_peak_memory_stats()
            y.backward(gy)
            torch.cuda.synchronize()
            grads = q.grad.nbytes + kk.grad.nbytes + vv.grad.nbytes
            # above the inputs' gradients and what was live before: the kernel's own scratch
            out[key + "_backward_scratch_bytes"] = torch.cuda.max_memory_allocated() - base - grads
            q.grad = None
            del y, gy, kk, vv
            k.grad = v.grad = None
        # cross-entropy under CUDA autocast: the dtype it computes in
        logits = torch.randn(2048, 32000, device="cuda", dtype=torch.float32, requires_grad=True)
        h = torch.randn(2048, 32000, device="cuda", dtype=bf)
        with torch.autocast("cuda", dtype=bf):
            mm = logits.to(bf) * h
            out["autocast_cross_entropy_dtype"] = str(F.cross_entropy(mm, torch.zeros(2048, dtype=torch.long,
                                                                                        device="cuda")).dtype)
        del logits, h, mm
    except Exception as e:  # noqa: BLE001 - the probe is evidence, not a gate
        out["probe_error"] = f"{type(e).__name__}: {e}"
    torch.cuda.empty_cache()
    return out


def _entry(label: str, opts: dict[str, Any], world: str, case: str | None, timeout: float) -> dict[str, Any]:
    from memcalc.options import RunOptions, build_run
    from memcalc.validate.api import validate

    e: dict[str, Any] = {"label": label, "opts": opts, "world": world, "published_case": case}
    t0 = time.perf_counter()
    try:
        run = build_run(RunOptions(**opts))
        e["report"] = validate(run, device="cuda", world=world, tolerance=0.03, timeout=timeout)
    except Exception as ex:  # noqa: BLE001 - a failed row is a result
        e["failure"] = f"{type(ex).__name__}: {str(ex).strip()[:2000]}"
        e["traceback"] = traceback.format_exc(limit=6)
    e["seconds"] = round(time.perf_counter() - t0, 1)
    return e


def run_all(path: Path, budget_s: float, timeout: float, only: list[int] | None, expandable: bool) -> None:
    t_all = time.perf_counter()
    data: dict[str, Any] = {"probe": probe(), "results": [], "expandable_segments": expandable}
    path.write_text(json.dumps(data, indent=1, default=str))
    print(json.dumps(data["probe"], default=str)[:3000], flush=True)
    for i, (label, opts, world, case) in enumerate(configurations(), 1):
        if only and i not in only:
            continue
        left = budget_s - (time.perf_counter() - t_all)
        if left < 20:
            data["results"].append({"label": label, "opts": opts, "world": world, "published_case": case,
                                    "failure": "not run: the device budget ran out", "seconds": 0})
            continue
        if expandable:  # memcalc's figure for expandable segments (memcalc/cost/fragmentation.py)
            opts = dict(opts, allocator="expandable")
        e = _entry(label, opts, world, case, min(timeout, left))
        e["id"] = i
        data["results"].append(e)
        rep = e.get("report")
        if rep:
            c = rep.get("cuda") or {}
            print(f"[{i:2d}] {label[:70]:<70} {e['seconds']:6.1f}s alloc {c.get('measured_peak_bytes', 0) / 2**30:7.3f}"
                  f" GiB pred {c.get('predicted_peak_bytes', 0) / 2**30:7.3f} err {rep['error'] * 100:+.2f}% | "
                  f"reserved {c.get('measured_reserved_bytes', 0) / 2**30:7.3f} pred "
                  f"{c.get('predicted_reserved_bytes', 0) / 2**30:7.3f} | tracked err "
                  f"{_tracked_error(rep) * 100:+.2f}%", flush=True)
        else:
            print(f"[{i:2d}] {label[:70]:<70} {e['seconds']:6.1f}s FAILED {e['failure'][:400]}", flush=True)
        data["seconds"] = round(time.perf_counter() - t_all, 1)
        path.write_text(json.dumps(data, indent=1, default=str))


def _tracked_error(rep: dict[str, Any]) -> float:
    p, m = rep["predicted"]["peak_bytes"], rep["measured"]["peak_bytes"]
    return (p - m) / m if m else 0.0


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def _pct(p: int, m: int) -> str:
    return f"{(p - m) / m * 100:+.2f}%" if m else "n/a"


def predict(opts: dict[str, Any], expandable: bool = False) -> dict[str, Any]:
    """memcalc's figures for a recorded configuration, from the current cost model (the measured rank's stage)."""
    from memcalc.cost.estimate import estimate
    from memcalc.options import RunOptions, build_run

    if expandable:
        opts = dict(opts, allocator="expandable")
    mem = estimate(build_run(RunOptions(**opts)), advice=False).memory
    return {"allocated": int(mem.allocated_peak_bytes), "phase": mem.peak_phase,
            "reserved": int(mem.reserved_peak_bytes), "phases": phase_allocated(mem)}


_REPLAYS: dict[str, dict[str, int] | None] = {}


def replayed(opts: dict[str, Any], expandable: bool = False) -> int | None:
    """The caching allocator replayed over the configuration's allocations, run on fake tensors here (one rank, a
    pool per stream; memcalc/validate/allocator.py), with the default policy or expandable segments: reserved
    bytes, or None where the harness cannot run it faithfully on fake tensors (DDP, ZeroRedundancyOptimizer,
    activation offloading, data-dependent shapes). One run serves both tables (the rows' options differ in
    --fragmentation / --allocator, prediction inputs only)."""
    from memcalc.options import RunOptions, build_run
    from memcalc.validate.api import validate

    if opts.get("offload_activations"):
        return None  # not faithful on fake tensors (see cuda_section)
    key = json.dumps({k: v for k, v in opts.items() if k not in ("fragmentation", "allocator")}, sort_keys=True)
    if key not in _REPLAYS:
        try:
            rep = validate(build_run(RunOptions(**opts)), device="meta", world="fake", timeout=300)
            _REPLAYS[key] = rep["measured"]["allocator_replay"]
        except Exception:  # noqa: BLE001 - shown as n/a
            _REPLAYS[key] = None
    got = _REPLAYS[key]
    if got is None:
        return None
    return int(got["expandable_reserved_peak_bytes" if expandable else "reserved_peak_bytes"])


def measured(e: dict[str, Any]) -> dict[str, Any] | None:
    """The GPU's figures of a recorded row (None where it failed)."""
    c = (e.get("report") or {}).get("cuda")
    if not c:
        return None
    return {"allocated": c["measured_peak_bytes"], "phase": c["measured_peak_phase"],
            "reserved": c["measured_reserved_bytes"],
            "gpu_only": c["phases"][c["measured_peak_phase"]]["gpu_only"],
            "tracked": e["report"]["measured"]["peak_bytes"]}


def _table(data: dict[str, Any], expandable: bool) -> list[str]:
    replay = True
    out = ["| # | configuration | world | allocated (GiB) | memcalc | error | reserved (GiB) | memcalc | error "
           + ("| replayed | error " if replay else "") + "| GPU-only (MiB) | s |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: " + ("| ---: | ---: " if replay else "")
           + "| ---: | ---: |"]
    for e in data["results"]:
        m = measured(e)
        if m is None:
            out.append(f"| {e.get('id', '')} | {e['label']} | {e['world']} | failed: "
                       f"{e.get('failure', '?').splitlines()[0][:200]} | | | | | | | |" + (" | |" if replay else ""))
            continue
        p = predict(e["opts"], expandable)
        label = e["label"] + (" (a later run)" if e.get("note") else "")
        cells = ""
        if replay:
            r = replayed(e["opts"], expandable)
            cells = f"{_gib(r)} | {_pct(r, m['reserved'])} | " if r is not None else "n/a | | "
        out.append(f"| {e.get('id', '')} | {label} | {e['world']} | {_gib(m['allocated'])} ({m['phase']}) | "
                   f"{_gib(p['allocated'])} ({p['phase']}) | {_pct(p['allocated'], m['allocated'])} | "
                   f"{_gib(m['reserved'])} | {_gib(p['reserved'])} | {_pct(p['reserved'], m['reserved'])} | "
                   f"{cells}{m['gpu_only'] / 2**20:.1f} | {e['seconds']:.0f} |")
    return out


def cuda_section(data: dict[str, Any], expandable: dict[str, Any] | None = None) -> list[str]:
    """Markdown for docs/validation.md: the recorded GPU measurements against memcalc's current figures."""
    pr = data["probe"]
    out = ["## On a GPU (CUDA)", "",
           f"Measured by `scripts/gpu_validation.py` on one {pr.get('device', '?')} (torch {pr.get('torch', '?')}, "
           f"CUDA {pr.get('cuda', '?')}) and recorded in docs/data/validation-cuda.json (default caching allocator) "
           "and docs/data/validation-cuda-expandable.json (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`); "
           "memcalc's figures are recomputed from the current cost model when this page is generated, and "
           "tests/test_cuda_record.py holds them to the record. Each row is `memcalc validate --device cuda`: "
           "2 warm-up steps and 1 measured step; a multi-GPU layout is one rank of a fake process group of the full "
           "world (real CUDA tensors; the collectives move nothing). The harness empties the allocator's cache after "
           "building the model (it initialises in fp32 and casts), so that the reserved figures are training's. "
           "Rows marked (a later run) were measured in later runs on the same kind of GPU with the same probe "
           "readings: 20-21, and 22-31 on 2026-11-27, after the harness's stand-ins for fused kernels "
           "(bitsandbytes' dequantization, inductor's chunked cross-entropy) were made to work in pieces on a GPU: "
           "they had shown their own eager scratch there (the torchtune QLoRA row -15.4%, the chunked-loss rows' "
           "forward 1.4 GiB over), which the kernels they stand for never allocate.",
           "",
           "- `allocated`: `torch.cuda.max_memory_allocated()` (the largest over the measured step's phases) against "
           "memcalc's allocated peak, cuBLAS workspaces included.",
           "- `reserved`: `torch.cuda.max_memory_reserved()` against allocated + fragmentation "
           "(memcalc/cost/fragmentation.py; on the default allocator it includes the first optimizer step's foreach "
           "temporaries left in segments of their own).",
           "- `GPU-only`: allocated minus the harness's exact tracked tensor bytes in the measured peak phase: the two "
           "cuBLAS workspaces (64 MiB) and what kernels allocate for themselves.",
           "- `replayed`: PyTorch's caching allocator replayed over the same configuration's allocations, run without "
           "a GPU on fake tensors (`memcalc validate --device meta --world fake`, measured.allocator_replay; "
           "memcalc/validate/allocator.py), with a pool per stream (FSDP2's all-gather and reduce-scatter "
           "streams); in the expandable-segments table, the same log replayed under that policy "
           "(allocator.ExpandableAllocator). Tensor parallelism over the fake process group without SP (row 29) or "
           "under FSDP2 (row 13) is not replayed exactly by the default policy (TP 4 + SP, row 8, is since fake runs "
           "stopped counting each collective's output twice: -8.5% before). n/a: DDP and ZeroRedundancyOptimizer do "
           "not run on fake tensors, nor the MoE block's data-dependent shapes, nor the harness's context parallelism, nor activation "
           "offloading (rows 19, 25), which does not run faithfully on fake tensors (its tracked peak there is 4-7% "
           "above the exact one on the CPU).", ""]
    out += _table(data, False)
    if expandable:
        out += ["", "With `expandable_segments:True` (memcalc `--allocator expandable`: its 2% fraction, no "
                "first-step stranding):", ""]
        out += _table(expandable, True)
    out += ["", "Facts read on this GPU by the script's probe (memcalc/cost uses each):", ""]
    for k in ("cublas_workspace_first_matmul_bytes", "cublas_workspace_backward_thread_bytes", "rms_norm_ops",
              "rms_norm_saved_bytes", "sdpa_mha_ops", "sdpa_mha_saved", "sdpa_mha_backward_scratch_bytes",
              "sdpa_gqa_ops", "sdpa_gqa_backward_scratch_bytes", "autocast_cross_entropy_dtype", "probe_error"):
        if k in pr:
            out.append(f"- `{k}`: {pr[k]}")
    return out


def _later_section(data: dict[str, Any], expandable: dict[str, Any], title: str, card: str, text: str) -> list[str]:
    """A later record's heading (`title` after the device), its paragraph (`card`: said of the card beside its
    torch and CUDA versions; `text`: the rest) and its two tables, the default allocator's, then expandable
    segments'."""
    pr = data["probe"]
    dev = pr.get("device", "?")
    return ["", f"### On an {dev}{title} ({data.get('date', '?')})", "",
            f"The same script on one {dev} (torch {pr.get('torch', '?')}, CUDA {pr.get('cuda', '?')}{card}), " + text,
            "", *_table(data, False), "", "With `expandable_segments:True`:", "", *_table(expandable, True)]


def h200_section(data: dict[str, Any], expandable: dict[str, Any]) -> list[str]:
    """Markdown for the H200 record (rows 4, 8 and 11 again, and rows 32-47)."""
    return _later_section(
        data, expandable, "", "; its probe read the same facts as the H100's",
        "recorded in docs/data/validation-cuda-h200.json and docs/data/validation-cuda-h200-expandable.json and held "
        "by tests/test_cuda_record.py. Rows 4, 8 and 11 repeat H100 rows: the same bytes, allocated and reserved, on "
        "both cards. Rows 32-41 run what sessions without a GPU had added; rows 42-47 are whole models on one GPU "
        "whose optimizer step is the compute stream's peak, 36 one that an 80 GB card cannot hold. They moved the "
        "first optimizer step's foreach temporaries (memcalc/cost/fragmentation.py): added on top of a step that is "
        "itself the peak, the list was counted twice (rows 35 and 42-47 were +10% to +21% on the default "
        "allocator).")


def third_section(data: dict[str, Any], expandable: dict[str, Any]) -> list[str]:
    """Markdown for the third record (rows 48-59, an H100 again)."""
    pr = data["probe"]
    out = _later_section(
        data, expandable, ", rows 48-59", "",
        "recorded in docs/data/validation-cuda-3.json and docs/data/validation-cuda-3-expandable.json and held by "
        "tests/test_cuda_record.py: what sessions without a GPU had modelled since (Gemma 2's post norms and "
        "softcaps, Qwen3's q/k norms, MLA's latent norms under AMP, the later micro-batches of gradient "
        "accumulation under FSDP2, offloading and on one GPU, AMP with a chunked loss, fp32 GQA under selective "
        "recompute). Rows 2, 4, 8, 14, 15, 21 and 22 were run again first: the same bytes as their records. "
        "Found here: nn.RMSNorm under AMP on a linear's bf16 output (an fp32 weight) runs torch's composite, "
        "not the fused kernel (the probe below): it saves the normalized fp32 tensor too and returns bf16 "
        "(row 49's forward was -0.90%; rows 58-59 ran after the fix). With the default allocator, "
        "`max_memory_allocated()` counts whole blocks, up to 1 MiB above a request that a cached block serves "
        "unsplit (c10/cuda/CUDACachingAllocator.cpp, `should_split`): the MoE row 54's tensors of every size "
        "make that 1.4-1.6 GiB (-4.6%), which the replay of the run's own allocations reproduces (35.082 GiB "
        "against 35.079) and expandable segments do not show (-0.00%).")
    out += ["", "nn.RMSNorm under CUDA autocast, a bf16 input and an fp32 weight (the probe; bytes, dtype, shape of "
            "each saved tensor):", ""]
    for k in ("per_head", "hidden", "latent"):
        if f"rms_norm_autocast_{k}_ops" in pr:
            out.append(f"- `{k}`: ops {pr[f'rms_norm_autocast_{k}_ops']}, output "
                       f"{pr[f'rms_norm_autocast_{k}_out_dtype']}, saved {pr[f'rms_norm_autocast_{k}_saved']}")
    return out


def fourth_section(data: dict[str, Any], expandable: dict[str, Any]) -> list[str]:
    """Markdown for the fourth record (rows 60-72, an H100)."""
    return _later_section(
        data, expandable, ", rows 60-72", "",
        "recorded in docs/data/validation-cuda-4.json and docs/data/validation-cuda-4-expandable.json and held by "
        "tests/test_cuda_record_4.py: what sessions without a GPU had modelled since, mostly the layers' own moments, "
        "which a 512-token vocabulary leaves as the peak (the MLP's backward under AMP, weight-heavy AMP, dropout "
        "under full recompute, LoRA's frozen projections and adapters, SDPA's math fallback with dropout), AMP under "
        "partial recompute with offloading, FSDP2 in fp32 with a 128k vocabulary, and torchtune's LoRA recipe shape. "
        "Rows 4, 22, 49 and 58 were run again after them: the same bytes as their records. Found here, all "
        "reproduced by the CPU harness and then modelled: LoRA's sums (an adapted linear's base output, its "
        "adapter's and their sum live at once in forward, the two input gradients summed out of place in backward; "
        "rows 65, 69-71 were -0.6%, +2.4%, -7.6% and -3.2% in a phase), FSDP2's attention core of the last "
        "layer that prefetches the next unit (row 68's backward, -2.2%), and, offloaded under AMP, the plain layers' "
        "weight casts, which the offloading hook leaves on the device until each layer's backward (row 67's "
        "backward, -1.5%). Rows 62 and 66 (eager or math-path "
        "softmax with dropout) are exact in allocated bytes while the tracked tensors are 4-5% fewer: CUDA's "
        "softmax backward allocates its scratch inside the kernel, where the harness allocates it as a tensor.")


def record_section() -> list[str]:
    """The section from the committed records (empty when there is none)."""
    if not RECORD.exists():
        return []
    exp = RECORD.with_name("validation-cuda-expandable.json")
    out = cuda_section(json.loads(RECORD.read_text()), json.loads(exp.read_text()) if exp.exists() else None)
    h200 = RECORD.with_name("validation-cuda-h200.json")
    if h200.exists():
        out += h200_section(json.loads(h200.read_text()),
                            json.loads(h200.with_name("validation-cuda-h200-expandable.json").read_text()))
    third = RECORD.with_name("validation-cuda-3.json")
    if third.exists():
        out += third_section(json.loads(third.read_text()),
                             json.loads(third.with_name("validation-cuda-3-expandable.json").read_text()))
    fourth = RECORD.with_name("validation-cuda-4.json")
    if fourth.exists():
        out += fourth_section(json.loads(fourth.read_text()),
                              json.loads(fourth.with_name("validation-cuda-4-expandable.json").read_text()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="write the run's record here (as it goes)")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; no configuration starts after")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds allowed per configuration")
    ap.add_argument("--only", default=None, help="comma-separated configuration numbers (1-based)")
    ap.add_argument("--expandable", action="store_true", help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
                    "and memcalc's fragmentation for it")
    ap.add_argument("--diag", action="store_true", help="MEMCALC_CUDA_DIAG=1: each report's measurement gains "
                    "`cuda_diag` (bytes per stream, untracked blocks by allocating frames; measure.cuda_diagnosis)")
    ap.add_argument("--from-json", default=None, help="print the markdown section of a record")
    args = ap.parse_args(argv)
    if args.from_json:
        print("\n".join(cuda_section(json.loads(Path(args.from_json).read_text()))))
        return 0
    if args.diag:
        os.environ["MEMCALC_CUDA_DIAG"] = "1"
    if args.expandable:
        # before CUDA starts here and in the workers (the forkserver inherits this environment)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: run this on a machine with a GPU", file=sys.stderr)
        return 2
    run_all(Path(args.json or "validation-cuda.json"), args.budget, args.timeout,
            [int(x) for x in args.only.split(",")] if args.only else None, args.expandable)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
