// XLA FFI handler of a buffer that no one reads before writing it: a pipeline's slots of
// kept residuals (python/jax_cpu_mpi/_src/ops/uninitialized.py). XLA has no value without
// contents; zeros, its only way to make one, cost a write of every byte, and a first touch
// of every page, at every run, for slots that the schedule writes before it reads them (and
// some devices never use).
#pragma once

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JcmUninitialized);

namespace jcm {

// Poison mode (JAX_CPU_MPI_POISON_UNINITIALIZED): the handler fills its buffer with a value
// no computation would leave there, NaN in floats, so that a read before a write shows in
// results instead of reading the zeros a fresh page happens to hold. Read at each call,
// so it applies to programs compiled before it was set.
void SetPoisonUninitialized(bool on);
bool PoisonUninitialized();

// Poison mode's fill of `out` (the value above, for its element type). Also what a precv
// that is no destination writes in poison mode where the program selects its zeros
// (zero_fill = 0, passes/selected_zeros.py), whose output is otherwise left unwritten: a
// read without the select then shows, where the buffer would often hold the zeros of an
// earlier fill.
void Poison(const xla::ffi::AnyBuffer& out);

}  // namespace jcm
