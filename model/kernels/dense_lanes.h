// The dense kernel's vector lanes (dense_matmul.cc; the grouped and LoRA kernels run the same
// tiles): Lanes<V> loads float32, 8-bit, bfloat16 and float16 weights into a V of float32 lanes, widened
// exactly, and sums a V's lanes in its fixed order (lane_loads.h's ToFloat widens one value at a
// time, for the tiles' k tails).
#ifndef RAYLM_DENSE_LANES_H_
#define RAYLM_DENSE_LANES_H_

#include <cstdint>
#include <cstring>

#include "bfloat16.h"
#include "fp8_e4m3.h"
#include "lane_loads.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace {

using raylm::Bf16;
using raylm::Fp16;
using raylm::Fp8E4m3;
using raylm::ToFloat;

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
  // float32, int8, bfloat16 (LoRA slots, lora_delta.cc; 16-bit weight matrices) and float16 as
  // lane_loads.h widens them; 8-bit floats and 4-bit blocks from the same bytes at the lanes' tops.
  using Loads = raylm::LaneLoad<Vec8>;
  using I32x8 = Loads::I32x8;
  using U32x8 = Loads::U32x8;

  static Vec8 Load(const float* p) { return Loads::From(p); }
  static Vec8 Load(const int8_t* p) { return Loads::From(p); }
  static Vec8 Load(const Bf16* p) { return Loads::From(p); }
  static Vec8 Load(const Fp16* p) { return Loads::From(p); }
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
    WidenNibbles(p, d, m, d, m, low, high);
  }

  // The same with a scale and offset of their own for the low and the high halves (blocks of
  // two 16-weight groups).
  static void WidenNibbles(const uint8_t* p, float d_low, float m_low, float d_high, float m_high, Vec8* low,
                           Vec8* high) {
    LoadNibbles(p, low, high);
    *low = d_low * *low + m_low;  // exact with or without a fused multiply-add
    *high = d_high * *high + m_high;
  }

  // The eight bytes at p as 4-bit codes into `codebook` (16 floats), weights d * codebook[q]: a
  // lookup per weight, then the one rounding of d * value.
  static void WidenCodes(const uint8_t* p, const float* codebook, float d_low, float d_high, Vec8* low,
                         Vec8* high) {
    Vec8 low_values{}, high_values{};
    for (int i = 0; i < 8; ++i) {
      low_values[i] = codebook[p[i] & 0x0F];
      high_values[i] = codebook[p[i] >> 4];
    }
    *low = d_low * low_values;
    *high = d_high * high_values;
  }

  static float Sum(Vec8 v) {  // in lane order
    float s = 0.0f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
  }

  static constexpr bool kSumsTiles = false;  // see Lanes<Vec16>::SumTile
};

#if defined(__x86_64__) && defined(__GNUC__)
// The sixteen-lane family (Lanes<Vec16> here, WideTiles in dense_tiles.h) is compiled.
#define RAYLM_WIDE_TILES 1
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
// GCC 12 reports its own _mm512_undefined_* placeholders inside these intrinsics as
// (maybe-)uninitialized (a known false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

using raylm::Vec16;

template <>
struct Lanes<Vec16> {
  typedef float Vec4 __attribute__((vector_size(16)));
  typedef uint32_t U32x16 __attribute__((vector_size(64)));

  // float32, int8, bfloat16 and float16 as lane_loads.h widens them (intrinsics), 8-bit floats here.
  static Vec16 Load(const float* p) { return raylm::LaneLoad<Vec16>::From(p); }
  static Vec16 Load(const int8_t* p) { return raylm::LaneLoad<Vec16>::From(p); }
  static Vec16 Load(const Bf16* p) { return raylm::LaneLoad<Vec16>::From(p); }
  static Vec16 Load(const Fp16* p) { return raylm::LaneLoad<Vec16>::From(p); }

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

  // The same with a table of its own for the low and the high halves (two 16-weight groups).
  static void WidenNibbles(const uint8_t* p, float d_low, float m_low, float d_high, float m_high, Vec16* low,
                           Vec16* high) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 low_table = _mm512_fmadd_ps(_mm512_set1_ps(d_low), q, _mm512_set1_ps(m_low));
    const __m512 high_table = _mm512_fmadd_ps(_mm512_set1_ps(d_high), q, _mm512_set1_ps(m_high));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    *low = reinterpret_cast<Vec16>(_mm512_permutexvar_ps(bytes, low_table));
    *high = reinterpret_cast<Vec16>(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), high_table));
  }

  // The sixteen bytes at p as 4-bit codes into `codebook` (16 floats), weights d * codebook[q]: the
  // table is d * codebook (one multiply, each entry's one rounding), then a permute per sixteen
  // weights, as WidenNibbles.
  static void WidenCodes(const uint8_t* p, const float* codebook, float d_low, float d_high, Vec16* low,
                         Vec16* high) {
    const __m512 values = _mm512_loadu_ps(codebook);
    const __m512 low_table = _mm512_mul_ps(_mm512_set1_ps(d_low), values);
    const __m512 high_table = _mm512_mul_ps(_mm512_set1_ps(d_high), values);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    *low = reinterpret_cast<Vec16>(_mm512_permutexvar_ps(bytes, low_table));
    *high = reinterpret_cast<Vec16>(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), high_table));
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

#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

}  // namespace

#endif  // RAYLM_DENSE_LANES_H_
