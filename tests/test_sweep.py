"""`estimate --sweep KEY=V1,V2,...` and `--plot FILE.png`."""

from __future__ import annotations

import json

import pytest

from memcalc.errors import InputError
from memcalc.options import RunOptions
from memcalc.sweep import parse_sweep, run_sweep
from tests.conftest import cli

BASE = ("estimate", "-m", "llama-3.1-8b", "--gpus", "8")


def sweep_json(*args: str) -> list[dict]:
    code, out, err = cli(*BASE, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_zero_stages_lower_the_model_states_and_the_peak():
    # ZeRO paper sec. 5: each stage shards one more of optimizer state, gradients, parameters over dp = 8
    pts = sweep_json("--sweep", "zero=0,1,2,3")
    assert [p["value"] for p in pts] == [0, 1, 2, 3]
    peaks = [p["estimate"]["memory"]["peak_bytes"] for p in pts]
    states = [sum(p["estimate"]["memory"]["model_states_detail"][k]
                  for k in ("params", "master_weights", "grads", "grads_fp32_copy", "optimizer_moments"))
              for p in pts]
    # torch profile: ZeRO-2 is FSDP2 reshard_after_forward=False, which keeps the same shards between steps as
    # ZeRO-3 and the whole stage unsharded from forward to backward (a buffer): equal states, a higher peak
    assert states[0] > states[1] > states[2] == states[3], states
    assert peaks[2] > peaks[3], peaks
    # the peak also holds stage-dependent buffers (reduce-scatter / all-gather staging), so only the ends are ordered
    assert peaks[0] > peaks[-1], peaks


def test_micro_batch_raises_the_peak_once_activations_are_modelled():
    pts = sweep_json("--zero", "3", "--sweep", "micro-batch=1,2,4")
    mems = [p["estimate"]["memory"] for p in pts]
    if any("activations" in m["not_modelled"] for m in mems):
        pytest.skip("activations are not modelled yet")
    acts = [m["activations_detail"] for m in mems]
    peaks = [m["peak_bytes"] for m in mems]
    assert all(a < b for a, b in zip(peaks, peaks[1:])), peaks
    assert acts[0] != acts[1]
    # the global batch follows the micro-batch (grad-accum stays 1 when no global batch is given)
    assert [p["estimate"]["inputs"]["training"]["global_batch"] for p in pts] == [8, 16, 32]


def test_sweep_keeps_the_global_batch_and_adjusts_accumulation():
    pts = sweep_json("--global-batch", "64", "--sweep", "mb=1,2,4,8")
    assert [p["estimate"]["inputs"]["training"]["grad_accum"] for p in pts] == [8, 4, 2, 1]


def test_gpus_sweep_clears_dp_and_invalid_values_are_rows_not_failures():
    code, out, err = cli("estimate", "-m", "llama-3.1-8b", "--dp", "4", "--sweep", "gpus=8,16", "--json")
    assert code == 0, err
    assert [p["estimate"]["inputs"]["parallel"]["dp"] for p in json.loads(out)] == [8, 16]
    pts = sweep_json("--sweep", "tp=1,3,8")
    assert "error" in pts[1] and "does not divide the 32 attention heads" in pts[1]["error"]
    assert pts[0]["estimate"]["inputs"]["parallel"]["tp"] == 1 and pts[2]["estimate"]["inputs"]["parallel"]["tp"] == 8


def test_sweep_table_lists_every_value():
    code, out, err = cli(*BASE, "--sweep", "recompute=none,selective,full")
    assert code == 0, err
    lines = [ln.split()[0] for ln in out.splitlines() if ln.split()]
    assert {"none", "selective", "full"} <= set(lines)


def test_sweep_check_exit_codes():
    assert cli(*BASE, "--sweep", "zero=2,3", "--check")[0] == 0
    code, out, err = cli(*BASE, "--sweep", "zero=0,3", "--check")
    assert code == 1 and err.startswith("memcalc: check failed")


@pytest.mark.parametrize("spec,needle", [
    ("warp=1,2", "cannot be swept"),
    ("tp", "is not KEY=V1,V2"),
    ("tp=1,,2", "comma-separated"),
    ("tp=one", "not a whole number"),
    ("tp=3,5", "no value gives a valid configuration"),
    ("recompute=sometimes", "no value gives a valid configuration"),
])
def test_bad_sweeps_are_one_line_exit_2(spec, needle):
    code, out, err = cli(*BASE, "--sweep", spec)
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_parse_sweep_aliases():
    assert parse_sweep("micro_batch=1,2") == ("micro-batch", "micro_batch", [1, 2])
    assert parse_sweep("--seq=1024, 2048")[2] == [1024, 2048]
    with pytest.raises(InputError):
        parse_sweep("=1")


def test_run_sweep_api_with_an_import(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}')
    from memcalc.importers import apply_imports

    opts = apply_imports(RunOptions(model="llama-3.2-1b", gpus=8, deepspeed_config=str(p)))
    pts = run_sweep(opts, "zero=1,2")
    assert [pt.run.zero for pt in pts] == [1, 2]
    assert all(pt.estimate.inputs["import_report"]["framework"] == "deepspeed" for pt in pts)
    assert all(pt.run.profile == "deepspeed" and pt.run.micro_batch == 2 for pt in pts)


# --- --plot --------------------------------------------------------------------------------------------------------

def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "zero.png"
    code, stdout, err = cli(*BASE, "--sweep", "zero=0,1,2,3", "--plot", str(out))
    assert code == 0, err
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    # IHDR: a real image with a width and height
    assert data[12:16] == b"IHDR" and int.from_bytes(data[16:20], "big") > 100
    # a single estimate can be plotted too
    one = tmp_path / "one.png"
    assert cli(*BASE, "--plot", str(one))[0] == 0 and one.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_is_one_line(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    code, out, err = cli(*BASE, "--sweep", "zero=1,2", "--plot", str(tmp_path / "x.png"))
    assert code == 2 and err.count("\n") == 1 and "pip install 'memcalc[plot]'" in err


def test_plot_into_a_missing_folder_is_one_line(tmp_path):
    pytest.importorskip("matplotlib")
    code, out, err = cli(*BASE, "--sweep", "zero=1,2", "--plot", str(tmp_path / "no" / "x.png"))
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err
