// The offset of this process's steady clock from rank 0's, measured over MPI when the
// transport is created, so that the timelines of all processes (and hosts) line up
// (common/trace.h). Rank 0 ping-pongs with each rank in turn and keeps the round trip
// with the smallest delay (Cristian's method): the error is at most half that round trip.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>

#include "common/status.h"

namespace jcm {

struct ClockOffset {
  bool measured = false;
  int64_t offset_ns = 0;  // this process's steady clock minus rank 0's
  int64_t rtt_ns = 0;     // the round trip it was measured with (0 on rank 0)
};

// Collective over `comm` (which carries no other traffic while it runs).
Status MeasureClockOffset(MPI_Comm comm, std::chrono::steady_clock::time_point deadline,
                          ClockOffset* out);

}  // namespace jcm
