// XLA FFI handler of the mark: a point in a program's run that the program names (a
// pipeline tick's start, python/jax_cpu_mpi/_src/ops/marks.py), recorded into the
// timeline while tracing. It passes its operands through (aliased): what reads its results
// runs after it.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmMark);
