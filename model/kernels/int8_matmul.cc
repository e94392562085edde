// The integer compute mode's matmul for CPU, an XLA FFI custom call (model/kernels/int8_matmul.py).
//
// Why: the exact kernels (dense_matmul.cc) widen 4- and 8-bit weights to float32 and multiply-add
// in float32, 16 per instruction on AVX-512. An int8 dot product does 64 multiply-adds per
// instruction (AVX-512 VNNI's vpdpbusd), and llama.cpp computes its Q4/Q8 blocks this way: the
// activations are quantized per row and per block of 32 to int8 (its Q8_0 scheme), each block's
// products summed in integers, and only the block sums scaled in float. Opt-in
// (`model.activation_quantization: int8`): the activations lose precision (model/kernels/int8_matmul.py
// says what is measured).
//
// Operands: x [M, K] f32 and the weights as model/quantization/int8_panels.py repacked them at load: GGUF
// blocks with a scale per 32 weights (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0; IQ4_NL, IQ4_XS and
// MXFP4's 4-bit codes with their codebook; int8_g32, held as Q8_0 blocks), signed bytes with an int8
// scale per 16 under a super-block's d (Q6_K, Q3_K), or int8 with a scale per output row, N output
// columns in groups of 16. A mixture of experts' stacked experts
// take the same operands with a leading expert dim, and group_sizes: GroupedInt8PanelMatmul below.
//
// The arithmetic, the same in every family below and for every M, per row r and output column n:
//   activations, per block b of 32 (the last one zero-padded): a = max |x|, d_x = a / 127,
//     q_x = nearest-even(x * (127 / a)) (0 when a = 0), S = sum of the block's q_x;
//   i_b = sum over the block of q_x * v, v the stored weight integer: the nibble 0..15 of a 4-bit
//     block, the codebook's int8 value of a 4-bit code (IQ4, MXFP4), the signed byte of an 8-bit
//     one (exact in int32); with int8 sub-scales per 16
//     (Q6_K, Q3_K) i_b = sc_0 * (sum over weights 0..15) + sc_1 * (sum over 16..31), also in
//     int32 (exact: at most 2 * 16 * 128 * 127 * 128 < 2^31), and d_w the super-block's d, as
//     llama.cpp's q6_K x q8_K dot product forms it; with int8 offsets per 16 too (Q2_K, a fused
//     Q4_K / Q6_K matrix), after the block's fma below acc = fma(m_0 S_0 + m_1 S_1, d_x * -dmin,
//     acc), S_h the sum of the half's q_x (the integer again exact);
//   acc = fma(float(i_b), d_x * d_w, acc) for b in order (d_w: the block's scale, 1 for
//     per-row int8), then for blocks with offsets (4-bit, Q5_K, Q5_1) acc = fma(m, d_x * S, acc)
//     with m the block's offset (w = d_w * v + m covers Q4_1, Q4_0's m = -8 d_w and the
//     K-quants' -(dmin * m): llama.cpp's q8_1 sum term);
//   y = acc (GGUF blocks) or acc * scale[n] (per-row int8).
// Integer sums are exact whatever the instruction, and each output's float operations are this
// one sequence, so a row's result does not depend on the batch, the tile, the thread or the
// family (AMX, VNNI, AVX2 and the portable loops agree bit for bit), and one loop nest serves decode
// rows and prompt chunks alike (AMX tiles, int8_amx.h, take prompt chunks where the CPU has them).
//
// Layout (model/quantization/int8_panels.py): for each group of 16 output columns and each block, T 64-byte
// vectors (T = 4 for 4-bit blocks, 8 for 8-bit weights) whose 4-byte lane j holds column j's bytes
// 4t..4t+3 of the block as stored (4-bit: weights 4t..4t+3 in the low nibbles, 16+4t..19+4t in the
// high ones), then the group's 16 d_w and 16 m per block in arrays of their own. Q6_K and Q3_K are
// held in 6 bits (T = 6: v + 32's low nibbles so, then two vectors of its top two bits; the
// kernel ORs them into bytes 0..63 and starts each half's sums at -32 S of its activations). A broadcast of
// four activation bytes against such a vector adds four products to each of the group's columns,
// so a block's integer sums end up one per lane, with no horizontal additions. The layout is made
// once at load, so a call streams the weights in the order it reads them: a decode row reads each
// weight byte once, as the exact kernels do. AVX2's eight-column groups are the halves of a
// sixteen-column one.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "column_items.h"
#include "ffi_helpers.h"
#include "group_rows.h"
#include "int8_amx.h"
#include "int8_families.h"
#include "int8_panels.h"

