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

Each part hooks into JAX internals that a JAX release may move: such a part switches off
with one :class:`JaxCompatWarning` and the rest keeps working (``python -m jax_cpu_mpi info``
lists every feature). Importing the package never fails because of that.
"""

from __future__ import annotations

import warnings

from . import _barrier_tokens, _fast_dispatch, _kept_operands, _versions
from . import _compat as _compat
from . import _jax_cpu_mpi as _ext
from . import batching as _batching
from . import cluster as _cluster
from . import config as _config
from . import lowering as _lowering
from . import plugin as _plugin
from . import validation as _validation
from ._compat import JaxCompatWarning
from ._versions import TESTED_JAX_VERSIONS, UntestedJaxWarning
from .config import Config, configure
from .mpi_runtime import MpiSetupError
from .p2p import precv, psend

__version__ = "0.1.0"

_installed = False


def install() -> None:
    """Register the CPU lowerings (done on import; calling again is harmless).

    Never raises because of JAX internals: a feature whose private JAX names are missing
    or changed stays off, with one :class:`JaxCompatWarning` naming it.
    """
    global _installed
    if _installed:
        return
    _config.apply()
    _compat.enable("lowerings", _lowering.register)
    _compat.enable("gpu_parity", _validation.install)
    _compat.enable("kept_operands", _kept_operands.install)
    _compat.enable("barrier_tokens", _barrier_tokens.install)
    _compat.enable("fast_dispatch", _fast_dispatch.install)
    _batching.install()
    _compat.enable("info:lowering_table", lambda: None)  # read-only: nothing to install
    # Before jax.distributed.initialize(), which JAX runs before any plugin is loaded: only
    # `import jax_cpu_mpi` gets there in time.
    _compat.enable("clusters", _cluster.register)
    _compat.enable("exit_from_broken_job", lambda: None)  # used at exit (mpi_runtime)
    _installed = True


def features() -> list[dict[str, object]]:
    """Every feature jax_cpu_mpi adds to JAX: state (active, off, not needed, not
    installed) and why. The same list as ``python -m jax_cpu_mpi info``."""
    return _compat.report()


def stats() -> dict[str, int]:
    """Counters of this process: queued in-process messages, undelivered MPI sends."""
    return dict(_ext.stats())


def _activate_on_import() -> None:
    _versions.warn_if_untested()
    try:
        disabled = _plugin.disabled()
    except ValueError as e:  # a bad JAX_CPU_MPI_DISABLE must not break JAX's plugin discovery
        warnings.warn(f"jax_cpu_mpi is not activated: {e}", RuntimeWarning, stacklevel=3)
        return
    if disabled:
        return
    try:
        install()
    except Exception as e:  # last resort: JAX's plugin discovery must never see an error
        warnings.warn(
            f"jax_cpu_mpi could not be activated with {_compat.versions_text()}: "
            f"{type(e).__name__}: {e}. JAX works as without jax_cpu_mpi. Please report this.",
            JaxCompatWarning, stacklevel=3)


# JAX_CPU_MPI_DISABLE=1 turns this off (and the jax_plugins entry point with it).
_activate_on_import()

__all__ = ["TESTED_JAX_VERSIONS", "Config", "JaxCompatWarning", "MpiSetupError",
           "UntestedJaxWarning", "__version__", "configure", "features", "install", "precv",
           "psend", "stats"]
