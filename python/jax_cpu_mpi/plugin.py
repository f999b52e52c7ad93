"""Activation without code changes: the ``jax_plugins`` entry point of jax_cpu_mpi.

The package declares ``[project.entry-points.jax_plugins] jax_cpu_mpi = "jax_cpu_mpi.plugin"``.
When JAX initializes its backends (the first ``jax.devices()``, ``jax.jit(...)(x)``,
``jax.device_put``...), it imports every module advertised under that group and calls its
``initialize()``. Importing this module imports the package, which registers the CPU
lowerings of ``psend`` / ``precv`` and the batching rules; that is all it does. MPI stays
untouched: ``mpi4py`` is imported, and ``MPI_Init`` called, only when a program whose mesh
spans processes is lowered.

``JAX_CPU_MPI_DISABLE=1`` (or ``true``/``yes``/``on``) turns automatic registration off,
for the plugin and for ``import jax_cpu_mpi`` alike; ``jax_cpu_mpi.install()`` still
registers everything when a program asks for it explicitly. A value that is no boolean
disables nothing: the first psend/precv lowering raises its ``ConfigError``.
"""

from __future__ import annotations

from jax_cpu_mpi._src.runtime.config import DISABLE_ENV, ConfigError, disabled


def initialize() -> None:
    """Called by JAX's plugin discovery: register jax_cpu_mpi unless disabled.

    Cheap and MPI-free, as JAX asks of plugins (it calls this for every installed plugin).
    JAX imports this module while it holds its (non-reentrant) plugin lock, inside its first
    ``backends()`` call: nothing that the package runs at import or in ``install()`` may ask
    JAX for backends or devices (``jax.devices()``, ``jax.process_count()``...), or the
    program deadlocks. ``tests/test_packaging.py`` would hang, then time out, on such a change.
    """
    try:
        if disabled():
            return
    except ConfigError:  # never an error here: the first psend/precv lowering raises it
        pass
    from jax_cpu_mpi import install

    install()


__all__ = ["DISABLE_ENV", "disabled", "initialize"]
