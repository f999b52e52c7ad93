// XLA FFI handlers for psend and precv on CPU.
//
// Both handlers learn which device (partition) they run as from an operand (the partition id
// of the SPMD program), look up their peer in the source-target pairs that the lowering
// computed with JAX's own helper, and route the bytes:
//   - peer device in this process  -> Mailbox (direct copy between device threads);
//   - peer device in another process -> MpiTransport (point-to-point on our communicator).
// A psend whose `operand_kept` is 1 may return before its bytes have left its operand: the
// precv that takes its token also takes the operand (kept alive by XLA until then) and
// finishes the send (kept_sends.h).
// Nothing about the process (communicators, pointers) is baked into the executable: the
// attributes only hold partition -> (global device index, process index) tables.
// The transports report a jcm::Status; this file alone turns it into an ffi::Error, with
// the op, the pair and the peer in the text.
#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <sstream>
#include <string>
#include <string_view>

#include "ffi/p2p_handlers.h"
#include "common/keep_freed_memory.h"
#include "common/trace.h"
#include "ffi/runtime.h"
#include "ffi/uninitialized.h"
#include "local/zero_fill.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jcm {
namespace {

using I64Span = ffi::Span<const int64_t>;

// Outputs from this size on are worth posting deferred sends before their zero-fill (the
// smallest deferred send is the transport's rendezvous size, 256 KiB).
constexpr size_t kPostBeforeZeroFillBytes = size_t{256} << 10;

// Everything the lowering tells a handler about one psend/precv.
struct OpInfo {
  std::string_view op;       // e.g. "psend(axis_name=('x',), perm=((0, 1),))"
  std::string_view operand;  // e.g. "float32[4]"
  I64Span pairs;             // flat (source, destination) partition ids
  I64Span device_index;      // partition -> dense global device index
  I64Span device_process;    // partition -> jax.process_index()
  int64_t num_devices;       // devices in the whole job (for MPI tags)
  // The pairs of the precvs that finish the op's group of sends (passes/kept_operands.py),
  // empty when no precv keeps the operands.
  I64Span group_pairs;
  // The pairs of the program's precvs (PROGRAM_RECEIVES of the lowering: each as often as
  // its precvs run at most in a call, and with -1 - destination where one may run any
  // number of times); read only when an op fails (failed_runs.h).
  I64Span program_receives;
  // The pairs of the program's psends (PROGRAM_SENDS), in the same form; read only when an
  // op fails (failed_runs.h).
  I64Span program_sends;
  // precv: whether a device that is no destination writes the zeros of its output. False
  // where the program selects the zeros itself (passes/kept_operands.py: the users of the
  // result read it through select(is_destination, result, 0), which XLA fuses into them),
  // and the output is then left unwritten there.
  bool zero_fill;
};

// What the lowering's `routing` attribute says of one psend/precv, unpacked.
struct Routing {
  OpInfo info;
  int64_t operand_kept;  // how many precvs keep the psend's operand alive (0: none)
};

// A send that gave up at its deadline is a timeout, as a precv's is (DEADLINE_EXCEEDED, so
// a caller can tell both from a broken transport); any other failed send is internal.
ffi::ErrorCode ErrorCodeOf(const Status& failed) {
  return failed.code() == StatusCode::kSendTimeout ? ffi::ErrorCode::kDeadlineExceeded
                                                   : ffi::ErrorCode::kInternal;
}

ffi::Error Malformed(std::string_view op) {
  return ffi::Error::Internal(std::string(op) + ": malformed attributes");
}

// Unpacks the lowering's `routing` attribute (python/jax_cpu_mpi/_src/ffi/custom_calls.py):
// the header [num_devices, operand_kept, partitions, pair values, group pair values,
// zero_fill, program receive values, program send values], then the pairs, device_index,
// device_process, group_pairs, program_receives and program_sends, one after another. One
// attribute, not nine: XLA's FFI decodes every attribute of a call, by name, on each call,
// and a psend and a precv run for every message. Malformed if the sizes do not add up.
ffi::ErrorOr<Routing> Unpack(I64Span routing, std::string_view op, std::string_view operand) {
  constexpr size_t kHeader = 8;
  if (routing.size() < kHeader) return ffi::Unexpected(Malformed(op));
  const int64_t n = routing[2], n_pairs = routing[3], n_group = routing[4];
  const int64_t n_receives = routing[6], n_sends = routing[7];
  if (n < 0 || n_pairs < 0 || n_group < 0 || n_receives < 0 || n_sends < 0 ||
      static_cast<uint64_t>(n_pairs) + 2 * static_cast<uint64_t>(n) +
              static_cast<uint64_t>(n_group) + static_cast<uint64_t>(n_receives) +
              static_cast<uint64_t>(n_sends) !=
          routing.size() - kHeader) {
    return ffi::Unexpected(Malformed(op));
  }
  const int64_t* at = routing.begin() + kHeader;
  auto take = [&at](int64_t size) {
    I64Span span(at, static_cast<size_t>(size));
    at += size;
    return span;
  };
  Routing r{};
  r.info.op = op;
  r.info.operand = operand;
  r.info.num_devices = routing[0];
  r.operand_kept = routing[1];
  r.info.zero_fill = routing[5] != 0;
  r.info.pairs = take(n_pairs);
  r.info.device_index = take(n);
  r.info.device_process = take(n);
  r.info.group_pairs = take(n_group);
  r.info.program_receives = take(n_receives);
  r.info.program_sends = take(n_sends);
  return r;
}

std::string ProcessSuffix(const OpInfo& info, int64_t partition) {
  std::ostringstream s;
  s << "partition " << partition;
  if (partition >= 0 && partition < static_cast<int64_t>(info.device_process.size())) {
    s << " (process " << info.device_process[partition] << ")";
  }
  return s.str();
}

ffi::Error CheckTables(const OpInfo& info, int64_t me) {
  const int64_t n = static_cast<int64_t>(info.device_index.size());
  if (info.pairs.size() % 2 != 0 || static_cast<int64_t>(info.device_process.size()) != n) {
    return Malformed(info.op);
  }
  if (me < 0 || me >= n) {
    std::ostringstream s;
    s << info.op << ": running as partition " << me << " but the program was lowered for " << n
      << " partitions";
    return ffi::Error::Internal(s.str());
  }
  for (int64_t p : info.pairs) {
    if (p < 0 || p >= n) {
      std::ostringstream s;
      s << info.op << ": source-target pair names partition " << p << " outside [0, " << n
        << ")";
      return ffi::Error::InvalidArgument(s.str());
    }
  }
  return ffi::Error::Success();
}

// The partition at the other end of `me` in `pairs` (as source if `me_is_source`), or -1.
int64_t FindPeerIn(I64Span pairs, int64_t me, bool me_is_source) {
  for (size_t i = 0; i + 1 < pairs.size(); i += 2) {
    int64_t src = pairs[i], dst = pairs[i + 1];
    if (me_is_source && src == me) return dst;
    if (!me_is_source && dst == me) return src;
  }
  return -1;
}

int64_t FindPeer(const OpInfo& info, int64_t me, bool me_is_source) {
  return FindPeerIn(info.pairs, me, me_is_source);
}

// Whether `partition` receives in a precv of the op's group, which then runs after the
// op's psend and before the last precv that finishes its send: a send deferred there is
// posted by that precv's receive loop (both directions in flight at once).
bool ReceivesInGroup(const OpInfo& info, int64_t partition) {
  return FindPeerIn(info.group_pairs, partition, /*me_is_source=*/false) >= 0;
}

// Tags keep device pairs apart between one pair of processes: the tag of the messages from
// src_dev to dst_dev (checked against MPI's limit by MpiTag).
int64_t PairTag(const OpInfo& info, int64_t src_dev, int64_t dst_dev) {
  return src_dev * info.num_devices + dst_dev;
}

ffi::ErrorOr<int> MpiTag(const OpInfo& info, const MpiTransport& mpi, int64_t src_dev,
                         int64_t dst_dev) {
  const int64_t tag = PairTag(info, src_dev, dst_dev);
  if (tag > mpi.tag_ub()) {
    std::ostringstream s;
    s << info.op << ": " << info.num_devices << " devices need MPI tags up to "
      << info.num_devices * info.num_devices << " but this MPI's MPI_TAG_UB is " << mpi.tag_ub();
    return ffi::Unexpected(ffi::Error::Internal(s.str()));
  }
  return static_cast<int>(tag);
}

// " (MPI rank R on host H)": where a peer process runs, for messages about MPI traffic.
std::string MpiPeer(int rank) {
  std::string host = Runtime::Get().host_of_rank(rank);
  return " (MPI rank " + std::to_string(rank) + (host.empty() ? "" : " on host " + host) + ")";
}

std::string MpiMissing(const OpInfo& info, int64_t me, int64_t peer) {
  std::ostringstream s;
  if (Closing()) {  // a program nobody waited for, still running at exit
    s << info.op << " of " << info.operand << " on " << ProcessSuffix(info, me) << " with "
      << ProcessSuffix(info, peer) << " ran after this process closed its MPI transport at "
         "exit: ended without moving the message. Wait for the outputs of every program "
         "before the program ends (jax.block_until_ready).";
    return s.str();
  }
  s << info.op << ": " << ProcessSuffix(info, me) << " and its peer " << ProcessSuffix(info, peer)
    << " live in different processes, but this process has no MPI communicator attached. "
       "Launch every process with mpirun/srun, call jax.distributed.initialize() before "
       "creating the mesh, and import jax_cpu_mpi before lowering the program.";
  return s.str();
}

// A psend on a channel whose receiver may still wait for a message of a call that failed on
// this device before its psend there ran (failed_runs.h): refused, naming that failure.
ffi::Error RefusedSend(const OpInfo& info, int64_t me, int64_t peer, const std::string& why) {
  std::ostringstream s;
  s << info.op << " of " << info.operand << " from " << ProcessSuffix(info, me) << " to "
    << ProcessSuffix(info, peer) << " refused: an earlier call of a program that sends on "
    << "this channel (device " << info.device_index[me] << " -> device "
    << info.device_index[peer] << ") failed on this device (" << why << "). XLA runs no "
    << "further op of a program on a device once one has failed, so that call's psend on "
    << "this channel may have been skipped while its peer's precv still waits for it: this "
    << "psend's message would reach that precv, which cannot tell it from its own (it would "
    << "return this call's bytes as the earlier call's, and this call's precv would wait in "
    << "vain). Every later psend on this channel in this process is refused: after a failed "
    << "psend/precv, restart the job, as after a failed NCCL op (catching the error does "
    << "not make the channels usable again).";
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, s.str());
}

