"""`memcalc validate` launched by torchrun (issue 8): each process runs its own rank (gloo on CPU here, NCCL on a
user's GPUs), every measurement is gathered, and global rank 0 prints the comparison once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


def test_torchrun_two_ranks_on_cpu(tmp_path):
    model = tmp_path / "tiny.toml"
    model.write_text('name = "tiny"\nhidden = 64\nlayers = 2\nheads = 4\nffn = 256\nvocab = 1000\n')
    runner = shutil.which("torchrun") or None
    cmd = ([runner] if runner else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--standalone", "--nproc_per_node", "2", "-m", "memcalc", "validate", "--model", str(model),
        "--gpus", "2", "--device", "cpu", "--seq", "32", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, (res.stdout[-1000:], res.stderr[-3000:])
    # one JSON document: only rank 0 printed
    report = json.loads(res.stdout)
    assert report["launcher"] == "torchrun"
    assert report["this_process_rank"] == 0
    assert set(report["all_ranks_peak_bytes"]) == {"0", "1"}
    # DDP fp32 on 2 ranks: the gradient all-reduce moves exactly the 4-byte grads of every parameter
    n = 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 1000 * 64 + 64 + 1000 * 64
    ar = [c for c in report["collectives"] if c["op"] == "all-reduce" and c["group"] == "dp"]
    assert ar and ar[0]["measured_bytes"] == 4 * n
    assert report["within_tolerance"]
