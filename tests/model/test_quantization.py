"""Weight-only quantization: quantize's error bounds, the C++ kernel on 8-bit weights against
float64 and bit for bit, ``dense``'s choice of path, whole-model quantization and sharding.

Kernel shapes cover the remainders of its tiling (3-row x 4-weight-row tiles, 8-lane vectors
over k with a scalar tail, 64-row work items), both the direct path (one row widens weights
in registers) and the panel path (several rows share a widened float32 panel), and the
single-threaded and thread-pool split.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.decoder.params import (
    LAYER_AXES,
    LAYER_MATRIX_INPUT_DIMS,
    MODEL_AXES,
    MODEL_MATRIX_INPUT_DIMS,
    LayerParams,
    ModelParams,
)
from raylm.model.kernels import dense as dense_module
from raylm.model.kernels.dense import KERNEL_MAX_ROWS as MAX_ROWS
from raylm.model.kernels.dense import dense, quantized_matmul
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.quantization.quant_array import (
    SCHEMES,
    QuantArray,
    parse_quantization,
    quantize,
    quantize_params,
    weight_bytes,
)
from raylm.model.runtime.sharding import make_mesh, param_shardings, rules_for, shard_params, spec_for

needs_kernel = pytest.mark.skipif(
    not dense_module.available(),
    reason="C++ kernel not built (no compiler or jaxlib headers at install); the XLA path is tested instead",
)

STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
RANGE = {"int8": 127.0, "fp8": 448.0}
FP8_MIN_NORMAL = 2.0**-6  # float8_e4m3fn: smallest normal; subnormals step by 2^-9
FP8_SUBNORMAL_STEP = 2.0**-9


def _lowered(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()


def _exact(qa: QuantArray) -> np.ndarray:
    """The weight a QuantArray stands for, in float64 (q * scale without rounding)."""
    q = np.asarray(qa.q).astype(np.float64)
    scale = np.asarray(qa.scale, np.float64).reshape(*qa.scale.shape, *(1,) * qa.num_input_dims)
    return q * scale


def _channel_scale(qa: QuantArray) -> np.ndarray:
    """The scale broadcast to q's shape."""
    scale = np.asarray(qa.scale, np.float64).reshape(*qa.scale.shape, *(1,) * qa.num_input_dims)
    return np.broadcast_to(scale, qa.shape)


def _assert_within_bounds(w: np.ndarray, qa: QuantArray, scheme: str) -> None:
    """Per-element round-trip error bounds of ``quantize``'s per-channel absmax scheme."""
    w = np.asarray(w, np.float64)
    deq = np.asarray(qa.dequantize(), np.float64)
    err = np.abs(deq - w)
    scale = _channel_scale(qa)
    if scheme == "int8":
        bound = scale * (0.5 + 1e-5)  # round to nearest, plus float32 slack in w / scale and q * scale
        assert np.all(err <= bound), f"worst int8 error / scale: {np.max(err / scale)}"
    else:
        normal = np.abs(w) >= FP8_MIN_NORMAL * scale * (1 + 1e-6)
        # Three mantissa bits: half an ulp is at most 2^-4 of the value.
        rel_bound = (2.0**-4 + 1e-6) * np.abs(w)
        worst = np.max(err[normal] / np.abs(w[normal]), initial=0.0)
        assert np.all(err[normal] <= rel_bound[normal]), f"worst fp8 relative error: {worst}"
        # Below the normal range the grid is uniform: half the smallest subnormal step.
        abs_bound = scale * FP8_SUBNORMAL_STEP / 2 * (1 + 1e-5)
        assert np.all(err[~normal] <= abs_bound[~normal])


