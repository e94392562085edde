"""The Pallas (Triton) paged attention kernel, run in Pallas interpret mode on the CPU, for
decode rows and prompt chunks, against the jnp ``paged_attention`` and the naive float64 path
of the C++ kernel's tests (same cases: shuffled block ids, garbage past each row's context,
padding rows, tables wider than needed), and lowered for a GPU to check Triton takes it. Its timing needs a GPU
(``benchmarks/gpu_bench.py``); this file checks what it computes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.model.config.model_config import AttentionSpec
from raylm.model.decoder.attention import paged_attention
from raylm.model.kernels import lowering_for_every_platform
from raylm.model.kernels.pallas import paged_attention as pallas
from tests.model.test_paged_decode_kernel import (
    WINDOW_LENS,
    _dequantized,
    _quantized,
    jnp_reference,
    make_case,
    naive_reference,
)


def kernel(case, layer, spec=None, sinks=None):
    return np.asarray(pallas.pallas_paged_decode_attention(layer=layer, spec=spec, sinks=sinks, interpret=True,
                                                           **case).astype(jnp.float32))


def assert_matches(case, layer, spec=None, sinks=None, tol=1e-5, naive_case=None):
    got = kernel(case, layer, spec, sinks)
    real = np.asarray(case["context_lens"]) > 0
    np.testing.assert_allclose(got[real], jnp_reference(case, layer, spec, sinks)[real], rtol=tol, atol=tol)
    np.testing.assert_allclose(got, naive_reference(naive_case or case, layer, spec, sinks), rtol=tol, atol=tol)
    assert np.all(got[~real] == 0)
    return got


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 16), (20, 1, 16, 4), (16, 2, 64, 32)],
    ids=["smollm-gqa", "mha", "mqa-dh128", "group-of-20", "group-of-8-blocks-of-32"],
)
@pytest.mark.parametrize("layer", [0, 2])
def test_float32_pool_matches_references(heads, kv_heads, head_dim, block_size, layer):
    """Every head layout (groups padded to the dot's 16 rows and past it), block sizes, layers."""
    lens = (1, block_size - 1, block_size, 3 * block_size + 1, 0, 8 * block_size)
    case = make_case(3, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, lens=lens)
    assert_matches(case, layer)


def test_long_rows_split_over_partitions_combine_exactly():
    """A 2048-key row is 128 pages: 16 partitions of 8 pages, combined after; beside short rows."""
    case = make_case(12, layers=2, heads=4, kv_heads=2, head_dim=32, width=136, lens=(2048, 3, 0, 1000))
    assert pallas._split_plan(136, splittable=True) == (8, 16, 256)
    assert_matches(case, 1)


@pytest.mark.parametrize("window", [5, 16, 40, 1000])
def test_sliding_window_reads_nothing_before_it(window):
    """Table entries before each row's window point at a NaN-filled null block: a row matches
    only if no value there reaches its sum (the kernel's dots may load them, masked)."""
    spec = AttentionSpec(64**-0.5, window=window)
    finite = make_case(20, lens=WINDOW_LENS, window=window)
    nan = make_case(20, lens=WINDOW_LENS, window=window, null=np.nan)
    got = kernel(nan, 1, spec)
    np.testing.assert_array_equal(got, kernel(finite, 1, spec))
    assert_matches(finite, 1, spec, naive_case=nan)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_scale_soft_cap_and_sinks(with_sinks):
    """Gemma's scale and soft-cap, gpt-oss's per-head sink logits (one large enough to matter)."""
    case = make_case(30, heads=8, kv_heads=2)
    spec = AttentionSpec(0.3, softcap=4.0)
    sinks = jnp.asarray([0.5, -1.0, 3.0, 0.0, 8.0, -2.0, 1.0, 0.25], jnp.float32) if with_sinks else None
    with_spec = assert_matches(case, 1, spec, sinks)
    assert not np.allclose(with_spec, kernel(case, 1)), "the spec must change the output"


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_quantized_pool_matches_references(scheme):
    """8-bit pools with a scale per (token, kv head): keys' scales on the scores, values' on the
    weights; equal to the jnp path on the same pool and the naive path on its dequantized copy."""
    case = _quantized(make_case(10, heads=8, kv_heads=2, head_dim=64), scheme)
    assert_matches(case, 1, naive_case=_dequantized(case))


def test_bfloat16_pool_and_query_match_float32_within_rounding():
    case = make_case(40, heads=8, kv_heads=2, head_dim=64)
    want = kernel(case, 1)
    half = dict(case, q=case["q"].astype(jnp.bfloat16), k_pool=case["k_pool"].astype(jnp.bfloat16),
                v_pool=case["v_pool"].astype(jnp.bfloat16))
    out = pallas.pallas_paged_decode_attention(layer=1, interpret=True, **half)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=0.05)
    real = np.asarray(case["context_lens"]) > 0
    np.testing.assert_allclose(np.asarray(out, np.float32)[real], jnp_reference(half, 1)[real], atol=0.02)


