"""Paged attention, portable jnp path: scatter new K/V into the pool, gather through block tables.

The KV pool of one layer is ``[num_blocks, block_size, kv_heads, head_dim]``. A sequence's
logical block ``p`` lives in physical block ``block_tables[b, p]``; block 0 is the null
block, where padding tokens write and which no valid token ever reads.

A quantized pool (``kv_cache_dtype: int8 | fp8``) holds each of K and V as a ``QuantArray``:
8-bit values and one float32 scale per (token, kv head) (``[L, num_blocks, block_size, KVH]``,
kept beside the values so block copies, prefix caching and preemption move them together).
K/V are quantized when written and dequantized when read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from model import kv_write
from model.config import AttentionSpec, ModelConfig
from model.quantization import QUANTIZED_DTYPES, QuantArray, quantize
from model.sharding import TP_AXIS, rules_for, spec_for

# Finite stand-in for -inf so fully masked (padding) rows give a defined softmax, not NaN.
_MASKED = -1e30
# Tokens per KV block unless a pool is made otherwise: the engine's default (EngineArgs.block_size)
# and the single-sequence reference's.
DEFAULT_BLOCK_SIZE = 16


Pool = jax.Array | QuantArray


def pool_dtype(pool: Pool) -> jnp.dtype:
    """A pool's stored element type (int8 / float8_e4m3fn for a quantized pool)."""
    return jnp.dtype(pool.q.dtype if isinstance(pool, QuantArray) else pool.dtype)


@dataclasses.dataclass(frozen=True)
class KVPoolInfo:
    """The KV pool declared once (as jax-llm-examples' ``KVCache.abstract``): allocation
    (``KVCache.create``), sharding (``shardings``) and sizing (``cache.kv_arrays``) read it.

    Each of K and V is ``shape`` of ``dtype`` with a logical name per dim (``axes``, mapped
    onto the mesh by model.sharding's rules); an 8-bit ``dtype`` keeps a float32 scale per
    (token, kv head) beside its values: ``shape[:4]`` over ``axes[:4]``."""

    shape: tuple[int, int, int, int, int]  # [layers, num_blocks, block_size, kv_heads, head_dim]
    dtype: jnp.dtype
    axes: tuple[str, ...] = ("layers", "blocks", "block_slot", "kv_heads", "head_dim")

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_DTYPES

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return self.shape[:4]

    @property
    def nbytes(self) -> int:
        """K and V together, an 8-bit pool's scales included."""
        scales = math.prod(self.scale_shape) * 4 if self.quantized else 0
        return 2 * (math.prod(self.shape) * self.dtype.itemsize + scales)

    def shardings(self, config: ModelConfig, mesh: Mesh) -> NamedSharding | QuantArray:
        """How one of K / V lies on ``mesh`` (a QuantArray of the values' and scales' for an 8-bit pool)."""
        rules = rules_for(config, mesh.shape[TP_AXIS])
        values = NamedSharding(mesh, spec_for(self.axes, rules))
        return QuantArray(values, NamedSharding(mesh, spec_for(self.axes[:4], rules))) if self.quantized else values


class KVCache(NamedTuple):
    """The paged KV pool of all layers: ``k``/``v`` are ``[L, num_blocks, block_size, KVH, Dh]``
    arrays, or QuantArrays of that shape for an 8-bit pool (``KVPoolInfo``)."""

    k: Pool
    v: Pool

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self) -> jnp.dtype:
        """The stored element type (int8 / float8_e4m3fn for a quantized pool)."""
        return pool_dtype(self.k)

    @staticmethod
    def abstract(config: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype,
                 num_layers: int | None = None) -> KVPoolInfo:
        """The pool ``create`` makes, described: ``num_blocks`` (block 0 included, reserved as
        the null block) of ``block_size`` tokens for every layer (or ``num_layers``: one KV
        group's, ``GroupedKV``) and KV head of ``config``."""
        layers = config.num_layers if num_layers is None else num_layers
        shape = (layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        return KVPoolInfo(shape, jnp.dtype(dtype))

    @classmethod
    def create(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype, mesh: Mesh | None = None,
        num_layers: int | None = None,
    ) -> KVCache:
        """The one constructor of a pool: ``abstract``'s, zeroed (scales one), on ``mesh`` by
        its shardings, or without one on the default device."""
        info = cls.abstract(config, num_blocks, block_size, dtype, num_layers)

        def zeros() -> Pool:
            values = jnp.zeros(info.shape, info.dtype)
            return QuantArray(values, jnp.ones(info.scale_shape, jnp.float32)) if info.quantized else values

        make = jax.jit(zeros, out_shardings=info.shardings(config, mesh) if mesh is not None else None)
        return cls(make(), make())


class GroupedKV(NamedTuple):
    """The pools of a model that interleaves sliding and full-attention layers: its
    full-attention layers' and its sliding layers' (each stacked in layer order,
    ``config.kv_group_layers``), with block counts of their own (vLLM's hybrid KV cache): the
    sliding layers need only their window's blocks per sequence, so theirs can be the smaller."""

    full: KVCache
    sliding: KVCache

    @property
    def block_size(self) -> int:
        return self.full.block_size

    @property
    def dtype(self) -> jnp.dtype:
        return self.full.dtype

    @classmethod
    def create(cls, config: ModelConfig, num_blocks: tuple[int, int], block_size: int, dtype: jnp.dtype,
               mesh: Mesh | None = None) -> GroupedKV:
        """``num_blocks``: the full and the sliding group's (block 0 of each is its null block)."""
        return cls(*(KVCache.create(config, n, block_size, dtype, mesh, len(layers))
                     for n, layers in zip(num_blocks, config.kv_group_layers)))


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
    pool: Pool, layer: jax.Array | int, block: jax.Array, offset: jax.Array, values: jax.Array, cpu_kernel: bool = False
) -> Pool:
    """Scatter ``values [B, S, KVH, Dh]`` into ``pool[layer, block, offset]`` in place
    (quantized per token and kv head first, for an 8-bit pool). With ``cpu_kernel`` (a CPU
    program on one device), element types XLA's CPU scatter would upcast, rewriting the
    whole pool, are written by ``model.kv_write``'s kernel."""
    if isinstance(pool, QuantArray):
        quantized = quantize(values, pool.scheme, 1)
        return QuantArray(
            _store(pool.q, layer, block, offset, quantized.q, cpu_kernel),
            pool.scale.at[layer, block, offset].set(quantized.scale),
        )
    return _store(pool, layer, block, offset, values.astype(pool.dtype), cpu_kernel)


