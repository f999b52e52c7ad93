"""Programs with XLA's own collectives stay out of JAX's persistent cache on jaxlib 0.12.1.

With jaxlib 0.12.1, a multi-process program whose collectives run on gloo (XLA's CPU path
between processes) waits forever in its first collective when JAX loads it from the
persistent compilation cache (``jax_compilation_cache_dir``), on every process, with or
without jax_cpu_mpi (``scripts/jax_cache_gloo_hang.py`` shows it with JAX alone; jaxlib
0.12.0.1 runs the same program). Collectives lowered over MPI are custom calls and run from
the cache as they should; but some stay on gloo even under an MPI launcher (a dtype MPI
cannot reduce, a partially manual ``shard_map``, the collectives XLA's partitioner inserts
into a ``jax.jit`` with shardings, or ``JAX_CPU_MPI_COLLECTIVES=gloo``).

So on such a jaxlib, in a job of several processes, a program found in the cache whose
optimized HLO holds one of XLA's collectives is treated as not found: JAX compiles it as
on a cold cache (and stores it again). The first time a process does this it warns, naming
the program. Programs without such collectives, and every single-process job, keep the cache.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import jax

from jax_cpu_mpi._src import compat

#: An instruction of one of XLA's collectives in HLO text (``%x = f32[4] all-reduce(...)``,
#: the async ``-start`` forms too); instruction names (``%all-reduce.1``) are not followed
#: by a parenthesis.
_XLA_COLLECTIVE = re.compile(
    r"\s(?:all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|"
    r"collective-permute|collective-broadcast)(?:-start)?\(")


class GlooCacheWarning(UserWarning):
    """A program was compiled anew instead of loaded from JAX's persistent cache."""


def has_xla_collectives(hlo_texts: list[str]) -> bool:
    """Whether any of these HLO modules' texts holds one of XLA's collectives."""
    return any(_XLA_COLLECTIVE.search(text) for text in hlo_texts)


def _hlo_texts(executable: Any) -> list[str]:
    return [module.to_string() for module in executable.hlo_modules()]


_warned = False


def _guarded(cache_read: Any) -> Any:
    @functools.wraps(cache_read)
    def read(module_name: str, *args: Any, **kwargs: Any) -> Any:
        executable, compile_time = cache_read(module_name, *args, **kwargs)
        if (executable is None or not compat.GLOO_CACHE_GUARD.active
                or jax.process_count() == 1):
            return executable, compile_time
        try:
            gloo = has_xla_collectives(_hlo_texts(executable))
        except Exception as e:  # an executable without HLO modules: a JAX we do not know
            compat.failed_at_run_time(compat.GLOO_CACHE_GUARD.name, e)
            return executable, compile_time
        if not gloo:
            return executable, compile_time
        global _warned
        if not _warned:
            _warned = True
            warnings.warn(
                f"jax_cpu_mpi: '{module_name}' was found in JAX's persistent compilation "
                f"cache, but it has collectives of XLA's own (gloo), and jaxlib "
                f"{compat.jaxlib_version()} hangs in such a program's first collective when "
                "the program comes from the cache: it is compiled anew instead (so is every "
                "such program of this process; the others still load from the cache). "
                "Collectives lowered over MPI are not affected (`python -m jax_cpu_mpi "
                "info` lists which stay on gloo and why).", GlooCacheWarning, stacklevel=2)
        return None, None

    return read


def install() -> bool:
    """Wrap JAX's persistent-cache lookup (``compat.enable`` calls this only on a jaxlib with
    the hang: elsewhere the compat room declares the feature not needed)."""
    compat.wrap_once(compat.compiler, "_cache_read", "_jax_cpu_mpi_gloo_cache", _guarded)
    return True


__all__ = ["GlooCacheWarning", "has_xla_collectives", "install"]
