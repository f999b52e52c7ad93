// Collectives between processes: one communicator per group of devices, nonblocking
// MPI calls polled against a deadline (see MpiTransport::Allreduce in mpi/transport.h).
#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/config.h"
#include "mpi/internal.h"
#include "mpi/transport.h"

namespace jcm {

Status MpiTransport::GroupComm(const std::string& key, const std::vector<int>& ranks,
                               GroupHandle& handle, GroupEntry** out,
                               std::chrono::steady_clock::time_point deadline) {
  // The caller's handle: a device thread runs the same few call sites over and over, and
  // each keeps its group. Entries are never erased, and a transport's id is never reused,
  // so a handle of this transport is always valid.
  if (handle.transport_ == id_) [[likely]] {
    *out = handle.entry_;
    return Status::Ok();
  }
  auto remember = [&](GroupEntry* entry) {
    handle.transport_ = id_;
    handle.entry_ = entry;
  };
  {
    std::lock_guard<std::mutex> lock(group_comms_mu_);
    auto it = group_comms_.find(key);
    if (it != group_comms_.end()) {
      *out = it->second.get();
      remember(*out);
      return Status::Ok();
    }
  }
  // Only the device thread that leads this group's round gets here, and rounds of one
  // group never overlap, so no other thread creates the same key meanwhile.
  // Concurrent creations by other threads of this process (other groups) are told apart
  // by the group and the tag; the key is the same string on every process of the group.
  const int tag = static_cast<int>(std::hash<std::string>{}(key) %
                                   static_cast<size_t>(std::max<int64_t>(tag_ub_, 1)));
  // MPI_Comm_create_group blocks until every process of the group calls it, with no
  // deadline: first a token from and to every other process of the group, polled against
  // the collective's deadline, so that a peer that never comes fails here, in time.
  {
    int me = -1;
    if (int rc = MPI_Comm_rank(coll_comm_, &me); rc != MPI_SUCCESS) {
      return Status::MpiError("MPI_Comm_rank", rc);
    }
    auto tokens = std::make_shared<std::vector<char>>(ranks.size() + 1, 0);
    std::vector<MPI_Request> requests;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      for (size_t i = 0; i < ranks.size(); ++i) {
        if (ranks[i] == me) continue;
        MPI_Request r = MPI_REQUEST_NULL;
        int rc = MPI_Irecv(tokens->data() + i, 1, MPI_CHAR, ranks[i], tag, coll_comm_, &r);
        if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Irecv", rc);
        requests.push_back(r);
        rc = MPI_Isend(tokens->data() + ranks.size(), 1, MPI_CHAR, ranks[i], tag, coll_comm_,
                       &r);
        if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Isend", rc);
        requests.push_back(r);
      }
    }
    Backoff backoff;
    while (!requests.empty()) {
      int done = 0;
      {
        std::unique_lock<std::mutex> lock = MpiCallLock();
        int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                             MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Testall", rc);
      }
      if (done) break;
      if (Expired(deadline)) {
        size_t cancelled = 0;
        bool abandoned = false;
        Status s = CancelWithGrace(requests, &cancelled, &abandoned, tokens);
        if (!s.ok() && !abandoned) return s;
        if (cancelled != 0 || abandoned) {
          return Status::Timeout("its group's communicator, created at the group's first "
                                 "collective, was not created in time");
        }
        break;  // every token arrived, just in time
      }
      backoff.Pause();
    }
  }
  MPI_Group parent_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  int rc = MPI_Comm_group(coll_comm_, &parent_group);
  if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Comm_group", rc);
  rc = MPI_Group_incl(parent_group, static_cast<int>(ranks.size()), ranks.data(), &group);
  (void)MPI_Group_free(&parent_group);
  if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Group_incl", rc);
  MPI_Comm comm = MPI_COMM_NULL;
  rc = MPI_Comm_create_group(coll_comm_, group, tag, &comm);
  (void)MPI_Group_free(&group);
  if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Comm_create_group", rc);
  auto entry = std::make_unique<GroupEntry>();
  entry->comm = comm;
  std::lock_guard<std::mutex> lock(group_comms_mu_);
  auto& slot = group_comms_[key];
  slot = std::move(entry);
  *out = slot.get();
  remember(*out);
  return Status::Ok();
}

