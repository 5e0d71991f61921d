"""The planner's search space: the axes, their bounds, and the validity rules with a count of what each rejects.

A configuration is one value per axis: GPU count G, tp, pp, cp (with tp*pp*cp dividing G; dp = G/(tp*pp*cp)),
vpp, micro-batch, ZeRO stage, recompute mode, sequence parallel on/off, offload. An axis bound is a list of values
or `auto`; `auto` is a superset that the rules below cut down to every valid value (tp, pp, cp: the divisors of G;
vpp: the divisors of the layer count; micro-batch: the divisors of the global batch; the categorical axes: every
choice). "Considered" counts every configuration of that product whose tp*pp*cp divides G; each is then rejected
by the first rule it breaks, in the order of RULES, or evaluated by the cost model (memcalc/plan/search.py).

The rules are those of `memcalc.specs.resolve` (one source of truth for what is valid: each rule here mirrors one
check there, and tests/test_plan.py re-resolves every returned configuration), plus the planner's own default
that TP stays inside a node (DESIGN section 7) unless a tp value is listed explicitly.

Everything here is computed with numpy on small tables: per layout (G, tp, pp, cp, vpp) and per (layout,
micro-batch) pair. The categorical axes multiply the counts and become the search's groups.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np

from memcalc.errors import InputError

AXES: tuple[str, ...] = ("tp", "pp", "vpp", "cp", "micro_batch", "zero", "recompute", "sp", "offload")
AXIS_FLAGS: dict[str, str] = {
    "tp": "--tp", "pp": "--pp", "vpp": "--vpp", "cp": "--cp", "micro_batch": "--micro-batch", "zero": "--zero",
    "recompute": "--recompute", "sp": "--sp", "offload": "--offload",
}
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")  # searched by default
RECOMPUTE_CHOICES: tuple[str, ...] = ("none", "selective", "op", "full")  # accepted by --recompute
OFFLOAD_MODES: tuple[str, ...] = ("none", "optimizer", "params")

# rule key -> what it rejects, in the order the rules are applied (the first rule broken counts).
RULES: dict[str, str] = {
    "tp_heads": "tp does not divide the attention heads and KV heads",
    "tp_node": "tp exceeds the GPUs per node (give --tp explicitly to allow it)",
    "pp_layers": "pp exceeds the layers",
    "vpp_layers": "vpp > 1 needs pp > 1 and layers divisible by pp*vpp",
    "recompute_every_chunks": "--recompute-every K with vpp > 1 needs model chunks of a multiple of K layers",
    "schedule": "vpp or pp conflicts with --schedule (interleaved needs vpp > 1, the others vpp = 1; pipedream "
                "needs pp > 1)",
    "keep_logits_pp": "--keep-logits (the training loop's logits) needs pp = 1",
    "cp_seq": "cp does not divide the sequence length",
    "cp_a2a_heads": "--cp-comm a2a needs cp to divide the query and KV heads per TP rank",
    "cp_mla": "context parallelism over multi-head latent attention is not modelled",
    "ep": "ep does not divide dp*cp",
    "global_batch": "the global batch is not a multiple of micro-batch*dp",
    "offload_zero": "offload params needs ZeRO-3; offload with ZeRO-0 needs the torch profile",
    "sp_tp": "sequence parallel needs tp > 1",
    "out_of_memory": "the worst stage's peak exceeds the GPU's capacity",
    "below_min_headroom": "fits, but leaves less free memory than --min-headroom",
    "pruned_micro_batch": "not kept: a smaller micro-batch of the same layout already exceeded the memory budget",
}
INVALID_LAYOUT_RULES: tuple[str, ...] = ("tp_heads", "tp_node", "pp_layers", "vpp_layers", "recompute_every_chunks",
                                         "schedule",
                                         "keep_logits_pp", "cp_seq", "cp_a2a_heads", "cp_mla", "ep")


@dataclasses.dataclass(frozen=True)
class Bounds:
    """One tuple of allowed values per axis; None means `auto` (every valid value)."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    vpp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] | None = None
    zero: tuple[int, ...] | None = None
    recompute: tuple[str, ...] | None = None
    sp: tuple[bool, ...] | None = None
    offload: tuple[str, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {a: ("auto" if getattr(self, a) is None else list(getattr(self, a))) for a in AXES}


def _split(flag: str, text: str) -> list[str]:
    items = [x.strip() for x in str(text).split(",")]
    if not items or any(not x for x in items):
        raise InputError(f"{flag} {text!r} is not a list; use comma-separated values (e.g. 1,2,4) or auto")
    return items


def _int_axis(flag: str, text: str | None) -> tuple[int, ...] | None:
    if text is None or str(text).strip().lower() == "auto":
        return None
    out: list[int] = []
    for item in _split(flag, text):
        try:
            v = int(item)
        except ValueError:
            raise InputError(f"{flag} {text!r}: {item!r} is not an integer; use e.g. 1,2,4 or auto") from None
        if v < 1:
            raise InputError(f"{flag} {text!r}: {v} must be at least 1")
        out.append(v)
    return tuple(sorted(set(out)))


def _choice_axis(flag: str, text: str | None, valid: tuple[str, ...]) -> tuple[str, ...] | None:
    if text is None or str(text).strip().lower() == "auto":
        return None
    out: list[str] = []
    for item in _split(flag, text):
        v = item.lower()
        if v not in valid:
            raise InputError(f"{flag} {text!r}: {item!r} is not valid; valid: {', '.join(valid)}, auto")
        if v not in out:
            out.append(v)
    return tuple(sorted(out, key=valid.index))


def _zero_axis(text: str | None) -> tuple[int, ...] | None:
    vals = _choice_axis("--zero", text, ("0", "1", "2", "3"))
    return None if vals is None else tuple(int(v) for v in vals)


def _sp_axis(text: str | None) -> tuple[bool, ...] | None:
    if text is None or str(text).strip().lower() == "auto":
        return None
    table = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}
    out: set[bool] = set()
    for item in _split("--sp", text):
        if item.lower() not in table:
            raise InputError(f"--sp {text!r}: {item!r} is not valid; valid: on, off, auto")
        out.add(table[item.lower()])
    return tuple(sorted(out))


