"""CPU lowerings of ``psum`` / ``pmax`` / ``pmin`` (and so ``pmean``), ``all_gather``,
``psum_scatter`` and ``all_to_all`` between processes over MPI, and of ``ppermute`` between
processes as our ``precv(psend(x))`` (docs: "Collectives over MPI").

Each rule decides, when a program is lowered, between two lowerings:

* JAX's own (gloo between processes, XLA's in-process path within one), when the setting
  says ``gloo`` (or ``auto`` outside an MPI launch), when every group of the collective
  stays inside one process, or when MPI cannot reduce the combination exactly as XLA does
  (:data:`FALLBACKS`);
* otherwise the typed-FFI custom call ``jax_cpu_mpi_all_reduce(x, partition_id) -> out``
  (``cpp/ffi/collective_handlers.cc``): the group's devices in one process reduce among
  themselves, one MPI_Iallreduce per process on a communicator of the group's own, the
  result is shared in process; for all_gather / psum_scatter / all_to_all the custom call
  ``jax_cpu_mpi_exchange`` does the same with MPI_Iallgather(v) / MPI_Ireduce_scatter(_block)
  / MPI_Ialltoall(v), on the operand with the collective's dimension moved to the front.

The groups are JAX's own (``_replica_groups``: the mesh axes and ``axis_index_groups``), the
same partition numbering as psend/precv (:mod:`.topology`). Programs lowered for another
platform never see these rules (registered for ``cpu`` only).
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import jax
import numpy as np

from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.compat import ShapedArray, SPMDAxisContext, hlo, register_lowering
from jax_cpu_mpi._src.ffi.custom_calls import PRECV_TARGET, PSEND_TARGET
from jax_cpu_mpi._src.ffi.registration import register_targets
from jax_cpu_mpi._src.lowering import rules as p2p_rules
from jax_cpu_mpi._src.lowering.topology import partially_manual, partition_tables
from jax_cpu_mpi._src.runtime import config
from jax_cpu_mpi._src.runtime import mpi as mpi_runtime

#: ``all_reduce(x, partition_id) -> out`` over the groups of the attributes.
ALL_REDUCE_TARGET = "jax_cpu_mpi_all_reduce"
#: ``exchange(x, partition_id) -> out``: all_gather, reduce_scatter or all_to_all ("kind").
EXCHANGE_TARGET = "jax_cpu_mpi_exchange"
#: Every custom call of ours that the ordering pass chains.
TARGETS = (ALL_REDUCE_TARGET, EXCHANGE_TARGET)
#: ``collectives_end(last)``: the end of a program's chain of collectives (the ordering pass
#: adds it after the last one): a device that did not lead its last meeting resumes then
#: (``cpp/ffi/collective_handlers.cc``, Resumer), not a while later.
END_TARGET = "jax_cpu_mpi_collectives_end"

_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
#: The dtypes each reduction runs over MPI (reduced exactly as XLA does: integers wrap, float
#: max/min propagate NaN, bool max/min are or/and).
MPI_DTYPES: dict[str, tuple[str, ...]] = {
    "sum": ("float32", "float64", "complex64", "complex128", *_INTS),
    "max": ("float32", "float64", "bool", *_INTS),
    "min": ("float32", "float64", "bool", *_INTS),
}

#: What keeps JAX's own lowering, and why (``jax-cpu-mpi info`` shows it).
FALLBACKS: tuple[tuple[str, str], ...] = (
    ("float16, bfloat16, float8 and other narrow floats",
     "MPI has no reduction of them (an MPI operation of ours would not reduce as XLA does)"),
    ("psum of bool; pmax/pmin of complex", "MPI has no matching reduction"),
    ("psum_scatter of float16, bfloat16, bool and other dtypes psum keeps on gloo",
     "the same reductions as psum"),
    ("all_gather / all_to_all of sub-byte dtypes (int4, float4...)",
     "their bytes are packed differently"),
    ("all_gather / psum_scatter / all_to_all of more than 2 GiB in one group",
     "MPI counts and displacements are ints"),
    ("asynchronous collectives (is_async)", "XLA's asynchronous pair of ops"),
    ("axes that stay inside one process, in a mesh of one process",
     "XLA's in-process all-reduce is already direct"),
    ("positional (integer) axes in the same psum", "JAX reduces those itself, first"),
    ("a program traced with an abstract mesh only", "which process runs each device is unknown"),
    ("collectives (and ppermute) in a partially manual shard_map (axis_names= a subset of the "
     "mesh's axes)",
     "XLA's SPMD partitioner refuses the partition id by which our calls find their device"),
    ("an MPI without MPI_THREAD_MULTIPLE", "device threads would share MPI"),
)

_REDUCTIONS = {"psum": "sum", "psum_invariant": "sum", "pmax": "max", "pmin": "min",
               "reduce_scatter": "sum", "unreduced_reduce_scatter": "sum"}

#: ``{(primitive, dtype, how): count}`` of this process's lowerings ("mpi" or "gloo: why").
_decisions: collections.Counter[tuple[str, str, str]] = collections.Counter()


def decisions() -> dict[tuple[str, str, str], int]:
    """How this process lowered each collective so far: ``{(primitive, dtype, "mpi" or
    "gloo: reason"): count}``."""
    return dict(_decisions)


def resolved_setting() -> str:
    """``"mpi"`` or ``"gloo"``: what ``JAX_CPU_MPI_COLLECTIVES`` means in this process."""
    setting = config.current().collectives
    if setting == "auto":  # MPI where an MPI launcher started this process
        return "mpi" if mpi_runtime.launched_by_mpi() else "gloo"
    return setting


def _thread_multiple() -> bool:
    MPI = mpi_runtime.import_mpi4py()
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def _attach(name: str, tables: Any) -> str | None:
    """Attach MPI (collective over the ranks, once). Under ``auto`` a job MPI cannot serve
    (its ranks are not JAX's processes) keeps gloo, as it ran before; ``mpi`` raises."""
    try:
        mpi_runtime.ensure_attached(name, int(np.unique(tables.device_process).size))
    except mpi_runtime.MpiSetupError:
        if config.current().collectives == "mpi":
            raise
        return "MPI cannot serve this job (see JAX_CPU_MPI_COLLECTIVES=mpi for why)"
    return None


def _padded(groups: list[list[int]]) -> np.ndarray:
    rows = list(itertools.zip_longest(*groups, fillvalue=-1))
    return np.asarray(rows, dtype=np.int64).T.copy() if rows else np.zeros((0, 0), np.int64)


def _spmd_context(ctx: Any, name: str) -> Any:
    """``(axis_context, tables)`` of the ``shard_map`` that ``name`` is lowered in, or why
    no call of ours can run there: every plan (collectives and ppermute) goes through it."""
    axis_context = ctx.module_context.axis_context
    if not isinstance(axis_context, SPMDAxisContext):
        return "not in an SPMD (shard_map) context"
    if partially_manual(axis_context):
        return _PARTIALLY_MANUAL
    try:
        return axis_context, partition_tables(axis_context, name)
    except (ValueError, NotImplementedError):
        return "abstract mesh only"


def _plan(ctx: Any, name: str, axes: tuple, axis_index_groups: Any) -> Any:
    """``(groups, tables)`` for our custom call, or the reason to keep JAX's lowering."""
    reduction = _REDUCTIONS.get(name)
    if resolved_setting() == "gloo":
        return "JAX_CPU_MPI_COLLECTIVES selects gloo"
    if any(isinstance(a, int) for a in axes):
        return "positional axes"
    dtype = np.dtype(ctx.avals_in[0].dtype).name
    if reduction is not None and dtype not in MPI_DTYPES[reduction]:
        return f"no MPI reduction of {dtype} for {name}"
    if reduction is None and (dtype in _SUB_BYTE or np.dtype(ctx.avals_in[0].dtype).itemsize < 1):
        return f"sub-byte dtype {dtype}"
    context = _spmd_context(ctx, name)
    if isinstance(context, str):
        return context
    axis_context, tables = context
    groups = [list(g) for g in compat.replica_groups(axis_context, tuple(axes),
                                                     axis_index_groups)]
    spans = any(np.unique(tables.device_process[list(g)]).size > 1 for g in groups if g)
    # In a program whose mesh spans processes, XLA runs even an in-process group's
    # all-reduce on gloo (TCP through the loopback between the process's own devices):
    # ours reduces such a group in memory.
    if not spans and not tables.spans_processes:
        return "inside one process"
    if (why := _attach(name, tables)) is not None:
        return why
    if not _thread_multiple():
        return "MPI without MPI_THREAD_MULTIPLE"
    return groups, tables


#: Call sites share a communicator (and a local round) when their numbers agree modulo
#: this: a few communicators per group, however many collectives a program has. The
#: ordering pass numbers a program's calls (``site``), 0 until then.
SITES = 16
#: Collectives lowered over MPI that the ordering pass has not seen yet
#: (passes/ordered_collectives.py runs only when this is non-zero).
pending_for_pass = 0


#: Why a collective in a partially manual shard_map keeps JAX's lowering (decisions, info).
_PARTIALLY_MANUAL = "partially manual shard_map (XLA refuses partition-id there)"
_SUB_BYTE = ("int4", "uint4", "int2", "uint2", "float4_e2m1fn")
#: The most bytes one exchange's group may move (MPI's int counts and displacements).
_MAX_BYTES = (1 << 31) - 1


def _describe(aval: ShapedArray) -> str:
    return f"{aval.dtype.name}[{','.join(map(str, aval.shape))}]"


def _make_rule(prim: Any) -> Any:
    jax_rule = compat.default_lowerings[prim].rule

    def rule(ctx: Any, arg: Any, *, axes: tuple, axis_index_groups: Any = None, **rest: Any):
        params = dict(axes=axes, **rest)
        if prim is not compat.psum_invariant_p:
            params["axis_index_groups"] = axis_index_groups
        plan = _plan(ctx, prim.name, axes, axis_index_groups)
        if not _decided(ctx, prim.name, plan):
            return jax_rule(ctx, arg, **params)
        # In place: MPI reduces in the operand's buffer (MPI_IN_PLACE) where the operand is
        # dead afterwards (a scan's carry, a gradient), with no copy into a second buffer.
        return _custom_call(ctx, ALL_REDUCE_TARGET, prim.name, arg, ctx.avals_in[0],
                            ctx.avals_out[0], plan, axes, in_place=True,
                            reduction=_REDUCTIONS[prim.name])

    rule.__name__ = f"_{prim.name}_lowering_cpu_mpi"
    return rule


def _ppermute_rule(ctx: Any, x: Any, *, axis_name: Any, perm: Any, **rest: Any) -> Any:
    """ppermute between processes as our psend then precv (over MPI, ordered by the token);
    JAX's lowering otherwise."""
    jax_rule = compat.default_lowerings[compat.ppermute_p].rule
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    # No collective call of ours for the ordering pass: _emit counts the psend/precv calls
    # for the kept-operands pass.
    if not _decided(ctx, "ppermute", _ppermute_plan(ctx, names, rest), ordered=False):
        return jax_rule(ctx, x, axis_name=axis_name, perm=perm, **rest)
    token = compat.abstract_token
    sent = p2p_rules._emit(ctx.replace(avals_out=[token]), PSEND_TARGET, "psend", x,
                           axis_name=names, perm=perm, data_aval=ctx.avals_in[0])
    return p2p_rules._emit(ctx.replace(avals_in=[token]), PRECV_TARGET, "precv", sent[0],
                           axis_name=names, perm=perm, data_aval=ctx.avals_out[0])


def _ppermute_plan(ctx: Any, names: tuple, rest: dict) -> str | None:
    """None to go over psend/precv, else why JAX's lowering stays."""
    if resolved_setting() == "gloo":
        return "JAX_CPU_MPI_COLLECTIVES selects gloo"
    if rest.get("is_async"):
        return "asynchronous ppermute"
    context = _spmd_context(ctx, "ppermute")
    if isinstance(context, str):
        return context
    axis_context, tables = context
    if not tables.spans_processes:
        return "inside one process"
    groups = compat.replica_groups(axis_context, names, None)
    if not any(np.unique(tables.device_process[list(g)]).size > 1 for g in groups if g):
        return "inside one process"
    return _attach("ppermute", tables)


def _transpose(ctx: Any, x: Any, aval: Any, perm: list[int]) -> tuple[Any, Any]:
    """``x`` (of ``aval``) with its axes in the order ``perm`` (no op for the identity)."""
    if perm == sorted(perm):
        return x, aval
    new = aval.update(shape=tuple(aval.shape[i] for i in perm))
    return hlo.transpose(x, compat.dense_int_array(perm)), new


def _reshape(ctx: Any, x: Any, aval: Any, shape: tuple) -> tuple[Any, Any]:
    if tuple(aval.shape) == tuple(shape):
        return x, aval
    new = aval.update(shape=tuple(shape))
    return hlo.reshape(compat.aval_to_ir_type(ctx.module_context, new), x), new


def _decided(ctx: Any, name: str, plan: Any, *, ordered: bool = True) -> bool:
    """Records how ``name`` is lowered (``plan``: ``(groups, tables)``, or None, for ours;
    a string, why JAX's lowering stays); True for ours. ``ordered``: ours is a collective
    call of this module, which the ordering pass must chain."""
    dtype = np.dtype(ctx.avals_in[0].dtype).name
    if isinstance(plan, str):
        _decisions[(name, dtype, f"gloo: {plan}")] += 1
        return False
    _decisions[(name, dtype, "mpi")] += 1
    if ordered:
        global pending_for_pass
        pending_for_pass += 1
    return True


def _custom_call(ctx: Any, target: str, name: str, x: Any, in_aval: Any, out_aval: Any,
                 plan: Any, axes: tuple, in_place: bool = False, **attrs: Any) -> Any:
    """Our collective custom call ``target(x, partition_id) -> out`` over the plan's groups
    (the attributes every one carries, and ``attrs``). ``in_place``: the result may take the
    operand's buffer (XLA copies the operand first where it is still needed)."""
    groups, tables = plan
    u32 = ShapedArray((), np.uint32)
    sub_ctx = ctx.replace(avals_in=[in_aval, u32], avals_out=[out_aval])
    padded = _padded(groups)
    call = jax.ffi.ffi_lowering(target, has_side_effect=True,
                                operand_output_aliases={0: 0} if in_place else None)
    return call(sub_ctx, x, hlo.partition_id(),
                groups=padded.reshape(-1), group_size=np.int64(padded.shape[1]),
                device_index=tables.device_index, device_process=tables.device_process,
                site=np.int64(0), park=np.int64(0), op=f"{name}(axes={tuple(axes)!r})",
                operand=_describe(ctx.avals_in[0]), **attrs)


def _exchange_call(ctx: Any, kind: str, name: str, x: Any, in_aval: Any, out_aval: Any,
                   plan: Any, axes: tuple, in_place: bool = False) -> Any:
    return _custom_call(ctx, EXCHANGE_TARGET, name, x, in_aval, out_aval, plan, axes,
                        in_place=in_place, kind=kind, reduction="sum")[0]


def _exchange_plan(ctx: Any, name: str, axes: tuple, params: dict) -> Any:
    if params.get("is_async"):
        return "asynchronous collective"
    plan = _plan(ctx, name, axes, params.get("axis_index_groups"))
    if isinstance(plan, str):
        return plan
    groups = plan[0]
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        return "groups of different sizes"
    biggest = max(ctx.avals_in[0].size, ctx.avals_out[0].size) * ctx.avals_in[0].dtype.itemsize
    if n * biggest > _MAX_BYTES:
        return "more than 2 GiB in one group"
    return plan


def _make_exchange_rule(prim: Any, kind: str) -> Any:
    jax_rule = compat.default_lowerings[prim].rule

    def rule(ctx: Any, x: Any, **params: Any) -> Any:
        names = params["axis_name"]
        axes = names if isinstance(names, tuple) else (names,)
        plan = _exchange_plan(ctx, prim.name, axes, params)
        if not _decided(ctx, prim.name, plan):
            return jax_rule(ctx, x, **params)
        n = len(plan[0][0])
        aval, out_aval = ctx.avals_in[0], ctx.avals_out[0]
        shape = list(aval.shape)
        if kind == "all_gather":
            d = params["all_gather_dimension"]
            if not params["tiled"]:
                shape.insert(d, 1)
            perm = [d, *(i for i in range(len(shape)) if i != d)]
            moved = tuple(shape[i] for i in perm)
            if params["tiled"]:
                x, aval = _transpose(ctx, x, aval, perm)
            else:  # the new axis of size 1 goes first: only a reshape
                x, aval = _reshape(ctx, x, aval, moved)
            mid = aval.update(shape=(n * moved[0], *moved[1:]))
            y = _exchange_call(ctx, kind, prim.name, x, aval, mid, plan, axes)
            y, mid = _transpose(ctx, y, mid, [perm.index(i) for i in range(len(perm))])
        elif kind == "reduce_scatter":
            d = params["scatter_dimension"]
            perm = [d, *(i for i in range(len(shape)) if i != d)]
            x, aval = _transpose(ctx, x, aval, perm)
            mid = aval.update(shape=(aval.shape[0] // n, *aval.shape[1:]))
            y = _exchange_call(ctx, kind, prim.name, x, aval, mid, plan, axes)
            y, mid = _transpose(ctx, y, mid, [perm.index(i) for i in range(len(perm))])
        elif (params["split_axis"] == params["concat_axis"] == 0
              and tuple(out_aval.shape) == tuple(aval.shape)):
            # all_to_all of the leading axis: the blocks are contiguous as they are, and the
            # result has the operand's shape, so the call takes the operand itself, in place
            # (MPI_IN_PLACE) where the operand is dead afterwards: a scan's carry then needs
            # no copy of the result into it at every step (XLA copies it after a reshape).
            return [_exchange_call(ctx, kind, prim.name, x, aval, aval, plan, axes,
                                   in_place=True)]
        else:  # all_to_all: block j of the result is member j's block of my position
            s, c = params["split_axis"], params["concat_axis"]
            others = [i for i in range(len(shape)) if i != s]
            x, aval = _transpose(ctx, x, aval, [s, *others])
            x, aval = _reshape(ctx, x, aval, (n, shape[s] // n, *(shape[i] for i in others)))
            y = _exchange_call(ctx, kind, prim.name, x, aval, aval, plan, axes)
            # Axes of y: 0 the sender j, 1 the split axis, 2.. the others; j goes right
            # before the concat axis and merges with it.
            order: list[int] = []
            for i in range(len(shape)):
                if i == c:
                    order.append(0)
                order.append(1 if i == s else 2 + others.index(i))
            y, mid = _transpose(ctx, y, aval, order)
        y, _ = _reshape(ctx, y, mid, out_aval.shape)
        return [y]

    rule.__name__ = f"_{prim.name}_lowering_cpu_mpi"
    return rule


_rules: dict[Any, Any] = {}


def register() -> None:
    """Register the CPU lowerings of the collectives over MPI (idempotent).

    Every rule is made before any is registered: making one reads JAX's own rule for the
    primitive, and a JAX whose rules moved must leave the feature off with JAX's lowerings
    in place, not half of the collectives over MPI without the ordering pass that
    ``install`` adds after this returns (their order against psend/precv would then differ
    between processes).
    """
    register_targets()
    kinds = [(prim, None) for prim in (compat.psum_p, compat.pmax_p, compat.pmin_p,
                                       compat.psum_invariant_p)]
    kinds += [(compat.all_gather_p, "all_gather"),
              (compat.all_gather_invariant_p, "all_gather"),
              (compat.all_gather_reduced_p, "all_gather"),
              (compat.reduce_scatter_p, "reduce_scatter"),
              (compat.unreduced_reduce_scatter_p, "reduce_scatter"),
              (compat.all_to_all_p, "all_to_all")]
    rules = dict(_rules)
    for prim, kind in kinds:
        if compat.lowered_as_other_primitives(prim) or prim in rules:
            continue
        rules[prim] = _make_rule(prim) if kind is None else _make_exchange_rule(prim, kind)
    if compat.ppermute_p not in compat.default_lowerings:  # _ppermute_rule falls back to it
        raise KeyError(compat.ppermute_p)
    _rules.update(rules)
    for prim, rule in rules.items():
        register_lowering(prim, rule, platform="cpu")
    register_lowering(compat.ppermute_p, _ppermute_rule, platform="cpu")
