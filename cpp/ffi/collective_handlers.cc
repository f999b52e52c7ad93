// The all-reduce of a group of devices spread over processes, NCCL's hierarchical way:
//   1. the group's devices in this process meet (a round of a LocalRound, keyed by the
//      group); the last to arrive leads: it reduces every local operand into its own output,
//      in ascending partition order;
//   2. the leader reduces that across the group's processes with one MPI all-reduce on the
//      group's communicator (MpiTransport::Allreduce: a persistent request for small
//      messages, else MPI_Iallreduce), polled against the deadline;
//   3. the leader copies the result into the other local devices' outputs and ends the
//      round. Every device of the group thus gets the same bits.
// The reduction order is fixed: in process, partitions ascending; between processes, MPI's
// algorithm for the group's size and the byte count (the same on every run; MPICH's give
// every rank the same bits).
//
// Where the node has more busy threads than cores (WaitChoice::sleeps_soon: e.g. 2 ranks x 2
// devices on 2 cores), a device that does not lead does not wait in the meeting: its
// handler returns a pending xla::ffi::Future (XLA keeps the call's operands, results and
// attributes alive until it completes, and the CPU client's thread for that device blocks
// until its program is done). The leader writes its result, and the device's program then
// resumes on the thread of whoever completes the future: XLA's thunk executor runs the
// remaining thunks there. So one thread per process runs every device's program from
// collective to collective, instead of two threads taking turns on a core at every
// collective (a context switch each) or, worse, trading cores with the other process's
// threads. See Resumer for when a parked device resumes, and why not at once.
#include "ffi/collective_handlers.h"

#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "common/config.h"
#include "common/immortal.h"
#include "common/keep_freed_memory.h"
#include "common/trace.h"
#include "ffi/runtime.h"
#include "local/reduce.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jcm {
namespace {

using I64Span = ffi::Span<const int64_t>;

using Clock = std::chrono::steady_clock;

// The floating-point control state of a thread (flush to zero, denormals as zero,
// rounding): XLA sets it on the thread that runs a program, and a parked device's program
// that resumes on a thread of ours must compute with the same (Resumer::Run).
struct FpState {
#if defined(__x86_64__) || defined(__i386__)
  unsigned int csr = 0;
  static FpState Current() { return {_mm_getcsr()}; }
  void Apply() const { _mm_setcsr(csr); }
#elif defined(__aarch64__)
  uint64_t fpcr = 0;
  static FpState Current() { return {__builtin_aarch64_get_fpcr64()}; }
  void Apply() const { __builtin_aarch64_set_fpcr64(fpcr); }
#else
  static FpState Current() { return {}; }
  void Apply() const {}
#endif
};

// How a meeting's parked devices resumed of late (Resumer), kept by its slot and reached from
// its parked calls: a meeting whose parked devices resumed late (to the timer: no device of
// the meeting entered another one soon) kLate times in a row has its devices wait in it
// instead (its leader's program waits on something else after that collective, an
// in-process collective of XLA's or a precv from the parked device, or computes for long:
// a runner's wake then costs more than a waiting device's), all but a probe now and then,
// which parks to see whether that still holds (every kProbe-th round).
class MeetingPace {
 public:
  static constexpr uint32_t kLate = 2;
  static constexpr uint32_t kProbe = 1024;

  // Whether a device that does not lead this round parks (under the slot's mutex).
  bool Parks() {
    return late_.load(std::memory_order_relaxed) < kLate || ++probe_ % kProbe == 0;
  }
  // Its parked device resumed in time (entering another meeting), or late (the timer).
  void InTime() { late_.store(0, std::memory_order_relaxed); }
  void Late() { late_.fetch_add(1, std::memory_order_relaxed); }

 private:
  std::atomic<uint32_t> late_{0};
  uint32_t probe_ = 0;  // under the slot's mutex
};

// A device whose call returned a pending future (see the top of this file): what completing
// it needs. The strings are the call's attributes, which XLA keeps until it completes.
struct Parked {
  ffi::Promise promise;
  Clock::time_point deadline;  // of its wait for the group's other devices
  Clock::time_point due;       // when a Resumer thread resumes it (Resumer::Defer)
  int64_t run_id = 0;
  int64_t me = 0;
  std::string_view op, operand;
  FpState fp;  // the leader's, which ran XLA's program when it deferred this one
  // Its meeting's pace, in its slot (never erased).
  MeetingPace* pace = nullptr;
  bool traced = false;
  trace::Event event;  // its timeline slice, from its arrival (when traced)
};

// Set while this thread runs another device's program from a completed future (Complete):
// the outer call's state must survive whatever that program calls.
thread_local int g_inline_depth = 0;
// Set while that program runs inside another device's call, suspended under it on this
// thread (Resumer::ResumeFor), not on a runner of ours.
thread_local int g_under_call = 0;

// The devices of one group that live in this process meet here, once per collective.
class LocalRound {
 public:
  struct Slot {
    std::mutex mu;
    std::condition_variable cv;
    // Rounds completed, and whether the leader of the current round has started: written
    // under `mu`, read without it while a device yields.
    std::atomic<uint64_t> generation{0};
    std::atomic<bool> leading{false};
    int arrived = 0;
    int sleepers = 0;  // devices waiting on `cv` (the leader wakes them only if any)
    // The CPU each device (by position) last ran on, as it arrived or left (-1: unknown):
    // read without a lock by a device deciding how to wait (MeetLocally).
    // As many as `in` (set once, with the slot).
    std::unique_ptr<std::atomic<int>[]> cpu;
    std::vector<const void*> in;
    std::vector<void*> out;
    std::string error;  // of the last round ("" when it succeeded)
    std::vector<int64_t> partitions;  // the devices that meet here, ascending (set once)
    // By position: the devices of this round whose call returned a pending future.
    std::vector<std::optional<Parked>> parked;
    MeetingPace pace;
    int64_t error_leader = -1;  // the partition that led the last round, when it failed
  };
  Slot& Get(const std::string& key, const std::vector<int64_t>& local) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = slots_[key];
    if (!slot) {
      const size_t members = local.size();
      slot = std::make_unique<Slot>();
      slot->cpu = std::make_unique<std::atomic<int>[]>(members);
      for (size_t i = 0; i < members; ++i) slot->cpu[i].store(-1, std::memory_order_relaxed);
      slot->in.resize(members);
      slot->out.resize(members);
      slot->partitions = local;
      slot->parked.resize(members);
    }
    return *slot;
  }

  // Devices parked in a meeting, over all slots (changed under their slot's lock).
  std::atomic<int> parked{0};
  // Every slot (they are never erased), for the watch over parked devices.
  void Slots(std::vector<Slot*>* out) {
    std::lock_guard<std::mutex> lock(mu_);
    out->clear();
    for (auto& [key, slot] : slots_) out->push_back(slot.get());
  }

  // A meeting that timed out: its devices no longer run the same collectives, and every
  // call behind it would wait a whole timeout in turn (JAX keeps dozens in flight), so
  // every later meeting of the process fails at once, naming this first one.
  void Fail(const std::string& first) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load(std::memory_order_relaxed)) return;
    first_failure_ = first;
    failed_.store(true, std::memory_order_release);
  }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::string first_failure() {
    std::lock_guard<std::mutex> lock(mu_);
    return first_failure_;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<Slot>> slots_;  // never erased
  std::atomic<bool> failed_{false};
  std::string first_failure_;
};

LocalRound& Rounds() {
  static Immortal<LocalRound> rounds;
  return rounds.get();
}

// A device waiting for its group's leader yields its core in a loop before it sleeps on
// the slot's condition variable (JAX_CPU_MPI_WAIT=sleep: at once). A sleeping device costs
// every round a futex wake and a reschedule, and its core may go idle meanwhile; at each
// yield a sibling device thread, or another process's, that shares the core may run
// instead. It never spins without yielding: that delays the sibling it waits for whenever
// they share a core. But a yield does not always hand the core over (the scheduler may
// pick the yielding thread again, e.g. when the other thread has used more than its share),
// and the thread it waits for then runs only once this one sleeps: so the time a thread
// yields adapts, like an adaptive mutex's spin count. It grows after a wait that ended while
// yielding, halves after one that had to sleep, and once below kMeetYieldMin the thread
// sleeps at once, probing with kMeetYieldStart every kMeetProbe waits (CHANGELOG.md has
// the measurements).
// On a node with more busy threads than cores (WaitChoice::sleeps_soon), a device yields
// only while another device of its group last ran on its own core: a yield then hands that
// core to the device it waits for (with 2 ranks x 2 devices on 2 cores, each process's two
// device threads taking turns on one core, one context switch an op). Where the others run
// on other cores, its yields only pass the core back and forth with another process's
// threads, which may be yielding too, while the leader it waits for shares its core with
// the leader of the other process, whose MPI wait spins; no core ever goes idle, so the
// scheduler never moves them apart, and the placement held for whole runs (an 8 B psum took
// 35-45 us an op instead of 3, with 3-12 involuntary context switches an op instead of 1).
// Sleeping there leaves the core to the other process's thread, or idle, and the scheduler
// then moves a thread over.
constexpr int64_t kMeetYieldStartNs = 50'000;
constexpr int64_t kMeetYieldMaxNs = 200'000;
constexpr int64_t kMeetYieldMinNs = 2'000;
constexpr uint32_t kMeetProbe = 32;
// How often a sleeping device looks whether the process closed at exit or another meeting
// failed.
constexpr std::chrono::milliseconds kMeetCheck{50};

// Yields until `done()` or this thread's current yield time has passed (no lock held),
// and adapts that time to how the wait ended.
template <typename Done>
void YieldWhileNot(Done&& done) {
  thread_local int64_t budget_ns = kMeetYieldStartNs;
  thread_local uint32_t asleep = 0;  // waits since the budget fell below the minimum
  int64_t budget = budget_ns;
  const bool probe = budget < kMeetYieldMinNs;
  if (probe) {
    if (++asleep % kMeetProbe != 0) return;
    budget = kMeetYieldStartNs;
  }
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::nanoseconds(budget);
  for (uint32_t polls = 1;; ++polls) {
    if (done()) {
      budget_ns = std::min(kMeetYieldMaxNs, budget + budget / 4);
      return;
    }
    if ((polls & 15) == 0 && std::chrono::steady_clock::now() >= until) break;
    sched_yield();
  }
  budget_ns = probe ? 0 : budget / 2;  // a failed probe sleeps at once again
}

// Whether another device of the slot last ran on `cpu` (`pos`: this device's position).
bool SharesCpu(const LocalRound::Slot& slot, size_t pos, int cpu) {
  if (cpu < 0) return true;  // unknown: as if shared
  // in's size is set with the slot and never changes: readable without its lock.
  for (size_t i = 0; i < slot.in.size(); ++i) {
    if (i != pos && slot.cpu[i].load(std::memory_order_relaxed) == cpu) return true;
  }
  return false;
}

ffi::Error MeetingFailedEarlier(std::string_view op, std::string_view operand, int64_t me) {
  return ffi::Error::Internal(
      std::string(op) + " of " + std::string(operand) + " on partition " +
      std::to_string(me) + ": an earlier collective of this process timed out waiting for "
      "the other devices of its group, so every later collective of this process fails at "
      "once (end the job; the first error: " + Rounds().first_failure() + ")");
}

