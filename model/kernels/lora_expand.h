// The LoRA kernel's second phase (lora_delta.cc): (x A^T) B^T as R vector updates of each
// slot's contiguous outputs, B^T packed in tiles of kExpandTile columns, by the eight-lane
// tiles (Expand) or, where the process runs the dense kernel's sixteen-lane family, the wide
// ones (ExpandWide).
#ifndef RAYLM_LORA_EXPAND_H_
#define RAYLM_LORA_EXPAND_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dense_tiles.h"

namespace {

using raylm::Vec8;

// How Expand's tiles load weights as float32 lanes (exactly) on CPUs without AVX-512: eight at
// a time (Lanes<Vec8>), in registers of the width they have. Sixteen-lane vector extensions,
// which each target_clones clone compiled before, came out on AVX2 as scalar stores and
// reloads of every broadcast rank value (a rank-64 LoRA step 0.42x of the base model's on a
// 2-core AVX2 EPYC, against 0.78x on AVX-512). ExpandWide's loads use the dense kernel's
// intrinsics instead.
struct PortableLoad {
  template <typename W>
  __attribute__((always_inline)) static Vec8 Load(const W* p) { return Lanes<Vec8>::Load(p); }
};
constexpr int64_t kExpandTile = 64;  // output columns per tile (B's tiles, model/decoder/lora_slots.py)
// How far ahead ExpandTile fetches B, in ranks (int8: 4 KiB, a rank-64 tile). The tiles are read
// once per call in one stream, which the hardware prefetcher alone left waiting on memory; at a
// few multiply-adds per rank, 16 ranks (1 KiB) ahead were less than a memory latency away: in
// a perf profile of 16 rows over 8 rank-64 adapters, half of the expansion's time sat on the
// load of each rank's first vector, and 64 ranks ahead made one row's 120 calls of a step
// 1.7-2.0x and 16 rows' 1.25-1.35x faster back to back, and 16 rows' ~1.1x from memory (2-core
// AVX-512 EPYC, alternating runs; 128 and 256 ranks measured within noise of 64).
constexpr int64_t kExpandAheadRanks = 64;

// d[i, c] = sum_r xa[i, r] tile[r, c] for MR rows and kCols columns of one tile (its R rows
// kExpandTile values apart, d's rows ldd apart), the ranks in order: each tile vector is loaded
// once for all the rows, by `Load`, as vectors of its width. With `scale` (int8 weights: these
// columns' scales) each sum is then rounded times its column's scale, once for all the rows
// while the sums are in registers. `prefetch`: fetch the tile's lines kExpandAheadRanks ranks
// ahead (into the next tile at its end) while this computes.
template <int MR, int kCols, typename W, typename Load = PortableLoad>
__attribute__((always_inline)) inline void ExpandTile(const float* __restrict xa, const W* __restrict tile,
                                                      const float* __restrict scale, float* __restrict d, int64_t ldd,
                                                      int64_t R, bool prefetch) {
  using V = decltype(Load::Load(tile));
  constexpr int kLanes = sizeof(V) / sizeof(float), kVectors = kCols / kLanes;
  constexpr int kLines = kExpandTile * sizeof(W) / 64;  // cache lines per rank of a whole tile
  V acc[MR][kVectors];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kVectors; ++v) acc[i][v] = V{};
  for (int64_t r = 0; r < R; ++r) {
    if (prefetch)
      for (int l = 0; l < kLines; ++l)
        __builtin_prefetch(reinterpret_cast<const char*>(tile + (r + kExpandAheadRanks) * kExpandTile) + 64 * l);
    V bv[kVectors];
    for (int v = 0; v < kVectors; ++v) bv[v] = Load::Load(tile + r * kExpandTile + v * kLanes);
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < kVectors; ++v) acc[i][v] += xa[i * R + r] * bv[v];
  }
  if (scale)
    for (int v = 0; v < kVectors; ++v) {
      const V sv = Load::Load(scale + v * kLanes);
      for (int i = 0; i < MR; ++i) acc[i][v] *= sv;
    }
  for (int i = 0; i < MR; ++i) std::memcpy(d + i * ldd, acc[i], sizeof acc[i]);
}

