"""The batching rules jax_cpu_mpi adds to JAX: :func:`status` says which are active, and
why the others are not (:data:`RULES` lists them)."""

from jax_cpu_mpi._src.batching.rules import PATCHES, RULES, status

__all__ = ["PATCHES", "RULES", "status"]
