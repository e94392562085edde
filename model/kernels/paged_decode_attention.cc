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
// position + 1 for a real decode row, 0 for a padding row); sinks [H] f32, each head's sink
// logit that joins its softmax's denominator with no value (gpt-oss), or [0] for none.
// Result: [B, H, Dh] f32,
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
// The 8-bit pools' variant is quantized_paged_decode_attention.cc.

#include "attention_kernel.h"

namespace {

ffi::Error PagedDecodeAttention(ffi::ThreadPool thread_pool, QueryBuffer q,
                                ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, LayerBuffer layer,
                                TableBuffer block_tables, LensBuffer context_lens, SinkBuffer sinks, float scale,
                                float softcap, int64_t window, ffi::Result<QueryBuffer> out) {
  Problem pr{};
  const std::string error =
      Prepare(q, k_pool, v_pool, layer, block_tables, context_lens, sinks, out, scale, softcap, window, pr);
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t batch = q.dimensions()[0];
  return raylm::RunOnDataOf<float, Bf16>(
      k_pool, "paged_decode_attention: pool dtype must be float32 or bfloat16", [&](const auto* kv) {
        Run(pr, batch, RowKernel<std::remove_const_t<std::remove_pointer_t<decltype(kv)>>>(pr.pool.head_dim),
            thread_pool);
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
                                  .Arg<SinkBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Ret<QueryBuffer>());
