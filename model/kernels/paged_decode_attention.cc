// Paged decode attention for CPU, an XLA FFI custom call (see model/paged_decode.py).
//
// Why a kernel: XLA's CPU path gathers every row's whole bucketed block-table width per
// layer, copies it again into a dot-friendly layout and softmaxes over the padding. Here
// each row walks only its real blocks through its block table, reads K/V in place from
// the pool (no gather copy) and keeps an online softmax in float32; a K/V row serves all
// query heads of its GQA group while it is in L1. Large batches are split over XLA's
// intra-op thread pool.
//
// Operands: q [B, H, Dh] f32; k_pool, v_pool (f32 or bf16, layout: PoolLayout below);
// layer [] s32; block_tables [B, P] s32; context_lens [B] s32 (keys the query sees:
// position + 1 for a real decode row, 0 for a padding row). Result: [B, H, Dh] f32,
// zeros for rows with no keys. Block ids and the layer are clamped, so no input can make
// the kernel read outside the pool.
//
// Attributes (model.config.model_config.AttentionSpec): `scale` multiplies q.k; `softcap` > 0 turns a
// score s into softcap * tanh(s / softcap) before the softmax (Gemma 2), 0 leaves it;
// `window` > 0 lets a row with n keys see only keys max(0, n - window) .. n - 1 (sliding
// window layers), 0 all n. A windowed row starts at the block holding its first visible key
// and never reads the table entries or blocks before it: the engine may have freed those
// blocks and pointed their entries at the null block.
//
// The quantized variant takes 8-bit pools (int8 or float8 e4m3fn) and after each a float32
// scale per (token, kv head), [L, num_blocks, block_size, KVH]: a key's score is its 8-bit
// dot product times its scale, a value row's weight is its probability times its scale.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "ffi_shape.h"
#include "lane_loads.h"
#include "wide_lanes.h"
#include "fp8_e4m3.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using raylm::Bf16;
using raylm::Fp8E4m3;
using raylm::LaneLoad;
using raylm::Shape;
using raylm::Vec16;
using raylm::Vec8;

