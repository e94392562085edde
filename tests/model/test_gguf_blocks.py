"""GGUF block matrices kept as stored: the same float32 numbers as expanding them, bit for bit.

The references are independent of raylm's code: the gguf package's own quantizer and numpy
dequantizer (for the values), and the float32 matrix through the float32 kernel or XLA's dot
(for every product), down to a whole engine run on the bundled model, whose layers are Q4_1
and whose tied embedding / LM head is Q8_0.
"""

from __future__ import annotations

import gguf.quants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.kernels import dense as dense_module
from raylm.model.kernels.dense import KERNEL_MAX_ROWS, dense, dense_matmul, gguf_matmul
from raylm.model.kernels.int8_matmul import takes_int8_activations
from raylm.model.loaders.hf_quantized_matrix import BlockScaled
from raylm.model.loaders.load import keep_gguf_blocks, load_model
from raylm.model.quantization.gguf_blocks import GgufBlocks, from_gguf, map_rows
from raylm.model.quantization.quant_array import quantize, weight_bytes
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.reruns import rerun_in_child

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
needs_kernel = pytest.mark.skipif(not dense_module.available(), reason="C++ kernel not built; XLA path tested")


def _matrix(n: int, k: int, seed: int) -> np.ndarray:
    """Gaussian weights with a zero row, a constant row and outliers (GGUF's hard cases)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[0] = 0.0
    if n > 1:
        w[1] = 0.75
    w[rng.integers(0, n, 3), rng.integers(0, k, 3)] = [40.0, -60.0, 1e-3]
    return w


def _blocks(kind: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> tuple[GgufBlocks, np.ndarray]:
    """A matrix quantized by the gguf package, as blocks and as gguf's own float32 dequantization."""
    data = gguf.quants.quantize(_matrix(n, k, seed), kind)
    expected = gguf.quants.dequantize(data, kind).reshape(n, k).astype(np.float32)
    return from_gguf(data, kind, (n, k)), expected


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_values_are_the_gguf_packages_dequantization(kind):
    blocks, expected = _blocks(kind, 13, 96)
    np.testing.assert_array_equal(np.asarray(blocks.dequantize()), expected)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda b: b.dequantize())(blocks.to_device())), expected)
    rows = jnp.asarray([[4, 0], [12, 4]])
    np.testing.assert_array_equal(np.asarray(blocks.to_device().rows(rows, jnp.float32)), expected[np.asarray(rows)])
    assert blocks.shape == (13, 96) and blocks.nbytes < expected.nbytes / (3 if kind == TYPES[2] else 5)


def test_row_operations_and_input_views_act_on_the_matrix():
    a, ea = _blocks(GGMLQuantizationType.Q4_1, 8, 64, seed=1)
    b, eb = _blocks(GGMLQuantizationType.Q4_1, 4, 64, seed=2)
    fused = map_rows(lambda x, y: np.concatenate([x.reshape(2, 4, *x.shape[1:]), y.reshape(2, 2, *y.shape[1:])], 1),
                     a, b)
    assert isinstance(fused, GgufBlocks) and fused.shape == (2, 6, 64)
    expected = np.concatenate([ea.reshape(2, 4, 64), eb.reshape(2, 2, 64)], 1)
    np.testing.assert_array_equal(np.asarray(fused.dequantize()), expected)
    viewed = a.with_input_shape((4, 16))
    np.testing.assert_array_equal(np.asarray(viewed.dequantize()), ea.reshape(8, 4, 16))
    # Blocks of another kind in one fuse: one layout that holds both exactly (bytes with offsets).
    c, ec = _blocks(GGMLQuantizationType.Q8_0, 4, 64, seed=3)
    mixed = map_rows(lambda x, y: np.concatenate([x, y]), a, c)
    assert isinstance(mixed, GgufBlocks) and not mixed.nibbles and mixed.has_offset
    np.testing.assert_array_equal(np.asarray(mixed.dequantize()), np.concatenate([ea, ec]))
    # Blocks beside a float matrix: expanded, still exact.
    expanded = map_rows(lambda x, y: np.concatenate([x, y]), a, ec)
    np.testing.assert_array_equal(expanded, np.concatenate([ea, ec]))
    with pytest.raises(ValueError, match="cannot view"):
        a.with_input_shape((3, 16))


@needs_kernel
@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 17, 32, 40])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (130, 64), (960, 576)])
def test_kernel_is_the_float32_kernel_on_the_dequantized_matrix(kind, m, n, k):
    blocks, w = _blocks(kind, n, k, seed=m + n)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.float32)
    got = np.asarray(gguf_matmul(x, blocks.to_device()))
    np.testing.assert_array_equal(got, np.asarray(dense_matmul(x, jnp.asarray(w))))
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ w.astype(np.float64).T, rtol=1e-4, atol=1e-3)


