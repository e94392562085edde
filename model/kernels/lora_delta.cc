// LoRA deltas for CPU, an XLA FFI custom call (model/lora_delta.py).
//
// y_in [M, N] is a projection's result for M rows (the base matmul, whatever computed it); each
// row m carries slots[m]: 0 for the base model, s >= 1 for adapter buffer s - 1. The result adds
// to row m's outputs its adapter's delta (x[m] A_s^T) B_s^T for each target t of the group, and
// aliases y_in (rows of the base model are left as they are).
//
// Operands, one group of targets that read the same input (model/lora_weights.py): x [M, K];
// a [n, T * R, K], the T targets' A of every buffer, each buffer's rows contiguous; then one
// b_t [n, R, O_t] per target (B transposed: each rank's outputs contiguous). The targets' outputs are
// interleaved in y as the fused projection lays them out: y's N columns are `groups` groups
// of W = N / groups, target t owning O_t / groups consecutive columns of each group after the
// earlier targets' (the fused QKV: a group per KV head, then q's heads, k, v; gate/up: one group).
//
// Why a kernel: XLA's gathered form copied every row's adapter out of the slot buffers on
// every step (A and B written and read again) and took a dozen small ops per group of
// targets. Here each adapter is read in place, once per call however many rows use it: rows
// are sorted by slot, and each slot's rows pass its weights together (the dense kernel's
// tiles, dense_matmul.cc: weights streamed in order, the rows in cache). Two phases, each
// split over the calling thread and XLA's pool by output columns: x A^T for every (slot,
// target) by the dense kernel's tiles, then (x A^T) B^T as R vector updates of each slot's
// contiguous outputs (Expand); then each row's sums are added into y.
//
// Batch invariance: x A^T is summed in the dense kernel's TileOf order (lanes along k, the lane
// order, the k tail), which does not depend on how many rows share a tile, a call or a slot;
// (x A^T) B^T over the ranks in order, by the same vector code for every output column (see
// Expand), work items starting at multiples of the vector tile within each target's outputs. So a row's delta is the same bits whatever else is in the batch.

#include <numeric>
#include <vector>

#include "dense_matmul.cc"
#include "ffi_shape.h"

namespace {

using raylm::kColumnsPerItem;
using Slots = ffi::Buffer<ffi::S32, 1>;

// Expand's tile: kExpandVectors vectors of 16 output columns, for up to four rows.
typedef float Lanes16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));

__attribute__((always_inline)) inline Lanes16 LoadLanes16(const float* p) {
  Lanes16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

__attribute__((always_inline)) inline Lanes16 LoadLanes16(const Bf16* p) {  // widened exactly
  U16x16 halves;
  std::memcpy(&halves, p, sizeof halves);
  return reinterpret_cast<Lanes16>(__builtin_convertvector(halves, U32x16) << 16);
}
constexpr int64_t kExpandLanes = 16, kExpandVectors = 4, kExpandTile = kExpandLanes * kExpandVectors;

// Output columns per work item in a phase whose products are `K` long: about as many weights
// as an item of the dense kernel (kColumnsPerItem rows of a projection), a multiple of
// Expand's tile.
int64_t ColumnsPerItem(int64_t K) {
  const int64_t columns = std::max<int64_t>(kColumnsPerItem, (kColumnsPerItem * 576) / std::max<int64_t>(K, 1));
  return (columns + kExpandTile - 1) / kExpandTile * kExpandTile;
}

// Runs `columns(segment, begin, end)` over segments of output columns (their lengths `sizes`)
// as one parallel region. Work items never cross a segment and start at multiples of
// ColumnsPerItem(K) within it, so how a segment's columns are cut does not depend on the others.
template <typename SegmentFn>
void RunSegments(const std::vector<int64_t>& sizes, int64_t K, SegmentFn columns, ffi::ThreadPool& pool) {
  const int64_t per_item = ColumnsPerItem(K);
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

// d[i, o] = sum_r xa[i, r] b[r, o] for MR rows and the kVectors vectors of columns from o,
// the ranks in order: each b vector is loaded once for all the rows.
template <int MR, int kVectors, typename W>
__attribute__((always_inline)) inline void ExpandTile(const float* __restrict xa, const W* __restrict b,
                                                      float* __restrict d, int64_t R, int64_t O, int64_t o) {
  Lanes16 acc[MR][kVectors];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kVectors; ++v) acc[i][v] = Lanes16{};
  for (int64_t r = 0; r < R; ++r) {
    Lanes16 bv[kVectors];
    for (int v = 0; v < kVectors; ++v) bv[v] = LoadLanes16(b + r * O + o + v * kExpandLanes);
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < kVectors; ++v) acc[i][v] += xa[i * R + r] * bv[v];
  }
  for (int i = 0; i < MR; ++i) std::memcpy(d + i * O + o, acc[i], sizeof acc[i]);
}

