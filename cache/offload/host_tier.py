"""The host tier: block payloads in this process's memory, least recently used evicted first.

On a CPU replica it is a second, larger tier beside the pool (a block evicted from the pool,
or never held there, is loaded back by a memory copy instead of recomputed); on an accelerator
it is the device-to-host offload. It is also where blocks loaded from the disk and cluster tiers
are kept, so the next request on the same prefix finds them nearest.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from raylm.cache.offload.tier import TierKey, TierStats, leading_run


class HostTier:
    """At most ``capacity_bytes`` of payloads in memory."""

    name = "host"

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"the host tier needs a capacity > 0 bytes, got {capacity_bytes}")
        self._blocks: OrderedDict[TierKey, np.ndarray] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._stats = TierStats(self.name, capacity_bytes)

    def contains(self, keys: Sequence[TierKey]) -> int:
        with self._lock:
            return leading_run(keys, self._blocks)

    def get(self, keys: Sequence[TierKey]) -> list[np.ndarray | None]:
        start = time.perf_counter()
        found: list[np.ndarray | None] = []
        with self._lock:
            for key in keys:
                payload = self._blocks.get(key)
                if payload is not None:
                    self._blocks.move_to_end(key)
                    self._stats.hits += 1
                    self._stats.load_bytes += payload.nbytes
                else:
                    self._stats.misses += 1
                found.append(payload)
            self._stats.record_load(time.perf_counter() - start)
        return found

    def put(self, items: Sequence[tuple[TierKey, np.ndarray]]) -> None:
        with self._lock:
            stats = self._stats
            for key, payload in items:
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                if payload.nbytes > stats.capacity_bytes:
                    stats.count_error("too_large")
                    continue
                while stats.stored_bytes + payload.nbytes > stats.capacity_bytes:
                    _, dropped = self._blocks.popitem(last=False)
                    stats.stored_bytes -= dropped.nbytes
                    stats.stored_blocks -= 1
                    stats.evicted += 1
                self._blocks[key] = payload
                stats.stored_bytes += payload.nbytes
                stats.stored_blocks += 1
                stats.stored += 1

    def stats(self) -> TierStats:
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._stats.stored_bytes = self._stats.stored_blocks = 0
