// Paged decode attention's work item (paged_decode_attention.cc): the query heads of a range of
// kv heads of a few rows, unit by unit (AttendUnitOf, AttendRowsOf), the blocks prefetched.
#ifndef RAYLM_ATTENTION_ROWS_H_
#define RAYLM_ATTENTION_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention_lanes.h"
#include "attention_math.h"
#include "attention_problem.h"

namespace {

// Blocks sit at random places in the pool, beyond what the hardware prefetcher guesses. The
// first kilobyte of the next block's K and V is asked for while this one is computed; the
// hardware prefetcher follows the rest of each stream. Measured on 30-layer steps (2-core
// AMD EPYC, 16-lane family): 64 rows x 192 keys 28.5 ms without prefetching, 27.6 ms
// prefetching whole blocks, 26.2 ms with the first kilobyte; 16 rows x 550 keys sharing a
// 512-key prefix (in cache) 6.8, 7.7 and 6.6 ms; 64 rows x 550 keys 81.5, 82.6 and 75.6 ms.
constexpr int64_t kPrefetchBytes = 1024;

template <typename KV>
inline void Prefetch(const KV* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < count * static_cast<int64_t>(sizeof(KV)); off += 64)
    __builtin_prefetch(bytes + off);
}

// Within a block, one kv head's rows are `dh` elements every `stride` (the other heads' rows
// lie between), a pattern the hardware prefetcher does not follow ahead of the loads: a perf
// profile of an int8 pool had 30% of the kernel's samples on the first load of each value row.
// So each kv head asks for its n value rows before scoring its keys, and for the next kv head's
// key rows. Against the first kilobyte of the next block alone (30-layer calls, blocks of 64,
// 2-core AMD EPYC, alternating in one process): int8 pool 64 rows x 192 keys 1.24 x 1.07 =
// ~1.33x, 16 x 192 1.28 x 1.07, 64 x 550 1.21 x 1.10; bfloat16 1.04-1.08 x 1.06-1.08;
// float32 1.04-1.08 x 0.98-1.00; rows sharing a cached prefix 1.00.
template <typename KV>
inline void PrefetchRows(const KV* rows, int64_t stride, int64_t n, int64_t dh) {
  for (int64_t t = 0; t < n; ++t) Prefetch(rows + t * stride, dh);
}

// One row's online-softmax state: each query head's running max, denominator and float32
// accumulator ([num_heads], [num_heads], [num_heads, Dh]), indexed by the row's query head.
struct RowState {
  float* max;
  float* denom;
  float* acc;
};

// The part of block `j` that row `b` (visible keys `keys`) sees: its K and V rows in the pool
// (one kv head's rows are head_stride apart within them), how many, and the index of the first
// one's per (token, kv head) scale.
template <typename KV>
struct Segment {
  const KV* k;
  const KV* v;
  int64_t n, scale_index;
};

template <typename KV>
inline Segment<KV> SegmentOf(const Problem& pr, int64_t b, int64_t j, KeyRange keys) {
  const PoolLayout& L = pr.pool;
  const int64_t bs = L.block_size;
  const int64_t block = std::clamp<int64_t>(pr.tables[b * pr.table_width + j], 0, L.num_blocks - 1);
  // The visible keys are the block's slots [t0, t0 + n): t0 > 0 only where a window starts.
  const int64_t t0 = std::max<int64_t>(keys.first - j * bs, 0);
  const int64_t n = std::min(bs, keys.end - j * bs) - t0;
  const int64_t at = block * L.block_stride + t0 * L.token_stride;
  return {static_cast<const KV*>(pr.k_layer) + at, static_cast<const KV*>(pr.v_layer) + at, n,
          (block * bs + t0) * L.num_kv_heads};
}

// The blocks of unit `u` that keys `keys` touch, [begin, end) (empty past the keys).
struct BlockSpan {
  int64_t begin, end;
};

inline BlockSpan UnitBlocks(const PoolLayout& L, int64_t u, KeyRange keys) {
  const int64_t bs = L.block_size, m = UnitKeys(bs) / bs;
  return {std::max(u * m, keys.first / bs), std::min((u + 1) * m, (keys.end + bs - 1) / bs)};
}

