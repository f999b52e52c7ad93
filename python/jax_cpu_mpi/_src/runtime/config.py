"""Runtime configuration, from environment variables or :func:`configure`.

=================================  ==========  ================================================
Environment variable               Default     Meaning
=================================  ==========  ================================================
``JAX_CPU_MPI_RECV_TIMEOUT``       ``300``     Seconds a precv waits for its message before it
                                               fails with an error naming the op and the peer.
``JAX_CPU_MPI_MAX_INFLIGHT_BYTES`` ``1GiB``    Bytes of MPI sends copied and not yet received.
                                               A psend beyond it waits for older sends first.
``JAX_CPU_MPI_EXIT_TIMEOUT``       ``60``      Seconds the process waits at exit for its
                                               undelivered MPI sends before MPI finalizes.
``JAX_CPU_MPI_ABORT_ON_ERROR``     ``1``       In an MPI job (once MPI is attached), an uncaught
                                               Python exception aborts the whole job
                                               (``MPI_Abort``) instead of leaving the other
                                               ranks waiting for this one forever.
``JAX_CPU_MPI_GPU_PARITY``         ``1``       ``1``: reject at lowering what XLA GPU rejects
                                               at compile time (cyclic pairs in one op,
                                               unmatched psend/precv). ``0``: run every
                                               pattern the CPU transport can run.
``JAX_CPU_MPI_FAST_DISPATCH``      ``1``       ``1``: a jitted CPU program with psend/precv
                                               that XLA never runs inline (2+ devices of
                                               this process, or 1000+ flops) runs through
                                               JAX's C++ dispatch like any other
                                               (``jax.effects_barrier()`` then does not wait
                                               for it: block on its outputs). ``0``: JAX's
                                               Python dispatch of effectful programs.
=================================  ==========  ================================================
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """Parse ``"1073741824"``, ``"512MiB"``, ``"1G"``, ``"64k"`` into a byte count."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not match:
        raise ValueError(f"cannot parse a byte count from {text!r} (examples: 1048576, 64MiB, 1G)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


@dataclass(frozen=True)
class Config:
    """The runtime settings of jax_cpu_mpi."""

    #: Seconds a precv waits for a matching psend before raising.
    recv_timeout: float = 300.0
    #: Bound on the bytes of undelivered MPI sends held by this process.
    max_inflight_bytes: int = 1 << 30
    #: Seconds to wait at interpreter exit for undelivered MPI sends.
    exit_timeout: float = 60.0
    #: Reject, when a program is lowered, the psend/precv patterns XLA GPU rejects.
    gpu_parity: bool = True
    #: In an MPI job, abort the job on an uncaught Python exception.
    abort_on_error: bool = True
    #: Dispatch jitted CPU programs with psend/precv that XLA never runs inline (2+ devices of
    #: this process, or 1000+ flops) through JAX's C++ fast path (see dispatch/fast_path.py).
    fast_dispatch: bool = True

    def __post_init__(self) -> None:
        if not self.recv_timeout > 0:
            raise ValueError(f"recv_timeout must be > 0 seconds, got {self.recv_timeout}")
        if not self.max_inflight_bytes > 0:
            raise ValueError(f"max_inflight_bytes must be > 0, got {self.max_inflight_bytes}")
        if not self.exit_timeout >= 0:
            raise ValueError(f"exit_timeout must be >= 0 seconds, got {self.exit_timeout}")


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env_bool(name: str, default: bool, meaning: str = "use 1 or 0") -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off (any case), ``default`` when
    unset or empty; ValueError naming the variable, the value and ``meaning`` otherwise."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a boolean ({meaning})")


#: Environment variable that turns automatic registration off (``import jax_cpu_mpi`` and
#: JAX's plugin discovery alike); ``jax_cpu_mpi.install()`` still registers everything.
DISABLE_ENV = "JAX_CPU_MPI_DISABLE"


def disabled() -> bool:
    """Whether :data:`DISABLE_ENV` asks for no automatic registration."""
    return _env_bool(DISABLE_ENV, False, "use 1 to disable jax_cpu_mpi's automatic "
                     "registration, 0 or unset to keep it")


def from_environment() -> Config:
    """The configuration described by the ``JAX_CPU_MPI_*`` environment variables."""
    inflight = os.environ.get("JAX_CPU_MPI_MAX_INFLIGHT_BYTES")
    try:
        max_inflight = parse_bytes(inflight) if inflight else Config.max_inflight_bytes
    except ValueError as e:
        raise ValueError(f"JAX_CPU_MPI_MAX_INFLIGHT_BYTES: {e}") from None
    return Config(
        recv_timeout=_env_float("JAX_CPU_MPI_RECV_TIMEOUT", Config.recv_timeout),
        max_inflight_bytes=max_inflight,
        exit_timeout=_env_float("JAX_CPU_MPI_EXIT_TIMEOUT", Config.exit_timeout),
        gpu_parity=_env_bool("JAX_CPU_MPI_GPU_PARITY", Config.gpu_parity),
        abort_on_error=_env_bool("JAX_CPU_MPI_ABORT_ON_ERROR", Config.abort_on_error),
        fast_dispatch=_env_bool("JAX_CPU_MPI_FAST_DISPATCH", Config.fast_dispatch),
    )


_current: Config | None = None


def current() -> Config:
    """The configuration in force."""
    global _current
    if _current is None:
        _current = from_environment()
    return _current


def configure(**changes: float | int | bool) -> Config:
    """Change settings for this process, e.g. ``configure(recv_timeout=30)``.

    Takes effect for every psend/precv executed afterwards (compiled programs included).
    """
    global _current
    from jax_cpu_mpi import _jax_cpu_mpi as ext

    new = replace(current(), **changes)  # type: ignore[arg-type]
    ext.configure(new.recv_timeout, new.max_inflight_bytes)
    _current = new
    return new


@contextlib.contextmanager
def overrides(**changes: float | int | bool) -> Iterator[Config]:
    """Temporarily change settings: ``with overrides(gpu_parity=False): ...``."""
    before = current()
    try:
        yield configure(**changes)
    finally:
        configure(**{f.name: getattr(before, f.name) for f in fields(before)})


def apply() -> None:
    """Push the current configuration into the extension."""
    from jax_cpu_mpi import _jax_cpu_mpi as ext

    cfg = current()
    ext.configure(cfg.recv_timeout, cfg.max_inflight_bytes)