// The error of a device whose group's other devices in this process did not all come to the
// meeting by its deadline, or by the process's exit (Closing: it did not wait that long).
std::string MeetingTimedOut(std::string_view op, std::string_view operand, int64_t me,
                            const std::vector<int64_t>& local, double timeout_s) {
  std::ostringstream m;
  m << op << " of " << operand << " on partition " << me;
  if (Closing()) {
    m << " was still waiting for the other devices of its group in this process (partitions";
    for (int64_t p : local) m << ' ' << p;
    m << ") when the process exited: ended at exit after the grace period "
         "(JAX_CPU_MPI_EXIT_GRACE). The program ended without waiting for its outputs "
         "(jax.block_until_ready), or its devices did not all run this collective.";
    return m.str();
  }
  m << " waited " << timeout_s << " s for the other devices of its group in this process "
       "(partitions";
  for (int64_t p : local) m << ' ' << p;
  m << "), and not all of them got there: every device of the mesh must run the same "
       "collectives in the same order, and with several devices per process a few calls "
       "in flight at most (JAX may queue a device's call behind the calls it already "
       "runs: wait on a result every few calls; a host callback between collectives "
       "needs more XLA CPU pool threads than devices per process: PJRT_NPROC); set "
       "JAX_CPU_MPI_RECV_TIMEOUT to wait longer.";
  return m.str();
}

// The error of a device whose meeting's leader (another device of its process, which ran
// the collective for the group's devices here) failed: the leader's message names the
// leader's partition, not this one's.
std::string LeaderFailed(std::string_view op, std::string_view operand, int64_t me,
                         int64_t leader, std::string_view error) {
  return std::string(op) + " of " + std::string(operand) + " on partition " +
         std::to_string(me) + ": partition " + std::to_string(leader) +
         ", which ran it for this process's devices of the group, failed: " +
         std::string(error);
}

// When a non-leading device parks (returns a pending future) instead of waiting in its
// meeting (SetMeetingHandoff, JAX_CPU_MPI_PARK): 0 never (off, the default), 1 where the
// node is oversubscribed (auto), 2 wherever the program allows it (on: to compare, or to
// test this path on any machine).
std::atomic<int> g_handoff{0};
// Calls that parked so far (jax_cpu_mpi.stats(): whether a program took this path at all).
std::atomic<uint64_t> g_parks{0};

// The timeline's slice of a parked call ends when it completes: it waited all that time.
void RecordParked(const Parked& p, bool ok) {
  if (!p.traced) return;
  trace::Event e = p.event;
  e.dur_ns = std::max<int64_t>(0, trace::NowNs() - e.start_ns);
  e.wait_ns = e.dur_ns;
  e.ok = ok;
  trace::Record(e);
}

// Completes a parked call: its device's program resumes on this thread, up to its next
// pending collective or its end (XLA's thunk executor), before this returns.
void Complete(Parked& p) {
  RecordParked(p, true);
  ++g_inline_depth;
  p.promise.SetAvailable();
  --g_inline_depth;
}

void Fail(Parked& p, const std::string& error) {
  RecordParked(p, false);
  Runtime::Get().settle_run_after_failure(p.run_id, p.me, error);
  ++g_inline_depth;
  p.promise.SetError(ffi::Error::Internal(error));
  --g_inline_depth;
}

// When a parked device's program resumes. Its leader does not complete the future at once:
// the device's program would then run on the leader's thread while the leader's own program
// waits under it, and anything it waited for from the leader's device (a precv of a psend
// the leader's program makes after this collective) would never come. Instead the leader
// defers it here, and the device resumes
//   * on the thread of a device of the same meeting when that device enters its next
//     meeting of the group's devices (ResumeFor): its program has then done all it does
//     before that collective, so the parked device cannot wait for it, as it could not with
//     blocking meetings (it met it there). This is the usual way: in a loop of collectives
//     one thread runs every device of the process, with no context switch;
//   * or on a thread of ours (a runner) kResumeAfter after the collective, if no such
//     device came first (the leader's program ended, computes for long, or waits on
//     something else): the device then runs beside the leader as it did with blocking
//     meetings, only that much later.
// A parked device whose group's other devices do not come is failed by the same thread
// (Watch) after JAX_CPU_MPI_RECV_TIMEOUT, as a waiting device failed before.
//
// Why a program resumed on another device's thread cannot deadlock (D the device entering
// its meeting for collective k, E a device resumed there, running on D's thread until E's
// program parks again; every device runs the program's collectives in the same order, the
// ordering pass's chain). E is in D's group at k (ResumeFor takes that meeting's devices),
// and it is resumed at the first meeting D enters after E parked whose group holds E: so at
// the collectives E runs nested before k, its groups leave D out, and at k D has not
// arrived, so E is not the last there and parks (g_under_call): E never passes k. Before k,
// with axis_index_groups that change from one collective to the next (3 or more devices per
// process), E can be the last of its group here and lead: it then waits for MPI on D's
// thread, for a collective before k. Its group's devices, here and in other processes,
// need nothing of D for that: D has finished every collective before k. And so for every
// suspended device: one under a nested wait at collective m is suspended before a
// collective later than m, so the earliest collective anyone waits for never waits for a
// suspended device. The program's other steps cannot wait for another device at all
// (passes/park_safety.py decides which programs park).
class Resumer {
 public:
  static constexpr auto kResumeAfter = std::chrono::microseconds(250);
  static constexpr int kMaxRunners = 64;

  // A parked device of a meeting the caller (its leader) has just finished: resume it later
  // (the caller holds the slot's lock).
  void Defer(jcm::Parked&& p, LocalRound::Slot& slot) {
    p.fp = FpState::Current();
    p.pace = &slot.pace;
    std::lock_guard<std::mutex> lock(mu_);
    p.due = Clock::now() + kResumeAfter;
    due_.push_back(std::move(p));
    count_.fetch_add(1, std::memory_order_relaxed);
    ++defers_;
    // The timer ticks every kResumeAfter while calls are deferred; only one that sleeps
    // longer needs a wake.
    if (!ticking_) timer_cv_.notify_one();
  }

  // A device parked: the timer must watch its deadline.
  void WatchParked() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!watching_) timer_cv_.notify_one();
  }

  // Starts the timer thread, before a device first parks (Defer and WatchParked count on
  // it): where the system cannot start another thread, the call that would park fails
  // with an error instead of throwing out of its handler.
  ffi::Error Start(std::string_view op, std::string_view operand, int64_t me) {
    if (timer_running_.load(std::memory_order_acquire)) [[likely]] return ffi::Error::Success();
    std::lock_guard<std::mutex> lock(mu_);
    if (!timer_running_.load(std::memory_order_relaxed)) {
      try {
        std::thread([this] { Timer(); }).detach();
      } catch (const std::system_error& e) {
        return ffi::Error::Internal(
            std::string(op) + " of " + std::string(operand) + " on partition " +
            std::to_string(me) + ": could not start the thread that resumes parked devices (" +
            e.what() + "); set JAX_CPU_MPI_PARK=off to have devices wait in their meetings.");
      }
      timer_running_.store(true, std::memory_order_release);
    }
    return ffi::Error::Success();
  }

  // A device's program reached its end (JcmCollectivesEnd): the devices it left parked
  // would wait for kResumeAfter, since it enters no further meeting; a runner resumes them
  // now. (Not this thread: what the device's program still does after that call, which XLA
  // may schedule there, might be what they wait for.)
  void HandOff() {
    if (count_.load(std::memory_order_relaxed) == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (due_.empty()) return;
    while (!due_.empty()) {
      ready_.push_back(std::move(due_.front()));
      due_.pop_front();
    }
    WakeRunners();
  }

  // Resumes, on this thread, every deferred device among `partitions` (the devices of the
  // meeting the caller is entering).
  void ResumeFor(const std::vector<int64_t>& partitions) {
    while (count_.load(std::memory_order_relaxed) > 0) {
      std::optional<jcm::Parked> p;
      {
        std::lock_guard<std::mutex> lock(mu_);
        p = TakeFirst(due_, partitions);
        if (!p) p = TakeFirst(ready_, partitions);
        if (p) count_.fetch_sub(1, std::memory_order_relaxed);
      }
      if (!p) return;
      if (p->pace != nullptr) p->pace->InTime();
      ++g_under_call;
      Complete(*p);
      --g_under_call;
    }
  }

 private:
  static std::optional<jcm::Parked> TakeFirst(std::deque<jcm::Parked>& q,
                                              const std::vector<int64_t>& partitions) {
    for (auto it = q.begin(); it != q.end(); ++it) {
      if (std::find(partitions.begin(), partitions.end(), it->me) == partitions.end()) continue;
      std::optional<jcm::Parked> p(std::move(*it));
      q.erase(it);
      return p;
    }
    return std::nullopt;
  }

  // mu_ held: enough runners for the calls in ready_. Where the system cannot start one
  // more, the runners there are take them in turn, and with none the timer tries again at
  // its next tick (Timer: it ticks while calls wait without a runner); a parked device
  // that none resumes fails at its deadline (Watch).
  void WakeRunners() {
    if (idle_runners_ < static_cast<int>(ready_.size()) && runners_ < kMaxRunners) {
      try {
        std::thread([this] { Run(); }).detach();
        ++runners_;
      } catch (const std::system_error&) {
      }
    }
    runner_cv_.notify_all();
  }

  // Moves due calls to the runners, and watches parked devices' deadlines.
  void Timer() {
    std::unique_lock<std::mutex> lock(mu_);
    Clock::time_point watch_at = Clock::now();
    for (;;) {
      const auto now = Clock::now();
      bool moved = false;
      while (!due_.empty() && due_.front().due <= now) {
        if (due_.front().pace != nullptr) due_.front().pace->Late();
        ready_.push_back(std::move(due_.front()));
        due_.pop_front();
        moved = true;
      }
      if (moved) WakeRunners();
      const bool parked = Rounds().parked.load(std::memory_order_relaxed) > 0;
      if (parked && now >= watch_at) {
        lock.unlock();
        Watch();
        lock.lock();
        watch_at = Clock::now() + kMeetCheck;
        continue;
      }
      // Tick while calls were deferred since the last tick (a loop of collectives defers
      // one per collective, and the next meeting takes it: no wake per collective), then
      // sleep until a parked device's next check, or until woken.
      ticking_ = !due_.empty() || defers_ > 0 || (!ready_.empty() && runners_ == 0);
      watching_ = parked;
      defers_ = 0;
      if (ticking_) {
        timer_cv_.wait_until(lock, now + kResumeAfter);
      } else if (watching_) {
        timer_cv_.wait_until(lock, watch_at);
      } else {
        timer_cv_.wait(lock);
      }
    }
  }

  // A runner: resumes calls whose meeting nobody entered in time.
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      while (ready_.empty()) {
        ++idle_runners_;
        runner_cv_.wait(lock);
        --idle_runners_;
      }
      jcm::Parked p = std::move(ready_.front());
      ready_.pop_front();
      count_.fetch_sub(1, std::memory_order_relaxed);
      lock.unlock();
      p.fp.Apply();
      Complete(p);
      lock.lock();
    }
  }

  // Fails the parked devices whose wait is over: their deadline passed, the process is
  // closing, or another meeting failed (LocalRound::Fail).
  static void Watch();

  std::mutex mu_;
  std::condition_variable timer_cv_, runner_cv_;
  std::deque<jcm::Parked> due_;    // deferred, by due time
  std::deque<jcm::Parked> ready_;  // due, for the runners
  std::atomic<size_t> count_{0};   // in due_ and ready_
  uint64_t defers_ = 0;            // since the timer's last tick
  std::atomic<bool> timer_running_{false};
  bool ticking_ = false, watching_ = false;
  int runners_ = 0, idle_runners_ = 0;
};