// 8-bit pools: the scores ([group, stride], the segments' keys in order) of kv head `kvh`
// times each key's per (token, kv head) scale in `scales`.
template <typename KV>
inline void ScaleScores(const float* scales, const Segment<KV>* seg, int64_t segments, int64_t kvh,
                        int64_t kv_heads, float* __restrict scores, int64_t stride, int64_t group) {
  for (int64_t i = 0, at = 0; i < segments; at += seg[i++].n) {
    const float* ks = scales + seg[i].scale_index + kvh;
    for (int64_t h = 0; h < group; ++h)
      for (int64_t t = 0; t < seg[i].n; ++t) scores[h * stride + at + t] *= ks[t * kv_heads];
  }
}

// Unit `u` of row `b` (visible keys `keys`) for the query heads of kv heads [kv_begin,
// kv_end): every block's scores, one softmax update and the values, into `st`. Kv heads are
// the inner loop, so a unit's K/V streams in once. `prefetch`: ask for the start of the row's
// next unit's blocks meanwhile. DH > 0 fixes the head dim at compile time; when it is a
// multiple of V's lanes, scores are summed by lane trees and the value accumulators stay in
// registers (BlockScores, AccumulateValues), else (DH == 0: taken from the pool) scalar
// reductions run. A (row, kv head)'s arithmetic depends only on its own state and unit, so the
// order AttendRowsOf visits them in does not change a bit.
template <typename KV, int DH, typename V>
__attribute__((always_inline)) inline void AttendUnitOf(const Problem& pr, int64_t b, int64_t u, KeyRange keys,
                                                        int64_t kv_begin, int64_t kv_end, RowState st,
                                                        Scratch& s, bool prefetch) {
  constexpr bool kVectorised = DH > 0 && DH % kLanesOf<V> == 0;
  // What the K and V rows are read as: the pool's own type where the loops widen it in
  // registers, else float32 rows widened into the scratch first. In registers for bfloat16 and
  // int8 pools in the sixteen-lane family (one or two instructions a vector), where it beat the
  // scratch rows 1.07-1.34x (30-layer calls, 2-core AMD EPYC: 64 rows x 256 keys, 1 x 1024, 16 x
  // 100); the eight-lane family's loads take more steps, and there it lost (0.66-0.91x).
  using Elem = std::conditional_t<std::is_same_v<KV, float> ||
                                      (kVectorised && kLanesOf<V> == 16 &&
                                       (std::is_same_v<KV, Bf16> || std::is_same_v<KV, int8_t>)),
                                  KV, float>;
  const PoolLayout& L = pr.pool;
  const int64_t dh = DH > 0 ? DH : L.head_dim, ss = UnitScoreStride(L.block_size);
  const int64_t group = pr.num_heads / L.num_kv_heads;
  const float* __restrict q = pr.q + b * pr.num_heads * dh;
  float* __restrict scores = s.scores.data();
  Segment<KV> seg[kUnitKeys];  // a unit has at most kUnitKeys blocks (blocks of one key)
  int64_t segments = 0, n = 0;
  const BlockSpan span = UnitBlocks(L, u, keys);
  for (int64_t j = span.begin; j < span.end; ++j) {
    seg[segments] = SegmentOf<KV>(pr, b, j, keys);
    n += seg[segments++].n;
  }
  if (prefetch) {
    const BlockSpan next = UnitBlocks(L, u + 1, keys);
    const int64_t count = std::min<int64_t>(kPrefetchBytes / sizeof(KV), L.block_stride);
    for (int64_t j = next.begin; j < next.end; ++j) {
      const int64_t block = std::clamp<int64_t>(pr.tables[b * pr.table_width + j], 0, L.num_blocks - 1);
      Prefetch(static_cast<const KV*>(pr.k_layer) + block * L.block_stride, count);
      Prefetch(static_cast<const KV*>(pr.v_layer) + block * L.block_stride, count);
    }
  }
  RowRun<Elem> k_runs[kUnitKeys], v_runs[kUnitKeys];
  for (int64_t kvh = kv_begin; kvh < kv_end; ++kvh) {
    const int64_t h0 = kvh * group;  // this group's first head
    float* __restrict acc = st.acc + h0 * dh;
    for (int64_t i = 0; i < segments; ++i) {
      PrefetchRows(seg[i].v + kvh * L.head_stride, L.token_stride, seg[i].n, dh);
      if (kvh + 1 < kv_end) PrefetchRows(seg[i].k + (kvh + 1) * L.head_stride, L.token_stride, seg[i].n, dh);
    }
    // This kv head's K and V rows as Elem (above): in place, a run a block, or widened once
    // into the scratch rows, one run.
    int64_t runs = 0;
    if constexpr (std::is_same_v<Elem, KV>) {
      for (; runs < segments; ++runs) {
        k_runs[runs] = {seg[runs].k + kvh * L.head_stride, seg[runs].n, L.token_stride};
        v_runs[runs] = {seg[runs].v + kvh * L.head_stride, seg[runs].n, L.token_stride};
      }
    } else {
      for (int64_t i = 0, at = 0; i < segments; at += seg[i++].n) {
        WidenRows(seg[i].k + kvh * L.head_stride, L.token_stride, seg[i].n, dh, s.k_rows.data() + at * dh);
        WidenRows(seg[i].v + kvh * L.head_stride, L.token_stride, seg[i].n, dh, s.v_rows.data() + at * dh);
      }
      k_runs[0] = {s.k_rows.data(), n, dh};
      v_runs[0] = {s.v_rows.data(), n, dh};
      runs = 1;
    }
    // Heads outer, keys inner: a head's query (then its accumulator) stays in registers
    // across a block while the block's K (then V) rows come from L1. A run's last lane group
    // is written whole; the next run's scores overwrite what lies past its keys.
    for (int64_t h = 0; h < group; ++h) {
      float* __restrict sh = scores + h * ss;
      for (int64_t i = 0; i < runs; sh += k_runs[i++].n) {
        const RowRun<Elem>& r = k_runs[i];
        if constexpr (kVectorised) {
          BlockScores<V, DH, Elem>(q + (h0 + h) * dh, r.rows, r.stride, r.n, pr.scale, sh);
        } else {
          for (int64_t t = 0; t < r.n; ++t) sh[t] = Dot(q + (h0 + h) * dh, r.rows + t * r.stride, dh) * pr.scale;
        }
      }
    }
    if (pr.k_scale_layer) ScaleScores(pr.k_scale_layer, seg, segments, kvh, L.num_kv_heads, scores, ss, group);
    if (pr.softcap > 0.0f) SoftCap<V>(scores, ss, n, group, pr.softcap);
    SoftmaxUpdate<V>(scores, ss, n, group, dh, st.max + h0, st.denom + h0, acc);
    // a value row's weight: its probability times its scale
    if (pr.v_scale_layer) ScaleScores(pr.v_scale_layer, seg, segments, kvh, L.num_kv_heads, scores, ss, group);
    if constexpr (kVectorised) {
      constexpr int G = kValueHeads<V, DH>;
      int64_t h = 0;
      for (; h + G <= group; h += G)
        AccumulateValues<V, DH, G, Elem>(scores + h * ss, ss, v_runs, runs, acc + h * dh);
      AccumulateValuesRest<V, DH, Elem>(group - h, scores + h * ss, ss, v_runs, runs, acc + h * dh);
    } else {
      for (int64_t h = 0; h < group; ++h) {
        float* __restrict ah = acc + h * dh;
        const float* p = scores + h * ss;
        for (int64_t i = 0; i < runs; p += v_runs[i++].n) {
          for (int64_t t = 0; t < v_runs[i].n; ++t) {
            const float* __restrict vt = v_runs[i].rows + t * v_runs[i].stride;
#pragma omp simd
            for (int64_t d = 0; d < dh; ++d) ah[d] += p[t] * vt[d];
          }
        }
      }
    }
  }
}

