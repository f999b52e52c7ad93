#include "mpi_transport.h"

#include <sched.h>

#include <algorithm>
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
  int rc = MPI_Comm_dup(comm, &t->comm_);
  if (rc != MPI_SUCCESS) {
    *error = "MPI_Comm_dup failed: " + t->ErrorString(rc);
    return nullptr;
  }
  // Errors on our communicator come back as codes, never abort the job behind our back.
  MPI_Comm_set_errhandler(t->comm_, MPI_ERRORS_RETURN);
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
  if (comm_ != MPI_COMM_NULL && MpiIsUsable()) MPI_Comm_free(&comm_);
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
  return MpiResult::Ok();
}

MpiResult MpiTransport::Send(int dest_rank, int tag, const void* data, size_t bytes,
                             uint64_t max_inflight_bytes,
                             std::chrono::steady_clock::time_point deadline) {
  {
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
      backoff.Pause();
      lock.lock();
      if (MpiResult r = ProgressLocked(); !r.ok) return r;
    }
    inflight_bytes_ += bytes;  // reserved now, released when the send completes
    peak_inflight_bytes_ = std::max(peak_inflight_bytes_, inflight_bytes_);
  }

  PendingSend send;
  send.bytes = bytes;
  if (bytes > 0) send.buffer = GlobalBufferPool().Acquire(bytes);
  auto isend = [&](const void* buf, size_t count) -> int {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    send.requests.emplace_back();
    return MPI_Isend(buf, static_cast<int>(count), MPI_BYTE, dest_rank, tag, comm_,
                     &send.requests.back());
  };
  int rc = MPI_SUCCESS;
  if (bytes < kChunkedThreshold) {
    // One message: copy, send.
    if (bytes > 0) std::memcpy(send.buffer.data(), data, bytes);
    rc = isend(send.buffer.data(), bytes);
  } else {
    // A header, then the payload in chunks, each sent as soon as it is copied: the receiver
    // pulls chunk k while this thread copies chunk k+1, so the copy costs little time.
    send.header = std::make_unique<ChunkHeader>();
    send.header->magic = kChunkMagic;
    send.header->total_bytes = bytes;
    send.header->chunk_bytes = kChunkBytes;
    rc = isend(send.header.get(), sizeof(ChunkHeader));
    const auto* src = static_cast<const std::byte*>(data);
    for (size_t offset = 0; offset < bytes && rc == MPI_SUCCESS; offset += kChunkBytes) {
      const size_t n = std::min(kChunkBytes, bytes - offset);
      std::memcpy(send.buffer.data() + offset, src + offset, n);
      rc = isend(send.buffer.data() + offset, n);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (rc != MPI_SUCCESS) {
    // Requests already started keep referring to the buffer: keep it until they complete.
    send.requests.pop_back();
    pending_.push_back(std::move(send));
    return MpiResult::Error("MPI_Isend failed: " + ErrorString(rc));
  }
  pending_.push_back(std::move(send));
  // Small messages often complete at once (eager protocol): free them now.
  return ProgressLocked();
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
        lock.unlock();
        WaitAll(requests, std::chrono::steady_clock::now());  // cancels what was posted
        return MpiResult::Error("MPI_Irecv failed: " + ErrorString(rc));
      }
    }
  }
  return WaitAll(requests, deadline);
}

MpiResult MpiTransport::Recv(int source_rank, int tag, void* out, size_t bytes,
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
  Backoff backoff;
  MPI_Request barrier = MPI_REQUEST_NULL;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!MpiIsUsable()) return {pending_.size(), false};
      ProgressLocked();
      const bool sends_done = pending_.empty();
      if (sends_done && barrier == MPI_REQUEST_NULL) {
        if (MPI_Ibarrier(comm_, &barrier) != MPI_SUCCESS) return {0, false};
      }
      if (barrier != MPI_REQUEST_NULL) {
        int done = 0;
        MPI_Test(&barrier, &done, MPI_STATUS_IGNORE);
        if (done) return {0, true};
      }
      if (std::chrono::steady_clock::now() > deadline) {
        // A peer never reached its exit (or died): report only our own undelivered sends.
        // The barrier request is left to MPI_Finalize.
        return {pending_.size(), false};
      }
    }
    backoff.Pause();
  }
}

size_t MpiTransport::inflight_sends() {
  std::lock_guard<std::mutex> lock(mu_);
  if (MpiIsUsable()) ProgressLocked();  // count only what is really still in flight
  return pending_.size();
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

uint64_t MpiTransport::sends_completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sends_completed_;
}

}  // namespace jcm
