"""Model and GPU presets (TOML files under presets/, shipped inside the wheel as memcalc/presets), Hugging Face
`config.json` import, and the `--params N` reference shapes. Nothing is downloaded.
"""

from __future__ import annotations

import difflib
import functools
import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from memcalc.errors import InputError
from memcalc.specs import HardwareSpec, ModelSpec, validation_message

_MODEL_KEYS = set(ModelSpec.model_fields)
_GPU_KEYS = set(HardwareSpec.model_fields)


def presets_dir() -> Path:
    """presets/ inside the installed package (wheel), else the source checkout's top-level presets/."""
    here = Path(__file__).resolve().parent
    for cand in (here / "presets", here.parent / "presets"):
        if (cand / "models").is_dir():
            return cand
    raise InputError("memcalc's presets/ folder is missing from this installation; reinstall memcalc")


def _slug(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


@functools.lru_cache(maxsize=None)
def _load_dir(kind: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted((presets_dir() / kind).glob("*.toml")):
        with path.open("rb") as f:
            data = tomllib.load(f)
        data["_path"] = str(path)
        out[data["name"]] = data
    return out


@functools.lru_cache(maxsize=None)
def _aliases(kind: str) -> dict[str, str]:
    table: dict[str, str] = {}
    for name, data in _load_dir(kind).items():
        for alias in [name, *data.get("aliases", [])]:
            table[_slug(alias)] = name
            table[_slug(alias).replace("-", "")] = name
    return table


def _lookup(kind: str, name: str, flag: str) -> dict[str, Any]:
    table = _aliases(kind)
    key = _slug(name)
    hit = table.get(key) or table.get(key.replace("-", ""))
    if hit is None:
        names = sorted(_load_dir(kind))
        close = difflib.get_close_matches(key, list(table), n=3, cutoff=0.5)
        close_names = list(dict.fromkeys(table[c] for c in close))
        hint = f"did you mean {', '.join(close_names)}? " if close_names else ""
        raise InputError(f"{flag} {name!r} is not a known preset; {hint}valid: {', '.join(names)}")
    return _load_dir(kind)[hit]


def model_names() -> list[str]:
    return sorted(_load_dir("models"))


def gpu_names() -> list[str]:
    return sorted(_load_dir("gpus"))


def model_preset_data(name: str) -> dict[str, Any]:
    return _lookup("models", name, "--model")


def gpu_preset_data(name: str) -> dict[str, Any]:
    return _lookup("gpus", name, "--gpu")


def _model_from_dict(data: dict[str, Any], where: str) -> ModelSpec:
    fields = {k: v for k, v in data.items() if k in _MODEL_KEYS}
    try:
        return ModelSpec(**fields)
    except ValidationError as e:
        raise InputError(validation_message(e, prefix=f"{where}: ")) from None


def load_model_preset(name: str) -> ModelSpec:
    data = model_preset_data(name)
    return _model_from_dict(data, f"preset {data['name']}")


def load_gpu(name: str) -> HardwareSpec:
    data = gpu_preset_data(name)
    fields = {k: v for k, v in data.items() if k in _GPU_KEYS}
    try:
        return HardwareSpec(**fields)
    except ValidationError as e:
        raise InputError(validation_message(e, prefix=f"GPU preset {data['name']}: ")) from None


# --- Hugging Face config.json -------------------------------------------------------------------------------

_HF_GELU = {"gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu"}
# Gemma's MLP is gated (gate_proj, up_proj, down_proj: GeGLU) with a GELU activation (modeling_gemma*.py GemmaMLP):
# the same three matrices and saved tensors as SwiGLU. Its configs (configuration_gemma*.py) tie the LM head to the
# embedding by default, so a saved config.json leaves tie_word_embeddings out.
_GEMMA = {"gemma", "gemma2", "gemma3", "gemma3_text"}
# the model types whose config.json fields this mapping reads in full; others are read by the same field names, with
# a note that what else their layers do is not modelled
# Falcon (modeling_falcon.py; the first checkpoints' model types RefinedWebModel, 7B, and RefinedWeb, 40B)
_FALCON = {"falcon", "refinedwebmodel", "refinedweb"}
_HF_KNOWN = {"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3",
             "gpt2", "gpt_neox", "gptj", "phi", "phi3", *_GEMMA, *_FALCON}


def model_from_hf_config(cfg: dict[str, Any], where: str) -> ModelSpec:
    """Map the field names of Llama, Mistral, Qwen2, Mixtral, DeepSeek, GPT-2, GPT-NeoX, GPT-J and phi configs
    onto a ModelSpec."""
    mt = str(cfg.get("model_type", "")).lower()

    def get(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if k in cfg and cfg[k] is not None:
                return cfg[k]
        return default

    hidden = get("hidden_size", "n_embd", "d_model")
    text = cfg.get("text_config")
    if hidden is None and isinstance(text, dict):
        # a multimodal checkpoint (Gemma 3, Llama 4, Mistral 3, ...): the language model's fields in text_config
        inner = model_from_hf_config({"_name_or_path": cfg.get("_name_or_path"), **text}, where)
        towers = sorted(k.removesuffix("_config") for k, v in cfg.items()
                        if k.endswith("_config") and k != "text_config" and isinstance(v, dict))
        note = ("the language model read from text_config" + (f"; the {', '.join(towers)} tower(s) and projector "
                "are not counted" if towers else ""))
        return inner.model_copy(update={"notes": (note, *inner.notes)})
    if hidden is None:
        raise InputError(f"{where} has no hidden_size (or n_embd); it is not a transformer config.json")
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    vocab = get("vocab_size")
    for key, val in (("num_hidden_layers", layers), ("num_attention_heads", heads), ("vocab_size", vocab)):
        if val is None:
            raise InputError(f"{where} has no {key}; a config.json for Llama, Mistral, Qwen2, GPT-2 or GPT-NeoX needs it")
    gptj = mt == "gptj"
    phi = mt == "phi"
    gpt2 = mt == "gpt2" or ("n_embd" in cfg and not gptj)
    neox = mt == "gpt_neox"
    # the parallel blocks (`ModelSpec.block`): GPT-NeoX's use_parallel_residual (default true, two LayerNorms;
    # modeling_gpt_neox.py), GPT-J's and phi's one shared LayerNorm (modeling_gptj.py, modeling_phi.py)
    block = "sequential"
    if neox and get("use_parallel_residual", default=True):
        block = "parallel"
    elif gptj or phi:
        block = "parallel-shared-norm"
    falcon = mt in _FALCON
    kv_heads = get("num_key_value_heads", default=heads)
    if falcon:
        # FalconDecoderLayer / FalconAttention (modeling_falcon.py, FalconConfig defaults): the new decoder
        # architecture (40B, 180B; RefinedWeb) has num_kv_heads K/V heads and, with num_ln_in_parallel_attn 2 (its
        # default), ln_attn and ln_mlp; the original (7B) one input_layernorm for both branches when parallel_attn,
        # and multi_query's single K/V head; sequential layers have a post_attention_layernorm
        new_arch = bool(get("new_decoder_architecture", default=mt == "refinedweb"))
        if new_arch:
            kv_heads = get("num_kv_heads", "n_head_kv", default=heads)
            block = "parallel" if get("num_ln_in_parallel_attn", default=2) == 2 else "parallel-shared-norm"
        else:
            kv_heads = 1 if get("multi_query", default=True) else heads
            block = "parallel-shared-norm" if get("parallel_attn", default=True) else "sequential"
    act = str(get("hidden_activation", "hidden_act", "activation_function", default="silu")).lower()
    # (Falcon's MLP is a plain nn.GELU between dense_h_to_4h and dense_4h_to_h; its config names no activation)
    gated = mt in _GEMMA or (act not in _HF_GELU and not gpt2 and not neox and not gptj and not falcon)
    ffn = get("intermediate_size", "n_inner", "ffn_hidden_size")
    if ffn is None:
        ffn = 4 * hidden
    spec: dict[str, Any] = {
        "name": str(get("_name_or_path", default="")).split("/")[-1].lower() or (mt or "hf-model"),
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": get("head_dim", default=hidden // heads),
        "ffn": ffn,
        "vocab": vocab,
        "mlp": "swiglu" if gated else "gelu",
        "norm": "layernorm" if (gpt2 or neox or gptj or phi or falcon) else "rmsnorm",
        # phi's every linear has a bias; GPT-J's MLP and LM head do, its q/k/v/out_proj not (linear_bias also
        # gives it an out_proj bias: h parameters per layer too many)
        # Qwen2 and Qwen2-MoE give q, k and v a bias (modeling_qwen2*.py: bias=True), whatever attention_bias says
        "qkv_bias": bool(gpt2 or neox or phi or mt in ("qwen2", "qwen2_moe") or get("attention_bias", default=False)
                         or (falcon and get("bias", default=False))),
        "linear_bias": bool(gpt2 or neox or phi or gptj or get("mlp_bias", default=False)
                            or (falcon and get("bias", default=False))),
        "head_bias": bool(gptj or phi),
        # Gemma 2/3 (modeling_gemma2.py Gemma2DecoderLayer): post_attention_layernorm and post_feedforward_layernorm
        "post_norms": mt in ("gemma2", "gemma3", "gemma3_text"),
        # Qwen3 and Gemma 3 (modeling_qwen3.py Qwen3Attention): an RMSNorm over each head of q and k
        "qk_norm": mt in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
        # Gemma 2 (Gemma2ForCausalLM.forward): logits / cap -> tanh -> * cap before the loss; Gemma2Config's default
        # is 30.0 (a config.json that omits it gets it), an explicit null turns it off; Gemma 3 sets it null
        "final_logit_softcap": bool(cfg.get("final_logit_softcapping", 30.0 if mt == "gemma2" else None)),
        # and its attention scores (eager_attention_forward's `softcap`): Gemma2Config's default 50.0
        "attn_softcap": bool(cfg.get("attn_logit_softcapping", 50.0 if mt == "gemma2" else None)),
        "block": block,
        "tied_embeddings": bool(get("tie_word_embeddings", default=gpt2 or falcon or mt in _GEMMA)),
        "positions": "learned" if gpt2 else "rotary",
        "max_positions": get("max_position_embeddings", "n_positions", "n_ctx", default=0),
        "dropout": float(get("attention_dropout", "attn_pdrop", "hidden_dropout", default=0.0) or 0.0),
        "source": f"Hugging Face config.json at {where}",
    }
    notes: list[str] = []
    experts = get("num_local_experts", "num_experts", "n_routed_experts")
    if experts:
        expert_ffn = get("moe_intermediate_size", default=ffn)
        # DeepSeek-V2/V3 (modeling_deepseek*.py): n_shared_experts of moe_intermediate_size each, and the first
        # first_k_dense_replace layers keep a dense MLP of intermediate_size. Qwen2-MoE (modeling_qwen2_moe.py): one
        # shared expert MLP of shared_expert_intermediate_size, i.e. that width / moe_intermediate_size experts
        # of expert_ffn (MoESpec: one MLP of their summed width), behind a sigmoid gate of h weights
        shared = get("n_shared_experts", default=0) or 0
        shared_width = get("shared_expert_intermediate_size", default=0) or 0
        if shared_width and not shared:
            shared = max(1, round(shared_width / expert_ffn))
            if shared * expert_ffn != shared_width:
                notes.append(f"shared_expert_intermediate_size {shared_width} is not a multiple of "
                             f"moe_intermediate_size {expert_ffn}: modelled as {shared} shared expert(s) of "
                             f"{expert_ffn}")
            notes.append("the shared expert's sigmoid gate (hidden_size weights per layer) is not counted")
        spec["moe"] = {
            "experts": experts,
            "top_k": get("num_experts_per_tok", default=2),
            "expert_ffn": expert_ffn,
            "shared_experts": shared,
            "first_dense_layers": get("first_k_dense_replace", default=0) or 0,
        }
    if get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3 DeepseekV3Attention)
        spec["mla"] = {
            "q_lora_rank": get("q_lora_rank", default=0) or 0,
            "kv_lora_rank": get("kv_lora_rank"),
            "qk_nope_dim": get("qk_nope_head_dim"),
            "qk_rope_dim": get("qk_rope_head_dim"),
            "v_head_dim": get("v_head_dim"),
        }
        spec["head_dim"] = 0  # the query/key width, nope + rope (ModelSpec derives it; kv_heads = heads)
    notes += _hf_unmodelled(cfg, mt)
    spec["notes"] = tuple(notes)
    return _model_from_dict(spec, where)


def _hf_unmodelled(cfg: dict[str, Any], mt: str) -> list[str]:
    """What a config.json describes that ModelSpec does not carry, each with its effect on memory."""
    out = []
    if mt == "olmo2":
        out.append("q_norm and k_norm over the whole q and k projections (OLMo 2): their weights and saved inputs "
                   "are not counted")
    if cfg.get("attn_logit_softcapping", 50.0 if mt == "gemma2" else None):
        out.append("attn_logit_softcapping: needs --attention eager (modelled: its tanh saves the scores once more) "
                   "or flash-attn >= 2.6 (inside the kernel); PyTorch's SDPA kernels do not apply it")
    if cfg.get("alibi"):
        out.append("alibi (falcon-rw): ALiBi's per-head position bias has no parameters and is modelled as rotary "
                   "positions (their small cos/sin tables); Hugging Face runs it through SDPA with a bias mask, "
                   "where flash-attn would need alibi_slopes")
    if mt and mt not in _HF_KNOWN:
        out.append(f"model_type {mt!r} is read by the field names of Llama, GPT-2 and GPT-NeoX configs; whatever "
                   "else its layers hold is not modelled (check the parameter count against the model card)")
    return out


def load_model_file(path: Path, name: str = "") -> ModelSpec:
    """A config.json or preset-format TOML; `name` names a config.json without `_name_or_path` (a repository id or
    a checkpoint directory's name)."""
    if not path.is_file():
        raise InputError(f"--model {str(path)!r} is neither a preset nor a readable file; see `memcalc presets`")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise InputError(f"--model {str(path)!r} is not valid TOML: {e}") from None
        if "name" not in data:
            data["name"] = path.stem
        return _model_from_dict(data, str(path))
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"--model {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno}); expected a config.json") from None
    if not isinstance(cfg, dict):
        raise InputError(f"--model {str(path)!r} holds a JSON {type(cfg).__name__}, not a config object")
    if name and not cfg.get("_name_or_path"):
        cfg = {**cfg, "_name_or_path": name}
    return model_from_hf_config(cfg, str(path))


def hf_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded repositories: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (huggingface_hub constants.py)."""
    import os

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    base = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _cached_hf_config(repo: str) -> Path | None:
    """A Hugging Face repository id's config.json in the local hub cache (models--org--name/snapshots/<rev>/), the
    revision refs/main names first, else the newest snapshot holding one; None when it was never downloaded."""
    root = hf_cache_dir() / ("models--" + repo.replace("/", "--"))
    snaps = root / "snapshots"
    main = root / "refs" / "main"
    if main.is_file():
        cfg = snaps / main.read_text(encoding="utf-8").strip() / "config.json"
        if cfg.is_file():
            return cfg
    found = sorted(snaps.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snaps.is_dir() else []
    return found[-1] if found else None


def load_model(ref: str) -> ModelSpec:
    """A preset name; a path to a config.json, a preset-format TOML or a checkpoint directory holding a config.json;
    or a Hugging Face repository id (org/name) already in the local hub cache (no download)."""
    path = Path(ref)
    if path.is_dir():
        if (path / "config.json").is_file():
            return load_model_file(path / "config.json", path.resolve().name)
        raise InputError(f"--model {ref!r} is a directory without a config.json; give a checkpoint directory, a "
                         "config.json or a preset (`memcalc presets`)")
    repo_like = ref.count("/") == 1 and not ref.startswith((".", "/", "~")) and not ref.endswith((".json", ".toml"))
    if repo_like and not path.exists():
        cached = _cached_hf_config(ref)
        if cached is not None:
            return load_model_file(cached, ref)
        raise InputError(f"--model {ref!r} is not a preset, a file, or a repository in the Hugging Face cache "
                         f"({hf_cache_dir()}); fetch its config (`huggingface-cli download {ref} config.json`) or "
                         "pass the path of its config.json")
    looks_like_path = ref.endswith((".json", ".toml")) or "/" in ref or "\\" in ref
    if looks_like_path:
        return load_model_file(path)
    return load_model_preset(ref)


# --- --params N: reference shapes ----------------------------------------------------------------------------

REFERENCE_FAMILIES = ("llama",)


def reference_shape(n_params: int) -> ModelSpec:
    """The Llama-style preset nearest in (log) size to `n_params`; its dimensions drive activations and compute
    while model states use exactly `n_params` (ModelSpec.params_override)."""
    import math

    from memcalc.cost.params import shape_params

    best: tuple[float, ModelSpec] | None = None
    for name, data in _load_dir("models").items():
        if data.get("family") not in REFERENCE_FAMILIES or data.get("moe"):
            continue
        spec = _model_from_dict(data, f"preset {name}")
        dist = abs(math.log(shape_params(spec) / n_params))
        if best is None or dist < best[0]:
            best = (dist, spec)
    if best is None:
        raise InputError("no Llama-style reference shape is installed; reinstall memcalc")
    return best[1].model_copy(update={"params_override": n_params})
