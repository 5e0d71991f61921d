"""An eager fp32 RMSNorm's own moments and where a checkpointed layer's re-run stops (memcalc/cost/activations.py,
timeline.py; docs/methodology.md "An eager fp32 RMSNorm's own moments" and "Where the re-run stops"). Found with a
256-token vocabulary, which leaves the layers' and the norms' moments as the peak, and measured op by op by the CPU
harness (exact tracked bytes)."""

from __future__ import annotations

import pytest

from memcalc.cost import activations as A
from memcalc.cost import timeline as T
from tests.conftest import prediction_gap, run_of

# pure bf16 (c = 2), HF's eager fp32 RMSNorm; tok = 256, h = 128, so e = tok*h = 32,768 elements and rstd 4*256 B
TOY = dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=512, vocab=64, seq=256, precision="bf16",
           master_weights=False, norm_impl="fp32")
E, STATS = 256 * 128, 4 * 256


def test_the_final_norms_forward_moment():
    """At the weight multiply: the input (2e, the caller's reference), the saved fp32 copy and rstd (4e + 1,024),
    `x * rstd` in fp32 (4e), the saved cast back (2e) and the product (2e): 14e + 1,024 = 459,776 B. Under AMP the
    stream is fp32: `x.float()` is the input and the cast back is `x * rstd`, so 4e + 1,024 + 4e + 4e = 394,240.
    With LoRA the frozen weight saves no cast back, but it is live all the same: 459,776 again."""
    assert A._final_norm_moment(run_of(**TOY)) == 2 * E + 4 * E + STATS + 4 * E + 2 * E + 2 * E == 459_776
    assert A._final_norm_moment(run_of(**{**TOY, "master_weights": True})) == 12 * E + STATS == 394_240
    assert A._final_norm_moment(run_of(**TOY, lora_rank=4, lora_targets="all")) == 459_776
    assert A._final_norm_moment(run_of(**{**TOY, "norm_impl": "fused"})) == 0


def test_the_eager_norms_backward():
    """The square's backward: five fp32 tensors (20e) once the cast back (2e) and rstd are freed: 18e - 1,024 =
    588,800 B (the weight multiply's, 3 x 2e = 196,608, is lower). With LoRA no cast back is saved: 20e - 1,024 =
    654,336. Under AMP the cast back is fp32 (4e): 16e - 1,024 = 523,264 for the final norm; a layer's MLP norm, whose
    input also feeds the residual add, sums the rstd product's input gradient into the waiting residual gradient
    first (4e less, 12e - 1,024), below the weight multiply's 3 x 4e = 393,216."""
    assert A._final_norm_backward(run_of(**TOY)) == 20 * E - 2 * E - STATS == 588_800
    assert A._final_norm_backward(run_of(**TOY, lora_rank=4, lora_targets="all")) == 20 * E - STATS == 654_336
    amp = run_of(**{**TOY, "master_weights": True})
    assert A._final_norm_backward(amp) == 20 * E - 4 * E - STATS == 523_264
    assert A._eager_norm_backward(amp, merged=True) == 3 * 4 * E == 393_216


def test_a_checkpoint_is_not_in_an_fp32_norms_inventory():
    """A checkpointed layer's re-run remakes its whole inventory less the checkpoint where the inventory holds it;
    an eager fp32 norm over a bf16 stream saves an fp32 copy instead, so the checkpoint (2e = 65,536 B) is not taken
    off; an fp32 stream's copy is the input itself."""
    assert A._remat_kept(run_of(**TOY), 1_000_000) == 1_000_000 - 2 * E == 934_464
    assert A._remat_kept(run_of(**{**TOY, "master_weights": True}), 1_000_000) == 1_000_000
    assert A._remat_kept(run_of(**{**TOY, "norm_impl": "fused"}), 1_000_000) == 1_000_000


