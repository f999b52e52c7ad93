// Runtime configuration shared by the handlers and the transports, and the deadline helper.
#pragma once

#include <chrono>
#include <cstdint>

namespace jcm {

struct Config {
  // How long a precv waits for its message before failing (seconds).
  double recv_timeout_s = 300.0;
  // Upper bound on the bytes of MPI sends that are copied and not yet delivered.
  // A psend that would exceed it first waits for older sends to complete.
  uint64_t max_inflight_bytes = uint64_t{1} << 30;
};

using Clock = std::chrono::steady_clock;

inline Clock::time_point DeadlineAfter(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(seconds));
}

}  // namespace jcm
