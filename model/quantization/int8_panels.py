"""The integer compute mode's weights: 4-, 6- and 8-bit matrices repacked once, at load, for its kernel.

Why: the integer kernel (model/kernels/int8_matmul.cc) multiplies sixteen output columns at once,
each 4-byte vector lane holding one column's consecutive weight bytes. Read as stored, row after
row, every call had to gather that layout first: at one decode row the gathers cost more than
the products (0.4x the exact mode's speed). Repacked once, a call streams each weight byte once,
in the order it uses it. It is the same numbers in another order: nothing is re-quantized.

Layout of a matrix ``[N..., K...]`` (outputs and inputs each flattened, ``N`` and ``K``), in
``G = ceil(N / 16)`` groups of 16 columns and ``B = ceil(K / 32)`` blocks of 32 inputs:

- ``q [G, B, T, 16, 4]``: lane ``j`` of vector ``t`` holds column ``16 g + j``'s bytes ``4t .. 4t+3``
  of block ``b`` as stored: for 4-bit GGUF blocks (``T = 4``, uint8) GGUF's byte ``i`` holds
  weight ``i`` in its low nibble and ``i + 16`` in its high one; for 8-bit weights (``T = 8``,
  int8) the bytes are the weights, zero past ``K``. Columns past ``N`` repeat column ``N - 1``
  (the kernel computes them and drops them).
- ``scale [G, B, 16]``: each block's ``d`` (GGUF blocks, ``int8_g32``), else ``[G, B, 0]``.
- ``offset [G, B, 16]``: the block's ``m`` (``w = d q + m``) where it has one (4-bit blocks, Q5_1,
  Q5_K's ``-(dmin * m)``), else ``[G, B, 0]``.
- ``scale`` and ``offset`` are float16 where every value of both is a float16 (GGUF stores them
  so), else float32: a decode row reads every byte of the matrix, and float32 tables were a
  third of a 4-bit weight's bytes (0.25 of 0.75 per weight; float16: 0.125 of 0.625). The
  kernel widens them exactly, so the results do not change.
- ``row_scale [N]``: per-row int8's scale per output column, else ``[0]``.
- ``codebook [16]`` (int8): for 4-bit codes (IQ4_NL, IQ4_XS, MXFP4), the values the codes stand
  for (IQ4's table; MXFP4's e2m1 values doubled, its scale halved), else ``[0]``. ``q`` holds the
  codes as 4-bit blocks hold nibbles, and the kernel looks them up with one byte shuffle per
  vector: a weight stays 4 bits (IQ4_NL and MXFP4 4.5 bits a weight with float16 scales, MXFP4 5
  where a scale is no float16 value, IQ4_XS 4.3125), where bytes of the values took 4 more. The
  sums are those of the values, so the results are the bits the bytes gave.
- Two-level scales (the K-quants and IQ4_XS: an int8 scale, and offset, per group under a
  float16 ``d``, and ``dmin``, per super-block of 256) keep their two levels, as their files do:
  ``scale`` and ``offset`` hold ``d`` and ``-dmin`` once per super-block, ``[G, K/256, 16]``, and
  ``sub_scale [G, B, rows, 16]`` the int8 scales and then offsets of each block. Scales per 32
  (Q4_K, Q5_K, IQ4_XS; ``rows`` 1, or 2 with offsets): the kernel forms ``d * sc`` and ``-dmin *
  m`` per block, exact float32 products, the values a float32 table would hold at a third of its
  bytes (Q4_K: 4.625 bits a weight, where such tables made it 6). Else ``sub_scale`` is ``[0, 0,
  0, 0]``.
- Scales per 16 (Q6_K, Q3_K, weights -32..31; with offsets Q2_K, and a Q4_K_M's Q4_K query and
  key fused with its Q6_K value) are held in 6 bits, as Q6_K's file holds them: ``u = v + 32`` in
  ``q`` (uint8, ``T = 6``: vectors 0..3 ``u``'s low four bits as 4-bit blocks hold nibbles,
  vector ``4 + h`` the top two bits of half ``h``'s weights, lane byte ``i`` holding those of
  weights ``16h + 4t + i`` at bits ``2t, 2t + 1``); ``sub_scale``'s ``rows`` are the two halves'
  scales (2), then their offsets (4). The kernel sums each half in integers, multiplies it by its
  int8 scale and adds the two in int32 (as llama.cpp does), so the per-16 scales ``d * sc`` are
  never formed. Q6_K: 6.5625 bits a weight, as in its file, where bytes took 9.

Only the integer kernel reads this layout; ``rows`` (the tied embedding's lookup) and
``dequantize`` (references) rebuild the stored form of what they need.
"""

