"""GGUF's block-quantized matrices kept as stored, computed exactly.

Why: the bundled model's layers are Q4_1 and its tied embedding / LM head is Q8_0. Expanded
to float32 at load, one decode step reads 538 MB of weights; kept as blocks it reads about 115
MB. At one to a few sequences a step is bound by reading weights, so this is most of a
single stream's speed (benchmarks/dense_bench.py). An 8B Q4_K_M file (4.9 GB) would be ~32 GB
as float32.

It is not another quantization: the numbers are the float32 ones. Each row of a matrix is
blocks of 32 weights along its inputs, held as 4-bit nibbles or signed bytes, with a float32
scale ``d`` and optionally an offset ``m`` per group of 32 (or 16) weights: ``w = d * q + m``
or ``w = d * q``; IQ4's and MXFP4's nibbles are codes into a 16-entry ``codebook``: ``w = d *
codebook[q]``. model/quantization/gguf_transcode.py turns each GGUF type (Q4_0 .. Q8_0, the K-quants,
IQ4) into this form, folding super-block scales into ``d`` and ``m`` exactly, so the C++ kernel
(which widens a few weight rows at a time into an L1 panel and runs its float32 tiles on them,
model/kernels/gguf_blocks.h), XLA's dot on ``dequantize()`` and numpy all see the same float32
matrix: a model served from blocks gives the logits of the same model expanded to float32, bit
for bit (tests/model/test_gguf_blocks.py, tests/model/test_gguf_kquants.py).

Layout: ``q [N..., K/2]`` uint8 for 4-bit blocks (block byte ``i`` holds weight ``i`` in its
low half and ``i + 16`` in its high half, GGUF's order) or ``q [N..., K]`` int8 for 8-bit
ones, or float8_e4m3fn for FP8 checkpoints scaled per 128x128 block
(model/loaders/hf_quantized_matrix.py: each block's scale repeated per 32 inputs, no offset, ``w =
d * fp8``); ``scale [N..., K/group]`` float32 (group 32 or 16, read off the shapes) and ``offset``
like it, or ``[N..., 0]`` for types without one (4-bit blocks have one unless they have a codebook). Types with
super-blocks of 256 weights (the K-quants, IQ4_XS) keep two levels, as their files do: int8
``scale`` and ``offset`` per group and ``supers [N..., K/256 * 2]`` float32, each super-block's
``d`` and ``dmin``; a group's scale is ``d * scale`` and its offset ``-(dmin * offset)``, both
exact in float32 (``float_tables``).
``input_shape`` is the matrix's input dims (``K`` flattened in row-major order), so a
``GgufBlocks`` stands wherever model/decoder/params.py declares an ``[N..., K...]`` matrix. Row
operations (fusing QKV, stacking gate/up, llama.cpp's Q/K row permutation) apply to the three
arrays alike (``map_rows``); matrices of different types are first brought to one layout (codes
then become bytes of their values: ``widened``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from raylm.model.quantization.gguf_transcode import TRANSCODED_TYPES, codebook_of, transcode
from raylm.model.quantization.stored_bytes import StoredBytes

BLOCK = 32
GGUF_BLOCK_TYPES: frozenset[GGMLQuantizationType] = TRANSCODED_TYPES


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GgufBlocks(StoredBytes):
    """A matrix ``[N..., *input_shape]`` in GGUF blocks (see the module docstring)."""

    q: Any
    scale: Any
    offset: Any
    input_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    supers: Any = None  # two-level scales' super-block d and dmin, or None (float32 tables)
    # The 16 integers a 4-bit code stands for (IQ4's kvalues, MXFP4's doubled e2m1: ``w = d *
    # codebook[q]``, no offset), or None: the code is the value. Static: one table per matrix.
    codebook: tuple[int, ...] | None = dataclasses.field(default=None, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.scale.shape[:-1], *self.input_shape)

    @property
    def group(self) -> int:
        """Weights per scale: 32, or 16 (Q2_K, Q3_K, Q6_K)."""
        return math.prod(self.input_shape) // self.scale.shape[-1]

    @property
    def has_offset(self) -> bool:
        return self.offset.shape[-1] > 0

    @property
    def fp8(self) -> bool:
        """Whether the 8-bit values are float8_e4m3fn (no offset, float32 scales), not integers."""
        return self.q.dtype == jnp.float8_e4m3fn

    @property
    def two_level(self) -> bool:
        """Whether the scales are int8 per group times float32 per super-block."""
        return self.supers is not None

    def float_tables(self) -> tuple[Any, Any]:
        """``(scale, offset)`` as float32 per group: ``d * scale`` and ``-(dmin * offset)`` for
        two-level scales (exact: a float16 times a small integer), else the tables as held.
        numpy in, numpy out; device arrays in, device arrays out."""
        if not self.two_level:
            return self.scale, self.offset
        xp = np if isinstance(self.scale, np.ndarray) else jnp
        per_super = self.scale.shape[-1] // (self.supers.shape[-1] // 2)
        d = xp.repeat(self.supers[..., 0::2], per_super, axis=-1)
        scale = d * self.scale.astype(xp.float32)
        if not self.has_offset:
            return scale, xp.zeros((*self.scale.shape[:-1], 0), xp.float32)
        dmin = xp.repeat(self.supers[..., 1::2], per_super, axis=-1)
        return scale, -(dmin * self.offset.astype(xp.float32))

    def with_float_tables(self) -> "GgufBlocks":
        """The same matrix with float32 scales and offsets per group (exact; larger)."""
        scale, offset = self.float_tables()
        return GgufBlocks(self.q, scale, offset, self.input_shape, codebook=self.codebook)

    def codebook_table(self) -> jax.Array:
        """The kernels' ``codebook`` operand: the 16 values as float32 (exact), or ``[0]``."""
        return jnp.asarray(np.asarray(self.codebook or (), np.float32))

    def values(self) -> jax.Array:
        """The stored integers ``[N..., K]`` in input order (nibbles unpacked, codes looked up in
        the codebook), as float32."""
        lead, size = self.scale.shape[:-1], math.prod(self.input_shape)
        q = jnp.asarray(self.q)
        if self.nibbles:
            q = q.reshape(*lead, size // BLOCK, BLOCK // 2)
            q = jnp.concatenate([q & 0x0F, q >> 4], axis=-1)
        q = q.reshape(*lead, size)
        return self.codebook_table()[q] if self.codebook else q.astype(jnp.float32)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The float32 matrix, exactly as ``gguf.quants.dequantize`` computes it."""
        lead, groups = self.scale.shape[:-1], self.scale.shape[-1]
        scale, offset = (jnp.asarray(t) for t in self.float_tables())
        w = self.values().reshape(*lead, groups, -1) * scale[..., None]
        if self.has_offset:
            w = w + offset[..., None]
        return w.reshape(*lead, *self.input_shape).astype(dtype)

    def _map(self, fn: Callable[[Any], Any], input_shape: tuple[int, ...] | None = None) -> "GgufBlocks":
        """``fn`` on every array (row selections, reshapes of the output dims, transfers)."""
        return GgufBlocks(fn(self.q), fn(self.scale), fn(self.offset), input_shape or self.input_shape,
                          None if self.supers is None else fn(self.supers), self.codebook)

    def widened(self) -> "GgufBlocks":
        """Host blocks with a codebook as signed bytes of their values (the layout before codebooks,
        twice the bytes; exact): for a fused matrix of mixed types and the integer mode's packing.
        Others as they are."""
        if not self.codebook:
            return self
        q = _widened_nibbles(np.asarray(self.q))
        return GgufBlocks(np.asarray(self.codebook, np.int8)[q], self.scale, self.offset, self.input_shape,
                          self.supers)

    def rows(self, index: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """Entries ``index`` of the output dims with their inputs, dequantized (the
        embedding lookup: token ids into ``[V, D]``)."""
        return self._map(lambda a: a[index]).dequantize(dtype)

    def flat(self) -> "GgufBlocks":
        """The same blocks as a 2-D ``[N, K]`` matrix (free reshapes), as the kernel takes them."""
        rows = math.prod(self.scale.shape[:-1])
        return self._map(lambda a: a.reshape(rows, -1), (math.prod(self.input_shape),))

    def with_input_shape(self, input_shape: tuple[int, ...]) -> "GgufBlocks":
        """The same matrix with its inputs viewed as ``input_shape`` (same count, row-major)."""
        if math.prod(input_shape) != math.prod(self.input_shape):
            raise ValueError(f"cannot view inputs {self.input_shape} as {input_shape}")
        return dataclasses.replace(self, input_shape=tuple(input_shape))

    def to_device(self) -> "GgufBlocks":
        return self._map(jnp.asarray)


def from_gguf(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, ...], name: str = "") -> GgufBlocks:
    """A file tensor's raw blocks (``data``, the reader's bytes) as ``GgufBlocks`` of
    ``shape = (N..., K)`` (numpy arrays, host side): a matrix ``(rows, K)``, or stacked
    matrices (an MoE layer's experts, ``(E, rows, K)``). ``name`` names the tensor in errors."""
    *lead, size = shape
    if size % BLOCK:
        raise ValueError(f"tensor {name!r}: a {kind.name} matrix's rows must be whole blocks of {BLOCK}, got {size}")
    q, scale, offset, supers = transcode(data, kind, math.prod(lead), size, name)
    return GgufBlocks(q, scale, offset, (size,), supers, codebook_of(kind))._map(lambda a: a.reshape(*lead, a.shape[-1]))


def _widened_nibbles(q: np.ndarray) -> np.ndarray:
    """Nibble blocks ``[..., K/2]`` as their codes in bytes ``[..., K]`` (int8, input order)."""
    halves = q.reshape(*q.shape[:-1], -1, BLOCK // 2)
    return np.concatenate([halves & 0x0F, halves >> 4], axis=-1).reshape(*q.shape[:-1], -1).astype(np.int8)


def _in_layout(m: GgufBlocks, nibbles: bool, group: int, offsets: bool) -> GgufBlocks:
    """``m`` (host arrays) in a layout that holds it exactly: float32 tables, nibbles widened to
    bytes, each scale repeated for a smaller group, zero offsets added (``d * q + 0`` rounds as
    ``d * q``)."""
    m = m.widened().with_float_tables()
    q, scale, offset = np.asarray(m.q), np.asarray(m.scale), np.asarray(m.offset)
    if m.nibbles and not nibbles:
        q = _widened_nibbles(q)
    repeat = m.group // group
    if repeat > 1:
        scale = np.repeat(scale, repeat, axis=-1)
        offset = np.repeat(offset, repeat, axis=-1)
    if offsets and not m.has_offset:
        offset = np.zeros_like(scale)
    return GgufBlocks(q, scale, offset, m.input_shape)


def _same_supers(matrices: tuple[GgufBlocks, ...]) -> bool:
    """Whether two-level matrices share their super-block size (and so can share one table)."""
    return len({m.supers.shape[-1] for m in matrices}) == 1


def _in_two_level_bytes(m: GgufBlocks) -> GgufBlocks:
    """Two-level ``m`` (host arrays) as bytes with int8 scales and offsets per 16 under its super-blocks'
    ``d`` and ``dmin`` (Q2_K's layout), exactly: each scale repeated for a smaller group, zero offsets
    where it has none (its ``dmin`` is 0 already: ``d * sc * q - 0 * 0`` rounds as ``d * sc * q``).
    The K-quants of a Q4_K_M file fused (Q4_K query and key, Q6_K value) keep their file's two
    levels: 9.25 bits a weight where float32 tables per 16 took 12, and the integer mode reads them."""
    m = m.widened()
    q, scale, offset = np.asarray(m.q), np.asarray(m.scale), np.asarray(m.offset)
    q = _widened_nibbles(q) if m.nibbles else q
    repeat = m.group // 16
    scale = np.repeat(scale, repeat, axis=-1)
    offset = np.repeat(offset, repeat, axis=-1) if m.has_offset else np.zeros_like(scale)
    return GgufBlocks(q, scale, offset, m.input_shape, np.asarray(m.supers))


def map_rows(fn: Callable[..., np.ndarray], *matrices: np.ndarray | GgufBlocks) -> np.ndarray | GgufBlocks:
    """``fn`` (which rearranges leading, output dims only) over host matrices: on the arrays
    themselves, or on each of the blocks' three arrays when all are blocks with the same
    inputs, first brought to one layout when their types differ (a Q4_K_M file's Q4_K query
    and Q6_K value projections: bytes with int8 scales and offsets per 16 under their super-blocks'
    two levels; with a single-level type, float32 tables per 16; both exact). A mix of blocks
    and float matrices is expanded to float32 (exact, just larger)."""
    if not any(isinstance(m, GgufBlocks) for m in matrices):
        return fn(*matrices)
    first = matrices[0]
    if not all(isinstance(m, GgufBlocks) and m.input_shape == first.input_shape for m in matrices):
        return fn(*(dequantized(m) for m in matrices))
    layouts = {(m.nibbles, m.group, m.has_offset, m.two_level, m.codebook, m.fp8) for m in matrices}
    if len(layouts) > 1 and any(m.fp8 for m in matrices):  # fp8 beside integer blocks: no common layout
        return fn(*(dequantized(m) for m in matrices))
    if len(layouts) > 1 and all(m.two_level for m in matrices) and _same_supers(matrices):
        matrices = tuple(_in_two_level_bytes(m) for m in matrices)
    elif len(layouts) > 1:  # codebook nibbles beside another type become bytes of their values
        nibbles = all(n and not c for n, _, _, _, c, _ in layouts)
        group = min(g for _, g, _, _, _, _ in layouts)
        offsets = nibbles or any(o for _, _, o, _, _, _ in layouts)
        matrices = tuple(_in_layout(m, nibbles, group, offsets) for m in matrices)
    supers = None if matrices[0].supers is None else fn(*(m.supers for m in matrices))
    return GgufBlocks(
        fn(*(m.q for m in matrices)), fn(*(m.scale for m in matrices)), fn(*(m.offset for m in matrices)),
        first.input_shape, supers, matrices[0].codebook,
    )


def dequantized(matrix: np.ndarray | GgufBlocks) -> np.ndarray:
    """A host matrix as a float32 numpy array, blocks expanded exactly (a mix of kinds in
    ``map_rows``; the small tensors no kernel reads as blocks: an MoE router, a shared gate)."""
    return np.asarray(matrix.dequantize() if isinstance(matrix, GgufBlocks) else matrix, np.float32)
