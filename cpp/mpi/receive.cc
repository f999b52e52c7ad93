// Receives of the MPI transport: the entry point, the staged path (one message with its
// envelope, or a chunk header and its chunks; mpi/framing.h), and the waits with a
// deadline that cancel, and abandon what MPI cannot cancel, at that deadline (see the top
// of mpi/transport.h).
#include <array>
#include <atomic>
#include <climits>
#include <cstring>
#include <utility>

#include "common/keep_freed_memory.h"
#include "mpi/internal.h"
#include "mpi/transport.h"

namespace jcm {

Status MpiTransport::Recv(int source_rank, int tag, void* out, size_t bytes,
                          std::string_view desc, std::chrono::steady_clock::time_point deadline,
                          bool sender_kept, bool sender_one_way) {
  ChannelState& ch = Channel(source_rank, tag);
  std::lock_guard<std::mutex> channel_lock(ch.recv_mu);
  const uint64_t seq = ch.next_recv_seq++;  // every message counts, whatever its size
  trace::NoteSeq(seq);
  const uint64_t desc_hash = DescriptionHash(desc);
  // What StallReport tells of this receive.
  // A kept sender frames its message from its operand (SendFramed) where SentFramed says
  // so: no rendezvous then, whatever the size.
  ch.recv_rendezvous = bytes >= kRendezvousMinBytes &&
                       !SentFramed(sender_kept, sender_one_way, bytes);
  ch.direct_posted = false;
  ch.staged_matched = false;
  // A cycle's sender receives in the group too (an exchange, a ring): there both ends copy
  // at once, the peer's send completes only once this end has copied, and a page faulted in
  // between two polls delays that copy (the exchange measured no faster for it, see
  // docs/benchmarks.md). A one-way sender's receiver (a pipeline's) and the plain path wait
  // for a sender that does not wait for them.
  ch.recv_prefault = !(sender_kept && !sender_one_way);
  ch.recv_end = ChannelState::RecvEnd::kRunning;
  Status received = ch.recv_rendezvous
                        ? RecvLarge(ch, seq, source_rank, tag, out, bytes, desc_hash, deadline)
                        : RecvStaged(ch, source_rank, tag, out, bytes, desc_hash, deadline);
  ch.recv_end = received.ok() ? ChannelState::RecvEnd::kTaken : ChannelState::RecvEnd::kFailed;
  return received;
}

namespace {

// Whether a one-message payload of `payload_bytes` with trailer `e` is what the receiver
// waits for (`bytes` bytes of the description hashed `desc_hash`).
Status Arrived(const Envelope& e, size_t payload_bytes, size_t bytes, uint64_t desc_hash) {
  if (e.magic != kPayloadMagic) return Status::Invalid("corrupt message (no envelope)");
  if (payload_bytes != bytes) return Status::SizeMismatch(payload_bytes, e.Description());
  if (e.desc_hash != desc_hash) return Status::TypeMismatch(bytes, e.Description());
  return Status::Ok();
}

// The payload of a message whose chunk header is `header` (sent with it, or bare: the
// channel's last one), received by `receive(buffer, keep_alive)`: into the output when its
// byte count is `bytes`, even when the description differs (an error then, whatever the
// output holds), which keeps the channel in step; else drained into a pooled scratch, so
// the channel stays usable. Then the mismatches reported.
template <typename Receive>
Status TakePayload(const Envelope& header, void* out, size_t bytes, uint64_t desc_hash,
                   Receive&& receive) {
  if (header.total_bytes != bytes) {
    auto scratch = std::make_shared<PooledBuffer>(
        GlobalBufferPool().Acquire(header.total_bytes));
    if (Status s = receive(scratch->data(), scratch); !s.ok()) return s;
    return Status::SizeMismatch(header.total_bytes, header.Description());
  }
  if (Status s = receive(static_cast<std::byte*>(out), nullptr); !s.ok()) return s;
  if (header.desc_hash != desc_hash) return Status::TypeMismatch(bytes, header.Description());
  return Status::Ok();
}

}  // namespace

Status MpiTransport::WaitAll(std::span<MPI_Request> requests,
                             std::chrono::steady_clock::time_point deadline,
                             std::shared_ptr<void> keep_alive) {
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
    if ((++polls & 63) == 0 && Expired(deadline)) {
      // Never leave a receive pointing into a buffer that XLA will reuse, unless MPI
      // cannot cancel it (then the transport is broken, see Abandon).
      size_t cancelled = 0;
      bool abandoned = false;
      Status s = CancelWithGrace(requests, &cancelled, &abandoned, std::move(keep_alive));
      if (!s.ok() && !abandoned) return s;
      if (cancelled == 0 && !abandoned) return Status::Ok();  // all arrived, just in time
      return Status::Timeout(
          "the message started to arrive but its payload did not complete in time");
    }
    backoff.Pause();
  }
}

