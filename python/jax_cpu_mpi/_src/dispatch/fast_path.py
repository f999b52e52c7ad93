"""JAX's C++ dispatch for jitted CPU programs with psend/precv.

psend and precv carry an *unordered effect*. For a program with one, JAX gives up the C++
fast path of ``jax.jit``: every call goes through its Python dispatch, which adds runtime
tokens so that ``jax.effects_barrier()`` can wait for the program. That costs several times
a small hop per call (the benchmark's dispatch figures are in benchmarks/results/). On
CPU the effect exists to keep psend/precv in place while JAX transforms and
lowers the program; at run time they are custom calls whose completion shows in the
program's outputs, like any computation's.

So, for a CPU executable whose only unordered effect is that of psend/precv, which has at
least one output and which XLA never runs in the calling thread, this module records no
unordered effect when JAX builds the object that runs the program (``ExecuteReplicated``).
jit then takes its C++ path. What changes for users: ``jax.effects_barrier()`` no longer
waits for such a program (block on its outputs instead).

Why "never in the calling thread": XLA CPU runs a cheap single-device program inline, and
JAX's C++ path turns an error returned that way (a precv that timed out, an MPI failure)
into a plain ``ValueError``, where JAX's Python dispatch raises the
``jax.errors.JaxRuntimeError`` users catch (and get on GPU). A program that runs on device
threads reports its errors through its outputs, as ``JaxRuntimeError`` on either path.
That is a program on two or more devices of the process, or a single-device program that
XLA does not call cheap: its HLO cost analysis counts 1000 flops or more
(``cheap_computation_`` in XLA's ``cpu_client.cc``), with JAX's asynchronous CPU dispatch on
(its default). A single-device program of little more than psend/precv (the stage of a
pipeline, one device per MPI rank) gets there through the device-thread hint that
:mod:`.device_thread_hint` adds when JAX lowers it: a few thousand flops that
XLA counts and that cost about a microsecond. So both the step of a model and a loop of
hops, one device per MPI rank, take the C++ path. Programs without outputs, GPU programs,
programs with other effects and ``JAX_CPU_MPI_FAST_DISPATCH=0`` (no hint then) keep JAX's
dispatch. The choice is made when a program is compiled, from the compiled program's own
cost analysis: a program the hint did not reach (a GSPMD-partitioned one) stays cheap and
keeps JAX's dispatch.
"""

from __future__ import annotations

import functools
from typing import Any

from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.dispatch.device_thread_hint import async_cpu_dispatch
from jax_cpu_mpi._src.runtime import config as _config


def _p2p_effect(effect: Any) -> bool:
    p2p = compat.single_side_collective_effect  # JAX's, or ours where JAX dropped it
    return compat.available(p2p) and effect == p2p


def _dispatch_fast(xla_executable: Any, backend: Any, out_handler: Any,
                   unordered_effects: list[Any]) -> bool:
    """Whether to record no unordered effect for this program (see the module doc)."""
    return (bool(unordered_effects)
            and all(_p2p_effect(e) for e in unordered_effects)
            and getattr(backend, "platform", None) == "cpu"
            and len(getattr(out_handler, "handlers", ())) > 0
            and _config.current().fast_dispatch
            and _runs_off_the_calling_thread(xla_executable))


def _runs_off_the_calling_thread(xla_executable: Any) -> bool:
    """Whether XLA CPU runs every call of this program on device threads (module doc)."""
    if len(xla_executable.local_devices()) >= 2:
        return True
    if not async_cpu_dispatch():
        return False  # the CPU client runs every program inline
    try:
        costs = xla_executable.cost_analysis()
    except Exception:  # no cost analysis: it may be cheap, keep JAX's dispatch
        return False
    if isinstance(costs, (list, tuple)):  # one dict per program in older jaxlibs
        costs = costs[0] if len(costs) == 1 else None
    if not isinstance(costs, dict):
        return False
    return float(costs.get("flops", 0.0)) >= compat.XLA_CPU_INLINE_FLOPS


def _dispatching_fast(original: Any) -> Any:
    """``ExecuteReplicated.__init__`` that records no effect where :func:`_dispatch_fast`."""

    @functools.wraps(original)
    def __init__(self: Any, xla_executable: Any, name: Any, backend: Any, in_handler: Any,
                 out_handler: Any, unordered_effects: list[Any], *args: Any,
                 **kwargs: Any) -> None:
        try:
            fast = _dispatch_fast(xla_executable, backend, out_handler, unordered_effects)
        except Exception as e:  # never break a JAX program over a speed-up
            compat.failed_at_run_time(compat.FAST_DISPATCH.name, e)
            fast = False
        original(self, xla_executable, name, backend, in_handler, out_handler,
                 [] if fast else unordered_effects, *args, **kwargs)

    return __init__


def install() -> None:
    """Wrap ``ExecuteReplicated.__init__`` (the ``fast_dispatch`` feature also runs the
    device-thread hint, a pass of the lowering hook).

    Calling it again does nothing. A failure while deciding leaves JAX's own choice.
    """
    compat.wrap_once(compat.ExecuteReplicated, "__init__", "_jax_cpu_mpi_fast_dispatch",
                     _dispatching_fast)
