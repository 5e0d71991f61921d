"""The `memcalc` command: a thin shell over options.build_run -> cost.estimate -> report.

Errors: every bad input prints one line `memcalc: error: ...` on stderr and exits 2 (never a traceback).
A configuration that does not fit is a result: exit 0 (or 1 with --check).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Annotated, Any, Callable, Optional

import typer

from memcalc.errors import InputError
from memcalc.options import DEFAULT_GPU, RunOptions

app = typer.Typer(
    name="memcalc",
    help="Will this training run fit, and what should I change? Per-GPU memory, communication and step time "
    "for DP / ZeRO / TP / PP / SP / CP transformer training.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

_M = "Model"
_T = "Training"
_P = "Parallelism"
_H = "Hardware"
_O = "Output"
_I = "Import a framework's config"
_F = "Fine-tuning"
_B = "Framework buffers"


def _opt(*names: str, help: str, panel: str, **kw: Any) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=panel, show_default=kw.pop("show_default", True), **kw)


# name -> (annotation, default, typer.Option); the order is the order in --help.
RUN_OPTIONS: dict[str, tuple[Any, Any, Any]] = {
    "model": (Optional[str], None, _opt("--model", "-m", help="Preset name (see `memcalc presets`); a Hugging "
              "Face config.json, checkpoint directory or repository id already in the local hub cache (org/name); "
              "or a preset-format TOML.", panel=_M)),
    "params": (Optional[str], None, _opt("--params", help="Parameter count (7B, 1.5e9, 124M). Alone: model states "
               "use exactly this count and a Llama-style reference shape of that size supplies dimensions.", panel=_M)),
    "layers": (Optional[int], None, _opt("--layers", help="Override the number of layers.", panel=_M)),
    "hidden": (Optional[int], None, _opt("--hidden", help="Override the hidden size.", panel=_M)),
    "heads": (Optional[int], None, _opt("--heads", help="Override the attention heads.", panel=_M)),
    "kv_heads": (Optional[int], None, _opt("--kv-heads", help="Override the KV heads (GQA/MQA).", panel=_M)),
    "ffn": (Optional[int], None, _opt("--ffn", help="Override the MLP intermediate size.", panel=_M)),
    "vocab": (Optional[int], None, _opt("--vocab", help="Override the vocabulary size.", panel=_M)),
    "mlp": (Optional[str], None, _opt("--mlp", help="MLP: swiglu (3 matrices) | gelu (2).", panel=_M)),
    "norm": (Optional[str], None, _opt("--norm", help="Norm: rmsnorm | layernorm (weight and bias).", panel=_M)),
    "tied_embeddings": (Optional[bool], None, _opt("--tied-embeddings/--untied-embeddings", help="LM head shares "
                        "the embedding weight.", panel=_M, show_default=False)),
    "positions": (Optional[str], None, _opt("--positions", help="Positions: rotary | learned (a table of "
                  "--max-positions rows).", panel=_M)),
    "bias": (Optional[bool], None, _opt("--bias/--no-bias", help="Biases on every linear layer (QKV included).",
             panel=_M, show_default=False)),
    "qkv_bias": (Optional[bool], None, _opt("--qkv-bias/--no-qkv-bias", help="Biases on Q, K, V only.", panel=_M,
                 show_default=False)),
    "head_bias": (Optional[bool], None, _opt("--head-bias/--no-head-bias", help="A bias on the LM head (phi-1.5).",
                  panel=_M, show_default=False)),
    "post_norms": (Optional[bool], None, _opt("--post-norms/--no-post-norms", help="Norms on the attention and MLP "
                   "outputs before the residual adds, four per layer (Gemma 2/3).", panel=_M, show_default=False)),
    "qk_norm": (Optional[bool], None, _opt("--qk-norm/--no-qk-norm", help="An RMSNorm over each head of q and of k "
                "before rotary (Qwen3, Gemma 3).", panel=_M, show_default=False)),
    "final_logit_softcap": (Optional[bool], None, _opt("--logit-softcap/--no-logit-softcap", help="The logits pass "
                            "tanh(x / cap) * cap before the loss, whose tanh saves one more logit-sized tensor "
                            "(Gemma 2).", panel=_M, show_default=False)),
    "attn_softcap": (Optional[bool], None, _opt("--attn-softcap/--no-attn-softcap", help="The attention scores pass "
                     "tanh(x / cap) * cap before the softmax; under --attention eager its tanh saves them once more "
                     "(Gemma 2).", panel=_M, show_default=False)),
    "block": (Optional[str], None, _opt("--block", help="Layer: sequential (attention, then MLP) | parallel (x + "
              "attn(norm1 x) + mlp(norm2 x): GPT-NeoX) | parallel-shared-norm (one norm for both: GPT-J, phi).",
              panel=_M)),
    "max_positions": (Optional[int], None, _opt("--max-positions", help="Rows of a learned position table "
                      "(default: --seq).", panel=_M)),
    "head_dim": (Optional[int], None, _opt("--head-dim", help="Override the attention head width (default: "
                 "hidden / heads; Megatron --kv-channels).", panel=_M)),
    "experts": (Optional[int], None, _opt("--experts", help="Routed experts per MoE layer (with --top-k on a dense "
                "model: makes it a mixture of experts).", panel=_M)),
    "top_k": (Optional[int], None, _opt("--top-k", help="Routed experts per token.", panel=_M)),
    "expert_ffn": (Optional[int], None, _opt("--expert-ffn", help="One expert's MLP width (default: --ffn).",
                   panel=_M)),
    "shared_experts": (Optional[int], None, _opt("--shared-experts", help="Shared experts per MoE layer, each of "
                       "--expert-ffn (one MLP of their summed width).", panel=_M)),
    "first_dense_layers": (Optional[int], None, _opt("--first-dense-layers", help="The first K layers keep a dense "
                           "MLP of --ffn (DeepSeek first_k_dense_replace).", panel=_M)),
    "q_lora_rank": (Optional[int], None, _opt("--q-lora-rank", help="Multi-head latent attention: the query "
                    "latent's rank (0: queries projected directly). Not LoRA fine-tuning (--lora-rank).", panel=_M)),
    "kv_lora_rank": (Optional[int], None, _opt("--kv-lora-rank", help="MLA: the key/value latent's rank (with "
                     "--qk-nope-dim --qk-rope-dim --v-head-dim: makes the attention MLA).", panel=_M)),
    "qk_nope_dim": (Optional[int], None, _opt("--qk-nope-dim", help="MLA: per-head query/key width from the "
                    "latent.", panel=_M)),
    "qk_rope_dim": (Optional[int], None, _opt("--qk-rope-dim", help="MLA: per-head rotary query/key width.",
                    panel=_M)),
    "v_head_dim": (Optional[int], None, _opt("--v-head-dim", help="MLA: per-head value width.", panel=_M)),
    "seq": (Optional[int], None, _opt("--seq", help="Sequence length (tokens). Default 4096, or the model's "
            "learned-position table where it is shorter (GPT-2: 1024).", panel=_T, show_default=False)),
    "micro_batch": (int, 1, _opt("--micro-batch", "--mb", help="Sequences per micro-batch per GPU.", panel=_T)),
    "global_batch": (Optional[int], None, _opt("--global-batch", help="Sequences per optimizer step (sets "
                     "grad-accum = global / (micro-batch * dp)).", panel=_T)),
    "grad_accum": (Optional[int], None, _opt("--grad-accum", help="Micro-batches per optimizer step.", panel=_T)),
    "precision": (str, "bf16", _opt("--precision", help="fp32 | bf16 | fp16 | fp8.", panel=_T)),
    "master_weights": (Optional[bool], None, _opt("--master-weights/--no-master-weights", help="Keep fp32 master "
                       "weights (default: yes for mixed precision).", panel=_T, show_default=False)),
    "grad_dtype": (Optional[str], None, _opt("--grad-dtype", help="fp32 | bf16 | fp16 (default: the profile's).",
                   panel=_T)),
    "optimizer": (str, "adamw", _opt("--optimizer", help="adam | adamw | sgd | sgd-momentum | adam-8bit | adafactor "
                  "| lion.", panel=_T)),
    "recompute": (str, "none", _opt("--recompute", help="Activation recompute: none | selective (attention core, Megatron) | op (torchtitan's op-level SAC: saves every other matmul output and the attention output) | full.", panel=_T)),
    "recompute_layers": (Optional[int], None, _opt("--recompute-layers", help="Checkpoint only this many layers per "
                         "stage.", panel=_T)),
    "recompute_every": (Optional[int], None, _opt("--recompute-every", help="With --recompute full: checkpoint "
                        "every K-th layer of each stage instead (torchtitan's selective_ac_option = K).", panel=_T)),
    "attention": (str, "flash", _opt("--attention", help="flash (SDPA/flash kernels) | eager.", panel=_T)),
    "norm_impl": (str, "fused", _opt("--norm-impl", help="RMSNorm code: fused (nn.RMSNorm, Apex, TE: saves the "
                  "input) | fp32 (eager upcast of HF, torchtune, lit-gpt: saves an fp32 copy).", panel=_T)),
    "qkv_impl": (str, "separate", _opt("--qkv-impl", help="QKV projection: separate (q/k/v matrices: HF, "
                 "torchtitan) | fused (one matrix whose output V views: lit-gpt).", panel=_T)),
    "gqa_impl": (str, "native", _opt("--gqa-impl", help="K/V heads under GQA: native (the kernel reads the "
                 "K/V heads: flash_attn, SDPA enable_gqa, torchtitan) | expand (copied to every query head before "
                 "SDPA: torchtune, HF repeat_kv). Eager attention always expands.", panel=_T)),
    "loss": (str, "full", _opt("--loss", help="full (the loss upcasts all logits to fp32 and saves their "
             "log-softmax: HF, torchtitan, Megatron) | fused (one kernel saves only the compute-dtype logits and "
             "writes their gradient in place: TransformerEngine parallel_cross_entropy, Megatron-LM "
             "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te) | chunked (8 sequence chunks, each upcast "
             "and cross-entropied inside torch.compile, which saves only the compute-dtype logits: torchtune "
             "CEWithChunkedOutputLoss with compile) | chunked-eager (the same chunks in eager mode: every chunk's "
             "fp32 log-softmax is saved) | lit-gpt (lit-gpt's LM head per 128-token chunk and chunked_cross_entropy: "
             "no upcast outside autocast, and the training loop keeps the logits until the next forward).", panel=_T)),
    "keep_logits": (str, "none", _opt("--keep-logits", help="The training loop's reference to the model's "
                    "logits (`logits = model(x); loss_fn(logits, y).backward()`), live until the next forward "
                    "replaces it: none (dropped before backward: HF Trainer, del logits) | compute (nanoGPT's "
                    "`logits, loss = model(X, Y)`) | fp32 (a model that returns upcast logits: torchtune 0.1; with "
                    "--loss lit-gpt, Lightning Fabric's bf16-true / bitsandbytes precision, whose convert_output "
                    "upcasts the chunks). --loss full or lit-gpt.", panel=_T)),
    "peak_step": (str, "steady", _opt("--peak-step", help="Which micro-batch's peak: steady (one in the middle "
                  "of training, after another of the same shape: the loop's kept logits and the bitsandbytes inputs "
                  "held by the previous graph are live) | first (the run's first, before any optimizer step: nothing "
                  "from an earlier micro-batch, and torch.optim's states not created yet; a loop that trains on its "
                  "longest batch first, as lit-gpt did in 2023, peaks there).", panel=_T)),
    "rope_cache": (str, "none", _opt("--rope-cache", help="A rotary table the model code keeps as a buffer: "
                   "none (computed per forward: Hugging Face, Megatron) | N (one fp32 cos/sin table of N positions "
                   "for the model: torchtune's builders since 0.2 pass one RoPE module to every layer, e.g. 131072 "
                   "for Llama 3.2) | N/layer (one per layer: torchtune 0.1 deep-copies the first layer, e.g. "
                   "4096/layer for Llama 2).", panel=_T)),
    "offload_activations": (bool, False, _opt("--offload-activations/--no-offload-activations", help="Layers' "
                            "saved activations go to host memory in forward and come back in backward, one layer "
                            "ahead (torchtune enable_activation_offloading, Megatron/TE --cpu-offloading); two "
                            "layers stay on the GPU.", panel=_T)),
    "dropout": (Optional[float], None, _opt("--dropout", help="Dropout probability (default: the model's).",
                panel=_T)),
    "foreach": (Optional[bool], None, _opt("--foreach/--no-foreach", help="Shorthand for --optimizer-impl "
                "foreach / for-loop (Megatron, DeepSpeed: fused).", panel=_T, show_default=False)),
    "optimizer_impl": (Optional[str], None, _opt("--optimizer-impl", help="Optimizer step kernels: foreach "
                       "(torch's default: a sqrt(v) copy of every stepped tensor) | for-loop (one tensor at a "
                       "time) | fused (in place: torch fused=True, Apex/TE/DeepSpeed FusedAdam; the default for "
                       "megatron and deepspeed).", panel=_T)),
    "fragmentation": (Optional[float], None, _opt("--fragmentation", help="Allocator slack: fraction of the "
                      "compute stream's reserved memory left unallocated (default: the profile's; FSDP2's stream "
                      "pools and the stranded logits block are added on top).", panel=_T)),
    "allocator": (str, "default", _opt("--allocator", help="PyTorch's CUDA caching allocator: default | "
                  "expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as torchtitan launches): its "
                  "fragmentation fraction (3% / 2%) and, on the default one, the first optimizer step's foreach "
                  "temporaries that stay reserved.", panel=_T)),
    "mfu": (Optional[float], None, _opt("--mfu", help="Assumed model-FLOPs utilisation (default: the GPU's).",
            panel=_T)),
    "lora_rank": (Optional[int], None, _opt("--lora-rank", help="LoRA rank: base weights frozen, adapters train.",
                  panel=_F)),
    "lora_targets": (str, "attn", _opt("--lora-targets", help="attn (q,k,v,o) | qv (q,v: PEFT's Llama default) | "
                     "mlp | all, or a comma list of q,k,v,o,gate,up,down and those sets (q,v,o,mlp: torchtune's "
                     "Llama 3 configs); PEFT's q_proj ... down_proj also read.", panel=_F)),
    "lora_dropout": (float, 0.0, _opt("--lora-dropout", help="Dropout on each adapter's input (PEFT default 0).",
                     panel=_F)),
    "lora_alpha": (Optional[float], None, _opt("--lora-alpha", help="Accepted; scales the update, no memory effect.",
                   panel=_F)),
    "base_dtype": (Optional[str], None, _opt("--base-dtype", help="Frozen base weights: nf4 | int8 | fp8 | bf16 | "
                   "fp16 | fp32 (QLoRA: nf4).", panel=_F)),
    "double_quant": (bool, True, _opt("--double-quant/--no-double-quant", help="QLoRA double quantization of the "
                     "nf4 scales.", panel=_F)),
    "quant_backend": (str, "bnb", _opt("--quant-backend", help="Quantized base linears: bnb (bitsandbytes, HF PEFT "
                      "QLoRA, lit-gpt: saves each linear's input) | bnb-fp16 (the same, quantized from fp16: "
                      "bitsandbytes <= 0.42 Params4bit.cuda, Lightning Fabric's plugin; nf4 dequantizes to fp16, "
                      "then to the compute dtype) | torchao (torchtune's linear_nf4: saves none).",
                      panel=_F)),
    "quantize_head": (bool, False, _opt("--quantize-head/--no-quantize-head", help="The LM head is quantized like "
                      "the base linears (lit-gpt with Fabric's bnb plugin; HF and torchtune keep it bf16).",
                      panel=_F)),
    "freeze": (Optional[str], None, _opt("--freeze", help="Freeze parts: embeddings, head, layers:K (comma-separated).",
               panel=_F)),
    "base_lr": (Optional[float], None, _opt("--base-lr", help="Reference learning rate (with --base-batch) for "
                "LR scaling guidance.", panel=_F)),
    "base_batch": (Optional[int], None, _opt("--base-batch", help="Reference global batch for --base-lr.",
                   panel=_F)),
    "base_warmup_steps": (Optional[int], None, _opt("--base-warmup-steps", help="Reference warm-up steps, scaled "
                          "to the same number of samples.", panel=_F)),
    "gpus": (Optional[int], None, _opt("--gpus", "-g", help="Total GPUs (default: tp*pp*cp*dp).", panel=_P)),
    "dp": (Optional[int], None, _opt("--dp", help="Data-parallel degree (default: gpus / (tp*pp*cp)).", panel=_P)),
    "tp": (int, 1, _opt("--tp", help="Tensor-parallel degree.", panel=_P)),
    "pp": (int, 1, _opt("--pp", help="Pipeline-parallel degree.", panel=_P)),
    "vpp": (int, 1, _opt("--vpp", help="Virtual pipeline stages per rank (interleaved 1F1B).", panel=_P)),
    "cp": (int, 1, _opt("--cp", help="Context-parallel degree.", panel=_P)),
    "ep": (int, 1, _opt("--ep", help="Expert-parallel degree (MoE).", panel=_P)),
    "sp": (Optional[bool], None, _opt("--sp/--no-sp", help="Sequence parallel with TP (default: on for megatron).",
           panel=_P, show_default=False)),
    "zero": (int, 0, _opt("--zero", "-z", help="ZeRO stage 0-3 (megatron: 1 = distributed optimizer; torch: "
             "1 = ZeroRedundancyOptimizer, 2/3 = FSDP2).", panel=_P)),
    "offload": (str, "none", _opt("--offload", help="none | optimizer | params (CPU offload).", panel=_P)),
    "schedule": (Optional[str], None, _opt("--schedule", help="Pipeline schedule: 1f1b | interleaved | gpipe.",
                 panel=_P)),
    "order": (str, "tp,cp,pp,dp", _opt("--order", help="Rank placement, innermost first.", panel=_P)),
    "dp_mode": (str, "collective", _opt("--dp-mode", help="collective (DDP/ZeRO) | ps (parameter server) | "
                "dataparallel (torch.nn.DataParallel).", panel=_P)),
    "cp_comm": (str, None, _opt("--cp-comm", help="Context parallelism's attention exchange: p2p (ring of K/V "
                "blocks: TE, torch context_parallel) | a2a (all-to-all of Q, K, V and the output, Ulysses-style: "
                "Megatron-LM --cp-comm-type a2a, DeepSpeed-Ulysses; needs cp | heads per TP rank). Default: a2a "
                "with --profile deepspeed, else p2p.", panel=_P)),
    "tp_overlap": (bool, False, _opt("--tp-overlap/--no-tp-overlap", help="TP communication overlapped with "
                   "compute.", panel=_P)),
    "profile": (str, "torch", _opt("--profile", help="Framework whose buffers and dtypes to model: torch | "
                "megatron | deepspeed.", panel=_P)),
    "bucket_cap_mb": (Optional[float], None, _opt("--bucket-cap-mb", help="DDP gradient bucket size, MiB (default 25).", panel=_B, show_default=False)),
    "gradient_as_bucket_view": (Optional[bool], None, _opt("--gradient-as-bucket-view/--no-gradient-as-bucket-view", help="DDP grads as views of the buckets.", panel=_B, show_default=False)),
    "overlap_comm": (Optional[bool], None, _opt("--overlap-comm/--no-overlap-comm", help="DeepSpeed overlap_comm (double IPG buffers).", panel=_B, show_default=False)),
    "overlap_grad_reduce": (Optional[bool], None, _opt("--overlap-grad-reduce/--no-overlap-grad-reduce", help="Megatron gradient reduction overlapped with backward (default on).", panel=_B, show_default=False)),
    "overlap_param_gather": (Optional[bool], None, _opt("--overlap-param-gather/--no-overlap-param-gather", help="Megatron distributed optimizer's param all-gather overlapped with forward (default on).", panel=_B, show_default=False)),
    "contiguous_gradients": (Optional[bool], None, _opt("--contiguous-gradients/--no-contiguous-gradients", help="DeepSpeed contiguous_gradients.", panel=_B, show_default=False)),
    "reduce_bucket_size": (Optional[str], None, _opt("--reduce-bucket-size", help="DeepSpeed reduce_bucket_size, elements (default 5e8; 5e8, 500M or 500000000).", panel=_B, show_default=False, metavar="<count>")),
    "allreduce_bucket_size": (Optional[str], None, _opt("--allreduce-bucket-size", help="DeepSpeed ZeRO-0 allreduce bucket, elements.", panel=_B, show_default=False, metavar="<count>")),
    "allgather_bucket_size": (Optional[str], None, _opt("--allgather-bucket-size", help="DeepSpeed allgather_bucket_size, elements.", panel=_B, show_default=False, metavar="<count>")),
    "stage3_prefetch_bucket_size": (Optional[str], None, _opt("--stage3-prefetch-bucket-size", help="DeepSpeed ZeRO-3 prefetch, elements.", panel=_B, show_default=False, metavar="<count>")),
    "stage3_max_live_parameters": (Optional[str], None, _opt("--stage3-max-live-parameters", help="DeepSpeed ZeRO-3 live parameters.", panel=_B, show_default=False, metavar="<count>")),
    "stage3_max_reuse_distance": (Optional[str], None, _opt("--stage3-max-reuse-distance", help="DeepSpeed ZeRO-3 reuse distance.", panel=_B, show_default=False, metavar="<count>")),
    "gpu": (str, DEFAULT_GPU, _opt("--gpu", help="GPU preset (see `memcalc presets`).", panel=_H)),
    "gpus_per_node": (Optional[int], None, _opt("--gpus-per-node", help="Override the GPU preset.", panel=_H)),
    "intra_bw": (Optional[float], None, _opt("--intra-bw", help="Intra-node bytes/s per GPU per direction.",
                 panel=_H)),
    "inter_bw": (Optional[float], None, _opt("--inter-bw", help="Inter-node (NIC) bytes/s per GPU per direction.",
                 panel=_H)),
    "host_bw": (Optional[float], None, _opt("--host-bw", help="GPU <-> host copy bytes/s per direction (PCIe): "
                "times offloaded activations and optimizer offload.", panel=_H)),
    "cpu_optimizer_rate": (Optional[float], None, _opt("--cpu-optimizer-rate", help="Offloaded optimizer step: AdamW "
                           "parameters one node's CPUs update per second with a vectorized kernel (DeepSpeedCPUAdam, "
                           "torch fused); default 1.8e9. torch's for-loop step is taken as 5x slower.", panel=_H)),
    "latency": (Optional[float], None, _opt("--latency", help="Per-step collective latency, seconds.", panel=_H)),
    "memory": (Optional[str], None, _opt("--memory", help="Override GPU memory capacity (e.g. 80GiB).", panel=_H)),
    "runtime_overhead": (Optional[str], None, _opt("--runtime-overhead", help="Memory outside the allocator, all of it "
                         "(CUDA context and every NCCL communicator), e.g. 1GiB. Default: the GPU preset's context and "
                         "one communicator, plus one per further process group.", panel=_H)),
    "deepspeed_config": (Optional[str], None, _opt("--deepspeed-config", help="Read a DeepSpeed ds_config.json "
                         "(ZeRO stage, offload, precision, batch sizes); sets --profile deepspeed. Flags given "
                         "here win.", panel=_I)),
    "megatron_args": (Optional[str], None, _opt("--megatron-args", help="Read Megatron-LM arguments: a launch "
                      "script / argument file, or a quoted string of --flags; sets --profile megatron.", panel=_I)),
    "torchtitan_config": (Optional[str], None, _opt("--torchtitan-config", help="Read a torchtitan job TOML "
                          "(model flavour, parallelism, batch, activation checkpointing); profile torch.",
                          panel=_I)),
}


def with_options(options: dict[str, tuple[Any, Any, Any]]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the named options in addition to its own keyword-only parameters."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())
        own = [p for p in own if p.kind is not inspect.Parameter.VAR_KEYWORD]
        extra = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                              annotation=Annotated[ann, opt])
            for name, (ann, default, opt) in options.items()
        ]

        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> Any:
            return fn(**kwargs)

        wrapper.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
        return wrapper

    return deco


def _explicit_options() -> set[str] | None:
    """The RUN_OPTIONS the user typed (click's parameter source), or None outside a command."""
    try:
        from typer._click.globals import get_current_context  # type: ignore[import-not-found]
    except ImportError:  # typer with the external click package
        from click import get_current_context
    ctx = get_current_context(silent=True)
    if ctx is None:
        return None
    out = set()
    for name in RUN_OPTIONS:
        src = ctx.get_parameter_source(name)
        if src is not None and src.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT"):
            out.add(name)
    return out


def run_options_from(kwargs: dict[str, Any]) -> RunOptions:
    """RunOptions from a command's keyword arguments, with --deepspeed-config / --megatron-args /
    --torchtitan-config merged in (flags typed on the command line win; `.import_report` says what happened)."""
    opts = RunOptions(**{k: kwargs[k] for k in RUN_OPTIONS if k in kwargs})
    from memcalc.options import IMPORT_FIELDS

    if any(getattr(opts, f) for f in IMPORT_FIELDS):
        from memcalc.importers import apply_imports

        opts = apply_imports(opts, _explicit_options())
    return opts


def _stage_arg(stage: str | None, pp: int) -> int | None:
    if stage is None:
        return None
    s = stage.strip().lower()
    if s == "first":
        return 0
    if s == "last":
        return pp - 1
    if s == "worst":
        return None
    try:
        return int(s)
    except ValueError:
        raise InputError(f"--stage {stage!r} is not valid; valid: first, last, worst, 0..{pp - 1}") from None


@app.command()
@with_options(RUN_OPTIONS)
def estimate(
    *,
    json_out: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON (schema: docs/json.md).",
                                           rich_help_panel=_O)] = False,
    units: Annotated[str, typer.Option("--units", help="GiB (2^30) or GB (10^9) in tables.",
                                       rich_help_panel=_O)] = "GiB",
    explain: Annotated[bool, typer.Option("--explain", help="Show each formula with its numbers.",
                                          rich_help_panel=_O)] = False,
    stage: Annotated[Optional[str], typer.Option("--stage", help="Pipeline stage the headline describes: first | "
                                                 "last | worst | N.", rich_help_panel=_O)] = None,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 when the configuration does not fit (CI gate).",
                                        rich_help_panel=_O)] = False,
    fmt: Annotated[Optional[str], typer.Option("--format", help="table | json | markdown | csv (--json = --format "
                                               "json).", rich_help_panel=_O)] = None,
    min_headroom: Annotated[Optional[str], typer.Option("--min-headroom", help="With --check (implied): also exit 1 "
                                                        "when less than this is left: a size (5GiB, 4GB) or a share "
                                                        "of the GPU's memory (10% or 0.1).",
                                                        rich_help_panel=_O)] = None,
    sweep: Annotated[Optional[str], typer.Option("--sweep", help="KEY=V1,V2,...: one estimate per value (keys: "
                                                 "micro-batch, seq, gpus, dp, tp, pp, cp, zero, recompute, offload, "
                                                 "precision, ...).", rich_help_panel=_O)] = None,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Write a PNG of memory per component (per swept "
                                                "value) with the capacity line; needs matplotlib (memcalc[plot]).",
                                                rich_help_panel=_O)] = None,
    **kwargs: Any,
) -> None:
    """Per-GPU memory (params, grads, optimizer, activations, buffers, fragmentation), communication and step
    time of one training configuration."""
    from memcalc.cost.estimate import estimate as run_estimate
    from memcalc.options import build_run, check_choice

    from memcalc.report import formats

    units = check_choice("units", units) or "GiB"
    out_fmt = formats.output_format(fmt, json_out)
    room = formats.Headroom(min_headroom) if min_headroom is not None else None
    opts = run_options_from(kwargs)
    if sweep is not None:
        from memcalc.sweep import emit_sweep, run_sweep

        points = run_sweep(opts, sweep, stage_of=lambda pp: _stage_arg(stage, pp))
        results = [p.estimate for p in points if p.estimate is not None]
        failed = any(p.error for p in points)
    else:
        run = build_run(opts)
        est = formats.attach_import_report(run_estimate(run, stage=_stage_arg(stage, run.pp)), opts.import_report)
        points, results, failed = None, [est], False
    if plot is not None:
        from memcalc.plot import plot_points
        from memcalc.sweep import SweepPoint

        plot_points(points or [SweepPoint(key="", field="", value="", estimate=results[0])], plot, units)
    if points is not None:
        emit_sweep(points, out_fmt, units)
    else:
        formats.emit_estimate(results[0], run, out_fmt, units, explain)
    if check or room is not None:
        reasons = [r for ok, r in (formats.check_estimate(e, room, units) for e in results) if not ok]
        if failed:
            reasons.append("a swept value is not a valid configuration")
        if reasons:
            sys.stderr.write(f"memcalc: check failed: {reasons[0]}\n")
            raise typer.Exit(1)


