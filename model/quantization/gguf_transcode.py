"""Every GGUF block type the kernels read, turned at load into their one layout, exactly.

Why: the file most people download is a Q4_K_M (Q4_K matrices with some Q6_K), then Q5_K_M,
Q6_K, Q8_0, IQ4_XS. Expanded to float32, an 8B model is ~32 GB; kept as blocks it stays near
its file's size, and the block kernels (model/kernels/gguf_blocks.h) compute the same float32
numbers. Each type's super-block scales are folded into one float32 scale (and offset) per
group of 32 or 16 weights, the values become 4-bit nibbles, 4-bit codes into a codebook of 16
integers, or signed bytes:

==========  =======================================  =====  ======  =======
type        w (the gguf package's dequantization)    group  values  offset
==========  =======================================  =====  ======  =======
Q4_0        d * (q - 8)                              32     nibble  -8 d
Q4_1        d * q + m                                32     nibble  m
Q5_0        d * (q - 16)                             32     byte    none
Q5_1        d * q + m                                32     byte    m
Q8_0        d * q                                    32     byte    none
Q2_K        (d sc) * q - (dmin m)                    16     byte    -(dmin m)
Q3_K        (d (sc - 32)) * q                        16     byte    none
Q4_K        (d sc) * q - (dmin m)                    32     nibble  -(dmin m)
Q5_K        (d sc) * q - (dmin m)                    32     byte    -(dmin m)
Q6_K        (d sc) * (q - 32)                        16     byte    none
IQ4_NL      d * kvalue[q]                            32     code    none
IQ4_XS      (d (ls - 32)) * kvalue[q]                32     code    none
MXFP4       (2^e / 2) * (2 e2m1[q])                  32     code    none
==========  =======================================  =====  ======  =======

The K-quants and IQ4_XS keep their scales as the file does, in two levels: a signed byte per
group (``sc``, ``m``; Q3_K's and IQ4_XS's ``sc - 32``) and per super-block of 256 weights the
float32 ``d`` and ``dmin`` (``supers``); the kernel forms ``d * sc`` and ``-(dmin * m)`` as it
reads a block. Q4_K is then held in 4.75 bits a weight (its file: 4.5), IQ4_XS in 4.5 (4.25), Q6_K
in 8.75 (6.56), Q5_K in 8.75 (5.5); the other types keep a float32 scale (and offset) per 32 (IQ4_NL
and MXFP4: 5 bits, files 4.5 and 4.25).

"code": the file's 4-bit codes kept as nibbles (GGUF's order, as Q4's) with the type's 16-entry
table (``codebook_of``: IQ4's ``kvalues``, MXFP4's ``E2M1_DOUBLED``; ``GgufBlocks.codebook``), no
offset. The kernels widen a code to ``d * codebook[q]``: one rounding of a small integer times the
scale, the numbers signed bytes of the values gave (twice the bytes), bit for bit.

MXFP4 (gpt-oss's experts; HF checkpoints' ``*_blocks`` / ``*_scales`` too, model/quantization/mxfp4.py)
has IQ4_NL's form, as llama.cpp reads it: twice an e2m1 value is an integer of {0, 1, 2, 3, 4, 6,
8, 12} with its sign (a 16-entry table), and the e8m0 scale ``2^(e - 127)`` halved is a power of
two held exactly as a float32 (2^-128 subnormal, 2^127 normal): each weight is one product of
two exact numbers, a power of two times a small integer, exact itself.

Exact because the folded scale is a float16 times a small integer (at most 17 significant bits,
exact in float32, the product the gguf package also forms first), the offset likewise, and
wherever an offset is added the product ``scale * q`` is exact too (at most 22 bits): so the
kernel's ``scale * q + offset`` rounds once, as numpy's ``d * q - dm`` does, fused or not.
Without an offset ``scale * q`` is the one rounding on both sides. tests/model/test_gguf_kquants.py
checks every type against ``gguf.quants.dequantize`` bit for bit.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL as _IQ4_NL
from gguf.quants import Q4_K as _Q4_K

# One transcoder's answer for n file blocks: values [n, block] int8, or for types held as nibbles
# (codes into the type's codebook for IQ4 and MXFP4) [n, block / 2] uint8 in the kernels' nibble
# order (``pack_nibbles``), scale [n, block / group] float32 (int8 sub-scales for types with
# super-blocks), offset like scale or None, and supers [n, 2] float32 (d, dmin; dmin 0 without
# offsets) or None. Q4_0, Q4_1, IQ4_NL, IQ4_XS and MXFP4 store their nibbles in that order
# already: their bytes are copied, not unpacked and packed again (at load that was most of a
# gpt-oss file's time).
Transcoded = tuple[np.ndarray, np.ndarray, "np.ndarray | None", "np.ndarray | None"]
SUPER = 256  # weights per super-block of the types with two-level scales
T = GGMLQuantizationType
_KVALUES = np.array(_IQ4_NL.kvalues, np.int8)
# Twice each e2m1 value of a 4-bit code (sign in the top bit): the OCP microscaling FP4 table.
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
# Weights a transcoder turns at once (bounds the load's temporaries, a few bytes a weight).
CHUNK_WEIGHTS = 1 << 20


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block, as float32 ``[n, 1]``."""
    return np.ascontiguousarray(blocks[:, at: at + 2]).view(np.float16).astype(np.float32)


