// The integer compute mode's matmul for CPU, an XLA FFI custom call (model/int8_matmul.py).
//
// Why: the exact kernels (dense_matmul.cc) widen 4- and 8-bit weights to float32 and multiply-add
// in float32, 16 per instruction on AVX-512. An int8 dot product does 64 multiply-adds per
// instruction (AVX-512 VNNI's vpdpbusd), and llama.cpp computes its Q4/Q8 blocks this way: the
// activations are quantized per row and per block of 32 to int8 (its Q8_0 scheme), each block's
// products summed in integers, and only the block sums scaled in float. Opt-in
// (`model.activation_quantization: int8`): the activations lose precision (model/int8_matmul.py
// says what is measured).
//
// Operands: x [M, K] f32 and the weights as model/int8_panels.py repacked them at load: GGUF
// blocks (Q4_0 / Q4_1 / Q8_0, and int8_g32, held as Q8_0 blocks) or int8 with a scale per output
// row, N output columns in groups of 16.
//
// The arithmetic, the same in every family below and for every M, per row r and output column n:
//   activations, per block b of 32 (the last one zero-padded): a = max |x|, d_x = a / 127,
//     q_x = nearest-even(x * (127 / a)) (0 when a = 0), S = sum of the block's q_x;
//   i_b = sum over the block of q_x * v, v the stored weight integer: the nibble 0..15 of a 4-bit
//     block, the signed byte of an 8-bit one (exact in int32);
//   acc = fma(float(i_b), d_x * d_w, acc) for b in order (d_w: the block's scale, 1 for
//     per-row int8), then for 4-bit blocks acc = fma(m, d_x * S, acc) with m the block's offset
//     (w = d_w * v + m covers Q4_1 and Q4_0's m = -8 d_w: llama.cpp's q8_1 sum term);
//   y = acc (GGUF blocks) or acc * scale[n] (per-row int8).
// Integer sums are exact whatever the instruction, and each output's float operations are this
// one sequence, so a row's result does not depend on the batch, the tile, the thread or the
// family (VNNI, AVX2 and the portable loops agree bit for bit), and one loop nest serves decode
// rows and prompt chunks alike.
//
// Layout (model/int8_panels.py): for each group of 16 output columns and each block, T 64-byte
// vectors (T = 4 for 4-bit blocks, 8 for 8-bit weights) whose 4-byte lane j holds column j's bytes
// 4t..4t+3 of the block as stored (4-bit: weights 4t..4t+3 in the low nibbles, 16+4t..19+4t in the
// high ones), then the group's 16 d_w and 16 m per block in arrays of their own. A broadcast of
// four activation bytes against such a vector adds four products to each of the group's columns,
// so a block's integer sums end up one per lane, with no horizontal additions. The layout is made
// once at load, so a call streams the weights in the order it reads them: a decode row reads each
// weight byte once, as the exact kernels do. AVX2's eight-column groups are the halves of a
// sixteen-column one.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "column_items.h"
#include "ffi_shape.h"
#include "float16.h"
#include "gguf_blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using raylm::kGgufBlock;

namespace {

using Matrix = ffi::Buffer<ffi::F32, 2>;
using RowScale = ffi::Buffer<ffi::F32, 1>;  // [N or 0]

constexpr int64_t kGroupCols = 16;  // output columns of one packed group
constexpr int64_t kVectorBytes = 64;

// One call's activations, quantized (see the arithmetic above): row r's block b holds 32 values
// at q[(r * blocks + b) * 32], its d_x, d_x * S and 128 * S.
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> sum128;
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
}

// Stores block b of row r's scale and sums (the values are in place).
inline void SetBlock(Int8Rows* out, int64_t r, int64_t b, float amax, int32_t sum) {
  const float d = amax / 127.0f;
  out->d[out->At(r, b)] = d;
  out->ds[out->At(r, b)] = d * static_cast<float>(sum);
  out->sum128[out->At(r, b)] = 128 * sum;
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
      int32_t sum = 0;
      for (int64_t k = 0; k < count; ++k) {
        // |v * inverse| <= 127 * (1 + 2^-23): it rounds to at most 127.
        const int32_t value = static_cast<int32_t>(std::nearbyint(v[k] * inverse));
        q[k] = static_cast<int8_t>(value);
        sum += value;
      }
      SetBlock(out, r, b, amax, sum);
    }
}

