"""Parsing and formatting of counts and byte sizes. Internally every size is an int of bytes.

GiB (2**30) and GB (10**9) are different units and both appear in the literature: the ZeRO paper and the
Ultra-Scale Playbook print GB, DeepSpeed's estimator and Megatron print GiB (labelled "GB"). Every formatter
here says which one it used.
"""

from __future__ import annotations

import math
import re

from memcalc.errors import InputError

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_,]*\.?[0-9]*(?:[eE][+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)

_BYTE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9][0-9_,]*\.?[0-9]*(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

GIB = 2**30
GB = 10**9
UNIT_BYTES = {"GiB": GIB, "GB": GB}


def parse_count(text: str | int | float, what: str = "--params", examples: str = "7B, 1.5e9, 124M") -> int:
    """'7B' -> 7_000_000_000, '1.5e9' -> 1_500_000_000, '175B', '124M', '7,000,000'."""
    if isinstance(text, bool):
        raise InputError(f"{what} {text!r} is not a count; use e.g. {examples}")
    if isinstance(text, int):
        value = float(text)
    elif isinstance(text, float):
        value = text
    else:
        m = _COUNT_RE.match(str(text))
        if not m:
            raise InputError(f"{what} {text!r} is not a count; use e.g. {examples}")
        value = float(m.group(1).replace(",", "").replace("_", "")) * _COUNT_SUFFIX[m.group(2).upper()]
    if not math.isfinite(value) or value < 1:
        raise InputError(f"{what} {text!r} must be a positive count; use e.g. {examples}")
    return int(round(value))


def parse_bytes(text: str | int, what: str = "size") -> int:
    """'80GiB' -> 85899345920, '80GB' -> 80e9, '512MiB', '1e9' (plain number = bytes)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InputError(f"{what} {text!r} must not be negative")
        return text
    m = _BYTES_RE.match(str(text))
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _BYTE_UNITS:
        raise InputError(f"{what} {text!r} is not a size; use e.g. 80GiB, 80GB, 512MiB or a number of bytes")
    value = float(m.group(1).replace(",", "").replace("_", "")) * _BYTE_UNITS[unit]
    if not math.isfinite(value) or value < 0:
        raise InputError(f"{what} {text!r} must be a non-negative size")
    return int(round(value))


def format_count(n: int) -> str:
    """6738415616 -> '6.74B'."""
    for div, suf in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suf}" if n / div < 100 else f"{n / div:.0f}{suf}"
    return str(n)


def format_bytes(n: int, unit: str = "GiB", digits: int = 2) -> str:
    """Bytes in the named unit ('GiB' = 2**30, 'GB' = 10**9), e.g. '12.55 GiB'."""
    return f"{n / UNIT_BYTES[unit]:,.{digits}f} {unit}"
