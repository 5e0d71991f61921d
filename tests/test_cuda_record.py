"""memcalc against real GPU measurements, without a GPU: the records `scripts/gpu_validation.py` wrote on one
NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130) -- docs/data/validation-cuda.json with the default caching allocator,
docs/data/validation-cuda-expandable.json with `expandable_segments:True`. Each recorded row is a real
`memcalc validate --device cuda` run (2 warm-up steps, 1 measured step); memcalc's figures are recomputed here
from the current cost model, so a change that moves a prediction away from the GPU fails. docs/validation.md
("On a GPU") shows the same table."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_validation as gv  # noqa: E402

from memcalc.cost import activations, buffers  # noqa: E402
from memcalc.options import RunOptions, build_run  # noqa: E402

DEFAULT = json.loads((ROOT / "docs/data/validation-cuda.json").read_text())
EXPANDABLE = json.loads((ROOT / "docs/data/validation-cuda-expandable.json").read_text())

# rows whose allocated peak memcalc misses by more than 1%, with the measured reason
ALLOCATED_MISSES = {
    18: "-2.7%: Hugging Face's MoE block on CUDA allocates 260-340 MiB that no tensor owns (kernels' own scratch "
        "in the routing / expert dispatch ops; the tracked tensor bytes agree with memcalc to +0.01%)",
    28: "-1.8%: the same MoE block (DeepSeek-V2-Lite's 64 experts, top-6) on CUDA: 219-296 MiB that no tensor "
        "owns beyond the cuBLAS workspaces; the tracked tensor bytes agree with memcalc to -0.00%",
}
# (row, phase) pairs memcalc misses by more than 1% where the row's peak is within it
PHASE_MISSES = {
    (22, "optimizer"): "-3.1% (78 MiB): GPT-2 (flash attention with dropout, learned positions) on the default "
                       "allocator peaks 72-78 MiB above the tracked bytes and the cuBLAS workspaces in every phase, "
                       "the optimizer's included, in both of two runs; with expandable segments not (its row there "
                       "is within 0.01%). MEMCALC_CUDA_DIAG finds no untracked block but the workspaces held at "
                       "forward end or step end (65 MiB), and per-op scratch up to 132 MiB in aten.sum.dim_IntList "
                       "(the biases' gradients): not attributed; the row's peak is a backward moment (-0.75%)",
    (21, "forward"): "-3.0% (158 MiB): SDPA's math fallback runs `_safe_softmax`, which on CUDA allocates a bool "
                     "mask of the scores (128 MiB here, read per op with MEMCALC_CUDA_DIAG) and ~30 MiB more, "
                     "not modelled; the row's peak is a backward moment",
}
# default caching allocator: rows whose reserved figure memcalc (allocated + the documented fragmentation + the
# first optimizer step's stranded foreach temporaries) misses by more than 7%; expandable segments bring every one
# of the rows recorded with them within 1.5%. The stranded temporaries moved rows 8 (-17.7% -> -2.2%), 18 (-13.1% ->
# +2.3%) and 21 (-18.7% -> -4.8%) within 7%, row 2 from -24.0% and row 19 from -22.1%, and rows 9, 13 and 16 out,
# above (+0.3%, -5.7%, -2.5% before): on small models later activations fit part of the temporaries' blocks
RESERVED_MISSES = {
    26: "+10.1%: Ulysses context parallelism over the fake process group (its all-to-all outputs are new tensors "
        "of every size); not replayed (the harness's CP does not run on fake tensors), not attributed",
    30: "-10.3%: Llama-3.2-1B, SGD, selective recompute, 4 x 4096 tokens: 60.2 GiB reserved for a 48.5 GiB "
        "peak; the default-policy replay is 13% low too (52.4 GiB) while its expandable replay is exact, so the "
        "gap is an allocator behaviour the replay lacks, not attributed",
    2: "-10.5% (-24.0% before the first step's temporaries): FSDP2 ZeRO-3 over 8 ranks; the side streams' pools "
       "are as modelled (all-gather 954 MiB, reduce-scatter 3,262 MiB measured); the compute stream reserves 19.05 "
       "GiB, of which 3.29 GiB is the first step's sqrt(v) list (replay, foreach minus fused), the rest unsharded "
       "layers, fp32 reduce-scatter inputs and the loss's blocks carving its segments",
    9: "+10.6% (+0.3% before): DDP; the replay strands 0.08 GiB of the first step's 0.91 GiB sqrt(v) list, whose "
       "blocks the next steps' activations reuse (DDP's first-iteration buckets are freed when rebuilt)",
    13: "+10.6% (-5.7% before): FSDP2 ZeRO-3 x TP 2; the replay strands 0.79 of the 1.57 GiB list, and replays "
        "this layout 13.4% above the H100 (TP over the fake process group, not attributed)",
    16: "+9.1% (-2.5% before): fp32 4-layer model; the replay strands 0.25 of the 0.95 GiB list: only its 16 MiB "
        "blocks (q, k, v, o) are smaller than every later activation (32 MiB and up)",
    28: "-18.3% (-6.1% while the first step's 3.11 GiB sqrt(v) list was added on top of the optimizer step, which is "
        "this row's peak and holds it: the H200's rows 35 and 42-47): DeepSeek-V2-Lite's MoE blocks reserve 20.45 GiB "
        "for a 15.9 GiB peak; the routing's data-dependent shapes keep it from fake tensors, so no replay; not "
        "attributed",
    17: "-11%: fp32 GQA through SDPA's math fallback: its s x s fp32 probabilities carve the segments",
    19: "-10.6% (-22.1% before): activation offloading: 4.77 GiB reserved for a 3.36 GiB peak (reloaded blocks of "
        "every size)",
}


def _rows(data, misses):
    out = []
    for e in data["results"]:
        if "report" not in e:
            continue
        marks = [pytest.mark.xfail(reason=misses[e["id"]], strict=True)] if e["id"] in misses else []
        out.append(pytest.param(e, id=f"row{e['id']}", marks=marks))
    return out


def _err(p: int, m: int) -> float:
    return (p - m) / m


def test_every_recorded_row_ran_on_the_h100():
    assert DEFAULT["probe"]["device"] == EXPANDABLE["probe"]["device"] == "NVIDIA H100 80GB HBM3"
    assert [e["id"] for e in DEFAULT["results"]] == list(range(1, 32))
    assert all("report" in e for e in DEFAULT["results"] + EXPANDABLE["results"])
    # the labels and configurations are the script's own (a record of what it runs now)
    confs = gv.configurations()
    for e in DEFAULT["results"]:
        assert (e["label"], e["opts"], e["world"]) == confs[e["id"] - 1][:3]


@pytest.mark.parametrize("e", _rows(DEFAULT, ALLOCATED_MISSES))
def test_allocated_peak_within_1pct_of_max_memory_allocated(e):
    """`torch.cuda.max_memory_allocated()` of the measured step against memcalc's allocated peak (cuBLAS
    workspaces included), overall and phase by phase (the peak is reset as each phase starts)."""
    m, p = gv.measured(e), gv.predict(e["opts"])
    assert abs(_err(p["allocated"], m["allocated"])) <= 0.01, (p["allocated"], m["allocated"])
    for name, ph in e["report"]["cuda"]["phases"].items():
        err = _err(p["phases"][name], ph["measured"])
        if (e["id"], name) in PHASE_MISSES:
            assert -0.035 < err < -0.01, err  # still the recorded miss
            continue
        assert abs(err) <= 0.01, (name, p["phases"][name], ph["measured"])


# expandable segments: rows whose reserved figure memcalc's 2% fraction misses by more than 1.5%
EXPANDABLE_MISSES = {
    23: "-4.4%: torchtune QLoRA: torchao's dequantization makes temporaries of five sizes per weight (int64 "
        "codes, half-weight products, the stacked weight), 14 bytes per weight of the largest at once; the "
        "expandable replay of the same allocations is within 0.4% (5.324 against 5.344 GiB)",
    25: "-3.1%: activation offloading (reloaded blocks of every size, as row 19 on the default allocator); the "
        "harness's offloading does not run on fake tensors, so no replay",
    30: "+1.8%: SGD with selective recompute; the expandable replay is exact (52.504 GiB): the fraction is "
        "high here",
}


@pytest.mark.parametrize("e", _rows(EXPANDABLE, EXPANDABLE_MISSES))
def test_expandable_segments_reserved_within_1_5pct(e):
    """With expandable segments memcalc's 2% fraction (fragmentation.EXPANDABLE_SEGMENTS_FRACTION) puts the
    reserved figure within 1.5% of `max_memory_reserved()`, FSDP2's side-stream pools included (rows 2, 14); the
    rows in EXPANDABLE_MISSES are strict xfails with their measured cause."""
    m, p = gv.measured(e), gv.predict(e["opts"], expandable=True)
    assert abs(_err(p["allocated"], m["allocated"])) <= 0.01
    assert abs(_err(p["reserved"], m["reserved"])) <= 0.015, (p["reserved"], m["reserved"])


@pytest.mark.parametrize("e", _rows(DEFAULT, RESERVED_MISSES))
def test_default_allocator_reserved_within_7pct(e):
    """The default caching allocator: the documented 3% fraction plus the stranded logits block, the first
    optimizer step's foreach temporaries and FSDP2's side-stream pools (memcalc/cost/fragmentation.py) against
    `max_memory_reserved()`. The rows in
    RESERVED_MISSES are further off; each is a strict xfail with its measured cause."""
    m, p = gv.measured(e), gv.predict(e["opts"])
    assert abs(_err(p["reserved"], m["reserved"])) <= 0.07, (p["reserved"], m["reserved"])


def test_the_gpu_only_bytes_are_the_two_cublas_workspaces():
    """The probe read one 32 MiB cuBLAS workspace for the first matmul on the Python thread and one more for the
    first on autograd's backward thread: memcalc's `cublas_workspaces` (buffers.CUBLAS_WORKSPACE_BYTES, two of
    them). Where no kernel allocates for itself, the allocated peak minus the tracked tensor bytes is exactly
    those 64 MiB (rows 4, 6, 9, 11)."""
    pr = DEFAULT["probe"]
    assert pr["cublas_workspace_first_matmul_bytes"] == pr["cublas_workspace_backward_thread_bytes"]
    assert pr["cublas_workspace_first_matmul_bytes"] == buffers.CUBLAS_WORKSPACE_BYTES == 32 * 2**20
    for e in DEFAULT["results"]:
        if e["id"] in (4, 6, 9, 11):
            gpu_only = gv.measured(e)["gpu_only"]
            assert 2 * buffers.CUBLAS_WORKSPACE_BYTES <= gpu_only <= 2 * buffers.CUBLAS_WORKSPACE_BYTES + 64 * 1024


def test_the_kernels_save_what_the_activation_terms_count():
    """What the probe read SDPA (cuDNN's kernel on the H100, bf16) and nn.RMSNorm (aten `_fused_rms_norm`) save,
    against the per-layer terms: Q at every head, K and V at the KV heads (GQA passed natively), the fp32
    log-sum-exp 4 b a s (1 x 32 x 4096 x 4 = 524,288 B) and the norm's fp32 rstd, 4 bytes per token
    (2 x 1024 tokens: 8,192 B)."""
    pr = DEFAULT["probe"]
    assert pr["rms_norm_ops"] == ["_fused_rms_norm"]
    assert 8192 in pr["rms_norm_saved_bytes"]
    run = build_run(RunOptions(layers=1, hidden=4096, heads=32, kv_heads=8, ffn=11008, vocab=32000, seq=4096,
                               precision="bf16", master_weights=False))
    assert activations._fp32_norm_stats(run) * 2 * 1024 == 8192
    terms = activations.layer_terms(run)
    saved = {tuple(shape): n for n, _, shape in pr["sdpa_gqa_saved"]}
    assert terms["q"] == saved[(1, 32, 4096, 128)] == 33_554_432
    assert terms["k"] == terms["v"] == saved[(1, 8, 4096, 128)] == 8_388_608
    assert terms["attn_lse"] == saved[(1, 32, 4096, 1)] == 524_288


def test_softmax_backward_scratch_on_the_h100():
    """Rows 20 and 21 (eager attention in bf16, and fp32 GQA through SDPA's math fallback, both under full
    recompute, where a lower layer's softmax backward is the step's peak): CUDA's `_softmax_backward_data` over
    rows of 4096 and 2048 keys allocated one more fp32 scores-sized buffer beside the gradient (read per op with
    MEMCALC_CUDA_DIAG: 8,192 MiB = 4 x 32 heads x 4 x 4096 x 4096 and 512 MiB = 4 x 16 x 2 x 2048 x 2048); memcalc
    was 19.2% and 7.4% below the measured peaks without it (`activations.softmax_backward_scratch`)."""
    runs = {e["id"]: build_run(RunOptions(**e["opts"])) for e in DEFAULT["results"] if e["id"] in (20, 21)}
    assert activations.softmax_backward_scratch(runs[20]) == 4 * 32 * 4 * 4096 * 4096 == 8192 * 2**20
    assert activations.softmax_backward_scratch(runs[21]) == 4 * 16 * 2 * 2048 * 2048 == 512 * 2**20
    short = build_run(RunOptions(**dict(DEFAULT["results"][20]["opts"], seq=1024)))
    assert activations.softmax_backward_scratch(short) == 0  # the persistent kernel: no scratch


def test_fp32_gqa_sdpa_is_the_math_path():
    """Row 17: fp32 with GQA passed natively has no fused SDPA kernel on CUDA, and torch's math fallback keeps the
    s x s fp32 probabilities, as eager attention does (activations.eager_core); fp32 MHA (row 16) takes the
    memory-efficient kernel and keeps the log-sum-exp."""
    runs = {e["id"]: build_run(RunOptions(**e["opts"])) for e in DEFAULT["results"] if e["id"] in (16, 17)}
    gqa, mha = runs[17], runs[16]
    assert activations.eager_core(gqa) and not activations.eager_core(mha)
    assert "attn_softmax" in activations.layer_terms(gqa) and "attn_lse" in activations.layer_terms(mha)


# rows replayed on the CPU (fake tensors, one rank), single-stream layouts: the allowed gap to the H100's reserved
REPLAY_BAR = {1: 0.0, 2: 0.0, 5: 0.0, 7: 0.0, 12: 0.0, 14: 0.0, 15: 0.0, 3: 0.011, 4: 0.011, 6: 0.011, 11: 0.011,
              16: 0.011, 21: 0.011, 17: 0.021,
              # session 32's rows: torchao's dequantization temporaries (23) to the byte, bitsandbytes' (31)
              22: 0.002, 23: 0.0, 31: 0.002,
              # TP 4 + SP: -0.20%; -8.5% while a fake run's `wait_tensor` held each collective output twice
              # (measure.Tracker._carry_over)
              8: 0.003}
REPLAY_MISSES = {
    20: "+18.7%: one 8 GiB segment more than the GPU reserved; where CUDA's softmax backward places its scratch "
        "(model._CudaSoftmax allocates it before the gradient) is not known",
    13: "+13.4%: FSDP2 x tensor parallelism over the fake process group: the first optimizer step's Adam moments "
        "fill the activation segments and the second step cuts them afresh (+2.24 GiB, 8.68 -> 10.92); on the H100 "
        "they did not, perhaps because blocks a collective still used were not free yet (not confirmed)",
}


# (the known misses only confirm that they still miss: `slow`, outside the default run; `python -m pytest -m slow`)
@pytest.mark.parametrize("e", [pytest.param(e, id=f"row{e['id']}", marks=[pytest.mark.xfail(
    reason=REPLAY_MISSES[e["id"]], strict=True), pytest.mark.slow] if e["id"] in REPLAY_MISSES else [])
    for e in DEFAULT["results"] if e["id"] in REPLAY_BAR or e["id"] in REPLAY_MISSES])
def test_allocator_replay_matches_the_h100_reserved(e):
    """The caching allocator replayed (memcalc/validate/allocator.py) over the harness's allocation log of the same
    configuration, run here on fake tensors (`--device meta --world fake`), against the H100's
    `max_memory_reserved()`, with a pool per stream: to the byte on rows 1 (7B LoRA, 14,585,692,160 B), 5, 7, 15 and
    the three FSDP2 runs 2 (ZeRO-3, 24,880,611,328 B, where memcalc's fraction is 24% low), 12 and 14 (FSDP2 allocates
    its all-gather buffers and reduce-scatter outputs on streams of its own) and 23 (torchao's dequantization
    temporaries, torchtune QLoRA), within 1.1% or 2% on the others. Where memcalc's fraction misses (rows 2, 17, 21:
    -24%, -11%, -19%; 23: -6.2%), the replay does not: the gap is the allocator's policy over the allocation order,
    reproducible without a GPU. (Activation offloading, rows 19 and 25, does not run faithfully on fake tensors: not
    replayed.)"""
    replayed = _meta_replay(e["id"])["reserved_peak_bytes"]
    gpu = e["report"]["cuda"]["measured_reserved_bytes"]
    bar = REPLAY_BAR.get(e["id"], 0.0)
    assert abs(replayed - gpu) <= bar * gpu, (replayed, gpu, _err(replayed, gpu))


@functools.cache
def _meta_replay(row: int, card: str = "h100") -> dict:
    """The harness's run of a recorded row on fake tensors; its `measured.allocator_replay` (both allocators)."""
    pytest.importorskip("torch")
    from memcalc.validate.api import validate

    e = next(e for e in (DEFAULT if card == "h100" else H200)["results"] if e["id"] == row)
    rep = validate(build_run(RunOptions(**e["opts"])), device="meta", world="fake", timeout=200)
    return rep["measured"]["allocator_replay"]


