// The dense kernel's tiles (dense_matmul.cc; the grouped and LoRA kernels run them too): a tile of
// input rows against a tile of weight rows with the sums in registers (TileOf, GgufTileOf), the
// widening of weight rows into a float32 panel, and the two families that compile them, eight
// lanes (NarrowTiles) and sixteen (WideTiles), of which a process runs one (UseWideTiles).
#ifndef RAYLM_DENSE_TILES_H_
#define RAYLM_DENSE_TILES_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dense_lanes.h"
#include "gguf_blocks.h"
#include "wide_lanes.h"

namespace {

using raylm::GgufRows;


// y[i, j] = x[i, :] . w[j, :] for i < MR, j < NR: MR*NR vector accumulators, NR weight vectors
// and one input vector per step, loaded by L (Lanes<V>, or F16cLanes for float16 weights). Each
// element is summed over V's lanes along k, then the lanes in Lanes<V>::Sum's order, then the k
// tail. `ahead` (or null): NR weight rows to
// prefetch, one cache line per row every 16 floats, while this tile computes.
template <typename V, int MR, int NR, typename W, typename L = Lanes<V>>
__attribute__((always_inline)) inline void TileOf(const float* __restrict x, const W* __restrict w,
                                                  const float* __restrict scale, float* __restrict y, int64_t K,
                                                  int64_t N, const float* __restrict ahead) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  V acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = V{};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if constexpr (sizeof(W) == 1) {
      // 8-bit rows are short (576 B for K = 576): too short for the hardware prefetcher to
      // pick up before they end, which left a one-row call at a third of DRAM bandwidth.
      // Fetch the next tile's rows (contiguous after these) one tile ahead.
      if (k % 64 == 0)
        for (int j = 0; j < NR; ++j) __builtin_prefetch(w + (NR + j) * K + k);
    } else if constexpr (sizeof(W) == 2) {
      // 16-bit rows likewise, a cache line (32 values) per row at a time: without it 4-row
      // calls of a 2048x2048 and an 8192x2048 matrix were 1.1x the float32 kernel's speed,
      // with it 1.3-1.5x (16-lane tiles, 2-core AMD EPYC).
      if (k % 32 == 0)
        for (int j = 0; j < NR; ++j) __builtin_prefetch(w + (NR + j) * K + k);
    }
    if (ahead && k % 16 == 0)
      for (int j = 0; j < NR; ++j) __builtin_prefetch(ahead + j * K + k);
    V wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = L::Load(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const V xv = L::Load(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  if constexpr (L::kSumsTiles && MR == 4 && NR == 4) {
    if (k == K) return L::SumTile(acc, scale, y, N);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = L::Sum(acc[i][j]);
      // std::fma, not `s += x * w`: whether the compiler fuses a written multiply-add
      // depends on how it vectorises each instantiation, and the float32-panel and direct
      // 8-bit tiles must round the tail alike (batch invariance).
      for (int64_t t = k; t < K; ++t) s = std::fma(x[i * K + t], ToFloat(w[j * K + t]), s);
      y[i * N + j] = scale ? s * scale[j] : s;
    }
}

// out[0 .. count) = w[0 .. count) widened to float32 (exactly: every format fits).
template <typename V, typename W, typename L = Lanes<V>>
__attribute__((always_inline)) inline void WidenRowsOf(const W* __restrict w, float* __restrict out, int64_t count) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    const V v = L::Load(w + i);
    std::memcpy(out + i, &v, sizeof v);
  }
  for (; i < count; ++i) out[i] = ToFloat(w[i]);
}

// One block's 8-bit values (int8, or fp8 e4m3fn) of type T times its scale: `d` for the low
// sixteen, `d_high` for the high sixteen (the same value where a block has one scale).
template <typename V, typename T>
__attribute__((always_inline)) inline void ScaledBlock(const T* __restrict values, float d, float d_high,
                                                       V* __restrict out) {
  constexpr int kLanes = sizeof(V) / sizeof(float), kVectors = raylm::kGgufBlock / kLanes;
  for (int v = 0; v < kVectors; ++v) out[v] = Lanes<V>::Load(values + v * kLanes) * (v < kVectors / 2 ? d : d_high);
}

