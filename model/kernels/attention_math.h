// Paged decode attention's scalar arithmetic (paged_decode_attention.cc): rows of the pools'
// elements widened to float32, exp as plain arithmetic (on a float, or on a vector's lanes by
// attention_lanes.h), and a dot product for head dims without a vectorised instance.
#ifndef RAYLM_ATTENTION_MATH_H_
#define RAYLM_ATTENTION_MATH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bfloat16.h"
#include "fp8_e4m3.h"
#include "lane_loads.h"

namespace {

using raylm::Bf16;
using raylm::Fp8E4m3;
using raylm::ToFloat;

// Cephes' expf up to its last step, on a float or on every lane of a float vector T: x =
// n ln2 + r with n whole (returned in `n`), and P(r) ~ e^r returned, so e^x = 2^n * P(r).
template <typename T>
__attribute__((always_inline)) inline T ExpOfRemainder(T x, T& n) {
  n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const T r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (scores minus their running max) as plain arithmetic, |rel err| < 2e-7
// (ExpNonPositiveLanes, attention_lanes.h, is the same on every lane of a vector).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);  // below this exp underflows; also turns -inf into a tiny value
  float n;
  const float p = ExpOfRemainder(x, n);
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

// Rows `n` of `dh` elements, `stride` apart, widened into `out` ([n, dh], contiguous), for the
// pools AttendUnitOf does not widen in registers (fp8; bfloat16 and int8 in the eight-lane family
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

}  // namespace

#endif  // RAYLM_ATTENTION_MATH_H_
