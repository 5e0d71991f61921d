"""Published single-GPU fine-tuning memory figures against `memcalc.cost.estimate.estimate` (issue 7).

Every case, its source, its exact configuration and the unit conversion are recorded in
docs/published-finetune.md. Errors are (memcalc - published) / published.

Tolerances:
- MEASURED (3%, the issue's bar): figures read from a CUDA allocator counter on a real run
  (lit-gpt: torch.cuda.max_memory_allocated() / 1e9; torchtune: max_memory_reserved() / 1e9 or
  the "active_bytes.all.peak" counter in GiB). A measured case that misses is xfail(strict=True) with the error
  measured when this file was written and the suspected missing term; the tolerance is never widened.
- ROUNDING (0.01 GB absolute): differences of two published figures that are printed to 0.01 GB; the
  published difference itself is only known to +-0.01 GB.
- ESTIMATE (25%): LLaMA-Factory's "Hardware Requirement" table is marked *estimated* in its README, gives no
  sequence length or batch, and is a rule of thumb (2 bytes per parameter for LoRA, 0.5 for 4-bit QLoRA).

What is compared:
- lit-gpt resource tables ("Max GPU RAM", max_memory_allocated in GB = 1e9 bytes) -> memcalc's allocated peak.
- torchtune LoRA / QLoRA tutorials ("Peak memory reserved", GB = 1e9 bytes; torchtune's get_memory_stats divided
  by 1e9 at the time) -> memcalc's reserved peak (allocated + fragmentation); no CUDA context, which torch's
  reserved counter does not see.
- torchtune README "Optimization flags" table ("Peak Memory Active (GiB)") -> allocated peak.
- LLaMA-Factory (estimate, nvidia-smi style) -> memcalc's peak_bytes (allocated + fragmentation + runtime).
"""

from __future__ import annotations

import dataclasses

import pytest

from memcalc.cost.estimate import estimate
from tests.conftest import run_of

GB = 10**9
GIB = 2**30
MEASURED = 0.03
ESTIMATE = 0.25
ROUNDING_GB = 0.01


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    published: float  # in `unit`, as published
    unit: str  # "GB" (1e9 bytes) or "GiB" (2**30 bytes)
    figure: str  # "allocated" | "reserved" | "peak"
    options: dict
    tolerance: float = MEASURED
    xfail: str | None = None  # reason, with the error measured when written


# where each case was read, by case-id prefix (docs/validation.md lists every case with its source and error)
SOURCES = {
    "litgpt": "Lightning-AI/litgpt `tutorials/resource-tables.md` (8641822), \"Max GPU RAM\" = "
              "`max_memory_allocated` / 1e9; one A100 40 GB",
    "torchtune-llama2": "pytorch/torchtune `docs/source/tutorials/lora_finetune.rst`, `qlora_finetune.rst`, "
                        "\"Peak memory reserved\" (GB); one device",
    "torchtune-llama3.2": "pytorch/torchtune `README.md` \"Optimization flags\", \"Peak Memory Active (GiB)\"; "
                          "one A100",
    "llamafactory": "hiyouga/LLaMA-Factory `README.md` \"Hardware Requirement\" (*estimated*, tolerance 25%)",
    "litgpt-hub": "Lightning-AI/litgpt `config_hub/finetune/README.md` (3ba6da4, 03ffc55), \"Peak memory\" = "
                  "`max_memory_allocated` / 1e9 (finetune/lora.py); one A10G",
}


def memcalc_bytes(figure: str, **options) -> int:
    mem = estimate(run_of(**options)).memory
    if figure == "allocated":
        return mem.allocated_peak_bytes
    if figure == "reserved":
        return mem.reserved_peak_bytes
    if figure == "peak":
        return mem.peak_bytes
    raise ValueError(figure)


def memcalc_value(case: Case) -> float:
    return memcalc_bytes(case.figure, **case.options) / (GB if case.unit == "GB" else GIB)


def rel_error(case: Case) -> float:
    return (memcalc_value(case) - case.published) / case.published


