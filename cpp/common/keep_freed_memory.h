// Keeps the memory that malloc frees in the process (glibc), so that XLA's large per-call
// buffers are not faulted in, and zeroed by the kernel, again on every call.
//
// glibc serves blocks from 128 KiB up (the dynamic threshold rises to at most 32 MiB) with
// fresh mmaps and returns them with munmap when freed, and trims the heap's free top once it
// exceeds a threshold; XLA allocates a program's buffers (the scan's carry, the outputs)
// afresh at every call, so every call of a program with large messages page-faults them in
// again, and the kernel zeroes each page first (docs/benchmarks.md: 22-23 % of a 16 MiB
// hop's samples). With KeepFreedMemory the heap serves every block and is never trimmed:
// the process keeps the peak of its heap (what was ever allocated at once) for its lifetime.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

namespace jcm {

// Applies the settings (mallopt M_MMAP_MAX 0 and M_TRIM_THRESHOLD at its maximum); false
// where the C library is not glibc, or it refused one of them.
bool KeepFreedMemory();

// Whether KeepFreedMemory applied its settings in this process: the process keeps its pages,
// and the zeros of a precv (local/zero_fill.h) are then written, not given back to the kernel.
bool KeepingFreedMemory();

// Blocks at least this large may be fresh maps at every call even with KeepFreedMemory: a
// thread's arena (where XLA's executing threads allocate) grows by heaps of at most 64 MiB,
// and glibc maps a block that does not fit one afresh, and unmaps it when it is freed (and
// without KeepFreedMemory, every block from 32 MiB up, where glibc caps its mmap threshold).
inline constexpr size_t kFreshMapMinBytes = size_t{32} << 20;

// Asks the kernel to back [data, data + bytes) with transparent huge pages where the range
// covers whole ones (madvise MADV_HUGEPAGE; Linux with THP "madvise" or "always"). For a
// buffer about to be written for the first time (a large output XLA allocated afresh) that is
// one page fault per huge page instead of one per 4 KiB page; the kernel zeroes the same
// bytes either way. A hint only: the contents do not change, and failures are ignored.
void AdviseHugePages(void* data, size_t bytes);

// For a buffer that is written again and again (a loop's carry, a donated buffer), the
// second time this thread asks about it: has the kernel move the whole huge pages inside
// [data, data + bytes) that are 4 KiB pages onto huge pages (madvise MADV_COLLAPSE, Linux
// 6.1; the contents do not change). AdviseHugePages cannot: a range that was written before
// it was advised (the carry's first value, computed by XLA; a buffer XLA wrote and the
// program donates back at every call) keeps its 4 KiB pages for as long as it lives, and MPI's
// single copy into or out of it then pins and walks 512 times as many pages, at every
// message. The first time only notes the buffer: a buffer received into once would pay the
// collapse (a copy of its bytes) and gain nothing from it.
// An address is not a buffer: XLA's allocator gives a freed buffer's address to the next one
// of its size, over the same pages or, for a block glibc maps afresh, over new 4 KiB pages.
// So at every later ask the kernel says whether the range is still all huge pages (one
// PAGEMAP_SCAN of /proc/self/pagemap for the first page that is not, Linux 6.7): where it is
// not, a new buffer is there, collapsed at its next ask if the one before was used often
// enough to repay its collapse; a buffer made afresh at every call and used once is instead
// left alone for a number of asks that doubles each time. Where the kernel cannot say
// (older kernels), a collapsed buffer is collapsed again at every 16th ask: cheap while its
// pages are still huge, and a new buffer at its address is caught within as many asks.
void CollapseReusedBuffer(void* data, size_t bytes);

// The whole transparent huge pages (PMD-sized, aligned) inside [data, data + bytes): the range
// AdviseHugePages advises. Empty where it holds none, or the kernel has no huge pages.
std::span<std::byte> WholeHugePages(void* data, size_t bytes);

// The size of a base page (sysconf(_SC_PAGESIZE)), asked once.
size_t BasePageBytes();

// Which base pages of [begin, end) are in memory (mincore: bit 0 of each byte, a page a
// byte), in a buffer of the calling thread's that its next call reuses: a fresh vector would
// be a malloc at every call. nullopt where mincore refuses (or not on Linux). `begin` is a
// multiple of BasePageBytes().
std::optional<std::span<const unsigned char>> ResidentPages(uintptr_t begin, uintptr_t end);

// The size of a transparent huge page where the kernel backs a range advised with
// AdviseHugePages by them (THP "madvise" or "always"), else 0 (no THP, or "never").
size_t TransparentHugePageBytes();

// Memory of at least `bytes` of its own, on transparent huge pages: a fresh anonymous map,
// aligned to a huge page and advised (MADV_HUGEPAGE) before anything touches it, so that its
// pages fault in as huge pages. For memory this package keeps from call to call and that MPI
// copies into or out of (the collectives' staging buffers): with KeepFreedMemory malloc
// serves even large blocks from a thread's arena heap, on 4 KiB pages whenever that memory was
// touched before, and the peer's single copy out of such memory (process_vm_readv) pins and
// walks each of its 4 KiB pages. Unmapped when the last owner lets go. Null where the kernel
// has no transparent huge pages (or the map fails): the caller allocates as it would anyway.
std::shared_ptr<std::byte[]> HugePageMemory(size_t bytes);

// From this many bytes a collective's output, and a precv's from another process, gets
// AdviseHugePages before MPI writes it:
// numpy's threshold for the same hint, so that the collective writes into the pages mpi4py's
// call on a numpy array of that size would (a range this large holds a whole huge page).
inline constexpr size_t kHugePageHintBytes = size_t{4} << 20;

// Faults in a large precv output while its precv waits for the message, a huge page at a
// time (madvise MADV_POPULATE_WRITE, Linux 5.14). XLA gives a program's outputs fresh memory
// at every call (pages glibc mapped afresh, or that a precv's zeros gave back to the kernel),
// and otherwise MPI's single copy takes their page faults, and the kernel's clearing of each
// page, inside the copy, after the message arrived. A receiver that waits (its sender is still
// computing, or still receiving into its own output) has the pages ready by then. One step
// per poll of the wait, so the message is seen at most one huge page's fault-in late, and
// that page is one the copy would have faulted in anyway. A huge page's worth of pages all
// present already (a loop's carry, a donated buffer) is seen as such (mincore) and left
// alone: the populate's own walk over present 4 KiB pages costs far more than that look,
// and delayed the poll that would see the message by that walk at every receive of a warm
// output (docs/benchmarks.md). Contents never change. A hint only: a kernel that does not know the request, or
// refuses it, leaves the copy to fault.
class OutputPrefault {
 public:
  // Nothing to do below kHugePageHintBytes (where the output is advised for huge pages).
  OutputPrefault(void* data, size_t bytes);
  // Faults in the next huge page of the range (the first and last: the 4 KiB pages up to a
  // huge page's boundary); false, doing nothing, once the range is done or the kernel refused.
  bool Step();

 private:
  uintptr_t next_ = 0;
  uintptr_t end_ = 0;
};

// Bytes that OutputPrefault faulted in in this process, and bytes it found in memory
// already and left alone (a warm output): for tests.
uint64_t PrefaultedBytes();
uint64_t PrefaultPresentBytes();
// Turns OutputPrefault off or back on for the outputs of later precvs (on by default): a
// benchmark's A/B of both ways in one process.
void SetOutputPrefault(bool on);

}  // namespace jcm
