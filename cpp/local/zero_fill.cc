#include "local/zero_fill.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "common/keep_freed_memory.h"

#if defined(__linux__)
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define JCM_STREAMING_STORES 1
#endif

namespace jcm {
namespace {

#ifdef JCM_STREAMING_STORES
size_t CpusIn(const std::string& list) {  // "0-1,4" -> 3
  size_t count = 0;
  std::istringstream in(list);
  std::string range;
  while (std::getline(in, range, ',')) {
    const size_t dash = range.find('-');
    try {
      const long lo = std::stol(range.substr(0, dash));
      const long hi = dash == std::string::npos ? lo : std::stol(range.substr(dash + 1));
      if (hi >= lo) count += static_cast<size_t>(hi - lo + 1);
    } catch (const std::exception&) {
      return 0;
    }
  }
  return count;
}
#endif

// glibc's rule for streaming copies (__x86_shared_non_temporal_threshold): three quarters
// of one CPU's share of the last-level cache. The cache comes from the kernel (sysfs), not
// from sysconf: glibc reads CPUID, which in VMs on AMD EPYC reports the L3 of the whole
// package (256 MiB on the benchmark VM, whose CPUs share 32 MiB). 8 MiB where unknown.
size_t ComputeMinBytes() {
#ifdef JCM_STREAMING_STORES
  constexpr size_t kUnknown = size_t{8} << 20;
  const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index3/";
  std::ifstream size_file(dir + "size"), cpus_file(dir + "shared_cpu_list");
  std::string size_text, cpus_text;
  if (!std::getline(size_file, size_text) || !std::getline(cpus_file, cpus_text)) {
    return kUnknown;
  }
  size_t cache = 0;
  try {
    cache = std::stoul(size_text);
  } catch (const std::exception&) {
    return kUnknown;
  }
  if (size_text.find('K') != std::string::npos) cache <<= 10;
  if (size_text.find('M') != std::string::npos) cache <<= 20;
  const size_t cpus = CpusIn(cpus_text);
  if (cache == 0 || cpus == 0) return kUnknown;
  return std::max<size_t>(size_t{1} << 20, cache / cpus / 4 * 3);
#else
  return 0;
#endif
}

}  // namespace

size_t StreamingZeroFillMinBytes() {
  static const size_t min_bytes = ComputeMinBytes();
  return min_bytes;
}

namespace {

std::atomic<uint64_t> g_written_bytes{0};  // ZeroFillWrittenBytes
std::atomic<uint64_t> g_dropped_bytes{0};  // ZeroFillDroppedBytes
std::atomic<bool> g_ends_by_page{true};    // SetZeroFillEndsByPage

// The bytes of [data, data + bytes) set to zero: with streaming stores if `stream` (a buffer
// of StreamingZeroFillMinBytes() or more, of which this may be a part), else memset.
void Fill(void* data, size_t bytes, bool stream) {
  if (bytes == 0) return;
  g_written_bytes.fetch_add(bytes, std::memory_order_relaxed);
#ifdef JCM_STREAMING_STORES
  if (stream) {
    auto* p = static_cast<std::byte*>(data);
    // memset up to a 64-byte boundary and past the last whole line; stream the lines.
    const auto addr = reinterpret_cast<uintptr_t>(p);
    const size_t head = static_cast<size_t>((64 - addr % 64) % 64);
    const size_t lines = (bytes - head) / 64;
    std::memset(p, 0, head);
    const __m128i zero = _mm_setzero_si128();
    std::byte* line = p + head;
    for (size_t i = 0; i < lines; ++i, line += 64) {
      auto* v = reinterpret_cast<__m128i*>(line);
      _mm_stream_si128(v, zero);
      _mm_stream_si128(v + 1, zero);
      _mm_stream_si128(v + 2, zero);
      _mm_stream_si128(v + 3, zero);
    }
    std::memset(line, 0, bytes - head - lines * 64);
    // Streaming stores are weakly ordered: make them visible before XLA (another thread,
    // or the next op) reads the output.
    _mm_sfence();
    return;
  }
#else
  (void)stream;
#endif
  std::memset(data, 0, bytes);
}

#if defined(__linux__)
// Whether [begin, end) lies in private anonymous mappings alone (/proc/self/maps: "rw-p",
// no file, as glibc's heap and its mmapped blocks are): there a page that this process never
// touched reads as zeros. A private file mapping's untouched page reads the file, a shared
// mapping's what another process wrote: those are always written.
bool PrivateAnonymous(uintptr_t begin, uintptr_t end) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  uintptr_t covered = begin;
  while (covered < end && std::getline(maps, line)) {
    unsigned long lo = 0, hi = 0, offset = 0, inode = 0;
    unsigned major = 0, minor = 0;
    char perms[5] = {};
    int path_at = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx %4s %lx %x:%x %lu %n", &lo, &hi, perms, &offset,
                    &major, &minor, &inode, &path_at) < 7) {
      return false;
    }
    if (hi <= covered) continue;
    if (lo > covered) return false;  // a hole: not mapped
    const std::string_view path = path_at > 0 && static_cast<size_t>(path_at) <= line.size()
                                      ? std::string_view(line).substr(path_at)
                                      : std::string_view();
    const bool anonymous = inode == 0 && (path.empty() || path == "[heap]" ||
                                          path.substr(0, 6) == "[anon:");
    if (std::string_view(perms) != "rw-p" || !anonymous) return false;
    covered = hi;
  }
  return covered >= end;
}

