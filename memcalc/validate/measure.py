"""Exact live-bytes tracking and a collective counter (see shared/research/validation-findings.md (the team notes)).

`Tracker` is a TorchDispatchMode that registers the UntypedStorage of every tensor an op returns (keyed by the
storage's C pointer, freed through weakref.finalize), wraps `UntypedStorage.resize_` (FSDP2 frees and re-allocates
its unsharded parameters through it, outside the dispatcher) and returns NotImplemented for DTensor so that it sees
the local ops DTensor issues. Every allocation, resize and free is logged with the phase that caused it; the
categories (params, grads, optimizer state, ...) are assigned afterwards from the live objects, and the log is
replayed to get the peak of each phase and the breakdown at that moment. The same mode counts every `c10d.*` and
`_c10d_functional.*` collective with its payload and process group.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import defaultdict
from typing import Any, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# fine-grained categories -> the cost model's categories (memcalc/cost/timeline.py CATEGORIES)
COARSE = {
    "params": "params",
    "master_weights": "master_weights",
    "grads": "grads",
    "optimizer": "optimizer",
    "activations": "activations",  # allocated in forward, not a state
    "compute_copies": "buffers",  # low-precision copies of parameters (autocast casts)
    "sharded_buffers": "buffers",  # FSDP2 unsharded parameters (all-gather outputs)
    "persistent_buffers": "buffers",  # live before the measured step and not a state (DDP buckets, ...)
    "backward_temporaries": "buffers",  # allocated in backward, not a gradient of a parameter
    "optimizer_temporaries": "buffers",  # allocated in the optimizer step, not optimizer state
}
FINE = tuple(COARSE)

_COLL_KIND = (
    ("reduce_scatter", "reduce_scatter"),
    ("all_gather", "all_gather"),
    ("allgather", "all_gather"),
    ("all_reduce", "all_reduce"),
    ("allreduce", "all_reduce"),
    ("all_to_all", "all_to_all"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("recv", "recv"),
    ("send", "send"),
    ("barrier", "barrier"),
)


def _coll_kind(name: str) -> str | None:
    for pat, kind in _COLL_KIND:
        if pat in name:
            return kind
    return None


def _tensors(x: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(x)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _nbytes(ts: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def storage_key(t: torch.Tensor) -> int | None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - tensors without storage (sparse, some subclasses)
        return None


class Tracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # live storage key -> bytes
        self.uid: dict[int, int] = {}  # live storage key -> unique id (keys are reused after a free)
        self.alloc_phase: dict[int, str] = {}  # uid -> phase at allocation
        self.events: list[tuple[int, int]] = []  # (uid, delta bytes)
        # the stream current at each event (the caching allocator's pools are per stream: allocator.replay_log);
        # on the CPU FSDP2 switches torch.cpu's stand-in streams as it switches CUDA's
        self.streams: list[object] = []
        self.cuda_streams = False  # set by the harness on CUDA
        self.marks: list[tuple[int, str]] = []  # (event index, phase) at each phase change
        self.phase = "init"
        self.param_storages: set[int] = set()  # storage keys of parameters (for compute copies)
        self.copy_uids: set[int] = set()
        self.counting = False
        self.collectives: list[dict[str, Any]] = []
        self.group_labels: dict[str, str] = {}
        self._next = 0
        self._lock = threading.RLock()
        self._orig_resize = None
        self._orig_propagate: Any = None
        self._paused = 0  # > 0 while DTensor propagates shapes on fake global tensors
        self.ptrs: dict[int, int] | None = None  # storage key -> data pointer, kept for cuda_diagnosis
        # op -> [largest bytes the op allocated beyond its new outputs, calls] (MEMCALC_CUDA_DIAG; resets the
        # allocator's peak around every op, so a diagnosed run's per-phase CUDA figures are not measurements)
        self.scratch: dict[str, list[int]] | None = None
        # gloo runs collectives on worker threads that drop their references to a finished collective's tensors
        # a moment after its wait returns: a storage whose last reference such a thread held is freed there, late
        # in the log (it may count at a peak the main thread's program order never reaches). Set by the harness
        # on a real gloo world: uid -> index of the free event of each storage freed off the main thread.
        self.watch_late_frees = False
        self.late_frees: dict[int, int] = {}
        # `_carry_over`: a collective's input storage (key -> uid) whose allocation `wait_tensor`'s fake output took
        # over, while that input is still referenced; and the allocations whose output died first (uid -> bytes)
        self.carried_inputs: dict[int, int] = {}
        self.carried_uids: set[int] = set()
        self.outlived: dict[int, int] = {}

    # -- lifecycle
    def __enter__(self) -> "Tracker":
        orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: Any, n: int) -> Any:
            r = orig(st, n)
            tracker._resized(st)
            return r

        self._orig_resize = orig
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        # DTensor computes each op's output shape by running it on global-shape fake tensors; under `--device
        # meta` those share the harness's FakeTensorMode and would be tracked as if allocated: pause meanwhile
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        prop = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate(sp: Any, *a: Any, **kw: Any) -> Any:
            with tracker.paused():
                return prop(sp, *a, **kw)

        self._orig_propagate = prop
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        if self._orig_propagate is not None:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator

            ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate  # type: ignore[method-assign]
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def paused(self) -> Any:
        """Outputs of ops dispatched meanwhile are not tracked (they own no memory a GPU run would hold)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            self.marks.append((len(self.events), phase))

    # -- storages
    def _register(self, st: Any) -> None:
        key = st._cdata
        with self._lock:
            if key in self.sizes:
                return
            n = st.nbytes()
            self._next += 1
            uid = self._next
            self.sizes[key] = n
            self.uid[key] = uid
            if self.ptrs is not None:
                self.ptrs[key] = st.data_ptr()
            self.alloc_phase[uid] = self.phase
            self.events.append((uid, n))
            self.streams.append(self._stream())
        try:
            weakref.finalize(st, self._free, key, uid)
        except TypeError:
            pass

    def _stream(self) -> object:
        if self.cuda_streams:
            return torch.cuda.current_stream().cuda_stream
        return id(torch.cpu.current_stream())

    def _free(self, key: int, uid: int) -> None:
        with self._lock:
            if self.carried_inputs.get(key) == uid:
                # a collective's input, whose allocation its fake `wait_tensor` output took over: on a device they
                # are one storage, freed when the last of the two goes
                del self.carried_inputs[key]
                self.carried_uids.discard(uid)
                if uid not in self.outlived:
                    return
                n = self.outlived.pop(uid)
                self.events.append((uid, -n))
                self.streams.append(None)
                return
            if self.uid.get(key) != uid:
                return
            n = self.sizes.pop(key)
            del self.uid[key]
            if uid in self.carried_uids:
                # the output went first while the input is still referenced (op-level SAC caches a reduce-scatter's
                # output before its wait): the allocation lives on with it
                self.outlived[uid] = n
                return
            if self.watch_late_frees and threading.current_thread() is not threading.main_thread():
                self.late_frees[uid] = len(self.events)
            self.events.append((uid, -n))
            self.streams.append(None)

    def _resized(self, st: Any) -> None:
        key = st._cdata
        with self._lock:
            if key not in self.sizes:
                self._register(st)
                return
            n = st.nbytes()
            delta = n - self.sizes[key]
            if self.ptrs is not None:
                self.ptrs[key] = st.data_ptr()
            if delta:
                self.sizes[key] = n
                self.events.append((self.uid[key], delta))
                self.streams.append(self._stream())

    def track(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
            if type(t) not in (torch.Tensor, torch.nn.Parameter, _FakeTensor):
                # a wrapper subclass (functional collectives' AsyncCollectiveTensor) has a placeholder storage
                # that owns no memory: reading its pointer raises; its inner tensor is tracked on its own (a fake
                # tensor's storage stands for real memory: tracked without the probe, which torch warns about)
                st.data_ptr()
        except Exception:  # noqa: BLE001
            return
        self._register(st)

    def _carry_over(self, args: Any, out: Any) -> bool:
        """`wait_tensor` returns its input on a device (the collective's output, now complete), but the fake kernel
        behind meta and fake tensors returns a new tensor: the input's allocation is carried over to that tensor
        (same uid and bytes), so a fake run does not count the output twice, and it lives as long as either does (on
        a device they are one storage: op-level SAC caches a reduce-scatter's output before its wait, and keeps it
        when the waited tensor is gone; without this a fake run freed it early, -3.6% in forward under TP 2 + SP).
        Without it a fake run held a second copy of each functional collective's output for a moment: under SP the
        reduce-scatter's, c tok/t h bytes (256 MiB a layer for Llama-3.1-70B at 131,072 tokens over TP 8); the H100's
        TP 4 + SP row replayed 8.5% low for it (docs/methodology.md, "Fragmentation")."""
        if not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
            return False
        src, dst = storage_key(args[0]), storage_key(out)
        if src is None or dst is None or src == dst:
            return False
        st = out.untyped_storage()
        with self._lock:
            if src not in self.sizes or dst in self.sizes or st.nbytes() != self.sizes[src]:
                return False
            self.sizes[dst], self.uid[dst] = self.sizes.pop(src), self.uid.pop(src)
            if self.ptrs is not None:
                self.ptrs[dst] = self.ptrs.pop(src, 0)
            # (the input's own finalizer, registered when it was allocated, now ends the allocation only if the
            # output is gone by then: `_free`)
            self.carried_inputs[src] = self.uid[dst]
            self.carried_uids.add(self.uid[dst])
        try:
            weakref.finalize(st, self._free, dst, self.uid[dst])
        except TypeError:
            pass
        return True

    def uid_of(self, t: torch.Tensor) -> int | None:
        key = storage_key(t)
        return None if key is None else self.uid.get(key)

    def live_bytes(self) -> int:
        return sum(self.sizes.values())

    # -- dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional") and self.counting:
            self._count(func, args, kwargs)
        if self.ptrs is not None and self.scratch is not None:
            out = self._call_measuring_scratch(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self._paused:
            return out
        if func is torch.ops._c10d_functional.wait_tensor.default and self._carry_over(args, out):
            return out
        for t in _tensors(out):
            self.track(t)
        if func is torch.ops.aten._to_copy.default and self.param_storages and args:
            src = args[0]
            if isinstance(src, torch.Tensor) and storage_key(src) in self.param_storages:
                u = self.uid_of(out)
                if u is not None:
                    self.copy_uids.add(u)
        return out

    def _call_measuring_scratch(self, func: Any, args: Any, kwargs: Any) -> Any:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        known = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))
                 if type(t) in (torch.Tensor, torch.nn.Parameter)}
        out = func(*args, **kwargs)
        peak = torch.cuda.max_memory_allocated()
        new = {}
        for t in _tensors(out):
            if type(t) is torch.Tensor and t.is_cuda:
                st = t.untyped_storage()
                if st._cdata not in known:
                    new[st._cdata] = st.nbytes()
        extra = peak - before - sum(new.values())
        if extra > 0 and self.scratch is not None:
            rec = self.scratch.setdefault(str(func), [0, 0])
            rec[0] = max(rec[0], extra)
            rec[1] += 1
        return out

    def _count(self, func: Any, args: Any, kwargs: Any) -> None:
        name = func._opname if hasattr(func, "_opname") else str(func)
        kind = _coll_kind(name)
        if kind is None or kind == "barrier" or name.startswith("wait"):
            return
        tens = _tensors(args)
        ns = func.namespace
        if ns == "_c10d_functional":
            if kind == "all_gather":
                group_size = next(a for a in args if isinstance(a, int) and not isinstance(a, bool))
                nbytes = _nbytes(tens) * group_size
            else:
                nbytes = _nbytes(tens)
            gname = next((a for a in reversed(args) if isinstance(a, str)), "")
        else:
            # c10d ops: (outputs, inputs, pg, ...) for gathers/scatters, (tensors, pg, ...) otherwise
            if kind == "all_gather":
                first = args[0]
                nbytes = _nbytes(_tensors(first))
            elif kind == "reduce_scatter":
                nbytes = _nbytes(_tensors(args[1]))
            else:
                nbytes = _nbytes(_tensors(args[0]))
            gname = ""
            for a in args:
                if isinstance(a, torch.ScriptObject):
                    try:
                        gname = torch.distributed.ProcessGroup.unbox(a).group_name
                        break
                    except Exception:  # noqa: BLE001 - the ReduceOp, not a group
                        continue
                if hasattr(a, "group_name"):
                    gname = a.group_name
                    break
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tens})
        with self._lock:
            self.collectives.append({"op": kind, "group": self.group_labels.get(gname, gname or "?"),
                                     "bytes": int(nbytes), "dtype": ",".join(dtypes), "raw": name})


