// In-process transport: messages between devices of one process (device threads of the
// XLA CPU client). Every message is copied once when its receiver is in time: whichever
// side arrives second copies straight from the sender's operand into the receiver's output.
//   - receiver already waiting: the sender copies straight into the receiver's output, or,
//     when the sender's operand stays alive after the psend (see kept_sends.h), hands the
//     operand to the receiver, which copies it while the sender goes on with its own work;
//   - otherwise a message of kOfferMinBytes or more is first *offered*: the receiver may
//     copy it straight out of the sender's operand during a short grace period (about the
//     time one copy of the message takes), while the sender waits (or, with its operand
//     kept alive, works on until the precv that finishes the send);
//   - after that (or for tiny messages at once) the bytes are queued in a pooled buffer
//     and the receiver copies them out later (two copies, but the sender never waits on its
//     receiver for longer than one copy would take).
// The side that waits for the other one's copy spins, then yields its core, and only then
// sleeps on the channel's condition variable: a wake-up from sleep costs tens of
// microseconds on a busy machine, more than a whole hop of a mid-sized message.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/buffer_pool.h"
#include "common/status.h"

namespace jcm {

// A channel is identified by (source device, destination device), as dense global device
// indices. Messages on a channel are delivered in the order they were sent (like NCCL).
using ChannelKey = std::pair<int64_t, int64_t>;

// Locking:
//   map_mu_       channels_ (the map only: a Channel is never erased, so a reference to one
//                 stays valid without the lock).
//   Channel::mu   that channel's queued and posted lists, every change of an Offer's or a
//                 PostedRecv's state, and PostedRecv::handed; Channel::cv is notified under
//                 it. A side that spins reads `state` without the lock (it is atomic).
//   Ownership instead of a lock: the side that moved a state to kClaimed/kHanded copies the
//   bytes (and writes PostedRecv::outcome) without any lock; the other side touches neither
//   until it sees kDone.
//   Order: map_mu_ before a Channel::mu (queued_messages/queued_bytes), never the reverse.
class Mailbox {
 public:
  struct Offer;

  // Delivers `bytes` bytes to the channel; waits for the receiver at most about as long as
  // one copy of the message takes. With `may_keep_operand` (the operand stays alive and
  // unchanged until the caller calls Finish), it may return before the receiver has copied
  // the bytes: it then returns the send, which Finish completes; otherwise nullptr.
  std::shared_ptr<Offer> Send(ChannelKey key, const void* data, size_t bytes,
                              const std::string& sender_desc, bool may_keep_operand = false);

  // Completes a send that Send returned: waits while its receiver copies, or, if no
  // receiver has started by the end of the grace period, copies the bytes into the queue.
  // Afterwards the operand is no longer read.
  void Finish(const std::shared_ptr<Offer>& offer);

  // Waits until a message arrives on the channel or `deadline` passes: kOk, kTimeout,
  // kSizeMismatch or kTypeMismatch (the same byte count, but a sender's description other
  // than `desc`; both with the sender's byte count and description). A mismatched message
  // is consumed all the same: the next one on the channel is the next message.
  Status Recv(ChannelKey key, void* out, size_t bytes, std::string_view desc,
              std::chrono::steady_clock::time_point deadline);

  // Number of messages sent and not yet received (all channels).
  size_t queued_messages() const;
  size_t queued_bytes() const;

 private:
  struct Channel;
  // kPosted: waiting for the other side; kClaimed: the other side is copying; kHanded (a
  // posted receive only): the sender handed its operand over, the receiver copies it;
  // kDone: finished.
  enum class PostState { kPosted, kClaimed, kHanded, kDone };

 public:
  // A large message offered from the sender's own buffer (during its grace period, or
  // until the precv that keeps the operand alive finishes it).
  struct Offer {
    Channel* channel = nullptr;
    const void* data = nullptr;
    size_t bytes = 0;
    std::string sender_desc;
    std::chrono::steady_clock::time_point grace_end;
    // Written under the channel lock; read without it while a side spins.
    std::atomic<PostState> state{PostState::kPosted};
  };

 private:
  struct Message {
    PooledBuffer data;             // the copied bytes, unless `offer` is set
    std::shared_ptr<Offer> offer;  // bytes still in the sender's operand
    size_t bytes = 0;
    std::string sender_desc;
  };
  // Smallest message worth offering before queueing (below it a second copy costs less than
  // waiting), and the copy rate that sets the grace period (bytes / rate).
  static constexpr size_t kOfferMinBytes = size_t{16} << 10;
  static constexpr double kGraceBytesPerSecond = 4e9;
  // How a side waits for the other: it spins kSpin, then yields its core until the wait
  // has lasted kYield, then sleeps on the condition variable (a wake-up then costs little
  // next to the wait). Spinning longer than a quick handoff costs dearly on a loaded
  // machine: the other device thread may be waiting for this very core, so a longer spin
  // only delays the copy it waits for (benchmarks/README.md has the measurements).
  static constexpr std::chrono::microseconds kSpin{5};
  static constexpr std::chrono::microseconds kYield{200};
  // How often a sleeping receiver looks whether the process closed at exit.
  static constexpr std::chrono::milliseconds kClosingCheck{50};
  struct PostedRecv {
    void* out = nullptr;
    size_t bytes = 0;
    std::string_view desc;  // the receiver's description of its output ("int32[4]")
    // Written under the channel lock; read without it while the receiver spins.
    std::atomic<PostState> state{PostState::kPosted};
    Status outcome;
    std::shared_ptr<Offer> handed;  // set with kHanded: the operand to copy from
  };
  struct Channel {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Message> queued;
    std::deque<PostedRecv*> posted;
  };

  Channel& GetChannel(ChannelKey key);
  // Ok when the sender's message fits the receiver's output, else why not.
  static Status Match(size_t sender_bytes, const std::string& sender_desc, size_t bytes,
                      std::string_view desc);
  // Copies an offer's bytes into `out` (or reports a mismatch); marks it done.
  static Status TakeOffer(Channel& ch, Offer& offer, void* out, size_t bytes,
                          std::string_view desc);
  // Finish() with the channel lock held.
  static void FinishLocked(Channel& ch, std::unique_lock<std::mutex>& lock, Offer& offer);

  // Waits (see kSpin) until `state` is kDone, or until it leaves kPosted when
  // `until_claimed`; `lock` holds ch.mu on entry and on return. Spins and yields with the
  // lock released, up to `yield_until`; then sleeps until `deadline`. Returns the state.
  static PostState Await(Channel& ch, std::unique_lock<std::mutex>& lock,
                         const std::atomic<PostState>& state, bool until_claimed,
                         std::chrono::steady_clock::time_point yield_until,
                         std::chrono::steady_clock::time_point deadline);

  mutable std::mutex map_mu_;
  std::map<ChannelKey, std::unique_ptr<Channel>> channels_;
};

}  // namespace jcm
