#include "mpi_transport.h"

#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstring>
#include <thread>

namespace jcm {
namespace {

bool MpiIsUsable() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

// Adaptive wait used by every polling loop: spin first (lowest latency), then yield the core
// (ranks may share cores), then sleep a little (long waits must not burn a core).
class Backoff {
 public:
  void Pause() {
    ++iterations_;
    if (iterations_ < 2000) return;
    if (iterations_ < 200000) {
      sched_yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

 private:
  uint64_t iterations_ = 0;
};

}  // namespace

std::unique_ptr<MpiTransport> MpiTransport::Create(MPI_Comm comm,
                                                   std::vector<int> rank_of_process,
                                                   std::string* error) {
  if (!MpiIsUsable()) {
    *error = "MPI is not initialized (or already finalized)";
    return nullptr;
  }
  auto t = std::make_unique<MpiTransport>(PrivateTag{});
  static std::atomic<uint64_t> last_id{0};
  t->id_ = ++last_id;
  int rc = MPI_Comm_dup(comm, &t->comm_);
  if (rc != MPI_SUCCESS) {
    *error = "MPI_Comm_dup failed: " + t->ErrorString(rc);
    return nullptr;
  }
  // Errors on our communicator come back as codes, never abort the job behind our back.
  MPI_Comm_set_errhandler(t->comm_, MPI_ERRORS_RETURN);
  for (MPI_Comm* extra : {&t->ctrl_comm_, &t->direct_comm_}) {
    rc = MPI_Comm_dup(t->comm_, extra);  // inherits the error handler
    if (rc != MPI_SUCCESS) {
      *error = "MPI_Comm_dup failed: " + t->ErrorString(rc);
      return nullptr;
    }
  }
  MPI_Comm_rank(t->comm_, &t->rank_);
  MPI_Comm_size(t->comm_, &t->size_);
  void* attr = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(t->comm_, MPI_TAG_UB, &attr, &flag);
  if (flag && attr) t->tag_ub_ = *static_cast<int*>(attr);
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  t->thread_multiple_ = provided >= MPI_THREAD_MULTIPLE;
  t->rank_of_process_ = std::move(rank_of_process);
  return t;
}

MpiTransport::~MpiTransport() {
  if (!MpiIsUsable()) return;
  for (MPI_Comm* comm : {&ctrl_comm_, &direct_comm_, &comm_}) {
    if (*comm != MPI_COMM_NULL) MPI_Comm_free(comm);
  }
}

int MpiTransport::RankOfProcess(int64_t process_index) const {
  if (process_index < 0 || process_index >= static_cast<int64_t>(rank_of_process_.size())) {
    return -1;
  }
  return rank_of_process_[process_index];
}

std::string MpiTransport::ErrorString(int code) const {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, len);
}

std::unique_lock<std::mutex> MpiTransport::MpiCallLock() {
  std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
  if (!thread_multiple_) lock.lock();  // this MPI only takes one thread at a time
  return lock;
}

MpiResult MpiTransport::ProgressLocked() {
  while (!control_sends_.empty()) {  // ready signals: tiny, complete in order
    int done = 0;
    int rc = MPI_Test(&control_sends_.front().request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return MpiResult::Error("MPI_Test failed: " + ErrorString(rc));
    if (!done) break;
    control_sends_.pop_front();
  }
  // Direct sends left in flight for the precv that keeps their operand (testing them here
  // also moves them along whenever anything else polls: a precv, the progress thread).
  for (auto it = direct_in_flight_.begin(); it != direct_in_flight_.end();) {
    DirectSend& send = **it;
    int done = 0;
    int rc = MPI_Testall(static_cast<int>(send.requests.size()), send.requests.data(), &done,
                         MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return MpiResult::Error("MPI_Testall failed: " + ErrorString(rc));
    if (done) {
      send.done = true;
      ++sends_completed_;
      ++direct_sends_;
      it = direct_in_flight_.erase(it);
    } else {
      ++it;
    }
  }
  // Sends to different peers complete in any order: test them all.
  for (auto it = pending_.begin(); it != pending_.end();) {
    int done = 0;
    int rc = MPI_Testall(static_cast<int>(it->requests.size()), it->requests.data(), &done,
                         MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return MpiResult::Error("MPI_Testall failed: " + ErrorString(rc));
    if (done) {
      inflight_bytes_ -= it->bytes;
      ++sends_completed_;
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  has_pending_.store(!pending_.empty(), std::memory_order_release);
  return MpiResult::Ok();
}

MpiTransport::ChannelState& MpiTransport::Channel(int peer_rank, int tag) {
  // Every psend and precv looks its channel up: a device thread keeps the last few it used
  // (a ping-pong alternates a send and a receive channel), so the hot path takes no lock.
  // Entries name the transport by a number never reused, and channels are never erased.
  struct Cached {
    uint64_t transport = 0;  // 0: empty
    int peer = 0, tag = 0;
    ChannelState* channel = nullptr;
  };
  constexpr size_t kCached = 4;
  thread_local std::array<Cached, kCached> cache;
  thread_local size_t next_slot = 0;
  for (const Cached& c : cache) {
    if (c.transport == id_ && c.peer == peer_rank && c.tag == tag) return *c.channel;
  }
  ChannelState* channel = nullptr;
  {
    std::lock_guard<std::mutex> lock(channels_mu_);
    auto& slot = channels_[{peer_rank, tag}];
    if (!slot) slot = std::make_unique<ChannelState>();
    channel = slot.get();
  }
  cache[next_slot] = {id_, peer_rank, tag, channel};
  next_slot = (next_slot + 1) % kCached;
  return *channel;
}

MpiResult MpiTransport::Send(int dest_rank, int tag, const void* data, size_t bytes,
                             uint64_t max_inflight_bytes,
                             std::chrono::steady_clock::time_point deadline,
                             std::shared_ptr<DirectSend>* kept) {
  ChannelState& ch = Channel(dest_rank, tag);
  std::lock_guard<std::mutex> channel_lock(ch.send_mu);
  const uint64_t seq = ch.next_send_seq++;  // every message counts, whatever its size
  if (bytes >= kRendezvousMinBytes) {
    return SendLarge(ch, seq, dest_rank, tag, data, bytes, max_inflight_bytes, deadline, kept);
  }
  return SendStaged(dest_rank, tag, data, bytes, max_inflight_bytes, deadline);
}

template <typename Stop>
MpiResult MpiTransport::ReserveInflight(size_t bytes, uint64_t max_inflight_bytes,
                                        std::chrono::steady_clock::time_point deadline,
                                        Stop stop, bool* stopped) {
  *stopped = false;
  std::unique_lock<std::mutex> lock(mu_);
  if (!MpiIsUsable()) return MpiResult::Error("MPI is not initialized or already finalized");
  if (MpiResult r = ProgressLocked(); !r.ok) return r;
  // Bound the memory of undelivered sends: wait for older ones to complete first.
  Backoff backoff;
  while (!pending_.empty() && inflight_bytes_ + bytes > max_inflight_bytes) {
    if (std::chrono::steady_clock::now() > deadline) {
      return MpiResult::Error(
          "gave up waiting for earlier sends to be received: " +
          std::to_string(inflight_bytes_) + " bytes in " + std::to_string(pending_.size()) +
          " sends are undelivered and the limit is " + std::to_string(max_inflight_bytes) +
          " bytes (JAX_CPU_MPI_MAX_INFLIGHT_BYTES); the receivers never posted their precv");
    }
    lock.unlock();
    bool stop_now = false;
    if (MpiResult r = stop(&stop_now); !r.ok) return r;
    if (stop_now) {
      *stopped = true;
      return MpiResult::Ok();
    }
    backoff.Pause();
    lock.lock();
    if (MpiResult r = ProgressLocked(); !r.ok) return r;
  }
  inflight_bytes_ += bytes;  // reserved now, released when the send completes
  peak_inflight_bytes_ = std::max(peak_inflight_bytes_, inflight_bytes_);
  return MpiResult::Ok();
}

MpiResult MpiTransport::SendStaged(int dest_rank, int tag, const void* data, size_t bytes,
                                   uint64_t max_inflight_bytes,
                                   std::chrono::steady_clock::time_point deadline) {
  bool stopped = false;
  auto never = [](bool* stop) {
    *stop = false;
    return MpiResult::Ok();
  };
  if (MpiResult r = ReserveInflight(bytes, max_inflight_bytes, deadline, never, &stopped);
      !r.ok) {
    return r;
  }
  PendingSend send;
  send.bytes = bytes;
  if (bytes > 0) {
    send.buffer = GlobalBufferPool().Acquire(bytes);
    std::memcpy(send.buffer.data(), data, bytes);
  }
  return IsendStaged(std::move(send), dest_rank, tag);
}

MpiResult MpiTransport::IsendStaged(PendingSend send, int dest_rank, int tag) {
  const size_t bytes = send.bytes;
  auto isend = [&](const void* buf, size_t count) -> int {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    send.requests.emplace_back();
    return MPI_Isend(buf, static_cast<int>(count), MPI_BYTE, dest_rank, tag, comm_,
                     &send.requests.back());
  };
  int rc = MPI_SUCCESS;
  if (bytes < kChunkedThreshold) {
    rc = isend(send.buffer.data(), bytes);
  } else {
    // A header, then the payload in chunks: every count fits an int, and the receiver learns
    // the size before it touches its output.
    send.header = std::make_unique<ChunkHeader>();
    send.header->magic = kChunkMagic;
    send.header->total_bytes = bytes;
    send.header->chunk_bytes = kChunkBytes;
    rc = isend(send.header.get(), sizeof(ChunkHeader));
    for (size_t offset = 0; offset < bytes && rc == MPI_SUCCESS; offset += kChunkBytes) {
      rc = isend(send.buffer.data() + offset, std::min(kChunkBytes, bytes - offset));
    }
  }
  if (rc == MPI_SUCCESS && send.requests.size() == 1) {
    // A small message usually leaves at once (eager protocol): then it needs no entry in the
    // pending list, and its buffer goes back when this function returns.
    // (If the test fails, the send takes the pending list, whose test reports the error.)
    int done = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      if (MPI_Test(&send.requests[0], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) done = 0;
    }
    if (done) {
      std::lock_guard<std::mutex> lock(mu_);
      inflight_bytes_ -= bytes;
      ++sends_completed_;
      return ProgressLocked();  // the other sends, as after every send
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (rc != MPI_SUCCESS) {
    // Requests already started keep referring to the buffer: keep it until they complete.
    send.requests.pop_back();
    pending_.push_back(std::move(send));
    has_pending_.store(true, std::memory_order_release);
    return MpiResult::Error("MPI_Isend failed: " + ErrorString(rc));
  }
  pending_.push_back(std::move(send));
  has_pending_.store(true, std::memory_order_release);
  // Small messages often complete at once (eager protocol): free them now.
  return ProgressLocked();
}

MpiResult MpiTransport::PollReady(ChannelState& ch, uint64_t seq, int dest_rank, int tag,
                                  bool* ready, uint64_t* receiver_bytes) {
  *ready = false;
  auto take = [&](const ReadySignal& signal) {
    if (signal.seq < seq) return false;  // an older message, which went staged: forget it
    if (signal.seq == seq) {
      *ready = true;
      *receiver_bytes = signal.bytes;
    } else {
      ch.has_early_ready = true;  // a later message (the two ends lost count after an error)
      ch.early_ready = signal;
    }
    return true;
  };
  if (ch.has_early_ready) {
    ch.has_early_ready = false;
    if (take(ch.early_ready)) return MpiResult::Ok();
  }
  while (true) {
    int flag = 0;
    MPI_Message message = MPI_MESSAGE_NULL;
    ReadySignal signal;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      if (!MpiIsUsable()) return MpiResult::Error("MPI is not initialized or already finalized");
      int rc = MPI_Improbe(dest_rank, tag, ctrl_comm_, &flag, &message, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return MpiResult::Error("MPI_Improbe failed: " + ErrorString(rc));
      if (!flag) return MpiResult::Ok();
      rc = MPI_Mrecv(&signal, sizeof(ReadySignal), MPI_BYTE, &message, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return MpiResult::Error("MPI_Mrecv failed: " + ErrorString(rc));
    }
    if (take(signal)) return MpiResult::Ok();
  }
}

MpiResult MpiTransport::SendDirect(int dest_rank, int tag, const void* data, size_t bytes,
                                   std::chrono::steady_clock::time_point deadline,
                                   std::shared_ptr<DirectSend>* kept) {
  auto send = std::make_shared<DirectSend>();
  send->requests.reserve(bytes / kDirectChunkBytes + 1);
  const auto* src = static_cast<const std::byte*>(data);
  {
    std::unique_lock<std::mutex> lock(mu_);  // guards direct_in_flight_ (and MPI if needed)
    for (size_t offset = 0; offset < bytes; offset += kDirectChunkBytes) {
      const size_t n = std::min(kDirectChunkBytes, bytes - offset);
      send->requests.emplace_back();
      // Synchronous mode: once it completes, the receive has matched, so the receiver can
      // never cancel it as a receive that a staged message superseded.
      int rc = MPI_Issend(src + offset, static_cast<int>(n), MPI_BYTE, dest_rank, tag,
                          direct_comm_, &send->requests.back());
      if (rc != MPI_SUCCESS) {
        send->requests.pop_back();
        if (!send->requests.empty()) {
          // The pieces already posted read from the operand: finish them before returning.
          direct_in_flight_.push_back(send);
          lock.unlock();
          FinishDirect(send, deadline);
        }
        return MpiResult::Error("MPI_Issend failed: " + ErrorString(rc));
      }
    }
    direct_in_flight_.push_back(send);
  }
  if (kept) {
    *kept = std::move(send);
    return MpiResult::Ok();
  }
  return FinishDirect(send, deadline);
}

MpiResult MpiTransport::FinishDirect(const std::shared_ptr<DirectSend>& send,
                                     std::chrono::steady_clock::time_point deadline) {
  Backoff backoff;
  uint64_t polls = 0;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (send->done) return MpiResult::Ok();
      if (!MpiIsUsable()) return MpiResult::Error("MPI is not initialized or already finalized");
      if (MpiResult r = ProgressLocked(); !r.ok) return r;
      if (send->done) return MpiResult::Ok();
      if ((++polls & 63) == 0 && std::chrono::steady_clock::now() > deadline) {
        // The receiver matched (or will never match) a send from an operand that XLA is
        // about to reuse: cancel what can be cancelled and forget the rest.
        for (MPI_Request& r : send->requests) {
          if (r == MPI_REQUEST_NULL) continue;
          MPI_Cancel(&r);
          MPI_Request_free(&r);
        }
        direct_in_flight_.erase(
            std::remove(direct_in_flight_.begin(), direct_in_flight_.end(), send),
            direct_in_flight_.end());
        return MpiResult::Error(
            "the receiver signalled that it was ready for this message, then did not take it "
            "before the timeout (JAX_CPU_MPI_RECV_TIMEOUT); did its process fail or exit?");
      }
    }
    backoff.Pause();
  }
}

MpiResult MpiTransport::SendLarge(ChannelState& ch, uint64_t seq, int dest_rank, int tag,
                                  const void* data, size_t bytes, uint64_t max_inflight_bytes,
                                  std::chrono::steady_clock::time_point deadline,
                                  std::shared_ptr<DirectSend>* kept) {
  bool ready = false;
  bool mismatch = false;  // the receiver waits for another byte count: send staged
  auto poll = [&](bool* go_direct) -> MpiResult {
    *go_direct = false;
    if (mismatch) return MpiResult::Ok();
    uint64_t receiver_bytes = 0;
    MpiResult r = PollReady(ch, seq, dest_rank, tag, &ready, &receiver_bytes);
    if (r.ok && ready) {
      if (receiver_bytes == bytes) *go_direct = true;
      else mismatch = true;
    }
    return r;
  };
  bool go_direct = false;
  if (MpiResult r = poll(&go_direct); !r.ok) return r;
  const auto spin_until = std::chrono::steady_clock::now() + kReadySpin;
  while (!go_direct && !mismatch && std::chrono::steady_clock::now() < spin_until) {
    if (MpiResult r = poll(&go_direct); !r.ok) return r;
  }
  if (go_direct) return SendDirect(dest_rank, tag, data, bytes, deadline, kept);

  bool stopped = false;
  if (MpiResult r = ReserveInflight(bytes, max_inflight_bytes, deadline, poll, &stopped);
      !r.ok) {
    return r;
  }
  if (stopped) return SendDirect(dest_rank, tag, data, bytes, deadline, kept);

  // Stage, looking for the receiver between steps: a receiver that gets ready within about
  // one copy's time still gets the message straight from the operand.
  PendingSend send;
  send.bytes = bytes;
  send.buffer = GlobalBufferPool().Acquire(bytes);
  const auto* src = static_cast<const std::byte*>(data);
  for (size_t offset = 0; offset < bytes; offset += kStageStepBytes) {
    std::memcpy(send.buffer.data() + offset, src + offset, std::min(kStageStepBytes,
                                                                    bytes - offset));
    if (offset + kStageStepBytes >= bytes) break;  // copied: send the copy, return at once
    if (MpiResult r = poll(&go_direct); !r.ok || go_direct) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        inflight_bytes_ -= bytes;  // the reservation is not needed
      }
      if (!r.ok) return r;
      return SendDirect(dest_rank, tag, data, bytes, deadline, kept);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++staged_large_sends_;
  }
  return IsendStaged(std::move(send), dest_rank, tag);
}

MpiResult MpiTransport::WaitAll(std::vector<MPI_Request>& requests,
                                std::chrono::steady_clock::time_point deadline) {
  Backoff backoff;
  uint64_t polls = 0;
  while (true) {
    int done = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                           MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) return MpiResult::Error("MPI_Testall failed: " + ErrorString(rc));
    }
    if (done) return MpiResult::Ok();
    if ((++polls & 63) == 0 && std::chrono::steady_clock::now() > deadline) {
      // Never leave a receive pointing into a buffer that XLA will reuse.
      std::unique_lock<std::mutex> lock = MpiCallLock();
      for (MPI_Request& r : requests) {
        if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
      }
      MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
      MpiResult r;
      r.ok = false;
      r.timed_out = true;
      r.error = "the message started to arrive but its payload did not complete in time";
      return r;
    }
    backoff.Pause();
  }
}

MpiResult MpiTransport::ReceiveChunks(int source_rank, int tag, std::byte* out, size_t total,
                                      size_t chunk_bytes,
                                      std::chrono::steady_clock::time_point deadline) {
  if (chunk_bytes == 0 || chunk_bytes > static_cast<size_t>(INT_MAX)) {
    return MpiResult::Error("corrupt chunk header (chunk size " + std::to_string(chunk_bytes) +
                            ")");
  }
  std::vector<MPI_Request> requests;
  requests.reserve(total / chunk_bytes + 1);
  {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    for (size_t offset = 0; offset < total; offset += chunk_bytes) {
      const size_t n = std::min(chunk_bytes, total - offset);
      requests.emplace_back();
      int rc = MPI_Irecv(out + offset, static_cast<int>(n), MPI_BYTE, source_rank, tag, comm_,
                         &requests.back());
      if (rc != MPI_SUCCESS) {
        requests.pop_back();
        if (lock.owns_lock()) lock.unlock();
        WaitAll(requests, std::chrono::steady_clock::now());  // cancels what was posted
        return MpiResult::Error("MPI_Irecv failed: " + ErrorString(rc));
      }
    }
  }
  return WaitAll(requests, deadline);
}

MpiResult MpiTransport::Recv(int source_rank, int tag, void* out, size_t bytes,
                             std::chrono::steady_clock::time_point deadline) {
  ChannelState& ch = Channel(source_rank, tag);
  std::lock_guard<std::mutex> channel_lock(ch.recv_mu);
  const uint64_t seq = ch.next_recv_seq++;  // every message counts, whatever its size
  if (bytes >= kRendezvousMinBytes) return RecvLarge(seq, source_rank, tag, out, bytes, deadline);
  return RecvStaged(source_rank, tag, out, bytes, deadline);
}

MpiResult MpiTransport::CancelDirect(std::vector<MPI_Request>& requests, bool* all_cancelled,
                                     bool* none_cancelled) {
  std::vector<MPI_Status> statuses(requests.size());
  std::unique_lock<std::mutex> lock = MpiCallLock();
  for (MPI_Request& r : requests) {
    if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
  }
  // A receive that matched completes (its sender is under way); the others are cancelled.
  int rc = MPI_Waitall(static_cast<int>(requests.size()), requests.data(), statuses.data());
  if (rc != MPI_SUCCESS) return MpiResult::Error("MPI_Waitall failed: " + ErrorString(rc));
  size_t cancelled = 0;
  for (MPI_Status& status : statuses) {
    int flag = 0;
    MPI_Test_cancelled(&status, &flag);
    cancelled += flag ? 1 : 0;
  }
  *all_cancelled = cancelled == statuses.size();
  *none_cancelled = cancelled == 0;
  return MpiResult::Ok();
}

MpiResult MpiTransport::RecvLarge(uint64_t seq, int source_rank, int tag, void* out,
                                  size_t bytes, std::chrono::steady_clock::time_point deadline) {
  {
    // Already sent staged (the sender did not find us ready): take it the plain way.
    int flag = 0;
    std::unique_lock<std::mutex> lock = MpiCallLock();
    if (!MpiIsUsable()) return MpiResult::Error("MPI is not initialized or already finalized");
    int rc = MPI_Iprobe(source_rank, tag, comm_, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return MpiResult::Error("MPI_Iprobe failed: " + ErrorString(rc));
    if (flag) {
      if (lock.owns_lock()) lock.unlock();
      return RecvStaged(source_rank, tag, out, bytes, deadline);
    }
  }
  // Post the receives into the output, then tell the sender that we are ready.
  std::vector<MPI_Request> requests;
  requests.reserve(bytes / kDirectChunkBytes + 1);
  auto* dst = static_cast<std::byte*>(out);
  {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    for (size_t offset = 0; offset < bytes; offset += kDirectChunkBytes) {
      const size_t n = std::min(kDirectChunkBytes, bytes - offset);
      requests.emplace_back();
      int rc = MPI_Irecv(dst + offset, static_cast<int>(n), MPI_BYTE, source_rank, tag,
                         direct_comm_, &requests.back());
      if (rc != MPI_SUCCESS) {
        requests.pop_back();
        if (lock.owns_lock()) lock.unlock();
        bool all = false, none = false;
        CancelDirect(requests, &all, &none);
        return MpiResult::Error("MPI_Irecv failed: " + ErrorString(rc));
      }
    }
  }
  {
    ControlSend control;
    control.signal = std::make_unique<ReadySignal>();
    control.signal->seq = seq;
    control.signal->bytes = bytes;
    std::unique_lock<std::mutex> lock(mu_);  // guards control_sends_ (and MPI if needed)
    int rc = MPI_Isend(control.signal.get(), sizeof(ReadySignal), MPI_BYTE, source_rank, tag,
                       ctrl_comm_, &control.request);
    if (rc != MPI_SUCCESS) {
      lock.unlock();
      bool all = false, none = false;
      CancelDirect(requests, &all, &none);
      return MpiResult::Error("MPI_Isend of the ready signal failed: " + ErrorString(rc));
    }
    control_sends_.push_back(std::move(control));
  }
  Backoff backoff;
  uint64_t polls = 0;
  while (true) {
    int done = 0, staged = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                           MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) return MpiResult::Error("MPI_Testall failed: " + ErrorString(rc));
      if (done) return MpiResult::Ok();  // straight into the output
      rc = MPI_Iprobe(source_rank, tag, comm_, &staged, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return MpiResult::Error("MPI_Iprobe failed: " + ErrorString(rc));
    }
    bool timed_out = false;
    if (!staged && (++polls & 63) == 0) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (MpiResult r = ProgressLocked(); !r.ok) return r;
      }
      timed_out = std::chrono::steady_clock::now() > deadline;
    }
    if (staged || timed_out) {
      // Either this message went staged (the sender did not see us in time; its direct
      // receives cannot have matched) or, if the direct message completed meanwhile, the
      // staged one is the next message, left for the next precv.
      bool all_cancelled = false, none_cancelled = false;
      if (MpiResult r = CancelDirect(requests, &all_cancelled, &none_cancelled); !r.ok) return r;
      if (none_cancelled) return MpiResult::Ok();
      if (!all_cancelled) {
        return MpiResult::Error("internal error: a direct message arrived in part only");
      }
      if (staged) return RecvStaged(source_rank, tag, out, bytes, deadline);
      MpiResult r;
      r.ok = false;
      r.timed_out = true;
      return r;
    }
    backoff.Pause();
  }
}

MpiResult MpiTransport::RecvStaged(int source_rank, int tag, void* out, size_t bytes,
                                   std::chrono::steady_clock::time_point deadline) {
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status status;
  Backoff backoff;
  uint64_t polls = 0;
  while (true) {
    int flag = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      if (!MpiIsUsable()) return MpiResult::Error("MPI is not initialized or already finalized");
      int rc = MPI_Improbe(source_rank, tag, comm_, &flag, &message, &status);
      if (rc != MPI_SUCCESS) return MpiResult::Error("MPI_Improbe failed: " + ErrorString(rc));
    }
    if (flag) break;
    if ((++polls & 63) == 0) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (MpiResult r = ProgressLocked(); !r.ok) return r;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        MpiResult r;
        r.ok = false;
        r.timed_out = true;
        return r;
      }
    }
    backoff.Pause();
  }

