"""The Pallas (Triton) grouped matmul of the experts, in Pallas interpret mode on the CPU, against
a float64 numpy product per group; and lowered for a GPU to check Triton takes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.model.kernels import grouped_matmul as grouped
from raylm.model.kernels import interpreting_gpu_kernels, lowering_for_every_platform
from raylm.model.kernels.pallas import grouped_matmul as pallas
from raylm.model.quantization.quant_array import QuantArray, quantize


def naive(x, w, sizes) -> np.ndarray:
    """Group ``g``'s rows times ``w[g]`` in float64; rows past the groups zeros."""
    x = np.asarray(x.astype(jnp.float32), np.float64)
    w = np.asarray((w.dequantize() if isinstance(w, QuantArray) else w).astype(jnp.float32), np.float64)
    out, start = np.zeros((x.shape[0], w.shape[1])), 0
    for g, n in enumerate(np.asarray(sizes)):
        out[start:start + n] = x[start:start + n] @ w[g].T
        start += n
    return out


def case(seed, M, K, N, sizes, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), N, K)) / np.sqrt(K), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def test_pair_plan_lists_each_groups_tiles_in_order():
    """Rows 0-69 | 70-99 | none | 100-139, tiles of 64: group 0 spans tiles 0-1, group 1 shares
    tile 1, group 3 spans tiles 1-2; 3 tiles + 4 groups - 1 = 6 program rows, 5 real."""
    group, tile, real = pallas.pair_plan(jnp.asarray([70, 30, 0, 40]), 3, 64)
    assert np.asarray(real).tolist() == [1, 1, 1, 1, 1, 0]
    assert np.asarray(group)[:5].tolist() == [0, 0, 1, 3, 3]
    assert np.asarray(tile)[:5].tolist() == [0, 1, 1, 1, 2]


@pytest.mark.parametrize(
    "M,K,N,sizes",
    [(200, 96, 80, [100, 0, 60, 30]),  # K, N off the tiles; an empty group; 10 padding rows
     (3, 64, 128, [0, 2, 0, 0, 0, 1, 0, 0]),  # a decode step: 3 routed rows, most experts idle
     (130, 128, 256, [64, 64, 2]),  # groups on tile bounds
     (64, 32, 16, [1] * 64)],  # 64 groups of a row each, all in one tile
    ids=["ragged-shapes", "decode", "tile-bounds", "a-row-per-group"],
)
def test_float_experts_match_the_per_group_product(M, K, N, sizes):
    x, w, s = case(1, M, K, N, sizes)
    got = np.asarray(pallas.pallas_grouped_matmul(x, w, s, interpret=True))
    np.testing.assert_allclose(got, naive(x, w, s), rtol=1e-5, atol=1e-5)
    assert np.all(got[int(np.sum(sizes)):] == 0)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_8_bit_experts_are_widened_in_the_kernel(scheme):
    x, w, s = case(2, 120, 96, 80, [50, 0, 40, 20])
    q = quantize(w, scheme, 1)
    np.testing.assert_allclose(np.asarray(pallas.pallas_grouped_matmul(x, q, s, interpret=True)), naive(x, q, s),
                               rtol=1e-5, atol=1e-5)


def test_bfloat16_rows_and_experts_accumulate_in_float32():
    x, w, s = case(3, 100, 128, 64, [30, 70], jnp.bfloat16)
    got = pallas.pallas_grouped_matmul(x, w, s, interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), naive(x, w, s), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("experts", ["bfloat16", "fp8"])
def test_lowers_to_a_triton_kernel_for_a_gpu(experts):
    x, w, s = case(4, 64, 128, 256, [20, 30, 14], jnp.bfloat16)
    stacked = quantize(w.astype(jnp.float32), "fp8", 1) if experts == "fp8" else w
    text = jax.jit(pallas.pallas_grouped_matmul).trace(x, stacked, s).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "raylm_grouped_matmul" in text


def test_grouped_matmul_takes_the_kernel_on_a_gpu_and_ragged_dot_elsewhere():
    """``grouped_matmul(gpu_kernel=True)``: ragged_dot in this CPU process, the kernel inside
    ``interpreting_gpu_kernels`` and when lowered for a GPU; the same numbers either way, for
    experts with two output dims (gate and up, as MoE layers store them)."""
    x, w, s = case(5, 40, 32, 48, [10, 25, 0])
    w = w.reshape(3, 2, 24, 32)
    want = naive(x, w.reshape(3, 48, 32), s).reshape(40, 2, 24)
    cpu = grouped.grouped_matmul(x, w, s, gpu_kernel=True)
    with interpreting_gpu_kernels():
        interpreted = grouped.grouped_matmul(x, w, s, gpu_kernel=True)
    for got in (cpu, interpreted):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    fn = lambda x, w, s: grouped.grouped_matmul(x, w, s, gpu_kernel=True)  # noqa: E731
    assert "triton" not in jax.jit(fn).trace(x, w, s).lower(lowering_platforms=("cpu",)).as_text()
    with lowering_for_every_platform():
        gpu = jax.jit(lambda x, w, s: grouped.grouped_matmul(x, w, s, gpu_kernel=True)).trace(x, w, s).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in gpu