def _check_structure(w: np.ndarray, qa: QuantArray, scheme: str, num_input_dims: int) -> None:
    out_shape = w.shape[: w.ndim - num_input_dims]
    assert isinstance(qa, QuantArray)
    assert qa.q.dtype == STORAGE[scheme] and qa.q.shape == w.shape
    assert qa.scale.dtype == jnp.float32 and qa.scale.shape == out_shape
    assert qa.shape == w.shape and qa.num_input_dims == num_input_dims and qa.scheme == scheme
    assert qa.nbytes == int(np.prod(w.shape)) + 4 * int(np.prod(out_shape))
    q = np.asarray(qa.q).astype(np.float64)
    assert not np.any(np.isnan(q))
    assert np.all(np.abs(q) <= RANGE[scheme])


# ---------------------------------------------------------------------------------------------
# 1. quantize: round-trip error bounds


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize(
    "shape,num_input_dims",
    [((8, 16), 1), ((1, 1), 1), ((3, 5, 33), 1), ((4, 6, 10), 2), ((2, 3, 4, 7), 2), ((5, 2, 3, 4), 3)],
)
def test_round_trip_error_is_bounded(scheme, shape, num_input_dims):
    rng = np.random.default_rng(zlib.crc32(repr((scheme, shape, num_input_dims)).encode()))
    # A wide dynamic range (1e-7 .. 1e1) so fp8's subnormal range is exercised too.
    w = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-7, 1, shape)).astype(np.float32)
    qa = quantize(w, scheme, num_input_dims)
    _check_structure(w, qa, scheme, num_input_dims)
    _assert_within_bounds(w, qa, scheme)
    # Each channel's absolute maximum maps to the end of the range, and comes back (nearly) exactly.
    flat_q = np.abs(np.asarray(qa.q).astype(np.float64)).reshape(*qa.scale.shape, -1)
    np.testing.assert_array_equal(flat_q.max(axis=-1), RANGE[scheme])
    flat_w = np.abs(w.astype(np.float64)).reshape(*qa.scale.shape, -1)
    np.testing.assert_allclose(np.asarray(qa.scale, np.float64), flat_w.max(axis=-1) / RANGE[scheme], rtol=1e-6)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_special_channels(scheme):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((6, 40)).astype(np.float32)
    w[0] = 0.0  # all zeros
    w[1, 17] = -1.0e4  # one huge (negative) outlier
    w[2] = -np.abs(w[2]) - 0.01  # all negative
    w[3] *= 1e-3  # small
    w[4, :] = 3.5  # constant
    w[5, ::2] = 0.0  # half zeros
    qa = quantize(jnp.asarray(w), scheme)
    _check_structure(w, qa, scheme, 1)
    _assert_within_bounds(w, qa, scheme)
    deq = np.asarray(qa.dequantize())
    scale = np.asarray(qa.scale)

    assert scale[0] == 1.0
    assert np.all(np.asarray(qa.q[0]).astype(np.float32) == 0) and np.all(deq[0] == 0)

    # The outlier sets the channel's scale and comes back to float32 precision ...
    assert scale[1] == pytest.approx(1.0e4 / RANGE[scheme], rel=1e-6)
    assert deq[1, 17] == pytest.approx(-1.0e4, rel=1e-6)
    # ... the rest of its channel is coarse, but bounded by that channel's scale.
    others = np.delete(np.arange(40), 17)
    assert np.all(np.abs(deq[1, others] - w[1, others]) <= scale[1] * (0.5 + 1e-5))
    if scheme == "int8":  # N(0, 1) values under a step of ~79 all round to zero
        assert np.all(deq[1, others] == 0)

    assert np.all(deq[2] < 0) and np.all(np.asarray(qa.q[2]).astype(np.float32) < 0)
    np.testing.assert_allclose(deq[4], 3.5, rtol=1e-6)
    assert np.all(deq[5, ::2] == 0)
    # The other channels are unaffected by the outlier: their scales follow their own maxima.
    for row in (2, 3, 5):
        assert scale[row] == pytest.approx(np.abs(w[row]).max() / RANGE[scheme], rel=1e-6)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_bfloat16_input_quantizes_like_its_float32_values(scheme):
    w = jnp.asarray(np.random.default_rng(2).standard_normal((12, 24)), jnp.bfloat16)
    a, b = quantize(w, scheme), quantize(w.astype(jnp.float32), scheme)
    np.testing.assert_array_equal(np.asarray(a.q).astype(np.float32), np.asarray(b.q).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


def test_int8_rounds_to_nearest():
    # Channel max 127 -> scale 1, so q is w rounded to the nearest integer.
    w = np.array([[127.0, -127.0, 0.4, 0.6, -0.6, 1.51, 2.49, -3.49, 100.2, -126.7]], np.float32)
    qa = quantize(w, "int8")
    assert float(qa.scale[0]) == 1.0
    np.testing.assert_array_equal(np.asarray(qa.q), [[127, -127, 0, 1, -1, 2, 2, -3, 100, -127]])


# ---------------------------------------------------------------------------------------------
# 2. argument checking


def test_quantize_rejects_unknown_scheme_and_bad_input_dims():
    w = jnp.ones((4, 8))
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        quantize(w, "int4")
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        quantize(w, "none")  # "none" is a setting, not a scheme quantize can apply
    for bad in (0, 2, 3, -1):
        with pytest.raises(ValueError, match="input dims"):
            quantize(w, "int8", bad)
    with pytest.raises(ValueError, match="input dims"):
        quantize(jnp.ones((8,)), "fp8", 1)


def test_parse_quantization():
    assert parse_quantization(None) is None
    assert parse_quantization("none") is None
    assert parse_quantization("int8") == "int8"
    assert parse_quantization("fp8") == "fp8"
    assert parse_quantization("int8_g32") == "int8_g32"
    assert set(SCHEMES) == {"none", "int8", "int8_g32", "fp8"}
    for junk in ("int4", "fp16", "q8_0", "", "int8 "):
        with pytest.raises(ValueError, match="quantization must be one of"):
            parse_quantization(junk)


# ---------------------------------------------------------------------------------------------
# 3. kernel vs float64


@functools.cache
def _quantized_weight(n: int, k: int, scheme: str, seed: int = 0) -> QuantArray:
    w = np.random.default_rng(seed + n * 7 + k).standard_normal((n, k)).astype(np.float32)
    return quantize(jnp.asarray(w), scheme)


def _activations(m: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)


@needs_kernel
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 32, 64])
@pytest.mark.parametrize("n,k", [(1, 8), (5, 3), (67, 45), (130, 64), (960, 576), (576, 1536)])
def test_kernel_matches_float64_reference(scheme, m, n, k):
    qa = _quantized_weight(n, k, scheme)
    x = _activations(m, k, seed=m * 1000 + n)
    got = np.asarray(quantized_matmul(jnp.asarray(x), qa))
    assert got.shape == (m, n) and got.dtype == np.float32
    w = _exact(qa)
    want = x.astype(np.float64) @ w.T
    # Also the reference through the float32 dequantized matrix (what the XLA paths use).
    want_deq = x.astype(np.float64) @ np.asarray(qa.dequantize(), np.float64).T
    atol = 1e-5 * np.sqrt(k) * np.abs(w).max()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(got, want_deq, rtol=1e-5, atol=atol)


