// The custom call that consumes the device-thread hint (device_thread_hint.h). It is
// side-effecting only so that XLA keeps it, and the flops feeding it, in the program.
#include "ffi/device_thread_hint.h"

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
ffi::Error DeviceThreadHintImpl(ffi::AnyBuffer /*flops_xla_counts*/) {
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcmDeviceThreadHint, DeviceThreadHintImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>());
