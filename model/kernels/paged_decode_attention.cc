// Paged decode attention for CPU, an XLA FFI custom call (see model/kernels/paged_decode.py).
//
// Why a kernel: XLA's CPU path gathers every row's whole bucketed block-table width per
// layer, copies it again into a dot-friendly layout and softmaxes over the padding. Here
// each row walks only its real blocks through its block table, reads K/V in place from
// the pool (no gather copy) and keeps an online softmax in float32; a K/V row serves all
// query heads of its GQA group while it is in L1. Large batches are split over XLA's
// intra-op thread pool.
//
// Operands: q [B, H, Dh] f32; k_pool, v_pool (f32 or bf16, layout: PoolLayout below);
// layer [] s32; block_tables [B, P] s32; context_lens [B] s32 (keys the query sees:
// position + 1 for a real decode row, 0 for a padding row). Result: [B, H, Dh] f32,
// zeros for rows with no keys. Block ids and the layer are clamped, so no input can make
// the kernel read outside the pool.
//
// Attributes (model.config.model_config.AttentionSpec): `scale` multiplies q.k; `softcap` > 0 turns a
// score s into softcap * tanh(s / softcap) before the softmax (Gemma 2), 0 leaves it;
// `window` > 0 lets a row with n keys see only keys max(0, n - window) .. n - 1 (sliding
// window layers), 0 all n. A windowed row starts at the block holding its first visible key
// and never reads the table entries or blocks before it: the engine may have freed those
// blocks and pointed their entries at the null block.
//
// The quantized variant takes 8-bit pools (int8 or float8 e4m3fn) and after each a float32
// scale per (token, kv head), [L, num_blocks, block_size, KVH]: a key's score is its 8-bit
// dot product times its scale, a value row's weight is its probability times its scale.

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
                    TableBuffer& block_tables, LensBuffer& context_lens, ffi::Result<QueryBuffer>& out,
                    float scale, float softcap, int64_t window, Problem& pr) {
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
  const int64_t l = std::clamp<int64_t>(*layer.typed_data(), 0, pool.num_layers - 1);
  const size_t elem = ffi::ByteWidth(k_pool.element_type());
  pr = Problem{q.typed_data(),
               static_cast<const char*>(k_pool.untyped_data()) + l * pool.layer_stride * elem,
               static_cast<const char*>(v_pool.untyped_data()) + l * pool.layer_stride * elem,
               nullptr, nullptr,
               block_tables.typed_data(), context_lens.typed_data(), out->typed_data(), pool,
               num_heads, td[1], scale, softcap, window};
  return "";
}

ffi::Error PagedDecodeAttention(ffi::ThreadPool thread_pool, QueryBuffer q,
                                ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, LayerBuffer layer,
                                TableBuffer block_tables, LensBuffer context_lens, float scale, float softcap,
                                int64_t window, ffi::Result<QueryBuffer> out) {
  Problem pr{};
  const std::string error =
      Prepare(q, k_pool, v_pool, layer, block_tables, context_lens, out, scale, softcap, window, pr);
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t batch = q.dimensions()[0];
  return raylm::RunOnDataOf<float, Bf16>(
      k_pool, "paged_decode_attention: pool dtype must be float32 or bfloat16", [&](const auto* kv) {
        Run(pr, batch, RowKernel<std::remove_const_t<std::remove_pointer_t<decltype(kv)>>>(pr.pool.head_dim),
            thread_pool);
      });
}

// 8-bit pools with their scales [L, num_blocks, block_size, KVH].
ffi::Error QuantizedPagedDecodeAttention(ffi::ThreadPool thread_pool, QueryBuffer q, ffi::AnyBuffer k_pool,
                                         ScaleBuffer k_scale, ffi::AnyBuffer v_pool, ScaleBuffer v_scale,
                                         LayerBuffer layer, TableBuffer block_tables, LensBuffer context_lens,
                                         float scale, float softcap, int64_t window,
                                         ffi::Result<QueryBuffer> out) {
  Problem pr{};
  const std::string error =
      Prepare(q, k_pool, v_pool, layer, block_tables, context_lens, out, scale, softcap, window, pr);
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const PoolLayout& L = pr.pool;
  const auto kd = k_pool.dimensions();
  const std::string scale_shape = Shape(kd).substr(0, Shape(kd).rfind(',')) + "]";
  if (Shape(k_scale.dimensions()) != scale_shape || Shape(v_scale.dimensions()) != scale_shape)
    return ffi::Error::InvalidArgument("paged_decode_attention: scales must be " + scale_shape + ", got " +
                                       Shape(k_scale.dimensions()) + " and " + Shape(v_scale.dimensions()));
  const int64_t l = std::clamp<int64_t>(*layer.typed_data(), 0, L.num_layers - 1);
  const int64_t scale_layer_stride = L.num_blocks * L.block_size * L.num_kv_heads;
  pr.k_scale_layer = k_scale.typed_data() + l * scale_layer_stride;
  pr.v_scale_layer = v_scale.typed_data() + l * scale_layer_stride;
  const int64_t batch = q.dimensions()[0];
  return raylm::RunOnDataOf<int8_t, Fp8E4m3>(
      k_pool, "paged_decode_attention: quantized pools must be int8 or float8_e4m3fn", [&](const auto* kv) {
        Run(pr, batch, RowKernel<std::remove_const_t<std::remove_pointer_t<decltype(kv)>>>(L.head_dim), thread_pool);
      });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmPagedDecodeAttention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<QueryBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<LayerBuffer>()
                                  .Arg<TableBuffer>()
                                  .Arg<LensBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Ret<QueryBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmQuantizedPagedDecodeAttention, QuantizedPagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<QueryBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ScaleBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ScaleBuffer>()
                                  .Arg<LayerBuffer>()
                                  .Arg<TableBuffer>()
                                  .Arg<LensBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Ret<QueryBuffer>());
