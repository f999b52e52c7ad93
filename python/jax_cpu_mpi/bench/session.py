"""The processes and devices a benchmark run measures.

Under ``mpirun -n 2`` (or ``srun``) every rank starts JAX's distributed runtime from MPI and
keeps ``MPI.COMM_WORLD`` to keep ranks in step. The cross-process methods run on the first
device of process 0 and the first device of process 1 (:attr:`Session.pair`); the in-process
methods run on the first two devices of rank 0 (:attr:`Session.local_pair`) while the other
ranks wait without spinning, so they do not steal a core from the measurement.
"""

from __future__ import annotations

import os
import platform as _platform
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

#: Environment variables that MPI launchers (MPICH/Hydra, Open MPI, PMIx, Slurm) set.
_LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


class BenchSetupError(RuntimeError):
    """The run cannot measure what was asked (e.g. ``--platform gpu`` with one GPU)."""


def launched_by_mpi() -> bool:
    """Whether this process is one rank of an MPI job (mpirun/mpiexec/srun)."""
    if any(v in os.environ for v in _LAUNCHER_VARIABLES):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


@dataclass
class Session:
    """Ranks, communicator and devices of one benchmark run."""

    platform: str
    rank: int = 0
    nranks: int = 1
    comm: Any = None  # mpi4py.MPI.Comm when launched by MPI
    pair_comm: Any = None  # ranks 0 and 1 only, for the raw-MPI and mpi4jax methods
    pair: tuple[Any, Any] | None = None  # one device in each of processes 0 and 1
    local_pair: tuple[Any, Any] | None = None  # two devices of rank 0
    notes: list[str] = field(default_factory=list)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def barrier(self, sleep: bool = False) -> None:
        """All ranks meet. Spins (right before a measurement), or sleeps while waiting
        (``sleep=True``: ranks left out of a measurement must not steal a core)."""
        if self.comm is None:
            return
        request = self.comm.Ibarrier()
        if sleep:
            while not request.Test():
                time.sleep(0.002)
        else:
            request.Wait()

    def idle_barrier(self) -> None:
        """All ranks meet, sleeping while waiting."""
        self.barrier(sleep=True)

    def allreduce_sum(self, value: int) -> int:
        if self.comm is None:
            return int(value)
        return int(self.comm.allreduce(int(value)))

    def bcast(self, value: Any) -> Any:
        return value if self.comm is None else self.comm.bcast(value, root=0)

    def describe(self) -> dict[str, Any]:
        """The environment, for the JSON header."""
        import jaxlib

        info: dict[str, Any] = dict(
            host=socket.gethostname(),
            machine=_platform.machine(),
            cpus=os.cpu_count(),
            python=sys.version.split()[0],
            jax=jax.__version__,
            jaxlib=jaxlib.__version__,
            numpy=np.__version__,
            platform=self.platform,
            ranks=self.nranks,
            pair=[str(d) for d in self.pair] if self.pair else None,
            local_pair=[str(d) for d in self.local_pair] if self.local_pair else None,
        )
        info.update(_package_build())
        if self.comm is not None:
            from mpi4py import MPI

            info["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
            info["mpi4py"] = sys.modules["mpi4py"].__version__
            hosts = self.comm.allgather(socket.gethostname())
            info["hosts"] = sorted(set(hosts))
        return info


def _package_build() -> dict[str, Any]:
    """Which jax_cpu_mpi was measured: version, extension build time, git commit, and the
    settings and features that change timings (fast dispatch, kept operands...)."""
    import dataclasses
    import datetime
    import subprocess

    from jax_cpu_mpi import _jax_cpu_mpi as ext
    from jax_cpu_mpi._src import __version__, compat
    from jax_cpu_mpi._src.runtime import config

    info: dict[str, Any] = dict(jax_cpu_mpi=__version__)
    info["config"] = dataclasses.asdict(config.current())
    info["features_not_active"] = sorted(
        f["feature"] for f in compat.report() if f["state"] not in ("active", "not needed"))
    # Zero-fills of this size and more use streaming stores (from the machine's cache size).
    info["streaming_zero_fill_min_bytes"] = ext.streaming_zero_fill_min_bytes()
    # And from this size their whole huge pages are given back instead (0: never; larger
    # where the kernel has no PROCMAP_QUERY): the two-op and pipeline timings depend on it.
    info["zero_fill_drop_min_bytes"] = ext.zero_fill_drop_min_bytes()
    try:
        built = os.path.getmtime(ext.__file__)
        info["extension_built"] = datetime.datetime.fromtimestamp(built).isoformat(
            timespec="seconds")
    except (OSError, AttributeError):
        pass
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5, cwd=os.path.dirname(__file__))
        if head.returncode == 0:
            info["git_commit"] = head.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def _first_device_of_each_process(devices: list[Any]) -> tuple[Any, Any]:
    by_process: dict[int, Any] = {}
    for d in sorted(devices, key=lambda d: d.id):
        by_process.setdefault(d.process_index, d)
    return by_process[0], by_process[1]


