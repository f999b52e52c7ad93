"""jax_cpu_mpi: point-to-point ``psend`` / ``precv`` on CPU, and beyond JAX's deprecation.

:func:`psend` / :func:`precv` are ``jax.lax.psend`` / ``jax.lax.precv`` (deprecated in JAX
0.12) without the deprecation: JAX's primitives while JAX has them, ours once it drops them
(:mod:`jax_cpu_mpi.primitives`), the same program on CPU and GPU.

Importing the package registers CPU lowerings for the point-to-point primitives:

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
from . import config as _config
from . import lowering as _lowering
from . import plugin as _plugin
from . import validation as _validation
from .config import Config, configure
from .mpi_runtime import MpiSetupError
from .p2p import precv, psend

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
    _installed = True


def stats() -> dict[str, int]:
    """Counters of this process: queued in-process messages, undelivered MPI sends."""
    return dict(_ext.stats())


# JAX_CPU_MPI_DISABLE=1 turns this off (and the jax_plugins entry point with it).
if not _plugin.disabled():
    install()

__all__ = ["Config", "MpiSetupError", "__version__", "configure", "install", "precv", "psend",
           "stats"]