// A kept psend's finish (KeptFinish: a plain function, the send, and what its error says).
// A mailbox send: done once the receiver has copied it.
Status FinishKeptOffer(const KeptFinish& f, Clock::time_point /*deadline*/) {
  Runtime::Get().mailbox().Finish(std::static_pointer_cast<Mailbox::Offer>(f.send));
  return Status::Ok();
}

// What the error of a kept MPI send names: the op's texts, shared by the sends of one call
// site (KeptTextOf), and in KeptFinish::values:
enum KeptValue {
  kDest, kTag, kReverseTag, kMe, kPeer, kMeProcess, kPeerProcess, kMyDev, kPeerDev
};
struct KeptText {
  std::string op, operand;
};

// The texts of `op` and `operand` for a kept send's error: made once per call site and
// thread and shared by its sends (a copy per send was an allocation per message). A few
// sites per thread alternate (a step's ops); a site not among the last few is made again.
std::shared_ptr<const KeptText> KeptTextOf(std::string_view op, std::string_view operand) {
  thread_local std::array<std::shared_ptr<const KeptText>, 8> cache;
  thread_local size_t next = 0;
  for (const std::shared_ptr<const KeptText>& t : cache) {
    if (t && t->op == op && t->operand == operand) return t;
  }
  auto made = std::make_shared<const KeptText>(KeptText{std::string(op), std::string(operand)});
  cache[next++ % cache.size()] = made;
  return made;
}

