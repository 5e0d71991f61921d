"""A representative subset of scripts/validation_matrix.py, one row per layout, measured in CI on the CPU: the
total peak within 2% of the exact tracked peak, model states and collective bytes equal to the byte (issue #6).
Rows by number in the matrix; the full table with every figure is docs/validation.md."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from memcalc.validate.api import validate  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "validation_matrix", Path(__file__).resolve().parents[1] / "scripts" / "validation_matrix.py")
assert _spec and _spec.loader
vm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vm)

ROWS = {
    2: "single GPU, torch AMP",
    9: "LoRA on a bf16 base",
    12: "DDP, SGD momentum",
    22: "ZeroRedundancyOptimizer (ZeRO-1)",
    26: "FSDP2 ZeRO-2 bf16",
    35: "TP4 + SP, bf16 AMP, GQA (loss_parallel)",
    40: "FSDP2 ZeRO-2 x TP2",
    42: "pipelining GPipe, last stage",
    43: "pipelining 1F1B, 4 stages, AMP",
    44: "pipelining 1F1B, full recompute: the last stage's kept send ops",
    45: "pipelining x FSDP2 ZeRO-3",
    47: "fake world 32, ZeRO-1 greedy partition",
    48: "fake world 64, FSDP2 ZeRO-3",
    51: "meta, FSDP2 ZeRO-3 x TP4 + SP",
    54: "pipelining interleaved 1F1B",
    56: "interleaved 1F1B, full recompute",
    59: "TP2 + SP, torchtitan op-level SAC",
    60: "lit-gpt layer: LoRA q,v + dropout, fused QKV, fp32 RMSNorm, pure bf16",
    62: "lit-gpt layer, full training, DDP",
    70: "eager attention + dropout (bool masks), seq 512",
    71: "full recompute re-run after the loss terms are freed, grad-accum 2",
    73: "activation offloading + full recompute, grad-accum 2",
    75: "activation offloading + full recompute of 2 of 6 layers",
    78: "activation offloading, LoRA, DDP",
    79: "QLoRA nf4 (bitsandbytes), lit-gpt layer, quantized head",
    80: "QLoRA nf4 (torchao), quantized head",
    82: "QLoRA nf4 (bitsandbytes), no double quant, DDP",
    84: "chunked loss (compiled), the head's weight-gradient sum",
    85: "chunked loss (eager), uneven chunks",
    86: "chunked loss (compiled), LoRA, activation offloading",
    87: "lit-gpt loss (logits kept to the next forward), lit-gpt layer, LoRA",
    90: "LoRA on a list of projections (k_proj, down_proj) + dropout, DDP",
    92: "the loop keeps fp32 logits to the next forward (torchtune 0.1), LoRA, grad-accum 2",
    95: "Ulysses all-to-all CP, full recompute",
    96: "Ulysses all-to-all CP over 4 ranks, selective recompute",
    97: "fake world 16, Ulysses CP 4 x FSDP2 ZeRO-3",
    122: "pipelining under one autocast region, full recompute: the step's cast cache",
    124: "pipelining under autocast, weight-heavy: a later backward's end, weight gradients waiting for their casts",
    130: "grad-accum under AMP: a later LM-head backward's new gradient and its cast beside .grad",
    132: "a tied head's gradient held in autograd's input buffer to the end of backward",
    136: "FSDP2, tied head: the embedding's backward beside the held head gradient and their sum",
    138: "FSDP2 AMP over 2 ranks: the root's reduce-scatter output beside the head's gradient",
    140: "FSDP2 ZeRO-3, weight-heavy: a layer's backward copy-out",
    141: "FSDP2 ZeRO-3, weight-heavy: the end of a layer's backward, all its unsharded gradients",
    145: "TP without FSDP2, SGD: the step's shard of the replicated embedding gradient",
    147: "TP without FSDP2, SGD momentum: the replicated momentum buffer",
    148: "TP+SP, AMP, grad-accum 2: a later micro-batch's whole embedding gradient",
    149: "TP without FSDP2, fp32 masters: the replicated gradient's upcast",
    151: "FSDP2 x TP: the root's replicated dense gradient and its shard's clone",
    152: "DDP with 1-25 MiB of gradients: two buckets (the 1 MiB first one)",
    153: "grad-accum under AMP, wide MLP: the weight gradient and its fp32 cast",
    154: "grad-accum under AMP with TP+SP, wide MLP",
    156: "PP x TP, last stage: loss_parallel under the pipelining schedule",
    158: "PP x TP + SP under AMP, first stage: the forward end's reduce-scatter and fp32 MLP input",
    160: "PP x TP + SP under AMP, full recompute: the embedding's all-gathered gradient",
    161: "PP x TP GPipe under AMP: the forward sends keep their outputs",
    172: "DDP's buckets in gradient-ready order (--bucket-cap-mb)",
    173: "DDP's buckets: GQA, fused QKV with biases, AMP, grad-accum",
    174: "DDP's buckets: GPT-2 block, tied head and learned positions, pure bf16",
    176: "DDP's default buckets at 25 MiB, the LM head alone in the first",
    178: "PP x FSDP2 bf16, 1F1B's cool-down: every unit gathered, a layer's bf16 gradients before its post-backward",
    180: "PP x FSDP2 bf16, weight-heavy: a steady-state backward, then the cool-down",
    181: "LoRA under DDP: the adapters' buckets",
    182: "Ulysses cp 2 over an eager core (SDPA's math fallback), full recompute",
    229: "activation-heavy, TP2+SP pure bf16 GELU, op-level SAC: the re-run's kept reduce-scatter outputs",
    237: "activation-heavy, TP4 pure bf16 GQA, V 256: the LM head's backward on narrow vocabulary shards",
    238: "activation-heavy, fp32 GQA through SDPA's math fallback, 1024 tokens",
    245: "TP2 + SP, AMP, full recompute with dropout: the re-run through the down projection's reduce-scatter",
    247: "SDPA's math path, selective recompute, 2 sequences: the re-run's own mask add",
}
# Real gloo worlds of FSDP2 ZeRO-3 are not fully deterministic (docs/validation.md: gloo's worker thread may free
# the previous all-gather output after the next one is allocated); their rows run in the full matrix, and ZeRO-3
# runs here on the fake process group (row 48), which is synchronous.


@pytest.mark.parametrize("row", sorted(ROWS), ids=[f"{r}-{ROWS[r]}" for r in sorted(ROWS)])
def test_matrix_row_within_2_percent_states_and_collectives_exact(row):
    label, opts, model, world, device = vm.configurations()[row - 1]
    # FSDP2 over a real gloo world is measured once more when it misses (`vm.measure`; see the note above): row 26
    # once measured -4.1% in a full run of this suite and -0.03% in the matrix run just before it. One more
    # measurement, not a wider bar
    rep, _ = vm.measure(vm.build(opts, model), opts, world, device, 120)
    assert abs(rep["error"]) <= 0.02, (label, rep["error"])
    pred, meas = rep["predicted"]["model_states"], rep["measured"]["model_states"]
    for k in ("params", "master_weights", "grads", "optimizer"):
        assert pred[k] == meas[k], (label, k, pred[k], meas[k])
    assert all(c["exact"] for c in rep["collectives"]), label
    assert rep["collectives"] or opts.get("gpus", 1) == 1, label  # none on one GPU


def test_op_sac_amp_row_holds_the_head_cast_at_the_loss_gradient():
    """Row 57 (DDP, bf16 AMP, op-level SAC, seq 512): its peak is the loss gradient, where the LM head's autocast
    weight copy (512 x 64 x 2 B = 65,536) is still saved for the head's backward while the checkpointed layers'
    copies are gone. With the term the backward phase is within 0.1% (it was 0.69% low)."""
    label, opts, model, world, device = vm.configurations()[56]
    assert label == "DDP bf16 AMP op-level SAC, seq 512"
    rep = validate(vm.build(opts, model), device=device, world=world, tolerance=0.02, timeout=120)
    bwd = next(r for r in rep["rows"] if r["section"] == "phases" and r["name"] == "backward")
    assert abs(bwd["predicted"] - bwd["measured"]) / bwd["measured"] < 1e-3, bwd
    assert rep["predicted"]["buffers_detail"]["amp_head_cast_saved"] == 65_536
