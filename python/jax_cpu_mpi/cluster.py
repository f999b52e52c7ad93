"""``jax.distributed.initialize()`` with no arguments under ``mpirun``: MPICH and Open MPI 5.

JAX detects its cluster from the environment, through its cluster environments
(``ClusterEnv`` subclasses). JAX's own ones cover Slurm (``srun``) and Open MPI 4
(``OMPI_MCA_orte_hnp_uri``); mpi4py only on request (``cluster_detection_method="mpi4py"``).
Under MPICH's ``mpirun``/``mpiexec`` (Hydra: Intel MPI, MVAPICH, the ``mpich`` wheel) and Open
MPI 5 (PRRTE, which sets no ORTE variable) a plain ``jax.distributed.initialize()`` fails with
"coordinator_address should be defined".

:class:`MpirunCluster` is a cluster environment of our own, registered with JAX's detection
when jax_cpu_mpi is imported (:func:`register`). It is present when the launcher's variables
are, and only then imports mpi4py:

==================  ============================================  ============================
launcher            variables read                                local rank
==================  ============================================  ============================
MPICH Hydra         ``PMI_RANK``, ``PMI_SIZE``                    ``MPI_LOCALRANKID``
Open MPI 5 (PRRTE)  ``PMIX_RANK``, ``OMPI_COMM_WORLD_RANK/SIZE``  ``OMPI_COMM_WORLD_LOCAL_RANK``
==================  ============================================  ============================

Process index and count come from those variables (process index = MPI rank), without MPI.
The coordinator runs on rank 0's host, as in JAX's mpi4py detection: rank 0 picks a free port
(or ``JAX_COORDINATOR_PORT``) and broadcasts ``hostname:port`` over ``MPI_COMM_WORLD``
(mpi4py, after jax_cpu_mpi's MPI ABI check). Every host must resolve rank 0's hostname.

It steps aside wherever JAX's own detection applies: under Slurm (the step variables JAX's
Slurm detection reads) and Open MPI 4 (``OMPI_MCA_orte_hnp_uri``), JAX's environments are
found first, and this one reports itself absent there too. An explicit
``cluster_detection_method`` or explicit arguments still win, as always in JAX.
"""

from __future__ import annotations

import os
import socket

from . import _compat

#: ``cluster_detection_method`` that selects this environment explicitly.
NAME = "mpirun"

_HYDRA = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
_PRRTE = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
_ORTE_URI = "OMPI_MCA_orte_hnp_uri"  # Open MPI 4 and older: JAX's OmpiCluster
#: What JAX's SlurmCluster requires (srun sets them all).
_SLURM_STEP = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")

_registered: type | None = None


def _int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def launcher() -> str | None:
    """``"mpich"`` (Hydra's PMI variables), ``"openmpi5"`` (PRRTE's PMIx variables), or
    None: not started by those launchers, or started where JAX's own detection applies."""
    if _ORTE_URI in os.environ or all(v in os.environ for v in _SLURM_STEP):
        return None
    if "PMIX_RANK" in os.environ and _int(_PRRTE[0]) is not None and _int(_PRRTE[1]):
        return "openmpi5"
    if _int(_HYDRA[0]) is not None and _int(_HYDRA[1]):
        return "mpich"
    return None


def _variables() -> tuple[str, str, str]:
    return _PRRTE if launcher() == "openmpi5" else _HYDRA


def _free_port() -> int:
    """A TCP port nothing listens on now (the coordinator binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def coordinator_address(override_port: str | None = None) -> str:
    """``rank 0's hostname:port``, the same on every rank (collective over MPI_COMM_WORLD)."""
    from . import mpi_runtime

    MPI = mpi_runtime.import_mpi4py()  # the ABI check before MPI is initialized
    world = MPI.COMM_WORLD
    address = None
    if world.Get_rank() == 0:
        address = f"{socket.gethostname()}:{override_port or _free_port()}"
    return world.bcast(address, root=0)


def _make_class(base: type) -> type:
    class MpirunCluster(base):  # type: ignore[misc, valid-type]
        """MPICH's ``mpirun``/``mpiexec`` (PMI variables) and Open MPI 5's (PMIx variables)."""

        name: str = NAME
        opt_in_only_method: bool = False

        @classmethod
        def is_env_present(cls) -> bool:
            return launcher() is not None

        @classmethod
        def get_coordinator_address(cls, timeout_secs: int | None = None,
                                    override_coordinator_port: str | None = None) -> str:
            return coordinator_address(override_coordinator_port)

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ[_variables()[1]])

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ[_variables()[0]])

        @classmethod
        def get_local_process_id(cls) -> int | None:
            return _int(_variables()[2])

    MpirunCluster.__module__ = __name__
    return MpirunCluster


def register() -> None:
    """Register :class:`MpirunCluster` with JAX's cluster detection (once; through
    ``_compat.enable("clusters", register)``, which keeps it off, with a warning, if this
    JAX's ``ClusterEnv`` moved or changed)."""
    global _registered
    if _registered is not None:
        return
    base = _compat.cluster_env_base
    existing = [c for c in base._cluster_types if getattr(c, "name", None) == NAME]
    if existing:  # a second copy of the package in this process
        _registered = existing[0]
        return
    _registered = _make_class(base)  # defining the subclass registers it


def registered() -> bool:
    """Whether :class:`MpirunCluster` is registered with JAX's detection."""
    return _registered is not None


__all__ = ["NAME", "coordinator_address", "launcher", "register", "registered"]