# --- lit-gpt tutorials/resource-tables.md (commit 8641822, A100-SXM4-40GB, torch 2.1.0, bitsandbytes 0.41.1) ----
# finetune/lora.py: --precision bf16-true (weights, LoRA adapters and AdamW moments all bf16), torch.optim.AdamW,
# LoRA r=8 alpha=16 dropout=0.05 on query and value only (the table's 4,194,304 trainable parameters =
# 32 x 2 x 8 x (4096 + 4096): --lora-targets qv), no activation checkpointing, SDPA (is_causal),
# lm_head_chunk_size=128 + chunked cross-entropy in eager mode (lit_gpt/utils.py `chunked_cross_entropy`: each
# chunk's bf16 log-softmax is saved and the loop keeps the logits list through backward, 4 B per logit like
# --loss chunked-eager's fp32 log-softmax; the forward upcast memcalc adds is not there, +0.10 GiB at the
# forward moment of row 1); the longest Alpaca sample (1304 Llama-2 tokens) is forced into the
# first micro-batch and every micro-batch is padded to its longest sample.
# lit-gpt's model code (lit_gpt/model.py, lit_gpt/lora.py, lit_gpt/rmsnorm.py as stored, read for this table):
# one fused QKV matrix whose output q, k, v view (--qkv-impl fused), an eager RMSNorm computed in fp32
# (--norm-impl fp32; the upcast is in the stored rmsnorm.py revision 98898ca, the table's own commit was not
# readable here) and LoRAQKVLinear's index_copy zero padding. Per token per layer that is 43.2 h bytes for
# Llama-2-7B (fused qkv 6 h + roped q, k copies 4 h + SDPA output 2 h + two fp32 norm inputs 8 h + LoRA dropout
# mask and copy 3 h + zero-pad source 4 h + SwiGLU gate, up, SiLU outputs 6 f = 16.1 h), against ~45 h measured.
# Fabric's precision plugins return the model's output upcast to the default dtype (HalfPrecision and
# BitsandbytesPrecision `convert_output`, lightning/fabric/plugins/precision/half.py, bitsandbytes.py): the loop
# keeps fp32 chunks and the cross-entropy saves fp32 log-softmaxes (--keep-logits fp32; each row was 0.2-0.4 GB
# lower before, ~4.6 B per logit and micro-batch on every model).
# The table's loop trains on the longest sample first (`get_batch(..., longest_seq_ix if iter_num == 0 else None)`,
# finetune/lora.py as stored) and on random, shorter ones after: its peak is the first micro-batch's, with nothing
# kept from an earlier one and no AdamW state yet (--peak-step first; docs/published-finetune.md A).
LIT = dict(precision="bf16", master_weights=False, optimizer="adamw", lora_rank=8, lora_targets="qv",
           lora_dropout=0.05, norm_impl="fp32", qkv_impl="fused", gpu="a100-40gb", seq=1304, loss="lit-gpt",
           recompute="none", keep_logits="fp32", peak_step="first")
# --quantize bnb.nf4[-dq]: Fabric's BitsandbytesPrecision (lightning/fabric/plugins/precision/bitsandbytes.py)
# replaces every nn.Linear not in `ignore_modules`, which lit-gpt's finetune/lora.py leaves empty: the LM head
# (LoRALinear's inner linear) is quantized too, keeps its input (MatMul4Bit) and is dequantized at its matmuls.
# bitsandbytes 0.41.1 quantizes a `.half()` copy (Params4bit.cuda), so each dequantization is fp16 and then cast to
# bf16 (--quant-backend bnb-fp16): at the LM head's matmul both copies of the head are live (the nf4 rows of phi-1.5
# and StableLM were -3.8% / -5.4% without it, Llama-2's -1.2..-1.6%)
LIT_Q = dict(LIT, quantize_head=True, quant_backend="bnb-fp16")
# phi-1.5 and StableLM-Base-Alpha-3B: lit-gpt's GPT-NeoX-style block (`parallel_residual`; phi with one shared
# norm), torch.nn.LayerNorm (no --norm-impl fp32), GptNeoxMLP, biases on every linear (and phi's LM head); the
# longest Alpaca sample is 1044 (phi-1.5) / 1034 (StableLM) tokens (the table's header)
LIT_NEOX = {k: v for k, v in LIT.items() if k != "norm_impl"}
LIT_NEOX_Q = dict(LIT_NEOX, quantize_head=True, quant_backend="bnb-fp16")
PHI = dict(model="phi-1.5", seq=1044)
SLM = dict(model="stablelm-base-alpha-3b", seq=1034)
LITGPT = [
    Case("litgpt-llama2-7b-lora-mb1", 21.30, "GB", "allocated", dict(model="llama-2-7b", micro_batch=1, **LIT)),
    Case("litgpt-llama2-7b-lora-mb2", 29.07, "GB", "allocated", dict(model="llama-2-7b", micro_batch=2, **LIT)),
    Case("litgpt-llama2-7b-qlora-nf4", 14.14, "GB", "allocated",
         dict(model="llama-2-7b", base_dtype="nf4", double_quant=False, **LIT_Q)),
    Case("litgpt-llama2-7b-qlora-nf4-dq", 13.84, "GB", "allocated",
         dict(model="llama-2-7b", base_dtype="nf4", **LIT_Q)),
    Case("litgpt-llama2-13b-lora-mb1", 38.12, "GB", "allocated", dict(model="llama-2-13b", **LIT)),
    Case("litgpt-llama2-13b-qlora-nf4", 23.14, "GB", "allocated",
         dict(model="llama-2-13b", base_dtype="nf4", double_quant=False, **LIT_Q)),
    Case("litgpt-llama2-13b-qlora-nf4-dq", 22.55, "GB", "allocated",
         dict(model="llama-2-13b", base_dtype="nf4", **LIT_Q)),
]


