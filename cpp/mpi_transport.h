// MPI transport: point-to-point between processes on a communicator owned by this package
// (a duplicate of MPI_COMM_WORLD made by mpi4py, never the user's communicator).
//
// Messages of kChunkedThreshold bytes or more travel as a 32-byte header (magic, total size,
// chunk size) and chunks of kChunkBytes: the copy of chunk k+1 overlaps the transfer of
// chunk k, every MPI count fits an int (messages over 2 GiB work on any MPI), and the
// receiver learns the sender's size before it touches its output buffer.
//
// Sends are copy-and-Isend: a psend copies its operand into a buffer the transport owns and
// returns without waiting for the receiver, so that two devices that both send before they
// receive never deadlock, whatever the message size. The bytes of undelivered sends are
// bounded (Config::max_inflight_bytes). Receives probe with a deadline (MPI_Improbe) so a
// receive that nothing matches fails instead of hanging, and check the byte count.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "buffer_pool.h"

namespace jcm {

struct MpiResult {
  bool ok = true;
  std::string error;        // set when !ok
  bool timed_out = false;   // receive deadline passed
  bool size_mismatch = false;
  size_t sender_bytes = 0;  // for size_mismatch
  static MpiResult Ok() { return {}; }
  static MpiResult Error(std::string message) {
    MpiResult r;
    r.ok = false;
    r.error = std::move(message);
    return r;
  }
};

class MpiTransport {
 public:
  // `comm` is duplicated again, so the transport owns its communicator; `rank_of_process`
  // maps jax.process_index() to the rank in `comm`.
  static std::unique_ptr<MpiTransport> Create(MPI_Comm comm, std::vector<int> rank_of_process,
                                              std::string* error);
  struct PrivateTag {};
  explicit MpiTransport(PrivateTag) {}
  ~MpiTransport();
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int64_t tag_ub() const { return tag_ub_; }
  // The MPI rank of a JAX process, or -1 if unknown.
  int RankOfProcess(int64_t process_index) const;

  MpiResult Send(int dest_rank, int tag, const void* data, size_t bytes,
                 uint64_t max_inflight_bytes, std::chrono::steady_clock::time_point deadline);
  MpiResult Recv(int source_rank, int tag, void* out, size_t bytes,
                 std::chrono::steady_clock::time_point deadline);

  // At exit (collective over the communicator): completes every outstanding send and waits
  // for every rank to get there, or gives up at the deadline.
  struct DrainResult {
    size_t undelivered = 0;      // our sends left undelivered
    bool all_ranks_met = false;  // the exit barrier completed
  };
  DrainResult Drain(std::chrono::steady_clock::time_point deadline);

  // Sends not yet completed (after testing them) and their bytes.
  size_t inflight_sends();
  uint64_t inflight_bytes();
  uint64_t sends_completed() const;
  uint64_t peak_inflight_bytes() const;

 private:
  struct ChunkHeader {
    uint64_t magic = 0;
    uint64_t total_bytes = 0;
    uint64_t chunk_bytes = 0;
    uint64_t reserved = 0;
  };
  static constexpr uint64_t kChunkMagic = 0x6a636d2d6368756bULL;  // "jcm-chuk"
  static constexpr size_t kChunkedThreshold = size_t{4} << 20;
  static constexpr size_t kChunkBytes = size_t{1} << 20;

  struct PendingSend {
    PooledBuffer buffer;
    std::unique_ptr<ChunkHeader> header;  // chunked messages only
    size_t bytes = 0;
    std::vector<MPI_Request> requests;  // header and chunks, or the one message
  };

  // Polls `requests` to completion; at the deadline cancels them and reports a timeout.
  MpiResult WaitAll(std::vector<MPI_Request>& requests,
                    std::chrono::steady_clock::time_point deadline);
  MpiResult ReceiveChunks(int source_rank, int tag, std::byte* out, size_t total,
                          size_t chunk_bytes, std::chrono::steady_clock::time_point deadline);

  // Held around an MPI call when the library is not MPI_THREAD_MULTIPLE (else unlocked).
  std::unique_lock<std::mutex> MpiCallLock();
  // Frees completed sends; caller holds mu_.
  MpiResult ProgressLocked();
  std::string ErrorString(int code) const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
  int64_t tag_ub_ = 32767;
  bool thread_multiple_ = false;
  std::vector<int> rank_of_process_;

  mutable std::mutex mu_;       // guards the pending list (and MPI, if not THREAD_MULTIPLE)
  std::deque<PendingSend> pending_;
  uint64_t inflight_bytes_ = 0;
  uint64_t sends_completed_ = 0;
  uint64_t peak_inflight_bytes_ = 0;
};

}  // namespace jcm
