"""torchtune 0.1.0's own LoRA code, run on fake tensors under memcalc's tracker, with the CUDA caching allocator
replayed over what it allocates: the reserved memory its tutorial's runs would show, without a GPU.

    pip install --no-deps torchtune==0.1.0 torchao==0.1    # their pins (torch 2.2 era) would replace torch
    pip install omegaconf sentencepiece safetensors huggingface-hub tqdm numpy packaging "setuptools<70"
    python scripts/torchtune_replay.py --json a.json              # about 15 minutes on one core
    python scripts/torchtune_replay.py --variants lora-qv-r8 --lengths random:10,random:300 --json b.json
    python scripts/torchtune_replay.py --variants lora-qv-r8 --no-checkpointing --seq 2048 --batch 1 \
        --micro-batches 16 --lengths fixed,random:40 --json c.json
    (docs/data/torchtune-replay.json holds the three, merged: `--merge a.json b.json c.json --json OUT`)

What runs is torchtune's code, not memcalc's model of it:
- the model: `torchtune.models.llama2.lora_llama2_7b` (and `qlora_llama2_7b`) built as the recipe builds it
  (`recipes/lora_finetune_single_device.py` `_setup_model`: bf16 default dtype, on the device), then
  `set_trainable_params` and `set_activation_checkpointing` on every `TransformerDecoderLayer`;
- the loop: the recipe's `train()` body (model, shift with `.contiguous()`, `transpose(1, 2)`,
  `nn.CrossEntropyLoss`, `/ grad_accum`, `backward`, `AdamW.step` (foreach, as on CUDA) and
  `zero_grad(set_to_none=True)` every grad-accum micro-batches); the loop's `logits` lives until the next forward.
Two stand-ins, both allocation-neutral:
- the tensors are FakeTensorMode's on the CPU (every allocation's size is exact; nothing is computed);
- `copy.deepcopy` of a fake tensor leaves the fake mode, so torchtune's `_get_clones` (32 deep copies of the first
  layer) is replaced by a copy that clones every parameter and buffer in this mode, in deepcopy's order (a
  module's parameters, then its buffers, then its submodules; NF4 weights through their inner tensors).
One blind spot: the tracker is a dispatch mode, so the ops that a tensor subclass runs inside its own
`__torch_dispatch__` are below it and not counted: torchao's NF4 dequantization (`get_original_weight`, 14 bytes
per weight at its peak, measured on an H100) is seen only as its bf16 output, and the QLoRA variant's training
figures here leave those temporaries out (docs/published-finetune.md D).
The recipe loads the checkpoint on the CPU and copies it into the parameters in place, so loading allocates
nothing on the GPU and is not run. The allocator replay is memcalc/validate/allocator.py (validated to the byte
against an H100's `max_memory_reserved` on the harness's runs: docs/validation.md). Nothing is emptied: torchtune
0.1.0's recipe never calls `empty_cache`, so what model init cached stays in the pool.

Micro-batch lengths: the recipe's collate (`utils.padded_collate`) pads each batch to its longest sample (Alpaca
samples up to `max_seq_len=512`), so batch shapes vary. `--lengths fixed` runs every micro-batch at 512 tokens;
`random:MIN` draws each sample's length uniformly from MIN..512 (seeded), the batch taking the longest of its two.
The Alpaca-cleaned lengths themselves are not available here, which is why several MIN are recorded.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the tutorial's runs (pytorch/torchtune docs/source/tutorials/lora_finetune.rst, qlora_finetune.rst; GB = 1e9 B)
VARIANTS: dict[str, dict[str, Any]] = {
    "lora-qv-r8": dict(attn=["q_proj", "v_proj"], mlp=False, out=False, rank=8, published_gb=15.57),
    "lora-all-r8": dict(attn=["q_proj", "k_proj", "v_proj", "output_proj"], mlp=True, out=True, rank=8,
                        published_gb=15.87),
    "lora-qv-r64": dict(attn=["q_proj", "v_proj"], mlp=False, out=False, rank=64, published_gb=15.86),
    "lora-all-r64": dict(attn=["q_proj", "k_proj", "v_proj", "output_proj"], mlp=True, out=True, rank=64,
                         published_gb=17.04),
    # recipes/configs/llama2/7B_qlora_single_device.yaml (0.1.0): q, v, k, output_proj and the MLP, r=8
    "qlora": dict(attn=["q_proj", "v_proj", "k_proj", "output_proj"], mlp=True, out=False, rank=8, qlora=True,
                  published_gb=9.29),
}
PUBLISHED_INIT_GB = {"lora": (13.96, 13.98), "qlora": (None, 9.13)}  # (allocated peak, reserved) after model init
# cuBLAS's workspace per handle before Hopper (aten/src/ATen/cuda/CublasHandlePool.cpp: 4096 KiB x 2 + 16 KiB x 8);
# the tutorial does not name its GPU; two handles (forward thread, autograd's backward thread)
CUBLAS_PRE_HOPPER = 4096 * 1024 * 2 + 16 * 1024 * 8


def _import_torchtune() -> Any:
    if "datasets" not in sys.modules:  # imported by torchtune.datasets only; no dataset is loaded here
        stub = types.ModuleType("datasets")
        stub.load_dataset = None  # type: ignore[attr-defined]
        sys.modules["datasets"] = stub
    import torchtune  # noqa: F401
    import torchtune.modules.transformer as tt_transformer

    return tt_transformer


def _clones_in_mode(module: Any, n: int) -> Any:
    """torchtune's `_get_clones` (n deep copies) with each tensor cloned in the current fake mode."""
    import torch

    def memo_of(mod: Any, memo: dict[int, Any]) -> dict[int, Any]:
        for p in mod._parameters.values():
            if p is None:
                continue
            if hasattr(p, "__tensor_flatten__"):  # torchao's NF4Tensor
                names, ctx = p.__tensor_flatten__()
                inner = {k: getattr(p, k).clone() for k in names}
                memo[id(p)] = torch.nn.Parameter(type(p).__tensor_unflatten__(inner, ctx, p.size(), p.stride()),
                                                 p.requires_grad)
            else:
                memo[id(p)] = torch.nn.Parameter(p.detach().clone(), p.requires_grad)
        for b in mod._buffers.values():
            if b is not None:
                memo[id(b)] = b.clone()
        for c in mod._modules.values():
            if c is not None:
                memo_of(c, memo)
        return memo

    return torch.nn.ModuleList([copy.deepcopy(module, memo_of(module, {})) for _ in range(n)])


