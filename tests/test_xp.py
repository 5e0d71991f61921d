"""The array-polymorphic helpers the planner's bulk mode relies on (memcalc/xp.py, timeline._highest): each array
result must equal the Python-int computation element by element."""

from __future__ import annotations

import numpy as np
import pytest

from memcalc.cost.timeline import _highest
from memcalc.xp import muldiv, per_value_tuple, where


def _ref_muldiv(a, b, c) -> list[int]:
    cols = np.broadcast_arrays(np.asarray(a, dtype=object), np.asarray(b, dtype=object), np.asarray(c, dtype=object))
    return [int(x) * int(y) // int(z) for x, y, z in zip(*(col.ravel() for col in cols))]


def test_muldiv_products_beyond_int64() -> None:
    # `--params 7B` scales element counts by 7e9 / shape_params: the products pass 2^63 (9.2e18)
    shape = 6_738_415_616  # Llama-2-7B's own count
    a = np.array([0, 1, 3, 202_383_360, 6_738_415_616, 7_000_000_000, 2**40 + 7], dtype=np.int64)
    got = muldiv(a, 7_000_000_000, shape)
    assert got.dtype == np.int64
    assert got.tolist() == _ref_muldiv(a, 7_000_000_000, shape)
    assert int(got[4]) == 7_000_000_000  # the whole shape scales to exactly N
    # 2^40 + 7 elements: (2^40 + 7) * 7e9 = 7.7e21, far beyond int64; floor of the exact quotient
    assert int(got[6]) == (2**40 + 7) * 7_000_000_000 // shape


def test_muldiv_random_against_python_ints() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        n = int(rng.integers(1, 40))
        a = rng.integers(-(2**40), 2**62, n)
        b = int(rng.integers(0, 2**62)) if rng.random() < 0.5 else rng.integers(0, 2**40, n)
        c = int(rng.integers(1, 2**60)) if rng.random() < 0.7 else rng.integers(1, 2**40, n)
        want = _ref_muldiv(a, b, c)
        if max(abs(w) for w in want) >= 2**63:  # not an int64 result (the next test)
            continue
        assert np.asarray(muldiv(a, b, c)).tolist() == want


def test_muldiv_scalars_and_huge_values_take_python_ints() -> None:
    assert muldiv(7, 3, 2) == 10
    # a quotient beyond int64 cannot be an int64 array: Python integers say so rather than wrap
    with pytest.raises(OverflowError):
        muldiv(np.array([2**62], dtype=np.int64), 2**62, 1)


def test_per_value_tuple_matches_each_element() -> None:
    rng = np.random.default_rng(1)

    def fn(*xs: int) -> tuple[int, ...]:
        return tuple(sum(xs) * (j + 1) + xs[0] for j in range(1 + xs[0] % 3))  # 1-3 items

    for _ in range(300):
        n = int(rng.integers(1, 200))
        args = [rng.integers(0, int(rng.integers(1, 20)), n) if rng.random() < 0.8 else int(rng.integers(0, 5))
                for _ in range(int(rng.integers(1, 6)))]
        args[0] = np.broadcast_to(np.asarray(args[0]), (n,))
        got = per_value_tuple(fn, *args)
        cols = np.broadcast_arrays(*(np.asarray(a) for a in args))
        ref = [fn(*(int(col[i]) for col in cols)) for i in range(n)]
        assert len(got) == max(len(r) for r in ref)
        for j, col in enumerate(got):
            assert col.tolist() == [r[j] if j < len(r) else 0 for r in ref]


def test_where_on_python_and_numpy_scalars() -> None:
    assert where(True, 1, 2) == 1 and where(False, 1, 2) == 2
    assert where(np.bool_(True), 1, 2) == 1 and where(np.int64(0), 1, 2) == 2
    assert where(np.array(True), 1, 2) == 1
    assert where(np.array([True, False]), 1, 2).tolist() == [1, 2]


def test_highest_elementwise_equals_per_configuration() -> None:
    # three moments over four configurations; configuration 2 ties moments 0 and 2 (the first wins), and
    # configuration 3 is a tie of all three at the same total with different components
    m0 = {"a": np.array([5, 1, 4, 3]), "b": 1}
    m1 = {"a": np.array([1, 9, 2, 2]), "b": np.array([0, 0, 0, 2])}
    m2 = {"a": np.array([2, 0, 3, 1]), "b": np.array([0, 3, 2, 3])}
    got = _highest(m0, m1, m2)
    for i in range(4):
        scalar = [{k: int(np.broadcast_to(v, (4,))[i]) for k, v in m.items()} for m in (m0, m1, m2)]
        want = _highest(*scalar)
        assert {k: int(got[k][i]) for k in got} == want
    assert got["a"].tolist() == [5, 9, 4, 3] and got["b"].tolist() == [1, 0, 1, 1]