// The three weight formats; each is its own instantiation of the tiles.
enum class Format {
  kNibbles,     // 4-bit GGUF blocks: d_w and m per block
  kBlockBytes,  // Q8_0 blocks and int8_g32: signed bytes, d_w per block
  kRowBytes,    // per-row int8: signed bytes, d_w = 1, a scale per output column at the end
};

// The packed weights (model/int8_panels.py): q [groups, blocks, T, 16, 4] bytes, d and m
// [groups, blocks, 16] (absent: null) in float32, or in float16 (`half`) where the values are
// float16's, as GGUF stores them (a sixth less to read per 4-bit weight: a decode row streams
// every byte of the matrix once), row_scale [N] (absent: null).
struct Int8Panels {
  const uint8_t* q;
  const void* d;
  const void* m;
  const float* row_scale;
  int64_t N, K, blocks;
  Format format = Format::kNibbles;
  bool half = false;

  int Vectors() const { return format == Format::kNibbles ? 4 : 8; }
  // Vector t of block b for the lanes from column c (c a multiple of 8: AVX2 reads half groups).
  const uint8_t* Vector(int64_t c, int64_t b, int t) const {
    return q + (((c / kGroupCols) * blocks + b) * Vectors() + t) * kVectorBytes + (c % kGroupCols) * 4;
  }
  // Where block b's d_w or m are for the lanes from column c, in values of their type.
  int64_t LaneIndex(int64_t c, int64_t b) const {
    return ((c / kGroupCols) * blocks + b) * kGroupCols + c % kGroupCols;
  }
  // Block b's d_w or m (`values`: d or m) of column n.
  float Lane(const void* values, int64_t n, int64_t b) const {
    const int64_t i = LaneIndex(n, b);
    return half ? raylm::HalfToFloat(static_cast<const uint16_t*>(values)[i]) : static_cast<const float*>(values)[i];
  }
  // Weight k of column n as the integer the sums use.
  int32_t Value(int64_t n, int64_t k) const {
    const int64_t b = k / kGgufBlock, i = k % kGgufBlock;
    const int64_t byte = format == Format::kNibbles ? i % 16 : i;
    const uint8_t stored = Vector(n - n % kGroupCols, b, static_cast<int>(byte / 4))[(n % kGroupCols) * 4 + byte % 4];
    if (format != Format::kNibbles) return static_cast<int8_t>(stored);
    return i < 16 ? stored & 0x0F : stored >> 4;
  }
};

// The portable family: the arithmetic above as plain loops.
void PortableColumns(const Int8Rows& a, const Int8Panels& w, float* y, int64_t M, int64_t n_begin, int64_t n_end) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = n_begin; n < n_end; ++n) {
      float acc = 0.0f;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const int8_t* xq = a.Block(r, b);
        int32_t sum = 0;
        for (int64_t k = 0; k < kGgufBlock; ++k) sum += xq[k] * w.Value(n, b * kGgufBlock + k);
        const float dw = w.format == Format::kRowBytes ? 1.0f : w.Lane(w.d, n, b);
        acc = std::fma(static_cast<float>(sum), a.d[a.At(r, b)] * dw, acc);
        if (w.format == Format::kNibbles) acc = std::fma(w.Lane(w.m, n, b), a.ds[a.At(r, b)], acc);
      }
      y[r * w.N + n] = w.format == Format::kRowBytes ? acc * w.row_scale[n] : acc;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define RAYLM_INT8_VECTOR_FAMILIES 1

