// Testing only: stops this process (SIGSTOP) in the middle of one of its MPI sends, as a
// peer whose link dies mid-message (tests/mpi_programs/stopped_sender.py). Disarmed, it
// costs one relaxed atomic load per send posted.
#pragma once

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>

namespace jcm {

class StopMidSendForTest {
 public:
  using Clock = std::chrono::steady_clock;

  // The next send of at least `min_bytes` stops the process at the first test of it, while
  // it is not known complete, `after` or more after it was posted. A message whose
  // receiver has matched it is then flowing: the stop lands in its middle. min_bytes 0
  // disarms.
  static void Arm(size_t min_bytes, std::chrono::microseconds after) {
    after_us_.store(after.count(), std::memory_order_relaxed);
    min_bytes_.store(min_bytes, std::memory_order_release);
  }

  // When a send of `bytes` is posted: the time to hand to Check later, or the epoch when
  // this send does not qualify (then no clock is read).
  static Clock::time_point Posted(size_t bytes) {
    const size_t min_bytes = min_bytes_.load(std::memory_order_relaxed);
    if (min_bytes == 0 || bytes < min_bytes) return {};
    return Clock::now();
  }

  // Before a send posted at `posted` (Posted's answer), not yet known complete, is tested.
  static void Check(Clock::time_point posted) {
    if (posted == Clock::time_point{}) return;
    const std::chrono::microseconds after(after_us_.load(std::memory_order_relaxed));
    if (Clock::now() - posted < after) return;
    if (min_bytes_.exchange(0, std::memory_order_acq_rel) != 0) std::raise(SIGSTOP);
  }

 private:
  static inline std::atomic<size_t> min_bytes_{0};
  static inline std::atomic<int64_t> after_us_{0};
};

}  // namespace jcm