def replay(tr: Tracker, categories: dict[int, str], start_mark: int) -> dict[str, Any]:
    """Replay the event log; per phase from the `start_mark`-th mark: the peak of live bytes and the breakdown by
    fine category at that moment. Storages not in `categories` are labelled by their phase of allocation."""

    def cat_of(uid: int) -> str:
        c = categories.get(uid)
        if c is not None:
            return c
        if uid in tr.copy_uids:
            return "compute_copies"
        ph = tr.alloc_phase.get(uid, "init")
        if ph.startswith("forward"):
            return "activations"
        if ph.startswith("backward"):
            return "backward_temporaries"
        if ph.startswith("optimizer"):
            return "optimizer_temporaries"
        return "persistent_buffers"

    by_cat: dict[str, int] = defaultdict(int)
    total = 0
    now = -1  # index of the event just applied
    marks = tr.marks
    start_event = marks[start_mark][0]
    phases: dict[str, dict[str, Any]] = {}
    mark_i = 0
    current: str | None = None

    def observe(phase: str) -> None:
        ph = phases.setdefault(phase, {"peak": -1, "live": {}, "at": -1})
        if total > ph["peak"]:
            ph["peak"], ph["live"], ph["at"] = total, dict(by_cat), now

    def enter_marks(upto: int) -> None:
        nonlocal mark_i, current
        while mark_i < len(marks) and marks[mark_i][0] <= upto:
            if mark_i >= start_mark:
                current = marks[mark_i][1]
                observe(current)
            mark_i += 1

    born: dict[int, int] = {}  # uid -> allocation event index, of the storages freed late (Tracker.late_frees)
    for i, (uid, delta) in enumerate(tr.events):
        enter_marks(i)
        if uid in tr.late_frees and uid not in born:
            born[uid] = i
        by_cat[cat_of(uid)] += delta
        total += delta
        now = i
        if i >= start_event and current is not None:
            observe(current)
    enter_marks(max((m[0] for m in marks), default=0))  # marks after the last event
    for ph in phases.values():
        ph["live"] = {k: int(ph["live"].get(k, 0)) for k in FINE}
        # bytes of storages freed late by a collective's worker thread yet live at this peak: the peak may hold
        # them only because that thread had not yet let go (0: the peak is the program's own)
        at = ph.pop("at")
        ph["late_free_bytes"] = sum(-tr.events[f][1] for u, f in tr.late_frees.items() if born.get(u, f) <= at < f)
    return phases