Status MpiTransport::CancelWithGrace(std::span<MPI_Request> requests, size_t* cancelled,
                                     bool* abandoned, std::shared_ptr<void> keep_alive,
                                     bool cancel, MPI_Status* completed) {
  *cancelled = 0;
  *abandoned = false;
  Status failure;
  auto note = [&failure](const char* call, int rc) {
    if (rc != MPI_SUCCESS && failure.ok()) failure = Status::MpiError(call, rc);
  };
  if (cancel) {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    for (MPI_Request& r : requests) {
      if (r != MPI_REQUEST_NULL) note("MPI_Cancel", MPI_Cancel(&r));
    }
  }
  // A cancelled request, or one whose message is flowing, completes within the grace
  // period; one that matched a message whose sender stopped never does.
  const auto grace_end = std::chrono::steady_clock::now() + kCancelGrace;
  Backoff backoff;
  while (true) {
    size_t open = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      for (MPI_Request& r : requests) {
        if (r == MPI_REQUEST_NULL) continue;
        int flag = 0;
        MPI_Status status;
        int rc = MPI_Test(&r, &flag, &status);
        note("MPI_Test", rc);
        if (rc != MPI_SUCCESS || !flag) {
          ++open;
          continue;
        }
        int was_cancelled = 0;
        note("MPI_Test_cancelled", MPI_Test_cancelled(&status, &was_cancelled));
        if (was_cancelled) {
          ++*cancelled;
        } else if (completed) {
          *completed = status;
        }
      }
    }
    if (open == 0) return failure;
    if (std::chrono::steady_clock::now() > grace_end) {
      Abandon(requests, std::move(keep_alive));
      *abandoned = true;
      return failure;
    }
    backoff.Pause();
  }
}

Status MpiTransport::Usable() const {
  if (!MpiIsUsable()) return Status::Invalid(kMpiNotUsable);
  if (broken()) return Status::Invalid(BrokenMessage());
  return Status::Ok();
}

namespace {
// Set by Abandon, taken by the op layer when the op of this thread fails.
thread_local bool t_abandoned = false;
}  // namespace

std::string MpiTransport::BrokenMessage() const {
  std::string message = kMpiBroken;
  std::lock_guard<std::mutex> lock(break_mu_);
  if (break_cause_.empty()) return message + kMpiBrokenCauseUnknown;
  return message + kMpiBrokenCause + break_cause_;
}

void MpiTransport::NoteBreak(std::string_view error) {
  // Its first line: the lines after it are the transport's state at the time (StallReport),
  // which every later error would otherwise repeat.
  error = error.substr(0, error.find('\n'));
  std::lock_guard<std::mutex> lock(break_mu_);
  if (break_cause_.empty()) break_cause_ = error;
}

bool MpiTransport::TakeAbandonedOnThisThread() { return std::exchange(t_abandoned, false); }

void MpiTransport::Abandon(std::span<MPI_Request> requests, std::shared_ptr<void> keep_alive) {
  // Neither waited on (it would never end) nor freed (MPI_Request_free would let MPI
  // release the request while it may still write into its buffer): kept until the process
  // ends, with the buffer the transport owns, if any. The exit drain does not look at them.
  Abandoned entry;
  entry.keep_alive = std::move(keep_alive);
  for (MPI_Request& r : requests) {
    if (r != MPI_REQUEST_NULL) entry.requests.push_back(r);
    r = MPI_REQUEST_NULL;
  }
  t_abandoned = true;
  std::lock_guard<std::mutex> lock(mu_);
  abandoned_.push_back(std::move(entry));
  broken_.store(true, std::memory_order_release);
}

