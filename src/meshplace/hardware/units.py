"""Quantities with units, as written in cluster YAML files, and their pretty-printing.

A quantity is a plain number in base units (bytes/s, seconds, bytes, FLOP/s) or a string
``"<number> <unit>"``. Decimal prefixes (k/K, M, G, T, P) are powers of 1000, binary
prefixes (Ki, Mi, Gi, Ti) powers of 1024. A capital ``B`` is a byte, a lower-case ``b`` a bit,
so ``"100 Gb/s"`` is 12.5e9 bytes/s and ``"12 GB/s"`` is 12e9 bytes/s.

>>> parse_quantity("100 Gb/s", "bandwidth")
12500000000.0
>>> parse_quantity("5 us", "time")
5e-06
>>> parse_quantity("32 GiB", "bytes")
34359738368.0
>>> format_bandwidth(12.5e9)
'12.5 GB/s'
"""

from __future__ import annotations

import math
import re
from typing import Literal

QuantityKind = Literal["bandwidth", "time", "bytes", "flops"]

_DEC = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BIN = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}


def _table() -> dict[str, dict[str, float]]:
    bw: dict[str, float] = {}
    size: dict[str, float] = {}
    flops: dict[str, float] = {}
    for p, f in _DEC.items():
        for unit in ("B/s", "Bps", "bytes/s"):
            bw[p + unit] = f
        for unit in ("b/s", "bps", "bit/s"):
            bw[p + unit] = f / 8
        size[p + "B"] = f
        for unit in ("FLOP/s", "FLOPS", "flop/s", "FLOP/S"):
            flops[p + unit] = f
    for p, f in _BIN.items():
        bw[p + "B/s"] = f
        size[p + "B"] = f
    size["bytes"] = 1.0
    time = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}
    return {"bandwidth": bw, "time": time, "bytes": size, "flops": flops}


UNITS: dict[str, dict[str, float]] = _table()
_EXAMPLES = {
    "bandwidth": "a number of bytes/s or a string such as '12 GB/s' or '100 Gb/s'",
    "time": "a number of seconds or a string such as '5 us', '2 ms' or '1e-6 s'",
    "bytes": "a number of bytes or a string such as '16 GiB' or '80 GB'",
    "flops": "a number of FLOP/s or a string such as '15.7 TFLOP/s'",
}
_RE = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([^\s\d].*?)?\s*$")


def parse_quantity(value: object, kind: QuantityKind) -> float:
    """``value`` (a number or a string with a unit) in base units; raises ``ValueError`` with
    one sentence naming the accepted units."""
    if isinstance(value, bool):
        raise ValueError(f"expected {_EXAMPLES[kind]}, not a boolean")
    if isinstance(value, int | float):
        try:
            result = float(value)
        except OverflowError:  # an int beyond float range
            raise ValueError(f"expected a finite value, {_EXAMPLES[kind]}") from None
    elif isinstance(value, str):
        m = _RE.match(value)
        if not m:
            raise ValueError(f"cannot read {value!r} as {_EXAMPLES[kind]}")
        number, unit = m.group(1), m.group(2) or ""
        table = UNITS[kind]
        if unit and unit not in table:
            raise ValueError(
                f"unknown unit {unit!r} in {value!r}; expected {_EXAMPLES[kind]} "
                f"(units: {', '.join(_preferred(kind))})"
            )
        factor = table[unit] if unit else 1.0
        # divide by 1e6 rather than multiply by 1e-6, so "5 us" is exactly 5e-06
        result = float(number) / round(1 / factor) if factor < 1 else float(number) * factor
    else:
        raise ValueError(f"expected {_EXAMPLES[kind]}")
    if not math.isfinite(result):
        raise ValueError(f"expected a finite value, {_EXAMPLES[kind]}")
    return result


def _preferred(kind: str) -> list[str]:
    return {
        "bandwidth": ["B/s", "KB/s", "MB/s", "GB/s", "TB/s", "GiB/s", "Mb/s", "Gb/s", "Tb/s"],
        "time": ["s", "ms", "us", "ns"],
        "bytes": ["B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"],
        "flops": ["FLOP/s", "GFLOP/s", "TFLOP/s", "PFLOP/s"],
    }[kind]


def _fmt(value: float, steps: list[tuple[float, str]], digits: int = 3) -> str:
    if value == math.inf:
        return "inf"
    for factor, unit in steps:
        if abs(value) >= factor:
            return f"{value / factor:.{digits}g} {unit}"
    factor, unit = steps[-1]
    return f"{value / factor:.{digits}g} {unit}"


def format_bandwidth(value: float) -> str:
    """Bytes/s with a decimal prefix: ``'900 GB/s'``."""
    return _fmt(value, [(1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s"), (1, "B/s")])


def format_bytes(value: float) -> str:
    """Bytes with a binary prefix: ``'32 GiB'``."""
    return _fmt(
        value,
        [(2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB"), (1, "B")],
    )


def format_flops(value: float) -> str:
    """FLOP/s with a decimal prefix: ``'123 TFLOP/s'``."""
    return _fmt(
        value,
        [(1e18, "EFLOP/s"), (1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1, "FLOP/s")],
    )


def format_time(value: float) -> str:
    """Seconds with a prefix: ``'5.7 µs'``."""
    if value == 0:
        return "0 s"
    return _fmt(value, [(1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")])