// `rows` rows through one tile. Sixteen-lane registers (kWide: 32 of them) hold four rows of a
// whole tile's accumulators. Eight-lane ones (16 registers) hold one row's whole tile, or two
// rows' half tile: rows go in pairs over each half (the second half's lines are in L1 by then),
// so a pair widens each weight once for both rows, which at two rows per adapter (16 requests
// over 8 adapters) had been most of the kernel's work. A column's sum is over the ranks in order
// whatever the tile, so every path gives the same bits.
template <typename W, typename Load = PortableLoad, bool kWide = false>
__attribute__((always_inline)) inline void ExpandRows(int64_t rows, const float* xa, const W* tile,
                                                      const float* scale, float* d, int64_t ldd, int64_t R) {
  int64_t i = 0;
  if constexpr (kWide) {
    for (; i + 4 <= rows; i += 4)
      ExpandTile<4, kExpandTile, W, Load>(xa + i * R, tile, scale, d + i * ldd, ldd, R, i == 0);
    switch (rows - i) {
      case 3: return ExpandTile<3, kExpandTile, W, Load>(xa + i * R, tile, scale, d + i * ldd, ldd, R, i == 0);
      case 2: return ExpandTile<2, kExpandTile, W, Load>(xa + i * R, tile, scale, d + i * ldd, ldd, R, i == 0);
      case 1: return ExpandTile<1, kExpandTile, W, Load>(xa + i * R, tile, scale, d + i * ldd, ldd, R, i == 0);
    }
  } else {
    constexpr int kHalf = kExpandTile / 2;
    for (; i + 2 <= rows; i += 2)
      for (int half = 0; half < 2; ++half)
        ExpandTile<2, kHalf, W, Load>(xa + i * R, tile + half * kHalf, scale ? scale + half * kHalf : nullptr,
                                      d + i * ldd + half * kHalf, ldd, R, i == 0 && half == 0);
    if (i < rows) ExpandTile<1, kExpandTile, W, Load>(xa + i * R, tile, scale, d + i * ldd, ldd, R, i == 0);
  }
}

// B^T [R, O] is packed in tiles (model/decoder/lora_slots.py, B_TILE): tile j holds columns
// [64 j, 64 j + 64) of every rank, its R rows of kExpandTile values contiguous, the columns past O
// zero. A tile's sums then read one stream: from [R, O] they read R lines O values apart, more
// streams than the prefetchers follow (int8 and bfloat16 slots at rank 64 took 1.2x as long).
inline int64_t TiledColumns(int64_t O) { return (O + kExpandTile - 1) / kExpandTile * kExpandTile; }

// A target's column scales (int8 weights; null for float ones) a tile at a time: tile o's in
// place, or for a tile that passes the target's O outputs a copy beside zeros (those columns'
// sums are dropped, and the scales end at O).
class TileScales {
 public:
  TileScales(const float* scale, int64_t O) : scale_(scale), O_(O) {}
  const float* At(int64_t o) {
    if (!scale_ || o + kExpandTile <= O_) return scale_ ? scale_ + o : nullptr;
    std::fill(tail_, tail_ + kExpandTile, 0.0f);
    std::copy(scale_ + o, scale_ + O_, tail_);
    return tail_;
  }

 private:
  const float* scale_;
  int64_t O_;
  float tail_[kExpandTile];
};

// d [rows, ldd] = xa [rows, R] . B [R, *] (times `scale`'s column scales, for the O outputs),
// the tiles of columns [begin, end) (multiples of kExpandTile) of the tiled b, every output by
// ExpandTile's vector code, so bfloat16 and int8 weights give float32's sums on their (exactly
// widened) values.
template <typename W>
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void Expand(int64_t rows, const float* xa, const W* b, const float* scale, int64_t O, float* d, int64_t ldd, int64_t R,
            int64_t begin, int64_t end) {
  TileScales scales(scale, O);
  for (int64_t o = begin; o < end; o += kExpandTile)
    ExpandRows(rows, xa, b + o * R, scales.At(o), d + o, ldd, R);
}

#ifdef RAYLM_WIDE_TILES
// On AVX-512 CPUs every slot type is widened in sixteen-lane registers by the dense kernel's
// intrinsics (Lanes<Vec16>), four rows per tile: an int8 panel's store and reload, and GCC's
// code for bfloat16 vector extensions, had cost a rank-64 adapter's slots more than reading
// them. A multiply-add per rank, in order, on the exact float32 values, as Expand's, so either
// path gives the same bits.
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
// Not always_inline: GCC refuses that into ExpandTile, compiled for the default target; it
// inlines the call once ExpandTile is inlined here (as TileOf's loads in dense_tiles.h).
struct WideLoad {
  template <typename W>
  static Vec16 Load(const W* p) { return Lanes<Vec16>::Load(p); }
};

template <typename W>
void ExpandWide(int64_t rows, const float* xa, const W* b, const float* scale, int64_t O, float* d, int64_t ldd,
                int64_t R, int64_t begin, int64_t end) {
  TileScales scales(scale, O);
  for (int64_t o = begin; o < end; o += kExpandTile)
    ExpandRows<W, WideLoad, true>(rows, xa, b + o * R, scales.At(o), d + o, ldd, R);
}
#pragma GCC pop_options
#endif

// Expand for any slot type: by the wide tiles where the process runs the dense kernel's
// sixteen-lane family (UseWideTiles), else by Expand's eight-lane tiles.
template <typename W>
void ExpandSlots(int64_t rows, const float* xa, const W* b, const float* scale, int64_t O, float* d, int64_t ldd,
                 int64_t R, int64_t begin, int64_t end) {
#ifdef RAYLM_WIDE_TILES
  if (UseWideTiles()) return ExpandWide(rows, xa, b, scale, O, d, ldd, R, begin, end);
#endif
  Expand(rows, xa, b, scale, O, d, ldd, R, begin, end);
}

}  // namespace

#endif  // RAYLM_LORA_EXPAND_H_
