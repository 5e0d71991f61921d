"""torch DDP's gradient buckets, one all-reduce each (comm._ddp_allreduce): the order autograd makes gradients
ready (params.grad_ready_elems) and the buckets DDP rebuilds from it after the first step. The hand-computed cases
are in tests/test_comm.py and tests/test_compute.py; the matrix rows 152 and 172-176 measure the calls and bytes
over real and fake gloo worlds (tests/test_validation_matrix_subset.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memcalc.cost import comm
from memcalc.cost.params import grad_ready_elems, stage_param_split, stage_params
from memcalc.specs import DTYPE_BYTES, ModelSpec
from tests.test_comm import make

LLAMA = ModelSpec(name="l", hidden=256, layers=5, heads=8, kv_heads=4, ffn=704, vocab=1000)
GPT2 = ModelSpec(name="g", hidden=256, layers=5, heads=8, ffn=1024, vocab=1003, mlp="gelu", norm="layernorm",
                 qkv_bias=True, linear_bias=True, positions="learned", max_positions=128, tied_embeddings=True)
PHI = ModelSpec(name="p", hidden=256, layers=5, heads=8, ffn=1024, vocab=1003, mlp="gelu", norm="layernorm",
                qkv_bias=True, linear_bias=True, block="parallel-shared-norm", head_bias=True)


# Megatron-LM's layer is sequential: phi's parallel block runs under torch only
@pytest.mark.parametrize("model,profile", [(LLAMA, "torch"), (LLAMA, "megatron"), (GPT2, "torch"), (GPT2, "megatron"),
                                           (PHI, "torch")], ids=["llama-gqa", "llama-megatron", "gpt2-tied",
                                                                 "gpt2-megatron", "phi"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (4, 3), (2, 5)])
def test_ready_order_lists_every_tensor_of_the_stage(model, profile, tp, pp):
    """The listed tensors add up to the stage's trainable parameters on every stage (embedding on the first, final
    norm and head on the last, a tied head's own copy when pp > 1; Megatron's padded vocabulary; LoRA's adapters)."""
    for kw in ({"qkv_impl": "separate"}, {"qkv_impl": "fused"}, {"lora_rank": 8, "lora_targets": "all"},
               {"lora_rank": 4, "lora_targets": "q,v,down"}):
        run = make(model, profile=profile, tp=tp, pp=pp, **kw)
        for stage in range(pp):
            elems = grad_ready_elems(run, stage)
            assert sum(elems) == stage_param_split(run, stage).trainable_dense, (kw, stage)
            assert all(e > 0 for e in elems)


def test_params_override_buckets_add_up_to_the_scaled_gradients():
    """`--params N`: the reference shape's tensors, scaled on the running total, so the buckets add up to the
    stage's scaled gradients exactly."""
    run = make(LLAMA.model_copy(update={"params_override": 7_000_000}), precision="fp32", dp=4)
    colls = comm.collectives(run)
    assert sum(c.bytes_per_call * c.calls_per_step for c in colls) == 4 * stage_params(run, 0)[0]
    assert sum(c.calls_per_step for c in colls) == 2  # 28 MB: the 1 MiB first bucket and the rest


def test_bulk_and_scalar_agree_bucket_by_bucket():
    """The planner's arrays (per distinct layout, padded with empty buckets) give each layout's own figures."""
    import numpy as np

    runs = [make(LLAMA, precision="fp32", gpus=8 * tp * pp, dp=8, tp=tp, pp=pp, grad_accum=pp, bucket_cap_mb=0.5)
            for tp, pp in [(1, 1), (2, 1), (1, 5), (4, 1)]]
    fields = ["gpus", "dp", "tp", "pp", "vpp", "cp", "ep", "micro_batch", "grad_accum", "global_batch"]
    arr = runs[0].replace(**{f: np.array([getattr(r, f) for r in runs], dtype=np.int64) for f in fields})
    for stage in (0, arr.pp - 1):
        terms = [t for t in comm.stage_terms(arr, stage) if t.op == "all-reduce" and t.group == "dp"]
        for i, r in enumerate(runs):
            st = stage if isinstance(stage, int) else int(stage[i])
            want = sorted((int(t.s), int(t.calls)) for t in comm.stage_terms(r, st)
                          if t.op == "all-reduce" and t.group == "dp")
            got = sorted((int(t.s[i] if np.ndim(t.s) else t.s), int(t.calls[i])) for t in terms
                         if int(t.calls[i]))
            assert got == want, (i, st)


