// Setup of the MPI transport: its communicators, what it learns about the library, and the
// per-channel state.
#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <thread>

#include "common/config.h"
#include "mpi/internal.h"
#include "mpi/transport.h"

namespace jcm {

std::string MpiErrorText(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) {
    return "MPI error code " + std::to_string(rc);
  }
  return std::string(text, len);
}

namespace {

// MPI_Comm_dup is collective: a rank that never gets there would hold the others in it
// for good. MPI_Comm_idup, tested until `deadline`, fails instead (the request of a
// collective cannot be cancelled: it is left to MPI, with its communicator).
Status DupWithDeadline(MPI_Comm comm, MPI_Comm* dup, Clock::time_point deadline) {
  MPI_Request request = MPI_REQUEST_NULL;
  if (int rc = MPI_Comm_idup(comm, dup, &request); rc != MPI_SUCCESS) {
    return Status::MpiError("MPI_Comm_dup", rc);
  }
  Backoff backoff;
  while (true) {
    int done = 0;
    if (int rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
      return Status::MpiError("MPI_Comm_dup", rc);
    }
    if (done) return Status::Ok();
    if (Clock::now() > deadline) {
      *dup = MPI_COMM_NULL;
      return Status::Invalid(
          "MPI_Comm_dup of the communicator did not complete in time: a rank did not "
          "attach MPI");
    }
    backoff.Pause();
  }
}

// The cores this process may run on (its affinity mask, which mpirun's binding narrows), or
// the machine's when the mask cannot be read.
int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    if (int n = CPU_COUNT(&set); n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

// Every device of every rank on the node may be waiting or computing at once: more of them
// than the cores the node's ranks run on means a spinning waiter takes a core from the
// thread it waits for; so do more devices than this rank's own cores. Ranks bound to a core
// each (mpirun -bind-to core) count the node's cores, not their own one: a waiter then
// spins on its own core and takes none from its peer.
WaitChoice ChooseWait(WaitChoice wait) {
  wait.local_devices = std::max(wait.local_devices, 1);
  wait.node_ranks = std::max(wait.node_ranks, 1);
  const int own = UsableCores();
  wait.cores = wait.node_cores > 0 ? std::max(wait.node_cores, own) : own;
  switch (wait.policy) {
    case WaitPolicy::kSpin: wait.sleeps_soon = false; break;
    case WaitPolicy::kSleep: wait.sleeps_soon = true; break;
    case WaitPolicy::kAuto:
      wait.sleeps_soon = int64_t{wait.node_ranks} * wait.local_devices > wait.cores ||
                         wait.local_devices > own;
      break;
  }
  return wait;
}

int NoteFinalizeBegun(MPI_Comm /*comm*/, int /*keyval*/, void* /*value*/, void* /*extra*/) {
  g_finalize_begun.store(true, std::memory_order_release);
  return MPI_SUCCESS;
}

}  // namespace

void WatchFinalize() {
  static const bool watched = [] {
    int keyval = MPI_KEYVAL_INVALID;
    if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, NoteFinalizeBegun, &keyval, nullptr) !=
        MPI_SUCCESS) {
      return false;
    }
    if (MPI_Comm_set_attr(MPI_COMM_SELF, keyval, nullptr) != MPI_SUCCESS) return false;
    g_finalize_watched.store(true, std::memory_order_release);
    return true;
  }();
  (void)watched;
}

