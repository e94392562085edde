"""The C++ small-batch matmul kernel against float64 numpy, and ``model.kernels.dense``'s choice of path.

Shapes cover every remainder of the kernel's tiling (rows not a multiple of the 3-row or
4-row tile, weight rows not a multiple of the 4-row tile or the 64-row work item, inputs not
a multiple of the 8- or 16-lane vector), the single-threaded and the thread-pool split, and
the projections of the bundled model. A process runs one tile family (16 lanes on AVX-512
CPUs, else 8); ``test_eight_lane_tiles_on_any_cpu`` reruns these checks with the 8-lane
family forced, so an AVX-512 machine checks both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.model.kernels import dense as dense_module
from raylm.model.kernels import lowering_for_every_platform, tracing_targets
from raylm.model.kernels.dense import KERNEL_MAX_ROWS, dense, dense_matmul
from tests.reruns import rerun_in_child

needs_kernel = pytest.mark.skipif(
    not dense_module.available(),
    reason="C++ kernel not built (no compiler or jaxlib headers at install); the XLA path is tested instead",
)


def _operands(m: int, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)


def _reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ w.astype(np.float64).T


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 9, 16, 31, 32])
@pytest.mark.parametrize("n,k", [(1, 8), (5, 3), (7, 24), (67, 45), (130, 64), (960, 576), (576, 1536)])
def test_matches_float64_reference(m, n, k):
    x, w = _operands(m, n, k, seed=m * 1000 + n)
    got = np.asarray(dense_matmul(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_allclose(got, _reference(x, w), rtol=1e-5, atol=1e-5 * np.sqrt(k))


@needs_kernel
@pytest.mark.parametrize("n,k", [(70, 45), (3072, 576)])  # one thread, and split over the pool
def test_a_row_does_not_depend_on_the_rest_of_the_batch(n, k):
    """Greedy output must not change with batching: each row is summed in the same order
    whether it is computed alone or at any place in a batch of any size."""
    x, w = _operands(32, n, k, seed=3)
    x, w = jnp.asarray(x), jnp.asarray(w)
    full = np.asarray(dense_matmul(x, w))
    for m in (1, 2, 4, 5, 17):
        np.testing.assert_array_equal(np.asarray(dense_matmul(x[-m:], w)), full[-m:])
    np.testing.assert_array_equal(np.asarray(dense_matmul(x[7:8], w)), full[7:8])


@needs_kernel
def test_eight_lane_tiles_on_any_cpu():
    """The 8-lane family (what AVX2 CPUs run) is forced by RAYLM_DENSE_NARROW_TILES; on an
    AVX2 CPU this repeats the checks above, on an AVX-512 one it covers the other family."""
    checks = "test_matches_float64_reference or test_a_row_does_not_depend_on_the_rest_of_the_batch"
    rerun_in_child(__file__, checks, {"RAYLM_DENSE_NARROW_TILES": "1"})


@needs_kernel
def test_zero_sized_operands():
    assert dense_matmul(jnp.zeros((2, 8)), jnp.zeros((0, 8))).shape == (2, 0)
    np.testing.assert_array_equal(np.asarray(dense_matmul(jnp.ones((2, 0)), jnp.ones((3, 0)))), np.zeros((2, 3)))


@needs_kernel
def test_rejects_what_it_cannot_compute():
    with pytest.raises(ValueError, match="float32"):
        dense_matmul(jnp.ones((2, 8), jnp.bfloat16), jnp.ones((3, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        dense_matmul(jnp.ones((2, 8)), jnp.ones((3, 9)))


def _lowered(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()


@pytest.mark.parametrize(
    "x_shape,w_shape,contract",
    [((4, 1, 64), (2, 4, 8, 64), 1), ((3, 1, 4, 16), (64, 4, 16), 2), ((72, 64), (96, 64), 1)],
    ids=["fused qkv", "output projection", "a prompt chunk (the prompt GEMM)"],
)
@pytest.mark.parametrize("kernel", [True, False])
def test_dense_matches_tensordot_on_every_path(x_shape, w_shape, contract, kernel):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    want = np.tensordot(np.asarray(x, np.float64), np.asarray(w, np.float64),
                        (list(range(x.ndim - contract, x.ndim)), list(range(w.ndim - contract, w.ndim))))
    fn = functools.partial(dense, contract=contract, kernel=kernel)
    got = np.asarray(jax.jit(fn)(x, w))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    rows = int(np.prod(x_shape[: len(x_shape) - contract]))
    expect_kernel = kernel and dense_module.available()
    lowered = _lowered(fn, x, w)
    assert ("raylm_dense_matmul" in lowered) == expect_kernel
    assert ("raylm_dense_matmul_prompt" in lowered) == (expect_kernel and rows > KERNEL_MAX_ROWS)


def test_dense_takes_xla_for_bfloat16_and_keeps_float32_logits():
    x = jnp.ones((2, 1, 64), jnp.bfloat16)
    w = jnp.ones((100, 64), jnp.bfloat16)
    fn = functools.partial(dense, kernel=True, out_dtype=jnp.float32)
    assert "raylm_dense_matmul" not in _lowered(fn, x, w)
    out = jax.jit(fn)(x, w)
    assert out.dtype == jnp.float32 and out.shape == (2, 1, 100) and np.all(np.asarray(out) == 64)


def test_dense_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="differ in their last 1 dims"):
        dense(jnp.ones((2, 8)), jnp.ones((3, 9)), kernel=True)


@needs_kernel
def test_dense_lowers_for_gpu_to_xla():
    x, w = jnp.ones((4, 64)), jnp.ones((32, 64))
    fn = functools.partial(dense, kernel=True)
    with lowering_for_every_platform():  # (a new function: jit caches a function's trace)
        gpu = jax.jit(functools.partial(dense, kernel=True)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "raylm_dense_matmul" in _lowered(fn, x, w) and "raylm_dense_matmul" not in gpu


@needs_kernel
def test_a_cpu_only_process_traces_the_kernel_branch_alone():
    """Tracing the XLA branch too (``platform_dependent``) doubled a replica's start-up tracing."""
    x, w = jnp.ones((4, 64)), jnp.ones((32, 64))
    assert "platform_index" not in str(jax.make_jaxpr(functools.partial(dense, kernel=True))(x, w))
    with lowering_for_every_platform():  # (a new function: JAX caches a function's trace)
        assert "platform_index" in str(jax.make_jaxpr(functools.partial(dense, kernel=True))(x, w))


