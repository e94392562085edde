// The integer compute mode's vector families (int8_matmul.cc): AVX-512 VNNI and AVX2 tiles of the
// arithmetic int8_matmul.cc describes, and their quantization of the activations, each the same
// bits as int8_panels.h's portable loops.
#ifndef RAYLM_INT8_FAMILIES_H_
#define RAYLM_INT8_FAMILIES_H_

#include <algorithm>
#include <cstdint>

#include "int8_panels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
#define RAYLM_INT8_VECTOR_FAMILIES 1

// Packed weights per column panel (read again by every block of rows) and quantized rows per
// block: together about half of a core's L2, as in prompt_gemm.inc.
constexpr int64_t kInt8PanelBytes = 256 << 10;
constexpr int64_t kInt8RowBlockBytes = 128 << 10;

// AVX-512 VNNI: sixteen columns a group; vpdpbusd adds four u8 x s8 products per lane, the
// weights being the unsigned operand (nibbles as they are, 8-bit weights + 128, whose extra
// 128 * S per block is subtracted by starting the block's sums at -128 * S; 6-bit weights + 32
// likewise per half block).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

struct VnniFamily {
  static constexpr int kCols = 16;

  // The sixteen d_w or m (`values`) of block b from column c, widened exactly where float16.
  static __m512 Lanes(const Int8Panels& w, const void* values, int64_t c, int64_t b) {
    const int64_t i = w.LaneIndex(c, b);
    if (w.half) {
      const uint16_t* halves = static_cast<const uint16_t*>(values) + i;
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves)));
    }
    return _mm512_loadu_ps(static_cast<const float*>(values) + i);
  }

  // Block b's sixteen d_w and m from column c: the tables' entries, times the block's int8 scale
  // or offset where the tables are two-level (Int8Panels::BlockScale's exact products).
  static __m512 BlockScales(const Int8Panels& w, int64_t c, int64_t b) {
    const __m512 d = Lanes(w, w.d, c, b);
    return w.ScaledTables() ? _mm512_mul_ps(d, SubScaleLanes(w, c, b, 0)) : d;
  }
  static __m512 BlockOffsets(const Int8Panels& w, int64_t c, int64_t b) {
    const __m512 m = Lanes(w, w.m, c, b);
    return w.ScaledTables() ? _mm512_mul_ps(m, SubScaleLanes(w, c, b, 1)) : m;
  }
  // Groups [first, first + groups)'s d_w (into d) and m (into m, where w has them) per block as
  // float32 tables [groups, blocks, 16] (int8_matmul.cc's WithFormedTables). Here, not there:
  // the vectors cross no call between code built for different CPUs.
  static void FormTables(const Int8Panels& w, int64_t first, int64_t groups, float* d, float* m) {
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t b = 0; b < w.blocks; ++b)
        for (int64_t j = 0; j < kGroupCols; j += kCols) {
          const int64_t c = (first + g) * kGroupCols + j, at = (g * w.blocks + b) * kGroupCols + j;
          _mm512_storeu_ps(d + at, BlockScales(w, c, b));
          if (m) _mm512_storeu_ps(m + at, BlockOffsets(w, c, b));
        }
  }
  static __m512 SubScaleLanes(const Int8Panels& w, int64_t c, int64_t b, int h) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.SubScales(c, b, h)));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  }

  // QuantizeRows's arithmetic, two vectors a block: the maximum and the integer sum are exact
  // in any order, and vcvtps2dq rounds to nearest even as nearbyint does.
  static void Quantize(const float* x, int64_t r_begin, int64_t r_end, int64_t K, Int8Rows* out) {
    for (int64_t r = r_begin; r < r_end; ++r)
      for (int64_t b = 0; b < out->blocks; ++b) {
        const float* v = x + r * K + b * kGgufBlock;
        const int64_t count = std::min<int64_t>(kGgufBlock, K - b * kGgufBlock);
        const __mmask16 first = count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
        const __mmask16 second =
            count >= 32 ? 0xFFFF : count > 16 ? static_cast<__mmask16>((1u << (count - 16)) - 1) : 0;
        const __m512 low = _mm512_maskz_loadu_ps(first, v), high = _mm512_maskz_loadu_ps(second, v + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
        const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
        const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
        int8_t* q = out->q.data() + out->At(r, b) * kGgufBlock;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q_low));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q_high));
        SetBlock(out, r, b, amax, _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high)),
                 _mm512_reduce_add_epi32(q_low));
      }
  }

  // Vector t of half h of block b's 6-bit weights u (kSixBits) for the lanes from column c, as
  // bytes 0..63: their low four bits from nibble vector t, their top two from `top` (vector 4 + h).
  static __m512i SixBits(const Int8Panels& w, int64_t c, int64_t b, int h, int t, __m512i top) {
    const __m512i bytes = _mm512_loadu_si512(w.Vector(c, b, t));
    const __m512i low = _mm512_and_si512(h == 0 ? bytes : _mm512_srli_epi16(bytes, 4), _mm512_set1_epi8(0x0F));
    const __m512i high = t < 2 ? _mm512_slli_epi16(top, 4 - 2 * t) : _mm512_srli_epi16(top, 2 * t - 4);
    return _mm512_or_si512(low, _mm512_and_si512(high, _mm512_set1_epi8(0x30)));
  }

  // Rows [m, m + R) against G consecutive groups from column n; writes y[r, n + c] for the
  // first `valid` columns (of G * kCols).
  template <int R, int G, Format F>
  static void Tile(const Int8Rows& a, int64_t m, const Int8Panels& w, float* y, int64_t n, int64_t valid) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
    // kCodes: the codebook's values + 128 (unsigned, as vpdpbusd takes the weights; the sums start
    // at -128 S as 8-bit weights' do) in each 128-bit lane, which the byte shuffle indexes alone.
    const __m512i book = F == Format::kCodes ? _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(
                                                                    reinterpret_cast<const __m128i*>(w.codebook))),
                                                                flip)
                                             : _mm512_setzero_si512();
    __m512 acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w.blocks; ++b) {
      __m512i sums[R][G];
      for (int r = 0; r < R; ++r) {
        const __m512i start =
            F == Format::kNibbles ? _mm512_setzero_si512() : _mm512_set1_epi32(-a.sum128[a.At(m + r, b)]);
        for (int g = 0; g < G; ++g) sums[r][g] = start;
      }
      if constexpr (F == Format::kNibbles || F == Format::kCodes) {
        for (int t = 0; t < 4; ++t) {
          __m512i low[G], high[G];
          for (int g = 0; g < G; ++g) {
            const __m512i bytes = _mm512_loadu_si512(w.Vector(n + g * kCols, b, t));
            low[g] = _mm512_and_si512(bytes, nibble);
            high[g] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
            if constexpr (F == Format::kCodes) {  // the codes' values + 128, as 8-bit weights are read
              low[g] = _mm512_shuffle_epi8(book, low[g]);
              high[g] = _mm512_shuffle_epi8(book, high[g]);
            }
          }
          for (int r = 0; r < R; ++r) {
            const __m512i x_low = _mm512_set1_epi32(a.Four(m + r, b, 4 * t));
            const __m512i x_high = _mm512_set1_epi32(a.Four(m + r, b, 16 + 4 * t));
            for (int g = 0; g < G; ++g) {
              sums[r][g] = _mm512_dpbusd_epi32(sums[r][g], low[g], x_low);
              sums[r][g] = _mm512_dpbusd_epi32(sums[r][g], high[g], x_high);
            }
          }
        }
      } else if constexpr (F == Format::kSixBits) {
        // Each half's sums of u = v + 32 (started at -32 S of its 16 activations, so they are
        // those of v) times the columns' int8 sub-scales, the two added in int32.
        for (int h = 0; h < 2; ++h) {
          __m512i half[R][G], top[G];
          for (int r = 0; r < R; ++r) {
            const int64_t i = a.At(m + r, b);
            const __m512i start = _mm512_set1_epi32((h == 0 ? -a.low128[i] : a.low128[i] - a.sum128[i]) / 4);
            for (int g = 0; g < G; ++g) half[r][g] = start;
          }
          for (int g = 0; g < G; ++g) top[g] = _mm512_loadu_si512(w.Vector(n + g * kCols, b, 4 + h));
          for (int t = 0; t < 4; ++t) {
            __m512i u[G];
            for (int g = 0; g < G; ++g) u[g] = SixBits(w, n + g * kCols, b, h, t, top[g]);
            for (int r = 0; r < R; ++r) {
              const __m512i x = _mm512_set1_epi32(a.Four(m + r, b, 16 * h + 4 * t));
              for (int g = 0; g < G; ++g) half[r][g] = _mm512_dpbusd_epi32(half[r][g], u[g], x);
            }
          }
          for (int g = 0; g < G; ++g) {
            const __m512i scale = _mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.SubScales(n + g * kCols, b, h))));
            for (int r = 0; r < R; ++r) {
              const __m512i scaled = _mm512_mullo_epi32(half[r][g], scale);
              sums[r][g] = h == 0 ? scaled : _mm512_add_epi32(sums[r][g], scaled);
            }
          }
        }
      } else {
        for (int t = 0; t < 8; ++t) {
          __m512i weights[G];
          for (int g = 0; g < G; ++g)
            weights[g] = _mm512_xor_si512(_mm512_loadu_si512(w.Vector(n + g * kCols, b, t)), flip);
          for (int r = 0; r < R; ++r) {
            const __m512i x = _mm512_set1_epi32(a.Four(m + r, b, 4 * t));
            for (int g = 0; g < G; ++g) sums[r][g] = _mm512_dpbusd_epi32(sums[r][g], weights[g], x);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512 d = F == Format::kRowBytes ? _mm512_set1_ps(1.0f) : BlockScales(w, n + g * kCols, b);
        const __m512 offset = F == Format::kNibbles || F == Format::kOffsetBytes ? BlockOffsets(w, n + g * kCols, b)
                                                                                : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r) {
          const __m512 dx = _mm512_set1_ps(a.d[a.At(m + r, b)]);
          acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][g]), _mm512_mul_ps(dx, d), acc[r][g]);
          if constexpr (F == Format::kNibbles || F == Format::kOffsetBytes)
            acc[r][g] = _mm512_fmadd_ps(offset, _mm512_set1_ps(a.ds[a.At(m + r, b)]), acc[r][g]);
        }
        if constexpr (F == Format::kSixBits) {
          if (w.m != nullptr) {  // offsets per 16: o = m_0 S_0 + m_1 S_1 in int32, scaled by d_x * (-dmin)
            const __m512i m0 = _mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.SubScales(n + g * kCols, b, 2))));
            const __m512i m1 = _mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.SubScales(n + g * kCols, b, 3))));
            const __m512 min = Lanes(w, w.m, n + g * kCols, b);
            for (int r = 0; r < R; ++r) {
              const int64_t i = a.At(m + r, b);
              const __m512i high_sum = _mm512_set1_epi32((a.sum128[i] - a.low128[i]) / 128);
              const __m512i o = _mm512_add_epi32(_mm512_mullo_epi32(m0, _mm512_set1_epi32(a.low128[i] / 128)),
                                                 _mm512_mullo_epi32(m1, high_sum));
              acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(o), _mm512_mul_ps(_mm512_set1_ps(a.d[i]), min), acc[r][g]);
            }
          }
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const int64_t count = std::min<int64_t>(kCols, valid - g * kCols);
      if (count <= 0) break;
      const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
      const __m512 scale = F == Format::kRowBytes ? _mm512_maskz_loadu_ps(mask, w.row_scale + n + g * kCols)
                                                  : _mm512_set1_ps(1.0f);
      for (int r = 0; r < R; ++r) {
        const __m512 out = F == Format::kRowBytes ? _mm512_mul_ps(acc[r][g], scale) : acc[r][g];
        _mm512_mask_storeu_ps(y + (m + r) * w.N + n + g * kCols, mask, out);
      }
    }
  }
};

