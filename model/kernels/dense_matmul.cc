// Small-batch dense matmul for CPU, an XLA FFI custom call (see model/dense.py).
//
// Why a kernel: a decode step multiplies a few rows (1..32 sequences) by every weight
// matrix. XLA's CPU dot runs these shapes at a third to a half of what the two cores can
// do (its GEMM packs and blocks for large matrices; one row takes a separate GEMV path
// and two rows already cost three times one). Here the weight is read as stored, each
// output row's K inputs contiguous ([N, K], the layout model/params.py keeps), so weights
// stream from memory once in order while the few activation rows stay in cache; a tile of
// MR activation rows x NR weight rows keeps MR*NR float32 vector accumulators in registers,
// and the first row tile prefetches the next weight rows, so memory keeps streaming while
// the other row tiles compute.
//
// Operands: x [M, K] f32, w [N, K] f32. Result: y [M, N] f32, y = x . w^T.
// Quantized weights (model/quantization.py): w [N, K] int8 or float8 e4m3fn with one f32
// scale per output row, y = (x . w^T) * scale. The kernel reads the 8-bit weights and widens
// them in registers (never an f32 copy of the matrix): at one to a few rows a step is bound
// by reading weights, so a quarter of the bytes is most of the speed-up.
//
// GGUF block weights (model/gguf_blocks.py): llama.cpp's Q4_0 / Q4_1 / Q8_0 matrices kept as
// stored, 32 weights per block along k with a float32 scale (and offset) per block, widened
// with exactly the arithmetic of the gguf package's dequantization (gguf_blocks.h). With up to
// one row tile of inputs the widened weights stay in registers (GgufTile); with more, each
// tile of weight rows is widened once into an L1 panel that every row tile then reads. Either
// way the sums are the float32 tiles' on the dequantized matrix, bit for bit, from a fifth of
// the bytes.
//
// Calls of many rows (prompt chunks) run the same tiles through a loop nest blocked for the
// caches, each weight panel widened once per call (prompt_gemm.inc); model/dense.py picks it
// above KERNEL_MAX_ROWS rows.
//
// Every output element is summed in the same order whatever M, the tile it falls in or the
// thread that computes it (lanes over k, then the lanes in a fixed order, then the k tail), so
// a row's result does not depend on what else is in the batch. There are two tile families,
// eight lanes (AVX2 and older) and sixteen (AVX-512); a process runs one of them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "bfloat16.h"
#include "column_items.h"
#include "fp8_e4m3.h"
#include "gguf_blocks.h"
#include "lane_loads.h"
#include "wide_lanes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using raylm::Bf16;
using raylm::Fp8E4m3;
using raylm::GgufRows;
using raylm::kPromptItemsPerThread;
using raylm::Run;

namespace {

using Matrix = ffi::Buffer<ffi::F32, 2>;  // aliases: the binding macro cannot take commas
using Scales = ffi::Buffer<ffi::F32, 1>;

inline float Widen(float w) { return w; }
inline float Widen(int8_t w) { return static_cast<float>(w); }
inline float Widen(Fp8E4m3 w) { return raylm::Fp8ToFloat(w); }
inline float Widen(Bf16 w) { return raylm::Bf16ToFloat(w); }

// float8 e4m3fn bytes to float32 on every lane of a vector whose 32-bit lanes hold one byte
// each at their top (`top`, unsigned lanes): raylm::Fp8ToFloat (fp8_e4m3.h) lane-wise. Both
// lane widths below place the bytes, then share these steps.
template <typename V, typename U>
__attribute__((always_inline)) inline V Fp8FromLaneTops(U top) {
  const U sign = top & 0x80000000u, exponent_mantissa = (top >> 4) & 0x07F00000u;
  const U bias = U{} + (120u << 23);
  const V value = reinterpret_cast<V>((sign | exponent_mantissa) + bias);
  const V subnormal = (value - reinterpret_cast<V>(sign | bias)) * 2.0f;
  return (exponent_mantissa & 0x07800000u) == 0 ? subnormal : value;
}

// Vector lanes: Lanes<V> loads float32 and 8-bit values into a V of float32 lanes (8-bit
// values widened exactly) and sums a V's lanes in its fixed order. Two specialisations: eight
// lanes (AVX2; the tiles below are cloned for AVX-512, AVX2 and SSE) and, on x86-64 with GCC,
// sixteen lanes (AVX-512 only, Lanes<Vec16> below).
template <typename V>
struct Lanes;

using raylm::Vec8;

template <>
struct Lanes<Vec8> {
  // float32, int8 and bfloat16 (LoRA slots, lora_delta.cc) as lane_loads.h widens them; 8-bit
  // floats and 4-bit blocks from the same bytes at the lanes' tops.
  using Loads = raylm::LaneLoad<Vec8>;
  using I32x8 = Loads::I32x8;
  using U32x8 = Loads::U32x8;