def copy_blocks(pool: Pool, src: jax.Array, dst: jax.Array, cpu_kernel: bool = False) -> Pool:
    """``pool`` with blocks ``src [n]`` copied to ``dst [n]`` in every layer (an 8-bit pool's
    scales with its values); every source is read before any block is written. With
    ``cpu_kernel``, as in ``write_kv``."""

    def copy(array: jax.Array) -> jax.Array:
        if not (cpu_kernel and kv_write.wanted(array)):
            return array.at[:, dst].set(array[:, src])
        block_size = array.shape[2]
        block = jnp.repeat(dst, block_size)
        offset = jnp.tile(jnp.arange(block_size, dtype=jnp.int32), dst.shape[0])
        for layer in range(array.shape[0]):  # layers are disjoint: each reads its sources first
            array = kv_write.kv_write(array, layer, block, offset, array[layer, src])
        return array

    return jax.tree.map(copy, pool)


def _store(array: jax.Array, layer: jax.Array | int, block: jax.Array, offset: jax.Array, values: jax.Array,
           cpu_kernel: bool) -> jax.Array:
    if cpu_kernel and kv_write.wanted(array):
        return kv_write.kv_write(array, layer, block, offset, values)
    return array.at[layer, block, offset].set(values)


def gather_blocks(pool: Pool, layer: jax.Array, block_tables: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``pool[layer, block_tables]`` (``[B, P, block_size, KVH, Dh]``), dequantized to ``dtype``
    for an 8-bit pool (one gather of the values and one of the scales, no layer-slice copy)."""
    if isinstance(pool, QuantArray):
        return pool.rows((layer, block_tables), dtype)
    return pool[layer, block_tables]


def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    context_lens: jax.Array,
    valid: jax.Array,
    spec: AttentionSpec | None = None,
) -> jax.Array:
    """Causal GQA attention of queries ``q [B, S, H, Dh]`` over each row's cached keys.

    A query at position ``p`` sees the keys at positions ``0..p`` of its own row (which
    includes the K/V just written for this step), only ``p - window + 1..p`` for a sliding
    ``spec.window``; scores are ``q.k * spec.scale`` (default ``Dh ** -0.5``), soft-capped
    by ``spec.softcap`` (``cap * tanh(s / cap)``) before the mask. Returns ``[B, S, H, Dh]``.
    """
    B, S, H, Dh = q.shape
    spec = spec or AttentionSpec(Dh**-0.5)
    k = gather_blocks(k_pool, layer, block_tables, q.dtype)  # [B, P, bs, KVH, Dh]
    v = gather_blocks(v_pool, layer, block_tables, q.dtype)
    P, bs, KVH = k.shape[1], k.shape[2], k.shape[3]
    # (batch, kv_head) leading, keys next: XLA CPU's batched dot is ~8x faster on this layout
    # than on the gathered one, which is worth one transposing copy.
    k = k.transpose(0, 3, 1, 2, 4).reshape(B, KVH, P * bs, Dh)
    v = v.transpose(0, 3, 1, 2, 4).reshape(B, KVH, P * bs, Dh)
    qg = q.reshape(B, S, KVH, H // KVH, Dh).transpose(0, 2, 3, 1, 4).reshape(B, KVH, -1, Dh)  # [B,KVH,G*S,Dh]

    scores = jnp.einsum("bkqd,bktd->bkqt", qg, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(B, KVH, H // KVH, S, P * bs) * spec.scale
    if spec.softcap is not None:
        scores = jnp.tanh(scores / spec.softcap) * spec.softcap
    key_pos = jnp.arange(P * bs)
    mask = (
        (key_pos[None, None, :] <= positions[:, :, None])
        & (key_pos[None, None, :] < context_lens[:, None, None])
        & valid[:, :, None]
    )  # [B, S, T]
    if spec.window is not None:
        mask &= key_pos[None, None, :] > positions[:, :, None] - spec.window
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(B, KVH, -1, P * bs)
    out = jnp.einsum("bkqt,bktd->bkqd", probs, v, preferred_element_type=jnp.float32)
    out = out.reshape(B, KVH, H // KVH, S, Dh).transpose(0, 3, 1, 2, 4)
    return out.reshape(B, S, H, Dh).astype(q.dtype)
