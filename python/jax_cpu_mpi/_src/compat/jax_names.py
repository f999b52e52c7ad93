"""The private JAX names jax_cpu_mpi uses, one section per feature (the machinery is in
:mod:`.registry`).

Every other module of jax_cpu_mpi takes a private JAX name from here (through
``jax_cpu_mpi._src.compat``), never from ``jax._src`` itself.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any

from .registry import (
    Feature,
    Missing,
    _need_all,
    available,
    feature,
    has_params,
    is_callable,
    is_instance_of,
    is_module,
    is_primitive,
    is_type,
    mark_not_needed,
    resolve,
)
from .versions import has_gloo_cache_hang, jaxlib_version

# =========================================================================================
# Sections: one per feature. Add new features in a section of their own, at the end.
# =========================================================================================

# ------------------------------------------------------------- psend/precv CPU lowerings

LOWERINGS = feature(
    "lowerings", "the CPU lowerings of psend/precv",
    when_off="psend/precv on CPU raise JAX's own NotImplementedError, as without jax_cpu_mpi")

#: JAX's modules we reach into. (MLIR's ``ir``/``hlo`` are jaxlib's MLIR bindings, which
#: JAX re-exports.)
mlir = LOWERINGS.need("jax._src.interpreters.mlir", check=is_module)
parallel = LOWERINGS.need("jax._src.lax.parallel", check=is_module)
ir = LOWERINGS.need("jax._src.lib.mlir:ir", check=is_module)
hlo = LOWERINGS.need("jax._src.lib.mlir.dialects:hlo", check=is_module)

# The primitives the lowerings attach to are those of ops/primitives.py: JAX's
# psend_p/precv_p while JAX has them, ours after (section "own psend/precv primitives").
#: JAX's own computation of source-target pairs (with its validation and its
#: ``ValueError`` for duplicate sources/destinations), shared by ppermute/psend/precv.
pcollectives_lowering_common = LOWERINGS.need(
    "jax._src.lax.parallel:_pcollectives_lowering_common",
    check=has_params("ctx", "axis_name", "perm", "op_name"))
SPMDAxisContext = LOWERINGS.need("jax._src.sharding_impls:SPMDAxisContext", check=is_type)
get_concrete_mesh = LOWERINGS.need("jax._src.mesh:get_concrete_mesh", check=is_callable)
register_lowering = LOWERINGS.need(
    "jax._src.interpreters.mlir:register_lowering", check=has_params("prim", "rule", "platform"))
ShapedArray = LOWERINGS.need("jax._src.core:ShapedArray", check=is_type)

# ------------------------------------------------------------------- GPU-parity check

GPU_PARITY = feature(
    "gpu_parity", "the GPU-parity check of psend/precv programs", requires=("lowerings",),
    when_off="psend/precv programs that XLA GPU refuses to compile are not rejected at "
             "lowering on CPU (they may run, or fail after recv_timeout)")

#: The module whose ``lower_jaxpr_to_module`` jit lowers every program through (we wrap it).
lower_jaxpr_to_module = GPU_PARITY.need(
    "jax._src.interpreters.mlir:lower_jaxpr_to_module",
    check=has_params("module_name", "jaxpr", "platforms"))
#: The effect psend and precv carry; jit, shard_map and control flow propagate it, so a
#: program without it has no psend/precv (the parity check skips such programs).
single_side_collective_effect = GPU_PARITY.need(
    "jax._src.lax.parallel:single_side_collective_effect")
_need_all([GPU_PARITY], "jax._src.lib.mlir:ir", check=is_module)
#: A context with JAX's dialects (StableHLO, Shardy...) registered: ``jax_cpu_mpi.check``
#: parses the module of a ``jax.export.Exported`` in it.
make_ir_context = GPU_PARITY.need("jax._src.interpreters.mlir:make_ir_context",
                                  check=is_callable)

# ------------------------------------------- precvs that keep their psend's operand alive

KEPT_OPERANDS = feature(
    "kept_operands", "precvs that keep their psend's operand alive (a psend then returns "
    "while its receiver copies)", requires=("lowerings",),
    when_off="every psend finishes its send before it returns (correct, but a device that "
             "sends waits for its receiver's copy instead of going on with its own work)")
_need_all([KEPT_OPERANDS], "jax._src.interpreters.mlir:lower_jaxpr_to_module",
          check=has_params("module_name", "jaxpr", "platforms"))
_need_all([KEPT_OPERANDS], "jax._src.lax.parallel:single_side_collective_effect")
_need_all([KEPT_OPERANDS], "jax._src.lib.mlir:ir", check=is_module)

# --------------------------------------------------- optimization_barrier over tokens

BARRIER_TOKENS = feature(
    "barrier_tokens", "optimization_barrier over tokens on CPU", requires=("lowerings",),
    when_off="jax.lax.optimization_barrier over tokens fails to lower on CPU, as in plain JAX")

#: optimization_barrier and JAX's lowering rule for it (lowering/barrier_tokens.py wraps it).
optimization_barrier_p = BARRIER_TOKENS.need(
    "jax._src.lax.lax:optimization_barrier_p", check=is_primitive)
optimization_barrier_lowering = BARRIER_TOKENS.need(
    "jax._src.lax.lax:_optimization_barrier_lowering_rule", check=has_params("ctx"))
abstract_token = BARRIER_TOKENS.need("jax._src.core:abstract_token")
lower_with_sharding_in_types = BARRIER_TOKENS.need(
    "jax._src.interpreters.mlir:lower_with_sharding_in_types", check=is_callable)
dense_int_array = BARRIER_TOKENS.need(
    "jax._src.interpreters.mlir:dense_int_array", check=is_callable)
_need_all([BARRIER_TOKENS], "jax._src.core:ShapedArray", check=is_type)
_need_all([BARRIER_TOKENS], "jax._src.lib.mlir.dialects:hlo", check=is_module)

# ------------------------------------------------------------------- batching rules
# One feature per rule (``batching:<primitive>``), so that a moved primitive switches off
# only its own rule. The rules live in batching/.

_BATCHING_OFF = ("jax.vmap of {what} fails as in plain JAX (NotImplementedError or JAX's "
                 "own rule)")


def _batching_feature(prim: str, what: str, *, requires: Iterable[str] = ()) -> Feature:
    f = feature(f"batching:{prim}", f"the batching rule of {prim}", requires=requires,
                when_off=_BATCHING_OFF.format(what=what))
    f.need("jax._src.interpreters.batching:fancy_primitive_batchers",
           check=is_instance_of("builtins:dict"))
    return f


B_ALL_GATHER_REDUCED = _batching_feature(
    "all_gather_reduced", "all_gather(..., to='reduced')")
B_UNREDUCED_REDUCE_SCATTER = _batching_feature(
    "unreduced_reduce_scatter", "the transpose of all_gather(..., to='reduced')")
B_UNREDUCED_PSUM = _batching_feature("unreduced_psum", "psum of an unreduced value")
B_UNREDUCED_PMAX = _batching_feature("unreduced_pmax", "pmax of an unreduced value")
B_UNREDUCED_PMIN = _batching_feature("unreduced_pmin", "pmin of an unreduced value")
B_PREDUCED = _batching_feature("preduced", "pcast(..., to='reduced')")
B_VARY_UNREDUCED_CAST = _batching_feature(
    "vary_unreduced_cast", "pcast(..., to='unreduced') of a varying value")
B_REDUCED_VARY_CAST = _batching_feature(
    "reduced_vary_cast", "pcast(..., to='varying') of a reduced value")
B_PSEND = _batching_feature("psend", "psend (JAX lends it ppermute's rule)")
B_PRECV = _batching_feature("precv", "precv (JAX lends it ppermute's rule)")

#: The rule table: ``fancy_primitive_batchers[primitive] = rule``.
fancy_primitive_batchers = B_ALL_GATHER_REDUCED.need(
    "jax._src.interpreters.batching:fancy_primitive_batchers",
    check=is_instance_of("builtins:dict"))

all_gather_reduced_p = B_ALL_GATHER_REDUCED.need(
    "jax._src.lax.parallel:all_gather_reduced_p", check=is_primitive)
unreduced_reduce_scatter_p = _need_all(
    [B_UNREDUCED_REDUCE_SCATTER, B_ALL_GATHER_REDUCED],
    "jax._src.lax.parallel:unreduced_reduce_scatter_p", check=is_primitive)
unreduced_psum_p = B_UNREDUCED_PSUM.need(
    "jax._src.lax.parallel:unreduced_psum_p", check=is_primitive)
#: Only JAX >= 0.12 has unreduced pmax/pmin (their features are "not needed" before).
unreduced_pmax_p = B_UNREDUCED_PMAX.need(
    "jax._src.lax.parallel:unreduced_pmax_p", check=is_primitive, optional=True)
unreduced_pmin_p = B_UNREDUCED_PMIN.need(
    "jax._src.lax.parallel:unreduced_pmin_p", check=is_primitive, optional=True)
preduced_p = B_PREDUCED.need("jax._src.lax.parallel:preduced_p", check=is_primitive)
vary_unreduced_cast_p = _need_all(
    [B_VARY_UNREDUCED_CAST, B_UNREDUCED_REDUCE_SCATTER, B_UNREDUCED_PSUM, B_UNREDUCED_PMAX,
     B_UNREDUCED_PMIN], "jax._src.lax.parallel:vary_unreduced_cast_p", check=is_primitive)
reduced_vary_cast_p = B_REDUCED_VARY_CAST.need(
    "jax._src.core:reduced_vary_cast_p", check=is_primitive)
#: ppermute's batcher, which JAX lends to psend/precv (how we recognise JAX's rule).
ppermute_batcher = _need_all([B_PSEND, B_PRECV], "jax._src.lax.parallel:_ppermute_batcher",
                             check=is_callable)
_need_all([B_PRECV], "jax._src.core:ShapedArray", check=is_type)

# ------------------------------------------- vmap from outside a reduced/unreduced shard_map
# JAX's vmap machinery indexes PartitionSpecs (``spec[i]``, ``*spec``), which JAX refuses for
# a spec with reduced/unreduced sets; batching/outer_vmap.py wraps the three functions that
# do it. Each is a feature of its own, so that JAX fixing one makes only ours step aside.

_OUTER_OFF = ("jax.vmap of {what} fails as in plain JAX (ValueError: Using pspec[...] is "
              "dangerous when PartitionSpec has non-empty unreduced/reduced set)")


def _has_shard_map_batcher(value: Any) -> str | None:
    rule = getattr(value, "process_shard_map", None)
    if rule is None:
        return "has no process_shard_map"
    return has_params("trace", "prim", "fun", "in_tracers", "mesh", "in_specs")(rule)


B_SHARD_MAP = feature(
    "batching:shard_map", "vmap of a shard_map whose in_specs/out_specs carry reduced/"
    "unreduced sets", when_off=_OUTER_OFF.format(
        what="a shard_map with reduced/unreduced in_specs or out_specs"))
#: Where JAX's shard_map batcher (and jit's) inserts the batch dimension into a spec.
pxla = B_SHARD_MAP.need("jax._src.interpreters.pxla", check=is_module)
jax_batch_spec = B_SHARD_MAP.need("jax._src.interpreters.pxla:batch_spec",
                                  check=has_params("spec", "dim", "val"))
#: The trace whose ``process_shard_map`` is JAX's shard_map batcher.
BatchTrace = B_SHARD_MAP.need("jax._src.interpreters.batching:BatchTrace",
                              check=_has_shard_map_batcher)

B_VMAP_IN_AXES = feature(
    "batching:vmap_in_axes", "vmap over arguments whose sharding is reduced/unreduced",
    when_off=_OUTER_OFF.format(what="an argument typed reduced/unreduced (in_axes not None)"))
jax_api = B_VMAP_IN_AXES.need("jax._src.api", check=is_module)
_need_all([B_VMAP_IN_AXES], "jax._src.api:_mapped_axis_spec",
          check=has_params("args_flat", "in_axes_flat"))

B_BROADCAST = feature(
    "batching:broadcast", "an unbatched reduced/unreduced value given a batch dimension "
    "under vmap (a scan carry, a vmap(grad) cotangent)",
    when_off=_OUTER_OFF.format(what="a program where an unbatched reduced/unreduced value "
                                    "meets a batched one"))
batching_module = B_BROADCAST.need("jax._src.interpreters.batching", check=is_module)
_need_all([B_BROADCAST], "jax._src.interpreters.batching:broadcast",
          check=has_params("x", "sz", "axis", "mesh_axis"))
spmd_names_insert_pvary = B_BROADCAST.need(
    "jax._src.interpreters.batching:spmd_names_insert_pvary", check=is_callable)



def unwrap_batcher(rule: Any) -> Any:
    """The function behind a registered batcher, through partials and JAX's shims.

    ``batching.primitive_batchers[p] = f`` registers a closure around ``f`` whose free
    variable is named ``batcher`` (a detail of JAX's, hence here); this returns ``f``.
    """
    seen = 0
    while rule is not None and seen < 8:
        seen += 1
        if isinstance(rule, functools.partial):
            rule = rule.func
            continue
        code = getattr(rule, "__code__", None)
        closure = getattr(rule, "__closure__", None)
        if code is not None and closure and "batcher" in code.co_freevars:
            rule = closure[code.co_freevars.index("batcher")].cell_contents
            continue
        break
    return rule


# ------------------------------------------------------ diagnostics (info) of lowerings

LOWERING_TABLE = feature(
    "info:lowering_table", "reading JAX's table of CPU lowerings for `info`",
    when_off="`info` cannot confirm that our psend/precv lowerings are the registered ones")

_platform_specific_lowerings = LOWERING_TABLE.need(
    "jax._src.interpreters.mlir:_platform_specific_lowerings",
    check=is_instance_of("builtins:dict"))


def platform_lowering(primitive: Any, platform: str) -> Any:
    """The lowering rule registered for ``primitive`` on ``platform`` (None if none or
    unknown)."""
    if not available(_platform_specific_lowerings):
        return None
    return _platform_specific_lowerings.get(platform, {}).get(primitive)


# ------------------------------------------------------------------- cluster detection
# The launchers' cluster environment (jax.distributed.initialize() under mpirun) and the
# MPI runtime's exit from a job that lost a peer.


def _is_cluster_env_base(value: Any) -> str | None:
    if not isinstance(value, type):
        return f"not a class ({type(value).__name__})"
    methods = ("is_env_present", "get_coordinator_address", "get_process_count",
               "get_process_id", "get_local_process_id", "auto_detect_unset_distributed_params")
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        return f"has no {', '.join(missing)}"
    if not isinstance(getattr(value, "_cluster_types", None), list):
        return "its registry of subclasses (_cluster_types) is not a list"
    return None


def _is_distributed_state(value: Any) -> str | None:
    missing = [a for a in ("client", "service", "preemption_sync_manager")
               if not hasattr(value, a)]
    return f"has no {', '.join(missing)}" if missing else None


CLUSTERS = feature(
    "clusters",
    "jax.distributed.initialize() without arguments under MPICH's and Open MPI 5's mpirun",
    when_off="Under those launchers call jax.distributed.initialize("
             "cluster_detection_method='mpi4py'), or pass coordinator_address, num_processes "
             "and process_id")
#: JAX's base class of cluster environments: a subclass joins jax.distributed.initialize()'s
#: detection when it is defined (``__init_subclass__`` appends it to ``_cluster_types``).
cluster_env_base = CLUSTERS.need("jax._src.clusters:ClusterEnv", check=_is_cluster_env_base)


def registered_cluster_envs() -> list[type]:
    """The cluster environments JAX's detection tries, in order (the check above made sure
    the registry is a list)."""
    return list(cluster_env_base._cluster_types)

EXIT_FROM_BROKEN_JOB = feature(
    "exit_from_broken_job",
    "a prompt exit from an MPI job that lost a peer, without JAX's distributed shutdown",
    when_off="A process leaving a job whose peer is unreachable still waits in JAX's "
             "distributed shutdown until JAX's heartbeat timeout (100 s by default), and is "
             "then aborted by JAX")
#: JAX's distributed-runtime state (``client``, ``service``, ``preemption_sync_manager``).
distributed_state = EXIT_FROM_BROKEN_JOB.need("jax._src.distributed:global_state",
                                              check=_is_distributed_state)



# ----------------------------------------------------------- own psend/precv primitives
# JAX 0.12 deprecates jax.lax.psend/precv; a later JAX drops them with psend_p/precv_p.
# jax_cpu_mpi.psend/precv (ops/p2p.py) bind JAX's primitives while JAX has them, and primitives
# of our own (ops/own_primitives.py) after: JAX's primitives are looked up here WITHOUT being a
# need of any feature (their absence is what the "own_primitives" feature is for).

#: JAX's primitives, or a Missing where this JAX has dropped them.
jax_psend_p, _ = resolve("jax._src.lax.parallel:psend_p", is_primitive)
jax_precv_p, _ = resolve("jax._src.lax.parallel:precv_p", is_primitive)
#: JAX's single-side-collective effect (psend/precv carry it), or a Missing.
jax_single_side_collective_effect, _ = resolve(
    "jax._src.lax.parallel:single_side_collective_effect")

OWN_PRIMITIVES = feature(
    "own_primitives", "psend/precv primitives of jax_cpu_mpi's own, for a JAX without them",
    when_off="jax_cpu_mpi.psend/precv raise a RuntimeError naming the missing JAX name")


def _has_send_recv(module: Any) -> str | None:
    lacking = [n for n in ("SendOp", "RecvOp", "create_token") if not hasattr(module, n)]
    return f"it lacks {', '.join(lacking)}" if lacking else None


#: What our primitives are built from.
Primitive = OWN_PRIMITIVES.need("jax._src.core:Primitive", check=is_type)
apply_primitive = OWN_PRIMITIVES.need("jax._src.dispatch:apply_primitive", check=is_callable)
NamedAxisEffect = OWN_PRIMITIVES.need("jax._src.core:NamedAxisEffect", check=is_type)
check_axis_names = OWN_PRIMITIVES.need(
    "jax._src.lax.parallel:_check_axis_names", check=has_params("axes", "api_name"))
dense_int_elements = OWN_PRIMITIVES.need(
    "jax._src.interpreters.mlir:dense_int_elements", check=is_callable)
aval_to_ir_type = OWN_PRIMITIVES.need(
    "jax._src.interpreters.mlir:aval_to_ir_type", check=is_callable)
_need_all([OWN_PRIMITIVES], "jax._src.core:abstract_token")
_need_all([OWN_PRIMITIVES], "jax._src.interpreters.mlir", check=is_module)
_need_all([OWN_PRIMITIVES], "jax._src.interpreters.mlir:register_lowering",
          check=has_params("prim", "rule", "platform"))
_need_all([OWN_PRIMITIVES], "jax._src.lib.mlir.dialects:hlo", check=is_module)
_need_all([OWN_PRIMITIVES], "jax._src.lib.mlir.dialects:hlo", check=_has_send_recv)
_need_all([OWN_PRIMITIVES], "jax._src.lax.parallel:_pcollectives_lowering_common",
          check=has_params("ctx", "axis_name", "perm", "op_name"))
_need_all([OWN_PRIMITIVES], "jax._src.sharding_impls:SPMDAxisContext", check=is_type)
if not available(jax_single_side_collective_effect):
    # JAX dropped the effect too: ours (an equivalent class) must be registered where JAX
    # registered its own, so that jit, loops and lowering accept it.
    Effect = OWN_PRIMITIVES.need("jax._src.core:Effect", check=is_type)
    control_flow_allowed_effects = OWN_PRIMITIVES.need(
        "jax._src.effects:control_flow_allowed_effects")
    lowerable_effects = OWN_PRIMITIVES.need("jax._src.effects:lowerable_effects")



def own_single_side_collective_effect() -> Any:
    """The effect our primitives carry where JAX has dropped its own (made once)."""
    global _own_effect
    if _own_effect is None:
        from .effect import make_single_side_collective_effect

        _own_effect = make_single_side_collective_effect(
            Effect, [r for r in (control_flow_allowed_effects, lowerable_effects) if available(r)])
    return _own_effect


_own_effect: Any = None

if (not available(jax_psend_p) and not available(jax_single_side_collective_effect)
        and OWN_PRIMITIVES.usable):
    # JAX dropped psend/precv AND their effect: our primitives carry an effect of our own
    # (ops/own_primitives.py), and the GPU-parity check recognises psend/precv programs by the
    # effect they carry, so it looks for ours (the missing JAX effect is then no problem of
    # gpu_parity's). While JAX has its primitives, a missing effect keeps gpu_parity off:
    # JAX's primitives would carry an effect we cannot see.
    single_side_collective_effect = own_single_side_collective_effect()

    GPU_PARITY.problems[:] = [p for p in GPU_PARITY.problems
                              if "single_side_collective_effect" not in p]

#: What JAX's psend does to its operand (marks it varying over the axes, the vma type
#: system); jax_cpu_mpi.psend does the same, through public pcast where JAX lacks it.
insert_collective_pvary, _ = resolve("jax._src.lax.parallel:insert_collective_pvary",
                                     is_callable)


def register_source_exclusion(path: str) -> None:
    """Treat ``path`` as JAX-internal in source locations and filtered tracebacks, as JAX's
    own files are, so that a psend traced through our wrapper is located at the user's line
    (parity messages, lowered locations, errors). A no-op on a JAX without these hooks."""
    for module_path in ("jax._src.source_info_util", "jax._src.traceback_util"):
        register, _ = resolve(f"{module_path}:register_exclusion", is_callable)
        if available(register):
            register(path)


# ------------------------------------------- JAX's C++ dispatch for psend/precv programs

FAST_DISPATCH = feature(
    "fast_dispatch", "jitted CPU programs with psend/precv dispatched by JAX's C++ fast path "
    "(a Python dispatch less per call); one-device programs get the flops that make XLA run them "
    "on a device thread", requires=("lowerings",),
    when_off="every call of a jitted program with psend/precv goes through JAX's Python "
             "dispatch of effectful programs (correct, slower per call)")


def _executes_replicated(value: Any) -> str | None:
    """A check: a class whose ``__init__`` takes the unordered effects 6th, after ``self``,
    the executable, its name, the backend and the in/out handlers."""
    if not isinstance(value, type):
        return f"not a class ({type(value).__name__})"
    params = list(inspect.signature(value.__init__).parameters)[:7]
    expected = ["self", "xla_executable", "name", "backend", "in_handler", "out_handler",
                "unordered_effects"]
    return None if params == expected else f"its __init__ parameters start {params}"


#: What runs a compiled program; a true ``has_unordered_effects`` keeps jit off its C++
#: fast path (dispatch/fast_path.py wraps its ``__init__``).
ExecuteReplicated = FAST_DISPATCH.need("jax._src.interpreters.pxla:ExecuteReplicated",
                                       check=_executes_replicated)
#: XLA CPU runs a single-device program inline (in the calling thread) below this many flops
#: of its cost analysis (``cheap_computation_`` in xla/pjrt/cpu/cpu_client.cc): a fact of
#: XLA's, not an API, so it lives here with the names that move between releases.
XLA_CPU_INLINE_FLOPS = 1000
# The device-thread hint (dispatch/device_thread_hint.py) rewrites lowered CPU modules.
_need_all([FAST_DISPATCH], "jax._src.interpreters.mlir:lower_jaxpr_to_module",
          check=has_params("module_name", "jaxpr", "platforms"))
_need_all([FAST_DISPATCH], "jax._src.lib.mlir.dialects:hlo", check=is_module)

# ---------------------------------------------- pipeline: kept residuals, split backward

PIPELINE_SPLIT_BACKWARD = feature(
    "pipeline:split_backward", "pipelines with remat=False: a split backward (zero-bubble's "
    "input and weight cotangents) whose weight part reuses the input part's work",
    when_off="with remat=False the weight part of a split backward (ZeroBubble's W) "
             "recomputes the cotangents inside the chunk from the kept residuals; results "
             "are the same, W costs more")
#: Dead-code elimination of a jaxpr for chosen outputs: how the backward of a chunk is cut
#: into the part that forms its input's cotangent and the part that forms its parameters'.
dce_jaxpr = PIPELINE_SPLIT_BACKWARD.need(
    "jax._src.interpreters.partial_eval:dce_jaxpr",
    check=has_params("jaxpr", "used_outputs", "instantiate"))


def scan_layout(params: dict[str, Any], n_inputs: int
                ) -> tuple[int, int, dict[str, Any]] | None:
    """A scan equation's ``(consts, carries, lax.scan keywords)`` from its parameters: JAX
    0.10's ``num_consts`` / ``num_carry``, or JAX 0.12's ``ft_in`` (a flat tree of the
    consts, carries and xs); ``None`` where this JAX describes them otherwise (the pipeline
    then leaves that scan whole)."""
    keywords = {k: params[k] for k in ("length", "reverse", "unroll") if k in params}
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"]), keywords
    try:
        consts, carry, xs = (list(part) for part in
                             params["ft_in"].update(list(range(n_inputs))).unpack())
    except Exception:  # any other shape of this private parameter
        return None
    if consts + carry + xs != list(range(n_inputs)):
        return None
    return len(consts), len(carry), keywords

# ------------------------------------------------------ collectives over MPI (CPU lowerings)

COLLECTIVES = feature(
    "collectives", "psum/pmean/pmax/pmin/all_gather/psum_scatter/all_to_all between processes "
    "over MPI (JAX_CPU_MPI_COLLECTIVES)",
    requires=("lowerings",),
    when_off="collectives between processes run on JAX's gloo path, as without jax_cpu_mpi")
#: JAX's replica groups of a collective (partition ids, one list per group), with its
#: handling of axis_index_groups: the groups JAX's own lowering gives XLA.
replica_groups = COLLECTIVES.need(
    "jax._src.lax.parallel:_replica_groups",
    check=has_params("axis_ctx", "axis_name", "axis_index_groups"))
psum_p = COLLECTIVES.need("jax._src.lax.parallel:psum_p", check=is_primitive)
pmax_p = COLLECTIVES.need("jax._src.lax.parallel:pmax_p", check=is_primitive)
pmin_p = COLLECTIVES.need("jax._src.lax.parallel:pmin_p", check=is_primitive)
#: psum under shard_map's check_vma binds this one (a variant -> invariant psum).
psum_invariant_p = COLLECTIVES.need("jax._src.lax.parallel:psum_invariant_p",
                                    check=is_primitive)
#: all_gather (and its invariant / reduced forms), psum_scatter (and its unreduced form) and
#: all_to_all between processes over MPI (lowering/collectives.py).
all_gather_p = COLLECTIVES.need("jax._src.lax.parallel:all_gather_p", check=is_primitive)
all_gather_invariant_p = COLLECTIVES.need("jax._src.lax.parallel:all_gather_invariant_p",
                                          check=is_primitive)
all_gather_reduced_p = COLLECTIVES.need("jax._src.lax.parallel:all_gather_reduced_p",
                                        check=is_primitive)
reduce_scatter_p = COLLECTIVES.need("jax._src.lax.parallel:reduce_scatter_p",
                                    check=is_primitive)
unreduced_reduce_scatter_p = COLLECTIVES.need(
    "jax._src.lax.parallel:unreduced_reduce_scatter_p", check=is_primitive)
all_to_all_p = COLLECTIVES.need("jax._src.lax.parallel:all_to_all_p", check=is_primitive)
#: ppermute between processes goes as precv(psend(x)) (lowering/collectives.py).
ppermute_p = COLLECTIVES.need("jax._src.lax.parallel:ppermute_p", check=is_primitive)
_need_all([COLLECTIVES], "jax._src.core:abstract_token")
# all_gather / psum_scatter / all_to_all move their dimension to the front and back.
_need_all([COLLECTIVES], "jax._src.interpreters.mlir:aval_to_ir_type", check=is_callable)
_need_all([COLLECTIVES], "jax._src.interpreters.mlir:dense_int_array", check=is_callable)
#: JAX's platform-independent lowering rules: ours fall back to them (gloo on CPU).
default_lowerings = COLLECTIVES.need("jax._src.interpreters.mlir:_lowerings",
                                     check=is_instance_of("builtins:dict"))
_need_all([COLLECTIVES], "jax._src.sharding_impls:SPMDAxisContext", check=is_type)


def lowered_as_other_primitives(primitive: Any) -> bool:
    """Whether JAX rewrites ``primitive`` into other primitives before lowering.

    jax 0.12.1 made some collectives of unreduced values "high" primitives (an ``is_high`` /
    ``to_lojax`` pair on the instance): ``unreduced_reduce_scatter`` becomes ``psum_scatter``
    of the unreduced value's lowered form, and has no lowering rule of its own. Such a
    primitive reaches the lowering as the primitives it becomes, so their CPU lowerings over
    MPI cover it; one without a rule and without that rewrite is a JAX we do not know.
    """
    if not available(default_lowerings) or primitive in default_lowerings:
        return False
    return "to_lojax" in vars(primitive)
# The ordering pass (passes/ordered_collectives.py) runs in the lowering hook.
#: Shardy's MLIR bindings: the ordering pass chains sibling shard_maps (each a
#: ``sdy.manual_computation``) by one more replicated operand and result.
sdy = COLLECTIVES.need("jax._src.lib.mlir.dialects:sdy", check=is_module)
_need_all([COLLECTIVES], "jax._src.interpreters.mlir:lower_jaxpr_to_module",
          check=has_params("module_name", "jaxpr", "platforms"))
_need_all([COLLECTIVES], "jax._src.lib.mlir:ir", check=is_module)

# -------------------------------- gloo programs kept out of JAX's persistent cache (0.12.1)

GLOO_CACHE_GUARD = feature(
    "gloo_cache_guard", "programs of a multi-process job whose collectives are XLA's own "
    "(gloo) compiled anew instead of loaded from JAX's persistent compilation cache "
    "(jaxlib 0.12.1 hangs in such a program's first collective when it comes from the cache)",
    when_off="with JAX's persistent compilation cache on, a multi-process program whose "
             "collectives run on gloo hangs in its first collective when jaxlib 0.12.1 loads "
             "it from the cache: turn the cache off, or keep the collectives on MPI "
             "(JAX_CPU_MPI_COLLECTIVES=mpi, the default under an MPI launcher)")
if has_gloo_cache_hang(jaxlib_version()):
    #: JAX's lookup of a program in the persistent cache (``compile_or_get_cached`` calls
    #: it by its module-global name, so the wrapper in runtime/gloo_cache.py sees every one).
    compiler = GLOO_CACHE_GUARD.need("jax._src.compiler", check=is_module)
    _need_all([GLOO_CACHE_GUARD], "jax._src.compiler:_cache_read",
              check=has_params("module_name", "cache_key", "compile_options", "backend"))
else:
    compiler = Missing("jax._src.compiler", "not looked up: this jaxlib has no such hang")
    mark_not_needed(GLOO_CACHE_GUARD.name,
                    f"jaxlib {jaxlib_version()} runs gloo programs from the persistent cache")
