// Sends that finish in a later precv: the psend returned while its bytes were still being
// read from its operand.
//
// When a precv takes a psend's token in the same computation, the CPU lowering also gives
// that precv the psend's operand (python/jax_cpu_mpi/_src/passes/kept_operands.py). XLA then keeps the
// operand's buffer alive, and unchanged, until that precv has run, so the psend may hand
// the operand itself to a receiver that is already waiting and return at once: the device
// goes on with its own work (say, the zero-fill of its precv output) while the peer copies.
// Several precvs may keep one operand (a group: passes/kept_operands.py); the last of them
// to run finishes the sends made from it before it returns, after it has done its own
// receive: it only waits for a receiver that is already taking the bytes, never for one
// that has not come. So a device that sends and receives in one step finishes its sends
// only after all its receives of the step: both directions are in flight at once.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"

namespace jcm {

// How long a kept send may still take once the op that would have waited for it failed (a
// failed precv's own sends, a failed op's run: Runtime::settle_run_after_failure): its error
// must not come a whole timeout after the op's, and a send that is just completing still may.
inline constexpr std::chrono::milliseconds kKeptSendGraceAfterFailure{500};

// How a kept send is finished: a plain function and the few things it needs, not a
// std::function: this is made for every kept send (every message of an exchange from 16 KiB
// on), and captures of a std::function that size go to the heap, as did the op's text.
struct KeptFinish {
  using Fn = Status (*)(const KeptFinish& self, std::chrono::steady_clock::time_point deadline);
  Fn fn = nullptr;
  std::shared_ptr<void> send;   // the send in flight (a mailbox offer, a DirectSend)
  std::shared_ptr<void> owner;  // what it belongs to and must outlive it (the transport)
  std::shared_ptr<const void> text;  // what its error names (the op's texts), shared by sends
  int64_t values[10] = {};      // the rest of that error's details (ranks, tags, partitions)

  // Waits for the send to finish by `deadline`; its status says how it ended.
  Status operator()(std::chrono::steady_clock::time_point deadline) const {
    return fn(*this, deadline);
  }
};

// Locking:
//   mu_   pending_ and kept_total_. A Finish runs without it (it may wait for a peer).
//   pending_count_ mirrors pending_.size() for the lock-free check of Release.
class KeptSends {
 public:
  using Finish = KeptFinish;

  // A send still reading from `operand` (a buffer XLA keeps alive until the `keepers`
  // precvs that take it as an operand have run) of the program run `run_id` (XLA's RunId)
  // on partition `partition`. The last of those precvs to run finishes it (Release).
  void Add(const void* operand, int64_t run_id, int64_t partition, int64_t keepers,
           Finish finish);

  // Called by a precv with the operands it keeps (`operands[0..count)`, each address once
  // however often it comes): counts this precv off every send of its run and partition
  // still reading from one of them, and finishes those it was the last keeper of (in the
  // order they were added) by the time `deadline()` returns; returns the first failure, or
  // ok. Every keeper of a send
  // runs after its psend (it reads the psend's u32 result: passes/kept_operands.py), so
  // none is missed, and a send is finished while its operand is alive. `deadline` is
  // called only when there is a send to finish (not on the path of a precv whose psend
  // finished its own send, e.g. every small message).
  // Only sends of the run `run_id` are counted: an entry of another run at the same address
  // would point into a buffer of that run, not this precv's operand.
  template <typename Deadline>
  Status Release(const void* const* operands, size_t count, int64_t run_id, int64_t partition,
                 Deadline deadline) {
    if (pending_count_.load(std::memory_order_acquire) == 0) return Status::Ok();
    return ReleaseSlow(operands, count, run_id, partition, deadline);
  }

  // Finishes every send of the run `run_id` on `partition` by `deadline`, whichever precv
  // keeps it; called by an op of ours that fails there. XLA's thunk executor (one per
  // device) runs no further thunk of a program once one fails, so the precvs that keep
  // these operands may never run, and XLA frees the operands when the program ends: the
  // sends must be done with them (posted, staged or cancelled) before the failing op
  // returns, while the operands are still alive.
  // Returns the first failure, or ok.
  Status FinishRun(int64_t run_id, int64_t partition,
                   std::chrono::steady_clock::time_point deadline);

  // Sends not finished yet, and sends that were kept at all (since the start).
  size_t pending() const;
  uint64_t kept_total() const;

 private:
  Status ReleaseSlow(const void* const* operands, size_t count, int64_t run_id,
                     int64_t partition,
                     const std::function<std::chrono::steady_clock::time_point()>& deadline);

  struct Entry {
    const void* operand = nullptr;
    int64_t run_id = 0;
    int64_t partition = 0;
    int64_t keepers = 1;  // precvs of this run that have not counted themselves off yet
    Finish finish;
  };

  // Moves the finishes of the entries that `matches` into `out` and erases them (in the
  // order they were added), under mu_. `matches` may change the entry (count a keeper off)
  // before it says.
  template <typename Matches>
  void Take(std::vector<Finish>& out, Matches matches);

  // pending_.size(), readable without the lock: the precv that finishes a send runs after
  // its psend (it takes the psend's token), so a zero here never hides a send it must finish.
  std::atomic<size_t> pending_count_{0};
  mutable std::mutex mu_;
  // A few entries at a time (the sends of a step, a window of a stream): a vector that keeps
  // its capacity, where a map allocated a node per send. In the order they were added.
  std::vector<Entry> pending_;
  uint64_t kept_total_ = 0;
};

}  // namespace jcm