@needs_kernel
def test_kernel_rejects_what_it_cannot_compute():
    qa = _quantized_weight(3, 8, "int8")
    with pytest.raises(ValueError, match="float32 activations"):
        quantized_matmul(jnp.ones((2, 8), jnp.bfloat16), qa)
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        quantized_matmul(jnp.ones((2, 9)), qa)
    with pytest.raises(ValueError, match=r"scale \[N\]"):
        quantized_matmul(jnp.ones((2, 8)), QuantArray(qa.q, jnp.ones((4,))))


@needs_kernel
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_kernel_zero_sized_operands(scheme):
    empty = QuantArray(jnp.zeros((0, 8), STORAGE[scheme]), jnp.zeros((0,)))
    assert quantized_matmul(jnp.zeros((2, 8)), empty).shape == (2, 0)
    no_k = QuantArray(jnp.zeros((3, 0), STORAGE[scheme]), jnp.ones((3,)))
    np.testing.assert_array_equal(np.asarray(quantized_matmul(jnp.ones((2, 0)), no_k)), np.zeros((2, 3)))


# ---------------------------------------------------------------------------------------------
# 4. exactness of the kernel's widening over every 8-bit pattern


def _every_pattern(scheme: str) -> np.ndarray:
    """Every value the storage type holds (fp8: the 254 finite bit patterns, subnormals and -0
    included; int8: -128..127, although quantize never produces -128)."""
    if scheme == "int8":
        return np.arange(-128, 128).astype(np.int8)
    bits = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], np.uint8)
    values = bits.view(ml_dtypes.float8_e4m3fn)
    assert values.size == 254 and not np.any(np.isnan(values.astype(np.float32)))
    return values


