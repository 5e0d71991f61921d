"""memcalc against the fourth GPU record, without a GPU: rows 60-72 of `scripts/gpu_validation.py` on one NVIDIA
H100 80GB HBM3 (torch 2.11.0+cu130), docs/data/validation-cuda-4.json (default caching allocator) and
docs/data/validation-cuda-4-expandable.json (`expandable_segments:True`); docs/validation.md "rows 60-72". A file of
its own, so that the test workers (pytest-xdist, a file each) run it beside tests/test_cuda_record.py, which holds
the first three records and their replays."""

from __future__ import annotations

import json

import pytest

from memcalc.cost import buffers
from tests.test_cuda_record import ROOT, _err, _ran_the_scripts_configurations, _rows, gv

FOURTH = json.loads((ROOT / "docs/data/validation-cuda-4.json").read_text())
FOURTH_EXPANDABLE = json.loads((ROOT / "docs/data/validation-cuda-4-expandable.json").read_text())
FOURTH_RESERVED_MISSES = {
    64: "-7.7%: LoRA under AMP with full recompute, a 0.63 GiB peak: the replay is -4.7%, not attributed",
    66: "+9.2%: fp32 GQA's math fallback with dropout under selective recompute; the replay has it to the byte",
    68: "-14.4%: FSDP2 ZeRO-3 in fp32 with a 128k vocabulary (its 1 GiB unsharded embedding and tied head's gradient "
        "on the compute stream beside 0.5 GiB score blocks); the replay has it to the byte, the fraction does not",
}
FOURTH_EXPANDABLE_RESERVED_MISSES = {
    62: "-5.1%: eager attention with dropout on CUDA: the softmax backward's scratch is the kernel's own (257 MiB, "
        "not tensors the replay sees: -2.0%)",
    65: "-3.3%: LoRA on every projection, a 1 GiB peak; the replay is -1.8%, not attributed",
    67: "-8.2%: activation offloading (reloaded blocks of every size, as rows 19 and 25); not replayable",
    68: "-2.5%: FSDP2 ZeRO-3 in fp32 over 8 ranks, with its side streams' pools; the replay is +4.6% (9.26 GiB against "
        "8.85), not attributed",
}


def test_the_fourth_record_ran_the_scripts_configurations_on_an_h100():
    _ran_the_scripts_configurations(FOURTH, FOURTH_EXPANDABLE, "NVIDIA H100 80GB HBM3", list(range(60, 73)))
    assert [e["id"] for e in FOURTH_EXPANDABLE["results"]] == list(range(60, 73))


@pytest.mark.parametrize("e", _rows(FOURTH, {}))
def test_fourth_record_allocated_within_0_6pct_in_every_phase(e):
    """`max_memory_allocated()` per phase against memcalc on rows 60-72: within 0.6% (the largest: FSDP2's optimizer
    phase, -0.55%, its blocks charged whole; -0.00% with expandable segments). Before this record's fixes: LoRA rows
    65 and 69-71 -0.6%, +2.4%, -7.6% and -3.2% in a phase, FSDP2's row 68 -2.2% and the offloaded row 67 -1.5% (both
    backward)."""
    p = gv.predict(e["opts"])
    for name, ph in e["report"]["cuda"]["phases"].items():
        assert abs(_err(p["phases"][name], ph["measured"])) <= 0.006, (name, p["phases"][name], ph["measured"])


@pytest.mark.parametrize("e", _rows(FOURTH_EXPANDABLE, {}))
def test_fourth_record_expandable_allocated_within_0_25pct_in_every_phase(e):
    """With expandable segments, rows 60-72 in every phase within 0.25% (the largest: the GELU LoRA row 71, -0.21% in
    its optimizer phase, a 1 MiB block CUDA allocates in every phase that the CPU harness has no tensor for)."""
    p = gv.predict(e["opts"], expandable=True)
    for name, ph in e["report"]["cuda"]["phases"].items():
        assert abs(_err(p["phases"][name], ph["measured"])) <= 0.0025, (name, p["phases"][name], ph["measured"])


def test_cuda_softmax_backward_scratch_is_the_kernels_own():
    """Rows 62 (eager attention, dropout) and 66 (fp32 GQA's math fallback, dropout): memcalc's backward matches
    `max_memory_allocated()` to 0.02% while the harness's tracked tensors on CUDA are 160-340 MiB fewer than the
    allocated bytes beyond the cuBLAS workspaces: the softmax backward's scratch, which the harness allocates as a
    tensor on the CPU (`_CudaSoftmax`) and CUDA's kernel allocates for itself, is counted either way."""
    for e in FOURTH["results"]:
        if e["id"] in (62, 66):
            ph = e["report"]["cuda"]["phases"]["backward"]
            assert ph["measured"] - 2 * buffers.CUBLAS_WORKSPACE_BYTES - ph["tracked"] >= 150 * 2**20
            assert abs(_err(gv.predict(e["opts"])["phases"]["backward"], ph["measured"])) <= 0.0002


@pytest.mark.parametrize("e", _rows(FOURTH, FOURTH_RESERVED_MISSES))
def test_fourth_record_default_allocator_reserved_within_7pct(e):
    m, p = gv.measured(e), gv.predict(e["opts"])
    assert abs(_err(p["reserved"], m["reserved"])) <= 0.07, (p["reserved"], m["reserved"])


@pytest.mark.parametrize("e", _rows(FOURTH_EXPANDABLE, FOURTH_EXPANDABLE_RESERVED_MISSES))
def test_fourth_record_expandable_segments_reserved_within_2_1pct(e):
    m, p = gv.measured(e), gv.predict(e["opts"], expandable=True)
    assert abs(_err(p["reserved"], m["reserved"])) <= 0.021, (p["reserved"], m["reserved"])


def test_the_fourth_records_runs_beyond_the_reserved_error_band():
    """`memory.tight`'s shares (fragmentation.RESERVED_SHORTFALL_FRACTION, 12.5% / 5%) were set from the first three
    records. On the fourth, max_memory_reserved() exceeds memcalc's reserved figure by more on three runs, listed here
    with what settles each: the default allocator's row 68 (+16.8%: the replay `memcalc validate --device meta
    --world fake`, which the tight verdict names, has it to the byte), and with expandable segments row 67
    (+8.9%, activation offloading, not replayable) and row 62 (+5.4%, CUDA's own softmax scratch). Every other run
    is inside its band."""
    from memcalc.cost.fragmentation import RESERVED_SHORTFALL_FRACTION

    beyond = set()
    for data, allocator in ((FOURTH, "default"), (FOURTH_EXPANDABLE, "expandable")):
        for e in data["results"]:
            m, p = gv.measured(e), gv.predict(e["opts"], expandable=allocator == "expandable")
            if (m["reserved"] - p["reserved"]) / p["reserved"] > RESERVED_SHORTFALL_FRACTION[allocator]:
                beyond.add((allocator, e["id"]))
    assert beyond == {("default", 68), ("expandable", 67), ("expandable", 62)}
    e68 = next(e for e in FOURTH["results"] if e["id"] == 68)
    assert gv.replayed(e68["opts"]) == gv.measured(e68)["reserved"]
