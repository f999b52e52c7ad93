"""jax_cpu_mpi: ``jax.lax.psend`` / ``jax.lax.precv`` on CPU.

Importing the package registers CPU lowerings for JAX's point-to-point primitives:

* between devices of one process (``--xla_force_host_platform_device_count=N``), messages
  are copied directly between the device threads;
* between processes (``mpirun -n P`` + ``jax.distributed.initialize()``), they travel over
  MPI point-to-point on a communicator of our own.

The results are those of the GPU lowering: ``precv(psend(x, perm), perm)`` equals
``lax.ppermute(x, perm)``. See the README for configuration and launch instructions.
"""

from __future__ import annotations

from . import _jax_cpu_mpi as _ext
from . import batching as _batching
from . import cluster as _cluster
from . import config as _config
from . import lowering as _lowering
from . import plugin as _plugin
from . import validation as _validation
from .config import Config, configure
from .mpi_runtime import MpiSetupError

__version__ = "0.1.0"

_installed = False


def install() -> None:
    """Register the CPU lowerings (done on import; calling again is harmless)."""
    global _installed
    if _installed:
        return
    _config.apply()
    _lowering.register()
    _validation.install()
    _batching.install()
    # Before jax.distributed.initialize(), which JAX runs before any plugin is loaded: only
    # `import jax_cpu_mpi` gets there in time.
    _cluster.register()
    _installed = True


def stats() -> dict[str, int]:
    """Counters of this process: queued in-process messages, undelivered MPI sends."""
    return dict(_ext.stats())


# JAX_CPU_MPI_DISABLE=1 turns this off (and the jax_plugins entry point with it).
if not _plugin.disabled():
    install()

__all__ = ["Config", "MpiSetupError", "__version__", "configure", "install", "stats"]
