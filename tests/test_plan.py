"""`memcalc plan`: every configuration it returns is valid and reproduces through `estimate` to the byte; the bulk
(numpy) evaluation equals the scalar one; bounds, counts, ranking, Pareto front and advice behave as documented
(docs/plan.md)."""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any

import numpy as np
import pytest

from memcalc.cost.estimate import peak_bytes
from memcalc.options import RunOptions, build_run
from memcalc.specs import InputError
from memcalc.plan.search import (Request, _tight, bulk_peak, command_for, config_options, pareto, plan, ranked, search,
                                 times, _group_run)
from memcalc.plan.space import RULES, parse_bounds
from tests.conftest import cli, cli_json

# Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters using Megatron-LM"),
# Table 1: GPT-3 175B (96 layers, hidden 12288, 96 heads) trained on 1024 A100-80GB with t = 8, p = 8, global
# batch 1536, seq 2048; Korthikanti et al. 2022 (Table 3 / sec. 5) run the same 175B shape at t = 8, p = 8 with
# sequence parallelism and selective recompute.
GPT3 = RunOptions(model="gpt3-175b", gpus=1024, gpu="a100-80gb", global_batch=1536, seq=2048, profile="megatron")


def _args(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[:2] == ["memcalc", "estimate"]
    return words[1:]


@pytest.fixture(scope="module")
def gpt3():
    req = Request(dataclasses.replace(GPT3), top=3)
    res = search(req)
    return res, plan(req, res=res)


@pytest.fixture(scope="module")
def small():
    """A 13B model on 16 H100s, uneven pipelines included (pp = 16 over 40 layers: 3 layers on the first 8 stages,
    2 on the rest)."""
    o = RunOptions(model="llama-2-13b", gpus=16, gpu="h100-sxm-80gb", global_batch=64, seq=4096, profile="torch")
    req = Request(o, top=4)
    res = search(req)
    return res, plan(req, res=res)


def test_counts_add_up(gpt3, small):
    for res, out in (gpt3, small):
        s = out["search"]
        assert set(s["rejected"]) == set(RULES)
        assert s["considered"] == sum(s["rejected"].values()) + s["feasible"]
        memory_rules = ("out_of_memory", "below_min_headroom")
        assert s["evaluated"] >= sum(s["rejected"][k] for k in memory_rules) + s["feasible"]
        assert s["feasible"] == res.feasible.size > 0
        assert s["evaluated"] < s["considered"]


def test_top_plans_reproduce_through_estimate(small):
    """Each plan's command, run through `memcalc estimate --json`, gives the plan's memory, communication and
    compute blocks, and the bulk search's peak to the byte."""
    res, out = small
    assert len(out["plans"]) == 4
    for p in out["plans"]:
        est = cli_json(*_args(p["command"]))
        assert est["memory"] == p["memory"]
        assert est["communication"] == p["communication"]
        assert est["compute"] == p["compute"]
        assert est["memory"]["peak_bytes"] == p["search"]["peak_bytes"]
        assert est["memory"]["fits"]
        assert est["compute"]["step_seconds"] == pytest.approx(p["search"]["step_seconds"], rel=1e-12)
        assert est["compute"]["tokens_per_second"] == pytest.approx(p["search"]["tokens_per_second"], rel=1e-12)
        assert est["compute"]["mfu"] == pytest.approx(p["search"]["mfu"], rel=1e-12)
        lay = p["layout"]
        par = est["inputs"]["parallel"]
        for k in ("gpus", "dp", "tp", "pp", "vpp", "cp", "sp", "zero", "offload", "schedule"):
            assert par[k] == lay[k], k
        assert est["inputs"]["training"]["micro_batch"] == lay["micro_batch"]
        assert est["inputs"]["training"]["grad_accum"] == lay["grad_accum"]


def test_every_feasible_configuration_is_valid_and_fits(small):
    """A random sample of everything the search found feasible: `build_run` accepts it (resolve's rules) and
    `estimate`'s peak, which walks every pipeline stage, equals the bulk peak (stage 0 and pp-1 only) and fits."""
    res, _ = small
    rng = np.random.default_rng(0)
    f = res.feasible
    pick = rng.choice(f.size, size=min(60, f.size), replace=False)
    # and every pipeline depth present, so that uneven placements are checked stage by stage
    for pp in np.unique(res.space.pp[f.pair]):
        pick = np.r_[pick, np.flatnonzero(res.space.pp[f.pair] == pp)[:2]]
    assert (res.space.pp[f.pair[pick]] == 16).any()
    for i in pick:
        run = build_run(config_options(res, int(f.pair[i]), int(f.combo[i])))
        assert peak_bytes(run) == int(f.peak[i]) <= run.hardware.memory_bytes


@pytest.mark.parametrize("flags", [dict(loss="chunked"), dict(loss="chunked-eager"), dict(loss="lit-gpt"),
                                   dict(keep_logits="fp32"), dict(offload_activations=True),
                                   dict(offload="optimizer"), dict(loss="fused"),
                                   dict(profile="megatron", loss="fused", cp_comm="a2a"), dict(cp_comm="a2a"),
                                   dict(profile="deepspeed"), dict(model="llama-3-8b", precision="fp32"),
                                   dict(model="llama-3-8b", precision="fp32", dropout=0.1)],
                         ids=["chunked", "chunked-eager", "lit-gpt", "keep-logits", "offload-activations",
                              "offload-optimizer", "fused", "megatron-fused-a2a", "torch-ulysses",
                              "deepspeed-ulysses", "fp32-gqa-sdpa-math", "fp32-gqa-sdpa-math-dropout"])
def test_bulk_equals_estimate_for_losses_and_offloading(flags):
    """The losses' terms depend on the micro-batch (chunk copies, the head's weight-gradient moment, lit-gpt's kept
    logits) and offloading adds GPU <-> host copies to the step: for a sample of the bulk search's feasible rows,
    its peak equals `estimate`'s to the byte and its step time equals the scalar time model's. (The losses'
    searches leave offloading out, a third of the space: the offloading cases search it.) fp32 GQA runs SDPA's math
    fallback, whose moments branch on the model, not on the layout (a plan of it once raised on an array's truth
    value)."""
    o = RunOptions(**{"model": "llama-2-7b", "gpus": 8, "gpu": "h100-sxm-80gb", "global_batch": 32, "seq": 4096,
                      "profile": "torch", **flags})
    offloading = "offload" in flags or "offload_activations" in flags
    res = search(Request(o, bounds=parse_bounds() if offloading else parse_bounds(offload="none"), top=2))
    f = res.feasible
    assert f.size > 0
    pick = np.random.default_rng(3).choice(f.size, size=min(10, f.size), replace=False)
    if flags.get("cp_comm") == "a2a" or flags.get("profile") == "deepspeed":  # and some all-to-all CP rows
        with_cp = np.flatnonzero(res.space.cp[f.pair] > 1)
        assert with_cp.size > 0
        pick = np.r_[pick, with_cp[:: max(1, with_cp.size // 5)]]
    for i in pick:
        run = build_run(config_options(res, int(f.pair[i]), int(f.combo[i])))
        assert peak_bytes(run) == int(f.peak[i])
        assert times(run)[0] == pytest.approx(float(f.step[i]), rel=1e-12)


def test_bulk_equals_scalar_on_random_configurations(small):
    """Bulk vs scalar on valid configurations drawn at random from the whole space, fitting or not: the same peak
    to the byte (the scalar path checks every stage) and the same step time, tokens/s and MFU."""
    res, _ = small
    s = res.space
    rng = np.random.default_rng(1)
    checked = 0
    for ci in rng.choice(len(s.combos), size=12, replace=False):
        combo = s.combos[ci]
        ok = (s.tp > 1) if combo.sp else np.ones(s.pairs, dtype=bool)
        for inter in (False, True):
            cand = np.flatnonzero(ok & ((s.vpp > 1) == inter))
            if cand.size == 0:
                continue
            idx = np.sort(rng.choice(cand, size=min(8, cand.size), replace=False))
            training = res.base.training.model_copy(update={"recompute": combo.recompute})
            run = _group_run(res.base, s, idx, combo, training, "interleaved" if inter else "1f1b", 1)
            peak = bulk_peak(run, idx.size)
            step, tps, mfu = (np.broadcast_to(x, idx.shape) for x in times(run))
            for j, pair in enumerate(idx):
                one = build_run(config_options(res, int(pair), int(ci)))
                assert peak_bytes(one) == int(peak[j])
                st, tk, mf = times(one)
                assert st == pytest.approx(float(step[j]), rel=1e-12)
                assert tk == pytest.approx(float(tps[j]), rel=1e-12)
                assert mf == pytest.approx(float(mfu[j]), rel=1e-12)
                checked += 1
    assert checked >= 50


def test_first_and_last_stage_cover_the_worst(gpt3):
    """The search evaluates stages 0 and pp-1 only; `estimate` walks every stage. Deep and uneven pipelines of
    GPT-3 (pp = 64 over 96 layers puts 2 layers on the first 32 stages, 1 on the rest)."""
    res, _ = gpt3
    f, s = res.feasible, res.space
    rng = np.random.default_rng(2)
    for pp in (3, 6, 12, 64):
        rows = np.flatnonzero(s.pp[f.pair] == pp)
        if pp in (3, 6, 12):
            assert rows.size == 0  # 1024 GPUs: pp is a power of two
            continue
        assert rows.size > 0
        for i in rng.choice(rows, size=min(4, rows.size), replace=False):
            run = build_run(config_options(res, int(f.pair[i]), int(f.combo[i])))
            assert peak_bytes(run) == int(f.peak[i])
    for pp in (8, 16, 32):
        rows = np.flatnonzero(s.pp[f.pair] == pp)
        for i in rng.choice(rows, size=min(3, rows.size), replace=False):
            run = build_run(config_options(res, int(f.pair[i]), int(f.combo[i])))
            assert peak_bytes(run) == int(f.peak[i])


def test_gpt3_175b_megatron_layout_is_feasible(gpt3):
    """Narayanan 2021 Table 1 / Korthikanti 2022: t8 p8 with SP and selective recompute, micro-batch 1, plain
    Adam without the distributed optimizer (ZeRO-0), fits on A100-80GB."""
    res, _ = gpt3
    f, s = res.feasible, res.space
    combos = s.combos
    hit = [
        i for i in range(f.size)
        if s.tp[f.pair[i]] == 8 and s.pp[f.pair[i]] == 8 and s.micro_batch[f.pair[i]] == 1
        and combos[f.combo[i]].sp and combos[f.combo[i]].recompute == "selective"
        and combos[f.combo[i]].zero == 0 and combos[f.combo[i]].offload == "none"
    ]
    assert hit, "GPT-3 175B t8 p8 SP + selective recompute should fit on 80 GB A100s"
    run = build_run(config_options(res, int(f.pair[hit[0]]), int(f.combo[hit[0]])))
    assert run.dp == 16 and run.grad_accum == 96 and run.sp
    assert peak_bytes(run) <= run.hardware.memory_bytes


def test_bounds_are_honoured():
    o = RunOptions(model="llama-2-7b", gpus=16, gpu="h100-sxm-80gb", global_batch=64, seq=4096)
    b = parse_bounds(tp="2,4", pp="1,2", vpp="1", cp="1", micro_batch="1,2", zero="1,2", recompute="selective",
                     sp="on", offload="none")
    res = search(Request(o, bounds=b))
    # hand count: (tp, pp) in {2,4} x {1,2}, all dividing 16; vpp 1; mb 1,2; zero 1,2; one recompute, sp, offload
    assert res.considered == 4 * 2 * 2
    assert res.considered == sum(res.rejected.values()) + res.feasible.size
    f, s = res.feasible, res.space
    assert f.size > 0
    assert set(s.tp[f.pair]) <= {2, 4} and set(s.pp[f.pair]) <= {1, 2}
    assert set(s.vpp[f.pair]) == {1} and set(s.cp[f.pair]) == {1} and set(s.micro_batch[f.pair]) <= {1, 2}
    for ci in set(f.combo.tolist()):
        c = s.combos[ci]
        assert c.zero in (1, 2) and c.recompute == "selective" and c.sp and c.offload == "none"


def test_rules_count_what_they_reject():
    """tp 3 does not divide Llama-2-7B's 32 heads; tp 16 exceeds a node only when auto; cp 3 does not divide 4096;
    SP is impossible at tp 1; offload params needs ZeRO-3; 144 is not a multiple of mb*dp = 12*72."""
    o = RunOptions(model="llama-2-7b", gpus=72, gpu="h100-sxm-80gb", global_batch=144, seq=4096)
    b = parse_bounds(tp="1,3", pp="1", vpp="1", cp="1,3", micro_batch="1,12", zero="2,3", recompute="full",
                     sp="auto", offload="none,params")
    res = search(Request(o, bounds=b))
    r = res.rejected
    n_cat = 2 * 1 * 2 * 2  # zero x recompute x sp x offload
    # layouts: (tp, cp) in {1,3}^2 all divide 72 -> tp3: 2 layouts x 2 mb x n_cat
    assert r["tp_heads"] == 2 * 2 * n_cat
    assert r["cp_seq"] == 1 * 2 * n_cat  # tp1 cp3
    # the one valid layout tp1 cp1 dp72: mb 12 -> 864 does not divide 144
    assert r["global_batch"] == 1 * n_cat
    assert r["offload_zero"] == 1 * 2  # mb 1: zero 2 with offload params, sp off/on
    assert r["sp_tp"] == 1 * 3  # tp 1, sp on: (z2, none), (z3, none), (z3, params)
    assert res.considered == 4 * 2 * n_cat


def test_min_headroom(small):
    o = dataclasses.replace(small[0].request.options)
    out = plan(Request(o, min_headroom=0.25, top=3))
    cap = out["search"]["capacity_bytes"]
    assert out["search"]["rejected"]["below_min_headroom"] > 0
    assert out["search"]["feasible"] < small[1]["search"]["feasible"]
    for p in out["plans"] + out["pareto"]:
        assert p["search"]["headroom_bytes"] >= 0.25 * cap


def test_objectives_and_pareto(small):
    res, out = small
    f = res.feasible
    best = out["plans"][0]["search"]
    # throughputs within 1% count as equal (search.THROUGHPUT_TIE): the first is within 1% of the fastest, and the
    # plans run down the 1% bands, within one a fit with room before a tight one, no offload before offload, fewer
    # model-splitting axes before more (search.parallel_dims), then the faster first
    top = float(f.tps.max())
    assert top / 1.01 <= best["tokens_per_second"] <= top
    band = [int(np.floor(np.log(top / p["search"]["tokens_per_second"]) / np.log(1.01))) for p in out["plans"]]
    off = {"none": 0, "optimizer": 1, "params": 2}
    dims = [sum(p["layout"][k] > 1 for k in ("tp", "pp", "cp", "vpp")) for p in out["plans"]]
    order = [(b, p["search"]["tight"], off[p["layout"]["offload"]], d, -p["search"]["tokens_per_second"])
             for b, d, p in zip(band, dims, out["plans"])]
    assert order == sorted(order)
    mem = plan(Request(dataclasses.replace(res.request.options), objective="memory", top=2))
    assert mem["plans"][0]["search"]["peak_bytes"] == int(f.peak.min())
    # Pareto: lower peak, higher throughput, nothing in the feasible set dominates a front point
    front = out["pareto"]
    peaks = [p["search"]["peak_bytes"] for p in front]
    speeds = [p["search"]["tokens_per_second"] for p in front]
    assert peaks == sorted(peaks) and speeds == sorted(speeds) and len(set(speeds)) == len(speeds)
    for p, v in zip(peaks, speeds):
        assert not ((f.peak <= p) & (f.tps > v)).any()
    assert pareto(res).size == len(front)
    assert ranked(res).size == f.size


def test_objective_gpus_finds_fewest():
    o = RunOptions(model="llama-2-7b", gpus=16, gpu="h100-sxm-80gb", global_batch=64, seq=4096)
    b = parse_bounds(pp="1", vpp="1", cp="1", offload="none")
    req = Request(o, bounds=b, objective="gpus", top=3)
    res = search(req)
    out = plan(req, res=res)
    fewest = out["plans"][0]["layout"]["gpus"]
    assert fewest < 16
    assert fewest == int(res.space.gpus[res.feasible.pair].min())
    est = cli_json(*_args(out["plans"][0]["command"]))
    assert est["memory"]["fits"] and est["inputs"]["parallel"]["gpus"] == fewest


def test_objective_gpus_puts_fits_with_room_first():
    """Llama-2-13B on up to 16 H100s without offload: on 4 GPUs the fastest layouts peak at 74.6-75.7 GiB of 79.6,
    inside the reserved-memory error (12.5% of the peak, about 9.4 GiB): tight. They ranked 1-4 before; a fit with
    room (69.9 GiB, 9.7 GiB free > 8.7 GiB) on the same 4 GPUs now ranks first, and every tight fit follows all fits
    with room, each group by fewest GPUs."""
    o = RunOptions(model="llama-2-13b", gpus=16, gpu="h100-sxm-80gb", global_batch=64, seq=4096)
    b = parse_bounds(offload="none")
    req = Request(o, bounds=b, objective="gpus", top=3)
    res = search(req)
    out = plan(req, res=res)
    assert [(p["search"]["tight"], p["layout"]["gpus"]) for p in out["plans"]] == [(False, 4)] * 3
    order = ranked(res)
    tight, gpus = _tight(res)[order], res.space.gpus[res.feasible.pair][order]
    keys = list(zip(tight.tolist(), gpus.tolist()))
    assert keys == sorted(keys) and int(gpus.min()) == 4
    assert (True, 4) in keys  # the tight 4-GPU layouts are there, after every fit with room


def test_nothing_fits_gives_advice_that_fits():
    """Llama-2-7B with ZeRO-1, no TP/PP/CP, no recompute on 8 H100s: torch keeps fp32 params and grads
    (2 x 4 x 6.74e9 = 54 GB) plus activations of a 4096-token sequence: over 80 GB. The advice's commands are
    re-run through `estimate`."""
    o = RunOptions(model="llama-2-7b", gpus=8, gpu="h100-sxm-80gb", global_batch=64, seq=4096)
    b = parse_bounds(tp="1", pp="1", cp="1", zero="1", offload="none", recompute="none")
    out = plan(Request(o, bounds=b))
    assert out["search"]["feasible"] == 0 and out["plans"] == [] and out["pareto"] == []
    closest = [a for a in out["advice"] if a["kind"] == "closest"]
    assert closest and closest[0]["shortfall_bytes"] > 0
    assert cli_json(*_args(closest[0]["command"]))["memory"]["peak_bytes"] == closest[0]["peak_bytes"]
    fixes = [c for c in closest[0]["changes"] if c["fits_after"]]
    assert fixes
    for c in fixes:
        est = cli_json(*_args(c["command"]))
        assert est["memory"]["fits"] and est["memory"]["peak_bytes"] == c["peak_bytes_after"]
    for c in closest[0]["changes"]:
        assert c["saves_bytes"] == closest[0]["peak_bytes"] - c["peak_bytes_after"] > 0


def test_nothing_fits_suggests_more_gpus():
    """ZeRO-3 shards everything over dp: Llama-2-13B's 16 bytes/param (torch AMP) need more than 2 x 80 GB."""
    o = RunOptions(model="llama-2-13b", gpus=2, gpu="h100-sxm-80gb", global_batch=64, seq=4096)
    b = parse_bounds(tp="1", pp="1", cp="1", zero="3", offload="none", recompute="full")
    out = plan(Request(o, bounds=b))
    more = [a for a in out["advice"] if a["kind"] == "more_gpus"]
    assert out["search"]["feasible"] == 0 and more
    est = cli_json(*_args(more[0]["command"]))
    assert est["memory"]["fits"] and est["inputs"]["parallel"]["gpus"] == more[0]["gpus"] > 2
    assert est["memory"]["peak_bytes"] == more[0]["search"]["peak_bytes"]


def test_command_round_trips_options():
    o = RunOptions(model="llama-2-7b", gpus=8, gpu="h100-sxm-80gb", global_batch=64, seq=2048, tp=2, sp=False,
                   zero=3, offload="params", recompute="full", micro_batch=2, fragmentation=0.1, profile="deepspeed")
    est = cli_json(*_args(command_for(o)))
    assert est["memory"]["peak_bytes"] == peak_bytes(build_run(dataclasses.replace(o)))
    assert "--no-sp" in command_for(o)


# --- the CLI -------------------------------------------------------------------------------------------------------


def test_cli_json_contract():
    code, out, err = cli("plan", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "h100-sxm-80gb",
                         "--global-batch", "32", "--seq", "2048", "--pp", "1,2", "--top", "2", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["schema_version"] == "1.4" and data["kind"] == "plan"
    assert set(data) == {"schema_version", "kind", "inputs", "search", "plans", "pareto", "advice"}
    assert set(data["search"]) >= {"considered", "rejected", "evaluated", "feasible", "wall_seconds"}
    assert data["inputs"]["bounds"]["pp"] == [1, 2] and data["inputs"]["bounds"]["tp"] == "auto"
    assert len(data["plans"]) == 2 and [p["rank"] for p in data["plans"]] == [1, 2]
    for p in data["plans"]:
        assert set(p) >= {"command", "layout", "search", "memory", "communication", "compute"}
        assert p["layout"]["pp"] in (1, 2)


def test_within_a_band_the_simpler_layout_ranks_first():
    """Llama-3-8B on 8 H100s, global batch 64 x 4096: pipeline + interleaving + context parallelism (dp1 pp2 vpp4
    cp4, ZeRO-2) is modelled 0.3% faster than plain ZeRO-2 data parallelism over 8 GPUs, inside the 1% the time
    model cannot resolve (search.THROUGHPUT_TIE). The plain layout, with no process group but the data-parallel one,
    ranks first; the faster four-axis one still ranks within the band, after every simpler layout there."""
    code, out, err = cli("plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-sxm-80gb",
                         "--global-batch", "64", "--top", "40", "--json")
    assert code == 0, err
    plans = json.loads(out)["plans"]
    dims = [sum(p["layout"][k] > 1 for k in ("tp", "pp", "cp", "vpp")) for p in plans]
    top = plans[0]["layout"]
    assert (top["dp"], top["tp"], top["pp"], top["cp"], dims[0]) == (8, 1, 1, 1, 0)
    # (a tight fit, headroom inside the reserved model's error, ranks after every fit with room: left out here)
    tps = [0.0 if p["search"]["tight"] else p["search"]["tokens_per_second"] for p in plans]
    fastest = max(tps)
    in_band = [i for i, t in enumerate(tps) if t > fastest / 1.01]
    assert in_band == list(range(len(in_band)))
    # the fastest layout with room splits the model more ways than the top one and ranks below it
    i_fast = tps.index(fastest)
    assert dims[i_fast] >= 3 and i_fast > 0 and tps[0] < fastest
    assert dims[:len(in_band)] == sorted(dims[:len(in_band)])


def test_tight_rows_are_those_inside_the_reserved_error_band():
    """`search.tight` is estimate's `memory.tight` for the row (headroom below 12.5% of the peak, the GPU records'
    largest reserved miss; fragmentation.RESERVED_SHORTFALL_FRACTION), and the table marks the free column with *.
    Llama-2-7B on 8 H100s, batch 64 x 4096, ZeRO-2: over cp 4 at micro-batch 8 it has 8.75 GiB free at a 70.9 GiB
    peak (12.3%): tight; without cp at micro-batch 2, 9.42 GiB at 70.2 GiB (13.4%): not. Their throughputs are
    within 1% (68.5k tokens/s), so the tight one ranks after every configuration with room in its 1% band
    (search.THROUGHPUT_TIE): 8th, behind 68.0k-tokens/s layouts with 40 GiB free."""
    args = ("plan", "--model", "llama-2-7b", "--gpus", "8", "--global-batch", "64", "--pp", "1", "--tp", "1",
            "--zero", "2", "--recompute", "none", "--offload", "none", "--top", "10")
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    data = json.loads(out)
    rows = data["plans"] + data["pareto"]
    assert {r["search"]["tight"] for r in rows} == {True, False}
    for r in rows:
        f = r["search"]
        assert f["tight"] == (f["headroom_bytes"] < int(f["peak_bytes"] * 0.125))
    for p in data["plans"]:
        assert p["memory"]["tight"] == p["search"]["tight"]
        assert p["memory"]["peak_bytes"] == p["search"]["peak_bytes"]
    tight = [p["rank"] for p in data["plans"] if p["search"]["tight"]]
    assert tight == [8]
    fastest = max(p["search"]["tokens_per_second"] for p in data["plans"])
    assert data["plans"][7]["search"]["tokens_per_second"] > fastest / 1.0001
    assert all(p["search"]["tokens_per_second"] > fastest / 1.01 for p in data["plans"][:8])
    code, out, _ = cli(*args)
    assert "*" in out and "reserved-memory model's measured error" in " ".join(out.split())


def test_cli_table():
    code, out, err = cli("plan", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "h100-sxm-80gb",
                         "--global-batch", "32", "--seq", "2048", "--top", "3")
    assert code == 0, err
    assert "Top 3 by throughput" in out and "memcalc estimate --model llama-2-7b" in out and "Pareto" in out
    code, out, err = cli("plan", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "h100-sxm-80gb",
                         "--global-batch", "64", "--seq", "4096", "--tp", "1", "--pp", "1", "--cp", "1", "--zero",
                         "1", "--offload", "none", "--recompute", "none")
    assert code == 0, err
    assert "Nothing fits" in out and "Closest" in out


def test_cli_table_says_offload_rows_include_the_cpu_step():
    """Offload's CPU optimizer step is in the step time: the table says at which rate under rows with off-opt /
    off-par; a plan searched without offload does not."""
    from memcalc.plan.render import OFFLOAD_NOTE

    base = ("plan", "--model", "llama-3-70b", "--gpus", "64", "--global-batch", "256", "--top", "3")
    code, out, err = cli(*base, "--offload", "optimizer", "--recompute", "none")
    assert code == 0, err
    assert any("off-opt" in ln for ln in out.splitlines())
    assert " ".join(OFFLOAD_NOTE.split()) in " ".join(out.split())
    code, out, err = cli(*base, "--offload", "none")
    assert code == 0, err
    assert "cpu-optimizer-rate" not in out and "off-" not in out


def test_offload_no_longer_wins_on_an_untimed_cpu_step():
    """With the CPU step timed, the default search of Llama-3.1-70B on 64 H100s ranks layouts without offload
    first (before, the five best were offload layouts whose step time left the CPU step out), and an offload
    layout's tokens/s equals estimate's for its command."""
    import json

    code, out, err = cli("plan", "--model", "llama-3.1-70b", "--gpus", "64", "--global-batch", "256", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert all(p["layout"]["offload"] == "none" for p in res["plans"])
    off = [p for p in res["pareto"] if p["layout"]["offload"] != "none"]
    assert off
    code, out, err = cli(*off[0]["command"].split()[1:], "--json")
    assert code == 0, err
    est = json.loads(out)["compute"]
    assert est["cpu_optimizer_seconds"] > 0
    assert est["tokens_per_second"] == pytest.approx(off[0]["search"]["tokens_per_second"], rel=1e-9)


def test_cli_min_headroom_takes_a_percentage_as_estimate_does():
    """`plan --min-headroom 10%` and `0.1` are the same request (estimate's --min-headroom takes both too)."""
    base = ["plan", "--model", "llama-2-7b", "--gpus", "8", "--global-batch", "32", "--seq", "2048", "--pp", "1",
            "--cp", "1", "--json"]
    outs = []
    for v in ("10%", "0.1"):
        code, out, err = cli(*base, "--min-headroom", v)
        assert code == 0, err
        outs.append(json.loads(out))
    assert outs[0]["inputs"]["min_headroom"] == outs[1]["inputs"]["min_headroom"] == 0.1
    for o in outs:
        o["search"].pop("wall_seconds")
    assert outs[0]["search"] == outs[1]["search"] and outs[0]["search"]["rejected"]["below_min_headroom"] > 0


@pytest.mark.parametrize("args, needle", [
    (["--tp", "0"], "--tp"),
    (["--tp", "two"], "--tp"),
    (["--pp", "1,,2"], "--pp"),
    (["--zero", "4"], "--zero"),
    (["--recompute", "some"], "--recompute"),
    (["--sp", "maybe"], "--sp"),
    (["--offload", "disk"], "--offload"),
    (["--objective", "speed"], "--objective"),
    (["--min-headroom", "1.5"], "--min-headroom '1.5': plan keeps a share of each GPU's memory free"),
    (["--min-headroom", "5GiB"], "give e.g. 10% or 0.1"),
    (["--min-headroom", "100%"], "--min-headroom '100%' must be a percentage in [0, 100)"),
    (["--top", "0"], "--top"),
    (["--tp", "5", "--pp", "1"], "no configuration"),
    (["--units", "MB"], "--units"),
])
def test_cli_bad_bounds(args, needle):
    base = ["plan", "--model", "llama-2-7b", "--gpus", "8", "--global-batch", "32", "--seq", "2048"]
    code, out, err = cli(*base, *args)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("memcalc: error:") and needle in err
    assert "Traceback" not in err


@pytest.mark.parametrize("missing, needle", [("--gpus", "--gpus"), ("--global-batch", "--global-batch")])
def test_cli_requires_cluster_and_batch(missing, needle):
    args = {"--model": "llama-2-7b", "--gpus": "8", "--global-batch": "32"}
    del args[missing]
    code, _, err = cli("plan", *[x for kv in args.items() for x in kv])
    assert code == 2 and needle in err and err.count("\n") == 1


def test_op_level_sac_in_the_planner_equals_estimate():
    """--recompute op (torchtitan's op-level SAC) is searched only when asked for; every feasible layout's bulk
    peak equals `estimate`'s to the byte, TP with and without SP and interleaved pipelines included."""
    o = RunOptions(model="llama-2-13b", gpus=16, gpu="h100-sxm-80gb", global_batch=64, seq=4096, profile="torch")
    res = search(Request(o, bounds=parse_bounds(recompute="op")))
    f, s = res.feasible, res.space
    assert f.size > 0 and {s.combos[ci].recompute for ci in set(f.combo.tolist())} == {"op"}
    rng = np.random.default_rng(2)
    for i in rng.choice(f.size, size=min(25, f.size), replace=False):
        run = build_run(config_options(res, int(f.pair[i]), int(f.combo[i])))
        assert run.training.recompute == "op"
        assert peak_bytes(run) == int(f.peak[i])


def test_model_code_and_lora_dropout_in_the_planner_equal_estimate():
    """The model-code knobs (--norm-impl fp32, --qkv-impl fused) and LoRA on q,v with dropout pass through the
    planner's array evaluation unchanged: every sampled feasible layout's bulk peak equals `estimate`'s."""
    o = RunOptions(model="llama-2-7b", gpus=8, gpu="a100-40gb", global_batch=16, seq=2048, profile="torch",
                   lora_rank=8, lora_targets="qv", lora_dropout=0.05, norm_impl="fp32", qkv_impl="fused",
                   precision="bf16", master_weights=False)
    for run, bulk_peak in _sampled_feasible(o, seed=3):
        assert run.training.qkv_impl == "fused" and run.training.lora_dropout == 0.05
        assert peak_bytes(run) == bulk_peak


def test_eager_fp32_norm_under_amp_in_the_planner_equal_estimate():
    """--norm-impl fp32 under torch AMP: FSDP2 drops autocast where it shards (ZeRO-2/3 over more than one rank), so
    the residual stream's width is an array in the planner's evaluation, and `plan` raised on an array's truth
    value (`_stream_unsaved`, `_eager_norm_backward`; found by a random search over plan's inputs). Sampled
    feasible layouts, with and without sharding: bulk peaks equal `estimate`'s."""
    o = RunOptions(model="llama-3-8b", gpus=16, gpu="h100-sxm-80gb", global_batch=64, seq=4096, precision="bf16",
                   norm_impl="fp32")
    sampled = _sampled_feasible(o, seed=7, n=40)
    assert {run.zero >= 2 for run, _ in sampled} == {True, False}
    for run, bulk_peak in sampled:
        assert peak_bytes(run) == bulk_peak


def test_deepspeed_ring_attention_is_refused_up_front():
    """DeepSpeed has no ring attention: `estimate` refuses --profile deepspeed --cp-comm p2p at cp > 1, so `plan`
    says so before searching (the search returned cp > 1 layouts that `estimate` then rejected, which the CLI
    reported only when one of them ranked among the plans); with --cp 1 it plans."""
    with pytest.raises(InputError, match="no ring attention"):
        search(Request(RunOptions(model="mistral-7b", gpus=8, global_batch=64, profile="deepspeed", cp_comm="p2p")))
    flags = ("plan", "--model", "mistral-7b", "--gpus", "8", "--global-batch", "64", "--profile", "deepspeed",
             "--cp-comm", "p2p")
    code, _, err = cli(*flags)
    assert code == 2 and "no ring attention" in err and len(err.strip().splitlines()) == 1
    code, out, err = cli(*flags, "--cp", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["plans"] and all(p["layout"]["cp"] == 1 for p in json.loads(out)["plans"])


def test_op_level_recompute_with_adapters_is_refused_before_the_search():
    """`estimate` refuses --recompute op with LoRA or a fused QKV (not modelled: specs.check_op_recompute); `plan`
    asked to search it says the same before searching, and without op in the bounds plans LoRA as before."""
    code, _, err = cli("plan", "--model", "llama-3-8b", "--gpus", "8", "--global-batch", "32", "--lora-rank", "8",
                       "--recompute", "op,full")
    assert code == 2 and "--recompute op with --lora-rank" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("plan", "--model", "llama-3-8b", "--gpus", "8", "--global-batch", "32", "--lora-rank", "8",
                       "--recompute", "full")
    assert code == 0, err


def _sampled_feasible(o: RunOptions, seed: int, n: int = 25) -> list[tuple[Any, int]]:
    """Up to n of the bulk search's feasible layouts for `o`, each as (its run rebuilt through `estimate`'s
    rules, the bulk search's peak bytes)."""
    res = search(Request(o))
    f = res.feasible
    assert f.size > 0
    rng = np.random.default_rng(seed)
    return [(build_run(config_options(res, int(f.pair[i]), int(f.combo[i]))), int(f.peak[i]))
            for i in rng.choice(f.size, size=min(n, f.size), replace=False)]



def test_kept_logits_rule_out_pipelining():
    """A training loop that keeps its logits (--keep-logits) runs the model itself: every layout with pp > 1 is
    rejected by `keep_logits_pp` (pp in {1, 2} x tp in {1, 2} on 8 GPUs: the two pp-2 layouts x 1 micro-batch x
    the categorical combos), and every returned plan re-resolves through `estimate`'s rules."""
    o = RunOptions(model="llama-2-7b", gpus=8, gpu="h100-sxm-80gb", global_batch=32, seq=4096, keep_logits="compute")
    b = parse_bounds(tp="1,2", pp="1,2", vpp="1", cp="1", micro_batch="1", zero="3", recompute="full", sp="off",
                     offload="none")
    res = search(Request(o, bounds=b, top=5))
    assert res.rejected["keep_logits_pp"] == 2 * 1 * 1
    assert res.feasible.size > 0
    for i in range(res.feasible.size):
        run = build_run(config_options(res, int(res.feasible.pair[i]), int(res.feasible.combo[i])))
        assert run.pp == 1 and run.training.keep_logits == "compute"


def test_all_to_all_context_parallelism_rules_out_cp_beyond_the_heads():
    """--cp-comm a2a shards heads across the cp ranks (TE AttnFuncWithCPAndQKVOA2A): Llama-3-8B has 32 query and 8
    KV heads, 16 and 4 per rank at tp 2, so cp 8 is rejected by `cp_a2a_heads` (one layout of tp 2 x cp
    {1, 2, 4, 8} on 16 GPUs, one micro-batch, one categorical combo) while p2p keeps it; every returned plan
    re-resolves through `estimate`'s rules with the exchange it was planned for."""
    def plan(cp_comm: str):
        o = RunOptions(model="llama-3-8b", gpus=16, gpu="h100-sxm-80gb", profile="megatron", global_batch=32,
                       seq=8192, cp_comm=cp_comm, loss="fused")
        b = parse_bounds(tp="2", pp="1", vpp="1", cp="1,2,4,8", micro_batch="1", zero="1", recompute="none",
                         sp="on", offload="none")
        return search(Request(o, bounds=b, top=10))

    a2a, p2p = plan("a2a"), plan("p2p")
    assert a2a.rejected["cp_a2a_heads"] == 1 and p2p.rejected["cp_a2a_heads"] == 0
    def cps(res):
        return {int(res.space.cp[int(i)]) for i in res.feasible.pair}

    assert cps(p2p) - cps(a2a) == {8}
    for i in range(a2a.feasible.size):
        run = build_run(config_options(a2a, int(a2a.feasible.pair[i]), int(a2a.feasible.combo[i])))
        assert run.cp_comm == "a2a" and run.cp in (1, 2, 4)
    with pytest.raises(InputError, match="--cp 8 with --cp-comm a2a must divide"):
        build_run(RunOptions(model="llama-3-8b", gpus=16, tp=2, cp=8, profile="megatron", cp_comm="a2a"))


def test_mla_moe_plans_skip_cp_and_reproduce_to_the_byte():
    """DeepSeek-V2-Lite (MLA, first layer dense, 64 experts) on 16 GPUs with ep 4: the search rejects cp > 1 with
    its own rule (context parallelism over MLA is not modelled) instead of failing, and the bulk peak of random
    layouts, pipelined ones included (the dense layer on stage 0 only), equals the scalar estimate to the byte."""
    o = RunOptions(model="deepseek-v2-lite", gpus=16, gpu="h100-sxm-80gb", global_batch=64, seq=4096,
                   profile="megatron", ep=4)
    res = search(Request(o, top=4))
    assert res.space.rejected["cp_mla"] > 0 and "cp_mla" in RULES
    f = res.feasible
    rng = np.random.default_rng(3)
    pick = rng.choice(f.size, size=min(12, f.size), replace=False)
    assert any(int(res.space.pp[int(f.pair[i])]) > 1 for i in pick)
    for i in pick:
        run = build_run(config_options(res, int(f.pair[i]), int(f.combo[i])))
        assert peak_bytes(run) == int(f.peak[i])


@pytest.mark.parametrize("model,flags", [
    ("stablelm-base-alpha-3b", dict(precision="bf16", master_weights=False)),
    ("phi-1.5", dict(precision="bf16")),  # AMP: the shared norm's output cast per linear
    ("phi-1.5", dict(precision="bf16", master_weights=False, lora_rank=8, lora_targets="qv", lora_dropout=0.05,
                     qkv_impl="fused", loss="lit-gpt", keep_logits="fp32", base_dtype="nf4",
                     quant_backend="bnb-fp16", quantize_head=True)),
], ids=["neox-parallel", "phi-shared-norm-amp", "phi-lit-gpt-fabric-qlora"])
def test_parallel_blocks_in_the_planner_equal_estimate(model, flags):
    """Parallel blocks (one norm or two), Fabric's fp32 logits and bitsandbytes' fp16 dequantization (bnb-fp16) go
    through the planner's array evaluation unchanged: sampled feasible layouts' bulk peaks equal `estimate`'s."""
    o = RunOptions(model=model, gpus=8, gpu="a100-40gb", global_batch=16, seq=2048, profile="torch", **flags)
    res = search(Request(o))
    f = res.feasible
    assert f.size > 0
    for i in np.random.default_rng(5).choice(f.size, size=min(15, f.size), replace=False):
        run = build_run(config_options(res, int(f.pair[i]), int(f.combo[i])))
        assert run.model.block != "sequential"
        assert peak_bytes(run) == int(f.peak[i])


@pytest.mark.parametrize("step", ["steady", "first"])
def test_held_graph_and_first_step_in_the_planner_equal_estimate(step):
    """bitsandbytes' ctx-held inputs under lit-gpt's loop (the previous graph live through the next forward) and
    `--peak-step first` pass through the planner's array evaluation: sampled feasible layouts' bulk peaks equal
    `estimate`'s to the byte."""
    o = RunOptions(model="llama-2-7b", gpus=8, gpu="a100-40gb", global_batch=16, seq=2048, profile="torch",
                   lora_rank=8, lora_targets="qv", lora_dropout=0.05, norm_impl="fp32", qkv_impl="fused",
                   precision="bf16", master_weights=False, base_dtype="nf4", quantize_head=True, loss="lit-gpt",
                   keep_logits="fp32", peak_step=step)
    for run, bulk_peak in _sampled_feasible(o, seed=5):
        assert run.training.peak_step == step
        assert peak_bytes(run) == bulk_peak


def test_recompute_every_plans_full_recompute_and_whole_chunks():
    """--recompute-every K: the search keeps --recompute full only, and refuses interleaved layouts whose model chunks
    are not a multiple of K layers (the `recompute_every_chunks` rule); every plan reproduces through estimate.
    llama-2-7b: 32 layers; every 4th: pp 2 x vpp 2 (chunks of 8) is a layout, pp 2 x vpp 8 (chunks of 2) is not."""
    code, out, err = cli("plan", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "h100-sxm-80gb",
                         "--global-batch", "32", "--seq", "2048", "--pp", "2", "--vpp", "2,8", "--recompute-every",
                         "4", "--top", "50", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["search"]["rejected"]["recompute_every_chunks"] > 0
    assert data["plans"] and all(p["layout"]["vpp"] == 2 for p in data["plans"])
    for p in data["plans"]:
        assert "--recompute full --recompute-every 4" in p["command"]
        args = shlex.split(p["command"])[2:]
        c2, o2, e2 = cli("estimate", *args, "--json")
        assert c2 == 0, e2
        assert json.loads(o2)["memory"]["peak_bytes"] == p["memory"]["peak_bytes"]
    code, _, err = cli("plan", "--model", "llama-2-7b", "--gpus", "8", "--global-batch", "32", "--recompute",
                       "none,selective", "--recompute-every", "4")
    assert code == 2 and "--recompute-every 4 needs --recompute full" in err