Resumer& Resumers() {
  static Immortal<Resumer> resumer;
  return resumer.get();
}

void Resumer::Watch() {
  LocalRound& rounds = Rounds();
  thread_local std::vector<LocalRound::Slot*> slots;
  rounds.Slots(&slots);
  const bool failed = rounds.failed();
  const double timeout_s = Runtime::Get().state().config.recv_timeout_s;
  struct Gone {
    jcm::Parked p;
    std::string message;
  };
  std::vector<Gone> expired;
  for (LocalRound::Slot* slot : slots) {
    std::lock_guard<std::mutex> lock(slot->mu);
    if (slot->leading.load(std::memory_order_relaxed)) continue;  // its leader ends it
    for (auto& parked : slot->parked) {
      if (!parked || !(failed || jcm::Expired(parked->deadline))) continue;
      std::string message = failed ? std::string() :
          MeetingTimedOut(parked->op, parked->operand, parked->me, slot->partitions,
                          timeout_s);
      expired.push_back({std::move(*parked), std::move(message)});
      parked.reset();
      --slot->arrived;
      rounds.parked.fetch_sub(1, std::memory_order_relaxed);
    }
  }
  for (Gone& e : expired) {
    if (e.message.empty()) {
      e.message = MeetingFailedEarlier(e.p.op, e.p.operand, e.p.me).message();
    } else {
      rounds.Fail(e.message);
    }
    Fail(e.p, e.message);
  }
}

// What a collective handler returns: an error (or success) now, or a pending future (its
// device parked in its meeting).
struct Outcome {
  ffi::Error error;
  std::optional<ffi::Future> future;
  Outcome(ffi::Error e) : error(std::move(e)) {}  // NOLINT: implicit, as ffi::Error's
  explicit Outcome(ffi::Future f) : error(ffi::Error::Success()), future(std::move(f)) {}
  bool failure() const { return !future && error.failure(); }
};

// Of a call, what a parked device needs later: its run (to settle it after a failure) and
// its timeline slice.
struct CallInfo {
  int64_t run_id = 0;
  // Whether its program may park at all (its "park" attribute: passes/park_safety.py says
  // when nothing else in the program can wait for another device).
  bool may_park = false;
  bool traced = false;
  trace::Event event;
};

// Where the timeline's slice of the call running on this thread started (Traced): a call
// that resumed other devices' programs on this thread first starts after them.
thread_local int64_t* g_trace_start = nullptr;