namespace {

// How long a small collective's wait spins before it yields, per thread: AdaptiveSpin
// (mpi/internal.h). The peer's reply takes a round trip of a few us when each
// rank has a core; but where the scheduler put both ranks on one core (unbound ranks now
// and then, a node with more busy threads than cores) the peer runs only once this thread
// yields, so every poll of the spin is lost: it was most of a small collective's time
// there (the wait's own spin, kSpinFor or kSoonSpins polls, against MPICH's blocking
// call, which yields sooner). With several devices
// per process only for waits of up to kAdaptiveSpinBytes (with one, larger waits adapt a
// budget of their own: PollCollective). From 16 KiB (beyond MPICH's eager cells) a wait
// with each rank on its own core already outlasts the spin often enough to halve it away:
// with 2 devices per rank on a quiet 2-core node the 16-64 KiB psum then yielded 4-5 times
// an op, 9-11 context switches instead of 1 (benchmarks/wait_placement.py --devices 2),
// where the fixed spin kept 1. JAX_CPU_MPI_WAIT=spin keeps its long spin.
constexpr size_t kAdaptiveSpinBytes = size_t{8} << 10;

}  // namespace

Status MpiTransport::PollCollective(MPI_Request* request, const char* name, size_t bytes,
                                    std::chrono::steady_clock::time_point deadline,
                                    std::shared_ptr<void> keep_alive) {
  Backoff backoff(bytes);
  // A larger wait adapts its spin too where the process has one device, with a budget of
  // its own (a thread that alternates small and large collectives keeps the small ones'
  // spin). MPICH's own blocking wait polls and yields as soon as a poll moved nothing
  // (MPID_Progress_wait). Beyond its CMA threshold (8 KiB) a collective is a few
  // handshakes around one process_vm_readv per peer, each run by an MPI_Test of one side:
  // where both ranks share a core, every handshake waited out this rank's whole spin
  // (kSpinFor in kBounded, kSoonSpins polls in kSoon) before the peer could run: that
  // spin was what all_gather / all_to_all of 32 KiB to 2 MiB lost to MPI's blocking call
  // there (benchmarks/polled_wait.c: a polled MPI_Iallgather with and without it; and
  // benchmarks/wait_placement.py --op all_gather under taskset: docs/benchmarks.md). With
  // a core per rank a large wait outlasts the spin and halves it away as well (its polls
  // are the transfer's own, and a yield there finds no other thread to run), while a wait
  // that ends within the spin keeps it. Not with several devices per process: there a
  // yield hands the core to a sibling device thread (above).
  thread_local AdaptiveSpin adaptive, adaptive_large;
  const bool small = bytes <= kAdaptiveSpinBytes;
  const bool adapts =
      !backoff.spins_long() && (small || wait_choice_.local_devices == 1);
  AdaptiveSpin& spin = small ? adaptive : adaptive_large;
  const int64_t spin_ns = adapts ? spin.Begin() : -1;
  bool spinning = adapts;
  std::chrono::steady_clock::time_point spin_start{};
  for (uint32_t polls = 1;; ++polls) {
    int finished = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      int rc = MPI_Test(request, &finished, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return Status::MpiError(std::string(name) + " (test)", rc);
    }
    if (finished) {
      if (adapts) spin.End(spin_ns, spinning);
      return Status::Ok();
    }
    // The clock every 16 polls: a small collective completes within a few, and reading the
    // clock at each was a tenth of its time on our side.
    // The deadline (or the exit's close), or another operation abandoned a request.
    if ((polls & 15) == 0) {
      const bool expired = Expired(deadline);
      if (expired || broken()) {
        // A collective cannot be cancelled: the request may still write into its buffers.
        Abandon(std::span<MPI_Request>(request, 1), std::move(keep_alive));
        if (expired) return Status::Timeout(std::string(name) + " did not complete");
        (void)TakeAbandonedOnThisThread();  // an effect of the break, not its cause
        return Status::Invalid(BrokenMessage());
      }
    }
    if (spinning) {
      // The clock at the first poll that found nothing, then every 16 polls.
      if (polls == 1) {
        spin_start = std::chrono::steady_clock::now();
        backoff.Waiting();
      }
      if (spin_ns > 0 && ((polls & 15) != 0 ||
                          std::chrono::steady_clock::now() - spin_start <
                              std::chrono::nanoseconds(spin_ns))) {
        continue;
      }
      spinning = false;
      backoff.SkipSpin();
    }
    backoff.Pause();
  }
}

