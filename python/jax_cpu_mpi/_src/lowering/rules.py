"""CPU lowerings of psend / precv to our XLA FFI custom calls.

The primitives are those of :mod:`jax_cpu_mpi._src.ops.primitives`: JAX's while JAX has them (so
``jax.lax.psend`` and ``jax_cpu_mpi.psend`` lower alike), ours once JAX drops them.

Each rule computes the source-target pairs with JAX's own helper (the same pairs, the same
validation and the same errors as JAX's GPU lowering), then emits a typed-FFI custom call
whose operands are the data (or token) and the partition id of the running device:

* ``jax_cpu_mpi_psend(x, partition_id) -> (token, u32 zero)``: sends ``x`` if this device
  is a source (the zero orders ops after it at run time: see :func:`_emit`);
* ``jax_cpu_mpi_precv(token, partition_id) -> out``: receives if this device is a
  destination, zeros otherwise (like ``ppermute``).

The token that psend returns is a result of its custom call, and precv takes it as an
operand, so XLA cannot reorder a precv before the psend it depends on when it schedules;
at run time XLA CPU orders calls by their buffers, and the kept-operands pass gives the
precv the psend's ``u32`` result. Both calls are side-effecting, so a psend whose token is
dropped still runs.

Both calls carry ``operand_kept = 0``; the kept-operands pass
(:mod:`jax_cpu_mpi._src.passes.kept_operands`) later lets a precv keep alive the operand of
the psend whose token it takes (and finish its send).
"""

from __future__ import annotations

import jax
import numpy as np

from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.compat import (
    ShapedArray,
    SPMDAxisContext,
    hlo,
    mlir,
    pcollectives_lowering_common,
    register_lowering,
)
from jax_cpu_mpi._src.ffi.custom_calls import PRECV_TARGET, PSEND_TARGET, attributes
from jax_cpu_mpi._src.ffi.registration import register_targets
from jax_cpu_mpi._src.lowering.topology import partially_manual, partition_tables
from jax_cpu_mpi._src.ops.p2p import check_perm_in_axis
from jax_cpu_mpi._src.ops.primitives import precv_p, psend_p
from jax_cpu_mpi._src.runtime import config, launchers
from jax_cpu_mpi._src.runtime import mpi as mpi_runtime


def _describe(aval: ShapedArray) -> str:
    return f"{aval.dtype.name}[{','.join(map(str, aval.shape))}]"


def _check_inside_shard_map(ctx: mlir.LoweringRuleContext, op_name: str, axis_name) -> None:
    """Outside shard_map, fail as JAX's psend does at trace time (precv has no such check)."""
    axis_context = ctx.module_context.axis_context
    manual = axis_context.manual_axes if isinstance(axis_context, SPMDAxisContext) else ()
    for name in axis_name:
        if name not in manual:
            raise NameError(
                f"Found an unbound axis name: {name}. To fix this, please call {op_name} under "
                "`jax.shard_map`."
            )


def _check_fully_manual(ctx: mlir.LoweringRuleContext, op_name: str, axis_name) -> None:
    """A partially manual shard_map (``axis_names=`` a subset of the mesh's axes): our calls
    name their device by ``partition-id``, which XLA's SPMD partitioner refuses there (JAX's
    GPU lowering emits ``stablehlo.send`` with pairs over the whole mesh instead). Raised
    here, at lowering, rather than XLA's RET_CHECK at compile time."""
    axis_context = ctx.module_context.axis_context
    if not partially_manual(axis_context):
        return
    manual = tuple(name for name in axis_context.mesh.axis_names
                   if name in axis_context.manual_axes)
    raise NotImplementedError(
        f"{op_name}(axis_name={tuple(axis_name)!r}) is inside a partially manual shard_map "
        f"(manual axes {manual} of the mesh's {tuple(axis_context.mesh.axis_names)}): on CPU "
        f"psend/precv are not supported there: XLA's SPMD partitioner refuses the partition "
        f"id they route by. Make every mesh axis manual (shard_map without axis_names=, or "
        f"with all of the mesh's axes), or use jax.lax.ppermute, which keeps JAX's own "
        f"lowering there."
    )