def _pattern_matrix(scheme: str, k: int) -> np.ndarray:
    """[P, k]: every column holds every pattern once (rolled differently per column), so each
    pattern passes through every vector lane and the scalar k tail, in tiles and remainder rows."""
    p = _every_pattern(scheme)
    return np.stack([np.roll(p, 17 * j) for j in range(k)], axis=1)


@needs_kernel
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("k", [11, 21])  # 8 lanes + a 3-wide tail; 16 lanes + a 5-wide tail
@pytest.mark.parametrize("unit_scale", [True, False], ids=["scale 1", "random scale"])
def test_kernel_widens_every_8bit_value_exactly(scheme, k, unit_scale):
    q = _pattern_matrix(scheme, k)  # [N, k]
    n = q.shape[0]
    q_f32 = q.astype(np.float32)
    scale = np.ones(n, np.float32) if unit_scale else np.random.default_rng(k).uniform(0.01, 3, n).astype(np.float32)
    # One nonzero product per output element, so the kernel's sum is exact: q times the scale,
    # rounded once to float32 like this float32 product.
    want = (q_f32 * scale[:, None]).T  # [k, N]
    qa = QuantArray(jnp.asarray(q), jnp.asarray(scale))
    assert qa.q.dtype == STORAGE[scheme]
    eye = np.eye(k, dtype=np.float32)
    # The panel path: all basis rows at once (M = k rows: 3-row tiles and a remainder).
    np.testing.assert_array_equal(np.asarray(quantized_matmul(jnp.asarray(eye), qa)), want)
    # The direct path: one basis row at a time (M = 1).
    for i in range(k):
        np.testing.assert_array_equal(np.asarray(quantized_matmul(jnp.asarray(eye[i : i + 1]), qa)), want[i : i + 1])


# ---------------------------------------------------------------------------------------------
# 5. batch invariance


@needs_kernel
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
# One thread (with a 5-wide k tail, and without one), and split over the pool.
@pytest.mark.parametrize("n,k", [(70, 45), (67, 64), (3072, 576)])
def test_a_row_does_not_depend_on_the_rest_of_the_batch(scheme, n, k):
    """Greedy output must not change with batching: a row computed alone (the direct path)
    equals the same row inside any batch (the panel path), bit for bit."""
    qa = _quantized_weight(n, k, scheme, seed=11)
    x = jnp.asarray(_activations(64, k, seed=3))
    full = np.asarray(quantized_matmul(x, qa))
    for m in (1, 2, 4, 5, 17, 32, 64):
        np.testing.assert_array_equal(np.asarray(quantized_matmul(x[-m:], qa)), full[-m:], err_msg=f"last {m} rows")
        np.testing.assert_array_equal(np.asarray(quantized_matmul(x[:m], qa)), full[:m], err_msg=f"first {m} rows")
    alone = range(64) if n * k < 1 << 16 else (0, 1, 2, 7, 31, 32, 62, 63)
    for row in alone:
        np.testing.assert_array_equal(
            np.asarray(quantized_matmul(x[row : row + 1], qa)), full[row : row + 1], err_msg=f"row {row} alone"
        )


# ---------------------------------------------------------------------------------------------
# 6. dense with a QuantArray


