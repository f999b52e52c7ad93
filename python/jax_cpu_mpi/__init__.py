"""jax_cpu_mpi: point-to-point ``psend`` / ``precv`` on CPU, and beyond JAX's deprecation.

:func:`psend` / :func:`precv` are ``jax.lax.psend`` / ``jax.lax.precv`` (deprecated in JAX
0.12) without the deprecation: JAX's primitives while JAX has them, ours once it drops them
, the same program on CPU and GPU.

Importing the package registers CPU lowerings for the point-to-point primitives:

* between devices of one process (``--xla_force_host_platform_device_count=N``), messages
  are copied directly between the device threads;
* between processes (``mpirun -n P`` + ``jax.distributed.initialize()``), they travel over
  MPI point-to-point on a communicator of our own.

The results are those of the GPU lowering: ``precv(psend(x, perm), perm)`` equals
``lax.ppermute(x, perm)``. The documentation (``docs/``) covers configuration and
launchers.

Each part hooks into JAX internals that a JAX release may move: such a part switches off
with one :class:`JaxCompatWarning` and the rest keeps working (``python -m jax_cpu_mpi info``
lists every feature). Importing the package never fails because of that.
"""

from __future__ import annotations

from jax_cpu_mpi._src import __version__
from jax_cpu_mpi._src.cli.trace import TraceError
from jax_cpu_mpi._src.cli.trace import merge as read_timeline
from jax_cpu_mpi._src.compat import JaxCompatWarning, UntestedJaxWarning
from jax_cpu_mpi._src.compat.versions import TESTED_JAX_VERSIONS
from jax_cpu_mpi._src.install import activate_on_import as _activate_on_import
from jax_cpu_mpi._src.install import features, install, stats
from jax_cpu_mpi._src.ops.p2p import precv, psend
from jax_cpu_mpi._src.parity.check import GpuParityError
from jax_cpu_mpi._src.parity.check import check_lowered as check
from jax_cpu_mpi._src.runtime.config import Config, ConfigError, ConfigWarning, configure
from jax_cpu_mpi._src.runtime.gloo_cache import GlooCacheWarning
from jax_cpu_mpi._src.runtime.launchers import initialize_distributed
from jax_cpu_mpi._src.runtime.mpi import MpiSetupError, MpiSetupWarning
from jax_cpu_mpi._src.runtime.trace import flush as trace_flush
from jax_cpu_mpi._src.runtime.trace import trace

# JAX_CPU_MPI_DISABLE=1 turns this off (and the jax_plugins entry point with it).
_activate_on_import()

__all__ = ["TESTED_JAX_VERSIONS", "Config", "ConfigError", "ConfigWarning", "GlooCacheWarning",
           "GpuParityError", "JaxCompatWarning", "MpiSetupError", "MpiSetupWarning", "TraceError",
           "UntestedJaxWarning", "__version__", "check", "configure", "features",
           "initialize_distributed", "install", "precv", "psend", "read_timeline", "stats",
           "trace", "trace_flush"]

# The public submodules load on first use (`jax_cpu_mpi.pipeline.GPipe()` after a plain
# `import jax_cpu_mpi`), so that importing the package stays as cheap as the lowerings need.
_SUBMODULES = frozenset({"batching", "config", "pipeline"})


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES)
