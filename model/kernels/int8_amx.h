// The integer compute mode's AMX family (int8_matmul.cc): prompt chunks' integer sums on Intel's
// tile unit, the float steps on AVX-512 exactly as VnniFamily does them, so the same bits.
//
// Why: a tdpbssd multiplies a tile of 16 rows x 32 int8 activations (one block of 16 rows) by a
// tile of 8 x 64 weight bytes (one block of 16 columns) into 16 x 16 int32 sums: 8192 multiply-adds
// an instruction where vpdpbusd does 64. The weight tile's layout (row t: four consecutive bytes
// of each of 16 columns) is the packed layout's (int8_matmul.cc), so 8-bit blocks are read where
// they are; 4-bit blocks are unpacked once per panel of columns into a per-thread scratch (the
// low and high nibbles of the 4 stored vectors become 8 byte rows) that every block of rows then
// reads. Each block's sums must be scaled on their own (the fixed fma sequence), so the tiles
// cover one block of K: the sums of a few blocks are stored to L1 and each output row of 16
// columns takes them, block by block, in registers.
//
// Decode rows stay on VNNI (a tile is 16 rows; 4-bit blocks take AMX from 32); Q6_K / Q3_K / Q2_K
// (kSixBits: sums per half block times int8 sub-scales) and codebook codes (kCodes: IQ4, MXFP4;
// their unpacking would need the codebook lookup too, not written yet) also do. The tile registers
// need the kernel's permission on Linux (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), asked once; where
// it is refused, or the CPU has no AMX, the family is not offered.
#ifndef RAYLM_INT8_AMX_H_
#define RAYLM_INT8_AMX_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "int8_families.h"
#include "int8_panels.h"

#if defined(RAYLM_INT8_VECTOR_FAMILIES) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define RAYLM_INT8_AMX 1
#endif

namespace {

#ifdef RAYLM_INT8_AMX

constexpr int64_t kAmxRows = 16;        // rows of an activation tile; fewer rows stay on VNNI (AmxTakes)
constexpr int64_t kAmxTileBytes = 512;  // one block of 16 columns as a weight tile: 8 rows of 64 bytes

// Whether the CPU has AMX tiles with int8 products and Linux lets this process use them (the
// request is process-wide: every thread of the pool may then load tiles).
inline bool AmxPermitted() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tiles = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return tiles && int8 && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // offset[] of formats without offsets, as in int8_vnni.inc

struct AmxFamily {
  static constexpr int kChunk = 4;  // blocks whose sums wait in L1 for the float steps

  // Tiles 0, 1: activations (16 rows x one block); 2, 3: weights (one block of 16 columns);
  // 4..7: sums, activation tile i times weight tile j in 4 + 2i + j.
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {32, 32, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 8, 8, 16, 16, 16, 16};
  };

  // Rows [r_begin, r_end) of `a` copied into a->tiled (allocated, zeros past M): block b of the 16
  // rows from 16t at ((t * blocks + b) * 16) * 32, an activation tile of contiguous bytes. Read
  // from q, a tile's rows are blocks * 32 bytes apart, and at K = 2^k they fall in one L1 set.
  static void TileActivations(Int8Rows* a, int64_t r_begin, int64_t r_end) {
    for (int64_t r = r_begin; r < r_end; ++r)
      for (int64_t b = 0; b < a->blocks; ++b)
        std::copy_n(a->Block(r, b), kGgufBlock,
                    a->tiled.data() + TileAt(*a, r - r % kAmxRows, b) + r % kAmxRows * kGgufBlock);
  }

  // Where in a.tiled the activation tile of rows [m, m + 16) (m a multiple of 16) and block b starts.
  static int64_t TileAt(const Int8Rows& a, int64_t m, int64_t b) {
    return ((m / kAmxRows) * a.blocks + b) * kAmxRows * kGgufBlock;
  }