template <int kVectors, typename W>
__attribute__((always_inline)) inline void ExpandRows(int64_t rows, const float* xa, const W* b, float* d,
                                                      int64_t R, int64_t O, int64_t o) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) ExpandTile<4, kVectors, W>(xa + i * R, b, d + i * O, R, O, o);
  switch (rows - i) {
    case 3: return ExpandTile<3, kVectors, W>(xa + i * R, b, d + i * O, R, O, o);
    case 2: return ExpandTile<2, kVectors, W>(xa + i * R, b, d + i * O, R, O, o);
    case 1: return ExpandTile<1, kVectors, W>(xa + i * R, b, d + i * O, R, O, o);
  }
}

// d [rows, O] = xa [rows, R] . b [R, O], columns [begin, end) (begin a multiple of
// kExpandTile): whole tiles, then single vectors, then the last columns of O (fewer than a
// vector) through a zero-padded float32 copy by the same vector code. So every output is summed
// by the same instructions whatever W (no scalar tail the compiler might fuse otherwise), and
// bfloat16 weights give float32's sums on their values.
template <typename W>
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void Expand(int64_t rows, const float* xa, const W* b, float* d, int64_t R, int64_t O, int64_t begin,
            int64_t end) {
  int64_t o = begin;
  for (; o + kExpandTile <= end; o += kExpandTile) ExpandRows<kExpandVectors>(rows, xa, b, d, R, O, o);
  for (; o + kExpandLanes <= end; o += kExpandLanes) ExpandRows<1>(rows, xa, b, d, R, O, o);
  if (o == end) return;
  const int64_t tail = end - o;
  std::vector<float> panel(R * kExpandLanes, 0.0f), sums(rows * kExpandLanes);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < tail; ++c) panel[r * kExpandLanes + c] = Widen(b[r * O + o + c]);
  ExpandRows<1>(rows, xa, panel.data(), sums.data(), R, kExpandLanes, 0);
  for (int64_t i = 0; i < rows; ++i) std::memcpy(d + i * O + o, &sums[i * kExpandLanes], sizeof(float) * tail);
}

std::string ShapeErrors(const Matrix& y_in, const Matrix& x, const ffi::AnyBuffer& a, const Slots& slots,
                        const std::vector<ffi::AnyBuffer>& bs, const Matrix& y, int64_t groups) {
  const auto ad = a.dimensions();
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], T = bs.size();
  const bool weights = a.element_type() == ffi::DataType::F32 || a.element_type() == ffi::DataType::BF16;
  bool agree = weights && ad.size() == 3 && T > 0 && groups > 0 && y_in.dimensions()[0] == M &&
               slots.dimensions()[0] == M && y.dimensions()[0] == M && y.dimensions()[1] == y_in.dimensions()[1];
  const int64_t R = agree && bs[0].dimensions().size() == 3 ? bs[0].dimensions()[1] : -1;
  agree = agree && ad[1] == T * R && ad[2] == K;
  int64_t N = 0;
  for (const ffi::AnyBuffer& b : bs) {
    const auto bd = b.dimensions();
    agree = agree && b.element_type() == a.element_type() && bd.size() == 3 && bd[0] == ad[0] && bd[1] == R &&
            bd[2] % groups == 0;
    if (agree) N += bd[2];
  }
  if (agree && N == y_in.dimensions()[1]) return "";
  std::string got = "lora_add: y_in [M, N], x [M, K], a [n, T * R, K], slots [M], b_t [n, R, O_t] for T >= 1 "
                    "targets, sum O_t = N, each O_t a multiple of groups " + std::to_string(groups) +
                    ", a and every b float32 or all bfloat16; got y_in " + raylm::Shape(y_in.dimensions()) + ", x " +
                    raylm::Shape(x.dimensions()) + ", a " + raylm::Shape(ad) + ", slots " +
                    raylm::Shape(slots.dimensions());
  for (const ffi::AnyBuffer& b : bs) got += ", b " + raylm::Shape(b.dimensions());
  return got;
}

// One used slot: its buffer, its first row in the sorted order and how many rows.
struct SlotRows {
  int64_t buffer, first, rows;
};

