// An identity for XLA CPU programs that XLA cannot fuse into its consumers: the result is the
// operand's bytes (see model/kernels/fusion_barrier.py for why).
//
// Operand: any array. Result: a copy, of the same shape and element type (nothing to copy
// should XLA ever hand the call the operand's own buffer).

#include <cstring>

#include "ffi_helpers.h"

namespace {

ffi::Error FusionBarrier(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  if (out->element_type() != x.element_type() || out->size_bytes() != x.size_bytes())
    return ffi::Error::InvalidArgument("fusion_barrier: the result must have the operand's type and shape");
  if (out->untyped_data() != x.untyped_data()) std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmFusionBarrier, FusionBarrier,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