# expandable segments replayed (allocator.ExpandableAllocator) against the H100 run with expandable_segments:True
EXPANDABLE_REPLAY_BAR = {1: 0.0, 4: 0.0, 11: 0.002, 14: 0.002, 2: 0.004, 8: 0.004, 22: 0.003, 23: 0.004, 31: 0.002}


@pytest.mark.parametrize("e", [pytest.param(e, id=f"row{e['id']}") for e in EXPANDABLE["results"]
                               if e["id"] in EXPANDABLE_REPLAY_BAR])
def test_expandable_replay_matches_the_h100_reserved(e):
    """The same allocation logs replayed with expandable segments (one range of addresses per stream and pool,
    mapped in 2 / 20 MiB granules as requests need them): to the byte on rows 1 (7B LoRA, 14,535,360,512 B) and 4,
    within 0.4% on the four others, tensor parallelism (row 8: -0.12%) included."""
    replayed = _meta_replay(e["id"])["expandable_reserved_peak_bytes"]
    gpu = e["report"]["cuda"]["measured_reserved_bytes"]
    bar = EXPANDABLE_REPLAY_BAR[e["id"]]
    assert abs(replayed - gpu) <= bar * gpu, (replayed, gpu, _err(replayed, gpu))


# --- the H200 record: rows 4, 8 and 11 again, and rows 32-47 (scripts/gpu_validation.py, docs/validation.md)
H200 = json.loads((ROOT / "docs/data/validation-cuda-h200.json").read_text())
H200_EXPANDABLE = json.loads((ROOT / "docs/data/validation-cuda-h200-expandable.json").read_text())
H200_RESERVED_MISSES = {
    33: "-10.8%: 4 layers, pure bf16, fp32 norms, full recompute: 4.79 GiB reserved for a 3.44 GiB peak; the replay "
        "is -5.3% (4.53 GiB) too; not attributed",
    36: "-10.8%: Llama-3.1-8B, seq 8192: the first step's Adam moments carve the segments of the loss's 4008 MiB fp32 "
        "logit blocks, and the second step reserves two of them afresh (the replay, step by step: +7.83 GiB); the "
        "replay is -4.5% (83.05 GiB against 86.97)",
    41: "-9.5%: eager attention with dropout under selective recompute: 5.78 GiB reserved for a 5.07 GiB peak; the "
        "replay has it to the byte, the fraction does not (the scores-sized blocks carve the segments)",
    45: "-7.1%: Qwen2.5-7B, seq 4096: as row 36, the second step reserves three 2376 MiB fp32 logit blocks afresh "
        "(the replay: 78.88 GiB, +0.17%)",
    47: "+12.6%: Mistral-7B under selective recompute: the list's 112 MiB blocks (the MLP weights' sqrt(v)) serve the "
        "recomputed MLP activations of the same size (4096 x 14336 x 2 B), so nothing is stranded; memcalc keeps 8.6 "
        "GiB of the list beside the backward (sizes are not compared)",
}
H200_EXPANDABLE_MISSES = {
    38: "-3.3%: Qwen2.5-7B's 4 layers under its 152k vocabulary: not attributed",
    46: "-3.3%: Llama-3.2-1B, AMP, full recompute: not attributed",
}


