// Elementwise reductions of XLA buffers, as XLA CPU computes them (the in-process half of a
// collective, and the MPI operations that reduce like it).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jcm {

enum class Reduction { kSum, kMax, kMin };

// "sum", "max", "min" -> the Reduction; false for anything else.
bool ParseReduction(std::string_view name, Reduction* out);

// acc[i] = acc[i] (op) x[i] for `n` elements of `type`. Integers wrap on overflow; float
// max/min propagate NaN (XLA's maximum/minimum); bool max/min are or/and. Returns false for
// a (type, reduction) it does not implement (the lowering falls back to JAX's then).
bool ReduceInto(xla::ffi::DataType type, Reduction op, void* acc, const void* x, size_t n);

// out[i] = a[i] (op) b[i]: ReduceInto of a copy of `a`, in one pass over the memory instead
// of two (`out` may be `a` or `b`).
bool ReduceTwo(xla::ffi::DataType type, Reduction op, void* out, const void* a, const void* b,
               size_t n);

// out[i] = (a[i] (op) b[i]) (op) c[i]: ReduceTwo, then ReduceInto of `c`, in one pass
// (`out` may be `a`, `b` or `c`).
bool ReduceThree(xla::ffi::DataType type, Reduction op, void* out, const void* a,
                 const void* b, const void* c, size_t n);

// The MPI datatype and operation that reduce `type` like ReduceInto (float max/min are
// operations of ours that propagate NaN). False where there is none.
bool MpiReduction(xla::ffi::DataType type, Reduction op, MPI_Datatype* mpi_type, MPI_Op* mpi_op);

}  // namespace jcm
