"""jax_cpu_mpi's runtime settings: ``JAX_CPU_MPI_*`` environment variables, or
:func:`configure` / :func:`overrides` in the program (the table of settings is in
:mod:`jax_cpu_mpi._src.runtime.config`)."""

from jax_cpu_mpi._src.runtime.config import (
    VARIABLES,
    Config,
    ConfigError,
    ConfigWarning,
    Variable,
    check_environment,
    configure,
    current,
    from_environment,
    markdown_table,
    overrides,
    parse_bytes,
)

__all__ = ["VARIABLES", "Config", "ConfigError", "ConfigWarning", "Variable",
           "check_environment", "configure", "current", "from_environment", "markdown_table",
           "overrides", "parse_bytes"]
