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
single_side_collective_effect = getattr(parallel, "single_side_collective_effect", None)

#: optimization_barrier and JAX's lowering rule for it (_barrier_tokens.py wraps it).
optimization_barrier_p = lax_internal.optimization_barrier_p
optimization_barrier_lowering = lax_internal._optimization_barrier_lowering_rule


def platform_lowering(primitive: core.Primitive, platform: str):
    """The lowering rule registered for ``primitive`` on ``platform`` (None if none)."""
    return mlir._platform_specific_lowerings.get(platform, {}).get(primitive)


__all__ = [
    "SPMDAxisContext",
    "all_gather_reduced_p",
    "batching",
    "core",
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
    "preduced_p",
    "reduced_vary_cast_p",
    "unreduced_psum_p",
    "unreduced_reduce_scatter_p",
    "vary_unreduced_cast_p",
]


# --------------------------------------------------------------------------------------
# psend / precv (jax_cpu_mpi.psend / precv, primitives.py, _own_primitives.py).
#
# JAX 0.12 deprecates jax.lax.psend / precv; a later JAX drops them. What jax_cpu_mpi needs
# to keep them working is resolved here, each name with a fallback: JAX's primitives (None
# where JAX has dropped them: primitives.py then defines ours), and what our own primitives
# and our public functions are built from.
from jax._src import dispatch as dispatch  # noqa: E402
from jax._src import effects as effects_lib  # noqa: E402

#: JAX's primitives, or None where JAX has dropped them.
jax_psend_p = getattr(parallel, "psend_p", None)
jax_precv_p = getattr(parallel, "precv_p", None)


def _own_check_axis_names(axes, api_name):
    """JAX's unbound-axis check (``parallel._check_axis_names``), for a JAX without it."""
    axis_env = core.get_axis_env()
    for name in axes:
        if not isinstance(name, int) and not axis_env.axis_exists(name):
            raise NameError(
                f"Found an unbound axis name: {name}. To fix this, please call {api_name} "
                "under `jax.shard_map`.")


#: ``check_axis_names(axes, api_name)``: NameError for an axis name not bound by shard_map.
check_axis_names = getattr(parallel, "_check_axis_names", _own_check_axis_names)


def _own_insert_collective_pvary(axis_name, x):
    """JAX's ``insert_collective_pvary``: mark ``x`` varying over ``axis_name`` (vma)."""
    import jax
    from jax._src import config as jax_config

    if not jax_config.auto_pcast.value or not jax_config._check_vma.value:
        return x
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    varying = core.typeof(x).vma
    missing = tuple(n for n in names if n not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


#: ``insert_collective_pvary(axis_name, x)``: what JAX's collectives do to their operand.
insert_collective_pvary = getattr(parallel, "insert_collective_pvary",
                                  _own_insert_collective_pvary)


def _own_single_side_collective_effect() -> core.Effect:
    """An effect like JAX's ``SingleSideCollectiveEffect``, for a JAX that dropped it."""

    class SingleSideCollectiveEffect(core.Effect):
        __str__ = lambda _: "one-sided communication"  # noqa: E731

        def __hash__(self):
            return hash(SingleSideCollectiveEffect)

        def __eq__(self, other):
            return isinstance(other, SingleSideCollectiveEffect)

    core.effects.control_flow_allowed_effects.add_type(SingleSideCollectiveEffect)
    effects_lib.lowerable_effects.add_type(SingleSideCollectiveEffect)
    return SingleSideCollectiveEffect()


#: Whether :data:`single_side_collective_effect` is JAX's (False: ours, JAX dropped it).
jax_has_single_side_effect = single_side_collective_effect is not None
if single_side_collective_effect is None:
    single_side_collective_effect = _own_single_side_collective_effect()

def register_source_exclusion(path: str) -> None:
    """Treat ``path`` as JAX-internal in source locations and filtered tracebacks, as JAX's
    own files are, so that a psend traced through our wrapper is located at the user's line
    (parity messages, lowered locations, errors). A no-op on a JAX without these hooks."""
    from jax._src import source_info_util, traceback_util

    for module in (source_info_util, traceback_util):
        register = getattr(module, "register_exclusion", None)
        if register is not None:
            register(path)


__all__ += [
    "check_axis_names",
    "dispatch",
    "effects_lib",
    "insert_collective_pvary",
    "jax_has_single_side_effect",
    "jax_precv_p",
    "jax_psend_p",
    "register_source_exclusion",
]
