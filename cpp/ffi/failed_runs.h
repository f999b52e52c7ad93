// Channels that may still hold a message of a call whose program failed on the receiving
// device, and channels whose receiver may still wait for a message of a call whose program
// failed on the sending device.
//
// XLA's thunk executor runs no further thunk of a program on a device once one fails, so a
// precv of that call which had not run yet never runs, while its peer's psend (on another
// device, which did not fail) may have run: its message stays in the channel (peer ->
// failing device). The next precv on that channel, in a later call, would take it as its
// own: at another shape a mismatch error, at the same shape the earlier call's bytes,
// returned as this call's without a word. Neither end can tell the two messages apart:
// nothing on the wire says which call sent them, and the receiver cannot know whether, or
// how often, the peer's psend ran. So an op of ours that fails marks the channels into its
// device on which its program receives (the lowering lists them: PROGRAM_RECEIVES in
// python/jax_cpu_mpi/_src/ffi/custom_calls.py) where the call's precvs did not all take
// their messages: a channel is left alone if as many precvs ran their receive on it in the
// failed run (NoteTaken) as run at most in a call of the program (a branch counts its
// largest branch); one with a precv in a loop is always marked. Every later precv on a
// marked channel fails, naming the failure, instead of returning what may be the old message.
// A precv that timed out marks its own channel too (MarkTimedOut): its message may come
// later than it waited (a late sender), and the channel's next precv would take it as its
// own just the same.
// The same holds the other way round: a psend of the failed call that had not run yet never
// runs, while its peer's precv (in another process, whose call goes on) still waits for it;
// the next call's psend on that channel would meet that precv, which would return the later
// call's bytes as the failed call's (and the later call's precv would wait in vain). So the
// failed op also marks the channels out of its device on which its program sends
// (PROGRAM_SENDS) where the call's psends did not all run (NoteSent, counted as NoteTaken),
// and every later psend on such a channel fails (MarkSend, FindSend): the waiting precv
// times out instead, with its own error, and marks its channel in turn.
// As with NCCL after a failed op, the job is to be restarted: the channels are not usable
// again in this process.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace jcm {

// Per channel (hashed into kSlots), how many messages of one program run went through it:
// one word written only by one device (the channel's receiver for the messages taken, its
// sender for the messages sent), a tag of (channel, run) in the high bits, the count in
// the low 16. A slot shared by two channels loses counts, which only marks more channels.
class RunCounts {
 public:
  // One more message of the run `run_id` on the channel. A few relaxed atomic operations.
  void Note(int64_t src_dev, int64_t dst_dev, int64_t run_id) {
    std::atomic<uint64_t>& slot = counts_[SlotOf(src_dev, dst_dev)];
    const uint64_t tag = TagOf(src_dev, dst_dev, run_id);
    const uint64_t now = slot.load(std::memory_order_relaxed);
    slot.store((now & ~kCountMask) == tag && (now & kCountMask) != kCountMask ? now + 1 : tag | 1,
               std::memory_order_relaxed);
  }
  // The messages of the run `run_id` on the channel: at most the true count (another
  // channel sharing the slot only makes it smaller, never larger).
  int64_t Count(int64_t src_dev, int64_t dst_dev, int64_t run_id) const {
    const uint64_t now = counts_[SlotOf(src_dev, dst_dev)].load(std::memory_order_relaxed);
    return (now & ~kCountMask) == TagOf(src_dev, dst_dev, run_id)
               ? static_cast<int64_t>(now & kCountMask) : 0;
  }

 private:
  static constexpr size_t kSlots = 4096;
  static constexpr uint64_t kCountMask = 0xffff;
  static size_t SlotOf(int64_t src_dev, int64_t dst_dev) {
    return static_cast<size_t>(src_dev * 131 + dst_dev) % kSlots;
  }
  static uint64_t TagOf(int64_t src_dev, int64_t dst_dev, int64_t run_id) {
    uint64_t h = static_cast<uint64_t>(run_id) * 0x9e3779b97f4a7c15ULL;
    h ^= (static_cast<uint64_t>(src_dev) << 32 | static_cast<uint64_t>(dst_dev)) *
         0xc2b2ae3d27d4eb4fULL;
    h ^= h >> 29;
    return h & ~kCountMask;
  }
  std::atomic<uint64_t> counts_[kSlots] = {};
};

