// LoRA deltas for CPU, an XLA FFI custom call (model/kernels/lora_delta.py).
//
// y_in [M, N] is a projection's result for M rows (the base matmul, whatever computed it); each
// row m carries slots[m]: 0 for the base model, s >= 1 for adapter buffer s - 1. The result adds
// to row m's outputs its adapter's delta (x[m] A_s^T) B_s^T for each target t of the group, and
// aliases y_in (rows of the base model are left as they are).
//
// Operands, one group of targets that read the same input (model/decoder/lora_slots.py): x [M, K];
// the slots' weights w [n, S], every buffer's adapter packed in its row of S values (float32, or
// bfloat16 or int8 widened exactly as read), so that a step passes one array for all its layers
// rather than one per layer and target (each argument costs the step microseconds of dispatch);
// in it, at `a_offset`, the T targets' A [T * R, K], then at `b_offsets[t]` target t's B^T [R,
// O_t] in tiles of 64 outputs (see TiledColumns); int8 weights have float32 scales [n, S2],
// A's one per row at `a_scale_offset`, target t's B one per output at `b_scale_offsets[t]`.
// The targets' outputs are interleaved in y as the fused projection lays them out: y's N
// columns are `groups` groups of W = N / groups, target t owning O_t / groups consecutive
// columns of each group after the earlier targets' (the fused QKV: a group per KV head, then
// q's heads, k, v; gate/up: one group).
//
// Why a kernel: XLA's gathered form copied every row's adapter out of the slot buffers on
// every step (A and B written and read again) and took a dozen small ops per group of
// targets. Here each adapter is read in place, once per call however many rows use it: rows
// are sorted by slot, and each slot's rows pass its weights together (the dense kernel's
// tiles, dense_columns.h: weights streamed in order, the rows in cache). Two phases: x A^T for
// every (slot, target) by the dense kernel's tiles, then (x A^T) B^T as R vector updates of each
// slot's contiguous outputs (Expand); then each row's sums are added into y. A call with several
// (slot, target) pairs runs both phases of a pair, and the adds of its sums, as one work item,
// over the calling thread and XLA's pool (one parallel region, the pair's x A^T and sums still in
// cache); a call with one pair splits each phase by output columns instead, and adds after them
// (AddDeltas).
//
// Batch invariance: x A^T is summed in the dense kernel's TileOf order (lanes along k, the lane
// order, the k tail), which does not depend on how many rows share a tile, a call or a slot;
// (x A^T) B^T over the ranks in order, by the same vector code for every output column (see
// Expand), work items starting at multiples of the vector tile within each target's outputs;
// int8 sums scaled per row of A by the dense kernel's tiles and per output of B by one multiply
// before the add. So a row's delta is the same bits whatever else is in the batch.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "column_items.h"
#include "dense_columns.h"
#include "ffi_helpers.h"
#include "lora_expand.h"

using raylm::Bf16;
using raylm::Matrix;

