// ZeroFill: the zeros of a precv on a device that is no destination (like ppermute's).
//
// glibc before 2.40 writes memset's bytes through the cache at every size. A buffer larger
// than this core's share of the last-level cache then costs a read of every line before
// its write, and evicts what the peer's copy is using, where streaming (non-temporal) stores
// write it without reading it first (benchmarks/results/ has the measured difference).
// ZeroFill streams such buffers (x86-64) and leaves the rest to memset.
//
// A buffer of kFreshMapMinBytes or more (common/keep_freed_memory.h) may be a fresh map,
// which XLA allocates for a large output at every call: its pages read as zeros until
// touched, and writing them would fault each one in, have the kernel clear it, and write
// its bytes again. On Linux ZeroFill leaves such pages alone: where some of the buffer's
// pages are neither present nor swapped out (/proc/self/pagemap) and the buffer lies in
// private anonymous mappings (/proc/self/maps), it writes only the other pages. The output
// then holds zeros all the same, and stays unpopulated until something writes it.
//
// From ZeroFillDropMinBytes(), where the kernel has transparent huge pages, ZeroFill gives
// the whole huge pages of a buffer in private anonymous mappings back to the kernel instead
// of writing them (madvise MADV_DONTNEED): they read as zeros from then on. A precv that is
// no destination at every step of a loop (the first stage of a pipeline, one direction of a
// two-op exchange) then costs a system call, not a pass over its output; a later write of
// the range faults the pages back in, a huge page at a time, for about what writing the
// zeros would have cost. At the partial huge pages at both ends it writes the 4 KiB pages
// that are in memory and gives the others back too: writing a page that is not in memory
// (a fresh output's) would fault it in, 4 KiB at a time, and have the kernel clear it first.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jcm {

// From this size ZeroFill may give a buffer's whole huge pages back to the kernel: a range
// this large holds at least one whole 2 MiB page wherever it starts.
inline constexpr size_t kDropHugePagesMinBytes = size_t{4} << 20;

void ZeroFill(void* data, size_t bytes);

// The size from which ZeroFill gives whole huge pages back: kDropHugePagesMinBytes where the
// kernel answers PROCMAP_QUERY (Linux 6.11), kFreshMapMinBytes where /proc/self/maps must be
// read instead, 0 where there are no transparent huge pages or the process keeps its freed
// memory (KeepingFreedMemory: JAX_CPU_MPI_KEEP_FREED_MEMORY).
size_t ZeroFillDropMinBytes();

// Bytes that ZeroFill wrote, and bytes it gave back to the kernel instead, in this process:
// for tests and benchmarks.
uint64_t ZeroFillWrittenBytes();
uint64_t ZeroFillDroppedBytes();

// Benchmarks only: false has ZeroFill write the partial huge pages at both ends of a buffer
// from ZeroFillDropMinBytes() whole, in memory or not (as before it gave back the 4 KiB
// pages there that are not in memory); true is the default.
void SetZeroFillEndsByPage(bool on);

// The size from which ZeroFill streams (0: never, on this platform).
size_t StreamingZeroFillMinBytes();

}  // namespace jcm