// Zeroes [data, data + bytes) writing only the pages that may hold something else: in a
// private anonymous mapping a page that is neither present nor swapped out (pagemap's bits
// 63 and 62: never touched since it was mapped, or given back) reads as zeros already, and
// stays so until this process writes it. False (nothing written) where every page is
// present (a reused buffer: the usual case, told by pagemap alone, before the slower look
// at the mappings) or the kernel does not say: the caller then writes every byte.
bool FillSkippingUntouched(std::byte* data, size_t bytes, bool stream) {
  const uintptr_t page = BasePageBytes();
  const auto start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (start + page - 1) / page;  // the whole pages, by number
  const uintptr_t last = (start + bytes) / page;
  if (last <= first) return false;
  const size_t count = last - first;
  // This thread's buffer: a fresh vector would be a malloc (and for a large one, a fresh
  // map) at every call.
  thread_local std::vector<uint64_t> entries;
  if (entries.size() < count) entries.resize(count);
  const int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  size_t read_bytes = 0;
  while (read_bytes < count * sizeof(uint64_t)) {
    const ssize_t got = pread(fd, reinterpret_cast<char*>(entries.data()) + read_bytes,
                              count * sizeof(uint64_t) - read_bytes,
                              static_cast<off_t>(first * sizeof(uint64_t) + read_bytes));
    if (got <= 0) break;
    read_bytes += static_cast<size_t>(got);
  }
  close(fd);
  if (read_bytes != count * sizeof(uint64_t)) return false;
  constexpr uint64_t kHeld = (uint64_t{1} << 63) | (uint64_t{1} << 62);  // present, swapped
  const bool any_untouched = std::any_of(entries.begin(), entries.begin() + count,
                                         [](uint64_t e) { return (e & kHeld) == 0; });
  if (!any_untouched || !PrivateAnonymous(start, start + bytes)) return false;
  auto at = [&](uintptr_t n) { return reinterpret_cast<std::byte*>(n * page); };
  // The parts outside the whole pages are always written; each whole page as it says.
  Fill(data, static_cast<size_t>(at(first) - data), stream);
  uintptr_t run = first;  // the pages from `run` up to the current one must be written
  for (size_t i = 0; i < count; ++i) {
    if ((entries[i] & kHeld) != 0) continue;
    Fill(at(run), static_cast<size_t>(at(first + i) - at(run)), stream);
    run = first + i + 1;
  }
  Fill(at(run), static_cast<size_t>(data + bytes - at(run)), stream);
  return true;
}

// /proc/<pid>/maps's PROCMAP_QUERY ioctl (Linux 6.11): the mapping that covers an address,
// without reading the whole text of the maps file. Declared here: the C library's kernel
// headers may predate it; the layout is the kernel's ABI (include/uapi/linux/fs.h).
struct ProcmapQuery {
  uint64_t size;
  uint64_t query_flags;
  uint64_t query_addr;
  uint64_t vma_start;
  uint64_t vma_end;
  uint64_t vma_flags;
  uint64_t vma_page_size;
  uint64_t vma_offset;
  uint64_t inode;
  uint32_t dev_major;
  uint32_t dev_minor;
  uint32_t vma_name_size;
  uint32_t build_id_size;
  uint64_t vma_name_addr;
  uint64_t build_id_addr;
};
static_assert(sizeof(ProcmapQuery) == 104, "struct procmap_query is 104 bytes (0xC0686611)");
constexpr unsigned long kProcmapQuery = _IOWR('f', 17, ProcmapQuery);
constexpr uint64_t kVmaWritable = 0x02, kVmaShared = 0x08;

