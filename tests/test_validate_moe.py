"""The harness's MoE block (Hugging Face's MixtralSparseMoeBlock, memcalc/validate/model.py `MoE`) against the
cost model's inventory of it (memcalc/cost/activations.py `_hf_moe_terms`, `_hf_moe_backward_transient`),
measured to the byte with the harness's storage tracker: what the block saves for backward, and the highest moment
of its backward beyond that and the incoming gradient. Then a whole training step of a tiny MoE model."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from memcalc.cost.activations import _hf_moe_backward_transient, layer_terms  # noqa: E402
from memcalc.specs import HardwareSpec, ModelSpec, MoESpec, ParallelSpec, TrainingSpec, resolve  # noqa: E402
from memcalc.validate.api import validate  # noqa: E402
from memcalc.validate.measure import Tracker  # noqa: E402
from memcalc.validate.model import MoE  # noqa: E402

HW = HardwareSpec(name="x", memory_bytes=80 * 10**9)
MOE_TERMS = ("moe_router_probs", "moe_routing_metadata", "moe_token_indices", "moe_dispatched_input",
             "moe_expert_gate_up_output", "moe_expert_silu_output", "moe_expert_act_output", "moe_combine",
             "moe_weighted_output", "moe_shared_gate_up_output", "moe_shared_silu_output", "moe_shared_act_output")


def _model(E: int, k: int, h: int, f: int, shared: int = 0) -> ModelSpec:
    return ModelSpec(name="moe", hidden=h, layers=1, heads=4, ffn=f, vocab=64,
                     moe=MoESpec(experts=E, top_k=k, expert_ffn=f, shared_experts=shared))


def _measure(m: ModelSpec, dtype, tok: int) -> tuple[int, int]:
    """(bytes the block saves beyond its input, highest backward moment beyond the saved set and the incoming
    gradient), parameters and their gradients excluded."""
    torch.manual_seed(0)
    blk = MoE(m, 0.0).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in blk.parameters()}
    x = torch.randn(1, tok, m.hidden, dtype=dtype, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key != x.untyped_storage().data_ptr():
            saved[key] = t.untyped_storage().nbytes()
        return t

    tr = Tracker()
    with tr:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = blk(x)
        g = torch.ones_like(y)
        gc.collect()
        n0 = len(tr.events)
        y.backward(g)
    grads = {tr.uid_of(p.grad) for p in blk.parameters()} | {tr.uid_of(x.grad)}
    live = peak = 0
    for uid, delta in tr.events[n0:]:
        if uid not in grads:
            live += delta
            peak = max(peak, live)
    return sum(saved.values()), peak


# (experts, top_k, hidden, expert_ffn, tokens): which backward moment is highest differs: the first expert's
# combine (1, 4), its SwiGLU (2, 5) or the index backward of the first two experts (3)
CASES = [(4, 2, 128, 192, 512), (4, 2, 128, 384, 512), (16, 2, 128, 64, 512), (8, 2, 128, 192, 512),
         (8, 8, 64, 128, 256)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("E,k,h,f,tok", CASES)
def test_moe_block_saved_set_and_backward_transient_to_the_byte(precision, E, k, h, f, tok):
    m = _model(E, k, h, f)
    t = TrainingSpec(seq=tok, precision=precision, master_weights=precision == "fp32")
    run = resolve(m, t, ParallelSpec(gpus=1), HW, "torch")
    saved, transient = _measure(m, torch.float32 if precision == "fp32" else torch.bfloat16, tok)
    terms = layer_terms(run)
    assert sum(terms.get(n, 0) for n in MOE_TERMS) == saved
    assert _hf_moe_backward_transient(run) == transient


def test_moe_block_saved_set_hand_computed():
    """fp32, 4 experts, top-2, h 128, f 192, 512 tokens: R = 1024 routed copies.
    router 4*512*4 + 8*512*2 + 4*512*2 + 4*512 = 8,192 + 8,192 + 4,096 + 2,048 = 22,528;
    indices 16 R = 16,384; expert inputs, outputs and index_add_ sources 3 * 4 R h = 1,572,864;
    weight slices 4 R = 4,096; SwiGLU 4 * 4 R f = 3,145,728: 4,761,600 B."""
    m = _model(4, 2, 128, 192)
    saved, _ = _measure(m, torch.float32, 512)
    assert saved == 22_528 + 16_384 + 1_572_864 + 4_096 + 3_145_728 == 4_761_600


def test_shared_expert_saved_set():
    m = _model(4, 2, 128, 192, shared=1)
    run = resolve(m, TrainingSpec(seq=512, precision="fp32"), ParallelSpec(gpus=1), HW, "torch")
    saved, _ = _measure(m, torch.float32, 512)
    assert sum(layer_terms(run).get(n, 0) for n in MOE_TERMS) == saved


def test_tiny_moe_training_step_within_a_tenth_of_a_percent():
    """A whole step (2 layers, 4 experts top-2, seq 512, vocab 1,000: the loss gradient is the peak) measured by
    the harness: the peak within 0.1% and the model states exact."""
    m = ModelSpec(name="moe", hidden=128, layers=2, heads=4, kv_heads=2, ffn=192, vocab=1000,
                  moe=MoESpec(experts=4, top_k=2, expert_ffn=192))
    run = resolve(m, TrainingSpec(seq=512, precision="bf16"), ParallelSpec(gpus=1), HW, "torch")
    rep = validate(run, device="cpu", world="real", tolerance=0.03, timeout=120)
    assert abs(rep["error"]) < 0.001
    for k in ("params", "grads", "optimizer"):
        assert rep["measured"]["model_states"][k] == rep["predicted"]["model_states"][k]
