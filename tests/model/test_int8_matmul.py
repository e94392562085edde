"""The integer compute mode's kernel (model/kernels/int8_matmul.py) against a NumPy model of its scheme.

The reference quantizes each row per block of 32 in float32 exactly as the kernel says it does
(scale ``max|x| / 127``, ``rint(x * (127 / max|x|))``), sums each block's products in int64 and
replays the kernel's float32 steps in order: ``acc = fma(sum_b, d_x * d_w, acc)`` (and
``fma(m, d_x * S, acc)`` for 4-bit blocks), then the row scale. Integer sums are exact and every
float step is one IEEE operation, so the results must be equal, not close: the fused multiply-add
is emulated in float64, where the product is exact (at most 19 + 24 bits), and only the addition
could round twice, with a chance of about 2^-29 per step (fixed seeds keep the test deterministic).
Equality also gives the batch-invariance rule (row r of any call is the reference's row r); one
test checks it directly. A second, independent check bounds the distance to the float product of
the gguf package's own dequantized weights by the quantization step: each activation moves by at
most half its block's step, ``max|x| / 254``.

Shapes: 1, 3, 16, 17, 64, 65 and 130 rows (AMX tiles take 16 rows and more, 4-bit blocks 32; fewer
stay on VNNI); weight rows not a multiple of the families' 32, 16 or 8 columns; K not whole blocks
of 32 for per-row int8; several panels and both threads. ``test_every_family_is_the_integer_scheme``
runs every kind with each family this CPU has (AMX, VNNI, AVX2, portable) chosen in this process,
skipping those it lacks; ``test_lower_families`` reruns everything with the AVX2 and portable
families forced by the environment (all families give the same bits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator

import gguf.quants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from raylm.model.kernels import int8_matmul
from raylm.model.kernels.dense import dense
from raylm.model.quantization import int8_panels
from raylm.model.quantization.gguf_blocks import GgufBlocks, from_gguf, map_rows
from raylm.model.quantization.int8_panels import Int8Panels, pack_int8_panels, sub_scaled
from raylm.model.quantization.quant_array import QuantArray, quantize
from tests.gguf_export import random_blocks
from tests.reruns import rerun_in_child

pytestmark = pytest.mark.skipif(int8_matmul.unavailable_reason() is not None, reason="int8 kernel not built")

BLOCK = 32
KINDS = ["Q4_0", "Q4_1", "Q8_0", "int8_g32", "int8"]
# (rows, weight rows, K): column tails of both families on one thread; three row blocks on both threads.
SHAPES = [(1, 67, 96), (3, 67, 96), (16, 67, 96), (17, 67, 96), (64, 67, 96), (65, 67, 96), (130, 67, 96),
          (130, 200, 2080)]
INT8_K = [45, 2100]  # per-row int8 takes any K
# Types with a scale per 32 that the gguf package cannot quantize: random blocks (every bit
# pattern), as tests/gguf_export.py writes them. The K-quants' rows are whole 256-weight blocks.
# "Q4_K+Q6_K" is a Q4_K_M file's fused QKV: Q4_K rows above Q6_K ones (model/quantization/gguf_blocks.py map_rows).
RANDOM_KINDS = {"Q4_K": 512, "IQ4_XS": 512, "IQ4_NL": 96, "MXFP4": 96, "Q5_0": 96, "Q6_K": 512, "Q3_K": 512,
                "Q5_K": 512, "Q5_1": 96, "Q2_K": 512, "Q4_K+Q6_K": 512}


@functools.cache
def _weights(kind: str, n: int, k: int) -> tuple[GgufBlocks | QuantArray, np.ndarray]:
    """A matrix in ``kind`` and its float32 values (the gguf package's dequantization)."""
    w = np.random.default_rng(n + k).standard_normal((n, k)).astype(np.float32)
    if kind in ("int8", "int8_g32"):
        q = quantize(jnp.asarray(w), kind)
        if kind == "int8":  # -128 is a valid int8 weight, though the quantizer never writes it
            q = QuantArray(q.q.at[0, :5].set(-128), q.scale)
        else:
            q = GgufBlocks(q.q.at[0, :5].set(-128), q.scale, q.offset, q.input_shape)
        return q, np.asarray(q.dequantize())
    if "+" in kind:  # types fused into one matrix, as the loader fuses them
        parts = [_weights(part, rows, k) for part, rows in zip(kind.split("+"), (n - n // 3, n // 3))]
        fused = map_rows(lambda *a: np.concatenate(a), *(jax.device_get(m) for m, _ in parts))
        return fused.to_device(), np.concatenate([values for _, values in parts])
    gtype = GGMLQuantizationType[kind]
    data = random_blocks(gtype, (n, k), n + k) if kind in RANDOM_KINDS else gguf.quants.quantize(w, gtype)
    return from_gguf(data, gtype, (n, k)).to_device(), gguf.quants.dequantize(data, gtype).reshape(n, k)


def _activations(m: int, k: int) -> np.ndarray:
    x = (np.random.default_rng(m * k).standard_normal((m, k)) * 3).astype(np.float32)
    x[0, :BLOCK] = 0.0  # a block of zeros has scale 0
    return x


def _quantized_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row and block: the int8 values [M, B, 32], the scale d_x and d_x * S (float32)."""
    m, k = x.shape
    blocks = -(-k // BLOCK)
    padded = np.zeros((m, blocks * BLOCK), np.float32)
    padded[:, :k] = x
    padded = padded.reshape(m, blocks, BLOCK)
    amax = np.abs(padded).max(axis=-1)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(padded * inverse[..., None]).astype(np.int64)
    d = (amax / np.float32(127)).astype(np.float32)
    return q, d, (d * q.sum(axis=-1).astype(np.float32)).astype(np.float32)


def _stored_integers(w: GgufBlocks | QuantArray, k: int) -> np.ndarray:
    """The weight integers the sums use, [N, B, 32]: nibbles 0..15 (IQ4's codes looked up in their
    codebook) or signed bytes (zeros past K)."""
    q = np.asarray(w.q)
    n, blocks = q.shape[0], -(-k // BLOCK)
    if isinstance(w, GgufBlocks) and w.nibbles:
        q = q.reshape(n, blocks, BLOCK // 2)
        codes = np.concatenate([q & 0x0F, q >> 4], axis=-1).astype(np.int64)
        return np.asarray(w.codebook, np.int64)[codes] if w.codebook else codes
    values = np.zeros((n, blocks * BLOCK), np.int64)
    values[:, :k] = q.astype(np.int64)
    return values.reshape(n, blocks, BLOCK)


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _reference(x: np.ndarray, w: GgufBlocks | QuantArray) -> np.ndarray:
    """The integer scheme, step by step (see the module docstring)."""
    k = x.shape[1]
    q, d_x, ds = _quantized_rows(x)
    integers = _stored_integers(w, k).astype(np.float64)  # products and sums are exact in float64
    blocks = isinstance(w, GgufBlocks)
    offsets = None  # two-level offsets per 16: (o = m_0 S_0 + m_1 S_1 [M, N, B], -dmin [N, B])
    if blocks and sub_scaled(w):  # each half's sum times its int8 scale, d_w the super-block's d
        n, count = integers.shape[0], q.shape[1]
        sub = np.asarray(w.scale).reshape(n, count, 2).astype(np.float64)
        halves = [[q[:, b, h * 16:(h + 1) * 16].astype(np.float64) @ integers[:, b, h * 16:(h + 1) * 16].T
                   for h in (0, 1)] for b in range(count)]
        sums = np.stack([lo * sub[:, b, 0] + hi * sub[:, b, 1] for b, (lo, hi) in enumerate(halves)], axis=-1)
        supers = np.asarray(w.supers)
        d_w = np.repeat(supers[:, 0::2], count // (supers.shape[1] // 2), axis=-1)
        if w.has_offset:
            m = np.asarray(w.offset).reshape(n, count, 2).astype(np.float64)
            s = q.reshape(q.shape[0], count, 2, 16).sum(axis=-1).astype(np.float64)  # [M, B, 2]
            o = s[:, None, :, 0] * m[None, :, :, 0] + s[:, None, :, 1] * m[None, :, :, 1]
            offsets = o, -np.repeat(supers[:, 1::2], count // (supers.shape[1] // 2), axis=-1)
    else:
        sums = np.stack([q[:, b].astype(np.float64) @ integers[:, b].T for b in range(q.shape[1])], axis=-1)
        if blocks:  # two-level scales per 32 (Q4_K, IQ4_XS) as the float32 products they stand for
            w = w.with_float_tables()
        d_w = np.asarray(w.scale) if blocks else np.ones((sums.shape[1], sums.shape[2]), np.float32)
    acc = np.zeros(sums.shape[:2], np.float32)
    for b in range(sums.shape[2]):
        acc = _fma32(sums[:, :, b].astype(np.float32), (d_x[:, b, None] * d_w[None, :, b]).astype(np.float32), acc)
        if offsets is not None:
            o, minus_dmin = offsets
            scaled = (d_x[:, b, None] * minus_dmin[None, :, b]).astype(np.float32)
            acc = _fma32(o[:, :, b].astype(np.float32), scaled, acc)
        elif blocks and w.has_offset:
            acc = _fma32(np.asarray(w.offset)[None, :, b], ds[:, b, None], acc)
    return acc if blocks else (acc * np.asarray(w.scale)[None, :]).astype(np.float32)


@functools.cache
def _packed(kind: str, n: int, k: int) -> Int8Panels:
    return pack_int8_panels(_weights(kind, n, k)[0])


def _matmul(x: np.ndarray, kind: str, n: int, k: int) -> np.ndarray:
    return np.asarray(int8_matmul.int8_matmul(jnp.asarray(x), _packed(kind, n, k)))


def _cases() -> list[tuple[str, int, int, int]]:
    cases = [(kind, m, n, k) for kind in KINDS for m, n, k in SHAPES]
    cases += [(kind, m, 67, k) for kind, k in RANDOM_KINDS.items() for m in (1, 3, 65)]
    return cases + [("int8", 65, 67, INT8_K[0]), ("int8", 130, 200, INT8_K[1])]


@pytest.mark.parametrize("kind,m,n,k", _cases())
def test_kernel_is_the_integer_scheme(kind, m, n, k):
    w, values = _weights(kind, n, k)
    x = _activations(m, k)
    got = _matmul(x, kind, n, k)
    np.testing.assert_array_equal(got, _reference(x, w))
    # Independently of the reference: within the activations' rounding of the float product.
    _, d_x, _ = _quantized_rows(x)
    padded = np.zeros((n, d_x.shape[1] * BLOCK))
    padded[:, :k] = np.abs(values)
    bound = 0.5 * d_x.astype(np.float64) @ padded.reshape(n, -1, BLOCK).sum(axis=-1).T
    exact = x.astype(np.float64) @ values.astype(np.float64).T
    assert np.all(np.abs(got - exact) <= bound * (1 + 1e-4) + 1e-5 * np.abs(exact).max())


@pytest.mark.parametrize("kind", ["Q4_1", "int8"])
def test_a_row_does_not_depend_on_the_batch(kind):
    """Row r of a 65-row call is the 1-row call on row r, bit for bit."""
    x = _activations(65, 96)
    batch = _matmul(x, kind, 67, 96)
    for r in (0, 1, 31, 64):
        np.testing.assert_array_equal(batch[r], _matmul(x[r: r + 1], kind, 67, 96)[0])


@pytest.mark.parametrize("kind,k", [(kind, 96) for kind in KINDS] + [("int8", INT8_K[0]), *RANDOM_KINDS.items()])
def test_packed_weights_give_back_the_stored_matrix(kind, k):
    """The packed layout keeps every weight: the embedding lookup (``rows``) and ``dequantize``
    of the packed matrix equal the stored matrix's, bit for bit, column tails included."""
    w, values = _weights(kind, 67, k)
    packed = _packed(kind, 67, k)
    assert packed.shape == w.shape
    np.testing.assert_array_equal(np.asarray(packed.dequantize()), values)
    ids = jnp.asarray([[66, 0], [17, 16]])
    np.testing.assert_array_equal(np.asarray(packed.rows(ids, jnp.float32)), values[np.asarray(ids)])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "int8_g32"])
def test_block_tables_are_float16_where_their_values_are(kind):
    """GGUF's scales and offsets are float16 values: packed as float16 (half the table bytes),
    and the results are those of the same tables in float32, bit for bit, decode rows and a
    prompt chunk alike. int8_g32's float32 scales are not float16 values: kept float32."""
    n, k = 67, 96
    packed = _packed(kind, n, k)
    half = kind != "int8_g32"
    assert packed.scale.dtype == packed.offset.dtype == (jnp.float16 if half else jnp.float32)
    wide = dataclasses.replace(packed, scale=packed.scale.astype(jnp.float32), offset=packed.offset.astype(jnp.float32))
    for m in (1, 3, 65):
        x = jnp.asarray(_activations(m, k))
        np.testing.assert_array_equal(np.asarray(int8_matmul.int8_matmul(x, packed)),
                                      np.asarray(int8_matmul.int8_matmul(x, wide)))
    if half:  # a sixth fewer bytes per 4-bit weight (0.625 instead of 0.75), an eighteenth per 8-bit one
        assert packed.nbytes < wide.nbytes


@pytest.mark.parametrize("kind", ["Q6_K", "Q3_K"])
def test_scales_per_16_pack_in_six_bits(kind):
    """Q6_K and Q3_K (weights -32..31) are held in 6.5625 bits a weight, as Q6_K's file holds them:
    6 for the value, 0.5 for the int8 scales per 16, 0.0625 for the super-block's float16 d. Larger
    weights in that layout (IQ4_XS's table values fused beside Q6_K) stay in the exact kernel."""
    w, _ = _weights(kind, 64, 512)
    packed = pack_int8_panels(w)
    assert packed.nbytes * 8 == 6.5625 * 64 * 512
    wide = dataclasses.replace(w, q=w.q.at[3, 7].set(40))
    assert int8_matmul.takes_int8_activations(w) and not int8_matmul.takes_int8_activations(wide)
    with pytest.raises(TypeError, match="not GGUF blocks with a scale per 16"):
        pack_int8_panels(wide)


# Two-level kinds with a scale per 32, and their bits a weight packed: the value's (4 or 8), int8
# scales (and offsets) per 32 (0.25 each), float16 d (and -dmin) per 256 (0.0625 each).
TWO_LEVEL_BITS = {"Q4_K": 4 + 0.5 + 0.125, "Q5_K": 8 + 0.5 + 0.125, "IQ4_XS": 4 + 0.25 + 0.0625}


@pytest.mark.parametrize("kind", list(TWO_LEVEL_BITS))
def test_two_level_scales_per_32_keep_their_levels(kind):
    """Q4_K, Q5_K and IQ4_XS keep int8 scales (and offsets) per 32 under float16 d (and -dmin) per
    256, and the kernel forms d * sc per block: the very bits of the same matrix packed with the
    float32 tables of those products, for decode rows and prompt chunks, in fewer bytes."""
    n, k = 64, 512
    w, _ = _weights(kind, n, k)
    packed, tables = pack_int8_panels(w), pack_int8_panels(jax.device_get(w).with_float_tables())
    assert packed.sub_scale.shape == (n // 16, k // BLOCK, 2 if w.has_offset else 1, 16)
    assert packed.scale.shape == (n // 16, k // 256, 16) and packed.scale.dtype == jnp.float16
    assert tables.sub_scale.size == 0 and tables.scale.dtype == jnp.float32
    codebook = packed.codebook.nbytes  # IQ4_XS's 16 values, once per matrix
    assert (packed.nbytes - codebook) * 8 == TWO_LEVEL_BITS[kind] * n * k < (tables.nbytes - codebook) * 8
    for m in (1, 3, 65):
        x = jnp.asarray(_activations(m, k))
        np.testing.assert_array_equal(np.asarray(int8_matmul.int8_matmul(x, packed)),
                                      np.asarray(int8_matmul.int8_matmul(x, tables)))


# 4-bit codes and their bits a weight packed: the code (4), then IQ4_NL's float16 d per 32 (0.5),
# IQ4_XS's int8 scale per 32 and float16 d per 256 (0.25 + 0.0625), MXFP4's 2^(e - 128) per 32 (0.5:
# the random scales, 2^-11 .. 2^-5, are float16 values, as trained weights' are; float32 where one
# is not).
CODE_BITS = {"IQ4_NL": 4 + 0.5, "IQ4_XS": 4 + 0.25 + 0.0625, "MXFP4": 4 + 0.5}


@pytest.mark.parametrize("kind", list(CODE_BITS))
def test_codebook_codes_stay_four_bits_and_sum_as_their_values(kind):
    """IQ4 and MXFP4 keep their 4-bit codes and codebook (not bytes of the values: twice the bytes)
    and the kernel gives the bits of the same matrix packed as those bytes, for decode rows and
    prompt chunks, whichever family this CPU runs."""
    n, k = 64, RANDOM_KINDS[kind]
    w, _ = _weights(kind, n, k)
    packed, as_bytes = pack_int8_panels(w), pack_int8_panels(jax.device_get(w).widened())
    assert packed.q.dtype == jnp.uint8 and packed.q.shape[2] == 4 and packed.codebook.shape == (16,)
    assert np.array_equal(np.asarray(packed.codebook), np.asarray(w.codebook))
    assert as_bytes.q.shape[2] == 8 and as_bytes.codebook.size == 0
    assert (packed.nbytes - packed.codebook.nbytes) * 8 == CODE_BITS[kind] * n * k
    for m in (1, 3, 65):
        x = jnp.asarray(_activations(m, k))
        np.testing.assert_array_equal(np.asarray(int8_matmul.int8_matmul(x, packed)),
                                      np.asarray(int8_matmul.int8_matmul(x, as_bytes)))


def _float32_scale_in_a_late_row() -> GgufBlocks:
    """Q4_1 blocks whose row 50 has a scale that is no float16 value: only the last slice of 32
    rows needs float32 tables, and the whole matrix's are float32."""
    w, _ = _weights("Q4_1", 67, 96)
    return dataclasses.replace(w, scale=w.scale.at[50, 1].set(np.float32(1 + 2**-20)))


def _stacked_outputs() -> GgufBlocks:
    w, _ = _weights("Q4_1", 64, 96)
    return GgufBlocks(w.q.reshape(2, 32, -1), w.scale.reshape(2, 32, -1), w.offset.reshape(2, 32, -1), (3, 32))


@pytest.mark.parametrize("kind", KINDS + list(RANDOM_KINDS) + ["late float32 row", "output dims"])
def test_a_matrix_packed_in_slices_of_rows_is_the_matrix_packed_whole(kind, monkeypatch):
    """Packing a slice of output rows at a time (bounded temporaries for a large head) gives the
    whole matrix's panels and tables, bit for bit and dtype for dtype, a partial last slice and
    float32 tables needed by one slice alone included."""
    if kind == "late float32 row":
        w = _float32_scale_in_a_late_row()
    elif kind == "output dims":
        w = _stacked_outputs()
    else:
        w = _weights(kind, 67, RANDOM_KINDS.get(kind, 96))[0]
    whole = pack_int8_panels(w)
    monkeypatch.setattr(int8_panels, "PACK_ROWS", 32)
    sliced = pack_int8_panels(w)
    assert (sliced.output_shape, sliced.input_shape) == (whole.output_shape, whole.input_shape)
    for field in ("q", "scale", "offset", "row_scale", "sub_scale", "codebook"):
        a, b = getattr(sliced, field), getattr(whole, field)
        assert (a.shape, a.dtype) == (b.shape, b.dtype), field
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if kind == "late float32 row":
        assert whole.scale.dtype == jnp.float32


def test_a_packed_matrix_keeps_its_output_and_input_dims():
    """A weight with several output and input dims (the fused QKV, ``wo [D, H, Dh]``) packs flat
    and multiplies as ``model.kernels.dense`` views it."""
    w, values = _weights("Q4_1", 64, 96)
    packed = pack_int8_panels(_stacked_outputs())
    assert packed.shape == (2, 32, 3, 32)
    x = _activations(5, 96)
    got = dense(jnp.asarray(x).reshape(5, 3, 32), packed, 2, kernel=True)
    np.testing.assert_array_equal(np.asarray(got).reshape(5, 64), _reference(x, w))


@contextlib.contextmanager
def _family(family: str) -> Iterator[None]:
    """Runs the block with ``family`` chosen in this process (skipped where the CPU lacks it), then
    gives the choice back to the environment."""
    try:
        if int8_matmul.use_family(family) != family:
            pytest.skip(f"this CPU has no {family} family (or Linux refused AMX)")
        yield
    finally:
        int8_matmul.use_family("")


@functools.cache
def _reference_of(kind: str, m: int, n: int, k: int) -> np.ndarray:
    return _reference(_activations(m, k), _weights(kind, n, k)[0])


@pytest.mark.parametrize("family", int8_matmul.FAMILIES)
@pytest.mark.parametrize("kind", KINDS + list(RANDOM_KINDS))
def test_every_family_is_the_integer_scheme(kind, family):
    """``family`` chosen in this process (skipped where the CPU lacks it) gives the reference's bits
    for decode rows and prompt chunks (1, 16, 17, 64, 130 rows: AMX's whole and partial tiles of 16
    and 32 rows), 67 columns (a partial tile of 16 and 32) and per-row int8 at K = 45 (a partial
    last block); the families other than the scalar loops also on several panels and both threads."""
    k = INT8_K[0] if kind == "int8" else RANDOM_KINDS.get(kind, 96)
    cases = [(m, 67, k) for m in (1, 16, 17, 64, 130)]
    cases += [SHAPES[-1]] if family != "portable" and kind in KINDS else []
    with _family(family):
        for m, n, k in cases:
            got = _matmul(_activations(m, k), kind, n, k)
            np.testing.assert_array_equal(got, _reference_of(kind, m, n, k), err_msg=f"{family} {m} x {n} x {k}")


def _at_extreme(w: GgufBlocks, largest: bool) -> GgufBlocks:
    """``w`` with every stored integer at its type's largest (or smallest) value: 4-bit blocks'
    nibbles 15 (0), codes the codebook's largest (smallest) value, bytes the largest (smallest)
    value the matrix holds (Q6_K's random blocks 31 and -32, Q5_K's 31 and 0, Q8_0's 127 and -127)."""
    q = np.asarray(w.q)
    if w.nibbles:
        book = np.asarray(w.codebook) if w.codebook else np.arange(16)
        code = int(np.argmax(book) if largest else np.argmin(book))
        return dataclasses.replace(w, q=jnp.full(q.shape, code | code << 4, q.dtype))
    return dataclasses.replace(w, q=jnp.full(q.shape, q.max() if largest else q.min(), q.dtype))


@pytest.mark.parametrize("family", int8_matmul.FAMILIES)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "MXFP4"])
def test_every_family_holds_the_largest_sums(kind, family):
    """The families add some products in 16-bit lanes before widening them (AVX2: a block's
    nibble products, two vectors of six-bit ones), on the bound that no such sum passes 32767.
    Weights all at their type's largest or smallest integer against activations all at +-127 (the
    largest products there are, all of one sign) give the reference's bits: a sum that wrapped
    would be off by 65536 of them."""
    k = RANDOM_KINDS.get(kind, 96)
    x = np.concatenate([np.ones((2, k), np.float32), -np.ones((1, k), np.float32)])
    x[1, k // 2:] = -1.0  # the second row's halves of opposite sign
    with _family(family):
        for largest in (True, False):
            w = _at_extreme(_weights(kind, 67, k)[0], largest)
            got = np.asarray(int8_matmul.int8_matmul(jnp.asarray(x), pack_int8_panels(w)))
            np.testing.assert_array_equal(got, _reference(x, w), err_msg=f"{family}, largest {largest}")


def test_the_environment_names_the_family():
    """``RAYLM_INT8_MATMUL_FAMILY`` (set by test_lower_families in a child) picks the family, capped
    at the best this CPU has; unset, the best. Unknown names are errors."""
    best = int8_matmul.use_family("amx")
    int8_matmul.use_family("")
    named = os.environ.get("RAYLM_INT8_MATMUL_FAMILY", "amx")
    families = int8_matmul.FAMILIES  # best first
    assert int8_matmul.family() == families[max(families.index(named), families.index(best))]
    with pytest.raises(ValueError, match="expected one of amx, vnni, avx2, portable"):
        int8_matmul.use_family("sse2")


@pytest.mark.parametrize("family,select", [("avx2", "not lower_families and not every_family"),
                                           ("portable", "not lower_families and not every_family and not 2080 "
                                                        "and not 2100")])
def test_lower_families(family, select):
    """The tests above with a lower family forced (what AVX2-only and older CPUs run; the scalar
    loops skip the large shapes, which only they find slow)."""
    rerun_in_child(__file__, select, {"RAYLM_INT8_MATMUL_FAMILY": family})


@pytest.mark.parametrize("why", ["a codebook of 15 values", "a codebook beside offsets", "codes without one"])
def test_kernel_itself_checks_the_codebook(why):
    """The handler's own check (past ``int8_matmul``'s): 4-bit codes come with a codebook of 16 int8
    values and no offsets, and other layouts with none; else an error naming every operand, never
    a read past a buffer."""
    codes, nibbles = _packed("IQ4_NL", 67, 96), _packed("Q4_1", 67, 96)
    bad = {
        "a codebook of 15 values": dataclasses.replace(codes, codebook=codes.codebook[:15]),
        "a codebook beside offsets": dataclasses.replace(nibbles, codebook=codes.codebook),
        "codes without one": dataclasses.replace(codes, codebook=nibbles.codebook),
    }[why]
    x = jnp.asarray(_activations(3, 96))
    np.asarray(int8_matmul.int8_matmul(x, codes))  # the good call
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"codebook \[\d+\] .* codebook int8 \[16\]"):
        np.asarray(int8_matmul.int8_matmul(x, bad))