Status MpiTransport::ReceiveMatched(MPI_Message* message, void* buf, int count,
                                    std::chrono::steady_clock::time_point deadline,
                                    std::shared_ptr<void> keep_alive) {
  MPI_Request request = MPI_REQUEST_NULL;
  {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    int rc = MPI_Imrecv(buf, count, MPI_BYTE, message, &request);
    if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Imrecv", rc);
  }
  return WaitAll({&request, 1}, deadline, std::move(keep_alive));
}

std::shared_ptr<Envelope> MpiTransport::ReusableEnvelope(ChannelState& ch) {
  return ReusableOrNew(ch.recv_envelope);
}

Status MpiTransport::ReceiveChunks(int source_rank, int tag, std::byte* out, size_t total,
                                   size_t chunk_bytes,
                                   std::chrono::steady_clock::time_point deadline,
                                   std::shared_ptr<void> keep_alive) {
  if (chunk_bytes == 0 || chunk_bytes > static_cast<size_t>(INT_MAX)) {
    return Status::Invalid("corrupt chunk header (chunk size " + std::to_string(chunk_bytes) +
                           ")");
  }
  // Most messages are one chunk (a framed one up to kDirectChunkBytes): their requests
  // need no list on the heap.
  constexpr size_t kInline = 4;
  std::array<MPI_Request, kInline> inline_requests;
  std::vector<MPI_Request> heap_requests;
  const size_t chunks = (total + chunk_bytes - 1) / chunk_bytes;
  if (chunks > kInline) heap_requests.resize(chunks);
  std::span<MPI_Request> all = chunks > kInline ? std::span<MPI_Request>(heap_requests)
                                                : std::span<MPI_Request>(inline_requests);
  size_t posted = 0;
  {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    for (size_t offset = 0; offset < total; offset += chunk_bytes) {
      const size_t n = std::min(chunk_bytes, total - offset);
      int rc = MPI_Irecv(out + offset, static_cast<int>(n), MPI_BYTE, source_rank, tag, comm_,
                         &all[posted]);
      if (rc != MPI_SUCCESS) {
        if (lock.owns_lock()) lock.unlock();
        // Cancels what was posted; the Irecv failure is the error to report.
        (void)WaitAll(all.first(posted), std::chrono::steady_clock::now(), keep_alive);
        return Status::MpiError("MPI_Irecv", rc);
      }
      ++posted;
    }
  }
  return WaitAll(all.first(posted), deadline, std::move(keep_alive));
}