namespace {

using Slots = ffi::Buffer<ffi::S32, 1>;

// Weights per work item of a call split by columns (one (slot, target) pair, kFusedMinPairs):
// small enough that both threads share it, large enough that claiming an item costs nothing next
// to reading it.
constexpr int64_t kLoraItemWeights = 16384;
// Phase 1's items start at multiples of this many rows of A (a multiple of the tiles' rows).
constexpr int64_t kPhaseOneAlign = 16;
// From this many (slot, target) pairs in a call, each pair's two phases are one work item, in
// one parallel region (below, each phase is split by columns in a region of its own). Against
// two regions per call, the 120 calls of a step (rank 64, int8 slots, 2-core AVX-512 EPYC,
// alternating runs) took 0.63-0.81x the time at 16 rows over 8 adapters back to back (0.80-0.87x
// from memory), 0.55-0.76x at two rows, and 0.71-0.85x at one row (0.78-0.93x from memory),
// where QKV's three targets and gate/up's two are the pairs; a call of one pair (one row's
// o_proj or down_proj) has one item to give, and stays split.
constexpr int64_t kFusedMinPairs = 2;

// Output columns per work item in a phase whose products are `K` long: about kLoraItemWeights
// weights, a multiple of `align` (Expand's tile in phase 2; phase 1's tiles give each output the
// same sums wherever an item starts).
int64_t ColumnsPerItem(int64_t K, int64_t align) {
  const int64_t columns = std::max<int64_t>(align, kLoraItemWeights / std::max<int64_t>(K, 1));
  return (columns + align - 1) / align * align;
}

// Runs `columns(segment, begin, end)` over segments of output columns (their lengths `sizes`)
// as one parallel region. Work items never cross a segment and start at multiples of
// ColumnsPerItem(K, align) within it, so how a segment's columns are cut does not depend on the
// others.
template <typename SegmentFn>
void RunSegments(const std::vector<int64_t>& sizes, int64_t K, int64_t align, SegmentFn columns,
                 ffi::ThreadPool& pool) {
  const int64_t per_item = ColumnsPerItem(K, align);
  std::vector<int64_t> starts(sizes.size() + 1, 0);  // each segment padded to whole items
  for (size_t s = 0; s < sizes.size(); ++s) starts[s + 1] = starts[s] + (sizes[s] + per_item - 1) / per_item * per_item;
  const int64_t total = starts.back();
  if (total == 0) return;
  Run(total, K, 0,
      [&starts, &sizes, columns](int64_t begin, int64_t end, float*) {
        const size_t s = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
        const int64_t hi = std::min(end - starts[s], sizes[s]);
        if (begin - starts[s] < hi) columns(s, begin - starts[s], hi);
      },
      pool, per_item);
}

// The packed layout (offsets and sizes, in values of w's rows) against the operands' shapes.
std::string ShapeErrors(const Matrix& y_in, const Matrix& x, const Slots& slots, const ffi::AnyBuffer& w,
                        const Matrix& scales, const Matrix& y, int64_t groups, int64_t R, int64_t a_offset,
                        ffi::Span<const int64_t> b_offsets, ffi::Span<const int64_t> outputs, int64_t a_scale_offset,
                        ffi::Span<const int64_t> b_scale_offsets) {
  const auto wd = w.dimensions();
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], T = outputs.size();
  const bool int8 = w.element_type() == ffi::DataType::S8;
  const bool weights = int8 || w.element_type() == ffi::DataType::F32 || w.element_type() == ffi::DataType::BF16;
  bool agree = weights && wd.size() == 2 && T > 0 && b_offsets.size() == outputs.size() && groups > 0 && R >= 0 &&
               scales.dimensions()[0] == wd[0] && b_scale_offsets.size() == (int8 ? outputs.size() : 0) &&
               y_in.dimensions()[0] == M && slots.dimensions()[0] == M && y.dimensions()[0] == M &&
               y.dimensions()[1] == y_in.dimensions()[1];
  const int64_t S = agree ? wd[1] : 0;
  agree = agree && a_offset >= 0 && a_offset + T * R * K <= S;
  int64_t N = 0;
  const int64_t S2 = scales.dimensions()[1];
  agree = agree && (!int8 || (a_scale_offset >= 0 && a_scale_offset + T * R <= S2));
  for (int64_t t = 0; agree && t < T; ++t) {
    agree = outputs[t] >= 0 && outputs[t] % groups == 0 && b_offsets[t] >= 0 &&
            b_offsets[t] + R * TiledColumns(outputs[t]) <= S &&
            (!int8 || (b_scale_offsets[t] >= 0 && b_scale_offsets[t] + outputs[t] <= S2));
    N += outputs[t];
  }
  if (agree && N == y_in.dimensions()[1]) return "";
  std::string got = "lora_add: y_in [M, N], x [M, K], slots [M], w [n, S] float32, bfloat16 or int8 holding at "
                    "a_offset A [T * R, K] and at each b_offsets[t] B^T [R, O_t] in tiles of 64 outputs "
                    "(R * ceil(O_t / 64) * 64 values) for T >= 1 targets, sum O_t = N, "
                    "each O_t a multiple of groups " + std::to_string(groups) + ", scales [n, S2] (int8: A's row "
                    "scales at a_scale_offset, B's column scales at each b_scale_offsets[t]); got y_in " +
                    raylm::Shape(y_in.dimensions()) + ", x " + raylm::Shape(x.dimensions()) + ", slots " +
                    raylm::Shape(slots.dimensions()) + ", w " + raylm::Shape(wd) + ", scales " +
                    raylm::Shape(scales.dimensions()) + ", R " + std::to_string(R) + ", a_offset " +
                    std::to_string(a_offset) + ", b_offsets " + raylm::Shape(b_offsets) + ", outputs " +
                    raylm::Shape(outputs) + ", a_scale_offset " + std::to_string(a_scale_offset) +
                    ", b_scale_offsets " + raylm::Shape(b_scale_offsets);
  return got;
}

// One used slot: its buffer, its first row in the sorted order and how many rows.
struct SlotRows {
  int64_t buffer, first, rows;
};