// What a head's accumulator (values summed with weights exp(s - max), the weights' sum `denom`)
// is multiplied by when a sink logit joins the softmax's denominator (gpt-oss): 1 / (denom +
// exp(sink - max)), computed shifted by top = max(max, sink) so no exponential overflows:
// c / (denom * c + exp(sink - top)) with c = exp(max - top).
inline float SinkedInverse(float max, float denom, float sink) {
  const float top = std::max(max, sink);
  const float c = ExpNonPositive(max - top);
  return c / (denom * c + ExpNonPositive(sink - top));
}

// Attention of the query heads of kv heads [kv_begin, kv_end) of rows `rows[0, count)`. One
// row walks its units in order. Rows that share their blocks (a common prompt prefix) go
// unit by unit and kv head by kv head across the rows, so the other rows read a shared
// unit's K/V from L1 (one kv head's K and V rows of a 64-key unit: 32 KiB float32, 16 KiB
// bfloat16); one row at a time, each read the whole prefix again, from L2 or L3
// once it outgrew L2 (a float32 pool's 512-key prefix of the bundled model is 768 KiB a
// layer). Every row's results are the bits it gets alone. Against one row at a time (30-layer
// calls, 2-core AMD EPYC, 16-lane family, blocks of 64, a shared 512-key prefix): float32
// pool 16 rows x 550 keys 0.213 -> 0.162 ms a layer, 64 x 550 0.677 -> 0.565 ms (blocks of
// 16: 1.07x); int8 and bfloat16 pools, whose prefix stays in L2, and rows sharing nothing:
// within 0.97-1.02x. Offline, 64 requests on a 512-token prefix at 16 at once: 1.02-1.06x
// the tokens/s. Inlined into the functions below, once per vector width. Against scalar
// reductions everywhere, a step of 30 layers on a 2-core AMD EPYC (16-lane family, first
// kilobyte prefetched): 1 row x 300 keys 0.8-0.9 -> 0.4 ms, 64 rows x 192 keys 33.0-33.8 ->
// 26.5-27.0 ms, 16 rows x 550 keys sharing a 512-key prefix 11.5-12.1 -> 6.8-6.9 ms, and 64 x
// 550 (bound by reading the pool) 97.5 -> 78-79 ms.
template <typename KV, int DH, typename V>
__attribute__((always_inline)) inline void AttendRowsOf(const Problem& pr, const int64_t* rows, int64_t count,
                                                        int64_t kv_begin, int64_t kv_end, Scratch& s) {
  const PoolLayout& L = pr.pool;
  const int64_t dh = DH > 0 ? DH : L.head_dim, uk = UnitKeys(L.block_size), heads = pr.num_heads;
  const int64_t group = heads / L.num_kv_heads, h_begin = kv_begin * group, h_count = (kv_end - kv_begin) * group;
  KeyRange keys[kMaxSharedRows];
  int64_t u_begin = std::numeric_limits<int64_t>::max(), u_end = 0;
  for (int64_t r = 0; r < count; ++r) {
    keys[r] = VisibleKeys(pr, rows[r]);
    std::fill_n(s.max.begin() + r * heads + h_begin, h_count, -std::numeric_limits<float>::infinity());
    std::fill_n(s.denom.begin() + r * heads + h_begin, h_count, 0.0f);
    std::fill_n(s.acc.begin() + (r * heads + h_begin) * dh, h_count * dh, 0.0f);
    if (keys[r].end > keys[r].first) {
      u_begin = std::min(u_begin, keys[r].first / uk);
      u_end = std::max(u_end, (keys[r].end + uk - 1) / uk);
    }
  }
  auto state = [&](int64_t r) {
    return RowState{s.max.data() + r * heads, s.denom.data() + r * heads, s.acc.data() + r * heads * dh};
  };
  if (count == 1) {
    for (int64_t u = u_begin; u < u_end; ++u)
      AttendUnitOf<KV, DH, V>(pr, rows[0], u, keys[0], kv_begin, kv_end, state(0), s, true);
  } else {
    for (int64_t u = u_begin; u < u_end; ++u)
      for (int64_t kvh = kv_begin; kvh < kv_end; ++kvh)
        for (int64_t r = 0; r < count; ++r)
          if (u * uk < keys[r].end && (u + 1) * uk > keys[r].first)
            AttendUnitOf<KV, DH, V>(pr, rows[r], u, keys[r], kvh, kvh + 1, state(r), s, kvh == kv_begin);
  }
  for (int64_t r = 0; r < count; ++r) {
    float* __restrict out = pr.out + (rows[r] * heads + h_begin) * dh;
    if (keys[r].end == keys[r].first) {
      std::fill(out, out + h_count * dh, 0.0f);
      continue;
    }
    const RowState st = state(r);
    for (int64_t h = 0; h < h_count; ++h) {
      float inv = 1.0f / st.denom[h_begin + h];
      if (pr.sinks) inv = SinkedInverse(st.max[h_begin + h], st.denom[h_begin + h], pr.sinks[h_begin + h]);
#pragma omp simd
      for (int64_t d = 0; d < dh; ++d) out[h * dh + d] = st.acc[(h_begin + h) * dh + d] * inv;
    }
  }
}

}  // namespace

#endif  // RAYLM_ATTENTION_ROWS_H_