// A kept MPI send (MpiTransport::DirectSend: framed, deferred or direct).
Status FinishKeptMpiSend(const KeptFinish& f, Clock::time_point deadline) {
  Runtime::MpiOpScope active;
  MpiTransport& mpi = *static_cast<MpiTransport*>(f.owner.get());
  const int dest = static_cast<int>(f.values[kDest]);
  Status done =
      mpi.FinishDirect(std::static_pointer_cast<MpiTransport::DirectSend>(f.send), deadline);
  // A deferred send that was staged (here, or by a receive loop or the progress
  // thread's watch, when its receiver came late) is done for this device, but its copy
  // may not have moved yet: it moves only while this process calls MPI (over TCP, and
  // over UCX's shared memory on one node too), and after this precv the device may not
  // call MPI again (the peer then waited for it until its receive timeout), so the
  // progress thread takes it on, as after a psend.
  if (mpi.has_staged_sends()) Runtime::Get().mpi_send_in_flight();
  if (done.ok()) return done;
  if (!Closing()) Runtime::Get().note_unreachable_peer(dest);
  const auto& text = *static_cast<const KeptText*>(f.text.get());
  std::ostringstream what;
  what << text.op << " of " << text.operand << " from partition " << f.values[kMe]
       << " (process " << f.values[kMeProcess] << ") to partition " << f.values[kPeer]
       << " (process " << f.values[kPeerProcess] << ")" << MpiPeer(dest) << " failed: ";
  if (done.code() == StatusCode::kSendTimeout && !Closing()) {
    done = done.WithSuffix(mpi.StallReport(dest, static_cast<int>(f.values[kReverseTag]),
                                           static_cast<int>(f.values[kTag])));
  }
  done = done.WithPrefix(what.str());
  // Counted as sent when its psend ran: its receiver may still wait for it (a send
  // cancelled), and would take the channel's next message as this one.
  const std::string& error = done.message();
  Runtime::Get().suspect_channels().MarkSend(f.values[kMyDev], f.values[kPeerDev],
                                             error.substr(0, error.find('\n')));
  return done;
}

