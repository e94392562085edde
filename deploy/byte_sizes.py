"""Sizes in bytes as a deploy file writes them: a whole number (``1073741824``) or a number with
a unit (``8GiB``, ``512MB``, ``1.5 GiB``).

Binary units are powers of 1024 (``KiB``, ``MiB``, ``GiB``, ``TiB``), decimal ones powers of 1000
(``kB``/``KB``, ``MB``, ``GB``, ``TB``), as IEC and SI define them; ``B`` is one byte; case does not
matter. A bare letter (``8G``, ``512M``) is refused rather than guessed: it means 2^30 to some
tools (``free -g``, Java's ``-Xmx``) and 10^9 to others (Kubernetes, Ray's ``--memory``), a 7%
difference in what a tier may hold. The result must be a whole number of bytes >= 0
(``1.5GiB`` is; ``0.5B`` is not).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Annotated, Any

from pydantic import BeforeValidator

_UNITS = {
    "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*(?P<unit>[A-Za-z]*)\s*")
_UNIT_NAMES = "B, KiB, MiB, GiB, TiB (powers of 1024) or kB, MB, GB, TB (powers of 1000)"


def parse_byte_size(value: Any) -> int:
    """``value`` (an int, a whole float, or a string as the module docstring says) in bytes.
    Raises ValueError saying what was wrong; the deploy schema adds the key's path."""
    if isinstance(value, bool):
        raise ValueError("a size in bytes is a number or a string like '8GiB', not true/false")
    if isinstance(value, int):
        amount = Decimal(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"a size in bytes must be finite, got {value}")
        amount = Decimal(value)
    elif isinstance(value, str):
        amount = _parse_string(value)
    else:
        raise ValueError(f"a size in bytes is a number or a string like '8GiB', not {type(value).__name__}")
    if amount < 0:
        raise ValueError("a size in bytes must be >= 0")
    if amount != amount.to_integral_value():
        raise ValueError(f"a size must be a whole number of bytes, and this is {amount.normalize()} bytes")
    return int(amount)


def _parse_string(text: str) -> Decimal:
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"not a size: write a number of bytes or a number and a unit ({_UNIT_NAMES}), e.g. '8GiB'")
    unit = match["unit"].lower() or "b"
    if unit not in _UNITS:
        hint = ""
        if unit in ("k", "m", "g", "t"):
            hint = f" ('{match['unit']}' alone is ambiguous: write {unit.upper()}iB or {unit.upper()}B)"
        raise ValueError(f"unknown unit '{match['unit']}'{hint}; units: {_UNIT_NAMES}")
    return Decimal(match["number"]) * _UNITS[unit]


# A pydantic field type: accepts what ``parse_byte_size`` does, holds the int.
ByteSize = Annotated[int, BeforeValidator(parse_byte_size)]


def format_bytes(size: float) -> str:
    """``size`` for people, in binary units with one decimal: ``1.5 GiB``, ``512.0 MiB``, ``17 B``."""
    unit, scale = _binary_unit(size)
    return f"{size:.0f} B" if scale == 1 else f"{size / scale:.1f} {unit}"


def format_bytes_of(part: float, whole: float) -> str:
    """``part`` of ``whole`` in ``whole``'s binary unit, one decimal: ``1.2/4.0 GiB``, ``0/512 B``."""
    unit, scale = _binary_unit(whole)
    return f"{part:.0f}/{whole:.0f} B" if scale == 1 else f"{part / scale:.1f}/{whole / scale:.1f} {unit}"


def _binary_unit(size: float) -> tuple[str, int]:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return unit, scale
    return "B", 1