def _ran_the_scripts_configurations(default, expandable, device: str, ids: list[int]) -> None:
    """A later record (both allocators) ran on `device` the script's configurations `ids`, each as it is now."""
    assert default["probe"]["device"] == expandable["probe"]["device"] == device
    assert [e["id"] for e in default["results"]] == ids
    assert all("report" in e for e in default["results"] + expandable["results"])
    confs = gv.configurations()
    for e in default["results"] + expandable["results"]:
        label, opts, world = confs[e["id"] - 1][:3]
        assert e["label"] == label and e["world"] == world
        assert e["opts"] == (dict(opts, allocator="expandable") if e in expandable["results"] else opts)


def test_the_h200_record_ran_on_the_h200_with_the_scripts_configurations():
    _ran_the_scripts_configurations(H200, H200_EXPANDABLE, "NVIDIA H200", [4, 8, 11, *range(32, 48)])
    # the facts the cost model assumes read the same on both cards
    for k in ("cublas_workspace_first_matmul_bytes", "sdpa_gqa_saved", "rms_norm_saved_bytes"):
        assert H200["probe"][k] == DEFAULT["probe"][k]


def test_the_h200_repeats_the_h100_rows_byte_for_byte():
    """Rows 4, 8 and 11 ran on both cards (torch 2.11.0+cu130 on each): the same peak allocated and reserved."""
    h100 = {e["id"]: e["report"]["cuda"] for e in DEFAULT["results"]}
    for e in H200["results"][:3]:
        c = e["report"]["cuda"]
        assert (c["measured_peak_bytes"], c["measured_reserved_bytes"]) == (
            h100[e["id"]]["measured_peak_bytes"], h100[e["id"]]["measured_reserved_bytes"])


