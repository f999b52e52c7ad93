// XLA FFI handler of the custom call that the collectives' ordering pass puts at the end of
// a loop body (python/jax_cpu_mpi/_src/passes/ordered_collectives.py): it reads the body's
// last collective's result (not its bytes) and writes a scalar the loop carries out, so
// that the next collective after the loop reads a value XLA cannot fold away.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmOrderToken);