using raylm::Matrix;
using GroupSizes = ffi::Buffer<ffi::S32, 1>;  // an alias: the binding macro cannot take commas

namespace {


enum class Int8Family { kPortable, kAvx2, kVnni, kAmx };  // in order: each CPU that has one has those before
constexpr const char* kFamilyNames[] = {"portable", "avx2", "vnni", "amx"};

// The best family this CPU offers, found once: AMX where it has AMX int8 tiles and Linux grants
// them (int8_amx.h), else VNNI where it has AVX-512 VNNI, else AVX2, else the portable loops.
Int8Family BestFamily() {
  static const Int8Family best = [] {
#ifdef RAYLM_INT8_VECTOR_FAMILIES
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const bool vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512vnni");
#ifdef RAYLM_INT8_AMX
    if (vnni && AmxPermitted()) return Int8Family::kAmx;
#endif
    if (vnni) return Int8Family::kVnni;
    if (avx2) return Int8Family::kAvx2;
#endif
    return Int8Family::kPortable;
  }();
  return best;
}

// The family `name` asks for, or the best one here if that is lower (an unknown or empty name:
// the best one).
Int8Family Capped(const char* name) {
  const std::string wanted = name ? name : "";
  for (int f = 0; f < 4; ++f)
    if (wanted == kFamilyNames[f]) return std::min(static_cast<Int8Family>(f), BestFamily());
  return BestFamily();
}

std::atomic<int> used_family{-1};  // set by RaylmInt8MatmulUseFamily; -1: the environment's choice

// The family this call runs: the best one, or a lower one that RAYLM_INT8_MATMUL_FAMILY=amx / vnni /
// avx2 / portable names (read once), or that RaylmInt8MatmulUseFamily picked since (tests and
// benchmarks compare every family on one machine; all give the same bits).
Int8Family ChosenFamily() {
  static const Int8Family from_environment = Capped(std::getenv("RAYLM_INT8_MATMUL_FAMILY"));
  const int used = used_family.load(std::memory_order_relaxed);
  return used >= 0 ? static_cast<Int8Family>(used) : from_environment;
}

#ifdef RAYLM_INT8_VECTOR_FAMILIES
constexpr int kInt8Rows = 4;  // rows per tile

template <typename Family, int G, Format F>
void TileRows(int64_t rows, const Int8Rows& a, int64_t m, const Int8Panels& w, float* y, int64_t n, int64_t valid) {
  switch (rows) {
    case 4: return Family::template Tile<4, G, F>(a, m, w, y, n, valid);
    case 3: return Family::template Tile<3, G, F>(a, m, w, y, n, valid);
    case 2: return Family::template Tile<2, G, F>(a, m, w, y, n, valid);
    case 1: return Family::template Tile<1, G, F>(a, m, w, y, n, valid);
  }
}

// w's layout once its two-level tables are formed (WithFormedTables): float32 d_w and m per block,
// no sub-scales (the tables' pointers still w's).
Int8Panels FormedLayout(const Int8Panels& w) {
  Int8Panels formed = w;
  formed.half = false;
  formed.sub_scale = nullptr;
  formed.sub_rows = 0;
  formed.super_shift = 0;
  return formed;
}

// Panels whose tables are two-level (Int8Panels::ScaledTables), for the columns [p, p_end) only:
// their d_w and m per block formed once (the family's exact products) into `scratch` as float32
// tables, for the row tiles that pass the panel. Formed in each tile instead, as a decode row's
// one tile does, they cost a tenth of a 16- to 64-row call on AVX2.
template <typename Family>
Int8Panels WithFormedTables(const Int8Panels& w, int64_t p, int64_t p_end, std::vector<float>* scratch) {
  const int64_t first = p / kGroupCols, groups = (p_end - p + kGroupCols - 1) / kGroupCols;
  const int64_t entries = groups * w.blocks * kGroupCols;
  scratch->resize((w.m ? 2 : 1) * entries);
  float* d = scratch->data();
  float* m = w.m ? d + entries : nullptr;
  Family::FormTables(w, first, groups, d, m);
  Int8Panels formed = FormedLayout(w);
  formed.d = d;
  formed.m = m;
  formed.table_group = first;
  return formed;
}

// Output columns [n_begin, n_end) (n_begin a multiple of 16) for all M rows: a panel of columns
// at a time, every block of rows passing it, two groups of the family and four rows a tile. At a
// few rows this is one pass over the columns, each weight byte read once.
template <typename Family, Format F>
void VectorColumns(const Int8Rows& a, const Int8Panels& w, float* y, int64_t M, int64_t n_begin, int64_t n_end) {
  constexpr int C = Family::kCols;
  static thread_local std::vector<float> scratch;  // a panel's formed tables (WithFormedTables)
  const bool form_tables = w.ScaledTables() && M > kInt8Rows;
  const int64_t table_bytes = (form_tables ? FormedLayout(w) : w).GroupTableBytes();
  const int64_t group_bytes = w.blocks * w.Vectors() * kVectorBytes + table_bytes;
  const int64_t panel_cols = std::max<int64_t>(2, kInt8PanelBytes / group_bytes) * kGroupCols;
  const int64_t block_rows =
      std::max<int64_t>(kInt8Rows, kInt8RowBlockBytes / (w.blocks * kGgufBlock) / kInt8Rows * kInt8Rows);
  for (int64_t p = n_begin; p < n_end; p += panel_cols) {
    const int64_t p_end = std::min(n_end, p + panel_cols);
    const Int8Panels panel = form_tables ? WithFormedTables<Family>(w, p, p_end, &scratch) : w;
    for (int64_t m_begin = 0; m_begin < M; m_begin += block_rows) {
      const int64_t m_end = std::min(M, m_begin + block_rows);
      for (int64_t n = p; n < p_end; n += 2 * C) {
        const int64_t valid = std::min<int64_t>(2 * C, p_end - n);
        for (int64_t m = m_begin; m < m_end; m += kInt8Rows) {
          const int64_t rows = std::min<int64_t>(kInt8Rows, m_end - m);
          if (valid > C)
            TileRows<Family, 2, F>(rows, a, m, panel, y, n, valid);
          else
            TileRows<Family, 1, F>(rows, a, m, panel, y, n, valid);
        }
      }
    }
  }
}

template <typename Family>
void VectorColumns(const Int8Rows& a, const Int8Panels& w, float* y, int64_t M, int64_t n_begin, int64_t n_end) {
  switch (w.format) {
    case Format::kNibbles: return VectorColumns<Family, Format::kNibbles>(a, w, y, M, n_begin, n_end);
    case Format::kCodes: return VectorColumns<Family, Format::kCodes>(a, w, y, M, n_begin, n_end);
    case Format::kBlockBytes: return VectorColumns<Family, Format::kBlockBytes>(a, w, y, M, n_begin, n_end);
    case Format::kOffsetBytes: return VectorColumns<Family, Format::kOffsetBytes>(a, w, y, M, n_begin, n_end);
    case Format::kRowBytes: return VectorColumns<Family, Format::kRowBytes>(a, w, y, M, n_begin, n_end);
    case Format::kSixBits: return VectorColumns<Family, Format::kSixBits>(a, w, y, M, n_begin, n_end);
  }
}
#endif

// y [M, N] = the integer mode's x . w^T, the columns split over the calling thread and the pool.
void RunInt8Matmul(const float* x, const Int8Panels& w, float* y, int64_t M, ffi::ThreadPool& pool) {
  const Int8Family family = ChosenFamily();
#ifdef RAYLM_INT8_AMX
  const bool amx = family == Int8Family::kAmx && AmxTakes(w, M);
#else
  const bool amx = false;
#endif
  Int8Rows a;
  const int64_t held_rows = amx ? (M + 2 * kAmxRows - 1) / (2 * kAmxRows) * (2 * kAmxRows) : M;  // AMX: whole tiles
  AllocateRows(held_rows, w.K, &a);
  if (amx) a.tiled.assign(a.q.size(), 0);
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t items = threads * raylm::kPromptItemsPerThread;
  const int64_t per_item = (w.N + items - 1) / items;
  const int64_t item = (per_item + kGroupCols - 1) / kGroupCols * kGroupCols;  // whole packed groups
  // The activations, quantized by rows over the same threads (on one thread they were up to a
  // fifth of a 64-row call; a decode step's few rows stay on the calling thread).
  const int64_t rows_per_item = std::max<int64_t>(1, (M + threads * 2 - 1) / (threads * 2));
  raylm::Run(
      M, w.K, 0,
      [x, &w, &a, family, amx](int64_t b, int64_t e, float*) {
#ifdef RAYLM_INT8_AMX
        if (amx) {
          VnniFamily::Quantize(x, b, e, w.K, &a);
          return AmxFamily::TileActivations(&a, b, e);
        }
#endif
#ifdef RAYLM_INT8_VECTOR_FAMILIES
        if (family >= Int8Family::kVnni) return VnniFamily::Quantize(x, b, e, w.K, &a);
        if (family == Int8Family::kAvx2) return Avx2Family::Quantize(x, b, e, w.K, &a);
#endif
        QuantizeRows(x, b, e, w.K, &a);
      },
      pool, rows_per_item);
  const int64_t N = w.N;
  raylm::Run(
      N, w.K, 0,
      [&a, &w, y, M, family, amx](int64_t b, int64_t e, float*) {
#ifdef RAYLM_INT8_AMX
        if (amx) return AmxColumns(a, w, y, M, b, e);
#endif
#ifdef RAYLM_INT8_VECTOR_FAMILIES
        if (family >= Int8Family::kVnni) return VectorColumns<VnniFamily>(a, w, y, M, b, e);
        if (family == Int8Family::kAvx2) return VectorColumns<Avx2Family>(a, w, y, M, b, e);
#endif
        PortableColumns(a, w, y, M, b, e);
      },
      pool, item);
}

// The packed operands of one matrix, or (`lead` 1) of a stack of experts: each buffer with a
// leading expert dim, each expert's panels one contiguous slice of it.
struct PackedBuffers {
  const ffi::AnyBuffer &q, &d, &m, &row_scale, &sub_scale, &codebook;
  size_t lead = 0;