// Up to a tile's MR input rows against NR GGUF block rows, the weights widened in registers
// (no panel): with one row tile the panel's store and reload were a quarter of the work. The
// same sums as TileOf<V, R, NR> on the widened rows: lanes over k in order (a block's vectors
// low nibbles first, as GGUF orders them), then Sum or SumTile. `prefetch_next`: fetch the
// next NR rows meanwhile. kStoresPanel: also store the widened rows in `panel` (NR * K floats,
// as WidenGgufRowsOf lays them out) for the call's other row tiles. kSplit: the blocks have a
// scale (and offset) per 16 weights (w.group == 16), the low sixteen's and the high sixteen's.
// kTwoLevel: int8 scales times the super-block's (w.supers).
template <typename V, int R, int NR, bool kSplit, bool kTwoLevel, bool kStoresPanel = false>
__attribute__((always_inline)) inline void GgufTileOf(const float* __restrict x, const GgufRows& w, int64_t n,
                                                      float* __restrict y, int64_t K, int64_t N, bool prefetch_next,
                                                      float* __restrict panel = nullptr) {
  constexpr int kLanes = sizeof(V) / sizeof(float), kVectors = raylm::kGgufBlock / kLanes;
  constexpr int kScalesPerBlock = kSplit ? 2 : 1;
  constexpr int64_t kTableBytes = kTwoLevel ? 1 : 4;
  const int64_t blocks = w.RowBlocks(), bytes_per_block = w.RowBytes() / blocks, scales = w.RowScales();
  const char* scale_bytes = static_cast<const char*>(w.scale);
  const char* offset_bytes = static_cast<const char*>(w.offset);
  V acc[R][NR];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = V{};
  for (int64_t b = 0; b < blocks; ++b) {
    // A cache line per row every few blocks, spread over the loop: block rows are too short
    // for the hardware prefetcher, and a burst of prefetches per tile left loads waiting.
    if (prefetch_next) {
      if ((b * bytes_per_block) % 64 < bytes_per_block)
        for (int j = 0; j < NR; ++j) __builtin_prefetch(w.q + (n + NR + j) * w.RowBytes() + b * bytes_per_block);
      if ((b * kScalesPerBlock * kTableBytes) % 64 < kScalesPerBlock * kTableBytes)
        for (int j = 0; j < NR; ++j) {
          const int64_t at = ((n + NR + j) * scales + b * kScalesPerBlock) * kTableBytes;
          __builtin_prefetch(scale_bytes + at);
          if (w.offset) __builtin_prefetch(offset_bytes + at);
        }
    }
    V weights[NR][kVectors];
    for (int j = 0; j < NR; ++j) {
      const int64_t s = (n + j) * scales + b * kScalesPerBlock;
      const float* super = kTwoLevel ? w.Super(n + j, b) : nullptr;
      const uint8_t* q = w.q + (n + j) * w.RowBytes() + b * bytes_per_block;
      const float d = w.Scale<kTwoLevel>(s, super), d_high = kSplit ? w.Scale<kTwoLevel>(s + 1, super) : d;
      if (w.codebook) {
        for (int h = 0; h < kVectors / 2; ++h)
          Lanes<V>::WidenCodes(q + h * kLanes, w.codebook, d, d_high, &weights[j][h], &weights[j][h + kVectors / 2]);
      } else if (w.Nibbles()) {
        const float m = w.Offset<kTwoLevel>(s, super);
        for (int h = 0; h < kVectors / 2; ++h) {
          if constexpr (kSplit) {
            Lanes<V>::WidenNibbles(q + h * kLanes, d, m, d_high, w.Offset<kTwoLevel>(s + 1, super), &weights[j][h],
                                   &weights[j][h + kVectors / 2]);
          } else {
            Lanes<V>::WidenNibbles(q + h * kLanes, d, m, &weights[j][h], &weights[j][h + kVectors / 2]);
          }
        }
      } else if (w.offset) {  // d * q is exact here (gguf_blocks.h): one rounding, fused or not
        const float m = w.Offset<kTwoLevel>(s, super), m_high = kSplit ? w.Offset<kTwoLevel>(s + 1, super) : m;
        for (int v = 0; v < kVectors; ++v)
          weights[j][v] = Lanes<V>::Load(reinterpret_cast<const int8_t*>(q) + v * kLanes) *
                              (v < kVectors / 2 ? d : d_high) + (v < kVectors / 2 ? m : m_high);
      } else if (w.fp8) {  // d * fp8: the one rounding (gguf_blocks.h)
        ScaledBlock<V>(reinterpret_cast<const Fp8E4m3*>(q), d, d_high, weights[j]);
      } else {
        ScaledBlock<V>(reinterpret_cast<const int8_t*>(q), d, d_high, weights[j]);
      }
      if constexpr (kStoresPanel)
        for (int v = 0; v < kVectors; ++v)
          std::memcpy(panel + j * K + raylm::kGgufBlock * b + v * kLanes, &weights[j][v], sizeof(V));
    }
    for (int v = 0; v < kVectors; ++v)
      for (int i = 0; i < R; ++i) {
        const V xv = Lanes<V>::Load(x + i * K + raylm::kGgufBlock * b + v * kLanes);
        for (int j = 0; j < NR; ++j) acc[i][j] += xv * weights[j][v];
      }
  }
  if constexpr (Lanes<V>::kSumsTiles && R == 4 && NR == 4) return Lanes<V>::SumTile(acc, nullptr, y, N);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = Lanes<V>::Sum(acc[i][j]);
}

