// The integer compute mode's operands (int8_matmul.cc says the arithmetic): the activations as
// quantized rows (Int8Rows), the weights as model/quantization/int8_panels.py packs them
// (Int8Panels), and the arithmetic as plain loops, the portable family that the vector families
// (int8_families.h) match bit for bit.
#ifndef RAYLM_INT8_PANELS_H_
#define RAYLM_INT8_PANELS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "float16.h"
#include "gguf_blocks.h"

namespace {

using raylm::kGgufBlock;

constexpr int64_t kGroupCols = 16;  // output columns of one packed group
constexpr int64_t kVectorBytes = 64;

// One call's activations, quantized (int8_matmul.cc says how): row r's block b holds 32 values
// at q[(r * blocks + b) * 32], its d_x, d_x * S, 128 * S and 128 * S_low (S_low: the sum of its
// first 16 values, for weights with a scale per 16).
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<int8_t> tiled;  // AMX only: q again, each 16 rows' block b contiguous (int8_amx.h)
  std::vector<float> d, ds;
  std::vector<int32_t> sum128, low128;
  int64_t blocks = 0;

  const int8_t* Block(int64_t r, int64_t b) const { return q.data() + (r * blocks + b) * kGgufBlock; }
  int64_t At(int64_t r, int64_t b) const { return r * blocks + b; }
  // Four activation bytes, as the 32-bit lane a broadcast repeats.
  int32_t Four(int64_t r, int64_t b, int at) const {
    int32_t four;
    std::memcpy(&four, Block(r, b) + at, 4);
    return four;
  }
};

// Buffers for M rows of K inputs (values zero, so a last partial block is padded with zeros).
void AllocateRows(int64_t M, int64_t K, Int8Rows* out) {
  const int64_t blocks = (K + kGgufBlock - 1) / kGgufBlock;
  out->blocks = blocks;
  out->q.assign(M * blocks * kGgufBlock, 0);
  out->d.resize(M * blocks);
  out->ds.resize(M * blocks);
  out->sum128.resize(M * blocks);
  out->low128.resize(M * blocks);
}

// Stores block b of row r's scale and sums (the values are in place): `sum` of all 32 values,
// `low` of the first 16.
inline void SetBlock(Int8Rows* out, int64_t r, int64_t b, float amax, int32_t sum, int32_t low) {
  const float d = amax / 127.0f;
  out->d[out->At(r, b)] = d;
  out->ds[out->At(r, b)] = d * static_cast<float>(sum);
  out->sum128[out->At(r, b)] = 128 * sum;
  out->low128[out->At(r, b)] = 128 * low;
}

