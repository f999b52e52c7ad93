// XLA FFI handler of the custom call that makes XLA CPU run a program on a device thread
// (see python/jax_cpu_mpi/_src/dispatch/device_thread_hint.py): it takes the result of a few thousand
// flops that XLA's cost model counts, and does nothing with it.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmDeviceThreadHint);