Status MpiTransport::RecvStaged(ChannelState& ch, int source_rank, int tag, void* out,
                                size_t bytes, uint64_t desc_hash,
                                std::chrono::steady_clock::time_point deadline) {
  trace::NotePath(trace::Path::kStaged);
  const Envelope& last = ch.last_header_received;
  if (AllowsBare(last) && last.total_bytes == bytes) {
    // Only chunk headers and bare payloads come on the channel now (mpi/framing.h).
    return RecvPostedFirst(ch, source_rank, tag, out, bytes, desc_hash, deadline);
  }
  if (!AllowsBare(last) && bytes < kScatterMinBytes) {
    // No bare payload can come: every message ends with an Envelope, and none is larger
    // than the channel's room.
    return RecvSmallPostedFirst(ch, source_rank, tag, out, bytes, desc_hash, deadline);
  }
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status status;
  Backoff backoff;
  OutputPrefault prefault(out, ch.recv_prefault ? bytes : 0);
  {
    // The wait for the message: its spin adapts as the rendezvous waits' do (RecvLarge), with
    // a budget of its own (where both ranks share a core the peer's psend runs only once
    // this thread yields).
    thread_local AdaptiveSpin adaptive;
    AdaptedPause pause(adaptive, backoff, PointToPointSpinAdapts(backoff));
    uint64_t polls = 0;
    while (true) {
      int flag = 0;
      {
        std::unique_lock<std::mutex> lock = MpiCallLock();
        if (Status s = Usable(); !s.ok()) return s;
        int rc = MPI_Improbe(source_rank, tag, comm_, &flag, &message, &status);
        if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Improbe", rc);
      }
      if (flag) {
        ch.staged_matched = true;  // for StallReport (recv_mu is held)
        break;
      }
      if (Status s = ProgressDeferred(deadline); !s.ok()) return s;
      if ((++polls & 63) == 0) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (Status s = ProgressLocked(); !s.ok()) return s;
        }
        if (Expired(deadline)) return Status::Timeout();
      }
      PrefaultOrPause(prefault, pause);
    }
  }

  int count = 0;
  if (int rc = MPI_Get_count(&status, MPI_BYTE, &count); rc != MPI_SUCCESS) {
    return Status::MpiError("MPI_Get_count", rc);
  }
  // The message has matched: from here on its sender may stop mid-message, so every
  // receive is non-blocking and waited for with the deadline (a message that matched just
  // before it still gets CancelWithGrace's grace period). Every staged message ends with
  // an Envelope (mpi/framing.h).
  if (static_cast<size_t>(count) != sizeof(Envelope)) {
    if (AllowsBare(last) && static_cast<size_t>(count) == last.total_bytes) {
      return RecvBare(ch, &message, out, bytes, desc_hash, deadline);
    }
    return RecvOneMessage(ch, &message, count, out, bytes, desc_hash, deadline);
  }
  // A chunk header, or the trailer of an empty payload.
  std::shared_ptr<Envelope> envelope = ReusableEnvelope(ch);
  if (Status s = ReceiveMatched(&message, envelope.get(), count, deadline, envelope); !s.ok()) {
    return s;
  }
  const Envelope header = *envelope;
  if (header.magic != kChunkMagic) return Arrived(header, 0, bytes, desc_hash);
  return TakeChunks(ch, header, source_rank, tag, out, bytes, desc_hash, deadline);
}

Status MpiTransport::TakeChunks(ChannelState& ch, const Envelope& header, int source_rank,
                                int tag, void* out, size_t bytes, uint64_t desc_hash,
                                std::chrono::steady_clock::time_point deadline) {
  ch.last_header_received = header;  // as the sender's last_header_sent (mpi/framing.h)
  return TakePayload(header, out, bytes, desc_hash,
                     [&](std::byte* buffer, std::shared_ptr<void> keep_alive) {
                       return ReceiveChunks(source_rank, tag, buffer, header.total_bytes,
                                            header.chunk_bytes, deadline,
                                            std::move(keep_alive));
                     });
}

Status MpiTransport::PostAndWait(ChannelState& ch, int source_rank, int tag, std::byte* buffer,
                                 size_t capacity, std::shared_ptr<void> keep_alive, void* out,
                                 size_t bytes, std::chrono::steady_clock::time_point deadline,
                                 size_t* count) {
  MPI_Request request = MPI_REQUEST_NULL;
  {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    if (Status s = Usable(); !s.ok()) return s;
    int rc = MPI_Irecv(buffer, static_cast<int>(capacity), MPI_BYTE, source_rank, tag, comm_,
                       &request);
    if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Irecv", rc);
  }
  // At a failure or the deadline the receive, which points into `buffer`, is cancelled;
  // one that already matched gets the grace period to complete (then it is taken as if in
  // time: `status` is its own), and is abandoned if it does not (its sender stopped
  // mid-message).
  MPI_Status status;
  auto give_up = [&](Status why) -> Status {
    size_t cancelled = 0;
    bool abandoned = false;
    Status s = CancelWithGrace({&request, 1}, &cancelled, &abandoned, keep_alive,
                               /*cancel=*/true, &status);
    if (abandoned) {
      return Status::Timeout("the message started to arrive but did not complete in time");
    }
    if (!s.ok()) return s;
    return cancelled ? why : Status::Ok();  // Ok: it completed after all
  };
  {
    Backoff backoff;
    OutputPrefault prefault(out, ch.recv_prefault ? bytes : 0);
    thread_local AdaptiveSpin adaptive;  // as RecvStaged's wait
    AdaptedPause pause(adaptive, backoff, PointToPointSpinAdapts(backoff));
    uint64_t polls = 0;
    while (true) {
      int done = 0;
      int rc = MPI_SUCCESS;
      {
        std::unique_lock<std::mutex> lock = MpiCallLock();
        rc = MPI_Test(&request, &done, &status);
      }
      if (rc != MPI_SUCCESS) {
        if (Status s = give_up(Status::MpiError("MPI_Test", rc)); !s.ok()) return s;
        break;
      }
      if (done) break;
      Status failed = ProgressDeferred(deadline);
      if (failed.ok() && (++polls & 63) == 0) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          failed = ProgressLocked();
        }
        if (failed.ok() && Expired(deadline)) failed = Status::Timeout();
      }
      if (!failed.ok()) {
        if (Status s = give_up(std::move(failed)); !s.ok()) return s;
        break;
      }
      PrefaultOrPause(prefault, pause);
    }
  }
  ch.staged_matched = true;  // for StallReport (recv_mu is held)
  int received = 0;
  if (int rc = MPI_Get_count(&status, MPI_BYTE, &received); rc != MPI_SUCCESS) {
    return Status::MpiError("MPI_Get_count", rc);
  }
  *count = static_cast<size_t>(received);
  return Status::Ok();
}