@pytest.mark.parametrize("e", _rows(H200, {}))
def test_h200_allocated_peak_within_1pct_in_every_phase(e):
    """`max_memory_allocated()` per phase on the H200 against memcalc: every row within 1% (the largest miss is
    TP 4 + SP, row 8, -0.67%; the mixed-recompute, TP 2 + SP under full recompute, fp16, GPT-NeoX and whole-model
    rows within 0.4%)."""
    m, p = gv.measured(e), gv.predict(e["opts"])
    assert abs(_err(p["allocated"], m["allocated"])) <= 0.01, (p["allocated"], m["allocated"])
    for name, ph in e["report"]["cuda"]["phases"].items():
        assert abs(_err(p["phases"][name], ph["measured"])) <= 0.01, (name, p["phases"][name], ph["measured"])


@pytest.mark.parametrize("e", _rows(H200, H200_RESERVED_MISSES))
def test_h200_default_allocator_reserved_within_7pct(e):
    m, p = gv.measured(e), gv.predict(e["opts"])
    assert abs(_err(p["reserved"], m["reserved"])) <= 0.07, (p["reserved"], m["reserved"])


def test_the_sqrt_v_list_is_not_added_on_top_of_a_step_that_is_the_peak():
    """Rows 35 and 42 (TP 2 + SP and Llama-2-7B on one GPU, full recompute, the optimizer step the peak): reserved is
    the step's peak / (1 - f), nothing stranded: 65.02 and 64.76 GiB against 65.37 and 64.45 measured (77.57 and
    77.31 while the 12.55 GiB list was added to the step that holds it)."""
    from memcalc.cost import fragmentation
    from memcalc.cost.timeline import stage_memory

    for e in H200["results"]:
        if e["id"] in (35, 42):
            run = build_run(RunOptions(**e["opts"]))
            sm = stage_memory(run, 0)
            assert sm.compute_stream_opt_peak > sm.compute_stream_fb_peak
            assert fragmentation.first_step_stranded_bytes(run, sm) == 0
            assert abs(_err(gv.predict(e["opts"])["reserved"], gv.measured(e)["reserved"])) < 0.006


