// MPI transport: point-to-point between processes on a communicator owned by this package
// (a duplicate of MPI_COMM_WORLD made by mpi4py, never the user's communicator).
//
// Small messages are copy-and-Isend: a psend copies its operand into a buffer the transport
// owns and returns without waiting for the receiver, so that two devices that both send
// before they receive never deadlock, whatever the message size. The bytes of undelivered
// sends are bounded (Config::max_inflight_bytes). Large staged messages are framed in
// chunks (mpi/framing.h). Receives probe with a deadline (MPI_Improbe), or post their receive
// first where no message can be larger than its room (a small receive: RecvSmallPostedFirst)
// and cancel it at the deadline, so a receive that nothing matches fails instead of hanging,
// and check the byte count and the sender's description of its operand (dtype and shape:
// every staged message carries a hash of it, mpi/framing.h), so that a float32[4] never
// lands in an int32[4] as garbage.
//
// Messages of kRendezvousMinBytes or more may skip the copy (rendezvous), and those of
// kKeptRendezvousMinBytes or more whose psend's operand is kept go framed below (see Send and
// SentFramed). Both ends number
// the messages of each channel (sequence numbers, one counter per direction and channel).
// A receiver that reaches its precv before the message posts its receives straight into
// its output buffer (on direct_comm_) and sends the sender a ready signal {sequence number,
// byte count, description hash} (on ctrl_comm_). A sender that holds the ready signal of
// *this* message, with its own byte count and description hash, sends straight from its
// operand (MPI_Issend, so a completed send means the receives matched) and returns once
// that send completes. Otherwise it starts
// staging: it copies its operand into a transport buffer step by step, looking for the
// ready signal between steps, so it waits for a late receiver at most about one copy's
// time, and never for one that is not coming; when the copy is done it sends the staged
// copy as above. Ready signals of older messages (the receiver got them staged) are
// discarded by sequence number, so one never matches a later message. A receiver whose
// message arrives staged cancels its direct receives, which cannot have matched: the
// sender takes exactly one of the two paths per message. A byte-count or description
// mismatch is always sent staged, so the receiver reports it as on the plain path.
// A psend of an op in which its device also receives (an exchange, a ring) does not stage
// for a receiver that is not ready: from kRendezvousMinBytes on it defers the send
// (DirectSend; below that it is framed, see SentFramed), and the receive loops
// post it straight from the operand when the ready signal comes (ProgressDeferred), so both
// directions move at once; the precv that keeps the operand stages what is still deferred.
// A receive made while a send of ours is deferred (to its peer, or in a ring to the next
// rank) signals ready first and posts its receives only once the sends deferred before it are
// posted (RecvLarge), so that MPI cannot copy the peer's message in before our send has
// started.
// A kept psend whose device receives nothing in the op's group (one-way: a hop, a stream, a
// pipeline's first stage) takes none of these paths from kKeptRendezvousMinBytes on, nor
// does a kept psend of a cycle below kRendezvousMinBytes (SentFramed): it sends the staged
// framing (a chunk header, then the payload) straight from its operand at once, without
// looking for a ready signal (SendFramed), and the receiver, which knows from the op's
// group that its sender is one-way (in a cycle, from the size), takes it the staged way
// and signals nothing. The ready signal's trip sat on every such hop's path (the receiver
// signals only once it has taken the previous message, when the sender is already sending
// the next; in a cycle both sends waited for it),
// and a receiver not yet ready got a staging copy. The price: MPI cannot cancel a send,
// so the precv that keeps the operand waits until the receiver has taken the bytes (its
// precv of the same op), however late it comes, up to the timeout; the sender no longer
// runs ahead of a one-way stream by more than the message in flight.
// XLA's thunk executor skips every thunk after one fails, so the precv that keeps the
// operand may never run: an op of ours that fails finishes the kept sends of its program
// run (XLA's RunId) before it returns, while their operands are still alive
// (KeptSends::FinishRun). Still open: a failure of a thunk that is not ours (a host
// callback, an XLA op) skips the precv without that, and the entry keeps pointing into an
// operand XLA frees when the program ends.
//
// Every wait has a deadline, matched receives included: requests are tested in a loop
// (never MPI_Wait/MPI_Mrecv/MPI_Recv), and at the deadline they are cancelled and tested
// for a short grace period. A request that still has not completed then has matched a
// message whose sender has stopped mid-message (a dead link, a stopped process): MPI cannot
// cancel it, and no wait would end. It is abandoned (kept, never waited on again: see
// Abandon), the operation fails with its usual timeout error and the transport is marked
// broken (broken(); the extension's job_broken()): if that sender ever resumes, MPI may still
// write the rest of the message into the abandoned receive's buffer, which may be an XLA
// buffer by then reused, so the job should end rather than go on.
//
// The code is split by concern: mpi/setup.cc (communicators, channels), mpi/send_queue.cc
// (staged sends, the in-flight bound, progress), mpi/rendezvous.cc (direct path),
// mpi/receive.cc (staged receives, waits and cancellation), mpi/drain.cc (exit),
// mpi/stall_report.cc (what a timeout's error tells of the transport).
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/buffer_pool.h"
#include "common/status.h"
#include "mpi/clock_sync.h"
#include "mpi/framing.h"

