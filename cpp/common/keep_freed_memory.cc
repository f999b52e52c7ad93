#include "common/keep_freed_memory.h"

#include <climits>  // first: a C library header defines __GLIBC__ where it is glibc

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif
#if defined(__linux__)
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace jcm {

namespace {
std::atomic<bool> g_keeping_freed_memory{false};
}  // namespace

bool KeepingFreedMemory() { return g_keeping_freed_memory.load(std::memory_order_relaxed); }

bool KeepFreedMemory() {
#if defined(__GLIBC__)
  // No new mmapped blocks: large blocks come from the heap (a thread's arena falls back to
  // an mmap only for a block larger than its 64 MiB heap). mallopt's M_MMAP_THRESHOLD
  // cannot say that: glibc caps it at 32 MiB.
  const bool no_mmap = mallopt(M_MMAP_MAX, 0) == 1;
  // The heap's free top is never given back (INT_MAX: mallopt takes an int).
  const bool no_trim = mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  if (no_mmap && no_trim) g_keeping_freed_memory.store(true, std::memory_order_relaxed);
  return no_mmap && no_trim;
#else
  return false;
#endif
}

namespace {

// The size of a transparent huge page (PMD size), or 0 where the kernel has none.
size_t HugePageBytes() {
  size_t bytes = 0;
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
  if (!(in >> bytes) || bytes == 0 || (bytes & (bytes - 1)) != 0) return 0;
  return bytes;
}

}  // namespace

namespace {

// PAGEMAP_SCAN (Linux 6.7, linux/fs.h), spelled out: the kernel headers of the build may be
// older than the kernel it runs on.
struct PageRegion {
  uint64_t start;
  uint64_t end;
  uint64_t categories;
};
struct PmScanArg {
  uint64_t size;
  uint64_t flags;
  uint64_t start;
  uint64_t end;
  uint64_t walk_end;
  uint64_t vec;
  uint64_t vec_len;
  uint64_t max_pages;
  uint64_t category_inverted;
  uint64_t category_mask;
  uint64_t category_anyof_mask;
  uint64_t return_mask;
};
static_assert(sizeof(PmScanArg) == 96, "struct pm_scan_arg of linux/fs.h");
#if defined(__linux__)
constexpr unsigned long kPagemapScan = _IOWR('f', 16, PmScanArg);
#endif
constexpr uint64_t kPageIsHuge = uint64_t{1} << 6;

// /proc/self/pagemap, opened once per process, asked which pages of a range are huge pages.
class Pagemap {
 public:
  Pagemap() {
#if defined(__linux__)
    fd_.store(open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC), std::memory_order_relaxed);
    pid_ = getpid();
#endif
  }
  ~Pagemap() {
#if defined(__linux__)
    // Taken before it is closed: a thread still asking at exit gets no answer, not another
    // file that reused the number.
    const int fd = fd_.exchange(-1);
    if (fd >= 0) close(fd);
#endif
  }
  Pagemap(const Pagemap&) = delete;
  Pagemap& operator=(const Pagemap&) = delete;

  // The first address of [begin, end) (page aligned) that is not on a huge page, end where
  // every page is, or nullopt where the kernel cannot say (no PAGEMAP_SCAN: Linux before 6.7;
  // a child forked from the process that opened the file, whose descriptor would describe
  // its parent's memory).
  std::optional<uintptr_t> FirstNotHuge(uintptr_t begin, uintptr_t end) {
#if defined(__linux__)
    const int fd = fd_.load(std::memory_order_relaxed);
    if (fd < 0 || !works_.load(std::memory_order_relaxed) || getpid() != pid_) return {};
    PageRegion region{};
    PmScanArg arg{};
    arg.size = sizeof(arg);
    arg.start = begin;
    arg.end = end;
    arg.vec = reinterpret_cast<uintptr_t>(&region);
    arg.vec_len = 1;
    // The pages whose "huge" category is 0 (inverted, then required): the first one found
    // ends the walk, so a range on 4 KiB pages costs one page's look-up, and one on huge
    // pages one look-up per huge page.
    arg.max_pages = 1;
    arg.category_inverted = kPageIsHuge;
    arg.category_mask = kPageIsHuge;
    arg.return_mask = kPageIsHuge;
    const int found = ioctl(fd, kPagemapScan, &arg);
    if (found < 0) {
      // An older kernel does not know the request (ENOTTY, or EINVAL for a field it does not
      // know): it will not learn it; other failures are this call's.
      if (errno == ENOTTY || errno == EINVAL) works_.store(false, std::memory_order_relaxed);
      return {};
    }
    return found > 0 ? std::max<uintptr_t>(region.start, begin) : end;
#else
    (void)begin;
    (void)end;
    return {};
#endif
  }

 private:
  std::atomic<int> fd_{-1};
  std::atomic<bool> works_{true};
  int pid_ = -1;
};

Pagemap& ProcessPagemap() {
  static Pagemap pagemap;
  return pagemap;
}

}  // namespace

