"""The paged KV pool, declared once: its shape, element type, sharding and allocation.

The KV pool of one layer is ``[num_blocks, block_size, kv_heads, head_dim]``, stacked over
layers. A sequence's logical block ``p`` lives in physical block ``block_tables[b, p]``; block
0 is the null block, where padding tokens write and which no valid token ever reads.

A quantized pool (``kv_cache_dtype: int8 | fp8``) holds each of K and V as a ``QuantArray``:
8-bit values and one float32 scale per (token, kv head) (``[L, num_blocks, block_size, KVH]``,
kept beside the values so block copies, prefix caching and preemption move them together).

A model with DeepSeek's latent attention (``config.mla``) keeps one array only, the ``k`` of a
``KVCache`` whose ``v`` is None: per token and layer its latent and shared rotary key
(``kv_lora_rank + qk_rope_head_dim`` values, one "KV head"), from which every head's keys and
values are computed (model/decoder/latent_attention.py).

The decoder reads and writes pools through this declaration (``attention``); the engine
allocates them (``KVCache.create``), and ``raylm.cache.kv_budget`` sizes them from
``KVPoolInfo.nbytes``. A ``kv_cache_dtype`` setting is read here, once (``kv_pool_dtype``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from raylm.model.config.model_config import ModelConfig
from raylm.model.quantization.quant_array import QUANTIZED_DTYPES, QuantArray
from raylm.model.runtime.sharding import TP_AXIS, rules_for, spec_for

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
    (``KVCache.create``), sharding (``shardings``) and sizing (``cache.kv_budget``) read it.

    Each of K and V is ``shape`` of ``dtype`` with a logical name per dim (``axes``, mapped
    onto the mesh by model.runtime.sharding's rules); an 8-bit ``dtype`` keeps a float32 scale per
    (token, kv head) beside its values: ``shape[:4]`` over ``axes[:4]``."""

    shape: tuple[int, int, int, int, int]  # [layers, num_blocks, block_size, kv_heads, head_dim]
    dtype: jnp.dtype
    axes: tuple[str, ...] = ("layers", "blocks", "block_slot", "kv_heads", "head_dim")
    latent: bool = False  # one array (MLA's latents), no separate V

    @property
    def num_arrays(self) -> int:
        """Arrays of ``shape`` the pool holds: K and V, or MLA's latents alone."""
        return 1 if self.latent else 2

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_DTYPES

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return self.shape[:4]

    @property
    def nbytes(self) -> int:
        """K and V together (or MLA's latents), an 8-bit pool's scales included."""
        scales = math.prod(self.scale_shape) * 4 if self.quantized else 0
        return self.num_arrays * (math.prod(self.shape) * self.dtype.itemsize + scales)

    def shardings(self, config: ModelConfig, mesh: Mesh) -> NamedSharding | QuantArray:
        """How one of K / V lies on ``mesh`` (a QuantArray of the values' and scales' for an 8-bit pool)."""
        rules = rules_for(config, mesh.shape[TP_AXIS])
        values = NamedSharding(mesh, spec_for(self.axes, rules))
        return QuantArray(values, NamedSharding(mesh, spec_for(self.axes[:4], rules))) if self.quantized else values


class KVCache(NamedTuple):
    """The paged KV pool of all layers: ``k``/``v`` are ``[L, num_blocks, block_size, KVH, Dh]``
    arrays, or QuantArrays of that shape for an 8-bit pool (``KVPoolInfo``); for latent
    attention ``k`` holds the latents and ``v`` is None."""

    k: Pool
    v: Pool | None

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
        if config.mla is not None:
            return KVPoolInfo((layers, num_blocks, block_size, 1, config.mla.latent_dim), jnp.dtype(dtype), latent=True)
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
        return cls(make(), None if info.latent else make())


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


def create_pools(config: ModelConfig, blocks: tuple[int, int | None], block_size: int, dtype: jnp.dtype,
                 mesh: Mesh | None = None) -> KVCache | GroupedKV:
    """A replica's (or pipeline stage's) pools for ``blocks``: the pool's block count, and the
    sliding group's (None: one pool for every layer)."""
    num_blocks, sliding_blocks = blocks
    if sliding_blocks is None:
        return KVCache.create(config, num_blocks, block_size, dtype, mesh)
    return GroupedKV.create(config, (num_blocks, sliding_blocks), block_size, dtype, mesh)


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