namespace jcm {

class Backoff;         // mpi/internal.h
class OutputPrefault;  // common/keep_freed_memory.h
class AdaptedPause;    // mpi/internal.h

// Locking:
//   mu_            pending_, has_pending_ (written), inflight_bytes_, the counters
//                  (sends_completed_, peak_inflight_bytes_, direct_sends_,
//                  staged_large_sends_), control_sends_, direct_in_flight_, abandoned_
//                  and each DirectSend::done; also every MPI call when the library is not
//                  MPI_THREAD_MULTIPLE (MpiCallLock()).
//   channels_mu_   channels_ (the map only: a ChannelState is never erased, so a reference
//                  to one stays valid without the lock).
//   ChannelState::send_mu  that channel's next_send_seq, has_early_ready, early_ready; held
//                  for a whole Send, so one psend per channel runs at a time.
//   ChannelState::recv_mu  that channel's next_recv_seq; held for a whole Recv.
//   Order: a channel's send_mu/recv_mu before mu_; channels_mu_ is a leaf (taken last,
//   never with another taken after it).
//   Set once by Create, read without a lock: the communicators, rank_, size_, tag_ub_,
//   thread_multiple_, rank_of_process_, clock_offset_, wait_choice_, id_. has_pending_ is
//   read without a lock, broken_ is an atomic.
// How the transport's polling loops wait for a peer (JAX_CPU_MPI_WAIT): kAuto spins briefly
// and then sleeps soon when this node runs more busy threads (ranks x devices) than it has
// cores, and otherwise spins and yields for a bounded time before it sleeps; kSpin spins and
// yields long; kSleep always sleeps soon (Backoff in mpi/internal.h).
enum class WaitPolicy { kAuto, kSpin, kSleep };
// What a policy comes to on this node (Backoff in mpi/internal.h says how each one waits):
// kBounded (auto, a core per busy thread), kLong (spin), kSoon (sleep, or more busy threads
// than cores).
enum class WaitMode : int { kBounded = 0, kLong = 1, kSoon = 2 };

// Where set (a WaitMode, >= 0), how this thread's polling waits behave instead of the
// process's mode: a device that leads its process's meeting while every other device of
// the meeting parked (ffi/collective_handlers.cc) is its process's only busy thread, so on
// a node that has a core per rank its waits need not sleep soon. (Set by ScopedWaitMode.)
inline thread_local int t_wait_mode = -1;
class ScopedWaitMode {
 public:
  explicit ScopedWaitMode(int mode) : saved_(t_wait_mode) { t_wait_mode = mode; }
  ~ScopedWaitMode() { t_wait_mode = saved_; }
  ScopedWaitMode(const ScopedWaitMode&) = delete;
  ScopedWaitMode& operator=(const ScopedWaitMode&) = delete;

 private:
  int saved_;
};

// Yields and sleeps of every polling wait of the process so far (jax_cpu_mpi.stats()).
uint64_t WaitYields();
uint64_t WaitSleeps();

// What Create learned about the node, and the wait it chose.
struct WaitChoice {
  WaitPolicy policy = WaitPolicy::kAuto;
  int local_devices = 1;  // devices of this process (its busy threads)
  int node_ranks = 1;     // ranks of the job on this node (from their host names)
  int node_cores = 0;     // cores the node's ranks may run on together (the union of their
                          // affinity masks; 0: unknown, this process's own are used)
  int cores = 1;          // node_cores, or this process's own (filled in by Create)
  bool sleeps_soon = false;

  // How every polling wait of the process then behaves (Backoff, mpi/internal.h).
  WaitMode mode() const {
    if (sleeps_soon) return WaitMode::kSoon;
    return policy == WaitPolicy::kSpin ? WaitMode::kLong : WaitMode::kBounded;
  }
};

class MpiTransport {
 private:
  struct GroupEntry;  // a group's communicator (below)

 public:
  // `comm` is duplicated again, so the transport owns its communicator; `rank_of_process`
  // maps jax.process_index() to the rank in `comm`. Fails if the duplication (collective)
  // has not completed by `deadline`.
  // `wait` (policy, local_devices, node_ranks) says how waits should go; Create counts the
  // cores, decides, and applies the choice to every wait of the process.
  static Status Create(MPI_Comm comm, std::vector<int> rank_of_process,
                       std::chrono::steady_clock::time_point deadline, WaitChoice wait,
                       std::unique_ptr<MpiTransport>* out);
  struct PrivateTag {};
  explicit MpiTransport(PrivateTag) {}
  ~MpiTransport();
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;

  // Whether a request was abandoned (see the top of this file): the job should end.
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  // Whether an operation may call MPI: MPI is initialized and not finalized, and no request
  // was abandoned. Once one was, every MPI call progresses MPI, which could complete the
  // abandoned request into a buffer XLA has freed or reused since (calls in flight go on
  // after the first one failed): operations fail at once instead. The exit's drain still
  // meets the other ranks.
  Status Usable() const;
  // Usable's error once broken: kMpiBroken, and the error of the operation that broke the
  // transport (NoteBreak) so that every later error names the cause, not only its effect.
  std::string BrokenMessage() const;
  // Keeps `error`, the error of an operation that broke the transport, for BrokenMessage;
  // only the first one counts (the others are effects of the same stopped peer).
  void NoteBreak(std::string_view error);
  // Whether this thread abandoned a request (Abandon) since the last call, which clears it:
  // the op that failed on this thread is then the one that broke the transport. A thread
  // flag, as only the op layer (cpp/ffi) knows the op and its peer, and only on failure.
  static bool TakeAbandonedOnThisThread();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int64_t tag_ub() const { return tag_ub_; }
  // This process's steady clock against rank 0's, measured by Create (for the timeline).
  const ClockOffset& clock_offset() const { return clock_offset_; }
  // How waits go, as Create chose.
  const WaitChoice& wait_choice() const { return wait_choice_; }
  // Unique per transport in the process, never reused: what a cache of something derived
  // from a transport keys on (an address can come back for a later transport).
  uint64_t id() const { return id_; }
  // The MPI rank of a JAX process, or -1 if unknown.
  int RankOfProcess(int64_t process_index) const;

  // A direct send (straight from the operand) in flight.
  // A send whose receiver was not ready when its psend ran may also be *deferred*: nothing
  // posted yet, the operand kept, the message's details below. The receive loops of the
  // process post it straight from the operand as soon as the receiver's ready signal comes
  // (ProgressDeferred), so that two ranks that both send before they receive exchange
  // without a staging copy, both directions at once; the precv that keeps the operand
  // posts or stages what is still deferred (FinishDirect), as the psend would have.
  struct DirectSend {
    std::vector<MPI_Request> requests;
    bool done = false;  // under mu_
    std::chrono::steady_clock::time_point posted_for_test;  // mpi/stop_for_test.h
    // Where it goes, set when it is deferred or posted (PostFromOperand), under mu_ once
    // in direct_in_flight_: for the exit's report of sends never received.
    int dest_rank = 0, tag = 0;
    size_t bytes = 0;
    // Deferred sends only (the fields are set once by Send, read under the channel's
    // send_mu; `deferred` is cleared under it when the send is posted or staged).
    bool deferred = false;
    void* channel = nullptr;  // its ChannelState
    uint64_t seq = 0;
    const void* data = nullptr;
    std::string desc_text;
    uint64_t desc_hash = 0;
    uint64_t max_inflight_bytes = 0;
    std::chrono::steady_clock::time_point deferred_at;
    Status failed;  // under mu_: why a deferred send could not be posted (with done)
    // A one-way send framed from its operand (SendFramed): its chunk header, which its first
    // request sends; the receiver never signalled for it. Held in the record itself (no
    // allocation of its own).
    std::optional<Envelope> header;
    // With `header`: sent without it (bare), the header being the channel's last one, which
    // the receiver kept (ChannelState::last_header_sent, mpi/framing.h).
    bool bare = false;
  };

