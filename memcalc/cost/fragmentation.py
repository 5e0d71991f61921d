"""Caching-allocator fragmentation: reserved minus allocated. Placeholder until the allocator model lands."""

from __future__ import annotations

from typing import Any

from memcalc.specs import Run


def fragmentation_bytes(run: Run, allocated_peak: Any) -> Any:
    frac = run.training.fragmentation
    if frac is None:
        return 0 * allocated_peak
    # the user's fraction f of reserved memory is not allocated: reserved = allocated / (1 - f)
    return (allocated_peak * frac) // (1 - frac) if isinstance(allocated_peak, int) else allocated_peak * frac / (1 - frac)
