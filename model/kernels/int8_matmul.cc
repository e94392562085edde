// The integer compute mode's matmul for CPU, XLA FFI custom calls (model/int8_matmul.py).
//
// Why: the exact kernels (dense_matmul.cc) widen 4- and 8-bit weights to float32 and multiply-add
// in float32, 16 per instruction on AVX-512. An int8 dot product does 64 multiply-adds per
// instruction (AVX-512 VNNI's vpdpbusd), and llama.cpp computes its Q4/Q8 blocks this way: the
// activations are quantized per row and per block of 32 to int8 (its Q8_0 scheme), each block's
// products summed in integers, and only the block sums scaled in float. Opt-in
// (`model.activation_quantization: int8`): the activations lose precision (model/int8_matmul.py
// says what is measured).
//
// Operands: x [M, K] f32 and weights kept as stored, either GGUF blocks (Q4_0 / Q4_1 / Q8_0, and
// int8_g32, which is held as Q8_0 blocks; gguf_blocks.h) or int8 with a scale per output row.
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
// Layout: the activations are quantized once per call; the weights are repacked per call, a
// group of output columns at a time (16 for AVX-512, 8 for AVX2), into an L2-sized panel where
// each block is eight vectors whose lane j holds four consecutive weights of column j, as
// unsigned bytes. A broadcast of four activation bytes against such a vector adds four products
// to each of the group's columns, so a block's integer sums end up one per lane, with no
// horizontal additions; the panel is reused by every row.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
// Before dense_matmul.cc, which includes it inside its AVX-512 region: included here, outside any
// target pragma, each intrinsic keeps its own ISA, so the AVX2 family below can use them too.
#include <immintrin.h>
#endif

#include "dense_matmul.cc"

namespace {

// One call's activations, quantized (see the arithmetic above): row r's block b holds 32 values
// at q[(r * blocks + b) * 32], its d_x, d_x * S and 128 * S.
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> sum128;
  int64_t blocks = 0;

  const int8_t* Block(int64_t r, int64_t b) const { return q.data() + (r * blocks + b) * raylm::kGgufBlock; }
  int64_t At(int64_t r, int64_t b) const { return r * blocks + b; }
};