def lengths_for(spec: str, count: int, seq: int, batch: int) -> list[int]:
    if spec == "fixed":
        return [seq] * count
    low = int(spec.removeprefix("random:"))
    rng = random.Random(0)
    return [max(rng.randint(low, seq) for _ in range(batch)) for _ in range(count)]


def run_variant(name: str, lengths: list[int], grad_accum: int, batch: int = 2,
                checkpointing: bool = True) -> tuple[Any, int]:
    """torchtune's build and loop under the tracker; returns (tracker, event index where model init ends)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memcalc.validate.measure import Tracker

    tt_transformer = _import_torchtune()
    tt_transformer._get_clones = _clones_in_mode
    from torchtune import modules, utils
    from torchtune.models.llama2 import lora_llama2_7b, qlora_llama2_7b
    from torchtune.modules.peft.peft_utils import get_adapter_params, set_trainable_params

    v = VARIANTS[name]
    tracker = Tracker()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        tracker.set_phase("init")
        with utils.set_default_dtype(torch.bfloat16):
            if v.get("qlora"):
                model = qlora_llama2_7b(lora_attn_modules=v["attn"], apply_lora_to_mlp=v["mlp"],
                                        apply_lora_to_output=v["out"], lora_rank=v["rank"],
                                        lora_alpha=2 * v["rank"])
            else:
                model = lora_llama2_7b(lora_attn_modules=v["attn"], apply_lora_to_mlp=v["mlp"],
                                       apply_lora_to_output=v["out"], lora_rank=v["rank"], lora_alpha=2 * v["rank"])
        init_end = len(tracker.events)
        set_trainable_params(model, get_adapter_params(model))
        if checkpointing:
            utils.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerDecoderLayer})
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4,
                                      weight_decay=0.01, foreach=True)
        loss_fn = torch.nn.CrossEntropyLoss()
        logits = None
        for idx, n in enumerate(lengths):
            tracker.set_phase("forward")
            input_ids = torch.randint(0, 32000, (batch, n))
            labels = torch.randint(0, 32000, (batch, n))
            logits = model(input_ids)
            logits = logits[..., :-1, :].contiguous()
            labels = labels[..., 1:].contiguous()
            logits = logits.transpose(1, 2)
            loss = loss_fn(logits, labels) / grad_accum
            tracker.set_phase("backward")
            loss.backward()
            if (idx + 1) % grad_accum == 0:
                tracker.set_phase("optimizer")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            tracker.set_phase("log")
        del logits
    return tracker, init_end


def replay(tracker: Any, init_end: int, cublas_bytes: int, empty_after_init: bool = False) -> dict[str, Any]:
    """The caching allocator over the whole log, model init included; nothing is emptied, as in torchtune's
    recipe, unless `empty_after_init` (what training alone would reserve)."""
    from memcalc.validate.allocator import CachingAllocator

    a = CachingAllocator()
    starts: dict[int, list[str]] = {}
    for i, ph in tracker.marks:
        starts.setdefault(i, []).append(ph)
    cur: dict[int, int] = {}
    out: dict[str, Any] = {"reserved_after_micro_batch": []}
    pending = {"forward": cublas_bytes, "backward": cublas_bytes}
    for i, (uid, d) in enumerate(tracker.events):
        if i == init_end:
            out["init"] = {"allocated_peak_bytes": a.peak_allocated, "reserved_bytes": a.reserved,
                           "allocated_bytes": a.allocated}
            if empty_after_init:
                a.release_free_segments()
            a.reset_peaks()
        for ph in starts.get(i, ()):
            if ph in pending:
                a.allocate(("cublas", ph), pending.pop(ph))
            if ph == "log":
                out["reserved_after_micro_batch"].append(a.reserved)
        old = cur.get(uid, 0)
        new = old + d
        if old > 0:
            a.free(uid)
        if new > 0:
            a.allocate(uid, new)
            cur[uid] = new
        else:
            cur.pop(uid, None)
    out["training"] = {"allocated_peak_bytes": a.peak_allocated, "reserved_peak_bytes": a.peak_reserved}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the record here")
    ap.add_argument("--merge", type=Path, nargs="+", help="merge these records (runs appended) and exit")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--lengths", default="fixed,random:40",
                    help="comma-separated: fixed, random:MIN")
    ap.add_argument("--micro-batches", type=int, default=40)
    ap.add_argument("--grad-accum", type=int, default=8,
                    help="the tutorial's config accumulates 64 (QLoRA 16); fewer gets the adapters' AdamW moments "
                         "into the replay within the micro-batches run")
    ap.add_argument("--cublas-bytes", type=int, default=CUBLAS_PRE_HOPPER)
    ap.add_argument("--seq", type=int, default=512, help="the longest sample (the recipe's max_seq_len: 512)")
    ap.add_argument("--batch", type=int, default=2, help="samples per micro-batch (the config's batch_size: 2)")
    ap.add_argument("--no-checkpointing", action="store_true", help="without activation checkpointing")
    args = ap.parse_args()
    if args.merge:
        recs = [json.loads(f.read_text()) for f in args.merge]
        merged = {**recs[0], "runs": [r for rec in recs for r in rec["runs"]]}
        merged.pop("argv", None)
        merged["invocations"] = [{k: v for k, v in rec.items() if k != "runs"} for rec in recs]
        args.json.write_text(json.dumps(merged, indent=1) + "\n")
        return
    import torch

    record: dict[str, Any] = {"argv": sys.argv[1:], "torch": torch.__version__,
                              "cublas_workspace_bytes": args.cublas_bytes,
                              "published_init_gb": PUBLISHED_INIT_GB, "runs": []}

    for name in args.variants.split(","):
        for spec in args.lengths.split(","):
            t0 = time.perf_counter()
            lengths = lengths_for(spec, args.micro_batches, args.seq, args.batch)
            tracker, init_end = run_variant(name, lengths, args.grad_accum, args.batch, not args.no_checkpointing)
            r = replay(tracker, init_end, args.cublas_bytes)
            emptied = replay(tracker, init_end, args.cublas_bytes, empty_after_init=True)["training"]
            res = r["training"]["reserved_peak_bytes"]
            tutorial = (args.seq, args.batch, args.no_checkpointing) == (512, 2, False)
            pub = VARIANTS[name]["published_gb"] if tutorial else None
            row = {"variant": name, "lengths": spec, "seq": args.seq, "batch": args.batch,
                   "grad_accum": args.grad_accum, "micro_batches": args.micro_batches,
                   "checkpointing": not args.no_checkpointing, "published_reserved_gb": pub,
                   "error": round((res / 1e9 - pub) / pub, 4) if pub else None,
                   "seconds": round(time.perf_counter() - t0, 1), "micro_batch_lengths": lengths, **r,
                   "training_cache_emptied_after_init": emptied}
            record["runs"].append(row)
            print(f"{name:13s} {spec:11s} init alloc peak {r['init']['allocated_peak_bytes'] / 1e9:6.3f} GB, "
                  f"reserved {r['init']['reserved_bytes'] / 1e9:6.3f} GB | training alloc peak "
                  f"{r['training']['allocated_peak_bytes'] / 1e9:6.3f} GB, reserved {res / 1e9:6.3f} GB "
                  f"({emptied['reserved_peak_bytes'] / 1e9:6.3f} GB with the cache emptied after init) "
                  + (f"(published {pub} GB, {row['error'] * 100:+.1f}%)" if pub else ""), flush=True)
            del tracker
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
