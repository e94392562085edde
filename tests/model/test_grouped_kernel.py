"""The grouped (MoE expert) kernels: 8-bit and GGUF block experts read as stored give the
float32 grouped kernel's results on their widened weights, bit for bit (8-bit: times the
scale of each row's expert), and all of them match float64 numpy per group.

Groups cover an empty first and middle group, a one-row group (the dense kernel's direct
path), groups of several row tiles plus a remainder (its panel path) and padding rows past
the groups; weights cover inputs that are not a multiple of the 8- or 16-lane vector (8-bit),
weight rows that are not a multiple of the 4-row tile, and a split over the thread pool. A
process runs one tile family; ``test_eight_lane_family_too`` reruns these with the 8-lane one
forced, so an AVX-512 machine checks both.
"""

from __future__ import annotations

import gguf.quants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType

import raylm.model.kernels.grouped_matmul as grouped
from raylm.model.loaders.hf_quantized_matrix import BlockScaled
from raylm.model.quantization.gguf_blocks import GgufBlocks, from_gguf, map_rows
from raylm.model.quantization.quant_array import QuantArray, quantize
from tests.reruns import rerun_in_child

needs_kernel = pytest.mark.skipif(not grouped.available(), reason="the C++ kernels are not built")
SIZES = [0, 9, 1, 0, 7, 5]  # 22 of 24 rows
ROWS = 24
# (weight rows N, inputs K): tile remainders with one thread; a split over the pool.
SHAPES = [(7, 96), (130, 576)]


def _kernel(x: jax.Array, w, sizes: list[int]) -> np.ndarray:
    run = jax.jit(lambda x, w, s: grouped.grouped_matmul(x, w, s, kernel=True))
    return np.asarray(run(x, w, jnp.asarray(sizes, jnp.int32)))


