"""Predicted (the Estimate) vs measured (the harness), per model state, per component at the peak, per phase and
per collective. Errors are relative to the measurement: (predicted - measured) / measured.

The tracked rows (model states, components, phases, the exact peak of live tensor bytes) are compared with the
prediction less its GPU-only terms, each named in `set_aside`: fragmentation and the runtime overhead (outside the
live-bytes figure by definition) and the cuBLAS / TransformerEngine workspaces (cuBLAS's own allocations, not
tensors; a CPU run has none). On a GPU the headline compares `torch.cuda.max_memory_allocated()` with the whole
allocated prediction, and `max_memory_reserved()` with allocated + fragmentation (`cuda_view`).
"""

from __future__ import annotations

from typing import Any

# 1.1: `cuda` (the GPU's counters; on a GPU the headline error is theirs), allocator replay; 1.2: `seq_lengths`
# (--seq-lengths), and `model_states.grads` counts one step's gradients whatever --steps; 1.5: gloo's late frees
# (`measured.late_free_bytes`, `remeasured_other_peak_bytes`: docs/json.md)
SCHEMA_VERSION = "1.5"
CATEGORIES = ("params", "master_weights", "grads", "optimizer", "activations", "buffers")
GPU_ONLY_BUFFERS = ("cublas_workspaces", "te_cublas_workspace")
# A point-to-point transfer is one `send/recv` of the rank that sends it (the prediction counts the bytes a GPU
# sends, memcalc/cost/comm.py); the receives a rank posts are its neighbours' sends, reported beside the send/recv
# row (`measured_recv_calls`, `measured_recv_bytes`) and not compared.
OPS = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
       "broadcast": "broadcast", "all_to_all": "all-to-all", "send": "send/recv"}


def rel_error(pred: int, meas: int) -> float | None:
    if meas == 0:
        return 0.0 if pred == 0 else None
    return (pred - meas) / meas


def verdict(pred: int, meas: int, tol: float) -> str:
    if pred == meas:
        return "exact"
    e = rel_error(pred, meas)
    return "ok" if e is not None and abs(e) <= tol else "miss"


def _collective_rows(colls: Any) -> list[dict[str, Any]]:
    return [{"op": c.op, "group": c.group, "group_size": c.group_size, "dtype": c.dtype,
             "bytes_per_call": c.bytes_per_call, "calls_per_step": c.calls_per_step, "window": c.window,
             "buffer_bytes_per_step": c.bytes_per_call * c.calls_per_step} for c in colls]


def predicted_view(est: Any) -> dict[str, Any]:
    """The prediction as the tracker can see it: without the GPU-only terms (`set_aside`)."""
    mem = est.memory
    set_aside: dict[str, int] = {}
    gpu_only = 0
    for k in GPU_ONLY_BUFFERS:
        v = int(mem.buffers_detail.get(k, 0))
        if v:
            set_aside[k] = v
            gpu_only += v
    for k in ("fragmentation", "runtime"):
        if mem.components.get(k):
            set_aside[k] = int(mem.components[k])
    phases: dict[str, dict[str, Any]] = {}
    for ph in mem.phases:
        live = {k: int(ph.live.get(k, 0)) for k in CATEGORIES}
        if gpu_only:
            live["buffers"] = max(0, live["buffers"] - gpu_only)
        phases[ph.name] = {"peak_bytes": sum(live.values()), "live": live}
    peak_phase = max(phases, key=lambda n: phases[n]["peak_bytes"])
    st = mem.model_states_detail
    states = {
        "params": int(st.get("params", 0)),
        "master_weights": int(st.get("master_weights", 0)),
        "grads": int(st.get("grads", 0)) + int(st.get("grads_fp32_copy", 0)),
        "optimizer": int(st.get("optimizer_moments", 0)),
    }
    colls = _collective_rows(est.communication.collectives)
    return {
        "stage": mem.reported_stage,
        "worst_rank": mem.worst_rank,
        "peak_bytes": phases[peak_phase]["peak_bytes"],
        "peak_phase": peak_phase,
        "components": phases[peak_phase]["live"],
        "phases": phases,
        "model_states": states,
        "activations_detail": dict(mem.activations_detail),
        "buffers_detail": dict(mem.buffers_detail),
        "set_aside": set_aside,
        "collectives": colls,
        "collectives_stage": int(est.communication.stage),
        "communication_modelled": bool(est.communication.modelled),
    }


