// Paged decode attention's shared body (see paged_decode_attention.cc): the pool layout, the
// row kernels per pool type, head dim and lane family, the work split and the operand checks.
// Each of the two handler libraries (float / bfloat16 pools, 8-bit pools) includes it and
// instantiates only its own pool types, so the two compile in parallel.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_problem.h"
#include "attention_rows.h"
#include "column_items.h"
#include "ffi_helpers.h"
#include "wide_lanes.h"

using raylm::Bf16;
using raylm::Fp8E4m3;
using raylm::Shape;

namespace {

// Operand types (aliases: the handler-binding macro cannot take commas in template args).
using QueryBuffer = ffi::Buffer<ffi::F32, 3>;      // [B, H, Dh]
using LayerBuffer = ffi::Buffer<ffi::S32, 0>;      // []
using TableBuffer = ffi::Buffer<ffi::S32, 2>;      // [B, P]
using LensBuffer = ffi::Buffer<ffi::S32, 1>;       // [B]
using ScaleBuffer = ffi::Buffer<ffi::F32, 4>;      // [L, num_blocks, block_size, KVH]
using SinkBuffer = ffi::Buffer<ffi::F32, 1>;       // [H] or [0] (none)

// The pool the engine uses today: [L, num_blocks, block_size, KVH, Dh], row-major.
PoolLayout StackedPoolLayout(const ffi::AnyBuffer::Dimensions& d) {
  PoolLayout p{d[0], d[1], d[2], d[3], d[4], 0, 0, 0, 0};
  p.head_stride = p.head_dim;
  p.token_stride = p.num_kv_heads * p.head_stride;
  p.block_stride = p.block_size * p.token_stride;
  p.layer_stride = p.num_blocks * p.block_stride;
  return p;
}

// The eight-lane family. Multiversioned so the same binary uses AVX-512 / AVX2+FMA where
// the CPU has them (eight lanes are the widest all three clones run natively).
template <typename KV, int DH>
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void AttendRows(const Problem& pr, const int64_t* rows, int64_t count, int64_t kv_begin, int64_t kv_end, Scratch& s) {
  AttendRowsOf<KV, DH, Vec8>(pr, rows, count, kv_begin, kv_end, s);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define RAYLM_WIDE_ATTENTION 1
// The sixteen-lane family, for CPUs with AVX-512 (x86-64-v4): a block of 16 keys is one
// lane tree. Its scores differ from the eight-lane family's in the last bits (another
// order of additions), so a process uses one family for every call (UseWideLanes, decided
// once; RAYLM_ATTENTION_NARROW_LANES keeps AVX-512 CPUs at eight lanes).
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
template <typename KV, int DH>
void AttendRowsWide(const Problem& pr, const int64_t* rows, int64_t count, int64_t kv_begin, int64_t kv_end,
                    Scratch& s) {
  AttendRowsOf<KV, DH, Vec16>(pr, rows, count, kv_begin, kv_end, s);
}
#pragma GCC pop_options
#endif

using RowFn = void (*)(const Problem&, const int64_t*, int64_t, int64_t, int64_t, Scratch&);

// Head dims with a compiled instance (lane trees, accumulators in registers): those of the
// supported families (SmolLM / Llama 3.2 64, Phi-3 96, Llama / Qwen / Mistral 128, Gemma 256)
// and 80; any other runs the scalar reductions (correct, slower). Each listed dim adds an
// instance per pool type and lane family (and the eight-lane family's three clones).
template <typename KV, template <typename, int> class Row>
RowFn RowOfHeadDim(int64_t head_dim) {
  switch (head_dim) {
    case 64: return Row<KV, 64>::Fn();
    case 80: return Row<KV, 80>::Fn();
    case 96: return Row<KV, 96>::Fn();
    case 128: return Row<KV, 128>::Fn();
    case 256: return Row<KV, 256>::Fn();
    default: return Row<KV, 0>::Fn();
  }
}

template <typename KV, int DH>
struct NarrowRow {
  static RowFn Fn() { return AttendRows<KV, DH>; }
};

#ifdef RAYLM_WIDE_ATTENTION
template <typename KV, int DH>
struct WideRow {
  static RowFn Fn() { return AttendRowsWide<KV, DH>; }
};
#endif

template <typename KV>
RowFn RowKernel(int64_t head_dim) {
#ifdef RAYLM_WIDE_ATTENTION
  if (raylm::UseWideLanes<raylm::LaneFamily::kAttention>()) return RowOfHeadDim<KV, WideRow>(head_dim);
#endif
  return RowOfHeadDim<KV, NarrowRow>(head_dim);
}

// Below this many (key, query head) pairs a call runs on the calling thread alone: waking a
// pool thread costs tens of microseconds, about what this much work takes. A call reading its
// keys from memory runs at ~10 ns a pair on one thread, so two threads pay from a few thousand
// pairs: 30-layer A/B runs against 16384 (2-core AMD EPYC, AVX-512, KV blocks of 16 and 64
// tokens) measured 1.3-1.9x faster attention from 4096 to 16384 pairs (1 row at 512-1000 keys,
// 4-16 rows at 40-250), and 2048 lost on some calls of 2000-4000 pairs (0.6-0.8x).
constexpr int64_t kMinParallelWork = 4096;

// Work items over the batch: runs of `order`, items[i] = order[starts[i], starts[i + 1]).
// Rows whose first visible block is the same block share it (and, in practice, a prefix of
// blocks): they run in items of up to kMaxSharedRows, sized so each of `threads` threads gets
// one where there are few; every other row is an item of its own. Returns the most rows an
// item holds (1: no rows share).
int64_t ShareBlocks(const Problem& pr, int64_t batch, int64_t threads, std::vector<int64_t>& order,
                    std::vector<int64_t>& starts) {
  order.resize(batch);
  std::iota(order.begin(), order.end(), int64_t{0});
  if (batch == 1) {
    starts = {0, 1};
    return 1;
  }
  const int64_t bs = pr.pool.block_size;
  std::vector<int64_t> first(batch, -1);  // the first visible block's id; -1: no keys
  for (int64_t b = 0; b < batch; ++b) {
    const KeyRange keys = VisibleKeys(pr, b);
    if (keys.end > keys.first) first[b] = pr.tables[b * pr.table_width + keys.first / bs];
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return first[a] < first[b]; });
  int64_t max_rows = 1;
  starts.assign(1, 0);
  for (int64_t i = 0; i < batch;) {
    int64_t run = 1;
    while (first[order[i]] >= 0 && i + run < batch && first[order[i + run]] == first[order[i]]) ++run;
    const int64_t size = std::min(kMaxSharedRows, (run + threads - 1) / threads);
    const int64_t items = (run + size - 1) / size;
    for (int64_t k = 1; k <= items; ++k) starts.push_back(i + run * k / items);
    max_rows = std::max(max_rows, (run + items - 1) / items);
    i += run;
  }
  return max_rows;
}

// Runs `row` over all rows, on the calling thread and, for large batches, on XLA's intra-op
// pool too (while attention runs, the rest of the decode step waits for it), by column_items.h's
// work loop (RunItems): a thread that claims an item makes its scratch, then runs the items it
// claims.
void Run(const Problem& pr, int64_t batch, RowFn row, ffi::ThreadPool& pool) {
  const PoolLayout& L = pr.pool;
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const KeyRange keys = VisibleKeys(pr, b);
    work += (keys.end - keys.first) * pr.num_heads;
  }
  const int64_t threads = work >= kMinParallelWork ? std::max<int64_t>(pool.num_threads(), 1) : 1;
  std::vector<int64_t> order, starts;
  const int64_t max_rows = ShareBlocks(pr, batch, threads, order, starts);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  // Whole items when there are enough of them or rows share blocks, else one item per (row,
  // kv head).
  const int64_t chunks = max_rows > 1 || batch >= 2 * threads ? 1 : L.num_kv_heads;
  const int64_t items = groups * chunks, per_chunk = L.num_kv_heads / chunks;

