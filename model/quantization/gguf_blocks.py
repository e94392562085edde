"""GGUF's block-quantized matrices (Q4_0, Q4_1, Q8_0) kept as stored, computed exactly.

Why: the bundled model's layers are Q4_1 and its tied embedding / LM head is Q8_0. Expanded
to float32 at load, one decode step reads 538 MB of weights; kept as blocks it reads about 115
MB. At one to a few sequences a step is bound by reading weights, so this is most of a
single stream's speed (benchmarks/dense_bench.py).

It is not another quantization: the numbers are the float32 ones. Each row of a matrix is
blocks of 32 weights along its inputs, with a scale ``d`` (and for 4-bit blocks an offset
``m``) per block; the gguf package dequantizes ``w = d * q + m`` (Q4_1), ``d * (q - 8)``
(Q4_0, held here as ``m = -8 d``) or ``q * d`` (Q8_0). ``d`` and ``m`` are float16 values, so
``d * q`` is exact in float32 and ``w`` is rounded once, the same whether a compiler fuses
the multiply-add or not. So the C++ kernel (which widens a few weight rows at a time into an
L1 panel and runs its float32 tiles on them, model/kernels/gguf_blocks.h), XLA's dot on
``dequantize()`` and numpy all see the same float32 matrix: a model served from blocks gives
the logits of the same model expanded to float32, bit for bit (tests/model/test_gguf_blocks.py).

Layout: ``q [N..., K/2]`` uint8 for 4-bit blocks (block byte ``i`` holds weight ``i`` in its
low half and ``i + 16`` in its high half, GGUF's order) or ``q [N..., K]`` int8 for 8-bit
ones; ``scale`` and ``offset`` ``[N..., K/32]`` float32 (``offset [N..., 0]`` for 8-bit).
``input_shape`` is the matrix's input dims (``K`` flattened in row-major order), so a
``GgufBlocks`` stands wherever model/decoder/params.py declares an ``[N..., K...]`` matrix. Row
operations (fusing QKV, stacking gate/up, llama.cpp's Q/K row permutation) apply to the three
arrays alike (``map_rows``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from raylm.model.quantization.stored_bytes import StoredBytes

BLOCK = 32
# Bytes of one 32-weight block in the file, and where its float16 scale / offset / values sit.
_LAYOUT = {
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
    GGMLQuantizationType.Q8_0: 34,
}
GGUF_BLOCK_TYPES: frozenset[GGMLQuantizationType] = frozenset(_LAYOUT)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GgufBlocks(StoredBytes):
    """A matrix ``[N..., *input_shape]`` in GGUF blocks (see the module docstring)."""

    q: Any
    scale: Any
    offset: Any
    input_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.scale.shape[:-1], *self.input_shape)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The float32 matrix, exactly as ``gguf.quants.dequantize`` computes it."""
        lead, blocks = self.scale.shape[:-1], self.scale.shape[-1]
        if self.nibbles:
            q = jnp.asarray(self.q).reshape(*lead, blocks, BLOCK // 2)
            values = jnp.concatenate([q & 0x0F, q >> 4], axis=-1).astype(jnp.float32)
            w = self.scale[..., None] * values + self.offset[..., None]
        else:
            w = jnp.asarray(self.q).reshape(*lead, blocks, BLOCK).astype(jnp.float32) * self.scale[..., None]
        return w.reshape(*lead, *self.input_shape).astype(dtype)

    def rows(self, index: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """Entries ``index`` of the output dims with their inputs, dequantized (the
        embedding lookup: token ids into ``[V, D]``)."""
        return GgufBlocks(self.q[index], self.scale[index], self.offset[index], self.input_shape).dequantize(dtype)

    def flat(self) -> "GgufBlocks":
        """The same blocks as a 2-D ``[N, K]`` matrix (free reshapes), as the kernel takes them."""
        rows = math.prod(self.scale.shape[:-1])
        return GgufBlocks(
            self.q.reshape(rows, -1), self.scale.reshape(rows, -1), self.offset.reshape(rows, -1),
            (math.prod(self.input_shape),),
        )

    def with_input_shape(self, input_shape: tuple[int, ...]) -> "GgufBlocks":
        """The same matrix with its inputs viewed as ``input_shape`` (same count, row-major)."""
        if math.prod(input_shape) != math.prod(self.input_shape):
            raise ValueError(f"cannot view inputs {self.input_shape} as {input_shape}")
        return dataclasses.replace(self, input_shape=tuple(input_shape))

    def to_device(self) -> "GgufBlocks":
        return GgufBlocks(jnp.asarray(self.q), jnp.asarray(self.scale), jnp.asarray(self.offset), self.input_shape)


def from_gguf(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, ...]) -> GgufBlocks:
    """A file tensor's raw blocks (``data``, the reader's bytes) as ``GgufBlocks`` of
    ``shape = (N..., K)`` (numpy arrays, host side): a matrix ``(rows, K)``, or stacked
    matrices (an MoE layer's experts, ``(E, rows, K)``)."""
    if kind not in _LAYOUT:
        raise ValueError(f"{kind.name} is not one of the block types kept as stored ({', '.join(t.name for t in GGUF_BLOCK_TYPES)})")
    *lead, size = shape
    rows = math.prod(lead)
    if size % BLOCK:
        raise ValueError(f"a {kind.name} matrix's rows must be whole blocks of {BLOCK}, got {size}")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, size // BLOCK, _LAYOUT[kind])

    def half(at: int) -> np.ndarray:  # the float16 at byte ``at`` of every block, as float32
        return np.ascontiguousarray(blocks[..., at: at + 2]).view(np.float16)[..., 0].astype(np.float32)

    scale = half(0)
    if kind == GGMLQuantizationType.Q8_0:
        q = blocks[..., 2:].reshape(rows, size).view(np.int8)
        offset = np.zeros((rows, 0), np.float32)
    elif kind == GGMLQuantizationType.Q4_1:
        q, offset = blocks[..., 4:].reshape(rows, size // 2), half(2)
    else:  # Q4_0: w = d * (q - 8) = d * q + (-8 d), both exact (see the module docstring)
        q, offset = blocks[..., 2:].reshape(rows, size // 2), -8.0 * scale

    def shaped(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a).reshape(*lead, a.shape[-1])

    return GgufBlocks(shaped(q), shaped(scale), shaped(offset), (size,))


def map_rows(fn: Callable[..., np.ndarray], *matrices: np.ndarray | GgufBlocks) -> np.ndarray | GgufBlocks:
    """``fn`` (which rearranges leading, output dims only) over host matrices: on the arrays
    themselves, or on each of the blocks' three arrays when all are blocks of one kind with
    the same inputs. A mix is expanded to float32 first (exact, just larger)."""
    if not any(isinstance(m, GgufBlocks) for m in matrices):
        return fn(*matrices)
    first = matrices[0]
    if all(isinstance(m, GgufBlocks) and m.nibbles == first.nibbles and m.input_shape == first.input_shape
           for m in matrices):
        return GgufBlocks(
            fn(*(m.q for m in matrices)), fn(*(m.scale for m in matrices)), fn(*(m.offset for m in matrices)),
            first.input_shape,
        )
    return fn(*(dequantized(m) for m in matrices))


def dequantized(matrix: np.ndarray | GgufBlocks) -> np.ndarray:
    """A host matrix as a float32 numpy array, blocks expanded exactly (a mix of kinds in
    ``map_rows``; the small tensors no kernel reads as blocks: an MoE router, a shared gate)."""
    return np.asarray(matrix.dequantize() if isinstance(matrix, GgufBlocks) else matrix, np.float32)