  // `desc` describes the operand ("float32[4]"); the receiver checks it against its own.
  // With `kept` (the operand stays alive and unchanged until FinishDirect(*kept)), a
  // direct send may be left in flight: *kept is then set, else left null.
  // `may_defer` (with `kept`): the psend's own precv receives too (an exchange, a ring), so a
  // send of kRendezvousMinBytes or more whose receiver is not ready yet is deferred (see
  // DirectSend) rather than staged; a smaller kept one is framed from the operand. A kept
  // send without it is one-way: framed from the operand (SendFramed; SentFramed says when).
  Status Send(int dest_rank, int tag, const void* data, size_t bytes, std::string_view desc,
              uint64_t max_inflight_bytes, std::chrono::steady_clock::time_point deadline,
              std::shared_ptr<DirectSend>* kept = nullptr, bool may_defer = false);
  // Waits until a direct send left in flight completes (or the deadline: then cancels it).
  Status FinishDirect(const std::shared_ptr<DirectSend>& send,
                      std::chrono::steady_clock::time_point deadline);
  // Posts the deferred sends whose receivers have signalled that they are ready (cheap when
  // none is deferred). Called by every receive loop, and by a precv before it receives.
  // `min_age`: only those deferred at least that long ago (the progress thread's watch,
  // which leaves the young ones to the device thread whose precv comes next).
  Status ProgressDeferred(std::chrono::steady_clock::time_point deadline,
                          std::chrono::nanoseconds min_age = std::chrono::nanoseconds{0});
  // kSizeMismatch or kTypeMismatch (with the sender's byte count and description) when the
  // message is not a `desc` ("int32[4]") of `bytes` bytes; the message is consumed anyway.
  // `sender_kept`: the sender's psend has its operand kept (Send's `kept`; the op's precvs
  // finish it, and in a cycle it defers from kRendezvousMinBytes on), so from
  // kKeptRendezvousMinBytes on it frames the message from its operand where SentFramed
  // says so, and the receive takes it the staged way, without a ready signal. Both ends
  // must agree, or ready signals pile up unread (or never come).
  // `sender_one_way` (with `sender_kept`): the sender's device receives nothing in the op's
  // group, so its kept psend frames every message of that size (SentFramed).
  Status Recv(int source_rank, int tag, void* out, size_t bytes, std::string_view desc,
              std::chrono::steady_clock::time_point deadline, bool sender_kept = false,
              bool sender_one_way = false);

  // At exit (collective over the communicator): completes every outstanding send and waits
  // for every rank to get there (joining them halfway to the deadline even with sends still
  // undelivered), or gives up at the deadline.
  struct DrainResult {
    size_t undelivered = 0;      // our sends left undelivered
    std::string undelivered_detail;  // which they are (DescribeSendsInFlight)
    bool all_ranks_met = false;  // the exit barrier completed
    Status status;               // an MPI call that failed while draining
  };
  DrainResult Drain(std::chrono::steady_clock::time_point deadline);

  // Sends not yet completed (after testing them) and their bytes.
  size_t inflight_sends();
  // Whether staged sends were left in flight when last tested (cheap: no MPI call). Direct
  // sends left in flight are not counted: the precv that keeps their operand finishes them.
  bool has_staged_sends() const;
  // Whether sends are deferred now (cheap: no MPI call).
  bool has_deferred_sends() const;
  uint64_t inflight_bytes();
  uint64_t sends_completed() const;
  uint64_t peak_inflight_bytes() const;
  // Sends of the rendezvous path that went straight from the operand / through a copy.
  uint64_t direct_sends() const;
  uint64_t staged_large_sends() const;
  // Framed messages sent, and received, without their chunk header (mpi/framing.h).
  uint64_t bare_sends() const { return bare_sends_.load(std::memory_order_relaxed); }
  uint64_t bare_receives() const { return bare_receives_.load(std::memory_order_relaxed); }

  // mpi/stall_report.cc. What this process knows of its exchanges with MPI rank
  // `peer_rank` (every peer if -1), for the error of an op that timed out, so that a rare
  // stall explains itself without a rerun: per channel with that peer (the ones of tags
  // `recv_tag` and `send_tag` first, -1 for none), the messages numbered so far each way
  // (the peer's own count shows in the ready signals it sent), the latest ready signal
  // read and sent, a deferred send, how a receive waits (staged or rendezvous, its direct
  // receives posted or not); what the peer has sent that nobody received yet (an
  // MPI_Iprobe of each communicator, unless the transport is broken); and the process's
  // sends in flight (staged, direct, deferred, ready signals). Built only on that path:
  // the channel and send-queue mutexes are tried for a short while (one that another
  // thread keeps shows as busy), the leaf mutexes (channels_mu_, deferred_mu_) and MPI's
  // call lock are taken; the caller holds none of the transport's. One line per item, each
  // indented.
  std::string StallReport(int peer_rank, int recv_tag = -1, int send_tag = -1);
  // mpi/stall_report.cc. Messages that peers sent to this process and no receive has
  // taken yet, one MPI_Iprobe per peer and communicator (staged messages and chunk
  // headers, ready signals, direct messages): at most the first one of each, which MPI
  // keeps (nothing is received). Empty when MPI is not usable or the transport is broken.
  // What a test (and the exit, once every rank met) checks: a message left there would be
  // taken by a later precv of the same channel, shape and size.
  struct Unreceived {
    const char* kind = "";  // "staged", "ready", "direct"
    int source = 0, tag = 0;
    int bytes = 0;
  };
  std::vector<Unreceived> ProbeUnreceived();

