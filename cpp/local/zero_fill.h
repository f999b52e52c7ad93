// ZeroFill: the zeros of a precv on a device that is no destination (like ppermute's).
//
// glibc before 2.40 writes memset's bytes through the cache at every size. A buffer larger
// than this core's share of the last-level cache then costs a read of every line before
// its write, and evicts what the peer's copy is using, where streaming (non-temporal) stores
// write it without reading it first (benchmarks/results/ has the measured difference).
// ZeroFill streams such buffers (x86-64) and leaves the rest to memset.
#pragma once

#include <cstddef>

namespace jcm {

void ZeroFill(void* data, size_t bytes);

// The size from which ZeroFill streams (0: never, on this platform).
size_t StreamingZeroFillMinBytes();

}  // namespace jcm
