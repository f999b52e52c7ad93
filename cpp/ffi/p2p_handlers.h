// XLA FFI handler symbols for psend/precv on CPU (registered from Python with
// jax.ffi.register_ffi_target(..., platform="cpu", api_version=1)).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmPsend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmPrecv);
