"""Launchers: which one started this process, and how JAX's distributed runtime starts
under it (:func:`initialize_distributed`, and our cluster environment for ``mpirun``).

Which launcher started this process, and how to start JAX's distributed runtime under it.

jax_cpu_mpi needs one thing of a multi-process job: every JAX process is one rank of one
MPI job. Any of JAX's ways to start the distributed runtime gives that, as long as the
processes were started by ``mpirun``/``mpiexec`` or ``srun``:

=====================  ===================================================================
launcher               ``jax.distributed.initialize(...)``
=====================  ===================================================================
MPICH ``mpirun``       no arguments, after ``import jax_cpu_mpi``: our cluster environment
(Hydra)                (:class:`MpirunCluster` below) reads ``PMI_RANK``/``PMI_SIZE``
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

**Our cluster environment**: ``jax.distributed.initialize()`` with no arguments under
``mpirun`` (MPICH and Open MPI 5).

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
import warnings
from dataclasses import dataclass

import jax

from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.runtime import mpi as mpi_runtime

#: (rank variable, size variable) of MPI launchers, most specific first.
_MPI_RANK_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ("PMI_RANK", "PMI_SIZE"),  # MPICH/Hydra, Intel MPI, srun --mpi=pmi2
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),  # MVAPICH
    ("PMIX_RANK", None),  # PMIx (srun --mpi=pmix, prterun)
)
#: What JAX's SlurmCluster requires (srun sets them all).
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")
#: Open MPI 4 and older (ORTE): JAX's OmpiCluster detects it.
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
    #: The variables that gave ``mpi_rank`` and ``mpi_size`` (for messages).
    rank_variables: tuple[str, ...] = ()
    #: How MPI learns the job from the launcher (see :func:`detect_pmi`), ``None`` if unknown.
    pmi: str | None = None

    def describe(self) -> str:
        """The launcher and its PMI in words, e.g. ``"srun (Slurm), PMI pmi2"``."""
        name = "srun (Slurm)" if self.launcher == "slurm" else self.launcher
        return f"{name}, PMI {self.pmi}" if self.pmi else name

    @property
    def multi_process(self) -> bool:
        sizes = [s for s in (self.mpi_size, self.slurm_ntasks) if s is not None]
        return any(s > 1 for s in sizes)

    @property
    def slurm_consistent(self) -> bool:
        """Slurm's task index and count are this process's MPI rank and job size (or MPI
        does not say).

        ``mpirun`` inside an ``sbatch`` script leaves Slurm variables of another step in
        every rank's environment: the batch step's, or (MPICH's mpirun, which starts its
        proxies with ``srun``) the proxies' step, one task per node. Then JAX's Slurm
        detection would be wrong; the count is compared too, so that rank 0, whose index
        happens to match, decides like the others.
        """
        return self.slurm_procid is not None and (
            self.mpi_rank is None or self.mpi_rank == self.slurm_procid) and (
            self.mpi_size is None or self.mpi_size == self.slurm_ntasks)

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
        if registered() and launcher() is not None:
            return "mpirun"
        return "mpi4py"


def _int_env(name: str | None) -> int | None:
    value = os.environ.get(name) if name else None
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def detect_pmi() -> str | None:
    """How MPI learns its rank and job from the launcher (a process-management interface).

    Under ``srun``: the ``--mpi`` plugin of the step (``SLURM_MPI_TYPE``: ``pmi2``,
    ``pmix``, ``pmix_v4``..., or ``none``: the tasks' MPI gets nothing and sees singletons).
    Elsewhere: ``"pmix"`` (``PMIX_RANK``: Open MPI 5, PMIx launchers) or ``"pmi"``
    (``PMI_RANK``/``PMI_FD``: MPICH's Hydra). ``None``: no launcher variable.
    """
    if all(v in os.environ for v in _SLURM_VARS) and os.environ.get("SLURM_MPI_TYPE"):
        return os.environ["SLURM_MPI_TYPE"]
    if "PMIX_RANK" in os.environ:
        return "pmix"
    if "PMI_RANK" in os.environ or "PMI_FD" in os.environ:
        return "pmi"
    return None


def detect() -> Launch:
    """Read the launcher's environment variables (nothing is initialized)."""
    mpi_rank = mpi_size = None
    launcher = "none"
    rank_variables: tuple[str, ...] = ()
    for rank_var, size_var in _MPI_RANK_VARS:
        if _int_env(rank_var) is not None:
            mpi_rank, mpi_size = _int_env(rank_var), _int_env(size_var)
            launcher = "openmpi" if rank_var.startswith("OMPI_") else "mpi"
            rank_variables = tuple(v for v in (rank_var, size_var) if v)
            break
    slurm = all(v in os.environ for v in _SLURM_VARS)
    if slurm and (launcher == "none" or (
            mpi_rank == _int_env("SLURM_PROCID")
            and mpi_size in (None, _int_env("SLURM_NTASKS")))):
        launcher = "slurm"
    return Launch(
        launcher=launcher,
        mpi_rank=mpi_rank,
        mpi_size=mpi_size,
        slurm_procid=_int_env("SLURM_PROCID") if slurm else None,
        slurm_ntasks=_int_env("SLURM_NTASKS") if slurm else None,
        orte=_ORTE_URI in os.environ,
        rank_variables=rank_variables,
        pmi=detect_pmi(),
    )


_LAUNCHER_NAMES = {"mpich": "MPICH's mpirun/mpiexec (Hydra)",
                   "openmpi5": "Open MPI 5's mpirun (PRRTE)"}
_warned_jax_alone = False


def warn_if_jax_runs_alone(op_name: str) -> None:
    """One :class:`MpiSetupWarning` (per process) when a launcher started this process as
    one of several ranks but JAX runs alone in it: ``jax.distributed.initialize()`` was
    forgotten, so every rank runs its own single-process copy of the program.

    Called when psend/precv is lowered: JAX's backends are up by then, so
    ``jax.process_count()`` is safe (it is not at import, see ``plugin.initialize``).
    """
    global _warned_jax_alone
    if _warned_jax_alone:
        return
    launch = detect()
    if not launch.multi_process or jax.process_count() != 1:
        return
    _warned_jax_alone = True
    if launch.launcher == "slurm":
        rank, size = launch.slurm_procid, launch.slurm_ntasks
        said = "SLURM_PROCID, SLURM_NTASKS"
        name = "srun (Slurm)"
    else:
        rank, size = launch.mpi_rank, launch.mpi_size
        said = ", ".join(f"{v}={os.environ.get(v)}" for v in launch.rank_variables)
        name = _LAUNCHER_NAMES.get(launcher() or "", "an MPI launcher (mpirun/mpiexec)")
    warnings.warn(
        f"jax_cpu_mpi: {op_name}: this process is rank {rank} of {size} started by {name} "
        f"({said}), but JAX runs alone in it (jax.process_count() == 1): every rank runs its "
        "own single-process copy of the program and no psend/precv reaches another process. "
        "Call jax.distributed.initialize() (or jax_cpu_mpi.initialize_distributed(), which "
        "picks its arguments for this launcher) at the start of the program, before building "
        "the mesh.", mpi_runtime.MpiSetupWarning, stacklevel=2)


def initialize_over_mpi4py(**kwargs) -> None:
    """``jax.distributed.initialize(cluster_detection_method="mpi4py", **kwargs)``, with the
    coordinator's address from the port rank 0 holds (:func:`coordinator_address`) unless
    ``kwargs`` or ``JAX_COORDINATOR_ADDRESS`` give one (``JAX_COORDINATOR_PORT`` honoured).

    JAX's mpi4py detection takes the coordinator's port from ``hash(hostname) % 4096`` (the
    hash salted per process): two jobs on one host share it once in 4096 and abort each other
    ("different incarnation"). Ours is held until the coordinator takes it.
    """
    mpi_runtime.import_mpi4py()  # the ABI check first: JAX imports mpi4py.MPI unchecked
    if kwargs.get("coordinator_address") is None and not os.environ.get(
            "JAX_COORDINATOR_ADDRESS"):
        kwargs["coordinator_address"] = coordinator_address(
            os.environ.get("JAX_COORDINATOR_PORT"))
    jax.distributed.initialize(cluster_detection_method="mpi4py", **kwargs)


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
        initialize_over_mpi4py(**kwargs)
    elif method == "mpirun":
        jax.distributed.initialize(cluster_detection_method=NAME, **kwargs)
    else:
        jax.distributed.initialize(**kwargs)
    return method


__all__ = ["Launch", "detect", "detect_pmi", "initialize_distributed",
           "initialize_over_mpi4py", "warn_if_jax_runs_alone"]


# ---- the cluster environment for MPICH's and Open MPI 5's mpirun




#: ``cluster_detection_method`` that selects this environment explicitly.
NAME = "mpirun"

_HYDRA = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
_PRRTE = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")

_registered: type | None = None


def launcher() -> str | None:
    """``"mpich"`` (Hydra's PMI variables), ``"openmpi5"`` (PRRTE's PMIx variables), or
    None: not started by those launchers, or started where JAX's own detection applies."""
    if _ORTE_URI in os.environ or all(v in os.environ for v in _SLURM_VARS):
        return None
    if "PMIX_RANK" in os.environ and _int_env(_PRRTE[0]) is not None and _int_env(_PRRTE[1]):
        return "openmpi5"
    if _int_env(_HYDRA[0]) is not None and _int_env(_HYDRA[1]):
        return "mpich"
    return None


def _variables() -> tuple[str, str, str]:
    return _PRRTE if launcher() == "openmpi5" else _HYDRA


#: The sockets that hold the coordinator ports this process chose (see :func:`_free_port`).
_reserved_ports: list[socket.socket] = []


def reserve_port() -> socket.socket:
    """A socket that holds a free TCP port for a JAX coordinator (the caller closes it once
    that coordinator has ended, or keeps it while the process lives).

    A port found free and let go is free for anyone until the coordinator binds it: another
    job's rank 0 on this host may pick the same one, and since gRPC binds with
    ``SO_REUSEPORT``, both coordinators then listen on it and the two jobs' processes
    register with either (JAX aborts them with "different incarnation" errors). This socket
    is bound with ``SO_REUSEPORT`` too, and never listens: gRPC's coordinator joins it on the
    port and gets every connection, while a bind by anything else (another job's choice of a
    free port included) is refused.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("", 0))
    except OSError:
        s.close()
        raise
    return s


def _free_port() -> int:
    """A TCP port for JAX's coordinator, held by this process until it exits
    (:func:`reserve_port`)."""
    s = reserve_port()
    _reserved_ports.append(s)
    return s.getsockname()[1]


def coordinator_address(override_port: str | None = None) -> str:
    """``rank 0's hostname:port``, the same on every rank (collective over MPI_COMM_WORLD)."""
    MPI = mpi_runtime.import_mpi4py()  # the ABI check before MPI is initialized
    world = MPI.COMM_WORLD
    address = None
    if world.Get_rank() == 0:
        address = f"{socket.gethostname()}:{override_port or _free_port()}"
    return world.bcast(address, root=0)


def process_count() -> int:
    """The job's size, from the launcher's variables (no MPI call)."""
    return int(os.environ[_variables()[1]])


def process_id() -> int:
    """This process's rank, from the launcher's variables (no MPI call)."""
    return int(os.environ[_variables()[0]])


def local_process_id() -> int | None:
    """This process's rank among those of its host, where the launcher says."""
    return _int_env(_variables()[2])


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
            return process_count()

        @classmethod
        def get_process_id(cls) -> int:
            return process_id()

        @classmethod
        def get_local_process_id(cls) -> int | None:
            return local_process_id()

    MpirunCluster.__module__ = __name__
    return MpirunCluster


def register() -> None:
    """Register :class:`MpirunCluster` with JAX's cluster detection (once; through
    ``compat.enable("clusters", register)``, which keeps it off, with a warning, if this
    JAX's ``ClusterEnv`` moved or changed)."""
    global _registered
    if _registered is not None:
        return
    base = compat.cluster_env_base
    existing = [c for c in compat.registered_cluster_envs()
                if getattr(c, "name", None) == NAME]
    if existing:  # a second copy of the package in this process
        _registered = existing[0]
        return
    _registered = _make_class(base)  # defining the subclass registers it


def registered() -> bool:
    """Whether :class:`MpirunCluster` is registered with JAX's detection."""
    return _registered is not None


__all__ = ["NAME", "Launch", "coordinator_address", "detect", "detect_pmi",
           "initialize_distributed", "initialize_over_mpi4py",
           "launcher", "local_process_id", "process_count", "process_id", "register",
           "registered", "reserve_port"]