// Buffers for M rows of K inputs (values zero, so a last partial block is padded with zeros).
void AllocateRows(int64_t M, int64_t K, Int8Rows* out) {
  const int64_t blocks = (K + raylm::kGgufBlock - 1) / raylm::kGgufBlock;
  out->blocks = blocks;
  out->q.assign(M * blocks * raylm::kGgufBlock, 0);
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

// The quantization by plain loops (the AVX2 and portable families; VNNI's gives the same bits).
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void QuantizeRows(const float* x, int64_t M, int64_t K, Int8Rows* out) {
  const int64_t blocks = out->blocks;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + r * K + b * raylm::kGgufBlock;
      const int64_t count = std::min<int64_t>(raylm::kGgufBlock, K - b * raylm::kGgufBlock);
      float amax = 0.0f;
      for (int64_t k = 0; k < count; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* q = out->q.data() + (r * blocks + b) * raylm::kGgufBlock;
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

// The weights as the kernel reads them: GGUF blocks (block_scale per 32 inputs, offset for 4-bit
// ones) or per-row int8 (row_scale).
struct Int8Weights {
  const uint8_t* q;
  const float* block_scale;  // [N, K/32] or null (per-row int8: d_w = 1)
  const float* offset;       // [N, K/32] for 4-bit blocks, else null
  const float* row_scale;    // [N] for per-row int8, else null
  int64_t K;

  bool Nibbles() const { return offset != nullptr; }
  int64_t Blocks() const { return (K + raylm::kGgufBlock - 1) / raylm::kGgufBlock; }
  int64_t RowBytes() const { return Nibbles() ? K / 2 : K; }
  // Weight k of row n as the integer the sums use.
  int32_t Value(int64_t n, int64_t k) const {
    if (!Nibbles()) return static_cast<int8_t>(q[n * K + k]);
    const int64_t b = k / raylm::kGgufBlock, i = k % raylm::kGgufBlock;
    const uint8_t byte = q[n * RowBytes() + b * raylm::kGgufBlock / 2 + i % (raylm::kGgufBlock / 2)];
    return i < raylm::kGgufBlock / 2 ? byte & 0x0F : byte >> 4;
  }
  float Scale(int64_t n, int64_t b) const { return block_scale ? block_scale[n * Blocks() + b] : 1.0f; }
};

// The panel's blocks: for a group of kCols columns, eight vectors of kCols lanes of four weight
// bytes (lane j of vector t: column j's weights 4t..4t+3 of the block), then d_w and m per column.
template <int kCols>
struct PanelBlock {
  uint8_t w[8][kCols * 4];
  float d[kCols];
  float m[kCols];
};

// Repacks block b of columns [n, n + valid) into `out` without vector gathers: the last block of
// per-row int8 rows whose K is not whole blocks (zeros past K; the activations are zero there).
// `flip`: store 8-bit weights as w + 128 (unsigned), as the VNNI tiles read them. Columns past
// `valid` repeat the last one (their sums are computed and dropped).
template <int kCols>
void RepackBlockByScalars(const Int8Weights& w, int64_t n, int64_t valid, int64_t b, bool flip,
                          PanelBlock<kCols>* out) {
  for (int j = 0; j < kCols; ++j) {
    const int64_t row = n + std::min<int64_t>(j, valid - 1);
    for (int k = 0; k < raylm::kGgufBlock; ++k) {
      const int64_t at = b * raylm::kGgufBlock + k;
      const int32_t value = at < w.K ? w.Value(row, at) : 0;
      out->w[k / 4][j * 4 + k % 4] = static_cast<uint8_t>(flip && !w.Nibbles() ? value + 128 : value);
    }
    out->d[j] = w.Scale(row, b);
    out->m[j] = w.Nibbles() ? w.offset[row * w.Blocks() + b] : 0.0f;
  }
}

// The portable family: the arithmetic above as plain loops over the stored weights (no panel).
void PortableColumns(const Int8Rows& a, const Int8Weights& w, float* y, int64_t M, int64_t N, int64_t n_begin,
                     int64_t n_end) {
  const int64_t blocks = w.Blocks();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = n_begin; n < n_end; ++n) {
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* xq = a.Block(r, b);
        int32_t sum = 0;
        for (int64_t k = 0; k < raylm::kGgufBlock && b * raylm::kGgufBlock + k < w.K; ++k)
          sum += xq[k] * w.Value(n, b * raylm::kGgufBlock + k);
        const float dx = a.d[a.At(r, b)];
        acc = std::fma(static_cast<float>(sum), dx * w.Scale(n, b), acc);
        if (w.Nibbles()) acc = std::fma(w.offset[n * blocks + b], a.ds[a.At(r, b)], acc);
      }
      y[r * N + n] = w.row_scale ? acc * w.row_scale[n] : acc;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define RAYLM_INT8_VECTOR_FAMILIES 1

// AVX-512 VNNI: sixteen columns a group; vpdpbusd adds four u8 x s8 products per lane, the
// weights being the unsigned operand (nibbles as they are, 8-bit weights + 128, whose extra
// 128 * S per block is subtracted by starting the block's sums at -128 * S).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

struct VnniFamily {
  static constexpr int kCols = 16;
  using Block = PanelBlock<kCols>;

  // QuantizeRows's arithmetic, two vectors a block: the maximum and the integer sum are exact
  // in any order, and vcvtps2dq rounds to nearest even as nearbyint does.
  static void Quantize(const float* x, int64_t M, int64_t K, Int8Rows* out) {
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < out->blocks; ++b) {
        const float* v = x + r * K + b * raylm::kGgufBlock;
        const int64_t count = std::min<int64_t>(raylm::kGgufBlock, K - b * raylm::kGgufBlock);
        const __mmask16 first = count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
        const __mmask16 second = count >= 32 ? 0xFFFF : count > 16 ? static_cast<__mmask16>((1u << (count - 16)) - 1) : 0;
        const __m512 low = _mm512_maskz_loadu_ps(first, v), high = _mm512_maskz_loadu_ps(second, v + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
        const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
        const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
        int8_t* q = out->q.data() + out->At(r, b) * raylm::kGgufBlock;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q_low));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q_high));
        SetBlock(out, r, b, amax, _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high)));
      }
  }

  // Columns [n, n + valid) into `out[0 .. blocks)`: each block's four-byte pieces gathered from
  // the sixteen rows (invalid columns read the last valid one).
  static void Repack(const Int8Weights& w, int64_t n, int64_t valid, Block* out) {
    const int64_t blocks = w.Blocks(), row_bytes = w.RowBytes();
    alignas(64) int32_t rows[kCols], scales[kCols];
    for (int j = 0; j < kCols; ++j) {
      rows[j] = static_cast<int32_t>(std::min<int64_t>(j, valid - 1) * row_bytes);
      scales[j] = static_cast<int32_t>(std::min<int64_t>(j, valid - 1) * blocks);
    }
    const __m512i row_index = _mm512_load_si512(rows), scale_index = _mm512_load_si512(scales);
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const uint8_t* q = w.q + n * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      Block& o = out[b];
      if (w.Nibbles()) {
        for (int t = 0; t < 4; ++t) {
          const __m512i bytes = _mm512_i32gather_epi32(row_index, q + b * 16 + 4 * t, 1);
          _mm512_storeu_si512(o.w[t], _mm512_and_si512(bytes, low));
          _mm512_storeu_si512(o.w[t + 4], _mm512_and_si512(_mm512_srli_epi32(bytes, 4), low));
        }
      } else if ((b + 1) * raylm::kGgufBlock <= w.K) {
        for (int t = 0; t < 8; ++t)
          _mm512_storeu_si512(o.w[t], _mm512_xor_si512(_mm512_i32gather_epi32(row_index, q + b * 32 + 4 * t, 1), flip));
      } else {
        RepackBlockByScalars<kCols>(w, n, valid, b, true, &o);
        continue;
      }
      const __m512 d = w.block_scale ? _mm512_i32gather_ps(scale_index, w.block_scale + n * blocks + b, 4)
                                     : _mm512_set1_ps(1.0f);
      _mm512_storeu_ps(o.d, d);
      _mm512_storeu_ps(o.m, w.Nibbles() ? _mm512_i32gather_ps(scale_index, w.offset + n * blocks + b, 4)
                                        : _mm512_setzero_ps());
    }
  }

  // Rows [m, m + R) against G consecutive column groups of the panel (`groups`, each `blocks`
  // blocks long); writes y[r, n + c] for the first `valid` columns (of G * kCols).
  template <int R, int G, bool kNibbles>
  static void Tile(const Int8Rows& a, int64_t m, const Block* groups, const float* row_scale, float* y, int64_t N,
                   int64_t n, int64_t valid) {
    const int64_t blocks = a.blocks;
    __m512 acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i sums[R][G];
      for (int r = 0; r < R; ++r) {
        const __m512i start = kNibbles ? _mm512_setzero_si512() : _mm512_set1_epi32(-a.sum128[a.At(m + r, b)]);
        for (int g = 0; g < G; ++g) sums[r][g] = start;
      }
      for (int t = 0; t < 8; ++t) {
        __m512i weights[G];
        for (int g = 0; g < G; ++g) weights[g] = _mm512_loadu_si512(groups[g * blocks + b].w[t]);
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, a.Block(m + r, b) + 4 * t, 4);
          const __m512i x = _mm512_set1_epi32(four);
          for (int g = 0; g < G; ++g) sums[r][g] = _mm512_dpbusd_epi32(sums[r][g], weights[g], x);
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512 d = _mm512_loadu_ps(groups[g * blocks + b].d);
        for (int r = 0; r < R; ++r) {
          const __m512 dx = _mm512_set1_ps(a.d[a.At(m + r, b)]);
          acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][g]), _mm512_mul_ps(dx, d), acc[r][g]);
          if constexpr (kNibbles)
            acc[r][g] = _mm512_fmadd_ps(_mm512_loadu_ps(groups[g * blocks + b].m),
                                        _mm512_set1_ps(a.ds[a.At(m + r, b)]), acc[r][g]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const int64_t count = std::min<int64_t>(kCols, valid - g * kCols);
      if (count <= 0) break;
      const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
      const __m512 scale =
          row_scale ? _mm512_maskz_loadu_ps(mask, row_scale + n + g * kCols) : _mm512_set1_ps(1.0f);
      for (int r = 0; r < R; ++r) {
        const __m512 out = row_scale ? _mm512_mul_ps(acc[r][g], scale) : acc[r][g];
        _mm512_mask_storeu_ps(y + (m + r) * N + n + g * kCols, mask, out);
      }
    }
  }
};