size_t TransparentHugePageBytes() {
  static const size_t bytes = [] {
    std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string setting;
    if (!std::getline(in, setting) || setting.find("[never]") != std::string::npos) {
      return size_t{0};
    }
    return HugePageBytes();
  }();
  return bytes;
}

std::span<std::byte> WholeHugePages(void* data, size_t bytes) {
  static const size_t huge = HugePageBytes();
  if (huge == 0) return {};
  const auto start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (start + huge - 1) & ~(huge - 1);
  const uintptr_t end = (start + bytes) & ~(huge - 1);
  if (end <= begin) return {};
  return {reinterpret_cast<std::byte*>(begin), static_cast<size_t>(end - begin)};
}

size_t BasePageBytes() {
#if defined(__linux__)
  static const size_t bytes = [] {
    const long page = sysconf(_SC_PAGESIZE);
    return page > 0 ? static_cast<size_t>(page) : size_t{4096};
  }();
  return bytes;
#else
  return 4096;
#endif
}

std::optional<std::span<const unsigned char>> ResidentPages(uintptr_t begin, uintptr_t end) {
#if defined(__linux__)
  const uintptr_t page = BasePageBytes();
  thread_local std::vector<unsigned char> resident;
  resident.resize((end - begin + page - 1) / page);
  if (mincore(reinterpret_cast<void*>(begin), end - begin, resident.data()) != 0) {
    return std::nullopt;
  }
  return std::span<const unsigned char>(resident);
#else
  (void)begin;
  (void)end;
  return std::nullopt;
#endif
}

namespace {

#if defined(__linux__)
constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE (Linux 6.1); the C headers may lack it

// Has the kernel move the 4 KiB pages of [begin, end) (whole huge pages) onto huge pages, from
// the first huge page that is not one: the kernel's collapse of huge pages already in place is
// cheap but not free (it drains every CPU's page lists first), and skipped where the range is
// all huge pages already. A hint only, as AdviseHugePages: the contents do not change, and a
// kernel without MADV_COLLAPSE (or without free huge pages) refuses; the 4 KiB pages then stay.
// False where the kernel refused for a passing reason (EAGAIN: a page it could not isolate,
// such as one pinned by a copy in progress, a peer's process_vm_readv out of this buffer):
// the caller asks again at the buffer's next use instead of taking it as collapsed.
bool CollapseFrom(Pagemap& pagemap, uintptr_t begin, uintptr_t end, size_t huge) {
  const std::optional<uintptr_t> first = pagemap.FirstNotHuge(begin, end);
  if (first && *first >= end) return true;
  const uintptr_t from = first ? (*first & ~(uintptr_t{huge} - 1)) : begin;
  return madvise(reinterpret_cast<void*>(from), end - from, kMadvCollapse) == 0 ||
         errno != EAGAIN;
}
#endif

// A collapse repaid itself when the memory it moved was asked about this many times (the
// collapsing ask included) before other memory took its place: the collapse copies the
// buffer once in the kernel, and each later copy by MPI out of it or into it pins and walks
// 512 times fewer pages. A new buffer where such a one was is collapsed at its second ask.
constexpr uint64_t kRepaidUses = 4;
// A new buffer where a collapsed one was before it repaid (a buffer made afresh at every call
// and sent once, at a recycled address) is left alone for this many asks, doubled at every
// such replacement up to kMaxWait, then collapsed again to see whether the buffer now there
// lives longer: what a buffer that is never reused costs tends to nothing.
constexpr uint32_t kMinWait = 8;
constexpr uint32_t kMaxWait = 1024;
// Where the kernel cannot say which pages are huge (before Linux 6.7): a collapsed buffer is
// collapsed again at every this many asks, which catches a new buffer at its address within
// as many asks and costs a buffer still on huge pages the kernel's cheap pass over them.
constexpr uint64_t kRecollapseAsks = 16;

}  // namespace

