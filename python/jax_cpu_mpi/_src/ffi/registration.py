"""Registering our FFI handlers with XLA's CPU platform (``jax.ffi``), once, and only where
the installed jaxlib can take them (:mod:`.abi_version`)."""

from __future__ import annotations

import jax

from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi._src.ffi import abi_version

_registered = False


def register_targets() -> None:
    """Register every handler of the extension for CPU (idempotent).

    Raises RuntimeError, naming the versions and the fix, when the extension was built
    against a newer XLA FFI API than the installed jaxlib accepts: registering its handlers
    would stop JAX's CPU backend from starting.
    """
    global _registered
    if _registered:
        return
    problem = abi_version.mismatch()
    if problem is not None:
        raise RuntimeError(problem)
    for name, capsule in ext.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    _registered = True


def targets_available() -> bool:
    """Whether the handlers are registered for CPU (registering them if not yet): False
    where this jaxlib is too old for the extension, so that an op can lower to something
    else there instead of failing."""
    try:
        register_targets()
    except RuntimeError:
        return False
    return True


def tell_this_process(process_index: int) -> None:
    """Tell the handlers this process's ``jax.process_index()`` (the marks' events carry it).

    Not an attribute of the call: a program must be the same on every process, or XLA's
    collectives between processes (gloo) wait for each other forever (jax 0.12.1)."""
    ext.trace_set_process(process_index)
