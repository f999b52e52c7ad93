// The all-reduce of a group of devices spread over processes, NCCL's hierarchical way:
//   1. the group's devices in this process meet (a round of a LocalRound, keyed by the
//      group); the last to arrive leads: it reduces every local operand into its own output,
//      in ascending partition order;
//   2. the leader reduces that across the group's processes with one MPI_Iallreduce on the
//      group's communicator (MpiTransport::Allreduce), polled against the deadline;
//   3. the leader copies the result into the other local devices' outputs and ends the
//      round. Every device of the group thus gets the same bits.
// The reduction order is fixed: in process, partitions ascending; between processes, MPI's
// algorithm for the group's size and the byte count (the same on every run; MPICH's give
// every rank the same bits).
#include "ffi/collective_handlers.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "common/config.h"
#include "common/immortal.h"
#include "common/trace.h"
#include "ffi/runtime.h"
#include "local/reduce.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jcm {
namespace {

using I64Span = ffi::Span<const int64_t>;

// The devices of one group that live in this process meet here, once per collective.
class LocalRound {
 public:
  struct Slot {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t generation = 0;  // rounds completed
    bool leading = false;     // the leader of the current round has started
    int arrived = 0;
    std::vector<const void*> in;
    std::vector<void*> out;
    std::string error;  // of the last round ("" when it succeeded)
  };
  Slot& Get(const std::string& key, size_t members) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = slots_[key];
    if (!slot) {
      slot = std::make_unique<Slot>();
      slot->in.resize(members);
      slot->out.resize(members);
    }
    return *slot;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<Slot>> slots_;  // never erased
};

LocalRound& Rounds() {
  static Immortal<LocalRound> rounds;
  return rounds.get();
}

struct Group {
  std::vector<int64_t> local;      // partitions of the group in this process, ascending
  std::vector<int64_t> processes;  // processes of the group, ascending
  std::string key;                 // the group's global device indices
};

// The group of `me` (a row of `groups`, -1 padded); false if `me` is in none.
bool FindGroup(I64Span groups, int64_t group_size, I64Span device_index,
               I64Span device_process, int64_t me, Group* g) {
  const size_t rows = group_size > 0 ? groups.size() / group_size : 0;
  for (size_t r = 0; r < rows; ++r) {
    const int64_t* row = groups.begin() + r * group_size;
    if (std::find(row, row + group_size, me) == row + group_size) continue;
    std::ostringstream key;
    for (int64_t i = 0; i < group_size; ++i) {
      const int64_t p = row[i];
      if (p < 0) continue;
      key << device_index[p] << ',';
      if (device_process[p] == device_process[me]) g->local.push_back(p);
      g->processes.push_back(device_process[p]);
    }
    std::sort(g->local.begin(), g->local.end());
    std::sort(g->processes.begin(), g->processes.end());
    g->processes.erase(std::unique(g->processes.begin(), g->processes.end()),
                       g->processes.end());
    g->key = key.str();
    return true;
  }
  return false;
}

std::string Peers(const MpiTransport& mpi, const std::vector<int>& ranks) {
  std::ostringstream s;
  bool first = true;
  for (int r : ranks) {
    if (r == mpi.rank()) continue;
    std::string host = Runtime::Get().host_of_rank(r);
    s << (first ? "" : ", ") << "MPI rank " << r << (host.empty() ? "" : " on host " + host);
    first = false;
  }
  return s.str();
}

// Steps 1-3 above, as the leader: every local operand is in `in`, every output in `out`.
ffi::Error Lead(const std::vector<const void*>& in, const std::vector<void*>& out,
                ffi::DataType type, Reduction reduction, size_t count, size_t bytes,
                const Group& g, int64_t me, std::string_view op, std::string_view operand) {
  void* acc = out[0];
  // One device here: MPI reads the operand itself (no copy into the output first).
  const bool mpi_reads_operand = in.size() == 1 && g.processes.size() > 1 && acc != in[0];
  if (acc != in[0] && !mpi_reads_operand) std::memcpy(acc, in[0], bytes);
  for (size_t i = 1; i < in.size(); ++i) {
    if (!ReduceInto(type, reduction, acc, in[i], count)) {
      return ffi::Error::InvalidArgument(std::string(op) + ": no in-process reduction for " +
                                         std::string(operand));
    }
  }
  if (g.processes.size() > 1) {
    Runtime& rt = Runtime::Get();
    const Runtime::State state = rt.state();
    if (!state.mpi) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        std::string(op) + ": the group spans processes, but this process has "
                        "no MPI communicator attached. Launch every process with mpirun/srun "
                        "and import jax_cpu_mpi before lowering the program.");
    }
    MPI_Datatype mpi_type;
    MPI_Op mpi_op;
    if (!MpiReduction(type, reduction, &mpi_type, &mpi_op)) {
      return ffi::Error::InvalidArgument(std::string(op) + ": no MPI reduction for " +
                                         std::string(operand));
    }
    std::vector<int> ranks;
    for (int64_t p : g.processes) ranks.push_back(state.mpi->RankOfProcess(p));
    std::sort(ranks.begin(), ranks.end());
    Runtime::MpiOpScope active;  // the exit keeps the transport until this returns
    Status s = state.mpi->Allreduce(g.key, ranks, mpi_reads_operand ? in[0] : nullptr, acc,
                                    static_cast<int64_t>(count), mpi_type, mpi_op,
                                    DeadlineAfter(state.config.recv_timeout_s));
    if (!s.ok()) {
      std::ostringstream m;
      m << op << " of " << operand << " on partition " << me << " (process "
        << state.mpi->rank() << ") between processes";
      for (int r : ranks) m << ' ' << r;
      if (s.code() == StatusCode::kTimeout) {
        // A collective ended at exit says nothing about its peers (they may be slower).
        for (int r : ranks) {
          if (r != state.mpi->rank() && !Closing()) rt.note_unreachable_peer(r);
        }
        m << " waited " << state.config.recv_timeout_s << " s and the collective did not "
          << "complete: a peer (" << Peers(*state.mpi, ranks) << ") did not take part, is "
          << "stuck, has died, or cannot be reached (set JAX_CPU_MPI_RECV_TIMEOUT to wait "
          << "longer).";
      } else {
        m << " failed: " << s.message();
      }
      return ffi::Error::Internal(m.str());
    }
  }
  for (size_t i = 1; i < out.size(); ++i) std::memcpy(out[i], acc, bytes);
  return ffi::Error::Success();
}