  // A group's communicator as its caller keeps it from call to call (in a call site's entry
  // of a device thread, which only that thread uses): the collectives below look the group
  // up by its key once per transport and store it here; later calls take it without a
  // lookup.
  class GroupHandle {
   private:
    friend class MpiTransport;
    uint64_t transport_ = 0;  // the transport `entry_` belongs to (0: none yet)
    GroupEntry* entry_ = nullptr;
  };

  // mpi/collectives.cc. Allreduce of `count` elements of `type` with `op`, in place in
  // `buf`, over the processes `ranks` (ranks of our communicator, ascending, this one
  // among them), on a communicator of the group's own: `key` names the group (its
  // devices), so two groups that device threads of this process reduce at the same time
  // never share a communicator (MPI forbids interleaved collectives on one). The
  // communicator is split off at first use (MPI_Comm_create_group: collective over the
  // group only) and kept in `group`, the caller's handle. Nonblocking and polled: at the
  // deadline the request is abandoned (MPI cannot cancel a collective; the transport is
  // then broken) and a kTimeout returned.
  // `send`: the operand when it is not `buf` (nullptr: in place, the operand in `buf`).
  Status Allreduce(const std::string& key, const std::vector<int>& ranks, GroupHandle& group,
                   const void* send, void* buf, int64_t count, MPI_Datatype type, MPI_Op op,
                   std::chrono::steady_clock::time_point deadline);
  // Any other collective over the group `ranks` (as Allreduce: the group's own
  // communicator `key`, polled against the deadline, abandoned at it): `start` posts the
  // nonblocking MPI call on the communicator (MPI_Iallgatherv, MPI_Ireduce_scatter, ...)
  // and returns its MPI error code; `name` names it in errors. `keep_alive` owns the
  // call's buffers where the caller staged them: kept with the request if it is abandoned.
  // `bytes`: what the call moves from or to this process (the larger), for its wait.
  Status Collective(const std::string& key, const std::vector<int>& ranks, GroupHandle& group,
                    const char* name,
                    const std::function<int(MPI_Comm, MPI_Request*)>& start, size_t bytes,
                    std::chrono::steady_clock::time_point deadline,
                    std::shared_ptr<void> keep_alive = nullptr);
  // One contiguous piece of an Exchange: to or from communicator rank `peer` (of the
  // group's own communicator), `bytes` at `data` (written for a receive).
  struct Piece {
    int peer = 0;
    void* data = nullptr;
    size_t bytes = 0;
  };
  // A collective of this package's own, as point-to-point messages over the group `ranks`
  // (as Collective: the group's own communicator `key`): every receive of `recvs`, then
  // every send of `sends` (MPI_Irecv / MPI_Isend, one tag: the pieces between two ranks
  // match in the order both list them, MPI's non-overtaking rule), polled together against
  // the deadline: for a collective whose algorithm is ours (with several devices per
  // process the in-process work and MPI's can then share passes over the memory).
  // At the deadline the requests are cancelled (and abandoned where MPI cannot: the
  // transport is then broken; `keep_alive` owns staged buffers).
  // `bytes`: what the exchange moves from or to this process (the larger), for its wait.
  Status Exchange(const std::string& key, const std::vector<int>& ranks, GroupHandle& group,
                  const char* name, std::span<const Piece> sends,
                  std::span<const Piece> recvs, size_t bytes,
                  std::chrono::steady_clock::time_point deadline,
                  std::shared_ptr<void> keep_alive = nullptr);
  // A small collective as a persistent request (MPI 4's MPI_Allgather_init and the like:
  // MPICH builds its schedule once, not at every call), on buffers of the transport's own:
  // `send_bytes` from `send` are copied into its send buffer (0: the call is in place) and,
  // if `recv_init`, `recv_bytes` from it into its receive buffer; `init(comm, send buffer,
  // receive buffer, request)` creates the request at the first call of its kind on the
  // group and returns its MPI error code; the result is copied from the receive buffer
  // into `recv`. `id`: what tells the group's requests apart (the call and its counts,
  // type and op), the same on every process at a call, since MPI matches the processes'
  // requests in the order they are made. As Collective otherwise.
  // The largest message (bytes moved by this process, the larger of sent and received) that
  // goes as a persistent request: above it the copies in and out cost more than MPICH's
  // schedule saves (an all-reduce of 32 KiB was no faster persistent). MPI 3 has none.
#if MPI_VERSION >= 4
  static constexpr size_t kPersistentBytes = 4096;
#else
  static constexpr size_t kPersistentBytes = 0;
#endif
  struct PersistentId {
    int kind = 0;
    int64_t count = 0;
    MPI_Datatype type = MPI_DATATYPE_NULL;
    MPI_Op op = MPI_OP_NULL;
    size_t send_bytes = 0, recv_bytes = 0;
    bool operator==(const PersistentId&) const = default;
  };
  Status PersistentCollective(
      const std::string& key, const std::vector<int>& ranks, GroupHandle& group,
      const char* name, const PersistentId& id,
      const std::function<int(MPI_Comm, void*, void*, MPI_Request*)>& init, const void* send,
      const void* recv_init, void* recv, std::chrono::steady_clock::time_point deadline);