# ------------------------------------------------------------------------------------------ against torch DDP

_PROBE = r"""
import json, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, sys.argv[1])
from tests.test_ddp_buckets import case_run
from memcalc.validate.model import GPT, apply_lora, loss_fn
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
out = {}
for name in json.loads(sys.argv[2]):
    run = case_run(name)
    torch.manual_seed(0)
    model = GPT(run.model, qkv_impl=run.training.qkv_impl)
    if run.recipe.param_dtype == "bf16":
        model = model.to(torch.bfloat16)
    t = run.training
    if t.lora_rank is not None:
        apply_lora(model, t.lora_targets, t.lora_rank, torch.float32, t.lora_dropout or 0.0)
    params = [p for p in model.parameters() if p.requires_grad]  # what DDP buckets
    kw = {} if run.training.bucket_cap_mb is None else {"bucket_cap_mb": run.training.bucket_cap_mb}
    ddp = DDP(model, **kw)
    x = torch.randint(0, run.model.vocab, (1, run.seq))
    for _ in range(3):  # rebuilt at the start of the second step, logged by the third
        loss_fn(ddp(x).float(), x).backward()
        for p in params:
            p.grad = None
    d = ddp._get_ddp_logging_data()
    order = [int(i) for i in d["rebuilt_per_bucket_param_indices"].replace(",", " ").split()]
    out[name] = {"ready": [params[i].numel() for i in order],
                 "buckets": [int(b) for b in d["rebuilt_bucket_sizes"].split(",")]}
print(json.dumps(out))
"""

_CASES = {
    "llama-gqa": (LLAMA, {}),
    "gpt2-tied-learned-biases": (GPT2, {"bucket_cap_mb": 0.25}),
    "phi-shared-norm-head-bias": (PHI, {"bucket_cap_mb": 0.25}),
    "fused-qkv-pure-bf16": (LLAMA, {"qkv_impl": "fused", "precision": "bf16", "master_weights": False,
                                    "bucket_cap_mb": 0.1}),
    "wide-default-caps": (ModelSpec(name="w", hidden=512, layers=3, heads=8, ffn=2048, vocab=16000), {}),
    "lora-all-gqa": (LLAMA, {"lora_rank": 8, "lora_targets": "all", "bucket_cap_mb": 0.02}),
    "lora-qv-gelu-biases": (GPT2, {"lora_rank": 4, "lora_targets": "q,v,up", "bucket_cap_mb": 0.01}),
}


def case_run(name: str):
    model, kw = _CASES[name]
    return make(model, **{"precision": "fp32", "seq": 8, **kw})


def _buckets(run, elems):
    """The rebuild rule, written out: close a bucket once it holds at least its limit."""
    cap = comm.DDP_BUCKET_BYTES if run.training.bucket_cap_mb is None else int(run.training.bucket_cap_mb * 2**20)
    limit = comm.DDP_FIRST_BUCKET_BYTES if run.training.bucket_cap_mb is None else cap
    out, cur = [], 0
    for e in elems:
        cur += e * DTYPE_BYTES[run.recipe.grad_dtype]
        if cur >= limit:
            out, cur, limit = out + [cur], 0, cap
    return out + ([cur] if cur else [])


def test_ready_order_and_buckets_match_torch_ddp():
    """torch's own record of the rebuilt buckets (`_get_ddp_logging_data`: the parameters in the order their
    gradients became ready, and each bucket's bytes) equals memcalc's, tensor by tensor and bucket by bucket, and
    `collectives()` lists those buckets (the last one apart, not overlapped)."""
    pytest.importorskip("torch")
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", _PROBE, str(root), json.dumps(list(_CASES))], capture_output=True,
                         text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    measured = json.loads(res.stdout.strip().splitlines()[-1])
    for name, got in measured.items():
        run = case_run(name)
        elems = list(grad_ready_elems(run, 0))
        assert elems == got["ready"], name
        assert _buckets(run, elems) == got["buckets"], name
        colls = comm.collectives(run.replace(dp=2, gpus=2))
        assert colls[-1].bytes_per_call == got["buckets"][-1] and not colls[-1].overlapped, name
        listed = sorted(b for c in colls[:-1] for b in [c.bytes_per_call] * c.calls_per_step)
        assert listed == sorted(got["buckets"][:-1]), name
    assert len(measured["wide-default-caps"]["buckets"]) > 2  # the 1 MiB first bucket, then 25 MiB ones
