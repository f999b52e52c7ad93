// Helpers shared by the files of the MPI transport (not part of its interface).
#pragma once

#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "common/config.h"
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

// Whether waits sleep soon (the node is oversubscribed, or JAX_CPU_MPI_WAIT=sleep): set by
// MpiTransport::Create, read by every Backoff.
inline std::atomic<bool> g_wait_sleeps_soon{false};

// How many channel send locks this thread holds (MpiTransport::Send, and FinishDirect while
// it completes a deferred send): ProgressDeferred does nothing then, as it would try-lock a
// channel's send_mu that its own thread may hold.
inline thread_local int t_send_locks = 0;
struct SendLockHeld {
  SendLockHeld() { ++t_send_locks; }
  ~SendLockHeld() { --t_send_locks; }
  SendLockHeld(const SendLockHeld&) = delete;
  SendLockHeld& operator=(const SendLockHeld&) = delete;
};

// Adaptive wait used by every polling loop. Normally: spin first (lowest latency), then
// yield the core, then sleep a little (long waits must not burn a core). When the node runs
// more busy threads than it has cores, a spinning or yielding waiter takes the core its
// sender needs (sched_yield hands it over only within one core's run queue): then spin a
// little (a reply already on its way), yield a few times, and sleep in steps growing to
// kMaxSleep, which frees the core for whole scheduler slices. A loop pauses only when it
// found nothing yet: the time from its first pause on is the time the op waited
// (trace::WaitTimer).
class Backoff {
 public:
  Backoff() : sleeps_soon_(g_wait_sleeps_soon.load(std::memory_order_relaxed)) {}

  void Pause() {
    if (iterations_ == 0) waited_.Waiting();
    ++iterations_;
    if (sleeps_soon_) {
      if (iterations_ < kSoonSpins) return;
      if (iterations_ < kSoonSpins + kSoonYields) {
        sched_yield();
        return;
      }
      std::this_thread::sleep_for(sleep_);
      sleep_ = std::min(sleep_ * 2, kMaxSleep);
      return;
    }
    if (iterations_ < 2000) return;
    if (iterations_ < 200000) {
      sched_yield();
      return;
    }
    std::this_thread::sleep_for(kMaxSleep);
  }

 private:
  static constexpr uint64_t kSoonSpins = 300;
  static constexpr uint64_t kSoonYields = 200;
  static constexpr std::chrono::microseconds kMaxSleep{50};

  const bool sleeps_soon_;
  uint64_t iterations_ = 0;
  std::chrono::microseconds sleep_{5};
  trace::WaitTimer waited_;
};

}  // namespace jcm