@pytest.mark.parametrize("e", _rows(H200_EXPANDABLE, H200_EXPANDABLE_MISSES))
def test_h200_expandable_segments_reserved_within_2_1pct(e):
    """memcalc's 2% fraction against the H200 with expandable segments: within 2.1% (whole models on one GPU reserve
    barely above their peak there, 74.87 GiB for 74.85 on row 36, so the fraction is the +2.0%)."""
    m, p = gv.measured(e), gv.predict(e["opts"], expandable=True)
    assert abs(_err(p["allocated"], m["allocated"])) <= 0.01
    assert abs(_err(p["reserved"], m["reserved"])) <= 0.021, (p["reserved"], m["reserved"])


# the caching allocator replayed over the H200 rows' allocation logs on fake tensors (every row of the record was
# replayed when it was made, docs/validation.md: within 0.9% on the default policy but rows 33 and 36, -5.3% and
# -4.5%, and within 0.43% with expandable segments); here a subset, to keep the suite short:
# {row: (default bar, expandable bar or None)}
H200_REPLAY_BAR = {35: (0.0, 0.005), 37: (0.0, 0.0015), 40: (0.0, None), 41: (0.0, None), 42: (0.0, 0.001),
                   46: (0.0, 0.0), 32: (0.0011, 0.0)}


