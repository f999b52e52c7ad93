// The uninitialized buffer (uninitialized.h). Its one result is whatever XLA allocated for
// it, left as it is. The `index` attribute only tells the calls of one program apart: XLA
// merges identical instructions, and two buffers merged into one would each get a copy of
// it where the program needs them apart (a loop's state), which is the write this avoids.
#include "ffi/uninitialized.h"

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error UninitializedImpl(ffi::Result<ffi::AnyBuffer> /*out*/, int64_t /*index*/) {
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcmUninitialized, UninitializedImpl,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>().Attr<int64_t>("index"));