Status MpiTransport::Allreduce(const std::string& key, const std::vector<int>& ranks,
                               GroupHandle& handle, const void* send, void* buf,
                               int64_t count, MPI_Datatype type, MPI_Op op,
                               std::chrono::steady_clock::time_point deadline) {
  if (Status s = Usable(); !s.ok()) return s;
  if (count == 0) return Status::Ok();  // the same shape on every rank: none calls MPI
  GroupEntry* group = nullptr;
  if (Status s = GroupComm(key, ranks, handle, &group, deadline); !s.ok()) return s;
  int type_size = 0;
  if (int rc = MPI_Type_size(type, &type_size); rc != MPI_SUCCESS) {
    return Status::MpiError("MPI_Type_size", rc);
  }
  // MPI counts are ints: more elements go as several reductions of at most kMaxCount.
  constexpr int64_t kMaxCount = int64_t{1} << 30;
#if MPI_VERSION >= 4
  // Small messages: MPICH's nonblocking schedule costs about as much as the message.
  if (static_cast<size_t>(count * type_size) <= kPersistentBytes) {
    PersistentId id;
    id.count = count;
    id.type = type;
    id.op = op;
    id.recv_bytes = static_cast<size_t>(count) * static_cast<size_t>(type_size);
    // Captures one reference: std::function keeps it without allocating.
    return PersistentOn(group, "MPI_Allreduce (persistent)", id,
                        [&id](MPI_Comm comm, void*, void* recv, MPI_Request* r) {
                          return MPI_Allreduce_init(MPI_IN_PLACE, recv,
                                                    static_cast<int>(id.count), id.type, id.op,
                                                    comm, MPI_INFO_NULL, r);
                        },
                        nullptr, send ? send : buf, buf, deadline);
  }
#endif
  auto* bytes = static_cast<std::byte*>(buf);
  const auto* send_bytes = static_cast<const std::byte*>(send);
  for (int64_t done = 0; done < count;) {
    const int n = static_cast<int>(std::min(count - done, kMaxCount));
    MPI_Request request = MPI_REQUEST_NULL;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      const void* from = send_bytes ? send_bytes + done * type_size : MPI_IN_PLACE;
      int rc = MPI_Iallreduce(from, bytes + done * type_size, n, type, op, group->comm,
                              &request);
      if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Iallreduce", rc);
    }
    Status s = PollCollective(&request, "MPI_Iallreduce", static_cast<size_t>(n) *
                              static_cast<size_t>(type_size), deadline, nullptr);
    if (!s.ok()) return s;
    done += n;
  }
  return Status::Ok();
}

Status MpiTransport::Collective(const std::string& key, const std::vector<int>& ranks,
                                GroupHandle& handle, const char* name,
                                const std::function<int(MPI_Comm, MPI_Request*)>& start,
                                size_t bytes, std::chrono::steady_clock::time_point deadline,
                                std::shared_ptr<void> keep_alive) {
  if (Status s = Usable(); !s.ok()) return s;
  GroupEntry* group = nullptr;
  if (Status s = GroupComm(key, ranks, handle, &group, deadline); !s.ok()) return s;
  MPI_Request request = MPI_REQUEST_NULL;
  {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    if (int rc = start(group->comm, &request); rc != MPI_SUCCESS) {
      return Status::MpiError(name, rc);
    }
  }
  return PollCollective(&request, name, bytes, deadline, std::move(keep_alive));
}

