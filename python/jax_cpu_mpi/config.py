"""jax_cpu_mpi's runtime settings: ``JAX_CPU_MPI_*`` environment variables, or
:func:`configure` / :func:`overrides` in the program (the table of settings is in
:mod:`jax_cpu_mpi._src.runtime.config`)."""

from jax_cpu_mpi._src.runtime.config import (
    Config,
    configure,
    current,
    from_environment,
    overrides,
    parse_bytes,
)

__all__ = ["Config", "configure", "current", "from_environment", "overrides", "parse_bytes"]