// The deltas of the rows `order` (sorted by slot, `runs` of them per slot) added into out [M, N],
// the slots' weights of type W (float32, or bfloat16 widened exactly as they are read).
template <typename W>
void AddDeltas(const float* x, const W* as, const std::vector<const W*>& bs, const std::vector<int64_t>& outputs,
               const std::vector<int64_t>& order, const std::vector<SlotRows>& runs, float* out, int64_t N, int64_t K,
               int64_t R, int64_t groups, ffi::ThreadPool& pool) {
  const int64_t T = bs.size(), rows = order.size();
  std::vector<float> xs(rows * K);  // the rows' inputs, in sorted order
  for (int64_t i = 0; i < rows; ++i) std::memcpy(&xs[i * K], x + order[i] * K, sizeof(float) * K);

  // Phase 1: xa_t [rows, R] = x A_t^T per target, a segment of R columns per (run, target).
  std::vector<int64_t> sizes;
  for (size_t r = 0; r < runs.size(); ++r) sizes.insert(sizes.end(), T, R);
  std::vector<float> xa(T * rows * R);
  RunSegments(sizes, K, [&](size_t segment, int64_t begin, int64_t end) {
    const SlotRows& run = runs[segment / T];
    const int64_t t = segment % T;
    Columns(&xs[run.first * K], as + (run.buffer * T + t) * R * K, static_cast<const float*>(nullptr),
            &xa[(t * rows + run.first) * R], run.rows, R, K, begin, end, nullptr);
  }, pool);

  // Phase 2: d_t [rows, O_t] = xa_t B_t^T, a segment of O_t columns per (run, target).
  std::vector<int64_t> offsets(T + 1, 0);  // of each target's sums in d
  sizes.clear();
  for (size_t r = 0; r < runs.size(); ++r) sizes.insert(sizes.end(), outputs.begin(), outputs.end());
  for (int64_t t = 0; t < T; ++t) offsets[t + 1] = offsets[t] + rows * outputs[t];
  std::vector<float> d(offsets[T]);
  RunSegments(sizes, R, [&](size_t segment, int64_t begin, int64_t end) {
    const SlotRows& run = runs[segment / T];
    const int64_t t = segment % T, O = outputs[t];
    Expand(run.rows, &xa[(t * rows + run.first) * R], bs[t] + run.buffer * R * O, &d[offsets[t] + run.first * O], R,
           O, begin, end);
  }, pool);

  // Each row's sums into its outputs, where the fused projection keeps each target's.
  const int64_t W_ = N / groups;
  for (int64_t i = 0; i < rows; ++i) {
    float* row = out + order[i] * N;
    int64_t column = 0;  // target t's first column in each group
    for (int64_t t = 0; t < T; ++t) {
      const int64_t width = outputs[t] / groups;
      const float* sums = &d[offsets[t] + i * outputs[t]];
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t c = 0; c < width; ++c) row[g * W_ + column + c] += sums[g * width + c];
      column += width;
    }
  }
}

template <typename W>
std::vector<const W*> Typed(const std::vector<ffi::AnyBuffer>& buffers) {
  std::vector<const W*> out;
  for (const ffi::AnyBuffer& b : buffers) out.push_back(static_cast<const W*>(b.untyped_data()));
  return out;
}

ffi::Error LoraAdd(ffi::ThreadPool pool, Matrix y_in, Matrix x, ffi::AnyBuffer a, Slots slots,
                   ffi::RemainingArgs rest, ffi::Result<Matrix> y, int64_t groups) {
  std::vector<ffi::AnyBuffer> bs;
  for (size_t t = 0; t < rest.size(); ++t) {
    auto b = rest.get<ffi::AnyBuffer>(t);
    if (!b.has_value()) return ffi::Error::InvalidArgument("lora_add: every b must be an array");
    bs.push_back(*b);
  }
  const std::string error = ShapeErrors(y_in, x, a, slots, bs, *y, groups);
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], n = a.dimensions()[0], N = y_in.dimensions()[1];
  const int64_t R = bs[0].dimensions()[1];
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
  if (order.empty() || R == 0) return ffi::Error::Success();
  std::stable_sort(order.begin(), order.end(), [slot](int64_t i, int64_t j) { return slot[i] < slot[j]; });
  std::vector<SlotRows> runs;
  for (int64_t i = 0; i < static_cast<int64_t>(order.size()); ++i) {
    const int64_t buffer = slot[order[i]] - 1;
    if (runs.empty() || runs.back().buffer != buffer) runs.push_back({buffer, i, 0});
    ++runs.back().rows;
  }
  std::vector<int64_t> outputs;
  for (const ffi::AnyBuffer& b : bs) outputs.push_back(b.dimensions()[2]);
  if (a.element_type() == ffi::DataType::BF16)
    AddDeltas(x.typed_data(), static_cast<const Bf16*>(a.untyped_data()), Typed<Bf16>(bs), outputs, order, runs, out,
              N, K, R, groups, pool);
  else
    AddDeltas(x.typed_data(), static_cast<const float*>(a.untyped_data()), Typed<float>(bs), outputs, order, runs,
              out, N, K, R, groups, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmLoraAdd, LoraAdd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Slots>()
                                  .RemainingArgs()
                                  .Ret<Matrix>()
                                  .Attr<int64_t>("groups"));