Status MpiTransport::Exchange(const std::string& key, const std::vector<int>& ranks,
                              GroupHandle& handle, const char* name,
                              std::span<const Piece> sends, std::span<const Piece> recvs,
                              size_t bytes, std::chrono::steady_clock::time_point deadline,
                              std::shared_ptr<void> keep_alive) {
  if (Status s = Usable(); !s.ok()) return s;
  GroupEntry* group = nullptr;
  if (Status s = GroupComm(key, ranks, handle, &group, deadline); !s.ok()) return s;
  constexpr int kTag = 0;
  thread_local std::vector<MPI_Request> requests;
  requests.assign(recvs.size() + sends.size(), MPI_REQUEST_NULL);
  {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    // Receives first: a send whose receive is posted moves straight into its buffer.
    size_t k = 0;
    int rc = MPI_SUCCESS;
    const char* failed = "";
    for (const Piece& p : recvs) {
      rc = MPI_Irecv(p.data, static_cast<int>(p.bytes), MPI_BYTE, p.peer, kTag, group->comm,
                     &requests[k++]);
      if (rc != MPI_SUCCESS) {
        failed = "MPI_Irecv";
        break;
      }
    }
    for (size_t i = 0; rc == MPI_SUCCESS && i < sends.size(); ++i) {
      const Piece& p = sends[i];
      rc = MPI_Isend(p.data, static_cast<int>(p.bytes), MPI_BYTE, p.peer, kTag, group->comm,
                     &requests[k++]);
      if (rc != MPI_SUCCESS) failed = "MPI_Isend";
    }
    if (rc != MPI_SUCCESS) {
      lock.unlock();
      // Those posted must not write into the buffers after this returns.
      size_t cancelled = 0;
      bool abandoned = false;
      (void)CancelWithGrace(requests, &cancelled, &abandoned, std::move(keep_alive));
      return Status::MpiError(std::string(name) + " (" + failed + ")", rc);
    }
  }
  Backoff backoff(bytes);
  for (uint32_t polls = 1;; ++polls) {
    int done = 0;
    {
      std::unique_lock<std::mutex> lock = MpiCallLock();
      int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                           MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) return Status::MpiError(std::string(name) + " (test)", rc);
    }
    if (done) return Status::Ok();
    if ((polls & 15) == 0) {
      const bool expired = Expired(deadline);
      if (expired || broken()) {
        // Never leave a receive pointing into a buffer that XLA will reuse, unless MPI
        // cannot cancel it (then the transport is broken, see Abandon).
        size_t cancelled = 0;
        bool abandoned = false;
        Status s = CancelWithGrace(requests, &cancelled, &abandoned, std::move(keep_alive));
        if (!s.ok() && !abandoned) return s;
        if (cancelled == 0 && !abandoned) return Status::Ok();  // all done, just in time
        if (!expired) {
          (void)TakeAbandonedOnThisThread();  // an effect of the break, not its cause
          return Status::Invalid(BrokenMessage());
        }
        return Status::Timeout(std::string(name) + " did not complete");
      }
    }
    backoff.Pause();
  }
}

Status MpiTransport::PersistentCollective(
    const std::string& key, const std::vector<int>& ranks, GroupHandle& handle,
    const char* name, const PersistentId& id,
    const std::function<int(MPI_Comm, void*, void*, MPI_Request*)>& init,
    const void* send, const void* recv_init, void* recv,
    std::chrono::steady_clock::time_point deadline) {
  if (Status s = Usable(); !s.ok()) return s;
  GroupEntry* group = nullptr;
  if (Status s = GroupComm(key, ranks, handle, &group, deadline); !s.ok()) return s;
  return PersistentOn(group, name, id, init, send, recv_init, recv, deadline);
}

Status MpiTransport::PersistentOn(
    GroupEntry* group, const char* name, const PersistentId& id,
    const std::function<int(MPI_Comm, void*, void*, MPI_Request*)>& init, const void* send,
    const void* recv_init, void* recv, std::chrono::steady_clock::time_point deadline) {
#if MPI_VERSION >= 4
  auto& cache = group->persistent;
  auto it = std::find_if(cache.begin(), cache.end(),
                         [&](const PersistentCall& p) { return p.id == id; });
  {
    std::unique_lock<std::mutex> lock = MpiCallLock();
    if (it == cache.end()) {
      constexpr size_t kPerGroup = 4;
      if (cache.size() >= kPerGroup) {
        (void)MPI_Request_free(&cache.front().request);  // inactive: freed at once
        cache.erase(cache.begin());
      }
      std::shared_ptr<std::byte[]> mine(
          std::make_unique_for_overwrite<std::byte[]>(id.send_bytes + id.recv_bytes));
      MPI_Request r = MPI_REQUEST_NULL;
      if (int rc = init(group->comm, mine.get(), mine.get() + id.send_bytes, &r);
          rc != MPI_SUCCESS) {
        return Status::MpiError(name, rc);
      }
      cache.push_back({id, std::move(mine), r});
      it = cache.end() - 1;
    }
    std::byte* const buf = it->buf.get();
    if (id.send_bytes != 0) std::memcpy(buf, send, id.send_bytes);
    if (recv_init != nullptr) std::memcpy(buf + id.send_bytes, recv_init, id.recv_bytes);
    if (int rc = MPI_Start(&it->request); rc != MPI_SUCCESS) {
      return Status::MpiError(std::string("MPI_Start (") + name + ")", rc);
    }
  }
  Status s = PollCollective(&it->request, name, id.send_bytes + id.recv_bytes, deadline,
                            it->buf);
  if (!s.ok()) {
    if (it->request == MPI_REQUEST_NULL) cache.erase(it);  // abandoned at the deadline
    return s;
  }
  std::memcpy(recv, it->buf.get() + id.send_bytes, id.recv_bytes);
  return Status::Ok();
#else
  (void)group, (void)id, (void)init, (void)send, (void)recv_init, (void)recv, (void)deadline;
  return Status::Invalid(std::string(name) + ": persistent collectives need MPI 4");
#endif
}

}  // namespace jcm
