"""One rank: build, parallelize, run warm-up and measured steps under the Tracker, return a Measurement dict.

Runs inside a worker process (memcalc/validate/runner.py). Phases of a measured step: `forward` (each
micro-batch's forward and loss), `backward` (loss.backward()), `optimizer` (step + zero_grad(set_to_none=True));
under pipelining the schedule interleaves them and the whole schedule is one phase, `forward-backward`.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

from memcalc.specs import Run
from memcalc.validate.measure import COARSE, Tracker, replay, storage_key, summarize_collectives

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class MasterOptimizer:
    """Low-precision params with a separate fp32 master copy in the optimizer (apex O2 style): the optimizer
    steps the fp32 masters on fp32 copies of the grads, then copies the result back into the params."""

    def __init__(self, params: list[torch.Tensor], make: Any):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float() for p in self.params]
        for m in self.masters:
            m.requires_grad_(True)
        self.optim = make(self.masters)
        self.state = self.optim.state

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.optim.step()
        for p, m in zip(self.params, self.masters):
            p.data.copy_(m.data)
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _impl_kwargs(impl: str) -> dict[str, Any]:
    """torch.optim's own switches for memcalc's --optimizer-impl."""
    return {"foreach": impl == "foreach", "fused": True if impl == "fused" else None}


def _make_optimizer(run: Run, impl: str) -> Any:
    cls, kw = _optimizer_class_kwargs(run, impl)
    return lambda params: cls(params, **kw)


def _optimizer_class_kwargs(run: Run, impl: str) -> tuple[Any, dict[str, Any]]:
    opt = run.training.optimizer
    if opt in ("adam", "adamw"):
        return (torch.optim.AdamW if opt == "adamw" else torch.optim.Adam), {"lr": 1e-4, **_impl_kwargs(impl)}
    return torch.optim.SGD, {"lr": 1e-4, "momentum": 0.9 if opt == "sgd-momentum" else 0.0, **_impl_kwargs(impl)}


def _fake_allreduce_hook(group, bucket):  # noqa: ANN001 - DDP rejects a `bucket` annotation other than GradBucket
    """DDP's default hook reads the result of the all-reduce future, which the fake group leaves empty: issue
    the same all-reduce synchronously and hand back the bucket."""
    import torch.distributed as dist

    buf = bucket.buffer()
    dist.all_reduce(buf, group=group)
    fut: Any = torch.futures.Future()
    fut.set_result(buf)
    return fut


@contextlib.contextmanager
def _precomputed_mesh_concat(mesh: Any, enabled: bool) -> Any:
    """FSDP2 x TP concatenates the dp and tp meshes inside the fake-tensor region, where DeviceMesh's coordinate
    lookup (nonzero) cannot run: build that mesh beforehand and hand it out."""
    from torch.distributed.device_mesh import DeviceMesh

    if not enabled:
        yield
        return
    orig = DeviceMesh.__dict__["_concatenate"]
    fn = orig.__func__
    cached = fn([mesh["dp"], mesh["tp"]])

    def patched(meshes: Any) -> Any:
        names = tuple(n for m in meshes for n in (m.mesh_dim_names or ()))
        return cached if names == ("dp", "tp") else fn(meshes)

    DeviceMesh._concatenate = staticmethod(patched)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._concatenate = orig  # type: ignore[method-assign]


@contextlib.contextmanager
def _untracked_gloo_reduce_scatter(tracker: Any, enabled: bool) -> Any:
    """gloo's reduce-scatter works on an internal full-size copy of its input, which it then splits (the split
    is dispatched, so the tracker would count the copy); NCCL reduce-scatters in place. Not counted: the harness
    measures what a GPU run holds. The collective itself is still counted."""
    if not enabled:
        yield
        return
    import torch.distributed as dist

    orig = dist.reduce_scatter_single

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with tracker.paused():
            return orig(*args, **kwargs)

    dist.reduce_scatter_single = wrapped
    try:
        yield
    finally:
        dist.reduce_scatter_single = orig


def run_rank(run: Run, rank: int, world_size: int, device: str, steps: int, warmup: int,
             fake_world: bool, seq_lengths: tuple[int, ...] | None = None) -> dict[str, Any]:
    """`seq_lengths`: the length of each micro-batch in turn, warm-up included (batches padded to their longest
    sample, as a dynamic-padding collate makes them; api.resolve_seq_lengths); None: every micro-batch is --seq
    tokens long."""
    import torch.distributed as dist

    from memcalc.cost.activations import LITGPT_CHUNK_TOKENS, LOSS_CHUNKS, loop_holds_graph
    from memcalc.validate.model import GPT, RMSNorm, cast_params, chunked_loss_fn, loss_fn
    from memcalc.validate.parallelize import (
        apply_fsdp,
        apply_tp,
        apply_ulysses,
        cp_group,
        fsdp_buffer_storages,
        make_mesh,
        mesh_coords,
        split_stage,
        stage_starts,
    )

    t0 = time.perf_counter()
    torch.manual_seed(0)
    meta = device == "meta"
    dev_type = "cuda" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(0 if fake_world else rank)
    torch_device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    mesh = make_mesh(run, dev_type)
    cp_pg = cp_group(run)
    coords = mesh_coords(run, rank)
    recipe = run.recipe
    m, t = run.model, run.training
    compute_dtype = DTYPES[recipe.compute_dtype]
    param_dtype = DTYPES[recipe.param_dtype]
    # FSDP2 only where the shard group has more than one rank (torchtitan; memcalc/cost/buffers.py)
    replicas = run.shard_degree  # dp x cp ranks hold the same parameters (the "dp" mesh dimension)
    fsdp = run.zero >= 2 and replicas > 1
    tracker = Tracker()
    tracker.cuda_streams = device == "cuda"
    compute_stream = tracker._stream()
    diag = device == "cuda" and os.environ.get("MEMCALC_CUDA_DIAG") == "1"
    if diag:
        tracker.ptrs = {}
        tracker.scratch = {}
    labels: dict[str, str] = {}
    for dim in ("dp", "pp", "tp"):
        try:
            labels[mesh.get_group(dim).group_name] = dim
        except Exception:  # noqa: BLE001
            pass
    if cp_pg is not None:
        labels[cp_pg.group_name] = "cp"
    world_name = dist.group.WORLD.group_name
    labels.setdefault(world_name, "dp" if replicas == world_size else "world")
    tracker.group_labels = labels

    fake_mode: Any = contextlib.nullcontext()
    if meta:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    cuda_phases: dict[str, dict[str, int]] = {}

    gloo = not fake_world and dist.get_backend() == "gloo"
    tracker.watch_late_frees = gloo
    with _precomputed_mesh_concat(mesh, meta and fsdp and run.tp > 1), fake_mode, tracker, \
            _untracked_gloo_reduce_scatter(tracker, gloo):
        def new_gpt() -> Any:
            with torch.device(torch_device):
                gpt = GPT(m, kernel=t.attention, dropout=run.dropout, recompute=t.recompute,
                          recompute_layers=t.recompute_layers, norm_impl=t.norm_impl, qkv_impl=t.qkv_impl,
                          gqa_impl=t.gqa_impl, loss_chunks=LOSS_CHUNKS if t.loss in ("chunked", "chunked-eager")
                          else 0, loss_chunk_size=LITGPT_CHUNK_TOKENS if t.loss == "lit-gpt" else 0,
                          unit_starts=stage_starts(run, run.pp * run.vpp) if run.pp > 1 else (0,),
                          recompute_every=t.recompute_every)
            for mod in gpt.modules():
                if isinstance(mod, RMSNorm):  # a fused kernel's intermediates are not allocations (_FusedRMSNorm)
                    mod.untracked = tracker.paused
            if t.rope_cache_positions:
                # the model code's rotary table(s) (--rope-cache): held, never read here (the harness computes
                # cos/sin per forward). Plain attributes, not buffers: DDP would broadcast buffers every forward.
                shape = (t.rope_cache_positions, gpt.head_dim // 2, 2)
                for owner in (gpt.layers.values() if t.rope_cache_per_layer else [gpt]):
                    owner.rope_cache = torch.zeros(shape, dtype=torch.float32, device=torch_device)
            return gpt

        model = new_gpt()
        if param_dtype != torch.float32:
            cast_params(model, param_dtype)
        if t.lora_rank is not None:
            from memcalc.validate.model import apply_lora

            quantized = t.base_dtype == "nf4"
            apply_lora(model, t.lora_targets, t.lora_rank,
                       compute_dtype if quantized else DTYPES[t.base_dtype or recipe.compute_dtype],
                       t.lora_dropout, param_dtype)
            if quantized:
                from memcalc.validate.quant import quantize_base

                for q in quantize_base(model, compute_dtype, t.double_quant, t.quant_backend, t.quantize_head):
                    q.untracked = tracker.paused
        chunks: list[Any] = []
        if run.pp > 1 and run.vpp > 1:
            # interleaved 1F1B: this rank holds the global stages pp_rank + k*pp, k < vpp (torchtitan's
            # "loop" stage placement), each a model chunk of L/(pp*vpp) layers, built one after the other
            n_stages = run.pp * run.vpp
            chunks = [split_stage(model, coords["pp"], n_stages, run)]
            for k in range(1, run.vpp):
                full = new_gpt()
                if param_dtype != torch.float32:
                    cast_params(full, param_dtype)
                chunks.append(split_stage(full, coords["pp"] + k * run.pp, n_stages, run))
                del full
            model = torch.nn.ModuleList(chunks)
        elif run.pp > 1:
            model = split_stage(model, coords["pp"], run.pp, run)
        ddp_model = model
        # vocab-parallel loss under TP (torchtitan's default, Megatron's cross-entropy), pipelined or not
        vocab_parallel_loss = run.tp > 1
        # (interleaved: each model chunk is parallelized on its own, as torchtitan does each model part)
        parts = chunks or [model]
        if run.tp > 1:
            for part in parts:
                apply_tp(part, mesh["tp"], run.sp, loss_parallel=vocab_parallel_loss)
        if fsdp:
            mp = None
            if recipe.compute_copy:
                from torch.distributed.fsdp import MixedPrecisionPolicy

                mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
            for part in parts:
                apply_fsdp(part, mesh["dp"], run.zero, mp, pipelined=run.pp > 1)
        elif replicas > 1 and run.pp == 1 and run.tp == 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            kw: dict[str, Any] = {}
            if t.bucket_cap_mb is not None:
                kw["bucket_cap_mb"] = t.bucket_cap_mb
            if t.gradient_as_bucket_view is not None:
                kw["gradient_as_bucket_view"] = t.gradient_as_bucket_view
            ddp_model = DDP(model, process_group=mesh.get_group("dp"), **kw)
            if fake_world:
                ddp_model.register_comm_hook(mesh.get_group("dp"), _fake_allreduce_hook)
        autocast = recipe.compute_copy and not fsdp
        impl = recipe.optimizer_impl
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
        if recipe.master_weights:
            optim: Any = MasterOptimizer(trainable, _make_optimizer(run, impl))
        elif run.zero == 1 and replicas > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            cls, kw = _optimizer_class_kwargs(run, impl)
            optim = ZeroRedundancyOptimizer(trainable, optimizer_class=cls,
                                            process_group=mesh.get_group("dp"), **kw)
        else:
            optim = _make_optimizer(run, impl)(trainable)
        offload = None
        if t.offload_activations:
            from memcalc.validate.offload import BlockOffload

            offload = BlockOffload(list(model.layers.values()), tracker, torch_device)
        params = [p for p in model.parameters()]
        tracker.param_storages = {k for k in (storage_key(p) for p in params) if k is not None}

        b, s, ga, V = run.micro_batch, run.seq, int(run.grad_accum), m.vocab
        g = torch.Generator(device="cpu").manual_seed(1234 + coords["dp"])
        tokens = torch.randint(0, V, (ga, b, s), generator=g)
        targets = torch.randint(0, V, (ga, b, s), generator=g)
        if cp_pg is not None:  # this rank's part of each sequence (contiguous chunks, causal attention unchanged)
            s_loc = s // run.cp
            apply_ulysses(model, cp_pg, coords["cp"], s_loc)
            tokens = tokens[..., coords["cp"] * s_loc:(coords["cp"] + 1) * s_loc].contiguous()
            targets = targets[..., coords["cp"] * s_loc:(coords["cp"] + 1) * s_loc].contiguous()
        tokens, targets = tokens.to(torch_device), targets.to(torch_device)

        schedule = None
        if run.pp > 1:
            from torch.distributed.pipelining import (
                PipelineStage,
                Schedule1F1B,
                ScheduleGPipe,
                ScheduleInterleaved1F1B,
            )

            pp_group = mesh.get_group("pp")
            if chunks:
                n_stages = run.pp * run.vpp
                stages = [PipelineStage(c, coords["pp"] + k * run.pp, n_stages, torch_device, group=pp_group)
                          for k, c in enumerate(chunks)]
            else:
                stage = PipelineStage(model, coords["pp"], run.pp, torch_device, group=pp_group)

            def pp_loss(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
                return loss_fn(logits, tgt) / ga

            if chunks:
                schedule = ScheduleInterleaved1F1B(stages, n_microbatches=ga, loss_fn=pp_loss)
            else:
                cls = ScheduleGPipe if run.schedule == "gpipe" else Schedule1F1B
                schedule = cls(stage, n_microbatches=ga, loss_fn=pp_loss)
            pp_tokens = tokens.flatten(0, 1)
            pp_targets = targets.flatten(0, 1)

        def amp() -> Any:
            if autocast:
                return torch.autocast(dev_type, dtype=compute_dtype)
            return contextlib.nullcontext()

        def loss_ctx() -> Any:
            if vocab_parallel_loss:
                from torch.distributed.tensor.parallel import loss_parallel

                return loss_parallel()
            return contextlib.nullcontext()

        def cuda_mark(name: str, start: bool) -> None:
            # torch.cuda.max_memory_allocated / max_memory_reserved per phase of the measured steps (the peak is
            # reset when a phase starts; the reserved pool keeps what the warm-up steps reserved, as training does)
            if device != "cuda" or not tracker.counting:
                return
            if start:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            else:
                torch.cuda.synchronize()
                ph = cuda_phases.setdefault(name, {"max_allocated": 0, "max_reserved": 0})
                ph["max_allocated"] = max(ph["max_allocated"], torch.cuda.max_memory_allocated())
                ph["max_reserved"] = max(ph["max_reserved"], torch.cuda.max_memory_reserved())

        cuda_setup: dict[str, int] = {}
        if device == "cuda":
            # what building the model left in the caching allocator (the harness initialises in fp32 and casts):
            # recorded, then returned, so that the reserved figures describe training alone
            torch.cuda.synchronize()
            cuda_setup = {"max_allocated": torch.cuda.max_memory_allocated(),
                          "max_reserved": torch.cuda.max_memory_reserved(),
                          "allocated": torch.cuda.memory_allocated()}
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        cuda_diag: dict[str, Any] = {}
        if diag:  # from the first warm-up step on: persistent blocks get their allocating frames too
            torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        start_mark = 0
        grad_keys: set[int] = set()  # every measured step's gradients (labels for the phase breakdown)
        step_grad_keys: set[int] = set()
        holds_graph = loop_holds_graph(run)
        held_loss: Any = None
        for step in range(warmup + steps):
            measuring = step >= warmup
            pre = "" if measuring else "w-"
            if measuring and step == warmup:
                start_mark = len(tracker.marks)
                tracker.counting = True
            if schedule is not None:
                tracker.set_phase(pre + "forward-backward")
                cuda_mark("forward-backward", True)
                first, last = coords["pp"] == 0, coords["pp"] == run.pp - 1
                with amp(), loss_ctx():
                    if first:
                        schedule.step(pp_tokens, return_outputs=False)
                    elif last:
                        losses: list[Any] = []
                        schedule.step(target=pp_targets, losses=losses, return_outputs=False)
                        del losses
                    else:
                        schedule.step(return_outputs=False)
                cuda_mark("forward-backward", False)
            else:
                for mb in range(ga):
                    sync = contextlib.nullcontext()
                    if ddp_model is not model and mb < ga - 1:
                        sync = ddp_model.no_sync()
                    with sync:
                        tracker.set_phase(pre + "forward")
                        cuda_mark("forward", True)
                        mb_tokens, mb_targets = tokens[mb], targets[mb]
                        if seq_lengths:
                            # this micro-batch padded to its own longest sample: fresh tensors of its length, as
                            # a loop's `input_ids.to(device)` makes them (the previous ones are freed here)
                            n_mb = seq_lengths[(step * ga + mb) % len(seq_lengths)]
                            mb_tokens = tokens[mb][:, :n_mb].contiguous()
                            mb_targets = targets[mb][:, :n_mb].contiguous()
                        with amp(), loss_ctx():
                            with offload.forward() if offload else contextlib.nullcontext():
                                out = ddp_model(mb_tokens)
                            if t.keep_logits == "fp32":
                                # torchtune 0.1's model returns `self.output(h).float()`; Lightning Fabric's
                                # bf16-true precision upcasts each chunk of lit-gpt's list (`convert_output`)
                                out = [o.float() for o in out] if isinstance(out, list) else out.float()
                            # the loop's `logits = model(...)` replaces the previous micro-batch's logits now
                            kept_logits = None
                            if t.loss == "full":
                                loss = loss_fn(out, mb_targets) / ga
                            else:
                                loss = chunked_loss_fn(out, mb_targets, t.loss, tracker.paused) / ga
                            # and its `loss = ...` the previous loss, and with it the previous graph
                            held_loss = None
                            if t.loss == "lit-gpt" or t.keep_logits != "none":
                                kept_logits = out  # referenced by the loop through backward and the step
                            del out  # torchtune's recipes `del logits` before backward
                        cuda_mark("forward", False)
                        if diag and measuring and mb == ga - 1:
                            from memcalc.validate.measure import cuda_diagnosis

                            cuda_diag["forward_end"] = cuda_diagnosis(tracker)
                        tracker.set_phase(pre + "backward")
                        cuda_mark("backward", True)
                        with loss_ctx():
                            loss.backward()
                        if holds_graph:
                            held_loss = loss  # the loop's `loss`: alive until the next one replaces it
                        del loss
                        cuda_mark("backward", False)
            if measuring:
                step_grad_keys = set()  # this step's gradients (set_to_none: each step allocates new ones)
                for p in params:
                    if p.grad is not None:
                        k = storage_key(p.grad)
                        if k is not None and k in tracker.uid:
                            step_grad_keys.add(tracker.uid[k])
                grad_keys |= step_grad_keys
            tracker.set_phase(pre + "optimizer")
            cuda_mark("optimizer", True)
            optim.step()
            optim.zero_grad(set_to_none=True)
            cuda_mark("optimizer", False)
            if diag and measuring:
                from memcalc.validate.measure import cuda_diagnosis

                cuda_diag["step_end"] = cuda_diagnosis(tracker)
            tracker.set_phase(pre + "idle")
        tracker.counting = False

        # categories of the storages that are states
        cats: dict[int, str] = {}

        def label(ts: Any, cat: str) -> None:
            for x in ts:
                if isinstance(x, torch.Tensor):
                    u = tracker.uid_of(x)
                    if u is not None:
                        cats.setdefault(u, cat)

        label(params, "params")
        if offload is not None:
            for u in offload.reloaded_uids:
                cats.setdefault(u, "activations")
        for u in grad_keys:
            cats.setdefault(u, "grads")
        inner = getattr(optim, "optim", optim)
        if isinstance(optim, MasterOptimizer):
            label(optim.masters, "master_weights")
        for st in inner.state.values():
            # torch.optim keeps a 4-byte `step` tensor per parameter; on CUDA it lives on the host (not
            # capturable/fused), so it is not device optimizer state: count it with the persistent buffers
            label([v for k, v in st.items() if k != "step"], "optimizer")
            label([v for k, v in st.items() if k == "step"], "persistent_buffers")
        if fsdp:
            label(fsdp_buffer_storages(model), "sharded_buffers")
        phases = replay(tracker, cats, start_mark)
    from memcalc.cost.buffers import blas_workspace_bytes
    from memcalc.validate.allocator import replay_log

    # the caching allocator replayed over the log, per stream, with cuBLAS's two workspaces (first forward and
    # first backward matmul): the reserved memory a GPU shows for these allocations (memcalc/validate/allocator.py)
    workspaces = {"forward": blas_workspace_bytes(run.hardware), "backward": blas_workspace_bytes(run.hardware)}
    allocator_replay = replay_log(tracker.events, tracker.marks, workspaces, tracker.streams, compute_stream)
    # the same log under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (allocator.ExpandableAllocator)
    allocator_replay["expandable_reserved_peak_bytes"] = replay_log(
        tracker.events, tracker.marks, workspaces, tracker.streams, compute_stream,
        expandable=True)["reserved_peak_bytes"]

    param_elems = sum((p._local_tensor if hasattr(p, "_local_tensor") else p).numel() for p in params)
    state_bytes = {"params": 0, "master_weights": 0, "grads": 0, "optimizer": 0}
    # model states measured directly (bytes of the storages labelled above, at their largest)
    sizes_by_uid: dict[int, int] = {}
    cur: dict[int, int] = {}
    for uid, d in tracker.events:
        cur[uid] = cur.get(uid, 0) + d
        if cur[uid] > sizes_by_uid.get(uid, 0):
            sizes_by_uid[uid] = cur[uid]
    for uid, cat in cats.items():
        # the gradients of one step (the last): earlier steps' were other storages of the same sizes
        if cat in state_bytes and (cat != "grads" or uid in step_grad_keys):
            state_bytes[cat] += sizes_by_uid.get(uid, 0)
    out_phases = {}
    for name, ph in phases.items():
        if name in ("idle",):
            continue
        coarse: dict[str, int] = {}
        for k, v in ph["live"].items():
            coarse[COARSE[k]] = coarse.get(COARSE[k], 0) + v
        out_phases[name] = {"peak_bytes": int(ph["peak"]), "live": coarse, "detail": ph["live"],
                            "late_free_bytes": int(ph["late_free_bytes"])}
    peak_name = max(out_phases, key=lambda n: out_phases[n]["peak_bytes"])
    return {
        "rank": rank,
        "coords": coords,
        "stage": coords["pp"],
        "device": device,
        "world": "fake" if fake_world else "real",
        "world_size": world_size,
        "torch_version": torch.__version__,
        "steps": steps,
        "warmup": warmup,
        "param_elements": int(param_elems),
        "model_states": state_bytes,
        "phases": out_phases,
        "peak_bytes": out_phases[peak_name]["peak_bytes"],
        "peak_phase": peak_name,
        "components": out_phases[peak_name]["live"],
        "components_detail": out_phases[peak_name]["detail"],
        # gloo's worker thread still held these bytes at a phase's peak (measure.Tracker.late_frees): a peak
        # that may be that thread's lag, not the program's (api.validate measures such a run once more)
        "late_free_bytes": max(ph["late_free_bytes"] for ph in out_phases.values()),
        "collectives": summarize_collectives(tracker.collectives, steps),
        # activation offloading's copies per step: {way: {calls, bytes}} (one copy per saved storage)
        "host_copies": ({way: {"calls": c // steps, "bytes": b // steps} for way, (c, b) in offload.copied.items()}
                        if offload is not None else {}),
        "cuda": cuda_phases,
        "cuda_setup": cuda_setup,
        "allocator_replay": allocator_replay,
        "cuda_diag": cuda_diag,
        "seconds": time.perf_counter() - t0,
    }