 private:
  // Rendezvous (see the top of this file): smallest message, the largest count of one
  // direct MPI message (messages beyond it go as several, every count within an int), and
  // how many bytes a staging sender copies between two looks for the ready signal.
  static constexpr size_t kRendezvousMinBytes = size_t{256} << 10;
  static constexpr size_t kDirectChunkBytes = size_t{256} << 20;
  // A psend whose operand is kept (`kept`: the precv that takes its token finishes the
  // send; Recv's `sender_kept`) sends straight from its operand from this size on, not from
  // kRendezvousMinBytes. From kRendezvousMinBytes on, in a cycle (a psend whose op also
  // receives: may_defer) the psend defers, each receiver posts its receive into its output
  // and signals, and the receive loops then post the sends straight from the operands, as
  // MPI_Sendrecv posts its receive before its send: neither end copies, no send waits in a
  // probe's unexpected-message handshake. One-way, and in a cycle below
  // kRendezvousMinBytes, the send is framed from the operand (SendFramed, SentFramed):
  // MPICH sends such a message by its own rendezvous (a single copy from 8 KiB on shared
  // memory, MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD), so no end copies; the send stays in
  // flight for the kept operand's precv, and no progress thread is woken, as a staged send
  // wakes it.
  static constexpr size_t kKeptRendezvousMinBytes = size_t{16} << 10;
  // Whether a psend frames its message from its operand (SendFramed) rather than taking
  // the rendezvous or the staged path; both ends decide by it, the receiver from the op's
  // group (Recv's `sender_kept`, `sender_one_way`). A kept one-way send from
  // kKeptRendezvousMinBytes on, and a kept send of a cycle (an exchange, a ring) below
  // kRendezvousMinBytes: there the deferred rendezvous put the ready signal's trip, a probe
  // for it and the post of the send between each precv's start and the transfer, a large
  // share of a step this size, while a framed send is under way before either precv runs
  // (MPICH's own rendezvous moves it in one copy, into the receive posted once its chunk
  // header is read), as MPI_Sendrecv's. From kRendezvousMinBytes on a cycle still defers:
  // there the trip is small against the copy.
  static bool SentFramed(bool kept, bool one_way, size_t bytes) {
    return kept && bytes >= kKeptRendezvousMinBytes && (one_way || bytes < kRendezvousMinBytes);
  }
  static constexpr size_t kStageStepBytes = size_t{128} << 10;
  // Smallest one-message payload received straight into the output (with its trailer
  // scattered apart by a datatype); smaller ones go through a buffer and one more copy.
  static constexpr size_t kScatterMinBytes = size_t{16} << 10;
  // A sender looks for the ready signal this long before it starts staging: a receiver
  // that has just finished the previous message signals within a few microseconds.
  static constexpr std::chrono::microseconds kReadySpin{5};
  // How long a deferred send waits for its receiver's ready signal before the receive loops
  // stage it (as its psend would have): a receiver that never signals (it expects a small
  // message, another size) must still get the message, and its error, soon. A receiver in
  // an exchange may be a whole step behind, still copying the previous message in (about
  // a millisecond per MiB at 1 GiB/s), or descheduled for a slice: staging for it only
  // adds a copy, so the patience grows with the message.
  static constexpr std::chrono::milliseconds kDeferredPatience{2};
  static std::chrono::microseconds DeferredPatience(size_t bytes) {
    return kDeferredPatience + std::chrono::microseconds(bytes >> 10);  // + 1 ms per MiB
  }
  // After cancelling at a deadline, how long requests are tested before those still open
  // are abandoned: a cancellable request completes at once, and a message already flowing
  // from a live peer finishes (a message matched just before the deadline is not failed).
  static constexpr std::chrono::milliseconds kCancelGrace{1000};

  // Where a small staged receive is posted before its message comes (RecvSmallPostedFirst):
  // room for any message that can come on a channel whose last header allows no bare
  // payload, a one-message payload below kChunkedThreshold with its trailer or a chunk
  // header, so that a message of another byte count still arrives whole and its trailer
  // says what it is, as after a probe. Its bytes are allocated, never written: only what a
  // message fills is touched.
  static constexpr size_t kPostedRoomBytes = kChunkedThreshold - 1 + sizeof(Envelope);
  struct PostedRoom {
    std::unique_ptr<std::byte[]> bytes =
        std::make_unique_for_overwrite<std::byte[]>(kPostedRoomBytes);  // not zeroed
  };

  struct ReadySignal {
    uint64_t seq = 0;        // which message of the channel the receiver waits for
    uint64_t bytes = 0;      // the receiver's byte count
    uint64_t desc_hash = 0;  // DescriptionHash() of the receiver's description
  };
  // An operand's description ("float32[4]") and its DescriptionHash().
  struct Desc {
    std::string_view text;
    uint64_t hash = 0;
  };
  // Per channel (peer rank, tag): one psend and one precv at a time, so that sequence
  // numbers follow the order of the messages on the wire. Locking: see the class comment.
  struct ChannelState {
    int peer_rank = 0;  // set once by Channel()
    std::mutex send_mu;
    std::mutex recv_mu;
    uint64_t next_send_seq = 0;
    uint64_t next_recv_seq = 0;
    bool has_early_ready = false;  // a ready signal for a later message
    ReadySignal early_ready;
    std::shared_ptr<DirectSend> deferred;  // a deferred send of this channel, if any
    // Under send_mu: the record of the channel's latest framed or deferred send, reused by
    // the next one once nothing else holds it (ReuseDirectSend): one allocation per
    // channel, not per message.
    std::shared_ptr<DirectSend> spare_send;
    // Under send_mu: the staged copy of the channel's latest small send that left at once
    // (SendStaged), reused by the next one of the same size.
    PooledBuffer spare_staged;
    // Under recv_mu: buffers of the channel's receives (RecvStaged, RecvOneMessage),
    // reused once nothing else holds them (an abandoned receive keeps its own): a chunk
    // header or trailer, and the copy of a small message.
    std::shared_ptr<Envelope> recv_envelope;
    std::shared_ptr<std::vector<std::byte>> recv_scratch;
    // Under recv_mu: the room a small receive is posted into (RecvSmallPostedFirst), reused
    // as recv_scratch is.
    std::shared_ptr<PostedRoom> recv_room;
    // Under send_mu: the chunk header of the channel's staged sends (IsendStaged), reused
    // once no send in flight holds it.
    std::shared_ptr<Envelope> send_envelope;
    // Under recv_mu: the direct receives of the channel's current rendezvous (RecvLarge).
    std::vector<MPI_Request> recv_requests;
    // Under send_mu: the buffer a ready signal is read into (PollReady).
    std::shared_ptr<ReadySignal> ready_in;
    // The channel's last chunk header, as each end saw it go by (mpi/framing.h: a framed
    // message whose header is this one goes bare, without it): under send_mu the last one
    // sent, under recv_mu the last one received. Both ends see the same messages in the
    // same order, so the two are equal between messages; magic 0 until the first header.
    Envelope last_header_sent;
    Envelope last_header_received;
    uint64_t deferred_id = 0;  // under deferred_mu_: when it was deferred (DeferredMark)
    // What StallReport tells of the channel: the ready signals either way, and how its
    // current (or last) receive waits. Written where they happen, read only by the report.
    // Under send_mu: the ready signals read from the receiver (PollReady), and the latest.
    uint64_t ready_seen = 0;
    ReadySignal last_ready_seen;
    std::chrono::steady_clock::time_point last_ready_seen_at;
    // Under recv_mu: the ready signals sent to the sender (RecvLarge), the latest one's
    // message and time; the latest receive: its path, whether its direct receives were
    // posted and a staged message matched, and how it ended.
    uint64_t ready_sent = 0;
    uint64_t last_ready_sent_seq = 0;
    std::chrono::steady_clock::time_point last_ready_sent_at;
    bool recv_rendezvous = false;
    bool direct_posted = false;
    bool staged_matched = false;
    enum class RecvEnd : uint8_t { kRunning, kTaken, kFailed } recv_end = RecvEnd::kRunning;
    // Under recv_mu: whether the current receive faults its output in while it waits
    // (OutputPrefault): not in a cycle (an exchange, a ring), where both ends copy at once.
    bool recv_prefault = true;
  };
  struct ControlSend {
    ReadySignal signal;  // sent from here: control_sends_ is a deque, whose elements stay put
    MPI_Request request = MPI_REQUEST_NULL;
  };

