"""Which psend/precv primitives jax_cpu_mpi binds: JAX's while JAX has them, ours after.

* **JAX has** ``psend_p`` / ``precv_p`` (0.10 to 0.12 at least): :data:`psend_p` and
  :data:`precv_p` ARE JAX's primitives. ``jax_cpu_mpi.psend`` and ``jax.lax.psend`` build the
  same equation, so one program mixes both, and our CPU lowering, batching rules and parity
  check serve both.
* **JAX dropped them**: they are the primitives of :mod:`jax_cpu_mpi._own_primitives`,
  which behave as JAX's did (params, effects, abstract eval, GPU lowering).

``JAX_CPU_MPI_PRIMITIVES=ours`` (read once, at import) takes our primitives even while JAX
has its own: the package then behaves as it will once JAX drops them, and a leftover
``jax.lax.psend`` fails on CPU as it will then (JAX's primitive has no CPU lowering). Use it
to check a migration; the default, ``auto``, takes JAX's where they exist.
"""

from __future__ import annotations

import os
from typing import Any

from . import _compat

#: Environment variable choosing the primitives: ``auto`` (default) or ``ours``.
MODE_ENV = "JAX_CPU_MPI_PRIMITIVES"
_MODES = ("auto", "ours")


def requested_mode() -> str:
    """The mode :data:`MODE_ENV` asks for (``auto`` when unset)."""
    value = os.environ.get(MODE_ENV, "").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(
            f"{MODE_ENV}={os.environ[MODE_ENV]!r}: use 'auto' (JAX's psend/precv primitives "
            "while JAX has them, jax_cpu_mpi's after) or 'ours' (jax_cpu_mpi's always)")
    return value


def _choose() -> tuple[Any, Any, bool, str]:
    mode = requested_mode()
    jax_has = _compat.jax_psend_p is not None and _compat.jax_precv_p is not None
    if mode == "auto" and jax_has:
        return (_compat.jax_psend_p, _compat.jax_precv_p, False,
                "JAX has psend_p/precv_p (jax._src.lax.parallel)")
    from . import _own_primitives as own

    why = (f"{MODE_ENV}=ours" if mode == "ours"
           else "this JAX has no psend_p/precv_p (dropped after their deprecation in 0.12)")
    return own.psend_p, own.precv_p, True, why


psend_p, precv_p, OURS, REASON = _choose()


def in_use() -> dict[str, Any]:
    """What :mod:`jax_cpu_mpi.info` reports: whose primitives and effect, and why."""
    return {
        "primitives": "jax_cpu_mpi" if OURS else "jax",
        "reason": REASON,
        "effect": "jax" if _compat.jax_has_single_side_effect else "jax_cpu_mpi",
        "jax_has_primitives": (_compat.jax_psend_p is not None
                               and _compat.jax_precv_p is not None),
    }


__all__ = ["MODE_ENV", "OURS", "REASON", "in_use", "precv_p", "psend_p", "requested_mode"]