// Whether [begin, end) lies in private, writable mappings that no file backs (glibc's heap
// and its mmapped blocks), asked of the kernel mapping by mapping. nullopt where the kernel
// has no PROCMAP_QUERY (the caller may then read /proc/self/maps, which is slower).
std::optional<bool> PrivateAnonymousByQuery(uintptr_t begin, uintptr_t end) {
  // Opened per call, not kept: a descriptor opened before a fork would describe the parent.
  const int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::optional<bool> result = true;
  for (uintptr_t at = begin; at < end;) {
    ProcmapQuery q{};
    q.size = sizeof(q);
    q.query_addr = at;
    if (ioctl(fd, kProcmapQuery, &q) != 0) {
      result = errno == ENOTTY || errno == EINVAL ? std::nullopt : std::optional<bool>(false);
      break;
    }
    const bool anonymous = q.inode == 0 && q.dev_major == 0 && q.dev_minor == 0;
    if (q.vma_start > at || q.vma_end <= at || (q.vma_flags & kVmaShared) != 0 ||
        (q.vma_flags & kVmaWritable) == 0 || !anonymous) {
      result = false;
      break;
    }
    at = q.vma_end;
  }
  close(fd);
  return result;
}

// Whether this kernel answers PROCMAP_QUERY, asked once (of this function's own static, which
// lies in a mapping): where it does not, a call need not open the maps file to learn it, and
// below kFreshMapMinBytes nothing is given back.
bool HasProcmapQuery() {
  static const bool has = [] {
    static const char probe = 0;
    const auto at = reinterpret_cast<uintptr_t>(&probe);
    return PrivateAnonymousByQuery(at, at + 1).has_value();
  }();
  return has;
}

// Zeroes [begin, end), whole 4 KiB pages of a private anonymous mapping: writes the pages in
// memory and gives the others back (MADV_DONTNEED, which also drops what was swapped out;
// nothing to do for a page never touched). Writing a page that is not in memory (a fresh
// output's) would fault it in, 4 KiB at a time, and have the kernel clear it before this
// writes it again. False where mincore or madvise refuses.
bool FillPresentDropRest(uintptr_t begin, uintptr_t end, bool stream) {
  if (begin >= end) return true;
  const uintptr_t page = BasePageBytes();
  const auto found = ResidentPages(begin, end);
  if (!found) return false;
  const std::span<const unsigned char> resident = *found;
  if (resident.empty()) return true;
  uintptr_t run = begin;  // the start of the current run of one kind
  bool run_present = (resident[0] & 1) != 0;
  auto flush = [&](uintptr_t to) {
    if (to <= run) return true;
    const size_t n = static_cast<size_t>(to - run);
    if (run_present) {
      Fill(reinterpret_cast<void*>(run), n, stream);
    } else {
      if (madvise(reinterpret_cast<void*>(run), n, MADV_DONTNEED) != 0) return false;
      g_dropped_bytes.fetch_add(n, std::memory_order_relaxed);
    }
    return true;
  };
  for (size_t i = 1; i < resident.size(); ++i) {
    const bool present = (resident[i] & 1) != 0;
    if (present == run_present) continue;
    const uintptr_t at = begin + i * page;
    if (!flush(at)) return false;
    run = at;
    run_present = present;
  }
  return flush(end);
}

