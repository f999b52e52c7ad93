"""jax_cpu_mpi's cluster environment, registered before anything imports jax_cpu_mpi.

``jax.distributed.initialize()`` runs JAX's cluster detection before JAX loads any
``jax_plugins`` entry point, so under MPICH's or Open MPI 5's ``mpirun`` a program that calls
it before ``import jax_cpu_mpi`` would fail with "coordinator_address should be defined".
``jax_cpu_mpi-startup.pth`` (installed next to this module) imports this module when the
interpreter starts. In a process that an MPI launcher started (its rank variables are set),
it waits for JAX to import ``jax._src.clusters`` and then registers a cluster environment
whose methods call :mod:`jax_cpu_mpi`'s (``_src/runtime/launchers.py``) when JAX asks.
Everywhere else it does nothing but read the environment. It never raises: a failure here
must not break the interpreter, only leave the detection to ``import jax_cpu_mpi``.

It is the one place outside ``jax_cpu_mpi/_src/compat/`` that touches a private JAX name
(``jax._src.clusters.ClusterEnv`` and its ``_cluster_types``): it runs inside JAX's own
import, where importing jax_cpu_mpi (and its compat room) is not possible. It checks what
it finds and registers nothing when it does not look as expected.
"""

from __future__ import annotations

import os
import sys

#: What our cluster environment is called (``cluster_detection_method``), as in launchers.py.
NAME = "mpirun"
#: Rank variables of the launchers it serves (MPICH's Hydra, Open MPI 5's PRRTE).
_LAUNCHED = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
_CLUSTERS = "jax._src.clusters"


def _launchers():
    from jax_cpu_mpi._src.runtime import launchers

    return launchers


def _register(clusters) -> None:
    base = getattr(clusters, "ClusterEnv", None)
    if base is None or any(getattr(c, "name", None) == NAME
                           for c in getattr(base, "_cluster_types", ())):
        return

    class MpirunCluster(base):  # type: ignore[misc, valid-type]
        """MPICH's and Open MPI 5's ``mpirun``: jax_cpu_mpi's, registered at start-up."""

        name: str = NAME
        opt_in_only_method: bool = False

        @classmethod
        def is_env_present(cls) -> bool:
            return _launchers().launcher() is not None

        @classmethod
        def get_coordinator_address(cls, timeout_secs=None, override_coordinator_port=None):
            return _launchers().coordinator_address(override_coordinator_port)

        @classmethod
        def get_process_count(cls) -> int:
            return _launchers().process_count()

        @classmethod
        def get_process_id(cls) -> int:
            return _launchers().process_id()

        @classmethod
        def get_local_process_id(cls):
            return _launchers().local_process_id()


class _AfterClusters:
    """A meta path finder that registers our environment once JAX's clusters module ran."""

    def find_spec(self, name, path=None, target=None):
        if name != _CLUSTERS:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            try:
                _register(module)
            except Exception:  # leave the detection to `import jax_cpu_mpi`
                pass

        spec.loader.exec_module = exec_module
        return spec


def _install() -> None:
    if not any(v in os.environ for v in _LAUNCHED):
        return
    if os.environ.get("JAX_CPU_MPI_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
        return
    if _CLUSTERS in sys.modules:
        _register(sys.modules[_CLUSTERS])
    else:
        sys.meta_path.insert(0, _AfterClusters())


try:
    _install()
except Exception:  # never break the interpreter's start
    pass