  struct PendingSend {
    PooledBuffer buffer;
    std::shared_ptr<Envelope> header;  // chunked messages only: the channel's send_envelope
    size_t bytes = 0;
    int dest_rank = 0, tag = 0;  // for the exit's report of sends never received
    std::vector<MPI_Request> requests;  // header and chunks, or the one message
    std::chrono::steady_clock::time_point posted_for_test;  // mpi/stop_for_test.h
  };

  // Told by ReserveInflight whether to stop waiting (sets *stop); an error ends the wait.
  using StopWaiting = std::function<Status(bool* stop)>;
  // Requests given up at a deadline, and what their buffers belong to (kept alive for them).
  struct Abandoned {
    std::vector<MPI_Request> requests;
    std::shared_ptr<void> keep_alive;
  };

  // mpi/receive.cc
  // Polls `requests` to completion; at the deadline cancels them (CancelWithGrace) and
  // reports a timeout, unless every one completed with its data after all.
  // `keep_alive` owns the receive buffers, if the transport owns them.
  Status WaitAll(std::span<MPI_Request> requests,
                 std::chrono::steady_clock::time_point deadline,
                 std::shared_ptr<void> keep_alive = nullptr);
  // Cancels `requests` and tests them for kCancelGrace; *cancelled counts those cancelled
  // (the others completed), and *abandoned tells that some never completed: Abandon took
  // them. A failed MPI call is returned after every request was dealt with. With `cancel`
  // false the requests are only tested for the grace period: for sends whose MPI_Cancel the
  // MPI library cannot take (SendFramed's). `completed`, where given, gets the status of a
  // request that completed with its message (the last one tested), left as it was if none
  // did: a receive of unknown length taken after all needs its count.
  Status CancelWithGrace(std::span<MPI_Request> requests, size_t* cancelled,
                         bool* abandoned, std::shared_ptr<void> keep_alive,
                         bool cancel = true, MPI_Status* completed = nullptr);
  // Keeps the open requests of `requests` (never to be waited on) and marks the transport
  // broken; leaves `requests` all MPI_REQUEST_NULL.
  void Abandon(std::span<MPI_Request> requests, std::shared_ptr<void> keep_alive);
  // Receives the message that MPI_Improbe matched into `buf` (MPI_Imrecv), by `deadline`.
  Status ReceiveMatched(MPI_Message* message, void* buf, int count,
                        std::chrono::steady_clock::time_point deadline,
                        std::shared_ptr<void> keep_alive = nullptr);
  Status ReceiveChunks(int source_rank, int tag, std::byte* out, size_t total,
                       size_t chunk_bytes, std::chrono::steady_clock::time_point deadline,
                       std::shared_ptr<void> keep_alive = nullptr);
  // `ch`: the channel of (source_rank, tag), whose recv_mu the caller (Recv) holds.
  Status RecvStaged(ChannelState& ch, int source_rank, int tag, void* out, size_t bytes,
                    uint64_t desc_hash, std::chrono::steady_clock::time_point deadline);
  // The channel's Envelope for a receive (ChannelState::recv_envelope) when nothing else
  // holds it (an abandoned receive keeps its own); else a new one, which becomes the
  // channel's. Caller holds ch.recv_mu.
  std::shared_ptr<Envelope> ReusableEnvelope(ChannelState& ch);
  // A staged receive of the byte count of the channel's last chunk header, which lets framed
  // payloads come bare (AllowsBare, mpi/framing.h): its receive is posted into the output
  // before the message comes; a bare payload fills it, a chunk header (its first 64 bytes)
  // is taken as RecvStaged takes one.
  Status RecvPostedFirst(ChannelState& ch, int source_rank, int tag, void* out, size_t bytes,
                         uint64_t desc_hash, std::chrono::steady_clock::time_point deadline);
  // A staged receive below kScatterMinBytes on a channel whose last header allows no bare
  // payload: its receive is posted into the channel's room (PostedRoom) before the message
  // comes, as MPI_Sendrecv posts its own, instead of probing for it; a one-message payload
  // is then copied out of the room, a chunk header (or an empty payload's trailer) taken
  // as RecvStaged takes one.
  Status RecvSmallPostedFirst(ChannelState& ch, int source_rank, int tag, void* out,
                              size_t bytes, uint64_t desc_hash,
                              std::chrono::steady_clock::time_point deadline);
  // RecvPostedFirst's and RecvSmallPostedFirst's receive: posted into `buffer` (room for
  // `capacity` bytes; `keep_alive` owns it unless it is the output) and waited for by
  // `deadline` while `out` (`bytes`) is faulted in; at a failure or the deadline cancelled,
  // with CancelWithGrace's grace for one already matched (then taken as if in time).
  // `*count`: the bytes that came.
  Status PostAndWait(ChannelState& ch, int source_rank, int tag, std::byte* buffer,
                     size_t capacity, std::shared_ptr<void> keep_alive, void* out,
                     size_t bytes, std::chrono::steady_clock::time_point deadline,
                     size_t* count);
  // The chunks of a chunk header just received (which becomes the channel's last one):
  // into the output, or drained when the byte count is not `bytes`; the mismatches reported.
  Status TakeChunks(ChannelState& ch, const Envelope& header, int source_rank, int tag,
                    void* out, size_t bytes, uint64_t desc_hash,
                    std::chrono::steady_clock::time_point deadline);
  // Receives the matched payload of a framed message sent bare (its header is the channel's
  // last, ch.last_header_received: AllowsBare) whose receiver expected another byte count.
  Status RecvBare(ChannelState& ch, MPI_Message* message, void* out, size_t bytes,
                  uint64_t desc_hash, std::chrono::steady_clock::time_point deadline);
  // Receives the matched one-message payload of `count` bytes (payload and Envelope).
  Status RecvOneMessage(ChannelState& ch, MPI_Message* message, int count, void* out,
                        size_t bytes,
                        uint64_t desc_hash, std::chrono::steady_clock::time_point deadline);