// AVX-512 VNNI: sixteen columns a group; vpdpbusd adds four u8 x s8 products per lane, the
// weights being the unsigned operand (nibbles as they are, 8-bit weights + 128, whose extra
// 128 * S per block is subtracted by starting the block's sums at -128 * S).
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

  // QuantizeRows's arithmetic, two vectors a block: the maximum and the integer sum are exact
  // in any order, and vcvtps2dq rounds to nearest even as nearbyint does.
  static void Quantize(const float* x, int64_t r_begin, int64_t r_end, int64_t K, Int8Rows* out) {
    for (int64_t r = r_begin; r < r_end; ++r)
      for (int64_t b = 0; b < out->blocks; ++b) {
        const float* v = x + r * K + b * kGgufBlock;
        const int64_t count = std::min<int64_t>(kGgufBlock, K - b * kGgufBlock);
        const __mmask16 first = count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
        const __mmask16 second = count >= 32 ? 0xFFFF : count > 16 ? static_cast<__mmask16>((1u << (count - 16)) - 1) : 0;
        const __m512 low = _mm512_maskz_loadu_ps(first, v), high = _mm512_maskz_loadu_ps(second, v + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
        const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
        const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
        int8_t* q = out->q.data() + out->At(r, b) * kGgufBlock;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q_low));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q_high));
        SetBlock(out, r, b, amax, _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high)));
      }
  }

  // Rows [m, m + R) against G consecutive groups from column n; writes y[r, n + c] for the
  // first `valid` columns (of G * kCols).
  template <int R, int G, Format F>
  static void Tile(const Int8Rows& a, int64_t m, const Int8Panels& w, float* y, int64_t n, int64_t valid) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
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
      if constexpr (F == Format::kNibbles) {
        for (int t = 0; t < 4; ++t) {
          __m512i low[G], high[G];
          for (int g = 0; g < G; ++g) {
            const __m512i bytes = _mm512_loadu_si512(w.Vector(n + g * kCols, b, t));
            low[g] = _mm512_and_si512(bytes, nibble);
            high[g] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
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
        const __m512 d = F == Format::kRowBytes ? _mm512_set1_ps(1.0f) : Lanes(w, w.d, n + g * kCols, b);
        for (int r = 0; r < R; ++r) {
          const __m512 dx = _mm512_set1_ps(a.d[a.At(m + r, b)]);
          acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][g]), _mm512_mul_ps(dx, d), acc[r][g]);
          if constexpr (F == Format::kNibbles)
            acc[r][g] = _mm512_fmadd_ps(Lanes(w, w.m, n + g * kCols, b),
                                        _mm512_set1_ps(a.ds[a.At(m + r, b)]), acc[r][g]);
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
// int16 and vpmaddwd adds the pairs into int32. Nibbles are the unsigned operand as they are; for
// 8-bit weights, |w| <= 128 is, with the activation given w's sign (|q_x| <= 127), so no pair sum
// overflows.
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
        const __m256 wide = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(values[0], magnitude), _mm256_and_ps(values[1], magnitude)),
                                          _mm256_max_ps(_mm256_and_ps(values[2], magnitude), _mm256_and_ps(values[3], magnitude)));
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(wide), _mm256_extractf128_ps(wide, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        const float amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_shuffle_ps(half, half, 1)));
        const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(values[i], inverse));
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out->q.data() + out->At(r, b) * kGgufBlock), bytes);
        const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(1, 0, 3, 2)));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(2, 3, 0, 1)));
        SetBlock(out, r, b, amax, _mm_cvtsi128_si32(sum));
      }
  }

  template <int R, int G, Format F>
  static void Tile(const Int8Rows& a, int64_t m, const Int8Panels& w, float* y, int64_t n, int64_t valid) {
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
    __m256 acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
    // Adds the products of four-byte lanes `weights` (their magnitudes `magnitudes` when signed)
    // and the broadcast `x` to `sums`.
    auto add = [&](__m256i& sums, __m256i weights, __m256i magnitudes, __m256i x) {
      const __m256i signed_x = F == Format::kNibbles ? x : _mm256_sign_epi8(x, weights);
      sums = _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, signed_x), ones));
    };
    for (int64_t b = 0; b < w.blocks; ++b) {
      __m256i sums[R][G];
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) sums[r][g] = _mm256_setzero_si256();
      if constexpr (F == Format::kNibbles) {
        for (int t = 0; t < 4; ++t) {
          __m256i low[G], high[G];
          for (int g = 0; g < G; ++g) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.Vector(n + g * kCols, b, t)));
            low[g] = _mm256_and_si256(bytes, nibble);
            high[g] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
          }
          for (int r = 0; r < R; ++r) {
            const __m256i x_low = _mm256_set1_epi32(a.Four(m + r, b, 4 * t));
            const __m256i x_high = _mm256_set1_epi32(a.Four(m + r, b, 16 + 4 * t));
            for (int g = 0; g < G; ++g) {
              add(sums[r][g], low[g], low[g], x_low);
              add(sums[r][g], high[g], high[g], x_high);
            }
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
        const __m256 d = F == Format::kRowBytes ? _mm256_set1_ps(1.0f) : Lanes(w, w.d, n + g * kCols, b);
        for (int r = 0; r < R; ++r) {
          const __m256 dx = _mm256_set1_ps(a.d[a.At(m + r, b)]);
          acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][g]), _mm256_mul_ps(dx, d), acc[r][g]);
          if constexpr (F == Format::kNibbles)
            acc[r][g] = _mm256_fmadd_ps(Lanes(w, w.m, n + g * kCols, b),
                                        _mm256_set1_ps(a.ds[a.At(m + r, b)]), acc[r][g]);
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

