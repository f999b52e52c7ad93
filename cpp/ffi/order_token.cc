// The ordering pass's loop token (order_token.h). A value passed through a loop unchanged,
// or the loop's trip counter, is something XLA's simplifiers replace by the value before
// the loop or by a constant; a custom call's result is not: XLA cannot know what it holds.
#include "ffi/order_token.h"

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
ffi::Error OrderTokenImpl(ffi::AnyBuffer /*last_collective_result*/,
                          ffi::Result<ffi::BufferR0<ffi::S32>> token) {
  *token->typed_data() = 0;
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcmOrderToken, OrderTokenImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::BufferR0<ffi::S32>>());
