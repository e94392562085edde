"""The order a replica compiles its programs in, and which it compiles before it serves.

A served engine compiles the programs a request alone takes first (one row's decode, and its
prompt chunks in the ``FIRST_PACKED_TOKENS`` bucket when they are packed, any length when not),
serves, and compiles the rest in the background (``raylm.workers.engine.async_engine``): the
larger packed buckets in ascending order, then the smaller ones, so that it rarely meets a cold
one.
"""

from __future__ import annotations

Shape = tuple[str, tuple[int, ...]]  # (program kind, bucket)

# The packed prompt program a served engine compiles before it serves: a 64-token chunk holds a
# chat turn's prompt whole (a shorter one is padded to it until its own bucket is compiled), and
# a longer prompt runs in such chunks until its larger program is (workers/engine/llm_engine.py).
# Each compile before serving delays a restarted or added replica: 0.45-0.8 s a program read back
# from the persistent cache on a 2-core AVX-512 machine, ~2 s on AVX2, 4-7 s cold.
FIRST_PACKED_TOKENS = 64


def first_packed_bucket(token_buckets: list[int]) -> int:
    """The token bucket of ``FIRST_PACKED_TOKENS`` (or the largest there is, if smaller)."""
    return next((n for n in token_buckets if n >= FIRST_PACKED_TOKENS), token_buckets[-1])


def compiled_first(shape: Shape, smallest_rows: int, first_packed: int) -> bool:
    """Whether a served engine compiles this (kind, bucket) before it serves: the packed prompt
    bucket ``first_packed``, and the programs of the smallest row bucket (decode, speculative, a
    padded prefill of any length); no copies."""
    kind, dims = shape
    if kind == "packed":
        return dims[0] == first_packed
    return kind in ("prefill", "decode", "spec") and dims[0] == smallest_rows


def warmup_order(shapes: list[Shape], smallest_rows: int, first_packed: int) -> list[Shape]:
    """``shapes`` in the order to compile them (see the module's docstring)."""
    return sorted(shapes, key=lambda shape: (not compiled_first(shape, smallest_rows, first_packed),
                                             shape[0] != "packed", shape[0] == "packed" and shape[1][0] < first_packed))
