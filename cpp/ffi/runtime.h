// Process-wide state of the extension: configuration, where this process sits in the job,
// and the two transports (in-process mailbox, MPI).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/config.h"
#include "ffi/failed_runs.h"
#include "ffi/kept_sends.h"
#include "local/mailbox.h"
#include "mpi/transport.h"

namespace jcm {

// Locking:
//   mu_           config_, mpi_, unreachable_peers_, exit_barrier_met_, rank_hosts_.
//   progress_mu_  progress_wanted_, progress_stop_, progress_thread_ (start and join);
//                 progress_cv_ waits on it. deferred_watch_ is set under it (and read
//                 without it by psends, with deferred_made_: see WatchDeferred).
//   Order: progress_mu_ before mu_ (ProgressLoop calls mpi() holding progress_mu_).
//   failed_mu_    failed_ops_, failed_ops_dropped_ (never held with another).
//   mailbox_, kept_sends_ and suspect_channels_ lock themselves.
class Runtime {
 public:
  static Runtime& Get();

  Config config() const;
  void set_config(const Config& config);

  Mailbox& mailbox() { return mailbox_; }
  // Sends that the precv keeping their operand alive finishes (see kept_sends.h).
  KeptSends& kept_sends() { return kept_sends_; }
  // Channels into this process's devices that a failed call may have left a message in
  // (failed_runs.h): their precvs are refused.
  SuspectChannels& suspect_channels() { return suspect_channels_; }
  // An op of ours failed on `partition` in the program run `run_id`: XLA runs no further
  // thunk of that run there, so the precvs that were to finish its kept sends never run,
  // and the operands they kept alive are freed when the program ends. Finishes those sends
  // now (KeptSends::FinishRun), giving each at most kKeptSendGraceAfterFailure; what goes
  // wrong with them is kept for the report at exit (the op's own error stands).
  // If this op (or finishing its sends) abandoned an MPI request, its `error` is what broke
  // the transport: every later cross-process op quotes it (MpiTransport::NoteBreak).
  void settle_run_after_failure(int64_t run_id, int64_t partition, const std::string& error);

  // The MPI transport, or nullptr until Python attaches a communicator.
  std::shared_ptr<MpiTransport> mpi() const;
  // Both at once (one lock: every psend and precv asks).
  struct State {
    Config config;
    std::shared_ptr<MpiTransport> mpi;
  };
  State state() const;
  void attach_mpi(std::unique_ptr<MpiTransport> transport);

  // A psend has left an MPI send in flight: wakes the progress thread, which polls the
  // transport until every send has completed. Over a network (UCX on TCP) a send moves only
  // while its process calls MPI; without this a sender that computes, or waits in something
  // else (a gloo collective, a JAX barrier), would hold its receiver up, or deadlock with it.
  void mpi_send_in_flight();
  // A psend has deferred an MPI send (mpi/transport.h: a cycle's message waiting for its
  // receiver's ready signal). The precv that comes next on the same device posts it, so the
  // progress thread is not woken for it: a wake-up per step cost a context switch and MPI
  // calls competing with the device thread's, and on a node with no core to spare it took
  // the core of a device thread (the exchange ran at less than half of MPI_Sendrecv's
  // speed). The thread only watches: while psends defer, it looks every kDeferredWatchTick
  // and posts (or stages) the sends deferred longer than that, for a device that waits
  // elsewhere between its psend and its precv (a mailbox receive, a collective), where
  // nothing polls MPI; it stops watching once none was deferred for kDeferredWatchLinger.
  void mpi_send_deferred();
  static constexpr std::chrono::microseconds kDeferredWatchTick{500};
  static constexpr std::chrono::milliseconds kDeferredWatchLinger{50};
  // Completes outstanding MPI sends, meets every rank in the exit barrier and forgets the
  // communicator (before MPI_Finalize). Waits at most timeout_s, and at most
  // kSuspectExitWaitS once a peer failed to answer (see note_unreachable_peer).
  std::string detach_mpi(double timeout_s);
  // Whether the last detach_mpi met every rank in the exit barrier.
  bool exit_barrier_met() const;
  // Whether the MPI transport abandoned a receive or send that MPI could not cancel at its
  // deadline (a peer stopped mid-message): the job should end (mpi/transport.h).
  bool job_broken() const;

