"""``jax.lax.optimization_barrier`` over tokens: lowerable on CPU, and really ordering.

JAX's GPU performance tips ("Using psend and precv") order a psend, a ppermute and a
precv inside a loop step with ``optimization_barrier((x, psend_token))`` (the ppermute of
``x`` comes after the psend) and ``optimization_barrier((create_token(), y))`` (the precv
taking that token comes after the ppermute producing ``y``). On CPU this fails twice:

1. JAX 0.10's lowering rule of the barrier calls ``lower_with_sharding_in_types`` on every
   result, and a token has no sharding: ``AttributeError: 'AbstractToken' object has no
   attribute 'sharding'``;
2. XLA CPU deletes optimization barriers before scheduling (``OptimizationBarrierExpander``),
   so nothing orders a precv after a ppermute: a precv that blocks first while its peer
   waits in the ppermute for this device deadlocks.

For a CPU barrier inside ``shard_map`` that holds tokens and arrays, this lowering keeps
the ``stablehlo.optimization_barrier`` and adds data dependencies XLA keeps: each token
result also waits for every array of the barrier, each array result for every token.

* token after array: our psend custom call with no source-target pairs (it sends nothing
  and returns a token that depends on the array);
* array after token: our precv custom call with no pairs returns a ``u32`` zero that
  depends on the token; the array's bits are OR-ed with it (the bits do not change, and
  XLA cannot fold the dependency away); a complex array's two parts are OR-ed each.

XLA CPU orders custom calls at run time by their buffers, not their tokens: the kept-operands
pass (:mod:`jax_cpu_mpi._src.passes.kept_operands`) gives each ordering call the buffers it
must wait for (a psend's ``u32`` result, an array), so that both orders hold at run time.

Both calls carry ``op=ORDERING_OP``, by which the GPU-parity check skips them.
Every other barrier keeps JAX's rule.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.compat import (
    ShapedArray,
    SPMDAxisContext,
    abstract_token,
    dense_int_array,
    hlo,
    ir,
    lower_with_sharding_in_types,
    optimization_barrier_lowering,
    optimization_barrier_p,
    register_lowering,
)
from jax_cpu_mpi._src.ffi.custom_calls import ORDERING_OP, PRECV_TARGET, PSEND_TARGET, attributes
from jax_cpu_mpi._src.lowering.topology import partition_tables

_NO_PAIRS = np.zeros((0,), np.int64)


def _u32() -> Any:
    return ShapedArray((), np.uint32)


def _attributes(ctx: Any, operand: str) -> dict[str, Any]:
    tables = partition_tables(ctx.module_context.axis_context, "optimization_barrier")
    return attributes(pairs=_NO_PAIRS, device_index=tables.device_index,
                      device_process=tables.device_process, num_devices=tables.num_devices,
                      op=ORDERING_OP, operand=operand)


def _token_after(ctx: Any, value: Any, aval: Any) -> Any:
    sub = ctx.replace(avals_in=[aval, _u32()], avals_out=[abstract_token, _u32()])
    rule = jax.ffi.ffi_lowering(PSEND_TARGET, has_side_effect=True)
    token, _ = rule(sub, value, hlo.partition_id(), **_attributes(ctx, str(aval)))
    return token


def _zero_after(ctx: Any, token: Any) -> Any:
    sub = ctx.replace(avals_in=[abstract_token, _u32()], avals_out=[_u32()])
    rule = jax.ffi.ffi_lowering(PRECV_TARGET, has_side_effect=True)
    (zero,) = rule(sub, token, hlo.partition_id(), **_attributes(ctx, "uint32[]"))
    return zero


def _array_after(value: Any, aval: Any, zero: Any) -> Any:
    """``value`` with its bits unchanged, computed after ``zero`` (a u32 zero) exists."""
    dtype = np.dtype(aval.dtype)
    if dtype.kind == "c":
        # No bitcast of a complex: order its two float parts, then put them together again
        # (real, imag and complex move the bits unchanged).
        part = ShapedArray(aval.shape, np.finfo(dtype).dtype)
        return hlo.complex(_array_after(hlo.real(value), part, zero),
                           _array_after(hlo.imag(value), part, zero))
    shape = list(aval.shape)
    if dtype == np.bool_:
        bits_type = value.type
        mask = hlo.convert(ir.RankedTensorType.get([], ir.IntegerType.get_signless(1)), zero)
    else:
        width = dtype.itemsize * 8
        bits_type = ir.RankedTensorType.get(shape, ir.IntegerType.get_unsigned(width))
        mask = hlo.convert(ir.RankedTensorType.get([], ir.IntegerType.get_unsigned(width)),
                           zero)
    bits = value if dtype == np.bool_ else hlo.bitcast_convert(bits_type, value)
    mask = hlo.broadcast_in_dim(bits_type, mask, dense_int_array([]))
    ored = hlo.or_(bits, mask)
    return ored if dtype == np.bool_ else hlo.bitcast_convert(value.type, ored)


def _ordered(ctx: Any, results: list[Any]) -> list[Any]:
    avals = ctx.avals_out
    tokens = [r for r, a in zip(results, avals, strict=True) if a is abstract_token]
    arrays = [(r, a) for r, a in zip(results, avals, strict=True)
              if a is not abstract_token]
    after_arrays = hlo.after_all([*tokens, *(_token_after(ctx, r, a) for r, a in arrays)])
    zero = _zero_after(ctx, hlo.after_all(tokens)) if arrays else None
    return [after_arrays if a is abstract_token else _array_after(r, a, zero)
            for r, a in zip(results, avals, strict=True)]


def _lowering(ctx: Any, *args: Any, order: bool = True) -> Any:
    is_token = [a is abstract_token for a in ctx.avals_out]
    if (not compat.BARRIER_TOKENS.active or not any(is_token)
            or not all(isinstance(a, ir.Value) for a in args)):
        return optimization_barrier_lowering(ctx, *args)
    try:
        return _token_barrier(ctx, args, is_token, order)
    except Exception as e:  # a JAX internal changed under us: JAX's rule from now on
        compat.failed_at_run_time(compat.BARRIER_TOKENS.name, e)
        return optimization_barrier_lowering(ctx, *args)


def _gpu_lowering(ctx: Any, *args: Any) -> Any:
    """On GPU: the barrier as JAX builds it, without JAX 0.10's sharding error on a token
    result (a pytree precv has such barriers: ops/p2p.py); XLA GPU keeps barriers."""
    return _lowering(ctx, *args, order=False)


def _token_barrier(ctx: Any, args: Any, is_token: list[bool], order: bool) -> Any:
    results = list(hlo.OptimizationBarrierOp(list(args)).results)
    axis_context = ctx.module_context.axis_context
    if order and not all(is_token) and isinstance(axis_context, SPMDAxisContext) and (
            axis_context.manual_axes):
        results = _ordered(ctx, results)
    return [r if token else lower_with_sharding_in_types(ctx, r, aval)
            for r, aval, token in zip(results, ctx.avals_out, is_token, strict=True)]


def install() -> None:
    """Register the CPU lowering of ``optimization_barrier`` (idempotent).

    Called through ``compat.enable("barrier_tokens", ...)``; the rule hands every barrier
    back to JAX's own rule once the feature is off. On CUDA and ROCm (a program exported
    for GPU on this machine) only JAX 0.10's error on token results is mended.
    """
    register_lowering(optimization_barrier_p, _lowering, platform="cpu")
    for platform in ("cuda", "rocm"):
        register_lowering(optimization_barrier_p, _gpu_lowering, platform=platform)