  // 4-bit blocks [p, p + 16 * groups) as weight tiles, [group][block][8 rows of 64 bytes] in
  // `out`: row t < 4 the low nibbles of stored vector t (weights 4t..4t+3 of each column),
  // row 4 + t its high ones (weights 16 + 4t..19 + 4t).
  static void Unpack(const Int8Panels& w, int64_t p, int64_t groups, uint8_t* out) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t b = 0; b < w.blocks; ++b) {
        uint8_t* tile = out + (g * w.blocks + b) * kAmxTileBytes;
        for (int t = 0; t < 4; ++t) {
          const __m512i bytes = _mm512_loadu_si512(w.Vector(p + g * kGroupCols, b, t));
          _mm512_storeu_si512(tile + t * kVectorBytes, _mm512_and_si512(bytes, nibble));
          _mm512_storeu_si512(tile + (4 + t) * kVectorBytes, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
        }
      }
  }

  // The float steps of blocks [b0, b0 + C) for rows [m, m + 16 RT) and G groups from column n,
  // the blocks' sums in `sums`: VnniFamily::Tile's sequence, output by output. between(i) runs
  // after the i-th of the G groups' float steps (the tiles' next sums, issued among them).
  template <int RT, int G, Format F, int C, typename Between>
  static void Scale(const Int8Rows& a, int64_t m, const Int8Panels& w, int64_t n, int64_t b0,
                    const int32_t (*sums)[2][2][kAmxRows][16], float (*acc)[2][kAmxRows][16], Between between) {
    for (int g = 0; g < G; ++g) {
      __m512 d[C], offset[C];
      for (int j = 0; j < C; ++j) {
        const int64_t c = n + g * kGroupCols;
        d[j] = F == Format::kRowBytes ? _mm512_set1_ps(1.0f) : VnniFamily::BlockScales(w, c, b0 + j);
        if constexpr (F == Format::kNibbles || F == Format::kOffsetBytes)
          offset[j] = VnniFamily::BlockOffsets(w, c, b0 + j);
      }
      for (int rt = 0; rt < RT; ++rt)
        for (int r = 0; r < kAmxRows; ++r) {
          const int64_t first = a.At(m + rt * kAmxRows + r, b0);
          __m512 v = _mm512_load_ps(acc[rt][g][r]);
          for (int j = 0; j < C; ++j) {
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(sums[j][rt][g][r]));
            v = _mm512_fmadd_ps(sum, _mm512_mul_ps(_mm512_set1_ps(a.d[first + j]), d[j]), v);
            if constexpr (F == Format::kNibbles || F == Format::kOffsetBytes)
              v = _mm512_fmadd_ps(offset[j], _mm512_set1_ps(a.ds[first + j]), v);
          }
          _mm512_store_ps(acc[rt][g][r], v);
        }
      between(g);
    }
  }

  // The integer sums of blocks [b0, b0 + count) for rows [m, m + 16 RT) and G groups, whose weight
  // tiles start at `tiles` (block b at + b * 512, the second group at + group_stride), into `out`.
  template <int RT, int G>
  static void Sums(const Int8Rows& a, int64_t m, const uint8_t* tiles, int64_t group_stride, int64_t b0, int count,
                   int32_t (*out)[2][2][kAmxRows][16]) {
    for (int j = 0; j < count; ++j) {
      const int64_t b = b0 + j;
      _tile_loadd(0, a.tiled.data() + TileAt(a, m, b), kGgufBlock);
      if constexpr (RT == 2) _tile_loadd(1, a.tiled.data() + TileAt(a, m + kAmxRows, b), kGgufBlock);
      _tile_loadd(2, tiles + b * kAmxTileBytes, kVectorBytes);
      if constexpr (G == 2) _tile_loadd(3, tiles + group_stride + b * kAmxTileBytes, kVectorBytes);
      _tile_zero(4);
      if constexpr (G == 2) _tile_zero(5);
      if constexpr (RT == 2) _tile_zero(6);
      if constexpr (RT == 2 && G == 2) _tile_zero(7);
      _tile_dpbssd(4, 0, 2);
      if constexpr (G == 2) _tile_dpbssd(5, 0, 3);
      if constexpr (RT == 2) _tile_dpbssd(6, 1, 2);
      if constexpr (RT == 2 && G == 2) _tile_dpbssd(7, 1, 3);
      _tile_stored(4, out[j][0][0], kVectorBytes);
      if constexpr (G == 2) _tile_stored(5, out[j][0][1], kVectorBytes);
      if constexpr (RT == 2) _tile_stored(6, out[j][1][0], kVectorBytes);
      if constexpr (RT == 2 && G == 2) _tile_stored(7, out[j][1][1], kVectorBytes);
    }
  }

  // Rows [m, m + 16 RT) (those below M written) against G groups from column n (weight tiles as
  // Sums takes them); writes y[r, n + c] for the first `valid` columns. The tile configuration is
  // loaded. Software-pipelined: the tiles' sums of the next chunk of blocks are issued before the
  // float steps of this one, so the tile unit and the vector units work at once.
  template <int RT, int G, Format F>
  static void Tile(const Int8Rows& a, int64_t m, int64_t M, const Int8Panels& w, const uint8_t* tiles,
                   int64_t group_stride, float* y, int64_t n, int64_t valid) {
    alignas(64) float acc[2][2][kAmxRows][16] = {};
    alignas(64) int32_t sums[2][kChunk][2][2][kAmxRows][16];
    Sums<RT, G>(a, m, tiles, group_stride, 0, static_cast<int>(std::min<int64_t>(kChunk, w.blocks)), sums[0]);
    for (int64_t b0 = 0, s = 0; b0 < w.blocks; b0 += kChunk, s ^= 1) {
      const int count = static_cast<int>(std::min<int64_t>(kChunk, w.blocks - b0));
      // The next chunk's sums, a share after each group's float steps of this chunk: the tile
      // instructions wait on each other (the tiles are not renamed), and spread out they wait
      // beside the vector work instead of filling the reorder buffer before it.
      const int next = static_cast<int>(std::clamp<int64_t>(w.blocks - b0 - kChunk, 0, kChunk));
      const int share = (next + G - 1) / G;
      const auto between = [&, s](int g) {
        const int first = g * share, last = std::min(next, first + share);
        if (first < last)
          Sums<RT, G>(a, m, tiles, group_stride, b0 + kChunk + first, last - first, sums[s ^ 1] + first);
      };
      switch (count) {
        case 4: Scale<RT, G, F, 4>(a, m, w, n, b0, sums[s], acc, between); break;
        case 3: Scale<RT, G, F, 3>(a, m, w, n, b0, sums[s], acc, between); break;
        case 2: Scale<RT, G, F, 2>(a, m, w, n, b0, sums[s], acc, between); break;
        default: Scale<RT, G, F, 1>(a, m, w, n, b0, sums[s], acc, between); break;
      }
    }
    for (int g = 0; g < G; ++g) {
      const int64_t count = std::min<int64_t>(kGroupCols, valid - g * kGroupCols);
      const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
      const __m512 scale = F == Format::kRowBytes ? _mm512_maskz_loadu_ps(mask, w.row_scale + n + g * kGroupCols)
                                                  : _mm512_set1_ps(1.0f);
      for (int64_t r = 0; r < std::min<int64_t>(RT * kAmxRows, M - m); ++r) {
        const __m512 v = _mm512_load_ps(acc[r / kAmxRows][g][r % kAmxRows]);
        _mm512_mask_storeu_ps(y + (m + r) * w.N + n + g * kGroupCols, mask,
                              F == Format::kRowBytes ? _mm512_mul_ps(v, scale) : v);
      }
    }
  }

  // Output columns [n_begin, n_end) (n_begin a multiple of 16) for all M rows (`a` holds whole
  // tiles of rows, zeros past M, and its activation tiles), as VectorColumns orders them: a panel
  // of columns, every block of rows passing it, 32 rows and 32 columns a tile.
  template <Format F>
  static void Columns(const Int8Rows& a, const Int8Panels& w, float* y, int64_t M, int64_t n_begin, int64_t n_end) {
    static thread_local std::vector<uint8_t> scratch;  // a panel's unpacked 4-bit weights
    static constexpr Config kConfig{};  // constant: ldtilecfg's asm tells the compiler of 8 bytes read
    _tile_loadconfig(&kConfig);
    const int64_t group_stride = w.blocks * kAmxTileBytes;
    const int64_t group_bytes = group_stride + w.GroupTableBytes();
    const int64_t panel_cols = std::max<int64_t>(2, kInt8PanelBytes / group_bytes) * kGroupCols;
    const int64_t block_rows = std::max<int64_t>(2 * kAmxRows, kInt8RowBlockBytes / (w.blocks * kGgufBlock) /
                                                                   (2 * kAmxRows) * (2 * kAmxRows));
    for (int64_t p = n_begin; p < n_end; p += panel_cols) {
      const int64_t p_end = std::min(n_end, p + panel_cols);
      const uint8_t* tiles = w.Vector(p, 0, 0);
      if constexpr (F == Format::kNibbles) {
        const int64_t groups = (p_end - p + kGroupCols - 1) / kGroupCols;
        scratch.resize(groups * group_stride);
        Unpack(w, p, groups, scratch.data());
        asm volatile("" ::: "memory");  // tileloadd's asm does not tell the compiler that it reads memory
        tiles = scratch.data();
      }
      for (int64_t m_begin = 0; m_begin < M; m_begin += block_rows) {
        const int64_t m_end = std::min(M, m_begin + block_rows);
        for (int64_t n = p; n < p_end; n += 2 * kGroupCols) {
          const int64_t valid = std::min<int64_t>(2 * kGroupCols, p_end - n);
          const uint8_t* group = tiles + (n - p) / kGroupCols * group_stride;
          for (int64_t m = m_begin; m < m_end; m += 2 * kAmxRows) {
            const bool two_row_tiles = m_end - m > kAmxRows, two_groups = valid > kGroupCols;
            if (two_row_tiles && two_groups) Tile<2, 2, F>(a, m, M, w, group, group_stride, y, n, valid);
            else if (two_row_tiles) Tile<2, 1, F>(a, m, M, w, group, group_stride, y, n, valid);
            else if (two_groups) Tile<1, 2, F>(a, m, M, w, group, group_stride, y, n, valid);
            else Tile<1, 1, F>(a, m, M, w, group, group_stride, y, n, valid);
          }
        }
      }
    }
    _tile_release();
  }
};

