"""The environment of a Ray cluster that raylm starts or joins on this machine: no usage-stats
upload (nothing outside the package registries may be reachable), no token auth on a local
cluster, and the multi-node emulation flag off. An operator's own environment wins over these
defaults."""

from __future__ import annotations

import os

LOCAL_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def apply_local_ray_env() -> None:
    """Set ``LOCAL_RAY_ENV`` where the environment does not say otherwise (before importing ray)."""
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