Status MpiTransport::RecvPostedFirst(ChannelState& ch, int source_rank, int tag, void* out,
                                     size_t bytes, uint64_t desc_hash,
                                     std::chrono::steady_clock::time_point deadline) {
  size_t count = 0;
  if (Status s = PostAndWait(ch, source_rank, tag, static_cast<std::byte*>(out), bytes,
                             nullptr, out, bytes, deadline, &count);
      !s.ok()) {
    return s;
  }
  const Envelope& last = ch.last_header_received;
  if (count == bytes) {  // a bare payload: its header is the last
    bare_receives_.fetch_add(1, std::memory_order_relaxed);
    if (last.desc_hash != desc_hash) return Status::TypeMismatch(bytes, last.Description());
    return Status::Ok();
  }
  if (count != sizeof(Envelope)) {
    return Status::Invalid("corrupt message of " + std::to_string(count) +
                           " bytes (neither a chunk header nor a payload of " +
                           std::to_string(bytes) + " bytes)");
  }
  // A chunk header, in the output's first bytes: what comes next.
  Envelope header;
  std::memcpy(&header, out, sizeof(header));
  if (header.magic != kChunkMagic) return Arrived(header, 0, bytes, desc_hash);
  return TakeChunks(ch, header, source_rank, tag, out, bytes, desc_hash, deadline);
}

Status MpiTransport::RecvSmallPostedFirst(ChannelState& ch, int source_rank, int tag,
                                          void* out, size_t bytes, uint64_t desc_hash,
                                          std::chrono::steady_clock::time_point deadline) {
  // An abandoned receive keeps its own room (ReusableOrNew).
  const std::shared_ptr<PostedRoom> room = ReusableOrNew(ch.recv_room);
  std::byte* const buffer = room->bytes.get();
  size_t count = 0;
  if (Status s = PostAndWait(ch, source_rank, tag, buffer, kPostedRoomBytes, room, out, bytes,
                             deadline, &count);
      !s.ok()) {
    return s;
  }
  // Every message that can come here ends with an Envelope (mpi/framing.h).
  if (count < sizeof(Envelope)) {
    return Status::Invalid("corrupt message of " + std::to_string(count) +
                           " bytes (shorter than its envelope)");
  }
  Envelope trailer;
  std::memcpy(&trailer, buffer + count - sizeof(Envelope), sizeof(trailer));
  if (count == sizeof(Envelope) && trailer.magic == kChunkMagic) {  // a chunk header
    return TakeChunks(ch, trailer, source_rank, tag, out, bytes, desc_hash, deadline);
  }
  const size_t payload = count - sizeof(Envelope);
  Status arrived = Arrived(trailer, payload, bytes, desc_hash);
  if (arrived.ok() && bytes > 0) std::memcpy(out, buffer, bytes);
  return arrived;
}

