// Python.h first, as Python asks of every file that includes it.
#include <Python.h>

#include "mpi/exit_before_finalize.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>

namespace jcm {
namespace {

std::atomic<int> exit_status{-1};  // -1: disarmed

void ExitBeforeFinalize() {
  const int status = exit_status.load();
  if (status < 0) return;
  std::fflush(nullptr);
  _exit(status);
}

}  // namespace

void RegisterExitBeforeFinalize() {
  static const bool registered = Py_AtExit(ExitBeforeFinalize) == 0;
  (void)registered;
}

void ArmExitBeforeFinalize(int status) { exit_status.store(status < 0 ? 1 : status & 0xff); }

}  // namespace jcm
