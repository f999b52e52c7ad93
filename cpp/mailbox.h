// In-process transport: messages between devices of one process (device threads of the
// XLA CPU client). A psend never waits for its receiver: if the receiver is already
// waiting, the sender copies straight into the receiver's output buffer (one copy);
// otherwise the bytes are queued (copied) and the receiver copies them out later.
#pragma once

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
  // Delivers `bytes` bytes to the channel; never blocks on the receiver.
  void Send(ChannelKey key, const void* data, size_t bytes, const std::string& sender_desc);

  // Waits until a message arrives on the channel or `deadline` passes.
  RecvOutcome Recv(ChannelKey key, void* out, size_t bytes,
                   std::chrono::steady_clock::time_point deadline);

  // Number of messages sent and not yet received (all channels).
  size_t queued_messages() const;
  size_t queued_bytes() const;

 private:
  struct Message {
    PooledBuffer data;
    size_t bytes = 0;
    std::string sender_desc;
  };
  enum class PostState { kPosted, kClaimed, kDone };
  struct PostedRecv {
    void* out = nullptr;
    size_t bytes = 0;
    PostState state = PostState::kPosted;
    RecvOutcome outcome;
  };
  struct Channel {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Message> queued;
    std::deque<PostedRecv*> posted;
  };

  Channel& GetChannel(ChannelKey key);

  mutable std::mutex map_mu_;
  std::map<ChannelKey, std::unique_ptr<Channel>> channels_;
};

}  // namespace jcm