// Zeroes [data, data + bytes) where it lies in private anonymous mappings by giving the whole
// huge pages inside it back to the kernel (madvise MADV_DONTNEED): such a page reads as zeros
// from then on, and a later read maps the kernel's shared zero page. The range is first
// advised for huge pages, so that a later write faults them back in 2 MiB at a time. A loop
// whose precv is no destination at every step (the first stage of a pipeline) thus pays a
// system call a step, not a pass over its output: the pages given back at the first step are
// not in memory at the next. At the partial huge pages at both ends, the 4 KiB pages in
// memory are written and the others given back (FillPresentDropRest; where
// SetZeroFillEndsByPage(false), the ends are written whole). The bytes outside whole 4 KiB
// pages are written. False (nothing written) where that cannot be done: no THP, a range
// without a whole huge page, a shared, file-backed or locked mapping, or a kernel that does
// not say.
bool FillByDroppingHugePages(std::byte* data, size_t bytes, bool stream) {
  if (TransparentHugePageBytes() == 0) return false;
  const std::span<std::byte> pages = WholeHugePages(data, bytes);
  if (pages.empty()) return false;
  std::byte* const first = pages.data();
  std::byte* const last = first + pages.size();
  const uintptr_t page = BasePageBytes();
  const auto start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t page_begin = (start + page - 1) & ~(page - 1);
  const uintptr_t page_end = (start + bytes) & ~(page - 1);
  const auto begin = reinterpret_cast<uintptr_t>(first);
  const auto end = reinterpret_cast<uintptr_t>(last);
  const bool ends_by_page = g_ends_by_page.load(std::memory_order_relaxed);
  // The ends' 4 KiB pages are only left unwritten if they too lie in such mappings.
  const uintptr_t ask_begin = ends_by_page ? page_begin : begin;
  const uintptr_t ask_end = ends_by_page ? page_end : end;
  // Without the query, the maps text is read (ZeroFillDropMinBytes: only at a size where that
  // read is worth it).
  const bool anonymous = HasProcmapQuery()
                             ? PrivateAnonymousByQuery(ask_begin, ask_end).value_or(false)
                             : PrivateAnonymous(ask_begin, ask_end);
  if (!anonymous) return false;
  AdviseHugePages(data, bytes);
  if (madvise(first, pages.size(), MADV_DONTNEED) != 0) return false;  // e.g. mlocked
  g_dropped_bytes.fetch_add(pages.size(), std::memory_order_relaxed);
  if (!ends_by_page) {
    Fill(data, static_cast<size_t>(first - data), stream);
    Fill(last, static_cast<size_t>(data + bytes - last), stream);
    return true;
  }
  // Whatever fails part way has written or given back only zeros: the caller's full write
  // after it is still right.
  if (!FillPresentDropRest(page_begin, begin, stream) ||
      !FillPresentDropRest(end, page_end, stream)) {
    return false;
  }
  Fill(data, static_cast<size_t>(page_begin - start), stream);
  Fill(reinterpret_cast<std::byte*>(page_end), static_cast<size_t>(start + bytes - page_end),
       stream);
  return true;
}
#endif

}  // namespace

size_t ZeroFillDropMinBytes() {
#if defined(__linux__)
  // JAX_CPU_MPI_KEEP_FREED_MEMORY asks that buffers stay in memory, so that writing them
  // faults nothing in: a buffer given back would fault in again at its next write.
  if (TransparentHugePageBytes() == 0 || KeepingFreedMemory()) return 0;
  return HasProcmapQuery() ? kDropHugePagesMinBytes : kFreshMapMinBytes;
#else
  return 0;
#endif
}

uint64_t ZeroFillWrittenBytes() { return g_written_bytes.load(std::memory_order_relaxed); }
uint64_t ZeroFillDroppedBytes() { return g_dropped_bytes.load(std::memory_order_relaxed); }
void SetZeroFillEndsByPage(bool on) { g_ends_by_page.store(on, std::memory_order_relaxed); }

void ZeroFill(void* data, size_t bytes) {
  if (bytes == 0) return;
  const size_t streaming = StreamingZeroFillMinBytes();
  const bool stream = streaming != 0 && bytes >= streaming;
#if defined(__linux__)
  const size_t drop = ZeroFillDropMinBytes();
  if (drop != 0 && bytes >= drop &&
      FillByDroppingHugePages(static_cast<std::byte*>(data), bytes, stream)) {
    return;
  }
  // A block this large may be a fresh map at every call (common/keep_freed_memory.h): its
  // pages are zeros until touched, and writing them would fault each one in, have the kernel
  // clear it, and then write its bytes a second time.
  if (bytes >= kFreshMapMinBytes &&
      FillSkippingUntouched(static_cast<std::byte*>(data), bytes, stream)) {
    return;
  }
#endif
  Fill(data, bytes, stream);
}

}  // namespace jcm