def _low_high(packed: np.ndarray, width: int) -> np.ndarray:
    """``packed [n, c * width]`` bytes as ``[n, c * 2 * width]`` nibbles: per chunk of ``width``
    bytes, their low halves then their high halves (GGUF's order within a chunk)."""
    n = packed.shape[0]
    chunks = packed.reshape(n, -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (chunks & np.uint8(0x0F)).reshape(n, -1)


def _bits(packed: np.ndarray, width: int, count: int, bits: int) -> np.ndarray:
    """``packed [n, width]`` as ``[n, count * width]`` fields of ``bits``: field ``j`` of every
    byte, for j in order (GGUF's high-bit planes)."""
    n = packed.shape[0]
    shifts = np.arange(0, count * bits, bits, dtype=np.uint8).reshape(1, count, 1)
    return ((packed.reshape(n, 1, width) >> shifts) & np.uint8((1 << bits) - 1)).reshape(n, -1)


def _q4_0(b: np.ndarray) -> Transcoded:
    d = _f16(b, 0)
    return b[:, 2:], d, -8.0 * d, None


def _q4_1(b: np.ndarray) -> Transcoded:
    return b[:, 4:], _f16(b, 0), _f16(b, 2), None


def _q5_0(b: np.ndarray) -> Transcoded:
    high = _bits(np.ascontiguousarray(b[:, 2:6]).view(np.uint32), 1, 32, 1).astype(np.uint8)
    q = (_low_high(b[:, 6:], 16) | (high << np.uint8(4))).astype(np.int8) - np.int8(16)
    return q, _f16(b, 0), None, None


def _q5_1(b: np.ndarray) -> Transcoded:
    high = _bits(np.ascontiguousarray(b[:, 4:8]).view(np.uint32), 1, 32, 1).astype(np.uint8)
    return (_low_high(b[:, 8:], 16) | (high << np.uint8(4))).astype(np.int8), _f16(b, 0), _f16(b, 2), None


def _q8_0(b: np.ndarray) -> Transcoded:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b, 0), None, None


def _q2_k(b: np.ndarray) -> Transcoded:
    scales, d, dmin = b[:, :16], _f16(b, 80), _f16(b, 82)
    n = b.shape[0]
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = ((b[:, 16:80].reshape(n, -1, 1, 32) >> shifts) & np.uint8(3)).reshape(n, 256)
    return q.astype(np.int8), (scales & 0x0F).astype(np.int8), (scales >> 4).astype(np.int8), _supers(d, dmin)