void CollapseReusedBuffer(void* data, size_t bytes) {
#if defined(__linux__)
  if (TransparentHugePageBytes() == 0) return;
  const std::span<std::byte> pages = WholeHugePages(data, bytes);
  if (pages.empty()) return;
  enum class Stage : uint8_t {
    kNoted,      // asked about once: collapsed at its next ask
    kCollapsed,  // collapsed (or found on huge pages) at an earlier ask
    kWaiting,    // a new buffer replaced a collapsed one before the collapse repaid
  };
  struct Seen {
    const void* data = nullptr;
    size_t bytes = 0;
    Stage stage = Stage::kNoted;
    uint64_t uses = 0;     // asks about the memory there since its collapse, that one included
    uint32_t wait = 0;     // kWaiting: the asks left before the next collapse
    uint32_t backoff = 0;  // the last wait, doubled at each early replacement
  };
  // The last buffers this thread was asked about, a ring: a loop's carries and a pipeline's
  // few buffers fit, and a lookup is a scan of a few words. An address names a place, not a
  // buffer (XLA's allocator gives a freed buffer's address to the next of its size, over the
  // same pages or over a fresh map), so what was done at an address is checked against the
  // memory there: the kernel says whether its pages are all huge pages.
  thread_local std::array<Seen, 8> seen{};
  thread_local size_t next = 0;
  Seen* s = nullptr;
  for (Seen& candidate : seen) {
    if (candidate.data == data) s = &candidate;
  }
  if (s == nullptr || s->bytes != bytes) {
    // Seen once (the first time, or a buffer of another size at a known address): a buffer
    // received into or sent from once would pay the collapse and gain nothing from it.
    Seen& slot = s != nullptr ? *s : seen[next];
    if (s == nullptr) next = (next + 1) % seen.size();
    slot = Seen{data, bytes};
    return;
  }
  const auto begin = reinterpret_cast<uintptr_t>(pages.data());
  const uintptr_t end = begin + pages.size();
  const size_t huge = TransparentHugePageBytes();
  Pagemap& pagemap = ProcessPagemap();
  switch (s->stage) {
    case Stage::kWaiting:
      if (--s->wait > 0) return;
      [[fallthrough]];
    case Stage::kNoted:
      if (!CollapseFrom(pagemap, begin, end, huge)) {
        s->stage = Stage::kNoted;  // refused for now: again at the next ask
        return;
      }
      s->stage = Stage::kCollapsed;
      s->uses = 1;
      return;
    case Stage::kCollapsed: {
      const std::optional<uintptr_t> first = pagemap.FirstNotHuge(begin, end);
      if (!first) {
        if (++s->uses % kRecollapseAsks == 0) {
          (void)madvise(pages.data(), pages.size(), kMadvCollapse);
        }
        return;
      }
      if (*first >= end) {
        if (++s->uses >= kRepaidUses) s->backoff = 0;
        return;
      }
      // Not all huge pages at an address whose pages were: other memory is there now (or the
      // kernel split them). Seen once, as a new buffer, if the last one repaid its collapse.
      if (s->uses >= kRepaidUses) {
        s->stage = Stage::kNoted;
        return;
      }
      s->backoff = std::clamp(2 * s->backoff, kMinWait, kMaxWait);
      s->wait = s->backoff;
      s->stage = Stage::kWaiting;
      return;
    }
  }
#else
  (void)data;
  (void)bytes;
#endif
}

