// Helpers shared by the files of the MPI transport (not part of its interface).
#pragma once

#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>

#include "common/config.h"
#include "common/timer_slack.h"
#include "common/trace.h"
#include "mpi/transport.h"  // WaitMode

namespace jcm {

// Whether WatchFinalize's callback is in place, and whether MPI_Finalize has run it.
inline std::atomic<bool> g_finalize_watched{false};
inline std::atomic<bool> g_finalize_begun{false};

// Makes MPI_Finalize tell MpiIsUsable that it has begun (once per process; MPI must be
// initialized): MPI_Finalize first frees MPI_COMM_SELF's attributes, calling their delete
// callbacks (MPI standard, "Allowing User Functions at Process Termination"). Without it
// (the registration failed) MpiIsUsable asks MPI.
void WatchFinalize();

// Whether MPI calls are allowed now. The receive and send loops ask on every poll: once
// WatchFinalize is in place it is two flags, not two calls into MPI (MPI, once
// initialized, stays so). A failure of the query itself counts as "not usable": nothing
// can be called then anyway.
inline bool MpiIsUsable() {
  if (g_finalize_watched.load(std::memory_order_acquire)) [[likely]] {
    return !g_finalize_begun.load(std::memory_order_acquire);
  }
  int initialized = 0, finalized = 0;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS) return false;
  if (MPI_Finalized(&finalized) != MPI_SUCCESS) return false;
  return initialized && !finalized;
}