// The meeting of a group's devices in this process (`local`: their partitions, ascending;
// `me` among them), once per collective: each brings its operand `x` and output `y`, the
// last to arrive leads, calling `lead(in, out, pos)` with every device's operand and output
// in `local`'s order and its own position `pos`; the others wait until it has finished and
// return its result, or, on an oversubscribed node, park (return a pending future that the
// leader's work completes: Resumer). A device whose peers do not all come by the deadline
// fails, naming them (once the leader has started, the wait is as long as its work: its MPI
// wait has a deadline of its own), and so does every later meeting of the process
// (LocalRound::Fail).
// `site_slot`: the group's slot as the call site keeps it (found by `key` at the site's
// first meeting on this thread; slots are never erased): a meeting takes no process-wide
// lock.
template <typename Lead>
Outcome MeetLocally(const std::string& key, LocalRound::Slot*& site_slot,
                    const std::vector<int64_t>& local, int64_t me, const void* x, void* y,
                    std::string_view op, std::string_view operand, const CallInfo& call,
                    Lead&& lead) {
  LocalRound& rounds = Rounds();
  if (rounds.failed()) [[unlikely]] return MeetingFailedEarlier(op, operand, me);
  const size_t pos = std::find(local.begin(), local.end(), me) - local.begin();
  if (site_slot == nullptr) site_slot = &rounds.Get(key, local);
  LocalRound::Slot& slot = *site_slot;
  // One look at the runtime (its lock is shared by every device thread): the deadline, and
  // whether a waiting device yields before it sleeps (not under JAX_CPU_MPI_WAIT=sleep),
  // and whether the node has fewer cores than busy threads (then only beside a sibling,
  // or it parks).
  const Runtime::State state = Runtime::Get().state();
  const double timeout_s = state.config.recv_timeout_s;
  const bool yields = state.mpi && state.mpi->wait_choice().policy != WaitPolicy::kSleep;
  const bool oversubscribed = state.mpi && state.mpi->wait_choice().sleeps_soon;
  const int handoff = g_handoff.load(std::memory_order_relaxed);
  // JAX_CPU_MPI_PARK=auto parks only where the node has more busy threads than cores, as
  // JAX_CPU_MPI_WAIT=auto judges it (not under WAIT=sleep: that asks for sleeping waits,
  // not for fewer of them); and only in a program whose steps cannot wait for another
  // device but in our meetings (call.may_park).
  const bool parks =
      call.may_park &&
      (handoff == 2 || (handoff == 1 && oversubscribed &&
                        state.mpi->wait_choice().policy == WaitPolicy::kAuto));
  Resumer& resumer = Resumers();
  if (parks) {
    if (ffi::Error started = resumer.Start(op, operand, me); started.failure()) [[unlikely]] {
      return started;
    }
    // The devices of this meeting that an earlier one left parked go first, on this thread
    // (Resumer): each runs up to this meeting, or its next one.
    const int64_t before = call.traced ? trace::NowNs() : 0;
    resumer.ResumeFor(slot.partitions);
    if (call.traced && g_trace_start != nullptr && trace::NowNs() - before > 0) {
      *g_trace_start = trace::NowNs();
      trace::Notes() = {};
    }
  }
  const auto deadline = DeadlineAfter(timeout_s);
  const int my_cpu = sched_getcpu();
  slot.cpu[pos].store(my_cpu, std::memory_order_relaxed);
  std::unique_lock<std::mutex> lock(slot.mu);
  const uint64_t generation = slot.generation.load(std::memory_order_relaxed);
  if (slot.parked[pos]) [[unlikely]] {
    // Its call of the round before is still parked: a second call of the same device
    // would take its place (the CPU client runs a device's programs with collectives one at
    // a time, so this is not expected).
    return ffi::Error::Internal(
        std::string(op) + " of " + std::string(operand) + " on partition " +
        std::to_string(me) + ": this device's previous call of this collective has not "
        "finished; run at most one program with collectives per device at a time.");
  }
  slot.in[pos] = x;
  slot.out[pos] = y;
  if (++slot.arrived < static_cast<int>(local.size())) {
    // A device whose program runs inside another device's call (resumed there: ResumeFor)
    // always parks: waiting here, it would wait for a device that may be the one suspended
    // under it on this thread.
    if (g_under_call > 0 || (parks && slot.pace.Parks())) {
      ffi::Promise promise;
      ffi::Future future(promise);
      Parked& p = slot.parked[pos].emplace(Parked{.promise = std::move(promise),
                                                  .deadline = deadline,
                                                  .run_id = call.run_id,
                                                  .me = me,
                                                  .op = op,
                                                  .operand = operand,
                                                  .traced = call.traced});
      if (call.traced) {
        p.event = call.event;
        p.event.start_ns = g_trace_start != nullptr ? *g_trace_start : trace::NowNs();
      }
      rounds.parked.fetch_add(1, std::memory_order_relaxed);
      g_parks.fetch_add(1, std::memory_order_relaxed);
      lock.unlock();
      resumer.WatchParked();
      return Outcome(std::move(future));
    }
    trace::WaitTimer waited;  // the timeline's wait: until the leader has finished
    waited.Waiting();
    auto finished = [&] { return slot.generation.load(std::memory_order_acquire) != generation; };
    if (yields && (!oversubscribed || SharesCpu(slot, pos, my_cpu))) {
      lock.unlock();
      YieldWhileNot(finished);
      lock.lock();
    }
    if (!finished()) {
      ++slot.sleepers;
      auto started = [&] {
        return finished() || slot.leading.load(std::memory_order_relaxed) || rounds.failed();
      };
      // In slices, so that a wait also ends once the process closes at exit (Closing()).
      while (!started() && !Expired(deadline)) {
        slot.cv.wait_until(
            lock, std::min(deadline, std::chrono::steady_clock::now() + kMeetCheck), started);
      }
      if (!finished() && !slot.leading.load(std::memory_order_relaxed)) {
        --slot.sleepers;
        --slot.arrived;
        if (rounds.failed()) return MeetingFailedEarlier(op, operand, me);
        std::string m = MeetingTimedOut(op, operand, me, local, timeout_s);
        rounds.Fail(m);
        return ffi::Error::Internal(std::move(m));
      }
      slot.cv.wait(lock, finished);
      --slot.sleepers;
    }
    slot.cpu[pos].store(sched_getcpu(), std::memory_order_relaxed);
    if (slot.error.empty()) return ffi::Error::Success();
    return ffi::Error::Internal(LeaderFailed(op, operand, me, slot.error_leader, slot.error));
  }
  slot.leading.store(true, std::memory_order_relaxed);
  slot.arrived = 0;
  // Every other device parked: this is the process's only busy thread (the parked devices'
  // threads wait for their programs' ends), so where the node has a core per rank its MPI
  // wait need not yield and sleep soon, as it must where each device runs a thread
  // (JAX_CPU_MPI_WAIT=auto only).
  size_t parked_here = 0;
  for (const auto& p : slot.parked) parked_here += p.has_value();
  const WaitChoice* const wait = state.mpi ? &state.mpi->wait_choice() : nullptr;
  const bool alone = parked_here + 1 == local.size() && wait != nullptr &&
                     wait->policy == WaitPolicy::kAuto && wait->node_ranks <= wait->cores;
  ScopedWaitMode wait_mode(alone ? static_cast<int>(WaitMode::kBounded) : t_wait_mode);
  // The round's operands and outputs, copied out of the slot (no allocation after the
  // thread's first round): the next round may fill the slot once this one has ended.
  thread_local std::vector<const void*> in;
  thread_local std::vector<void*> outs;
  in.assign(slot.in.begin(), slot.in.end());
  outs.assign(slot.out.begin(), slot.out.end());
  lock.unlock();
  ffi::Error result = lead(in, outs, pos);
  lock.lock();
  if (result.failure()) {
    slot.error = std::string(result.message());
    slot.error_leader = me;
  } else {
    slot.error.clear();
  }
  // The parked devices of this round: resumed later if it succeeded (Resumer), failed now
  // if not (their programs end: nothing of theirs runs on).
  std::vector<Parked> failed;
  for (auto& parked : slot.parked) {
    if (!parked) continue;
    if (result.failure()) {
      failed.push_back(std::move(*parked));
    } else {
      resumer.Defer(std::move(*parked), slot);
    }
    parked.reset();
    rounds.parked.fetch_sub(1, std::memory_order_relaxed);
  }
  slot.leading.store(false, std::memory_order_relaxed);
  slot.generation.fetch_add(1, std::memory_order_release);
  const bool wake = slot.sleepers > 0;
  lock.unlock();
  if (wake) slot.cv.notify_all();
  for (Parked& p : failed) Fail(p, LeaderFailed(p.op, p.operand, p.me, me, result.message()));
  slot.cpu[pos].store(sched_getcpu(), std::memory_order_relaxed);
  return result;
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

// A call site's attributes as this device sees them: its entry of a device thread's cache
// (SiteEntry) is found by them, compared in full (a few integers), so that another
// program's call site with the same number never takes it.
struct SiteAttributes {
  int64_t site = 0, me = 0, group_size = 0;
  int kind = -1;  // the exchange's (Exchange), -1 for the all-reduce
  std::vector<int64_t> groups, device_index, device_process;
};

bool Same(const std::vector<int64_t>& v, I64Span s) {
  return v.size() == s.size() && std::equal(v.begin(), v.end(), s.begin());
}

// The entry of a call site, made by `make(attributes)` at its first call on this device
// thread and looked up after: building its key's string and its vectors at every call was
// a fifth of a small collective's time on our side.
template <typename Entry, typename Make>
Entry& SiteEntry(I64Span groups, int64_t group_size, I64Span device_index,
                 I64Span device_process, int64_t site, int64_t me, int kind, Make&& make) {
  thread_local std::vector<std::unique_ptr<Entry>> sites;  // most recent last
  for (auto it = sites.rbegin(); it != sites.rend(); ++it) {
    const SiteAttributes& e = (*it)->attributes;
    if (e.site == site && e.me == me && e.kind == kind && e.group_size == group_size &&
        Same(e.groups, groups) && Same(e.device_index, device_index) &&
        Same(e.device_process, device_process)) {
      return **it;
    }
  }
  SiteAttributes a;
  a.site = site;
  a.me = me;
  a.group_size = group_size;
  a.kind = kind;
  a.groups.assign(groups.begin(), groups.end());
  a.device_index.assign(device_index.begin(), device_index.end());
  a.device_process.assign(device_process.begin(), device_process.end());
  std::unique_ptr<Entry> e = make(std::move(a));
  constexpr size_t kSites = 256;  // a thread's distinct call sites, before the oldest goes
  // Not while this thread runs a parked device's program inside another call: the outer
  // call holds its own entry.
  if (sites.size() >= kSites && g_inline_depth == 0) sites.erase(sites.begin());
  sites.push_back(std::move(e));
  return *sites.back();
}

// A call site's group (FindGroup's result and the key with the site), and what its leader
// needs of the transport: the group's MPI ranks and its communicator (made at the first
// lead, for the transport whose id() is `ranks_for`).
struct SiteGroup {
  SiteAttributes attributes;
  bool found = false;
  Group g;
  uint64_t ranks_for = 0;  // MpiTransport::id(); 0: none yet
  std::vector<int> ranks;
  MpiTransport::GroupHandle comm;
  LocalRound::Slot* slot = nullptr;  // its meeting's (MeetLocally)
};

SiteGroup& SiteGroupOf(I64Span groups, int64_t group_size, I64Span device_index,
                       I64Span device_process, int64_t site, int64_t me) {
  return SiteEntry<SiteGroup>(
      groups, group_size, device_index, device_process, site, me, -1,
      [&](SiteAttributes a) {
        auto e = std::make_unique<SiteGroup>();
        e->attributes = std::move(a);
        e->found = FindGroup(groups, group_size, device_index, device_process, me, &e->g);
        // Each call site of a program has its own communicator and local round:
        // collectives that XLA runs in another order on another device or process never
        // meet.
        e->g.key.append("#").append(std::to_string(site));
        return e;
      });
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

// The error of a collective between processes that did not complete.
ffi::Error Failure(const Status& s, std::string_view op, std::string_view operand, int64_t me,
                   const Runtime::State& state, const std::vector<int>& ranks) {
  std::ostringstream m;
  m << op << " of " << operand << " on partition " << me << " (process "
    << state.mpi->rank() << ") between processes";
  for (int r : ranks) m << ' ' << r;
  if (s.code() == StatusCode::kTimeout) {
    // A collective ended at exit says nothing about its peers (they may be slower).
    for (int r : ranks) {
      if (r != state.mpi->rank() && !Closing()) Runtime::Get().note_unreachable_peer(r);
    }
    m << " waited " << state.config.recv_timeout_s << " s and the collective did not "
      << "complete (" << s.message() << "): a peer (" << Peers(*state.mpi, ranks) << ") did not take part, is "
      << "stuck, has died, or cannot be reached (set JAX_CPU_MPI_RECV_TIMEOUT to wait "
      << "longer).";
    // The point-to-point state too: a peer may wait in a precv for a send of ours that is
    // deferred or still in flight while we wait here.
    if (!Closing()) m << state.mpi->StallReport(/*peer_rank=*/-1);
  } else {
    m << " failed: " << s.message();
  }
  return ffi::Error::Internal(m.str());
}

// Steps 1-3 above, as the leader: every local operand is in `in`, every output in `out`.
// out[0] accumulates: it may be in[0] or in[1], but no later operand, whose value the
// first reduction would overwrite before it is read.
ffi::Error Lead(std::span<const void* const> in, std::span<void* const> out,
                ffi::DataType type, Reduction reduction, size_t count, size_t bytes,
                SiteGroup& site, int64_t me, std::string_view op, std::string_view operand) {
  const Group& g = site.g;
  void* acc = out[0];
  // One device here: MPI reads the operand itself (no copy into the output first).
  const bool mpi_reads_operand = in.size() == 1 && g.processes.size() > 1 && acc != in[0];
  size_t next = 1;  // the next operand to reduce into acc
  if (acc != in[0] && !mpi_reads_operand) {
    if (in.size() > 1) {  // the copy of the first operand and the first reduction in one pass
      if (!ReduceTwo(type, reduction, acc, in[0], in[1], count)) {
        return ffi::Error::InvalidArgument(std::string(op) + ": no in-process reduction for " +
                                           std::string(operand));
      }
      next = 2;
    } else {
      std::memcpy(acc, in[0], bytes);
    }
  }
  for (size_t i = next; i < in.size(); ++i) {
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
    if (site.ranks_for != state.mpi->id()) {
      site.ranks.clear();
      for (int64_t p : g.processes) site.ranks.push_back(state.mpi->RankOfProcess(p));
      std::sort(site.ranks.begin(), site.ranks.end());
      site.ranks_for = state.mpi->id();
    }
    const std::vector<int>& ranks = site.ranks;
    Runtime::MpiOpScope active;  // the exit keeps the transport until this returns
    Status s = state.mpi->Allreduce(g.key, ranks, site.comm,
                                    mpi_reads_operand ? in[0] : nullptr, acc,
                                    static_cast<int64_t>(count), mpi_type, mpi_op,
                                    DeadlineAfter(state.config.recv_timeout_s));
    if (!s.ok()) return Failure(s, op, operand, me, state, ranks);
  }
  for (size_t i = 1; i < out.size(); ++i) std::memcpy(out[i], acc, bytes);
  return ffi::Error::Success();
}

// `after`: the previous collective's result, or a loop's or conditional's (unread: it
// only orders this call after that one, the same way on every process).
Outcome AllReduce(ffi::AnyBuffer x, ffi::Buffer<ffi::U32> partition,
                  ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> out,
                  I64Span groups, int64_t group_size, I64Span device_index,
                  I64Span device_process, int64_t site, std::string_view reduction,
                  std::string_view op, std::string_view operand, const CallInfo& call) {
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
  SiteGroup& site_group =
      SiteGroupOf(groups, group_size, device_index, device_process, site, me);
  const Group& g = site_group.g;
  const bool found = site_group.found;
  if (!found ||
      (g.local.size() == 1 && g.processes.size() == 1)) {
    if (out->untyped_data() != x.untyped_data()) std::memcpy(out->untyped_data(), x.untyped_data(), bytes);
    return ffi::Error::Success();
  }
  if (g.local.size() == 1) {  // no meeting (spans over the arguments: no allocation)
    const void* const in[] = {x.untyped_data()};
    void* const outs[] = {out->untyped_data()};
    return Lead(in, outs, x.element_type(), red, count, bytes, site_group, me, op, operand);
  }

  return MeetLocally(g.key, site_group.slot, g.local, me, x.untyped_data(), out->untyped_data(),
                     op, operand, call,
                     [&](const std::vector<const void*>& in, std::vector<void*>& outs,
                         size_t pos) {
                       // The leader's own output accumulates: it comes first among the
                       // outputs (any will do: all get the same bits), while operands stay
                       // in partition order. Except where that output is the leader's own
                       // operand (the lowering aliases them) at position 2 or later: Lead
                       // writes in[0] (op) in[1] into the accumulator before it reads
                       // in[pos], which would then be lost (with 3 devices per process,
                       // a wrong sum whenever the third led). The first device's output
                       // accumulates then: it is its own operand, reduced first, or no
                       // operand's buffer.
                       if (pos < 2 || outs[pos] != in[pos]) std::swap(outs[0], outs[pos]);
                       return Lead(in, outs, x.element_type(), red, count, bytes, site_group,
                                   me, op, operand);
                     });
}

// With the timeline off (the usual case) one predictable branch; on, one slice per device
// and collective, with its bytes and its wait (a parked call's when it completes).
template <typename Run>
Outcome Traced(Run&& run, int64_t run_id, bool may_park, ffi::Buffer<ffi::U32> partition,
               I64Span device_index, I64Span device_process, int64_t site, size_t bytes,
               trace::Op op) {
  CallInfo call;
  call.run_id = run_id;
  call.may_park = may_park;
  if (trace::Mode() == 0) [[likely]] return run(call);
  const int64_t me = static_cast<int64_t>(partition.typed_data()[0]);
  if (me < 0 || me >= static_cast<int64_t>(device_index.size()) ||
      device_process.size() != device_index.size()) {
    return run(call);
  }
  trace::Event& e = call.event;
  e.process = device_process[me];
  e.device = device_index[me];
  e.peer = -1;
  e.bytes = bytes;
  e.seq = static_cast<uint64_t>(site);
  e.op = op;
  call.traced = true;
  trace::Notes() = {};
  int64_t start = trace::NowNs();
  int64_t* const outer = g_trace_start;
  g_trace_start = &start;
  Outcome result = run(call);
  g_trace_start = outer;
  if (result.future) return result;  // recorded when it completes (RecordParked)
  const int64_t end = trace::NowNs();
  e.start_ns = start;
  e.dur_ns = end - start;
  e.wait_ns = std::min(trace::Notes().wait_ns, e.dur_ns);
  e.ok = !result.failure();
  trace::Record(e);
  return result;
}

// ---- all_gather, reduce_scatter (psum_scatter) and all_to_all between processes.
//
// The lowering (lowering/collectives.py) moves the collective's dimension to the front, so
// that each of the group's n members holds, or receives, n contiguous blocks of B bytes:
//   all_gather:     in 1 block,  out n blocks: out block j = member j's block;
//   reduce_scatter: in n blocks, out 1 block:  out = sum over members j of j's block (my
//                   position in the group);
//   all_to_all:     in n blocks, out n blocks: out block j = member j's block (my position).
// As for the all-reduce, the group's devices in this process meet, and the last to arrive
// does the work of all of them with one MPI call per process (MPI_Iallgather(v),
// MPI_Ireduce_scatter(_block), MPI_Ialltoall(v); small ones whose processes have as many
// members each as persistent requests), on the group's communicator, whose ranks
// are the group's processes in ascending MPI rank. Each process sends its members' blocks
// as one contiguous piece: where the group's order is not process by process (or a process
// has several members), blocks are packed into and unpacked from a staging buffer.

enum class Exchange { kAllGather, kReduceScatter, kAllToAll };

bool ParseExchange(std::string_view name, Exchange* out) {
  if (name == "all_gather") *out = Exchange::kAllGather;
  else if (name == "reduce_scatter") *out = Exchange::kReduceScatter;
  else if (name == "all_to_all") *out = Exchange::kAllToAll;
  else return false;
  return true;
}

// Where the group's members live: for each communicator rank q (the group's processes in
// ascending MPI rank), the group positions of its members, ascending.
struct Layout {
  std::vector<int> ranks;                      // MPI ranks of the group's processes
  std::vector<std::vector<int64_t>> positions;  // by communicator rank
  std::vector<int64_t> first;                  // blocks before communicator rank q's
  int mine = 0;                                // this process's communicator rank
  bool identity = true;                        // positions in order, process after process
};

// `row`: the group's partitions in group order; `rank_of`: the MPI rank of a process.
template <typename RankOf>
Layout MakeLayout(const std::vector<int64_t>& row, I64Span device_process, int64_t me,
                  RankOf rank_of) {
  Layout l;
  std::vector<int> rank_of_pos(row.size());
  for (size_t i = 0; i < row.size(); ++i) {
    rank_of_pos[i] = rank_of(device_process[row[i]]);
    l.ranks.push_back(rank_of_pos[i]);
  }
  std::sort(l.ranks.begin(), l.ranks.end());
  l.ranks.erase(std::unique(l.ranks.begin(), l.ranks.end()), l.ranks.end());
  l.positions.resize(l.ranks.size());
  for (size_t i = 0; i < row.size(); ++i) {
    const size_t q = std::lower_bound(l.ranks.begin(), l.ranks.end(), rank_of_pos[i]) -
                     l.ranks.begin();
    l.positions[q].push_back(static_cast<int64_t>(i));
  }
  int64_t next = 0;
  for (size_t q = 0; q < l.positions.size(); ++q) {
    l.first.push_back(next);
    for (int64_t p : l.positions[q]) l.identity = l.identity && p == next++;
  }
  l.mine = static_cast<int>(std::lower_bound(l.ranks.begin(), l.ranks.end(),
                                             rank_of(device_process[me])) - l.ranks.begin());
  return l;
}

// A call site's exchange as this device sees it (SiteEntry): the group's row, this
// process's members and the key, and the leader's layout of the group over the transport's
// ranks, with its counts and displacements for the site's block size.
struct ExchangeSite {
  SiteAttributes attributes;
  std::vector<int64_t> row;        // the group's partitions, in group order
  std::vector<int64_t> local;      // the group's partitions in this process, ascending
  std::vector<int64_t> local_pos;  // their group positions
  std::string key;
  bool spans = false;              // the group spans processes
  // Made at the first lead (LeadExchange), for the transport (its id(), `laid_out_for`)
  // and block.
  uint64_t laid_out_for = 0;
  bool laid_out = false;
  size_t laid_out_block = 0;
  ffi::DataType laid_out_type = ffi::DataType::INVALID;
  Layout layout;
  bool equal = true;  // every process has as many members
  std::vector<int> counts, displs;
  MpiTransport::GroupHandle comm;
  LocalRound::Slot* slot = nullptr;  // its meeting's (MeetLocally)
};

struct ExchangeCall {
  Exchange kind;
  ffi::DataType type;
  Reduction reduction;
  size_t block;  // bytes of one block
  ExchangeSite* site;
  std::string_view op, operand;
  int64_t me;
};

// Staging memory of one device thread's exchanges, kept from call to call: a fresh
// std::vector costs a zero fill and a page fault per page on every collective (of large
// all_to_all blocks with several devices per process, most of the call's time). When an MPI
// request on it is abandoned (a timeout), the transport keeps a reference, since MPI may
// still write into it; the next call then takes new memory. From a huge page up it is on
// huge pages of its own (HugePageMemory): from malloc it was memory of a thread's arena on
// 4 KiB pages, which the peer's single copy out of it (process_vm_readv: an all_to_all in
// place stages every block it sends) pinned and walked one 4 KiB page at a time.
class StagingBuffer {
 public:
  std::byte* Get(size_t n) {
    if (!buffer_ || buffer_.use_count() > 1 || n > size_) {
      const size_t huge = TransparentHugePageBytes();
      buffer_ = huge != 0 && n >= huge ? HugePageMemory(n) : nullptr;
      if (!buffer_) {
        buffer_ = std::shared_ptr<std::byte[]>(std::make_unique_for_overwrite<std::byte[]>(n));
      }
      size_ = n;
    }
    return buffer_.get();
  }
  std::shared_ptr<void> Owner() const { return buffer_; }

 private:
  std::shared_ptr<std::byte[]> buffer_;
  size_t size_ = 0;
};

// A small exchange whose processes have as many members each, as a persistent request
// (MpiTransport::PersistentCollective): `count` is each process's block count (as the
// nonblocking call takes it), `send` what this process sends (MPI_IN_PLACE: its part of
// `recv` for an all_gather), `recv` where the result goes; `all` and `own` the bytes of all
// processes' and of this process's members' blocks.
Status PersistentExchange(const ExchangeCall& c, MpiTransport& mpi, const Layout& l, int count,
                          const void* send, void* recv, size_t all, size_t own,
                          std::chrono::steady_clock::time_point deadline) {
#if MPI_VERSION >= 4
  MpiTransport::PersistentId id;
  id.kind = static_cast<int>(c.kind) + 1;  // the all-reduce's is 0
  id.count = count;
  const void* recv_init = nullptr;
  switch (c.kind) {
    case Exchange::kAllGather: {
      const bool in_place = send == MPI_IN_PLACE;
      id.send_bytes = in_place ? 0 : own;
      id.recv_bytes = all;
      if (in_place) recv_init = recv;  // this process's blocks are in place already
      return mpi.PersistentCollective(
          c.site->key, l.ranks, c.site->comm, "MPI_Allgather (persistent)", id,
          [&id](MPI_Comm comm, void* sbuf, void* rbuf, MPI_Request* r) {
            const int count = static_cast<int>(id.count);
            const bool in_place = id.send_bytes == 0;
            return MPI_Allgather_init(in_place ? MPI_IN_PLACE : sbuf, in_place ? 0 : count,
                                      MPI_BYTE, rbuf, count, MPI_BYTE, comm, MPI_INFO_NULL,
                                      r);
          },
          send, recv_init, recv, deadline);
    }
    case Exchange::kReduceScatter: {
      MPI_Datatype type = MPI_DATATYPE_NULL;
      MPI_Op op = MPI_OP_NULL;
      (void)MpiReduction(c.type, c.reduction, &type, &op);  // checked by the caller
      id.type = type;
      id.op = op;
      id.send_bytes = all;
      id.recv_bytes = own;
      return mpi.PersistentCollective(
          c.site->key, l.ranks, c.site->comm, "MPI_Reduce_scatter_block (persistent)", id,
          [&id](MPI_Comm comm, void* sbuf, void* rbuf, MPI_Request* r) {
            return MPI_Reduce_scatter_block_init(sbuf, rbuf, static_cast<int>(id.count),
                                                 id.type, id.op, comm, MPI_INFO_NULL, r);
          },
          send, nullptr, recv, deadline);
    }
    case Exchange::kAllToAll: {
      const bool in_place = send == MPI_IN_PLACE;
      id.recv_bytes = all * (own / c.block);  // every member's n blocks
      id.send_bytes = in_place ? 0 : id.recv_bytes;
      return mpi.PersistentCollective(
          c.site->key, l.ranks, c.site->comm, "MPI_Alltoall (persistent)", id,
          [&id](MPI_Comm comm, void* sbuf, void* rbuf, MPI_Request* r) {
            const int count = static_cast<int>(id.count);
            return MPI_Alltoall_init(id.send_bytes == 0 ? MPI_IN_PLACE : sbuf, count,
                                     MPI_BYTE, rbuf, count, MPI_BYTE, comm, MPI_INFO_NULL,
                                     r);
          },
          send, in_place ? recv : nullptr, recv, deadline);
    }
  }
#else
  (void)mpi, (void)l, (void)count, (void)send, (void)recv, (void)all, (void)own, (void)deadline;
#endif
  return Status::Invalid(std::string(c.op) + ": no persistent " + std::string(c.operand));
}

// Above this many bytes per process a multi-device all_to_all goes straight between the
// devices' buffers (MPI_Ialltoallw); below, making its datatypes costs more than the
// copies through the staging buffers save (an 8 KiB exchange was slower this way, a 64 KiB
// one no faster).
constexpr size_t kScatteredAllToAllBytes = size_t{64} << 10;

// Above this many bytes of a device's operand a reduce_scatter between processes of which
// one or more has several of the group's devices goes as point-to-point messages
// (PairwiseExchange): from 8 KiB up it took less time than MPI_Ireduce_scatter at every
// size measured; up to here it is a persistent request (MpiTransport::kPersistentBytes),
// about as fast.
constexpr size_t kPointToPointBytes = size_t{4} << 10;

// Whether `n` bytes from `a` and from `b` overlap.
bool Overlap(const void* a, const void* b, size_t n) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + n && y < x + n;
}

// Exchanges `n` bytes at `a` with `n` at `b` (not overlapping), through a small buffer
// that stays in the cache: each byte is read and written once.
void SwapBlocks(std::byte* a, std::byte* b, size_t n) {
  constexpr size_t kChunk = size_t{64} << 10;
  thread_local std::unique_ptr<std::byte[]> tmp =
      std::make_unique_for_overwrite<std::byte[]>(kChunk);
  for (size_t at = 0; at < n; at += kChunk) {
    const size_t len = std::min(kChunk, n - at);
    std::memcpy(tmp.get(), a + at, len);
    std::memcpy(a + at, b + at, len);
    std::memcpy(b + at, tmp.get(), len);
  }
}

// Derived datatypes of one call, freed at the end of the scope.
class ScopedDatatypes {
 public:
  ScopedDatatypes() = default;
  ScopedDatatypes(const ScopedDatatypes&) = delete;
  ScopedDatatypes& operator=(const ScopedDatatypes&) = delete;
  ~ScopedDatatypes() {
    for (MPI_Datatype& t : made_) MPI_Type_free(&t);
    made_.clear();
  }
  // `*type`: the blocks of `block_bytes` that `each(block)` calls `block(address)` for, in
  // that order, as one committed datatype relative to MPI_BOTTOM (adjacent blocks merged).
  // Returns an MPI error code.
  template <typename Each>
  int Blocks(size_t block_bytes, MPI_Datatype* type, Each&& each) {
    thread_local std::vector<int> lengths;
    thread_local std::vector<MPI_Aint> where;
    lengths.clear();
    where.clear();
    int rc = MPI_SUCCESS;
    each([&](const void* p) {
      MPI_Aint a = 0;
      if (rc == MPI_SUCCESS) rc = MPI_Get_address(p, &a);
      if (!where.empty() && where.back() + lengths.back() == a) {
        lengths.back() += static_cast<int>(block_bytes);
      } else {
        where.push_back(a);
        lengths.push_back(static_cast<int>(block_bytes));
      }
    });
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(),
                                  where.data(), MPI_BYTE, type);
    if (rc != MPI_SUCCESS) return rc;
    made_.push_back(*type);
    return MPI_Type_commit(type);
  }

 private:
  std::vector<MPI_Datatype> made_;
};

