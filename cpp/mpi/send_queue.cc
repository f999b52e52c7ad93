// Staged sends of the MPI transport: the copy-and-Isend path, the bound on the bytes of
// undelivered sends, and the progress that frees completed sends.
#include <algorithm>
#include <array>
#include <cstring>
#include <span>

#include "mpi/internal.h"
#include "mpi/stop_for_test.h"
#include "mpi/transport.h"

namespace jcm {

Status MpiTransport::Send(int dest_rank, int tag, const void* data, size_t bytes,
                          std::string_view desc_text, uint64_t max_inflight_bytes,
                          std::chrono::steady_clock::time_point deadline,
                          std::shared_ptr<DirectSend>* kept, bool may_defer) {
  ChannelState& ch = Channel(dest_rank, tag);
  std::lock_guard<std::mutex> channel_lock(ch.send_mu);
  SendLockHeld held;
  if (ch.deferred) {
    // The channel's previous message is still deferred: it goes first (the receiver takes
    // the channel's messages in order).
    const std::shared_ptr<DirectSend> previous = ch.deferred;
    bool posted = false;
    if (Status s = PostDeferredLocked(ch, /*complete=*/true, deadline, &posted); !s.ok()) {
      FailDeferred(previous, s);
      return s;
    }
  }
  const uint64_t seq = ch.next_send_seq++;  // every message counts, whatever its size
  trace::NoteSeq(seq);
  const Desc desc{desc_text, DescriptionHash(desc_text)};
  if (SentFramed(kept != nullptr, /*one_way=*/!may_defer, bytes)) {
    return SendFramed(ch, dest_rank, tag, data, bytes, desc, deadline, kept);
  }
  if (bytes >= kRendezvousMinBytes) {
    return SendLarge(ch, seq, dest_rank, tag, data, bytes, desc, max_inflight_bytes, deadline,
                     kept, may_defer);
  }
  trace::NotePath(trace::Path::kStaged);
  return SendStaged(ch, dest_rank, tag, data, bytes, desc, max_inflight_bytes, deadline,
                    &ch.spare_staged);
}

Status MpiTransport::ProgressLocked() {
  while (!control_sends_.empty()) {  // ready signals: tiny, complete in order
    int done = 0;
    int rc = MPI_Test(&control_sends_.front().request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Test", rc);
    if (!done) break;
    control_sends_.pop_front();
  }
  // Direct sends left in flight for the precv that keeps their operand (testing them here
  // also moves them along whenever anything else polls: a precv, the progress thread).
  for (auto it = direct_in_flight_.begin(); it != direct_in_flight_.end();) {
    DirectSend& send = **it;
    // Before the test, not after: one test's progress can move the rest of the message
    // (UCX over TCP pushes all the socket takes), so a send first tested late could
    // complete without ever being seen incomplete, and the stop would never land.
    StopMidSendForTest::Check(send.posted_for_test);
    int done = 0;
    int rc = MPI_Testall(static_cast<int>(send.requests.size()), send.requests.data(), &done,
                         MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Testall", rc);
    if (done) {
      CompleteDirectLocked(send);
      it = direct_in_flight_.erase(it);
    } else {
      ++it;
    }
  }
  // Sends to different peers complete in any order: test them all.
  for (auto it = pending_.begin(); it != pending_.end();) {
    StopMidSendForTest::Check(it->posted_for_test);  // before the test: as above
    int done = 0;
    int rc = MPI_Testall(static_cast<int>(it->requests.size()), it->requests.data(), &done,
                         MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Testall", rc);
    if (done) {
      CompleteStagedLocked(it->bytes);
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  has_pending_.store(!pending_.empty(), std::memory_order_release);
  return Status::Ok();
}

Status MpiTransport::ReserveInflight(size_t bytes, uint64_t max_inflight_bytes,
                                     std::chrono::steady_clock::time_point deadline,
                                     const StopWaiting& stop, bool* stopped) {
  *stopped = false;
  std::unique_lock<std::mutex> lock(mu_);
  if (Status s = Usable(); !s.ok()) return s;
  if (Status s = ProgressLocked(); !s.ok()) return s;
  // Bound the memory of undelivered sends: wait for older ones to complete first.
  Backoff backoff;
  while (!pending_.empty() && inflight_bytes_ + bytes > max_inflight_bytes) {
    if (Expired(deadline)) {
      return Status::SendTimeout(
          "gave up waiting for earlier sends to be received: " +
          std::to_string(inflight_bytes_) + " bytes in " + std::to_string(pending_.size()) +
          " sends are undelivered and the limit is " + std::to_string(max_inflight_bytes) +
          " bytes (JAX_CPU_MPI_MAX_INFLIGHT_BYTES); the receivers never posted their precv");
    }
    lock.unlock();
    bool stop_now = false;
    if (Status s = stop(&stop_now); !s.ok()) return s;
    if (stop_now) {
      *stopped = true;
      return Status::Ok();
    }
    backoff.Pause();
    lock.lock();
    if (Status s = ProgressLocked(); !s.ok()) return s;
  }
  inflight_bytes_ += bytes;  // reserved now, released when the send completes
  peak_inflight_bytes_ = std::max(peak_inflight_bytes_, inflight_bytes_);
  return Status::Ok();
}

Status MpiTransport::SendStaged(ChannelState& ch, int dest_rank, int tag, const void* data,
                                size_t bytes, const Desc& desc, uint64_t max_inflight_bytes,
                                std::chrono::steady_clock::time_point deadline,
                                PooledBuffer* spare) {
  bool stopped = false;
  static const StopWaiting never = [](bool* stop) {
    *stop = false;
    return Status::Ok();
  };
  if (Status s = ReserveInflight(bytes, max_inflight_bytes, deadline, never, &stopped);
      !s.ok()) {
    return s;
  }
  PendingSend send;
  send.bytes = bytes;
  const size_t staged_bytes = StagedBufferBytes(bytes);
  send.buffer = spare && spare->size() == staged_bytes
                    ? std::move(*spare)
                    : GlobalBufferPool().Acquire(staged_bytes);
  if (bytes > 0) std::memcpy(send.buffer.data(), data, bytes);
  return IsendStaged(ch, std::move(send), dest_rank, tag, desc, spare);
}

Status MpiTransport::IsendStaged(ChannelState& ch, PendingSend send, int dest_rank, int tag,
                                 const Desc& desc, PooledBuffer* spare) {
  const size_t bytes = send.bytes;
  send.dest_rank = dest_rank;
  send.tag = tag;
  int rc = MPI_SUCCESS;
  // What the tail below takes from either framing: the requests posted (on the stack for a
  // message of one chunk, no allocation if it has left at once), and whether to test them
  // at once (a larger message is rarely gone at once; a failed post is not tested).
  std::array<MPI_Request, 2> inline_requests{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  std::span<MPI_Request> posted;
  bool test_now = false;
  // Where the channel's last header lets framed payloads go bare, the receiver may have
  // posted its receive for one (mpi/framing.h): a staged message then goes as a chunk header
  // and its chunks, however small (its header becomes the last one).
  if (bytes < kChunkedThreshold && !AllowsBare(ch.last_header_sent)) {
    const Envelope trailer = MakeEnvelope(kPayloadMagic, bytes, desc.hash, desc.text);
    std::memcpy(send.buffer.data() + bytes, &trailer, sizeof(trailer));
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      rc = MPI_Isend(send.buffer.data(), static_cast<int>(bytes + sizeof(trailer)), MPI_BYTE,
                     dest_rank, tag, comm_, &inline_requests[0]);
    }
    posted = std::span<MPI_Request>(inline_requests).first(rc == MPI_SUCCESS ? 1 : 0);
    test_now = rc == MPI_SUCCESS;
  } else {
    // A chunk header and its chunks. The header is the channel's envelope, reused once no
    // earlier send still holds it (ReusableOrNew).
    send.header = ReusableOrNew(ch.send_envelope);
    *send.header = MakeEnvelope(kChunkMagic, bytes, desc.hash, desc.text);
    const size_t chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
    if (chunks > 1) send.requests.resize(1 + chunks);
    std::span<MPI_Request> all = chunks > 1 ? std::span<MPI_Request>(send.requests)
                                            : std::span<MPI_Request>(inline_requests).first(
                                                  1 + chunks);
    size_t count = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      rc = MPI_Isend(send.header.get(), sizeof(Envelope), MPI_BYTE, dest_rank, tag, comm_,
                     &all[0]);
      if (rc == MPI_SUCCESS) ++count;
      for (size_t offset = 0; offset < bytes && rc == MPI_SUCCESS; offset += kChunkBytes) {
        rc = MPI_Isend(send.buffer.data() + offset,
                       static_cast<int>(std::min(kChunkBytes, bytes - offset)), MPI_BYTE,
                       dest_rank, tag, comm_, &all[count]);
        if (rc == MPI_SUCCESS) ++count;
      }
    }
    if (count > 0) ch.last_header_sent = *send.header;  // the receiver's last one too
    posted = all.first(count);
    test_now = rc == MPI_SUCCESS && chunks <= 1;
  }
  // The test hook is consulted once per send, before its first test (a send it watches is
  // left to the pending list untested, so that its check there comes first).
  send.posted_for_test = StopMidSendForTest::Posted(bytes);
  if (test_now && send.posted_for_test == StopMidSendForTest::Clock::time_point{}) {
    // A send that has left at once (eager protocol) needs no entry in the pending list, and
    // its buffer goes back when this function returns, or becomes the channel's spare copy
    // for its next send. A failed test leaves the send to the pending list, whose test
    // reports the error.
    int done = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      if (MPI_Testall(static_cast<int>(posted.size()), posted.data(), &done,
                      MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
        done = 0;
      }
    }
    if (done) {
      if (spare && bytes < kChunkedThreshold) *spare = std::move(send.buffer);
      std::lock_guard<std::mutex> lock(mu_);
      CompleteStagedLocked(bytes);
      return ProgressLocked();  // the other sends, as after every send
    }
  }
  // Requests already started keep referring to the buffer and the header: the pending list
  // keeps both until they complete.
  if (posted.data() == send.requests.data()) {
    send.requests.resize(posted.size());
  } else {
    send.requests.assign(posted.begin(), posted.end());
  }
  std::lock_guard<std::mutex> lock(mu_);
  // A send whose first post failed goes in too (no requests): its test there completes it,
  // which releases its reservation.
  pending_.push_back(std::move(send));
  has_pending_.store(true, std::memory_order_release);
  if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Isend", rc);
  // Small messages often complete at once (eager protocol): free them now.
  return ProgressLocked();
}

size_t MpiTransport::SendsInFlightLocked() const {
  return pending_.size() + direct_in_flight_.size();
}

bool MpiTransport::has_staged_sends() const {
  return has_pending_.load(std::memory_order_acquire);
}

bool MpiTransport::has_deferred_sends() const {
  return deferred_count_.load(std::memory_order_acquire) > 0;
}

// The statistics below test the sends first so that they count only what is really still
// in flight. An MPI error there is not theirs to report: the next psend, precv or the exit
// drain meets it again and reports it.
size_t MpiTransport::inflight_sends() {
  // Deferred sends count too: the progress thread then posts them for a sender that
  // computes, or waits elsewhere, between its psend and its precv.
  if (MpiIsUsable()) (void)ProgressDeferred(std::chrono::steady_clock::now() + kCancelGrace);
  std::lock_guard<std::mutex> lock(mu_);
  if (MpiIsUsable()) (void)ProgressLocked();
  return SendsInFlightLocked() + deferred_count_.load(std::memory_order_acquire);
}

uint64_t MpiTransport::inflight_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  if (MpiIsUsable()) (void)ProgressLocked();
  return inflight_bytes_;
}

uint64_t MpiTransport::peak_inflight_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_inflight_bytes_;
}

uint64_t MpiTransport::direct_sends() const {
  std::lock_guard<std::mutex> lock(mu_);
  return direct_sends_;
}

uint64_t MpiTransport::staged_large_sends() const {
  std::lock_guard<std::mutex> lock(mu_);
  return staged_large_sends_;
}

uint64_t MpiTransport::sends_completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sends_completed_;
}

}  // namespace jcm