def _tensordot64(x: jax.Array, w: np.ndarray, contract: int) -> np.ndarray:
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    return np.tensordot(x64, w, (list(range(x64.ndim - contract, x64.ndim)), list(range(w.ndim - contract, w.ndim))))


DENSE_CASES = [
    ((4, 1, 64), (2, 4, 8, 64), 1),
    ((3, 1, 4, 16), (64, 4, 16), 2),
    ((MAX_ROWS + 8, 64), (96, 64), 1),
    ((MAX_ROWS, 64), (96, 64), 1),
]
DENSE_IDS = ["fused qkv", "output projection", "a prompt chunk (the prompt GEMM)", "the small-batch kernel's most rows"]


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("x_shape,w_shape,contract", DENSE_CASES, ids=DENSE_IDS)
@pytest.mark.parametrize("kernel", [True, False])
def test_dense_matches_dequantized_on_every_path(scheme, x_shape, w_shape, contract, kernel):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    qa = quantize(jnp.asarray(rng.standard_normal(w_shape), jnp.float32), scheme, contract)
    fn = functools.partial(dense, contract=contract, kernel=kernel)
    got = np.asarray(jax.jit(fn)(x, qa))
    want = _tensordot64(x, _exact(qa), contract)
    assert got.shape == want.shape == (*x_shape[: len(x_shape) - contract], *w_shape[: len(w_shape) - contract])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # The same as dense on the dequantized float32 matrix, through the same path.
    np.testing.assert_allclose(got, np.asarray(jax.jit(fn)(x, qa.dequantize())), rtol=1e-5, atol=1e-4)
    rows = int(np.prod(x_shape[: len(x_shape) - contract]))
    expect_kernel = kernel and dense_module.available()
    lowered = _lowered(fn, x, qa)
    assert ("raylm_dense_matmul_quantized" in lowered) == expect_kernel
    assert ("raylm_dense_matmul_quantized_prompt" in lowered) == (expect_kernel and rows > MAX_ROWS)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_dense_takes_xla_for_bfloat16(scheme, out_dtype):
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((4, 1, 64)), jnp.bfloat16)
    qa = quantize(jnp.asarray(rng.standard_normal((2, 4, 8, 64)), jnp.float32), scheme)
    fn = functools.partial(dense, kernel=True, out_dtype=out_dtype)
    assert "raylm_dense_matmul" not in _lowered(fn, x, qa)
    got = jax.jit(fn)(x, qa)
    assert got.dtype == (out_dtype or jnp.bfloat16) and got.shape == (4, 1, 2, 4, 8)
    want = _tensordot64(x, _exact(qa), 1)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@needs_kernel
def test_dense_kernel_and_xla_paths_agree_closely():
    rng = np.random.default_rng(13)
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
    for scheme in ("int8", "fp8"):
        qa = quantize(jnp.asarray(rng.standard_normal((130, 96)), jnp.float32), scheme)
        by_kernel = jax.jit(functools.partial(dense, kernel=True))(x, qa)
        by_tensordot = jax.jit(functools.partial(dense, kernel=False))(x, qa)
        np.testing.assert_allclose(np.asarray(by_kernel), np.asarray(by_tensordot), rtol=1e-5, atol=1e-5)


def test_dense_rejects_contract_other_than_input_dims():
    qa = quantize(jnp.ones((64, 4, 16)), "int8", 2)
    with pytest.raises(ValueError, match="2 input dims, contracted 1"):
        dense(jnp.ones((3, 1, 4, 16)), qa, 1, kernel=True)
    qa1 = quantize(jnp.ones((64, 4, 16)), "fp8", 1)
    with pytest.raises(ValueError, match="1 input dims, contracted 2"):
        dense(jnp.ones((3, 1, 4, 16)), qa1, 2, kernel=False)


