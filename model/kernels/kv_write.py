"""Writing new K/V into the paged pool in place on CPU when XLA's scatter would not.

XLA's CPU backend has no native scatter for bfloat16, float16 or float8 elements: it upcasts
the scatter, which rewrites the whole pool to store one token (measured on a 2 GiB bfloat16
pool: ~250 ms per layer and step, against ~10 µs for float32 or int8; it made a bfloat16 or
fp8 KV cache serve ~20x slower than float32). ``model/kernels/kv_write.cc`` copies each
token's row into the pool in place instead (the custom call's result aliases the pool). Like
the other kernels it is built by ``pip install``; without it, or off CPU, the scatter runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from raylm.model.kernels import CpuKernel

_KERNEL = CpuKernel("kv_write", "RaylmKvWrite", "raylm_kv_write")
# Element types whose XLA CPU scatter rewrites the whole array (float32 and int8 are in place).
UPCAST_SCATTER_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float8_e4m3fn))


def available() -> bool:
    """Whether the C++ kernel is built and registered with JAX (CPU only)."""
    return _KERNEL.available()


def wanted(pool: jax.Array) -> bool:
    """Whether a CPU program should write ``pool`` through the kernel."""
    return jnp.dtype(pool.dtype) in UPCAST_SCATTER_DTYPES and available()


def kv_write(pool: jax.Array, layer: jax.Array | int, block: jax.Array, offset: jax.Array,
             values: jax.Array) -> jax.Array:
    """``pool [L, num_blocks, block_size, KVH, Dh]`` with ``values [..., KVH, Dh]`` stored at
    ``[layer, block, offset]`` (``block``/``offset`` of ``values``' leading shape), by the
    kernel, in place when the caller donates the pool. Raises if the kernel is unavailable."""
    _KERNEL.require()
    kvh, head_dim = pool.shape[3:]
    rows = values.reshape(-1, kvh, head_dim).astype(pool.dtype)
    call = jax.ffi.ffi_call(_KERNEL.target, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0})
    return call(pool, jnp.asarray(layer, jnp.int32).reshape(()), block.reshape(-1).astype(jnp.int32),
                offset.reshape(-1).astype(jnp.int32), rows)
