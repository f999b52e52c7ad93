"""MPI for cross-process psend/precv: our own communicator, attached on first need.

MPI is touched only when a program whose mesh spans processes is lowered. Then, on every
process (the same SPMD program is lowered everywhere), this module

1. imports ``mpi4py.MPI`` (which calls ``MPI_Init_thread``, asking for
   ``MPI_THREAD_MULTIPLE``: several device threads of a process may communicate at once),
2. checks that the MPI job and the JAX job agree (same number of processes),
3. gathers ``jax.process_index()`` of every rank, and
4. hands ``MPI_COMM_WORLD`` to the extension, which duplicates it: our traffic never shares
   a communicator with the user's.

At interpreter exit, before mpi4py finalizes MPI, outstanding sends are completed and every
rank meets the others in a polled barrier (up to ``JAX_CPU_MPI_EXIT_TIMEOUT`` seconds), then
our communicator is freed. Once attached, an uncaught exception aborts the whole job
(``JAX_CPU_MPI_ABORT_ON_ERROR``) rather than leaving the other ranks waiting for this one.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

import jax

from . import _jax_cpu_mpi as ext
from . import config, mpi_abi

_lock = threading.Lock()

_LAUNCH_HINT = (
    "Launch one process per host/rank with MPI, e.g. `mpirun -n 2 python train.py` (or "
    "`srun`), and call `jax.distributed.initialize(cluster_detection_method='mpi4py')` (or the "
    "Open MPI / Slurm auto-detection) before building the mesh."
)


class MpiSetupError(RuntimeError):
    """MPI cannot serve a program whose mesh spans processes."""


def import_mpi4py():  # -> module mpi4py.MPI
    """``mpi4py.MPI`` (importing it initializes MPI, with every thread allowed to call it),
    checked to be the MPI of our extension. Raises
    :class:`~jax_cpu_mpi.mpi_abi.MpiMismatchError` if it is not."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        # Before mpi4py initializes an MPI of the wrong ABI, when it can tell.
        mpi_abi.check_before_mpi4py_import()
        # Device threads of one process may call MPI concurrently.
        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    mpi_abi.check_mpi4py(MPI)
    return MPI


def ensure_attached(op_name: str, num_processes_in_mesh: int) -> None:
    """Attach MPI to the extension if it is not attached yet (collective over all ranks)."""
    if ext.mpi_attached():
        return
    with _lock:
        if ext.mpi_attached():
            return
        jax_processes = jax.process_count()
        if jax_processes < 2:
            raise MpiSetupError(
                f"{op_name}: the mesh spans {num_processes_in_mesh} processes but JAX sees a "
                f"single process. {_LAUNCH_HINT}"
            )
        try:
            MPI = import_mpi4py()
        except ImportError as e:  # pragma: no cover - mpi4py is a dependency
            raise MpiSetupError(f"{op_name}: cannot import mpi4py ({e}). {_LAUNCH_HINT}") from e
        except mpi_abi.MpiMismatchError as e:
            raise MpiSetupError(f"{op_name}: {e}") from e
        world = MPI.COMM_WORLD
        if world.Get_size() != jax_processes:
            launched = "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ
            how = (
                "this process was not started by mpirun/srun (MPI sees a singleton)"
                if world.Get_size() == 1 and not launched
                else f"the MPI job has {world.Get_size()} ranks"
            )
            raise MpiSetupError(
                f"{op_name}: the mesh spans processes of a JAX job with {jax_processes} "
                f"processes, but {how}. jax_cpu_mpi moves bytes between processes with MPI, "
                f"so every JAX process must be one rank of the same MPI job. {_LAUNCH_HINT}"
            )
        process_of_rank = world.allgather(jax.process_index())
        if sorted(process_of_rank) != list(range(jax_processes)):
            raise MpiSetupError(
                f"{op_name}: MPI ranks report JAX process indices {process_of_rank}; expected "
                f"each of 0..{jax_processes - 1} once. {_LAUNCH_HINT}"
            )
        rank_of_process = [0] * jax_processes
        for rank, process in enumerate(process_of_rank):
            rank_of_process[process] = rank
        config.apply()
        ext.attach_mpi(world.py2f(), rank_of_process)
        # Registered after mpi4py's own finalization hook, so it runs before MPI_Finalize.
        atexit.register(_detach_at_exit)
        if config.current().abort_on_error:
            _abort_job_on_uncaught_exception(MPI)


def _abort_job_on_uncaught_exception(MPI) -> None:
    """Make an uncaught exception end the whole MPI job, as ``python -m mpi4py`` does.

    Otherwise the failing rank reaches ``MPI_Finalize`` at exit and waits there for ranks
    that wait for it (in a precv, a collective, or their own finalize): the job hangs.
    """
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb) -> None:
        previous(exc_type, exc, tb)
        print(
            f"jax_cpu_mpi: uncaught {exc_type.__name__} on MPI rank "
            f"{MPI.COMM_WORLD.Get_rank()}: aborting the MPI job (MPI_Abort) so that the other "
            "ranks do not wait for this one forever (JAX_CPU_MPI_ABORT_ON_ERROR=0 disables "
            "this).",
            file=sys.stderr,
            flush=True,
        )
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = excepthook


def _detach_at_exit() -> None:
    report = ext.detach_mpi(config.current().exit_timeout)
    if report:
        print(
            f"jax_cpu_mpi: at exit, {report} within JAX_CPU_MPI_EXIT_TIMEOUT="
            f"{config.current().exit_timeout} s.",
            file=sys.stderr,
        )
