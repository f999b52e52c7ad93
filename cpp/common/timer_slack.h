// The precision of a polling loop's short sleeps. Linux lets a sleep of a normal thread
// end up to its timer slack late, 50 us by default: a sleep_for of 5 us then lasts 55-75 us,
// and every wait that reaches its sleeping phase (JAX_CPU_MPI_WAIT=sleep, or an
// oversubscribed node, where it comes after a few hundred polls) pays that once per wait.
// While a FineTimerSlack is enabled its thread's slack is kSlackNs; it restores the
// thread's own slack when it goes (the thread is usually XLA's device thread, not ours).
#pragma once

#if defined(__linux__)
#include <sys/prctl.h>
#endif

namespace jcm {

class FineTimerSlack {
 public:
  FineTimerSlack() = default;
  ~FineTimerSlack() {
#if defined(__linux__)
    if (saved_ > 0) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(saved_), 0, 0, 0);
#endif
  }
  FineTimerSlack(const FineTimerSlack&) = delete;
  FineTimerSlack& operator=(const FineTimerSlack&) = delete;

  // Called before each sleep: one prctl pair per wait that sleeps at all.
  void Enable() {
#if defined(__linux__)
    if (saved_ != 0) return;
    const int current = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    saved_ = current > 0 ? current : -1;  // -1: unknown, leave it
    if (current > kSlackNs) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(kSlackNs), 0, 0, 0);
    else saved_ = -1;  // already as fine: nothing to restore
#endif
  }

 private:
  static constexpr int kSlackNs = 1000;
  int saved_ = 0;  // 0: not enabled yet; > 0: the slack to restore; -1: nothing to restore
};

}  // namespace jcm