// `after`: the previous collective's result in the same block of the program (unread: it
// only orders this call after that one, the same way on every process).
ffi::Error AllReduce(ffi::AnyBuffer x, ffi::Buffer<ffi::U32> partition,
                     ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> out,
                     I64Span groups, int64_t group_size, I64Span device_index,
                     I64Span device_process, int64_t site, std::string_view reduction,
                     std::string_view op, std::string_view operand) {
  const int64_t me = static_cast<int64_t>(partition.typed_data()[0]);
  const int64_t n = static_cast<int64_t>(device_index.size());
  if (me < 0 || me >= n || static_cast<int64_t>(device_process.size()) != n) {
    return ffi::Error::Internal(std::string(op) + ": malformed attributes");
  }
  for (int64_t p : groups) {
    if (p >= n) return ffi::Error::Internal(std::string(op) + ": malformed groups");
  }
  Reduction red;
  if (!ParseReduction(reduction, &red)) {
    return ffi::Error::Internal(std::string(op) + ": unknown reduction");
  }
  const size_t bytes = x.size_bytes();
  if (out->size_bytes() != bytes) {
    return ffi::Error::Internal(std::string(op) + ": operand and result sizes differ");
  }
  const size_t count = x.element_count();
  Group g;
  const bool found = FindGroup(groups, group_size, device_index, device_process, me, &g);
  // Each call site of a program has its own communicator and local round: collectives
  // that XLA runs in another order on another device or process never meet.
  g.key += "#" + std::to_string(site);
  if (!found ||
      (g.local.size() == 1 && g.processes.size() == 1)) {
    if (out->untyped_data() != x.untyped_data()) std::memcpy(out->untyped_data(), x.untyped_data(), bytes);
    return ffi::Error::Success();
  }
  if (g.local.size() == 1) {
    return Lead({x.untyped_data()}, {out->untyped_data()}, x.element_type(), red, count, bytes,
                g, me, op, operand);
  }

  const size_t pos = std::find(g.local.begin(), g.local.end(), me) - g.local.begin();
  LocalRound::Slot& slot = Rounds().Get(g.key, g.local.size());
  const double timeout_s = Runtime::Get().config().recv_timeout_s;
  std::unique_lock<std::mutex> lock(slot.mu);
  const uint64_t generation = slot.generation;
  slot.in[pos] = x.untyped_data();
  slot.out[pos] = out->untyped_data();
  if (++slot.arrived < static_cast<int>(g.local.size())) {
    // Wait for the other local devices until the deadline; once the leader has started,
    // for as long as it takes (its MPI wait has a deadline of its own).
    trace::WaitTimer waited;  // the timeline's wait: until the leader has finished
    waited.Waiting();
    const bool met = slot.cv.wait_until(lock, DeadlineAfter(timeout_s), [&] {
      return slot.generation != generation || slot.leading;
    });
    if (!met) {
      --slot.arrived;
      std::ostringstream m;
      m << op << " of " << operand << " on partition " << me << " waited " << timeout_s
        << " s for the other devices of its group in this process (partitions";
      for (int64_t p : g.local) m << ' ' << p;
      m << "), and not all of them got there: every device of the mesh must run the same "
           "collectives in the same order (set JAX_CPU_MPI_RECV_TIMEOUT to wait longer).";
      return ffi::Error::Internal(m.str());
    }
    slot.cv.wait(lock, [&] { return slot.generation != generation; });
    if (slot.error.empty()) return ffi::Error::Success();
    return ffi::Error::Internal(slot.error);
  }
  // The last to arrive leads: the others wait until the round ends.
  slot.leading = true;
  slot.arrived = 0;
  std::vector<const void*> in = slot.in;
  std::vector<void*> outs = slot.out;
  // The leader's own output accumulates: it comes first among the outputs (any output
  // will do: all get the same bits), while operands stay in partition order.
  std::swap(outs[0], outs[pos]);
  lock.unlock();
  ffi::Error result = Lead(in, outs, x.element_type(), red, count, bytes, g, me, op, operand);
  lock.lock();
  slot.error = result.failure() ? std::string(result.message()) : std::string();
  slot.leading = false;
  ++slot.generation;
  lock.unlock();
  slot.cv.notify_all();
  return result;
}

