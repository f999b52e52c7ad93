"""psend / precv primitives of our own, for a JAX that no longer has them.

JAX 0.12 deprecates ``jax.lax.psend`` / ``jax.lax.precv``, and a later JAX drops them with
``psend_p`` / ``precv_p``. Imported only then, or when ``JAX_CPU_MPI_PRIMITIVES=ours`` asks
for it (:mod:`jax_cpu_mpi._src.ops.primitives`, through the ``own_primitives`` feature of
:mod:`jax_cpu_mpi._src.compat`, where every private JAX name used here is resolved), this
module defines primitives that behave as JAX 0.10-0.12's, so that programs, our CPU
lowerings, batching rules and GPU-parity check are unchanged:

* the same names (``psend``, ``precv``), params (``axis_name`` a tuple, ``perm`` a tuple of
  pairs, precv's ``out_shape`` a ``ShapedArray``) and effects (a ``NamedAxisEffect`` per
  axis name and the single-side-collective effect: jit, shard_map, loops and our parity
  check see them like JAX's);
* the same abstract evaluation: psend returns a token and raises JAX's ``NameError`` for an
  axis that no ``shard_map`` binds; precv returns ``out_shape`` (not varying over the mesh
  axes, as JAX's: loop carries need ``pcast``);
* on GPU (``cuda``, ``rocm``; ``oneapi`` as in JAX 0.12) a ``stablehlo.send`` /
  ``stablehlo.recv`` with the source-target pairs and the device-to-device channel handle
  of JAX's own helper, exactly what JAX's lowering emits; on every other platform JAX's
  ``NotImplementedError`` (CPU gets our custom calls from :mod:`jax_cpu_mpi._src.lowering.rules`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.compat import (
    NamedAxisEffect,
    Primitive,
    SPMDAxisContext,
    abstract_token,
    apply_primitive,
    aval_to_ir_type,
    check_axis_names,
    dense_int_elements,
    hlo,
    pcollectives_lowering_common,
    register_lowering,
)

_GPU_PLATFORMS = ("cuda", "rocm", "oneapi")


def _single_side_collective_effect() -> Any:
    if compat.available(compat.jax_single_side_collective_effect):
        return compat.jax_single_side_collective_effect
    return compat.own_single_side_collective_effect()


#: The effect our psend/precv carry: JAX's while JAX has it (jax_cpu_mpi's parity check and
#: JAX's control flow look for it), an equivalent of ours after
#: (:mod:`jax_cpu_mpi._src.compat.effect`).
single_side_collective_effect = _single_side_collective_effect()


def _effects(axis_name: tuple) -> set:
    return {*map(NamedAxisEffect, axis_name), single_side_collective_effect}


def _psend_abstract_eval(x: Any, *, axis_name: tuple, perm: tuple):
    check_axis_names(axis_name, "psend")
    return abstract_token, _effects(axis_name)


def _precv_abstract_eval(token: Any, *, out_shape: Any, axis_name: tuple, perm: tuple):
    return out_shape, _effects(axis_name)


def _require_manual(ctx: Any, op_name: str) -> None:
    if not isinstance(ctx.module_context.axis_context, SPMDAxisContext):
        raise NotImplementedError(f"{op_name} currently only supports manual sharding")


def _psend_lowering_gpu(ctx: Any, x, *, axis_name, perm):
    if not any(p in ctx.module_context.platforms for p in _GPU_PLATFORMS):
        raise NotImplementedError("psend is currently only implemented on GPUs")
    pairs, channel = pcollectives_lowering_common(
        ctx, axis_name=axis_name, perm=perm, op_name="psend")
    send = hlo.SendOp([x], hlo.create_token(),
                      source_target_pairs=dense_int_elements(pairs), **channel)
    _require_manual(ctx, "psend")
    return send.results


def _precv_lowering_gpu(ctx: Any, token, *, out_shape, axis_name, perm):
    pairs, channel = pcollectives_lowering_common(
        ctx, axis_name=axis_name, perm=perm, op_name="precv")
    recv = hlo.RecvOp([aval_to_ir_type(ctx.module_context, out_shape), token.type],
                      token, source_target_pairs=dense_int_elements(pairs), **channel)
    _require_manual(ctx, "precv")
    return [recv.results[0]]  # the data; the recv's own token is not precv's result


def _not_implemented(op_name: str):
    def lowering(ctx, *args, **params):
        raise NotImplementedError(f"{op_name} is currently only implemented on GPU")

    return lowering


psend_p = Primitive("psend")
psend_p.def_impl(partial(apply_primitive, psend_p))
psend_p.def_effectful_abstract_eval(_psend_abstract_eval)
register_lowering(psend_p, _not_implemented("psend"))
register_lowering(psend_p, _psend_lowering_gpu, platform="gpu")

precv_p = Primitive("precv")
precv_p.def_effectful_abstract_eval(_precv_abstract_eval)
register_lowering(precv_p, _not_implemented("precv"))
register_lowering(precv_p, _precv_lowering_gpu, platform="gpu")

__all__ = ["precv_p", "psend_p", "single_side_collective_effect"]