#pragma GCC diagnostic pop
#pragma GCC pop_options

// AVX2: eight columns a group (half of a packed one); vpmaddubsw multiplies u8 x s8 pairs into
// int16 and vpmaddwd adds the pairs into int32. Nibbles and 6-bit values (0..63: pairs up to
// 2 * 63 * 127) are the unsigned operand as they are; for 8-bit weights, |w| <= 128 is, with the
// activation given w's sign (|q_x| <= 127), so no pair sum overflows.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

struct Avx2Family {
  static constexpr int kCols = 8;

  // The eight d_w or m (`values`) of block b from column c, widened exactly where float16.
  static __m256 Lanes(const Int8Panels& w, const void* values, int64_t c, int64_t b) {
    const int64_t i = w.LaneIndex(c, b);
    if (w.half) {
      const uint16_t* halves = static_cast<const uint16_t*>(values) + i;
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
    }
    return _mm256_loadu_ps(static_cast<const float*>(values) + i);
  }

  // As VnniFamily's: block b's eight d_w and m from column c.
  static __m256 BlockScales(const Int8Panels& w, int64_t c, int64_t b) {
    const __m256 d = Lanes(w, w.d, c, b);
    return w.ScaledTables() ? _mm256_mul_ps(d, SubScaleLanes(w, c, b, 0)) : d;
  }
  static __m256 BlockOffsets(const Int8Panels& w, int64_t c, int64_t b) {
    const __m256 m = Lanes(w, w.m, c, b);
    return w.ScaledTables() ? _mm256_mul_ps(m, SubScaleLanes(w, c, b, 1)) : m;
  }
  // Groups [first, first + groups)'s d_w (into d) and m (into m, where w has them) per block as
  // float32 tables [groups, blocks, 16] (int8_matmul.cc's WithFormedTables). Here, not there:
  // the vectors cross no call between code built for different CPUs.
  static void FormTables(const Int8Panels& w, int64_t first, int64_t groups, float* d, float* m) {
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t b = 0; b < w.blocks; ++b)
        for (int64_t j = 0; j < kGroupCols; j += kCols) {
          const int64_t c = (first + g) * kGroupCols + j, at = (g * w.blocks + b) * kGroupCols + j;
          _mm256_storeu_ps(d + at, BlockScales(w, c, b));
          if (m) _mm256_storeu_ps(m + at, BlockOffsets(w, c, b));
        }
  }
  static __m256 SubScaleLanes(const Int8Panels& w, int64_t c, int64_t b, int h) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.SubScales(c, b, h)));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }

  // The sum of eight int32 lanes.
  static int32_t Total(__m256i lanes) {
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(1, 0, 3, 2)));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(sum);
  }

  // QuantizeRows's arithmetic, four vectors a block (as VnniFamily::Quantize; a last partial
  // block is copied into zeros first).
  static void Quantize(const float* x, int64_t r_begin, int64_t r_end, int64_t K, Int8Rows* out) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
    for (int64_t r = r_begin; r < r_end; ++r)
      for (int64_t b = 0; b < out->blocks; ++b) {
        const float* v = x + r * K + b * kGgufBlock;
        const int64_t count = std::min<int64_t>(kGgufBlock, K - b * kGgufBlock);
        alignas(32) float padded[kGgufBlock];
        if (count < kGgufBlock) {
          std::fill(padded + count, padded + kGgufBlock, 0.0f);
          std::copy(v, v + count, padded);
          v = padded;
        }
        __m256 values[4];
        for (int i = 0; i < 4; ++i) values[i] = _mm256_loadu_ps(v + 8 * i);
        __m256 magnitudes[4];
        for (int i = 0; i < 4; ++i) magnitudes[i] = _mm256_and_ps(values[i], magnitude);
        const __m256 wide =
            _mm256_max_ps(_mm256_max_ps(magnitudes[0], magnitudes[1]), _mm256_max_ps(magnitudes[2], magnitudes[3]));
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(wide), _mm256_extractf128_ps(wide, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        const float amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_shuffle_ps(half, half, 1)));
        const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(values[i], inverse));
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out->q.data() + out->At(r, b) * kGgufBlock), bytes);
        const __m256i low = _mm256_add_epi32(q[0], q[1]);
        SetBlock(out, r, b, amax, Total(_mm256_add_epi32(low, _mm256_add_epi32(q[2], q[3]))), Total(low));
      }
  }

  template <int R, int G, Format F>
  static void Tile(const Int8Rows& a, int64_t m, const Int8Panels& w, float* y, int64_t n, int64_t valid) {
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
    // kCodes: the codebook in both 128-bit halves, as the byte shuffle indexes each half alone.
    const __m256i book = F == Format::kCodes ? _mm256_broadcastsi128_si256(
                                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codebook)))
                                             : _mm256_setzero_si256();
    __m256 acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
    // Adds the products of four-byte lanes `weights` (their magnitudes `magnitudes` when signed;
    // unsigned: nibbles and 6-bit values) and the broadcast `x` to `sums`.
    auto add = [&](__m256i& sums, __m256i weights, __m256i magnitudes, __m256i x) {
      const __m256i signed_x = F == Format::kNibbles || F == Format::kSixBits ? x : _mm256_sign_epi8(x, weights);
      sums = _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, signed_x), ones));
    };
    for (int64_t b = 0; b < w.blocks; ++b) {
      __m256i sums[R][G];
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) sums[r][g] = _mm256_setzero_si256();
      if constexpr (F == Format::kNibbles || F == Format::kCodes) {
        for (int t = 0; t < 4; ++t) {
          __m256i low[G], high[G], low_size[G], high_size[G];
          for (int g = 0; g < G; ++g) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.Vector(n + g * kCols, b, t)));
            low[g] = _mm256_and_si256(bytes, nibble);
            high[g] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
            if constexpr (F == Format::kCodes) {  // the codes' signed values, and their magnitudes
              low[g] = _mm256_shuffle_epi8(book, low[g]);
              high[g] = _mm256_shuffle_epi8(book, high[g]);
            }
            low_size[g] = F == Format::kCodes ? _mm256_abs_epi8(low[g]) : low[g];
            high_size[g] = F == Format::kCodes ? _mm256_abs_epi8(high[g]) : high[g];
          }
          for (int r = 0; r < R; ++r) {
            const __m256i x_low = _mm256_set1_epi32(a.Four(m + r, b, 4 * t));
            const __m256i x_high = _mm256_set1_epi32(a.Four(m + r, b, 16 + 4 * t));
            for (int g = 0; g < G; ++g) {
              add(sums[r][g], low[g], low_size[g], x_low);
              add(sums[r][g], high[g], high_size[g], x_high);
            }
          }
        }
      } else if constexpr (F == Format::kSixBits) {
        // As VnniFamily's: each half's sums of u = v + 32 (unsigned, so no sign trick), less 32 S
        // of its activations, times the columns' int8 sub-scales, the two added in int32.
        for (int h = 0; h < 2; ++h) {
          __m256i half[R][G], top[G];
          for (int r = 0; r < R; ++r) {
            const int64_t i = a.At(m + r, b);
            const __m256i start = _mm256_set1_epi32((h == 0 ? -a.low128[i] : a.low128[i] - a.sum128[i]) / 4);
            for (int g = 0; g < G; ++g) half[r][g] = start;
          }
          for (int g = 0; g < G; ++g)
            top[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.Vector(n + g * kCols, b, 4 + h)));
          for (int t = 0; t < 4; ++t) {
            __m256i u[G];
            for (int g = 0; g < G; ++g) {
              const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.Vector(n + g * kCols, b, t)));
              const __m256i low = _mm256_and_si256(h == 0 ? bytes : _mm256_srli_epi16(bytes, 4), nibble);
              const __m256i high = t < 2 ? _mm256_slli_epi16(top[g], 4 - 2 * t) : _mm256_srli_epi16(top[g], 2 * t - 4);
              u[g] = _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
            }
            for (int r = 0; r < R; ++r) {
              const __m256i x = _mm256_set1_epi32(a.Four(m + r, b, 16 * h + 4 * t));
              for (int g = 0; g < G; ++g) add(half[r][g], u[g], u[g], x);
            }
          }
          for (int g = 0; g < G; ++g) {
            const __m256i scale = _mm256_cvtepi8_epi32(
                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.SubScales(n + g * kCols, b, h))));
            for (int r = 0; r < R; ++r)
              sums[r][g] = _mm256_add_epi32(sums[r][g], _mm256_mullo_epi32(half[r][g], scale));
          }
        }
      } else {
        for (int t = 0; t < 8; ++t) {
          __m256i weights[G], magnitudes[G];
          for (int g = 0; g < G; ++g) {
            weights[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.Vector(n + g * kCols, b, t)));
            magnitudes[g] = _mm256_abs_epi8(weights[g]);
          }
          for (int r = 0; r < R; ++r) {
            const __m256i x = _mm256_set1_epi32(a.Four(m + r, b, 4 * t));
            for (int g = 0; g < G; ++g) add(sums[r][g], weights[g], magnitudes[g], x);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m256 d = F == Format::kRowBytes ? _mm256_set1_ps(1.0f) : BlockScales(w, n + g * kCols, b);
        const __m256 offset = F == Format::kNibbles || F == Format::kOffsetBytes ? BlockOffsets(w, n + g * kCols, b)
                                                                                : _mm256_setzero_ps();
        for (int r = 0; r < R; ++r) {
          const __m256 dx = _mm256_set1_ps(a.d[a.At(m + r, b)]);
          acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][g]), _mm256_mul_ps(dx, d), acc[r][g]);
          if constexpr (F == Format::kNibbles || F == Format::kOffsetBytes)
            acc[r][g] = _mm256_fmadd_ps(offset, _mm256_set1_ps(a.ds[a.At(m + r, b)]), acc[r][g]);
        }
        if constexpr (F == Format::kSixBits) {
          if (w.m != nullptr) {  // as VnniFamily's
            const __m256i m0 = _mm256_cvtepi8_epi32(
                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.SubScales(n + g * kCols, b, 2))));
            const __m256i m1 = _mm256_cvtepi8_epi32(
                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.SubScales(n + g * kCols, b, 3))));
            const __m256 min = Lanes(w, w.m, n + g * kCols, b);
            for (int r = 0; r < R; ++r) {
              const int64_t i = a.At(m + r, b);
              const __m256i high_sum = _mm256_set1_epi32((a.sum128[i] - a.low128[i]) / 128);
              const __m256i o = _mm256_add_epi32(_mm256_mullo_epi32(m0, _mm256_set1_epi32(a.low128[i] / 128)),
                                                 _mm256_mullo_epi32(m1, high_sum));
              acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_mul_ps(_mm256_set1_ps(a.d[i]), min), acc[r][g]);
            }
          }
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const int64_t count = std::min<int64_t>(kCols, valid - g * kCols);
      if (count <= 0) break;
      for (int r = 0; r < R; ++r) {
        alignas(32) float out[kCols];
        _mm256_store_ps(out, acc[r][g]);
        float* row = y + (m + r) * w.N + n + g * kCols;
        for (int64_t j = 0; j < count; ++j)
          row[j] = F == Format::kRowBytes ? out[j] * w.row_scale[n + g * kCols + j] : out[j];
      }
    }
  }
};

#pragma GCC pop_options
#endif

}  // namespace

#endif  // RAYLM_INT8_FAMILIES_H_