def _routing(ctx: mlir.LoweringRuleContext, op_name: str, axis_name, perm):
    config.current()  # a bad JAX_CPU_MPI_* value raises its ConfigError here, not at import
    _check_inside_shard_map(ctx, op_name, axis_name)
    _check_fully_manual(ctx, op_name, axis_name)
    # Before JAX's helper, which takes indices modulo the axis size (then IndexError, or a
    # wrong "sources and destinations must be unique"): jax.lax.psend is not checked when
    # traced, as jax_cpu_mpi.psend is (ops/p2p.py).
    sizes = ctx.module_context.axis_context.mesh.shape
    check_perm_in_axis(op_name, axis_name, perm,
                       int(np.prod([sizes[name] for name in axis_name], dtype=np.int64)))
    launchers.warn_if_jax_runs_alone(op_name)
    full_perm, _ = pcollectives_lowering_common(
        ctx, axis_name=axis_name, perm=perm, op_name=op_name
    )
    tables = partition_tables(ctx.module_context.axis_context, op_name)
    if tables.spans_processes:
        mpi_runtime.ensure_attached(op_name, int(np.unique(tables.device_process).size))
    return np.asarray(full_perm, dtype=np.int64).reshape(-1), tables


#: psend/precv calls emitted that the kept-operands pass has not seen yet: it runs on the
#: programs lowered since (passes/kept_operands.py), whatever lowered to these calls
#: (psend/precv, a ppermute over MPI), and resets this.
emitted_for_pass = 0


def _emit(ctx: mlir.LoweringRuleContext, target: str, op_name: str, operand, *, axis_name,
          perm, data_aval: ShapedArray) -> list:
    """The custom call ``target(operand, partition_id)`` with the routing attributes."""
    global emitted_for_pass
    pairs, tables = _routing(ctx, op_name, axis_name, perm)
    emitted_for_pass += 1
    op = f"{op_name}(axis_name={axis_name!r}, perm={list(map(tuple, perm))!r})"
    u32 = ShapedArray((), np.uint32)
    sending = target == PSEND_TARGET
    # A psend also returns a u32 zero that exists once it has run (cpp/ffi/p2p_handlers.cc):
    # the buffer by which a barrier orders later ops after it; JAX sees the token alone.
    sub_ctx = ctx.replace(avals_in=[*ctx.avals_in, u32],
                          avals_out=[*ctx.avals_out, u32] if sending else ctx.avals_out)
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True)
    results = rule(sub_ctx, operand, hlo.partition_id(),
                   **attributes(pairs=pairs, device_index=tables.device_index,
                                device_process=tables.device_process,
                                num_devices=tables.num_devices, op=op,
                                operand=_describe(data_aval)))
    return list(results)[:1] if sending else results


def _psend_lowering_cpu(ctx: mlir.LoweringRuleContext, x, *, axis_name, perm):
    return _emit(ctx, PSEND_TARGET, "psend", x, axis_name=axis_name, perm=perm,
                 data_aval=ctx.avals_in[0])


def _precv_lowering_cpu(ctx: mlir.LoweringRuleContext, token, *, out_shape, axis_name, perm):
    return _emit(ctx, PRECV_TARGET, "precv", token, axis_name=axis_name, perm=perm,
                 data_aval=out_shape)


def register() -> None:
    """Register the FFI targets and the CPU lowerings (idempotent).

    Called through ``compat.enable("lowerings", ...)``: not at all when this JAX lacks a
    name the lowerings need, and then psend/precv keep JAX's own lowering (on CPU, its
    ``NotImplementedError``). The primitives are those of :mod:`jax_cpu_mpi._src.ops.primitives`
    (JAX's, or ours where JAX has none); if neither is usable, this raises and the
    lowerings feature is off. Nor when the extension was built against a newer XLA FFI API
    than the installed jaxlib accepts (:mod:`jax_cpu_mpi._src.ffi.abi_version`): registering its
    handlers would stop JAX's CPU backend from starting.
    """
    for prim in (psend_p, precv_p):
        prim.name  # noqa: B018  (a Missing primitive raises here, naming what is missing)
    register_targets()
    register_lowering(psend_p, _psend_lowering_cpu, platform="cpu")
    register_lowering(precv_p, _precv_lowering_cpu, platform="cpu")


def registered_on_cpu() -> dict[str, bool]:
    """``{primitive name: our rule is the CPU lowering JAX has registered}``.

    Read from JAX's lowering table; where this JAX's table cannot be read, from whether
    the lowerings feature was installed.
    """
    if not (compat.available(psend_p) and compat.available(precv_p)):
        return {"psend": False, "precv": False}
    result = {}
    for prim, rule in ((psend_p, _psend_lowering_cpu), (precv_p, _precv_lowering_cpu)):
        if not compat.LOWERING_TABLE.usable:
            result[prim.name] = compat.LOWERINGS.active
            continue
        entry = compat.platform_lowering(prim, "cpu")
        result[prim.name] = getattr(entry, "rule", entry) is rule
    return result
