"""The C++ K/V write kernel against XLA's scatter (``write_kv``'s portable path), bit for bit.

Pools are random in every element type a pool can hold; writes land in several layers,
shuffled blocks, partial blocks and the null block (padding), with duplicates only there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.model.decoder.attention import copy_blocks, write_kv
from raylm.model.kernels import kv_write
from raylm.model.quantization.quant_array import QuantArray

needs_kernel = pytest.mark.skipif(
    not kv_write.available(),
    reason="C++ kernel not built (no compiler or jaxlib headers at install); the scatter runs instead",
)
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.int8]
SHAPE = (3, 9, 16, 2, 64)  # [L, num_blocks, block_size, KVH, Dh]


def _pool(rng: np.random.Generator, dtype, shape: tuple[int, ...] = SHAPE) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) * 4, jnp.float32).astype(dtype)


def _writes(rng: np.random.Generator, tokens: int = 21, rows: int = 3,
            shape: tuple[int, ...] = SHAPE) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``[rows, tokens // rows]`` distinct (block, offset) slots, padding (block 0) in every row."""
    slots = rng.permutation(np.arange(16, (shape[1]) * shape[2]))[:tokens]
    block, offset = (slots // shape[2]).reshape(rows, -1), (slots % shape[2]).reshape(rows, -1)
    block[:, -1] = offset[:, -1] = 0  # a padding token per row writes the null block
    values = rng.standard_normal((rows, tokens // rows, *shape[3:])) * 4
    return jnp.asarray(block, jnp.int32), jnp.asarray(offset, jnp.int32), jnp.asarray(values, jnp.float32)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layer", [0, 2])
def test_the_kernel_writes_what_the_scatter_writes(dtype, layer):
    rng = np.random.default_rng(layer)
    pool = _pool(rng, dtype)
    block, offset, values = _writes(rng)
    expected = np.asarray(pool.at[layer, block, offset].set(values.astype(dtype)))
    got = np.asarray(jax.jit(kv_write.kv_write, static_argnums=1)(pool, layer, block, offset, values))
    # Bits, not values: NaN-free either way, and fp8 compares exactly as bytes.
    as_bits = lambda a: a.view(np.uint8)
    assert (as_bits(got[:, 1:]) == as_bits(expected[:, 1:])).all()
    assert (as_bits(got[:layer]) == as_bits(np.asarray(pool)[:layer])).all()  # other layers untouched


@needs_kernel
@pytest.mark.parametrize("kv_heads,head_dim", [(4, 128), (1, 256), (3, 80), (2, 96)])
def test_head_sizes_of_every_family(kv_heads, head_dim):
    """A token's row is KVH x Dh elements copied whole, whatever the head size."""
    shape = (2, 9, 16, kv_heads, head_dim)
    rng = np.random.default_rng(head_dim)
    pool = _pool(rng, jnp.bfloat16, shape)
    block, offset, values = _writes(rng, shape=shape)
    expected = np.asarray(pool.at[1, block, offset].set(values.astype(jnp.bfloat16)))
    got = np.asarray(jax.jit(kv_write.kv_write, static_argnums=1)(pool, 1, block, offset, values))
    assert (got[:, 1:].view(np.uint16) == expected[:, 1:].view(np.uint16)).all()


@needs_kernel
def test_an_undonated_pool_is_left_as_it_was():
    rng = np.random.default_rng(7)
    pool = _pool(rng, jnp.bfloat16)
    before = np.asarray(pool).copy()
    block, offset, values = _writes(rng)
    written = jax.jit(kv_write.kv_write, static_argnums=1)(pool, 1, block, offset, values)
    assert (np.asarray(pool).view(np.uint16) == before.view(np.uint16)).all()
    assert not (np.asarray(written).view(np.uint16) == before.view(np.uint16)).all()


@needs_kernel
def test_slots_outside_the_pool_are_skipped_and_the_layer_is_clamped():
    pool = jnp.zeros(SHAPE, jnp.bfloat16)
    block = jnp.array([SHAPE[1], 3, -1], jnp.int32)
    offset = jnp.array([0, SHAPE[2], 2], jnp.int32)
    out = kv_write.kv_write(pool, 99, block, offset, jnp.ones((3, *SHAPE[3:])))
    assert not np.asarray(out.astype(jnp.float32)).any()
    out = kv_write.kv_write(pool, 99, jnp.array([4]), jnp.array([5]), jnp.ones((1, *SHAPE[3:])))
    assert np.asarray(out[-1, 4, 5].astype(jnp.float32)).all() and not np.asarray(out[:-1].astype(jnp.float32)).any()


@needs_kernel
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_write_kv_with_the_kernel_equals_it_without_on_8bit_pools(scheme):
    rng = np.random.default_rng(3)
    dtype = jnp.int8 if scheme == "int8" else jnp.float8_e4m3fn
    pool = QuantArray(_pool(rng, dtype), jnp.asarray(rng.random(SHAPE[:4]), jnp.float32))
    block, offset, values = _writes(rng)
    step = jax.jit(write_kv, static_argnums=(1, 5))
    plain, kernel = step(pool, 1, block, offset, values, False), step(pool, 1, block, offset, values, True)
    assert (np.asarray(plain.q[:, 1:]).view(np.uint8) == np.asarray(kernel.q[:, 1:]).view(np.uint8)).all()
    assert (np.asarray(plain.scale[:, 1:]) == np.asarray(kernel.scale[:, 1:])).all()


def test_only_element_types_that_xla_cpu_upcasts_take_the_kernel():
    for dtype, wanted in [(jnp.float32, False), (jnp.int8, False), (jnp.bfloat16, True), (jnp.float16, True),
                          (jnp.float8_e4m3fn, True)]:
        assert kv_write.wanted(jnp.zeros((1,), dtype)) == (wanted and kv_write.available()), dtype


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_block_copies_with_the_kernel_equal_the_scatters(dtype):
    """Every layer; a chain (3 -> 5 and 5 -> 7: 7 gets 5's old contents) and null-block padding."""
    rng = np.random.default_rng(11)
    pool = _pool(rng, dtype)
    if jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)):
        pool = QuantArray(pool, jnp.asarray(rng.random(SHAPE[:4]), jnp.float32))
    src, dst = jnp.array([3, 5, 1, 0], jnp.int32), jnp.array([5, 7, 8, 0], jnp.int32)
    step = jax.jit(copy_blocks, static_argnums=3)
    plain, kernel = step(pool, src, dst, False), step(pool, src, dst, True)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(kernel)):
        assert (np.asarray(a).view(np.uint8) == np.asarray(b).view(np.uint8)).all()
    first = jax.tree.leaves(pool)[0]
    assert (np.asarray(jax.tree.leaves(kernel)[0][:, 7]).view(np.uint8)
            == np.asarray(first[:, 5]).view(np.uint8)).all()