def _q3_k(b: np.ndarray) -> Transcoded:
    n = b.shape[0]
    hmask, qs, packed, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b, 108)
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & np.uint8(0x0F)) | ((high & np.uint8(0x03)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    ql = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)).reshape(n, 256) & 3
    qh = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).reshape(n, 256) & 1
    q = ql.astype(np.int8) - ((qh ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    return q, sc, None, _supers(d)


def _supers(d: np.ndarray, dmin: np.ndarray | None = None) -> np.ndarray:
    """``[n, 2]``: each super-block's ``d`` and ``dmin`` (0 for types without offsets)."""
    return np.concatenate([d, np.zeros_like(d) if dmin is None else dmin], axis=-1)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the eight 6-bit scales and mins, and the super-block's ``d`` and ``dmin``."""
    sc, m = _Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return sc.astype(np.int8), m.astype(np.int8), _supers(_f16(b, 0), _f16(b, 2))


def _q4_k(b: np.ndarray) -> Transcoded:
    # Each 32 bytes hold 64 weights: byte i's low half weight i, its high half weight 32 + i. The
    # kernels' two blocks of 32: byte i holds weights i and i + 16 of the block (low, high).
    n = b.shape[0]
    first, second = (b[:, 16:].reshape(n, 4, 2, 16)[:, :, h] for h in (0, 1))
    low_block = (first & np.uint8(0x0F)) | (second << np.uint8(4))
    high_block = (first >> np.uint8(4)) | (second & np.uint8(0xF0))
    return np.stack([low_block, high_block], axis=2).reshape(n, 128), *_k_scales(b)


def _q5_k(b: np.ndarray) -> Transcoded:
    high = _bits(b[:, 16:48], 32, 8, 1)
    return (_low_high(b[:, 48:], 32) | (high << np.uint8(4))).astype(np.int8), *_k_scales(b)


def _q6_k(b: np.ndarray) -> Transcoded:
    n = b.shape[0]
    low = _low_high(b[:, :128], 64).reshape(n, 8, 32)
    high = _bits(b[:, 128:192].reshape(n * 2, 32), 32, 4, 2).reshape(n, 8, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q.reshape(n, 256), np.ascontiguousarray(b[:, 192:208]).view(np.int8), None, _supers(_f16(b, 208))


def _iq4_nl(b: np.ndarray) -> Transcoded:
    return b[:, 2:], _f16(b, 0), None, None


def _iq4_xs(b: np.ndarray) -> Transcoded:
    high = _bits(np.ascontiguousarray(b[:, 2:4]).view(np.uint16), 1, 8, 2).astype(np.uint8)
    low = _low_high(b[:, 4:8], 1)  # per byte: its low half, then its high half
    ls = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return b[:, 8:], ls, None, _supers(_f16(b, 0))


# Every e8m0 byte's float32 ``2^(e - 127) / 2`` (exact: a power of two from 2^-128 to 2^127).
_E8M0_HALVED = np.ldexp(np.float32(0.5), np.arange(256, dtype=np.int32) - 127).astype(np.float32)


def e8m0_halved(e: np.ndarray) -> np.ndarray:
    """e8m0 scale bytes as float32 ``2^(e - 127) / 2`` (llama.cpp's ``ggml_e8m0_to_fp32_half``),
    the scale of the doubled e2m1 values: looked up (``ldexp`` per scale was a fifth of a
    gpt-oss file's load)."""
    return _E8M0_HALVED[np.asarray(e, np.uint8)]


def _mxfp4(b: np.ndarray) -> Transcoded:
    return b[:, 1:], e8m0_halved(b[:, :1]), None, None


_TRANSCODERS: dict[GGMLQuantizationType, tuple[Callable[[np.ndarray], Transcoded], int, bool]] = {
    # type: (transcoder, weights per scale, held as nibbles)
    T.Q4_0: (_q4_0, 32, True),
    T.Q4_1: (_q4_1, 32, True),
    T.Q5_0: (_q5_0, 32, False),
    T.Q5_1: (_q5_1, 32, False),
    T.Q8_0: (_q8_0, 32, False),
    T.Q2_K: (_q2_k, 16, False),
    T.Q3_K: (_q3_k, 16, False),
    T.Q4_K: (_q4_k, 32, True),
    T.Q5_K: (_q5_k, 32, False),
    T.Q6_K: (_q6_k, 16, False),
    T.IQ4_NL: (_iq4_nl, 32, True),
    T.IQ4_XS: (_iq4_xs, 32, True),
    T.MXFP4: (_mxfp4, 32, True),
}
TRANSCODED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_TRANSCODERS)
# The types whose 4-bit codes index a table of 16 integers (``w = d * codebook[q]``).
_CODEBOOKS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.IQ4_NL: tuple(int(v) for v in _KVALUES),
    T.IQ4_XS: tuple(int(v) for v in _KVALUES),
    T.MXFP4: tuple(int(v) for v in E2M1_DOUBLED),
}


def codebook_of(kind: GGMLQuantizationType) -> tuple[int, ...] | None:
    """The 16 integers a type's 4-bit codes stand for, or None where the code is the value."""
    return _CODEBOOKS.get(kind)


def layout_of(kind: GGMLQuantizationType) -> tuple[int, bool, bool]:
    """``(group, nibbles, offsets)`` of the layout a type is held in."""
    group, nibbles = _TRANSCODERS[kind][1:]
    return group, nibbles, kind in (T.Q4_0, T.Q4_1, T.Q5_1, T.Q2_K, T.Q4_K, T.Q5_K)


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """``values [R, K]`` (0..15, natural order) as the kernel's nibbles ``[R, K/2]``: block byte
    ``i`` holds weight ``i`` in its low half and ``i + 16`` in its high half."""
    halves = values.reshape(*values.shape[:-1], -1, 2, 16)
    return (halves[..., 0, :] | (halves[..., 1, :] << np.uint8(4))).reshape(*values.shape[:-1], -1)


def transcode(data: np.ndarray, kind: GGMLQuantizationType, rows: int, size: int, name: str
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """A file tensor's raw bytes (``rows`` rows of ``size`` weights) as the kernel's arrays
    ``(q, scale, offset, supers)``: ``offset [rows, 0]`` for types without one; for types with
    super-blocks int8 ``scale`` / ``offset`` and ``supers [rows, size / 256 * 2]`` float32, else
    float32 tables and ``supers`` None. Chunk by chunk, so the temporaries stay small whatever
    the tensor. ``name`` is the tensor's, for errors."""
    if kind not in _TRANSCODERS:
        raise ValueError(f"tensor {name!r}: GGML type {kind.name} is not one of the types kept as blocks "
                         f"({', '.join(sorted(t.name for t in TRANSCODED_TYPES))})")
    block, type_size = GGML_QUANT_SIZES[kind]
    if size % block:
        raise ValueError(f"tensor {name!r}: a {kind.name} row is whole blocks of {block} weights, got {size}")
    raw = np.asarray(data).view(np.uint8).reshape(-1)
    if raw.size != rows * (size // block) * type_size:
        raise ValueError(f"tensor {name!r}: {raw.size} bytes for {rows} x {size} {kind.name} weights, expected "
                         f"{rows * (size // block) * type_size} (a truncated or corrupt file)")
    raw = raw.reshape(rows, size // block, type_size)
    fn, group, nibbles = _TRANSCODERS[kind]
    offsets = layout_of(kind)[2]
    two_level = block == SUPER
    table = np.int8 if two_level else np.float32
    q = np.empty((rows, size // 2 if nibbles else size), np.uint8 if nibbles else np.int8)
    scale = np.empty((rows, size // group), table)
    offset = np.empty((rows, size // group if offsets else 0), table)
    supers = np.empty((rows, size // SUPER * 2), np.float32) if two_level else None
    step = max(1, CHUNK_WEIGHTS // size)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        values, s, m, d = fn(raw[start:stop].reshape(-1, type_size))
        q[start:stop] = values.reshape(stop - start, -1)
        scale[start:stop] = s.reshape(stop - start, -1)
        if offsets:
            offset[start:stop] = m.reshape(stop - start, -1)
        if two_level:
            supers[start:stop] = d.reshape(stop - start, -1)
    return q, scale, offset, supers
