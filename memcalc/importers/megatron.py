"""`--megatron-args FILE|"ARGS"`: Megatron-LM command-line arguments into RunOptions fields.

Argument names, meanings and defaults: Megatron-LM megatron/training/arguments.py (`_add_network_size_args`,
`_add_training_args`, `_add_mixed_precision_args`, `_add_distributed_args`) and the example launch scripts
(examples/gpt3/train_gpt3_175b_distributed.sh, examples/llama/train_llama3_8b_h100_fp8.sh). Defaults that matter
when a flag is absent: fp32 training (no --bf16/--fp16), no sequence parallel, no distributed optimizer,
LayerNorm, GELU MLP of 4*hidden (with --swiglu: int(4*hidden*2/3 / 64)*64), biases on every linear layer, learned
absolute positions, tied embedding and output weights, attention and hidden dropout 0.1.

The input is a file (a launch script or an argument list; shell comments, `\\` continuations, `VAR="..."` and
`VAR=( ... )` assignments are understood) or a string of arguments. Words that are not `--flags` (torchrun,
pretrain_gpt.py, $VARIABLES) are skipped and named in a note. `torchrun --nproc-per-node N --nnodes M` gives
--gpus N*M.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from memcalc.errors import InputError
from memcalc.importers import Imported, as_int
from memcalc.options import RunOptions

FLAG = "--megatron-args"

# store_true flags: never take a value
_BOOL = {
    "--sequence-parallel", "--use-distributed-optimizer", "--swiglu", "--group-query-attention",
    "--untie-embeddings-and-output-weights", "--bf16", "--fp16", "--disable-bias-linear", "--add-bias-linear",
    "--add-qkv-bias", "--use-flash-attn", "--use-mcore-models", "--overlap-grad-reduce", "--overlap-param-gather",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion", "--use-rotary-position-embeddings", "--qk-layernorm",
    "--no-position-embedding", "--recompute-activations", "--checkpoint-activations", "--distribute-saved-activations",
    "--apply-query-key-layer-scaling", "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
    "--tp-comm-overlap", "--use-cpu-initialization", "--no-load-optim", "--no-load-rng", "--finetune",
    "--mock-data", "--no-save-optim", "--no-save-rng", "--log-throughput", "--log-timers-to-tensorboard",
    "--log-memory-to-tensorboard", "--log-params-norm", "--log-num-zeros-in-grad", "--use-checkpoint-args",
    "--bf16-reduction", "--no-async-tensor-model-parallel-allreduce", "--use-legacy-models", "--standalone",
    "--no-persist-layer-norm", "--no-rope-fusion", "--use-torch-fsdp2", "--ckpt-fully-parallel-load",
    "--manual-gc", "--no-create-attention-mask-in-dataloader", "--check-for-nan-in-loss-and-grad",
    "--calculate-per-token-loss", "--defer-embedding-wgrad-compute", "--moe-grouped-gemm",
    "--use-precision-aware-optimizer", "--overlap-p2p-communication", "--cross-entropy-loss-fusion",
    "--use-contiguous-parameters-in-local-ddp", "--data-parallel-random-init", "--exit-on-missing-checkpoint",
    "--multi-latent-attention", "--moe-shared-expert-overlap", "--moe-use-legacy-grouped-gemm", "--moe-layer-recompute",
    "--moe-router-pre-softmax", "--moe-router-enable-expert-bias", "--moe-router-fusion", "--moe-permute-fusion",
    "--moe-router-padding-for-fp8", "--moe-router-force-load-balancing", "--moe-enable-deepep",
    "--moe-pad-expert-input-to-capacity", "--moe-apply-probs-on-input", "--moe-per-layer-logging",
    "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--moe-use-upcycling",
}

# flags that do not change memory or step time (listed as ignored with that reason)
_IRRELEVANT_PREFIXES = (
    "--lr", "--min-lr", "--warmup", "--train-iters", "--train-samples", "--weight-decay", "--clip-grad",
    "--adam-", "--sgd-momentum", "--init-method", "--log", "--save", "--load", "--eval", "--data-", "--split",
    "--tokenizer", "--vocab-file", "--merge-file", "--seed", "--tensorboard", "--wandb", "--distributed-backend",
    "--distributed-timeout", "--norm-epsilon", "--rotary-", "--rope-", "--no-load", "--no-save", "--finetune",
    "--mock-data", "--exit-", "--timing-", "--ckpt-", "--use-checkpoint-args", "--dataloader-", "--num-workers",
    "--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--hysteresis", "--attention-softmax-in-fp32",
    "--apply-query-key-layer-scaling", "--check-for-nan", "--manual-gc", "--no-masked-softmax-fusion",
    "--no-bias-", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
    "--use-cpu-initialization", "--use-mcore-models", "--use-legacy-models", "--reset-", "--eod-mask-loss",
    "--micro-batch-size-warmup", "--rampup-batch-size", "--use-flash-attn", "--transformer-impl",
    "--bias-", "--masked-softmax-fusion", "--no-create-attention-mask",
    "--calculate-per-token-loss", "--untie-",
)

# torchrun / launcher flags
_LAUNCH = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank", "--master_addr",
           "--master-addr", "--master_port", "--master-port", "--rdzv_backend", "--rdzv-backend", "--rdzv_endpoint",
           "--rdzv-endpoint", "--rdzv_id", "--rdzv-id", "--standalone", "--max_restarts", "--max-restarts"}

_HANDLED = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank", "--sequence-parallel", "--context-parallel-size",
    "--expert-model-parallel-size", "--use-distributed-optimizer", "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--recompute-modules", "--recompute-activations", "--checkpoint-activations",
    "--micro-batch-size",
    "--global-batch-size", "--seq-length", "--encoder-seq-length", "--num-layers", "--hidden-size",
    "--num-attention-heads", "--ffn-hidden-size", "--swiglu", "--group-query-attention", "--num-query-groups",
    "--untie-embeddings-and-output-weights", "--bf16", "--fp16", "--vocab-size", "--padded-vocab-size",
    "--normalization", "--position-embedding-type", "--use-rotary-position-embeddings", "--no-position-embedding",
    "--max-position-embeddings", "--disable-bias-linear", "--add-bias-linear", "--add-qkv-bias",
    "--attention-dropout", "--hidden-dropout", "--optimizer", "--fp8-format", "--tp-comm-overlap",
    "--accumulate-allreduce-grads-in-fp32", "--kv-channels", "--cp-comm-type", "--cross-entropy-loss-fusion",
    "--cross-entropy-fusion-impl", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size", "--moe-layer-freq", "--multi-latent-attention", "--q-lora-rank",
    "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--expert-tensor-parallel-size",
    "--moe-token-dispatcher-type", "--qk-layernorm", "--moe-grouped-gemm", "--moe-permute-fusion",
    "--overlap-grad-reduce", "--overlap-param-gather",
}
_RECORD = {"--make-vocab-size-divisible-by", "--distribute-saved-activations", "--bf16-reduction",
           "--use-precision-aware-optimizer", "--main-grads-dtype",
           "--exp-avg-dtype", "--exp-avg-sq-dtype", "--fp8-recipe", "--overlap-p2p-communication",
           "--defer-embedding-wgrad-compute", "--use-torch-fsdp2", "--data-parallel-sharding-strategy",
           "--ddp-bucket-size", "--attention-backend", "--context-parallel-comm-type", "--tp-comm-overlap-cfg"}
_MOE_PREFIXES = ("--num-experts", "--moe-")
# arguments that take a list of words (argparse nargs='*' in megatron/training/arguments.py)
_LISTS = {"--recompute-modules"}
# MoE arguments read but not modelled: why (an MoE run whose memory they change is estimated without them)
_MOE_UNMODELLED = {
    "--moe-expert-capacity-factor": "token dropping and capacity padding are not modelled (dropless routing "
                                    "with balanced load is)",
    "--moe-pad-expert-input-to-capacity": "capacity padding is not modelled (dropless routing is)",
    "--moe-layer-recompute": "recompute of the MoE layer alone is not modelled; use --recompute",
    "--moe-enable-deepep": "DeepEP's dispatch buffers are not modelled (the alltoall dispatcher's are)",
    "--mtp-num-layers": "multi-token prediction layers are not modelled",
}


_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=([^\s()$`;|&]+)\s*(?:#.*)?$")


def _expand_simple_vars(text: str) -> str:
    """Substitute $NAME / ${NAME} for plain one-word shell assignments (GPUS_PER_NODE=8) made in the script."""
    env: dict[str, str] = {}
    for line in text.splitlines():
        m = _ASSIGN.match(line)
        if m:
            env[m.group(1)] = m.group(2).strip("'\"")
    if not env:
        return text

    def sub(m: re.Match[str]) -> str:
        return env.get(m.group(1) or m.group(2), m.group(0))

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", sub, text)


def _words(text: str) -> list[str]:
    """Shell words of a launch script or argument list, with `VAR="--a 1"` / `VAR=(...)` values re-split."""
    text = _expand_simple_vars(re.sub(r"\\\r?\n", " ", text))
    try:
        lex = shlex.shlex(text, posix=True, punctuation_chars=False)
        lex.whitespace_split = True
        lex.commenters = "#"
        words = list(lex)
    except ValueError as e:
        raise InputError(f"{FLAG}: cannot split the arguments ({e})") from None
    out: list[str] = []
    for w in words:
        m = re.match(r"^[A-Za-z_][A-Za-z0-9_]*=\(?(.*)$", w)
        if m and not w.startswith("-"):
            w = m.group(1)
        w = w.strip("()")
        if not w:
            continue
        if any(c.isspace() for c in w):
            out.extend(_words(w))
        else:
            out.append(w)
    return out


def parse_args(words: list[str]) -> tuple[dict[str, str | bool], list[str]]:
    """(flag -> value or True, the words that are not flags or their values). The last occurrence wins, as in
    argparse."""
    args: dict[str, str | bool] = {}
    skipped: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("--") or w == "--":
            skipped.append(w)
            i += 1
            continue
        if "=" in w:
            k, v = w.split("=", 1)
            args[k] = v
            i += 1
            continue
        if w in _BOOL:
            args[w] = True
            i += 1
            continue
        if w in _LISTS:  # nargs='*': every word up to the next --flag
            j = i + 1
            while j < len(words) and not words[j].startswith("--"):
                j += 1
            args[w] = " ".join(words[i + 1:j]) or True
            i = j
            continue
        nxt = words[i + 1] if i + 1 < len(words) else None
        if nxt is not None and not nxt.startswith("--"):
            args[w] = nxt
            i += 2
        else:
            args[w] = True
            i += 1
    return args, skipped


def load_args(ref: str) -> tuple[dict[str, str | bool], list[str], str]:
    path = Path(ref).expanduser()
    stripped = ref.strip()
    if stripped.startswith("-"):
        text, source = ref, "<arguments>"
    elif path.is_file():
        try:
            text, source = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"{FLAG} {ref!r} cannot be read: {e}") from None
    else:
        raise InputError(f"{FLAG} {ref!r}: no such file (give a file or a quoted string of arguments starting "
                         "with --)")
    args, skipped = parse_args(_words(text))
    if not args:
        raise InputError(f"{FLAG} {ref!r} holds no --arguments")
    return args, skipped, source


def import_megatron(ref: str, o: RunOptions, explicit: set[str]) -> Imported:
    args, skipped, source = load_args(ref)
    imp = Imported(framework="megatron", source=source)
    imp.set("profile", "megatron", default=True)

    def num(flag: str) -> int | None:
        if flag not in args:
            return None
        v = args[flag]
        if v is True:
            raise InputError(f"{source}: {flag} needs a value")
        n = as_int(v, flag, source)
        if n < 1:
            raise InputError(f"{source}: {flag} {v} must be at least 1")
        return n

    def fnum(flag: str) -> float | None:
        if flag not in args:
            return None
        try:
            return float(args[flag])  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise InputError(f"{source}: {flag} {args[flag]!r} is not a number") from None

    def text(flag: str) -> str | None:
        v = args.get(flag)
        if v is True:
            raise InputError(f"{source}: {flag} needs a value")
        return v  # type: ignore[return-value]

    # parallel layout
    for flag, field in (("--tensor-model-parallel-size", "tp"), ("--pipeline-model-parallel-size", "pp"),
                        ("--context-parallel-size", "cp"), ("--expert-model-parallel-size", "ep"),
                        ("--num-virtual-stages-per-pipeline-rank", "vpp")):
        n = num(flag)
        if n is not None:
            imp.set(field, n)
    imp.set("sp", bool(args.get("--sequence-parallel")), default="--sequence-parallel" not in args)
    imp.set("zero", 1 if args.get("--use-distributed-optimizer") else 0,
            default="--use-distributed-optimizer" not in args)
    if args.get("--tp-comm-overlap"):
        imp.set("tp_overlap", True)
    # Megatron's argparse default for both is off: a launch line without them does not overlap
    imp.set("overlap_grad_reduce", bool(args.get("--overlap-grad-reduce")))
    imp.set("overlap_param_gather", bool(args.get("--overlap-param-gather")))
    lpv = num("--num-layers-per-virtual-pipeline-stage")
    if lpv is not None:
        def vpp_from_layers(model: Any, merged: RunOptions, imp: Imported) -> None:
            per_stage = model.layers // merged.pp
            if model.layers % merged.pp or per_stage % lpv:
                raise InputError(f"{source}: --num-layers-per-virtual-pipeline-stage {lpv} does not divide the "
                                 f"{model.layers} layers / pp {merged.pp}")
            imp.set("vpp", per_stage // lpv)
            imp.notes.append(f"--num-layers-per-virtual-pipeline-stage {lpv}: vpp = {model.layers} layers / pp "
                             f"{merged.pp} / {lpv} = {per_stage // lpv}")

        imp.deferred.append(vpp_from_layers)

    # batch and sequence
    for flag, field in (("--micro-batch-size", "micro_batch"), ("--global-batch-size", "global_batch"),
                        ("--seq-length", "seq"), ("--encoder-seq-length", "seq")):
        n = num(flag)
        if n is not None:
            imp.set(field, n)

    # recompute
    gran = text("--recompute-granularity")
    if args.get("--recompute-activations"):  # older spelling of selective
        gran = gran or "selective"
    if args.get("--checkpoint-activations"):  # older spelling of full, uniform
        gran = gran or "full"
    if gran is not None:
        gran = gran.lower()
        if gran not in ("selective", "full"):
            raise InputError(f"{source}: --recompute-granularity {gran!r}; valid: selective, full")
        imp.set("recompute", gran)
        method = (text("--recompute-method") or "").lower()
        k = num("--recompute-num-layers")
        if gran == "full" and method == "block" and k is not None:
            imp.set("recompute_layers", k)
        elif gran == "full" and k is not None and k > 1:
            imp.notes.append(f"--recompute-method {method or 'uniform'} --recompute-num-layers {k}: every layer is "
                             "recomputed, in groups of that many; modelled as full recompute of every layer")
        elif gran == "selective" and k is not None:
            imp.notes.append("--recompute-num-layers applies to full granularity only; ignored with selective")
        _recompute_modules(imp, args, gran)
    else:
        imp.set("recompute", "none", default=True)
        for flag in ("--recompute-method", "--recompute-num-layers"):
            if flag in args:
                imp.ignore(flag, "needs --recompute-granularity full")
        _recompute_modules(imp, args, None)

    # precision
    if args.get("--fp8-format"):
        imp.set("precision", "fp8")
    elif args.get("--bf16"):
        imp.set("precision", "bf16")
    elif args.get("--fp16"):
        imp.set("precision", "fp16")
    else:
        imp.set("precision", "fp32", default=True)
        imp.notes.append("no --bf16 / --fp16: Megatron trains in fp32")
    if args.get("--accumulate-allreduce-grads-in-fp32"):
        imp.set("grad_dtype", "fp32")

    opt = text("--optimizer")
    if opt is not None:
        o_map = {"adam": "adam", "sgd": "sgd-momentum"}
        if opt.lower() not in o_map:
            raise InputError(f"{source}: --optimizer {opt!r}; Megatron's are adam, sgd")
        imp.set("optimizer", o_map[opt.lower()])
        if opt.lower() == "sgd":
            imp.notes.append("Megatron's sgd uses --sgd-momentum (default 0.9): modelled as sgd-momentum")

    # context parallelism's attention exchange (default p2p) and the cross-entropy kernel
    cpc = text("--cp-comm-type")
    if cpc is not None:
        if cpc.lower() in ("p2p", "a2a"):
            imp.set("cp_comm", cpc.lower())
        else:
            imp.set("cp_comm", "p2p")
            imp.notes.append(f"--cp-comm-type {cpc}: modelled as p2p (memcalc models p2p and a2a)")
    if args.get("--cross-entropy-loss-fusion"):
        impl = (text("--cross-entropy-fusion-impl") or "native").lower()
        if impl == "te":  # TransformerEngine's parallel_cross_entropy: bf16 logits, gradient in place
            imp.set("loss", "fused")
        else:  # megatron/core/fusions/fused_cross_entropy.py upcasts and keeps the fp32 softmax, as unfused
            imp.notes.append(f"--cross-entropy-loss-fusion with --cross-entropy-fusion-impl {impl}: the fp32 "
                             "softmax is kept as without fusion (--loss full)")

    # dropout: memcalc has one probability; Megatron's default is 0.1 for both
    ad, hd = fnum("--attention-dropout"), fnum("--hidden-dropout")
    a = 0.1 if ad is None else ad
    h = 0.1 if hd is None else hd
    imp.set("dropout", max(a, h), default=ad is None and hd is None)
    if a != h:
        imp.notes.append(f"--attention-dropout {a} and --hidden-dropout {h}: memcalc uses one probability, "
                         f"{max(a, h)}")
    elif ad is None and hd is None:
        imp.notes.append("no --attention-dropout / --hidden-dropout: Megatron's default 0.1")

    _model_shape(args, imp, source, num, text)
    _experts_and_latents(args, imp, source, num, text)

    # gpus from a torchrun line
    nproc_raw = args.get("--nproc_per_node", args.get("--nproc-per-node"))
    if nproc_raw is not None:
        nnodes_raw = args.get("--nnodes", "1")
        if isinstance(nproc_raw, str) and nproc_raw.isdigit() and isinstance(nnodes_raw, str) and nnodes_raw.isdigit():
            gpus = int(nproc_raw) * int(nnodes_raw)
            imp.set("gpus", gpus)
            imp.notes.append(f"torchrun --nproc-per-node {nproc_raw} --nnodes {nnodes_raw}: --gpus {gpus}")
        elif "gpus" not in explicit:
            imp.needs_value.append(f"torchrun --nproc-per-node {nproc_raw} --nnodes {nnodes_raw}: not numbers here; "
                                   "give --gpus N")

    for flag in args:
        if flag.startswith(_MOE_PREFIXES) and "--num-experts" not in args:
            imp.ignore(flag, "no --num-experts: the model is dense")
            continue
        if flag in _HANDLED or flag in _LAUNCH:
            continue
        if flag in _RECORD:
            imp.recorded[flag] = args[flag]
        elif flag in _MOE_UNMODELLED:
            imp.ignore(flag, _MOE_UNMODELLED[flag])
        elif flag.startswith(_MOE_PREFIXES):
            imp.ignore(flag, "routing choice: no effect on memory or step time in memcalc's model")
        elif flag.startswith(_IRRELEVANT_PREFIXES):
            imp.ignore(flag, "no effect on memory or step time")
        else:
            imp.ignore(flag)
    if skipped:
        shown = ", ".join(skipped[:8]) + (f", ... ({len(skipped)} in all)" if len(skipped) > 8 else "")
        imp.notes.append(f"words that are not --arguments were skipped: {shown}")
    return imp


def _recompute_modules(imp: Imported, args: dict[str, Any], gran: str | None) -> None:
    """Megatron's `--recompute-modules` (nargs='*', default core_attn; megatron/training/arguments.py): the
    submodules that selective granularity recomputes. memcalc's `--recompute selective` is the attention core's
    (Korthikanti sec. 5); the others (mlp, moe, moe_act, layernorm, mla_up_proj, shared_experts, ...) are not
    modelled, so with them the estimate keeps those submodules' activations: an over-estimate, said in a note."""
    value = args.get("--recompute-modules")
    if value is None:
        return
    if gran != "selective":
        imp.ignore("--recompute-modules", "applies to --recompute-granularity selective only")
        return
    modules = str(value).split() if isinstance(value, str) else []
    others = [mod for mod in modules if mod != "core_attn"]
    if "core_attn" not in modules:
        imp.set("recompute", "none")
        imp.notes.append(f"--recompute-modules {' '.join(modules) or '(none)'}: the attention core is not recomputed; "
                         "recompute of the other modules is not modelled (their activations are counted as kept: an "
                         "over-estimate)")
    elif others:
        imp.notes.append(f"--recompute-modules: {' '.join(others)} recompute is not modelled (their activations are "
                         "counted as kept: an over-estimate); core_attn is --recompute selective")


