#include "ffi/runtime.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "common/immortal.h"

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

Runtime::State Runtime::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {config_, mpi_};
}

void Runtime::attach_mpi(std::unique_ptr<MpiTransport> transport) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    mpi_ = std::move(transport);
  }
  std::lock_guard<std::mutex> lock(progress_mu_);
  if (!progress_thread_.joinable()) {
    progress_stop_ = false;
    progress_thread_ = std::thread([this] { ProgressLoop(); });
  }
}

void Runtime::mpi_send_in_flight() {
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    if (progress_wanted_) return;
    progress_wanted_ = true;
  }
  progress_cv_.notify_one();
}

void Runtime::mpi_send_deferred() {
  deferred_made_.fetch_add(1);
  if (deferred_watch_.load()) return;  // the usual case: watching already, no wake-up
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    if (deferred_watch_.load()) return;
    deferred_watch_.store(true);
  }
  progress_cv_.notify_one();
}

void Runtime::WatchDeferred(std::unique_lock<std::mutex>& lock) {
  uint64_t seen = deferred_made_.load();
  auto last_deferred = std::chrono::steady_clock::now();
  while (true) {
    if (progress_cv_.wait_for(lock, kDeferredWatchTick,
                              [this] { return progress_wanted_ || progress_stop_; })) {
      return;  // deferred_watch_ stays set: the loop comes back here when that is done
    }
    lock.unlock();
    std::shared_ptr<MpiTransport> transport = mpi();
    bool deferred = false, staged = false;
    if (transport) {
      // Errors belong to the deferred sends (their precvs report them).
      (void)transport->ProgressDeferred(
          std::chrono::steady_clock::now() + std::chrono::seconds(1), kDeferredWatchTick);
      deferred = transport->has_deferred_sends();
      staged = transport->has_staged_sends();
    }
    lock.lock();
    if (staged) {
      // A send staged for a late receiver (by this watch or a device thread) moves only
      // while this process calls MPI: poll it now, not only once its precv runs.
      progress_wanted_ = true;
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    const uint64_t made = deferred_made_.load();
    if (made != seen || deferred) {
      seen = made;
      last_deferred = now;
      continue;
    }
    if (now - last_deferred < kDeferredWatchLinger) continue;
    deferred_watch_.store(false);
    if (deferred_made_.load() == seen) return;  // else a psend deferred meanwhile: go on
    deferred_watch_.store(true);
  }
}

void Runtime::ProgressLoop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(progress_mu_);
      progress_cv_.wait(lock, [this] {
        return progress_wanted_ || progress_stop_ || deferred_watch_.load();
      });
      if (progress_stop_) return;
      if (!progress_wanted_) {
        WatchDeferred(lock);
        if (progress_stop_) return;
        if (!progress_wanted_) continue;
      }
    }
    // Poll until no send is left in flight; sleep between polls (the device threads poll
    // much faster while they wait in MPI themselves), longer the longer it takes.
    auto pause = std::chrono::microseconds(20);
    while (true) {
      std::shared_ptr<MpiTransport> transport = mpi();
      if (!transport || transport->inflight_sends() == 0) break;
      {
        std::unique_lock<std::mutex> lock(progress_mu_);
        if (progress_cv_.wait_for(lock, pause, [this] { return progress_stop_; })) return;
      }
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
    std::lock_guard<std::mutex> lock(progress_mu_);
    progress_wanted_ = false;
    // A send that went in flight after the last poll set progress_wanted_ again before
    // this reset? It notified while wanted was true (no-op), so poll once more.
    std::shared_ptr<MpiTransport> transport = mpi();
    if (transport && transport->inflight_sends() > 0) progress_wanted_ = true;
  }
}

void Runtime::StopProgressThread() {
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    if (!progress_thread_.joinable()) return;
    progress_stop_ = true;
  }
  progress_cv_.notify_all();
  progress_thread_.join();
}

namespace {
// One line of the exit report for a message that no precv took: its kind, its size and, for
// a staged one, what the bytes hold (the envelope comes first), its sender and tag.
std::string DescribeUnreceived(const MpiTransport::Unreceived& u) {
  std::string what;
  if (std::string_view(u.kind) == "staged") {
    const int envelope = static_cast<int>(sizeof(Envelope));
    what = u.bytes <= envelope ? " (the chunk header of a larger or framed message)"
                               : " (a payload of " + std::to_string(u.bytes - envelope) +
                                     " bytes and its envelope)";
  }
  return "a " + std::string(u.kind) + " message of " + std::to_string(u.bytes) + " bytes" +
         what + " from MPI rank " + std::to_string(u.source) + " on tag " +
         std::to_string(u.tag);
}
}  // namespace