// Block b of row `row` widened into out[32] (gguf_blocks.h's arithmetic).
template <typename V, bool kTwoLevel>
__attribute__((always_inline)) inline void WidenGgufBlock(const GgufRows& w, int64_t row, int64_t b,
                                                          float* __restrict out) {
  constexpr int kLanes = sizeof(V) / sizeof(float), kVectors = raylm::kGgufBlock / kLanes;
  const int64_t per_block = raylm::kGgufBlock / w.group, split = per_block - 1;  // scales a block: 1 or 2
  const int64_t s = row * w.RowScales() + b * per_block;
  const float* super = kTwoLevel ? w.Super(row, b) : nullptr;
  const uint8_t* q = w.q + row * w.RowBytes() + b * (w.RowBytes() / w.RowBlocks());
  // Each vector is stored as soon as it is widened: gathering a block's vectors in an array
  // and copying it out made GCC pass them through the stack (a store and a reload each).
  if (w.codebook) {
    const float d = w.Scale<kTwoLevel>(s, super), d_high = w.Scale<kTwoLevel>(s + split, super);
    for (int h = 0; h < kVectors / 2; ++h) {
      V low, high;
      Lanes<V>::WidenCodes(q + h * kLanes, w.codebook, d, d_high, &low, &high);
      std::memcpy(out + h * kLanes, &low, sizeof low);
      std::memcpy(out + (h + kVectors / 2) * kLanes, &high, sizeof high);
    }
  } else if (w.Nibbles()) {
    const float d = w.Scale<kTwoLevel>(s, super), m = w.Offset<kTwoLevel>(s, super);
    const float d_high = w.Scale<kTwoLevel>(s + split, super), m_high = w.Offset<kTwoLevel>(s + split, super);
    for (int h = 0; h < kVectors / 2; ++h) {
      V low, high;
      Lanes<V>::WidenNibbles(q + h * kLanes, d, m, d_high, m_high, &low, &high);
      std::memcpy(out + h * kLanes, &low, sizeof low);
      std::memcpy(out + (h + kVectors / 2) * kLanes, &high, sizeof high);
    }
  } else if (w.fp8) {  // no offset (GgufRowsOf): d * fp8, the one rounding
    for (int v = 0; v < kVectors; ++v) {
      const V value = Lanes<V>::Load(reinterpret_cast<const Fp8E4m3*>(q) + v * kLanes) *
                      w.Scale<kTwoLevel>(s + (v < kVectors / 2 ? 0 : split), super);
      std::memcpy(out + v * kLanes, &value, sizeof value);
    }
  } else {
    for (int v = 0; v < kVectors; ++v) {
      const int64_t at = s + (v < kVectors / 2 ? 0 : split);
      V value = Lanes<V>::Load(reinterpret_cast<const int8_t*>(q) + v * kLanes) * w.Scale<kTwoLevel>(at, super);
      if (w.offset) value = value + w.Offset<kTwoLevel>(at, super);  // d * q exact here (gguf_blocks.h)
      std::memcpy(out + v * kLanes, &value, sizeof value);
    }
  }
}