def test_without_a_build_xla_runs(unbuilt_kernels):
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32)
    qa = quantize(jnp.asarray(rng.standard_normal((40, 16)), jnp.float32), "int8")
    assert not dense_module.available()
    with pytest.raises(RuntimeError, match="pip install"):
        quantized_matmul(x, qa)
    fn = functools.partial(dense, kernel=True)
    assert "raylm_dense_matmul" not in _lowered(fn, x, qa)
    np.testing.assert_allclose(np.asarray(fn(x, qa)), _tensordot64(x, _exact(qa), 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_equal_dequantized_rows(scheme, dtype):
    qa = quantize(jnp.asarray(np.random.default_rng(1).standard_normal((10, 16)), jnp.float32), scheme)
    index = jnp.array([[0, 3, 9], [5, 5, 1]], jnp.int32)
    got = qa.rows(index, dtype)
    assert got.dtype == dtype and got.shape == (2, 3, 16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(qa.dequantize(dtype)[index], np.float32))
    exact = jnp.asarray(_exact(qa).astype(np.float32)).astype(dtype)
    np.testing.assert_array_equal(np.asarray(qa.dequantize(dtype), np.float32), np.asarray(exact, np.float32))


# ---------------------------------------------------------------------------------------------
# 7. whole models


def _tiny(tied: bool = False, bias: bool = False, seed: int = 0) -> tuple[ModelConfig, ModelParams]:
    """A random 2-layer llama-shaped model (4 query heads over 2 KV heads)."""
    config = ModelConfig(
        architecture="Qwen2ForCausalLM" if bias else "LlamaForCausalLM",
        vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=tied, attention_bias=bias, bos_token_id=1, eos_token_ids=(2,),
    )
    rng = np.random.default_rng(seed)
    d, i, kvh, g, dh = 64, 128, 2, 2, 16

    def mat(*shape: int) -> jax.Array:
        return jnp.asarray(0.2 * rng.standard_normal(shape), jnp.float32)

    def norm() -> jax.Array:
        return jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)

    layers = tuple(
        LayerParams(
            attn_norm=norm(), wqkv=mat(kvh, g + 2, dh, d), wo=mat(d, kvh * g, dh), mlp_norm=norm(),
            w_gate_up=mat(2, i, d), w_down=mat(d, i), bqkv=mat(kvh, g + 2, dh) if bias else None,
        )
        for _ in range(config.num_layers)
    )
    params = ModelParams(embed=mat(320, d), layers=layers, final_norm=norm(), lm_head=None if tied else mat(320, d))
    return config, params


def _dequantized(params: ModelParams) -> ModelParams:
    return jax.tree_util.tree_map(
        lambda leaf: leaf.dequantize() if isinstance(leaf, (QuantArray, GgufBlocks)) else leaf,
        params,
        is_leaf=lambda leaf: isinstance(leaf, (QuantArray, GgufBlocks)),
    )


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("tied,bias", [(False, False), (True, True)], ids=["untied", "tied with biases"])
def test_quantize_params(scheme, tied, bias):
    config, params = _tiny(tied, bias)
    qp = quantize_params(params, scheme)
    for lp, qlp in zip(params.layers, qp.layers):
        for field in dataclasses.fields(LayerParams):
            before, after = getattr(lp, field.name), getattr(qlp, field.name)
            if before is None:  # (a dense model's expert fields)
                assert after is None, field.name
            elif field.name in LAYER_MATRIX_INPUT_DIMS:
                assert isinstance(after, QuantArray), field.name
                assert after.num_input_dims == LAYER_MATRIX_INPUT_DIMS[field.name] and after.scheme == scheme
                assert after.shape == before.shape
                _assert_within_bounds(np.asarray(before), after, scheme)
            else:  # norms and biases stay as they are
                assert not isinstance(after, QuantArray) and after.dtype == before.dtype, field.name
                np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    for name, n in MODEL_MATRIX_INPUT_DIMS.items():
        before, after = getattr(params, name), getattr(qp, name)
        if before is None:
            assert after is None and name == "lm_head" and tied
        else:
            assert isinstance(after, QuantArray) and after.num_input_dims == n and after.shape == before.shape
            _assert_within_bounds(np.asarray(before), after, scheme)
    assert not isinstance(qp.final_norm, QuantArray)
    np.testing.assert_array_equal(np.asarray(qp.final_norm), np.asarray(params.final_norm))
    # The input is left alone.
    assert not any(isinstance(leaf, QuantArray) for leaf in jax.tree_util.tree_leaves(
        params, is_leaf=lambda x: isinstance(x, QuantArray)))
    ratio = weight_bytes(qp) / weight_bytes(params)
    assert 0.24 <= ratio <= 0.30, ratio
    assert weight_bytes(params) == sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))