def test_where_the_re_run_stops():
    """A LoRA down adapter with dropout stops at its low-rank intermediate beside the stream's gradient (2e), the
    base's output (2e), the MLP's unsaved input (2e: gate and up are frozen) and the down projection's unsaved input
    (c*tok*f = 2*256*512): 458,752 B. A plain AMP layer with f = 64 stops as the down projection saves its input:
    the fp32 stream's gradient (4e), the MLP's fp32 argument (4e) and the down output's compute-dtype gradient
    (2e): 327,680."""
    down = run_of(**{**TOY, "norm_impl": "fused"}, lora_rank=4, lora_targets="down", lora_dropout=0.1,
                  recompute="full")
    assert A._recomputed_adapter_end(down) == 3 * 2 * E + 2 * 256 * 512 == 458_752
    amp = run_of(**{**TOY, "ffn": 64, "master_weights": True}, recompute="full")
    assert A._recomputed_plain_end(amp) == 4 * E + 4 * E + 2 * E == 327_680


def test_lora_layers_share_the_adapters_gradients():
    """Every layer's share of a LoRA stage's gradients is its adapters' (the embedding and head are frozen): r = 4 on
    every projection of 2 layers, 11,264 adapter elements a layer of 22,528."""
    shares = T._layer_shares(run_of(**TOY, lora_rank=4, lora_targets="all"), 0)
    assert (shares[0], shares[1]) == (11_264, 22_528)


torch_cases = {
    # case: (options, the phase errors before, measured on this toy)
    "plain": (dict(), "forward -0.46% (the final norm), backward -0.91% (its backward)"),
    "lora-all": (dict(lora_rank=4, lora_targets="all"), "forward -1.46%, backward -3.79%"),
    "full": (dict(recompute="full"), "backward -1.10% (the checkpoint taken off an fp32 norm's inventory)"),
    "narrow": (dict(ffn=64), "forward -1.03%, backward -9.69% (the MLP norm's backward)"),
    "narrow-full": (dict(ffn=64, recompute="full"), "forward -2.03%, backward -16.3%"),
    "narrow-amp-full": (dict(ffn=64, recompute="full", master_weights=True),
                        "backward -2.10% (the re-run's stop, and the down gradient not yet made)"),
    "amp-full": (dict(recompute="full", master_weights=True), "exact before"),
    "qlora-torchao-full": (dict(lora_rank=4, lora_targets="all", lora_dropout=0.05, recompute="full",
                                base_dtype="nf4", quant_backend="torchao", layers=4, keep_logits="fp32"),
                           "backward -1.42% (LoRA layers' gradient shares)"),
    # a fused norm: the LoRA down adapter's re-run stop alone (wider or longer than the other toys, where the MLP's
    # moment stays above it)
    "lora-down-dropout-full": (dict(norm_impl="fused", hidden=256, ffn=704, lora_rank=4, lora_targets="down",
                                    lora_dropout=0.1, recompute="full"), "backward -1.24%"),
    "lora-all-dropout-full": (dict(norm_impl="fused", ffn=352, seq=512, lora_rank=4, lora_targets="all",
                                   lora_dropout=0.1, recompute="full"), "backward -1.62%"),
}


@pytest.mark.parametrize("case", list(torch_cases))
def test_fp32_norm_moments_against_the_harness(case):
    """Every phase within 8 KiB of the harness's exact tracked peak (what is left: some of the int64 tokens, 4 KiB at
    512 tokens, and the loss's scalars); the errors before are in `torch_cases`."""
    pytest.importorskip("torch")
    from memcalc.validate.api import validate

    opts, _before = torch_cases[case]
    rep = validate(run_of(**{**TOY, **opts}), device="cpu", world="real", steps=1, timeout=300)
    gaps = prediction_gap(rep)
    assert max(abs(g) for g in gaps.values()) <= 8192, (case, gaps)


def test_eager_fp32_norms_run_under_tensor_parallelism_without_sp():
    """The harness replicates the eager fp32 norm's weight over the TP mesh like nn.RMSNorm's (it had mixed a
    DTensor weight with the plain input and failed: `validate --tp 2 --norm-impl fp32`); the final norm's and the MLP
    norms' moments hold there too (f = h/2)."""
    pytest.importorskip("torch")
    from memcalc.validate.api import validate

    run = run_of(**{**TOY, "ffn": 64}, gpus=2, tp=2)
    rep = validate(run, device="meta", world="fake", steps=1, timeout=300)
    gaps = prediction_gap(rep)
    assert max(abs(g) for g in gaps.values()) <= 8192, gaps
