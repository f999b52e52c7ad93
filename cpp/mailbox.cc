#include "mailbox.h"

#include <sched.h>

#include <algorithm>
#include <cstring>

namespace jcm {

Mailbox::Channel& Mailbox::GetChannel(ChannelKey key) {
  std::lock_guard<std::mutex> lock(map_mu_);
  auto& slot = channels_[key];
  if (!slot) slot = std::make_unique<Channel>();
  return *slot;
}

namespace {

using Clock = std::chrono::steady_clock;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

Mailbox::PostState Mailbox::Await(Channel& ch, std::unique_lock<std::mutex>& lock,
                                  const std::atomic<PostState>& state, bool until_claimed,
                                  Clock::time_point yield_until, Clock::time_point deadline) {
  auto satisfied = [&] {
    const PostState s = state.load(std::memory_order_acquire);
    return until_claimed ? s != PostState::kPosted : s == PostState::kDone;
  };
  if (satisfied()) return state.load(std::memory_order_relaxed);
  lock.unlock();
  const auto spin_until = std::min(Clock::now() + kSpin, yield_until);
  for (uint32_t polls = 1; !satisfied(); ++polls) {
    if ((polls & 63) != 0) {
      CpuRelax();
      continue;
    }
    const auto now = Clock::now();
    if (now >= yield_until || now >= deadline) break;
    if (now >= spin_until) sched_yield();  // let a device thread that shares this core run
  }
  lock.lock();
  if (deadline == Clock::time_point::max()) {
    ch.cv.wait(lock, satisfied);
  } else {
    ch.cv.wait_until(lock, deadline, satisfied);
  }
  return state.load(std::memory_order_relaxed);
}

void Mailbox::Send(ChannelKey key, const void* data, size_t bytes,
                   const std::string& sender_desc) {
  Channel& ch = GetChannel(key);
  std::unique_lock<std::mutex> lock(ch.mu);
  if (!ch.posted.empty()) {
    // The receiver is already waiting: copy straight into its output buffer.
    PostedRecv* recv = ch.posted.front();
    ch.posted.pop_front();
    recv->state.store(PostState::kClaimed, std::memory_order_release);
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
    recv->state.store(PostState::kDone, std::memory_order_release);  // `recv` is gone now
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
  const auto grace_end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(static_cast<double>(bytes) / kGraceBytesPerSecond));
  if (Await(ch, lock, offer.state, /*until_claimed=*/true, grace_end, grace_end) ==
      PostState::kPosted) {
    // Nobody came: copy the bytes into the queue entry (still in its place in the FIFO).
    for (Message& queued : ch.queued) {
      if (queued.offer == &offer) {
        queued.data = GlobalBufferPool().Acquire(bytes);
        std::memcpy(queued.data.data(), data, bytes);
        queued.offer = nullptr;
        break;
      }
    }
    offer.state.store(PostState::kDone, std::memory_order_relaxed);
    return;
  }
  // A receiver claimed it and may be copying from `data` right now.
  Await(ch, lock, offer.state, /*until_claimed=*/false, Clock::now() + kYield,
        Clock::time_point::max());
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
    const PostState state = Await(ch, lock, recv.state, /*until_claimed=*/true,
                                  Clock::now() + kYield, deadline);
    if (state == PostState::kPosted) {
      // Deadline passed. Withdraw: no sender has seen this receive.
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
    // A sender is copying into `out`: it takes about one copy's time.
    Await(ch, lock, recv.state, /*until_claimed=*/false, Clock::now() + kYield,
          Clock::time_point::max());
    return std::move(recv.outcome);
  }
  Message msg = std::move(ch.queued.front());
  ch.queued.pop_front();
  Offer* offer = msg.offer;
  // The sender keeps its operand for us.
  if (offer) offer->state.store(PostState::kClaimed, std::memory_order_release);
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
    offer->state.store(PostState::kDone, std::memory_order_release);  // `offer` is gone now
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
