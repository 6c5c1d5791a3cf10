"""Quantities with units, as people write them: sizes (binary), rates and FLOP/s (decimal), durations."""

from __future__ import annotations

import math
import re
from typing import Any

from shardlm.hardware.specs import GiB, MiB, HardwareError

_NUMBER = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([^\s\d].*?)?\s*$")
_SIZE_UNITS = {
    "": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": MiB, "MB": MiB, "MIB": MiB,
    "G": GiB, "GB": GiB, "GIB": GiB, "T": 2**40, "TB": 2**40, "TIB": 2**40,
}
_RATE_UNITS = {"": 1, "B/S": 1, "KB/S": 1e3, "MB/S": 1e6, "GB/S": 1e9, "TB/S": 1e12}
_FLOPS_UNITS = {
    "": 1, "FLOPS": 1, "FLOP/S": 1, "GFLOPS": 1e9, "GFLOP/S": 1e9, "TFLOPS": 1e12, "TFLOP/S": 1e12,
    "PFLOPS": 1e15, "PFLOP/S": 1e15,
}
_SECONDS_UNITS = {"": 1, "S": 1, "MS": 1e-3, "US": 1e-6, "µS": 1e-6, "NS": 1e-9}


def _parse_quantity(value: Any, units: dict[str, float], what: str, example: str) -> float:
    """A non-negative number with an optional unit from ``units`` (case-insensitive), in base units."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise HardwareError(f"expected {what} like {example}, got {_shown(value)}")
    if isinstance(value, (int, float)):
        number, unit = (float(value) if abs(value) < 1e300 else math.inf), ""
    else:
        match = _NUMBER.match(value) if len(value) <= 100 else None
        if match is None:
            raise HardwareError(f"cannot read {_shown(value)} as {what}; write it like {example}")
        number, unit = float(match.group(1)), (match.group(2) or "").upper()
        if unit not in units:
            known = ", ".join(u for u in units if u)
            raise HardwareError(f"unknown unit {match.group(2)!r} in {value!r} for {what}; use one of {known}")
    if number < 0:
        raise HardwareError(f"{what} {_shown(value)} is negative; write it like {example}")
    if not math.isfinite(number) or number * units[unit] > 1e30:  # 1e400 is inf; nothing measured is near 1e30
        raise HardwareError(f"{what} {_shown(value)} is too large; write it like {example}")
    scale = units[unit]
    return number * scale if scale >= 1 else number / round(1 / scale)  # 10 / 1e6, not 10 * 1e-6 (inexact)


def _shown(value: Any) -> str:
    """``value`` as messages show it: repr, cut to a few dozen characters."""
    text = repr(value)
    return text if len(text) <= 42 else f"{text[:40]}... ({len(text)} characters)"


def parse_size(text: str | int | float) -> int:
    """Bytes in a size such as ``"4GB"``, ``"4GiB"``, ``"300MB"``, ``"1.5TB"`` or ``"512"`` (bytes).

    Sizes are binary: ``GB`` means GiB (2**30 bytes), as ``nvidia-smi`` and ``free`` print them, so
    ``"4GB"`` and ``"4GiB"`` are the same 4294967296 bytes. Plain numbers are bytes.
    """
    return int(_parse_quantity(text, _SIZE_UNITS, "a size", "4GB, 300MB or 1.5TB"))


def parse_rate(text: Any) -> float:
    """Bytes/s in a rate such as ``"50GB/s"`` or ``"1.2TB/s"`` (decimal, as datasheets write them)."""
    return _parse_quantity(text, _RATE_UNITS, "a bandwidth in bytes per second", "50GB/s or 1.2TB/s")


def parse_flops(text: Any) -> float:
    """FLOP/s in ``"200TFLOPS"``, ``"500GFLOPS"`` or ``"1PFLOPS"`` (decimal)."""
    return _parse_quantity(text, _FLOPS_UNITS, "a compute rate", "200TFLOPS or 500GFLOPS")


def parse_seconds(text: Any) -> float:
    """Seconds in ``"5us"``, ``"2ms"``, ``"800ns"`` or ``"0.001s"``."""
    return _parse_quantity(text, _SECONDS_UNITS, "a duration", "5us, 2ms or 800ns")


def short_size(n: int) -> str:
    """``4GB`` / ``512MB``: the largest binary unit that divides ``n``, else GB to 0.1 (GB means GiB)."""
    for unit, scale in (("TB", 2**40), ("GB", GiB), ("MB", MiB)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n / GiB:.1f}GB"