enum class Int8Family { kPortable, kAvx2, kVnni };

// The family this process runs, chosen once: VNNI where the CPU has AVX-512 VNNI, else AVX2,
// else the portable loops. RAYLM_INT8_MATMUL_FAMILY=avx2 / portable picks a lower one (tests
// check every family on one machine; all give the same bits).
Int8Family ChosenFamily() {
  static const Int8Family family = [] {
#ifdef RAYLM_INT8_VECTOR_FAMILIES
    const char* forced = std::getenv("RAYLM_INT8_MATMUL_FAMILY");
    const std::string force = forced ? forced : "";
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const bool vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512vnni");
    if (force != "portable" && vnni && force != "avx2") return Int8Family::kVnni;
    if (force != "portable" && avx2) return Int8Family::kAvx2;
#endif
    return Int8Family::kPortable;
  }();
  return family;
}

#ifdef RAYLM_INT8_VECTOR_FAMILIES
// Packed weights per column panel (read again by every block of rows) and quantized rows per
// block: together about half of a core's L2, as in prompt_gemm.inc.
constexpr int64_t kInt8PanelBytes = 256 << 10;
constexpr int64_t kInt8RowBlockBytes = 128 << 10;
constexpr int kInt8Rows = 4;  // rows per tile

template <typename Family, int G, Format F>
void TileRows(int64_t rows, const Int8Rows& a, int64_t m, const Int8Panels& w, float* y, int64_t n, int64_t valid) {
  switch (rows) {
    case 4: return Family::template Tile<4, G, F>(a, m, w, y, n, valid);
    case 3: return Family::template Tile<3, G, F>(a, m, w, y, n, valid);
    case 2: return Family::template Tile<2, G, F>(a, m, w, y, n, valid);
    case 1: return Family::template Tile<1, G, F>(a, m, w, y, n, valid);
  }
}