namespace {

// Operand types (aliases: the handler-binding macro cannot take commas in template args).
using QueryBuffer = ffi::Buffer<ffi::F32, 3>;      // [B, H, Dh]
using LayerBuffer = ffi::Buffer<ffi::S32, 0>;      // []
using TableBuffer = ffi::Buffer<ffi::S32, 2>;      // [B, P]
using LensBuffer = ffi::Buffer<ffi::S32, 1>;       // [B]
using ScaleBuffer = ffi::Buffer<ffi::F32, 4>;      // [L, num_blocks, block_size, KVH]

// Element strides of one KV pool. Head dim is contiguous (stride 1); everything else is
// explicit so another pool layout only changes StackedPoolLayout.
struct PoolLayout {
  int64_t num_layers, num_blocks, block_size, num_kv_heads, head_dim;
  int64_t layer_stride, block_stride, token_stride, head_stride;
};

// The pool the engine uses today: [L, num_blocks, block_size, KVH, Dh], row-major.
PoolLayout StackedPoolLayout(const ffi::AnyBuffer::Dimensions& d) {
  PoolLayout p{d[0], d[1], d[2], d[3], d[4], 0, 0, 0, 0};
  p.head_stride = p.head_dim;
  p.token_stride = p.num_kv_heads * p.head_stride;
  p.block_stride = p.block_size * p.token_stride;
  p.layer_stride = p.num_blocks * p.block_stride;
  return p;
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(int8_t x) { return static_cast<float>(x); }

inline float ToFloat(Fp8E4m3 x) { return raylm::Fp8ToFloat(x); }

inline float ToFloat(Bf16 x) { return raylm::Bf16ToFloat(x); }  // exact: the high half of a float32

// exp(x) for x <= 0 (scores minus their running max), as plain arithmetic so the loop
// around it vectorises. Cephes' expf: 2^n * P(r) with r = x - n ln2, |rel err| < 2e-7.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);  // below this exp underflows; also turns -inf into a tiny value
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename KV>
inline float Dot(const float* __restrict q, const KV* __restrict k, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += q[d] * ToFloat(k[d]);
  return s;
}

// Keys whose scores are summed at once by a lane tree (LaneTree below): a block's scores are
// computed in groups of this many, so each head's score row is padded up to a multiple.
constexpr int64_t kMaxLanes = 16;

inline int64_t ScoreStride(int64_t block_size) { return (block_size + kMaxLanes - 1) / kMaxLanes * kMaxLanes; }

// Rows that share their first block run together, up to this many in one work item
// (AttendRowsOf): their softmax states ([rows, heads, Dh] floats) stay in L1 beside the
// shared block's K and V of one kv head. 4 and 16 measured the same as 8 (0.98-1.03x).
constexpr int64_t kMaxSharedRows = 8;

// Per-thread working memory for up to `rows` rows: the scores of one block for the query
// heads of one kv head ([group, ScoreStride(block_size)]), each row's query heads' running
// max, denominator and float32 accumulator, and one kv head's K and V rows of a block widened
// to float32 (for the pools AttendBlockOf does not widen in registers).
struct Scratch {
  std::vector<float> scores, max, denom, acc, k_rows, v_rows;
  Scratch(int64_t heads, int64_t group, int64_t block_size, int64_t head_dim, int64_t rows)
      : scores(group * ScoreStride(block_size)), max(rows * heads), denom(rows * heads),
        acc(rows * heads * head_dim), k_rows(block_size * head_dim), v_rows(block_size * head_dim) {}
};

// Vectors of 8 (AVX2) or 16 (AVX-512) floats (raylm::Vec8, Vec16, loaded by LaneLoad), as GCC
// vector extensions: the same code serves both widths, compiled for the instruction set of the
// function it is inlined into.
template <typename V>
constexpr int kLanesOf = sizeof(V) / sizeof(float);

// Sums of W vectors at once (W = lanes): lane t of the result is the sum of a[t]'s lanes.
// Each level adds two shuffles of a pair of vectors, halving the vectors while each lane
// sums twice as many elements: W - 1 additions and 2 (W - 1) shuffles for W sums, against
// a horizontal reduction of ~2 log2(W) + 1 dependent instructions per vector. The order of
// additions is fixed, so a score does not depend on the batch or on its neighbours.
template <typename V>
struct LaneTree;

template <>
struct LaneTree<Vec8> {
  __attribute__((always_inline)) static Vec8 Sum(const Vec8 (&a)[8]) {
    Vec8 c[4], e[2];
    for (int i = 0; i < 4; ++i)
      c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
             __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; ++i)
      e[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
             __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(e[0], e[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(e[0], e[1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
};

template <>
struct LaneTree<Vec16> {
  __attribute__((always_inline)) static Vec16 Sum(const Vec16 (&a)[16]) {
    Vec16 c[8], e[4], g[2];
    for (int i = 0; i < 8; ++i)
      c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
             __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    for (int i = 0; i < 4; ++i)
      e[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
             __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    for (int i = 0; i < 2; ++i)
      g[i] = __builtin_shufflevector(e[2 * i], e[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
             __builtin_shufflevector(e[2 * i], e[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    return __builtin_shufflevector(g[0], g[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(g[0], g[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
};

// Head dims above this are processed in slices of this many dims, so a slice of the query (or
// of the value accumulator) stays in registers: a whole 256-dim query is 16 AVX-512 registers
// beside 16 lane-tree accumulators, more than the 32 there are.
constexpr int kMaxSliceDims = 128;

template <int DH>
constexpr int kSliceDims = DH < kMaxSliceDims ? DH : kMaxSliceDims;

// Scores of one query head against the n keys of a block (rows `stride` apart, of type T:
// float32, or bfloat16 or int8 widened exactly as they are loaded), times `scale`, into out[0, n)
// (out has room up to n rounded up to the lanes). Keys go W at a time: W dot products
// accumulate in W vectors side by side (slice / W multiply-adds each), then one lane tree sums
// them into a vector of W scores; a head dim of several slices adds the slices' sums in order.
template <typename V, int DH, typename T>
__attribute__((always_inline)) inline void BlockScores(const float* __restrict q, const T* __restrict k,
                                                       int64_t stride, int64_t n, float scale, float* __restrict out) {
  constexpr int W = kLanesOf<V>, S = kSliceDims<DH>, C = S / W;
  static_assert(DH % S == 0, "head dim must be a whole number of slices");
  for (int d0 = 0; d0 < DH; d0 += S) {
    V qv[C];
    for (int c = 0; c < C; ++c) qv[c] = LaneLoad<V>::From(q + d0 + c * W);
    for (int64_t t0 = 0; t0 < n; t0 += W) {
      const auto key_sum = [&](int i) __attribute__((always_inline)) {  // key t0 + i's lanes of q.k
        const T* kt = k + (t0 + i) * stride + d0;
        V a = qv[0] * LaneLoad<V>::From(kt);
        for (int c = 1; c < C; ++c) a += qv[c] * LaneLoad<V>::From(kt + c * W);
        return a;
      };
      V acc[W];
      const int64_t m = std::min<int64_t>(W, n - t0);
      if (m == W) {  // a whole group, branch-free, so the compiler keeps the W sums in registers
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) acc[i] = key_sum(i);
      } else {
        for (int i = 0; i < W; ++i) acc[i] = i < m ? key_sum(i) : V{};
      }
      V sums = LaneTree<V>::Sum(acc);
      if (d0 > 0) sums += LaneLoad<V>::From(out + t0);
      if (d0 + S == DH) sums *= scale;
      std::memcpy(out + t0, &sums, sizeof sums);
    }
  }
}

// For G query heads g of one kv head: acc[g * DH, (g + 1) * DH) += sum over the block's n keys
// of p[g * p_stride + t] * v_t, a slice of each accumulator held in registers across the block.
// The heads share each value vector loaded (one load and widening, G multiply-adds); each
// head's sums are the same, in the same order, as one head at a time. T as in BlockScores.
template <typename V, int DH, int G, typename T>
__attribute__((always_inline)) inline void AccumulateValues(const float* __restrict p, int64_t p_stride,
                                                            const T* __restrict v, int64_t stride, int64_t n,
                                                            float* __restrict acc) {
  constexpr int W = kLanesOf<V>, S = kSliceDims<DH>, C = S / W;
  for (int d0 = 0; d0 < DH; d0 += S) {
    V a[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) a[g][c] = LaneLoad<V>::From(acc + g * DH + d0 + c * W);
    for (int64_t t = 0; t < n; ++t) {
      V pt[G];
      for (int g = 0; g < G; ++g) pt[g] = V{} + p[g * p_stride + t];
      const T* vt = v + t * stride + d0;
      for (int c = 0; c < C; ++c) {
        const V vc = LaneLoad<V>::From(vt + c * W);
        for (int g = 0; g < G; ++g) a[g][c] += pt[g] * vc;
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) std::memcpy(acc + g * DH + d0 + c * W, &a[g][c], sizeof a[g][c]);
  }
}

// Query heads whose value accumulators AccumulateValues keeps in registers at once: G * C
// accumulators beside a value vector and G broadcast weights, within the 32 registers of the
// sixteen-lane family (AVX-512) or the 16 of the eight-lane family's AVX2 clone, where a head
// dim of 64 is already eight accumulators (one head at a time, as before).
template <typename V, int DH>
constexpr int kValueHeads = kLanesOf<V> == 16 ? (kSliceDims<DH> / 16 <= 4 ? 4 : 2)
                                              : (kSliceDims<DH> / kLanesOf<V> <= 4 ? 2 : 1);

// AccumulateValues for `count` (< kValueHeads) heads.
template <typename V, int DH, typename T>
__attribute__((always_inline)) inline void AccumulateValuesRest(int64_t count, const float* __restrict p,
                                                                int64_t p_stride, const T* __restrict v,
                                                                int64_t stride, int64_t n, float* __restrict acc) {
  switch (count) {
    case 3: return AccumulateValues<V, DH, 3, T>(p, p_stride, v, stride, n, acc);
    case 2: return AccumulateValues<V, DH, 2, T>(p, p_stride, v, stride, n, acc);
    case 1: return AccumulateValues<V, DH, 1, T>(p, p_stride, v, stride, n, acc);
  }
}

// Rows `n` of `dh` elements, `stride` apart, widened into `out` ([n, dh], contiguous), for the
// pools AttendBlockOf does not widen in registers (fp8; bfloat16 and int8 in the eight-lane family
// or at a head dim without a vectorised instance). Every query head of the GQA group reads them:
// widening once instead of per head took 16 rows at 550 keys (30 layers, 2-core AVX-512) from
// 32.7 to 11.7 ms with an fp8 pool (float32: 10.3), int8 from 14.4 to 9.3 and bfloat16 from 13.5
// to 10.4 (an e4m3 element takes ~8 integer ops).
template <typename KV>
inline void WidenRows(const KV* __restrict rows, int64_t stride, int64_t n, int64_t dh, float* __restrict out) {
  for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
    for (int64_t d = 0; d < dh; ++d) out[t * dh + d] = ToFloat(rows[t * stride + d]);
  }
}

struct Problem {
  const float* q;           // [B, H, Dh]
  const void* k_layer;      // k_pool at the clamped layer
  const void* v_layer;
  const float* k_scale_layer;  // per (token, kv head) scales at the layer; null: float pools
  const float* v_scale_layer;
  const int32_t* tables;    // [B, P]
  const int32_t* lens;      // [B]
  float* out;               // [B, H, Dh]
  PoolLayout pool;
  int64_t num_heads, table_width;
  float scale;
  float softcap;            // 0: none
  int64_t window;           // 0: none
};

// The keys row `b` sees, [first, end): the first `lens[b]` (clamped to the table), or only
// the last `window` of them.
struct KeyRange {
  int64_t first, end;
};

inline KeyRange VisibleKeys(const Problem& pr, int64_t b) {
  const int64_t end = std::clamp<int64_t>(pr.lens[b], 0, pr.table_width * pr.pool.block_size);
  return {pr.window > 0 ? std::max<int64_t>(end - pr.window, 0) : 0, end};
}

// tanh(x) as plain arithmetic, so the soft-cap loop vectorises (std::tanh is a library call
// per score). Cephes' tanhf: an odd polynomial below |x| = 0.625, else 1 - 2 / (e^2|x| + 1)
// with e^-2|x| from ExpNonPositive; relative error a few float32 ulps.
inline float Tanh(float x) {
  const float a = std::fabs(x), z = x * x;
  float small = -5.70498872745e-3f;
  small = small * z + 2.06390887954e-2f;
  small = small * z - 5.37397155531e-2f;
  small = small * z + 1.33314422036e-1f;
  small = small * z - 3.33332819422e-1f;
  small = small * z * x + x;
  const float e = ExpNonPositive(-2.0f * a);
  const float large = std::copysign((1.0f - e) / (1.0f + e), x);
  return a < 0.625f ? small : large;
}

// Scores of `group` heads ([group, stride], first n valid) soft-capped in place.
inline void SoftCap(float* __restrict sc, int64_t stride, int64_t n, int64_t group, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t h = 0; h < group; ++h) {
    float* __restrict sh = sc + h * stride;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sh[t] = cap * Tanh(sh[t] * inv);
  }
}

// Blocks sit at random places in the pool, beyond what the hardware prefetcher guesses. The
// first kilobyte of the next block's K and V is asked for while this one is computed; the
// hardware prefetcher follows the rest of each stream. Measured on 30-layer steps (2-core
// AMD EPYC, 16-lane family): 64 rows x 192 keys 28.5 ms without prefetching, 27.6 ms
// prefetching whole blocks, 26.2 ms with the first kilobyte; 16 rows x 550 keys sharing a
// 512-key prefix (in cache) 6.8, 7.7 and 6.6 ms; 64 rows x 550 keys 81.5, 82.6 and 75.6 ms.
constexpr int64_t kPrefetchBytes = 1024;

template <typename KV>
inline void Prefetch(const KV* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < count * static_cast<int64_t>(sizeof(KV)); off += 64)
    __builtin_prefetch(bytes + off);
}

// Within a block, one kv head's rows are `dh` elements every `stride` (the other heads' rows
// lie between), a pattern the hardware prefetcher does not follow ahead of the loads: a perf
// profile of an int8 pool had 30% of the kernel's samples on the first load of each value row.
// So each kv head asks for its n value rows before scoring its keys, and for the next kv head's
// key rows. Against the first kilobyte of the next block alone (30-layer calls, blocks of 64,
// 2-core AMD EPYC, alternating in one process): int8 pool 64 rows x 192 keys 1.24 x 1.07 =
// ~1.33x, 16 x 192 1.28 x 1.07, 64 x 550 1.21 x 1.10; bfloat16 1.04-1.08 x 1.06-1.08;
// float32 1.04-1.08 x 0.98-1.00; rows sharing a cached prefix 1.00.
template <typename KV>
inline void PrefetchRows(const KV* rows, int64_t stride, int64_t n, int64_t dh) {
  for (int64_t t = 0; t < n; ++t) Prefetch(rows + t * stride, dh);
}

// The largest of sh[0, n), W lanes at a time (the compiler leaves a scalar float max loop
// scalar: it may not reorder it without fast-math). A maximum is exact, so the order of the
// comparisons does not change it.
template <typename V>
__attribute__((always_inline)) inline float BlockMax(const float* __restrict sh, int64_t n) {
  constexpr int W = kLanesOf<V>;
  float block_max = sh[0];
  int64_t t = 0;
  if (n >= W) {
    V lanes = LaneLoad<V>::From(sh);
    for (t = W; t + W <= n; t += W) {
      const V x = LaneLoad<V>::From(sh + t);
      lanes = lanes > x ? lanes : x;
    }
    for (int i = 0; i < W; ++i) block_max = std::max(block_max, lanes[i]);
  }
  for (; t < n; ++t) block_max = std::max(block_max, sh[t]);
  return block_max;
}

// Online-softmax update of `group` query heads with the scores `sc` ([group, stride], first
// n valid) of one block: rescales what was accumulated, turns scores into weights.
template <typename V>
__attribute__((always_inline)) inline void SoftmaxUpdate(float* __restrict sc, int64_t stride, int64_t n,
                                                         int64_t group, int64_t dh, float* __restrict max,
                                                         float* __restrict denom, float* __restrict acc) {
  for (int64_t h = 0; h < group; ++h) {
    float* __restrict sh = sc + h * stride;
    const float block_max = BlockMax<V>(sh, n);
    const float new_max = std::max(max[h], block_max);
    const float correction = ExpNonPositive(max[h] - new_max);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      sh[t] = ExpNonPositive(sh[t] - new_max);
      sum += sh[t];
    }
    max[h] = new_max;
    denom[h] = denom[h] * correction + sum;
    if (correction != 1.0f) {
      float* __restrict ah = acc + h * dh;
#pragma omp simd
      for (int64_t d = 0; d < dh; ++d) ah[d] *= correction;
    }
  }
}

// One row's online-softmax state: each query head's running max, denominator and float32
// accumulator ([num_heads], [num_heads], [num_heads, Dh]), indexed by the row's query head.
struct RowState {
  float* max;
  float* denom;
  float* acc;
};

// Block `j` of row `b` (visible keys `keys`) for the query heads of kv heads [kv_begin,
// kv_end): scores, the softmax update and the values, into `st`. Kv heads are the inner loop,
// so a block's K/V ([block_size, KVH, Dh], contiguous) streams in once. `prefetch`: ask for
// the start of the row's next block meanwhile. DH > 0 fixes the head dim at compile time;
// when it is a multiple of V's lanes, scores are summed by lane trees and the value
// accumulators stay in registers (BlockScores, AccumulateValues), else (DH == 0: taken from
// the pool) scalar reductions run. A (row, kv head)'s arithmetic depends only on its own
// state and block, so the order AttendRowsOf visits them in does not change a bit.
template <typename KV, int DH, typename V>
__attribute__((always_inline)) inline void AttendBlockOf(const Problem& pr, int64_t b, int64_t j, KeyRange keys,
                                                         int64_t kv_begin, int64_t kv_end, RowState st,
                                                         Scratch& s, bool prefetch) {
  constexpr bool kVectorised = DH > 0 && DH % kLanesOf<V> == 0;
  // What the K and V rows are read as: the pool's own type where the loops widen it in
  // registers, else float32 rows widened into the scratch first. In registers for bfloat16 and
  // int8 pools in the sixteen-lane family (one or two instructions a vector), where it beat the
  // scratch rows 1.07-1.34x (30-layer calls, 2-core AMD EPYC: 64 rows x 256 keys, 1 x 1024, 16 x
  // 100); the eight-lane family's loads take more steps, and there it lost (0.66-0.91x).
  using Elem = std::conditional_t<std::is_same_v<KV, float> ||
                                      (kVectorised && kLanesOf<V> == 16 &&
                                       (std::is_same_v<KV, Bf16> || std::is_same_v<KV, int8_t>)),
                                  KV, float>;
  const PoolLayout& L = pr.pool;
  const int64_t dh = DH > 0 ? DH : L.head_dim, bs = L.block_size, ss = ScoreStride(bs);
  const int64_t group = pr.num_heads / L.num_kv_heads;
  const float* __restrict q = pr.q + b * pr.num_heads * dh;
  const int32_t* table = pr.tables + b * pr.table_width;
  float* __restrict scores = s.scores.data();
  const int64_t block = std::clamp<int64_t>(table[j], 0, L.num_blocks - 1);
  // This block's visible keys are its slots [t0, t0 + n): t0 > 0 only where a window starts.
  const int64_t t0 = std::max<int64_t>(keys.first - j * bs, 0);
  const int64_t n = std::min(bs, keys.end - j * bs) - t0;
  const KV* k_block = static_cast<const KV*>(pr.k_layer) + block * L.block_stride + t0 * L.token_stride;
  const KV* v_block = static_cast<const KV*>(pr.v_layer) + block * L.block_stride + t0 * L.token_stride;
  // Scales of these keys: [block_size, KVH] per block, one per (token, kv head).
  const int64_t scale_block = (block * bs + t0) * L.num_kv_heads;
  if (prefetch && (j + 1) * bs < keys.end) {
    const int64_t next = std::clamp<int64_t>(table[j + 1], 0, L.num_blocks - 1);
    const int64_t count = std::min<int64_t>(kPrefetchBytes / sizeof(KV), L.block_stride);
    Prefetch(static_cast<const KV*>(pr.k_layer) + next * L.block_stride, count);
    Prefetch(static_cast<const KV*>(pr.v_layer) + next * L.block_stride, count);
  }
  for (int64_t kvh = kv_begin; kvh < kv_end; ++kvh) {
    const int64_t h0 = kvh * group;  // this group's first head
    float* __restrict acc = st.acc + h0 * dh;
    PrefetchRows(v_block + kvh * L.head_stride, L.token_stride, n, dh);
    if (kvh + 1 < kv_end) PrefetchRows(k_block + (kvh + 1) * L.head_stride, L.token_stride, n, dh);
    // This kv head's K and V rows as Elem (above): in place, or widened once into the
    // scratch rows.
    const Elem* __restrict k;
    const Elem* __restrict v;
    int64_t stride;
    if constexpr (std::is_same_v<Elem, KV>) {
      k = k_block + kvh * L.head_stride;
      v = v_block + kvh * L.head_stride;
      stride = L.token_stride;
    } else {
      WidenRows(k_block + kvh * L.head_stride, L.token_stride, n, dh, s.k_rows.data());
      WidenRows(v_block + kvh * L.head_stride, L.token_stride, n, dh, s.v_rows.data());
      k = s.k_rows.data();
      v = s.v_rows.data();
      stride = dh;
    }
    // Heads outer, keys inner: a head's query (then its accumulator) stays in registers
    // across the block while the block's K (then V) rows come from L1.
    for (int64_t h = 0; h < group; ++h) {
      if constexpr (kVectorised) {
        BlockScores<V, DH, Elem>(q + (h0 + h) * dh, k, stride, n, pr.scale, scores + h * ss);
      } else {
        for (int64_t t = 0; t < n; ++t) scores[h * ss + t] = Dot(q + (h0 + h) * dh, k + t * stride, dh) * pr.scale;
      }
    }
    if (pr.k_scale_layer) {
      const float* ks = pr.k_scale_layer + scale_block + kvh;
      for (int64_t h = 0; h < group; ++h)
        for (int64_t t = 0; t < n; ++t) scores[h * ss + t] *= ks[t * L.num_kv_heads];
    }
    if (pr.softcap > 0.0f) SoftCap(scores, ss, n, group, pr.softcap);
    SoftmaxUpdate<V>(scores, ss, n, group, dh, st.max + h0, st.denom + h0, acc);
    if (pr.v_scale_layer) {  // a value row's weight: its probability times its scale
      const float* vs = pr.v_scale_layer + scale_block + kvh;
      for (int64_t h = 0; h < group; ++h)
        for (int64_t t = 0; t < n; ++t) scores[h * ss + t] *= vs[t * L.num_kv_heads];
    }
    if constexpr (kVectorised) {
      constexpr int G = kValueHeads<V, DH>;
      int64_t h = 0;
      for (; h + G <= group; h += G)
        AccumulateValues<V, DH, G, Elem>(scores + h * ss, ss, v, stride, n, acc + h * dh);
      AccumulateValuesRest<V, DH, Elem>(group - h, scores + h * ss, ss, v, stride, n, acc + h * dh);
    } else {
      for (int64_t h = 0; h < group; ++h) {
        float* __restrict ah = acc + h * dh;
        for (int64_t t = 0; t < n; ++t) {
          const float p = scores[h * ss + t];
          const float* __restrict vt = v + t * stride;
#pragma omp simd
          for (int64_t d = 0; d < dh; ++d) ah[d] += p * vt[d];
        }
      }
    }
  }
}

// Attention of the query heads of kv heads [kv_begin, kv_end) of rows `rows[0, count)`. One
// row walks its blocks in order. Rows that share their blocks (a common prompt prefix) go
// block by block and kv head by kv head across the rows, so the other rows read a shared
// block's K/V from L1; one row at a time, each read the whole prefix again, from L2 or L3
// once it outgrew L2 (a float32 pool's 512-key prefix of the bundled model is 768 KiB a
// layer). Every row's results are the bits it gets alone. Against one row at a time (30-layer
// calls, 2-core AMD EPYC, 16-lane family, blocks of 64, a shared 512-key prefix): float32
// pool 16 rows x 550 keys 0.213 -> 0.162 ms a layer, 64 x 550 0.677 -> 0.565 ms (blocks of
// 16: 1.07x); int8 and bfloat16 pools, whose prefix stays in L2, and rows sharing nothing:
// within 0.97-1.02x. Offline, 64 requests on a 512-token prefix at 16 at once: 1.02-1.06x
// the tokens/s. Inlined into the functions below, once per vector width. Against scalar
// reductions everywhere, a step of 30 layers on a 2-core AMD EPYC (16-lane family, first
// kilobyte prefetched): 1 row x 300 keys 0.8-0.9 -> 0.4 ms, 64 rows x 192 keys 33.0-33.8 ->
// 26.5-27.0 ms, 16 rows x 550 keys sharing a 512-key prefix 11.5-12.1 -> 6.8-6.9 ms, and 64 x
// 550 (bound by reading the pool) 97.5 -> 78-79 ms.
template <typename KV, int DH, typename V>
__attribute__((always_inline)) inline void AttendRowsOf(const Problem& pr, const int64_t* rows, int64_t count,
                                                        int64_t kv_begin, int64_t kv_end, Scratch& s) {
  const PoolLayout& L = pr.pool;
  const int64_t dh = DH > 0 ? DH : L.head_dim, bs = L.block_size, heads = pr.num_heads;
  const int64_t group = heads / L.num_kv_heads, h_begin = kv_begin * group, h_count = (kv_end - kv_begin) * group;
  KeyRange keys[kMaxSharedRows];
  int64_t j_begin = std::numeric_limits<int64_t>::max(), j_end = 0;
  for (int64_t r = 0; r < count; ++r) {
    keys[r] = VisibleKeys(pr, rows[r]);
    std::fill_n(s.max.begin() + r * heads + h_begin, h_count, -std::numeric_limits<float>::infinity());
    std::fill_n(s.denom.begin() + r * heads + h_begin, h_count, 0.0f);
    std::fill_n(s.acc.begin() + (r * heads + h_begin) * dh, h_count * dh, 0.0f);
    if (keys[r].end > keys[r].first) {
      j_begin = std::min(j_begin, keys[r].first / bs);
      j_end = std::max(j_end, (keys[r].end + bs - 1) / bs);
    }
  }
  auto state = [&](int64_t r) {
    return RowState{s.max.data() + r * heads, s.denom.data() + r * heads, s.acc.data() + r * heads * dh};
  };
  if (count == 1) {
    for (int64_t j = j_begin; j < j_end; ++j)
      AttendBlockOf<KV, DH, V>(pr, rows[0], j, keys[0], kv_begin, kv_end, state(0), s, true);
  } else {
    for (int64_t j = j_begin; j < j_end; ++j)
      for (int64_t kvh = kv_begin; kvh < kv_end; ++kvh)
        for (int64_t r = 0; r < count; ++r)
          if (j * bs < keys[r].end && (j + 1) * bs > keys[r].first)
            AttendBlockOf<KV, DH, V>(pr, rows[r], j, keys[r], kvh, kvh + 1, state(r), s, kvh == kv_begin);
  }
  for (int64_t r = 0; r < count; ++r) {
    float* __restrict out = pr.out + (rows[r] * heads + h_begin) * dh;
    if (keys[r].end == keys[r].first) {
      std::fill(out, out + h_count * dh, 0.0f);
      continue;
    }
    const RowState st = state(r);
    for (int64_t h = 0; h < h_count; ++h) {
      const float inv = 1.0f / st.denom[h_begin + h];
#pragma omp simd
      for (int64_t d = 0; d < dh; ++d) out[h * dh + d] = st.acc[(h_begin + h) * dh + d] * inv;
    }
  }
}

// The eight-lane family. Multiversioned so the same binary uses AVX-512 / AVX2+FMA where
// the CPU has them (eight lanes are the widest all three clones run natively).
template <typename KV, int DH>
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void AttendRows(const Problem& pr, const int64_t* rows, int64_t count, int64_t kv_begin, int64_t kv_end, Scratch& s) {
  AttendRowsOf<KV, DH, Vec8>(pr, rows, count, kv_begin, kv_end, s);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define RAYLM_WIDE_ATTENTION 1
// The sixteen-lane family, for CPUs with AVX-512 (x86-64-v4): a block of 16 keys is one
// lane tree. Its scores differ from the eight-lane family's in the last bits (another
// order of additions), so a process uses one family for every call (UseWideAttention).
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
template <typename KV, int DH>
void AttendRowsWide(const Problem& pr, const int64_t* rows, int64_t count, int64_t kv_begin, int64_t kv_end,
                    Scratch& s) {
  AttendRowsOf<KV, DH, Vec16>(pr, rows, count, kv_begin, kv_end, s);
}
#pragma GCC pop_options
#endif

// Whether this process runs the sixteen-lane family: the CPU has x86-64-v4's AVX-512 subsets
// and RAYLM_ATTENTION_NARROW_LANES is unset (tests set it to check the eight-lane family on
// AVX-512 machines too). Decided once, so every call of a process sums alike.
bool UseWideAttention() {
#ifdef RAYLM_WIDE_ATTENTION
  static const bool wide = raylm::CpuRunsWideLanes("RAYLM_ATTENTION_NARROW_LANES");
  return wide;
#else
  return false;
#endif
}

using RowFn = void (*)(const Problem&, const int64_t*, int64_t, int64_t, int64_t, Scratch&);

// Head dims with a compiled instance (lane trees, accumulators in registers): those of the
// supported families (SmolLM / Llama 3.2 64, Phi-3 96, Llama / Qwen / Mistral 128, Gemma 256)
// and 80; any other runs the scalar reductions (correct, slower). Each listed dim adds an
// instance per pool type and lane family (and the eight-lane family's three clones).
template <typename KV, template <typename, int> class Row>
RowFn RowOfHeadDim(int64_t head_dim) {
  switch (head_dim) {
    case 64: return Row<KV, 64>::Fn();
    case 80: return Row<KV, 80>::Fn();
    case 96: return Row<KV, 96>::Fn();
    case 128: return Row<KV, 128>::Fn();
    case 256: return Row<KV, 256>::Fn();
    default: return Row<KV, 0>::Fn();
  }
}

template <typename KV, int DH>
struct NarrowRow {
  static RowFn Fn() { return AttendRows<KV, DH>; }
};

#ifdef RAYLM_WIDE_ATTENTION
template <typename KV, int DH>
struct WideRow {
  static RowFn Fn() { return AttendRowsWide<KV, DH>; }
};
#endif

template <typename KV>
RowFn RowKernel(int64_t head_dim) {
#ifdef RAYLM_WIDE_ATTENTION
  if (UseWideAttention()) return RowOfHeadDim<KV, WideRow>(head_dim);
#endif
  return RowOfHeadDim<KV, NarrowRow>(head_dim);
}

// Below this many (key, query head) pairs a call runs on the calling thread alone: waking a
// pool thread costs tens of microseconds, about what this much work takes. A call reading its
// keys from memory runs at ~10 ns a pair on one thread, so two threads pay from a few thousand
// pairs: 30-layer A/B runs against 16384 (2-core AMD EPYC, AVX-512, KV blocks of 16 and 64
// tokens) measured 1.3-1.9x faster attention from 4096 to 16384 pairs (1 row at 512-1000 keys,
// 4-16 rows at 40-250), and 2048 lost on some calls of 2000-4000 pairs (0.6-0.8x).
constexpr int64_t kMinParallelWork = 4096;

// Work items over the batch: runs of `order`, items[i] = order[starts[i], starts[i + 1]).
// Rows whose first visible block is the same block share it (and, in practice, a prefix of
// blocks): they run in items of up to kMaxSharedRows, sized so each of `threads` threads gets
// one where there are few; every other row is an item of its own. Returns the most rows an
// item holds (1: no rows share).
int64_t ShareBlocks(const Problem& pr, int64_t batch, int64_t threads, std::vector<int64_t>& order,
                    std::vector<int64_t>& starts) {
  order.resize(batch);
  std::iota(order.begin(), order.end(), int64_t{0});
  if (batch == 1) {
    starts = {0, 1};
    return 1;
  }
  const int64_t bs = pr.pool.block_size;
  std::vector<int64_t> first(batch, -1);  // the first visible block's id; -1: no keys
  for (int64_t b = 0; b < batch; ++b) {
    const KeyRange keys = VisibleKeys(pr, b);
    if (keys.end > keys.first) first[b] = pr.tables[b * pr.table_width + keys.first / bs];
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return first[a] < first[b]; });
  int64_t max_rows = 1;
  starts.assign(1, 0);
  for (int64_t i = 0; i < batch;) {
    int64_t run = 1;
    while (first[order[i]] >= 0 && i + run < batch && first[order[i + run]] == first[order[i]]) ++run;
    const int64_t size = std::min(kMaxSharedRows, (run + threads - 1) / threads);
    const int64_t items = (run + size - 1) / size;
    for (int64_t k = 1; k <= items; ++k) starts.push_back(i + run * k / items);
    max_rows = std::max(max_rows, (run + items - 1) / items);
    i += run;
  }
  return max_rows;
}

// Runs `row` over all rows, on the calling thread and, for large batches, on XLA's intra-op
// pool too (while attention runs, the rest of the decode step waits for it). Work items are
// claimed one by one from a shared counter, so the caller never waits for an item nobody has
// started, and a helper that starts late finds nothing left and touches only `state`.
void Run(const Problem& pr, int64_t batch, RowFn row, ffi::ThreadPool& pool) {
  const PoolLayout& L = pr.pool;
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const KeyRange keys = VisibleKeys(pr, b);
    work += (keys.end - keys.first) * pr.num_heads;
  }
  const int64_t threads = work >= kMinParallelWork ? std::max<int64_t>(pool.num_threads(), 1) : 1;
  std::vector<int64_t> order, starts;
  const int64_t max_rows = ShareBlocks(pr, batch, threads, order, starts);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  // Whole items when there are enough of them or rows share blocks, else one item per (row,
  // kv head).
  const int64_t chunks = max_rows > 1 || batch >= 2 * threads ? 1 : L.num_kv_heads;
  const int64_t items = groups * chunks, per_chunk = L.num_kv_heads / chunks;

  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto participate = [state, items, per_chunk, chunks, max_rows, row, &pr, &order, &starts] {
    int64_t i = state->next.fetch_add(1);
    if (i >= items) return;
    const PoolLayout& L = pr.pool;
    Scratch scratch(pr.num_heads, pr.num_heads / L.num_kv_heads, L.block_size, L.head_dim, max_rows);
    for (; i < items; i = state->next.fetch_add(1)) {
      const int64_t kv = (i % chunks) * per_chunk, g = i / chunks;
      row(pr, order.data() + starts[g], starts[g + 1] - starts[g], kv, kv + per_chunk, scratch);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min(threads, items); ++t)
    pool.Schedule(decltype(participate)(participate));
  participate();
  while (state->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

// Checks the operands and attributes and fills `pr` (all but the 8-bit pools' scales); an
// error message when they do not fit.
std::string Prepare(QueryBuffer& q, ffi::AnyBuffer& k_pool, ffi::AnyBuffer& v_pool, LayerBuffer& layer,
                    TableBuffer& block_tables, LensBuffer& context_lens, ffi::Result<QueryBuffer>& out,
                    float scale, float softcap, int64_t window, Problem& pr) {
  if (!std::isfinite(scale) || !std::isfinite(softcap) || softcap < 0.0f || window < 0)
    return "paged_decode_attention: scale must be finite, softcap and window >= 0 (0: none); got scale " +
           std::to_string(scale) + ", softcap " + std::to_string(softcap) + ", window " + std::to_string(window);
  const auto qd = q.dimensions();
  const auto kd = k_pool.dimensions();
  const int64_t batch = qd[0], num_heads = qd[1];
  if (kd.size() != 5 || Shape(kd) != Shape(v_pool.dimensions()))
    return "paged_decode_attention: k_pool and v_pool must both be [L, num_blocks, block_size, "
           "kv_heads, head_dim]; got " + Shape(kd) + " and " + Shape(v_pool.dimensions());
  if (k_pool.element_type() != v_pool.element_type())
    return "paged_decode_attention: k_pool and v_pool dtypes differ";
  const PoolLayout pool = StackedPoolLayout(kd);
  if (pool.num_layers < 1 || pool.num_blocks < 1 || pool.num_kv_heads < 1 ||
      num_heads % pool.num_kv_heads != 0 || qd[2] != pool.head_dim)
    return "paged_decode_attention: q " + Shape(qd) + " does not fit pool " + Shape(kd) +
           " (query heads must be a multiple of kv heads, head dims equal)";
  const auto td = block_tables.dimensions();
  if (td[0] != batch || context_lens.dimensions()[0] != batch)
    return "paged_decode_attention: block_tables " + Shape(td) + " and context_lens " +
           Shape(context_lens.dimensions()) + " must have q's batch " + std::to_string(batch);
  const int64_t l = std::clamp<int64_t>(*layer.typed_data(), 0, pool.num_layers - 1);
  const size_t elem = ffi::ByteWidth(k_pool.element_type());
  pr = Problem{q.typed_data(),
               static_cast<const char*>(k_pool.untyped_data()) + l * pool.layer_stride * elem,
               static_cast<const char*>(v_pool.untyped_data()) + l * pool.layer_stride * elem,
               nullptr, nullptr,
               block_tables.typed_data(), context_lens.typed_data(), out->typed_data(), pool,
               num_heads, td[1], scale, softcap, window};
  return "";
}

ffi::Error PagedDecodeAttention(ffi::ThreadPool thread_pool, QueryBuffer q,
                                ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, LayerBuffer layer,
                                TableBuffer block_tables, LensBuffer context_lens, float scale, float softcap,
                                int64_t window, ffi::Result<QueryBuffer> out) {
  Problem pr{};
  const std::string error =
      Prepare(q, k_pool, v_pool, layer, block_tables, context_lens, out, scale, softcap, window, pr);
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t batch = q.dimensions()[0];
  switch (k_pool.element_type()) {
    case ffi::DataType::F32:
      Run(pr, batch, RowKernel<float>(pr.pool.head_dim), thread_pool);
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      Run(pr, batch, RowKernel<Bf16>(pr.pool.head_dim), thread_pool);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument(
          "paged_decode_attention: pool dtype must be float32 or bfloat16");
  }
}

// 8-bit pools with their scales [L, num_blocks, block_size, KVH].
ffi::Error QuantizedPagedDecodeAttention(ffi::ThreadPool thread_pool, QueryBuffer q, ffi::AnyBuffer k_pool,
                                         ScaleBuffer k_scale, ffi::AnyBuffer v_pool, ScaleBuffer v_scale,
                                         LayerBuffer layer, TableBuffer block_tables, LensBuffer context_lens,
                                         float scale, float softcap, int64_t window,
                                         ffi::Result<QueryBuffer> out) {
  Problem pr{};
  const std::string error =
      Prepare(q, k_pool, v_pool, layer, block_tables, context_lens, out, scale, softcap, window, pr);
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const PoolLayout& L = pr.pool;
  const auto kd = k_pool.dimensions();
  const std::string scale_shape = Shape(kd).substr(0, Shape(kd).rfind(',')) + "]";
  if (Shape(k_scale.dimensions()) != scale_shape || Shape(v_scale.dimensions()) != scale_shape)
    return ffi::Error::InvalidArgument("paged_decode_attention: scales must be " + scale_shape + ", got " +
                                       Shape(k_scale.dimensions()) + " and " + Shape(v_scale.dimensions()));
  const int64_t l = std::clamp<int64_t>(*layer.typed_data(), 0, L.num_layers - 1);
  const int64_t scale_layer_stride = L.num_blocks * L.block_size * L.num_kv_heads;
  pr.k_scale_layer = k_scale.typed_data() + l * scale_layer_stride;
  pr.v_scale_layer = v_scale.typed_data() + l * scale_layer_stride;
  const int64_t batch = q.dimensions()[0];
  switch (k_pool.element_type()) {
    case ffi::DataType::S8:
      Run(pr, batch, RowKernel<int8_t>(L.head_dim), thread_pool);
      return ffi::Error::Success();
    case ffi::DataType::F8E4M3FN:
      Run(pr, batch, RowKernel<Fp8E4m3>(L.head_dim), thread_pool);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("paged_decode_attention: quantized pools must be int8 or float8_e4m3fn");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmPagedDecodeAttention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<QueryBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<LayerBuffer>()
                                  .Arg<TableBuffer>()
                                  .Arg<LensBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Ret<QueryBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmQuantizedPagedDecodeAttention, QuantizedPagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<QueryBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ScaleBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ScaleBuffer>()
                                  .Arg<LayerBuffer>()
                                  .Arg<TableBuffer>()
                                  .Arg<LensBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Ret<QueryBuffer>());