// Block rows [n, n + count) widened into out[count * K] (gguf_blocks.h's arithmetic), for the
// panel; `prefetch_next`: fetch the next `count` rows meanwhile, spread as in GgufTileOf.
template <typename V>
__attribute__((always_inline)) inline void WidenGgufRowsOf(const GgufRows& w, int64_t n, int64_t count,
                                                           float* __restrict out, bool prefetch_next) {
  const int64_t blocks = w.RowBlocks(), bytes_per_block = w.RowBytes() / blocks;
  for (int64_t row = n; row < n + count; ++row)
    for (int64_t b = 0; b < blocks; ++b, out += raylm::kGgufBlock) {
      if (prefetch_next && (b * bytes_per_block) % 64 < bytes_per_block)  // the next rows start `count` rows on
        __builtin_prefetch(w.q + (row + count) * w.RowBytes() + b * bytes_per_block);
      if (w.supers) {
        WidenGgufBlock<V, true>(w, row, b, out);
      } else {
        WidenGgufBlock<V, false>(w, row, b, out);
      }
    }
}

// The eight-lane tiles. MR = 3, NR = 4 measured best of 2x4, 4x3, 2x5, 3x4 and 4x2 on an
// AVX2 dev machine. Multiversioned so the same binary uses AVX-512 / AVX2+FMA where the CPU
// has them.
struct NarrowTiles {
  static constexpr int MR = 3, NR = 4;
  // Whether a call of more than two row tiles of GGUF blocks widens them in its first row tile
  // (GgufPanelTile) rather than in a pass of its own: not here, where an AVX2 clone's sixteen
  // registers cannot hold a tile's accumulators beside its widened weights (unmeasured).
  static constexpr bool kWidensInFirstTile = false;

  template <int R, int C, typename W>
#if defined(__x86_64__) && defined(__GNUC__)
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
  static void Tile(const float* x, const W* w, const float* scale, float* y, int64_t K, int64_t N,
                   const float* ahead) {
    TileOf<Vec8, R, C>(x, w, scale, y, K, N, ahead);
  }

  template <typename W>
#if defined(__x86_64__) && defined(__GNUC__)
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
  static void WidenRows(const W* w, float* out, int64_t count) {
    WidenRowsOf<Vec8>(w, out, count);
  }

  template <int R, int NR, bool kSplit, bool kTwoLevel>
#if defined(__x86_64__) && defined(__GNUC__)
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
  static void GgufTile(const float* x, const GgufRows& w, int64_t n, float* y, int64_t K, int64_t N,
                       bool prefetch_next) {
    GgufTileOf<Vec8, R, NR, kSplit, kTwoLevel>(x, w, n, y, K, N, prefetch_next);
  }

#if defined(__x86_64__) && defined(__GNUC__)
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
  static void WidenGgufRows(const GgufRows& w, int64_t n, int64_t count, float* out, bool prefetch_next) {
    WidenGgufRowsOf<Vec8>(w, n, count, out, prefetch_next);
  }
};