def _float64_groups(x: np.ndarray, w: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Each group's rows times its matrix in float64; zeros past the groups."""
    y = np.zeros((x.shape[0], w.shape[1]), np.float64)
    start = 0
    for g, rows in enumerate(sizes):
        y[start: start + rows] = x[start: start + rows].astype(np.float64) @ w[g].astype(np.float64).T
        start += rows
    return y


def _row_groups(sizes: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes)


@needs_kernel
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("n,k", [(7, 45), *SHAPES])  # 45: a 5-wide (8 lanes) / 13-wide (16 lanes) k tail
def test_8bit_experts_are_the_float32_kernel_on_their_values_times_the_scale(scheme, n, k):
    rng = np.random.default_rng(n + k)
    w = quantize(jnp.asarray(rng.standard_normal((len(SIZES), n, k)), jnp.float32), scheme)
    x = jnp.asarray(rng.standard_normal((ROWS, k)), jnp.float32)
    got = _kernel(x, w, SIZES)
    widened = _kernel(x, w.q.astype(jnp.float32), SIZES)  # exact: every 8-bit value is a float32
    used = sum(SIZES)
    scale = np.asarray(w.scale)[_row_groups(SIZES)]
    np.testing.assert_array_equal(got[:used], widened[:used] * scale)
    assert not got[used:].any()
    np.testing.assert_allclose(got, _float64_groups(np.asarray(x), np.asarray(w.dequantize()), SIZES),
                               rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", SHAPES)
def test_block_experts_are_the_float32_kernel_on_their_dequantized_values(kind, n, k):
    rng = np.random.default_rng(n + k)
    stack = rng.standard_normal((len(SIZES), n, k)).astype(np.float32)
    data = gguf.quants.quantize(stack, kind)  # rows of blocks, as llama.cpp stores stacked experts
    blocks = from_gguf(data, kind, stack.shape).to_device()
    values = gguf.quants.dequantize(data, kind).reshape(stack.shape).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((ROWS, k)), jnp.float32)
    got = _kernel(x, blocks, SIZES)
    np.testing.assert_array_equal(got, _kernel(x, jnp.asarray(values), SIZES))
    np.testing.assert_allclose(got, _float64_groups(np.asarray(x), values, SIZES), rtol=1e-5, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
def test_fp8_block_experts_are_the_float32_kernel_on_their_dequantized_values(n, k):
    """Experts of a block-scaled FP8 checkpoint (DeepSeek-V3's), each held as fp8 blocks."""
    rng = np.random.default_rng(n + k)
    stack = rng.standard_normal((len(SIZES), n, k)).astype(np.float32)
    experts = []
    for w in stack:
        scale = (np.abs(w).max() / 448 * rng.uniform(1.0, 1.5, (-(-n // 128), -(-k // 128)))).astype(np.float32)
        q = (w / np.repeat(np.repeat(scale, 128, 0), 128, 1)[:n, :k]).astype(jnp.float8_e4m3fn)
        experts.append(BlockScaled(q, scale, (128, 128)).blocks())
    blocks = map_rows(lambda *m: np.stack(m), *experts)
    assert isinstance(blocks, GgufBlocks) and blocks.fp8
    values = np.asarray(blocks.dequantize())
    x = jnp.asarray(rng.standard_normal((ROWS, k)), jnp.float32)
    got = _kernel(x, blocks.to_device(), SIZES)
    np.testing.assert_array_equal(got, _kernel(x, jnp.asarray(values), SIZES))
    np.testing.assert_allclose(got, _float64_groups(np.asarray(x), values, SIZES), rtol=1e-5, atol=1e-3)


@needs_kernel
def test_eight_lane_family_too():
    """The tests above with the 8-lane tiles forced (what AVX2 CPUs run)."""
    rerun_in_child(__file__, "float32_kernel", {"RAYLM_DENSE_NARROW_TILES": "1"})


def test_ragged_dot_path_computes_the_same_products():
    """Without the kernel (sharded programs, accelerators): 8-bit experts converted and scaled
    per row's expert after ragged_dot, blocks dequantized; padding rows zero."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((ROWS, 64)), jnp.float32)
    sizes = jnp.asarray(SIZES, jnp.int32)
    stack = rng.standard_normal((len(SIZES), 2, 5, 64)).astype(np.float32)
    int8 = quantize(jnp.asarray(stack), "int8")
    data = gguf.quants.quantize(stack, GGMLQuantizationType.Q4_0)
    blocks = from_gguf(data, GGMLQuantizationType.Q4_0, stack.shape).to_device()
    values = gguf.quants.dequantize(data, GGMLQuantizationType.Q4_0).reshape(len(SIZES), 10, 64)
    for w, matrices in ((int8, np.asarray(int8.dequantize()).reshape(len(SIZES), 10, 64)), (blocks, values)):
        got = np.asarray(jax.jit(lambda x, w, s: grouped.grouped_matmul(x, w, s))(x, w, sizes))
        assert got.shape == (ROWS, 2, 5)
        np.testing.assert_allclose(got.reshape(ROWS, 10), _float64_groups(np.asarray(x), matrices, SIZES),
                                   rtol=1e-5, atol=1e-4)


@needs_kernel
def test_kernel_rejects_mismatched_operands():
    x = jnp.ones((4, 64), jnp.float32)
    sizes = jnp.asarray([4], jnp.int32)
    with pytest.raises(ValueError, match="grouped_matmul takes"):
        grouped.grouped_matmul(x, jnp.ones((2, 3, 64)), sizes, kernel=True)
    with pytest.raises(ValueError, match="grouped_matmul takes"):
        grouped.grouped_matmul(x, QuantArray(jnp.ones((1, 3, 64), jnp.int8), jnp.ones((1,))), sizes, kernel=True)


def _raw_gguf_call(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, supers: np.ndarray) -> np.ndarray:
    """The grouped GGUF kernel's FFI target called as it is, past ``grouped_matmul``'s checks: x [4, 64]
    in groups of 1 and 3 rows -> y [4, 3]."""
    grouped._GGUF_KERNEL.require()
    call = jax.ffi.ffi_call(grouped._GGUF_KERNEL.target, jax.ShapeDtypeStruct((4, 3), jnp.float32))
    return np.asarray(call(jnp.ones((4, 64)), q, scale, offset, supers, jnp.asarray([1, 3], jnp.int32),
                           jnp.zeros((0,), jnp.float32)))


_NIBBLES, _NO_SUPERS = np.zeros((2, 3, 32), np.uint8), np.zeros((2, 3, 0), np.float32)
_TABLE = np.stack([np.ones((3, 2), np.float32), 2 * np.ones((3, 2), np.float32)])  # expert 1's scales and offsets: 2
_BAD_OPERANDS = {
    "a row short": (np.zeros((2, 3, 31), np.uint8), _TABLE, _TABLE, _NO_SUPERS),
    "an expert's rows unlike the scales'": (np.zeros((2, 4, 32), np.uint8), _TABLE, _TABLE, _NO_SUPERS),
    "no offset for 4-bit blocks": (_NIBBLES, _TABLE, np.zeros((2, 3, 0), np.float32), _NO_SUPERS),
    "two-level supers for float32 tables": (_NIBBLES, _TABLE, _TABLE, np.zeros((2, 3, 2), np.float32)),
}


@needs_kernel
@pytest.mark.parametrize("why", list(_BAD_OPERANDS))
def test_kernel_itself_names_the_operands_it_takes(why):
    """The handler's own check (gguf_operands.h, shared with the dense kernel): bad stacks get an
    error that says what they must be and what they are, never a read past them."""
    good = _raw_gguf_call(_NIBBLES, _TABLE, _TABLE, _NO_SUPERS)
    assert (good == np.asarray([[64.0] * 3] + [[128.0] * 3] * 3)).all()  # expert 0's w = 1, expert 1's w = 2
    expected = r"grouped_gguf_matmul: q \[G, N, K/2\] uint8 .* got K 64, q \["
    with pytest.raises(jax.errors.JaxRuntimeError, match=expected):
        _raw_gguf_call(*_BAD_OPERANDS[why])
