// XLA FFI handler of the collectives that span processes (psum/pmax/pmin lowered by
// python/jax_cpu_mpi/_src/lowering/collectives.py).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmAllReduce);
// all_gather / reduce_scatter / all_to_all between processes (attribute "kind").
XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmExchange);
// The end of a program's chain of collectives: resumes the devices it left parked.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmCollectivesEnd);

namespace jcm {
// When a device that does not lead its process's meeting in a collective parks (its
// handler returns a pending future) instead of waiting there: 0 never, 1 where the node has
// more busy threads than cores (the default), 2 always. Other than 1 only to compare the
// two in one launch, or to test either path on any machine. False for another mode.
bool SetMeetingHandoff(int mode);
int MeetingHandoff();
}  // namespace jcm
