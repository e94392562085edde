"""The C++ paged-decode attention kernel against the jnp ``paged_attention`` and a naive numpy path.

Pools are random, block ids shuffled, the null block and unused table slots hold large
values (so reading them shows), rows mix lengths (one key, partial last blocks, exact
block ends, the whole table) and include a padding row; tables are wider than needed,
as the engine's width buckets are. Sliding-window cases point the table entries before
each row's window at the null block, as the engine does once it frees those blocks.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.benchmarks.decode_attention_bench import attention_step
from raylm.model.config.model_config import AttentionSpec
from raylm.model.decoder.attention import paged_attention
from raylm.model.kernels import lowering_for_every_platform, paged_decode
from raylm.model.quantization.quant_array import QuantArray, quantize
from tests.reruns import rerun_in_child

needs_kernel = pytest.mark.skipif(
    not paged_decode.available(),
    reason="C++ kernel not built (no compiler or jaxlib headers at install); the jnp path is tested instead",
)


def make_case(seed, *, layers=3, heads=9, kv_heads=3, head_dim=64, block_size=16, width=8,
              lens=(1, 15, 16, 17, 0, 100, 128), pool_dtype=jnp.float32, window=None, null=1e4):
    """Random pools and shuffled block tables; slots past a row's context point at garbage.

    With a ``window``, a row's keys before its window that share a block with it get K = 0
    and V = 1e4 (a score like a visible key's, so reading one shows in the output) and its
    table entries before that block point at the null block, filled with ``null``."""
    rng = np.random.default_rng(seed)
    batch = len(lens)
    num_blocks = batch * width + 1
    shape = (layers, num_blocks, block_size, kv_heads, head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    k[:, 0] = v[:, 0] = null  # the null block: never read by a real key
    tables = rng.permutation(np.arange(1, num_blocks)).reshape(batch, width)
    for b, n in enumerate(lens):
        used = -(-n // block_size)
        if n % block_size:  # the unwritten tail of a partially filled last block
            k[:, tables[b, used - 1], n % block_size:] = v[:, tables[b, used - 1], n % block_size:] = -1e4
        k[:, tables[b, used:]] = v[:, tables[b, used:]] = -1e4  # blocks past this row's context
        tables[b, used + 1:] = 0  # and the rest of the bucket padded with the null block
        if window is not None and n:
            first = max(n - window, 0)
            k[:, tables[b, first // block_size], :first % block_size] = 0
            v[:, tables[b, first // block_size], :first % block_size] = 1e4
            tables[b, :first // block_size] = 0
    q = rng.standard_normal((batch, heads, head_dim))
    return dict(
        q=jnp.asarray(q, jnp.float32),
        k_pool=jnp.asarray(k, pool_dtype),
        v_pool=jnp.asarray(v, pool_dtype),
        block_tables=jnp.asarray(tables, jnp.int32),
        context_lens=jnp.asarray(lens, jnp.int32),
    )


def jnp_reference(case, layer, spec=None, sinks=None):
    """``paged_attention`` as the engine calls it for one decode token per row."""
    lens = case["context_lens"]
    out = paged_attention(case["q"][:, None], case["k_pool"], case["v_pool"], jnp.int32(layer),
                          case["block_tables"], (lens - 1)[:, None], lens, (lens > 0)[:, None], spec, sinks)
    return np.asarray(out[:, 0], np.float32)


def naive_reference(case, layer, spec=None, sinks=None):
    """Per row: the first ``context_len`` keys in logical order (only the last ``spec.window``
    of them), scores scaled and soft-capped as ``spec`` says, softmax in float64 (with each
    head's sink logit in its denominator, given ``sinks``)."""
    q = np.asarray(case["q"], np.float64)
    k = np.asarray(case["k_pool"].astype(jnp.float32), np.float64)[layer]
    v = np.asarray(case["v_pool"].astype(jnp.float32), np.float64)[layer]
    tables, lens = np.asarray(case["block_tables"]), np.asarray(case["context_lens"])
    batch, heads, head_dim = q.shape
    spec = spec or AttentionSpec(head_dim**-0.5)
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        first = max(lens[b] - spec.window, 0) if spec.window else 0
        keys = k[tables[b]].reshape(-1, *k.shape[2:])[first: lens[b]]  # [T, KVH, Dh]
        vals = v[tables[b]].reshape(-1, *v.shape[2:])[first: lens[b]]
        for h in range(heads if lens[b] else 0):
            s = keys[:, h // group] @ q[b, h] * spec.scale
            if spec.softcap:
                s = spec.softcap * np.tanh(s / spec.softcap)
            sink = -np.inf if sinks is None else float(sinks[h])
            top = max(s.max(), sink)
            p = np.exp(s - top)
            out[b, h] = p @ vals[:, h // group] / (p.sum() + np.exp(sink - top))
    return out


def kernel(case, layer, spec=None, sinks=None):
    return np.asarray(paged_decode.paged_decode_attention(layer=layer, spec=spec, sinks=sinks, **case))


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
     (9, 3, 64, 64), (4, 1, 128, 8), (9, 3, 64, 128), (4, 2, 64, 1)],
    ids=["smollm-gqa", "mha", "mqa-dh128", "odd-dh-small-blocks", "dh64-blocks-of-4", "dh64-blocks-of-32",
         "dh64-blocks-of-64", "dh128-blocks-of-8", "dh64-blocks-of-128", "dh64-blocks-of-1"],
)
def test_head_layouts(heads, kv_heads, head_dim, block_size):
    """Head dims 64 and 128 take the lane-tree path, whose key groups (8 or 16 keys) may be
    larger than a block, fill it, or split it in two; other head dims the scalar path. One
    softmax step covers 64 keys (several blocks, or one block of 64 or more), so the longer
    rows span several steps, their last one partial."""
    lens = (1, max(block_size - 1, 1), block_size, 3 * block_size + 1, 8 * block_size, 150)
    case = make_case(2, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, lens=lens,
                     width=max(8, -(-150 // block_size)))
    np.testing.assert_allclose(kernel(case, 1), jnp_reference(case, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernel(case, 1), naive_reference(case, 1), rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("pool", ["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("lens", [(1, 15, 16, 17, 0, 100, 128), (256,) * 15 + (0,)], ids=["one-thread", "threads"])
def test_a_row_does_not_depend_on_the_rest_of_the_batch(lens, pool):
    """Bit for bit, each row alone equals that row in the batch (greedy output must not change
    with batching): on one thread and split over the pool's threads, for every pool type (each
    reads its K and V its own way: in place, widened in registers or widened into rows)."""
    pool_dtype = jnp.bfloat16 if pool == "bfloat16" else jnp.float32
    case = make_case(14, width=max(lens) // 16 + 8, lens=lens, pool_dtype=pool_dtype)
    if pool in ("int8", "fp8"):
        case = _quantized(case, pool)
    batch = kernel(case, 1)
    for b in range(len(lens)):
        alone = dict(case, q=case["q"][b:b + 1], block_tables=case["block_tables"][b:b + 1],
                     context_lens=case["context_lens"][b:b + 1])
        np.testing.assert_array_equal(kernel(alone, 1)[0], batch[b])


# Rows sharing their first blocks (a cached prompt prefix), as (rows, blocks) runs of the
# table: over kMaxSharedRows rows, a partial share, a second prefix, rows alone and a padding
# row. The last row's first block is the first rows' fourth: with a window of 40 it is the
# first block all of them see, at another place in their tables.
SHARED_LENS = (100,) * 11 + (0, 70, 99, 128, 33) + (100,) * 3 + (64, 65, 17, 20)
SHARES = [(range(0, 11), 4), (range(13, 15), 2), (range(16, 19), 3), (range(19, 21), 4)]


@needs_kernel
@pytest.mark.parametrize("pool", ["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("lens,shares", [(SHARED_LENS, SHARES), ((20, 19, 33), [(range(0, 3), 1)])],
                         ids=["threads", "one-thread"])
def test_rows_sharing_blocks_get_what_they_get_alone(lens, shares, window, pool):
    """Rows whose tables start with the same blocks run block by block together (each shared
    block read once): each row's result is still, bit for bit, what it gets alone, and matches
    the naive path, with windows (the rows then share their first visible block) and every pool."""
    pool_dtype = jnp.bfloat16 if pool == "bfloat16" else jnp.float32
    case = make_case(31, width=10, lens=lens, pool_dtype=pool_dtype)
    tables = np.asarray(case["block_tables"]).copy()
    for rows, blocks in shares:
        tables[list(rows), :blocks] = tables[rows[0], :blocks]
    if len(lens) == len(SHARED_LENS):
        tables[-1, 0] = tables[0, 3]
    case["block_tables"] = jnp.asarray(tables)
    if pool in ("int8", "fp8"):
        case = _quantized(case, pool)
    spec = AttentionSpec(64**-0.5, window=window)
    batch = kernel(case, 1, spec)
    for b in range(len(lens)):
        alone = dict(case, q=case["q"][b:b + 1], block_tables=case["block_tables"][b:b + 1],
                     context_lens=case["context_lens"][b:b + 1])
        np.testing.assert_array_equal(kernel(alone, 1, spec)[0], batch[b])
    values = _dequantized(case) if pool in ("int8", "fp8") else case
    np.testing.assert_allclose(batch, naive_reference(values, 1, spec), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_eight_lane_family_on_any_cpu():
    """The eight-lane family (what AVX2 CPUs run) is forced by RAYLM_ATTENTION_NARROW_LANES; on
    an AVX2 CPU this repeats the checks, on an AVX-512 one it covers the other family
    (attention specs on float32 pools: other pools differ only in how rows are widened,
    which the 8-bit and bfloat16 checks cover)."""
    checks = ("test_float32_matches_references or test_head_layouts or test_a_row_does_not_depend "
              "or test_quantized_pool_matches_references or test_bfloat16_pool_matches_float32 "
              "or test_sliding_window_matches or (test_attention_spec_matches and float32)")
    rerun_in_child(__file__, checks, {"RAYLM_ATTENTION_NARROW_LANES": "1"})


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
    with caplog.at_level(logging.WARNING, logger="raylm.model.kernels"):
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
    with lowering_for_every_platform():  # (a new function: jit caches a function's trace)
        gpu = jax.jit(functools.partial(paged_decode.decode_attention, layer=0)).trace(**case).lower(
            lowering_platforms=("cuda",)).as_text()
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


def _null_scales(case, value):
    """An 8-bit case with its pools' null-block scales set to ``value`` (NaN: any read shows)."""
    def pool(p):
        return QuantArray(p.q, p.scale.at[:, 0].set(value))
    return dict(case, k_pool=pool(case["k_pool"]), v_pool=pool(case["v_pool"]))


def _spec_case(seed, *, window, pool_dtype, null, **kwargs):
    """A case for ``window`` whose null block holds ``null`` (NaN for 8-bit pools: their scales)."""
    scheme = {"int8": "int8", "fp8": "fp8"}.get(pool_dtype)
    case = make_case(seed, window=window, pool_dtype=jnp.float32 if scheme else pool_dtype,
                     null=1e4 if scheme else null, **kwargs)
    if scheme:
        case = _quantized(case, scheme)
        if np.isnan(null):
            case = _null_scales(case, np.nan)
    return case


# Windows against a block of 16: inside one block, a whole block, spanning blocks, wider than
# any context. The lengths put the window's first key at a block start, inside a block, at 0.
WINDOW_LENS = (1, 4, 5, 6, 15, 16, 17, 21, 0, 40, 41, 100, 128)


@needs_kernel
@pytest.mark.parametrize("window", [5, 16, 40, 1000])
def test_sliding_window_matches_references(window):
    """Each row sees only its last ``window`` keys; the table entries before the window's first
    block point at the null block, filled with NaN, so the kernel matches only if it never reads
    them. The jnp reference runs on the same case with a finite null block (it gathers every
    entry), the naive one on the NaN case."""
    spec = AttentionSpec(64**-0.5, window=window)
    finite = make_case(20, lens=WINDOW_LENS, window=window)
    nan = make_case(20, lens=WINDOW_LENS, window=window, null=np.nan)
    got = kernel(nan, 1, spec)
    np.testing.assert_array_equal(got, kernel(finite, 1, spec))
    np.testing.assert_allclose(got, naive_reference(nan, 1, spec), rtol=1e-5, atol=1e-6)
    real = np.asarray(finite["context_lens"]) > 0
    np.testing.assert_allclose(got[real], jnp_reference(finite, 1, spec)[real], rtol=1e-5, atol=1e-6)


@needs_kernel
def test_sliding_window_start_is_exact():
    """The references above are sharp at the window's first key: a window one key wider reads
    a planted V = 1e4, one key narrower drops a visible key, and both miss by far more than
    the tolerance; the plain (windowless) kernel differs too."""
    case = make_case(21, lens=WINDOW_LENS, window=40)
    got = kernel(case, 1, AttentionSpec(64**-0.5, window=40))
    for wrong in (39, 41):
        off = naive_reference(case, 1, AttentionSpec(64**-0.5, window=wrong))
        assert not np.allclose(got, off, rtol=1e-3, atol=1e-3), wrong
    assert not np.allclose(got, kernel(case, 1), rtol=1e-3, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("pool_dtype", ["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 4, 4), (128, 8, 4), (256, 8, 2), (96, 8, 1), (80, 6, 3)],
                         ids=["dh64-mha", "dh128-gqa2", "dh256-gqa4", "dh96-gqa8", "dh80-gqa2"])
def test_attention_spec_matches_references(pool_dtype, head_dim, heads, kv_heads):
    """A Gemma 2-like layer (custom scale, soft-cap, window spanning blocks) on every pool type,
    the head dims of the supported families (64, 128, 256 sliced in two, 96) and an odd one,
    GQA groups 1 to 8. Against the naive path on the same values (8-bit pools dequantized),
    and for float32 and 8-bit pools against the jnp path (a bfloat16 pool's jnp path rounds
    the probabilities to bfloat16)."""
    spec = AttentionSpec(0.3, window=21, softcap=2.0)
    lens = (1, 20, 21, 22, 0, 37, 64)
    shape = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, width=5, lens=lens, pool_dtype=pool_dtype)
    case = _spec_case(22, window=21, null=np.nan, **shape)
    got = kernel(case, 1, spec)
    values = _dequantized(case) if pool_dtype in ("int8", "fp8") else case
    tol = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, naive_reference(values, 1, spec), **tol)
    if pool_dtype != "bfloat16":
        finite = _spec_case(22, window=21, null=1e4, **shape)
        real = np.asarray(case["context_lens"]) > 0
        np.testing.assert_allclose(got[real], jnp_reference(finite, 1, spec)[real], **tol)


@needs_kernel
def test_attention_spec_soft_cap_and_scale_take_effect():
    """Soft-cap and scale each change the output (so the spec tests above can fail on them)."""
    case = make_case(23)
    plain = kernel(case, 1)
    capped = kernel(case, 1, AttentionSpec(64**-0.5, softcap=0.5))
    scaled = kernel(case, 1, AttentionSpec(0.5))
    np.testing.assert_allclose(capped, naive_reference(case, 1, AttentionSpec(64**-0.5, softcap=0.5)),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scaled, naive_reference(case, 1, AttentionSpec(0.5)), rtol=1e-5, atol=1e-6)
    assert not np.allclose(plain, capped, rtol=1e-3, atol=1e-3)
    assert not np.allclose(plain, scaled, rtol=1e-3, atol=1e-3)


@needs_kernel
def test_decode_attention_runs_the_kernel_for_every_spec():
    """``decode_attention`` lowers a windowed, soft-capped, rescaled layer to the kernel on CPU
    (no jnp fallback) and gives the kernel's result."""
    spec = AttentionSpec(0.2, window=20, softcap=30.0)
    case = make_case(24, window=20)
    fn = functools.partial(paged_decode.decode_attention, layer=1, spec=spec)
    cpu = jax.jit(fn).trace(**case).lower(lowering_platforms=("cpu",)).as_text()
    assert "raylm_paged_decode_attention" in cpu
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(**case)), kernel(case, 1, spec))


@needs_kernel
def test_rejects_a_bad_attention_spec():
    case = make_case(25)
    with pytest.raises(Exception, match="softcap and window >= 0"):
        kernel(case, 0, AttentionSpec(0.1, window=-1))