#pragma GCC diagnostic pop
#pragma GCC pop_options

// Whether the AMX family takes this call: prompt chunks of a format with one integer sum per block,
// 4-bit ones from two tiles of rows (below, unpacking the panel costs what the tiles save; measured).
inline bool AmxTakes(const Int8Panels& w, int64_t M) {
  return M >= (w.format == Format::kNibbles ? 2 : 1) * kAmxRows && w.format != Format::kSixBits &&
         w.format != Format::kCodes;
}

// AmxFamily::Columns for w's format (not kSixBits or kCodes: AmxTakes).
void AmxColumns(const Int8Rows& a, const Int8Panels& w, float* y, int64_t M, int64_t n_begin, int64_t n_end) {
  switch (w.format) {
    case Format::kNibbles: return AmxFamily::Columns<Format::kNibbles>(a, w, y, M, n_begin, n_end);
    case Format::kBlockBytes: return AmxFamily::Columns<Format::kBlockBytes>(a, w, y, M, n_begin, n_end);
    case Format::kOffsetBytes: return AmxFamily::Columns<Format::kOffsetBytes>(a, w, y, M, n_begin, n_end);
    case Format::kRowBytes: return AmxFamily::Columns<Format::kRowBytes>(a, w, y, M, n_begin, n_end);
    case Format::kSixBits:
    case Format::kCodes: break;
  }
}

#endif  // RAYLM_INT8_AMX

}  // namespace

#endif  // RAYLM_INT8_AMX_H_
