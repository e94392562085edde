"""Paged decode attention through a C++ CPU kernel (``jax.ffi``), with the jnp path as fallback.

XLA's CPU backend runs ``model.attention.paged_attention`` by gathering each row's whole
bucketed block-table width, copying it to a dot-friendly layout and softmaxing over the
padding, so decode attention costs the bucket, not the context. The kernel in
``model/kernels/paged_decode_attention.cc`` walks only each row's real blocks and reads K/V
in place from the pool. It is built by ``pip install`` (setup.py) when a C++ compiler is
there; without it, ``available()`` is False, one warning says why, and ``decode_attention``
runs the jnp reference instead. Under tensor parallelism call it per shard (``shard_map``
over the kv-head axis): XLA cannot partition a custom call by itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.attention import paged_attention
from model.kernels import CpuKernel

_KERNEL = CpuKernel("paged_decode_attention", "RaylmPagedDecodeAttention", "raylm_paged_decode_attention")
SUPPORTED_POOL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def available() -> bool:
    """Whether the C++ kernel is built and registered with JAX (CPU only)."""
    return _KERNEL.available()


def paged_decode_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    block_tables: jax.Array,
    context_lens: jax.Array,
) -> jax.Array:
    """One decode query per row ``q [B, H, Dh]`` over its paged keys, by the C++ kernel.

    ``k_pool``/``v_pool`` are ``[L, num_blocks, block_size, KVH, Dh]`` (float32 or bfloat16,
    read in place at ``layer``); row ``b`` sees its first ``context_lens[b]`` keys through
    ``block_tables [B, P]`` (for a decode token at position ``p``: ``p + 1``; 0 for a padding
    row, which gets zeros). Computes in float32, returns ``[B, H, Dh]`` in ``q``'s dtype.
    Raises if the kernel is unavailable or the pool dtype unsupported; ``decode_attention``
    falls back instead.
    """
    _KERNEL.require()
    if k_pool.dtype not in SUPPORTED_POOL_DTYPES or v_pool.dtype != k_pool.dtype:
        raise ValueError(
            f"paged decode attention kernel takes float32 or bfloat16 pools, got k {k_pool.dtype} "
            f"and v {v_pool.dtype}; use decode_attention() to fall back to the jnp path"
        )
    call = jax.ffi.ffi_call(_KERNEL.target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32),
        k_pool,
        v_pool,
        jnp.asarray(layer, jnp.int32).reshape(()),
        block_tables.astype(jnp.int32),
        context_lens.astype(jnp.int32),
    )
    return out.astype(q.dtype)


def reference_decode_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    block_tables: jax.Array,
    context_lens: jax.Array,
) -> jax.Array:
    """The same contract as ``paged_decode_attention``, by the portable jnp ``paged_attention``."""
    valid = (context_lens > 0)[:, None]
    positions = (context_lens - 1)[:, None]
    out = paged_attention(q[:, None], k_pool, v_pool, layer, block_tables, positions, context_lens, valid)
    return jnp.where(valid[:, :, None], out[:, 0], 0).astype(q.dtype)


def decode_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    block_tables: jax.Array,
    context_lens: jax.Array,
) -> jax.Array:
    """Decode attention by the kernel when it can run here (CPU, built, dtype), else by jnp.

    The choice of platform is made when the program is lowered, so the same traced function
    also lowers for GPU/TPU (to the jnp path).
    """
    args = (q, k_pool, v_pool, layer, block_tables, context_lens)
    if not available() or k_pool.dtype not in SUPPORTED_POOL_DTYPES or v_pool.dtype != k_pool.dtype:
        return reference_decode_attention(*args)
    return jax.lax.platform_dependent(*args, cpu=paged_decode_attention, default=reference_decode_attention)
