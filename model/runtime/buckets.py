"""Shape arithmetic for static-shape buckets: jitted programs compile once per bucket, so
lengths, row counts and block-table widths are rounded up to powers of two."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (how many blocks of ``b`` hold ``a`` tokens)."""
    return -(-a // b)


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest power of two >= n (at least ``minimum``), capped at ``maximum``."""
    return min(maximum, max(minimum, next_power_of_two(n)))


def power_buckets(minimum: int, maximum: int) -> list[int]:
    """Every bucket ``bucket`` can return for ``minimum`` and ``maximum``, ascending."""
    out, b = [], bucket(1, minimum, maximum)
    while True:
        out.append(b)
        if b >= maximum:
            return out
        b = min(maximum, b * 2)
