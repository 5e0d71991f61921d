"""`--explain`'s model-state lines: element counts times bytes per element, each product equal to the figure it
explains (JSON `memory.model_states_detail` carries the counts)."""

from __future__ import annotations

import pytest

from tests.conftest import cli, cli_json

# (flags, bytes per parameter, per gradient, per stepped element of optimizer state) -- torch fp32 params and
# grads under bf16 AMP; megatron bf16 params, fp32 main grads; deepspeed bf16 params and grads
CASES = [
    (["--model", "mixtral-8x7b", "--gpus", "16", "--ep", "8", "--tp", "2", "--zero", "1"], 4, 4, 8),
    (["--model", "mixtral-8x7b", "--gpus", "32", "--ep", "4", "--tp", "2", "--zero", "3"], 4, 4, 8),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--zero", "1"], 4, 4, 8),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--zero", "3", "--tp", "2", "--sp"], 4, 4, 8),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--tp", "2"], 4, 4, 8),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--zero", "1", "--profile", "megatron", "--tp", "2"], 2, 4, 8),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--zero", "2", "--profile", "deepspeed"], 2, 2, 8),
    (["--model", "llama-2-7b", "--gpus", "1", "--lora-rank", "8", "--base-dtype", "nf4"], 4, 4, 8),
    (["--model", "llama-2-7b", "--gpus", "4", "--pp", "4", "--schedule", "pipedream-2bw"], 4, 4, 8),
]


@pytest.mark.parametrize("flags,pb,gb,ob", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_model_state_counts_multiply_out(flags, pb, gb, ob):
    det = cli_json("estimate", *flags)["memory"]["model_states_detail"]
    assert det["params"] == pb * det["param_elems"] * det["weight_versions"] + det["frozen_params_bytes"]
    assert det["grads"] == gb * det["grad_elems"]
    assert det["optimizer_moments"] == ob * det["stepped_params"]
    if det["master_weights"]:
        assert det["master_weights"] == 4 * det["stepped_params"]
    # a rank never holds or steps more than its trainable elements, bar the replicated embedding gradient
    assert det["stepped_params"] <= det["param_elems"] <= det["trainable_params"]
    assert det["grad_elems"] - det["embedding_grad_extra_elems"] <= det["trainable_params"]


def test_moe_experts_shard_over_their_own_group():
    """Mixtral-8x7B, tp 2, ep 8 on 16 GPUs (dp 8), ZeRO-1. Per rank, by hand:
    dense = 32 layers x (attention (4096^2 q + 2 x 4096 x 1024 k,v + 4096^2 o) / 2 = 20,971,520 + norms 8,192
            + router 8 x 4096 = 32,768) + embedding and head 2 x 32000 x 4096 / 2 = 131,072,000 + final norm 4,096
          = 803,475,456;
    experts = 32 layers x 1 expert (8 / ep 8) x 3 x 4096 x 14336 / 2 = 2,818,572,288.
    ZeRO-1 shards the dense ones over dp*cp = 8 and the experts over dp*cp/ep = 1, so the optimizer steps
    803,475,456 / 8 + 2,818,572,288 = 2,919,006,720 elements: x 8 B = 23,352,053,760 B = 21.75 GiB, not
    N x 8 B / 8 = 3.37 GiB."""
    flags = ["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--ep", "8", "--tp", "2", "--zero", "1"]
    det = cli_json(*flags)["memory"]["model_states_detail"]
    assert det["trainable_expert_params"] == 2_818_572_288
    assert det["trainable_params"] - det["trainable_expert_params"] == 803_475_456
    assert det["stepped_params"] == 803_475_456 // 8 + 2_818_572_288 == 2_919_006_720
    assert det["optimizer_moments"] == 23_352_053_760
    # torch TP: the embedding's gradient comes back replicated at V x h: 32000 x 4096 / 2 more elements
    assert det["embedding_grad_extra_elems"] == 65_536_000
    code, out, _ = cli(*flags, "--explain")
    text = " ".join(out.split())
    assert code == 0
    assert "2,919,006,720 stepped (dense 803,475,456 / 8 + experts 2,818,572,288 / 1 (their group dp*cp/ep))" in text
    assert "= 21.75 GiB" in text and "replicated over tp: 65,536,000 x 4 B = 13.74 GiB" in text
    _, table, _ = cli(*flags)
    assert "experts replicated (dp*cp/ep = 1)" in " ".join(table.split())


def test_lora_explain_counts_the_trainable_and_the_frozen_base_apart():
    """LoRA r=8 on q,v of Llama-2-7B: T = 32 layers x 2 projections x 8 x (4096 in + 4096 out) = 4,194,304
    trainable elements (the lit-gpt table's "Trainable parameters"); the 6.7B frozen ones are the base, in NF4."""
    flags = ["estimate", "--model", "llama-2-7b", "--lora-rank", "8", "--lora-targets", "qv", "--base-dtype", "nf4"]
    det = cli_json(*flags)["memory"]["model_states_detail"]
    assert det["trainable_params"] == 32 * 2 * 8 * (4096 + 4096) == 4_194_304
    code, out, _ = cli(*flags, "--explain")
    text = " ".join(out.split())
    assert code == 0
    assert "of which T = 4,194,304 train" in text
    assert "params = 4,194,304 (T) x 4 B (fp32) + frozen base" in text and "(nf4)" in text


def test_activations_are_split_into_held_terms_and_transients():
    """Llama-2-7B shape, seq 4096, micro-batch 1, no recompute, ZeRO-3 over 64: one layer saves its Q as
    4096 tokens x 4096 x 2 B = 33,554,432 B, held for all 32 layers (1 GiB); the RMSNorm input adds its fp32
    1/rms per token (4096 x 4 B = 16,384 B). The held terms sum to the forward phase's activations less the
    loss's forward transient."""
    flags = ["estimate", "--params", "7B", "--zero", "3", "--gpus", "64"]
    d = cli_json(*flags)
    det = d["memory"]["activations_detail"]
    held = sum(v for k, v in det.items() if not k.endswith("_transient"))
    fwd = next(p for p in d["memory"]["phases"] if p["name"] == "forward")
    assert fwd["live"]["activations"] == held + det["logits_forward_transient"]
    code, out, _ = cli(*flags, "--explain")
    text = " ".join(out.split())
    assert code == 0
    assert "q 1.00 GiB = 33,554,432 B per layer x 32" in text and 33_554_432 == 4096 * 4096 * 2
    assert "attn_norm 1.00 GiB = 33,570,816 B per layer x 32" in text and 33_570_816 == 33_554_432 + 4096 * 4
    assert f"sum {held / 2**30:.2f} GiB" in text
    assert "Transients: each live only at its own moment" in text
    assert "0 in this configuration: residual_adds" in text and "recompute_transient" in text