#if defined(__x86_64__) && defined(__GNUC__)
// The eight-lane tiles for float16 weights on CPUs with x86-64-v3 (AVX2, FMA, F16C): the same
// sums as NarrowTiles (whose v3 and v4 clones such a CPU runs, both contracting the same
// multiply-adds), the weights widened by F16C's vcvtph2ps where NarrowTiles' clones, compiled
// for the default target too, use bit arithmetic (float16.h; 0.6-0.8x the float32 kernel at
// 1-16 rows). Picked by Columns and the prompt GEMM (UseF16cTiles).
#define RAYLM_F16C_TILES 1
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
struct F16cLanes : Lanes<Vec8> {
  using Lanes<Vec8>::Load;
  static Vec8 Load(const Fp16* p) {
    return reinterpret_cast<Vec8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

struct NarrowF16cTiles {
  static constexpr int MR = NarrowTiles::MR, NR = NarrowTiles::NR;

  template <int R, int C, typename W>
  static void Tile(const float* x, const W* w, const float* scale, float* y, int64_t K, int64_t N,
                   const float* ahead) {
    TileOf<Vec8, R, C, W, F16cLanes>(x, w, scale, y, K, N, ahead);
  }

  template <typename W>
  static void WidenRows(const W* w, float* out, int64_t count) {
    WidenRowsOf<Vec8, W, F16cLanes>(w, out, count);
  }
};
#pragma GCC pop_options

// Whether float16 weights take NarrowF16cTiles when the eight-lane family runs: the CPU runs
// NarrowTiles' x86-64-v3 or v4 clone. Decided once.
inline bool UseF16cTiles() {
  static const bool v3 = __builtin_cpu_supports("x86-64-v3");
  return v3;
}
#endif

#ifdef RAYLM_WIDE_TILES
// Sixteen-lane tiles for CPUs with AVX-512 (x86-64-v4). The eight-lane clone uses half of
// such a CPU's vector width, and XLA's own GEMM overtook it from 8-12 rows; these tiles are
// 1.4x faster at 16 rows and stay ahead of XLA to 32 (model/kernels/dense.py). The tile is 4 x 4
// (4x4, 6x4, 4x6, 8x3, 3x8, 5x5, 2x8 and 8x2 measured within noise of each other on a 2-core
// AMD EPYC).
//
// Lanes are summed by a halving tree (i + i+8, then i + i+4, i + i+2, i + i+1). A row's
// result still does not depend on the batch, but it differs in the last bits from the
// eight-lane tiles, so a process uses one family for every call (see UseWideTiles).
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
// GCC 12's false positives in the AVX-512 intrinsics, as in dense_lanes.h.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
struct WideTiles {
  static constexpr int MR = 4, NR = 4;
  static constexpr bool kWidensInFirstTile = true;  // see NarrowTiles

  template <int R, int C, typename W>
  static void Tile(const float* x, const W* w, const float* scale, float* y, int64_t K, int64_t N,
                   const float* ahead) {
    TileOf<Vec16, R, C>(x, w, scale, y, K, N, ahead);
  }

  template <typename W>
  static void WidenRows(const W* w, float* out, int64_t count) {
    WidenRowsOf<Vec16>(w, out, count);
  }

  template <int R, int NR, bool kSplit, bool kTwoLevel>
  static void GgufTile(const float* x, const GgufRows& w, int64_t n, float* y, int64_t K, int64_t N,
                       bool prefetch_next) {
    GgufTileOf<Vec16, R, NR, kSplit, kTwoLevel>(x, w, n, y, K, N, prefetch_next);
  }

  // A full row tile against NR block rows that also leaves the widened rows in `panel`.
  template <bool kSplit, bool kTwoLevel>
  static void GgufPanelTile(const float* x, const GgufRows& w, int64_t n, float* y, int64_t K, int64_t N,
                            bool prefetch_next, float* panel) {
    GgufTileOf<Vec16, MR, NR, kSplit, kTwoLevel, true>(x, w, n, y, K, N, prefetch_next, panel);
  }

  static void WidenGgufRows(const GgufRows& w, int64_t n, int64_t count, float* out, bool prefetch_next) {
    WidenGgufRowsOf<Vec16>(w, n, count, out, prefetch_next);
  }
};

#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

// Whether this process runs the sixteen-lane tiles: the CPU has x86-64-v4's AVX-512 subsets
// and RAYLM_DENSE_NARROW_TILES is unset (wide_lanes.h). Decided once, so every call of a
// process sums alike.
inline bool UseWideTiles() { return raylm::UseWideLanes<raylm::LaneFamily::kDenseTiles>(); }

constexpr int kMaxWeightRowsPerTile = 4;  // NR of either family, for the panel

// The last `rows` (< MR) input rows against NR weight rows, as one tile: each weight vector is
// loaded once for all of them, not once per row.
template <typename Tiles, int NR, typename W>
void RemainderRows(int64_t rows, const float* x, const W* w, const float* scale, float* y, int64_t K, int64_t N,
                   const float* ahead) {
  static_assert(Tiles::MR <= 4, "remainders of up to three rows");
  switch (rows) {
    case 3: if constexpr (Tiles::MR > 3) return Tiles::template Tile<3, NR>(x, w, scale, y, K, N, ahead);
            break;
    case 2: return Tiles::template Tile<2, NR>(x, w, scale, y, K, N, ahead);
    case 1: return Tiles::template Tile<1, NR>(x, w, scale, y, K, N, ahead);
  }
}

}  // namespace

#endif  // RAYLM_DENSE_TILES_H_