  raylm::RunItems(items, std::min(threads, items), pool, [per_chunk, chunks, max_rows, row, &pr, &order, &starts] {
    const PoolLayout& L = pr.pool;
    return [per_chunk, chunks, row, &pr, &order, &starts,
            scratch = Scratch(pr.num_heads, pr.num_heads / L.num_kv_heads, L.block_size, L.head_dim,
                              max_rows)](int64_t i) mutable {
      const int64_t kv = (i % chunks) * per_chunk, g = i / chunks;
      row(pr, order.data() + starts[g], starts[g + 1] - starts[g], kv, kv + per_chunk, scratch);
    };
  });
}

// Checks the operands and attributes and fills `pr` (all but the 8-bit pools' scales); an
// error message when they do not fit.
std::string Prepare(QueryBuffer& q, ffi::AnyBuffer& k_pool, ffi::AnyBuffer& v_pool, LayerBuffer& layer,
                    TableBuffer& block_tables, LensBuffer& context_lens, SinkBuffer& sinks,
                    ffi::Result<QueryBuffer>& out, float scale, float softcap, int64_t window, Problem& pr) {
  if (!std::isfinite(scale) || !std::isfinite(softcap) || softcap < 0.0f || window < 0)
    return "paged_decode_attention: scale must be finite, softcap and window >= 0 (0: none); got scale " +
           std::to_string(scale) + ", softcap " + std::to_string(softcap) + ", window " + std::to_string(window);
  const auto qd = q.dimensions();
  const auto kd = k_pool.dimensions();
  const int64_t batch = qd[0], num_heads = qd[1];
  if (kd.size() != 5 || Shape(kd) != Shape(v_pool.dimensions()))
    return "paged_decode_attention: k_pool and v_pool must both be [L, num_blocks, block_size, "
           "kv_heads, head_dim]; got " + Shape(kd) + " and " + Shape(v_pool.dimensions());
  if (k_pool.element_type() != v_pool.element_type())
    return "paged_decode_attention: k_pool and v_pool dtypes differ";
  const PoolLayout pool = StackedPoolLayout(kd);
  if (pool.num_layers < 1 || pool.num_blocks < 1 || pool.num_kv_heads < 1 ||
      num_heads % pool.num_kv_heads != 0 || qd[2] != pool.head_dim)
    return "paged_decode_attention: q " + Shape(qd) + " does not fit pool " + Shape(kd) +
           " (query heads must be a multiple of kv heads, head dims equal)";
  const auto td = block_tables.dimensions();
  if (td[0] != batch || context_lens.dimensions()[0] != batch)
    return "paged_decode_attention: block_tables " + Shape(td) + " and context_lens " +
           Shape(context_lens.dimensions()) + " must have q's batch " + std::to_string(batch);
  const int64_t num_sinks = sinks.dimensions()[0];
  if (num_sinks != 0 && num_sinks != num_heads)
    return "paged_decode_attention: sinks must be [num_heads] = [" + std::to_string(num_heads) +
           "] or [0] (none), got " + Shape(sinks.dimensions());
  const int64_t l = std::clamp<int64_t>(*layer.typed_data(), 0, pool.num_layers - 1);
  const size_t elem = ffi::ByteWidth(k_pool.element_type());
  pr = Problem{q.typed_data(),
               static_cast<const char*>(k_pool.untyped_data()) + l * pool.layer_stride * elem,
               static_cast<const char*>(v_pool.untyped_data()) + l * pool.layer_stride * elem,
               nullptr, nullptr,
               block_tables.typed_data(), context_lens.typed_data(), out->typed_data(), pool,
               num_heads, td[1], scale, softcap, window, num_sinks ? sinks.typed_data() : nullptr};
  return "";
}

}  // namespace
