// Receives of the MPI transport: the entry point, the staged path (one message, or a
// chunk header and its chunks) and the deadline-bound wait that cancels at the deadline.
#include <climits>
#include <cstring>

#include "mpi/internal.h"
#include "mpi/transport.h"

namespace jcm {

Status MpiTransport::Recv(int source_rank, int tag, void* out, size_t bytes,
                          std::chrono::steady_clock::time_point deadline) {
  ChannelState& ch = Channel(source_rank, tag);
  std::lock_guard<std::mutex> channel_lock(ch.recv_mu);
  const uint64_t seq = ch.next_recv_seq++;  // every message counts, whatever its size
  if (bytes >= kRendezvousMinBytes) return RecvLarge(seq, source_rank, tag, out, bytes, deadline);
  return RecvStaged(source_rank, tag, out, bytes, deadline);
}

Status MpiTransport::WaitAll(std::vector<MPI_Request>& requests,
                             std::chrono::steady_clock::time_point deadline) {
  Backoff backoff;
  uint64_t polls = 0;
  while (true) {
    int done = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                           MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Testall", rc);
    }
    if (done) return Status::Ok();
    if ((++polls & 63) == 0 && std::chrono::steady_clock::now() > deadline) {
      // Never leave a receive pointing into a buffer that XLA will reuse.
      std::unique_lock<std::mutex> lock = MpiCallLock();
      Status failure;
      for (MPI_Request& r : requests) {
        if (r == MPI_REQUEST_NULL) continue;
        int rc = MPI_Cancel(&r);
        if (rc != MPI_SUCCESS && failure.ok()) failure = Status::MpiError("MPI_Cancel", rc);
      }
      int rc = MPI_Waitall(static_cast<int>(requests.size()), requests.data(),
                           MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Waitall", rc);
      if (!failure.ok()) return failure;
      return Status::Timeout(
          "the message started to arrive but its payload did not complete in time");
    }
    backoff.Pause();
  }
}

Status MpiTransport::ReceiveChunks(int source_rank, int tag, std::byte* out, size_t total,
                                   size_t chunk_bytes,
                                   std::chrono::steady_clock::time_point deadline) {
  if (chunk_bytes == 0 || chunk_bytes > static_cast<size_t>(INT_MAX)) {
    return Status::Invalid("corrupt chunk header (chunk size " + std::to_string(chunk_bytes) +
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
        // Cancels what was posted; the Irecv failure is the error to report.
        (void)WaitAll(requests, std::chrono::steady_clock::now());
        return Status::MpiError("MPI_Irecv", rc);
      }
    }
  }
  return WaitAll(requests, deadline);
}

Status MpiTransport::RecvStaged(int source_rank, int tag, void* out, size_t bytes,
                                std::chrono::steady_clock::time_point deadline) {
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status status;
  Backoff backoff;
  uint64_t polls = 0;
  while (true) {
    int flag = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      if (!MpiIsUsable()) return Status::Invalid(kMpiNotUsable);
      int rc = MPI_Improbe(source_rank, tag, comm_, &flag, &message, &status);
      if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Improbe", rc);
    }
    if (flag) break;
    if ((++polls & 63) == 0) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (Status s = ProgressLocked(); !s.ok()) return s;
      }
      if (std::chrono::steady_clock::now() > deadline) return Status::Timeout();
    }
    backoff.Pause();
  }

  int count = 0;
  if (int rc = MPI_Get_count(&status, MPI_BYTE, &count); rc != MPI_SUCCESS) {
    return Status::MpiError("MPI_Get_count", rc);
  }
  auto mrecv = [&](void* buf, int n) -> int {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    return MPI_Mrecv(buf, n, MPI_BYTE, &message, MPI_STATUS_IGNORE);
  };

  if (static_cast<size_t>(count) == sizeof(ChunkHeader)) {
    // Either the header of a chunked message or a payload of exactly that size.
    ChunkHeader header;
    if (int rc = mrecv(&header, count); rc != MPI_SUCCESS) {
      return Status::MpiError("MPI_Mrecv", rc);
    }
    if (header.magic != kChunkMagic) {
      if (bytes != sizeof(ChunkHeader)) return Status::SizeMismatch(sizeof(ChunkHeader));
      std::memcpy(out, &header, sizeof(ChunkHeader));
      return Status::Ok();
    }
    if (header.total_bytes != bytes) {
      // Drain the payload so the channel stays usable, then report.
      PooledBuffer scratch = GlobalBufferPool().Acquire(header.total_bytes);
      Status s = ReceiveChunks(source_rank, tag, scratch.data(), header.total_bytes,
                               header.chunk_bytes, deadline);
      if (!s.ok()) return s;
      return Status::SizeMismatch(header.total_bytes);
    }
    return ReceiveChunks(source_rank, tag, static_cast<std::byte*>(out), bytes,
                         header.chunk_bytes, deadline);
  }
  if (static_cast<size_t>(count) != bytes) {
    PooledBuffer scratch = GlobalBufferPool().Acquire(static_cast<size_t>(count));
    if (int rc = mrecv(scratch.data(), count); rc != MPI_SUCCESS) {
      return Status::MpiError("MPI_Mrecv", rc);
    }
    return Status::SizeMismatch(static_cast<size_t>(count));
  }
  if (int rc = mrecv(out, count); rc != MPI_SUCCESS) return Status::MpiError("MPI_Mrecv", rc);
  return Status::Ok();
}

}  // namespace jcm