// The point-to-point messages of a pairwise reduce_scatter (`pairwise` in LeadExchange)
// with every other process of the group: to communicator rank q this process's partial
// sums of q's blocks (staged at their place in `send_stage`), from q its partial sums of
// this process's blocks (into `recv_stage` at q * m * B).
Status PairwiseExchange(const ExchangeCall& c, MpiTransport& mpi, const Layout& l,
                        std::byte* send_stage, std::byte* recv_stage, size_t moved,
                        std::chrono::steady_clock::time_point deadline,
                        std::shared_ptr<void> staged) {
  const size_t B = c.block;
  const size_t m = l.positions[l.mine].size();
  thread_local std::vector<MpiTransport::Piece> sends, recvs;
  sends.clear();
  recvs.clear();
  for (size_t q = 0; q < l.ranks.size(); ++q) {
    if (q == static_cast<size_t>(l.mine)) continue;
    const int peer = static_cast<int>(q);
    sends.push_back({peer, send_stage + static_cast<size_t>(l.first[q]) * B,
                     l.positions[q].size() * B});
    recvs.push_back({peer, recv_stage + q * m * B, m * B});
  }
  return mpi.Exchange(c.site->key, l.ranks, c.site->comm,
                      "reduce_scatter (MPI_Isend/MPI_Irecv)", sends, recvs, moved, deadline,
                      std::move(staged));
}