std::shared_ptr<std::byte[]> HugePageMemory(size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t huge = TransparentHugePageBytes();
  if (huge == 0 || bytes == 0) return nullptr;
  // Whole huge pages, and one more of slack for the alignment (address space only: the slack
  // is never touched).
  const size_t used = (bytes + huge - 1) & ~(huge - 1);
  const size_t mapped = used + huge;
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(base);
  auto* data = reinterpret_cast<std::byte*>((start + huge - 1) & ~(uintptr_t{huge} - 1));
  (void)madvise(data, used, MADV_HUGEPAGE);
  return std::shared_ptr<std::byte[]>(data, [base, mapped](std::byte*) {
    (void)munmap(base, mapped);
  });
#else
  (void)bytes;
  return nullptr;
#endif
}

namespace {
std::atomic<uint64_t> g_prefaulted_bytes{0};
std::atomic<uint64_t> g_prefault_present_bytes{0};
// Cleared by the first refusal that says the kernel does not know the request (EINVAL):
// it will not learn it, and every later wait would ask again.
std::atomic<bool> g_populate_works{true};
constexpr int kMadvPopulateWrite = 23;  // MADV_POPULATE_WRITE (Linux 5.14); may be missing
std::atomic<bool> g_prefault_on{true};  // SetOutputPrefault
}  // namespace

uint64_t PrefaultedBytes() { return g_prefaulted_bytes.load(std::memory_order_relaxed); }
uint64_t PrefaultPresentBytes() {
  return g_prefault_present_bytes.load(std::memory_order_relaxed);
}

void SetOutputPrefault(bool on) { g_prefault_on.store(on, std::memory_order_relaxed); }

OutputPrefault::OutputPrefault(void* data, size_t bytes) {
#if defined(__linux__)
  if (bytes < kHugePageHintBytes || !g_populate_works.load(std::memory_order_relaxed) ||
      !g_prefault_on.load(std::memory_order_relaxed)) {
    return;
  }
  const auto start = reinterpret_cast<uintptr_t>(data);
  const auto page = static_cast<uintptr_t>(BasePageBytes());
  next_ = start & ~(page - 1);
  end_ = (start + bytes + page - 1) & ~(page - 1);
#else
  (void)data;
  (void)bytes;
#endif
}

namespace {
// Whether every page of [begin, end) is in memory (mincore): a look at the page table that
// costs a small part of what MADV_POPULATE_WRITE's walk over the same pages does where they
// are 4 KiB pages and all present (a loop's carry, a donated buffer, memory that glibc handed
// back), and a step that walks them delays the poll that would see the message by that
// walk. False where mincore refuses (the populate then decides).
bool AllPresent(uintptr_t begin, uintptr_t end) {
  const auto resident = ResidentPages(begin, end);
  return resident && std::all_of(resident->begin(), resident->end(),
                                 [](unsigned char r) { return (r & 1) != 0; });
}
}  // namespace

bool OutputPrefault::Step() {
#if defined(__linux__)
  if (next_ >= end_) return false;
  const size_t huge = TransparentHugePageBytes() ? TransparentHugePageBytes() : size_t{2} << 20;
  const uintptr_t step_end = std::min<uintptr_t>((next_ + huge) & ~(uintptr_t{huge} - 1), end_);
  if (AllPresent(next_, step_end)) {
    g_prefault_present_bytes.fetch_add(step_end - next_, std::memory_order_relaxed);
    next_ = step_end;
    return true;
  }
  if (madvise(reinterpret_cast<void*>(next_), step_end - next_, kMadvPopulateWrite) != 0) {
    if (errno == EINVAL) g_populate_works.store(false, std::memory_order_relaxed);
    next_ = end_;  // refused (or memory it cannot fault in): the copy faults it
    return false;
  }
  g_prefaulted_bytes.fetch_add(step_end - next_, std::memory_order_relaxed);
  next_ = step_end;
  return true;
#else
  return false;
#endif
}

void AdviseHugePages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const std::span<std::byte> pages = WholeHugePages(data, bytes);
  if (!pages.empty()) (void)madvise(pages.data(), pages.size(), MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace jcm