// The quantization by plain loops, rows [r_begin, r_end) (the portable family; VNNI's and AVX2's
// give the same bits).
void QuantizeRows(const float* x, int64_t r_begin, int64_t r_end, int64_t K, Int8Rows* out) {
  const int64_t blocks = out->blocks;
  for (int64_t r = r_begin; r < r_end; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + r * K + b * kGgufBlock;
      const int64_t count = std::min<int64_t>(kGgufBlock, K - b * kGgufBlock);
      float amax = 0.0f;
      for (int64_t k = 0; k < count; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* q = out->q.data() + (r * blocks + b) * kGgufBlock;
      int32_t sum = 0, low = 0;
      for (int64_t k = 0; k < count; ++k) {
        // |v * inverse| <= 127 * (1 + 2^-23): it rounds to at most 127.
        const int32_t value = static_cast<int32_t>(std::nearbyint(v[k] * inverse));
        q[k] = static_cast<int8_t>(value);
        sum += value;
        if (k < kGgufBlock / 2) low += value;
      }
      SetBlock(out, r, b, amax, sum, low);
    }
}

// The six weight formats; each is its own instantiation of the tiles.
enum class Format {
  kNibbles,          // 4-bit GGUF blocks: d_w and m per block
  kCodes,            // 4-bit codes into a codebook of 16 int8 values (IQ4_NL, IQ4_XS, MXFP4): d_w per block
  kBlockBytes,       // Q8_0 blocks and int8_g32: signed bytes, d_w per block
  kOffsetBytes,      // Q5_K, Q5_1: bytes 0..31, d_w and m per block
  kRowBytes,         // per-row int8: signed bytes, d_w = 1, a scale per output column at the end
  kSixBits,          // Q6_K, Q3_K, Q2_K: v + 32 in 6 bits, an int8 sub-scale (and offset) per 16, d_w (and
                     // -dmin as m) per block
};

// 64-byte vectors per block of 16 columns: 4-bit nibbles and codes 4, 6-bit values 6, bytes 8.
constexpr int VectorsOf(Format format) {
  return format == Format::kNibbles || format == Format::kCodes ? 4 : format == Format::kSixBits ? 6 : 8;
}

constexpr int kSuperShift = 3;  // blocks per super-block of 256: 1 << kSuperShift

// Entries per group of a d or m table whose entries cover 1 << super_shift blocks each.
constexpr int64_t TableEntries(int64_t blocks, int super_shift) {
  return (blocks + (int64_t{1} << super_shift) - 1) >> super_shift;
}

// The packed weights (model/quantization/int8_panels.py): q [groups, blocks, T, 16, 4] bytes, d and m
// [groups, blocks, 16] (absent: null) in float32, or in float16 (`half`) where the values are
// float16's, as GGUF stores them (a sixth less to read per 4-bit weight: a decode row streams
// every byte of the matrix once), row_scale [N] (absent: null), sub_scale [groups, blocks, rows, 16]
// int8 or null. Two-level scales (the K-quants, IQ4_XS) keep their levels: d and m hold the
// super-block's d and -dmin, [groups, blocks / 8, 16], and sub_scale each block's int8 scales:
// - kSixBits (scales per 16): rows 0 and 1 the two halves' scales, 2 and 3 (where m is given)
//   their offsets, applied to the halves' integer sums;
// - the other formats (scales per 32): row 0 the block's scale, row 1 (where m is given) its
//   offset, so d_w = d * scale and m = -dmin * offset: the float32 products are exact (a float16
//   times a 6-bit integer), the very values a table of them would hold, at a third of the bytes.
// kCodes's q holds 4-bit codes as kNibbles's does, each standing for `codebook`'s int8 value at
// its index (IQ4's table; MXFP4's e2m1 values doubled, with d_w halved): the families look the
// codes up with one byte shuffle, so a weight stays 4 bits in memory.
// kSixBits's q holds
// u = v + 32 (0..63) of each weight v in T = 6 vectors: 0..3 its low four bits as 4-bit blocks
// hold nibbles, 4 + h the top two bits of half h's weights, byte i of a lane holding those of
// weights 16h + 4t + i at bits 2t, 2t + 1 (t = 0..3).
struct Int8Panels {
  const uint8_t* q;
  const void* d;
  const void* m;
  const float* row_scale;
  const int8_t* sub_scale;
  const int8_t* codebook;  // kCodes: the 16 values the codes stand for; else null
  int64_t N, K, blocks;
  Format format = Format::kNibbles;
  bool half = false;
  int64_t sub_rows = 0;  // rows of sub_scale per block (0 without)
  int super_shift = 0;    // d and m entries cover 1 << super_shift blocks: 0 (one), or kSuperShift (two levels)
  int64_t table_group = 0;  // the group d and m start at (a panel's own tables: WithFormedTables)

  int Vectors() const { return VectorsOf(format); }
  bool HasOffsets() const { return format == Format::kNibbles || format == Format::kOffsetBytes; }
  // Whether d_w and m are the super-block's d and -dmin times the block's int8 scale and offset.
  bool ScaledTables() const { return sub_scale != nullptr && format != Format::kSixBits; }
  // Entries of d (and m) per group: one per block, or one per super-block.
  int64_t TableBlocks() const { return TableEntries(blocks, super_shift); }
  // Bytes of one group's tables (d, m and sub-scales, every block's): panels are sized by them.
  int64_t GroupTableBytes() const {
    const int64_t tables = (d != nullptr) + (m != nullptr);
    return TableBlocks() * tables * kGroupCols * (half ? 2 : 4) + blocks * sub_rows * kGroupCols;
  }
  // Vector t of block b for the lanes from column c (c a multiple of 8: AVX2 reads half groups).
  const uint8_t* Vector(int64_t c, int64_t b, int t) const {
    return q + (((c / kGroupCols) * blocks + b) * Vectors() + t) * kVectorBytes + (c % kGroupCols) * 4;
  }
  // Block b's int8 sub-scales of row h for the lanes from column c (kSixBits: h 0 for weights
  // 0..15, 1 for 16..31, 2 and 3 their offsets; else 0 the block's scale, 1 its offset).
  const int8_t* SubScales(int64_t c, int64_t b, int h) const {
    return sub_scale + (((c / kGroupCols) * blocks + b) * sub_rows + h) * kGroupCols + c % kGroupCols;
  }
  // Where block b's entry of d or m is for the lanes from column c, in values of their type.
  int64_t LaneIndex(int64_t c, int64_t b) const {
    return ((c / kGroupCols - table_group) * TableBlocks() + (b >> super_shift)) * kGroupCols + c % kGroupCols;
  }
  // Block b's entry of d or m (`values`) for column n.
  float Lane(const void* values, int64_t n, int64_t b) const {
    const int64_t i = LaneIndex(n, b);
    return half ? raylm::HalfToFloat(static_cast<const uint16_t*>(values)[i]) : static_cast<const float*>(values)[i];
  }
  // Block b's d_w and m of column n (ScaledTables: the exact products; kSixBits: the super-block's).
  float BlockScale(int64_t n, int64_t b) const {
    const float d_w = Lane(d, n, b);
    return ScaledTables() ? d_w * static_cast<float>(*SubScales(n, b, 0)) : d_w;
  }
  float BlockOffset(int64_t n, int64_t b) const {
    const float offset = Lane(m, n, b);
    return ScaledTables() ? offset * static_cast<float>(*SubScales(n, b, 1)) : offset;
  }
  // Weight k of column n as the integer the sums use.
  int32_t Value(int64_t n, int64_t k) const {
    const int64_t b = k / kGgufBlock, i = k % kGgufBlock, c = n - n % kGroupCols, lane = (n % kGroupCols) * 4;
    const bool nibbles = format == Format::kNibbles || format == Format::kCodes || format == Format::kSixBits;
    const int64_t byte = nibbles ? i % 16 : i;
    const uint8_t stored = Vector(c, b, static_cast<int>(byte / 4))[lane + byte % 4];
    if (!nibbles) return static_cast<int8_t>(stored);
    const int32_t low = i < 16 ? stored & 0x0F : stored >> 4;
    if (format == Format::kNibbles) return low;
    if (format == Format::kCodes) return codebook[low];
    const uint8_t top = Vector(c, b, 4 + static_cast<int>(i / 16))[lane + byte % 4];
    return (low | ((top >> (2 * (byte / 4))) & 3) << 4) - 32;
  }
};

// kSixBits with offsets: block b's o = m_0 S_0 + m_1 S_1 of row r and column n (m_h the half's int8
// offset, S_h its activations' sum; exact in int32), which the kernel scales by d_x * (-dmin).
inline int32_t OffsetSum(const Int8Rows& a, const Int8Panels& w, int64_t r, int64_t n, int64_t b) {
  const int64_t i = a.At(r, b);
  return *w.SubScales(n, b, 2) * (a.low128[i] / 128) + *w.SubScales(n, b, 3) * ((a.sum128[i] - a.low128[i]) / 128);
}

// The portable family: the arithmetic above as plain loops.
void PortableColumns(const Int8Rows& a, const Int8Panels& w, float* y, int64_t M, int64_t n_begin, int64_t n_end) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = n_begin; n < n_end; ++n) {
      float acc = 0.0f;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const int8_t* xq = a.Block(r, b);
        int32_t sum = 0;
        if (w.format == Format::kSixBits) {
          // Each half's sum times its int8 sub-scale, added in int32: exact (at most 2 * 16 * 128 * 127 * 128).
          for (int h = 0; h < 2; ++h) {
            int32_t half = 0;
            for (int64_t k = 16 * h; k < 16 * h + 16; ++k) half += xq[k] * w.Value(n, b * kGgufBlock + k);
            sum += half * *w.SubScales(n, b, h);
          }
        } else {
          for (int64_t k = 0; k < kGgufBlock; ++k) sum += xq[k] * w.Value(n, b * kGgufBlock + k);
        }
        const float dw = w.format == Format::kRowBytes ? 1.0f : w.BlockScale(n, b);
        acc = std::fma(static_cast<float>(sum), a.d[a.At(r, b)] * dw, acc);
        if (w.HasOffsets()) acc = std::fma(w.BlockOffset(n, b), a.ds[a.At(r, b)], acc);
        if (w.format == Format::kSixBits && w.m != nullptr)
          acc = std::fma(static_cast<float>(OffsetSum(a, w, r, n, b)), a.d[a.At(r, b)] * w.BlockOffset(n, b), acc);
      }
      y[r * w.N + n] = w.format == Format::kRowBytes ? acc * w.row_scale[n] : acc;
    }
}

}  // namespace

#endif  // RAYLM_INT8_PANELS_H_