// The leader's work. `in`/`out`: the local members' buffers, by ascending partition;
// `local_pos`: their group positions.
ffi::Error LeadExchange(const ExchangeCall& c, std::span<const void* const> in,
                        std::span<void* const> out, I64Span device_process) {
  ExchangeSite& site = *c.site;
  const std::vector<int64_t>& local_pos = site.local_pos;
  const size_t n = site.row.size(), B = c.block;
  Runtime& rt = Runtime::Get();
  const Runtime::State state = rt.state();
  const bool spans = site.spans;
  if (spans && !state.mpi) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(c.op) + ": the group spans processes, but this process has "
                      "no MPI communicator attached. Launch every process with mpirun/srun "
                      "and import jax_cpu_mpi before lowering the program.");
  }
  // Every MPI count and displacement is an int (the lowering keeps larger ones on gloo).
  if (n * n * B > static_cast<size_t>(INT_MAX)) {
    return ffi::Error::InvalidArgument(std::string(c.op) + " of " + std::string(c.operand) +
                                       ": more than 2 GiB in one collective over MPI");
  }
  if (!site.laid_out || site.laid_out_for != state.mpi->id() || site.laid_out_block != B ||
      site.laid_out_type != c.type) {
    site.layout = MakeLayout(site.row, device_process, c.me, [&](int64_t process) {
      return spans ? state.mpi->RankOfProcess(process) : 0;
    });
    const Layout& l = site.layout;
    const size_t Q = l.ranks.size(), m = l.positions[l.mine].size();
    site.equal = true;
    for (size_t q = 0; q < Q; ++q) site.equal = site.equal && l.positions[q].size() == m;
    // As each kind passes them to MPI: bytes, except reduce_scatter's counts of elements.
    const size_t unit = c.kind == Exchange::kReduceScatter ? B / ffi::ByteWidth(c.type) : B;
    site.counts.assign(Q, 0);
    site.displs.assign(Q, 0);
    for (size_t q = 0; q < Q; ++q) {
      const size_t blocks = c.kind == Exchange::kAllToAll ? l.positions[q].size() * m
                                                           : l.positions[q].size();
      const size_t before = c.kind == Exchange::kAllToAll ? l.first[q] * m : l.first[q];
      site.counts[q] = static_cast<int>(blocks * unit);
      site.displs[q] = static_cast<int>(before * unit);
    }
    site.laid_out_for = state.mpi->id();
    site.laid_out_block = B;
    site.laid_out_type = c.type;
    site.laid_out = true;
  }
  const Layout& l = site.layout;
  const std::vector<int64_t>& mine = l.positions[l.mine];
  auto local_of = [&](int64_t position) {  // index into in/out of a local member
    return static_cast<size_t>(std::find(local_pos.begin(), local_pos.end(), position) -
                               local_pos.begin());
  };
  const size_t m = mine.size();
  const size_t Q = l.ranks.size();
  // A large output XLA allocated afresh for this call (the usual case outside a loop) is
  // first written here, by MPI's copy or ours: on transparent huge pages that is one fault
  // per 2 MiB instead of per 4 KiB, and MPI's copy into it (process_vm_readv's included)
  // runs at up to twice the speed (benchmarks/huge_pages.c: the output's pages decide).
  // From numpy's threshold for the same hint (4 MiB): mpi4py's calls write into such pages.
  // Only a hint for pages not yet touched (an output XLA wrote before keeps its pages), but
  // one that lasts: glibc serves the next call's output from the same memory where it keeps
  // it (below its mmap threshold), already on huge pages.
  const size_t out_bytes = c.kind == Exchange::kReduceScatter ? B : n * B;
  if (out_bytes >= kHugePageHintBytes) {
    for (void* o : out) AdviseHugePages(o, out_bytes);
  }
  auto bytes = [](const void* p) { return static_cast<const std::byte*>(p); };
  auto wbytes = [](void* p) { return static_cast<std::byte*>(p); };
  thread_local StagingBuffer send_staging, recv_staging;
  // all_gather in group order between processes, with several devices here: this process's
  // blocks go into every local output before the MPI call (which gathers into out[0]), and
  // only the other processes' blocks are copied from out[0] after it. Copying all of out[0]
  // after it read this process's blocks a second time, from memory: each piece of an
  // operand is now read once and written into every output while it is in the cache.
  const bool own_blocks_first = c.kind == Exchange::kAllGather && spans && l.identity &&
                                out.size() > 1;
  std::byte* send_stage = nullptr;  // set where this call stages its blocks
  std::byte* recv_stage = nullptr;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t local_copy = 0;  // one process: bytes to copy from send to recv instead of MPI
  // all_to_all: MPI reads the operands (unless `send` is staged) and writes the outputs
  // through a datatype per peer (MPI_BOTTOM-relative: the blocks' own addresses).
  bool scattered = false;
  bool in_place = false;  // scattered, and every output is its own operand's buffer
  // all_to_all of one member per process in place: only the peers' blocks are staged and
  // exchanged (MPI_Ialltoallv with no bytes to or from this process).
  bool peers_only = false;
  // reduce_scatter as point-to-point messages between the processes (PairwiseExchange)
  // instead of one MPI collective.
  bool pairwise = false;
  const std::vector<int>& counts = site.counts;  // of the site's layout, as MPI takes them
  const std::vector<int>& displs = site.displs;
  const bool equal = site.equal;
  const char* name = "";
  MPI_Datatype mpi_type = MPI_DATATYPE_NULL;  // reduce_scatter's reduction
  MPI_Op mpi_op = MPI_OP_NULL;
  switch (c.kind) {
    case Exchange::kAllGather: {
      name = equal ? "MPI_Iallgather" : "MPI_Iallgatherv";
      if (l.identity) {
        recv = out[0];
      } else {
        recv_stage = recv_staging.Get(n * B);
        recv = recv_stage;
      }
      if (m == 1 && spans && l.identity) {
        send = in[0];  // MPI reads the operand itself
      } else {
        constexpr size_t kPiece = size_t{256} << 10;  // well within a core's L2
        for (size_t i = 0; i < m; ++i) {
          const size_t to = (l.first[l.mine] + i) * B;
          const std::byte* from = bytes(in[local_of(mine[i])]);
          for (size_t at = 0; at < B; at += kPiece) {
            const size_t len = std::min(kPiece, B - at);
            std::memcpy(wbytes(recv) + to + at, from + at, len);
            if (!own_blocks_first) continue;
            for (size_t k = 1; k < out.size(); ++k) {
              std::memcpy(wbytes(out[k]) + to + at, from + at, len);
            }
          }
        }
        send = MPI_IN_PLACE;
      }
      break;
    }
    case Exchange::kReduceScatter: {
      name = equal ? "MPI_Ireduce_scatter_block" : "MPI_Ireduce_scatter";
      const size_t per = B / ffi::ByteWidth(c.type);  // elements of one block
      // Every process of the group takes the same path: where any has several members
      // (axis_index_groups may give one process 2 members of a group and another 1).
      bool several = false;
      for (const auto& members : l.positions) several = several || members.size() > 1;
      if (spans && several && n * B > kPointToPointBytes) {
        // Several devices here: only the other processes' blocks go through the staging
        // buffer, and each process's partial sums of another's blocks travel as one
        // message (Exchange); on arrival, this process's own blocks and the partial sums
        // received are reduced straight into their outputs, in one pass with 2 processes
        // and 2 devices here. Through MPI_Ireduce_scatter the whole
        // operand went through the staging buffer, and the result through a receive
        // buffer copied out afterwards: two more passes over the process's bytes.
        if (!MpiReduction(c.type, c.reduction, &mpi_type, &mpi_op)) {
          return ffi::Error::InvalidArgument(std::string(c.op) + ": no MPI reduction for " +
                                             std::string(c.operand));
        }
        // The local members' reduction of the block at byte `at` of every operand into
        // `acc`, in ascending partition order (the copy of the first operand and the
        // first reduction in one pass).
        auto reduce_local = [&](std::byte* acc, size_t at) {
          if (in.size() == 1) {
            std::memcpy(acc, bytes(in[0]) + at, B);
            return true;
          }
          bool ok = ReduceTwo(c.type, c.reduction, acc, bytes(in[0]) + at,
                              bytes(in[1]) + at, per);
          for (size_t k = 2; ok && k < in.size(); ++k) {
            ok = ReduceInto(c.type, c.reduction, acc, bytes(in[k]) + at, per);
          }
          return ok;
        };
        bool ok = true;
        send_stage = send_staging.Get(n * B);
        for (size_t q = 0; ok && q < Q; ++q) {
          if (q == static_cast<size_t>(l.mine)) continue;
          for (size_t i = 0; ok && i < l.positions[q].size(); ++i) {
            ok = reduce_local(send_stage + (l.first[q] + i) * B,
                              static_cast<size_t>(l.positions[q][i]) * B);
          }
        }
        if (!ok) {
          return ffi::Error::InvalidArgument(std::string(c.op) +
                                             ": no in-process reduction for " +
                                             std::string(c.operand));
        }
        recv_stage = recv_staging.Get(Q * m * B);  // from communicator rank q at q * m * B
        send = send_stage;
        recv = recv_stage;
        pairwise = true;
        break;
      }
      if (in.size() == 1 && l.identity) {
        send = in[0];
      } else {
        // The local members reduce first, in ascending partition order, into the blocks'
        // order on the wire.
        send_stage = send_staging.Get(n * B);
        for (size_t q = 0; q < Q; ++q) {
          for (size_t i = 0; i < l.positions[q].size(); ++i) {
            std::byte* acc = send_stage + (l.first[q] + i) * B;
            const size_t at = static_cast<size_t>(l.positions[q][i]) * B;
            // The copy of the first operand and the first reduction in one pass over
            // the memory (with 2 devices per process the whole of the local work).
            size_t k = 1;
            bool ok = true;
            if (in.size() > 1) {
              ok = ReduceTwo(c.type, c.reduction, acc, bytes(in[0]) + at, bytes(in[1]) + at,
                             per);
              k = 2;
            } else {
              std::memcpy(acc, bytes(in[0]) + at, B);
            }
            for (; ok && k < in.size(); ++k) {
              ok = ReduceInto(c.type, c.reduction, acc, bytes(in[k]) + at, per);
            }
            if (!ok) {
              return ffi::Error::InvalidArgument(std::string(c.op) +
                                                 ": no in-process reduction for " +
                                                 std::string(c.operand));
            }
          }
        }
        send = send_stage;
      }
      if (m == 1) {
        recv = out[local_of(mine[0])];
      } else {
        recv_stage = recv_staging.Get(m * B);
        recv = recv_stage;
      }
      if (spans && !MpiReduction(c.type, c.reduction, &mpi_type, &mpi_op)) {
        return ffi::Error::InvalidArgument(std::string(c.op) + ": no MPI reduction for " +
                                           std::string(c.operand));
      }
      if (!spans) {
        local_copy = m * B;
      }
      break;
    }
    case Exchange::kAllToAll: {
      name = equal ? "MPI_Ialltoall" : "MPI_Ialltoallv";
      // To communicator rank q: for each of q's positions i, my members' blocks i (my
      // positions ascending); from q the same, so block (i, j) lands in member i's output
      // as block j. `pack` lays the blocks to send out so in a staging buffer (`peers`:
      // only those for other processes, each at its place in that layout).
      auto pack = [&](bool peers = false) {
        send_stage = send_staging.Get(n * m * B);
        for (size_t q = 0; q < Q; ++q) {
          if (peers && q == static_cast<size_t>(l.mine)) continue;
          std::byte* cursor = send_stage + static_cast<size_t>(displs[q]);
          for (int64_t i : l.positions[q]) {
            for (int64_t j : mine) {
              std::memcpy(cursor, bytes(in[local_of(j)]) + static_cast<size_t>(i) * B, B);
              cursor += B;
            }
          }
        }
        send = send_stage;
      };
      if (m == 1 && l.identity) {
        send = in[0];
        recv = out[0];
        if (spans && send == recv && n * B > MpiTransport::kPersistentBytes) {
          // In place (XLA lets the result take the operand's buffer, as it does in a
          // loop): MPICH's in-place all-to-all copies each peer's block into a temporary
          // it allocates at every call (MPIR_Sched_alloc_state) and exchanges it one
          // sendrecv_replace step at a time, between schedule barriers. Here only the
          // blocks for other processes are staged, into memory kept from call to call, and
          // exchanged out of place in one step; this process's own block stays. Up to
          // kPersistentBytes the persistent in-place request stays: with 2 processes it
          // was the faster of the two there (one exchange, on buffers of its own).
          pack(/*peers=*/true);
          peers_only = true;
          name = "MPI_Ialltoallv";
        }
      } else if (spans && n * m * B > kScatteredAllToAllBytes) {
        // MPI reads the blocks from the operands and writes them into the outputs itself
        // (MPI_Ialltoallw, a datatype per peer of the blocks' addresses): no pack into a
        // staging buffer and no unpack out of one, two passes over every byte the process
        // holds, which took more than MPI's own exchange of the same bytes. Where an
        // output is an operand's buffer (XLA may alias them), a block received would
        // overwrite one not yet sent: the sends are then packed first. Where every output
        // is its own operand's buffer (the lowering lets XLA alias them, as it does in a
        // loop), only the blocks for other processes are: a device's own block stays where
        // it is, and the blocks between this process's devices trade places (SwapBlocks).
        // Packing every block and copying this process's back out of the stage moved
        // twice the bytes of MPI's own exchange again.
        scattered = true;
        name = "MPI_Ialltoallw";
        bool aliased = false;
        in_place = true;
        for (size_t a = 0; a < in.size(); ++a) {
          for (size_t b = 0; b < out.size(); ++b) {
            const bool overlap = Overlap(in[a], out[b], n * B);
            aliased = aliased || overlap;
            in_place = in_place && (a == b ? in[a] == out[b] : !overlap);
          }
        }
        in_place = in_place && aliased;
        if (aliased) pack(in_place);
      } else {
        pack();
        recv_stage = recv_staging.Get(n * m * B);
        recv = recv_stage;
      }
      // The operand's buffer is the result's (the lowering lets XLA alias them): in place.
      if (!scattered && send == recv) send = MPI_IN_PLACE;
      break;
    }
  }
  if (!spans) {
    // One process: the wire is a copy (all_gather already packed in place).
    if (c.kind == Exchange::kAllToAll) local_copy = n * m * B;
    if (local_copy && send != recv && send != MPI_IN_PLACE) {
      std::memcpy(recv, send, local_copy);
    }
  } else if (n * B > 0) {  // the same shapes on every rank: none calls MPI for 0 bytes
    Runtime::MpiOpScope active;  // the exit keeps the transport until this returns
    std::shared_ptr<void> staged;  // the staging memory, if MPI reads or writes it
    if (send_stage || recv_stage) {
      staged = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(
          send_stage ? send_staging.Owner() : nullptr,
          recv_stage ? recv_staging.Owner() : nullptr);
    }
    const size_t moved = c.kind == Exchange::kAllToAll ? n * m * B : n * B;
    const auto deadline = DeadlineAfter(state.config.recv_timeout_s);
    Status s;
    // The datatypes of a scattered all_to_all, freed when the call returns (MPI lets a
    // request in flight, one abandoned at a timeout too, outlive its datatypes).
    thread_local std::vector<MPI_Datatype> send_types, recv_types;
    thread_local std::vector<int> send_counts, recv_counts, zeros;
    ScopedDatatypes made;
    if (peers_only) {
      send_counts.assign(counts.begin(), counts.end());
      send_counts[l.mine] = 0;
    }
    if (scattered) {
      if (in_place) {
        // Member i's block j and member j's block i trade places; a member's own block is
        // already in its output.
        for (size_t ii = 0; ii < m; ++ii) {
          for (size_t jj = ii + 1; jj < m; ++jj) {
            SwapBlocks(wbytes(out[local_of(mine[ii])]) + static_cast<size_t>(mine[jj]) * B,
                       wbytes(out[local_of(mine[jj])]) + static_cast<size_t>(mine[ii]) * B,
                       B);
          }
        }
      } else {
        // This process's own blocks, copied here once: through MPI (a local copy between
        // two derived datatypes) they went through a buffer of MPI's, twice.
        for (size_t ii = 0; ii < m; ++ii) {
          for (size_t jj = 0; jj < m; ++jj) {
            const std::byte* from =
                send != nullptr
                    ? send_stage + displs[l.mine] + (ii * m + jj) * B
                    : bytes(in[local_of(mine[jj])]) + static_cast<size_t>(mine[ii]) * B;
            std::memcpy(wbytes(out[local_of(mine[ii])]) + static_cast<size_t>(mine[jj]) * B,
                        from, B);
          }
        }
      }
      if (send != nullptr) {
        send_counts.assign(counts.begin(), counts.end());
      } else {
        send_counts.assign(Q, 1);
      }
      recv_counts.assign(Q, 1);
      send_counts[l.mine] = recv_counts[l.mine] = 0;
      zeros.assign(Q, 0);
      send_types.assign(Q, MPI_BYTE);
      recv_types.assign(Q, MPI_BYTE);
      int rc = MPI_SUCCESS;
      for (size_t q = 0; q < Q && rc == MPI_SUCCESS; ++q) {
        if (q == static_cast<size_t>(l.mine)) continue;
        const auto& theirs = l.positions[q];
        if (send == nullptr) {
          rc = made.Blocks(B, &send_types[q], [&](auto&& block) {
            for (int64_t i : theirs) {
              for (int64_t j : mine) {
                block(bytes(in[local_of(j)]) + static_cast<size_t>(i) * B);
              }
            }
          });
        }
        if (rc != MPI_SUCCESS) break;
        rc = made.Blocks(B, &recv_types[q], [&](auto&& block) {
          for (int64_t i : mine) {
            for (int64_t j : theirs) {
              block(wbytes(out[local_of(i)]) + static_cast<size_t>(j) * B);
            }
          }
        });
      }
      if (rc != MPI_SUCCESS) {
        return Failure(Status::MpiError("MPI_Type_create_hindexed", rc), c.op, c.operand,
                       c.me, state, l.ranks);
      }
    }
    if (pairwise) {
      s = PairwiseExchange(c, *state.mpi, l, send_stage, recv_stage, moved, deadline,
                           std::move(staged));
    } else if (!scattered && equal && moved <= MpiTransport::kPersistentBytes) {
      s = PersistentExchange(c, *state.mpi, l, counts[0], send, recv, n * B, m * B,
                             deadline);
    } else {
      // One lambda, passed by reference: a std::function made of a lambda with this many
      // captures would allocate at every call.
      auto start = [&](MPI_Comm comm, MPI_Request* r) {
        switch (c.kind) {
          case Exchange::kAllGather: {
            const int sc = send == MPI_IN_PLACE ? 0 : counts[l.mine];
            if (equal) {
              return MPI_Iallgather(send, sc, MPI_BYTE, recv, counts[0], MPI_BYTE, comm, r);
            }
            return MPI_Iallgatherv(send, sc, MPI_BYTE, recv, counts.data(), displs.data(),
                                   MPI_BYTE, comm, r);
          }
          case Exchange::kReduceScatter:
            if (equal) {
              return MPI_Ireduce_scatter_block(send, recv, counts[0], mpi_type, mpi_op, comm,
                                               r);
            }
            return MPI_Ireduce_scatter(send, recv, counts.data(), mpi_type, mpi_op, comm, r);
          case Exchange::kAllToAll:
            if (scattered) {
              const bool staged_send = send != nullptr;
              return MPI_Ialltoallw(staged_send ? send : MPI_BOTTOM, send_counts.data(),
                                    staged_send ? displs.data() : zeros.data(),
                                    send_types.data(), MPI_BOTTOM, recv_counts.data(),
                                    zeros.data(), recv_types.data(), comm, r);
            }
            if (peers_only) {
              return MPI_Ialltoallv(send, send_counts.data(), displs.data(), MPI_BYTE, recv,
                                    send_counts.data(), displs.data(), MPI_BYTE, comm, r);
            }
            break;
        }
        if (equal) {
          return MPI_Ialltoall(send, counts[0], MPI_BYTE, recv, counts[0], MPI_BYTE, comm, r);
        }
        return MPI_Ialltoallv(send, counts.data(), displs.data(), MPI_BYTE, recv,
                              counts.data(), displs.data(), MPI_BYTE, comm, r);
      };
      s = state.mpi->Collective(site.key, l.ranks, site.comm, name, std::ref(start), moved,
                                deadline, std::move(staged));
    }
    if (!s.ok()) return Failure(s, c.op, c.operand, c.me, state, l.ranks);
  }
  // Unpack into the outputs.
  switch (c.kind) {
    case Exchange::kAllGather:
      if (!l.identity) {
        for (size_t q = 0; q < Q; ++q) {
          for (size_t i = 0; i < l.positions[q].size(); ++i) {
            std::memcpy(wbytes(out[0]) + static_cast<size_t>(l.positions[q][i]) * B,
                        recv_stage + (l.first[q] + i) * B, B);
          }
        }
      }
      if (own_blocks_first) {
        for (size_t k = 1; k < out.size(); ++k) {
          for (size_t q = 0; q < Q; ++q) {
            if (q == static_cast<size_t>(l.mine)) continue;
            const size_t at = static_cast<size_t>(l.first[q]) * B;
            std::memcpy(wbytes(out[k]) + at, bytes(out[0]) + at, l.positions[q].size() * B);
          }
        }
      } else {
        for (size_t k = 1; k < out.size(); ++k) std::memcpy(out[k], out[0], n * B);
      }
      break;
    case Exchange::kReduceScatter:
      if (pairwise) {
        // Each block of this process: its devices' blocks in ascending partition order,
        // then the other processes' partial sums in ascending communicator rank (the same
        // order at every call).
        const size_t per = B / ffi::ByteWidth(c.type);
        for (size_t i = 0; i < m; ++i) {
          void* o = out[local_of(mine[i])];
          const size_t at = static_cast<size_t>(mine[i]) * B;
          size_t q = l.mine == 0 ? 1 : 0;  // the first other process
          bool ok = true;
          if (in.size() == 2) {
            ok = ReduceThree(c.type, c.reduction, o, bytes(in[0]) + at, bytes(in[1]) + at,
                             recv_stage + (q * m + i) * B, per);
            ++q;
          } else {
            std::memcpy(o, bytes(in[0]) + at, B);
            for (size_t k = 1; ok && k < in.size(); ++k) {
              ok = ReduceInto(c.type, c.reduction, o, bytes(in[k]) + at, per);
            }
          }
          for (; ok && q < Q; ++q) {
            if (q == static_cast<size_t>(l.mine)) continue;
            ok = ReduceInto(c.type, c.reduction, o, recv_stage + (q * m + i) * B, per);
          }
          if (!ok) {
            return ffi::Error::InvalidArgument(std::string(c.op) +
                                               ": no in-process reduction for " +
                                               std::string(c.operand));
          }
        }
      } else if (recv != out[local_of(mine[0])] || m > 1) {
        for (size_t i = 0; i < m; ++i) {
          std::memcpy(out[local_of(mine[i])], wbytes(recv) + i * B, B);
        }
      }
      break;
    case Exchange::kAllToAll:
      if (!scattered && !(m == 1 && l.identity)) {
        for (size_t q = 0; q < Q; ++q) {
          const auto& theirs = l.positions[q];
          for (size_t ii = 0; ii < m; ++ii) {
            for (size_t jj = 0; jj < theirs.size(); ++jj) {
              std::memcpy(wbytes(out[local_of(mine[ii])]) + static_cast<size_t>(theirs[jj]) * B,
                          recv_stage + displs[q] + (ii * theirs.size() + jj) * B, B);
            }
          }
        }
      }
      break;
  }
  return ffi::Error::Success();
}

