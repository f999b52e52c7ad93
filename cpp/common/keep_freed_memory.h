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

namespace jcm {

// Applies the settings (mallopt M_MMAP_MAX 0 and M_TRIM_THRESHOLD at its maximum); false
// where the C library is not glibc, or it refused one of them.
bool KeepFreedMemory();

}  // namespace jcm
