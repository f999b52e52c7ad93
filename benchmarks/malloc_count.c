// An LD_PRELOAD counter of heap allocations (malloc, calloc, realloc, the aligned ones; C++'s
// operator new comes through malloc), per process and per thread, for
// benchmarks/alloc_counts.py: how many a psend and a precv make per message.
//
//   cc -O2 -shared -fPIC -o /tmp/malloc_count.so benchmarks/malloc_count.c
//   LD_PRELOAD=/tmp/malloc_count.so python benchmarks/alloc_counts.py ...
//
// Read through ctypes: jcm_malloc_count() (the process) and jcm_thread_malloc_count()
// (the calling thread). Forwards to glibc's own entry points (__libc_malloc...), so no
// dlsym, which may allocate itself.
#include <stddef.h>
#include <stdint.h>

extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);

static uint64_t total;
static __thread uint64_t mine;

static inline void count(void) {
  __atomic_fetch_add(&total, 1, __ATOMIC_RELAXED);
  ++mine;
}

uint64_t jcm_malloc_count(void) { return __atomic_load_n(&total, __ATOMIC_RELAXED); }
uint64_t jcm_thread_malloc_count(void) { return mine; }

void* malloc(size_t n) {
  count();
  return __libc_malloc(n);
}
void* calloc(size_t a, size_t b) {
  count();
  return __libc_calloc(a, b);
}
void* realloc(void* p, size_t n) {
  count();
  return __libc_realloc(p, n);
}
void* memalign(size_t align, size_t n) {
  count();
  return __libc_memalign(align, n);
}
void* aligned_alloc(size_t align, size_t n) {
  count();
  return __libc_memalign(align, n);
}
int posix_memalign(void** out, size_t align, size_t n) {
  count();
  void* p = __libc_memalign(align, n);
  if (!p) return 12;  // ENOMEM
  *out = p;
  return 0;
}
