"""The device KV pool's size and element type: blocks for a memory budget, the dtype a
``kv_cache_dtype`` setting stores (``model.KVCache.abstract`` declares the pool, ``create``
makes it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model import KVCache, ModelConfig

DEFAULT_CPU_KV_BYTES = 2 << 30
# ``kv_cache_dtype`` settings: ``auto`` (or unset) stores K/V in the model dtype; int8 / fp8
# store them 8-bit with a float32 scale per (token, kv head).
KV_CACHE_DTYPES: dict[str, jnp.dtype] = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "int8": jnp.dtype(jnp.int8),
    "fp8": jnp.dtype(jnp.float8_e4m3fn),
}


def kv_pool_dtype(kv_cache_dtype: str | None, model_dtype: jnp.dtype) -> jnp.dtype:
    """The pool's element type for a ``kv_cache_dtype`` setting (``auto``/None: the model's)."""
    if kv_cache_dtype in (None, "auto"):
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def bytes_per_block(config: ModelConfig, block_size: int, dtype: jnp.dtype) -> int:
    """K and V of one block across all layers (an 8-bit pool's scales included)."""
    return KVCache.abstract(config, 1, block_size, dtype).nbytes


def blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: jnp.dtype, memory_bytes: int | None, memory_fraction: float,
    device: jax.Device | None = None, draft_config: ModelConfig | None = None,
) -> int:
    """Pool size: ``memory_bytes`` if given; on accelerators a fraction of free memory; else 2 GiB.
    A speculative draft model's pool (as many blocks, its own layers) shares the budget."""
    device = device or jax.local_devices()[0]
    if memory_bytes is None:
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and "bytes_limit" in stats:
            memory_bytes = int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * memory_fraction)
        else:
            memory_bytes = DEFAULT_CPU_KV_BYTES
    per_block = bytes_per_block(config, block_size, dtype)
    if draft_config is not None:
        per_block += bytes_per_block(draft_config, block_size, dtype)
    blocks = memory_bytes // per_block
    if blocks < 2:
        raise ValueError(
            f"a KV budget of {memory_bytes} bytes holds {blocks} blocks of {block_size} tokens; "
            f"one block needs {per_block} bytes: raise the budget"
        )
    return int(blocks)
