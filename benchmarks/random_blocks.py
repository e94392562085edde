"""GGUF blocks with random bits and float16 scales of a sane magnitude, for the types the gguf
package cannot quantize (the K-quants, IQ4, MXFP4): valid file tensors whose values are what the
package dequantizes. Test checkpoints (tests/gguf_export.py), kernel benchmarks
(prompt_gemm_bench.weights_in) and benchmark files of any of these types (make_family_gguf: no
floats quantized, so a 15B-parameter file takes minutes) use them: every bit pattern of the stored integers and sub-scales
appears, and no scale is a NaN or an infinity."""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
# Where each type's float16 scales sit in its block, and a magnitude for them that keeps the
# weights within about +-0.3 (the largest stored integers times the largest sub-scales).
_F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
               T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q4_0: (0,), T.Q4_1: (0, 2),
               T.Q8_0: (0,)}
_SCALE = {T.Q2_K: 0.3 / 45, T.Q3_K: 0.3 / 128, T.Q4_K: 0.3 / 945, T.Q5_K: 0.3 / 1953, T.Q6_K: 0.3 / 4064,
          T.IQ4_NL: 0.3 / 127, T.IQ4_XS: 0.3 / 4064, T.Q5_0: 0.3 / 16, T.Q5_1: 0.3 / 31, T.Q4_0: 0.3 / 8,
          T.Q4_1: 0.3 / 15, T.Q8_0: 0.3 / 127}
F16_SCALED_TYPES: frozenset[T] = frozenset(_F16_FIELDS)


def random_blocks(kind: T, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A tensor of ``shape`` (numpy order, rows of whole blocks) in ``kind``'s blocks with random
    bits and float16 scales of a sane magnitude: a valid file tensor for types the gguf
    package cannot quantize (the K-quants, IQ4). Its values are what the package dequantizes."""
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(count, type_size), dtype=np.uint8)
    for at in _F16_FIELDS.get(kind, ()):
        d = (rng.uniform(0.2, 1.0, count) * _SCALE[kind]).astype(np.float16)
        raw[:, at: at + 2] = d.reshape(count, 1).view(np.uint8)
    if kind == T.MXFP4:  # its scale is an e8m0 byte, a power of two: 2^-10 .. 2^-4 here
        raw[:, 0] = rng.integers(117, 124, count)
    return raw.reshape(*shape[:-1], shape[-1] // block * type_size)