#pragma GCC diagnostic pop
#pragma GCC pop_options

// AVX2: eight columns a group; vpmaddubsw multiplies u8 x s8 pairs into int16 and vpmaddwd adds
// the pairs into int32. Nibbles are the unsigned operand as they are; for 8-bit weights,
// |w| <= 128 is, with the activation given w's sign (|q_x| <= 127), so no pair sum overflows.
#pragma GCC push_options
#pragma GCC target("avx2,fma")

struct Avx2Family {
  static constexpr int kCols = 8;
  using Block = PanelBlock<kCols>;

  static void Repack(const Int8Weights& w, int64_t n, int64_t valid, Block* out) {
    const int64_t blocks = w.Blocks(), row_bytes = w.RowBytes();
    alignas(32) int32_t rows[kCols], scales[kCols];
    for (int j = 0; j < kCols; ++j) {
      rows[j] = static_cast<int32_t>(std::min<int64_t>(j, valid - 1) * row_bytes);
      scales[j] = static_cast<int32_t>(std::min<int64_t>(j, valid - 1) * blocks);
    }
    const __m256i row_index = _mm256_load_si256(reinterpret_cast<const __m256i*>(rows));
    const __m256i scale_index = _mm256_load_si256(reinterpret_cast<const __m256i*>(scales));
    const __m256i low = _mm256_set1_epi8(0x0F);
    const uint8_t* q = w.q + n * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      Block& o = out[b];
      if (w.Nibbles()) {
        for (int t = 0; t < 4; ++t) {
          const __m256i bytes = _mm256_i32gather_epi32(reinterpret_cast<const int*>(q + b * 16 + 4 * t), row_index, 1);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.w[t]), _mm256_and_si256(bytes, low));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.w[t + 4]),
                              _mm256_and_si256(_mm256_srli_epi32(bytes, 4), low));
        }
      } else if ((b + 1) * raylm::kGgufBlock <= w.K) {
        for (int t = 0; t < 8; ++t)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.w[t]),
                              _mm256_i32gather_epi32(reinterpret_cast<const int*>(q + b * 32 + 4 * t), row_index, 1));
      } else {
        RepackBlockByScalars<kCols>(w, n, valid, b, false, &o);
        continue;
      }
      const __m256 d = w.block_scale ? _mm256_i32gather_ps(w.block_scale + n * blocks + b, scale_index, 4)
                                     : _mm256_set1_ps(1.0f);
      _mm256_storeu_ps(o.d, d);
      _mm256_storeu_ps(o.m, w.Nibbles() ? _mm256_i32gather_ps(w.offset + n * blocks + b, scale_index, 4)
                                        : _mm256_setzero_ps());
    }
  }

  template <int R, int G, bool kNibbles>
  static void Tile(const Int8Rows& a, int64_t m, const Block* groups, const float* row_scale, float* y, int64_t N,
                   int64_t n, int64_t valid) {
    const int64_t blocks = a.blocks;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i sums[R][G];
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) sums[r][g] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        __m256i weights[G], magnitudes[G];
        for (int g = 0; g < G; ++g) {
          weights[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(groups[g * blocks + b].w[t]));
          magnitudes[g] = kNibbles ? weights[g] : _mm256_abs_epi8(weights[g]);
        }
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, a.Block(m + r, b) + 4 * t, 4);
          const __m256i x = _mm256_set1_epi32(four);
          for (int g = 0; g < G; ++g) {
            const __m256i signed_x = kNibbles ? x : _mm256_sign_epi8(x, weights[g]);
            const __m256i pairs = _mm256_maddubs_epi16(magnitudes[g], signed_x);
            sums[r][g] = _mm256_add_epi32(sums[r][g], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m256 d = _mm256_loadu_ps(groups[g * blocks + b].d);
        for (int r = 0; r < R; ++r) {
          const __m256 dx = _mm256_set1_ps(a.d[a.At(m + r, b)]);
          acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][g]), _mm256_mul_ps(dx, d), acc[r][g]);
          if constexpr (kNibbles)
            acc[r][g] = _mm256_fmadd_ps(_mm256_loadu_ps(groups[g * blocks + b].m),
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
        float* row = y + (m + r) * N + n + g * kCols;
        for (int64_t j = 0; j < count; ++j) row[j] = row_scale ? out[j] * row_scale[n + g * kCols + j] : out[j];
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
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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
// Repacked weights per panel (shared by every row) and quantized rows per block: together about
// half of a core's L2, as in prompt_gemm.inc.
constexpr int64_t kInt8PanelBytes = 256 << 10;
constexpr int64_t kInt8RowBlockBytes = 128 << 10;
constexpr int kInt8Rows = 4;  // rows per tile

template <typename F, int G, bool kNibbles>
void TileRows(int64_t rows, const Int8Rows& a, int64_t m, const typename F::Block* groups, const float* row_scale,
              float* y, int64_t N, int64_t n, int64_t valid) {
  switch (rows) {
    case 4: return F::template Tile<4, G, kNibbles>(a, m, groups, row_scale, y, N, n, valid);
    case 3: return F::template Tile<3, G, kNibbles>(a, m, groups, row_scale, y, N, n, valid);
    case 2: return F::template Tile<2, G, kNibbles>(a, m, groups, row_scale, y, N, n, valid);
    case 1: return F::template Tile<1, G, kNibbles>(a, m, groups, row_scale, y, N, n, valid);
  }
}

template <typename F, int G>
void TileRows(int64_t rows, const Int8Rows& a, int64_t m, const typename F::Block* groups, bool nibbles,
              const float* row_scale, float* y, int64_t N, int64_t n, int64_t valid) {
  if (nibbles) return TileRows<F, G, true>(rows, a, m, groups, row_scale, y, N, n, valid);
  TileRows<F, G, false>(rows, a, m, groups, row_scale, y, N, n, valid);
}

// Output columns [n_begin, n_end) for all M rows: a panel of column groups repacked, then every
// block of rows passes it, two groups and four rows a tile.
template <typename F>
void VectorColumns(const Int8Rows& a, const Int8Weights& w, float* y, int64_t M, int64_t N, int64_t n_begin,
                   int64_t n_end, typename F::Block* panel) {
  constexpr int C = F::kCols;
  const int64_t blocks = w.Blocks();
  const int64_t panel_groups = std::max<int64_t>(2, kInt8PanelBytes / (blocks * int64_t{sizeof(typename F::Block)}));
  const int64_t block_rows =
      std::max<int64_t>(kInt8Rows, kInt8RowBlockBytes / (blocks * raylm::kGgufBlock) / kInt8Rows * kInt8Rows);
  for (int64_t p = n_begin; p < n_end; p += panel_groups * C) {
    const int64_t p_end = std::min(n_end, p + panel_groups * C), count = (p_end - p + C - 1) / C;
    for (int64_t g = 0; g < count; ++g)
      F::Repack(w, p + g * C, std::min<int64_t>(C, p_end - p - g * C), panel + g * blocks);
    for (int64_t m_begin = 0; m_begin < M; m_begin += block_rows) {
      const int64_t m_end = std::min(M, m_begin + block_rows);
      for (int64_t g = 0; g < count; g += 2) {
        const int64_t n = p + g * C, valid = std::min<int64_t>(2 * C, p_end - n);
        for (int64_t m = m_begin; m < m_end; m += kInt8Rows) {
          const int64_t rows = std::min<int64_t>(kInt8Rows, m_end - m);
          if (g + 1 < count)
            TileRows<F, 2>(rows, a, m, panel + g * blocks, w.Nibbles(), w.row_scale, y, N, n, valid);
          else
            TileRows<F, 1>(rows, a, m, panel + g * blocks, w.Nibbles(), w.row_scale, y, N, n, valid);
        }
      }
    }
  }
}

template <typename F>
int64_t PanelFloats(const Int8Weights& w, int64_t item) {
  const int64_t groups = std::min<int64_t>(
      (item + F::kCols - 1) / F::kCols,
      std::max<int64_t>(2, kInt8PanelBytes / (w.Blocks() * int64_t{sizeof(typename F::Block)})));
  return (groups * w.Blocks() * int64_t{sizeof(typename F::Block)} + sizeof(float) - 1) / sizeof(float);
}
#endif

// y [M, N] = the integer mode's x . w^T, the columns split over the calling thread and the pool.
void RunInt8Matmul(const float* x, const Int8Weights& w, float* y, int64_t M, int64_t N, ffi::ThreadPool& pool) {
  Int8Rows a;
  AllocateRows(M, w.K, &a);
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  constexpr int64_t kGroup = 16;  // items are whole groups of either vector family
  const int64_t per_item = (N + threads * kPromptItemsPerThread - 1) / (threads * kPromptItemsPerThread);
  const int64_t item = (per_item + kGroup - 1) / kGroup * kGroup;
  const Int8Family family = ChosenFamily();
#ifdef RAYLM_INT8_VECTOR_FAMILIES
  if (family == Int8Family::kVnni) VnniFamily::Quantize(x, M, w.K, &a);
#endif
  if (family != Int8Family::kVnni) QuantizeRows(x, M, w.K, &a);
#ifdef RAYLM_INT8_VECTOR_FAMILIES
  if (family == Int8Family::kVnni)
    return Run(N, w.K, PanelFloats<VnniFamily>(w, item), [&a, w, y, M, N](int64_t b, int64_t e, float* panel) {
      VectorColumns<VnniFamily>(a, w, y, M, N, b, e, reinterpret_cast<VnniFamily::Block*>(panel));
    }, pool, item);
  if (family == Int8Family::kAvx2)
    return Run(N, w.K, PanelFloats<Avx2Family>(w, item), [&a, w, y, M, N](int64_t b, int64_t e, float* panel) {
      VectorColumns<Avx2Family>(a, w, y, M, N, b, e, reinterpret_cast<Avx2Family::Block*>(panel));
    }, pool, item);
#endif
  Run(N, w.K, 0, [&a, w, y, M, N](int64_t b, int64_t e, float*) { PortableColumns(a, w, y, M, N, b, e); }, pool, item);
}

// GGUF blocks (q, scale, offset as gguf_matmul takes them; int8_g32 matrices are Q8_0 blocks).
ffi::Error Int8GgufMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer q, Matrix scale, Matrix offset,
                          ffi::Result<Matrix> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = y->dimensions()[1];
  GgufRows rows{};
  const std::string error = GgufCallOf(x, q, scale, offset, *y, &rows);
  if (!error.empty()) return ffi::Error::InvalidArgument("int8_gguf_matmul: " + error);
  if (M == 0 || N == 0) return ffi::Error::Success();
  RunInt8Matmul(x.typed_data(), Int8Weights{rows.q, rows.scale, rows.offset, nullptr, K}, y->typed_data(), M, N,
                thread_pool);
  return ffi::Error::Success();
}

// int8 weights [N, K] with a scale per output row.
ffi::Error Int8QuantizedMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer w, Scales scale,
                               ffi::Result<Matrix> y) {
  if (w.dimensions().size() != 2 || w.element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("int8_quantized_matmul: w must be int8 [N, K]");
  const int64_t scale_n = scale.dimensions()[0];
  const std::string error = ShapeError(x.dimensions(), w.dimensions(), &scale_n, y->dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  RunInt8Matmul(x.typed_data(),
                Int8Weights{static_cast<const uint8_t*>(w.untyped_data()), nullptr, nullptr, scale.typed_data(), K},
                y->typed_data(), M, N, thread_pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmInt8GgufMatmul, Int8GgufMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmInt8QuantizedMatmul, Int8QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Scales>()
                                  .Ret<Matrix>());