  // mpi/setup.cc
  ChannelState& Channel(int peer_rank, int tag);
  // Held around an MPI call when the library is not MPI_THREAD_MULTIPLE (else unlocked).
  std::unique_lock<std::mutex> MpiCallLock();

  // mpi/send_queue.cc
  // Copy-and-Isend (small messages, and large ones to a receiver that is not ready).
  // `spare`: the channel's spare copy (ChannelState::spare_staged), taken when it has the
  // size needed and given back when the send leaves at once; null: none.
  Status SendStaged(ChannelState& ch, int dest_rank, int tag, const void* data, size_t bytes,
                    const Desc& desc,
                    uint64_t max_inflight_bytes,
                    std::chrono::steady_clock::time_point deadline,
                    PooledBuffer* spare = nullptr);
  // Sends the staged copy (header and chunks, or one message: its buffer has
  // StagedBufferBytes(), the Envelope is written behind the payload); the caller reserved
  // the bytes. `ch`: the channel, whose send_mu the caller holds (its last chunk header:
  // one message the size of a bare framed payload goes as a header and a chunk instead).
  Status IsendStaged(ChannelState& ch, PendingSend send, int dest_rank, int tag,
                     const Desc& desc,
                     PooledBuffer* spare = nullptr);
  // The channel's spare DirectSend (ChannelState::spare_send), cleared, when nothing else
  // holds it any more; else a new one, which becomes the spare. Caller holds ch.send_mu.
  std::shared_ptr<DirectSend> ReuseDirectSend(ChannelState& ch);
  // Waits until the in-flight bytes leave room for `bytes` (or nothing else is in flight),
  // then reserves them. Stops early, reserving nothing, when `stop` says so.
  Status ReserveInflight(size_t bytes, uint64_t max_inflight_bytes,
                         std::chrono::steady_clock::time_point deadline,
                         const StopWaiting& stop, bool* stopped);
  // Frees completed sends; caller holds mu_.
  Status ProgressLocked();
  // A staged send of `bytes` that completed (found by ProgressLocked, or one that left at
  // once in IsendStaged): its bytes leave the in-flight count, and it counts as completed.
  // Caller holds mu_.
  void CompleteStagedLocked(size_t bytes) {
    inflight_bytes_ -= bytes;
    ++sends_completed_;
  }
  // mpi/stall_report.cc. The sends of this process still in flight, one per line ("uint8[8]
  // (8 bytes) to MPI rank 1 on tag 4, staged"), at most `limit` of them and a count of the
  // rest: what the exit names of the sends its peers never received. Caller holds mu_.
  std::string DescribeSendsInFlightLocked(size_t limit) const;
  // Staged and direct sends not completed when last tested; caller holds mu_.
  size_t SendsInFlightLocked() const;

  // mpi/rendezvous.cc
  // `may_defer`: with `kept`, a receiver not ready yet defers the send (see DirectSend);
  // `into`: the deferred send being completed.
  Status SendLarge(ChannelState& ch, uint64_t seq, int dest_rank, int tag, const void* data,
                   size_t bytes, const Desc& desc, uint64_t max_inflight_bytes,
                   std::chrono::steady_clock::time_point deadline,
                   std::shared_ptr<DirectSend>* kept, bool may_defer = false,
                   std::shared_ptr<DirectSend> into = nullptr);
  // A kept one-way send, or a kept send of a cycle below kRendezvousMinBytes (SentFramed):
  // the staged framing (a chunk
  // header, then the payload in chunks of kDirectChunkBytes) sent straight from the
  // operand, at once, without waiting for a ready signal; left in flight in *kept for the
  // precv that keeps the operand (FinishDirect). The receiver (Recv's `sender_kept`)
  // takes it as a staged message: a message and a wait fewer than the rendezvous, and no
  // staging copy for a receiver that comes late. A header that is the channel's last one
  // is left out (bare, mpi/framing.h): a loop's steps send their payload alone.
  Status SendFramed(ChannelState& ch, int dest_rank, int tag, const void* data, size_t bytes,
                    const Desc& desc,
                    std::chrono::steady_clock::time_point deadline,
                    std::shared_ptr<DirectSend>* kept);
  // Marks a deferred send that could not be sent as done with `failure` (its precv reports).
  void FailDeferred(const std::shared_ptr<DirectSend>& send, Status failure);
  // A send of direct_in_flight_ whose requests all completed: done, and counted (a framed
  // send not as a direct one: its receiver takes it staged). Under mu_.
  void CompleteDirectLocked(DirectSend& send);
  // What MPI_Isend and MPI_Issend are: how PostFromOperand posts.
  using MpiPostFn = int (*)(const void*, int, MPI_Datatype, int, int, MPI_Comm, MPI_Request*);
  // Posts `bytes` from `data` with `post` (`post_name` for the error) on `comm`, in pieces
  // of at most kDirectChunkBytes, after `send`'s header if it has one: each piece a request
  // of `send`, which then goes into direct_in_flight_. A post that fails leaves earlier
  // pieces reading the operand: they are finished (FinishDirect) before the error returns.
  Status PostFromOperand(const std::shared_ptr<DirectSend>& send, MpiPostFn post,
                         const char* post_name, MPI_Comm comm, int dest_rank, int tag,
                         const void* data, size_t bytes,
                         std::chrono::steady_clock::time_point deadline);
  // Starts the direct send; finishes it too unless `kept` takes it.
  // `into`: the deferred send to post (else a new one).
  Status SendDirect(int dest_rank, int tag, const void* data, size_t bytes,
                    std::chrono::steady_clock::time_point deadline,
                    std::shared_ptr<DirectSend>* kept,
                    std::shared_ptr<DirectSend> into = nullptr);
  // The channel's deferred send, if any: posted if its receiver is ready (*posted), else,
  // with `complete`, sent as SendLarge would (direct once ready, or staged). Caller holds
  // ch.send_mu.
  Status PostDeferredLocked(ChannelState& ch, bool complete,
                            std::chrono::steady_clock::time_point deadline, bool* posted);
  // Looks for the ready signal of message `seq`: sets *ready and *receiver (its signal).
  Status PollReady(ChannelState& ch, uint64_t seq, int dest_rank, int tag, bool* ready,
                   ReadySignal* receiver, std::chrono::steady_clock::time_point deadline);
  // The id of the latest send deferred (0 if none is deferred now), and whether a send
  // deferred no later than `mark` is still deferred (cheap when none is).
  uint64_t DeferredMark();
  bool HasDeferredUpTo(uint64_t mark);
  // Whether a point-to-point wait (RecvStaged, RecvLarge, FinishDirect) adapts its spin
  // (AdaptiveSpin, AdaptedPause): not under JAX_CPU_MPI_WAIT=spin, and not with several
  // devices per process, where a yield hands the core to a sibling device thread, which may
  // not be the one the wait needs.
  bool PointToPointSpinAdapts(const Backoff& backoff) const;
  // One poll's wait of a precv for its message (RecvStaged, RecvLarge): faults in the next
  // huge page of its output (OutputPrefault) unless a send of ours is deferred, else pauses.
  void PrefaultOrPause(OutputPrefault& prefault, AdaptedPause& pause);
  // `ch`: as for RecvStaged.
  Status RecvLarge(ChannelState& ch, uint64_t seq, int source_rank, int tag, void* out,
                   size_t bytes, uint64_t desc_hash,
                   std::chrono::steady_clock::time_point deadline);

