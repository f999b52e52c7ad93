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
#pragma once

#include <cstddef>

namespace jcm {

void ZeroFill(void* data, size_t bytes);

// The size from which ZeroFill streams (0: never, on this platform).
size_t StreamingZeroFillMinBytes();

}  // namespace jcm
