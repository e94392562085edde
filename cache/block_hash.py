"""Chained prefix hashes of full KV blocks, identical in every process.

The router hashes a prompt to pick the replica that already caches its prefix, and
the replica's block pool hashes the same tokens to find the cached blocks; both must
agree, so the hash is blake2b over explicitly little-endian packed integers, never
Python's per-process salted ``hash()``. Hash ``i`` covers the parent hash (and thus
every token of blocks ``0..i-1``), the salt (e.g. the model id, so two models never
share blocks) and the block's own tokens.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import blake2b

_HASH_BYTES = 8  # 64-bit hashes: cheap to store and ship, collisions negligible at cache sizes


def _digest(parent_hash: int | None, salt: bytes, tokens: bytes) -> int:
    h = blake2b(digest_size=_HASH_BYTES)
    # A marker byte keeps "no parent" distinct from a parent hash that happens to be 0;
    # the salt is length-prefixed so salt bytes can never be mistaken for token bytes.
    if parent_hash is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + parent_hash.to_bytes(_HASH_BYTES, "little"))
    h.update(len(salt).to_bytes(4, "little") + salt)
    h.update(tokens)
    return int.from_bytes(h.digest(), "little")


def _pack(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def hash_block(parent_hash: int | None, token_ids: Sequence[int], salt: str = "") -> int:
    """Hash one block's tokens chained onto its predecessor's hash (``None`` for block 0)."""
    return _digest(parent_hash, salt.encode(), _pack(token_ids))


def block_hashes(
    token_ids: Sequence[int], block_size: int, salt: str = "", parent: int | None = None
) -> list[int]:
    """One chained hash per full block of ``token_ids``; a trailing partial block gets none.

    ``parent`` continues a chain, e.g. to hash only the blocks a sequence filled since the
    last call. Packs all full blocks at once and slices, so long prompts hash fast.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_full = len(token_ids) // block_size
    packed = memoryview(_pack(token_ids[: num_full * block_size]))
    salt_bytes = salt.encode()
    stride = block_size * 8
    hashes: list[int] = []
    for i in range(num_full):
        parent = _digest(parent, salt_bytes, packed[i * stride : (i + 1) * stride])
        hashes.append(parent)
    return hashes


def adapter_salt(salt: str, adapter: str | None) -> str:
    """The salt of blocks computed with LoRA adapter ``adapter`` (its ``LoRARequest.cache_key``;
    None: the base model):
    an adapter changes every layer's K/V, so its blocks never match the base model's or another
    adapter's."""
    return salt if adapter is None else f"{salt}:lora:{adapter}"


def model_salt(model: str, dtype: str, quantization: str = "none") -> str:
    """The salt of a served model's block hashes: the engine and the router must agree on it.
    Quantized weights compute other K/V, so they hash apart."""
    return f"{model}:{dtype}" if quantization == "none" else f"{model}:{dtype}:{quantization}"