// A channel's buffer for the next message (a record, an envelope, a copy, a signal): `slot`'s
// object when nothing else holds it any more, else a new one, which becomes the slot's. An
// abandoned request keeps its own buffer alive (it may still be written), and so may a
// send in flight or a kept entry not finished yet: the next message must not use that one.
// The last other holder's release happens before the use-count load (the acquire fence), so
// its accesses are done with. Caller holds the lock that guards `slot` (the channel's).
template <typename T>
const std::shared_ptr<T>& ReusableOrNew(std::shared_ptr<T>& slot) {
  if (slot && slot.use_count() == 1) {
    std::atomic_thread_fence(std::memory_order_acquire);
    return slot;
  }
  slot = std::make_shared<T>();
  return slot;
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

// How every Backoff of the process waits (a WaitMode, mpi/transport.h; set by
// MpiTransport::Create from JAX_CPU_MPI_WAIT and the node; read by every Backoff):
//   kBounded  (auto, a core per busy thread): spin a short time, yield a short time, then
//             sleep in growing steps. Both phases are bounded by the clock, not by counts.
//   kLong     (spin): spin, then yield for a long time before sleeping: the lowest latency
//             when every waiter has a core of its own (ranks bound to cores).
//   kSoon     (sleep, or more busy threads than cores): a few spins and yields, then sleep.
inline std::atomic<int> g_wait_mode{static_cast<int>(WaitMode::kBounded)};

// Process-wide counts of what the waits did (jax_cpu_mpi.stats()): load does not change
// them, so they show which phase a wait ended in where timings are noisy.
inline std::atomic<uint64_t> g_wait_yields{0};
inline std::atomic<uint64_t> g_wait_sleeps{0};

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

// Adaptive wait used by every polling loop. A loop pauses only when it found nothing yet:
// the time from its first pause on is the time the op waited (trace::WaitTimer).
//
// kBounded, the default of a node with a core per busy thread, spins for kSpinFor, yields
// until kYieldUntil (1 ms), then sleeps in steps growing to kMaxSleep (kSoon's long waits
// further, see Sleep); the bounds are read from the clock, because a poll's cost varies
// from tens of ns (a small message) to us (MPI copying a large one inside MPI_Test).
// Unbound ranks are where the scheduler puts them, and now and then it puts both busy
// threads of a pair on one core: a waiter that spins
// (2000 polls, as kLong does) holds the core its peer needs until the scheduler preempts
// it, 130-270 us an op where the same placement costs MPI's own blocking call 8-15 us; and
// a yield hands the core only to a thread of its own core's run queue, never to one queued
// on another core, which only a sleep lets an idle core pull over. The short spin keeps
// the latency of ranks with a core each (it covers a small message's round trip); the
// yields hand the core to a peer that shares it; the sleeps free it in long waits.
// kLong (JAX_CPU_MPI_WAIT=spin) spins 2000 polls and then yields for a long time (200000
// polls, hundreds of ms) before it sleeps. kSoon (JAX_CPU_MPI_WAIT=sleep, or more busy threads than cores) spins
// a little (a reply already on its way), yields a few times and sleeps in growing steps.
//
// A wait for an MPI operation that moves many bytes (a collective) is given a busy time,
// about as long as the bytes take (kBusyPerByte): until then it spins and yields but never
// sleeps. MPI moves a large message only while its processes call it (the shared-memory
// copies run inside MPI_Test), so a sleep between two polls stalls the transfer itself.
class Backoff {
 public:
  using Clock = std::chrono::steady_clock;
  Backoff()
      : mode_(static_cast<WaitMode>(t_wait_mode >= 0
                                        ? t_wait_mode
                                        : g_wait_mode.load(std::memory_order_relaxed))),
        // kLong sleeps only after hundreds of ms of yields: in whole kMaxSleep steps.
        sleep_(mode_ == WaitMode::kLong ? kMaxSleep : kFirstSleep) {}
  explicit Backoff(size_t bytes_in_flight) : Backoff() {
    busy_ = std::chrono::duration_cast<Clock::duration>(
        kBusyPerByte * static_cast<double>(bytes_in_flight));
  }
  Backoff(const Backoff&) = delete;
  Backoff& operator=(const Backoff&) = delete;

  // Whether this wait spins long (JAX_CPU_MPI_WAIT=spin: ranks bound to a core each).
  bool spins_long() const { return mode_ == WaitMode::kLong; }

  // The wait begins (the timeline's wait), for a caller that spins before its first Pause.
  void Waiting() { waited_.Waiting(); }

  // Ends the spin: the next pauses yield, then sleep, as after a whole spin (the caller
  // spun by a budget of its own).
  void SkipSpin() {
    waited_.Waiting();
    iterations_ = std::max<uint64_t>(iterations_, mode_ == WaitMode::kLong ? kLongSpins
                                                                          : kSoonSpins);
    if (mode_ == WaitMode::kBounded && phase_ == Phase::kSpin) {
      phase_ = Phase::kYield;
      start_ = Clock::now() - kSpinFor;
    }
  }

  void Pause() {
    if (iterations_ == 0) waited_.Waiting();
    ++iterations_;
    switch (mode_) {
      case WaitMode::kBounded: PauseBounded(); return;
      case WaitMode::kSoon:
        if (iterations_ < kSoonSpins) return;
        if (iterations_ < kSoonSpins + kSoonYields || Busy()) {
          Yield();
          return;
        }
        Sleep();
        return;
      case WaitMode::kLong:
        if (iterations_ < kLongSpins) return;
        if (iterations_ < kLongYieldUntil || Busy()) {
          Yield();
          return;
        }
        Sleep();  // its first step is kMaxSleep already (the constructor)
        return;
    }
  }

 private:
  void PauseBounded() {
    if (phase_ == Phase::kSpin) {
      // The clock at the first pause, then every kClockEvery polls while spinning.
      if (iterations_ == 1) {
        start_ = Clock::now();
        return;
      }
      if ((iterations_ % kClockEvery) != 0 || Clock::now() - start_ < kSpinFor) return;
      phase_ = Phase::kYield;
    }
    if (phase_ == Phase::kYield) {
      if (Clock::now() - start_ < kYieldUntil || Busy()) {
        Yield();
        return;
      }
      phase_ = Phase::kSleep;
    }
    Sleep();
  }

  static void Yield() {
    g_wait_yields.fetch_add(1, std::memory_order_relaxed);
    sched_yield();
  }

  void Sleep() {
    slack_.Enable();
    g_wait_sleeps.fetch_add(1, std::memory_order_relaxed);
    const auto now = Clock::now();
    if (sleeping_since_ == Clock::time_point{}) sleeping_since_ = now;
    std::this_thread::sleep_for(sleep_);
    // A wait that has slept long is a peer computing (a pipeline's bubble), not a message
    // on its way. On a node with more busy threads than cores (kSoon) each wake-up is a
    // context switch and a poll of MPI taken from the threads that compute, thousands a
    // step at kMaxSleep; so there, beyond kMaxSleep, the step grows with the time already
    // slept (at most 1/kLateShare of it, and kMaxLongSleep): the message is then found at
    // most that late. A waiter with a core of its own takes nothing from anyone by waking,
    // and keeps kMaxSleep.
    auto cap = kMaxSleep;
    if (mode_ == WaitMode::kSoon) {
      const auto slept = std::chrono::duration_cast<std::chrono::microseconds>(
          now - sleeping_since_);
      cap = std::clamp(slept / kLateShare, kMaxSleep, kMaxLongSleep);
    }
    sleep_ = std::min(sleep_ * 2, cap);
  }

  // Whether the busy time has not run out yet (read from the clock only once the spins are
  // over, and only by a wait that has one).
  bool Busy() {
    if (busy_.count() == 0) return false;
    const auto now = Clock::now();
    if (busy_until_ == Clock::time_point{}) busy_until_ = now + busy_;
    return now < busy_until_;
  }

  // 1 ns per byte: 1 GB/s, slower than any shared-memory or network MPI moves a collective.
  static constexpr std::chrono::duration<double, std::nano> kBusyPerByte{1.0};
  // kBounded: a small message's round trip between ranks on their own cores is a few us,
  // and kSpinFor covers it several times over. Up to kYieldUntil a yield costs a rank with
  // a core of its own nothing (a syscall that finds no other thread) and answers sooner
  // than a sleep; beyond it the wait is long (a peer computing, a pipeline's bubble) and a
  // sleep's wakeup is small against it.
  static constexpr std::chrono::microseconds kSpinFor{10};
  static constexpr std::chrono::microseconds kYieldUntil{1000};
  static constexpr uint64_t kClockEvery = 8;
  static constexpr uint64_t kLongSpins = 2000;
  static constexpr uint64_t kLongYieldUntil = 200000;
  static constexpr uint64_t kSoonSpins = 300;
  static constexpr uint64_t kSoonYields = 200;
  static constexpr std::chrono::microseconds kFirstSleep{5};
  static constexpr std::chrono::microseconds kMaxSleep{50};
  static constexpr std::chrono::microseconds kMaxLongSleep{500};
  static constexpr int kLateShare = 16;

  enum class Phase { kSpin, kYield, kSleep };
  const WaitMode mode_;
  Phase phase_ = Phase::kSpin;
  uint64_t iterations_ = 0;
  Clock::time_point start_{};
  std::chrono::microseconds sleep_;
  Clock::time_point sleeping_since_{};
  Clock::duration busy_{0};
  Clock::time_point busy_until_{};
  trace::WaitTimer waited_;
  FineTimerSlack slack_;  // the thread's own slack comes back when the wait ends
};

// How long a wait spins before it yields (Backoff::SkipSpin), per thread and kind of wait,
// adapted like an adaptive mutex's spin count: where the scheduler put both ranks on one
// core (unbound ranks now and then) the peer runs only once the waiter yields, so every
// poll of a fixed spin (Backoff's kSpinFor) is lost, at every message. A wait that ends
// while spinning lets the next spin a little longer; one that had to yield halves it, and
// below kMinNs the wait yields at once, trying the whole spin again every kProbe waits.
// With a core per rank a wait that outlasts the spin (a peer still computing, a large
// message's copy) halves it away too, at no cost: its yields find no other thread to run.
// Used by the collectives' waits (PollCollective) and a precv's (RecvStaged, RecvLarge,
// FinishDirect: AdaptedPause).
class AdaptiveSpin {
 public:
  static constexpr int64_t kMaxNs = 10'000;  // Backoff::kSpinFor
  static constexpr int64_t kMinNs = 500;
  static constexpr uint32_t kProbe = 32;

  // The spin of this wait, in ns (0: yield at once).
  int64_t Begin() {
    if (budget_ns_ >= kMinNs) return budget_ns_;
    return ++skipped_ % kProbe == 0 ? kMaxNs : 0;
  }
  // `in_spin`: the wait ended before its spin ran out.
  void End(int64_t spun_ns, bool in_spin) {
    if (spun_ns == 0) return;  // no spin: nothing learned
    budget_ns_ = in_spin ? std::min(kMaxNs, spun_ns + spun_ns / 4) : spun_ns / 2;
  }

 private:
  int64_t budget_ns_ = kMaxNs;
  uint32_t skipped_ = 0;
};

// A polling wait's pause: a spin of the length `adaptive` gives (AdaptiveSpin), then
// `backoff`'s yields and sleeps; what the wait learned goes back to `adaptive` when it ends
// (however it ends: the destructor). Without `adapts`, `backoff` alone.
class AdaptedPause {
 public:
  AdaptedPause(AdaptiveSpin& adaptive, Backoff& backoff, bool adapts)
      : adaptive_(adaptive),
        backoff_(backoff),
        spin_ns_(adapts ? adaptive.Begin() : -1),
        spinning_(adapts) {}
  ~AdaptedPause() {
    if (spin_ns_ >= 0) adaptive_.End(spin_ns_, spinning_);
  }
  AdaptedPause(const AdaptedPause&) = delete;
  AdaptedPause& operator=(const AdaptedPause&) = delete;

  void Pause() {
    if (spinning_) {
      const auto now = std::chrono::steady_clock::now();
      if (spin_start_ == std::chrono::steady_clock::time_point{}) {
        spin_start_ = now;
        backoff_.Waiting();
      }
      if (spin_ns_ > 0 && now - spin_start_ < std::chrono::nanoseconds(spin_ns_)) return;
      spinning_ = false;
      backoff_.SkipSpin();
    }
    backoff_.Pause();
  }

  // A poll that did other work instead of pausing (a fault-in step): the wait has begun.
  void Waiting() { backoff_.Waiting(); }

 private:
  AdaptiveSpin& adaptive_;
  Backoff& backoff_;
  const int64_t spin_ns_;
  bool spinning_;
  std::chrono::steady_clock::time_point spin_start_{};
};

}  // namespace jcm
