// Runtime configuration shared by the handlers and the transports, and the deadline helper.
#pragma once

#include <atomic>
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

// Set once at exit (Runtime::Close), after the exit grace: from then on every wait for a
// peer (a precv, a send waiting for its receiver) ends at its next look at the clock, as
// at its deadline, and the handler says the op was ended at exit. Without it a program
// whose outputs nobody waited for leaves an op waiting a whole JAX_CPU_MPI_RECV_TIMEOUT in
// the interpreter's finalization (the CPU client joins its device threads there).
inline std::atomic<bool> g_closing{false};
inline bool Closing() { return g_closing.load(std::memory_order_relaxed); }

// Whether a wait with `deadline` must end now: the deadline passed, or the process closed.
inline bool Expired(Clock::time_point deadline) { return Closing() || Clock::now() > deadline; }

}  // namespace jcm
