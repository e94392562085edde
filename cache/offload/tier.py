"""What every KV tier beyond the pool offers the connector (``connector.py``).

A tier stores fixed-size block payloads (one block's K/V in every layer, encoded by
``block_layout.BlockLayout``) under a ``TierKey``: 16 bytes derived from the block's chained
prefix hash and the replica's identity (``identity.tier_key``), so a tier shared by several
models or adapters never hands one of them another's blocks.

``contains`` is asked on the scheduler's thread at admission and must answer from memory
(an index, a mirror of a directory): no I/O. ``get`` and ``put`` run on the connector's
threads and may block on I/O; a tier that fails (lost object, full disk, corrupt file) says
so by returning None for that key or by counting the error, never by raising into a request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Sequence
from typing import Protocol

import numpy as np

TierKey = bytes  # 16 bytes: identity.tier_key(namespace, block_hash)

TIER_NAMES = ("host", "disk", "cluster")  # the order a load tries them in: nearest first
RECENT_LOADS = 256  # load durations a TierStats keeps


@dataclasses.dataclass
class TierStats:
    """One tier's lifetime counters and current use, as metrics and ``raylm status`` show them.

    Hits and misses count blocks a load asked the tier for (a miss ends the run a load takes
    from it); ``errors`` counts failures by kind (``"corrupt"``, ``"lost"``, ``"timeout"``,
    ``"write"``), each of which cost a recompute, never a request."""

    tier: str
    capacity_bytes: int
    stored_bytes: int = 0
    stored_blocks: int = 0
    hits: int = 0
    misses: int = 0
    stored: int = 0  # blocks written into the tier, lifetime
    evicted: int = 0  # blocks dropped to make room, lifetime
    load_bytes: int = 0  # bytes read out of the tier, lifetime
    loads: int = 0  # get() calls, lifetime
    # Seconds of the latest get() calls (at most RECENT_LOADS, newest last): a reader that saw
    # ``loads`` == n before observes the last ``loads - n`` of them (histograms from snapshots).
    recent_load_seconds: list[float] = dataclasses.field(default_factory=list)
    errors: dict[str, int] = dataclasses.field(default_factory=dict)

    def count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def record_load(self, seconds: float) -> None:
        self.loads += 1
        self.recent_load_seconds.append(seconds)
        if len(self.recent_load_seconds) > RECENT_LOADS:
            del self.recent_load_seconds[0]

    def snapshot(self) -> TierStats:
        """A copy that later counting does not change."""
        return dataclasses.replace(self, recent_load_seconds=list(self.recent_load_seconds), errors=dict(self.errors))


def leading_run(keys: Sequence[TierKey], held: Container[TierKey]) -> int:
    """How many of ``keys``, from the first, ``held`` contains: every tier's ``contains``."""
    for i, key in enumerate(keys):
        if key not in held:
            return i
    return len(keys)


class KVTier(Protocol):
    """A store of block payloads behind the connector; see the module docstring for who calls what."""

    name: str  # one of TIER_NAMES

    def contains(self, keys: Sequence[TierKey]) -> int:
        """How many of ``keys``, from the first, the tier holds (answered from memory)."""

    def get(self, keys: Sequence[TierKey]) -> list[np.ndarray | None]:
        """The payloads of ``keys`` (uint8, ``block_nbytes`` each), None where the tier no longer
        has one or it failed its check. May block; never raises for a missing or bad block."""

    def put(self, items: Sequence[tuple[TierKey, np.ndarray]]) -> None:
        """Store payloads, evicting the least recently used beyond the tier's capacity. May
        block; a failed write is counted in ``stats().errors``, never raised."""

    def stats(self) -> TierStats:
        """A snapshot of the counters (``TierStats.snapshot``)."""

    def close(self) -> None:
        """Stop background work; what the tier stored stays where it lives (disk, cluster)."""