@pytest.mark.parametrize("row", sorted(H200_REPLAY_BAR))
def test_allocator_replay_matches_the_h200_reserved(row):
    """Where memcalc's fraction misses the H200 (rows 41: -9.5%, 35 and 42: +18.7% and +20.0% before the list was
    no longer added on top of the step), the replay of the same allocations, without a GPU, gives
    `max_memory_reserved()` to the byte (row 35: 70,191,677,440 B), on both policies for row 46."""
    bar, xbar = H200_REPLAY_BAR[row]
    rep = _meta_replay(row, "h200")
    gpu = next(e for e in H200["results"] if e["id"] == row)["report"]["cuda"]["measured_reserved_bytes"]
    assert abs(rep["reserved_peak_bytes"] - gpu) <= bar * gpu, (rep["reserved_peak_bytes"], gpu)
    if xbar is not None:
        x = next(e for e in H200_EXPANDABLE["results"] if e["id"] == row)["report"]["cuda"]["measured_reserved_bytes"]
        assert abs(rep["expandable_reserved_peak_bytes"] - x) <= xbar * x, (rep["expandable_reserved_peak_bytes"], x)


@pytest.mark.parametrize("records, allocator", [((DEFAULT, H200, "third"), "default"),
                                                ((EXPANDABLE, H200_EXPANDABLE, "third-expandable"), "expandable")])
