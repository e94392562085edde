"""Persistent XLA compilation cache, so a restarted process skips recompiling its programs."""

from __future__ import annotations

import os
from pathlib import Path

import jax

DEFAULT_CACHE_DIR = Path(os.environ.get("RAYLM_JAX_CACHE", Path.home() / ".cache" / "raylm" / "jax"))


def enable_compilation_cache(path: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """Point JAX's on-disk compilation cache at ``path`` (created if needed)."""
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
