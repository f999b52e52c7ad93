// Process-wide state of the extension: configuration, where this process sits in the job,
// and the two transports (in-process mailbox, MPI).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "mailbox.h"
#include "mpi_transport.h"

namespace jcm {

struct Config {
  // How long a precv waits for its message before failing (seconds).
  double recv_timeout_s = 300.0;
  // Upper bound on the bytes of MPI sends that are copied and not yet delivered.
  // A psend that would exceed it first waits for older sends to complete.
  uint64_t max_inflight_bytes = uint64_t{1} << 30;
};

class Runtime {
 public:
  static Runtime& Get();

  Config config() const;
  void set_config(const Config& config);

  Mailbox& mailbox() { return mailbox_; }

  // The MPI transport, or nullptr until Python attaches a communicator.
  std::shared_ptr<MpiTransport> mpi() const;
  void attach_mpi(std::unique_ptr<MpiTransport> transport);
  // Completes outstanding MPI sends and forgets the communicator (before MPI_Finalize).
  std::string detach_mpi(double timeout_s);

 private:
  mutable std::mutex mu_;
  Config config_;
  Mailbox mailbox_;
  std::shared_ptr<MpiTransport> mpi_;
};

// Deadline helper.
using Clock = std::chrono::steady_clock;
inline Clock::time_point DeadlineAfter(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(seconds));
}

}  // namespace jcm
