"""What the passes that rewrite lowered modules share: walking a module's ops, and running a
pass on every module JAX lowers (wrapping ``mlir.lower_jaxpr_to_module``).

The passes: :mod:`jax_cpu_mpi._kept_operands` and :mod:`jax_cpu_mpi._device_thread_hint`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from . import _compat
from ._compat import ir


def operations(op: Any) -> Iterator[Any]:
    """Every operation nested in ``op``, in program order, depth first."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner.operation
                yield from operations(inner.operation)


def call_target(op: Any) -> str | None:
    """The target of a custom call, None for any other op."""
    if op.name != "stablehlo.custom_call":
        return None
    return ir.StringAttr(op.attributes["call_target_name"]).value


def after_lowering(feature: _compat.Feature, wanted: Callable[[Any, Any], bool],
                   run: Callable[[Any], Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper for ``mlir.lower_jaxpr_to_module`` that runs ``run(module)`` on the modules
    for which ``wanted(platforms, jaxpr)``, while ``feature`` is active. A failure of the
    pass switches ``feature`` off with a warning and leaves the module as JAX lowered it."""

    def wrap(lower: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(lower)
        def lower_jaxpr_to_module(module_name, jaxpr, *args, platforms, **kwargs):
            result = lower(module_name, jaxpr, *args, platforms=platforms, **kwargs)
            if not feature.active:
                return result
            try:
                if wanted(platforms, jaxpr):
                    run(result.module)
            except Exception as e:  # a JAX internal changed under us: never break jit
                _compat.failed_at_run_time(feature.name, e)
            return result

        return lower_jaxpr_to_module

    return wrap
