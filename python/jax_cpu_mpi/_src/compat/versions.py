"""The JAX versions jax_cpu_mpi was tested with, and the warning for any other one.

jax_cpu_mpi reaches into JAX internals (:mod:`jax_cpu_mpi._src.compat`), which move between
releases. The requirements admit every JAX from the oldest to the newest tested series
(``jax>=0.10.2,<0.12.2``); on a version not listed here the package still imports and works
as far as the internals it finds allow, and warns once so that a surprise has a name.
"""

from __future__ import annotations

import warnings
from importlib import metadata

import jax

#: ``jax`` versions whose whole test suite passed (the jaxlib of the same version).
#: Python 3.11 gets at most 0.10.2; 0.11 and 0.12 need Python >= 3.12.
TESTED_JAX_VERSIONS: tuple[str, ...] = ("0.10.2", "0.11.2", "0.12.0.1", "0.12.1")


#: The first jaxlib that hangs in a multi-process program whose collectives run on gloo when
#: JAX loads it from its persistent compilation cache (``scripts/jax_cache_gloo_hang.py``);
#: newer ones count as having the hang until one is tested without it.
FIRST_JAXLIB_WITH_GLOO_CACHE_HANG = (0, 12, 1)


def release(version: str | None) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; the leading numeric parts only (``()`` for None)."""
    parts: list[int] = []
    for part in (version or "").split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def has_gloo_cache_hang(jaxlib: str | None) -> bool:
    """Whether this jaxlib hangs running gloo programs from JAX's persistent cache."""
    return release(jaxlib)[:3] >= FIRST_JAXLIB_WITH_GLOO_CACHE_HANG


class UntestedJaxWarning(UserWarning):
    """The installed JAX is not one jax_cpu_mpi was tested with."""


def jaxlib_version() -> str | None:
    """The installed jaxlib's version (None if jaxlib's metadata is missing)."""
    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return None


def untested_message(jax_version: str, jaxlib: str | None) -> str | None:
    """The warning text for these versions, or None if they were tested."""
    if jax_version in TESTED_JAX_VERSIONS and jaxlib in (None, jax_version):
        return None
    what = f"jax {jax_version}" + (f" with jaxlib {jaxlib}" if jaxlib != jax_version else "")
    return (
        f"jax_cpu_mpi was not tested with {what} (tested: jax "
        f"{', '.join(TESTED_JAX_VERSIONS)}, each with the jaxlib of the same version). It "
        "should work; a feature whose JAX internals moved switches itself off with a "
        "JaxCompatWarning, and `python -m jax_cpu_mpi info` lists which are active.")


_warned = False


def warn_if_untested() -> None:
    """Warn once per process if this JAX is not in :data:`TESTED_JAX_VERSIONS`."""
    global _warned
    message = untested_message(jax.__version__, jaxlib_version())
    if message is None or _warned:
        return
    _warned = True
    warnings.warn(message, UntestedJaxWarning, stacklevel=4)
