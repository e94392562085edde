// The dense kernel's small-batch loop nest (dense_matmul.cc; the grouped and LoRA kernels run it
// too): a call's output columns by tiles of weight rows, every input row passing each tile.
#ifndef RAYLM_DENSE_COLUMNS_H_
#define RAYLM_DENSE_COLUMNS_H_

#include <cstdint>
#include <type_traits>

#include "column_items.h"
#include "dense_tiles.h"
#include "ffi_helpers.h"

namespace {

using raylm::Run;

// Whether Columns widens a tile of weight rows of type W once into an L1 panel for calls of
// more than one row tile, rather than in registers in every row tile. fp8 does: its
// widening takes several operations a vector, and the panel made 16-64-row calls 1.4-2x
// faster. int8's takes two, and the panel's store and reload cost more than widening again:
// the bundled model's 120 int8 projections ran 2.2x faster at 8 rows and 1.1-1.6x at 16-64
// in registers (2-core AMD EPYC; eight-lane tiles 1.0-1.2x). bfloat16 and float16 do too:
// in registers their 16- and 64-row calls ran at half the float32 kernel's speed (2048x2048
// and 8192x2048, 16-lane tiles, same machine), through the panel at 0.9-1.0x of it.
template <typename W>
constexpr bool kWidensThroughPanel = std::is_same_v<W, Fp8E4m3> || sizeof(W) == 2;

// Output columns [n_begin, n_end) for all M rows. `scale` is null for float32 weights.
// fp8 and 16-bit weights feeding more than one row tile are widened once per tile of weight rows into
// `panel` (NR * K floats, L1-resident), which every row tile then reads (kWidensThroughPanel);
// without a panel (null: the LoRA kernel's bfloat16 slots) they are widened in registers.
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
    if (kWidensThroughPanel<W> && M > MR && panel) {
      Tiles::WidenRows(w + n * K, panel, NR * K);
      for (; m + MR <= M; m += MR) Tiles::template Tile<MR, NR>(x + m * K, panel, s, y + m * N + n, K, N, nullptr);
      RemainderRows<Tiles, NR>(M - m, x + m * K, panel, s, y + m * N + n, K, N, nullptr);
      continue;
    }
    // With more than one row, the first row tile also prefetches the next NR float32 weight
    // rows, one cache line per row and step: the hardware prefetcher alone left memory idle
    // while the other row tiles computed (8 and 16 rows 1.15-1.3x faster on either family).
    // At one row it made calls slower (1.1x). 8- and 16-bit rows prefetch themselves in the tile.
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
#ifdef RAYLM_F16C_TILES
  if constexpr (std::is_same_v<W, Fp16>)
    if (UseF16cTiles()) return Columns<NarrowF16cTiles>(x, w, scale, y, M, N, K, n_begin, n_end, panel);
#endif
  Columns<NarrowTiles>(x, w, scale, y, M, N, K, n_begin, n_end, panel);
}

template <typename W>
void RunDense(const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
              ffi::ThreadPool& pool) {
  const int64_t panel_floats = kWidensThroughPanel<W> && M > 1 ? kMaxWeightRowsPerTile * K : 0;
  Run(N, K, panel_floats,
      [=](int64_t n_begin, int64_t n_end, float* panel) { Columns(x, w, scale, y, M, N, K, n_begin, n_end, panel); },
      pool);
}

}  // namespace

#endif  // RAYLM_DENSE_COLUMNS_H_
