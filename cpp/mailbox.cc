#include "mailbox.h"

#include <cstring>

namespace jcm {

Mailbox::Channel& Mailbox::GetChannel(ChannelKey key) {
  std::lock_guard<std::mutex> lock(map_mu_);
  auto& slot = channels_[key];
  if (!slot) slot = std::make_unique<Channel>();
  return *slot;
}

void Mailbox::Send(ChannelKey key, const void* data, size_t bytes,
                   const std::string& sender_desc) {
  Channel& ch = GetChannel(key);
  std::unique_lock<std::mutex> lock(ch.mu);
  if (!ch.posted.empty()) {
    // The receiver is already waiting: copy straight into its output buffer.
    PostedRecv* recv = ch.posted.front();
    ch.posted.pop_front();
    recv->state = PostState::kClaimed;
    lock.unlock();
    if (recv->bytes == bytes) {
      if (bytes > 0) std::memcpy(recv->out, data, bytes);
      recv->outcome.status = RecvStatus::kOk;
    } else {
      recv->outcome.status = RecvStatus::kSizeMismatch;
      recv->outcome.sender_bytes = bytes;
      recv->outcome.sender_desc = sender_desc;
    }
    lock.lock();
    recv->state = PostState::kDone;
    ch.cv.notify_all();
    return;
  }
  Message msg;
  msg.bytes = bytes;
  msg.sender_desc = sender_desc;
  if (bytes < kOfferMinBytes) {
    if (bytes > 0) {
      msg.data = GlobalBufferPool().Acquire(bytes);
      std::memcpy(msg.data.data(), data, bytes);
    }
    ch.queued.push_back(std::move(msg));
    ch.cv.notify_all();
    return;
  }
  // Offer the operand itself for about as long as a copy would take.
  Offer offer;
  offer.data = data;
  msg.offer = &offer;
  ch.queued.push_back(std::move(msg));
  ch.cv.notify_all();
  const auto grace = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(static_cast<double>(bytes) / kGraceBytesPerSecond));
  ch.cv.wait_for(lock, grace, [&] { return offer.state != PostState::kPosted; });
  if (offer.state == PostState::kPosted) {
    // Nobody came: copy the bytes into the queue entry (still in its place in the FIFO).
    for (Message& queued : ch.queued) {
      if (queued.offer == &offer) {
        queued.data = GlobalBufferPool().Acquire(bytes);
        std::memcpy(queued.data.data(), data, bytes);
        queued.offer = nullptr;
        break;
      }
    }
    offer.state = PostState::kDone;
    return;
  }
  // A receiver claimed it and may be copying from `data` right now.
  ch.cv.wait(lock, [&] { return offer.state == PostState::kDone; });
}

RecvOutcome Mailbox::Recv(ChannelKey key, void* out, size_t bytes,
                          std::chrono::steady_clock::time_point deadline) {
  Channel& ch = GetChannel(key);
  std::unique_lock<std::mutex> lock(ch.mu);
  if (ch.queued.empty()) {
    PostedRecv recv;
    recv.out = out;
    recv.bytes = bytes;
    ch.posted.push_back(&recv);
    lock.unlock();
    const auto spin_until = std::chrono::steady_clock::now() + kSpinBeforeSleep;
    while (recv.state.load(std::memory_order_acquire) != PostState::kDone &&
           std::chrono::steady_clock::now() < spin_until) {
    }
    lock.lock();
    bool done = ch.cv.wait_until(lock, deadline,
                                 [&] { return recv.state == PostState::kDone; });
    if (!done) {
      if (recv.state == PostState::kPosted) {
        // Withdraw: no sender has seen this receive.
        for (auto it = ch.posted.begin(); it != ch.posted.end(); ++it) {
          if (*it == &recv) {
            ch.posted.erase(it);
            break;
          }
        }
        RecvOutcome timeout;
        timeout.status = RecvStatus::kTimeout;
        return timeout;
      }
      // A sender is copying into `out` right now: wait for it to finish.
      ch.cv.wait(lock, [&] { return recv.state == PostState::kDone; });
    }
    return std::move(recv.outcome);
  }
  Message msg = std::move(ch.queued.front());
  ch.queued.pop_front();
  Offer* offer = msg.offer;
  if (offer) offer->state = PostState::kClaimed;  // the sender keeps its operand for us
  lock.unlock();
  RecvOutcome outcome;
  if (msg.bytes != bytes) {
    outcome.status = RecvStatus::kSizeMismatch;
    outcome.sender_bytes = msg.bytes;
    outcome.sender_desc = std::move(msg.sender_desc);
  } else if (bytes > 0) {
    std::memcpy(out, offer ? offer->data : msg.data.data(), bytes);
  }
  if (offer) {
    lock.lock();
    offer->state = PostState::kDone;
    ch.cv.notify_all();
  }
  return outcome;
}

size_t Mailbox::queued_messages() const {
  std::lock_guard<std::mutex> lock(map_mu_);
  size_t n = 0;
  for (const auto& [key, ch] : channels_) {
    std::lock_guard<std::mutex> ch_lock(ch->mu);
    n += ch->queued.size();
  }
  return n;
}

size_t Mailbox::queued_bytes() const {
  std::lock_guard<std::mutex> lock(map_mu_);
  size_t n = 0;
  for (const auto& [key, ch] : channels_) {
    std::lock_guard<std::mutex> ch_lock(ch->mu);
    for (const auto& m : ch->queued) n += m.bytes;
  }
  return n;
}

}  // namespace jcm
