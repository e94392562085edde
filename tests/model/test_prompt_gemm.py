"""The prompt GEMM (calls of more than ``KERNEL_MAX_ROWS`` rows): each row's result is the
small-batch kernel's for that row, bit for bit, on every weight format.

The small-batch kernel is checked against float64 in test_dense_kernel.py, test_quantization.py
and test_gguf_blocks.py; here every row of a 65..601-row call must equal the same row computed
in calls of at most ``KERNEL_MAX_ROWS`` rows (the batch-invariance rule), and GGUF blocks must
give what the float32 matrix of the gguf package's own dequantization gives. The shapes leave
tails everywhere: rows not a multiple of the row tile or of the L2 row block, weight rows not a
multiple of the 4-row tile or of a thread's share, K not a multiple of the 8 or 16 lanes (float32
and 8-bit weights), several panels and row blocks per call (K = 2080-2100) and one thread or
both. ``test_eight_lane_family`` reruns them with the 8-lane tiles forced.
"""

from __future__ import annotations

import gguf.quants
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from raylm.model.kernels import dense as dense_module
from raylm.model.kernels.dense import KERNEL_MAX_ROWS, dense_matmul, gguf_matmul, quantized_matmul
from raylm.model.quantization.gguf_blocks import from_gguf
from raylm.model.quantization.quant_array import quantize
from tests.reruns import rerun_in_child

pytestmark = pytest.mark.skipif(not dense_module.available(), reason="C++ kernel not built; XLA path tested")

# (rows, weight rows, K): one thread with tails everywhere; several panels, row blocks and both threads.
SHAPES = [(65, 67, 45), (601, 150, 2100)]
GGUF_SHAPES = [(65, 67, 64), (601, 150, 2080)]


def _small_batches(matmul, x: jnp.ndarray, w) -> np.ndarray:
    """``matmul`` over ``x`` in calls of at most ``KERNEL_MAX_ROWS`` rows (the small-batch kernel)."""
    parts = [np.asarray(matmul(x[i : i + KERNEL_MAX_ROWS], w)) for i in range(0, x.shape[0], KERNEL_MAX_ROWS)]
    return np.concatenate(parts)


def _activations(m: int, k: int) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(m + k).standard_normal((m, k)), jnp.float32)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_float32_rows_are_the_small_batch_kernels(m, n, k):
    x = _activations(m, k)
    w = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
    got = np.asarray(dense_matmul(x, jnp.asarray(w)))
    np.testing.assert_array_equal(got, _small_batches(dense_matmul, x, jnp.asarray(w)))
    want = np.asarray(x, np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_8bit_rows_are_the_small_batch_kernels(scheme, m, n, k):
    x = _activations(m, k)
    qa = quantize(jnp.asarray(np.random.default_rng(n).standard_normal((n, k)), jnp.float32), scheme)
    got = np.asarray(quantized_matmul(x, qa))
    np.testing.assert_array_equal(got, _small_batches(quantized_matmul, x, qa))
    want = np.asarray(x, np.float64) @ np.asarray(qa.dequantize(), np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k) * float(np.abs(want).max()))


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k", GGUF_SHAPES)
def test_gguf_rows_are_the_float32_matrix_rows(kind, m, n, k):
    """Blocks give the float32 expansion's results through the prompt GEMM too (the gguf
    package's quantizer and dequantizer are the reference for the values)."""
    data = gguf.quants.quantize(np.random.default_rng(n).standard_normal((n, k)).astype(np.float32), kind)
    expanded = jnp.asarray(gguf.quants.dequantize(data, kind).reshape(n, k).astype(np.float32))
    blocks = from_gguf(data, kind, (n, k)).to_device()
    x = _activations(m, k)
    got = np.asarray(gguf_matmul(x, blocks))
    np.testing.assert_array_equal(got, np.asarray(dense_matmul(x, expanded)))
    np.testing.assert_array_equal(got, _small_batches(gguf_matmul, x, blocks))


def test_eight_lane_family():
    """The tests above with the 8-lane tiles forced (what AVX2 CPUs run)."""
    rerun_in_child(__file__, "not eight_lane", {"RAYLM_DENSE_NARROW_TILES": "1"})
