"""Which launcher started this process, and how to start JAX's distributed runtime under it.

jax_cpu_mpi needs one thing of a multi-process job: every JAX process is one rank of one
MPI job. Any of JAX's ways to start the distributed runtime gives that, as long as the
processes were started by ``mpirun``/``mpiexec`` or ``srun``:

=====================  ===================================================================
launcher               ``jax.distributed.initialize(...)``
=====================  ===================================================================
MPICH ``mpirun``       no arguments, after ``import jax_cpu_mpi``: our cluster environment
(Hydra)                (:mod:`jax_cpu_mpi.cluster`) reads ``PMI_RANK``/``PMI_SIZE``
Open MPI 5 (PRRTE)     no arguments, after ``import jax_cpu_mpi``: ours reads ``PMIX_RANK``,
                       ``OMPI_COMM_WORLD_RANK``/``SIZE``
Slurm (``srun``)       no arguments: JAX reads ``SLURM_PROCID``/``SLURM_NTASKS``...
Open MPI 4 (ORTE)      no arguments: JAX reads ``OMPI_MCA_orte_hnp_uri``/``OMPI_COMM_WORLD_*``
any MPI (``mpirun``)   ``cluster_detection_method="mpi4py"``: process index = MPI rank
=====================  ===================================================================

The JAX process index need not equal the MPI rank: when MPI is attached, each rank tells
the others its ``jax.process_index()`` and messages are routed by that map.

:func:`initialize_distributed` makes that choice for a program (and for
``python -m jax_cpu_mpi info``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

from . import cluster, mpi_runtime

#: (rank variable, size variable) of MPI launchers, most specific first.
_MPI_RANK_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ("PMI_RANK", "PMI_SIZE"),  # MPICH/Hydra, Intel MPI, srun --mpi=pmi2
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),  # MVAPICH
    ("PMIX_RANK", None),  # PMIx (srun --mpi=pmix, prterun)
)
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")
_ORTE_URI = "OMPI_MCA_orte_hnp_uri"


@dataclass(frozen=True)
class Launch:
    """What the environment says about how this process was started."""

    #: ``"slurm"``, ``"openmpi"``, ``"mpi"`` (another MPI launcher) or ``"none"``.
    launcher: str
    #: The MPI rank and job size from the launcher's variables (``None`` if not given).
    mpi_rank: int | None
    mpi_size: int | None
    #: Slurm's task index and count (``None`` outside ``srun``).
    slurm_procid: int | None
    slurm_ntasks: int | None
    #: ``OMPI_MCA_orte_hnp_uri`` is set (Open MPI 4 and older): JAX detects it.
    orte: bool

    @property
    def multi_process(self) -> bool:
        sizes = [s for s in (self.mpi_size, self.slurm_ntasks) if s is not None]
        return any(s > 1 for s in sizes)

    @property
    def slurm_consistent(self) -> bool:
        """Slurm's task index is this process's MPI rank (or MPI does not say).

        ``mpirun`` inside an ``sbatch`` script leaves the batch step's ``SLURM_PROCID`` in
        every rank's environment: then JAX's Slurm detection would be wrong.
        """
        return self.slurm_procid is not None and (
            self.mpi_rank is None or self.mpi_rank == self.slurm_procid)

    def jax_method(self) -> str:
        """How :func:`initialize_distributed` starts JAX here: ``"slurm"`` / ``"ompi"``
        (JAX's auto-detection), ``"mpirun"`` (our cluster environment, also found by a plain
        ``jax.distributed.initialize()``), ``"mpi4py"``, or ``"none"`` (a single process)."""
        if not self.multi_process:
            return "none"
        if self.slurm_consistent and (self.slurm_ntasks or 0) > 1:
            return "slurm"
        if self.orte:
            return "ompi"
        if cluster.registered() and cluster.launcher() is not None:
            return "mpirun"
        return "mpi4py"


def _int_env(name: str | None) -> int | None:
    value = os.environ.get(name) if name else None
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def detect() -> Launch:
    """Read the launcher's environment variables (nothing is initialized)."""
    mpi_rank = mpi_size = None
    launcher = "none"
    for rank_var, size_var in _MPI_RANK_VARS:
        if _int_env(rank_var) is not None:
            mpi_rank, mpi_size = _int_env(rank_var), _int_env(size_var)
            launcher = "openmpi" if rank_var.startswith("OMPI_") else "mpi"
            break
    slurm = all(v in os.environ for v in _SLURM_VARS)
    if slurm and (launcher == "none" or mpi_rank == _int_env("SLURM_PROCID")):
        launcher = "slurm"
    return Launch(
        launcher=launcher,
        mpi_rank=mpi_rank,
        mpi_size=mpi_size,
        slurm_procid=_int_env("SLURM_PROCID") if slurm else None,
        slurm_ntasks=_int_env("SLURM_NTASKS") if slurm else None,
        orte=_ORTE_URI in os.environ,
    )


def initialize_distributed(**kwargs) -> str:
    """Start ``jax.distributed`` the way the launcher of this process calls for.

    Does nothing for a single process or when JAX's distributed runtime is already up.
    ``kwargs`` go to ``jax.distributed.initialize`` (e.g. ``initialization_timeout``).
    Returns the method used: ``"already"``, ``"none"``, ``"slurm"``, ``"ompi"``,
    ``"mpirun"`` or ``"mpi4py"``.
    """
    if jax.distributed.is_initialized():
        return "already"
    method = detect().jax_method()
    if method == "none":
        return method
    if method == "mpi4py":
        mpi_runtime.import_mpi4py()  # the ABI check first: JAX imports mpi4py.MPI unchecked
        jax.distributed.initialize(cluster_detection_method="mpi4py", **kwargs)
    elif method == "mpirun":
        jax.distributed.initialize(cluster_detection_method=cluster.NAME, **kwargs)
    else:
        jax.distributed.initialize(**kwargs)
    return method


__all__ = ["Launch", "detect", "initialize_distributed"]
