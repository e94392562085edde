"""MXFP4 as HF checkpoints store it (gpt-oss's experts: ``*_blocks`` / ``*_scales``), held as
GGUF-style blocks, exactly.

OCP microscaling FP4: per 32 weights one e8m0 scale byte ``e`` (``2^(e - 127)``) and 32 e2m1
codes of 4 bits (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6). The openai
release and transformers store a tensor ``[..., out, in]`` as ``blocks [..., out, in/32, 16]``
uint8, byte ``j`` of a block holding code ``2j`` in its low half and ``2j + 1`` in its high half,
and ``scales [..., out, in/32]`` uint8; transformers' ``convert_moe_packed_tensors`` looks each
code up in its FP4 table and ``ldexp``s it by ``e - 127``.

Held as GGUF's MXFP4 is (model/quantization/gguf_transcode.py): the 4-bit codes as stored, re-paired
into GGUF's nibble order, looked up in a codebook of ``2 * e2m1`` (an integer of {0, 1, 2, 3, 4, 6,
8, 12} with its sign), and a float32 scale ``2^(e - 127) / 2`` per 32: 4.5 bits a weight. Both are exact and their product is the one rounding
of a power of two times a small integer, itself exact: the kernels widen the weights
transformers computes, bit for bit (tests/model/test_gpt_oss_mxfp4.py), for every scale byte
from 2 up. Bytes 0 and 1 make the scale a float32 subnormal (2^-128, 2^-127), which XLA's CPU
flushes to zero as it does every subnormal: those blocks' weights (at most 6 * 2^-126 = 7e-38,
where transformers keeps them) read as zeros.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from raylm.model.quantization.gguf_blocks import BLOCK, GgufBlocks
from raylm.model.quantization.gguf_transcode import codebook_of, e8m0_halved, pack_nibbles


def hf_mxfp4_blocks(blocks: np.ndarray, scales: np.ndarray) -> GgufBlocks:
    """``blocks [..., G, 16]`` and ``scales [..., G]`` (uint8, HF's layout above) as host
    ``GgufBlocks [..., G * 32]``."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: expected blocks [..., G, 16] "
                         "and scales [..., G]")
    *lead, groups, _ = blocks.shape
    codes = np.stack([blocks & np.uint8(0x0F), blocks >> np.uint8(4)], axis=-1)  # [..., G, 16, 2]: 2j, 2j + 1
    q = pack_nibbles(codes.reshape(*lead, groups * BLOCK))  # GGUF's order: code i low, code i + 16 high
    return GgufBlocks(q, e8m0_halved(scales), np.zeros((*lead, 0), np.float32), (groups * BLOCK,),
                      codebook=codebook_of(GGMLQuantizationType.MXFP4))
