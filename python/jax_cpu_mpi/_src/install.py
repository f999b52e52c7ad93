"""Switching jax_cpu_mpi on: every feature, in order, each through the compat room's
``enable`` (a feature whose JAX names are missing stays off with one warning; the others
still install). What ``import jax_cpu_mpi`` and JAX's plugin discovery run."""

from __future__ import annotations

import warnings

from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.batching import rules as batching
from jax_cpu_mpi._src.dispatch import fast_path
from jax_cpu_mpi._src.lowering import barrier_tokens
from jax_cpu_mpi._src.lowering import collectives as collective_lowering
from jax_cpu_mpi._src.lowering import rules as lowering
from jax_cpu_mpi._src.passes import hook
from jax_cpu_mpi._src.runtime import config, gloo_cache, launchers
from jax_cpu_mpi._src.runtime import mpi as mpi_runtime
from jax_cpu_mpi._src.runtime import trace as message_trace

_installed = False


def _fast_dispatch() -> None:
    fast_path.install()
    hook.install()  # the device-thread hint is the hook's last pass


def _collectives() -> None:
    collective_lowering.register()
    hook.install()


def install() -> None:
    """Register the CPU lowerings (done on import; calling again is harmless).

    Never raises because of JAX internals: a feature whose private JAX names are missing
    or changed stays off, with one :class:`JaxCompatWarning` naming it.
    """
    global _installed
    if _installed:
        return
    try:
        config.apply()
        # Here too, not only once MPI is attached: in one process XLA allocates a step's
        # temporaries afresh as well (a pipeline's kept residuals: tens of MB per device).
        if config.BY_NAME["JAX_CPU_MPI_KEEP_FREED_MEMORY"].read():
            ext.keep_freed_memory()
    except config.ConfigError:
        # A bad JAX_CPU_MPI_* value: everything is still registered, so that the first
        # psend/precv lowering raises this error (config.current() in lowering/rules.py),
        # not JAX's "only implemented on GPU".
        pass
    try:
        message_trace.apply_environment()
    except config.ConfigError:
        pass  # reported with the other bad values by the first lowering (config.current())
    compat.enable("lowerings", lowering.register)
    # The three module passes share one lowering hook (passes/hook.py runs them in order).
    compat.enable("gpu_parity", hook.install)
    compat.enable("kept_operands", hook.install)
    # After the lowerings (it requires them); its ordering pass is one of the hook's.
    compat.enable("collectives", _collectives)
    compat.enable("barrier_tokens", barrier_tokens.install)
    compat.enable("fast_dispatch", _fast_dispatch)
    batching.install()
    compat.enable("info:lowering_table", lambda: None)  # read-only: nothing to install
    # Before jax.distributed.initialize(), which JAX runs before any plugin is loaded: only
    # `import jax_cpu_mpi` gets there in time.
    compat.enable("clusters", launchers.register)
    compat.enable("exit_from_broken_job", lambda: None)  # used at exit (runtime.mpi)
    # Under mpirun, MPI is attached when jax.distributed.initialize() returns, while every
    # process is there (not at the first lowering, which processes outside a mesh skip).
    mpi_runtime.install_attach_at_initialize()
    compat.enable("pipeline:split_backward", lambda: None)  # used when pipelines trace
    compat.enable("gloo_cache_guard", gloo_cache.install)
    _installed = True


def features() -> list[dict[str, object]]:
    """Every feature jax_cpu_mpi adds to JAX: state (active, off, not needed, not
    installed) and why. The same list as ``python -m jax_cpu_mpi info``."""
    return compat.report()


def stats() -> dict[str, int]:
    """Counters of this process: queued in-process messages, undelivered MPI sends, the
    yields and sleeps of the waits for MPI peers."""
    return dict(ext.stats())


def activate_on_import() -> None:
    """What ``import jax_cpu_mpi`` does: warn about an untested JAX and about unknown
    ``JAX_CPU_MPI_*`` names, then :func:`install` unless ``JAX_CPU_MPI_DISABLE`` says not
    to. Never raises (JAX's plugin discovery imports the package and must never see an
    error)."""
    compat.warn_if_untested()
    config.warn_about_unknown_names(stacklevel=4)
    try:
        disabled = config.disabled()
    except config.ConfigError:
        # A bad JAX_CPU_MPI_DISABLE must not break JAX's plugin discovery: activate, and let
        # the first psend/precv lowering raise the error.
        disabled = False
    if disabled:
        return
    try:
        install()
    except Exception as e:  # last resort: JAX's plugin discovery must never see an error
        warnings.warn(
            f"jax_cpu_mpi could not be activated with {compat.versions_text()}: "
            f"{type(e).__name__}: {e}. JAX works as without jax_cpu_mpi. Please report this.",
            compat.JaxCompatWarning, stacklevel=4)