def start(platform: str, local_devices: int) -> Session:
    """Start JAX (and MPI when launched by an MPI launcher); pick the devices under test."""
    distributed = launched_by_mpi()
    if platform == "cpu":
        jax.config.update("jax_num_cpu_devices", local_devices)
    session = Session(platform=platform)
    if distributed and platform == "cpu":
        # The gloo methods need JAX's CPU collectives across processes.
        implementation = jax.config.jax_cpu_collectives_implementation
        if implementation != "gloo":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            session.notes.append(
                f"jax_cpu_collectives_implementation was {implementation!r}; set to 'gloo'")
    if distributed:
        # A held port, not JAX's hash(hostname) % 4096 one that concurrent jobs may share.
        from jax_cpu_mpi._src.runtime.launchers import initialize_over_mpi4py

        initialize_over_mpi4py()
    if distributed:
        from mpi4py import MPI

        session.comm = MPI.COMM_WORLD
        session.rank = session.comm.Get_rank()
        session.nranks = session.comm.Get_size()
        if session.nranks >= 2:
            color = 0 if session.rank < 2 else MPI.UNDEFINED
            session.pair_comm = session.comm.Split(color, session.rank)
    if platform == "gpu":
        _pick_gpus(session)
    else:
        _pick_cpus(session)
        if jax.process_count() >= 2:
            # Collective over all ranks: done here by every rank, not at the first lowering
            # (which only ranks 0 and 1 reach when there are more ranks).
            from jax_cpu_mpi._src.runtime import mpi as mpi_runtime

            mpi_runtime.ensure_attached("jax_cpu_mpi.bench", jax.process_count())
    return session


def _pick_cpus(session: Session) -> None:
    devices = jax.devices("cpu")
    if jax.process_count() >= 2:
        session.pair = _first_device_of_each_process(devices)
        if jax.process_count() > 2:
            session.notes.append(
                f"{jax.process_count()} processes: the MPI methods use processes 0 and 1 only")
    else:
        session.notes.append(
            "MPI methods skipped: this is a single process. Launch with "
            "`mpirun -n 2 python -m jax_cpu_mpi.bench` to measure them.")
    local = sorted(jax.local_devices(backend="cpu"), key=lambda d: d.id)
    if len(local) >= 2:
        session.local_pair = (local[0], local[1])
    else:
        session.notes.append(
            "in-process methods skipped: this process has 1 CPU device (use --local-devices 2)")


def _pick_gpus(session: Session) -> None:
    try:
        devices = jax.devices("gpu")
    except RuntimeError as e:
        raise BenchSetupError(
            f"--platform gpu: JAX finds no GPU backend ({e}). Install jax[cuda12] (or the "
            "ROCm build) and run on a machine with two or more GPUs, or use --platform cpu."
        ) from None
    if jax.process_count() >= 2:
        session.pair = _first_device_of_each_process(devices)
        return
    local = sorted(devices, key=lambda d: d.id)
    if len(local) < 2:
        raise BenchSetupError(
            f"--platform gpu needs two GPUs (psend/precv between them over NCCL) but this "
            f"process sees {len(local)}: {local}. Run on a machine with two or more GPUs, or "
            "launch one process per GPU with `mpirun -n 2` on two GPU hosts."
        )
    session.pair = (local[0], local[1])