ffi::Error Psend(int64_t run_id, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> partition,
                 ffi::Result<ffi::Token> /*token*/, const OpInfo& info, int64_t operand_kept) {
  const std::string_view op = info.op, operand = info.operand;
  const I64Span device_index = info.device_index, device_process = info.device_process;
  const int64_t me = static_cast<int64_t>(partition.typed_data()[0]);
  if (ffi::Error e = CheckTables(info, me); e.failure()) return e;
  const int64_t peer = FindPeer(info, me, /*me_is_source=*/true);
  if (peer < 0) return ffi::Error::Success();  // not a source: sends nothing

  Runtime& rt = Runtime::Get();
  const size_t bytes = x.size_bytes();
  const int64_t my_dev = device_index[me], peer_dev = device_index[peer];
  const bool kept = operand_kept != 0;
  const bool local = device_process[peer] == device_process[me];
  if (rt.suspect_channels().any_sends()) [[unlikely]] {
    const std::string why = rt.suspect_channels().FindSend(my_dev, peer_dev);
    // A broken transport's own error goes first, as for a precv (Receive).
    const std::shared_ptr<MpiTransport> mpi = local ? nullptr : rt.state().mpi;
    if (!why.empty() && !(mpi && mpi->broken())) return RefusedSend(info, me, peer, why);
  }
  if (local) {
    std::shared_ptr<Mailbox::Offer> offer =
        rt.mailbox().Send({my_dev, peer_dev}, x.untyped_data(), bytes, std::string(operand), kept);
    rt.suspect_channels().NoteSent(my_dev, peer_dev, run_id);
    if (offer) {
      trace::NotePath(trace::Path::kKept);
      KeptFinish finish;
      finish.fn = &FinishKeptOffer;
      finish.send = std::move(offer);
      rt.kept_sends().Add(x.untyped_data(), run_id, me, operand_kept, std::move(finish));
    }
    return ffi::Error::Success();
  }
  Runtime::MpiOpScope active;  // the exit keeps the transport until this returns
  const Runtime::State state = rt.state();
  const std::shared_ptr<MpiTransport>& mpi = state.mpi;
  if (!mpi) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, MpiMissing(info, me, peer));
  ffi::ErrorOr<int> tag = MpiTag(info, *mpi, my_dev, peer_dev);
  if (tag.has_error()) return tag.error();
  const int dest = mpi->RankOfProcess(device_process[peer]);
  if (dest < 0) {
    return ffi::Error::Internal(std::string(op) + ": no MPI rank known for " +
                                ProcessSuffix(info, peer));
  }
  const Config& config = state.config;
  // An operand sent again and again (a parameter sent at every step of a loop, a carry
  // received into and sent from) has its 4 KiB pages moved onto huge pages, once: MPI's
  // single copy out of it pins each of the sender's pages (common/keep_freed_memory.h).
  if (bytes >= kHugePageHintBytes) CollapseReusedBuffer(x.untyped_data(), bytes);
  std::shared_ptr<MpiTransport::DirectSend> in_flight;
  // This device also receives in the op's group (a cycle, or another op of the step): the
  // precvs that keep the operand run next and receive, so a large send may wait there for
  // its receiver instead of being copied.
  const bool receives_too = ReceivesInGroup(info, me);
  Status r = mpi->Send(dest, *tag, x.untyped_data(), bytes, operand, config.max_inflight_bytes,
                       DeadlineAfter(config.recv_timeout_s), kept ? &in_flight : nullptr,
                       kept && receives_too);
  if (in_flight) {
    trace::NotePath(trace::Path::kKept);
    // Finished by the precv that keeps the operand; its error names this psend. Its text
    // is the call site's, made once (KeptTextOf): this runs for every send of an exchange.
    KeptFinish finish;
    finish.fn = &FinishKeptMpiSend;
    finish.send = in_flight;
    finish.owner = mpi;
    finish.text = KeptTextOf(op, operand);
    finish.values[kDest] = dest;
    finish.values[kTag] = *tag;
    finish.values[kReverseTag] = PairTag(info, peer_dev, my_dev);
    finish.values[kMe] = me;
    finish.values[kPeer] = peer;
    finish.values[kMeProcess] = device_process[me];
    finish.values[kPeerProcess] = device_process[peer];
    finish.values[kMyDev] = my_dev;
    finish.values[kPeerDev] = peer_dev;
    rt.kept_sends().Add(x.untyped_data(), run_id, me, operand_kept, std::move(finish));
  }
  // Only a staged send left in flight needs the progress thread (the kept send's finish
  // above wakes it for a deferred send staged later): waking it after every
  // psend (most small sends complete at once) costs a context switch per hop. A direct send
  // left in flight does not: the precv that keeps its operand finishes it (over TCP its
  // bytes may then move only once that precv runs, as when psend waited for them).
  // A deferred send (a cycle) is posted by the precv that runs next, but between the two
  // this device may wait where nothing polls MPI's receives (a collective, a mailbox
  // receive), and the peer may be waiting for this send before it gets there: the progress
  // thread watches deferred sends, without a wake-up per psend (Runtime::mpi_send_deferred).
  if (r.ok()) {
    rt.suspect_channels().NoteSent(my_dev, peer_dev, run_id);
    if (mpi->has_staged_sends()) rt.mpi_send_in_flight();
    else if (in_flight && mpi->has_deferred_sends()) rt.mpi_send_deferred();
  }
  if (!r.ok()) {
    if (!Closing()) rt.note_unreachable_peer(dest);
    std::ostringstream s;
    s << op << " of " << operand << " from " << ProcessSuffix(info, me) << " to "
      << ProcessSuffix(info, peer) << MpiPeer(dest) << " failed: " << r.message();
    if (r.code() == StatusCode::kSendTimeout && !Closing()) {
      s << mpi->StallReport(dest, static_cast<int>(PairTag(info, peer_dev, my_dev)), *tag);
    }
    return ffi::Error(ErrorCodeOf(r), s.str());
  }
  return ffi::Error::Success();
}

std::string SizeMismatch(const OpInfo& info, int64_t me, int64_t peer, size_t expected,
                         size_t got, std::string_view sender_desc) {
  std::ostringstream s;
  s << info.op << " on " << ProcessSuffix(info, me) << " expected " << info.operand << " ("
    << expected << " bytes) from " << ProcessSuffix(info, peer) << ", but the matching psend sent ";
  if (!sender_desc.empty()) s << sender_desc << " (" << got << " bytes)";
  else s << got << " bytes";
  s << ". psend's operand and precv's out_shape must have the same shape and dtype.";
  return s.str();
}

// The same byte count as the receiver's, but another dtype or shape: the bytes would be
// reinterpreted (float32 bits read as int32), so the receive fails instead.
std::string TypeMismatch(const OpInfo& info, int64_t me, int64_t peer, size_t bytes,
                         std::string_view sender_desc) {
  std::ostringstream s;
  s << info.op << " on " << ProcessSuffix(info, me) << " expected " << info.operand << " ("
    << bytes << " bytes) from " << ProcessSuffix(info, peer) << ", but the matching psend sent ";
  if (!sender_desc.empty()) {
    s << sender_desc << " (" << bytes << " bytes): the byte counts agree, but the receiver "
      << "would reinterpret the sender's " << sender_desc << " as the receiver's "
      << info.operand;
  } else {
    s << bytes << " bytes of another dtype or shape than " << info.operand;
  }
  s << ". psend's operand and precv's out_shape must have the same shape and dtype.";
  return s.str();
}

// `mpi_peer`: MpiPeer() of the sender when the message comes over MPI, else empty.
// `partly`: the transport's word that the message matched but did not arrive whole (its
// sender stopped mid-message), else empty.
std::string Timeout(const OpInfo& info, int64_t me, int64_t peer, double seconds,
                    const std::string& mpi_peer = "", const std::string& partly = "") {
  std::ostringstream s;
  if (Closing()) {  // ended by the exit (Runtime::close), not by its own deadline
    s << info.op << " on " << ProcessSuffix(info, me) << " was still waiting for "
      << info.operand << " from " << ProcessSuffix(info, peer) << mpi_peer
      << " when the process exited: ended at exit after the grace period "
         "(JAX_CPU_MPI_EXIT_GRACE). The pair (" << peer << ", " << me
      << ") had no psend that ran before the exit, or the program ended without waiting "
         "for its outputs (jax.block_until_ready).";
    return s.str();
  }
  s << info.op << " on " << ProcessSuffix(info, me) << " waited " << seconds
    << " s for " << info.operand << " from " << ProcessSuffix(info, peer) << mpi_peer;
  if (!partly.empty()) {
    s << " and the message did not arrive whole (" << partly
      << "): the peer process is stuck, has died, or cannot be reached over the network "
         "(set JAX_CPU_MPI_RECV_TIMEOUT to wait longer).";
    return s.str();
  }
  s << " and no message arrived: no psend with the pair (" << peer << ", " << me << ") ran";
  if (!mpi_peer.empty()) {
    s << ", or the peer process is stuck, has died, or cannot be reached over the network";
  }
  s << ". Make sure a psend with the same axis and pairs runs on the source device "
       "(set JAX_CPU_MPI_RECV_TIMEOUT to wait longer).";
  return s.str();
}