def test_unsupported_attention_is_named():
    f32 = jnp.zeros((1, 2, 16, 1, 16), jnp.float32)
    assert pallas.unsupported_reason(64, 16, f32, f32, None) is None
    assert "power of two" in pallas.unsupported_reason(80, 16, f32, f32, None)
    assert "power of two" in pallas.unsupported_reason(8, 16, f32, f32, None)
    assert "chunked" in pallas.unsupported_reason(64, 16, f32, f32, AttentionSpec(0.1, chunk=16))
    int8 = _quantized(dict(k_pool=f32, v_pool=f32), "int8")["k_pool"]
    assert "differ" in pallas.unsupported_reason(64, 16, int8, f32, None)
    assert "dtype" in pallas.unsupported_reason(64, 16, f32.astype(jnp.int32), f32.astype(jnp.int32), None)
    case = make_case(1, head_dim=80)
    with pytest.raises(ValueError, match="head size 80"):
        kernel(case, 0)


def _lowered(fn, case, platform):
    return jax.jit(fn).trace(**case).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("variant", ["bfloat16", "int8", "window-softcap-sinks", "prompt-chunks"])
def test_lowers_to_a_triton_kernel_for_a_gpu(variant):
    """Pallas's Triton lowering runs on the CPU: every variant the engine calls becomes one
    Triton custom call (what compiles it to PTX needs a GPU, checked by the GPU benchmark)."""
    case = make_case(5, heads=8, kv_heads=2, head_dim=64)
    spec, sinks = None, None
    if variant == "bfloat16":
        case = dict(case, q=case["q"].astype(jnp.bfloat16), k_pool=case["k_pool"].astype(jnp.bfloat16),
                    v_pool=case["v_pool"].astype(jnp.bfloat16))
    elif variant == "int8":
        case = _quantized(case, "int8")
    elif variant == "prompt-chunks":
        case = chunk_case(5, (40, 16, 77, 5, 0), head_dim=64)
        case = {k: case[k] for k in ("q", "k_pool", "v_pool", "block_tables", "positions", "context_lens", "valid")}
    else:
        spec, sinks = AttentionSpec(0.2, window=20, softcap=5.0), jnp.ones((8,), jnp.float32)
    call = pallas.pallas_paged_attention if variant == "prompt-chunks" else pallas.pallas_paged_decode_attention
    fn = functools.partial(call, layer=jnp.int32(1), spec=spec, sinks=sinks)
    text = _lowered(fn, case, "cuda")
    assert text.count("__gpu$xla.gpu.triton") == 1 and "raylm_paged_attention" in text


def chunk_case(seed, chunk_lens, *, heads=8, kv_heads=2, head_dim=32, block_size=16, lens=(40, 16, 77, 5, 0)):
    """``make_case``'s pools and tables with a prompt chunk per row: the last ``chunk_lens[b]``
    of row ``b``'s context (its K/V already in the pool, as the engine writes a chunk's before
    attending), padded to the longest chunk with invalid tokens at position -1."""
    case = make_case(seed, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, lens=lens)
    rng = np.random.default_rng(seed + 1)
    S = max(chunk_lens)
    positions = np.full((len(lens), S), -1)
    for b, (n, c) in enumerate(zip(lens, chunk_lens)):
        positions[b, :c] = np.arange(n - c, n)
    q = jnp.asarray(rng.standard_normal((len(lens), S, heads, head_dim)), jnp.float32)
    return dict(case, q=q, positions=jnp.asarray(positions, jnp.int32), valid=jnp.asarray(positions >= 0))


