// llama.cpp's block-quantized matrices as the dense kernel reads them (model/quantization/gguf_blocks.py
// lays them out, model/quantization/gguf_transcode.py turns each GGUF type into this form; dense_matmul.cc
// widens and multiplies them).
//
// Each row of K weights is K/32 blocks of 32 along k, stored as 4-bit nibbles or signed bytes. Each
// group of 32 (or 16) weights has a float32 scale d and, for most formats, a float32 offset m:
// w = d * q + m, or w = d * q without offsets. Q4_1's w = d * q + m, Q4_0's d * (q - 8) held as
// m = -8 * d, Q8_0's q * d; the K-quants' super-block scales are folded in at load (Q4_K's
// d = d_super * sc, m = -dmin * min; Q6_K's d = d_super * sc per 16). Wherever an offset is
// added, d * q is exact in float32 (at most 22 significant bits), so whether a compiler fuses the
// multiply-add or rounds the product first, w rounds once, exactly as the gguf package's numpy
// dequantization computes it; without an offset, d * q is its one rounding. That is what makes the
// block path's results the float32 path's, bit for bit.
#ifndef RAYLM_GGUF_BLOCKS_H_
#define RAYLM_GGUF_BLOCKS_H_

#include <cstdint>

namespace raylm {

constexpr int64_t kGgufBlock = 32;

struct GgufRows {
  // 4-bit: K/2 bytes per row; block byte i holds weight i in its low half and weight i + 16 in
  // its high half (GGUF's order). 8-bit: K signed bytes per row.
  const uint8_t* q;
  const float* scale;   // K / group per row
  const float* offset;  // K / group per row, or null: w = d * q (always given for 4-bit blocks)
  int64_t K;
  bool nibbles;
  int64_t group;  // weights per scale: 32, or 16 (two scales a block: the low and high sixteen)

  bool Nibbles() const { return nibbles; }
  int64_t RowBytes() const { return nibbles ? K / 2 : K; }
  int64_t RowBlocks() const { return K / kGgufBlock; }
  int64_t RowScales() const { return K / group; }
};

}  // namespace raylm

#endif  // RAYLM_GGUF_BLOCKS_H_
