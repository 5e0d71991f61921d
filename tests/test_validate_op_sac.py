"""torchtitan's op-level selective activation checkpointing (`--recompute op`) against the harness, op by op: the
re-run's net (memcalc/cost/activations.py `_op_sac_kept_beyond_plain`), the autocast weight copies the re-run makes
again (`_saved_cast_terms`), the last layer's MLP and attention core in forward (`_op_sac_pending`,
`eager_attention_forward`), and the fake process group's reduce-scatter outputs that the policy caches
(memcalc/validate/measure.py `Tracker._carry_over`). Each case was off before by the figure in its comment; a
2-layer (3-layer) h 512 toy whose activations dominate, so that these moments are the phases' peaks."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from memcalc.validate.api import validate  # noqa: E402
from tests.conftest import run_of  # noqa: E402

TOY = dict(layers=2, hidden=512, heads=8, ffn=1408, vocab=1000, seq=1024, recompute="op")
WIDE = dict(TOY, layers=3, seq=512)


def _phases(flags: dict) -> dict[str, dict]:
    rep = validate(run_of(**flags), device="meta", world="fake")
    return {r["name"]: r for r in rep["rows"] if r["section"] == "phases"}


cases = {
    # backward: the re-run remakes every plain-saved tensor but those the policy kept, and the kept down projection
    # output stays (the re-run stops before it): one c*tok*h short before
    "bf16": (dict(TOY, precision="bf16", master_weights=False), "backward -1.27%"),
    "fp32": (dict(TOY, precision="fp32"), "backward -1.26%, forward -4.94% (the MLP's product in forward)"),
    # under autocast the re-run casts the layer's weights again (op-level SAC keeps no `_to_copy`)
    "amp": (dict(TOY, precision="bf16"), "backward -4.12%"),
    "amp-gelu": (dict(TOY, precision="bf16", mlp="gelu"), "backward -3.77%"),
    "fp32-gelu": (dict(TOY, precision="fp32", mlp="gelu", ffn=2048), "forward -1.68% (GELU's kept fc output)"),
    # with dropout the re-run goes through the down projection to the output dropout's mask
    "fp32-dropout": (dict(WIDE, precision="fp32", dropout=0.1), "backward +0.56% with the kept output counted"),
    # eager attention: the core's forward moment counted the gate's and down projection's kept outputs, not made yet
    "eager-bf16": (dict(WIDE, precision="bf16", master_weights=False, attention="eager"), "forward +2.61%"),
    "gqa-fp32-math": (dict(WIDE, precision="fp32", kv_heads=2), "forward +2.75% (SDPA's math path)"),
    # TP 2 + SP: the reduce-scatters' kept outputs (a fake world freed them with the waited tensor: forward +3.6%)
    "tp2-sp-bf16": (dict(WIDE, precision="bf16", master_weights=False, gpus=2, tp=2, sp=True),
                    "forward +3.61%, backward -1.11%"),
    "tp2-sp-fp32-gelu": (dict(WIDE, precision="fp32", gpus=2, tp=2, sp=True, mlp="gelu"), "forward +2.40%"),
    # the re-run's eager (math-path) core the step's peak: SP's gathered output gradient live through it, and the
    # kept q and v projection outputs counted in the saved set, not again (rotary frees the kept q output)
    "tp4-sp-fp32-gqa-math-rerun": (dict(WIDE, ffn=1024, vocab=1000, kv_heads=4, precision="fp32", gpus=4, tp=4,
                                        sp=True, mlp="gelu"), "backward -2.42% (526,360 B)"),
    "tp4-sp-fp32-gqa-math-rerun-1024": (dict(TOY, ffn=512, vocab=256, kv_heads=4, precision="fp32", gpus=4, tp=4,
                                             sp=True, mlp="gelu"), "backward -0.71% (268,312 B)"),
    # the forward's math-path core without grad: `attn` rebound at the softmax frees the scores, so the value matmul
    # holds its input, the causal bias and its output (its output counted beside the scores before)
    "gqa-fp32-math-value": (dict(WIDE, seq=256, ffn=1024, kv_heads=2, precision="fp32", mlp="gelu"),
                            "forward +0.69% (262,144 B)"),
    "gqa-fp32-math-value-mb2": (dict(WIDE, seq=256, ffn=1024, kv_heads=2, precision="fp32", mlp="gelu",
                                     micro_batch=2), "forward +1.56% (786,432 B)"),
}


@pytest.mark.parametrize("case", list(cases))
def test_op_sac_against_the_harness(case):
    flags, _before = cases[case]
    for name, row in _phases(flags).items():
        # within 10 KB: the measured step's loss scalars, the norms' statistics and the loss's index vectors
        assert abs(row["predicted"] - row["measured"]) <= 10_240, (name, row["predicted"], row["measured"])


# The re-run's end under SP (`_recomputed_plain_end`, full and op-level recompute): the re-run stops at the down
# projection, with the MLP's argument (the norm output's all-gather, fp32 under autocast) and its shard live, and the
# output gradient all-gathered before the re-run in place of its compute-dtype shard. Short before: GQA over tp 4,
# AMP, op-level 462,992 B (-1.02%); TP 2 and tp 4 + SP, AMP, full recompute at f = 1.375 h 594,056 B (-0.91%) and
# 708,752 B (-2.24%).
@pytest.mark.parametrize("flags", [
    dict(WIDE, precision="bf16", kv_heads=4, gpus=4, tp=4, sp=True),
    dict(WIDE, precision="bf16", ffn=704, gpus=2, tp=2, sp=True, recompute="full"),
    dict(WIDE, precision="bf16", ffn=704, kv_heads=4, gpus=4, tp=4, sp=True, recompute="full"),
], ids=["op-gqa-tp4-sp-amp", "full-tp2-sp-amp", "full-gqa-tp4-sp-amp"])
def test_sp_re_run_end(flags):
    bwd = _phases(flags)["backward"]
    assert abs(bwd["predicted"] - bwd["measured"]) <= 10_240, (bwd["predicted"], bwd["measured"])