def naive_chunk(case, layer, spec=None, sinks=None):
    """Each valid query as a decode row of its own (context: its position + 1) through the naive path."""
    out = np.zeros(case["q"].shape)
    for s in range(case["q"].shape[1]):
        lens = jnp.where(case["valid"][:, s], case["positions"][:, s] + 1, 0)
        out[:, s] = naive_reference(dict(case, q=case["q"][:, s], context_lens=lens), layer, spec, sinks)
    return out


def chunk_kernel(case, layer, spec=None, sinks=None):
    args = {k: case[k] for k in ("q", "k_pool", "v_pool", "block_tables", "positions", "context_lens", "valid")}
    return np.asarray(pallas.pallas_paged_attention(layer=layer, spec=spec, sinks=sinks, interpret=True, **args))


@pytest.mark.parametrize(
    "chunk_lens,heads,kv_heads",
    [((40, 16, 77, 5, 0), 8, 2), ((7, 16, 30, 1, 0), 8, 2), ((40, 3, 77, 5, 0), 9, 3), ((20, 16, 50, 5, 0), 2, 2)],
    ids=["whole-prompts", "chunks-after-cached-prefixes", "group-of-3", "mha"],
)
def test_prompt_chunks_match_references(chunk_lens, heads, kv_heads):
    """Chunks of a row each, several query blocks long, causal at each token; padding tokens get zeros."""
    case = chunk_case(50, chunk_lens, heads=heads, kv_heads=kv_heads)
    got = chunk_kernel(case, 1)
    np.testing.assert_allclose(got, naive_chunk(case, 1), rtol=1e-5, atol=1e-5)
    valid = np.asarray(case["valid"])
    want = paged_attention(case["q"], case["k_pool"], case["v_pool"], jnp.int32(1), case["block_tables"],
                           case["positions"], case["context_lens"], case["valid"])
    np.testing.assert_allclose(got[valid], np.asarray(want)[valid], rtol=1e-5, atol=1e-5)
    assert np.all(got[~valid] == 0)


@pytest.mark.parametrize("window", [5, 16, 40])
def test_prompt_chunks_with_windows_soft_caps_sinks_and_8_bit_pools(window):
    """Each token's own window (a chunk's first tokens see keys its last one does not)."""
    spec = AttentionSpec(0.3, window=window, softcap=4.0)
    sinks = jnp.linspace(-2.0, 6.0, 8, dtype=jnp.float32)
    case = chunk_case(60, (40, 16, 77, 5, 0))
    np.testing.assert_allclose(chunk_kernel(case, 2, spec, sinks), naive_chunk(case, 2, spec, sinks), rtol=1e-5,
                               atol=1e-5)
    quantized = _quantized(case, "int8")
    np.testing.assert_allclose(chunk_kernel(quantized, 2, spec, sinks), naive_chunk(_dequantized(quantized), 2, spec,
                                                                                    sinks), rtol=1e-5, atol=1e-5)


def test_gpu_paged_attention_is_the_kernel_on_a_gpu_and_the_jnp_path_elsewhere():
    case = chunk_case(6, (40, 16, 77, 5, 0))
    args = {k: case[k] for k in ("q", "k_pool", "v_pool", "block_tables", "positions", "context_lens", "valid")}
    cpu = _lowered(functools.partial(pallas.gpu_paged_attention, layer=0), args, "cpu")
    assert "triton" not in cpu
    with lowering_for_every_platform():  # (a new function: jit caches a function's trace)
        gpu = _lowered(functools.partial(pallas.gpu_paged_attention, layer=0), args, "cuda")
    assert "__gpu$xla.gpu.triton" in gpu
    np.testing.assert_allclose(np.asarray(pallas.gpu_paged_attention(layer=0, **args)), naive_chunk(case, 0),
                               rtol=1e-5, atol=1e-5)
