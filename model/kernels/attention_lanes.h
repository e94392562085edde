// Paged decode attention's vector loops (paged_decode_attention.cc): a block's scores summed by
// lane trees, the value accumulators held in registers, and the online softmax's unit update,
// written once for vectors of 8 (AVX2) or 16 (AVX-512) floats.
#ifndef RAYLM_ATTENTION_LANES_H_
#define RAYLM_ATTENTION_LANES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention_math.h"
#include "lane_loads.h"

namespace {

using raylm::LaneLoad;
using raylm::Vec16;
using raylm::Vec8;

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

// Stores v at p (any alignment) as one vector store. A memcpy per vector let GCC merge a run of
// them into one copy of the accumulators through the stack (a loop of 16-byte moves).
template <typename V>
struct UnalignedOf;
template <>
struct UnalignedOf<Vec8> {
  typedef float Type __attribute__((vector_size(32), aligned(4)));
};
template <>
struct UnalignedOf<Vec16> {
  typedef float Type __attribute__((vector_size(64), aligned(4)));
};

template <typename V>
__attribute__((always_inline)) inline void StoreLanes(float* p, V v) {
  *reinterpret_cast<typename UnalignedOf<V>::Type*>(p) = v;
}

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

// Rows of a unit's keys or values that lie together: n rows of type T, `stride` elements apart
// (one block's rows in the pool, or a unit's rows widened into the scratch).
template <typename T>
struct RowRun {
  const T* rows;
  int64_t n, stride;
};

// For G query heads g of one kv head: acc[g * DH, (g + 1) * DH) += sum over the unit's keys t
// (the runs' rows in order) of p[g * p_stride + t] * v_t, a slice of each accumulator held in
// registers across the unit. The heads share each value vector loaded (one load and widening,
// G multiply-adds); each head's sums are the same, in the same order, as one head at a time.
// T as in BlockScores.
template <typename V, int DH, int G, typename T>
__attribute__((always_inline)) inline void AccumulateValues(const float* __restrict p, int64_t p_stride,
                                                            const RowRun<T>* runs, int64_t num_runs,
                                                            float* __restrict acc) {
  constexpr int W = kLanesOf<V>, S = kSliceDims<DH>, C = S / W;
  for (int d0 = 0; d0 < DH; d0 += S) {
    V a[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) a[g][c] = LaneLoad<V>::From(acc + g * DH + d0 + c * W);
    const float* weights = p;  // the current run's first weight of head 0
    for (int64_t i = 0; i < num_runs; ++i) {
      const T* __restrict v = runs[i].rows;
      const int64_t n = runs[i].n, stride = runs[i].stride;
      for (int64_t t = 0; t < n; ++t) {
        V pt[G];
        for (int g = 0; g < G; ++g) pt[g] = V{} + weights[g * p_stride + t];
        const T* vt = v + t * stride + d0;
        for (int c = 0; c < C; ++c) {
          const V vc = LaneLoad<V>::From(vt + c * W);
          for (int g = 0; g < G; ++g) a[g][c] += pt[g] * vc;
        }
      }
      weights += n;
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) StoreLanes(acc + g * DH + d0 + c * W, a[g][c]);
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
                                                                int64_t p_stride, const RowRun<T>* runs,
                                                                int64_t num_runs, float* __restrict acc) {
  switch (count) {
    case 3: return AccumulateValues<V, DH, 3, T>(p, p_stride, runs, num_runs, acc);
    case 2: return AccumulateValues<V, DH, 2, T>(p, p_stride, runs, num_runs, acc);
    case 1: return AccumulateValues<V, DH, 1, T>(p, p_stride, runs, num_runs, acc);
  }
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

// Vectors of int32 lanes as wide as V: an exponent's bits, a lane's index.
template <typename V>
struct IntLanesOf;
template <>
struct IntLanesOf<Vec8> {
  typedef int32_t Type __attribute__((vector_size(32)));
};
template <>
struct IntLanesOf<Vec16> {
  typedef int32_t Type __attribute__((vector_size(64)));
};

// ExpNonPositive (attention_math.h) on every lane: the same arithmetic lane by lane, written
// as vector code because GCC turned the scalar form's clamp into a branch in some inlined
// instances and left their loop scalar (~20 instructions a score; a third of the samples of
// a 304-row prompt step over 2,800 keys).
template <typename V>
__attribute__((always_inline)) inline V ExpNonPositiveLanes(V x) {
  using I = typename IntLanesOf<V>::Type;
  const V floor = V{} - 87.0f;
  x = x < floor ? floor : x;  // std::max(x, -87.0f) lane by lane: -inf becomes a tiny value
  V n;
  const V p = ExpOfRemainder(x, n);
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// std::fabs and std::copysign on every lane, by the sign bits.
template <typename V>
__attribute__((always_inline)) inline V AbsLanes(V x) {
  using I = typename IntLanesOf<V>::Type;
  I bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits &= 0x7fffffff;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

template <typename V>
__attribute__((always_inline)) inline V CopySignLanes(V magnitude, V sign) {
  using I = typename IntLanesOf<V>::Type;
  I m, s;
  std::memcpy(&m, &magnitude, sizeof m);
  std::memcpy(&s, &sign, sizeof s);
  m = (m & 0x7fffffff) | (s & static_cast<int32_t>(0x80000000u));
  std::memcpy(&magnitude, &m, sizeof m);
  return magnitude;
}

// tanh on every lane as plain arithmetic (std::tanh is a library call per score), vector code
// for the reason ExpNonPositiveLanes is: the scalar form's branches left the soft-cap loop
// scalar in most inlined instances. Cephes' tanhf: an odd polynomial below |x| = 0.625, else
// 1 - 2 / (e^2|x| + 1) with e^-2|x| from ExpNonPositiveLanes; relative error a few ulps.
template <typename V>
__attribute__((always_inline)) inline V TanhLanes(V x) {
  const V a = AbsLanes(x), z = x * x;
  V small = V{} - 5.70498872745e-3f;
  small = small * z + 2.06390887954e-2f;
  small = small * z - 5.37397155531e-2f;
  small = small * z + 1.33314422036e-1f;
  small = small * z - 3.33332819422e-1f;
  small = small * z * x + x;
  const V e = ExpNonPositiveLanes(-2.0f * a);
  const V large = CopySignLanes((1.0f - e) / (1.0f + e), x);
  return a < 0.625f ? small : large;
}

// Scores of `group` heads ([group, stride], first n valid; stride as in SoftmaxUpdate)
// soft-capped in place, W lanes at a time (the lanes past n are padding).
template <typename V>
__attribute__((always_inline)) inline void SoftCap(float* __restrict sc, int64_t stride, int64_t n, int64_t group,
                                                   float cap) {
  constexpr int W = kLanesOf<V>;
  const float inv = 1.0f / cap;
  for (int64_t h = 0; h < group; ++h) {
    float* __restrict sh = sc + h * stride;
    for (int64_t t = 0; t < n; t += W) StoreLanes(sh + t, cap * TanhLanes(LaneLoad<V>::From(sh + t) * inv));
  }
}

// Online-softmax update of `group` query heads with the scores `sc` ([group, stride], first
// n valid; stride a multiple of the lanes, at least n rounded up to them) of one unit:
// rescales what was accumulated, turns scores into weights. The weights are summed W lanes
// at a time, then the lanes in order, the same order for every row and batch.
template <typename V>
__attribute__((always_inline)) inline void SoftmaxUpdate(float* __restrict sc, int64_t stride, int64_t n,
                                                         int64_t group, int64_t dh, float* __restrict max,
                                                         float* __restrict denom, float* __restrict acc) {
  constexpr int W = kLanesOf<V>;
  using I = typename IntLanesOf<V>::Type;
  I lane;
  for (int i = 0; i < W; ++i) lane[i] = i;
  for (int64_t h = 0; h < group; ++h) {
    float* __restrict sh = sc + h * stride;
    const float new_max = std::max(max[h], BlockMax<V>(sh, n));
    const float correction = ExpNonPositive(max[h] - new_max);
    V sums = V{};
    for (int64_t t = 0; t < n; t += W) {
      V e = ExpNonPositiveLanes(LaneLoad<V>::From(sh + t) - new_max);
      e = lane < static_cast<int32_t>(n - t) ? e : V{};  // the padding past n weighs nothing
      StoreLanes(sh + t, e);
      sums += e;
    }
    float sum = sums[0];
    for (int i = 1; i < W; ++i) sum += sums[i];
    max[h] = new_max;
    denom[h] = denom[h] * correction + sum;
    if (correction != 1.0f) {
      float* __restrict ah = acc + h * dh;
#pragma omp simd
      for (int64_t d = 0; d < dh; ++d) ah[d] *= correction;
    }
  }
}

}  // namespace

#endif  // RAYLM_ATTENTION_LANES_H_
