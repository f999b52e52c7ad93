"""Buffers whose contents are never read before they are written: no zeros written first.

XLA has no value without contents: the only way to start a loop's state is to fill it,
``jnp.zeros`` a write of every byte at every run, and on CPU the first touch of every page
of a freshly mapped buffer. A pipeline's slots of kept residuals (``remat=False``) are
tens of MB per device that the schedule writes before it reads them, and some devices use
only a few of them (in 1F1B the last stage one of ``P``): their zeros were a large part
of the step's memory traffic and page faults.

``uninitialized(shape)`` is, on CPU, a custom call of ours (``jax_cpu_mpi_uninitialized``,
``cpp/ffi/uninitialized.cc``) that leaves the buffer XLA gives it as it is: reading it
gives whatever was there, so only a caller that writes every element before reading it
may use it. ``index`` tells the calls of one program apart (XLA would merge identical
ones, then copy the merged buffer for each of its users). Elsewhere (GPU, or a CPU whose
handlers could not be registered) it is ``zeros``.

A read before a write would go unseen: a fresh page holds zeros, what ``zeros`` gave. With
``JAX_CPU_MPI_POISON_UNINITIALIZED=1`` (``configure(poison_uninitialized=True)``) the call
fills its buffer with NaN (floats) or an extreme value (integers) at every run, so that
such a read shows in the results (tests/pipeline/test_pipeline_poison.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_cpu_mpi._src.runtime import config

UNINITIALIZED_TARGET = "jax_cpu_mpi_uninitialized"


def _registered() -> bool:
    from jax_cpu_mpi._src.ffi import registration

    return registration.targets_available()


def uninitialized(shape: tuple[int, ...], dtype: Any, index: int) -> jax.Array:
    """An array of ``shape`` and ``dtype`` whose contents are undefined (module docstring);
    ``index``: distinct for each call in one program."""
    shape, dtype = tuple(int(d) for d in shape), jnp.dtype(dtype)

    def zeros() -> jax.Array:
        return jnp.zeros(shape, dtype)

    if not _registered():
        return zeros()
    # The poison setting reaches the handler with the rest of the configuration: push it
    # now if nothing has yet (a bad JAX_CPU_MPI_* value raises here, as at a lowering).
    config.current()

    def on_cpu() -> jax.Array:
        call = jax.ffi.ffi_call(UNINITIALIZED_TARGET, jax.ShapeDtypeStruct(shape, dtype))
        return call(index=np.int64(index))

    return jax.lax.platform_dependent(cpu=on_cpu, default=zeros)


__all__ = ["UNINITIALIZED_TARGET", "uninitialized"]
