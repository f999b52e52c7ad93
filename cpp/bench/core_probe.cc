#include "bench/core_probe.h"

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace jcm {
namespace {

bool PinTo(int cpu) {
  if (cpu < 0 || cpu >= CPU_SETSIZE) return false;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

}  // namespace

double CoreToCoreRoundTripNs(int cpu_a, int cpu_b, int iterations) {
  if (iterations <= 0 || cpu_a == cpu_b) return -1;
  // 0: the pinger's turn to write 1; 1: the ponger's turn to write 0; -1: done.
  alignas(64) std::atomic<int> flag{0};
  std::atomic<bool> pinned_b{false}, ready_b{false};
  std::thread ponger([&] {
    pinned_b = PinTo(cpu_b);
    ready_b = true;
    if (!pinned_b) return;
    while (true) {
      int seen;
      while ((seen = flag.load(std::memory_order_acquire)) != 1) {
        if (seen < 0) return;
      }
      flag.store(0, std::memory_order_release);
    }
  });
  cpu_set_t before;
  const bool saved = pthread_getaffinity_np(pthread_self(), sizeof(before), &before) == 0;
  const bool pinned_a = PinTo(cpu_a);
  while (!ready_b.load()) std::this_thread::yield();
  double ns = -1;
  if (pinned_a && pinned_b) {
    // At most about 50 ms: a CPU taken by another thread makes every round trip a
    // time slice; then the mean of the round trips done so far.
    const auto start = std::chrono::steady_clock::now();
    const auto stop = start + std::chrono::milliseconds(50);
    int done = 0;
    while (done < iterations) {
      if ((done & 63) == 0 && std::chrono::steady_clock::now() > stop) break;
      flag.store(1, std::memory_order_release);
      while (flag.load(std::memory_order_acquire) != 0) {
      }
      ++done;
    }
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    if (done > 0) ns = took.count() / done;
  }
  flag.store(-1, std::memory_order_release);  // the ponger stops waiting
  ponger.join();
  if (saved) pthread_setaffinity_np(pthread_self(), sizeof(before), &before);
  return ns;
}

}  // namespace jcm