presets_app = typer.Typer(help="List the model and GPU presets, or show one.", no_args_is_help=False,
                          invoke_without_command=True, rich_markup_mode=None)
app.add_typer(presets_app, name="presets")


@presets_app.callback()
def presets_list(ctx: typer.Context,
                 json_out: Annotated[bool, typer.Option("--json", help="As JSON.")] = False) -> None:
    """List the model and GPU presets."""
    if ctx.invoked_subcommand is not None:
        return
    from memcalc.report.presets import render_presets

    render_presets(json_out=json_out)


@presets_app.command("show")
def presets_show(name: Annotated[str, typer.Argument(help="A model or GPU preset name.")],
                 json_out: Annotated[bool, typer.Option("--json", help="As JSON.")] = False) -> None:
    """Show one preset with its derived parameter counts (models) or figures (GPUs)."""
    from memcalc.report.presets import render_preset

    render_preset(name, json_out=json_out)


@app.command()
def schema() -> None:
    """Print the JSON schema of `memcalc estimate --json` (a copy lives in docs/schema/estimate.schema.json)."""
    from memcalc.report.formats import estimate_schema_json

    sys.stdout.write(estimate_schema_json())


OPTIONAL_COMMANDS = {"plan": "memcalc.plan.cli", "validate": "memcalc.validate.cli"}
_registered: set[str] = set()


