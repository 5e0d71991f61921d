"""torchtitan's December 2024 H100 runs replayed: memcalc's harness on fake tensors, the CUDA caching allocator
replayed over its allocations (scripts/torchtitan_replay.py; the record is docs/data/torchtitan-replay.json).

Published figures: pytorch/torchtitan `benchmarks/llama3_h100_202412_torchtitan.md` (9dec370), "Memory(GiB)" =
max over ranks of `max_memory_reserved` (docs/published-measurements.md, section 2). Findings:
- the harness allocates memcalc's allocated peak for every row (cuBLAS's workspaces aside), so whatever separates
  memcalc's reserved figure from the replay's is the allocator, not a missing tensor;
- under the allocator's default policy the replay lands within 0.5% of the two eager rows (Tables 1 and 3) and of
  the FSDP x TP row (Table 4), where `expandable_segments:True` lands 3.6-4.4% below the eager rows and 7.9% above
  Table 4;
- Table 4's gap to the closed form is the layers' 2 GiB blocks (SP all-gathered inputs, row-parallel outputs):
  16 segments of them, of which 8.5 GiB are free at the loss gradient, where the 7.8 GiB logit-sized blocks of the
  loss cannot use them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memcalc.cost.buffers import blas_workspace_bytes
from memcalc.cost.estimate import estimate
from memcalc.options import RunOptions, build_run
from tests.test_published_peaks import TORCHTITAN

RECORD = json.loads((Path(__file__).resolve().parent.parent / "docs" / "data" / "torchtitan-replay.json").read_text())
ROWS = {r["case"]: r for r in RECORD["rows"]}
GIB = 2**30
T1, T3, T4 = ("torchtitan-8b-fsdp8-lbs2-sac", "torchtitan-8b-fsdp128-lbs2-sac",
              "torchtitan-70b-fsdp32-tp8-lbs16-full-fp8-compile")


def _error(row: dict, key: str) -> float:
    return (row[key] / GIB - row["published_gib"]) / row["published_gib"]


def test_record_rows_are_the_published_cases():
    published = {p.values[0] if hasattr(p, "values") else p[0]: p.values[1] if hasattr(p, "values") else p[1]
                 for p in TORCHTITAN}
    for case, row in ROWS.items():
        assert published[case] == row["published_gib"]


@pytest.mark.parametrize("case", list(ROWS))
def test_harness_allocates_memcalcs_peak(case):
    row = ROWS[case]
    run = build_run(RunOptions(**row["options"]))
    # the record was made by this cost model: its allocated figure is today's
    assert int(estimate(run, advice=False).memory.allocated_peak_bytes) == row["predicted_allocated_bytes"]
    # the tracker counts tensors; memcalc's figure adds cuBLAS's two workspaces (32 MiB each on Hopper)
    tensors = row["predicted_allocated_bytes"] - 2 * blas_workspace_bytes(run.hardware)
    assert abs(tensors - row["tracked_peak_bytes"]) / row["tracked_peak_bytes"] < 1e-6


def test_default_policy_replay_meets_the_published_rows():
    # Tables 1 and 3 (eager blocks, as the harness runs them) and Table 4 (compiled blocks: the loss, eager, is its
    # peak): the default policy within 0.5% (-0.4%, +0.1%, -0.1%), expandable segments 3.6-4.4% low on the eager
    # rows and 7.9% high on Table 4
    for case in (T1, T3, T4):
        assert abs(_error(ROWS[case], "replay_default_reserved_bytes")) < 0.005, case
    for case in (T1, T3):
        assert -0.045 < _error(ROWS[case], "replay_expandable_reserved_bytes") < -0.035, case
    assert _error(ROWS[T4], "replay_expandable_reserved_bytes") > 0.07


def test_table4_gap_is_the_layers_blocks_the_loss_cannot_use():
    seg = ROWS[T4]["segments_at_peak"]
    n, reserved, used = seg[str(2 * GIB)]  # the layers' 2 GiB blocks: 131,072 tokens x 8,192 x 2 B
    assert (n, reserved) == (16, 32 * GIB)
    assert 8.4 * GIB < reserved - used < 8.6 * GIB
    # the loss's fp32 logit-sized blocks (131,072 x 16,032 x 4 B, rounded to 2 MiB): all four in use; the bf16
    # logits' block beside them free (memcalc's `loss_stranded_logits`)
    fp32_logits = -(-131072 * 16032 * 4 // (2 << 20)) * (2 << 20)
    assert seg[str(fp32_logits)] == [4, 4 * fp32_logits, 4 * fp32_logits]
    assert seg[str(fp32_logits // 2)] == [1, fp32_logits // 2, 0]
    # which is what the closed form's 3% slack leaves out: the replay is 6.9 GiB above it
    gap = ROWS[T4]["replay_default_reserved_bytes"] - ROWS[T4]["estimate_default_reserved_bytes"]
    assert 0.75 * (reserved - used) < gap < reserved - used


def test_replay_reproduces_the_record():
    """Table 1's row run again: the harness's log and both replays give the record's bytes (torch 2.13.0)."""
    from memcalc.validate.api import validate

    row = ROWS[T1]
    rep = validate(build_run(RunOptions(**row["options"])), device="meta", world="fake")
    measured = rep["measured"]
    assert measured["peak_bytes"] == row["tracked_peak_bytes"]
    assert measured["allocator_replay"]["reserved_peak_bytes"] == row["replay_default_reserved_bytes"]
    assert measured["allocator_replay"]["expandable_reserved_peak_bytes"] == row["replay_expandable_reserved_bytes"]
