"""Which psend/precv primitives jax_cpu_mpi binds: JAX's while JAX has them, ours after.

* **JAX has** ``psend_p`` / ``precv_p`` (0.10 to 0.12 at least): :data:`psend_p` and
  :data:`precv_p` ARE JAX's primitives. ``jax_cpu_mpi.psend`` and ``jax.lax.psend`` build the
  same equation, so one program mixes both, and our CPU lowering, batching rules and parity
  check serve both. The ``own_primitives`` feature is then "not needed".
* **JAX dropped them**: they are the primitives of :mod:`jax_cpu_mpi._src.ops.own_primitives`,
  which behave as JAX's did (params, effects, abstract eval, GPU lowering); the
  ``own_primitives`` feature is active (or off, with one warning, if a JAX name they are
  built from is missing: then :data:`psend_p` is a ``Missing`` that names it when used).

``JAX_CPU_MPI_PRIMITIVES=ours`` (read once, at import) takes our primitives even while JAX
has its own: the package then behaves as it will once JAX drops them, and a leftover
``jax.lax.psend`` fails on CPU as it will then (JAX's primitive keeps no CPU lowering). Use
it to check a migration; the default, ``auto``, takes JAX's where they exist.
"""

from __future__ import annotations

import warnings
from typing import Any

from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.runtime import config

#: Environment variable choosing the primitives: ``auto`` (default) or ``ours`` (parsed by
#: its entry of :data:`jax_cpu_mpi._src.runtime.config.VARIABLES`).
MODE_ENV = "JAX_CPU_MPI_PRIMITIVES"


def requested_mode() -> str:
    """The mode :data:`MODE_ENV` asks for (``auto`` when unset); ConfigError if invalid."""
    return config.BY_NAME[MODE_ENV].read() or "auto"


def _mode() -> str:
    try:
        return requested_mode()
    except config.ConfigError as e:  # importing jax_cpu_mpi never fails (JAX's plugin
        # discovery); the first psend/precv lowering raises this error (config.current()).
        warnings.warn(f"jax_cpu_mpi: {e}. The primitives are chosen now, at import: 'auto' "
                      "is taken, and the first psend/precv lowering raises this error.",
                      config.ConfigWarning, stacklevel=3)
        return "auto"


def jax_has_primitives() -> bool:
    """Whether this JAX has ``psend_p`` and ``precv_p``."""
    return compat.available(compat.jax_psend_p) and compat.available(compat.jax_precv_p)


def _choose() -> tuple[Any, Any, bool, str]:
    mode = _mode()
    if mode == "auto" and jax_has_primitives():
        compat.mark_not_needed(
            "own_primitives", "this JAX has psend_p/precv_p: jax_cpu_mpi.psend/precv bind them")
        return (compat.jax_psend_p, compat.jax_precv_p, False,
                "JAX has psend_p/precv_p (jax._src.lax.parallel)")
    why = (f"{MODE_ENV}=ours" if mode == "ours"
           else "this JAX has no psend_p/precv_p (dropped after their deprecation in 0.12)")
    made: dict[str, Any] = {}

    def create() -> None:
        from jax_cpu_mpi._src.ops import own_primitives as own

        made.update(psend=own.psend_p, precv=own.precv_p)

    if compat.enable("own_primitives", create):
        return made["psend"], made["precv"], True, why
    reason = "; ".join(compat.get_feature("own_primitives").problems)
    return (compat.Missing("jax_cpu_mpi._src.ops.primitives:psend_p", reason),
            compat.Missing("jax_cpu_mpi._src.ops.primitives:precv_p", reason), True,
            f"{why}, but jax_cpu_mpi's own primitives are off ({reason})")


psend_p, precv_p, OURS, REASON = _choose()


def in_use() -> dict[str, Any]:
    """What :mod:`jax_cpu_mpi._src.cli.info` reports: whose primitives and effect, and why."""
    return {
        "primitives": "jax_cpu_mpi" if OURS else "jax",
        "reason": REASON,
        "usable": compat.available(psend_p) and compat.available(precv_p),
        "effect": ("jax" if compat.available(compat.jax_single_side_collective_effect)
                   else "jax_cpu_mpi"),
        "jax_has_primitives": jax_has_primitives(),
    }


__all__ = ["MODE_ENV", "OURS", "REASON", "in_use", "jax_has_primitives", "precv_p", "psend_p",
           "requested_mode"]
