"""LoRA's own moments in a layer (memcalc/cost/activations.py): an adapted linear returns base(x) + B(A(x)), summed
out of place, and autograd sums the two input gradients of a tensor both branches read out of place too. Found by
rows 65 and 69-71 of the fourth GPU record (docs/validation.md), a 512-token vocabulary leaving the layers' moments
as the peak, and measured here op by op by the CPU harness."""

from __future__ import annotations

import pytest

from memcalc.cost import activations as A
from tests.conftest import run_of

# a toy whose loss is smaller than a layer's moments: c = 2 (pure bf16), tok = 256, h = 128, f = 512, r = 4
TOY = dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=512, vocab=64, seq=256, precision="bf16",
           master_weights=False, lora_rank=4)
GELU = dict(mlp="gelu", norm="layernorm", bias=True)
C, TOK, H, F, R = 2, 256, 128, 512, 4


def test_gelu_down_adapter_backward_sums_the_two_input_gradients():
    """GELU, LoRA on every projection, no adapter dropout. The down adapter's backward runs first: its input
    gradient c*tok*f, its saved input (read by A alone: the frozen base keeps none) and x A (c*tok*r) freed; then
    the base's input gradient c*tok*f and their out-of-place sum c*tok*f:
    3*2*256*512 - 2*256*512 - 2*256*4 = 522,240 beside the saved set, plus the stream's gradient 2*256*128 = 65,536:
    587,776 (the GELU backward's moment alone is 2*256*512 - 2,048 = 260,096)."""
    run = run_of(**TOY, lora_targets="all", **GELU)
    assert A.layer_backward_transient(run) == 3 * C * TOK * F - C * TOK * F - C * TOK * R + C * TOK * H == 587_776


def test_the_products_backward_follows_the_down_adapters_with_dropout():
    """SwiGLU, LoRA everywhere, adapter dropout 0.1: the down adapter saves its dropped copy, its bool mask and x A,
    (2+1)*256*512 + 2*256*4 = 395,264, all freed before the product's backward, whose moment is the product's
    gradient and both factors' (the product itself unsaved: 3 c tok f): 786,432 - 395,264 = 391,168, plus the
    stream's 65,536. memcalc counted it net of nothing before (+6.9% of this toy's backward)."""
    run = run_of(**TOY, lora_targets="all", lora_dropout=0.1)
    saved = (C + 1) * TOK * F + C * TOK * R
    assert A.layer_backward_transient(run) == 3 * C * TOK * F - saved + C * TOK * H == 456_704


def test_a_checkpointed_mlp_with_adapters_holds_the_three_outputs_of_each_sum():
    """Full recompute: the checkpoint's no-grad forward. Up's sum holds its base output, its adapter's and the sum
    beside silu's output (4 c tok f, not 3), the down projection's the same three c tok h beside the product:
    +2*256*512 = +262,144 and +2*2*256*128 = +131,072 on a model whose adapters are on attention only (the
    moments were `_NEVER` for MLP adapters before: the forward was 38% low on this toy)."""
    ck = A.checkpointed_mlp_forward
    lora = run_of(**TOY, lora_targets="all", recompute="full")
    attn = run_of(**TOY, lora_targets="attn", recompute="full")
    (act, down), (act0, down0) = ck(lora, A.layer_terms(lora)), ck(attn, A.layer_terms(attn))
    assert act - act0 == C * TOK * F == 262_144
    assert down - down0 == 2 * C * TOK * H == 131_072


torch_cases = {
    # case: (options, the phase errors before, measured on this toy)
    "all": (dict(lora_targets="all"), "forward -0.67% (the down adapter's sum)"),
    "qv": (dict(lora_targets="qv"), "forward -4.3% (a frozen down projection's unsaved input at its matmul)"),
    "all-dropout": (dict(lora_targets="all", lora_dropout=0.1), "forward -5.1%, backward +6.9%"),
    "gelu-all": (dict(lora_targets="all", **GELU), "forward -0.83% (fc's sum), backward -7.6%"),
    "gelu-mlp-dropout": (dict(lora_targets="mlp", lora_dropout=0.1, **GELU), "forward -9.1%, backward +4.2%"),
    "all-full": (dict(lora_targets="all", recompute="full"), "forward -38%"),
    "all-full-dropout": (dict(lora_targets="all", recompute="full", lora_dropout=0.1), "forward -38%, backward "
                                                                                        "+10%"),
    "gelu-down-full-dropout": (dict(lora_targets="down", recompute="full", lora_dropout=0.1, **GELU),
                               "forward -34% (the down adapter's dropout in the no-grad forward), backward +5.7%"),
    "gelu-all-full": (dict(lora_targets="all", recompute="full", **GELU), "forward -35%, backward -10%"),
    "all-selective": (dict(lora_targets="all", recompute="selective"), "forward -0.67%"),
    "gelu-all-selective": (dict(lora_targets="all", recompute="selective", **GELU), "forward -0.83%, backward "
                                                                                     "-7.6%"),
}


@pytest.mark.parametrize("case", list(torch_cases))
def test_lora_moments_against_the_harness(case):
    """Every phase within 4 KiB of the harness's exact tracked peak (what is left: the int64 tokens and the loss's
    scalars); the errors before are in `torch_cases`."""
    pytest.importorskip("torch")
    from memcalc.validate.api import validate

    opts, _before = torch_cases[case]
    rep = validate(run_of(**TOY, **opts), device="cpu", world="real", steps=1, timeout=300)
    for r in rep["rows"]:
        if r["section"] == "phases":
            assert abs(r["predicted"] - r["measured"]) <= 4096, (r["name"], r["predicted"], r["measured"])