std::string Runtime::detach_mpi(double timeout_s) {
  std::shared_ptr<MpiTransport> transport;
  {
    std::lock_guard<std::mutex> lock(mu_);
    transport = mpi_;
  }
  if (!transport) return "";
  StopProgressThread();  // the drain below makes progress itself
  if (!unreachable_peers().empty()) timeout_s = std::min(timeout_s, kSuspectExitWaitS);
  const MpiTransport::DrainResult drained = transport->Drain(DeadlineAfter(timeout_s));
  std::string report;
  if (drained.undelivered > 0) {
    char within[64];
    std::snprintf(within, sizeof(within), "%g", timeout_s);
    report = std::to_string(drained.undelivered) +
             " psend message(s) were never received by their peer(s) in the " + within +
             " s the exit waited (JAX_CPU_MPI_EXIT_TIMEOUT, less with a peer that did not "
             "answer):\n" + drained.undelivered_detail;
  }
  // Once every rank met us, every send of the job that will ever start has: a message a
  // peer sent us that no precv took is still waiting here. Its sender reports it only if
  // its send could not complete without a receiver (an eager one completes), and a program
  // that went on would have had a later precv of the channel take it as its own. Ready
  // signals left are not messages (a sender that staged discards them by number).
  if (drained.all_ranks_met && !transport->broken()) {
    std::string unreceived;
    size_t count = 0;
    for (const MpiTransport::Unreceived& u : transport->ProbeUnreceived()) {
      if (std::string_view(u.kind) == "ready") continue;
      ++count;
      unreceived += "\n    " + DescribeUnreceived(u);
    }
    if (count > 0) {
      report += (report.empty() ? "" : "\n") +
                std::to_string(count) + " message(s) that peers sent were never taken by a "
                "precv here (the first of each peer and kind; tag: source partition x the "
                "op's partitions + destination partition):" + unreceived;
    }
  }
  if (!drained.status.ok()) {
    report += (report.empty() ? "" : "\n") + ("an MPI call failed while draining: " +
                                              drained.status.message());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    exit_barrier_met_ = drained.all_ranks_met;
    // Keep the transport (and its undelivered buffers) alive if sends are still pending, a
    // rank never met us or requests were abandoned: MPI may still use them. Otherwise free
    // the communicator now, before MPI_Finalize.
    if (drained.undelivered == 0 && drained.all_ranks_met && !transport->broken()) {
      mpi_.reset();
    }
  }
  return report;
}

bool Runtime::job_broken() const {
  std::shared_ptr<MpiTransport> transport = mpi();
  return transport && transport->broken();
}

bool Runtime::exit_barrier_met() const {
  std::lock_guard<std::mutex> lock(mu_);
  return exit_barrier_met_;
}

void Runtime::note_unreachable_peer(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  unreachable_peers_.insert(rank);
}

std::vector<int> Runtime::unreachable_peers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {unreachable_peers_.begin(), unreachable_peers_.end()};
}

void Runtime::set_rank_hosts(std::vector<std::string> hosts) {
  std::lock_guard<std::mutex> lock(mu_);
  rank_hosts_ = std::move(hosts);
}

std::string Runtime::host_of_rank(int rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (rank < 0 || rank >= static_cast<int>(rank_hosts_.size())) return "";
  return rank_hosts_[rank];
}

int Runtime::close(double wait_s) {
  g_closing.store(true, std::memory_order_relaxed);
  const auto until = DeadlineAfter(wait_s);
  while (mpi_ops_active() > 0 && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return mpi_ops_active();
}

void Runtime::settle_run_after_failure(int64_t run_id, int64_t partition,
                                       const std::string& error) {
  Status s = kept_sends_.FinishRun(
      run_id, partition, std::chrono::steady_clock::now() + kKeptSendGraceAfterFailure);
  if (!s.ok()) note_failed_op(s.message());
  // After FinishRun: a kept send abandoned there broke the transport because of this op too.
  if (MpiTransport::TakeAbandonedOnThisThread()) {
    if (std::shared_ptr<MpiTransport> transport = mpi()) transport->NoteBreak(error);
  }
}

void Runtime::note_failed_op(const std::string& error) {
  // Alike by their first line: the lines after it (a timeout's transport state, with its
  // times) differ from one failure of the same op to the next. The first one's are kept.
  auto head = [](std::string_view text) { return text.substr(0, text.find('\n')); };
  std::lock_guard<std::mutex> lock(failed_mu_);
  for (auto& [text, count] : failed_ops_) {
    if (head(text) == head(error)) {
      ++count;
      return;
    }
  }
  if (failed_ops_.size() >= kMaxFailedOps) {
    ++failed_ops_dropped_;
    return;
  }
  failed_ops_.emplace_back(error, 1);
}

std::vector<std::string> Runtime::take_failed_ops() {
  std::lock_guard<std::mutex> lock(failed_mu_);
  std::vector<std::string> lines;
  for (const auto& [text, count] : failed_ops_) {
    if (count == 1) {
      lines.push_back(text);
      continue;
    }
    // The count goes with the op's line, not after the transport state's lines under it.
    std::string line = text;
    const size_t head_end = std::min(line.find('\n'), line.size());
    line.insert(head_end, " (" + std::to_string(count) + " times)");
    lines.push_back(std::move(line));
  }
  if (failed_ops_dropped_ > 0) {
    lines.push_back(std::to_string(failed_ops_dropped_) + " other distinct error(s) not kept");
  }
  failed_ops_.clear();
  failed_ops_dropped_ = 0;
  return lines;
}

namespace {

std::mutex& ExitReportMutex() {
  static Immortal<std::mutex> mu;
  return mu.get();
}

std::string& ExitReportWhere() {
  static Immortal<std::string> where;
  return where.get();
}

void PrintFailedOpsAtProcessExit() {
  const std::vector<std::string> failed = Runtime::Get().take_failed_ops();
  if (failed.empty()) return;
  std::string text;
  {
    std::lock_guard<std::mutex> lock(ExitReportMutex());
    text = "jax_cpu_mpi: at exit, " + ExitReportWhere() + " had " +
           std::to_string(failed.size()) +
           " failed psend/precv (refused or lost messages; an error in an output the "
           "program never read is reported nowhere else):\n";
  }
  for (const std::string& line : failed) text += "  - " + line + "\n";
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}

}  // namespace

void Runtime::report_failed_ops_at_process_exit(const std::string& where) {
  {
    std::lock_guard<std::mutex> lock(ExitReportMutex());
    ExitReportWhere() = where;
  }
  static std::once_flag registered;
  std::call_once(registered, [] { std::atexit(PrintFailedOpsAtProcessExit); });
}

}  // namespace jcm
