// Loads of float32, int8, bfloat16 and float16 values into vectors of float32 lanes, widened exactly in
// registers: shared by the matmul tiles (dense_matmul.cc, which adds its own 8-bit float and
// 4-bit loads) and decode attention (paged_decode_attention.cc, for 16- and 8-bit KV pools).
// LaneLoad<Vec8> is plain vector-extension code that every target_clones clone compiles;
// LaneLoad<Vec16> is for AVX-512 (x86-64-v4) code only. ToFloat widens one value of each format
// the kernels read (float8 e4m3fn too), for their scalar loops and k tails.
#ifndef RAYLM_LANE_LOADS_H_
#define RAYLM_LANE_LOADS_H_

#include <cstdint>
#include <cstring>

#include "bfloat16.h"
#include "float16.h"
#include "fp8_e4m3.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace raylm {

inline float ToFloat(float x) { return x; }
inline float ToFloat(int8_t x) { return static_cast<float>(x); }
inline float ToFloat(Fp8E4m3 x) { return Fp8ToFloat(x); }
inline float ToFloat(Bf16 x) { return Bf16ToFloat(x); }  // exact: the high half of a float32
inline float ToFloat(Fp16 x) { return Fp16ToFloat(x); }  // exact: every float16 is a float32

typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec16 __attribute__((vector_size(64)));

template <typename V>
struct LaneLoad;

template <>
struct LaneLoad<Vec8> {
  typedef int8_t I8x32 __attribute__((vector_size(32)));
  typedef int32_t I32x8 __attribute__((vector_size(32)));
  typedef uint16_t U16x8 __attribute__((vector_size(16)));
  typedef uint32_t U32x8 __attribute__((vector_size(32)));
  typedef int64_t I64x4 __attribute__((vector_size(32)));

  static Vec8 From(const float* p) {
    Vec8 v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }

  // The eight bytes at p, byte i at the top of 32-bit lane i (one broadcast load and one byte
  // shuffle; plain vector extensions, which GCC lowers well for every clone, where a direct
  // int8 -> float conversion came out scalar). Every 8-bit format starts from here.
  static I32x8 BytesAtLaneTops(const void* p) {
    int64_t bits;
    std::memcpy(&bits, p, sizeof bits);
    const I64x4 copies = {bits, bits, bits, bits};
    I8x32 bytes;
    std::memcpy(&bytes, &copies, sizeof bytes);
    // The shuffle stays within each 16-byte half (a single vpshufb): the upper half's lanes
    // take bytes 4..7 of their own copy.
    const I8x32 index = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                         20, 20, 20, 20, 21, 21, 21, 21, 22, 22, 22, 22, 23, 23, 23, 23};
    const I8x32 moved = __builtin_shuffle(bytes, index);
    I32x8 lanes;
    std::memcpy(&lanes, &moved, sizeof lanes);
    return lanes;
  }

  // int8: an arithmetic shift sign-extends the top byte, then an exact conversion.
  static Vec8 From(const int8_t* p) { return __builtin_convertvector(BytesAtLaneTops(p) >> 24, Vec8); }

  // bfloat16: each value to the top half of its lane.
  static Vec8 From(const Bf16* p) { return LoadBf16Lanes<Vec8, U16x8, U32x8>(p); }

  // float16: bit arithmetic every clone compiles (float16.h). GCC's own _Float16 conversion
  // calls a library function per value in the default clone, and F16C's vcvtph2ps cannot be
  // named in code the default clone also compiles.
  static Vec8 From(const Fp16* p) { return LoadFp16Lanes<Vec8, U16x8, U32x8>(p); }
};

#if defined(__x86_64__) && defined(__GNUC__)
#define RAYLM_WIDE_LANE_LOADS 1
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
// GCC 12 reports its own _mm512_undefined_* placeholders inside these intrinsics as
// (maybe-)uninitialized (a known false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
template <>
struct LaneLoad<Vec16> {
  static Vec16 From(const float* p) {
    Vec16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }

  // The widening steps are intrinsics: GCC's vector extensions turned them into scalar code
  // here (one-row int8 matmul calls 3.5x slower than the eight-lane clone).
  static Vec16 From(const int8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<Vec16>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
  }

  static Vec16 From(const Bf16* p) {
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return reinterpret_cast<Vec16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
  }

  // float16 by F16C's AVX-512 form (vcvtph2ps): exact, as HalfToFloat.
  static Vec16 From(const Fp16* p) {
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return reinterpret_cast<Vec16>(_mm512_cvtph_ps(halves));
  }
};
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

}  // namespace raylm

#endif  // RAYLM_LANE_LOADS_H_
