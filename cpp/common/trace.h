// Per-message timeline and debug log (JAX_CPU_MPI_TRACE, JAX_CPU_MPI_DEBUG).
//
// The handlers time each psend/precv and record one Event into a bounded buffer of the
// device thread that ran it (full buffer: the event is counted as dropped, never grows the
// buffer); Python takes the events out (trace_flush, exit) and writes the Chrome trace file.
// With both switches off a handler pays one relaxed load and one predictable branch
// (Mode()), nothing else: the transports note their path, sequence number and waits only
// through the helpers below, which test Mode() themselves and sit off the fast path (a
// large message's path choice, a wait loop that already waits).
//
// Times are steady_clock (CLOCK_MONOTONIC) nanoseconds; MPI jobs align them across
// processes with the offsets measured at attach (mpi/clock_sync.h).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace jcm::trace {

// Bits of Mode().
inline constexpr uint32_t kRecord = 1;  // keep events for the timeline
inline constexpr uint32_t kLog = 2;     // one line per message on stderr

extern std::atomic<uint32_t> g_mode;
inline uint32_t Mode() { return g_mode.load(std::memory_order_relaxed); }

// This process's jax.process_index(), for the events whose op cannot tell it (a mark). Set
// from Python, not baked into the program as an attribute: every process must compile the
// same program, or XLA's collectives between processes (gloo) never meet (jax 0.12.1).
extern std::atomic<int64_t> g_process;
inline int64_t ThisProcess() { return g_process.load(std::memory_order_relaxed); }
inline void SetThisProcess(int64_t process) {
  g_process.store(process, std::memory_order_relaxed);
}

// kMark: a point in a program's run that the program itself names (a pipeline tick's
// start): no message; `seq` holds the tick, `label` what the program says of it.
// kAllReduce: a collective between processes (ffi/collective_handlers.cc): peer -1, wait the
// time spent for the group's other devices and processes.
// kAllGather, kReduceScatter, kAllToAll: the other collectives, as kAllReduce.
enum class Op : uint8_t {
  kPsend = 0, kPrecv = 1, kMark = 2, kAllReduce = 3, kAllGather = 4, kReduceScatter = 5,
  kAllToAll = 6
};
// How the bytes travelled: an in-process copy, MPI through a copy (staged), MPI straight
// from the operand (direct, the rendezvous of large messages), or a psend that returned
// with its operand still being read, finished by a later precv (kept).
enum class Path : uint8_t { kUnknown = 0, kLocal = 1, kStaged = 2, kDirect = 3, kKept = 4 };
const char* PathName(Path path);

struct Event {
  int64_t start_ns = 0;  // steady_clock
  int64_t dur_ns = 0;
  int64_t wait_ns = 0;   // blocked on the peer (a message not there yet, a send not taken)
  int64_t process = 0;   // jax.process_index()
  int64_t device = 0;    // global device id
  int64_t peer = 0;      // global device id at the other end
  uint64_t bytes = 0;
  uint64_t seq = 0;      // the message's number on its (source, destination) channel
  Op op = Op::kPsend;
  Path path = Path::kUnknown;
  bool ok = true;        // the op returned no error
  // A mark's words (what is done from here on: action, microbatch, virtual stage); -1
  // for a psend/precv.
  int64_t label[3] = {-1, -1, -1};
};
// Columns of the flat int64 table TakeEvents() returns, in this order.
inline constexpr size_t kEventColumns = 14;

// What the transports tell the handler of the op running on this thread.
struct OpNotes {
  int64_t wait_ns = 0;
  Path path = Path::kUnknown;
  bool has_seq = false;
  uint64_t seq = 0;
};
OpNotes& Notes();  // this thread's

inline void NotePath(Path path) {
  if (Mode() != 0) Notes().path = path;
}
inline void NoteSeq(uint64_t seq) {
  if (Mode() != 0) {
    OpNotes& n = Notes();
    n.has_seq = true;
    n.seq = seq;
  }
}

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Time spent blocked on the peer: a wait loop calls Waiting() each time it finds nothing
// yet (the first call starts the clock); the destructor adds the time to Notes().wait_ns.
class WaitTimer {
 public:
  WaitTimer() = default;
  WaitTimer(const WaitTimer&) = delete;
  WaitTimer& operator=(const WaitTimer&) = delete;
  void Waiting() {
    if (start_ns_ < 0 && Mode() != 0) start_ns_ = NowNs();
  }
  ~WaitTimer() {
    if (start_ns_ >= 0) Notes().wait_ns += NowNs() - start_ns_;
  }

 private:
  int64_t start_ns_ = -1;
};

// Switches recording and logging; starting to record resets the in-process channels'
// sequence numbers and sets how many events each thread keeps between two TakeEvents.
void SetMode(bool record, bool log, size_t events_per_thread);
// Sequence number of the next message on an in-process channel (counted while tracing).
uint64_t NextLocalSeq(Op op, int64_t source_device, int64_t destination_device);
// Keeps `event` (if recording) and prints it (if logging).
void Record(const Event& event);

struct Taken {
  std::vector<int64_t> table;  // kEventColumns per event
  uint64_t dropped = 0;        // events lost to full buffers since the last take
};
// Moves every thread's events out (the buffers stay, empty).
Taken TakeEvents();

}  // namespace jcm::trace
