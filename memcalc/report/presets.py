"""`memcalc presets` and `memcalc presets show NAME`."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

from memcalc.errors import InputError
from memcalc.units import format_bytes, format_count


def render_presets(json_out: bool = False) -> None:
    from memcalc.cost.params import total_params
    from memcalc.presets import gpu_names, gpu_preset_data, load_gpu, load_model_preset, model_names, model_preset_data

    models = []
    for name in model_names():
        spec = load_model_preset(name)
        data = model_preset_data(name)
        models.append({"name": name, "display_name": spec.display_name, "params": total_params(spec),
                       "aliases": data.get("aliases", []), "layers": spec.layers, "hidden": spec.hidden,
                       "heads": spec.heads, "kv_heads": spec.kv_heads, "moe": spec.moe is not None,
                       "mla": spec.mla is not None})
    gpus = []
    for name in gpu_names():
        hw = load_gpu(name)
        gpus.append({"name": name, "display_name": hw.display_name, "memory_bytes": hw.memory_bytes,
                     "aliases": gpu_preset_data(name).get("aliases", []),
                     "bf16_flops": hw.flops.get("bf16", 0.0), "gpus_per_node": hw.gpus_per_node})
    if json_out:
        sys.stdout.write(json.dumps({"models": models, "gpus": gpus}, indent=2) + "\n")
        return
    con = Console(highlight=False)
    t = Table(title="Models", box=None, header_style="bold", title_justify="left")
    for c in ("name", "params", "layers", "hidden", "heads (kv)", "aliases"):
        t.add_column(c, justify="right" if c in ("params", "layers", "hidden") else "left")
    for m in models:
        heads = f"{m['heads']} ({m['kv_heads']})" + (" MLA" if m["mla"] else "") + (" MoE" if m["moe"] else "")
        t.add_row(m["name"], format_count(m["params"]), str(m["layers"]), str(m["hidden"]), heads,
                  ", ".join(m["aliases"]))
    con.print(t)
    g = Table(title="GPUs", box=None, header_style="bold", title_justify="left")
    for c in ("name", "memory", "bf16 dense", "per node", "aliases"):
        g.add_column(c, justify="right" if c in ("memory", "bf16 dense", "per node") else "left")
    for x in gpus:
        g.add_row(x["name"], format_bytes(x["memory_bytes"], "GiB", 1), f"{x['bf16_flops'] / 1e12:,.0f} TFLOP/s",
                  str(x["gpus_per_node"]), ", ".join(x["aliases"]))
    con.print(g)
    con.print("memcalc presets show NAME for details; --model also takes a config.json or TOML path.")


def render_preset(name: str, json_out: bool = False) -> None:
    from memcalc.cost.params import attention_params, embedding_params, head_params, layer_params, total_params
    from memcalc.presets import _aliases, gpu_preset_data, load_gpu, load_model_preset, model_preset_data

    slug = name.strip().lower()
    if slug in _aliases("models") or slug.replace("-", "") in _aliases("models"):
        spec = load_model_preset(name)
        data = model_preset_data(name)
        dense, expert = layer_params(spec)
        derived = {
            "total_params": total_params(spec),
            "per_layer_params": dense + expert,
            "attention_params_per_layer": attention_params(spec),
            "embedding_params": embedding_params(spec),
            "lm_head_params": 0 if spec.tied_embeddings else head_params(spec),
        }
        out = {"kind": "model", **spec.model_dump(), "aliases": data.get("aliases", []),
               "expected_params": data.get("expected_params"), "derived": derived}
    elif slug in _aliases("gpus") or slug.replace("-", "") in _aliases("gpus"):
        hw = load_gpu(name)
        out = {"kind": "gpu", **hw.model_dump(), "aliases": gpu_preset_data(name).get("aliases", [])}
    else:
        from memcalc.presets import gpu_names, model_names

        raise InputError(f"preset {name!r} is not a model or GPU preset; valid: "
                         f"{', '.join(model_names() + gpu_names())}")
    if json_out:
        sys.stdout.write(json.dumps(out, indent=2, default=str) + "\n")
        return
    con = Console(highlight=False)
    t = Table(box=None, show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in out.items():
        if k == "derived":
            for dk, dv in v.items():
                t.add_row(dk, f"{dv:,}")
        elif isinstance(v, int) and not isinstance(v, bool) and k.endswith("bytes"):
            t.add_row(k, f"{v:,} ({format_bytes(v, 'GiB')})")
        else:
            t.add_row(k, str(v))
    con.print(t)