def phase_allocated(mem: Any) -> dict[str, int]:
    """Each predicted phase's allocated bytes (the Estimate's `memory.phases`, GPU-only buffers included)."""
    return {ph.name: sum(int(ph.live.get(k, 0)) for k in CATEGORIES) for ph in mem.phases}


def _phase_figure(pred_phases: dict[str, int], name: str) -> int | None:
    """The predicted figure for a measured phase: the same phase, or for pipelining's interleaved
    "forward-backward" the larger of forward and backward; None for a phase the prediction does not model."""
    if name in pred_phases:
        return pred_phases[name]
    if name == "forward-backward":
        return max(pred_phases.get(n, 0) for n in ("forward", "backward"))
    return None


def cuda_view(est: Any, meas: dict[str, Any]) -> dict[str, Any] | None:
    """Predicted vs `torch.cuda.max_memory_allocated()` per phase and at the peak, and the predicted reserved peak
    (allocated + fragmentation, memcalc/cost/fragmentation.py) vs `max_memory_reserved()`; None off a GPU. Each
    measured phase's figure is the largest over the measured steps (the harness resets the peak as a phase starts).
    The gap between the allocated figure and the tracked one is what only a GPU allocates: cuBLAS workspaces,
    kernels' own scratch (FlashAttention's backward accumulators), the allocator's 512-byte rounding."""
    phases_m = meas.get("cuda") or {}
    if meas.get("device") != "cuda" or not phases_m:
        return None
    mem = est.memory
    pred_ph = phase_allocated(mem)
    phases: dict[str, dict[str, Any]] = {}
    for name, c in phases_m.items():
        p = _phase_figure(pred_ph, name)
        if p is None:
            continue
        tracked = meas["phases"].get(name, {}).get("peak_bytes", 0)
        phases[name] = {"predicted": p, "measured": int(c["max_allocated"]), "tracked": int(tracked),
                        "gpu_only": int(c["max_allocated"]) - int(tracked),
                        "measured_reserved": int(c["max_reserved"])}
    peak_name = max(phases, key=lambda n: phases[n]["measured"])
    return {
        "phases": phases,
        "predicted_peak_bytes": int(mem.allocated_peak_bytes),
        "predicted_peak_phase": mem.peak_phase,
        "measured_peak_bytes": phases[peak_name]["measured"],
        "measured_peak_phase": peak_name,
        "predicted_reserved_bytes": int(mem.reserved_peak_bytes),
        "measured_reserved_bytes": max(c["measured_reserved"] for c in phases.values()),
        "predicted_gpu_only_bytes": sum(int(mem.buffers_detail.get(k, 0)) for k in GPU_ONLY_BUFFERS),
    }


