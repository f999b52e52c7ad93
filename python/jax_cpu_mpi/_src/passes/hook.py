"""The one lowering hook: after JAX lowers a program, our module passes run in this order.

===  ======================================  ==============================================
 #   pass (feature)                          why it runs there
===  ======================================  ==============================================
 1   GPU-parity check (``gpu_parity``)       sees the program exactly as JAX lowered it, as
     :mod:`jax_cpu_mpi._src.parity.check`    XLA GPU would; raises ``GpuParityError``
 2   kept operands (``kept_operands``)       rewrites precvs only once the program is
     :mod:`.kept_operands`                   known to be one GPU accepts
 3   device-thread hint (``fast_dispatch``)  adds flops and a call of its own, which no
     :mod:`jax_cpu_mpi._src.dispatch`        other pass may count or rewrite: last
===  ======================================  ==============================================

JAX lowers every program through ``mlir.lower_jaxpr_to_module``, which this module wraps
once. Each pass runs while its feature is active, on the programs it wants (CPU programs
that carry the psend/precv effect); a pass that fails on a program (a JAX internal it reads
changed) switches its feature off with one warning and leaves the module as it was; only
the parity check's own error reaches the user.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.dispatch import device_thread_hint
from jax_cpu_mpi._src.parity import check as parity
from jax_cpu_mpi._src.passes import kept_operands, ordered_collectives
from jax_cpu_mpi._src.runtime import config


@dataclass(frozen=True)
class ModulePass:
    """One pass over lowered modules."""

    feature: compat.Feature
    #: ``wanted(platforms, jaxpr)``: whether to run on this program (cheap: no module walk).
    wanted: Callable[[Any, Any], bool]
    #: ``run(module)``: rewrites or checks the module in place.
    run: Callable[[Any], Any]
    #: Errors that are the pass's verdict, not its failure: they reach the caller of jit.
    verdicts: tuple[type[BaseException], ...] = ()


#: The passes, in the order they run (the module docstring says why).
PASSES: tuple[ModulePass, ...] = (
    ModulePass(compat.GPU_PARITY, parity.wanted, parity.raise_on_violation,
               verdicts=(parity.GpuParityError,)),
    ModulePass(compat.KEPT_OPERANDS, kept_operands.wanted, kept_operands.keep_psend_operands),
    ModulePass(compat.COLLECTIVES, ordered_collectives.wanted,
               ordered_collectives.order_collectives),
    ModulePass(compat.FAST_DISPATCH, device_thread_hint.wanted,
               device_thread_hint.add_device_thread_hint),
)


def run_passes(module: Any, jaxpr: Any, platforms: Any) -> None:
    """Run every active pass that wants this program on its lowered ``module``."""
    for module_pass in PASSES:
        if not module_pass.feature.active:
            continue
        try:
            if module_pass.wanted(platforms, jaxpr):
                module_pass.run(module)
        except (config.ConfigError, *module_pass.verdicts):
            raise  # a bad JAX_CPU_MPI_* value, or the pass's verdict: the caller's error
        except Exception as e:  # a JAX internal changed under us: never break jit
            compat.failed_at_run_time(module_pass.feature.name, e)


def _hooked(lower: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(lower)
    def lower_jaxpr_to_module(module_name, jaxpr, *args, platforms, **kwargs):
        result = lower(module_name, jaxpr, *args, platforms=platforms, **kwargs)
        run_passes(result.module, jaxpr, platforms)
        return result

    return lower_jaxpr_to_module


def install() -> None:
    """Wrap ``mlir.lower_jaxpr_to_module`` once (each pass's feature calls this through
    ``compat.enable``; the first call installs the hook, the others find it)."""
    compat.wrap_once(compat.mlir, "lower_jaxpr_to_module", "_jax_cpu_mpi_passes", _hooked)
