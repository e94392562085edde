// Paged decode attention over 8-bit pools, an XLA FFI custom call (see model/kernels/paged_decode.py;
// the float / bfloat16 pools' kernel and the contract are paged_decode_attention.cc's).
//
// The quantized variant takes 8-bit pools (int8 or float8 e4m3fn) and after each a float32
// scale per (token, kv head), [L, num_blocks, block_size, KVH]: a key's score is its 8-bit
// dot product times its scale, a value row's weight is its probability times its scale.

#include "attention_kernel.h"

namespace {

// 8-bit pools with their scales [L, num_blocks, block_size, KVH].
ffi::Error QuantizedPagedDecodeAttention(ffi::ThreadPool thread_pool, QueryBuffer q, ffi::AnyBuffer k_pool,
                                         ScaleBuffer k_scale, ffi::AnyBuffer v_pool, ScaleBuffer v_scale,
                                         LayerBuffer layer, TableBuffer block_tables, LensBuffer context_lens,
                                         SinkBuffer sinks, float scale, float softcap, int64_t window,
                                         ffi::Result<QueryBuffer> out) {
  Problem pr{};
  const std::string error =
      Prepare(q, k_pool, v_pool, layer, block_tables, context_lens, sinks, out, scale, softcap, window, pr);
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
                                  .Arg<SinkBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Ret<QueryBuffer>());