def register_optional_commands(names: list[str] | None = None) -> None:
    """Commands that live in their own modules (plan, validate) register themselves on demand: building a
    command's ~90 options costs tens of milliseconds, and `estimate` runs in loops and CI."""
    import importlib

    for name, mod in OPTIONAL_COMMANDS.items():
        if (names is not None and name not in names) or name in _registered:
            continue
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):
                continue
            raise
        module.register(app)
        _registered.add(name)


def _commands_needed(argv: list[str]) -> list[str] | None:
    """Which optional commands this invocation needs: the one named, or all of them for top-level help."""
    words = [a for a in argv if not a.startswith("-")]
    if words and words[0] in OPTIONAL_COMMANDS:
        return [words[0]]
    if words:
        return []
    return None  # `memcalc`, `memcalc --help`: list every command


def _click_api() -> tuple[Any, type, type]:
    """(click exceptions module, Exit, Abort): typer >= 0.25 vendors click as typer._click, older typer uses click."""
    try:
        from typer._click import exceptions as click_exc  # type: ignore[attr-defined]
        from typer.exceptions import Abort, Exit  # type: ignore[attr-defined]
    except ImportError:  # typer with the external click package
        from click import exceptions as click_exc

        Exit, Abort = click_exc.Exit, click_exc.Abort
    return click_exc, Exit, Abort


