"""The identity a block's bytes depend on, and the keys tiers store blocks under.

A block hash (``raylm.cache.block_hash``) covers the block's tokens, every token before it,
the model name, dtype, quantization and LoRA adapter: enough inside one replica, whose pool
layout is fixed. A tier outlives replicas and is shared by all of them, so its key also covers
what makes the same tokens produce other bytes: the weights themselves (two checkpoints served
under one name), the KV pool's element type, the block size, a draft model sharing the block
tables, and the pool's layout (``BlockLayout.signature``).
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

from raylm.cache.offload.tier import TierKey

KEY_BYTES = 16


def namespace(*parts: str) -> bytes:
    """A digest of the identity ``parts`` (e.g. ``cache_salt``, ``kv=int8``, ``bs=16``, the weights'
    fingerprint, the layout signature): blocks of one namespace are interchangeable bit for bit."""
    h = blake2b(digest_size=KEY_BYTES)
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(4, "little") + data)
    return h.digest()


def group_namespace(space: bytes, group: int) -> bytes:
    """The namespace of KV group ``group``'s blocks (a model whose sliding-window layers keep a
    group of their own stores both groups' blocks under one block hash): group 0's is ``space``
    itself, so a model with one group keeps its keys."""
    return space if group == 0 else namespace(space.hex(), f"kv_group={group}")


def tier_key(space: bytes, block_hash: int) -> TierKey:
    """The key of the block with chained hash ``block_hash`` in namespace ``space``."""
    return blake2b(space + block_hash.to_bytes(8, "little"), digest_size=KEY_BYTES).digest()


def tier_keys(space: bytes, block_hashes: Sequence[int]) -> list[TierKey]:
    return [tier_key(space, h) for h in block_hashes]