def _fp8_blocks(n: int, k: int, seed: int = 0) -> tuple[GgufBlocks, np.ndarray]:
    """A matrix as an FP8 checkpoint stores it (float8_e4m3fn values, a float32 scale per 128x128
    block, partial blocks at the edges), held as blocks, and its float32 dequantization: fp8 * scale.
    Small weights beside the outliers are e4m3 subnormals."""
    w = _matrix(n, k, seed)
    rows, cols = -(-n // 128), -(-k // 128)
    padded = np.zeros((rows * 128, cols * 128), np.float32)
    padded[:n, :k] = np.abs(w)
    scale = (padded.reshape(rows, 128, cols, 128).max(axis=(1, 3)) / 448).astype(np.float32)
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:n, :k]
    q = (w / np.where(full > 0, full, 1)).astype(jnp.float8_e4m3fn)
    blocks = BlockScaled(q, scale, (128, 128)).blocks()
    assert blocks is not None and blocks.fp8
    return blocks, q.astype(np.float32) * full


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 17, 40])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (130, 160), (300, 576)])
def test_fp8_block_kernel_is_the_float32_kernel_on_the_dequantized_matrix(m, n, k):
    blocks, w = _fp8_blocks(n, k, seed=m + n)
    assert np.any((np.abs(w) > 0) & (np.abs(w) < 2.0**-6 * np.abs(w).max() / 448))  # subnormal codes present
    np.testing.assert_array_equal(np.asarray(blocks.dequantize()), w)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.float32)
    got = np.asarray(gguf_matmul(x, blocks.to_device()))
    np.testing.assert_array_equal(got, np.asarray(dense_matmul(x, jnp.asarray(w))))


def test_fp8_blocks_beside_integer_blocks_are_expanded():
    a, ea = _fp8_blocks(8, 64, seed=1)
    b, eb = _blocks(GGMLQuantizationType.Q8_0, 4, 64, seed=2)
    assert not takes_int8_activations(a) and takes_int8_activations(b)
    fused = map_rows(lambda x, y: np.concatenate([x, y]), a, b)
    np.testing.assert_array_equal(fused, np.concatenate([ea, eb]))
    same = map_rows(lambda x, y: np.concatenate([x, y]), a, a)
    assert isinstance(same, GgufBlocks) and same.fp8
    np.testing.assert_array_equal(np.asarray(same.dequantize()), np.concatenate([ea, ea]))
    assert BlockScaled(np.zeros((4, 48), jnp.float8_e4m3fn), np.ones((1, 1), np.float32), (128, 128)).blocks() is None


@needs_kernel
def test_eight_lane_family_too():
    """The tests above with the 8-lane tiles forced (what AVX2 CPUs run)."""
    rerun_in_child(__file__, "kernel_is_the_float32_kernel", {"RAYLM_DENSE_NARROW_TILES": "1"})


@needs_kernel
def test_kernel_rejects_mismatched_operands():
    blocks, _ = _blocks(GGMLQuantizationType.Q4_1, 4, 64)
    with pytest.raises(ValueError, match="float32 activations"):
        gguf_matmul(jnp.ones((1, 64), jnp.bfloat16), blocks.to_device())
    with pytest.raises(ValueError, match=r"x \[M, K\] and 2-D blocks"):
        gguf_matmul(jnp.ones((1, 32)), blocks.to_device())
    with pytest.raises(ValueError, match="whole blocks"):
        from_gguf(np.zeros((2, 20), np.uint8), GGMLQuantizationType.Q4_1, (2, 16))


def _raw_gguf_call(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, supers: np.ndarray) -> np.ndarray:
    """The GGUF kernel's FFI target called as it is, past ``gguf_matmul``'s checks: x [2, 64] -> y [2, 3]."""
    target = dense_module._GGUF_KERNEL.target(2)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((2, 3), jnp.float32))
    return np.asarray(call(jnp.ones((2, 64)), q, scale, offset, supers, jnp.zeros((0,), jnp.float32)))


_NIBBLES, _TABLE, _NO_SUPERS = np.zeros((3, 32), np.uint8), np.ones((3, 2), np.float32), np.zeros((3, 0), np.float32)
_BAD_OPERANDS = {
    "a row short": (np.zeros((3, 31), np.uint8), _TABLE, _TABLE, _NO_SUPERS),
    "no offset for 4-bit blocks": (_NIBBLES, _TABLE, np.zeros((3, 0), np.float32), _NO_SUPERS),
    "int8 tables without supers": (_NIBBLES, _TABLE.astype(np.int8), _TABLE.astype(np.int8), _NO_SUPERS),
    "fp8 with an offset": (np.zeros((3, 64), jnp.float8_e4m3fn), _TABLE, _TABLE, _NO_SUPERS),
}