def _litgpt_neox_cases(tag: str, model: dict, figures: tuple[float, ...]) -> list[Case]:
    """One model's five rows of lit-gpt's LoRA table, in its order: micro-batch 1, bnb.nf4, bnb.nf4-dq (both
    micro-batch 1, the LM head quantized too), micro-batch 2 and 4."""
    mb1, nf4, nf4_dq, mb2, mb4 = figures
    q = dict(LIT_NEOX_Q, base_dtype="nf4", **model)
    return [Case(f"litgpt-{tag}-lora-mb1", mb1, "GB", "allocated", dict(LIT_NEOX, micro_batch=1, **model)),
            Case(f"litgpt-{tag}-qlora-nf4", nf4, "GB", "allocated", dict(q, double_quant=False)),
            Case(f"litgpt-{tag}-qlora-nf4-dq", nf4_dq, "GB", "allocated", q),
            Case(f"litgpt-{tag}-lora-mb2", mb2, "GB", "allocated", dict(LIT_NEOX, micro_batch=2, **model)),
            Case(f"litgpt-{tag}-lora-mb4", mb4, "GB", "allocated", dict(LIT_NEOX, micro_batch=4, **model))]


LITGPT += _litgpt_neox_cases("phi1.5", PHI, (4.82, 3.78, 3.72, 6.76, 10.68))
LITGPT += _litgpt_neox_cases("stablelm3b", SLM, (9.69, 6.35, 6.19, 12.10, 16.92))
# --- LitGPT config_hub/finetune/README.md (2024: commits 3ba6da4 and 03ffc55, one A10G 24 GB) ------------------
# The hub's configs (config_hub/finetune/<model>/{lora,qlora}.yaml, read at the nearest stored commits): bf16-true,
# LoRA r=32 alpha 16 dropout 0.05 on query and value, global batch 8, Alpaca2k (mhenrichsen/alpaca_2k_test) capped at
# max_seq_length 512, micro-batch 2 (llama-2-7b, mistral-7b) or 1 (llama-3-8b LoRA, stablelm: the YAMLs and the
# later README). finetune/lora.py of the time (~v0.4): one GPU, no activation checkpointing, `model(x,
# lm_head_chunk_size=128)` + chunked_cross_entropy, the loop's logits list upcast by Fabric (--keep-logits fp32),
# torch AdamW; batches padded to their longest sample and cut at 512. memcalc takes seq 512: that assumes Alpaca2k's
# longest sample exceeds 512 tokens under each tokenizer, not checked here. QLoRA: bnb.nf4 (fp32 absmax) through
# Lightning's BitsandbytesPrecision, which quantizes from fp16 (`_Linear4bit.quantize`) and the LM head too, with
# bitsandbytes 0.42.0 (the `all` extra) and bnb's PagedAdamW, whose states live in CUDA managed memory outside the
# allocator's count (memcalc counts the adapters' bf16 moments: 67 MB for Llama-2-7B). The loop shuffles (no
# longest-first batch): steady state, where the previous micro-batch's graph, kept by the loop's `loss`, holds
# bitsandbytes' ctx-stored inputs through the next forward (7-12% low before they were counted; docs J).
HUB = dict(precision="bf16", master_weights=False, optimizer="adamw", lora_rank=32, lora_targets="qv",
           lora_dropout=0.05, qkv_impl="fused", gpu="a100-40gb", seq=512, loss="lit-gpt", recompute="none",
           keep_logits="fp32")
