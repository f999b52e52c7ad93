// In-process transport: messages between devices of one process (device threads of the
// XLA CPU client). Every message is copied once when its receiver is in time: whichever
// side arrives second copies straight from the sender's operand into the receiver's output.
//   - receiver already waiting: the sender copies straight into the receiver's output;
//   - otherwise a message of kOfferMinBytes or more is first *offered*: the sender waits a
//     short grace period (about the time one copy of the message takes) for the receiver
//     to copy it straight out of the sender's operand;
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
#include <utility>
#include <vector>

#include "buffer_pool.h"

namespace jcm {

// A channel is identified by (source device, destination device), as dense global device
// indices. Messages on a channel are delivered in the order they were sent (like NCCL).
using ChannelKey = std::pair<int64_t, int64_t>;

enum class RecvStatus { kOk, kTimeout, kSizeMismatch };

struct RecvOutcome {
  RecvStatus status = RecvStatus::kOk;
  size_t sender_bytes = 0;   // what the sender sent (for kSizeMismatch)
  std::string sender_desc;   // the sender's description of its operand
};

class Mailbox {
 public:
  // Delivers `bytes` bytes to the channel; waits for the receiver at most about as long as
  // one copy of the message takes.
  void Send(ChannelKey key, const void* data, size_t bytes, const std::string& sender_desc);

  // Waits until a message arrives on the channel or `deadline` passes.
  RecvOutcome Recv(ChannelKey key, void* out, size_t bytes,
                   std::chrono::steady_clock::time_point deadline);

  // Number of messages sent and not yet received (all channels).
  size_t queued_messages() const;
  size_t queued_bytes() const;

 private:
  enum class PostState { kPosted, kClaimed, kDone };
  // A large message offered from the sender's own buffer during its grace period.
  struct Offer {
    const void* data = nullptr;
    // Written under the channel lock; read without it while the sender spins.
    std::atomic<PostState> state{PostState::kPosted};
  };
  struct Message {
    PooledBuffer data;       // the copied bytes, unless `offer` is set
    Offer* offer = nullptr;  // bytes still in the (waiting) sender's operand
    size_t bytes = 0;
    std::string sender_desc;
  };
  // Smallest message worth offering before queueing (below it a second copy costs less than
  // waiting), and the copy rate that sets the grace period (bytes / rate).
  static constexpr size_t kOfferMinBytes = size_t{16} << 10;
  static constexpr double kGraceBytesPerSecond = 4e9;
  // How a side waits for the other: it spins kSpin, then yields its core until the wait
  // has lasted kYield, then sleeps on the condition variable (a wake-up then costs little
  // next to the wait). Spinning longer than a quick
  // handoff costs dearly on a loaded machine: the other device thread may be waiting for
  // this very core (measured on 2 shared cores: an 8 B hop cost the whole spin budget,
  // 57 us with 50 us of spinning, 13 us with 5 us and yielding).
  static constexpr std::chrono::microseconds kSpin{5};
  static constexpr std::chrono::microseconds kYield{200};
  struct PostedRecv {
    void* out = nullptr;
    size_t bytes = 0;
    // Written under the channel lock; read without it while the receiver spins.
    std::atomic<PostState> state{PostState::kPosted};
    RecvOutcome outcome;
  };
  struct Channel {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Message> queued;
    std::deque<PostedRecv*> posted;
  };

  Channel& GetChannel(ChannelKey key);

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