// Where a call's adapters lie: buffer b's A of target t at w + b * S + a_offset + t * R * K, its
// B^T at w + b * S + b_offsets[t]; int8 weights with A's row scales at scales + b * S2 +
// a_scale_offset + t * R and B's output column scales at scales + b * S2 + b_scale_offsets[t].
struct Packed {
  int64_t S, a_offset;
  ffi::Span<const int64_t> b_offsets, outputs;
  const float* scales;  // null for float weights
  int64_t S2, a_scale_offset;
  ffi::Span<const int64_t> b_scale_offsets;
};

// out[c] += sums[c] for c < n: one target's outputs in one group of a row (int8 sums come
// already scaled: ExpandTile rounds each product before this add, so no clone can fuse the two).
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void AddSums(float* __restrict out, const float* __restrict sums, int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] += sums[c];
}

// The deltas of the rows `order` (sorted by slot, `runs` of them per slot) added into out [M, N],
// the slots' weights of type W (float32, or bfloat16 or int8 widened exactly as they are read;
// int8 sums scaled by A's row scale, then each output by B's column scale).
template <typename W>
void AddDeltas(const float* x, const W* w, const Packed& p, const std::vector<int64_t>& order,
               const std::vector<SlotRows>& runs, float* out, int64_t N, int64_t K, int64_t R, int64_t groups,
               ffi::ThreadPool& pool) {
  const ffi::Span<const int64_t>& outputs = p.outputs;
  const int64_t T = outputs.size(), rows = order.size();
  // Scratch that every phase writes whole before it is read: left uninitialized (at one row its
  // zeroing and SSE adds were a sizable part of a rank-8 call).
  std::unique_ptr<float[]> xs(new float[rows * K]);  // the rows' inputs, in sorted order
  for (int64_t i = 0; i < rows; ++i) std::memcpy(&xs[i * K], x + order[i] * K, sizeof(float) * K);

  // Phase 1: xa_t [rows, R] = x A_t^T per target; `shrink` computes columns [begin, end) of
  // segment (run, target)'s R.
  std::unique_ptr<float[]> xa(new float[T * rows * R]);
  // Columns widens every slot type in registers when given no panel (null below), bfloat16
  // slots too (which 16-bit weight matrices widen through a panel).
  const auto shrink = [&](size_t segment, int64_t begin, int64_t end) {
    const SlotRows& run = runs[segment / T];
    const int64_t t = segment % T;
    const float* row_scales = p.scales ? p.scales + run.buffer * p.S2 + p.a_scale_offset + t * R : nullptr;
    Columns(&xs[run.first * K], w + run.buffer * p.S + p.a_offset + t * R * K, row_scales,
            &xa[(t * rows + run.first) * R], run.rows, R, K, begin, end, nullptr);
  };

  // Phase 2: d_t [rows, O_t'] = xa_t B_t^T (int8: times B's column scales); `expand` computes
  // columns [begin, end) of segment (run, target)'s O_t', which is O_t in whole tiles (the
  // columns past O_t are zero weights, computed and dropped).
  std::vector<int64_t> offsets(T + 1, 0), tiled(T);  // each target's sums in d, and its O_t'
  for (int64_t t = 0; t < T; ++t) tiled[t] = TiledColumns(outputs[t]);
  for (int64_t t = 0; t < T; ++t) offsets[t + 1] = offsets[t] + rows * tiled[t];
  std::unique_ptr<float[]> d(new float[offsets[T]]);  // every tile's every column
  const auto expand = [&](size_t segment, int64_t begin, int64_t end) {
    const SlotRows& run = runs[segment / T];
    const int64_t t = segment % T, O = tiled[t];
    const W* b = w + run.buffer * p.S + p.b_offsets[t];
    const float* column_scales = p.scales ? p.scales + run.buffer * p.S2 + p.b_scale_offsets[t] : nullptr;
    float* sums = &d[offsets[t] + run.first * O];
    ExpandSlots(run.rows, &xa[(t * rows + run.first) * R], b, column_scales, outputs[t], sums, O, R, begin, end);
  };

  // Segment (run, target)'s sums into its rows' outputs, where the fused projection keeps the
  // target's: in a call of several pairs each pair's item adds its own, while they are in cache
  // (a serial pass after the region took ~9% of a 16-row call over 8 adapters).
  const int64_t W_ = N / groups;
  std::vector<int64_t> first_column(T, 0);  // target t's first column in each group
  for (int64_t t = 1; t < T; ++t) first_column[t] = first_column[t - 1] + outputs[t - 1] / groups;
  const auto add = [&](size_t segment) {
    const SlotRows& run = runs[segment / T];
    const int64_t t = segment % T, width = outputs[t] / groups;
    for (int64_t i = run.first; i < run.first + run.rows; ++i) {
      float* row = out + order[i] * N + first_column[t];
      const float* sums = &d[offsets[t] + i * tiled[t]];
      for (int64_t g = 0; g < groups; ++g) AddSums(row + g * W_, sums + g * width, width);
    }
  };

  // The same sums either way: phase 1's items start at multiples of kPhaseOneAlign within a
  // target's R columns (a pair's item at 0), phase 2's at multiples of the tile.
  const int64_t pairs = static_cast<int64_t>(runs.size()) * T;
  if (pairs >= kFusedMinPairs) {
    int64_t weights = 0;  // a pair's, on average: Run's measure of the call's size
    for (int64_t t = 0; t < T; ++t) weights += R * (K + tiled[t]);
    Run(pairs, weights / T, 0, [&](int64_t begin, int64_t end, float*) {
      for (int64_t i = begin; i < end; ++i) {
        shrink(i, 0, R);
        expand(i, 0, tiled[i % T]);
        add(i);
      }
    }, pool, 1);
    return;
  }
  std::vector<int64_t> sizes;
  for (size_t r = 0; r < runs.size(); ++r) sizes.insert(sizes.end(), T, R);
  RunSegments(sizes, K, kPhaseOneAlign, shrink, pool);
  sizes.clear();
  for (size_t r = 0; r < runs.size(); ++r) sizes.insert(sizes.end(), tiled.begin(), tiled.end());
  RunSegments(sizes, R, kExpandTile, expand, pool);
  for (int64_t segment = 0; segment < pairs; ++segment) add(segment);
}

