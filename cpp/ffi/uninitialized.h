// XLA FFI handler of a buffer that no one reads before writing it: a pipeline's slots of
// kept residuals (python/jax_cpu_mpi/_src/ops/uninitialized.py). XLA has no value without
// contents; zeros, its only way to make one, cost a write of every byte, and a first touch
// of every page, at every run, for slots that the schedule writes before it reads them (and
// some devices never use).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmUninitialized);
