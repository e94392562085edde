// The dense kernel's small-batch loop nest for GGUF block weights (dense_matmul.cc, and the
// grouped kernel's block experts): the blocks widened in registers or once into a panel.
#ifndef RAYLM_GGUF_COLUMNS_H_
#define RAYLM_GGUF_COLUMNS_H_

#include <algorithm>
#include <cstdint>

#include "dense_tiles.h"
#include "gguf_blocks.h"

namespace {

// One row tile (M <= 4 input rows) against NR block rows widened in registers.
template <typename Tiles, int NR, bool kSplit, bool kTwoLevel>
void DirectGgufTile(int64_t M, const float* x, const GgufRows& w, int64_t n, float* y, int64_t K, int64_t N,
                    bool prefetch_next) {
  static_assert(Tiles::MR <= 4, "row tiles of up to four rows");
  switch (M) {
    case 4:
      if constexpr (Tiles::MR >= 4)
        return Tiles::template GgufTile<4, NR, kSplit, kTwoLevel>(x, w, n, y, K, N, prefetch_next);
      break;
    case 3: return Tiles::template GgufTile<3, NR, kSplit, kTwoLevel>(x, w, n, y, K, N, prefetch_next);
    case 2: return Tiles::template GgufTile<2, NR, kSplit, kTwoLevel>(x, w, n, y, K, N, prefetch_next);
    case 1: return Tiles::template GgufTile<1, NR, kSplit, kTwoLevel>(x, w, n, y, K, N, prefetch_next);
  }
}

// Columns for GGUF block weights: up to two row tiles widen the blocks in registers; more widen
// every tile of weight rows into `panel` once (exact, see gguf_blocks.h), and the float32 tiles
// run on it exactly as on a float32 matrix. Either way each output is the float32 kernel's sum
// over the dequantized weights, whatever M.
// kSplit: a scale per 16 weights (w.group == 16); kTwoLevel: int8 scales times the super-block's
// (w.supers); both decided once a call (GgufTileOf).
template <typename Tiles, bool kSplit, bool kTwoLevel>
void GgufColumns(const float* x, const GgufRows& w, float* y, int64_t M, int64_t N, int64_t K, int64_t n_begin,
                 int64_t n_end, float* panel) {
  constexpr int MR = Tiles::MR, NR = Tiles::NR;
  static_assert(NR <= kMaxWeightRowsPerTile, "the panel holds kMaxWeightRowsPerTile rows");
  int64_t n = n_begin;
  if (M <= 2 * MR) {
    // Up to two row tiles widen the blocks in registers, the second reading what the first
    // just brought into L1. Through the panel below, 5-7 rows had cost more than 8 (the
    // bundled model's projections, 2-core AVX-512: 4 rows 5.7 ms, 5/6/7/8 rows
    // 9.6/11.6/13.1/10.6 ms, now 7.4/8.0/8.4/8.9 ms). From 9 rows a third and fourth
    // direct tile measured no faster than the panel.
    for (; n + NR <= n_end; n += NR)
      for (int64_t m = 0; m < M; m += MR)
        DirectGgufTile<Tiles, NR, kSplit, kTwoLevel>(std::min<int64_t>(M - m, MR), x + m * K, w, n, y + m * N + n, K, N,
                                  m == 0 && n + 2 * NR <= n_end);
    for (; n < n_end; ++n)
      for (int64_t m = 0; m < M; m += MR)
        DirectGgufTile<Tiles, 1, kSplit, kTwoLevel>(std::min<int64_t>(M - m, MR), x + m * K, w, n, y + m * N + n, K, N,
                                                    false);
    return;
  }
  for (; n + NR <= n_end; n += NR) {
    int64_t m = 0;
    if constexpr (Tiles::kWidensInFirstTile) {
      // The first row tile widens the blocks in registers and leaves them in the panel for
      // the others, its multiply-adds beside the widening: a pass of its own had been a
      // quarter of a 16-row call's samples (2-core AMD EPYC, AVX-512).
      Tiles::template GgufPanelTile<kSplit, kTwoLevel>(x, w, n, y + n, K, N, n + 2 * NR <= n_end, panel);
      m = MR;
    } else {
      Tiles::WidenGgufRows(w, n, NR, panel, n + 2 * NR <= n_end);
    }
    for (; m + MR <= M; m += MR) Tiles::template Tile<MR, NR>(x + m * K, panel, nullptr, y + m * N + n, K, N, nullptr);
    RemainderRows<Tiles, NR>(M - m, x + m * K, panel, nullptr, y + m * N + n, K, N, nullptr);
  }
  for (; n < n_end; ++n) {
    Tiles::WidenGgufRows(w, n, 1, panel, false);
    for (int64_t m = 0; m < M; ++m)
      Tiles::template Tile<1, 1>(x + m * K, panel, nullptr, y + m * N + n, K, N, nullptr);
  }
}

template <typename Tiles>
void GgufColumnsOf(const float* x, const GgufRows& w, float* y, int64_t M, int64_t N, int64_t K, int64_t n_begin,
                   int64_t n_end, float* panel) {
  const bool split = w.group != raylm::kGgufBlock;
  if (w.supers) {
    return split ? GgufColumns<Tiles, true, true>(x, w, y, M, N, K, n_begin, n_end, panel)
                 : GgufColumns<Tiles, false, true>(x, w, y, M, N, K, n_begin, n_end, panel);
  }
  split ? GgufColumns<Tiles, true, false>(x, w, y, M, N, K, n_begin, n_end, panel)
        : GgufColumns<Tiles, false, false>(x, w, y, M, N, K, n_begin, n_end, panel);
}

void GgufColumns(const float* x, const GgufRows& w, float* y, int64_t M, int64_t N, int64_t K, int64_t n_begin,
                 int64_t n_end, float* panel) {
#ifdef RAYLM_WIDE_TILES
  if (UseWideTiles()) return GgufColumnsOf<WideTiles>(x, w, y, M, N, K, n_begin, n_end, panel);
#endif
  GgufColumnsOf<NarrowTiles>(x, w, y, M, N, K, n_begin, n_end, panel);
}

}  // namespace

#endif  // RAYLM_GGUF_COLUMNS_H_
