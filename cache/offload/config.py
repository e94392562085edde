"""``engine.kv_offload``: which tiers a replica keeps KV blocks in beyond its pool, sized in bytes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class KVOffloadConfig:
    """Each tier is on when its size is > 0 (the disk tier also needs a path).

    ``host_bytes``: this replica's memory for blocks beyond the pool. ``cluster_bytes``: what the
    cluster tier (Ray's object store, one directory per Ray namespace) may hold in all; replicas
    asking for different sizes get the largest. ``disk_path`` / ``disk_bytes``: a local directory
    that survives restarts. ``load_timeout_s``: a load from the cluster tier taking longer is
    given up and its blocks are computed instead."""

    host_bytes: int = 0
    cluster_bytes: int = 0
    disk_path: str | None = None
    disk_bytes: int = 0
    load_timeout_s: float = 10.0

    @classmethod
    def parse(cls, value: KVOffloadConfig | Mapping[str, Any] | None) -> KVOffloadConfig | None:
        """A config from the deploy file's mapping (unknown keys are errors naming them); None
        or a config with no tier on: offload is off."""
        if value is None or isinstance(value, KVOffloadConfig):
            config = value
        else:
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"kv_offload: unknown key(s) {unknown}; known: {sorted(known)}")
            config = cls(**value)
        return config if config is not None and config.enabled else None

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.cluster_bytes > 0 or self.disk_bytes > 0

    def __post_init__(self) -> None:
        for name in ("host_bytes", "cluster_bytes", "disk_bytes"):
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"kv_offload.{name} must be a whole number of bytes >= 0, got {size!r}")
        if self.disk_bytes > 0 and not self.disk_path:
            raise ValueError("kv_offload.disk_bytes is set but kv_offload.disk_path is not: name the directory")
        if self.disk_path and self.disk_bytes == 0:
            raise ValueError("kv_offload.disk_path is set but kv_offload.disk_bytes is 0: give the disk tier a size")
        if not self.load_timeout_s > 0:
            raise ValueError(f"kv_offload.load_timeout_s must be > 0 seconds, got {self.load_timeout_s!r}")
