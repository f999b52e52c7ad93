#include "common/keep_freed_memory.h"

#include <climits>  // first: a C library header defines __GLIBC__ where it is glibc

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace jcm {

bool KeepFreedMemory() {
#if defined(__GLIBC__)
  // No new mmapped blocks: large blocks come from the heap (a thread's arena falls back to
  // an mmap only for a block larger than its 64 MiB heap). mallopt's M_MMAP_THRESHOLD
  // cannot say that: glibc caps it at 32 MiB.
  const bool no_mmap = mallopt(M_MMAP_MAX, 0) == 1;
  // The heap's free top is never given back (INT_MAX: mallopt takes an int).
  const bool no_trim = mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  return no_mmap && no_trim;
#else
  return false;
#endif
}

}  // namespace jcm
