// Paged decode attention's call (paged_decode_attention.cc): the pool's layout, the operands as
// one Problem, the keys a row sees, and a thread's scratch.
#ifndef RAYLM_ATTENTION_PROBLEM_H_
#define RAYLM_ATTENTION_PROBLEM_H_

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Element strides of one KV pool. Head dim is contiguous (stride 1); everything else is
// explicit so another pool layout only changes StackedPoolLayout.
struct PoolLayout {
  int64_t num_layers, num_blocks, block_size, num_kv_heads, head_dim;
  int64_t layer_stride, block_stride, token_stride, head_stride;
};

// Keys whose scores are summed at once by a lane tree (LaneTree below): a block's scores are
// computed in groups of this many, so each head's score row is padded up to a multiple.
constexpr int64_t kMaxLanes = 16;

inline int64_t ScoreStride(int64_t keys) { return (keys + kMaxLanes - 1) / kMaxLanes * kMaxLanes; }

// Keys one online-softmax step covers (a unit): every block of a unit is scored, then one
// update (the max, the rescaling, the sum of the weights) covers them all, then their values
// are added. Each step costs a few dozen instructions a query head besides its keys' work:
// per block of 16 that was ~20% of a prompt step's samples. Units start at multiples of their
// size in the sequence, so a row's units, and its bits, do not depend on its batch. Against a
// step a block of 16 (one layer's call, float32 pool, 2-core AMD EPYC, AVX2): 304 prompt rows
// over a shared 2,800-key prefix 1.11x, a 512-token prompt 1.11x, 16 decode rows at 1,000 keys
// 1.09x, 64 at 300 1.03x; units of 32 keys measured 0.96-1.10x.
constexpr int64_t kUnitKeys = 64;

// A unit's keys (a whole number of blocks: one where blocks are kUnitKeys or more).
inline int64_t UnitKeys(int64_t block_size) { return std::max(block_size, kUnitKeys); }

// The scores' row length per query head: a unit's keys, and room for the last lane group
// of the unit's last block to be written whole (BlockScores writes whole groups).
inline int64_t UnitScoreStride(int64_t block_size) { return ScoreStride(UnitKeys(block_size)) + kMaxLanes; }

// Rows that share their first block run together, up to this many in one work item
// (AttendRowsOf): their softmax states ([rows, heads, Dh] floats) stay in L1 beside the
// shared block's K and V of one kv head. 4 and 16 measured the same as 8 (0.98-1.03x).
constexpr int64_t kMaxSharedRows = 8;

// Per-thread working memory for up to `rows` rows: the scores of one unit for the query
// heads of one kv head ([group, UnitScoreStride(block_size)]), each row's query heads' running
// max, denominator and float32 accumulator, and one kv head's K and V rows of a unit widened
// to float32 (for the pools AttendUnitOf does not widen in registers).
struct Scratch {
  std::vector<float> scores, max, denom, acc, k_rows, v_rows;
  Scratch(int64_t heads, int64_t group, int64_t block_size, int64_t head_dim, int64_t rows)
      : scores(group * UnitScoreStride(block_size)), max(rows * heads), denom(rows * heads),
        acc(rows * heads * head_dim), k_rows(UnitKeys(block_size) * head_dim),
        v_rows(UnitKeys(block_size) * head_dim) {}
};

struct Problem {
  const float* q;           // [B, H, Dh]
  const void* k_layer;      // k_pool at the clamped layer
  const void* v_layer;
  const float* k_scale_layer;  // per (token, kv head) scales at the layer; null: float pools
  const float* v_scale_layer;
  const int32_t* tables;    // [B, P]
  const int32_t* lens;      // [B]
  float* out;               // [B, H, Dh]
  PoolLayout pool;
  int64_t num_heads, table_width;
  float scale;
  float softcap;            // 0: none
  int64_t window;           // 0: none
  const float* sinks;       // [H]: each head's sink logit (gpt-oss); null: none
};

// The keys row `b` sees, [first, end): the first `lens[b]` (clamped to the table), or only
// the last `window` of them.
struct KeyRange {
  int64_t first, end;
};

inline KeyRange VisibleKeys(const Problem& pr, int64_t b) {
  const int64_t end = std::clamp<int64_t>(pr.lens[b], 0, pr.table_width * pr.pool.block_size);
  return {pr.window > 0 ? std::max<int64_t>(end - pr.window, 0) : 0, end};
}

}  // namespace

#endif  // RAYLM_ATTENTION_PROBLEM_H_
