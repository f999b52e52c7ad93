// Helpers shared by the files of the MPI transport (not part of its interface).
#pragma once

#include <mpi.h>
#include <sched.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include "common/trace.h"

namespace jcm {

// Whether MPI calls are allowed now. A failure of the query itself counts as "not usable":
// nothing can be called then anyway.
inline bool MpiIsUsable() {
  int initialized = 0, finalized = 0;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS) return false;
  if (MPI_Finalized(&finalized) != MPI_SUCCESS) return false;
  return initialized && !finalized;
}

inline constexpr const char* kMpiNotUsable = "MPI is not initialized or already finalized";

// Adaptive wait used by every polling loop: spin first (lowest latency), then yield the core
// (ranks may share cores), then sleep a little (long waits must not burn a core). A loop
// pauses only when it found nothing yet: the time from its first pause on is the time the
// op waited (trace::WaitTimer).
class Backoff {
 public:
  void Pause() {
    if (iterations_ == 0) waited_.Waiting();
    ++iterations_;
    if (iterations_ < 2000) return;
    if (iterations_ < 200000) {
      sched_yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

 private:
  uint64_t iterations_ = 0;
  trace::WaitTimer waited_;
};

}  // namespace jcm
