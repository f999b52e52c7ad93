// Helpers shared by the files of the MPI transport (not part of its interface).
#pragma once

#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>

#include "common/config.h"
#include "common/timer_slack.h"
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
// MpiTransport::BrokenMessage: kMpiBroken, then what broke the transport (the error of the
// operation that abandoned a request), or kMpiBrokenCauseUnknown while that operation has
// not returned its error yet.
inline constexpr const char* kMpiBroken =
    "an earlier MPI operation of this process timed out on a peer that stopped, and MPI "
    "cannot cancel it: any further MPI call could complete it into memory that is no longer "
    "its buffer, so this process makes no more MPI calls. End the job";
inline constexpr const char* kMpiBrokenCause = ". The operation that broke it: ";
inline constexpr const char* kMpiBrokenCauseUnknown =
    " (the first error of this process names the operation and the peer)";

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
//
// A wait for an MPI operation that moves many bytes (a collective) is given a busy time,
// about as long as the bytes take (kBusyPerByte): until then it spins and yields but never
// sleeps. MPI moves a large message only while its processes call it (the shared-memory
// copies run inside MPI_Test), so a sleep between two polls stalls the transfer itself.
class Backoff {
 public:
  Backoff() : sleeps_soon_(g_wait_sleeps_soon.load(std::memory_order_relaxed)) {}
  explicit Backoff(size_t bytes_in_flight) : Backoff() {
    busy_ = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        kBusyPerByte * static_cast<double>(bytes_in_flight));
  }

  void Pause() {
    if (iterations_ == 0) waited_.Waiting();
    ++iterations_;
    if (sleeps_soon_) {
      if (iterations_ < kSoonSpins) return;
      if (iterations_ < kSoonSpins + kSoonYields || Busy()) {
        sched_yield();
        return;
      }
      slack_.Enable();
      std::this_thread::sleep_for(sleep_);
      sleep_ = std::min(sleep_ * 2, kMaxSleep);
      return;
    }
    if (iterations_ < 2000) return;
    if (iterations_ < 200000 || Busy()) {
      sched_yield();
      return;
    }
    slack_.Enable();
    std::this_thread::sleep_for(kMaxSleep);
  }

 private:
  // Whether the busy time has not run out yet (read from the clock only once the spins are
  // over, and only by a wait that has one).
  bool Busy() {
    if (busy_.count() == 0) return false;
    const auto now = std::chrono::steady_clock::now();
    if (busy_until_ == std::chrono::steady_clock::time_point{}) busy_until_ = now + busy_;
    return now < busy_until_;
  }

  // 1 ns per byte: 1 GB/s, slower than any shared-memory or network MPI moves a collective.
  static constexpr std::chrono::duration<double, std::nano> kBusyPerByte{1.0};
  static constexpr uint64_t kSoonSpins = 300;
  static constexpr uint64_t kSoonYields = 200;
  static constexpr std::chrono::microseconds kMaxSleep{50};

  const bool sleeps_soon_;
  uint64_t iterations_ = 0;
  std::chrono::microseconds sleep_{5};
  std::chrono::steady_clock::duration busy_{0};
  std::chrono::steady_clock::time_point busy_until_{};
  trace::WaitTimer waited_;
  FineTimerSlack slack_;  // the thread's own slack comes back when the wait ends
};

}  // namespace jcm