def parse_bounds(
    tp: str | None = None, pp: str | None = None, vpp: str | None = None, cp: str | None = None,
    micro_batch: str | None = None, zero: str | None = None, recompute: str | None = None,
    sp: str | None = None, offload: str | None = None,
) -> Bounds:
    """Bounds from the flag texts (`1,2,4` or `auto`). Raises InputError (one line) on a bad value."""
    return Bounds(
        tp=_int_axis("--tp", tp), pp=_int_axis("--pp", pp), vpp=_int_axis("--vpp", vpp), cp=_int_axis("--cp", cp),
        micro_batch=_int_axis("--micro-batch", micro_batch), zero=_zero_axis(zero),
        recompute=_choice_axis("--recompute", recompute, RECOMPUTE_CHOICES), sp=_sp_axis(sp),
        offload=_choice_axis("--offload", offload, OFFLOAD_MODES),
    )


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclasses.dataclass(frozen=True)
class Combo:
    """The categorical part of a configuration (one search group per combo and schedule)."""

    zero: int
    recompute: str
    sp: bool
    offload: str


@dataclasses.dataclass
class Space:
    """Valid (layout, micro-batch) pairs, sorted by layout then micro-batch, and the valid categorical combos.
    Pair arrays are int64; `layout` numbers the layouts, `rank` is the micro-batch's rank within its layout."""

    considered: int
    rejected: dict[str, int]
    gpus: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    vpp: np.ndarray
    cp: np.ndarray
    dp: np.ndarray
    micro_batch: np.ndarray
    grad_accum: np.ndarray
    layout: np.ndarray
    rank: np.ndarray
    combos: tuple[Combo, ...]
    global_batch: int

    @property
    def pairs(self) -> int:
        return int(self.tp.size)


def _cat_axes(bounds: Bounds, recompute_layers: int | None, recompute_every: int | None = None
              ) -> tuple[tuple[int, ...], tuple[str, ...], tuple[bool, ...], tuple[str, ...]]:
    zeros = bounds.zero if bounds.zero is not None else (0, 1, 2, 3)
    rcs = bounds.recompute if bounds.recompute is not None else RECOMPUTE_MODES
    if recompute_every is not None:
        if "full" not in rcs:
            raise InputError(f"--recompute-every {recompute_every} needs --recompute full in the search (got "
                             f"{', '.join(rcs)})")
        rcs = ("full",)
    if recompute_layers is not None:
        if bounds.recompute is not None and "none" in bounds.recompute:
            raise InputError("--recompute-layers needs --recompute selective, op or full (not none)")
        rcs = tuple(r for r in rcs if r != "none")
    sps = bounds.sp if bounds.sp is not None else (False, True)
    offs = bounds.offload if bounds.offload is not None else OFFLOAD_MODES
    return zeros, rcs, sps, offs


def _offload_ok(zero: int, offload: str, profile: str) -> bool:
    """resolve(): `--offload params needs --zero 3`; `--offload X needs --zero >= 1` outside the torch profile."""
    if offload == "params" and zero < 3:
        return False
    if offload != "none" and zero == 0 and profile != "torch":
        return False
    return True