// A precv on a channel that a failed call, or a precv that timed out, may have left a
// message in (failed_runs.h): refused, naming that failure.
ffi::Error RefusedAfterFailure(const OpInfo& info, int64_t me, int64_t peer,
                               const SuspectChannels::Suspect& suspect) {
  std::ostringstream s;
  s << info.op << " of " << info.operand << " on " << ProcessSuffix(info, me) << " from "
    << ProcessSuffix(info, peer) << " refused: ";
  if (suspect.timed_out) {
    s << "an earlier precv on this channel (device " << info.device_index[peer]
      << " -> device " << info.device_index[me] << ") timed out (" << suspect.why
      << "). Its peer's psend may still run, later than that precv waited: its message "
      << "would then be in the channel, and this precv cannot tell it from its own (it "
      << "would return the earlier call's bytes as this call's).";
  } else {
    s << "an earlier call of a program that receives on this channel (device "
      << info.device_index[peer] << " -> device " << info.device_index[me]
      << ") failed on this device (" << suspect.why << "). XLA runs no further op of a "
      << "program on a device once one has failed, so that call's precv on this channel "
      << "may have been skipped while its peer's psend ran: the peer's message may still "
      << "be in the channel, and this precv cannot tell it from its own (it would return "
      << "the earlier call's bytes as this call's).";
  }
  s << " Every later precv on this channel in this process is refused: after a failed "
    << "psend/precv, restart the job, as after a failed NCCL op (catching the error does "
    << "not make the channels usable again).";
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, s.str());
}

// A precv that timed out marks its channel: a message that comes later would be taken by
// the channel's next precv as its own. Returns the timeout's error.
ffi::Error TimedOut(const OpInfo& info, int64_t me, int64_t peer, std::string message) {
  Runtime::Get().suspect_channels().Mark(info.device_index[peer], info.device_index[me],
                                         message.substr(0, message.find('\n')),
                                         /*timed_out=*/true);
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, std::move(message));
}

