// XLA FFI handler of the collectives that span processes (psum/pmax/pmin lowered by
// python/jax_cpu_mpi/_src/lowering/collectives.py).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmAllReduce);
// all_gather / reduce_scatter / all_to_all between processes (attribute "kind").
XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmExchange);