  int count = 0;
  MPI_Get_count(&status, MPI_BYTE, &count);
  auto mismatch = [](size_t sender_bytes) {
    MpiResult r;
    r.ok = false;
    r.size_mismatch = true;
    r.sender_bytes = sender_bytes;
    return r;
  };
  auto mrecv = [&](void* buf, int n) -> int {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    return MPI_Mrecv(buf, n, MPI_BYTE, &message, MPI_STATUS_IGNORE);
  };

  if (static_cast<size_t>(count) == sizeof(ChunkHeader)) {
    // Either the header of a chunked message or a payload of exactly that size.
    ChunkHeader header;
    if (int rc = mrecv(&header, count); rc != MPI_SUCCESS) {
      return MpiResult::Error("MPI_Mrecv failed: " + ErrorString(rc));
    }
    if (header.magic != kChunkMagic) {
      if (bytes != sizeof(ChunkHeader)) return mismatch(sizeof(ChunkHeader));
      std::memcpy(out, &header, sizeof(ChunkHeader));
      return MpiResult::Ok();
    }
    if (header.total_bytes != bytes) {
      // Drain the payload so the channel stays usable, then report.
      PooledBuffer scratch = GlobalBufferPool().Acquire(header.total_bytes);
      MpiResult r = ReceiveChunks(source_rank, tag, scratch.data(), header.total_bytes,
                                  header.chunk_bytes, deadline);
      if (!r.ok) return r;
      return mismatch(header.total_bytes);
    }
    return ReceiveChunks(source_rank, tag, static_cast<std::byte*>(out), bytes,
                         header.chunk_bytes, deadline);
  }
  if (static_cast<size_t>(count) != bytes) {
    PooledBuffer scratch = GlobalBufferPool().Acquire(static_cast<size_t>(count));
    mrecv(scratch.data(), count);
    return mismatch(static_cast<size_t>(count));
  }
  if (int rc = mrecv(out, count); rc != MPI_SUCCESS) {
    return MpiResult::Error("MPI_Mrecv failed: " + ErrorString(rc));
  }
  return MpiResult::Ok();
}