HUB_Q = dict(HUB, base_dtype="nf4", double_quant=False, quantize_head=True, quant_backend="bnb-fp16")
LITGPT_HUB = [
    Case("litgpt-hub-llama2-7b-lora", 19.77, "GB", "allocated",
         dict(HUB, model="llama-2-7b", norm_impl="fp32", micro_batch=2)),
    Case("litgpt-hub-llama3-8b-lora", 19.73, "GB", "allocated",
         dict(HUB, model="llama-3-8b", norm_impl="fp32", micro_batch=1)),
    Case("litgpt-hub-mistral-7b-lora", 20.66, "GB", "allocated",
         dict(HUB, model="mistral-7b", norm_impl="fp32", micro_batch=2)),
    Case("litgpt-hub-stablelm3b-lora", 8.58, "GB", "allocated",
         dict(HUB, model="stablelm-base-alpha-3b", micro_batch=1)),
    Case("litgpt-hub-llama2-7b-qlora", 13.68, "GB", "allocated",
         dict(HUB_Q, model="llama-2-7b", norm_impl="fp32", micro_batch=2)),
    Case("litgpt-hub-llama3-8b-qlora", 17.41, "GB", "allocated",
         dict(HUB_Q, model="llama-3-8b", norm_impl="fp32", micro_batch=2)),
    Case("litgpt-hub-mistral-7b-qlora", 14.29, "GB", "allocated",
         dict(HUB_Q, model="mistral-7b", norm_impl="fp32", micro_batch=2)),
    Case("litgpt-hub-stablelm3b-qlora", 5.24, "GB", "allocated",
         dict(HUB_Q, model="stablelm-base-alpha-3b", micro_batch=1)),
]

# The table's OOM rows on the 40 GB A100 (Llama 2 7B micro-batch 4, 13B micro-batch 2 and 4): memcalc must say they
# do not fit (test_litgpt_oom_rows_do_not_fit)
LITGPT_OOM = [dict(model="llama-2-7b", micro_batch=4, **LIT), dict(model="llama-2-13b", micro_batch=2, **LIT),
              dict(model="llama-2-13b", micro_batch=4, **LIT)]

# --- torchtune docs/source/tutorials/lora_finetune.rst and qlora_finetune.rst (Llama2-7B, single device) --------
# llama2/7B_lora_single_device: batch_size 2, dtype bf16 (pure: adapters and AdamW moments bf16), torch.optim.AdamW,
# enable_activation_checkpointing True, alpaca_cleaned_dataset (max_seq_len 512 at the time; batches padded to the
# longest sample, so the peak batch is 2 x 512), torch.nn.CrossEntropyLoss on the model's fp32 logits.
# torchtune's RMSNorm (torchtune/modules/rms_norm.py) computes in fp32 from `x.float()`: --norm-impl fp32.
# Read in the torchtune 0.1.0 wheel (PyPI, April 2024; 0.1.1 the same): the config accumulates 64 micro-batches
# (`gradient_accumulation_steps: 64`; QLoRA's 7B_qlora_single_device.yaml: 16), `lora_llama2_7b` passes
# `lora_dropout=0.05` whatever the config says, the model returns `self.output(h).float()` and the recipe's loop
# keeps that `logits` (shifted by `.contiguous()`) until the next forward: --keep-logits fp32.
# Each of its 32 layers is a deep copy of the first (`_get_clones`), RoPE table included: 32 x 4096 x 64 x 2 fp32 =
# 64 MiB (--rope-cache 4096/layer; tests/test_torchtune_record.py).
TT7 = dict(model="llama-2-7b", precision="bf16", master_weights=False, optimizer="adamw", gpu="a100-80gb",
           seq=512, micro_batch=2, recompute="full", loss="full", norm_impl="fp32", grad_accum=64,
           lora_dropout=0.05, keep_logits="fp32", rope_cache="4096/layer")