// Locking: mu_ guards why_, send_why_ and collectives_why_; any_ and any_sends_ are set
// under it and read without it.
class SuspectChannels {
 public:
  // Whether any channel is marked for its precvs, or collectives: the one load on a precv's
  // path while none is.
  bool any() const { return any_.load(std::memory_order_acquire); }
  // Whether any channel is marked for its psends: the one load on a psend's path while none
  // is (a psend does not pay for the precvs' marks).
  bool any_sends() const { return any_sends_.load(std::memory_order_acquire); }
  // What marked a channel: the first failure's error, and whether it was a precv of the
  // channel that timed out (else a failed call whose precv on it may have been skipped).
  struct Suspect {
    std::string why;
    bool timed_out = false;
  };
  // Marks the channel from global device `src_dev` to `dst_dev`; `why` says what failed
  // (the first failure's is kept).
  void Mark(int64_t src_dev, int64_t dst_dev, const std::string& why, bool timed_out = false);
  // What marked the channel; `why` is "" where it is not marked.
  Suspect Find(int64_t src_dev, int64_t dst_dev) const;
  // Channels marked so far for their precvs (stats()' refused_channels).
  size_t count() const;
  // Marks the channel from global device `src_dev` (this process's, where a failed call's
  // psend on it was skipped or did not complete) to `dst_dev` for its psends; `why` says
  // what failed (the first failure's is kept).
  void MarkSend(int64_t src_dev, int64_t dst_dev, const std::string& why);
  // What marked the channel for its psends, or "".
  std::string FindSend(int64_t src_dev, int64_t dst_dev) const;
  // Channels marked so far for their psends (stats()' refused_send_channels).
  size_t send_count() const;
  // Marks every later collective of ours in this process (collective_handlers.h) as
  // refused: `why` says what failed in a program that runs collectives over MPI (the first
  // failure's is kept). XLA skips that program's collectives that had not run yet on the
  // failing device, while its peers' may have run: their part waits in MPI, and this
  // process's next collective of the group would meet it (each side returning the other
  // call's data without a word).
  void MarkCollectives(const std::string& why);
  // The failure that marked the collectives, or "".
  std::string CollectivesWhy() const;

  // Forgets every mark. For tests only, after failures that left no message in a channel
  // (a precv that no psend matches, which times out): the channels are usable again.
  void Clear();

  // A precv of the program run `run_id` ran its receive on the channel `src_dev` ->
  // `dst_dev` (took its message, refused it for a mismatch, or timed out).
  void NoteTaken(int64_t src_dev, int64_t dst_dev, int64_t run_id) {
    taken_.Note(src_dev, dst_dev, run_id);
  }
  // How many messages precvs of the run `run_id` took on the channel (at most the truth).
  int64_t Taken(int64_t src_dev, int64_t dst_dev, int64_t run_id) const {
    return taken_.Count(src_dev, dst_dev, run_id);
  }
  // A psend of the program run `run_id` sent its message on the channel (or left it to a
  // kept send that marks the channel itself if it fails: MarkSend).
  void NoteSent(int64_t src_dev, int64_t dst_dev, int64_t run_id) {
    sent_.Note(src_dev, dst_dev, run_id);
  }
  // How many messages psends of the run `run_id` sent on the channel (at most the truth).
  int64_t Sent(int64_t src_dev, int64_t dst_dev, int64_t run_id) const {
    return sent_.Count(src_dev, dst_dev, run_id);
  }

 private:
  RunCounts taken_;  // written by each channel's receiving device
  RunCounts sent_;   // written by each channel's sending device

  std::atomic<bool> any_{false};
  std::atomic<bool> any_sends_{false};
  mutable std::mutex mu_;
  std::map<std::pair<int64_t, int64_t>, Suspect> why_;
  std::map<std::pair<int64_t, int64_t>, std::string> send_why_;
  std::string collectives_why_;
};

}  // namespace jcm