// The local meeting of an exchange (MeetLocally): as AllReduce's, the last to arrive leads.
Outcome ExchangeCollective(ffi::AnyBuffer x, ffi::Buffer<ffi::U32> partition,
                           ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> out,
                           I64Span groups, int64_t group_size, I64Span device_index,
                           I64Span device_process, int64_t site_number,
                           std::string_view kind, std::string_view reduction,
                           std::string_view op, std::string_view operand,
                           const CallInfo& call) {
  const int64_t me = static_cast<int64_t>(partition.typed_data()[0]);
  const int64_t n_dev = static_cast<int64_t>(device_index.size());
  if (me < 0 || me >= n_dev || static_cast<int64_t>(device_process.size()) != n_dev) {
    return ffi::Error::Internal(std::string(op) + ": malformed attributes");
  }
  for (int64_t p : groups) {
    if (p >= n_dev) return ffi::Error::Internal(std::string(op) + ": malformed groups");
  }
  ExchangeCall c;
  if (!ParseExchange(kind, &c.kind) || !ParseReduction(reduction, &c.reduction)) {
    return ffi::Error::Internal(std::string(op) + ": unknown collective");
  }
  c.type = x.element_type();
  c.op = op;
  c.operand = operand;
  c.me = me;
  ExchangeSite& site = SiteEntry<ExchangeSite>(
      groups, group_size, device_index, device_process, site_number, me,
      static_cast<int>(c.kind), [&](SiteAttributes a) {
        auto e = std::make_unique<ExchangeSite>();
        e->attributes = std::move(a);
        // The row of `me`, in group order.
        const size_t rows = group_size > 0 ? groups.size() / group_size : 0;
        for (size_t r = 0; r < rows && e->row.empty(); ++r) {
          const int64_t* row = groups.begin() + r * group_size;
          if (std::find(row, row + group_size, me) == row + group_size) continue;
          for (int64_t i = 0; i < group_size; ++i) {
            if (row[i] >= 0) e->row.push_back(row[i]);
          }
        }
        for (int64_t p : e->row) {
          if (device_process[p] == device_process[me]) e->local.push_back(p);
          e->spans = e->spans || device_process[p] != device_process[me];
        }
        std::sort(e->local.begin(), e->local.end());
        for (int64_t p : e->local) {
          e->local_pos.push_back(std::find(e->row.begin(), e->row.end(), p) - e->row.begin());
        }
        std::ostringstream key;
        key << kind << ':';
        for (int64_t p : e->row) key << device_index[p] << ',';
        key << '#' << site_number;
        e->key = key.str();
        return e;
      });
  c.site = &site;
  const size_t n = site.row.size();
  const size_t in_bytes = x.size_bytes(), out_bytes = out->size_bytes();
  const size_t expect_out = c.kind == Exchange::kAllGather ? in_bytes * n
                            : c.kind == Exchange::kReduceScatter ? (n ? in_bytes / n : 0)
                                                                  : in_bytes;
  if (n == 0 || out_bytes != expect_out ||
      (c.kind != Exchange::kAllGather && in_bytes % n != 0)) {
    return ffi::Error::Internal(std::string(op) + ": operand and result sizes do not match "
                                "the group");
  }
  c.block = c.kind == Exchange::kAllGather ? in_bytes : in_bytes / n;
  if (site.local.size() == 1) {  // no meeting (spans over the arguments: no allocation)
    const void* const in[] = {x.untyped_data()};
    void* const outs[] = {out->untyped_data()};
    return LeadExchange(c, in, outs, device_process);
  }
  return MeetLocally(site.key, site.slot, site.local, me, x.untyped_data(), out->untyped_data(),
                     op, operand, call,
                     [&](const std::vector<const void*>& in, std::vector<void*>& outs,
                         size_t /*pos*/) { return LeadExchange(c, in, outs, device_process); });
}

