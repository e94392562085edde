"""The paged KV cache's home: host bookkeeping of the pool (ref counts, free queue, prefix
cache: ``block_pool``), chained block hashes (``block_hash``), each sequence's block tables
(``block_tables``), and the pool's size for a memory budget (``kv_budget``).

The device arrays' layout (shape, element type, sharding) is declared once, by the decoder
that reads them: ``raylm.model.decoder.kv_pool``; everything here sizes and allocates from
that declaration.
"""

from raylm.cache.block_hash import adapter_salt, block_hashes, hash_block, model_salt
from raylm.cache.block_pool import NULL_BLOCK, BlockPool, NoFreeBlocksError, PoolStats

__all__ = [
    "NULL_BLOCK", "BlockPool", "NoFreeBlocksError", "PoolStats", "adapter_salt", "block_hashes", "hash_block",
    "model_salt",
]
