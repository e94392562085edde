"""Paged attention, portable jnp path: scatter new K/V into the pool, gather through block tables.

The KV pool of one layer is ``[num_blocks, block_size, kv_heads, head_dim]``. A sequence's
logical block ``p`` lives in physical block ``block_tables[b, p]``; block 0 is the null
block, where padding tokens write and which no valid token ever reads.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Finite stand-in for -inf so fully masked (padding) rows give a defined softmax, not NaN.
_MASKED = -1e30


class KVCache(NamedTuple):
    """The paged KV pool of all layers: ``k``/``v`` are ``[L, num_blocks, block_size, KVH, Dh]``."""

    k: jax.Array
    v: jax.Array

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
        sharding: jax.sharding.Sharding | None = None,
    ) -> "KVCache":
        """A zeroed pool (block 0 included, reserved as the null block), placed on ``sharding``."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return cls(make(), make())


def slot_indices(
    positions: jax.Array, block_tables: jax.Array, valid: jax.Array, block_size: int
) -> tuple[jax.Array, jax.Array]:
    """Physical (block, offset) where each token's K/V goes; padding goes to the null block."""
    logical_block = jnp.clip(positions // block_size, 0, block_tables.shape[1] - 1)
    block = jnp.take_along_axis(block_tables, logical_block, axis=1)
    block = jnp.where(valid, block, 0)
    offset = jnp.where(valid, positions % block_size, 0)
    return block, offset


def write_kv(
    pool: jax.Array, layer: jax.Array, block: jax.Array, offset: jax.Array, values: jax.Array
) -> jax.Array:
    """Scatter ``values [B, S, KVH, Dh]`` into ``pool[layer, block, offset]`` in place."""
    return pool.at[layer, block, offset].set(values.astype(pool.dtype))


def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    context_lens: jax.Array,
    valid: jax.Array,
) -> jax.Array:
    """Causal GQA attention of queries ``q [B, S, H, Dh]`` over each row's cached keys.

    A query at position ``p`` sees the keys at positions ``0..p`` of its own row (which
    includes the K/V just written for this step). Returns ``[B, S, H, Dh]``.
    """
    B, S, H, Dh = q.shape
    k = k_pool[layer, block_tables]  # [B, P, bs, KVH, Dh], one gather (no layer-slice copy)
    v = v_pool[layer, block_tables]
    P, bs, KVH = k.shape[1], k.shape[2], k.shape[3]
    # (batch, kv_head) leading, keys next: XLA CPU's batched dot is ~8x faster on this layout
    # than on the gathered one, which is worth one transposing copy.
    k = k.transpose(0, 3, 1, 2, 4).reshape(B, KVH, P * bs, Dh)
    v = v.transpose(0, 3, 1, 2, 4).reshape(B, KVH, P * bs, Dh)
    qg = q.reshape(B, S, KVH, H // KVH, Dh).transpose(0, 2, 3, 1, 4).reshape(B, KVH, -1, Dh)  # [B,KVH,G*S,Dh]

    scores = jnp.einsum("bkqd,bktd->bkqt", qg, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(B, KVH, H // KVH, S, P * bs) * (Dh**-0.5)
    key_pos = jnp.arange(P * bs)
    mask = (
        (key_pos[None, None, :] <= positions[:, :, None])
        & (key_pos[None, None, :] < context_lens[:, None, None])
        & valid[:, :, None]
    )  # [B, S, T]
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(B, KVH, -1, P * bs)
    out = jnp.einsum("bkqt,bktd->bkqd", probs, v, preferred_element_type=jnp.float32)
    out = out.reshape(B, KVH, H // KVH, S, Dh).transpose(0, 3, 1, 2, 4)
    return out.reshape(B, S, H, Dh).astype(q.dtype)