TT_RESERVED = ("reserved pool: torchtune's collate pads each batch to its longest sample, and the caching allocator "
               "keeps the segments cut for shorter batches when a longer one comes (docs/published-finetune.md C): "
               "torchtune 0.1.0's own code replayed at a fixed 512 tokens reserves 6.2-6.6% under the published "
               "figures, with varying lengths 0.2-1.9% under (docs/data/torchtune-replay.json); memcalc estimates "
               "fixed shapes, and `memcalc validate --seq-lengths` replays varying ones")
TORCHTUNE_TUTORIAL = [
    Case("torchtune-llama2-7b-lora-qv-r8", 15.57, "GB", "reserved", dict(lora_rank=8, lora_targets="qv", **TT7),
         xfail="-4.2% (was -5.6% before the config's grad-accum 64, LoRA dropout and kept fp32 logits); "
               + TT_RESERVED),
    Case("torchtune-llama2-7b-lora-all-r8", 15.87, "GB", "reserved", dict(lora_rank=8, lora_targets="all", **TT7),
         xfail="-5.2% (was -6.8%); the run also adapts the LM head, which memcalc does not; " + TT_RESERVED),
    Case("torchtune-llama2-7b-lora-qv-r64", 15.86, "GB", "reserved",
         dict(lora_rank=64, lora_targets="qv", **TT7),
         xfail="-4.4% (was -6.2%); " + TT_RESERVED),
    Case("torchtune-llama2-7b-lora-all-r64", 17.04, "GB", "reserved",
         dict(lora_rank=64, lora_targets="all", **TT7),
         xfail="-4.9% (was -8.1%); the run also adapts the LM head; " + TT_RESERVED),
    Case("torchtune-llama2-7b-qlora", 9.29, "GB", "reserved",
         dict(TT7, lora_rank=8, lora_targets="all", base_dtype="nf4", quant_backend="torchao", grad_accum=16),
         xfail="-40.1% (-44.7% before torchao's dequantization temporaries, -47.5% before that); the training "
               "figure (9.29 GB) is barely above the reserved pool after model init (9.13 GB), a load figure: "
               "torchtune 0.1.0's own QLoRA build, replayed, reserves 4.74 GB at init (docs/published-finetune.md "
               "D), so the tutorial's run built the model with other code; memcalc models training (its allocated "
               "peak is 5.03 GiB; the H100 measured the recipe's training step within 0.2% of it)"),
]

# --- torchtune README "Optimization flags" (Llama 3.2 3B, batch 2, packed to 4096 tokens, bf16, one A100) --------
# Peak Memory Active (GiB) = torch.cuda.memory_stats()["active_bytes.all.peak"]; rows are cumulative.
# torchtune's model code: RMSNorm computed in fp32 (--norm-impl fp32) and MultiHeadAttention expanding the 8 K/V
# heads to all 24 query heads before SDPA (`k.unsqueeze(2).expand(...).flatten(1, 2)`: --gqa-impl expand).
# And one RoPE table shared by the layers (torchtune 0.5 llama3_2 builders: one Llama3ScaledRoPE module with
# max_seq_len 131072, whose build_rope_cache keeps 131072 x 64 x 2 fp32 = 64 MiB: --rope-cache 131072).
TT3 = dict(model="llama-3.2-3b", precision="bf16", master_weights=False, optimizer="adamw", gpu="a100-80gb",
           seq=4096, micro_batch=2, norm_impl="fp32", gqa_impl="expand", rope_cache="131072")
