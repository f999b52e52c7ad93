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
from jax._src.lax import lax as lax_internal
from jax._src.lax import parallel as parallel
from jax._src.lib.mlir import ir as ir
from jax._src.lib.mlir.dialects import hlo as hlo
from jax._src.sharding_impls import SPMDAxisContext as SPMDAxisContext

psend_p = parallel.psend_p
precv_p = parallel.precv_p

# Batching (jax_cpu_mpi.batching): the primitives whose JAX batchers are placeholders,
# the rule table, and ppermute's batcher (which JAX lends to psend/precv).
fancy_primitive_batchers = batching.fancy_primitive_batchers
all_gather_reduced_p = parallel.all_gather_reduced_p
unreduced_reduce_scatter_p = parallel.unreduced_reduce_scatter_p
unreduced_psum_p = parallel.unreduced_psum_p
preduced_p = parallel.preduced_p
vary_unreduced_cast_p = parallel.vary_unreduced_cast_p
reduced_vary_cast_p = core.reduced_vary_cast_p
ppermute_batcher = parallel._ppermute_batcher

#: JAX's own computation of source-target pairs (with its validation and its
#: ``ValueError`` for duplicate sources/destinations), shared by ppermute/psend/precv.
pcollectives_lowering_common = parallel._pcollectives_lowering_common

#: The effect psend and precv carry; jit, shard_map and control flow propagate it, so a
#: program without it has no psend/precv (validation.py skips such programs).
single_side_collective_effect = parallel.single_side_collective_effect

#: optimization_barrier and JAX's lowering rule for it (_barrier_tokens.py wraps it).
optimization_barrier_p = lax_internal.optimization_barrier_p
optimization_barrier_lowering = lax_internal._optimization_barrier_lowering_rule


# --- Launch: cluster detection and the distributed runtime (cluster.py, mpi_runtime.py) ---
# Resolved defensively: a JAX that moved these names loses only `jax.distributed.initialize()`
# without arguments under mpirun (cluster_detection_method="mpi4py" still works) and the
# prompt exit from a broken job, never the import of jax_cpu_mpi.


def cluster_env_base() -> type | None:
    """JAX's ``ClusterEnv``: subclasses join ``jax.distributed.initialize()``'s detection
    when they are defined (``__init_subclass__``). None if this JAX has no usable one."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:
        return None
    needed = ("is_env_present", "get_coordinator_address", "get_process_count",
              "get_process_id", "get_local_process_id")
    if not all(hasattr(ClusterEnv, name) for name in needed):
        return None
    if not isinstance(getattr(ClusterEnv, "_cluster_types", None), list):
        return None
    return ClusterEnv


def distributed_state():
    """JAX's distributed-runtime state (``client``, ``service``, ``preemption_sync_manager``
    attributes), or None if this JAX keeps it elsewhere."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    state = getattr(distributed, "global_state", None)
    if state is None or not all(hasattr(state, name) for name in
                                ("client", "service", "preemption_sync_manager")):
        return None
    return state


def platform_lowering(primitive: core.Primitive, platform: str):
    """The lowering rule registered for ``primitive`` on ``platform`` (None if none)."""
    return mlir._platform_specific_lowerings.get(platform, {}).get(primitive)


__all__ = [
    "SPMDAxisContext",
    "all_gather_reduced_p",
    "batching",
    "cluster_env_base",
    "core",
    "distributed_state",
    "fancy_primitive_batchers",
    "hlo",
    "ir",
    "mesh_lib",
    "mlir",
    "optimization_barrier_lowering",
    "optimization_barrier_p",
    "parallel",
    "pcollectives_lowering_common",
    "platform_lowering",
    "ppermute_batcher",
    "precv_p",
    "preduced_p",
    "psend_p",
    "reduced_vary_cast_p",
    "unreduced_psum_p",
    "unreduced_reduce_scatter_p",
    "vary_unreduced_cast_p",
]
