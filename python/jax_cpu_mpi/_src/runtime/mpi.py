"""MPI for cross-process psend/precv: our own communicator, attached once per job.

Under an MPI launcher, MPI is attached when ``jax.distributed.initialize()`` returns (or
when jax_cpu_mpi is imported, if JAX's distributed runtime is up already): then every
process of the job is there. Elsewhere it is attached at the first lowering of a program
whose mesh spans processes. The attach, collective over every rank,

1. imports ``mpi4py.MPI`` (which calls ``MPI_Init_thread``, asking for
   ``MPI_THREAD_MULTIPLE``: several device threads of a process may communicate at once),
2. checks that the MPI job and the JAX job agree (same number of processes),
3. gathers the JAX process index of every rank, and
4. hands ``MPI_COMM_WORLD`` to the extension, which duplicates it: our traffic never shares
   a communicator with the user's.

Not at the first lowering under a launcher: a mesh may hold only some of the processes
(JAX's two-device psend/precv test under ``mpirun -n 4``), and the processes outside it
need not lower its program: they would never join the attach.

At interpreter exit, before mpi4py finalizes MPI, outstanding sends are completed and every
rank meets the others in a polled barrier (up to ``JAX_CPU_MPI_EXIT_TIMEOUT`` seconds), then
our communicator is freed. Once attached, an uncaught exception aborts the whole job
(``JAX_CPU_MPI_ABORT_ON_ERROR``) rather than leaving the other ranks waiting for this one.
If a peer failed to answer (a precv timed out, an MPI call failed) and misses the exit
barrier, however the program exits, the whole launch is aborted with the status the program
asked for (never 0), or with ``JAX_CPU_MPI_ABORT_ON_ERROR=0`` this process alone ends just
before ``MPI_Finalize``, without JAX's distributed shutdown (:func:`_leave_broken_job`).
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import sys
import threading
import time

import jax

from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.runtime import abi as mpi_abi
from jax_cpu_mpi._src.runtime import config

_lock = threading.Lock()

_LAUNCH_HINT = (
    "Launch one process per host/rank with MPI, e.g. `mpirun -n 2 python train.py` (or "
    "`srun`), and call `jax.distributed.initialize(cluster_detection_method='mpi4py')` (or the "
    "Open MPI / Slurm auto-detection) before building the mesh."
)


class MpiSetupError(RuntimeError):
    """MPI cannot serve a program whose mesh spans processes."""


class MpiSetupWarning(UserWarning):
    """The launch looks wrong: e.g. ``mpirun`` started several ranks but JAX runs alone in
    each (``jax.distributed.initialize()`` forgotten)."""


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


#: Variables an MPI launcher (MPICH's Hydra, Open MPI, srun with PMI) gives its ranks.
MPI_LAUNCH_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


def launched_by_mpi() -> bool:
    """Whether an MPI launcher started this process (its variables, no MPI call)."""
    return any(v in os.environ for v in MPI_LAUNCH_VARIABLES)


def ensure_attached(op_name: str, num_processes_in_mesh: int) -> None:
    """Attach MPI to the extension if it is not attached yet.

    Under an MPI launcher it is attached already, by :func:`attach_at_initialize` when
    ``jax.distributed.initialize()`` returned. Otherwise (a launcher not recognised, or JAX
    initialized in a way that skipped the hook) it is attached here, at the first lowering
    of a program whose mesh spans processes: collective over every rank, so every process
    must lower such a program."""
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
            launched = launched_by_mpi()
            # srun without a PMI plugin (--mpi=none, or Slurm's MpiDefault=none) starts
            # every task, but tells their MPI nothing: each one is a singleton.
            under_srun = "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ
            if world.Get_size() == 1 and not launched and under_srun:
                how = (
                    "srun started this process without a PMI for MPI (--mpi="
                    f"{os.environ.get('SLURM_MPI_TYPE', 'none')}: MPI sees a singleton). "
                    "Launch with `srun --mpi=pmi2` for the mpich wheel's MPI (a site MPI: "
                    "the --mpi plugin it was built for, e.g. --mpi=pmix; `srun --mpi=list` "
                    "shows those Slurm has)"
                )
            elif world.Get_size() == 1 and not launched:
                how = "this process was not started by mpirun/srun (MPI sees a singleton)"
            else:
                how = f"the MPI job has {world.Get_size()} ranks"
            raise MpiSetupError(
                f"{op_name}: the mesh spans processes of a JAX job with {jax_processes} "
                f"processes, but {how}. jax_cpu_mpi moves bytes between processes with MPI, "
                f"so every JAX process must be one rank of the same MPI job. {_LAUNCH_HINT}"
            )
        _attach(op_name, MPI, jax.process_index(), jax_processes, jax.local_device_count())


def _attach(op_name: str, MPI, process_index: int, jax_processes: int,
            local_devices: int) -> None:
    """The attach proper: collective over every rank of ``MPI_COMM_WORLD`` (an allgather,
    the communicators' duplications, the clock sync). Called with ``_lock`` held."""
    world = MPI.COMM_WORLD
    # Each rank's cores too: ranks bound to a core each still share the node's cores.
    gathered = world.allgather((process_index, socket.gethostname(),
                                sorted(os.sched_getaffinity(0))))
    process_and_host = [(process, host) for process, host, _ in gathered]
    process_of_rank = [process for process, _ in process_and_host]
    if sorted(process_of_rank) != list(range(jax_processes)):
        raise MpiSetupError(
            f"{op_name}: MPI ranks report JAX process indices {process_of_rank}; expected "
            f"each of 0..{jax_processes - 1} once. {_LAUNCH_HINT}"
        )
    rank_of_process = [0] * jax_processes
    for rank, process in enumerate(process_of_rank):
        rank_of_process[process] = rank
    config.apply()
    if config.BY_NAME["JAX_CPU_MPI_KEEP_FREED_MEMORY"].read():
        ext.keep_freed_memory()
    my_host = process_and_host[world.Get_rank()][1]
    ext.attach_mpi(world.py2f(), rank_of_process,
                   local_devices=local_devices,
                   node_ranks=sum(host == my_host for _, host in process_and_host),
                   wait=config.BY_NAME["JAX_CPU_MPI_WAIT"].read() or "auto",
                   node_cores=len(set().union(*(cores for _, host, cores in gathered
                                                if host == my_host))))
    ext.set_meeting_handoff(_PARK_MODES[config.BY_NAME["JAX_CPU_MPI_PARK"].read_or_default()])
    ext.set_rank_hosts([host for _, host in process_and_host])
    # A communicator of its own for the exit's "my programs are done" messages.
    global _exit_comm
    _exit_comm = world.Dup()
    # Registered after mpi4py's own finalization hook, so it runs before MPI_Finalize.
    atexit.register(_detach_at_exit)
    _close_at_distributed_shutdown()
    ext.register_exit_before_finalize()  # after mpi4py's, so it runs just before it
    _record_exit_status_requests()
    if config.current().abort_on_error:
        _abort_job_on_uncaught_exception(MPI)


#: JAX_CPU_MPI_PARK's values as the extension's meeting modes (set_meeting_handoff).
_PARK_MODES = {"off": 0, "auto": 1, "on": 2}



def attach_at_initialize() -> None:
    """Attach MPI right after ``jax.distributed.initialize()``, under an MPI launcher.

    The attach is collective over every rank. At the first lowering of a program that
    spans processes (where it was done before), only the processes of that program's mesh
    get there: a mesh on some of the processes (JAX's two-device psend/precv test under
    ``mpirun -n 4``) waited forever for ranks that never lower it. Here every process of
    the job is known to be present (JAX's initialization waits for all of them), and none
    is inside another collective of ours yet.

    Never raises: where the job is not one MPI job of JAX's processes, or anything fails,
    the first cross-process lowering attaches or raises the error that belongs to it."""
    if _detached or ext.mpi_attached() or not launched_by_mpi():
        return
    state = compat.distributed_state
    try:
        process_index, jax_processes = int(state.process_id), int(state.num_processes)
    except Exception:  # JAX's state moved (the exit_from_broken_job feature is off)
        return
    if jax_processes < 2:
        return
    try:
        config.apply()
        MPI = import_mpi4py()
    except Exception:  # bad settings, no or another MPI: said at the first lowering
        return
    if MPI.COMM_WORLD.Get_size() != jax_processes:
        return
    with _lock:
        if ext.mpi_attached():
            return
        try:
            _attach("jax.distributed.initialize()", MPI, process_index, jax_processes,
                    _local_cpu_devices())
        except Exception as e:
            import warnings

            warnings.warn(
                f"jax_cpu_mpi: attaching MPI after jax.distributed.initialize() failed "
                f"({type(e).__name__}: {e}); the first program whose mesh spans processes "
                "attaches it instead, and every process must then lower such a program.",
                MpiSetupWarning, stacklevel=3)


def _local_cpu_devices() -> int:
    """This process's CPU devices as JAX will create them, read from JAX's setting and
    XLA_FLAGS without creating the backend (``jax_num_cpu_devices`` may still be set after
    ``jax.distributed.initialize()``). Only the transport's choice to spin or sleep while
    waiting depends on it."""
    try:
        n = int(jax.config.jax_num_cpu_devices)
    except Exception:
        n = -1
    if n > 0:
        return n
    # The last occurrence counts, as in XLA's flag parsing (tools append to XLA_FLAGS).
    found = re.findall(r"--xla_force_host_platform_device_count=(\d+)",
                       os.environ.get("XLA_FLAGS", ""))
    return max(1, int(found[-1])) if found else 1


def install_attach_at_initialize() -> None:
    """Make ``jax.distributed.initialize()`` attach MPI when it returns
    (:func:`attach_at_initialize`), and attach now if JAX's distributed runtime is up
    already (``jax.distributed.initialize()`` ran before ``import jax_cpu_mpi``)."""
    import functools

    import jax.distributed

    def attaching_after(original):
        @functools.wraps(original)
        def initialize(*args, **kwargs):
            result = original(*args, **kwargs)
            attach_at_initialize()
            return result

        return initialize

    compat.wrap_once(jax.distributed, "initialize", "_jax_cpu_mpi_attaches_after",
                     attaching_after)
    if jax.distributed.is_initialized():
        attach_at_initialize()


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
        global _abort_attempted
        _abort_attempted = True
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = excepthook


def _detach_at_exit() -> None:
    global _detached
    if _detached:
        return
    _detached = True
    exit_timeout = config.current().exit_timeout
    _finish_programs_and_close()
    report = ext.detach_mpi(exit_timeout)
    if report:
        # One finding per unindented line, each followed by its indented items.
        for line in report.splitlines():
            print(line if line.startswith(" ") else f"jax_cpu_mpi: at exit, {line}",
                  file=sys.stderr)
    unreachable = ext.unreachable_peers()
    # A transport that abandoned receives MPI could not cancel (a peer stopped mid-message)
    # must not reach MPI_Finalize either, even if that peer came back for the barrier: MPI
    # may still complete those receives into buffers XLA has reused, or wait for them.
    if unreachable and (ext.job_broken() or not ext.exit_barrier_met()):
        _leave_broken_job(unreachable)


#: Whether _detach_at_exit ran (at jax.distributed.shutdown() or at exit: once).
_detached = False

#: A duplicate of MPI_COMM_WORLD made at attach, for the exit's "done" messages.
_exit_comm = None

#: How long a peer that failed to answer is waited for at exit (as the C++ drain does).
_SUSPECT_EXIT_WAIT_S = 2.0
#: How long the ops ended at exit get to return (a receive that had matched gets a second
#: to complete or be cancelled).
_CLOSE_WAIT_S = 3.0


def _unready(arrays: list) -> list:
    """The arrays of ``arrays`` whose computation has not finished (errors count as done)."""
    left = []
    for a in arrays:
        try:
            if not a.is_ready():
                left.append(a)
        except Exception:  # deleted, or failed: nothing to wait for
            pass
    return left


def _finish_programs_and_close() -> None:
    """Let the programs of every rank finish, then end every psend/precv still waiting.

    Why an op could still wait at exit: JAX dispatches a program asynchronously, so a
    program whose outputs nobody waited for (the program read only their ``.shape``) may
    not even have started when the interpreter exits. The exit barrier then met the other
    ranks, the transport was detached, the psend that ran afterwards failed silently, and
    its peer's precv waited its whole ``JAX_CPU_MPI_RECV_TIMEOUT`` in the interpreter's
    finalization (the CPU client joins its device threads there).

    So every rank, serving its peers all along, waits until the outputs of its live arrays
    are ready, then tells every other rank so (a message on a communicator of our own).
    Once it is done and has heard the same from every other rank, no peer will send for a
    program anyone kept: a psend/precv still running (of a program whose outputs were
    dropped) gets ``JAX_CPU_MPI_EXIT_GRACE`` seconds more, then every wait ends with an
    error (reported at exit, :func:`_report_failed_ops`). At most
    ``JAX_CPU_MPI_EXIT_TIMEOUT`` seconds in all, at most a few once a peer failed to answer.
    """
    cfg = config.current()
    start = time.monotonic()
    limit = cfg.exit_timeout
    if ext.unreachable_peers():
        limit = min(limit, _SUSPECT_EXIT_WAIT_S)
    comm = _exit_comm
    me = comm.Get_rank() if comm is not None else 0
    peers = [r for r in range(comm.Get_size()) if r != me] if comm is not None else []
    heard = {p: comm.irecv(source=p, tag=_DONE_TAG) for p in peers}
    told: list = []
    try:
        pending = _unready(list(jax.live_arrays()))
    except Exception:  # no backend left: nothing of ours can run
        pending = []
    all_done_at = None
    while True:
        pending = _unready(pending)
        if not pending and not told and comm is not None:
            told = [comm.isend(None, dest=p, tag=_DONE_TAG) for p in peers]
        for p in [p for p, req in heard.items() if req.Test()]:
            del heard[p]
        now = time.monotonic()
        if all_done_at is None and not pending and not heard:
            all_done_at = now
        if all_done_at is not None and (ext.mpi_ops_active() == 0
                                        or now - all_done_at >= cfg.exit_grace):
            break
        if now - start >= limit:
            break
        time.sleep(0.001 if now - start < 0.1 else 0.01)
    ext.close(_CLOSE_WAIT_S)
    if comm is not None and not heard and all(req.Test() for req in told):
        comm.Free()


#: The tag of the "my programs are done" message of the exit (on _exit_comm).
_DONE_TAG = 1


def _close_at_distributed_shutdown() -> None:
    """Make ``jax.distributed.shutdown()`` end our MPI traffic first, as the exit does:
    after it no rank runs programs across processes, and its barrier must not wait for a
    psend/precv still running."""
    import functools

    import jax.distributed

    def closing_first(original):
        @functools.wraps(original)
        def shutdown(*args, **kwargs):
            try:
                _detach_at_exit()
                # The process may go on with programs on its own devices: their waits
                # must not end at once as at exit.
                ext.reopen()
            except Exception as e:  # never keep JAX's shutdown from running
                print(f"jax_cpu_mpi: closing MPI before jax.distributed.shutdown() failed: "
                      f"{e}", file=sys.stderr)
            return original(*args, **kwargs)

        return shutdown

    compat.wrap_once(jax.distributed, "shutdown", "_jax_cpu_mpi_closes_first", closing_first)


def _report_failed_ops() -> None:
    """Say once, at exit, which psend/precv failed (refused for its size or dtype, timed
    out, ended at exit): JAX drops the error of an output nobody reads. The exit status
    stays the program's (on GPU the same program exits 0)."""
    try:
        where = f"process {jax.process_index()}" if _detached else "this process"
    except Exception:  # no backend left
        where = "this process"
    try:
        # Printed by the extension after the interpreter's finalization, not here: a
        # program whose outputs were dropped may run only when the CPU client joins its
        # device threads, after every atexit handler, and its ops must be in the report.
        sys.stderr.flush()
        ext.report_failed_ops_at_process_exit(where)
    except Exception:  # the extension is gone: nothing to say
        return


# Registered at import, before the exit handler that detaches MPI, so it runs after it
# (atexit runs handlers in reverse order) and sees the ops that the exit ended.
atexit.register(_report_failed_ops)


def _leave_broken_job(unreachable: list[int]) -> None:
    """End promptly a process whose job lost a peer: it did not answer, nor reach the exit
    barrier (whatever the way the program exits: ``sys.exit``, ``exit``, the end of main).

    By default (``JAX_CPU_MPI_ABORT_ON_ERROR=1``) the whole launch ends: ``MPI_Abort`` on
    ``MPI_COMM_WORLD``, with the status the program asked for (``sys.exit(n)``), or 1 if it
    asked for none or for 0: a broken job never ends with 0. Ending this process alone is
    not enough: under a launch across hosts, ``mpiexec`` waits minutes for the proxy of the
    unreachable host behind the dead link, and the unanswering rank may live on forever.

    With ``JAX_CPU_MPI_ABORT_ON_ERROR=0``, only this process ends, promptly. Two waits would
    otherwise hold it. MPI_Finalize: MPICH waits for every rank through the process manager,
    and UCX closes each endpoint with a flush that waits for the unreachable peer for
    minutes. And JAX's distributed shutdown: a barrier of every task in the coordination
    service, which ends only when the service declares the peer dead after
    ``heartbeat_timeout_seconds`` (100 s by default), and then aborts the process with
    SIGABRT. So JAX's distributed runtime is abandoned (its shutdown skipped) and the
    process ends, after the rest of the interpreter's exit (every other atexit handler, the
    flush of stdout/stderr), just before mpi4py would call MPI_Finalize, with the status the
    program asked for (``sys.exit(n)``, ``exit(n)``), or 1 if it asked for none.
    """
    global _abort_attempted
    hosts = ext.rank_hosts()
    peers = ", ".join(
        f"{r}" + (f" (host {hosts[r]})" if r < len(hosts) and hosts[r] else "")
        for r in unreachable)
    if config.current().abort_on_error and not _abort_attempted:
        status = _requested_exit_status or 1
        from mpi4py import MPI  # imported when MPI was attached

        print(f"jax_cpu_mpi: at exit, MPI rank(s) {peers} did not answer and did not reach "
              f"the exit barrier: aborting the whole MPI launch (MPI_Abort) with status "
              f"{status} so that it does not wait for the lost rank(s) "
              "(JAX_CPU_MPI_ABORT_ON_ERROR=0 ends only this process instead).",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        _abort_attempted = True
        MPI.COMM_WORLD.Abort(status)
        # MPI_Abort does not return; where it did (seen with MPICH over a dead link), this
        # process at least ends alone, below.
    status = 1 if _requested_exit_status is None else _requested_exit_status
    ext.arm_exit_before_finalize(status)
    abandoned = _abandon_jax_distributed_runtime()
    print(f"jax_cpu_mpi: at exit, MPI rank(s) {peers} did not answer and did not reach the "
          f"exit barrier: this process ends now with status {status}, without MPI_Finalize"
          + (" and without JAX's distributed shutdown" if abandoned else "")
          + " (both would wait for the unreachable peer; JAX_CPU_MPI_ABORT_ON_ERROR=1, the "
          "default, would abort the whole launch).", file=sys.stderr, flush=True)


#: Whether MPI_Abort was called already (by the excepthook): not twice.
_abort_attempted = False

#: The status the program asked for with ``sys.exit(n)`` (None: not asked).
_requested_exit_status: int | None = None


def _exit_status(code: object) -> int:
    """The process status Python gives ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # Python prints a non-integer code and exits with 1


def _record_exit_status_requests() -> None:
    """Wrap ``sys.exit`` (and ``exit``/``quit``) to remember the status asked for: Python
    does not tell its atexit handlers, and a process leaving a broken job must end itself
    (:func:`_leave_broken_job`) with the status the program chose."""
    import builtins
    import functools

    def recording(original):
        @functools.wraps(original)
        def exit_recording_status(code=None):
            global _requested_exit_status
            _requested_exit_status = _exit_status(code)
            return original(code)

        return exit_recording_status

    marker = "_jax_cpu_mpi_records_status"
    compat.wrap_once(sys, "exit", marker, recording)
    for name in ("exit", "quit"):  # site's Quitter objects, when present
        quitter = getattr(builtins, name, None)
        if quitter is not None and callable(quitter):
            compat.wrap_once(builtins, name, marker, recording)


def _abandon_jax_distributed_runtime() -> bool:
    """Make JAX's distributed shutdown at exit a no-op: its client, service and preemption
    manager are detached from JAX's state and deliberately kept alive until the process
    ends (their destructors would run the same shutdown barrier). Returns whether there
    was anything to abandon."""
    import ctypes

    if not compat.EXIT_FROM_BROKEN_JOB.active:
        return False
    state = compat.distributed_state
    names = ("preemption_sync_manager", "client", "service")
    try:
        held = [getattr(state, name) for name in names]
        if all(obj is None for obj in held):
            return False
        for obj in held:
            if obj is not None:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # never freed: no destructor
        for name in names:
            setattr(state, name, None)
    except Exception as e:  # a changed JAX internal: leave JAX's shutdown to JAX
        compat.failed_at_run_time("exit_from_broken_job", e)
        return False
    return True
