"""Activation without code changes: the ``jax_plugins`` entry point of jax_cpu_mpi.

The package declares ``[project.entry-points.jax_plugins] jax_cpu_mpi = "jax_cpu_mpi.plugin"``.
When JAX initializes its backends (the first ``jax.devices()``, ``jax.jit(...)(x)``,
``jax.device_put``...), it imports every module advertised under that group and calls its
``initialize()``. Importing this module imports the package, which registers the CPU
lowerings of ``psend`` / ``precv`` and the batching rules; that is all it does. MPI stays
untouched: ``mpi4py`` is imported, and ``MPI_Init`` called, only when a program whose mesh
spans processes is lowered (see :mod:`jax_cpu_mpi.mpi_runtime`).

``JAX_CPU_MPI_DISABLE=1`` (or ``true``/``yes``/``on``) turns automatic registration off,
for the plugin and for ``import jax_cpu_mpi`` alike; ``jax_cpu_mpi.install()`` still
registers everything when a program asks for it explicitly.
"""

from __future__ import annotations

import os

#: Environment variable that turns automatic registration off.
DISABLE_ENV = "JAX_CPU_MPI_DISABLE"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def disabled() -> bool:
    """Whether :data:`DISABLE_ENV` asks for no automatic registration."""
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{DISABLE_ENV}={os.environ[DISABLE_ENV]!r} is not a boolean: use 1 to disable "
        "jax_cpu_mpi's automatic registration, 0 or unset to keep it"
    )


def initialize() -> None:
    """Called by JAX's plugin discovery: register jax_cpu_mpi unless disabled.

    Cheap and MPI-free, as JAX asks of plugins (it calls this for every installed plugin).
    JAX imports this module while it holds its (non-reentrant) plugin lock, inside its first
    ``backends()`` call: nothing that the package runs at import or in ``install()`` may ask
    JAX for backends or devices (``jax.devices()``, ``jax.process_count()``...), or the
    program deadlocks. ``tests/test_packaging.py`` would hang, then time out, on such a change.
    """
    if disabled():
        return
    from . import install

    install()
