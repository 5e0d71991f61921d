"""What would make a configuration fit: re-run the cost model with one change at a time and report the bytes
each saves. Changes are listed cheapest first by their usual throughput cost (a higher ZeRO stage or a smaller
micro-batch costs little, a fused optimizer step nothing; recompute costs about a third more compute for full, a
4-bit base its dequantization; offload and more GPUs cost the most); every figure is computed, none is a rule of
thumb. Each change's flags are the command line that reproduces it (tests/test_advice.py). Where no single change
fits, or only a costlier one does, `combine` stacks the cheapest changes on the same GPUs until the peak fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from memcalc.specs import QUANTIZED, Run, _recipe, a2a_cp_limit

Change = tuple[str, str, Callable[[Run], Run]]

MIN_SAVING_BYTES = 64 * 2**20


def _accum(run: Run, factor: int) -> str:
    """The flag that keeps the global batch when a change divides the sequences per step by `factor`: none where
    --global-batch was given (the accumulation follows from it), else --grad-accum times `factor`."""
    return "" if run.training.global_batch is not None else f" --grad-accum {run.grad_accum * factor}"


def _micro_batch_change(before: int, after: int) -> str:
    """How a smaller micro-batch reads, relative to `before` sequences per micro-batch."""
    return (f"micro-batch {after} (x{before // after} accumulation"
            + (", same global batch)" if before % after == 0 else ")"))


def _candidates(run: Run) -> Iterator[Change]:
    t = run.training
    if run.zero < 3 and run.offload == "none":
        z = run.zero + 1
        yield (f"ZeRO stage {z}", f"--zero {z}", lambda r: r.replace(zero=z))
    if run.micro_batch > 1:
        mb = run.micro_batch // 2
        yield (
            _micro_batch_change(run.micro_batch, mb),
            f"--micro-batch {mb}" + _accum(run, run.micro_batch // mb),
            lambda r: r.replace(micro_batch=mb, grad_accum=r.grad_accum * (r.micro_batch // mb)),
        )
    drop = " --keep-logits none" if t.keep_logits != "none" else ""
    if drop and t.loss == "lit-gpt":
        # lit-gpt's loop keeps the logits whatever: only Fabric's fp32 upcast of them can go (the model's output
        # kept in the compute dtype, e.g. converted back before the loss)
        yield ("the loop keeps the logits in the compute dtype, not upcast", drop.strip(),
               lambda r: r.replace(training=r.training.model_copy(update={"keep_logits": "none"})))
        drop = ""
    elif drop:
        # the loop's `logits` reference, deleted before backward (`del logits`, as torchtune's recipes now do), and
        # no `loss` kept past backward (a bitsandbytes graph's held inputs go with it: `graph_held_layer_bytes`)
        yield ("the loop drops its logits before backward and its loss after (del logits, loss)", drop.strip(),
               lambda r: r.replace(training=r.training.model_copy(update={"keep_logits": "none"})))
    if t.loss in ("full", "chunked-eager") and not run.model.final_logit_softcap:
        # a compiled chunked cross-entropy (torchtune CEWithChunkedOutputLoss + compile) keeps the compute-dtype
        # logits instead of their fp32 log-softmax: no extra compute (not offered where the model's own forward
        # softcaps the logits, which only --loss full models: resolve() refuses the pair)
        yield ("chunked cross-entropy, compiled", "--loss chunked" + drop,
               lambda r: r.replace(training=r.training.model_copy(update={"loss": "chunked",
                                                                          "keep_logits": "none"})))
    if run.recipe.optimizer_impl == "foreach" and t.optimizer in ("adam", "adamw", "sgd", "sgd-momentum"):
        # torch.optim's fused=True (Adam, AdamW, SGD) steps in place: none of foreach's parameter-sized
        # temporaries, and no slower
        def fused(r: Run) -> Run:
            t2 = r.training.model_copy(update={"optimizer_impl": "fused", "foreach": None})
            return r.replace(training=t2, recipe=_recipe(r.profile, t2))  # the recipe as resolve() derives it

        yield ("fused optimizer step (torch fused=True)", "--optimizer-impl fused", fused)
    if t.attention == "eager":
        # a fused attention kernel keeps no s x s tensor, only its log-sum-exp (Dao et al. 2022), and is faster;
        # softcapped scores (Gemma 2) need flash-attn >= 2.6, which caps inside the kernel
        kernel = "flash-attn >= 2.6, which softcaps in the kernel" if run.model.attn_softcap else "SDPA / flash-attn"
        yield (f"fused attention kernel ({kernel})", "--attention flash",
               lambda r: r.replace(training=r.training.model_copy(update={"attention": "flash"})))
    if t.recompute == "none":
        yield ("selective recompute", "--recompute selective",
               lambda r: r.replace(training=r.training.model_copy(update={"recompute": "selective"})))
    m = run.model
    tp2 = run.tp * 2
    a2a_ok = run.cp_comm != "a2a" or (m.heads % tp2 == 0 and a2a_cp_limit(m, tp2) % run.cp == 0)
    # halving dp keeps a valid layout only where ep still divides dp*cp (resolve()'s rule for expert parallelism)
    halve_dp = run.dp % 2 == 0 and (run.dp // 2 * run.cp) % run.ep == 0
    if (m.heads % tp2 == 0 and m.kv_heads % tp2 == 0 and tp2 <= run.hardware.gpus_per_node and halve_dp
            and a2a_ok):
        # with SP where the profile has it. The flag is stated either way: at tp 1 the run's own --sp/--no-sp
        # is moot (resolve() keeps sp only with tp > 1), but it would decide the re-run of these flags
        sp = run.profile != "deepspeed" or run.sp
        yield (f"tensor parallel {tp2}" + (" with SP" if sp else ""),
               f"--tp {tp2}" + (" --sp" if sp else " --no-sp") + _accum(run, 2),
               lambda r: r.replace(tp=tp2, dp=r.dp // 2, sp=sp, grad_accum=r.grad_accum * 2,
                                   global_batch=r.global_batch))
    if t.recompute != "full":
        # every layer: where the run named --recompute-layers K, the flags must override it (K = all its layers)
        every = "" if t.recompute_layers is None else f" --recompute-layers {m.layers}"
        yield ("full recompute", "--recompute full" + every,
               lambda r: r.replace(training=r.training.model_copy(update={"recompute": "full",
                                                                          "recompute_layers": None})))
    if t.lora_rank is not None and t.base_dtype not in QUANTIZED:
        # QLoRA (Dettmers et al. 2023): the frozen base in 4-bit NF4, dequantized around each matmul
        yield ("4-bit NF4 base (QLoRA)", "--base-dtype nf4",
               lambda r: r.replace(training=r.training.model_copy(update={"base_dtype": "nf4"})))
    pp2 = run.pp * 2
    if pp2 <= m.layers and halve_dp and run.vpp == 1:
        yield (f"pipeline parallel {pp2}", f"--pp {pp2}" + _accum(run, 2),
               lambda r: r.replace(pp=pp2, dp=r.dp // 2, grad_accum=r.grad_accum * 2))
    if t.allocator == "default":
        # an environment variable: the caching allocator maps pages into growing segments instead of cutting fixed
        # ones (cost/fragmentation.py), at no cost in compute
        yield ("expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)", "--allocator expandable",
               lambda r: r.replace(training=r.training.model_copy(update={"allocator": "expandable"})))
    if not t.offload_activations and m.layers > 2:
        yield ("activation offloading to host memory", "--offload-activations",
               lambda r: r.replace(training=r.training.model_copy(update={"offload_activations": True})))
    if run.offload == "none" and run.zero >= 1:
        yield ("optimizer offload to CPU", "--offload optimizer", lambda r: r.replace(offload="optimizer"))
    if run.gpus == 1 and run.offload == "none":
        # one GPU has nothing to shard with: a second one only helps with the states sharded (FSDP / ZeRO-3)
        yield ("2 GPUs, states sharded (ZeRO-3 / FSDP)", "--gpus 2 --zero 3",
               lambda r: r.replace(gpus=2, dp=2, zero=3, global_batch=r.global_batch * 2))
    else:
        yield (f"twice the GPUs ({run.gpus * 2})", f"--gpus {run.gpus * 2}",
               lambda r: r.replace(gpus=r.gpus * 2, dp=r.dp * 2, global_batch=r.global_batch * 2))


def _merge_flags(first: str, then: str) -> str:
    """Two changes' flags as one command line: a flag given by both keeps the later value (every value a change
    prints is absolute, computed from the run it changed, e.g. `--grad-accum`)."""
    out: dict[str, str] = {}
    for flags in (first, then):
        toks = flags.split()
        for i, tok in enumerate(toks):
            if tok.startswith("--"):
                nxt = toks[i + 1] if i + 1 < len(toks) else ""
                out.pop(tok, None)  # keep the order in which flags were last set
                out[tok] = "" if nxt.startswith("--") else nxt
    return " ".join(f"{k} {v}".strip() for k, v in out.items())


def combine(run: Run, peak: int, max_changes: int = 6) -> tuple[str, str, Run, int] | None:
    """The cheapest changes stacked until the peak fits, on the same GPUs: each round applies the first candidate,
    in `_candidates`' cost order, that lowers the current peak by at least 1% (more GPUs is never one: it changes
    the cluster). Returns (what, flags, changed run, its peak), or None if `max_changes` rounds do not fit; a
    search over every layout is `memcalc plan`'s job, this is the shortest path along the advice's own order."""
    from memcalc.cost.estimate import peak_bytes

    capacity = run.hardware.memory_bytes
    cur, cur_peak, flags = run, peak, ""
    names: list[tuple[str, set[str]]] = []  # each change taken, with the flags it sets
    for _ in range(max_changes):
        for desc, f, change in _candidates(cur):
            if f.startswith("--gpus"):
                continue
            try:
                changed = change(cur)
                after = peak_bytes(changed)
            except (ValueError, ZeroDivisionError):
                continue
            if cur_peak - after >= max(MIN_SAVING_BYTES, cur_peak // 100):
                cur, cur_peak, flags = changed, after, _merge_flags(flags, f)
                # a later change that sets every flag of an earlier one supersedes it (ZeRO 2, then 3)
                mine = {tok for tok in f.split() if tok.startswith("--")} - {"--grad-accum"}
                if "--micro-batch" in mine:  # relative to the run's own micro-batch, not the last halving's
                    desc = _micro_batch_change(run.micro_batch, int(cur.micro_batch))
                names = [(d, fl) for d, fl in names if not fl <= mine] + [(desc, mine)]
                break
        else:
            return None  # nothing left that helps
        if cur_peak <= capacity:
            return " + ".join(d for d, _ in names), flags, cur, cur_peak
    return None


def tokens_per_second_per_gpu(run: Run) -> float:
    """The time model's throughput per GPU (0.0 where the GPU's peak FLOP/s is unknown)."""
    from memcalc.cost.compute import peak_flops_per_gpu, tokens_per_second

    return float(tokens_per_second(run)) / run.gpus if peak_flops_per_gpu(run) > 0 else 0.0


def advise_combined(run: Run, peak: int, singles: list) -> Any:
    """The stacked changes (`combine`) as one Advice where the peak does not fit and they beat every single change
    that fits on throughput (or none fits); else None."""
    from memcalc.cost.estimate import Advice

    if peak <= run.hardware.memory_bytes:
        return None
    found = combine(run, peak)
    if found is None:
        return None
    what, flags, changed, after = found
    if any(a.flags == flags for a in singles):
        return None  # one of the single changes already
    tps = tokens_per_second_per_gpu(changed)
    if any(a.fits_after and a.tokens_per_second_per_gpu_after >= tps for a in singles):
        return None
    return Advice(change=what, flags=flags, saves_bytes=peak - after, peak_bytes_after=after, fits_after=True,
                  tokens_per_second_per_gpu_after=tps)


def advise(run: Run, peak: int, limit: int = 3) -> list:
    """Up to `limit` single changes that reduce the worst stage's peak, those that make it fit first; each with
    its peak and its throughput per GPU after the change, both from re-running the model."""
    from memcalc.cost.estimate import Advice, peak_bytes

    capacity = run.hardware.memory_bytes
    fits_now = peak <= capacity
    out: list[Advice] = []
    for desc, flags, change in _candidates(run):
        try:
            changed = change(run)
            after = peak_bytes(changed)
        except (ValueError, ZeroDivisionError):
            continue
        if peak - after < max(MIN_SAVING_BYTES, peak // 100):
            continue  # not worth suggesting: under 1% of the peak (or 64 MiB)
        out.append(Advice(change=desc, flags=flags, saves_bytes=peak - after, peak_bytes_after=after,
                          fits_after=after <= capacity, tokens_per_second_per_gpu_after=tokens_per_second_per_gpu(
                              changed)))
    if fits_now:
        return out[:limit]
    fitting = [a for a in out if a.fits_after]
    rest = sorted((a for a in out if not a.fits_after), key=lambda a: -a.saves_bytes)
    return (fitting + rest)[:limit]
