#include "local/mailbox.h"

#include <sched.h>

#include <algorithm>
#include <cstring>

#include "common/config.h"
#include "common/trace.h"

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
  trace::WaitTimer waited;  // from here on this side waits for the other one
  waited.Waiting();
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
    // In slices, so that a wait also ends once the process closes at exit (Closing()).
    while (!satisfied() && !Expired(deadline)) {
      ch.cv.wait_until(lock, std::min(deadline, Clock::now() + kClosingCheck), satisfied);
    }
  }
  return state.load(std::memory_order_relaxed);
}

std::shared_ptr<Mailbox::Offer> Mailbox::Send(ChannelKey key, const void* data, size_t bytes,
                                              const std::string& sender_desc,
                                              bool may_keep_operand) {
  Channel& ch = GetChannel(key);
  std::unique_lock<std::mutex> lock(ch.mu);
  const bool large = bytes >= kOfferMinBytes;
  auto make_offer = [&] {
    auto offer = std::make_shared<Offer>();
    offer->channel = &ch;
    offer->data = data;
    offer->bytes = bytes;
    offer->sender_desc = sender_desc;
    offer->grace_end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / kGraceBytesPerSecond));
    return offer;
  };
  if (!ch.posted.empty()) {
    PostedRecv* recv = ch.posted.front();
    ch.posted.pop_front();
    if (large && may_keep_operand) {
      // The receiver is waiting and the operand stays alive: it copies, this device goes on.
      std::shared_ptr<Offer> offer = make_offer();
      offer->state.store(PostState::kClaimed, std::memory_order_relaxed);
      recv->handed = offer;
      recv->state.store(PostState::kHanded, std::memory_order_release);
      ch.cv.notify_all();
      return offer;
    }
    // Copy straight into the waiting receiver's output buffer.
    recv->state.store(PostState::kClaimed, std::memory_order_release);
    lock.unlock();
    recv->outcome = Match(bytes, sender_desc, recv->bytes, recv->desc);
    if (recv->outcome.ok() && bytes > 0) std::memcpy(recv->out, data, bytes);
    lock.lock();
    recv->state.store(PostState::kDone, std::memory_order_release);  // `recv` is gone now
    ch.cv.notify_all();
    return nullptr;
  }
  Message msg;
  msg.bytes = bytes;
  msg.sender_desc = sender_desc;
  if (!large) {
    if (bytes > 0) {
      msg.data = GlobalBufferPool().Acquire(bytes);
      std::memcpy(msg.data.data(), data, bytes);
    }
    ch.queued.push_back(std::move(msg));
    ch.cv.notify_all();
    return nullptr;
  }
  // Offer the operand itself, for about as long as a copy would take.
  std::shared_ptr<Offer> offer = make_offer();
  msg.offer = offer;
  ch.queued.push_back(std::move(msg));
  ch.cv.notify_all();
  if (may_keep_operand) return offer;  // the precv that keeps the operand finishes it
  FinishLocked(ch, lock, *offer);
  return nullptr;
}

void Mailbox::Finish(const std::shared_ptr<Offer>& offer) {
  Channel& ch = *offer->channel;
  std::unique_lock<std::mutex> lock(ch.mu);
  FinishLocked(ch, lock, *offer);
}

void Mailbox::FinishLocked(Channel& ch, std::unique_lock<std::mutex>& lock, Offer& offer) {
  if (Await(ch, lock, offer.state, /*until_claimed=*/true, offer.grace_end, offer.grace_end) ==
      PostState::kPosted) {
    // Nobody came: copy the bytes into the queue entry (still in its place in the FIFO).
    for (Message& queued : ch.queued) {
      if (queued.offer.get() == &offer) {
        queued.data = GlobalBufferPool().Acquire(offer.bytes);
        std::memcpy(queued.data.data(), offer.data, offer.bytes);
        queued.offer.reset();
        break;
      }
    }
    offer.state.store(PostState::kDone, std::memory_order_release);
    return;
  }
  // A receiver claimed it and may be copying from the operand right now.
  Await(ch, lock, offer.state, /*until_claimed=*/false, Clock::now() + kYield,
        Clock::time_point::max());
}

Status Mailbox::Match(size_t sender_bytes, const std::string& sender_desc, size_t bytes,
                      std::string_view desc) {
  if (sender_bytes != bytes) return Status::SizeMismatch(sender_bytes, sender_desc);
  // Both descriptions come from the same lowering ("float32[4]"): equal text, same array.
  if (sender_desc != desc) return Status::TypeMismatch(sender_bytes, sender_desc);
  return Status::Ok();
}

Status Mailbox::TakeOffer(Channel& ch, Offer& offer, void* out, size_t bytes,
                          std::string_view desc) {
  Status outcome = Match(offer.bytes, offer.sender_desc, bytes, desc);
  if (outcome.ok() && bytes > 0) std::memcpy(out, offer.data, bytes);
  std::lock_guard<std::mutex> lock(ch.mu);
  offer.state.store(PostState::kDone, std::memory_order_release);  // the sender may go on
  ch.cv.notify_all();
  return outcome;
}

Status Mailbox::Recv(ChannelKey key, void* out, size_t bytes, std::string_view desc,
                     std::chrono::steady_clock::time_point deadline) {
  Channel& ch = GetChannel(key);
  std::unique_lock<std::mutex> lock(ch.mu);
  if (ch.queued.empty()) {
    PostedRecv recv;
    recv.out = out;
    recv.bytes = bytes;
    recv.desc = desc;
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
      return Status::Timeout();
    }
    if (state == PostState::kHanded) {  // the sender handed us its operand: copy it
      std::shared_ptr<Offer> offer = std::move(recv.handed);
      lock.unlock();
      return TakeOffer(ch, *offer, out, bytes, desc);
    }
    // A sender is copying into `out`: it takes about one copy's time.
    Await(ch, lock, recv.state, /*until_claimed=*/false, Clock::now() + kYield,
          Clock::time_point::max());
    return std::move(recv.outcome);
  }
  Message msg = std::move(ch.queued.front());
  ch.queued.pop_front();
  if (msg.offer) {
    // The sender keeps its operand for us.
    msg.offer->state.store(PostState::kClaimed, std::memory_order_release);
    lock.unlock();
    return TakeOffer(ch, *msg.offer, out, bytes, desc);
  }
  lock.unlock();
  Status outcome = Match(msg.bytes, msg.sender_desc, bytes, desc);
  if (outcome.ok() && bytes > 0) std::memcpy(out, msg.data.data(), bytes);
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
