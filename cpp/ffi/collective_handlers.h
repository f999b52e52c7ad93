// XLA FFI handler of the collectives that span processes (psum/pmax/pmin lowered by
// python/jax_cpu_mpi/_src/lowering/collectives.py).
#pragma once

#include <cstdint>

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmAllReduce);
// all_gather / reduce_scatter / all_to_all between processes (attribute "kind").
XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmExchange);
// The end of a program's chain of collectives: resumes the devices it left parked.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmCollectivesEnd);

namespace jcm {
// When a device that does not lead its process's meeting in a collective parks (its
// handler returns a pending future) instead of waiting there (JAX_CPU_MPI_PARK): 0 never
// (off), 1 where the node has more busy threads than cores (auto, the default), 2 always
// (on). In every mode only in programs that allow it (their calls' "park" attribute).
// False for another mode.
bool SetMeetingHandoff(int mode);
int MeetingHandoff();
// Collective calls that parked so far in this process (jax_cpu_mpi.stats()).
uint64_t CollectiveParks();
}  // namespace jcm