Status MpiTransport::Create(MPI_Comm comm, std::vector<int> rank_of_process,
                            Clock::time_point deadline, WaitChoice wait,
                            std::unique_ptr<MpiTransport>* out) {
  if (!MpiIsUsable()) return Status::Invalid("MPI is not initialized (or already finalized)");
  WatchFinalize();
  auto t = std::make_unique<MpiTransport>(PrivateTag{});
  static std::atomic<uint64_t> last_id{0};
  t->id_ = ++last_id;
  // Chosen first: the duplications and the clock sync below wait too.
  t->wait_choice_ = ChooseWait(wait);
  g_wait_mode.store(static_cast<int>(t->wait_choice_.mode()), std::memory_order_relaxed);
  if (Status s = DupWithDeadline(comm, &t->comm_, deadline); !s.ok()) return s;
  // Errors on our communicator come back as codes, never abort the job behind our back.
  int rc = MPI_Comm_set_errhandler(t->comm_, MPI_ERRORS_RETURN);
  if (rc != MPI_SUCCESS) return Status::MpiError("MPI_Comm_set_errhandler", rc);
  for (MPI_Comm* extra : {&t->ctrl_comm_, &t->direct_comm_, &t->coll_comm_}) {
    // Each inherits the error handler.
    if (Status s = DupWithDeadline(t->comm_, extra, deadline); !s.ok()) return s;
  }
  if ((rc = MPI_Comm_rank(t->comm_, &t->rank_)) != MPI_SUCCESS) {
    return Status::MpiError("MPI_Comm_rank", rc);
  }
  if ((rc = MPI_Comm_size(t->comm_, &t->size_)) != MPI_SUCCESS) {
    return Status::MpiError("MPI_Comm_size", rc);
  }
  void* attr = nullptr;
  int flag = 0;
  if ((rc = MPI_Comm_get_attr(t->comm_, MPI_TAG_UB, &attr, &flag)) != MPI_SUCCESS) {
    return Status::MpiError("MPI_Comm_get_attr(MPI_TAG_UB)", rc);
  }
  if (flag && attr) t->tag_ub_ = *static_cast<int*>(attr);
  int provided = MPI_THREAD_SINGLE;
  if ((rc = MPI_Query_thread(&provided)) != MPI_SUCCESS) {
    return Status::MpiError("MPI_Query_thread", rc);
  }
  t->thread_multiple_ = provided >= MPI_THREAD_MULTIPLE;
  t->rank_of_process_ = std::move(rank_of_process);
  // Every rank is here (the duplications completed): line the clocks up for the timeline,
  // on a communicator of its own so that no early psend of a faster rank can match.
  MPI_Comm clock_comm = MPI_COMM_NULL;
  if (Status s = DupWithDeadline(t->comm_, &clock_comm, deadline); !s.ok()) return s;
  Status synced = MeasureClockOffset(clock_comm, deadline, &t->clock_offset_);
  (void)MPI_Comm_free(&clock_comm);
  if (!synced.ok()) return synced.WithPrefix("measuring the clock offsets: ");
  *out = std::move(t);
  return Status::Ok();
}

MpiTransport::~MpiTransport() {
  if (!MpiIsUsable()) return;
  for (auto& [key, group] : group_comms_) {
    for (PersistentCall& p : group->persistent) {
      if (p.request != MPI_REQUEST_NULL) (void)MPI_Request_free(&p.request);  // inactive
    }
    if (group->comm != MPI_COMM_NULL) (void)MPI_Comm_free(&group->comm);
  }
  for (MPI_Comm* comm : {&ctrl_comm_, &direct_comm_, &coll_comm_, &comm_}) {
    // Local in practice (it marks the communicator for freeing, it waits for no peer). A
    // failure has nobody to report to (the transport is going away) and leaves nothing to
    // undo: the communicator is at worst leaked until MPI_Finalize.
    if (*comm != MPI_COMM_NULL) (void)MPI_Comm_free(comm);
  }
}

int MpiTransport::RankOfProcess(int64_t process_index) const {
  if (process_index < 0 || process_index >= static_cast<int64_t>(rank_of_process_.size())) {
    return -1;
  }
  return rank_of_process_[process_index];
}

std::unique_lock<std::mutex> MpiTransport::MpiCallLock() {
  std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
  if (!thread_multiple_) lock.lock();  // this MPI only takes one thread at a time
  return lock;
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
    if (!slot) {
      slot = std::make_unique<ChannelState>();
      slot->peer_rank = peer_rank;
    }
    channel = slot.get();
  }
  cache[next_slot] = {id_, peer_rank, tag, channel};
  next_slot = (next_slot + 1) % kCached;
  return *channel;
}

uint64_t WaitYields() { return g_wait_yields.load(std::memory_order_relaxed); }
uint64_t WaitSleeps() { return g_wait_sleeps.load(std::memory_order_relaxed); }

}  // namespace jcm
