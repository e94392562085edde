"""The matrices of HF's quantized checkpoint formats, and how raylm holds each one.

model/loaders/hf_quantized.py reads the formats (AWQ, GPTQ, compressed-tensors, FP8); once a
layer's tensors are unpacked, every format means one of three things:

- ``IntGroups``: unsigned integers ``q [out, in]`` and, per output row and group of inputs, a
  scale ``s`` and a zero ``z``: ``w = (q - z) * s`` (AWQ, GPTQ, compressed-tensors' integer
  formats). Held as ``GgufBlocks`` (model/quantization/gguf_blocks.py) where that is exact: 4-bit
  values whose every 32-input block lies in one group become a block with ``scale = s`` and
  ``offset = -(s * z)``, so the kernel computes ``s * q + offset``. With ``s`` a float16 or
  bfloat16 value (at most 11 significant bits) and ``q``, ``z`` below 2^5, ``s * q`` and ``s * z``
  are exact in float32 and so is ``s * (q - z)``: the block's value and the format's formula
  give the same float32 number. float32 scales qualify when their last 4 significand bits are 0.
  8-bit values likewise become signed bytes ``q - 128`` with ``offset = -(s * (z - 128))``
  (``|q - z| <= 256``: exact for scales of at most 16 significant bits). Where every zero is one
  number ``c`` (symmetric schemes), the blocks are signed bytes ``q - c`` without offsets: then a
  weight is the single product ``(q - c) * s``, the formula itself, whatever the scales. Anything
  else (act-order GPTQ whose ``g_idx`` gives a 32-input block several groups, inputs that are not
  whole blocks, asymmetric groups with float32 scales that would round) is expanded to float32
  by the formula: exact, just larger.
- ``RowScaled``: 8-bit values (int8 or float8_e4m3fn) with one scale per output row (per channel,
  or per tensor broadcast to the rows): ``w = q * s``, held as a ``QuantArray``. Its kernel applies
  ``s`` to the row's sum instead of to each weight, which rounds differently (not bit for bit the
  float32 matrix's result, within float32 rounding of it).
- ``BlockScaled``: float8_e4m3fn values with a scale per 128x128 block (DeepSeek / Qwen FP8). Held
  as ``GgufBlocks`` of fp8 values, each block's scale repeated for every 32 inputs (1.125 bytes a
  weight where float32 took 4): the kernel widens ``fp8 * scale`` with one rounding, the format's
  float32 dequantization exactly. Blocks that are not whole groups of 32 inputs are expanded to
  float32 by the same formula.

``dense()`` is each format's formula in float32 (what a bfloat16 or tensor-parallel model is cast
from); ``stored()`` is what a float32 model on one CPU device keeps (``keep_blocks``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

import ml_dtypes
import numpy as np

from raylm.model.quantization.gguf_blocks import BLOCK, GgufBlocks
from raylm.model.quantization.quant_array import QuantArray

# What a format's layer loads as: a float32 matrix [out, in], GGUF-style blocks or 8-bit values
# with row scales (numpy arrays inside, host side).
Matrix = Union[np.ndarray, GgufBlocks, QuantArray]
# Scale dtypes of at most 11 significant bits: their products with any |n| <= 256 are exact in float32.
_SHORT_FLOATS = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def unpack_words(words: np.ndarray, bits: int, axis: int, order: Sequence[int] | None = None) -> np.ndarray:
    """int32 ``words`` holding ``32 // bits`` values each along ``axis`` -> those values
    (uint8, ``axis`` that many times longer). Field ``i`` of a word (bits ``bits*i`` up, low
    first) holds the word's value number ``order[i]`` (default: value ``i``; AWQ interleaves)."""
    per = 32 // bits
    order = list(range(per)) if order is None else list(order)
    u = np.ascontiguousarray(words).view(np.uint32)
    mask = np.uint32((1 << bits) - 1)
    fields = [((u >> np.uint32(bits * i)) & mask).astype(np.uint8) for i in range(per)]
    values = np.stack([fields[order.index(j)] for j in range(per)], axis=axis + 1)
    shape = list(u.shape)
    shape[axis] *= per
    return values.reshape(shape)