@needs_kernel
@pytest.mark.parametrize("why", list(_BAD_OPERANDS))
def test_kernel_itself_names_the_operands_it_takes(why):
    """The handler's own check (gguf_operands.h, shared with the grouped kernel): bad buffers get
    an error that says what they must be and what they are, never a read past them."""
    assert (_raw_gguf_call(_NIBBLES, _TABLE, _TABLE, _NO_SUPERS) == 64.0).all()  # the good call: w = 0 * 1 + 1
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"q \[N, K/2\] uint8 .* got N 3, K 64, q \[3, "):
        _raw_gguf_call(*_BAD_OPERANDS[why])


@pytest.mark.parametrize("kernel", [True, False], ids=["unsharded", "sharded program"])
@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 8])
def test_dense_gives_what_the_float32_matrix_gives(kernel, rows):
    """Every path ``dense`` takes (the small-batch and prompt block kernels; a plain tensordot
    over the widened matrix) gives the float32 matrix's result on the same path, bit for bit."""
    blocks, w = _blocks(GGMLQuantizationType.Q4_1, 96, 128, seed=rows)
    blocks = blocks.with_input_shape((4, 32)).to_device()
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 1, 4, 32)), jnp.float32)
    run = jax.jit(lambda x, w: dense(x, w, 2, kernel=kernel))
    got = run(x, blocks)
    assert got.shape == (rows, 1, 96)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(run(x, jnp.asarray(w.reshape(96, 4, 32)))))


def test_quantizing_blocks_quantizes_the_expanded_matrix():
    blocks, w = _blocks(GGMLQuantizationType.Q4_1, 16, 64)
    got, expected = quantize(blocks.to_device(), "int8"), quantize(jnp.asarray(w), "int8")
    np.testing.assert_array_equal(np.asarray(got.q), np.asarray(expected.q))
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(expected.scale))


def test_auto_keeps_blocks_only_where_they_serve():
    assert keep_gguf_blocks("auto", "float32", 1) == (jax.default_backend() == "cpu")
    assert not keep_gguf_blocks("auto", "bfloat16", 1) and not keep_gguf_blocks("auto", "float32", 2)
    assert not keep_gguf_blocks("expand", "float32", 1) and keep_gguf_blocks("keep", "float32", 1)
    with pytest.raises(ValueError, match="gguf_blocks=keep .* on 2 devices"):
        keep_gguf_blocks("keep", "float32", 2)
    with pytest.raises(ValueError, match="gguf_blocks=keep .* dtype=bfloat16"):
        keep_gguf_blocks("keep", "bfloat16", 1)
    with pytest.raises(ValueError, match="gguf_blocks must be one of"):
        keep_gguf_blocks("sometimes", "float32", 1)


def test_blocks_are_not_sharded():
    import dataclasses

    from raylm.model.runtime.sharding import make_mesh, shard_params

    model = load_model(DEFAULT_MODEL, keep_blocks=True)
    config = dataclasses.replace(model.config, num_heads=8, num_kv_heads=2)  # a head count 2 devices split
    with pytest.raises(ValueError, match="gguf_blocks='expand'"):
        shard_params(model.params, config, make_mesh(2))


PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colors: red,",
    " ".join(["counting"] * 45),  # a prompt of more rows than the kernel takes
]


def test_bundled_model_served_from_blocks_is_bit_identical_to_float32():
    """Greedy tokens and every logprob, batched and alone, prompt chunks on XLA's path and
    decode steps on the kernel's: identical whether the Q4_1 / Q8_0 matrices stay blocks."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for choice in ("keep", "expand"):
        llm = LLM(DEFAULT_MODEL, gguf_blocks=choice, max_model_len=256, num_kv_blocks=96)
        batched = llm.generate(PROMPTS, params)
        alone = llm.generate(PROMPTS[:1], params)
        runs[choice] = [
            (c.token_ids, c.logprobs)
            for out in (*batched, *alone) for c in out.outputs
        ]
        if choice == "keep":
            blocks_bytes = weight_bytes(llm.engine.model.params)
        else:
            float_bytes = weight_bytes(llm.engine.model.params)
    assert runs["keep"] == runs["expand"]
    assert float_bytes > 4.5 * blocks_bytes
