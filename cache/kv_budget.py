"""How many KV blocks a memory budget holds, from the pool's declaration
(``raylm.model.decoder.kv_pool``: ``KVCache.abstract`` describes a pool, ``create`` makes it)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.kv_pool import KVCache

DEFAULT_CPU_KV_BYTES = 2 << 30


def bytes_per_block(config: ModelConfig, block_size: int, dtype: jnp.dtype, num_layers: int | None = None) -> int:
    """K and V of one block across all layers, or ``num_layers`` of them (one KV group's; an
    8-bit pool's scales included)."""
    return KVCache.abstract(config, 1, block_size, dtype, num_layers).nbytes


def kv_budget_bytes(memory_bytes: int | None, memory_fraction: float, device: jax.Device | None = None) -> int:
    """The KV pools' budget: ``memory_bytes`` if given; on accelerators a fraction of free memory;
    else 2 GiB."""
    device = device or jax.local_devices()[0]
    if memory_bytes is not None:
        return memory_bytes
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * memory_fraction)
    return DEFAULT_CPU_KV_BYTES


def blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: jnp.dtype, memory_bytes: int | None, memory_fraction: float,
    device: jax.Device | None = None, draft_config: ModelConfig | None = None,
) -> int:
    """Pool size for the budget (``kv_budget_bytes``). A speculative draft model's pool (as many
    blocks, its own layers) shares the budget."""
    memory_bytes = kv_budget_bytes(memory_bytes, memory_fraction, device)
    per_block = bytes_per_block(config, block_size, dtype)
    if draft_config is not None:
        per_block += bytes_per_block(draft_config, block_size, dtype)
    return _at_least_two(memory_bytes // per_block, memory_bytes, block_size, per_block)


def group_blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: jnp.dtype, memory_bytes: int | None, memory_fraction: float,
    sliding_blocks: int, device: jax.Device | None = None, draft_config: ModelConfig | None = None,
    stage_layers: Sequence[tuple[int, ...]] | None = None,
) -> tuple[int, int]:
    """The full-attention and the sliding group's block counts for a model whose sliding layers
    keep a KV group of their own (``model.GroupedKV``): the sliding group gets ``sliding_blocks``
    (what its sequences can hold at once), no more than an even split (as many blocks for each
    group) would give it, and the full group the rest of the budget; a draft model's pool (as
    many blocks as the full group's: it reads that group's table) shares it. ``stage_layers``:
    each pipeline stage's layers per group (every stage's pools have these block counts, so
    each stage must fit the budget; a stage may hold no layer of a group), else ``config``'s."""
    memory_bytes = kv_budget_bytes(memory_bytes, memory_fraction, device)
    draft = bytes_per_block(draft_config, block_size, dtype) if draft_config is not None else 0
    stages = stage_layers or [tuple(len(layers) for layers in config.kv_group_layers)]
    per_block = [(bytes_per_block(config, block_size, dtype, full) + draft,
                  bytes_per_block(config, block_size, dtype, sliding)) for full, sliding in stages]
    sliding = max(2, min(sliding_blocks, *(memory_bytes // (f + s) for f, s in per_block)))
    full = min((memory_bytes - sliding * s) // f for f, s in per_block if f)
    return _at_least_two(full, memory_bytes, block_size, max(f + s for f, s in per_block)), sliding


def _at_least_two(blocks: int, memory_bytes: int, block_size: int, per_block: int) -> int:
    if blocks < 2:
        raise ValueError(
            f"a KV budget of {memory_bytes} bytes holds {blocks} blocks of {block_size} tokens; "
            f"one block needs {per_block} bytes: raise the budget"
        )
    return int(blocks)