def _measured_collectives(meas: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for c in meas["collectives"]:
        if c["op"] == "recv":
            continue
        op = OPS.get(c["op"], c["op"])
        a = out.setdefault((op, c["group"]), {"calls": 0, "bytes": 0, "dtypes": set()})
        a["calls"] += c["calls_per_step"]
        a["bytes"] += c["bytes_per_step"]
        a["dtypes"].add(c["dtype"])
    return out


def compare_collectives(pred: dict[str, Any], meas: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """One row per (op, group): the full buffer bytes of all calls in a step (S x calls; not the ring-scaled
    bytes sent) and the calls. GPU <-> host copies (group `host`, one row per direction) are compared by bytes:
    the harness copies one storage at a time, memcalc counts one call per micro-batch."""
    p: dict[tuple[str, str], dict[str, Any]] = {}
    for c in pred["collectives"]:
        if c["group"] == "host":
            way = "to_host" if c["window"] in ("fwd_host", "bwd_last_host") else "from_host"
            a = p.setdefault(("host-copy", way), {"calls": 0, "bytes": 0, "dtypes": set()})
            a["calls"] += int(c["calls_per_step"])
            a["bytes"] += int(c["buffer_bytes_per_step"])
            continue
        a = p.setdefault((c["op"], c["group"]), {"calls": 0, "bytes": 0, "dtypes": set()})
        a["calls"] += int(c["calls_per_step"])
        a["bytes"] += int(c["buffer_bytes_per_step"])
        a["dtypes"].add(c["dtype"])
    m = _measured_collectives(meas)
    recv: dict[str, dict[str, int]] = {}
    for c in meas["collectives"]:
        if c["op"] == "recv":
            a = recv.setdefault(c["group"], {"calls": 0, "bytes": 0})
            a["calls"] += c["calls_per_step"]
            a["bytes"] += c["bytes_per_step"]
    for g in recv:
        m.setdefault(("send/recv", g), {"calls": 0, "bytes": 0, "dtypes": set()})
    for way, c in meas.get("host_copies", {}).items():
        m[("host-copy", way)] = {"calls": c["calls"], "bytes": c["bytes"], "dtypes": set()}
    rows = []
    for key in sorted(set(p) | set(m)):
        pp_, mm = p.get(key, {"calls": 0, "bytes": 0, "dtypes": set()}), m.get(key, {"calls": 0, "bytes": 0,
                                                                                      "dtypes": set()})
        rows.append({
            "op": key[0], "group": key[1],
            "predicted_calls": pp_["calls"], "measured_calls": mm["calls"],
            "predicted_bytes": pp_["bytes"], "measured_bytes": mm["bytes"],
            "predicted_dtypes": sorted(pp_["dtypes"]), "measured_dtypes": sorted(mm["dtypes"]),
            "error": rel_error(pp_["bytes"], mm["bytes"]),
            "exact": pp_["bytes"] == mm["bytes"] and (pp_["calls"] == mm["calls"] or key[0] == "host-copy"),
            "bytes_exact": pp_["bytes"] == mm["bytes"],
        })
        if key[0] == "send/recv" and key[1] in recv:
            rows[-1]["measured_recv_calls"] = recv[key[1]]["calls"]
            rows[-1]["measured_recv_bytes"] = recv[key[1]]["bytes"]
    return rows


def mark_other_moment(rows: list[dict[str, Any]], total_error: float | None, tolerance: float) -> bool:
    """Where the totals agree but the activations live at the two peaks do not, the measured peak is another moment
    than the predicted one (e.g. the end of backward, activations freed, against the loss gradient) and its
    components describe that moment: their `miss` rows become `moment` (the phase and total rows stay the test);
    with the same gradients and optimizer state on both sides they become `split` (one moment, filed differently).
    Returns whether the moments differ."""
    comp = {r["name"]: r for r in rows if r["section"] == "peak_components"}
    total = next((r["measured"] for r in rows if r["section"] == "total"), 0)
    acts = comp.get("activations")
    # the activations must differ by a share of the peak, not by a few stray bytes (4 B against 0 is one moment)
    differ = (total_error is not None and abs(total_error) <= tolerance and acts is not None
              and acts["verdict"] == "miss" and abs(acts["predicted"] - acts["measured"]) > tolerance * total)
    # ... unless both hold the same model states (gradients made, optimizer state) and the activations and buffers
    # together agree: then it is one moment whose split differs, memcalc counting what backward allocates (layer
    # transients, a recomputed layer's set and weight casts) as activations where the tracker files it as
    # backward temporaries or compute copies (buffers): `split`
    states = [comp.get(k) for k in ("grads", "master_weights", "optimizer")]
    same = differ and all(r is not None for r in states) and all(
        abs(r["predicted"] - r["measured"]) <= tolerance * total for r in states)
    if differ:
        for r in comp.values():
            if r["verdict"] == "miss":
                r["verdict"] = "split" if same else "moment"
    return differ and not same


def compare(est: Any, meas: dict[str, Any], device: str, tolerance: float,
            inputs: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
            run: Any = None) -> dict[str, Any]:
    """`run` (the Run behind `est`): compare the collectives of the measured rank's pipeline stage. The
    Estimate's `communication` describes the stage with the most exposed communication, which under pipelining
    need not be the measured one."""
    pred = predicted_view(est)
    if run is not None and "stage" in meas:
        from memcalc.cost.comm import collectives

        pred["collectives"] = _collective_rows(collectives(run, stage=int(meas["stage"])))
        pred["collectives_stage"] = int(meas["stage"])
    rows: list[dict[str, Any]] = []

    def row(section: str, name: str, p: int, m: int) -> None:
        rows.append({"section": section, "name": name, "predicted": int(p), "measured": int(m),
                     "error": rel_error(int(p), int(m)), "verdict": verdict(int(p), int(m), tolerance)})

    for k in ("params", "master_weights", "grads", "optimizer"):
        row("model_states", k, pred["model_states"][k], meas["model_states"][k])
    for k in CATEGORIES:
        row("peak_components", k, pred["components"].get(k, 0), meas["components"].get(k, 0))
    tracked_ph = {n: ph["peak_bytes"] for n, ph in pred["phases"].items()}
    for name, mph in meas["phases"].items():
        p = _phase_figure(tracked_ph, name)
        if p is not None:
            row("phases", name, p, mph["peak_bytes"])
    row("total", "peak", pred["peak_bytes"], meas["peak_bytes"])
    err = rel_error(pred["peak_bytes"], meas["peak_bytes"])
    moments_differ = mark_other_moment(rows, err, tolerance)
    rep = meas.get("allocator_replay")
    if rep:
        # memcalc's reserved figure (allocated + fragmentation) against the caching allocator replayed over the
        # run's own allocations (per stream), under the policy the run names (--allocator): informative, outside
        # the verdict
        expandable = est.inputs["training"].get("allocator") == "expandable"
        key = "expandable_reserved_peak_bytes" if expandable else "reserved_peak_bytes"
        row("allocator_replay", "reserved", int(est.memory.reserved_peak_bytes), rep[key])
        rows[-1]["verdict"] = "info"
    cuda = cuda_view(est, meas)
    if cuda is not None:
        # on a GPU the headline is torch.cuda.max_memory_allocated against the prediction with its GPU terms
        # (cuBLAS workspaces); the rows above stay the exact tracked bytes against the prediction without them
        for name, c in cuda["phases"].items():
            row("cuda_allocated", name, c["predicted"], c["measured"])
        row("cuda_allocated", "peak", cuda["predicted_peak_bytes"], cuda["measured_peak_bytes"])
        row("cuda_reserved", "peak", cuda["predicted_reserved_bytes"], cuda["measured_reserved_bytes"])
        err = rel_error(cuda["predicted_peak_bytes"], cuda["measured_peak_bytes"])
    colls = compare_collectives(pred, meas, meas.get("world_size", 1))
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "validate",
        "inputs": inputs or {},
        "predicted": pred,
        "measured": meas,
        "rows": rows,
        "collectives": colls,
        "cuda": cuda,
        "error": err,
        "tolerance": tolerance,
        "within_tolerance": err is not None and abs(err) <= tolerance,
        "peak_moments_differ": moments_differ,
        "peak_split_differs": any(r["verdict"] == "split" for r in rows),
        **(extra or {}),
    }