def summarize_collectives(records: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    agg: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in records:
        k = (r["op"], r["group"], r["dtype"])
        a = agg.setdefault(k, {"op": r["op"], "group": r["group"], "dtype": r["dtype"], "calls": 0, "bytes": 0})
        a["calls"] += 1
        a["bytes"] += r["bytes"]
    out = []
    for a in agg.values():
        out.append({"op": a["op"], "group": a["group"], "dtype": a["dtype"],
                    "calls_per_step": a["calls"] // steps, "bytes_per_step": a["bytes"] // steps})
    return sorted(out, key=lambda x: (x["group"], x["op"], x["dtype"]))


def cuda_diagnosis(tracker: Tracker, top: int = 12) -> dict[str, Any]:
    """What the caching allocator holds now beside the tracker's view (`MEMCALC_CUDA_DIAG=1`, a development aid
    for GPU sessions): reserved and allocated bytes per stream, and the allocated blocks that no tracked storage
    owns (kernels' internal scratch, cuBLAS workspaces, ...), grouped by the Python frames that allocated them
    (recorded with torch.cuda.memory._record_memory_history)."""
    snap = torch.cuda.memory._snapshot()
    live = {p for k, p in (tracker.ptrs or {}).items() if k in tracker.sizes}
    streams: dict[str, dict[str, int]] = {}
    untracked: dict[str, dict[str, Any]] = {}
    for seg in snap["segments"]:
        st = streams.setdefault(str(seg["stream"]), {"segments": 0, "reserved": 0, "allocated": 0,
                                                     "largest_free": 0})
        st["segments"] += 1
        st["reserved"] += seg["total_size"]
        st["allocated"] += seg["allocated_size"]
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                if b["state"] == "inactive":
                    st["largest_free"] = max(st["largest_free"], b["size"])
                continue
            if b["address"] in live:
                continue
            frames = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in b.get("frames", [])
                      if f["filename"].endswith(".py")][:6]
            key = " < ".join(frames) or "(no python frame)"
            u = untracked.setdefault(key, {"bytes": 0, "blocks": 0, "stream": seg["stream"]})
            u["bytes"] += b["size"]
            u["blocks"] += 1
    worst = sorted(untracked.items(), key=lambda kv: -kv[1]["bytes"])[:top]
    return {"streams": streams, "untracked_bytes": sum(u["bytes"] for u in untracked.values()),
            "untracked": [dict(v, frames=k) for k, v in worst], "peak": _trace_peak(snap, top),
            "op_scratch": sorted(([k, v[0], v[1]] for k, v in (tracker.scratch or {}).items()),
                                 key=lambda r: -r[1])[:top]}


def _trace_peak(snap: dict[str, Any], top: int) -> dict[str, Any]:
    """The largest allocated moment of the recorded allocator trace and the blocks live then, the largest first,
    each with its allocating Python frames."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for tr in snap.get("device_traces", []):
        for ev in tr:
            if ev["action"] == "alloc":
                fr = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in ev.get("frames", [])
                      if f["filename"].endswith(".py")][:8]
                live[ev["addr"]] = (ev["size"], " < ".join(fr))
                total += ev["size"]
                if total > best:
                    best, best_live = total, dict(live)
            elif ev["action"] == "free_completed" and ev["addr"] in live:
                total -= live.pop(ev["addr"])[0]
    blocks = sorted(best_live.values(), key=lambda b: -b[0])[:top]
    return {"allocated_in_trace": best, "blocks": [{"bytes": b, "frames": f} for b, f in blocks]}
