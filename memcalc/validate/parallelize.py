"""Parallel layouts with PyTorch's own APIs (the `torch` profile, DESIGN.md section 3):
DDP (zero 0), DDP + ZeroRedundancyOptimizer (zero 1), FSDP2 `fully_shard` per block with
`reshard_after_forward=False` (zero 2, ZeRO-2-like) or the default (zero 3), DTensor TP (ColwiseParallel /
RowwiseParallel) with SequenceParallel for SP, FSDP2 x TP on a 2-D mesh, `torch.distributed.pipelining`
(GPipe / 1F1B / interleaved 1F1B; under PP x TP each stage is TP-sharded, with FSDP2 over it when dp > 1), and
all-to-all context parallelism (`--cp-comm a2a`: DeepSpeed-Ulysses' exchange, written with torch.distributed in
memcalc/validate/model.py; torch's own ring `context_parallel` needs CUDA's SDPA kernels).
Rank placement follows `--order tp,cp,pp,dp` (tp innermost): the mesh is (dp x cp, pp, tp), row-major.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memcalc.specs import Run
from memcalc.validate.model import GPT, EagerRMSNorm, inner_block


class Unsupported(Exception):
    """A configuration the harness cannot build (one line, exit 2)."""


def check_supported(run: Run, world: str, device: str) -> None:
    m, t = run.model, run.training
    if run.profile != "torch":
        raise Unsupported(f"--profile {run.profile} cannot be run by the harness; only --profile torch is runnable")
    if m.moe is not None and (run.ep > 1 or run.tp > 1):
        raise Unsupported("mixture-of-experts models run in the harness without expert or tensor parallelism "
                          "(ep = tp = 1: Hugging Face's MixtralSparseMoeBlock over DDP / FSDP2 / pipelining)")
    if m.mla is not None and (run.tp > 1 or t.qkv_impl != "separate" or t.gqa_impl != "native"
                              or t.attention != "flash" or t.lora_rank is not None or run.dropout > 0):
        raise Unsupported("multi-head latent attention runs in the harness without tensor parallelism (tp = 1), "
                          "with --attention flash, no dropout and no LoRA (Hugging Face's DeepseekV3Attention)")
    if run.cp > 1:
        if run.cp_comm != "a2a":
            raise Unsupported("--cp-comm p2p (ring attention: torch context_parallel) needs CUDA's SDPA kernels and "
                              "is not built by the harness; valid here: --cp-comm a2a (Ulysses)")
        if run.tp > 1 or run.pp > 1 or t.qkv_impl != "separate" or t.gqa_impl != "native":
            raise Unsupported("--cp-comm a2a runs in the harness with data and context parallelism alone (tp = pp = "
                              "1) and separate, native-GQA Q/K/V")
    if run.offload != "none":
        raise Unsupported("--offload is not built by the harness")
    if t.precision == "fp8":
        raise Unsupported("--precision fp8 is not built by the harness; valid: fp32, bf16, fp16")
    if t.optimizer not in ("adam", "adamw", "sgd", "sgd-momentum"):
        raise Unsupported(f"--optimizer {t.optimizer} is not built by the harness; valid: adam, adamw, sgd, "
                          "sgd-momentum")
    if t.freeze or t.base_dtype in ("int8", "fp8"):
        raise Unsupported("--freeze and int8 / fp8 base weights are not built by the harness yet; LoRA and "
                          "--base-dtype nf4 are")
    if t.base_dtype == "nf4" and (run.recipe.compute_copy or run.zero >= 2):
        raise Unsupported("--base-dtype nf4 runs in the harness in pure compute-dtype training (--no-master-weights "
                          "or fp32) on one rank or with DDP")
    if t.base_dtype == "nf4" and (m.qkv_bias or m.linear_bias):
        raise Unsupported("--base-dtype nf4 runs in the harness on bias-free linears only (no --qkv-bias / --bias)")
    if t.lora_rank is not None and (run.tp > 1 or run.pp > 1 or run.zero >= 2 or run.cp > 1):
        raise Unsupported("LoRA runs in the harness on one rank or with DDP / ZeRO-1 (tp = pp = cp = 1, zero <= 1)")
    if t.qkv_impl == "fused" and run.tp > 1:
        raise Unsupported("--qkv-impl fused runs in the harness without tensor parallelism (tp = 1)")
    if run.dp_mode != "collective":
        raise Unsupported(f"--dp-mode {run.dp_mode} is not built by the harness; valid: collective")
    if run.schedule not in ("1f1b", "gpipe", "interleaved"):
        raise Unsupported(f"--schedule {run.schedule} is not built by the harness; valid: 1f1b, gpipe, "
                          "interleaved")
    if t.offload_activations and (run.pp > 1 or run.tp > 1):
        raise Unsupported("--offload-activations runs in the harness without pipeline or tensor parallelism "
                          "(pp = tp = 1)")
    if t.loss == "lit-gpt" and run.recipe.compute_copy:
        raise Unsupported("--loss lit-gpt runs in the harness in pure compute-dtype training (--no-master-weights "
                          "or fp32): CPU autocast does not upcast the cross-entropy as CUDA's does")
    if t.loss == "fused":
        raise Unsupported("--loss fused is TransformerEngine's Triton cross-entropy, which the harness does not "
                          "build; valid here: full, chunked, chunked-eager, lit-gpt")
    if t.loss != "full" and (run.pp > 1 or run.tp > 1):
        raise Unsupported(f"--loss {t.loss} runs in the harness without pipeline or tensor parallelism (pp = tp = 1)")
    if m.params_override is not None:
        raise Unsupported("--params N without a shape cannot be built; give --model or the dimensions")
    if run.order != ("tp", "cp", "pp", "dp"):
        raise Unsupported("the harness places ranks in the default order tp,cp,pp,dp only")
    if run.pp > 1:
        if run.schedule == "1f1b" and run.grad_accum < run.pp:
            raise Unsupported(f"--grad-accum {run.grad_accum} with --pp {run.pp}: torch's Schedule1F1B needs at least "
                              f"as many micro-batches as stages; valid here: --grad-accum {run.pp} or more, or "
                              "--schedule gpipe")
        if run.dp > 1 and run.zero < 2:
            raise Unsupported("--pp with --dp > 1 needs --zero 2 or 3 (FSDP2 per stage) in the harness")
        if world == "fake":
            raise Unsupported("--pp needs --world real (pipelining exchanges tensor metadata the fake group "
                              "cannot carry)")
    if run.tp > 1 and run.dp > 1 and run.zero < 2:
        raise Unsupported("--tp with --dp > 1 needs --zero 2 or 3 (FSDP2 x TP) in the harness")
    if device == "meta":
        if world != "fake":
            raise Unsupported("--device meta needs --world fake")
        if run.zero in (0, 1) and run.dp > 1:
            raise Unsupported("--device meta (fake tensors) does not run DDP or ZeroRedundancyOptimizer; use "
                              "--device cpu or --zero 2/3")
        if m.moe is not None:
            # the router's dispatch (`torch.where` on the one-hot mask) has data-dependent shapes, which fake
            # tensors cannot give
            raise Unsupported("--device meta (fake tensors) cannot route a mixture of experts (the dispatch's "
                              "shapes depend on the data); use --device cpu, with --layers N to keep it small")
    if run.recipe.master_weights and (run.zero == 1 or run.zero >= 2):
        raise Unsupported("a separate fp32 master copy (low-precision grads) with --zero >= 1 is not built by the "
                          "harness; use fp32 grads (FSDP2 MixedPrecisionPolicy) instead")


def mesh_coords(run: Run, rank: int) -> dict[str, int]:
    """A rank's coordinates under the order tp,cp,pp,dp (tp innermost)."""
    tp, cp, pp = run.tp, run.cp, run.pp
    return {"tp": rank % tp, "cp": (rank // tp) % cp, "pp": (rank // (tp * cp)) % pp, "dp": rank // (tp * cp * pp)}


def make_mesh(run: Run, device_type: str) -> Any:
    """(dp, pp, tp). With context parallelism (tp = pp = 1 here) the "dp" dimension holds dp x cp ranks: they all
    hold the same parameters and reduce (or shard) gradients together, as DeepSpeed's and torchtitan's dp x cp
    groups do; `cp_group` is the all-to-all group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (run.shard_degree, run.pp, run.tp), mesh_dim_names=("dp", "pp", "tp"))


def cp_group(run: Run) -> Any:
    """This rank's context-parallel group: cp consecutive ranks (tp = 1). Every rank creates every group."""
    import torch.distributed as dist

    if run.cp == 1:
        return None
    group, _ = dist.new_subgroups(group_size=run.cp)
    return group


def apply_ulysses(model: GPT, group: Any, cp_rank: int, seq_local: int) -> None:
    """All-to-all context parallelism: every attention exchanges Q, K, V and its output over `group`; this rank's
    tokens start at cp_rank x seq_local (rotary and learned positions)."""
    model.seq_offset = cp_rank * seq_local
    if model.embed is not None:
        model.embed.seq_offset = cp_rank * seq_local
    for blk in model.layers.values():
        inner_block(blk).attn.cp_group = group


def apply_tp(model: GPT, tp_mesh: Any, sp: bool, loss_parallel: bool) -> None:
    """Megatron-style TP: q/k/v, gate/up column-parallel, o/down row-parallel, vocab-parallel embedding and head
    (torchtitan's Llama plan). With SP the norms run on sequence shards and the block inputs are all-gathered.
    With `loss_parallel` the logits stay vocab-sharded (a DTensor) for `torch.distributed.tensor.parallel.
    loss_parallel` (torchtitan's default; Megatron's vocab-parallel cross-entropy), else they are all-gathered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top: dict[str, Any] = {}
    if model.embed is not None:
        top["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
        if sp:
            model.embed.seq_shard = (tp_mesh.get_local_rank(), tp_mesh.size())
    if sp:
        model.seq_shards = tp_mesh.size()
    if model.head is not None:
        if sp:
            top["head.norm"] = SequenceParallel()
        top["head.out"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                          output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                          use_local_output=not loss_parallel)
    tied = model.embed is not None and model.head is not None and model.head.out.weight is model.embed.tok.weight
    parallelize_module(model, tp_mesh, top)
    if tied:  # both styles shard the shared (V, h) weight on dim 0: tie the head to the embedding's DTensor again
        model.head.out.weight = model.embed.tok.weight
    for blk in model.layers.values():
        b = inner_block(blk)
        plan: dict[str, Any] = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        }
        if b.mlp.gated:
            plan["mlp.gate"] = ColwiseParallel()
        if sp:
            plan["norm1"] = SequenceParallel()
            if b.norm2 is not None:  # a parallel block's shared norm has none (model.Block)
                plan["norm2"] = SequenceParallel()
            if b.post_attn is not None:  # Gemma 2/3: the sequence-sharded outputs' norms, back to the local stream
                plan["post_attn"] = SequenceParallel(use_local_output=True)
                plan["post_mlp"] = SequenceParallel(use_local_output=True)
            # (x, rope): the rotary cos/sin are plain tensors shared by all layers (memcalc/validate/model.py)
            plan["attn"] = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(b, tp_mesh, plan)
    _replicate_rest(model, tp_mesh)


def _replicate_rest(model: nn.Module, tp_mesh: Any) -> None:
    """Parameters no TP style covers (norms without SP, learned positions) become replicated DTensors, so that
    a foreach optimizer never mixes DTensors and plain tensors; norms take and return local tensors."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def inp(mod: Any, inputs: Any, mesh: Any) -> Any:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def out(mod: Any, outputs: Any, mesh: Any) -> Any:
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    for mod in list(model.modules()):
        plain = [p for p in mod.parameters(recurse=False) if not isinstance(p, DTensor)]
        if not plain:
            continue
        if isinstance(mod, (nn.RMSNorm, nn.LayerNorm, EagerRMSNorm)):
            distribute_module(mod, tp_mesh, input_fn=inp, output_fn=out)
        else:  # read directly by the parent (learned positions)
            distribute_module(mod, tp_mesh)


def apply_fsdp(model: nn.Module, dp_mesh: Any, zero: int, mp: Any | None, pipelined: bool = False) -> None:
    """FSDP2: one unit per block, then the root (embedding, final norm, head). ZeRO-3 without pipelining keeps the
    last block gathered from its forward to its backward, which follows at once (torchtitan's default
    `reshard_after_forward_policy`)."""
    from torch.distributed.fsdp import fully_shard

    reshard = zero >= 3
    kw: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard}
    if mp is not None:
        kw["mp_policy"] = mp
    blocks = list(model.layers.values())
    for i, blk in enumerate(blocks):
        last = i == len(blocks) - 1 and not pipelined
        fully_shard(blk, **{**kw, "reshard_after_forward": reshard and not last})
    # the root with FSDP2's default (None): not resharded after forward, so not gathered again in backward
    fully_shard(model, **{**kw, "reshard_after_forward": None if reshard else False})


def fsdp_buffer_storages(model: nn.Module) -> list[torch.Tensor]:
    """The tensors whose storages FSDP2 resizes to hold unsharded parameters (the ZeRO-3 working set)."""
    out: list[torch.Tensor] = []
    for mod in model.modules():
        get_state = getattr(mod, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            group = get_state()._fsdp_param_group
        except Exception:  # noqa: BLE001
            continue
        if group is None:
            continue
        for fp in group.fsdp_params:
            for name in ("all_gather_outputs",):
                for t in getattr(fp, name, None) or []:
                    out.append(t)
            up = getattr(fp, "_unsharded_param", None)
            if up is not None:
                out.append(up)
    return out


def stage_starts(run: Run, n_stages: int) -> tuple[int, ...]:
    """The first layer of each of `n_stages` pipeline stages (model chunks), split as split_stage splits them."""
    from memcalc.cost.params import stage_layers

    starts, at = [], 0
    for s in range(n_stages):
        starts.append(at)
        at += int(stage_layers(run, s, n_stages))
    return tuple(starts)


def split_stage(model: GPT, stage: int, pp: int, run: Run) -> GPT:
    """Keep the layers of `stage` (split as the profile's framework splits them, memcalc/cost/params.py), the
    embedding on the first stage and the final norm + head on the last; a tied head gets its own copy."""
    starts = stage_starts(run, pp) + (run.model.layers,)
    keep = {str(i) for i in range(starts[stage], starts[stage + 1])}
    for name in [n for n in model.layers.keys() if n not in keep]:
        del model.layers[name]
    assert len(model.layers) == starts[stage + 1] - starts[stage]
    if stage != 0:
        if model.head is not None and run.model.tied_embeddings:
            model.head.out.weight = nn.Parameter(model.head.out.weight.detach().clone())
        model.embed = None
    if stage != pp - 1:
        model.head = None
    return model