MpiTransport::DrainResult MpiTransport::Drain(std::chrono::steady_clock::time_point deadline) {
  // Phase 1: complete our own sends. Phase 2: a barrier (non-blocking, polled) with every
  // other rank, which keeps each rank's progress engine running until all have drained: a
  // receiver that already has all its bytes may owe its sender the acknowledgement that
  // completes the sender's request (MPICH's CMA rendezvous sends it on a later progress
  // call), and without this it would leave before sending it.
  // A send that is still undelivered halfway to the deadline has a receiver that will never
  // take it (a precv that timed out, a program that ended early): join the barrier anyway,
  // so that ranks that are waiting for us at their exit still meet us, and report the send.
  Backoff backoff;
  MPI_Request barrier = MPI_REQUEST_NULL;
  const auto start = std::chrono::steady_clock::now();
  const auto join_anyway =
      start + std::max(deadline - start, std::chrono::steady_clock::duration::zero()) / 2;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!MpiIsUsable()) return {SendsInFlightLocked(), false};
      ProgressLocked();
      const bool sends_done = SendsInFlightLocked() == 0;
      if (barrier == MPI_REQUEST_NULL &&
          (sends_done || std::chrono::steady_clock::now() > join_anyway)) {
        if (MPI_Ibarrier(comm_, &barrier) != MPI_SUCCESS) {
          return {SendsInFlightLocked(), false};
        }
      }
      if (barrier != MPI_REQUEST_NULL) {
        int done = 0;
        MPI_Test(&barrier, &done, MPI_STATUS_IGNORE);
        if (done) {
          ProgressLocked();
          return {SendsInFlightLocked(), true};
        }
      }
      if (std::chrono::steady_clock::now() > deadline) {
        // A peer never reached its exit (or died): report only our own undelivered sends.
        // The barrier request is left to MPI_Finalize.
        return {SendsInFlightLocked(), false};
      }
    }
    backoff.Pause();
  }
}

size_t MpiTransport::SendsInFlightLocked() const {
  return pending_.size() + direct_in_flight_.size();
}

bool MpiTransport::has_pending_sends() const {
  return has_pending_.load(std::memory_order_acquire);
}

size_t MpiTransport::inflight_sends() {
  std::lock_guard<std::mutex> lock(mu_);
  if (MpiIsUsable()) ProgressLocked();  // count only what is really still in flight
  return SendsInFlightLocked();
}

uint64_t MpiTransport::inflight_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  if (MpiIsUsable()) ProgressLocked();
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