  static Vec8 Load(const float* p) { return Loads::From(p); }
  static Vec8 Load(const int8_t* p) { return Loads::From(p); }
  static Vec8 Load(const Bf16* p) { return Loads::From(p); }
  static I32x8 BytesAtLaneTops(const void* p) { return Loads::BytesAtLaneTops(p); }

  static Vec8 Load(const Fp8E4m3* p) {
    return Fp8FromLaneTops<Vec8>(reinterpret_cast<U32x8>(BytesAtLaneTops(p)));
  }

  // The eight bytes at p as 4-bit values: their low halves and their high halves.
  static void LoadNibbles(const uint8_t* p, Vec8* low, Vec8* high) {
    const U32x8 tops = reinterpret_cast<U32x8>(BytesAtLaneTops(p));
    *low = __builtin_convertvector(reinterpret_cast<I32x8>((tops >> 24) & 0x0Fu), Vec8);
    *high = __builtin_convertvector(reinterpret_cast<I32x8>(tops >> 28), Vec8);
  }

  // The same values as weights d * q + m (a 4-bit block's, gguf_blocks.h).
  static void WidenNibbles(const uint8_t* p, float d, float m, Vec8* low, Vec8* high) {
    LoadNibbles(p, low, high);
    *low = d * *low + m;  // exact with or without a fused multiply-add
    *high = d * *high + m;
  }

  static float Sum(Vec8 v) {  // in lane order
    float s = 0.0f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
  }

  static constexpr bool kSumsTiles = false;  // see Lanes<Vec16>::SumTile
};

// y[i, j] = x[i, :] . w[j, :] for i < MR, j < NR: MR*NR vector accumulators, NR weight vectors
// and one input vector per step. Each element is summed over V's lanes along k, then the
// lanes in Lanes<V>::Sum's order, then the k tail. `ahead` (or null): NR weight rows to
// prefetch, one cache line per row every 16 floats, while this tile computes.
template <typename V, int MR, int NR, typename W>
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
    }
    if (ahead && k % 16 == 0)
      for (int j = 0; j < NR; ++j) __builtin_prefetch(ahead + j * K + k);
    V wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Lanes<V>::Load(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const V xv = Lanes<V>::Load(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  if constexpr (Lanes<V>::kSumsTiles && MR == 4 && NR == 4) {
    if (k == K) return Lanes<V>::SumTile(acc, scale, y, N);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = Lanes<V>::Sum(acc[i][j]);
      // std::fma, not `s += x * w`: whether the compiler fuses a written multiply-add
      // depends on how it vectorises each instantiation, and the float32-panel and direct
      // 8-bit tiles must round the tail alike (batch invariance).
      for (int64_t t = k; t < K; ++t) s = std::fma(x[i * K + t], Widen(w[j * K + t]), s);
      y[i * N + j] = scale ? s * scale[j] : s;
    }
}

// out[0 .. count) = w[0 .. count) widened to float32 (exactly: both formats fit).
template <typename V, typename W>
__attribute__((always_inline)) inline void WidenRowsOf(const W* __restrict w, float* __restrict out, int64_t count) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    const V v = Lanes<V>::Load(w + i);
    std::memcpy(out + i, &v, sizeof v);
  }
  for (; i < count; ++i) out[i] = Widen(w[i]);
}

