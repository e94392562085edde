"""Persistent XLA compilation cache, so a restarted process skips recompiling its programs."""

from __future__ import annotations

import os
from pathlib import Path

import jax

DEFAULT_CACHE_DIR = Path(os.environ.get("RAYLM_JAX_CACHE", Path.home() / ".cache" / "raylm" / "jax"))


def enable_compilation_cache(path: str | Path = DEFAULT_CACHE_DIR, min_compile_time_s: float = 0.5) -> Path:
    """Point JAX's on-disk compilation cache at ``path`` (created if needed), storing programs
    that took at least ``min_compile_time_s`` to compile. JAX opens its cache once per process,
    so a process moved to another directory resets it, or it would keep using the first one."""
    from jax.experimental.compilation_cache import compilation_cache

    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_s)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