def test_the_reserved_error_band_covers_the_records(records, allocator):
    """`memory.tight` (fragmentation.RESERVED_SHORTFALL_FRACTION) says a fit is inside the model's measured error
    when the headroom is below that share of the peak. The share must cover what the records measured:
    max_memory_reserved() <= memcalc's reserved x (1 + share) on every recorded run (rows 48-59 too) but the H100's
    MoE row 28 (+22.4%, not replayable). Worst now: +12.08% on the default allocator (H200 rows 33 and 36, memcalc -10.8%),
    +4.62% with expandable segments (H100 row 23)."""
    from memcalc.cost.fragmentation import RESERVED_SHORTFALL_FRACTION

    share = RESERVED_SHORTFALL_FRACTION[allocator]
    worst = 0.0
    for data in records:
        if isinstance(data, str):  # the third record (defined below)
            data = THIRD if data == "third" else THIRD_EXPANDABLE
        for e in data["results"]:
            if "report" not in e or (data is DEFAULT and e["id"] == 28):
                continue
            m, p = gv.measured(e), gv.predict(e["opts"], expandable=allocator == "expandable")
            worst = max(worst, (m["reserved"] - p["reserved"]) / p["reserved"])
    assert worst <= share
    # and the share is no wider than the records need (a margin of under 1 point)
    assert share - worst < 0.01, (share, worst)


# --- the third record: rows 48-59 on an H100 (scripts/gpu_validation.py, docs/validation.md "rows 48-59")
THIRD = json.loads((ROOT / "docs/data/validation-cuda-3.json").read_text())
THIRD_EXPANDABLE = json.loads((ROOT / "docs/data/validation-cuda-3-expandable.json").read_text())
# the default allocator counts whole blocks in max_memory_allocated(): a large-pool block is split only when more
# than 1 MiB would remain (c10/cuda/CUDACachingAllocator.cpp should_split), so a request up to 1 MiB below a
# cached block's size is charged the whole block. Tensors of every size (a mixture of experts' routed batches)
# make that the row's error; the row's expandable-segments run (splits at 512 B) is within 0.1%
THIRD_ALLOCATED_MISSES = {
    54: "-4.6% to -5.2%: DeepSeek-V2-Lite's MoE under AMP, 1.4-1.6 GiB of whole-block charges (the replay of the "
        "run's own allocations gives 35,082,247,680 B against 35,079,411,712 measured); -0.1% with expandable "
        "segments",
}
THIRD_RESERVED_MISSES = {
    53: "-9.8%: fp32 GQA under selective recompute, the math fallback's s x s blocks carve the segments (as row 41; "
        "the replay is -3.9%)",
    54: "-7.6%: the MoE row's blocks of every size (as row 28); not replayable on fake tensors",
    58: "-9.7%: Gemma 2's 256k-vocabulary fp32 logits and eager scores carve the segments; the replay of the same "
        "allocations on fake tensors has it to the byte (docs/validation.md), the fraction does not",
    48: "-7.4%: as row 58 (pure bf16; the replay to the byte as well)",
}


def test_the_third_record_ran_the_scripts_configurations_on_an_h100():
    _ran_the_scripts_configurations(THIRD, THIRD_EXPANDABLE, "NVIDIA H100 80GB HBM3", list(range(48, 60)))
    assert [e["id"] for e in THIRD_EXPANDABLE["results"]] == list(range(48, 60))


