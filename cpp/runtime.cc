#include "runtime.h"

#include "immortal.h"

namespace jcm {


Runtime& Runtime::Get() {
  static Immortal<Runtime> runtime;
  return runtime.get();
}

Config Runtime::config() const {
  std::lock_guard<std::mutex> lock(mu_);
  return config_;
}

void Runtime::set_config(const Config& config) {
  std::lock_guard<std::mutex> lock(mu_);
  config_ = config;
}

std::shared_ptr<MpiTransport> Runtime::mpi() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mpi_;
}

void Runtime::attach_mpi(std::unique_ptr<MpiTransport> transport) {
  std::lock_guard<std::mutex> lock(mu_);
  mpi_ = std::move(transport);
}

std::string Runtime::detach_mpi(double timeout_s) {
  std::shared_ptr<MpiTransport> transport;
  {
    std::lock_guard<std::mutex> lock(mu_);
    transport = mpi_;
  }
  if (!transport) return "";
  size_t left = transport->Drain(DeadlineAfter(timeout_s));
  std::string report;
  if (left > 0) {
    report = std::to_string(left) + " psend message(s) were never received by their peer(s)";
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Keep the transport (and its undelivered buffers) alive if sends are still pending:
    // MPI may still read them. Otherwise free the communicator now, before MPI_Finalize.
    if (left == 0) mpi_.reset();
  }
  return report;
}

}  // namespace jcm