// Sets *deadline to the receive's deadline once it has one (it is left alone otherwise).
// A receive that ran is counted for the run `run_id` (SuspectChannels::NoteTaken) whatever
// its outcome: received, or refused for a mismatch (the message is consumed either way), or
// timed out (its channel is marked then: TimedOut).
ffi::Error Receive(int64_t run_id, ffi::Buffer<ffi::U32> partition,
                   ffi::Result<ffi::AnyBuffer> out, const OpInfo& info,
                   Clock::time_point* deadline_out) {
  const std::string_view op = info.op, operand = info.operand;
  const I64Span device_index = info.device_index, device_process = info.device_process;
  const int64_t me = static_cast<int64_t>(partition.typed_data()[0]);
  if (ffi::Error e = CheckTables(info, me); e.failure()) return e;
  const size_t bytes = out->size_bytes();
  const int64_t peer = FindPeer(info, me, /*me_is_source=*/false);
  if (peer < 0) {  // not a destination: zeros, like ppermute
    // A large send that this precv keeps may be deferred (mpi/transport.h): post it first
    // if its receiver is ready, so that the zero-fill (or what follows) overlaps its
    // transfer.
    if (bytes >= kPostBeforeZeroFillBytes) {
      if (std::shared_ptr<MpiTransport> mpi = Runtime::Get().state().mpi) {
        (void)mpi->ProgressDeferred(DeadlineAfter(Runtime::Get().config().recv_timeout_s));
      }
    }
    if (info.zero_fill) ZeroFill(out->untyped_data(), bytes);
    else if (PoisonUninitialized()) [[unlikely]] Poison(*out);  // the program selects zeros
    return ffi::Error::Success();
  }

  Runtime& rt = Runtime::Get();
  const bool local = device_process[peer] == device_process[me];
  if (rt.suspect_channels().any()) [[unlikely]] {
    const SuspectChannels::Suspect suspect =
        rt.suspect_channels().Find(device_index[peer], device_index[me]);
    // A broken transport's own error goes first (below): it says to end the job, and why
    // no MPI call is made any more, which the channel's mark does not.
    const std::shared_ptr<MpiTransport> mpi = local ? nullptr : rt.state().mpi;
    if (!suspect.why.empty() && !(mpi && mpi->broken())) {
      return RefusedAfterFailure(info, me, peer, suspect);
    }
  }
  // The mailbox needs no transport: copying the shared pointer would bounce its count
  // between the device threads of the process on every hop.
  const Runtime::State state = local ? Runtime::State{rt.config(), nullptr} : rt.state();
  const Config& config = state.config;
  const auto deadline = DeadlineAfter(config.recv_timeout_s);
  *deadline_out = deadline;
  const int64_t my_dev = device_index[me], peer_dev = device_index[peer];
  if (local) {
    Status r = rt.mailbox().Recv({peer_dev, my_dev}, out->untyped_data(), bytes, operand,
                                 deadline);
    rt.suspect_channels().NoteTaken(peer_dev, my_dev, run_id);
    switch (r.code()) {
      case StatusCode::kOk:
        return ffi::Error::Success();
      case StatusCode::kSizeMismatch:
        return ffi::Error::InvalidArgument(
            SizeMismatch(info, me, peer, bytes, r.sender_bytes(), r.sender_desc()));
      case StatusCode::kTypeMismatch:
        return ffi::Error::InvalidArgument(TypeMismatch(info, me, peer, bytes, r.sender_desc()));
      case StatusCode::kTimeout:
        return TimedOut(info, me, peer, Timeout(info, me, peer, config.recv_timeout_s));
      default:  // the mailbox reports nothing else
        return ffi::Error::Internal(std::string(op) + ": " + r.message());
    }
  }
  const std::shared_ptr<MpiTransport>& mpi = state.mpi;
  if (!mpi) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, MpiMissing(info, me, peer));
  Runtime::MpiOpScope active;  // the exit keeps the transport until this returns
  ffi::ErrorOr<int> tag = MpiTag(info, *mpi, peer_dev, my_dev);
  if (tag.has_error()) return tag.error();
  const int source = mpi->RankOfProcess(device_process[peer]);
  if (source < 0) {
    return ffi::Error::Internal(std::string(op) + ": no MPI rank known for " +
                                ProcessSuffix(info, peer));
  }
  // The op's psends are kept (their operands stay alive until a precv of the group finishes
  // them; where the sender also receives in the group, they defer) exactly when its precvs
  // have group pairs (passes/kept_operands.py): the sender then takes the rendezvous path
  // from a smaller size on and reads this receive's ready signal (mpi/transport.h); a
  // sender that never reads ready signals must get none (they would pile up unread).
  const bool sender_kept = info.group_pairs.size() > 0;
  // A kept sender that receives nothing in the group frames its message from its operand
  // at once (MpiTransport::SendFramed): it reads no ready signal.
  const bool sender_one_way = sender_kept && !ReceivesInGroup(info, peer);
  // A large output is often fresh memory (XLA allocates a program's outputs at every call:
  // a new map, or heap that glibc trimmed). Unadvised, it gets 4 KiB pages for as long as it
  // lives: MPI's copy into it faults them in one at a time, and every later hop that sends
  // from it or receives into it again (a loop carry) handles 512 times as many pages (MPICH's
  // single copy pins each page of the sender's buffer). From NumPy's threshold for the same
  // hint, as a collective's output: mpi4py's receive into a NumPy array that large writes
  // huge pages. A no-op on memory already faulted in, and cheap once the range is advised:
  // memory already faulted in with 4 KiB pages (a carry whose first value XLA wrote, a
  // donated buffer) is collapsed into huge pages the second time it receives.
  if (bytes >= kHugePageHintBytes) {
    AdviseHugePages(out->untyped_data(), bytes);
    CollapseReusedBuffer(out->untyped_data(), bytes);
  }
  Status r = mpi->Recv(source, *tag, out->untyped_data(), bytes, operand, deadline,
                       sender_kept, sender_one_way);
  rt.suspect_channels().NoteTaken(peer_dev, my_dev, run_id);
  if (r.ok()) return ffi::Error::Success();
  if (r.code() == StatusCode::kSizeMismatch) {
    return ffi::Error::InvalidArgument(
        SizeMismatch(info, me, peer, bytes, r.sender_bytes(), r.sender_desc()));
  }
  if (r.code() == StatusCode::kTypeMismatch) {
    return ffi::Error::InvalidArgument(TypeMismatch(info, me, peer, bytes, r.sender_desc()));
  }
  // An op ended at exit says nothing about its peer (it may just be slower to finish).
  if (!Closing()) rt.note_unreachable_peer(source);
  if (r.code() == StatusCode::kTimeout) {
    // The transport's state goes with the error (not at exit: the peer is only slower):
    // a stall seen once in many launches is explained by the error it ends with.
    std::string state;
    if (!Closing()) {
      state = mpi->StallReport(source, *tag, static_cast<int>(PairTag(info, my_dev, peer_dev)));
    }
    return TimedOut(info, me, peer,
                    Timeout(info, me, peer, config.recv_timeout_s, MpiPeer(source),
                            r.message()) +
                        state);
  }
  std::ostringstream s;
  s << op << " of " << operand << " on " << ProcessSuffix(info, me) << " from "
    << ProcessSuffix(info, peer) << MpiPeer(source) << " failed: " << r.message();
  return ffi::Error::Internal(s.str());
}

// precv: receives (or zero-fills), then counts itself off the sends made from the operands
// it keeps alive (operand_kept of them), finishing those it is the last keeper of, whatever
// the outcome of its own receive.
ffi::Error Precv(int64_t run_id, ffi::Token /*token*/, ffi::Buffer<ffi::U32> partition,
                 ffi::RemainingArgs kept, ffi::Result<ffi::AnyBuffer> out, const OpInfo& info,
                 int64_t operand_kept) {
  const std::string_view op = info.op;
  Clock::time_point receive_deadline = Clock::time_point::min();
  ffi::Error received = Receive(run_id, partition, out, info, &receive_deadline);
  // After a successful receive a kept send gets a whole timeout of its own, as a psend
  // would. After a failed one it gets what is left of the receive's deadline, at least
  // kKeptSendGraceAfterFailure: its error must not come a whole timeout after the
  // receive's, and a send that is just completing still may.
  auto send_deadline = [&received, receive_deadline] {
    if (received.failure()) {
      return std::max(receive_deadline, Clock::now() + kKeptSendGraceAfterFailure);
    }
    return DeadlineAfter(Runtime::Get().config().recv_timeout_s);
  };
  // A group's precv keeps a few operands (its psends' and their u32 results).
  constexpr size_t kMaxKept = 64;
  std::array<const void*, kMaxKept> small;
  std::vector<const void*> large;
  const void** addresses = small.data();
  if (kept.size() > kMaxKept) {
    large.resize(kept.size());
    addresses = large.data();
  }
  for (size_t i = 0; i < kept.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> operand_buffer = kept.get<ffi::AnyBuffer>(i);
    if (operand_buffer.has_error()) return operand_buffer.error();
    addresses[i] = operand_buffer->untyped_data();
  }
  const int64_t me = static_cast<int64_t>(partition.typed_data()[0]);
  Status send_status = Runtime::Get().kept_sends().Release(addresses, kept.size(), run_id, me,
                                                           send_deadline);
  if (static_cast<int64_t>(kept.size()) != operand_kept) {  // after finishing them all
    return ffi::Error::Internal(std::string(op) + ": malformed call (" +
                                std::to_string(kept.size()) + " kept operands, expected " +
                                std::to_string(operand_kept) + ")");
  }
  if (received.failure() || send_status.ok()) return received;
  return ffi::Error(ErrorCodeOf(send_status), send_status.message());
}

