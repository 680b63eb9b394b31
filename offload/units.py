"""Byte counts for people: the one formatter that offload's errors, the estimate's tables and the benchmarks share."""

from __future__ import annotations

_BINARY = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_SI = (("GB", 10**9), ("MB", 10**6), ("kB", 10**3))
_SCALE = dict(_BINARY + _SI)


def fmt_bytes(nbytes: float, *, si: bool = False, digits: int = 1, unit: str | None = None) -> str:
    """`nbytes` in the largest unit it reaches, e.g. '1.5 MiB' (below 1 KiB: '512 B').

    si=True counts in powers of 1000 (kB, MB, GB: the units budgets are often given in, e.g. "8GB");
    `digits` decimals; `unit` ("MB", "GiB", ...) fixes the unit, so that a column of a table compares
    at a glance. An unbounded budget (inf) reads 'unbounded', a missing measurement (nan) 'n/a'.
    """
    if nbytes != nbytes:
        return "n/a"
    if nbytes == float("inf"):
        return "unbounded"
    if unit is not None:
        return f"{nbytes / _SCALE[unit]:.{digits}f} {unit}"
    for name, scale in _SI if si else _BINARY:
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{digits}f} {name}"
    return f"{nbytes:.0f} B"
