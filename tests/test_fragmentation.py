"""Caching-allocator fragmentation (memcalc/cost/fragmentation.py): reserved = allocated / (1 - f). Defaults and
their data in docs/methodology.md ("Fragmentation")."""

from __future__ import annotations

import numpy as np
import pytest

from memcalc.cost import fragmentation as F
from memcalc.cost.estimate import estimate
from memcalc.specs import HardwareSpec, ModelSpec, ParallelSpec, TrainingSpec, resolve

HW = HardwareSpec(name="test", memory_bytes=80 * 2**30)
TINY = ModelSpec(name="tiny", hidden=64, layers=4, heads=4, ffn=256, vocab=1000)


def run(profile="torch", gpus=1, zero=0, fragmentation=None):
    t = TrainingSpec(seq=128, fragmentation=fragmentation)
    return resolve(TINY, t, ParallelSpec(gpus=gpus, zero=zero), HW, profile)


@pytest.mark.parametrize("profile,gpus,zero,f", [
    ("torch", 8, 0, 0.03),  # DDP: one compute stream, persistent buckets
    ("torch", 8, 1, 0.03),
    ("torch", 8, 2, 0.05),  # FSDP2: all-gather / reduce-scatter streams
    ("torch", 8, 3, 0.05),
    ("torch", 1, 3, 0.03),  # a shard group of one is not wrapped by FSDP
    ("megatron", 8, 1, 0.06),  # SimuMax: reserved = allocated / 0.94
    ("deepspeed", 8, 2, 0.03),
    ("deepspeed", 8, 3, 0.05),
])
def test_default_fraction(profile, gpus, zero, f):
    assert F.default_fraction(run(profile, gpus, zero)) == f


def test_user_fraction_is_the_share_of_reserved_memory_not_allocated():
    # f = 0.2: reserved = 8e9 / 0.8 = 10e9, fragmentation = 8e9 * 0.2 / 0.8 = 2e9
    r = run(fragmentation=0.2)
    assert F.fragmentation_bytes(r, 8_000_000_000) == 2_000_000_000
    assert F.reserved_bytes(r, 8_000_000_000) == 10_000_000_000
    assert F.fragmentation_bytes(run(fragmentation=0.0), 8_000_000_000) == 0


def test_default_bytes():
    # torch DDP default f = 0.03: 97e9 * 0.03 / 0.97 = 3e9
    assert F.fragmentation_bytes(run(gpus=2), 97_000_000_000) == 3_000_000_000
    assert isinstance(F.fragmentation_bytes(run(gpus=2), 97_000_000_000), int)


def test_arrays_equal_scalars():
    alloc = np.array([0, 1_000_000_007, 79_999_999_999], dtype=np.int64)
    r = run(gpus=2)
    got = F.fragmentation_bytes(r, alloc)
    assert got.dtype == np.int64
    assert [int(x) for x in got] == [F.fragmentation_bytes(r, int(a)) for a in alloc]
    # the torch FSDP default depends on the (array) shard degree
    base = run(gpus=1, zero=3)
    dp = np.array([1, 2, 8], dtype=np.int64)
    arr = base.replace(dp=dp, gpus=dp)
    got = F.fragmentation_bytes(arr, np.full(3, 19_000_000_000, dtype=np.int64))
    want = [F.fragmentation_bytes(run(gpus=int(d), zero=3), 19_000_000_000) for d in dp]
    assert [int(x) for x in got] == want == [587_628_866, 1_000_000_000, 1_000_000_000]


def test_estimate_reports_the_model():
    r = run(gpus=2, zero=3)
    mem = estimate(r, advice=False).memory
    assert mem.components["fragmentation"] == F.fragmentation_bytes(r, mem.allocated_peak_bytes)
    assert mem.peak_bytes == mem.allocated_peak_bytes + mem.components["fragmentation"] + HW.runtime_overhead_bytes
