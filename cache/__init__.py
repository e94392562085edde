"""Paged KV memory: block pool with ref counts, prefix cache (chained block hashes), device KV arrays."""

from cache.block_hash import adapter_salt, block_hashes, hash_block, model_salt
from cache.block_pool import NULL_BLOCK, BlockPool, NoFreeBlocksError, PoolStats

__all__ = [
    "NULL_BLOCK", "BlockPool", "NoFreeBlocksError", "PoolStats", "adapter_salt", "block_hashes", "hash_block",
    "model_salt",
]