ffi::Error LoraAdd(ffi::ThreadPool pool, Matrix y_in, Matrix x, Slots slots, ffi::AnyBuffer w, Matrix scales,
                   ffi::Result<Matrix> y, int64_t groups, int64_t rank, int64_t a_offset,
                   ffi::Span<const int64_t> b_offsets, ffi::Span<const int64_t> outputs, int64_t a_scale_offset,
                   ffi::Span<const int64_t> b_scale_offsets) {
  const std::string error = ShapeErrors(y_in, x, slots, w, scales, *y, groups, rank, a_offset, b_offsets, outputs,
                                        a_scale_offset, b_scale_offsets);
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], n = w.dimensions()[0], S = w.dimensions()[1];
  const int64_t N = y_in.dimensions()[1];
  float* out = y->typed_data();
  if (out != y_in.typed_data()) std::memcpy(out, y_in.typed_data(), sizeof(float) * M * N);

  // Rows with an adapter, sorted by slot (stable), and each used slot's run of them.
  const int32_t* slot = slots.typed_data();
  std::vector<int64_t> order;
  for (int64_t m = 0; m < M; ++m) {
    if (slot[m] < 0 || slot[m] > n)
      return ffi::Error::InvalidArgument("lora_add: row " + std::to_string(m) + " has slot " +
                                         std::to_string(slot[m]) + ", outside [0, " + std::to_string(n) + "]");
    if (slot[m] > 0) order.push_back(m);
  }
  if (order.empty() || rank == 0) return ffi::Error::Success();
  std::stable_sort(order.begin(), order.end(), [slot](int64_t i, int64_t j) { return slot[i] < slot[j]; });
  std::vector<SlotRows> runs;
  for (int64_t i = 0; i < static_cast<int64_t>(order.size()); ++i) {
    const int64_t buffer = slot[order[i]] - 1;
    if (runs.empty() || runs.back().buffer != buffer) runs.push_back({buffer, i, 0});
    ++runs.back().rows;
  }
  const bool int8 = w.element_type() == ffi::DataType::S8;
  const Packed packed{S, a_offset, b_offsets, outputs, int8 ? scales.typed_data() : nullptr, scales.dimensions()[1],
                      a_scale_offset, b_scale_offsets};
  return raylm::RunOnDataOf<int8_t, Bf16, float>(
      w, "lora_add: w must be float32, bfloat16 or int8",
      [&](const auto* ws) { AddDeltas(x.typed_data(), ws, packed, order, runs, out, N, K, rank, groups, pool); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmLoraAdd, LoraAdd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Arg<Slots>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>()
                                  .Attr<int64_t>("groups")
                                  .Attr<int64_t>("rank")
                                  .Attr<int64_t>("a_offset")
                                  .Attr<ffi::Span<const int64_t>>("b_offsets")
                                  .Attr<ffi::Span<const int64_t>>("outputs")
                                  .Attr<int64_t>("a_scale_offset")
                                  .Attr<ffi::Span<const int64_t>>("b_scale_offsets"));
