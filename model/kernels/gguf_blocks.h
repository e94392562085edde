// llama.cpp's block-quantized matrices as the dense kernel reads them (model/quantization/gguf_blocks.py
// lays them out, model/quantization/gguf_transcode.py turns each GGUF type into this form; dense_matmul.cc
// widens and multiplies them).
//
// Each row of K weights is K/32 blocks of 32 along k, stored as 4-bit nibbles or signed bytes. Each
// group of 32 (or 16) weights has a scale d and, for most formats, an offset m: w = d * q + m, or
// w = d * q without offsets. Q4_1's w = d * q + m, Q4_0's d * (q - 8) held as m = -8 * d, Q8_0's
// q * d, IQ4's and MXFP4's d * codebook[q] (4-bit codes into a table of 16 integers), in float32
// tables; the K-quants keep their two levels (Q4_K's d = d_super * sc and m = -(dmin * min) per
// 32, Q6_K's d = d_super * sc per 16), formed as a block is read. Wherever an offset is added,
// d * q is exact in float32 (at most 22 significant bits), so whether a compiler fuses the
// multiply-add or rounds the product first, w rounds once, exactly as the gguf package's numpy
// dequantization computes it; without an offset, d * q is its one rounding. That is what makes
// the block path's results the float32 path's, bit for bit.
#ifndef RAYLM_GGUF_BLOCKS_H_
#define RAYLM_GGUF_BLOCKS_H_

#include <cstdint>

namespace raylm {

constexpr int64_t kGgufBlock = 32;
constexpr int64_t kGgufSuper = 256;  // weights per super-block of two-level scales

struct GgufRows {
  // 4-bit: K/2 bytes per row; block byte i holds weight i in its low half and weight i + 16 in
  // its high half (GGUF's order). 8-bit: K signed bytes per row.
  const uint8_t* q;
  // K / group per row: float32, or int8 sub-scales when `supers` is given.
  const void* scale;
  // Like scale, or null: w = d * q (always given for 4-bit blocks).
  const void* offset;
  // K / 256 pairs per row (the K-quants' d and dmin; a group's scale is d * scale[g], its offset
  // -(dmin * offset[g]), both exact in float32), or null: float32 tables.
  const float* supers;
  int64_t K;
  bool nibbles;
  int64_t group;  // weights per scale: 32, or 16 (two scales a block: the low and high sixteen)
  // 4-bit codes standing for 16 integers (IQ4's kvalues, MXFP4's doubled e2m1), as float32: w = d *
  // codebook[q], no offset (d * codebook[q] is the one rounding, as the gguf package's), or null.
  const float* codebook = nullptr;
  // 8-bit values that are float8 e4m3fn, not signed integers (block-scaled FP8 checkpoints:
  // w = d * fp8, no offset; the widening is exact, d * fp8 the one rounding, as the format's
  // float32 dequantization).
  bool fp8 = false;

  bool Nibbles() const { return nibbles; }
  int64_t RowBytes() const { return nibbles ? K / 2 : K; }
  int64_t RowBlocks() const { return K / kGgufBlock; }
  int64_t RowScales() const { return K / group; }
  int64_t TableBytes() const { return supers ? 1 : 4; }

  // These rows from row `first` on: a stack's expert e, with N rows each, is From(e * N).
  GgufRows From(int64_t first) const {
    GgufRows rest = *this;
    const int64_t table_bytes = first * RowScales() * TableBytes();
    rest.q = q + first * RowBytes();
    rest.scale = static_cast<const char*>(scale) + table_bytes;
    rest.offset = offset ? static_cast<const char*>(offset) + table_bytes : nullptr;
    rest.supers = supers ? supers + first * (K / kGgufSuper) * 2 : nullptr;
    return rest;
  }

  // The (d, dmin) pair of block b of `row` (two-level scales only).
  const float* Super(int64_t row, int64_t b) const {
    return supers + 2 * (row * (K / kGgufSuper) + b / (kGgufSuper / kGgufBlock));
  }

  // Group s's (of the whole matrix) scale and offset; `super` is its block's Super(), or null
  // for float32 tables.
  template <bool kTwoLevel>
  float Scale(int64_t s, const float* super) const {
    if constexpr (kTwoLevel) return super[0] * static_cast<float>(static_cast<const int8_t*>(scale)[s]);
    return static_cast<const float*>(scale)[s];
  }
  template <bool kTwoLevel>
  float Offset(int64_t s, const float* super) const {
    if constexpr (kTwoLevel) return -(super[1] * static_cast<float>(static_cast<const int8_t*>(offset)[s]));
    return static_cast<const float*>(offset)[s];
  }
};

}  // namespace raylm

#endif  // RAYLM_GGUF_BLOCKS_H_
