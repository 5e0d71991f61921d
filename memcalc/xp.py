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
    if isinstance(cond, bool):
        return a if cond else b
    import numpy as np

    if np.ndim(cond) == 0:
        return a if bool(cond) else b
    return np.where(cond, a, b)


def as_int(x: Num) -> Num:
    """Round a float (or array of floats) to the nearest int (bytes are ints)."""
    if isinstance(x, (int, float)):
        return int(round(x))
    import numpy as np

    return np.rint(x).astype(np.int64)


def muldiv(a: Num, b: Num, c: Num) -> Num:
    """Exact floor(a * b / c) for non-negative integers: products such as params x 10^12 overflow int64 in the
    planner's bulk mode, so arrays are computed with Python integers (object dtype) and converted back."""
    if _is_scalar(a, b, c):
        return (a * b) // c
    import numpy as np

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
    stacked = np.stack([c.ravel() for c in cols], axis=1)
    uniq, inv = np.unique(stacked, axis=0, return_inverse=True)
    rows = [tuple(fn(*(int(v) for v in row))) for row in uniq]
    vals = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int64)
    for i, r in enumerate(rows):
        vals[i, :len(r)] = r
    return [vals[inv.ravel(), j].reshape(cols[0].shape) for j in range(vals.shape[1])]