# ---------------------------------------------------------------------------------------------
# 8. sharding


def _quantized_fields(params: ModelParams):
    for li, lp in enumerate(params.layers):
        for name in LAYER_MATRIX_INPUT_DIMS:
            if getattr(lp, name) is not None:
                yield f"layers[{li}].{name}", LAYER_AXES[name], getattr(lp, name)
    for name in MODEL_MATRIX_INPUT_DIMS:
        if getattr(params, name) is not None:
            yield name, MODEL_AXES[name], getattr(params, name)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_param_shardings_on_one_device(scheme):
    config, params = _tiny()
    qp = quantize_params(params, scheme)
    mesh = make_mesh(1)
    rules = rules_for(config, 1)
    shardings = param_shardings(qp, config, mesh)
    for (name, axes, qa), (_, _, sh) in zip(_quantized_fields(qp), _quantized_fields(shardings)):
        assert isinstance(sh, QuantArray), name
        assert isinstance(sh.q, NamedSharding) and isinstance(sh.scale, NamedSharding), name
        assert sh.q.spec == spec_for(axes, rules), name
        assert sh.scale.spec == spec_for(axes[: qa.scale.ndim], rules), name
        assert len(sh.scale.spec) == qa.scale.ndim, name
    assert isinstance(shardings.final_norm, NamedSharding)
    placed = shard_params(qp, config, mesh)
    for (name, _, qa), (_, _, sh), (_, _, placed_qa) in zip(
        _quantized_fields(qp), _quantized_fields(shardings), _quantized_fields(placed)
    ):
        assert isinstance(placed_qa, QuantArray), name
        assert placed_qa.q.dtype == qa.q.dtype and placed_qa.scale.dtype == jnp.float32
        assert placed_qa.q.sharding == sh.q and placed_qa.scale.sharding == sh.scale, name
        np.testing.assert_array_equal(np.asarray(placed_qa.scale), np.asarray(qa.scale))


needs_two_devices = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (XLA_FLAGS set in conftest)")


@needs_two_devices
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_tp2_splits_scales_with_output_dims(scheme):
    config, params = _tiny()
    qp = shard_params(quantize_params(params, scheme), config, make_mesh(2))
    layer = qp.layers[0]
    # w_down [D, I]: the split "mlp" axis is its input, so its [D] scales are whole on each device.
    assert layer.w_down.scale.sharding.spec == PartitionSpec(None)
    assert layer.w_down.scale.sharding.is_fully_replicated
    assert layer.w_down.q.addressable_shards[0].data.shape == (64, 64)
    # w_gate_up [2, I, D]: scales [2, I] split on I like the matrix.
    assert layer.w_gate_up.scale.sharding.spec == PartitionSpec(None, "tp")
    assert layer.w_gate_up.scale.addressable_shards[0].data.shape == (2, 64)
    assert layer.w_gate_up.q.addressable_shards[0].data.shape == (2, 64, 64)
    # wqkv [KVH, G + 2, Dh, D]: scales split by KV head; wo [D, H, Dh]: [D] scales replicated.
    assert layer.wqkv.scale.addressable_shards[0].data.shape == (1, 4, 16)
    assert layer.wo.scale.sharding.is_fully_replicated
    assert layer.wo.q.addressable_shards[0].data.shape == (64, 2, 16)


