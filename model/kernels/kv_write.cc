// Writes new K/V rows into the paged pool in place, for CPU: an XLA FFI custom call whose
// result aliases the pool (see model/kernels/kv_write.py).
//
// Why a kernel: XLA's CPU backend has no native scatter for bfloat16, float16 or float8
// elements. It upcasts the scatter, which turns writing one token into rewriting the whole
// pool (a 2 GiB bfloat16 pool: ~250 ms per layer and step, against microseconds for a
// float32 or int8 pool). Here each token's [KVH, Dh] row is a plain byte copy, whatever the
// element type.
//
// Operands: pool [L, num_blocks, block_size, KVH, Dh] (any element type; the result is the
// same buffer); layer [] s32; block [T] s32; offset [T] s32; values [T, KVH, Dh] of the
// pool's element type. A token whose block or offset is outside the pool is skipped (XLA's
// scatter drops such updates too); the layer is clamped, so no input can write outside it.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "ffi_helpers.h"

using raylm::Shape;

namespace {

using IndexBuffer = ffi::Buffer<ffi::S32, 1>;  // [T]
using LayerBuffer = ffi::Buffer<ffi::S32, 0>;  // []

ffi::Error KvWrite(ffi::AnyBuffer pool, LayerBuffer layer, IndexBuffer block, IndexBuffer offset,
                   ffi::AnyBuffer values, ffi::Result<ffi::AnyBuffer> out) {
  const auto pd = pool.dimensions();
  const auto vd = values.dimensions();
  if (pd.size() != 5 || vd.size() != 3 || vd[1] != pd[3] || vd[2] != pd[4])
    return ffi::Error::InvalidArgument("kv_write: pool must be [L, num_blocks, block_size, KVH, Dh] and values "
                                       "[T, KVH, Dh]; got " + Shape(pd) + " and " + Shape(vd));
  if (values.element_type() != pool.element_type() || out->element_type() != pool.element_type())
    return ffi::Error::InvalidArgument("kv_write: values and result must have the pool's element type");
  const int64_t tokens = vd[0];
  if (block.dimensions()[0] != tokens || offset.dimensions()[0] != tokens)
    return ffi::Error::InvalidArgument("kv_write: block and offset must have one entry per value row");
  const int64_t num_layers = pd[0], num_blocks = pd[1], block_size = pd[2];
  const size_t row_bytes = static_cast<size_t>(pd[3] * pd[4]) * ffi::ByteWidth(pool.element_type());
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pool.untyped_data())  // XLA kept the input alive: start from a copy of it
    std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  const int64_t l = std::clamp<int64_t>(*layer.typed_data(), 0, num_layers - 1);
  const char* src = static_cast<const char*>(values.untyped_data());
  const int32_t* blocks = block.typed_data();
  const int32_t* offsets = offset.typed_data();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t b = blocks[t], o = offsets[t];
    if (b < 0 || b >= num_blocks || o < 0 || o >= block_size) continue;
    std::memcpy(dst + ((l * num_blocks + b) * block_size + o) * row_bytes, src + t * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmKvWrite, KvWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<LayerBuffer>()
                                  .Arg<IndexBuffer>()
                                  .Arg<IndexBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