// Output columns [n_begin, n_end) (n_begin a multiple of 16) for all M rows: a panel of columns
// at a time, every block of rows passing it, two groups of the family and four rows a tile. At a
// few rows this is one pass over the columns, each weight byte read once.
template <typename Family, Format F>
void VectorColumns(const Int8Rows& a, const Int8Panels& w, float* y, int64_t M, int64_t n_begin, int64_t n_end) {
  constexpr int C = Family::kCols;
  const int64_t group_bytes = w.blocks * (w.Vectors() * kVectorBytes + 2 * kGroupCols * (w.half ? 2 : 4));
  const int64_t panel_cols = std::max<int64_t>(2, kInt8PanelBytes / group_bytes) * kGroupCols;
  const int64_t block_rows =
      std::max<int64_t>(kInt8Rows, kInt8RowBlockBytes / (w.blocks * kGgufBlock) / kInt8Rows * kInt8Rows);
  for (int64_t p = n_begin; p < n_end; p += panel_cols) {
    const int64_t p_end = std::min(n_end, p + panel_cols);
    for (int64_t m_begin = 0; m_begin < M; m_begin += block_rows) {
      const int64_t m_end = std::min(M, m_begin + block_rows);
      for (int64_t n = p; n < p_end; n += 2 * C) {
        const int64_t valid = std::min<int64_t>(2 * C, p_end - n);
        for (int64_t m = m_begin; m < m_end; m += kInt8Rows) {
          const int64_t rows = std::min<int64_t>(kInt8Rows, m_end - m);
          if (valid > C)
            TileRows<Family, 2, F>(rows, a, m, w, y, n, valid);
          else
            TileRows<Family, 1, F>(rows, a, m, w, y, n, valid);
        }
      }
    }
  }
}

template <typename Family>
void VectorColumns(const Int8Rows& a, const Int8Panels& w, float* y, int64_t M, int64_t n_begin, int64_t n_end) {
  switch (w.format) {
    case Format::kNibbles: return VectorColumns<Family, Format::kNibbles>(a, w, y, M, n_begin, n_end);
    case Format::kBlockBytes: return VectorColumns<Family, Format::kBlockBytes>(a, w, y, M, n_begin, n_end);
    case Format::kRowBytes: return VectorColumns<Family, Format::kRowBytes>(a, w, y, M, n_begin, n_end);
  }
}
#endif

// y [M, N] = the integer mode's x . w^T, the columns split over the calling thread and the pool.
void RunInt8Matmul(const float* x, const Int8Panels& w, float* y, int64_t M, ffi::ThreadPool& pool) {
  Int8Rows a;
  AllocateRows(M, w.K, &a);
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t per_item = (w.N + threads * raylm::kPromptItemsPerThread - 1) / (threads * raylm::kPromptItemsPerThread);
  const int64_t item = (per_item + kGroupCols - 1) / kGroupCols * kGroupCols;  // whole packed groups
  const Int8Family family = ChosenFamily();
  // The activations, quantized by rows over the same threads (on one thread they were up to a
  // fifth of a 64-row call; a decode step's few rows stay on the calling thread).
  const int64_t rows_per_item = std::max<int64_t>(1, (M + threads * 2 - 1) / (threads * 2));
  raylm::Run(
      M, w.K, 0,
      [x, &w, &a, family](int64_t b, int64_t e, float*) {
#ifdef RAYLM_INT8_VECTOR_FAMILIES
        if (family == Int8Family::kVnni) return VnniFamily::Quantize(x, b, e, w.K, &a);
        if (family == Int8Family::kAvx2) return Avx2Family::Quantize(x, b, e, w.K, &a);
#endif
        QuantizeRows(x, b, e, w.K, &a);
      },
      pool, rows_per_item);
  const int64_t N = w.N;
  raylm::Run(
      N, w.K, 0,
      [&a, &w, y, M, family](int64_t b, int64_t e, float*) {
#ifdef RAYLM_INT8_VECTOR_FAMILIES
        if (family == Int8Family::kVnni) return VectorColumns<VnniFamily>(a, w, y, M, b, e);
        if (family == Int8Family::kAvx2) return VectorColumns<Avx2Family>(a, w, y, M, b, e);
#endif
        PortableColumns(a, w, y, M, b, e);
      },
      pool, item);
}