  // An MPI rank that did not answer: a precv from it timed out or an MPI call with it
  // failed. The exit barrier then waits only a few seconds: a peer that is just slow
  // still meets it, one that is unreachable must not hold this process for the whole
  // JAX_CPU_MPI_EXIT_TIMEOUT.
  void note_unreachable_peer(int rank);
  std::vector<int> unreachable_peers() const;
  static constexpr double kSuspectExitWaitS = 2.0;

  // psend/precv handlers of this process that use the MPI transport now. At exit the
  // transport is kept until they are done (see close()).
  class MpiOpScope {
   public:
    MpiOpScope() { Get().mpi_ops_active_.fetch_add(1, std::memory_order_acq_rel); }
    ~MpiOpScope() { Get().mpi_ops_active_.fetch_sub(1, std::memory_order_acq_rel); }
    MpiOpScope(const MpiOpScope&) = delete;
    MpiOpScope& operator=(const MpiOpScope&) = delete;
  };
  int mpi_ops_active() const { return mpi_ops_active_.load(std::memory_order_acquire); }
  // At exit, once every op had its grace: ends every wait for a peer (Closing()) and waits
  // up to `wait_s` for the ops still running to return; returns how many are still running.
  int close(double wait_s);

  // A message refused (size or dtype mismatch) or lost (timed out, failed, ended at exit):
  // the error text, kept for the report at exit (an error JAX drops with an output that
  // nobody reads is seen there). The same text is counted, not kept twice.
  void note_failed_op(const std::string& error);
  // "error (N times)" lines, oldest first, and how many distinct errors were dropped beyond
  // kMaxFailedOps; clears the list.
  std::vector<std::string> take_failed_ops();
  // Prints the failed ops (take_failed_ops) on stderr when the process exits, after the
  // interpreter's finalization: the CPU client joins its device threads there, so an op of a
  // program whose outputs were dropped, which may start only then, is reported too.
  // `where` names the process ("process 1"); the last call's name is used. Once registered,
  // it stays (a C atexit handler).
  void report_failed_ops_at_process_exit(const std::string& where);
  static constexpr size_t kMaxFailedOps = 20;

  // Hostname of each MPI rank (set when MPI is attached), for error messages.
  void set_rank_hosts(std::vector<std::string> hosts);
  std::string host_of_rank(int rank) const;

 private:
  mutable std::mutex mu_;
  Config config_;
  Mailbox mailbox_;
  KeptSends kept_sends_;
  SuspectChannels suspect_channels_;
  std::shared_ptr<MpiTransport> mpi_;
  void ProgressLoop();
  // The progress thread's watch of deferred sends (mpi_send_deferred); returns when it ends,
  // when a staged send wants the thread, or at stop. Called and returns with `lock` held.
  void WatchDeferred(std::unique_lock<std::mutex>& lock);
  void StopProgressThread();

  std::set<int> unreachable_peers_;
  std::mutex progress_mu_;
  std::condition_variable progress_cv_;
  bool progress_wanted_ = false;
  bool progress_stop_ = false;
  // Sequentially consistent, so that a watch that ends as a psend defers is never missed:
  // the psend counts (deferred_made_) and then reads deferred_watch_; the watch clears
  // deferred_watch_ and then reads the count.
  std::atomic<bool> deferred_watch_{false};
  std::atomic<uint64_t> deferred_made_{0};
  std::thread progress_thread_;
  bool exit_barrier_met_ = false;
  std::vector<std::string> rank_hosts_;
  std::atomic<int> mpi_ops_active_{0};
  // Under failed_mu_: distinct error texts with their counts, in order of first sight.
  std::mutex failed_mu_;
  std::vector<std::pair<std::string, uint64_t>> failed_ops_;
  uint64_t failed_ops_dropped_ = 0;
};

}  // namespace jcm