// Tracing (common/trace.h): the op's event, timed around the whole handler. A device that
// is neither source nor destination moves no message and gets no event.
template <typename Body>
[[gnu::noinline]] ffi::Error Traced(trace::Op op, const OpInfo& info,
                                    ffi::Buffer<ffi::U32> partition, size_t bytes, Body body) {
  trace::Notes() = {};
  const int64_t start = trace::NowNs();
  ffi::Error result = body();
  const int64_t end = trace::NowNs();
  const int64_t me = static_cast<int64_t>(partition.typed_data()[0]);
  const int64_t n = static_cast<int64_t>(info.device_index.size());
  if (me < 0 || me >= n || static_cast<int64_t>(info.device_process.size()) != n) {
    return result;
  }
  const bool sending = op == trace::Op::kPsend;
  const int64_t peer = FindPeer(info, me, sending);
  if (peer < 0 || peer >= n) return result;
  const trace::OpNotes notes = trace::Notes();
  trace::Event e;
  e.start_ns = start;
  e.dur_ns = end - start;
  e.wait_ns = std::min(notes.wait_ns, e.dur_ns);
  e.process = info.device_process[me];
  e.device = info.device_index[me];
  e.peer = info.device_index[peer];
  e.bytes = bytes;
  e.op = op;
  const bool local = info.device_process[peer] == info.device_process[me];
  e.path = notes.path != trace::Path::kUnknown ? notes.path
           : local                              ? trace::Path::kLocal
                                                : trace::Path::kStaged;
  e.seq = notes.has_seq ? notes.seq
                        : trace::NextLocalSeq(op, sending ? e.device : e.peer,
                                              sending ? e.peer : e.device);
  e.ok = !result.failure();
  trace::Record(e);
  return result;
}

// A failed op is kept for the report at exit (Runtime::note_failed_op): JAX drops the error
// of an output that nobody reads, and with it the only word of a refused or lost message.
ffi::Error Noted(ffi::Error result) {
  if (result.failure()) [[unlikely]] Runtime::Get().note_failed_op(result.message());
  return result;
}

// How often a program's psends or precvs (PROGRAM_SENDS / PROGRAM_RECEIVES: each pair as
// often as its ops run at most in a call, with -1 - destination where one may run any
// number of times, a loop) use each channel of partition `me`, by peer partition: as
// source where `me_is_source`, else as destination. Pairs outside the axis are skipped.
struct PairRuns {
  int64_t once = 0;     // ops on the channel that run at most once per call
  bool repeat = false;  // one that may run any number of times
};
std::map<int64_t, PairRuns> RunsByPeer(I64Span pairs, int64_t me, int64_t n, bool me_is_source) {
  std::map<int64_t, PairRuns> runs;
  for (size_t i = 0; i + 1 < pairs.size(); i += 2) {
    const int64_t src = pairs[i];
    const bool repeat = pairs[i + 1] < 0;
    const int64_t dst = repeat ? -1 - pairs[i + 1] : pairs[i + 1];
    if (src < 0 || src >= n || dst >= n || (me_is_source ? src : dst) != me) continue;
    PairRuns& r = runs[me_is_source ? dst : src];
    if (repeat) r.repeat = true;
    else ++r.once;
  }
  return runs;
}

// The psends of the run that XLA skips on that device leave their peers' precvs waiting
// (over MPI, in a call that goes on): their channels are marked for psends
// (failed_runs.h), so that no later psend's message meets such a precv.
void MarkSkippedSends(const OpInfo& info, int64_t run_id, int64_t me, const std::string& why) {
  const int64_t n = static_cast<int64_t>(info.device_index.size());
  SuspectChannels& suspect = Runtime::Get().suspect_channels();
  const int64_t my_dev = info.device_index[me];
  for (const auto& [dst, r] : RunsByPeer(info.program_sends, me, n, /*me_is_source=*/true)) {
    const int64_t dst_dev = info.device_index[dst];
    if (!r.repeat && suspect.Sent(my_dev, dst_dev, run_id) >= r.once) continue;
    suspect.MarkSend(my_dev, dst_dev, why);
  }
}