# Row 14's AdamW implementation is not stated. foreach (torch's default) is ruled out by the measurement itself: its
# sqrt(v) list (5.98 GiB) on top of params + grads + moments (23.95 GiB) is above the 24.9 GiB measured. torchtune's
# own AdamW configs set `fused: True` (recipes/configs/llama3_2/3B_full.yaml); the for-loop step is within the bar
# too (test_torchtune_row14_non_foreach_variants).
TT3_AC = dict(recompute="full", loss="chunked", **TT3)
TORCHTUNE_README = [
    Case("torchtune-llama3.2-3b-full-packed", 60.0, "GiB", "allocated", dict(recompute="none", loss="full", **TT3)),
    Case("torchtune-llama3.2-3b-full-compile-chunkedce-ac", 24.9, "GiB", "allocated",
         dict(optimizer_impl="fused", **TT3_AC)),
    # the command sets enable_activation_offloading=True: --offload-activations moves the 1.31 GiB of checkpointed
    # layer inputs to the host (was +34.4% / +63.7% without)
    # torchtune 0.5.0's llama3_2/3B_lora_single_device.yaml and 3B_qlora_single_device.yaml: lora_attn_modules
    # [q_proj, v_proj, output_proj], apply_lora_to_mlp, r=64, AdamW fused: True (the command overrides only
    # optimizer._component_)
    Case("torchtune-llama3.2-3b-lora-r64", 8.5, "GiB", "allocated",
         dict(lora_rank=64, lora_targets="q_proj,v_proj,output_proj,mlp", offload_activations=True,
              optimizer_impl="fused", **TT3_AC),
         xfail="+4.8% (+19.5% before the compiled chunked loss, +5.3% with k adapted too): 0.41 GiB above; the "
               "adapters' AdamW moments are 0.335 GiB of it, and without them (a first step: AdamW creates them "
               "in its first step()) memcalc gives 8.57 GiB (docs/published-finetune.md G)"),
    Case("torchtune-llama3.2-3b-qlora-r64", 4.6, "GiB", "allocated",
         dict(lora_rank=64, lora_targets="q_proj,v_proj,output_proj,mlp", base_dtype="nf4", quant_backend="torchao",
              offload_activations=True, optimizer_impl="fused", **TT3_AC),
         xfail="+9.0% (+36.2% before the compiled chunked loss): the same 0.41 GiB as the LoRA row on a 2.3 GiB "
               "base; 4.68 GiB without the adapters' moments"),
]

# --- LLaMA-Factory README "Hardware Requirement" (*estimated*; no sequence length or batch stated) ----------------
# Compared with memcalc's nvidia-smi-style peak for a short-context run (seq 512, micro-batch 1, torch AMP,
# LoRA r=8 on all linears, full recompute): only the rule of thumb (2 B/param LoRA, 0.5 B/param QLoRA-4) is tested.
LF = dict(model="llama-2-7b", lora_rank=8, lora_targets="all", seq=512, micro_batch=1, recompute="full",
          gpu="a100-80gb")
LLAMA_FACTORY = [
    Case("llamafactory-7b-lora-16bit", 16.0, "GB", "peak", dict(**LF), tolerance=ESTIMATE),
    Case("llamafactory-7b-qlora-4bit", 6.0, "GB", "peak", dict(base_dtype="nf4", **LF), tolerance=ESTIMATE),
]

CASES = LITGPT + TORCHTUNE_TUTORIAL + TORCHTUNE_README + LLAMA_FACTORY + LITGPT_HUB


def _param(case: Case):
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_published_finetune_figure(case: Case):
    err = rel_error(case)
    assert abs(err) <= case.tolerance, (
        f"{case.id}: memcalc {memcalc_value(case):.2f} {case.unit} vs published {case.published} {case.unit} "
        f"({err:+.1%}, tolerance {case.tolerance:.0%})")


# --- differences of two published figures (same run setup, one knob changed) ------------------------------------


def _diff_gb(a: dict, b: dict, figure: str = "allocated") -> float:
    return (memcalc_bytes(figure, **a) - memcalc_bytes(figure, **b)) / GB


@pytest.mark.parametrize("model,no_dq,dq", [("llama-2-7b", 14.14, 13.84), ("llama-2-13b", 23.14, 22.55)])
def test_litgpt_double_quant_saving(model, no_dq, dq):
    """bnb.nf4 -> bnb.nf4-dq in lit-gpt's table: the only difference is the absmax storage (fp32 per 64 weights
    -> int8 per 64 + fp32 per 16384), so the saving isolates memcalc's nf4 scale term. Published to 0.01 GB."""
    base = dict(model=model, base_dtype="nf4", **LIT_Q)
    predicted = _diff_gb(dict(base, double_quant=False), base)
    assert abs(predicted - (no_dq - dq)) <= ROUNDING_GB, (predicted, no_dq - dq)


@pytest.mark.parametrize("model,mb_a,mb_b,published", [
    ("llama-2-7b", 2, 1, 29.07 - 21.30),
    ("phi-1.5", 2, 1, 6.76 - 4.82),
    ("phi-1.5", 4, 2, 10.68 - 6.76),
    ("stablelm-base-alpha-3b", 2, 1, 12.10 - 9.69), ("stablelm-base-alpha-3b", 4, 2, 16.92 - 12.10)])