def _layer_freq(value: str, layers: int | None, source: str) -> int:
    """The number of leading dense layers in Megatron's `--moe-layer-freq` (arguments.py `moe_freq_type`): an
    integer N (one MoE layer every N; 1 = every layer) or a list expression such as `([0]*3+[1]*58)`, 1 for an
    MoE layer. memcalc models MoE models whose first K layers are dense and the rest MoE; other patterns are
    refused with that reason."""
    import ast

    flag = "--moe-layer-freq"
    text = value.strip().strip("'\"")
    if text.isdigit():
        if int(text) == 1:
            return 0
        raise InputError(f"{source}: {flag} {value}: one MoE layer every {text} is not modelled; valid: 1 (every "
                         "layer MoE) or a list with the dense layers first, e.g. ([0]*3+[1]*58)")

    def ev(node: ast.AST) -> list[int] | int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [ev(e) for e in node.elts]
            if all(isinstance(i, int) for i in items):
                return items  # type: ignore[return-value]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add) and isinstance(a, list) and isinstance(b, list):
                return a + b
            if isinstance(node.op, ast.Mult) and isinstance(a, list) and isinstance(b, int) and b * len(a) <= 1 << 16:
                return a * b
        raise ValueError

    try:
        pattern = ev(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        pattern = None
    if not isinstance(pattern, list) or not pattern or set(pattern) - {0, 1}:
        raise InputError(f"{source}: {flag} {value!r} is not a list of 0 (dense) and 1 (MoE) per layer; valid: an "
                         "integer or an expression such as ([0]*3+[1]*58)")
    if layers is not None and len(pattern) != layers:
        raise InputError(f"{source}: {flag} {value!r} gives {len(pattern)} layers, --num-layers is {layers}")
    k = pattern.index(1) if 1 in pattern else len(pattern)
    if any(x != 1 for x in pattern[k:]) or k == len(pattern):
        raise InputError(f"{source}: {flag} {value!r}: only the first layers may be dense (memcalc models the "
                         "first K layers dense, the rest MoE); valid: e.g. ([0]*3+[1]*58)")
    return k


def _experts_and_latents(args: dict[str, Any], imp: Imported, source: str, num: Any, text: Any) -> None:
    """Megatron's MoE (`_add_moe_args`) and multi-latent attention (`_add_mla_args`, `--multi-latent-attention`)
    arguments into --experts ... --v-head-dim, with Megatron's defaults where absent: top-k 2, expert width
    --ffn-hidden-size, kv_lora_rank 32, qk_head_dim 128, qk_pos_emb_head_dim 64, v_head_dim 128, no query
    latent (Megatron-LM megatron/training/arguments.py)."""
    experts = num("--num-experts")
    if experts is not None:
        imp.set("experts", experts)
        k = num("--moe-router-topk")
        imp.set("top_k", 2 if k is None else k, default=k is None)
        if k is None:
            imp.notes.append("no --moe-router-topk: Megatron's default 2")
        f = num("--moe-ffn-hidden-size")
        width = f if f is not None else imp.values.get("ffn")
        if f is not None:
            imp.set("expert_ffn", f)
        elif width is not None:
            imp.set("expert_ffn", width, default=True)
            imp.notes.append(f"no --moe-ffn-hidden-size: Megatron's default, the --ffn-hidden-size {width}")
        shared = num("--moe-shared-expert-intermediate-size")
        if shared is not None:
            if width is None or shared % width:
                raise InputError(f"{source}: --moe-shared-expert-intermediate-size {shared} is not a multiple of "
                                 f"the expert width {width}; memcalc models shared experts as n experts of that width")
            imp.set("shared_experts", shared // width)
        freq = args.get("--moe-layer-freq")
        if isinstance(freq, str):
            imp.set("first_dense_layers", _layer_freq(freq, imp.values.get("layers"), source))
        dispatcher = (text("--moe-token-dispatcher-type") or "allgather").lower()
        if dispatcher != "alltoall":
            imp.notes.append(f"--moe-token-dispatcher-type {dispatcher}"
                             + (" (Megatron's default)" if "--moe-token-dispatcher-type" not in args else "")
                             + ": memcalc models the alltoall dispatcher's buffers")
        # the inventory memcalc models (docs/methodology.md, "MoE layer, megatron profile")
        for flag, what in (("--moe-grouped-gemm", "TE's grouped GEMM"), ("--moe-permute-fusion", "TE's fused "
                                                                                               "permutation")):
            if not args.get(flag):
                imp.notes.append(f"no {flag}: memcalc models the MoE layer with {what}")
        etp = num("--expert-tensor-parallel-size")
        if etp is not None and etp != imp.values.get("tp", 1):
            imp.ignore("--expert-tensor-parallel-size", f"{etp}: experts are modelled with the attention's tensor "
                                                         "parallelism (--tp)")
    if args.get("--multi-latent-attention"):
        if not args.get("--disable-bias-linear"):
            raise InputError(f"{source}: --multi-latent-attention with biased linear layers (Megatron's default): "
                             "memcalc models MLA layers without biases, as DeepSeek's; add --disable-bias-linear")
        dims = (("--kv-lora-rank", "kv_lora_rank", 32), ("--qk-head-dim", "qk_nope_dim", 128),
                ("--qk-pos-emb-head-dim", "qk_rope_dim", 64), ("--v-head-dim", "v_head_dim", 128))
        for flag, field, default in dims:
            v = num(flag)
            imp.set(field, default if v is None else v, default=v is None)
            if v is None:
                imp.notes.append(f"--multi-latent-attention without {flag}: Megatron's default {default}")
        q = num("--q-lora-rank")
        imp.set("q_lora_rank", 0 if q is None else q, default=q is None)
        imp.values.pop("kv_heads", None)  # MLA: a key and a value per head
        imp.from_config.discard("kv_heads")
        if "--kv-channels" in args:
            imp.notes.append("--kv-channels is not used by multi-latent attention (its widths are --qk-head-dim, "
                             "--qk-pos-emb-head-dim and --v-head-dim)")
    else:
        for flag in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim"):
            if flag in args:
                imp.ignore(flag, "used only with --multi-latent-attention")
        if args.get("--qk-layernorm"):  # with MLA: the latents' norms, which memcalc's MLA always has
            imp.ignore("--qk-layernorm", "per-head query and key norms are not modelled (2 x head_dim parameters "
                                         "and the normed q, k saved per layer)")


def _model_shape(args: dict[str, Any], imp: Imported, source: str, num: Any, text: Any) -> None:
    """Megatron's model dimensions and architecture choices (with Megatron's defaults when absent). Dropped by
    apply_imports when --model or --params is given."""
    dims = {f: num(flag) for flag, f in (("--num-layers", "layers"), ("--hidden-size", "hidden"),
                                         ("--num-attention-heads", "heads"), ("--ffn-hidden-size", "ffn"))}
    vocab = num("--padded-vocab-size") or num("--vocab-size")
    for f, v in dims.items():
        if v is not None:
            imp.set(f, v)
    if vocab is not None:
        imp.set("vocab", vocab)
    swiglu = bool(args.get("--swiglu"))
    imp.set("mlp", "swiglu" if swiglu else "gelu", default=not swiglu)
    hidden = dims["hidden"]
    if dims["ffn"] is None and hidden is not None:
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
        imp.set("ffn", ffn, default=True)
        imp.notes.append(f"no --ffn-hidden-size: Megatron's default {ffn}"
                         + (" (int(4*hidden*2/3 / 64)*64 with --swiglu)" if swiglu else " (4*hidden)"))
    if args.get("--group-query-attention"):
        g = num("--num-query-groups")
        if g is None:
            raise InputError(f"{source}: --group-query-attention needs --num-query-groups")
        imp.set("kv_heads", g)
    elif "--num-query-groups" in args:
        imp.ignore("--num-query-groups", "Megatron uses it only with --group-query-attention")
    if dims["heads"] is not None and "kv_heads" not in imp.values:
        imp.set("kv_heads", dims["heads"], default=True)
    norm = text("--normalization")
    if norm is not None:
        n = {"layernorm": "layernorm", "rmsnorm": "rmsnorm"}.get(norm.lower())
        if n is None:
            raise InputError(f"{source}: --normalization {norm!r}; valid: LayerNorm, RMSNorm")
        imp.set("norm", n)
    else:
        imp.set("norm", "layernorm", default=True)
    pos = text("--position-embedding-type")
    if args.get("--use-rotary-position-embeddings"):
        pos = pos or "rope"
    if pos is not None:
        p = pos.lower()
        if p not in ("rope", "learned_absolute", "none", "mrope", "yarn"):
            raise InputError(f"{source}: --position-embedding-type {pos!r}; valid: learned_absolute, rope, none")
        imp.set("positions", "learned" if p == "learned_absolute" else "rotary")
        if p == "none":
            imp.notes.append("--position-embedding-type none: no position parameters (modelled as rotary)")
    elif args.get("--no-position-embedding"):
        imp.set("positions", "rotary")
    else:
        imp.set("positions", "learned", default=True)
    mpe = num("--max-position-embeddings")
    if mpe is not None:
        imp.set("max_positions", mpe)
    if args.get("--disable-bias-linear"):
        imp.set("bias", False)
    else:
        imp.set("bias", True, default="--add-bias-linear" not in args)
    if args.get("--add-qkv-bias"):
        imp.set("qkv_bias", True)
    tied = not args.get("--untie-embeddings-and-output-weights")
    imp.set("tied_embeddings", tied, default=tied)
    kv = num("--kv-channels")
    if kv is not None and not args.get("--multi-latent-attention"):
        if hidden is not None and dims["heads"] is not None and kv == hidden // dims["heads"]:
            imp.notes.append(f"--kv-channels {kv} equals hidden/heads")
        else:
            imp.set("head_dim", kv)
    if vocab is None and any(v is not None for v in dims.values()):
        imp.needs_value.append("no --vocab-size / --padded-vocab-size (Megatron takes it from the tokenizer): "
                               "give --vocab N, or --model")