def enumerate_space(
    *, layers: int, heads: int, kv_heads: int, seq: int, global_batch: int, gpus: list[int], gpus_per_node: int,
    profile: str, ep: int, schedule: str | None, recompute_layers: int | None, bounds: Bounds,
    keep_logits: str = "none", cp_comm: str = "p2p", mla: bool = False, recompute_every: int | None = None,
) -> Space:
    """Every configuration within the bounds, with the count each rule rejects. See the module docstring."""
    zeros, rcs, sps, offs = _cat_axes(bounds, recompute_layers, recompute_every)
    all_combos = [Combo(z, r, s, o) for z, r, s, o in itertools.product(zeros, rcs, sps, offs)]
    combos = tuple(c for c in all_combos if _offload_ok(c.zero, c.offload, profile))
    n_cat = len(all_combos)
    n_off_bad = n_cat - len(combos)
    n_sp_on = sum(1 for c in combos if c.sp)
    rejected = dict.fromkeys(RULES, 0)

    # layouts: (G, tp, pp, cp) with tp*pp*cp | G, crossed with vpp
    rows: list[np.ndarray] = []
    for g in gpus:
        d = divisors(g)
        t = np.asarray(bounds.tp or d, dtype=np.int64)
        p = np.asarray(bounds.pp or d, dtype=np.int64)
        c = np.asarray(bounds.cp or d, dtype=np.int64)
        tt, pp_, cc = (x.ravel() for x in np.meshgrid(t, p, c, indexing="ij"))
        ok = g % (tt * pp_ * cc) == 0
        rows.append(np.stack([np.full(int(ok.sum()), g, dtype=np.int64), tt[ok], pp_[ok], cc[ok]]))
    lay3 = np.concatenate(rows, axis=1) if rows else np.zeros((4, 0), dtype=np.int64)
    vpps = np.asarray(bounds.vpp or divisors(layers), dtype=np.int64)
    mbs = np.asarray(bounds.micro_batch or divisors(global_batch), dtype=np.int64)
    n_mb = len(mbs)
    G = np.repeat(lay3[0], len(vpps))
    TP = np.repeat(lay3[1], len(vpps))
    PP = np.repeat(lay3[2], len(vpps))
    CP = np.repeat(lay3[3], len(vpps))
    VPP = np.tile(vpps, lay3.shape[1])
    DP = G // (TP * PP * CP)
    considered = int(G.size) * n_mb * n_cat

    # layout rules, first broken wins
    code = np.full(G.size, -1, dtype=np.int64)
    inter = VPP > 1
    if schedule == "interleaved":
        sched_bad = ~inter
    elif schedule is not None:  # 1f1b, gpipe, pipedream, pipedream-2bw: one stage per rank
        sched_bad = inter | ((PP == 1) if schedule.startswith("pipedream") else False)
    else:
        sched_bad = np.zeros(G.size, dtype=bool)
    conds = {
        "tp_heads": (heads % TP != 0) | (kv_heads % TP != 0),
        "tp_node": (TP > gpus_per_node) if bounds.tp is None else np.zeros(G.size, dtype=bool),
        "pp_layers": PP > layers,
        "vpp_layers": inter & ((PP == 1) | (layers % (PP * VPP) != 0)),
        "recompute_every_chunks": inter & ((layers // (PP * VPP)) % (recompute_every or 1) != 0),
        "schedule": sched_bad,
        "keep_logits_pp": (PP > 1) if keep_logits != "none" else np.zeros(G.size, dtype=bool),
        "cp_seq": seq % CP != 0,
        "cp_a2a_heads": (np.gcd(heads // TP, kv_heads // TP) % CP != 0) if cp_comm == "a2a"
        else np.zeros(G.size, dtype=bool),
        "cp_mla": (CP > 1) if mla else np.zeros(G.size, dtype=bool),
        "ep": (ep > 1) & ((DP * CP) % ep != 0),
    }
    for i, rule in enumerate(INVALID_LAYOUT_RULES):
        hit = (code < 0) & conds[rule]
        code[hit] = i
        rejected[rule] = int(hit.sum()) * n_mb * n_cat
    valid = code < 0
    G, TP, PP, CP, VPP, DP = G[valid], TP[valid], PP[valid], CP[valid], VPP[valid], DP[valid]
    nl = int(G.size)

    # (layout, micro-batch) pairs, sorted by layout then micro-batch (mbs is sorted)
    lay = np.repeat(np.arange(nl, dtype=np.int64), n_mb)
    mb = np.tile(mbs, nl)
    dp = DP[lay]
    ok = global_batch % (mb * dp) == 0
    rejected["global_batch"] = int((~ok).sum()) * n_cat
    lay, mb, dp = lay[ok], mb[ok], dp[ok]
    rejected["offload_zero"] = int(lay.size) * n_off_bad
    rejected["sp_tp"] = int((TP[lay] == 1).sum()) * n_sp_on
    # rank of each micro-batch within its layout
    start = np.r_[True, lay[1:] != lay[:-1]] if lay.size else np.zeros(0, dtype=bool)
    seg_first = np.flatnonzero(start)
    seg = np.cumsum(start) - 1
    rank = np.arange(lay.size, dtype=np.int64) - seg_first[seg] if lay.size else np.zeros(0, dtype=np.int64)
    return Space(
        considered=considered, rejected=rejected, gpus=G[lay], tp=TP[lay], pp=PP[lay], vpp=VPP[lay], cp=CP[lay],
        dp=dp, micro_batch=mb, grad_accum=global_batch // (mb * dp), layout=lay, rank=rank, combos=combos,
        global_batch=global_batch,
    )