def test_litgpt_activation_per_sequence(model, mb_a, mb_b, published):
    """lit-gpt LoRA, one micro-batch size minus another: whole sequences of activations and logits (every
    micro-batch is padded to the longest sample), at the run's first micro-batch (lit-gpt 2023 trains on the
    longest sample first: `--peak-step first`, so no logits are kept from an earlier micro-batch). Llama-2-7B:
    measured 7.77 GB, memcalc 7.74 GB (-0.4%; +0.3% when the previous micro-batch's logits were counted, -2.7%
    before Fabric's fp32 output was, -3.2% before the chunked loss's saved log-softmax of every chunk); phi-1.5
    1.94 / 3.92 GB, memcalc 1.95 / 3.91 (+0.7% / -0.3%; were +3.5% / +2.4%); StableLM 2.41 / 4.82 GB, memcalc
    2.40 / 4.80 (-0.3% each; were +1.8%). The issue's 3% bar."""
    base = dict(LIT if model.startswith("llama") else LIT_NEOX, **(PHI if model == "phi-1.5" else SLM
                                                                   if model.startswith("stablelm") else {}))
    base["model"] = model
    predicted = _diff_gb(dict(base, micro_batch=mb_a), dict(base, micro_batch=mb_b))
    assert abs(predicted - published) / published <= MEASURED, (predicted, published)


@pytest.mark.parametrize("opts", LITGPT_OOM, ids=["llama2-7b-mb4", "llama2-13b-mb2", "llama2-13b-mb4"])
def test_litgpt_oom_rows_do_not_fit(opts):
    """The rows lit-gpt's table reports as OOM on one A100 40 GB: memcalc's verdict is "does not fit" (the peak
    with fragmentation and the CUDA context above the capacity), by more than the 3% bar."""
    mem = estimate(run_of(**opts)).memory
    assert not mem.fits
    assert mem.peak_bytes > 1.03 * mem.capacity_bytes, (mem.peak_bytes / GB, mem.capacity_bytes / GB)


def test_litgpt_quantization_saving():
    """lit-gpt Llama-2-7B LoRA micro-batch 1: bf16 base 21.30 GB -> bnb.nf4 base 14.14 GB (saving 7.16 GB)."""
    predicted = _diff_gb(dict(model="llama-2-7b", **LIT),
                         dict(model="llama-2-7b", base_dtype="nf4", double_quant=False, **LIT_Q))
    assert abs(predicted - 7.16) / 7.16 <= MEASURED, predicted


def test_torchtune_row14_non_foreach_variants():
    """Row 14 (24.9 GiB) names no AdamW implementation. The measurement excludes foreach: its states alone plus
    foreach's sqrt(v) list exceed it. Each remaining implementation lands within the 3% bar."""
    foreach = memcalc_bytes("allocated", optimizer_impl="foreach", **TT3_AC)
    assert foreach / GIB > 24.9 * (1 + MEASURED)  # 29.98 GiB: the foreach step cannot have run
    for impl in ("fused", "for-loop"):
        err = memcalc_bytes("allocated", optimizer_impl=impl, **TT3_AC) / GIB / 24.9 - 1
        assert abs(err) <= MEASURED, (impl, err)


def test_torchtune_lora_rows_read_without_the_adapters_moments():
    """Rows 15-16 (docs/published-finetune.md G): everything memcalc holds at their peak (the first loss chunk's
    gradient) but the adapters' AdamW moments lands within the bar; the moments are 89,915,392 adapter params
    x 2 moments x 2 B (bf16) = 0.335 GiB, the whole of the rows' shared excess but 0.05 GiB. A torch AdamW creates
    its moments in its first step(), so a first step runs forward and backward without them (`--peak-step first`,
    which gives the same figure); which step the README read is not stated."""
    for case, published in (("torchtune-llama3.2-3b-lora-r64", 8.5), ("torchtune-llama3.2-3b-qlora-r64", 4.6)):
        opts = next(c for c in CASES if c.id == case).options
        full = memcalc_bytes("allocated", **opts)
        no_moments = memcalc_bytes("allocated", **dict(opts, optimizer="sgd"))  # sgd without momentum: no state
        assert full - no_moments == 89_915_392 * 2 * 2
        assert 0 < no_moments / GIB / published - 1 <= MEASURED, case  # +0.9% and +1.8%
        # the run's first micro-batch: nothing kept from an earlier one (this loop keeps no logits), no moments yet
        assert memcalc_bytes("allocated", **dict(opts, peak_step="first")) == no_moments
