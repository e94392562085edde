"""The C++ paged-decode attention kernel against the jnp ``paged_attention`` and a naive numpy path.

Pools are random, block ids shuffled, the null block and unused table slots hold large
values (so reading them shows), rows mix lengths (one key, partial last blocks, exact
block ends, the whole table) and include a padding row; tables are wider than needed,
as the engine's width buckets are.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deploy.benchmarks.decode_attention_bench import attention_step
from model import paged_decode
from model.attention import paged_attention
from model.quantization import quantize

needs_kernel = pytest.mark.skipif(
    not paged_decode.available(),
    reason="C++ kernel not built (no compiler or jaxlib headers at install); the jnp path is tested instead",
)


def make_case(seed, *, layers=3, heads=9, kv_heads=3, head_dim=64, block_size=16, width=8,
              lens=(1, 15, 16, 17, 0, 100, 128), pool_dtype=jnp.float32):
    """Random pools and shuffled block tables; slots past a row's context point at garbage."""
    rng = np.random.default_rng(seed)
    batch = len(lens)
    num_blocks = batch * width + 1
    shape = (layers, num_blocks, block_size, kv_heads, head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    k[:, 0] = v[:, 0] = 1e4  # the null block: never read by a real key
    tables = rng.permutation(np.arange(1, num_blocks)).reshape(batch, width)
    for b, n in enumerate(lens):
        used = -(-n // block_size)
        if n % block_size:  # the unwritten tail of a partially filled last block
            k[:, tables[b, used - 1], n % block_size:] = v[:, tables[b, used - 1], n % block_size:] = -1e4
        k[:, tables[b, used:]] = v[:, tables[b, used:]] = -1e4  # blocks past this row's context
        tables[b, used + 1:] = 0  # and the rest of the bucket padded with the null block
    q = rng.standard_normal((batch, heads, head_dim))
    return dict(
        q=jnp.asarray(q, jnp.float32),
        k_pool=jnp.asarray(k, pool_dtype),
        v_pool=jnp.asarray(v, pool_dtype),
        block_tables=jnp.asarray(tables, jnp.int32),
        context_lens=jnp.asarray(lens, jnp.int32),
    )


def jnp_reference(case, layer):
    """``paged_attention`` as the engine calls it for one decode token per row."""
    lens = case["context_lens"]
    out = paged_attention(case["q"][:, None], case["k_pool"], case["v_pool"], jnp.int32(layer),
                          case["block_tables"], (lens - 1)[:, None], lens, (lens > 0)[:, None])
    return np.asarray(out[:, 0], np.float32)


def naive_reference(case, layer):
    """Per row: the first ``context_len`` keys in logical order, softmax in float64."""
    q = np.asarray(case["q"], np.float64)
    k = np.asarray(case["k_pool"].astype(jnp.float32), np.float64)[layer]
    v = np.asarray(case["v_pool"].astype(jnp.float32), np.float64)[layer]
    tables, lens = np.asarray(case["block_tables"]), np.asarray(case["context_lens"])
    batch, heads, head_dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        keys = k[tables[b]].reshape(-1, *k.shape[2:])[: lens[b]]  # [T, KVH, Dh]
        vals = v[tables[b]].reshape(-1, *v.shape[2:])[: lens[b]]
        for h in range(heads if lens[b] else 0):
            s = keys[:, h // group] @ q[b, h] * head_dim**-0.5
            p = np.exp(s - s.max())
            out[b, h] = p @ vals[:, h // group] / p.sum()
    return out


def kernel(case, layer):
    return np.asarray(paged_decode.paged_decode_attention(layer=layer, **case))


@needs_kernel
@pytest.mark.parametrize("layer", [0, 2])
def test_float32_matches_references(layer):
    case = make_case(0)
    got = kernel(case, layer)
    real = np.asarray(case["context_lens"]) > 0
    np.testing.assert_allclose(got[real], jnp_reference(case, layer)[real], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, naive_reference(case, layer), rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("lens", [(256,) * 15 + (0,), (2048,)], ids=["many-rows", "one-long-row"])
def test_large_batches_split_over_threads(lens):
    """Enough work to use XLA's thread pool: by whole rows, or by (row, kv head) items."""
    case = make_case(12, width=max(lens) // 16 + 8, lens=lens)
    got = kernel(case, 1)
    real = np.asarray(case["context_lens"]) > 0
    np.testing.assert_allclose(got[real], jnp_reference(case, 1)[real], rtol=1e-5, atol=1e-6)
    assert np.all(got[~real] == 0)


@needs_kernel
def test_padding_row_is_zero():
    case = make_case(1, lens=(0, 5, 0))
    got = kernel(case, 1)
    assert np.all(got[[0, 2]] == 0) and np.all(np.isfinite(got))


@needs_kernel
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 16), (6, 2, 80, 4), (8, 2, 64, 4), (9, 3, 64, 32),
     (4, 1, 128, 8)],
    ids=["smollm-gqa", "mha", "mqa-dh128", "odd-dh-small-blocks", "dh64-blocks-of-4", "dh64-blocks-of-32",
         "dh128-blocks-of-8"],
)
def test_head_layouts(heads, kv_heads, head_dim, block_size):
    """Head dims 64 and 128 take the lane-tree path, whose key groups (8 or 16 keys) may be
    larger than a block, fill it, or split it in two; other head dims the scalar path."""
    lens = (1, block_size - 1, block_size, 3 * block_size + 1, 8 * block_size)
    case = make_case(2, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, lens=lens)
    np.testing.assert_allclose(kernel(case, 1), jnp_reference(case, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernel(case, 1), naive_reference(case, 1), rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("lens", [(1, 15, 16, 17, 0, 100, 128), (256,) * 15 + (0,)], ids=["one-thread", "threads"])
def test_a_row_does_not_depend_on_the_rest_of_the_batch(lens):
    """Bit for bit, each row alone equals that row in the batch (greedy output must not change
    with batching): on one thread and split over the pool's threads."""
    case = make_case(14, width=max(lens) // 16 + 8, lens=lens)
    batch = kernel(case, 1)
    for b in range(len(lens)):
        alone = dict(case, q=case["q"][b:b + 1], block_tables=case["block_tables"][b:b + 1],
                     context_lens=case["context_lens"][b:b + 1])
        np.testing.assert_array_equal(kernel(alone, 1)[0], batch[b])


@needs_kernel
def test_eight_lane_family_on_any_cpu():
    """The eight-lane family (what AVX2 CPUs run) is forced by RAYLM_ATTENTION_NARROW_LANES; on
    an AVX2 CPU this repeats the checks, on an AVX-512 one it covers the other family."""
    env = {**os.environ, "RAYLM_ATTENTION_NARROW_LANES": "1"}
    checks = ("test_float32_matches_references or test_head_layouts or test_a_row_does_not_depend "
              "or test_quantized_pool_matches_references or test_bfloat16_pool_matches_float32")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", checks],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


@needs_kernel
def test_bfloat16_pool_matches_float32():
    """bf16 K/V widen exactly, so the kernel matches the float32 path on the widened pool up to
    float32 rounding: the two instantiations are vectorised separately (and per CPU by the
    multiversioned clones), so their sums may run in another order (seen: 3.6e-7 absolute on
    an AVX2 machine without AVX-512)."""
    case = make_case(3, pool_dtype=jnp.bfloat16)
    widened = dict(case, k_pool=case["k_pool"].astype(jnp.float32), v_pool=case["v_pool"].astype(jnp.float32))
    np.testing.assert_allclose(kernel(case, 1), kernel(widened, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernel(case, 1), naive_reference(case, 1), rtol=1e-5, atol=1e-6)


@needs_kernel
def test_bfloat16_query_returns_bfloat16():
    case = make_case(4, pool_dtype=jnp.bfloat16)
    case["q"] = case["q"].astype(jnp.bfloat16)
    got = paged_decode.paged_decode_attention(layer=0, **case)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), naive_reference(case, 0), rtol=1e-2, atol=1e-2)


@needs_kernel
def test_never_reads_outside_the_pool():
    """Context past the table and bad block ids / layer are clamped, not followed."""
    case = make_case(5, width=2, lens=(32, 32))
    num_blocks = case["k_pool"].shape[1]
    bad = dict(case, block_tables=jnp.array([[num_blocks + 7, -3], [1, 2]], jnp.int32),
               context_lens=jnp.array([10_000, 32], jnp.int32))
    clamped = dict(case, block_tables=jnp.array([[num_blocks - 1, 0], [1, 2]], jnp.int32))
    got = np.asarray(paged_decode.paged_decode_attention(layer=99, **bad))
    np.testing.assert_array_equal(got, np.asarray(paged_decode.paged_decode_attention(layer=2, **clamped)))


@needs_kernel
def test_rejects_unsupported_pool_dtype():
    case = make_case(6, pool_dtype=jnp.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        paged_decode.paged_decode_attention(layer=0, **case)


def test_decode_attention_falls_back_for_unsupported_dtype():
    case = make_case(6, pool_dtype=jnp.float16)
    got = np.asarray(paged_decode.decode_attention(layer=0, **case))
    real = np.asarray(case["context_lens"]) > 0
    np.testing.assert_allclose(got[real], jnp_reference(case, 0)[real], rtol=2e-3, atol=2e-3)
    assert np.all(got[~real] == 0)


def test_reference_contract_matches_paged_attention():
    case = make_case(7)
    got = np.asarray(paged_decode.reference_decode_attention(layer=1, **case))
    real = np.asarray(case["context_lens"]) > 0
    np.testing.assert_array_equal(got[real], jnp_reference(case, 1)[real])
    assert np.all(got[~real] == 0)


def test_without_a_build_the_jnp_path_runs(unbuilt_kernels, caplog):
    case = make_case(8)
    with caplog.at_level(logging.WARNING, logger="model.kernels"):
        assert not paged_decode.available()
        assert not paged_decode.available()
    assert sum("kernel unavailable" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="pip install"):
        paged_decode.paged_decode_attention(layer=0, **case)
    got = np.asarray(paged_decode.decode_attention(layer=0, **case))
    np.testing.assert_array_equal(got, np.asarray(paged_decode.reference_decode_attention(layer=0, **case)))


@needs_kernel
def test_decode_attention_lowers_for_gpu_to_the_jnp_path():
    case = make_case(9)
    fn = functools.partial(paged_decode.decode_attention, layer=0)
    cpu = jax.jit(fn).trace(**case).lower(lowering_platforms=("cpu",)).as_text()
    gpu = jax.jit(fn).trace(**case).lower(lowering_platforms=("cuda",)).as_text()
    assert "raylm_paged_decode_attention" in cpu
    assert "raylm_paged_decode_attention" not in gpu


@needs_kernel
def test_in_a_jitted_step_with_a_donated_pool_updated_in_place():
    case = make_case(10)
    layers, (batch, heads, head_dim) = case["k_pool"].shape[0], case["q"].shape
    kv_heads = case["k_pool"].shape[3]
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((layers, batch, heads, head_dim)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((layers, batch, kv_heads, head_dim)), jnp.float32)
                    for _ in range(2))
    args = (q, k_new, v_new, case["block_tables"], case["context_lens"])

    ref = jax.jit(functools.partial(attention_step, paged_decode.reference_decode_attention))
    want, want_k, want_v = ref(case["k_pool"], case["v_pool"], *args)
    step = jax.jit(functools.partial(attention_step, paged_decode.paged_decode_attention), donate_argnums=(0, 1))
    k_pool, v_pool = jnp.array(case["k_pool"]), jnp.array(case["v_pool"])
    k_ptr = k_pool.unsafe_buffer_pointer()
    got, got_k, got_v = step(k_pool, v_pool, *args)

    assert k_pool.is_deleted() and got_k.unsafe_buffer_pointer() == k_ptr  # updated in place
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _quantized(case, scheme):
    """The case's pools stored 8-bit with a scale per (token, kv head), as the engine writes them."""
    return dict(case, k_pool=quantize(case["k_pool"], scheme, 1), v_pool=quantize(case["v_pool"], scheme, 1))


def _dequantized(case):
    return dict(case, k_pool=case["k_pool"].dequantize(), v_pool=case["v_pool"].dequantize())


@needs_kernel
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (8, 1, 128, 16), (6, 2, 80, 4)],
    ids=["smollm-gqa", "mqa-dh128", "odd-dh-small-blocks"],
)
def test_quantized_pool_matches_references(scheme, heads, kv_heads, head_dim, block_size):
    """An 8-bit pool: the kernel equals the jnp path reading the same pool and the naive path
    on the dequantized pool (up to float32 rounding: the scales are applied after the dot)."""
    lens = (1, block_size - 1, block_size, 3 * block_size + 1, 0, 8 * block_size)
    case = make_case(10, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, lens=lens)
    case = _quantized(case, scheme)
    got = kernel(case, 1)
    real = np.asarray(case["context_lens"]) > 0
    np.testing.assert_allclose(got[real], jnp_reference(case, 1)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, naive_reference(_dequantized(case), 1), rtol=1e-5, atol=1e-5)
    assert np.all(got[~real] == 0)


@needs_kernel
def test_quantized_pool_is_read_through_decode_attention_and_lowers_to_its_kernel():
    case = _quantized(make_case(11), "int8")
    fn = functools.partial(paged_decode.decode_attention, layer=0)
    cpu = jax.jit(fn).trace(**case).lower(lowering_platforms=("cpu",)).as_text()
    assert "raylm_quantized_paged_decode_attention" in cpu
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(**case)), kernel(case, 0))


def test_quantized_pool_falls_back_to_the_jnp_path_without_a_build(unbuilt_kernels):
    case = _quantized(make_case(12), "int8")
    got = np.asarray(paged_decode.decode_attention(layer=0, **case))
    np.testing.assert_array_equal(got, np.asarray(paged_decode.reference_decode_attention(layer=0, **case)))


@needs_kernel
def test_mixed_pools_are_refused():
    case = make_case(13)
    mixed = dict(case, k_pool=quantize(case["k_pool"], "int8", 1))
    with pytest.raises(ValueError, match="8-bit pools with scales"):
        paged_decode.paged_decode_attention(layer=0, **mixed)
