"""`memcalc validate` runs LoRA (issue 7): frozen base weights stored in the compute dtype, fp32 adapters trained
under autocast; model states measured against the prediction."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memcalc.validate.api import validate  # noqa: E402
from tests.conftest import run_of  # noqa: E402


@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny.toml"
    p.write_text('name = "tiny"\nhidden = 64\nlayers = 2\nheads = 4\nffn = 256\nvocab = 1000\n')
    return str(p)


@pytest.mark.parametrize("targets,gpus", [("attn", 1), ("all", 2)])
def test_lora_model_states_and_peak(tiny, targets, gpus):
    run = run_of(model=tiny, lora_rank=4, lora_targets=targets, seq=32, gpus=gpus)
    rep = validate(run, device="cpu", world="real", steps=1, timeout=180)
    states = {r["name"]: r for r in rep["rows"] if r["section"] == "model_states"}
    # params (bf16 frozen base + fp32 adapters) and grads (adapters only) equal to the byte
    assert states["params"]["measured"] == states["params"]["predicted"]
    assert states["grads"]["measured"] == states["grads"]["predicted"]
    r, h, f = 4, 64, 256
    per_layer = 4 * (h * r + r * h) + (0 if targets == "attn" else 2 * (h * r + r * f) + (f * r + r * h))
    assert states["grads"]["measured"] == 4 * 2 * per_layer  # fp32 grads of the adapters of 2 layers
    assert states["optimizer"]["measured"] == 8 * 2 * per_layer  # Adam moments; `step` counters are host-side on CUDA
    assert rep["within_tolerance"], rep["error"]
