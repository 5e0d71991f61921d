#!/usr/bin/env python3
"""Check the preset TOML files under presets/ (stdlib only; does not import memcalc).

For every file in presets/models/ and presets/gpus/: parse it with tomllib, check the required keys, their
types and allowed values, that no unknown key is present, that `name` matches the file name and that names and
aliases are unique. For models, compute the exact parameter count from the shape (param_count() below: embedding,
learned positions, per-layer attention (or MLA) / MLP or MoE (dense first layers) / one, two or four norms
(post_norms), final norm, untied LM head and its bias) and compare it with
`expected_params` where a file has one. Prints a table per kind; exits 1 on any problem.

Usage: python scripts/check_presets.py [PRESETS_DIR]
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

MODEL_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "display_name": str,
    "aliases": list,
    "family": str,
    "source": str,
    "hidden": int,
    "layers": int,
    "heads": int,
    "ffn": int,
    "vocab": int,
    "mlp": str,
    "norm": str,
    "qkv_bias": bool,
    "linear_bias": bool,
    "tied_embeddings": bool,
    "positions": str,
    "max_positions": int,
    "dropout": (int, float),
}
MODEL_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "kv_heads": int,  # required unless [mla] (one key/value per head)
    "head_dim": int,  # required unless [mla] (qk_nope_dim + qk_rope_dim)
    "expected_params": int,
    "params_source": str,
    "head_bias": bool,
    "post_norms": bool,
    "qk_norm": bool,
    "final_logit_softcap": bool,  # the head's output softcapped (Gemma 2): activations only, no parameters
    "attn_softcap": bool,  # the attention scores softcapped (Gemma 2): activations only
    "notes": list,  # what the model does that memcalc leaves to the user's choices, shown with the estimate
    "block": str,
    "moe": dict,
    "mla": dict,
}
MOE_REQUIRED: dict[str, type] = {"experts": int, "top_k": int, "expert_ffn": int, "shared_experts": int}
MOE_OPTIONAL: dict[str, type] = {"first_dense_layers": int}
MLA_REQUIRED: dict[str, type] = {"kv_lora_rank": int, "qk_nope_dim": int, "qk_rope_dim": int, "v_head_dim": int}
MLA_OPTIONAL: dict[str, type] = {"q_lora_rank": int}
CHOICES = {
    "family": {"llama", "gpt2", "gpt3", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "falcon", "deepseek", "phi",
               "gpt-neox"},
    "mlp": {"swiglu", "gelu"},
    "norm": {"rmsnorm", "layernorm"},
    "positions": {"rotary", "learned"},
}

BLOCKS = {"sequential", "parallel", "parallel-shared-norm"}

GPU_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "display_name": str,
    "aliases": list,
    "source": str,
    "memory_bytes": int,
    "memory_note": str,
    "hbm_bytes_per_s": (int, float),
    "gpus_per_node": int,
    "intra_node_bytes_per_s": (int, float),
    "inter_node_bytes_per_s": (int, float),
    "host_bytes_per_s": (int, float),
    "latency_s": (int, float),
    "runtime_overhead_bytes": int,
    "default_mfu": (int, float),
    "arch": str,
    "flops": dict,
}
GPU_OPTIONAL: dict[str, type | tuple[type, ...]] = {}
FLOPS_KEYS = {"fp32", "tf32", "bf16", "fp16", "fp8"}
ARCH_PATTERN = r"sm[0-9]{2,3}|gfx[0-9a-f]{3,4}"  # memcalc/specs.py HardwareSpec.arch


def _type_ok(value: object, want: type | tuple[type, ...]) -> bool:
    # bool is a subclass of int: never accept it where a number is wanted.
    if isinstance(value, bool) and want is not bool and not (isinstance(want, tuple) and bool in want):
        return False
    return isinstance(value, want)


def _check_keys(data: dict, required: dict, optional: dict, where: str) -> list[str]:
    errors = []
    for key, want in required.items():
        if key not in data:
            errors.append(f"{where}: missing key {key!r}")
        elif not _type_ok(data[key], want):
            errors.append(f"{where}: {key!r} has type {type(data[key]).__name__}")
    for key, value in data.items():
        if key in required:
            continue
        if key not in optional:
            errors.append(f"{where}: unknown key {key!r}")
        elif not _type_ok(value, optional[key]):
            errors.append(f"{where}: {key!r} has type {type(value).__name__}")
    return errors


def _check_aliases(data: dict, where: str) -> list[str]:
    aliases = data.get("aliases", [])
    bad = [a for a in aliases if not isinstance(a, str) or a != a.lower() or not a]
    return [f"{where}: aliases must be non-empty lower-case strings: {bad}"] if bad else []


def param_count(m: dict) -> int:
    """Exact parameter count of a decoder-only transformer described by a model preset."""
    h, L, a = m["hidden"], m["layers"], m["heads"]
    f, V = m["ffn"], m["vocab"]
    swiglu = m["mlp"] == "swiglu"
    norm = h if m["norm"] == "rmsnorm" else 2 * h

    total = V * h  # token embedding
    if m["positions"] == "learned":
        total += m["max_positions"] * h

    mla = m.get("mla")
    if mla:  # DeepSeek-V2/V3 attention: latents with their RMSNorms, per-head up projections
        qk = mla["qk_nope_dim"] + mla["qk_rope_dim"]
        kvl, ql, dv = mla["kv_lora_rank"], mla.get("q_lora_rank", 0), mla["v_head_dim"]
        attn = h * (kvl + mla["qk_rope_dim"]) + kvl + kvl * a * (mla["qk_nope_dim"] + dv) + a * dv * h
        attn += (h * ql + ql + ql * a * qk) if ql else h * a * qk
    else:
        g, d = m["kv_heads"], m["head_dim"]
        attn = h * a * d + 2 * h * g * d + a * d * h  # q, k, v, o
        if m.get("qk_norm"):  # an RMSNorm (LayerNorm: + bias) over each head of q and of k
            attn += 2 * d * (1 if m["norm"] == "rmsnorm" else 2)
        if m["qkv_bias"]:
            attn += a * d + 2 * g * d
        if m["linear_bias"]:
            attn += h  # o bias

    def dense_mlp(width: int) -> int:
        return (3 if swiglu else 2) * h * width + ((width * (2 if swiglu else 1) + h) if m["linear_bias"] else 0)

    moe = m.get("moe")
    n_norms = 1 if m.get("block") == "parallel-shared-norm" else (4 if m.get("post_norms") else 2)
    layer = attn + n_norms * norm
    if moe:
        routed = h * moe["experts"] + (moe["experts"] + moe["shared_experts"]) * dense_mlp(moe["expert_ffn"])
        k = moe.get("first_dense_layers", 0)
        total += (L - k) * (layer + routed) + k * (layer + dense_mlp(f))
    else:
        total += L * (layer + dense_mlp(f))
    total += norm  # final norm
    if not m["tied_embeddings"]:
        total += V * h + (V if m.get("head_bias") else 0)  # LM head (and its bias)
    return total


def check_model(path: Path, m: dict) -> tuple[list[str], list[str]]:
    where = f"models/{path.name}"
    errors = _check_keys(m, MODEL_REQUIRED, MODEL_OPTIONAL, where)
    if errors:
        return errors, []
    errors += _check_aliases(m, where)
    if m["name"] != path.stem:
        errors.append(f"{where}: name {m['name']!r} differs from the file name")
    for key, allowed in CHOICES.items():
        if m[key] not in allowed:
            errors.append(f"{where}: {key} = {m[key]!r} not in {sorted(allowed)}")
    if m.get("block", "sequential") not in BLOCKS:
        errors.append(f"{where}: block = {m['block']!r} not in {sorted(BLOCKS)}")
    if "mla" in m:
        errors += _check_keys(m["mla"], MLA_REQUIRED, MLA_OPTIONAL, f"{where} [mla]")
    else:
        errors += [f"{where}: missing key {k!r}" for k in ("kv_heads", "head_dim") if k not in m]
    if errors:
        return errors, []
    dims = ("hidden", "layers", "heads", "ffn", "vocab", "max_positions") + (() if "mla" in m else ("kv_heads",
                                                                                                    "head_dim"))
    for key in dims:
        if m[key] < 1:
            errors.append(f"{where}: {key} must be >= 1")
    if "mla" not in m and m["kv_heads"] >= 1 and m["heads"] % m["kv_heads"]:
        errors.append(f"{where}: heads {m['heads']} not a multiple of kv_heads {m['kv_heads']}")
    if not 0.0 <= m["dropout"] < 1.0:
        errors.append(f"{where}: dropout out of [0, 1)")
    if "expected_params" in m and "params_source" not in m:
        errors.append(f"{where}: expected_params without params_source")
    if "moe" in m:
        errors += _check_keys(m["moe"], MOE_REQUIRED, MOE_OPTIONAL, f"{where} [moe]")
        if not errors and m["moe"]["top_k"] > m["moe"]["experts"]:
            errors.append(f"{where}: moe top_k exceeds experts")
    if errors:
        return errors, []
    computed = param_count(m)
    expected = m.get("expected_params")
    status = "-" if expected is None else ("ok" if computed == expected else "MISMATCH")
    if status == "MISMATCH":
        errors.append(f"{where}: computed {computed:,} != expected_params {expected:,}")
    exp = "" if expected is None else f"{expected:,}"
    row = [m["name"], m["family"], f"{computed:,}", exp, status]
    return errors, row


def check_gpu(path: Path, g: dict) -> tuple[list[str], list[str]]:
    where = f"gpus/{path.name}"
    errors = _check_keys(g, GPU_REQUIRED, GPU_OPTIONAL, where)
    if errors:
        return errors, []
    errors += _check_aliases(g, where)
    if g["name"] != path.stem:
        errors.append(f"{where}: name {g['name']!r} differs from the file name")
    flops = g["flops"]
    unknown = set(flops) - FLOPS_KEYS
    if unknown:
        errors.append(f"{where}: unknown [flops] keys {sorted(unknown)}")
    for key in ("fp32", "bf16", "fp16"):
        if key not in flops and not (key == "bf16" and g["name"].startswith("v100")):
            errors.append(f"{where}: [flops] lacks {key}")
    for key, value in flops.items():
        if not _type_ok(value, (int, float)) or value <= 0:
            errors.append(f"{where}: [flops] {key} must be a positive number")
    for key in ("memory_bytes", "hbm_bytes_per_s", "gpus_per_node", "intra_node_bytes_per_s", "host_bytes_per_s"):
        if g[key] <= 0:
            errors.append(f"{where}: {key} must be > 0")
    if g["inter_node_bytes_per_s"] < 0 or g["latency_s"] < 0 or g["runtime_overhead_bytes"] < 0:
        errors.append(f"{where}: negative network/latency/overhead figure")
    if not 0 < g["default_mfu"] <= 1:
        errors.append(f"{where}: default_mfu out of (0, 1]")
    if not re.fullmatch(ARCH_PATTERN, g["arch"]):
        errors.append(f"{where}: arch {g['arch']!r} is not smNN or gfxNNN")
    row = [
        g["name"],
        f"{g['memory_bytes'] / 2**30:.2f} GiB",
        f"{flops.get('bf16', flops.get('fp16', 0)) / 1e12:.1f}",
        f"{g['hbm_bytes_per_s'] / 1e12:.2f}",
        f"{g['intra_node_bytes_per_s'] / 1e9:.0f}",
        f"{g['inter_node_bytes_per_s'] / 1e9:.1f}",
        f"{g['default_mfu']:.2f}",
    ]
    return errors, row


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "presets"
    errors: list[str] = []
    tables = []
    seen: dict[str, str] = {}
    for kind, checker, header in (
        ("models", check_model, ["model", "family", "computed params", "expected_params", "check"]),
        ("gpus", check_gpu, ["gpu", "memory", "bf16 TF/s", "HBM TB/s", "intra GB/s", "inter GB/s", "mfu"]),
    ):
        files = sorted((root / kind).glob("*.toml"), key=lambda p: p.stem)
        if not files:
            errors.append(f"no files in {root / kind}")
        rows = []
        for path in files:
            try:
                data = tomllib.loads(path.read_text(encoding="utf-8"))
            except (OSError, tomllib.TOMLDecodeError) as exc:
                errors.append(f"{kind}/{path.name}: cannot parse: {exc}")
                continue
            errs, row = checker(path, data)
            errors += errs
            if row:
                rows.append(row)
            for label in [data.get("name", "")] + list(data.get("aliases", [])):
                key = f"{kind}:{str(label).lower()}"
                if key in seen and seen[key] != path.name:
                    errors.append(f"{kind}/{path.name}: name or alias {label!r} also used by {seen[key]}")
                seen[key] = path.name
        tables.append(_table(header, rows))
    print("\n\n".join(tables))
    if errors:
        print("\nPROBLEMS:")
        print("\n".join(f"  {e}" for e in errors))
        return 1
    print("\nall presets OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
