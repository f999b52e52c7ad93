#include "common/keep_freed_memory.h"

#include <climits>  // first: a C library header defines __GLIBC__ where it is glibc

#include <array>
#include <atomic>
#include <cstdint>
#include <fstream>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
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

void CollapseReusedBuffer(void* data, size_t bytes) {
#if defined(__linux__)
  constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE (Linux 6.1); the C headers may lack it
  if (TransparentHugePageBytes() == 0) return;
  struct Seen {
    const void* data = nullptr;
    size_t bytes = 0;
    bool collapsed = false;
  };
  // The last buffers this thread was asked about, a ring: a loop's carries and a pipeline's
  // few buffers fit, and a lookup is a scan of a few words.
  thread_local std::array<Seen, 8> seen{};
  thread_local size_t next = 0;
  for (Seen& s : seen) {
    if (s.data != data || s.bytes != bytes) continue;
    // Asked once per buffer: the kernel's collapse of huge pages already in place is cheap
    // but not free (it drains every CPU's page lists first).
    if (s.collapsed) return;
    s.collapsed = true;
    const std::span<std::byte> pages = WholeHugePages(data, bytes);
    // A hint only, as AdviseHugePages: the contents do not change, and a kernel without
    // MADV_COLLAPSE (or without free huge pages) refuses; the 4 KiB pages then stay.
    if (!pages.empty()) (void)madvise(pages.data(), pages.size(), kMadvCollapse);
    return;
  }
  seen[next] = Seen{data, bytes, false};
  next = (next + 1) % seen.size();
#else
  (void)data;
  (void)bytes;
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
