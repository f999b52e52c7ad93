"""Every use of JAX private modules, in one place.

jax_cpu_mpi hooks into JAX where no public API exists (primitive lowerings and batching
rules). Keeping those imports here means a JAX upgrade breaks one file, and the tests in
``tests/test_compat.py`` say which name moved.
"""

from __future__ import annotations

from jax._src import core as core
from jax._src import mesh as mesh_lib
from jax._src.interpreters import batching as batching
from jax._src.interpreters import mlir as mlir
from jax._src.lax import parallel as parallel
from jax._src.lib.mlir.dialects import hlo as hlo
from jax._src.sharding_impls import SPMDAxisContext as SPMDAxisContext

psend_p = parallel.psend_p
precv_p = parallel.precv_p

#: JAX's own computation of source-target pairs (with its validation and its
#: ``ValueError`` for duplicate sources/destinations), shared by ppermute/psend/precv.
pcollectives_lowering_common = parallel._pcollectives_lowering_common

__all__ = [
    "SPMDAxisContext",
    "batching",
    "core",
    "hlo",
    "mesh_lib",
    "mlir",
    "parallel",
    "pcollectives_lowering_common",
    "precv_p",
    "psend_p",
]
