"""Sequence parallelism's own collectives at the LM head and a layer's start of backward (memcalc/cost/activations.py
`_sp_head_input`, `_sp_head_gather`, `_head_grad_end`, `_sp_grad_gather`; docs/methodology.md "Sequence
parallelism at the LM head"). A narrow MLP (f = h) and a 64-token vocabulary leave them as the peaks; measured op by
op by the harness on fake tensors (`--device meta --world fake`, every allocation exact)."""

from __future__ import annotations

import pytest

from memcalc.cost import activations as A
from tests.conftest import prediction_gap, run_of

# tp 2 with SP: tok = 2 x 256 = 512 tokens, tok_sp = 256, h = 256
TOY = dict(layers=2, hidden=256, heads=4, ffn=256, vocab=64, seq=256, micro_batch=2, gpus=2, tp=2, sp=True)


def test_the_heads_collectives_hand_computed():
    """fp32 (4 B): the final norm's sharded output 4 x 256 x 256 = 262,144 B; the head's all-gather holds its raw
    output and the sequence-ordered copy, 2 x 4 x 512 x 256 = 1,048,576, beside the norm's saved input and rstd
    (262,144 + 1,024); its backward's reduce-scatter the full input gradient and the concatenated copy beside the
    sharded output: 1,048,576 + 262,144."""
    run = run_of(**TOY, precision="fp32")
    assert A._sp_head_input(run) == 4 * 256 * 256 == 262_144
    assert A._sp_head_gather(run) == (4 * 256 * 256 + 4 * 256) + 262_144 + 2 * 4 * 512 * 256 == 1_573_888
    assert A._head_grad_end(run) == 2 * 4 * 512 * 256 + 4 * 256 * 256 == 1_310_720
    assert A._sp_head_input(run_of(**{**TOY, "sp": False}, precision="fp32")) == 0
    # without SP the head's input gradient's all-reduce output, then the final norm's input gradient beside it, over
    # all 512 tokens: 2 x 4 x 512 x 256; at tp 1 (one GPU) the input gradient itself in the all-reduce's place;
    # pure bf16 at 2 bytes
    assert A._head_grad_end(run_of(**{**TOY, "sp": False}, precision="fp32")) == 2 * 4 * 512 * 256 == 1_048_576
    assert A._head_grad_end(run_of(**{**TOY, "sp": False, "gpus": 1, "tp": 1}, precision="fp32")) == 1_048_576
    assert A._head_grad_end(run_of(**{**TOY, "sp": False}, precision="bf16", master_weights=False)) == 524_288


cases = {
    # case: (options, the phase errors before, on this toy)
    "fp32": (dict(precision="fp32"), "backward -2.68% (the head's reduce-scatter)"),
    "fp32-eager-norm": (dict(precision="fp32", norm_impl="fp32"), "forward -1.66% (the head's all-gather), "
                                                                  "backward -3.35%"),
    "amp": (dict(precision="bf16"), "forward -0.85%, backward -5.14%"),
    "bf16": (dict(precision="bf16", master_weights=False), "backward -1.76%"),
    "fsdp-zero3": (dict(precision="bf16", master_weights=False, gpus=4, zero=3),
                   "backward -1.02% (a layer's output-gradient all-gather)"),
    "grad-accum": (dict(precision="fp32", grad_accum=2), "backward -1.03%"),
    # one sequence per micro-batch: the head's all-gather output is already sequence-ordered (no copy)
    "fp32-one-sequence": (dict(precision="fp32", micro_batch=1), "backward -1.28%"),
}


@pytest.mark.parametrize("case", list(cases))
def test_sp_moments_against_the_harness(case):
    """Every phase within 16 KiB of the harness's exact tracked peak (the int64 tokens and the loss's scalars, and the
    AMP head all-gather's rstd-sized slack); the errors before are in `cases`."""
    pytest.importorskip("torch")
    from memcalc.validate.api import validate

    opts, _before = cases[case]
    rep = validate(run_of(**{**TOY, **opts}), device="meta", world="fake", steps=1, timeout=300)
    gaps = prediction_gap(rep)
    assert max(abs(g) for g in gaps.values()) <= 16384, (case, gaps)