Status MpiTransport::RecvBare(ChannelState& ch, MPI_Message* message, void* out,
                              size_t bytes, uint64_t desc_hash,
                              std::chrono::steady_clock::time_point deadline) {
  bare_receives_.fetch_add(1, std::memory_order_relaxed);
  // Its header is the channel's last one (AllowsBare): what the sender said then, it says
  // again now.
  const Envelope& header = ch.last_header_received;
  const int count = static_cast<int>(header.total_bytes);  // one chunk: within an int
  return TakePayload(header, out, bytes, desc_hash,
                     [&](std::byte* buffer, std::shared_ptr<void> keep_alive) {
                       return ReceiveMatched(message, buffer, count, deadline,
                                             std::move(keep_alive));
                     });
}

Status MpiTransport::RecvOneMessage(ChannelState& ch, MPI_Message* message, int count,
                                    void* out, size_t bytes, uint64_t desc_hash,
                                    std::chrono::steady_clock::time_point deadline) {
  if (static_cast<size_t>(count) < sizeof(Envelope)) {
    auto scratch = std::make_shared<PooledBuffer>(
        GlobalBufferPool().Acquire(static_cast<size_t>(count)));
    if (Status s = ReceiveMatched(message, scratch->data(), count, deadline, scratch);
        !s.ok()) {
      return s;
    }
    return Status::Invalid("corrupt message of " + std::to_string(count) +
                           " bytes (shorter than its envelope)");
  }
  const size_t payload = static_cast<size_t>(count) - sizeof(Envelope);
  if (payload == bytes && bytes >= kScatterMinBytes) {
    // Straight into the output, the trailer into a buffer of its own: one receive with a
    // datatype of two blocks (its setup costs less than copying the payload once more).
    std::shared_ptr<Envelope> envelope = ReusableEnvelope(ch);
    MPI_Request request = MPI_REQUEST_NULL;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      MPI_Aint displacements[2];
      int rc = MPI_Get_address(out, &displacements[0]);
      if (rc == MPI_SUCCESS) rc = MPI_Get_address(envelope.get(), &displacements[1]);
      if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Get_address", rc);
      const int lengths[2] = {static_cast<int>(bytes), static_cast<int>(sizeof(Envelope))};
      MPI_Datatype type = MPI_DATATYPE_NULL;
      rc = MPI_Type_create_hindexed(2, lengths, displacements, MPI_BYTE, &type);
      if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Type_create_hindexed", rc);
      rc = MPI_Type_commit(&type);
      if (rc == MPI_SUCCESS) rc = MPI_Imrecv(MPI_BOTTOM, 1, type, message, &request);
      MPI_Type_free(&type);  // the pending receive keeps what it needs
      if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Imrecv", rc);
    }
    if (Status s = WaitAll({&request, 1}, deadline, envelope); !s.ok()) return s;
    return Arrived(*envelope, payload, bytes, desc_hash);
  }
  // Small (a copy costs less than a datatype), or not the byte count expected (drained to
  // keep the channel in step): through a buffer of our own, the channel's below
  // kScatterMinBytes (reused from message to message).
  std::shared_ptr<void> keep_alive;
  std::byte* scratch = nullptr;
  if (static_cast<size_t>(count) < kScatterMinBytes + sizeof(Envelope)) {
    ReusableOrNew(ch.recv_scratch);  // an abandoned receive keeps its own
    if (ch.recv_scratch->size() < static_cast<size_t>(count)) {
      ch.recv_scratch->resize(static_cast<size_t>(count));
    }
    scratch = ch.recv_scratch->data();
    keep_alive = ch.recv_scratch;
  } else {
    auto pooled = std::make_shared<PooledBuffer>(
        GlobalBufferPool().Acquire(static_cast<size_t>(count)));
    scratch = pooled->data();
    keep_alive = std::move(pooled);
  }
  if (Status s = ReceiveMatched(message, scratch, count, deadline, std::move(keep_alive));
      !s.ok()) {
    return s;
  }
  Envelope trailer;
  std::memcpy(&trailer, scratch + payload, sizeof(trailer));
  Status arrived = Arrived(trailer, payload, bytes, desc_hash);
  if (arrived.ok() && bytes > 0) std::memcpy(out, scratch, bytes);
  return arrived;
}

}  // namespace jcm
