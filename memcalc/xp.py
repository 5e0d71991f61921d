"""Arithmetic that works the same on Python ints (estimate) and numpy int64 arrays (plan's bulk mode).

The cost model branches with `if` only on categorical choices (profile, ZeRO stage, recompute mode, ...).
Numeric layout values (dp, tp, pp, vpp, cp, ep, micro-batch, accumulation steps, the stage index) may be arrays
when the planner evaluates many layouts at once, so the cost model uses only these helpers, arithmetic and `//`
on them. numpy is imported only when an array is actually passed: `estimate` never loads it.
"""

from __future__ import annotations

from typing import Any

Num = Any  # int | numpy.ndarray


_SCALAR_TYPES = frozenset((int, float, bool))


def _is_scalar(*xs: Any) -> bool:
    # exact type test: the hot path of every cost function (numpy scalars take the numpy route)
    for x in xs:
        if type(x) not in _SCALAR_TYPES:
            return False
    return True


def cdiv(a: Num, b: Num) -> Num:
    """Ceiling division of non-negative integers (a shard of a buffer padded to equal parts)."""
    return -((-a) // b)


def imin(a: Num, b: Num) -> Num:
    if type(a) in _SCALAR_TYPES and type(b) in _SCALAR_TYPES:
        return a if a <= b else b
    import numpy as np

    return np.minimum(a, b)


def imax(a: Num, b: Num) -> Num:
    if type(a) in _SCALAR_TYPES and type(b) in _SCALAR_TYPES:
        return a if a >= b else b
    import numpy as np

    return np.maximum(a, b)


def where(cond: Any, a: Num, b: Num) -> Num:
    """`a if cond else b`, elementwise when cond is an array."""
    if type(cond) is bool or not getattr(cond, "ndim", 0):  # a Python or numpy scalar
        return a if cond else b
    import numpy as np

    return np.where(cond, a, b)


def as_int(x: Num) -> Num:
    """Round a float (or array of floats) to the nearest int (bytes are ints)."""
    if isinstance(x, (int, float)):
        return int(round(x))
    import numpy as np

    return np.rint(x).astype(np.int64)


def muldiv(a: Num, b: Num, c: Num) -> Num:
    """Exact floor(a * b / c) for integers, c > 0. Products such as params x 10^12 overflow int64 in the planner's
    bulk mode, so int64 arrays take a float64 estimate q0 of the quotient and correct it: a * b - q0 * c, computed
    modulo 2^64 (numpy's int64 arrays wrap), is the true remainder while that is small, and q0 + remainder // c is
    the floor. Anything else goes through Python integers (object dtype)."""
    if _is_scalar(a, b, c):
        return (a * b) // c
    import numpy as np

    ia, ib, ic = np.asarray(a), np.asarray(b), np.asarray(c)
    if ia.dtype.kind == ib.dtype.kind == ic.dtype.kind == "i":
        prod = ia.astype(np.float64) * ib
        est = prod / ic
        # float64 rounding: |q0 - q| <= |a * b / c| * 2^-51 + 1, so |a * b - q0 * c| <= |a * b| * 2^-51 + 2c, which
        # these bounds keep under 2^63; the quotient itself must fit int64
        if (np.max(np.abs(prod)) < 2.0**100 and np.max(np.abs(est)) < 2.0**62
                and np.min(ic) > 0 and np.max(ic) < 2**61):
            q0 = np.floor(est).astype(np.int64)
            with np.errstate(over="ignore"):
                rem = ia * ib - q0 * ic  # exact modulo 2^64
            q = q0 + rem // ic
            return q if q.ndim else int(q)
    obj = (np.asarray(a, dtype=object) * b) // c
    return np.asarray(obj, dtype=np.int64) if np.ndim(obj) else int(obj)


def per_value(fn: Any, *args: Num) -> Num:
    """fn(*args) for Python ints; for arrays, fn of each distinct combination of the broadcast arguments (for
    the rare term with no closed form, such as a greedy partition), mapped back elementwise."""
    if _is_scalar(*args):
        return fn(*args)
    return per_value_tuple(lambda *a: (fn(*a),), *args)[0]


def per_value_tuple(fn: Any, *args: Num) -> list[Num]:
    """As per_value for an fn that returns a tuple of ints: a list of its items for Python ints; for arrays, one
    array per position, the tuples of combinations that return fewer items padded with zeros."""
    if _is_scalar(*args):
        return list(fn(*args))
    import numpy as np

    cols = np.broadcast_arrays(*(np.asarray(a, dtype=np.int64) for a in args))
    if cols[0].ndim == 0:
        return list(fn(*(int(c) for c in cols)))
    # the distinct combinations: each column's distinct values, and one mixed-radix key per element over their
    # indices (np.unique over rows sorts them lexicographically, several times slower)
    key = np.zeros(cols[0].size, dtype=np.int64)
    values = []
    for c in cols:
        u, i = np.unique(c.ravel(), return_inverse=True)
        key = key * u.size + i.ravel()
        values.append(u)
    ukey, inv = np.unique(key, return_inverse=True)
    digits = []
    for u in reversed(values):
        digits.append(u[ukey % u.size])
        ukey = ukey // u.size
    rows = [tuple(fn(*(int(v) for v in row))) for row in zip(*reversed(digits))]
    vals = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int64)
    for i, r in enumerate(rows):
        vals[i, :len(r)] = r
    return [vals[inv.ravel(), j].reshape(cols[0].shape) for j in range(vals.shape[1])]