from __future__ import annotations

import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from raylm.model.quantization.gguf_blocks import BLOCK, GgufBlocks
from raylm.model.quantization.gguf_transcode import pack_nibbles
from raylm.model.quantization.quant_array import QuantArray
from raylm.model.quantization.stored_bytes import StoredBytes

GROUP = 16  # output columns per packed group (the AVX-512 kernel's vector of int32 lanes)
SUPER = 256  # weights per super-block of two-level scales: one entry of d (and -dmin) in their tables
LANE = 4  # bytes per lane: one vpdpbusd adds four products


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Panels(StoredBytes):
    """A matrix ``[*output_shape, *input_shape]`` packed for the integer kernel (module docstring),
    or with ``experts`` a stack of them ``[experts, *output_shape, *input_shape]`` (a mixture of
    experts' experts): every array gains a leading expert dim, expert ``e``'s slice being exactly
    ``pack_int8_panels`` of its matrix."""

    q: Any
    scale: Any
    offset: Any
    row_scale: Any
    sub_scale: Any
    codebook: Any
    output_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    input_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    experts: int = dataclasses.field(default=0, metadata={"static": True})  # 0: one matrix

    @property
    def shape(self) -> tuple[int, ...]:
        return (*((self.experts,) if self.experts else ()), *self.output_shape, *self.input_shape)

    def expert(self, e: int) -> "Int8Panels":
        """Expert ``e``'s matrix of a stack (its arrays' slices: what the grouped kernel reads for it)."""
        if not self.experts:
            raise ValueError(f"expert({e}) of one packed matrix {self.shape}, not a stack of experts")
        return Int8Panels(*(a[e] for a in self.arrays()), self.output_shape, self.input_shape)

    def arrays(self) -> tuple[Any, ...]:
        """The kernel's operands in its order: ``q, scale, offset, row_scale, sub_scale, codebook``."""
        return self.q, self.scale, self.offset, self.row_scale, self.sub_scale, self.codebook

    def rows(self, index: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """Output entries ``index`` (flat ids, e.g. token ids into ``[V, D]``; for a stack, into
        ``[experts * N]``) with their inputs, dequantized exactly as the stored matrix's ``rows``
        would give them."""
        per_expert = math.prod(self.output_shape)
        lead_index = (index // per_expert,) if self.experts else ()
        index = index % per_expert if self.experts else index

        def at(a: jax.Array, *rest: Any) -> jax.Array:
            return a[(*lead_index, *rest)]

        group, lane = index // GROUP, index % GROUP
        lead = index.shape
        size = math.prod(self.input_shape)
        every = slice(None)
        q = at(self.q, group, every, every, lane, every)  # [..., B, T, 4]: one column's vectors
        stored = q.reshape(*lead, -1)  # the stored bytes in order
        if self.row_scale.shape[-1]:
            w = stored[..., :size].astype(jnp.float32) * at(self.row_scale, index)[..., None]
            return w.reshape(*lead, *self.input_shape).astype(dtype)
        no_offset = jnp.zeros((*lead, 0), jnp.float32)
        offset = at(self.offset, group, every, lane).astype(jnp.float32) if self.offset.shape[-1] else no_offset
        scale = at(self.scale, group, every, lane).astype(jnp.float32)  # [..., B], or per super-block
        if self.sub_scale.shape[-1]:  # two levels: d * sc and -dmin * m, the float32 products (exact)
            blocks, six_bits = q.shape[-3], q.shape[-2] == 6
            sub = at(self.sub_scale, group, every, every, lane).astype(jnp.float32)  # [..., B, rows]
            scale = jnp.repeat(scale, SUPER // BLOCK, axis=-1)[..., :blocks]
            offset = jnp.repeat(offset, SUPER // BLOCK, axis=-1)[..., :blocks]
            if six_bits:  # signed bytes, scales (and offsets) per 16
                stored = _unpack_six_bits(q).reshape(*lead, -1)
                if offset.shape[-1]:
                    offset = (offset[..., None] * sub[..., 2:]).reshape(*lead, -1)
                scale = (scale[..., None] * sub[..., :2]).reshape(*lead, -1)
            else:  # per 32
                offset = offset * sub[..., 1] if offset.shape[-1] else offset
                scale = scale * sub[..., 0]
        if self.codebook.shape[-1]:  # codes as bytes of their values (every expert has the type's codebook)
            nibbles = stored.reshape(*lead, -1, BLOCK // 2)
            codes = jnp.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(*lead, -1)
            stored = self.codebook.reshape(-1, 16)[0][codes]
        blocks = GgufBlocks(stored, scale, offset, self.input_shape)
        return blocks.dequantize(dtype)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The whole matrix (or stack) in ``dtype`` (for references and tests)."""
        rows = self.rows(jnp.arange(math.prod(self.shape[: len(self.shape) - self.num_input_dims])), dtype)
        return rows.reshape(self.shape)


def sub_scaled(w: GgufBlocks) -> bool:
    """Whether ``w`` is 8-bit blocks with two-level scales per 16 (Q6_K, Q3_K; with offsets Q2_K and
    a fused Q4_K / Q6_K matrix): the layout whose int8 scales (and offsets) the kernel applies to
    its integer sums (``sub_scale``), with every weight in the 6-bit range -32..31 (not, say,
    IQ4_XS's table values fused beside a Q6_K matrix)."""
    if not (w.group == BLOCK // 2 and w.two_level and not w.nibbles):
        return False
    q = np.asarray(w.q)
    return q.size == 0 or (int(q.min()) >= -32 and int(q.max()) <= 31)


def _six_bits(q: np.ndarray) -> np.ndarray:
    """Signed bytes ``q [N, K]`` (-32..31, ``sub_scaled`` checked) as rows of the 6-bit layout (module
    docstring): per block the 16 nibble bytes of ``u = q + 32``, then the top two bits of each half's
    16, in 4 bytes."""
    n = q.shape[0]
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(n, -1, BLOCK)  # [N, B, 32]
    nibbles = pack_nibbles(u.reshape(n, -1) & np.uint8(0x0F)).reshape(n, -1, BLOCK // 2)
    top = (u >> np.uint8(4)).reshape(n, -1, 2, 4, LANE)  # [N, B, half, t, i]: weight 16 half + 4t + i
    top_bytes = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
    return np.concatenate([nibbles, top_bytes.reshape(n, -1, 2 * LANE)], axis=-1).reshape(n, -1)


def _unpack_six_bits(stored: jax.Array) -> jax.Array:
    """The 6-bit layout's vectors ``[..., B, 6, 4]`` of one column each: its weights ``[..., B, 32]`` as int8."""
    nibbles = stored[..., :4, :].reshape(*stored.shape[:-2], BLOCK // 2)
    low = jnp.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    shifts = (2 * jnp.arange(4, dtype=jnp.uint8))[:, None]
    top = (stored[..., 4:, None, :] >> shifts) & 3  # [..., B, half, t, i]
    return (low | (top.reshape(low.shape) << 4)).astype(jnp.int8) - 32


def _super_block_tables(w: GgufBlocks) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """A flat two-level ``w``'s ``d`` and ``-dmin`` (None without offsets) per super-block of 256
    ``[N, K/256]``, and its int8 scales, then offsets, of each block ``[N, B, rows]``: one of each
    per block of 32, or (scales per 16) the two halves'."""
    n, blocks = w.scale.shape[0], -(-math.prod(w.input_shape) // BLOCK)
    sub = np.asarray(w.scale).reshape(n, blocks, -1)
    if w.has_offset:
        sub = np.concatenate([sub, np.asarray(w.offset).reshape(n, blocks, -1)], axis=-1)
    supers = np.asarray(w.supers)
    return supers[:, 0::2], -supers[:, 1::2] if w.has_offset else None, sub


# Output rows packed at a time (a multiple of GROUP). Packing's host temporaries are several
# bytes a weight (a Q6_K head's int16 and unpacked bytes): whole, a 128k-vocabulary head's passed
# 2 GiB at the top of an 8B model's load; in slices they stay a few tens of MiB.
PACK_ROWS = 4096


def pack_int8_panels(w: GgufBlocks | QuantArray) -> Int8Panels:
    """``w`` (GGUF blocks that ``takes_int8_activations``, ``int8_g32``, or int8 with a scale per output
    channel) in the integer kernel's layout, on the device ``w`` is on (host numpy in between),
    packed ``PACK_ROWS`` output rows at a time: each slice's groups of 16 columns are exactly the
    whole matrix's. Tables are float16 only where every slice's are (as the whole's would be)."""
    host = jax.device_get(w)
    output_shape, input_shape = _shapes(host)
    flat = host.flat() if isinstance(host, GgufBlocks) else QuantArray(
        np.asarray(host.q).reshape(-1, *input_shape), np.asarray(host.scale).reshape(-1))
    n = math.prod(output_shape)
    slices = [_rows(flat, start, min(start + PACK_ROWS, n)) for start in range(0, n, PACK_ROWS)]
    first = _packed_arrays(slices[0])
    if len(slices) == 1:
        return Int8Panels(*(jnp.asarray(a) for a in first), output_shape, input_shape)
    codebook = first[-1]
    q = np.empty((-(-n // GROUP), *first[0].shape[1:]), first[0].dtype)
    q[: len(first[0])] = first[0]
    parts = [first[1:-1]] + [
        _packed_arrays(part, into=q[i * PACK_ROWS // GROUP:][: -(-part.shape[0] // GROUP)])[1:-1]
        for i, part in enumerate(slices[1:], 1)]
    scale, offset, row_scale, sub_scale = _one_table_dtype(parts)
    sub = np.concatenate(sub_scale) if sub_scale[0].size else sub_scale[0]
    return Int8Panels(jnp.asarray(q), *(jnp.asarray(np.concatenate(kind)) for kind in (scale, offset, row_scale)),
                      jnp.asarray(sub), jnp.asarray(codebook), output_shape, input_shape)


def _shapes(w: GgufBlocks | QuantArray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``w``'s output and input shapes."""
    if isinstance(w, GgufBlocks):
        return tuple(w.scale.shape[:-1]), tuple(w.input_shape)
    return tuple(w.scale.shape), tuple(w.shape[w.scale.ndim:])


def _one_table_dtype(parts: list[tuple[np.ndarray, ...]]) -> list[list[np.ndarray]]:
    """The tables of a matrix's parts (row slices or experts), each ``(scale, offset, row_scale,
    sub_scale[, codebook])``, per kind: scale and offset tables float16 only where every part's are
    (float32 if any part needs it), so the parts share the one layout the kernel reads."""
    kinds = [list(kind) for kind in zip(*parts)]
    float_tables = np.result_type(*(a.dtype for a in (*kinds[0], *kinds[1])))
    kinds[:2] = [[a.astype(float_tables, copy=False) for a in kind] for kind in kinds[:2]]
    return kinds


def _rows(flat: GgufBlocks | QuantArray, start: int, stop: int) -> GgufBlocks | QuantArray:
    """Output rows ``start:stop`` of a flat ``[N, K]`` matrix (views, no copy)."""
    if isinstance(flat, GgufBlocks):
        return flat._map(lambda a: a[start:stop])
    return QuantArray(flat.q[start:stop], flat.scale[start:stop])


def pack_int8_experts(w: GgufBlocks | QuantArray) -> Int8Panels:
    """Stacked experts ``w [E, N..., K...]`` (of a type ``pack_int8_panels`` takes) as one ``Int8Panels``
    with ``experts = E``: each expert's matrix packed as ``pack_int8_panels`` packs it, straight into
    its slice of the stack (the grouped kernel reads expert ``e``'s panels as one contiguous slice).
    Experts are packed on a thread each core (numpy's copies run without the GIL): at load, a
    gpt-oss-sized layer's experts took seconds one after another, and a stack assembled from copies
    held the weights twice. Tables are float16 only where every expert's are, so that all experts
    share one layout."""
    host = jax.device_get(w)
    experts = host.shape[0]
    if isinstance(host, GgufBlocks):
        def matrix(e: int) -> GgufBlocks | QuantArray:
            return host._map(lambda a: a[e])
    else:
        def matrix(e: int) -> GgufBlocks | QuantArray:
            return QuantArray(host.q[e], host.scale[e])
    output_shape, input_shape = _shapes(matrix(0))
    first = _packed_arrays(matrix(0))
    q = np.empty((experts, *first[0].shape), first[0].dtype)
    q[0] = first[0]
    tables: list[tuple[np.ndarray, ...]] = [first[1:]] + [()] * (experts - 1)

    def pack(e: int) -> None:
        tables[e] = _packed_arrays(matrix(e), into=q[e])[1:]

    with ThreadPoolExecutor(max(1, min(len(os.sched_getaffinity(0)), experts - 1))) as pool:
        list(pool.map(pack, range(1, experts)))
    return Int8Panels(jnp.asarray(q), *(jnp.asarray(np.stack(kind)) for kind in _one_table_dtype(tables)),
                      output_shape, input_shape, experts)


def _packed_arrays(w: GgufBlocks | QuantArray, into: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """``pack_int8_panels``'s arrays (``q, scale, offset, row_scale, sub_scale, codebook``: module
    docstring) in host memory; ``q`` written ``into`` that array where one is given (an expert's or a
    row slice's part of the whole). Codebook nibbles (IQ4, MXFP4) stay codes, with their codebook."""
    sub, codebook = None, np.zeros((0,), np.int8)
    _, input_shape = _shapes(w)
    if isinstance(w, GgufBlocks):
        w = jax.device_get(w)
        if w.codebook and w.nibbles and w.group == BLOCK:  # packed below as 4-bit blocks are
            codebook = np.asarray(w.codebook, np.int8)
        else:
            w = w.widened()
    if isinstance(w, GgufBlocks) and sub_scaled(w):
        flat = w.flat()
        q, row_scale = _six_bits(np.asarray(flat.q)), None
        scale, offset, sub = _super_block_tables(flat)
    elif isinstance(w, GgufBlocks) and w.group == BLOCK and w.two_level:
        flat = w.flat()
        q, row_scale = np.asarray(flat.q), None
        scale, offset, sub = _super_block_tables(flat)
    elif isinstance(w, GgufBlocks) and w.group == BLOCK:
        flat = w.flat().with_float_tables()
        q, scale = np.asarray(flat.q), np.asarray(flat.scale)
        offset = np.asarray(flat.offset) if w.has_offset else None
        row_scale = None
    elif isinstance(w, QuantArray) and w.scheme == "int8":
        size = math.prod(input_shape)
        q = np.asarray(w.q).reshape(-1, size)
        q = np.pad(q, ((0, 0), (0, -size % BLOCK)))  # zero weights past K (their activations are zero too)
        scale = offset = None
        row_scale = np.asarray(w.scale, np.float32).reshape(-1)
    else:
        layout = f"GGUF blocks with a scale per {w.group}" if isinstance(w, GgufBlocks) else type(w).__name__
        raise TypeError(f"the integer kernel reads GGUF blocks with a scale per 32, two-level int8 scales per 16 "
                        f"on weights -32..31, and int8 weights; not {layout}")
    n = q.shape[0]
    groups = -(-n // GROUP)
    repeat = np.minimum(np.arange(groups * GROUP), n - 1)  # columns past N repeat the last one
    blocks = -(-math.prod(input_shape) // BLOCK)
    vectors = q.shape[1] // (blocks * LANE)
    columns = q if n == groups * GROUP else q[repeat]
    packed = columns.reshape(groups, GROUP, blocks, vectors, LANE).transpose(0, 2, 3, 1, 4)
    if into is None:
        into = np.empty(packed.shape, packed.dtype)
    if into.shape != packed.shape or into.dtype != packed.dtype:
        raise ValueError(f"experts of one tensor packed unlike each other: {packed.shape} {packed.dtype} "
                         f"into {into.shape} {into.dtype}")
    np.copyto(into, packed)

    tables = [np.asarray(v, np.float32) for v in (scale, offset) if v is not None]
    halves = all(np.array_equal(t.astype(np.float16).astype(np.float32), t) for t in tables)
    table_dtype = np.float16 if halves else np.float32

    def per_group(values: np.ndarray | None) -> np.ndarray:
        """A table ``[N, B]`` (or per super-block ``[N, K/256]``) as ``[G, B (or K/256), 16]``."""
        if values is None:
            return np.zeros((groups, blocks, 0), table_dtype)
        entries = values.shape[1]
        return np.ascontiguousarray(values[repeat].reshape(groups, GROUP, entries).transpose(0, 2, 1), table_dtype)

    if sub is None:
        sub_scale = np.zeros((0, 0, 0, 0), np.int8)
    else:  # [N, B, rows] -> [G, B, rows, 16]
        sub_scale = np.ascontiguousarray(sub[repeat].reshape(groups, GROUP, blocks, -1).transpose(0, 2, 3, 1))
    return (into, per_group(scale), per_group(offset),
            row_scale if row_scale is not None else np.zeros((0,), np.float32), sub_scale, codebook)
