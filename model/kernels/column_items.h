// How the CPU matmul kernels split a call's output columns over threads (dense_matmul.cc,
// grouped_matmul.cc, int8_matmul.cc): one loop, shared, so every kernel claims work the same way.
#ifndef RAYLM_COLUMN_ITEMS_H_
#define RAYLM_COLUMN_ITEMS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace raylm {

// Weight rows per work item: a multiple of the tile, small enough that two threads share
// the work evenly, large enough that claiming an item costs nothing next to computing it.
constexpr int64_t kColumnsPerItem = 64;
// Below this many weights (256 KiB) a call runs on the calling thread alone: waking a pool
// thread costs tens of microseconds, about what reading this much takes. Counted in weights,
// not multiply-adds: at one row the call is bound by memory bandwidth, which one core does
// not saturate. (8-bit weights use the same count: half the work of a parallel call is
// converting them, which the second core shares.)
constexpr int64_t kMinParallelWeights = int64_t{1} << 16;
// Work items per thread for calls of many rows (prompt chunks): weight rows are split into about
// this many items per thread, claimed one by one, so a thread that falls behind (the other cores
// are shared) leaves little waiting.
constexpr int64_t kPromptItemsPerThread = 8;

// Splits output columns [0, N) over the calling thread and XLA's intra-op pool:
// `columns(n_begin, n_end, panel)` computes a range of up to `columns_per_item` columns, `panel`
// being `panel_floats` of scratch per thread (null when 0). Items are claimed one by one from a
// shared counter, so the caller never waits for an item nobody has started and a helper that
// starts late finds nothing left and touches only `state`.
template <typename ColumnsFn>
void Run(int64_t N, int64_t K, int64_t panel_floats, ColumnsFn columns, xla::ffi::ThreadPool& pool,
         int64_t columns_per_item = kColumnsPerItem) {
  const int64_t items = (N + columns_per_item - 1) / columns_per_item;
  const int64_t threads =
      N * K >= kMinParallelWeights ? std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items) : 1;
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto participate = [state, items, N, panel_floats, columns, columns_per_item] {
    std::unique_ptr<float[]> panel(panel_floats ? new float[panel_floats] : nullptr);
    for (int64_t i = state->next.fetch_add(1); i < items; i = state->next.fetch_add(1)) {
      columns(i * columns_per_item, std::min(N, (i + 1) * columns_per_item), panel.get());
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule(decltype(participate)(participate));
  participate();
  while (state->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace raylm

#endif  // RAYLM_COLUMN_ITEMS_H_
