"""The harness's multi-head latent attention (Hugging Face's DeepseekV3Attention, memcalc/validate/model.py
`LatentAttention`) against the cost model's inventory of it (memcalc/cost/activations.py `_mla_terms`,
`_latent_norm`): what the attention saves for backward, measured to the byte with saved-tensor hooks, by hand and
over dtypes, norm forms and query latents; then whole training steps of a DeepSeek-shaped model (MLA, a dense first
layer, routed and shared experts) measured by the harness."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memcalc.cost.activations import layer_terms  # noqa: E402
from memcalc.specs import HardwareSpec, MLASpec, ModelSpec, MoESpec, ParallelSpec, TrainingSpec, resolve  # noqa: E402
from memcalc.validate.api import validate  # noqa: E402
from memcalc.validate.model import LatentAttention, rotary_cos_sin  # noqa: E402

HW = HardwareSpec(name="x", memory_bytes=80 * 10**9)
# the attention's own terms (the norm before it and its output, qkv_input, are the layer's, saved by q and kv_a)
MLA_TERMS = ("mla_q_latent", "mla_kv_latent", "q", "k", "v", "attn_lse", "attn_output")


def _model(q_rank: int, moe: MoESpec | None = None, layers: int = 1) -> ModelSpec:
    return ModelSpec(name="mla", hidden=128, layers=layers, heads=4, ffn=384, vocab=1000, moe=moe,
                     mla=MLASpec(q_lora_rank=q_rank, kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16))


def _saved(m: ModelSpec, dtype, norm_impl: str, tok: int) -> int:
    """Bytes the attention saves for backward beyond its input, the parameters and the rotary tables."""
    torch.manual_seed(0)
    att = LatentAttention(m, 0.0, False, norm_impl).to(dtype)
    x = torch.randn(1, tok, m.hidden, dtype=dtype, requires_grad=True)
    cos, sin = rotary_cos_sin(tok, m.mla.qk_rope_dim, "cpu", dtype)
    skip = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *att.parameters())}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in skip:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        att(x, (cos, sin)).sum().backward()
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("norm_impl", ["fused", "fp32"])
@pytest.mark.parametrize("q_rank", [0, 48])
def test_mla_saved_set_to_the_byte(precision, norm_impl, q_rank):
    m = _model(q_rank)
    t = TrainingSpec(seq=256, precision=precision, master_weights=False, norm_impl=norm_impl)
    run = resolve(m, t, ParallelSpec(gpus=1), HW, "torch")
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    assert sum(layer_terms(run).get(n, 0) for n in MLA_TERMS) == _saved(m, dtype, norm_impl, 256)


def test_mla_saved_set_hand_computed():
    """fp32, fused norms, no query latent, 256 tokens, 4 heads, kv_lora_rank 32, nope 16, rope 8, v 16:
    - the kv latent's norm saves its input, a `split` view that keeps the down projection's whole output,
      256 x (32 + 8) x 4 = 40,960, and its rstd, 256 x 4 = 1,024; kv_b saves the normalized latent,
      256 x 32 x 4 = 32,768;
    - SDPA saves Q and K, 4 x 256 x 24 x 4 = 98,304 each; V, a view of kv_b's output, keeps all of it,
      256 x 4 x (16 + 16) x 4 = 131,072; its output, 4 x 256 x 16 x 4 = 65,536 (which the o projection saves too);
      the fp32 log-sum-exp, 4 x 256 x 4 = 4,096.
    40,960 + 1,024 + 32,768 + 2 x 98,304 + 131,072 + 65,536 + 4,096 = 472,064."""
    assert _saved(_model(0), torch.float32, "fused", 256) == 472_064


@pytest.mark.parametrize("opts", [
    dict(precision="bf16"),
    dict(precision="fp32"),
    dict(precision="bf16", recompute="selective"),
    dict(precision="bf16", gpus=2, zero=3),
])
def test_deepseek_shaped_training_step(opts):
    """Three layers of a DeepSeek-shaped model (query and kv latents, the first layer dense, 8 routed experts top-2
    and one shared expert, HF's fp32 RMSNorm) through whole steps: model states exact, the peak within 0.1%."""
    moe = MoESpec(experts=8, top_k=2, expert_ffn=64, shared_experts=1, first_dense_layers=1)
    m = _model(48, moe, layers=3)
    opts = dict(opts)
    p = ParallelSpec(gpus=opts.pop("gpus", 1), zero=opts.pop("zero", 0))
    t = TrainingSpec(seq=256, norm_impl="fp32", **opts)
    rep = validate(resolve(m, t, p, HW, "torch"), device="cpu", world="real", tolerance=0.03, timeout=120)
    assert abs(rep["error"]) < 0.001, rep["error"]
    for k in ("params", "grads", "optimizer"):
        assert rep["measured"]["model_states"][k] == rep["predicted"]["model_states"][k]


@pytest.mark.parametrize("q_rank", [0, 48])
def test_latent_norms_under_amp_run_torchs_composite(q_rank):
    """A latent nn.RMSNorm under torch AMP gets a bf16 latent and an fp32 weight, a pair the fused kernel refuses
    (read on an H100: scripts/gpu_validation.py's probe, `rms_norm_autocast_latent_saved`): torch's composite saves
    an fp32 copy of the latent (not the split view), rstd and the fp32 normalized tensor, and returns bf16, which
    the up projection saves. kv latent 32 wide (its view 32 + 8), 256 tokens, bf16: 8 x 256 x 32 + 4 x 256 (rstd) +
    2 x 256 x 32 = 82,944 B, where without autocast 2 x 256 x 40 + 4 x 256 + 2 x 256 x 32 = 37,888. Two whole
    steps, every phase within 256 bytes of the measurement."""
    from memcalc.cost.activations import layer_terms

    m = _model(q_rank, layers=2)
    amp = resolve(m, TrainingSpec(seq=256, precision="bf16"), ParallelSpec(gpus=1), HW, "torch")
    pure = resolve(m, TrainingSpec(seq=256, precision="bf16", master_weights=False), ParallelSpec(gpus=1), HW,
                   "torch")
    assert layer_terms(amp)["mla_kv_latent"] == 8 * 256 * 32 + 4 * 256 + 2 * 256 * 32 == 82_944
    assert layer_terms(pure)["mla_kv_latent"] == 2 * 256 * 40 + 4 * 256 + 2 * 256 * 32 == 37_888
    rep = validate(amp, device="cpu", world="real", tolerance=0.03, timeout=120)
    for r in rep["rows"]:
        if r["section"] == "phases":
            assert abs(r["predicted"] - r["measured"]) <= 256, r