@needs_kernel
def test_tracing_targets_renames_the_kernels_calls_inside_only():
    """The kernel A/B benchmarks trace a commit's build through the same code this way."""
    x, w = jnp.ones((4, 64)), jnp.ones((32, 64))
    with tracing_targets({"raylm_dense_matmul": "raylm_other_build"}):  # (a new function each time)
        renamed = jax.jit(functools.partial(dense, kernel=True)).lower(x, w).as_text()
        prompt = jax.jit(functools.partial(dense, kernel=True)).lower(jnp.ones((KERNEL_MAX_ROWS + 1, 64)), w).as_text()
    assert "@raylm_other_build(" in renamed and "@raylm_dense_matmul(" not in renamed
    assert "@raylm_dense_matmul_prompt(" in prompt  # not in the mapping
    assert "@raylm_dense_matmul(" in jax.jit(functools.partial(dense, kernel=True)).lower(x, w).as_text()


def test_without_a_build_xla_runs(unbuilt_kernels):
    x, w = _operands(3, 40, 16)
    assert not dense_module.available()
    with pytest.raises(RuntimeError, match="pip install"):
        dense_matmul(jnp.asarray(x), jnp.asarray(w))
    got = np.asarray(dense(jnp.asarray(x), jnp.asarray(w), kernel=True))
    np.testing.assert_allclose(got, _reference(x, w), rtol=1e-5, atol=1e-5)