// The registered handler: with the timeline off (the usual case) one predictable branch;
// on, one slice per device and collective, with its bytes and its wait.
ffi::Error MaybeTraced(ffi::AnyBuffer x, ffi::Buffer<ffi::U32> partition,
                         ffi::RemainingArgs after, ffi::Result<ffi::AnyBuffer> out,
                         I64Span groups, int64_t group_size, I64Span device_index,
                         I64Span device_process, int64_t site, std::string_view reduction,
                         std::string_view op, std::string_view operand) {
  if (trace::Mode() == 0) [[likely]] {
    return AllReduce(x, partition, after, out, groups, group_size, device_index,
                     device_process, site, reduction, op, operand);
  }
  trace::Notes() = {};
  const int64_t start = trace::NowNs();
  ffi::Error result = AllReduce(x, partition, after, out, groups, group_size, device_index,
                                device_process, site, reduction, op, operand);
  const int64_t end = trace::NowNs();
  const int64_t me = static_cast<int64_t>(partition.typed_data()[0]);
  if (me < 0 || me >= static_cast<int64_t>(device_index.size()) ||
      device_process.size() != device_index.size()) {
    return result;
  }
  trace::Event e;
  e.start_ns = start;
  e.dur_ns = end - start;
  e.wait_ns = std::min(trace::Notes().wait_ns, e.dur_ns);
  e.process = device_process[me];
  e.device = device_index[me];
  e.peer = -1;
  e.bytes = x.size_bytes();
  e.seq = static_cast<uint64_t>(site);
  e.op = trace::Op::kAllReduce;
  e.ok = !result.failure();
  trace::Record(e);
  return result;
}

// A failed collective ends its program run (XLA runs no further thunk): the sends that the
// run's later precvs were to finish are finished now, while their operands are alive
// (KeptSends::FinishRun, and Settled in ffi/p2p_handlers.cc).
ffi::Error AllReduceImpl(xla::ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> partition,
                         ffi::RemainingArgs after, ffi::Result<ffi::AnyBuffer> out,
                         I64Span groups, int64_t group_size, I64Span device_index,
                         I64Span device_process, int64_t site, std::string_view reduction,
                         std::string_view op, std::string_view operand) {
  ffi::Error result = MaybeTraced(x, partition, after, out, groups, group_size, device_index,
                             device_process, site, reduction, op, operand);
  if (result.failure()) [[unlikely]] {
    Status s = Runtime::Get().kept_sends().FinishRun(
        run.run_id, static_cast<int64_t>(partition.typed_data()[0]),
        std::chrono::steady_clock::now() + std::chrono::milliseconds(500));
    if (!s.ok()) Runtime::Get().note_failed_op(s.message());
  }
  return result;
}

}  // namespace
}  // namespace jcm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcmAllReduce, jcm::AllReduceImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<jcm::I64Span>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<jcm::I64Span>("device_index")
                                  .Attr<jcm::I64Span>("device_process")
                                  .Attr<int64_t>("site")
                                  .Attr<std::string_view>("reduction")
                                  .Attr<std::string_view>("op")
                                  .Attr<std::string_view>("operand"));