def test_rmsnorm_under_autocast_on_a_bf16_input_runs_torchs_composite():
    """The probe on the H100: nn.RMSNorm(128) on a (1, 4096, 32, 128) bf16 input with its fp32 weight under CUDA
    autocast runs the composite (upcast, pow, mean, add_, rsqrt, mul, mul, downcast), saves three fp32 tensors of
    the input's size (its copy twice, the same storage, and the normalized one) beside the rstd, and returns bf16:
    what `activations._output_norm_saved` counts (8 bytes an element and the rstd) and the harness runs."""
    pr = THIRD["probe"]
    assert pr["rms_norm_autocast_per_head_ops"] == ["_to_copy", "pow", "mean", "add_", "rsqrt", "mul", "mul",
                                                    "_to_copy"]
    assert pr["rms_norm_autocast_per_head_out_dtype"] == "torch.bfloat16"
    big = [s for s in pr["rms_norm_autocast_per_head_saved"] if s[0] == 4 * 4096 * 32 * 128]
    assert len(big) == 3 and all(s[1] == "torch.float32" for s in big)
    # a residual-stream norm (fp32 input, fp32 weight) keeps the fused kernel
    assert pr["rms_norm_ops"] == ["_fused_rms_norm"]


@pytest.mark.parametrize("e", _rows(THIRD, THIRD_ALLOCATED_MISSES))
def test_third_record_allocated_within_0_6pct_in_every_phase(e):
    """`max_memory_allocated()` per phase against memcalc on rows 48-59: within 0.6% (the largest: FSDP2 ZeRO-3 with
    two micro-batches accumulated, -0.59% in its optimizer phase, whose all-gather and reduce-scatter blocks are
    charged whole; -0.00% there with expandable segments)."""
    p = gv.predict(e["opts"])
    for name, ph in e["report"]["cuda"]["phases"].items():
        assert abs(_err(p["phases"][name], ph["measured"])) <= 0.006, (name, p["phases"][name], ph["measured"])


@pytest.mark.parametrize("e", _rows(THIRD_EXPANDABLE, {}))
def test_third_record_expandable_allocated_within_0_25pct_in_every_phase(e):
    """With expandable segments (blocks split to 512 B, so nothing is charged above the request), rows 48-59 in every
    phase within 0.25%: the q/k-norm rows 49 and 59 and Gemma 2's AMP row 58 to within 6 KB (row 49's forward was
    -0.90% while the model took nn.RMSNorm's fused kernel); the MoE row 54 -0.10%, TP 2 + SP's backward -0.22%
    (CUDA's embedding_dense_backward scratch, about tokens x h x 4 B, not modelled)."""
    p = gv.predict(e["opts"], expandable=True)
    for name, ph in e["report"]["cuda"]["phases"].items():
        assert abs(_err(p["phases"][name], ph["measured"])) <= 0.0025, (name, p["phases"][name], ph["measured"])
    if e["id"] in (49, 58, 59):
        for name, ph in e["report"]["cuda"]["phases"].items():
            assert abs(p["phases"][name] - ph["measured"]) <= 6 * 1024, (name, p["phases"][name], ph["measured"])


def test_the_moe_rows_allocated_gap_is_the_allocators_whole_blocks():
    """Row 54 on the default allocator: the replay of the run's own allocations through the caching allocator's
    policy (memcalc/validate/allocator.py) charges whole blocks as the GPU does and lands within 0.01% of
    `max_memory_allocated()`, 1.5 GiB above memcalc's tensor bytes; the same run with expandable segments is within
    0.1% of memcalc."""
    e = next(e for e in THIRD["results"] if e["id"] == 54)
    c, replay = e["report"]["cuda"], e["report"]["measured"]["allocator_replay"]
    assert abs(_err(replay["allocated_peak_bytes"], c["measured_peak_bytes"])) < 0.0001
    assert c["measured_peak_bytes"] - gv.predict(e["opts"])["allocated"] > 1.4 * 2**30


@pytest.mark.parametrize("e", _rows(THIRD, THIRD_RESERVED_MISSES))
def test_third_record_default_allocator_reserved_within_7pct(e):
    m, p = gv.measured(e), gv.predict(e["opts"])
    assert abs(_err(p["reserved"], m["reserved"])) <= 0.07, (p["reserved"], m["reserved"])

