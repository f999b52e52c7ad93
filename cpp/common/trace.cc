#include "common/trace.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "common/immortal.h"

namespace jcm::trace {

std::atomic<uint32_t> g_mode{0};
std::atomic<int64_t> g_process{0};

const char* PathName(Path path) {
  switch (path) {
    case Path::kLocal: return "local";
    case Path::kStaged: return "staged";
    case Path::kDirect: return "direct";
    case Path::kKept: return "kept";
    default: return "unknown";
  }
}

namespace {

// One device thread's events. Locking: `mu` guards events and dropped (the owner thread
// appends, TakeEvents empties; uncontended but for a take).
struct ThreadBuffer {
  std::mutex mu;
  std::vector<Event> events;
  uint64_t dropped = 0;
};

// Locking: `mu` guards buffers (taken once per thread, and by TakeEvents); `seq_mu` guards
// local_seq. The capacity is an atomic: recording takes no lock but its own buffer's.
struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  std::atomic<size_t> capacity{1 << 16};
  std::mutex seq_mu;
  std::map<std::tuple<int, int64_t, int64_t>, uint64_t> local_seq;
};

Registry& GetRegistry() {
  // Device threads may record while the interpreter runs static destructors.
  static Immortal<Registry> registry;
  return registry.get();
}

ThreadBuffer& ThisThreadBuffer() {
  thread_local std::shared_ptr<ThreadBuffer> mine;
  if (!mine) {
    mine = std::make_shared<ThreadBuffer>();
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.buffers.push_back(mine);  // the registry keeps it past the thread's end
  }
  return *mine;
}

const char* OpName(Op op) {
  switch (op) {
    case Op::kPsend: return "psend";
    case Op::kPrecv: return "precv";
    case Op::kMark: return "mark";
    case Op::kAllReduce: return "all_reduce";
    case Op::kAllGather: return "all_gather";
    case Op::kReduceScatter: return "reduce_scatter";
    case Op::kAllToAll: return "all_to_all";
  }
  return "?";
}

void Log(const Event& e) {
  char line[256];
  const int n = e.op == Op::kMark ? std::snprintf(
      line, sizeof(line),
      "jax_cpu_mpi: process %" PRId64 " device id %" PRId64 " tick %" PRIu64
      " starts (action %" PRId64 ", microbatch %" PRId64 ", virtual stage %" PRId64 ")\n",
      e.process, e.device, e.seq, e.label[0], e.label[1], e.label[2]) : std::snprintf(
      line, sizeof(line),
      "jax_cpu_mpi: process %" PRId64 " device %" PRId64 " %s peer %" PRId64 " bytes %" PRIu64
      " path %s %.1f us (waited %.1f us) seq %" PRIu64 "%s\n",
      e.process, e.device, OpName(e.op), e.peer, e.bytes,
      PathName(e.path), static_cast<double>(e.dur_ns) / 1e3,
      static_cast<double>(e.wait_ns) / 1e3, e.seq, e.ok ? "" : " FAILED");
  // One write per line: lines of concurrent device threads do not interleave.
  if (n > 0) std::fwrite(line, 1, static_cast<size_t>(std::min<int>(n, sizeof(line) - 1)),
                         stderr);
}

}  // namespace

OpNotes& Notes() {
  thread_local OpNotes notes;
  return notes;
}

void SetMode(bool record, bool log, size_t events_per_thread) {
  Registry& r = GetRegistry();
  if (events_per_thread > 0) r.capacity.store(events_per_thread, std::memory_order_relaxed);
  if (record && (Mode() & kRecord) == 0) {
    std::lock_guard<std::mutex> lock(r.seq_mu);
    r.local_seq.clear();
  }
  g_mode.store((record ? kRecord : 0) | (log ? kLog : 0), std::memory_order_relaxed);
}

uint64_t NextLocalSeq(Op op, int64_t source_device, int64_t destination_device) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.seq_mu);
  return r.local_seq[{static_cast<int>(op), source_device, destination_device}]++;
}

void Record(const Event& event) {
  const uint32_t mode = Mode();
  if (mode & kLog) Log(event);
  if ((mode & kRecord) == 0) return;
  const size_t capacity = GetRegistry().capacity.load(std::memory_order_relaxed);
  ThreadBuffer& buffer = ThisThreadBuffer();
  std::lock_guard<std::mutex> lock(buffer.mu);
  if (buffer.events.size() >= capacity) {
    ++buffer.dropped;
    return;
  }
  buffer.events.push_back(event);
}

Taken TakeEvents() {
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    buffers = r.buffers;
  }
  Taken taken;
  for (const auto& buffer : buffers) {
    std::vector<Event> events;
    {
      std::lock_guard<std::mutex> lock(buffer->mu);
      events.swap(buffer->events);
      taken.dropped += buffer->dropped;
      buffer->dropped = 0;
    }
    for (const Event& e : events) {
      taken.table.insert(taken.table.end(),
                         {e.start_ns, e.dur_ns, e.wait_ns, e.process, e.device, e.peer,
                          static_cast<int64_t>(e.bytes), static_cast<int64_t>(e.seq),
                          static_cast<int64_t>(e.op), static_cast<int64_t>(e.path),
                          e.ok ? 1 : 0, e.label[0], e.label[1], e.label[2]});
    }
  }
  return taken;
}

}  // namespace jcm::trace