def _typed_value(opts: list[str], argv: list[str]) -> str | None:
    """The last value given on the command line to an option spelled any of `opts` (`--seq x` or `--seq=x`)."""
    found = None
    for i, a in enumerate(argv):
        if a in opts and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith("--") and "=" in a and a.split("=", 1)[0] in opts:
            found = a.split("=", 1)[1]
    return found


def _bad_parameter_message(e: Any, argv: list[str]) -> str:
    """One line naming the flag, the value typed and what is valid. recent typer releases convert through pydantic, whose
    message names neither the value nor (for numbers) a valid form: "Input should be a valid integer, ..."."""
    param = getattr(e, "param", None)
    opts = list(getattr(param, "opts", []) or [])
    text = " ".join(e.format_message().split())
    value = _typed_value(opts, argv) if opts else None
    if value is None:
        return text
    flag = max(opts, key=len)
    low = text.lower()
    if "integer" in low:
        return f"{flag} {value!r} is not a whole number"
    if "number" in low or "float" in low:
        return f"{flag} {value!r} is not a number"
    detail = text.split(": ", 1)[1] if ": " in text else text
    return f"{flag} {value!r}: {detail}"


def main(argv: list[str] | None = None) -> None:
    click_exc, Exit, Abort = _click_api()
    register_optional_commands(_commands_needed(sys.argv[1:] if argv is None else argv))
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name="memcalc", standalone_mode=False)
    except InputError as e:
        sys.stderr.write(f"memcalc: error: {e}\n")
        sys.exit(2)
    except click_exc.NoArgsIsHelpError as e:
        sys.stdout.write(e.ctx.get_help() + "\n")
        sys.exit(0)
    except click_exc.BadParameter as e:
        sys.stderr.write(f"memcalc: error: {_bad_parameter_message(e, sys.argv[1:] if argv is None else argv)}\n")
        sys.exit(2)
    except click_exc.UsageError as e:
        msg = " ".join(e.format_message().split())
        sys.stderr.write(f"memcalc: error: {msg}\n")
        sys.exit(2)
    except click_exc.ClickException as e:
        sys.stderr.write(f"memcalc: error: {e.format_message()}\n")
        sys.exit(2)
    except Exit as e:
        sys.exit(e.exit_code)
    except Abort:
        sys.stderr.write("memcalc: aborted\n")
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