// The precvs of the run that XLA skips on that device may leave their peers' messages in
// their channels: those channels are marked (failed_runs.h). The pair (-1, -1) in
// PROGRAM_RECEIVES says the program runs collectives (custom_calls.RUNS_COLLECTIVES).
void MarkSkippedReceives(const OpInfo& info, int64_t run_id, int64_t me,
                         const std::string& error) {
  const int64_t n = static_cast<int64_t>(info.device_index.size());
  if (me < 0 || me >= n) return;
  bool runs_collectives = false;
  for (size_t i = 0; i + 1 < info.program_receives.size(); i += 2) {
    if (info.program_receives[i] == -1 && info.program_receives[i + 1] == -1) {
      runs_collectives = true;
    }
  }
  SuspectChannels& suspect = Runtime::Get().suspect_channels();
  const int64_t my_dev = info.device_index[me];
  const std::string why = std::string(info.op) + " failed on " + ProcessSuffix(info, me) +
                          ": " + error.substr(0, error.find('\n'));
  for (const auto& [src, r] :
       RunsByPeer(info.program_receives, me, n, /*me_is_source=*/false)) {
    const int64_t src_dev = info.device_index[src];
    if (!r.repeat && suspect.Taken(src_dev, my_dev, run_id) >= r.once) continue;
    suspect.Mark(src_dev, my_dev, why);
  }
  if (runs_collectives) suspect.MarkCollectives(why);
  MarkSkippedSends(info, run_id, me, why);
}

// A failed op also finishes the sends of its program run and device that later precvs were
// to finish: XLA runs no further thunk of the program on that device, so those precvs never
// run, and the operands they kept alive are freed when the program ends, while a deferred
// send (or a direct send in flight) still points into them (mpi/transport.h). Finished now,
// while the operands are still alive, each is posted, staged or cancelled, and nothing
// reads them afterwards (a precv of another run at the same address finishes none of them).
// What goes wrong with them is kept for the report at exit (the op's own error stands).
// It also marks the channels that the skipped precvs may have left messages in
// (MarkSkippedReceives), and those whose receivers may wait for a skipped psend
// (MarkSkippedSends), where the op's attributes could be read (`info`).
ffi::Error Settled(ffi::Error result, int64_t run_id, ffi::Buffer<ffi::U32> partition,
                   const OpInfo* info) {
  if (!result.failure()) [[likely]] return result;
  const int64_t me = static_cast<int64_t>(partition.typed_data()[0]);
  if (info) MarkSkippedReceives(*info, run_id, me, result.message());
  Runtime::Get().settle_run_after_failure(run_id, me, result.message());
  return result;
}

// The registered handlers: with tracing off (the usual case) one predictable branch.
// A psend's second result, a u32 zero, exists only once the psend has run: XLA CPU orders
// custom calls at run time by their buffers, not their tokens, so an op that must run
// after this psend (an optimization_barrier's array, passes/kept_operands.py) takes it.
ffi::Error PsendImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> partition,
                     ffi::Result<ffi::Token> token, ffi::Result<ffi::Buffer<ffi::U32>> done,
                     std::string_view op, std::string_view operand, I64Span routing) {
  done->typed_data()[0] = 0;
  ffi::ErrorOr<Routing> unpacked = Unpack(routing, op, operand);
  if (unpacked.has_error()) [[unlikely]] {
    return Settled(Noted(unpacked.error()), run.run_id, partition, nullptr);
  }
  const OpInfo& info = unpacked->info;
  const int64_t operand_kept = unpacked->operand_kept;
  if (trace::Mode() == 0) [[likely]] {
    return Settled(Noted(Psend(run.run_id, x, partition, token, info, operand_kept)),
                   run.run_id, partition, &info);
  }
  return Settled(Noted(Traced(trace::Op::kPsend, info, partition, x.size_bytes(), [&] {
    return Psend(run.run_id, x, partition, token, info, operand_kept);
  })), run.run_id, partition, &info);
}

ffi::Error PrecvImpl(ffi::RunId run, ffi::Token token, ffi::Buffer<ffi::U32> partition,
                     ffi::RemainingArgs kept, ffi::Result<ffi::AnyBuffer> out,
                     std::string_view op, std::string_view operand, I64Span routing) {
  ffi::ErrorOr<Routing> unpacked = Unpack(routing, op, operand);
  if (unpacked.has_error()) [[unlikely]] {
    return Settled(Noted(unpacked.error()), run.run_id, partition, nullptr);
  }
  const OpInfo& info = unpacked->info;
  const int64_t operand_kept = unpacked->operand_kept;
  if (trace::Mode() == 0) [[likely]] {
    return Settled(Noted(Precv(run.run_id, token, partition, kept, out, info, operand_kept)),
                   run.run_id, partition, &info);
  }
  return Settled(Noted(Traced(trace::Op::kPrecv, info, partition, out->size_bytes(), [&] {
    return Precv(run.run_id, token, partition, kept, out, info, operand_kept);
  })), run.run_id, partition, &info);
}

}  // namespace
}  // namespace jcm

namespace {
// The attributes every psend/precv custom call carries (see python/jax_cpu_mpi/_src/ffi/custom_calls.py).
template <typename Binding>
auto WithRoutingAttributes(Binding binding) {
  return std::move(binding)
      .template Attr<std::string_view>("op")
      .template Attr<std::string_view>("operand")
      .template Attr<jcm::I64Span>("routing");
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcmPsend, jcm::PsendImpl,
                              WithRoutingAttributes(ffi::Ffi::Bind()
                                                        .Ctx<ffi::RunId>()
                                                        .Arg<ffi::AnyBuffer>()
                                                        .Arg<ffi::Buffer<ffi::U32>>()
                                                        .Ret<ffi::Token>()
                                                        .Ret<ffi::Buffer<ffi::U32>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcmPrecv, jcm::PrecvImpl,
                              WithRoutingAttributes(ffi::Ffi::Bind()
                                                        .Ctx<ffi::RunId>()
                                                        .Arg<ffi::Token>()
                                                        .Arg<ffi::Buffer<ffi::U32>>()
                                                        .RemainingArgs()
                                                        .Ret<ffi::AnyBuffer>()));