  MPI_Comm comm_ = MPI_COMM_NULL;         // staged messages
  MPI_Comm ctrl_comm_ = MPI_COMM_NULL;    // ready signals, receiver -> sender
  MPI_Comm direct_comm_ = MPI_COMM_NULL;  // direct messages, straight from the operand
  int rank_ = 0;
  int size_ = 0;
  int64_t tag_ub_ = 32767;
  bool thread_multiple_ = false;
  std::vector<int> rank_of_process_;
  ClockOffset clock_offset_;
  WaitChoice wait_choice_;

  mutable std::mutex mu_;
  std::deque<PendingSend> pending_;
  std::atomic<bool> has_pending_{false};  // !pending_.empty(), as of the last change or test
  uint64_t inflight_bytes_ = 0;
  uint64_t sends_completed_ = 0;
  uint64_t peak_inflight_bytes_ = 0;
  // Sends a direct receive took (not framed ones: their receiver takes them staged).
  uint64_t direct_sends_ = 0;
  uint64_t staged_large_sends_ = 0;
  // Framed messages sent and received bare (without their chunk header, mpi/framing.h).
  std::atomic<uint64_t> bare_sends_{0};
  std::atomic<uint64_t> bare_receives_{0};
  std::deque<ControlSend> control_sends_;  // ready signals not yet completed
  std::vector<std::shared_ptr<DirectSend>> direct_in_flight_;  // left in flight
  std::vector<Abandoned> abandoned_;  // never tested again, never freed
  std::atomic<bool> broken_{false};   // set once a request is abandoned
  mutable std::mutex break_mu_;       // guards break_cause_ only (Usable runs under mu_)
  std::string break_cause_;           // NoteBreak's first error

  // mpi/collectives.cc: the parent of the groups' communicators (a duplicate made by
  // Create), and the communicator of each group key. group_comms_mu_ guards the map only
  // (never held while a communicator is created: two threads may create two at once).
  // A group's communicator, and the persistent collectives of small messages started on
  // it (PersistentCollective). MPI fixes a persistent collective's buffers, and matches
  // the processes' requests in the order they were made, so every process must make them
  // at the same calls: a request works in buffers of its own (the operand copied in, the
  // result out), made for an id that is the same on every process at a call. A few per
  // group, the oldest freed first (the same on every process). Only the thread leading the
  // group's round uses an entry, and rounds of one group never overlap.
  struct PersistentCall {
    PersistentId id;
    std::shared_ptr<std::byte[]> buf;  // send, then receive; kept with an abandoned request
    MPI_Request request;  // inactive between calls
  };
  struct GroupEntry {
    MPI_Comm comm = MPI_COMM_NULL;
    std::vector<PersistentCall> persistent;
  };
  // PersistentCollective on the group's entry.
  Status PersistentOn(GroupEntry* group, const char* name, const PersistentId& id,
                      const std::function<int(MPI_Comm, void*, void*, MPI_Request*)>& init,
                      const void* send, const void* recv_init, void* recv,
                      std::chrono::steady_clock::time_point deadline);
  Status GroupComm(const std::string& key, const std::vector<int>& ranks, GroupHandle& handle,
                   GroupEntry** out, std::chrono::steady_clock::time_point deadline);
  // Polls `request` until it completes; at the deadline abandons it (with `keep_alive`).
  Status PollCollective(MPI_Request* request, const char* name, size_t bytes,
                        std::chrono::steady_clock::time_point deadline,
                        std::shared_ptr<void> keep_alive);
  MPI_Comm coll_comm_ = MPI_COMM_NULL;
  std::mutex group_comms_mu_;
  std::map<std::string, std::unique_ptr<GroupEntry>> group_comms_;  // never erased

  uint64_t id_ = 0;  // unique per transport in the process (Channel()'s per-thread cache)
  std::mutex channels_mu_;
  std::map<std::pair<int, int>, std::unique_ptr<ChannelState>> channels_;

  // Channels with a deferred send (deferred_mu_; order: a channel's send_mu before it, and
  // ProgressDeferred only try-locks a send_mu while holding it). deferred_count_ mirrors
  // its size for the lock-free check of the receive loops.
  std::mutex deferred_mu_;
  std::vector<ChannelState*> deferred_channels_;
  uint64_t last_deferred_id_ = 0;  // under deferred_mu_: ids of deferred sends, from 1
  std::atomic<size_t> deferred_count_{0};
};

}  // namespace jcm
