// Ending the process before MPI_Finalize in a job that a peer can no longer answer.
#pragma once

namespace jcm {

// Registers (once) a low-level exit function of the interpreter (Py_AtExit). Those run
// last to first, after every Python atexit handler and the interpreter's teardown; one
// registered after mpi4py's runs just before mpi4py calls MPI_Finalize. Until
// ArmExitBeforeFinalize is called it does nothing.
void RegisterExitBeforeFinalize();

// Makes that function end the process with `status` (_exit, stdio already flushed by the
// interpreter) instead of letting MPI_Finalize run: in a job with an unreachable peer,
// MPI_Finalize waits for the network (UCX closes its endpoints with a flush) for minutes.
void ArmExitBeforeFinalize(int status);

}  // namespace jcm