// Up to a tile's MR input rows against NR GGUF block rows, the weights widened in registers
// (no panel): with one row tile the panel's store and reload were a quarter of the work. The
// same sums as TileOf<V, R, NR> on the widened rows: lanes over k in order (a block's vectors
// low nibbles first, as GGUF orders them), then Sum or SumTile. `prefetch_next`: fetch the
// next NR rows meanwhile. kStoresPanel: also store the widened rows in `panel` (NR * K floats,
// as WidenGgufRowsOf lays them out) for the call's other row tiles.
template <typename V, int R, int NR, bool kStoresPanel = false>
__attribute__((always_inline)) inline void GgufTileOf(const float* __restrict x, const GgufRows& w, int64_t n,
                                                      float* __restrict y, int64_t K, int64_t N, bool prefetch_next,
                                                      float* __restrict panel = nullptr) {
  constexpr int kLanes = sizeof(V) / sizeof(float), kVectors = raylm::kGgufBlock / kLanes;
  const int64_t blocks = w.RowBlocks(), bytes_per_block = w.RowBytes() / blocks;
  V acc[R][NR];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = V{};
  for (int64_t b = 0; b < blocks; ++b) {
    // A cache line per row every few blocks, spread over the loop: block rows are too short
    // for the hardware prefetcher, and a burst of prefetches per tile left loads waiting.
    if (prefetch_next) {
      if ((b * bytes_per_block) % 64 < bytes_per_block)
        for (int j = 0; j < NR; ++j) __builtin_prefetch(w.q + (n + NR + j) * w.RowBytes() + b * bytes_per_block);
      if (b % 16 == 0)
        for (int j = 0; j < NR; ++j) {
          __builtin_prefetch(w.scale + (n + NR + j) * blocks + b);
          if (w.offset) __builtin_prefetch(w.offset + (n + NR + j) * blocks + b);
        }
    }
    V weights[NR][kVectors];
    for (int j = 0; j < NR; ++j) {
      const int64_t block = (n + j) * blocks + b;
      const uint8_t* q = w.q + (n + j) * w.RowBytes() + b * bytes_per_block;
      const float d = w.scale[block];
      if (w.Nibbles()) {
        const float m = w.offset[block];
        for (int h = 0; h < kVectors / 2; ++h)
          Lanes<V>::WidenNibbles(q + h * kLanes, d, m, &weights[j][h], &weights[j][h + kVectors / 2]);
      } else {
        for (int v = 0; v < kVectors; ++v)
          weights[j][v] = Lanes<V>::Load(reinterpret_cast<const int8_t*>(q) + v * kLanes) * d;
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

// Block rows [n, n + count) widened into out[count * K] (gguf_blocks.h's arithmetic), for the
// panel; `prefetch_next`: fetch the next `count` rows meanwhile, spread as in GgufTileOf.
template <typename V>
__attribute__((always_inline)) inline void WidenGgufRowsOf(const GgufRows& w, int64_t n, int64_t count,
                                                           float* __restrict out, bool prefetch_next) {
  constexpr int kLanes = sizeof(V) / sizeof(float), kVectors = raylm::kGgufBlock / kLanes;
  const int64_t blocks = count * w.RowBlocks(), bytes_per_block = w.RowBytes() / w.RowBlocks();
  const uint8_t* q = w.q + n * w.RowBytes();
  const float* scale = w.scale + n * w.RowBlocks();
  const float* offset = w.offset ? w.offset + n * w.RowBlocks() : nullptr;
  for (int64_t b = 0; b < blocks; ++b, q += bytes_per_block, out += raylm::kGgufBlock) {
    if (prefetch_next) {  // the next rows start `count` rows on
      if ((b * bytes_per_block) % 64 < bytes_per_block) __builtin_prefetch(q + count * w.RowBytes());
      if (b % 16 == 0) {
        __builtin_prefetch(scale + b + blocks);
        if (offset) __builtin_prefetch(offset + b + blocks);
      }
    }
    // Each vector is stored as soon as it is widened: gathering a block's vectors in an array
    // and copying it out made GCC pass them through the stack (a store and a reload each).
    if (offset) {
      for (int h = 0; h < kVectors / 2; ++h) {
        V low, high;
        Lanes<V>::WidenNibbles(q + h * kLanes, scale[b], offset[b], &low, &high);
        std::memcpy(out + h * kLanes, &low, sizeof low);
        std::memcpy(out + (h + kVectors / 2) * kLanes, &high, sizeof high);
      }
    } else {
      for (int v = 0; v < kVectors; ++v) {
        const V value = Lanes<V>::Load(reinterpret_cast<const int8_t*>(q) + v * kLanes) * scale[b];
        std::memcpy(out + v * kLanes, &value, sizeof value);
      }
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

  template <int R, int NR>
#if defined(__x86_64__) && defined(__GNUC__)
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
  static void GgufTile(const float* x, const GgufRows& w, int64_t n, float* y, int64_t K, int64_t N,
                       bool prefetch_next) {
    GgufTileOf<Vec8, R, NR>(x, w, n, y, K, N, prefetch_next);
  }

#if defined(__x86_64__) && defined(__GNUC__)
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
  static void WidenGgufRows(const GgufRows& w, int64_t n, int64_t count, float* out, bool prefetch_next) {
    WidenGgufRowsOf<Vec8>(w, n, count, out, prefetch_next);
  }
};

#if defined(__x86_64__) && defined(__GNUC__)
#define RAYLM_WIDE_TILES 1
// Sixteen-lane tiles for CPUs with AVX-512 (x86-64-v4). The eight-lane clone uses half of
// such a CPU's vector width, and XLA's own GEMM overtook it from 8-12 rows; these tiles are
// 1.4x faster at 16 rows and stay ahead of XLA to 32 (model/dense.py). The tile is 4 x 4
// (4x4, 6x4, 4x6, 8x3, 3x8, 5x5, 2x8 and 8x2 measured within noise of each other on a 2-core
// AMD EPYC).
//
// Lanes are summed by a halving tree (i + i+8, then i + i+4, i + i+2, i + i+1). A row's
// result still does not depend on the batch, but it differs in the last bits from the
// eight-lane tiles, so a process uses one family for every call (see UseWideTiles).
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
// GCC 12 reports its own _mm512_undefined_* placeholders inside these intrinsics as
// (maybe-)uninitialized (a known false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

using raylm::Vec16;

template <>
struct Lanes<Vec16> {
  typedef float Vec4 __attribute__((vector_size(16)));
  typedef uint32_t U32x16 __attribute__((vector_size(64)));

  // float32, int8 and bfloat16 as lane_loads.h widens them (intrinsics), 8-bit floats here.
  static Vec16 Load(const float* p) { return raylm::LaneLoad<Vec16>::From(p); }
  static Vec16 Load(const int8_t* p) { return raylm::LaneLoad<Vec16>::From(p); }
  static Vec16 Load(const Bf16* p) { return raylm::LaneLoad<Vec16>::From(p); }

  static Vec16 Load(const Fp8E4m3* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return Fp8FromLaneTops<Vec16>(reinterpret_cast<U32x16>(_mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), 24)));
  }

  // The sixteen bytes at p as a 4-bit block's weights d * q + m: the block's sixteen values
  // d * q + m are one vector (a table, by one multiply-add), and each weight is a lookup in it
  // (vpermps reads only an index's low four bits, so the low halves need no mask). Per sixteen
  // weights a permute replaces a conversion and a multiply-add: the one-row decode step's
  // widening, most of its arithmetic (1-2 rows 6-9% faster). The same values as the eight-lane
  // d * q + m: d * q is exact, so the multiply-add rounds once either way.
  static void WidenNibbles(const uint8_t* p, float d, float m, Vec16* low, Vec16* high) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d), q, _mm512_set1_ps(m));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    *low = reinterpret_cast<Vec16>(_mm512_permutexvar_ps(bytes, table));
    *high = reinterpret_cast<Vec16>(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table));
  }

  static float Sum(Vec16 v) {
    const Vec8 half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const Vec4 quarter =
        __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
  }

  // Sum of a whole 4 x 4 tile, y[i * N + j] = Sum(acc[i][j]) (times scale[j]), with the same
  // additions as Sum but sixteen accumulators at a time: each level adds two shuffled vectors
  // holding that level's halves of several accumulators. 30 shuffles and 15 additions instead
  // of ~9 instructions per accumulator; at K = 576 the lane sums had been ~20% of a tile.
  static constexpr bool kSumsTiles = true;
  static void SumTile(const Vec16 (&acc)[4][4], const float* scale, float* y, int64_t N) {
    // A column's four accumulators end in lane j of each quarter: Q[j] quarter i is acc[i][j].
    __m512 q[4];
    for (int j = 0; j < 4; ++j) {
      __m512 h[2];  // h[p] = [acc[2p][j] halves added, acc[2p+1][j] halves added]
      for (int p = 0; p < 2; ++p) {
        const __m512 a = reinterpret_cast<__m512>(acc[2 * p][j]), b = reinterpret_cast<__m512>(acc[2 * p + 1][j]);
        h[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
      }
      q[j] = _mm512_add_ps(_mm512_shuffle_f32x4(h[0], h[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(h[0], h[1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    // Quarter i of r[0]: accumulators acc[i][0], acc[i][1] as (q0 + q2, q1 + q3) each.
    const __m512 r0 = _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 r1 = _mm512_add_ps(_mm512_shuffle_ps(q[2], q[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(q[2], q[3], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(r0, r1, _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_ps(r0, r1, _MM_SHUFFLE(3, 1, 3, 1)));  // lane 4i + j
    if (scale) sums = _mm512_mul_ps(sums, _mm512_broadcast_f32x4(_mm_loadu_ps(scale)));
    _mm_storeu_ps(y, _mm512_extractf32x4_ps(sums, 0));
    _mm_storeu_ps(y + N, _mm512_extractf32x4_ps(sums, 1));
    _mm_storeu_ps(y + 2 * N, _mm512_extractf32x4_ps(sums, 2));
    _mm_storeu_ps(y + 3 * N, _mm512_extractf32x4_ps(sums, 3));
  }
};

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

  template <int R, int NR>
  static void GgufTile(const float* x, const GgufRows& w, int64_t n, float* y, int64_t K, int64_t N,
                       bool prefetch_next) {
    GgufTileOf<Vec16, R, NR>(x, w, n, y, K, N, prefetch_next);
  }

  // A full row tile against NR block rows that also leaves the widened rows in `panel`.
  static void GgufPanelTile(const float* x, const GgufRows& w, int64_t n, float* y, int64_t K, int64_t N,
                            bool prefetch_next, float* panel) {
    GgufTileOf<Vec16, MR, NR, true>(x, w, n, y, K, N, prefetch_next, panel);
  }

  static void WidenGgufRows(const GgufRows& w, int64_t n, int64_t count, float* out, bool prefetch_next) {
    WidenGgufRowsOf<Vec16>(w, n, count, out, prefetch_next);
  }
};

#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

// Whether this process runs the sixteen-lane tiles: the CPU has x86-64-v4's AVX-512 subsets
// and RAYLM_DENSE_NARROW_TILES is unset (tests set it to check the eight-lane family on
// AVX-512 machines too). Decided once, so every call of a process sums alike.
bool UseWideTiles() {
#ifdef RAYLM_WIDE_TILES
  static const bool wide = raylm::CpuRunsWideLanes("RAYLM_DENSE_NARROW_TILES");
  return wide;
#else
  return false;
#endif
}

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

// Whether Columns widens a tile of weight rows of type W once into an L1 panel for calls of
// more than one row tile, rather than in registers in every row tile. Only fp8 does: its
// widening takes several operations a vector, and the panel made 16-64-row calls 1.4-2x
// faster. int8's takes two, and the panel's store and reload cost more than widening again:
// the bundled model's 120 int8 projections ran 2.2x faster at 8 rows and 1.1-1.6x at 16-64
// in registers (2-core AMD EPYC; eight-lane tiles 1.0-1.2x).
template <typename W>
constexpr bool kWidensThroughPanel = std::is_same_v<W, Fp8E4m3>;

// Output columns [n_begin, n_end) for all M rows. `scale` is null for float32 weights.
// fp8 weights feeding more than one row tile are widened once per tile of weight rows into
// `panel` (NR * K floats, L1-resident), which every row tile then reads (kWidensThroughPanel).
// The widened values are exact, so a row's sums are the same on either path (the
// batch-invariance the engine relies on).
template <typename Tiles, typename W>
void Columns(const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
             int64_t n_begin, int64_t n_end, float* panel) {
  constexpr int MR = Tiles::MR, NR = Tiles::NR;
  static_assert(NR <= kMaxWeightRowsPerTile, "the panel holds kMaxWeightRowsPerTile rows");
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) {  // NR weight rows stay in L1 while every input row passes
    int64_t m = 0;
    const float* s = scale ? scale + n : nullptr;
    if (kWidensThroughPanel<W> && M > MR) {
      Tiles::WidenRows(w + n * K, panel, NR * K);
      for (; m + MR <= M; m += MR) Tiles::template Tile<MR, NR>(x + m * K, panel, s, y + m * N + n, K, N, nullptr);
      RemainderRows<Tiles, NR>(M - m, x + m * K, panel, s, y + m * N + n, K, N, nullptr);
      continue;
    }
    // With more than one row, the first row tile also prefetches the next NR float32 weight
    // rows, one cache line per row and step: the hardware prefetcher alone left memory idle
    // while the other row tiles computed (8 and 16 rows 1.15-1.3x faster on either family).
    // At one row it made calls slower (1.1x). 8-bit rows prefetch themselves in the tile.
    const float* ahead = nullptr;
    if constexpr (sizeof(W) == 4)
      if (M > 1 && n + 2 * NR <= n_end) ahead = reinterpret_cast<const float*>(w + (n + NR) * K);
    for (; m + MR <= M; m += MR, ahead = nullptr)
      Tiles::template Tile<MR, NR>(x + m * K, w + n * K, s, y + m * N + n, K, N, ahead);
    RemainderRows<Tiles, NR>(M - m, x + m * K, w + n * K, s, y + m * N + n, K, N, ahead);
  }
  for (; n < n_end; ++n)
    for (int64_t m = 0; m < M; ++m)
      Tiles::template Tile<1, 1>(x + m * K, w + n * K, scale ? scale + n : nullptr, y + m * N + n, K, N, nullptr);
}

template <typename W>
void Columns(const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
             int64_t n_begin, int64_t n_end, float* panel) {
#ifdef RAYLM_WIDE_TILES
  if (UseWideTiles()) return Columns<WideTiles>(x, w, scale, y, M, N, K, n_begin, n_end, panel);
#endif
  Columns<NarrowTiles>(x, w, scale, y, M, N, K, n_begin, n_end, panel);
}


// One row tile (M <= 4 input rows) against NR block rows widened in registers.
template <typename Tiles, int NR>
void DirectGgufTile(int64_t M, const float* x, const GgufRows& w, int64_t n, float* y, int64_t K, int64_t N,
                    bool prefetch_next) {
  static_assert(Tiles::MR <= 4, "row tiles of up to four rows");
  switch (M) {
    case 4: if constexpr (Tiles::MR >= 4) return Tiles::template GgufTile<4, NR>(x, w, n, y, K, N, prefetch_next);
            break;
    case 3: return Tiles::template GgufTile<3, NR>(x, w, n, y, K, N, prefetch_next);
    case 2: return Tiles::template GgufTile<2, NR>(x, w, n, y, K, N, prefetch_next);
    case 1: return Tiles::template GgufTile<1, NR>(x, w, n, y, K, N, prefetch_next);
  }
}

// Columns for GGUF block weights: up to two row tiles widen the blocks in registers; more widen
// every tile of weight rows into `panel` once (exact, see gguf_blocks.h), and the float32 tiles
// run on it exactly as on a float32 matrix. Either way each output is the float32 kernel's sum
// over the dequantized weights, whatever M.
template <typename Tiles>
void GgufColumns(const float* x, const GgufRows& w, float* y, int64_t M, int64_t N, int64_t K, int64_t n_begin,
                 int64_t n_end, float* panel) {
  constexpr int MR = Tiles::MR, NR = Tiles::NR;
  static_assert(NR <= kMaxWeightRowsPerTile, "the panel holds kMaxWeightRowsPerTile rows");
  int64_t n = n_begin;
  if (M <= 2 * MR) {
    // Up to two row tiles widen the blocks in registers, the second reading what the first
    // just brought into L1. Through the panel below, 5-7 rows had cost more than 8 (the
    // bundled model's projections, 2-core AVX-512: 4 rows 5.7 ms, 5/6/7/8 rows
    // 9.6/11.6/13.1/10.6 ms, now 7.4/8.0/8.4/8.9 ms). From 9 rows a third and fourth
    // direct tile measured no faster than the panel.
    for (; n + NR <= n_end; n += NR)
      for (int64_t m = 0; m < M; m += MR)
        DirectGgufTile<Tiles, NR>(std::min<int64_t>(M - m, MR), x + m * K, w, n, y + m * N + n, K, N,
                                  m == 0 && n + 2 * NR <= n_end);
    for (; n < n_end; ++n)
      for (int64_t m = 0; m < M; m += MR)
        DirectGgufTile<Tiles, 1>(std::min<int64_t>(M - m, MR), x + m * K, w, n, y + m * N + n, K, N, false);
    return;
  }
  for (; n + NR <= n_end; n += NR) {
    int64_t m = 0;
    if constexpr (Tiles::kWidensInFirstTile) {
      // The first row tile widens the blocks in registers and leaves them in the panel for
      // the others, its multiply-adds beside the widening: a pass of its own had been a
      // quarter of a 16-row call's samples (2-core AMD EPYC, AVX-512).
      Tiles::GgufPanelTile(x, w, n, y + n, K, N, n + 2 * NR <= n_end, panel);
      m = MR;
    } else {
      Tiles::WidenGgufRows(w, n, NR, panel, n + 2 * NR <= n_end);
    }
    for (; m + MR <= M; m += MR) Tiles::template Tile<MR, NR>(x + m * K, panel, nullptr, y + m * N + n, K, N, nullptr);
    RemainderRows<Tiles, NR>(M - m, x + m * K, panel, nullptr, y + m * N + n, K, N, nullptr);
  }
  for (; n < n_end; ++n) {
    Tiles::WidenGgufRows(w, n, 1, panel, false);
    for (int64_t m = 0; m < M; ++m)
      Tiles::template Tile<1, 1>(x + m * K, panel, nullptr, y + m * N + n, K, N, nullptr);
  }
}

void GgufColumns(const float* x, const GgufRows& w, float* y, int64_t M, int64_t N, int64_t K, int64_t n_begin,
                 int64_t n_end, float* panel) {
#ifdef RAYLM_WIDE_TILES
  if (UseWideTiles()) return GgufColumns<WideTiles>(x, w, y, M, N, K, n_begin, n_end, panel);
#endif
  GgufColumns<NarrowTiles>(x, w, y, M, N, K, n_begin, n_end, panel);
}

template <typename W>
void RunDense(const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
              ffi::ThreadPool& pool) {
  const int64_t panel_floats = kWidensThroughPanel<W> && M > 1 ? kMaxWeightRowsPerTile * K : 0;
  Run(N, K, panel_floats,
      [=](int64_t n_begin, int64_t n_end, float* panel) { Columns(x, w, scale, y, M, N, K, n_begin, n_end, panel); },
      pool);
}

#include "prompt_gemm.inc"

// Which loop nest a handler runs: the small-batch one above (decode steps) or the prompt GEMM
// (prompt_gemm.inc). model/dense.py picks by the call's rows; both give every row the same sums.
enum class Nest { kSmallBatch, kPrompt };

// Checks x [M, K], w [N, K], scale [N] (when given) and y [M, N] agree; an empty message
// when they do.
std::string ShapeError(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, const int64_t* scale_n,
                       ffi::Span<const int64_t> yd) {
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] == K && yd[0] == M && yd[1] == N && (!scale_n || *scale_n == N)) return "";
  return "dense_matmul: x [M, K] . w [N, K]^T (* scale [N]) -> y [M, N]; got x [" + std::to_string(M) +
         ", " + std::to_string(K) + "], w [" + std::to_string(N) + ", " + std::to_string(wd[1]) + "], " +
         (scale_n ? "scale [" + std::to_string(*scale_n) + "], " : "") + "y [" + std::to_string(yd[0]) +
         ", " + std::to_string(yd[1]) + "]";
}

// y = x . w^T (* scale) for float32 or 8-bit weights by the loop nest `kNest`.
template <Nest kNest, typename W>
void RunMatmul(const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
               ffi::ThreadPool& pool) {
  if constexpr (kNest == Nest::kPrompt) {
    RunPromptGemm(x, w, scale, y, M, N, K, pool);
  } else {
    RunDense(x, w, scale, y, M, N, K, pool);
  }
}

template <Nest kNest>
ffi::Error DenseMatmul(ffi::ThreadPool thread_pool, Matrix x, Matrix w, ffi::Result<Matrix> y) {
  const std::string error = ShapeError(x.dimensions(), w.dimensions(), nullptr, y->dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (M > 0 && N > 0) RunMatmul<kNest>(x.typed_data(), w.typed_data(), nullptr, y->typed_data(), M, N, K, thread_pool);
  return ffi::Error::Success();
}

// 8-bit weights (int8 or float8 e4m3fn, told apart by the buffer's type) with a scale per
// output row: y = (x . w^T) * scale.
template <Nest kNest>
ffi::Error QuantizedMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer w, Scales scale,
                           ffi::Result<Matrix> y) {
  if (w.dimensions().size() != 2) return ffi::Error::InvalidArgument("dense_matmul: w must be [N, K]");
  const int64_t scale_n = scale.dimensions()[0];
  const std::string error = ShapeError(x.dimensions(), w.dimensions(), &scale_n, y->dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  switch (w.element_type()) {
    case ffi::DataType::S8:
      RunMatmul<kNest>(x.typed_data(), static_cast<const int8_t*>(w.untyped_data()), scale.typed_data(),
                       y->typed_data(), M, N, K, thread_pool);
      return ffi::Error::Success();
    case ffi::DataType::F8E4M3FN:
      RunMatmul<kNest>(x.typed_data(), static_cast<const Fp8E4m3*>(w.untyped_data()), scale.typed_data(),
                       y->typed_data(), M, N, K, thread_pool);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("dense_matmul: quantized weights must be int8 or float8_e4m3fn");
  }
}

// GGUF block weights of N rows of K: q [N, K/2] uint8 (4-bit blocks, with offset [N, K/32]) or
// [N, K] int8 (8-bit blocks, offset [N, 0]), scale [N, K/32]; K a multiple of 32. Checks the
// buffers agree and fills `rows`; an empty message when they do.
std::string GgufRowsOf(ffi::AnyBuffer q, Matrix scale, Matrix offset, int64_t N, int64_t K, GgufRows* rows) {
  const bool nibbles = q.element_type() == ffi::DataType::U8;
  const auto qd = q.dimensions();
  const int64_t blocks = K / raylm::kGgufBlock;
  const bool agree = (nibbles || q.element_type() == ffi::DataType::S8) && K % raylm::kGgufBlock == 0 &&
                     qd.size() == 2 && qd[0] == N && qd[1] == (nibbles ? K / 2 : K) &&
                     scale.dimensions()[0] == N && scale.dimensions()[1] == blocks && offset.dimensions()[0] == N &&
                     offset.dimensions()[1] == (nibbles ? blocks : 0);
  if (!agree)
    return "q [N, K/2] uint8 or [N, K] int8, scale [N, K/32], offset [N, K/32] (uint8 q) or [N, 0] (int8 q), "
           "K a multiple of 32; got N " + std::to_string(N) + ", K " + std::to_string(K) + ", q [" +
           std::to_string(qd.size() == 2 ? qd[0] : -1) + ", " + std::to_string(qd.size() == 2 ? qd[1] : -1) +
           "], scale [" + std::to_string(scale.dimensions()[0]) + ", " + std::to_string(scale.dimensions()[1]) +
           "], offset [" + std::to_string(offset.dimensions()[0]) + ", " + std::to_string(offset.dimensions()[1]) + "]";
  *rows = GgufRows{static_cast<const uint8_t*>(q.untyped_data()), scale.typed_data(),
                   nibbles ? offset.typed_data() : nullptr, K};
  return "";
}

// GgufRowsOf for a call x [M, K] . blocks^T -> y [M, N] (N from y); an empty message when all agree.
std::string GgufCallOf(const Matrix& x, ffi::AnyBuffer q, Matrix scale, Matrix offset, const Matrix& y,
                       GgufRows* rows) {
  std::string error = GgufRowsOf(q, scale, offset, y.dimensions()[1], x.dimensions()[1], rows);
  if (error.empty() && y.dimensions()[0] != x.dimensions()[0]) error = "y must be [M, N]";
  return error.empty() ? error : "x [M, K], y [M, N]; " + error;
}

// x [M, K] . blocks^T -> y [M, N].
template <Nest kNest>
ffi::Error GgufMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer q, Matrix scale, Matrix offset,
                      ffi::Result<Matrix> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = y->dimensions()[1];
  GgufRows w{};
  const std::string error = GgufCallOf(x, q, scale, offset, *y, &w);
  if (!error.empty()) return ffi::Error::InvalidArgument("gguf_matmul: " + error);
  if (M == 0 || N == 0) return ffi::Error::Success();
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  if constexpr (kNest == Nest::kPrompt) {
    RunPromptGemm(xs, w, nullptr, ys, M, N, K, thread_pool);
  } else {
    Run(N, K, kMaxWeightRowsPerTile * K,
        [=](int64_t n_begin, int64_t n_end, float* panel) { GgufColumns(xs, w, ys, M, N, K, n_begin, n_end, panel); },
        thread_pool);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmul, DenseMatmul<Nest::kSmallBatch>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmulQuantized, QuantizedMatmul<Nest::kSmallBatch>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Scales>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmGgufMatmul, GgufMatmul<Nest::kSmallBatch>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());

// The same three products by the prompt GEMM (prompt_gemm.inc), for calls of many rows.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmulPrompt, DenseMatmul<Nest::kPrompt>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmulQuantizedPrompt, QuantizedMatmul<Nest::kPrompt>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Scales>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmGgufMatmulPrompt, GgufMatmul<Nest::kPrompt>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());