// Checks the packed operands against x [M, K] and y [M, N]; an empty message when they agree.
std::string PanelError(const Matrix& x, const ffi::AnyBuffer& q, const ffi::AnyBuffer& d, const ffi::AnyBuffer& m,
                       const RowScale& row_scale, const Matrix& y, Format* format, bool* half) {
  const int64_t K = x.dimensions()[1], N = y.dimensions()[1];
  const int64_t groups = (N + kGroupCols - 1) / kGroupCols, blocks = (K + kGgufBlock - 1) / kGgufBlock;
  const bool nibbles = q.element_type() == ffi::DataType::U8;
  if (!nibbles && q.element_type() != ffi::DataType::S8) return "q must be uint8 (4-bit blocks) or int8";
  const auto qd = q.dimensions();
  const bool q_ok = qd.size() == 5 && qd[0] == groups && qd[1] == blocks && qd[2] == (nibbles ? 4 : 8) &&
                    qd[3] == kGroupCols && qd[4] == 4;
  if (d.dimensions().size() != 3 || m.dimensions().size() != 3) return "d and m must be 3-D";
  *half = d.element_type() == ffi::DataType::F16;
  if ((!*half && d.element_type() != ffi::DataType::F32) || m.element_type() != d.element_type())
    return "d and m must both be float32 or both float16";
  const bool has_d = d.dimensions()[2] == kGroupCols, has_m = m.dimensions()[2] == kGroupCols;
  const bool has_row_scale = row_scale.dimensions()[0] == N && N > 0;
  *format = nibbles ? Format::kNibbles : has_d ? Format::kBlockBytes : Format::kRowBytes;
  const bool tables_ok = (d.dimensions()[2] == 0 || has_d) && (m.dimensions()[2] == 0 || has_m) &&
                         (!has_d || (d.dimensions()[0] == groups && d.dimensions()[1] == blocks)) &&
                         (!has_m || (m.dimensions()[0] == groups && m.dimensions()[1] == blocks)) &&
                         (row_scale.dimensions()[0] == 0 || has_row_scale);
  const bool format_ok = nibbles ? has_d && has_m && !has_row_scale : !has_m && has_d != has_row_scale;
  const bool blocks_ok = *format == Format::kRowBytes || K % kGgufBlock == 0;
  if (q_ok && tables_ok && format_ok && blocks_ok && y.dimensions()[0] == x.dimensions()[0]) return "";
  return "x " + raylm::Shape(x.dimensions()) + " against packed q " + raylm::Shape(qd) + " (" +
         (nibbles ? "uint8" : "int8") + "), d " + raylm::Shape(d.dimensions()) + ", m " + raylm::Shape(m.dimensions()) +
         ", row_scale " + raylm::Shape(row_scale.dimensions()) + " and y " + raylm::Shape(y.dimensions()) +
         ": expected q [" + std::to_string(groups) + ", " + std::to_string(blocks) + ", 4 or 8, 16, 4], d and m [" +
         std::to_string(groups) + ", " + std::to_string(blocks) +
         ", 16 or 0] (4-bit: both; 8-bit: d or row_scale [N]; float32 or float16), K whole blocks unless per-row int8";
}

ffi::Error Int8PanelMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer q, ffi::AnyBuffer d,
                           ffi::AnyBuffer m, RowScale row_scale, ffi::Result<Matrix> y) {
  Format format = Format::kNibbles;
  bool half = false;
  const std::string error = PanelError(x, q, d, m, row_scale, *y, &format, &half);
  if (!error.empty()) return ffi::Error::InvalidArgument("int8_panel_matmul: " + error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = y->dimensions()[1];
  if (M == 0 || N == 0) return ffi::Error::Success();
  const Int8Panels w{static_cast<const uint8_t*>(q.untyped_data()),
                     format == Format::kRowBytes ? nullptr : d.untyped_data(),
                     format == Format::kNibbles ? m.untyped_data() : nullptr,
                     format == Format::kRowBytes ? row_scale.typed_data() : nullptr,
                     N, K, (K + kGgufBlock - 1) / kGgufBlock, format, half};
  RunInt8Matmul(x.typed_data(), w, y->typed_data(), M, thread_pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmInt8PanelMatmul, Int8PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<RowScale>()
                                  .Ret<Matrix>());
