// How the CPU kernels split a call's work over threads: RunItems, the one work loop (claiming
// items from a shared counter) that every kernel uses, and Run, the matmul kernels' split of a
// call's output columns (dense_matmul.cc, grouped_matmul.cc, int8_matmul.cc, lora_delta.cc).
#ifndef RAYLM_COLUMN_ITEMS_H_
#define RAYLM_COLUMN_ITEMS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

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

// Runs work items [0, items) on the calling thread and up to `threads - 1` threads of XLA's
// intra-op pool. Items are claimed one by one from a shared counter, so the caller never waits
// for an item nobody has started, and a helper that starts late finds nothing left and touches
// only `state`. A thread that claims an item first calls `make_worker()` (its scratch, say),
// then `worker(i)` for each item i it claims.
template <typename MakeWorker>
void RunItems(int64_t items, int64_t threads, xla::ffi::ThreadPool& pool, MakeWorker make_worker) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto participate = [state, items, make_worker] {
    int64_t i = state->next.fetch_add(1);
    if (i >= items) return;
    auto worker = make_worker();
    for (; i < items; i = state->next.fetch_add(1)) {
      worker(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule(decltype(participate)(participate));
  participate();
  while (state->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

// Splits output columns [0, N) over the calling thread and XLA's intra-op pool (RunItems):
// `columns(n_begin, n_end, panel)` computes a range of up to `columns_per_item` columns, `panel`
// being `panel_floats` of scratch per thread (null when 0).
template <typename ColumnsFn>
void Run(int64_t N, int64_t K, int64_t panel_floats, ColumnsFn columns, xla::ffi::ThreadPool& pool,
         int64_t columns_per_item = kColumnsPerItem) {
  const int64_t items = (N + columns_per_item - 1) / columns_per_item;
  const int64_t threads =
      N * K >= kMinParallelWeights ? std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items) : 1;
  RunItems(items, threads, pool, [N, panel_floats, columns, columns_per_item] {
    std::unique_ptr<float[]> panel(panel_floats ? new float[panel_floats] : nullptr);
    return [N, columns, columns_per_item, panel = std::move(panel)](int64_t i) {
      columns(i * columns_per_item, std::min(N, (i + 1) * columns_per_item), panel.get());
    };
  });
}

}  // namespace raylm

#endif  // RAYLM_COLUMN_ITEMS_H_