  // `b`'s dims past the leading expert dim (rank checked by RankError first).
  static ffi::AnyBuffer::Dimensions Inner(const ffi::AnyBuffer& b, size_t lead) {
    return b.dimensions().last(b.dimensions().size() - lead);
  }
};

// The operands' ranks, element types of the tables and expert counts (`experts`: the stack's,
// -1 for one matrix); an empty message when they agree.
std::string RankError(const PackedBuffers& p, int64_t experts) {
  const ffi::AnyBuffer* buffers[] = {&p.q, &p.d, &p.m, &p.row_scale, &p.sub_scale, &p.codebook};
  const size_t ranks[] = {5, 3, 3, 1, 4, 1};
  bool ok = p.row_scale.element_type() == ffi::DataType::F32 && p.sub_scale.element_type() == ffi::DataType::S8 &&
            p.codebook.element_type() == ffi::DataType::S8;
  for (int i = 0; i < 6; ++i)
    ok = ok && buffers[i]->dimensions().size() == ranks[i] + p.lead &&
         (p.lead == 0 || buffers[i]->dimensions()[0] == experts);
  if (ok) return "";
  std::string got;
  for (int i = 0; i < 6; ++i) got += std::string(i ? ", " : "") + raylm::Shape(buffers[i]->dimensions());
  return std::string(p.lead ? "packed experts: q, d, m, row_scale, sub_scale, codebook with a leading dim of " +
                                  std::to_string(experts) + " experts (group_sizes') before "
                            : "packed matrix: q, d, m, row_scale, sub_scale, codebook of ") +
         "ranks 5, 3, 3, 1 (float32), 4 (int8) and 1 (int8); got " + got;
}

// Checks the packed operands (one expert's, past `lead`) against x [M, K] and y [M, N]; an empty
// message when they agree.
std::string PanelError(const Matrix& x, const PackedBuffers& p, const Matrix& y, Format* format, bool* half) {
  const auto qd = PackedBuffers::Inner(p.q, p.lead), dd = PackedBuffers::Inner(p.d, p.lead),
             md = PackedBuffers::Inner(p.m, p.lead), rd = PackedBuffers::Inner(p.row_scale, p.lead),
             sd = PackedBuffers::Inner(p.sub_scale, p.lead), cd = PackedBuffers::Inner(p.codebook, p.lead);
  const int64_t K = x.dimensions()[1], N = y.dimensions()[1];
  const int64_t groups = (N + kGroupCols - 1) / kGroupCols, blocks = (K + kGgufBlock - 1) / kGgufBlock;
  const bool unsigned_q = p.q.element_type() == ffi::DataType::U8;
  if (!unsigned_q && p.q.element_type() != ffi::DataType::S8) return "q must be uint8 (4-bit or 6-bit blocks) or int8";
  *half = p.d.element_type() == ffi::DataType::F16;
  if ((!*half && p.d.element_type() != ffi::DataType::F32) || p.m.element_type() != p.d.element_type())
    return "d and m must both be float32 or both float16";
  const bool has_d = dd[2] == kGroupCols, has_m = md[2] == kGroupCols;
  const bool has_row_scale = rd[0] == N && N > 0;
  const bool six_bits = unsigned_q && qd[2] == 6;
  const bool has_codebook = cd[0] == 16;
  // Two-level scales: sub_scale's rows per block (kSixBits: 2, or 4 with m; else 1, or 2 with m),
  // and d and m per super-block of 256.
  const int64_t sub_rows = six_bits ? (has_m ? 4 : 2) : (has_m ? 2 : 1);
  const bool has_sub_scale = sd[0] == groups && sd[1] == blocks && sd[2] == sub_rows && sd[3] == kGroupCols;
  const bool no_sub_scale = sd[0] == 0 && sd[1] == 0 && sd[2] == 0 && sd[3] == 0;
  const int64_t table_blocks = TableEntries(blocks, has_sub_scale ? kSuperShift : 0);
  *format = unsigned_q ? (six_bits ? Format::kSixBits : has_codebook ? Format::kCodes : Format::kNibbles)
            : has_m    ? Format::kOffsetBytes
            : has_d    ? Format::kBlockBytes
                       : Format::kRowBytes;
  const bool q_ok =
      qd[0] == groups && qd[1] == blocks && qd[2] == VectorsOf(*format) && qd[3] == kGroupCols && qd[4] == 4;
  const bool tables_ok = (dd[2] == 0 || has_d) && (md[2] == 0 || has_m) &&
                         (!has_d || (dd[0] == groups && dd[1] == table_blocks)) &&
                         (!has_m || (md[0] == groups && md[1] == table_blocks)) && (rd[0] == 0 || has_row_scale) &&
                         (has_sub_scale || no_sub_scale) && (no_sub_scale || K % raylm::kGgufSuper == 0) &&
                         (has_codebook || cd[0] == 0);
  bool format_ok = false;
  switch (*format) {
    case Format::kNibbles: format_ok = has_d && has_m && !has_row_scale; break;
    case Format::kCodes: format_ok = has_d && !has_m && !has_row_scale; break;
    case Format::kSixBits: format_ok = has_d && has_sub_scale && !has_row_scale; break;
    case Format::kOffsetBytes: format_ok = has_d && !has_row_scale; break;
    case Format::kBlockBytes: format_ok = !has_row_scale; break;
    case Format::kRowBytes: format_ok = has_row_scale && no_sub_scale; break;
  }
  const bool blocks_ok = *format == Format::kRowBytes || K % kGgufBlock == 0;
  const bool codebook_ok = has_codebook == (*format == Format::kCodes);
  if (q_ok && tables_ok && format_ok && blocks_ok && codebook_ok && y.dimensions()[0] == x.dimensions()[0])
    return "";
  return "x " + raylm::Shape(x.dimensions()) + " against packed q " + raylm::Shape(qd) + " (" +
         (unsigned_q ? "uint8" : "int8") + "), d " + raylm::Shape(dd) + ", m " + raylm::Shape(md) + ", row_scale " +
         raylm::Shape(rd) + ", sub_scale " + raylm::Shape(sd) + ", codebook " + raylm::Shape(cd) +
         (p.lead ? " per expert" : "") + " and y " +
         raylm::Shape(y.dimensions()) + ": expected q [" + std::to_string(groups) + ", " + std::to_string(blocks) +
         ", 4 (4-bit) or 6 (6-bit) or 8 (int8), 16, 4], d and m [" + std::to_string(groups) + ", " +
         std::to_string(blocks) + " (or " + std::to_string(TableEntries(blocks, kSuperShift)) +
         " super-blocks with sub_scale), 16 or 0] (4-bit: both; 6-bit: d (and m); 8-bit: d (and m) or row_scale [N]; "
         "float32 or float16), sub_scale int8 [" + std::to_string(groups) + ", " + std::to_string(blocks) +
         ", rows, 16] (6-bit: 2, or 4 with m; else 1, or 2 with m) or [0, 0, 0, 0] (needed by 6-bit), " +
         "codebook int8 [16] (4-bit codes: d, no m) or [0], " +
         "K whole blocks unless per-row int8 (whole super-blocks of 256 with sub_scale)";
}

// The checked operands' panels for N outputs of K inputs: the matrix's, or (a stack) expert 0's.
Int8Panels PanelsOf(const PackedBuffers& p, int64_t N, int64_t K, Format format, bool half) {
  const bool has_m = p.m.dimensions().back() > 0;
  const int64_t sub_rows = PackedBuffers::Inner(p.sub_scale, p.lead)[2];
  return Int8Panels{static_cast<const uint8_t*>(p.q.untyped_data()),
                    format == Format::kRowBytes ? nullptr : p.d.untyped_data(),
                    has_m ? p.m.untyped_data() : nullptr,
                    format == Format::kRowBytes ? static_cast<const float*>(p.row_scale.untyped_data()) : nullptr,
                    sub_rows ? static_cast<const int8_t*>(p.sub_scale.untyped_data()) : nullptr,
                    format == Format::kCodes ? static_cast<const int8_t*>(p.codebook.untyped_data()) : nullptr,
                    N, K, (K + kGgufBlock - 1) / kGgufBlock, format, half, sub_rows, sub_rows ? kSuperShift : 0};
}

// Expert g's panels in a stack whose expert 0 is `w`: each array's g-th slice (the sizes of one
// expert's arrays as model/quantization/int8_panels.py packs them).
Int8Panels ExpertPanels(const Int8Panels& w, int64_t g) {
  const int64_t groups = (w.N + kGroupCols - 1) / kGroupCols;
  const int64_t table_bytes = groups * w.TableBlocks() * kGroupCols * (w.half ? 2 : 4);
  Int8Panels e = w;
  e.q += g * groups * w.blocks * w.Vectors() * kVectorBytes;
  if (e.d) e.d = static_cast<const char*>(w.d) + g * table_bytes;
  if (e.m) e.m = static_cast<const char*>(w.m) + g * table_bytes;
  if (e.row_scale) e.row_scale += g * w.N;
  if (e.sub_scale) e.sub_scale += g * groups * w.blocks * w.sub_rows * kGroupCols;
  if (e.codebook) e.codebook += g * 16;
  return e;
}

ffi::Error Int8PanelMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer q, ffi::AnyBuffer d,
                           ffi::AnyBuffer m, ffi::AnyBuffer row_scale, ffi::AnyBuffer sub_scale,
                           ffi::AnyBuffer codebook, ffi::Result<Matrix> y) {
  const PackedBuffers p{q, d, m, row_scale, sub_scale, codebook};
  Format format = Format::kNibbles;
  bool half = false;
  std::string error = RankError(p, -1);
  if (error.empty()) error = PanelError(x, p, *y, &format, &half);
  if (!error.empty()) return ffi::Error::InvalidArgument("int8_panel_matmul: " + error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = y->dimensions()[1];
  if (M == 0 || N == 0) return ffi::Error::Success();
  RunInt8Matmul(x.typed_data(), PanelsOf(p, N, K, format, half), y->typed_data(), M, thread_pool);
  return ffi::Error::Success();
}

// A mixture of experts' experts in the integer mode: x [M, K]'s rows in consecutive groups,
// group_sizes [E] each, group g times expert g's panels (the operands above with a leading expert
// dim), y [M, N]; rows past the groups are zeros (group_rows.h). Each group is one call of the
// matrix's loop nest on its rows, and a row's result does not depend on the batch there, so each
// token gets the bits int8_panel_matmul gives it alone against its expert's panels.
ffi::Error GroupedInt8PanelMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer q, ffi::AnyBuffer d,
                                  ffi::AnyBuffer m, ffi::AnyBuffer row_scale, ffi::AnyBuffer sub_scale,
                                  ffi::AnyBuffer codebook, GroupSizes group_sizes, ffi::Result<Matrix> y) {
  const int64_t E = group_sizes.dimensions()[0];
  const PackedBuffers p{q, d, m, row_scale, sub_scale, codebook, 1};
  Format format = Format::kNibbles;
  bool half = false;
  std::string error = RankError(p, E);
  if (error.empty()) error = PanelError(x, p, *y, &format, &half);
  if (!error.empty()) return ffi::Error::InvalidArgument("grouped_int8_panel_matmul: " + error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = y->dimensions()[1];
  const Int8Panels first = PanelsOf(p, N, K, format, half);
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  ForEachGroup(group_sizes.typed_data(), E, M, N, ys, [&](int64_t g, int64_t start, int64_t rows) {
    RunInt8Matmul(xs + start * K, ExpertPanels(first, g), ys + start * N, rows, thread_pool);
  });
  return ffi::Error::Success();
}

}  // namespace

// The family calls run now (model/kernels/int8_matmul.py reads it through ctypes).
extern "C" const char* RaylmInt8MatmulFamily() { return kFamilyNames[static_cast<int>(ChosenFamily())]; }

// Makes later calls run the family `name` (amx, vnni, avx2, portable), or the best one here if that
// is lower; an empty name goes back to the environment's choice. Returns the family now used.
extern "C" const char* RaylmInt8MatmulUseFamily(const char* name) {
  used_family.store(name && *name ? static_cast<int>(Capped(name)) : -1, std::memory_order_relaxed);
  return RaylmInt8MatmulFamily();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmInt8PanelMatmul, Int8PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmGroupedInt8PanelMatmul, GroupedInt8PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<GroupSizes>()
                                  .Ret<Matrix>());