trace::Op TraceOp(std::string_view kind) {
  if (kind == "all_gather") return trace::Op::kAllGather;
  if (kind == "reduce_scatter") return trace::Op::kReduceScatter;
  return trace::Op::kAllToAll;
}


// A collective after a failed psend/precv in a program that runs collectives
// (SuspectChannels::MarkCollectives): refused before it meets anyone, naming the failure.
// One atomic load while nothing failed.
ffi::Error RefusedAfterFailure(std::string_view op, std::string_view operand,
                               ffi::Buffer<ffi::U32> partition) {
  if (!Runtime::Get().suspect_channels().any()) [[likely]] return ffi::Error::Success();
  const std::string why = Runtime::Get().suspect_channels().CollectivesWhy();
  if (why.empty()) return ffi::Error::Success();
  return ffi::Error(
      ffi::ErrorCode::kFailedPrecondition,
      std::string(op) + " of " + std::string(operand) + " on partition " +
          std::to_string(partition.typed_data()[0]) + " refused: an earlier call of a program "
          "that runs collectives failed on this process (" + why + "). XLA runs no further "
          "op of a program on a device once one has failed, so that call's collectives there "
          "may have been skipped while its peers' ran: their part may still wait, and this "
          "collective would meet it (each side returning the other call's data as its own). "
          "Every later collective of this process is refused: restart the job, as after a "
          "failed NCCL op (catching the error does not make them usable again).");
}

Outcome AllReduceImpl(xla::ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> partition,
                      ffi::RemainingArgs after, ffi::Result<ffi::AnyBuffer> out,
                      I64Span groups, int64_t group_size, I64Span device_index,
                      I64Span device_process, int64_t site, int64_t park,
                      std::string_view reduction, std::string_view op,
                      std::string_view operand) {
  ffi::Error refused = RefusedAfterFailure(op, operand, partition);
  Outcome result = refused.failure() ? Outcome(std::move(refused)) : Traced(
      [&](const CallInfo& call) {
        return AllReduce(x, partition, after, out, groups, group_size, device_index,
                         device_process, site, reduction, op, operand, call);
      },
      run.run_id, park != 0, partition, device_index, device_process, site, x.size_bytes(),
      trace::Op::kAllReduce);
  // A failed collective ends its program run (XLA runs no further thunk).
  if (result.failure()) [[unlikely]] {
    Runtime::Get().settle_run_after_failure(
        run.run_id, static_cast<int64_t>(partition.typed_data()[0]), result.error.message());
  }
  return result;
}

Outcome ExchangeImpl(xla::ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> partition,
                     ffi::RemainingArgs after, ffi::Result<ffi::AnyBuffer> out,
                     I64Span groups, int64_t group_size, I64Span device_index,
                     I64Span device_process, int64_t site, int64_t park,
                     std::string_view reduction, std::string_view op,
                     std::string_view operand, std::string_view kind) {
  ffi::Error refused = RefusedAfterFailure(op, operand, partition);
  Outcome result = refused.failure() ? Outcome(std::move(refused)) : Traced(
      [&](const CallInfo& call) {
        return ExchangeCollective(x, partition, after, out, groups, group_size, device_index,
                                  device_process, site, kind, reduction, op, operand, call);
      },
      run.run_id, park != 0, partition, device_index, device_process, site,
      std::max(x.size_bytes(), out->size_bytes()), TraceOp(kind));
  // A failed collective ends its program run (XLA runs no further thunk).
  if (result.failure()) [[unlikely]] {
    Runtime::Get().settle_run_after_failure(
        run.run_id, static_cast<int64_t>(partition.typed_data()[0]), result.error.message());
  }
  return result;
}

// The end of a program's chain of collectives (passes/ordered_collectives.py): its
// operands (the last collective's result and what the program returns, unread) only order
// it after them.
ffi::Error CollectivesEnd(ffi::RemainingArgs /*after*/) {
  Resumers().HandOff();
  return ffi::Error::Success();
}

}  // namespace

bool SetMeetingHandoff(int mode) {
  if (mode < 0 || mode > 2) return false;
  g_handoff.store(mode, std::memory_order_relaxed);
  return true;
}
int MeetingHandoff() { return g_handoff.load(std::memory_order_relaxed); }
uint64_t CollectiveParks() { return g_parks.load(std::memory_order_relaxed); }

}  // namespace jcm

// A handler's Outcome goes to XLA as an error (or success) when it has no future, as the
// future otherwise (an FFI handler may return either).
template <xla::ffi::ExecutionStage stage>
struct xla::ffi::ResultEncoding<stage, jcm::Outcome> {
  static std::variant<XLA_FFI_Error*, XLA_FFI_Future*> Encode(const XLA_FFI_Api* api,
                                                              XLA_FFI_ExecutionContext* ctx,
                                                              jcm::Outcome outcome) {
    if (outcome.future) {
      return ResultEncoding<stage, Future>::Encode(api, ctx, std::move(*outcome.future));
    }
    return ResultEncoding<stage, Error>::Encode(api, ctx, std::move(outcome.error));
  }
};

namespace {
// The operands, results and attributes both collective custom calls have (see
// python/jax_cpu_mpi/_src/lowering/collectives.py); the exchange adds its "kind".
auto CollectiveBinding() {
  return xla::ffi::Ffi::Bind()
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
      .Attr<int64_t>("park")
      .Attr<std::string_view>("reduction")
      .Attr<std::string_view>("op")
      .Attr<std::string_view>("operand");
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcmAllReduce, jcm::AllReduceImpl, CollectiveBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcmExchange, jcm::ExchangeImpl,
                              CollectiveBinding().Attr<std::string_view>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcmCollectivesEnd, jcm::CollectivesEnd,
                              xla::ffi::Ffi::Bind().RemainingArgs());