@needs_two_devices
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_quantized_forward_tp2_equals_tp1_and_dequantized(scheme):
    config, params = _tiny(seed=1)
    qp = quantize_params(params, scheme)
    ids = np.random.RandomState(3).randint(3, 320, size=20).tolist()
    tp1 = SingleSequenceGenerator(config, qp, mesh=make_mesh(1))
    tp2 = SingleSequenceGenerator(config, qp, mesh=make_mesh(2))
    reference = SingleSequenceGenerator(config, _dequantized(qp), mesh=make_mesh(1))
    logits1 = tp1.prompt_logits(ids)
    assert np.all(np.isfinite(logits1))
    np.testing.assert_allclose(tp2.prompt_logits(ids), logits1, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(logits1, reference.prompt_logits(ids), atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# 9. int8 with a scale per group of 32 inputs (int8_g32)


def test_int8_g32_scales_each_group_of_32_inputs():
    rng = np.random.default_rng(21)
    w = rng.standard_normal((5, 3, 64)).astype(np.float32)  # inputs [3, 64]: 6 groups per row
    w[0, 0, :32] = 0.0  # an all-zero group
    w[1, 2, 40] = 1.0e4  # an outlier: it coarsens its own group, not its row
    g = quantize(jnp.asarray(w), "int8_g32", 2)
    assert isinstance(g, GgufBlocks) and g.shape == w.shape and not g.nibbles and g.q.dtype == jnp.int8
    groups = w.reshape(5, 6, 32).astype(np.float64)
    absmax = np.abs(groups).max(axis=-1)
    scale = np.asarray(g.scale, np.float64)
    np.testing.assert_allclose(scale, np.where(absmax > 0, absmax / 127, 1.0), rtol=1e-6)
    deq = np.asarray(g.dequantize(), np.float64).reshape(5, 6, 32)
    assert np.all(np.abs(deq - groups) <= scale[..., None] * (0.5 + 1e-5))
    assert np.all(deq[0, 0] == 0) and np.all(np.abs(np.asarray(g.q)).max(axis=-1) <= 127)
    # The outlier's row: the other groups keep steps of their own maxima (per channel: ~79).
    assert np.all(scale[1, :5] < 0.05) and scale[1, 5] == pytest.approx(1.0e4 / 127, rel=1e-6)
    with pytest.raises(ValueError, match="whole groups"):
        quantize(jnp.ones((4, 40)), "int8_g32")


@pytest.mark.parametrize("rows", [3, MAX_ROWS + 7], ids=["decode rows", "a prompt chunk"])
def test_int8_g32_dense_is_the_dequantized_matrix(rows):
    """The block kernels (or XLA's dot where they do not run) give the float32 matrix's results."""
    rng = np.random.default_rng(rows)
    g = quantize(jnp.asarray(rng.standard_normal((96, 4, 32)), jnp.float32), "int8_g32", 2)
    x = jnp.asarray(rng.standard_normal((rows, 4, 32)), jnp.float32)
    run = jax.jit(lambda x, w: dense(x, w, 2, kernel=True))
    got = np.asarray(run(x, g))
    np.testing.assert_array_equal(got, np.asarray(run(x, g.dequantize())))
    want = np.tensordot(np.asarray(x, np.float64), np.asarray(g.dequantize(), np.float64), ([1, 2], [1, 2]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_int8_g32_model_is_its_dequantized_model():
    config, params = _tiny(tied=True)
    qp = quantize_params(params, "int8_g32")
    matrices = [getattr(lp, f) for lp in qp.layers for f in LAYER_MATRIX_INPUT_DIMS if getattr(lp, f) is not None]
    matrices.append(qp.embed)
    assert all(isinstance(m, GgufBlocks) for m in matrices)
    assert 0.26 <= weight_bytes(qp) / weight_bytes(params) <= 0.32
    ids = np.random.RandomState(5).randint(3, 320, size=20).tolist()
    logits = SingleSequenceGenerator(config, qp).prompt_logits(ids)
    reference = SingleSequenceGenerator(config, _dequantized(qp)).prompt_logits(ids)
    # The same float32 matrices; XLA's dot may order the dequantized program's sums differently.
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)
    assert np.abs(logits - SingleSequenceGenerator(config, params).prompt_logits(ids)).max() > 1e-4  # quantized