def _nibble_blocks(q: np.ndarray) -> np.ndarray:
    """4-bit values ``[out, in]`` (in whole blocks of 32) in GGUF's byte order: block byte ``i``
    holds value ``i`` in its low half and value ``i + 16`` in its high half."""
    out, size = q.shape
    blocks = q.reshape(out, size // BLOCK, BLOCK)
    return (blocks[..., : BLOCK // 2] | (blocks[..., BLOCK // 2:] << 4)).reshape(out, size // 2)


def _products_exact(scale: np.ndarray, bits: int) -> bool:
    """Whether ``scale * n`` is exact in float32 for every integer ``|n| <= 2**bits`` (the
    differences of two ``bits``-bit values and the values themselves): the scale's last ``bits``
    significand bits are 0."""
    if scale.dtype in _SHORT_FLOATS:
        return True
    if scale.dtype != np.float32:
        return False
    return bool(np.all(scale.view(np.uint32) & np.uint32((1 << bits) - 1) == 0))


@dataclasses.dataclass(frozen=True)
class IntGroups:
    """``w[o, k] = (q[o, k] - zero[o, g]) * scale[o, g]`` with ``g = groups[k]``."""

    q: np.ndarray  # [out, in] uint8: unsigned values 0 .. 2**bits - 1
    zero: np.ndarray  # [out, num_groups] integers in q's domain (GPTQ v1's z + 1 may reach 2**bits)
    scale: np.ndarray  # [out, num_groups] as stored: float16, bfloat16 or float32
    groups: np.ndarray  # [in]: each input's group
    bits: int

    def dense(self) -> np.ndarray:
        """The format's formula in float32: ``(q - z)`` is an exact integer, one rounding after."""
        zero = self.zero[:, self.groups].astype(np.float32)
        return (self.q.astype(np.float32) - zero) * self.scale[:, self.groups].astype(np.float32)

    def stored(self) -> np.ndarray | GgufBlocks:
        blocks = self.blocks()
        return self.dense() if blocks is None else blocks

    def blocks(self) -> GgufBlocks | None:
        """The same float32 matrix as ``GgufBlocks``, or None where blocks cannot hold it exactly
        (see the module docstring)."""
        out, size = self.q.shape
        if size % BLOCK or size == 0:
            return None
        first = self.groups[::BLOCK]
        if not np.array_equal(self.groups.reshape(-1, BLOCK), np.repeat(first[:, None], BLOCK, axis=1)):
            return None  # a block spans two groups (act-order GPTQ)
        scale = self.scale[:, first].astype(np.float32)
        zero = self.zero[:, first]
        if self.bits == 4 and _products_exact(self.scale, 4):
            offset = -(scale * zero.astype(np.float32))  # exact: see _products_exact
            return GgufBlocks(_nibble_blocks(self.q), scale, offset, (size,))
        common = int(zero.flat[0]) if zero.size else 0
        if np.all(zero == common) and common - 128 <= 0 <= common + 127 - ((1 << self.bits) - 1):
            q = (self.q.astype(np.int16) - common).astype(np.int8)  # every q - c fits a signed byte
            return GgufBlocks(q, scale, np.zeros((out, 0), np.float32), (size,))
        if self.bits == 8 and _products_exact(self.scale, 8):
            q = (self.q.astype(np.int16) - 128).astype(np.int8)
            offset = -(scale * (zero.astype(np.float32) - 128))  # exact: see _products_exact
            return GgufBlocks(q, scale, offset, (size,))
        return None


@dataclasses.dataclass(frozen=True)
class RowScaled:
    """``w[o, k] = q[o, k] * scale[o]``: 8-bit values (int8 or float8_e4m3fn)."""

    q: np.ndarray  # [out, in]
    scale: np.ndarray  # [out]

    def dense(self) -> np.ndarray:
        return self.q.astype(np.float32) * self.scale.astype(np.float32)[:, None]

    def stored(self) -> QuantArray:
        return QuantArray(np.ascontiguousarray(self.q), np.ascontiguousarray(self.scale, dtype=np.float32))


@dataclasses.dataclass(frozen=True)
class BlockScaled:
    """``w[o, k] = q[o, k] * scale[o // rows, k // cols]`` (the last blocks may be partial)."""

    q: np.ndarray  # [out, in] float8_e4m3fn
    scale: np.ndarray  # [ceil(out / rows), ceil(in / cols)]
    block: tuple[int, int]  # (rows, cols)

    def dense(self) -> np.ndarray:
        out, size = self.q.shape
        rows, cols = self.block
        scale = np.repeat(np.repeat(self.scale.astype(np.float32), rows, axis=0), cols, axis=1)[:out, :size]
        return self.q.astype(np.float32) * scale

    def stored(self) -> np.ndarray | GgufBlocks:
        blocks = self.blocks()
        return self.dense() if blocks is None else blocks

    def blocks(self) -> GgufBlocks | None:
        """The same float32 matrix as fp8 ``GgufBlocks`` (a float32 scale per 32 inputs), or None
        where a scale block's inputs are not whole groups of 32."""
        out, size = self.q.shape
        rows, cols = self.block
        if size % BLOCK or cols % BLOCK or size == 0:
            return None
        scale = np.repeat(np.repeat(self.scale.astype(np.float32), rows, axis=0)[:out], cols // BLOCK, axis=1)
        return GgufBlocks(np.ascontiguousarray(self.q), np.ascontiguousarray(scale[:, :size // BLOCK]),
                          np.zeros((out, 0), np.float32), (size,))


Form = Union[IntGroups, RowScaled, BlockScaled]
