// llama.cpp's legacy block-quantized matrices (Q4_0, Q4_1, Q8_0) as the dense kernel reads them
// (model/quantization/gguf_blocks.py lays them out; dense_matmul.cc widens and multiplies them).
//
// Each row of K weights is K/32 blocks of 32 along k. Per block a float32 scale d and, for 4-bit
// blocks, a float32 offset m: Q4_1's w = d * q + m with q in 0..15, Q4_0's w = d * (q - 8) held
// as m = -8 * d, Q8_0's w = q * d with q a signed byte. d and m are GGUF's float16 values, so
// every product d * q is exact in float32 (11 + 4 or 11 + 8 significant bits): whether a compiler
// fuses the multiply-add or rounds the product first, w rounds once, exactly as the gguf
// package's numpy dequantization computes it. That is what makes the block path's results the
// float32 path's, bit for bit.
#ifndef RAYLM_GGUF_BLOCKS_H_
#define RAYLM_GGUF_BLOCKS_H_

#include <cstdint>

namespace raylm {

constexpr int64_t kGgufBlock = 32;

struct GgufRows {
  // 4-bit: K/2 bytes per row; block byte i holds weight i in its low half and weight i + 16 in
  // its high half (GGUF's order). 8-bit: K signed bytes per row.
  const uint8_t* q;
  const float* scale;   // K/32 per row
  const float* offset;  // K/32 per row for 4-bit blocks; null for 8-bit ones
  int64_t K;

  bool Nibbles() const { return offset != nullptr; }
  int64_t RowBytes() const { return Nibbles() ? K / 2 : K; }
  int64_t RowBlocks() const { return K / kGgufBlock; }
};

}  // namespace raylm

#endif  // RAYLM_GGUF_BLOCKS_H_
