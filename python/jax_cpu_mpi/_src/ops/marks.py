"""Marks: points in a program's run that the program names, recorded into the timeline.

``mark(label, after)`` returns its two operands unchanged. On CPU it is a custom call of
ours (``jax_cpu_mpi_mark``, ``cpp/ffi/mark.cc``) that, while tracing
(:func:`jax_cpu_mpi.trace`), records the time it ran, the device, and ``label``: int32
``[tick, action, microbatch, virtual stage]``. Whatever reads a result runs after the mark,
and the mark runs after whatever makes ``after``: data orders it, not a side effect (XLA
CPU orders a side-effecting call against every other one, which made the tick marks cost
a small model's step a few per cent; as a plain call whose results the program reads they
cost nothing measurable: ``benchmarks/results/dev-2core-2026-12-03-ticks/``). A mark whose
results nobody reads is dropped, like any unused value. The pipeline executor marks each
tick's start (its row of the plan goes through the mark) and the step's end (the loss
goes through), which gives every tick's span on every device
(:attr:`jax_cpu_mpi.Timeline.ticks`). Its results alias its operands: nothing is copied.

Elsewhere (GPU, or a CPU whose handlers could not be registered) the mark is the identity:
the same program exports for GPU without a CPU-only call. Under ``jax.grad`` ``after``'s
tangent passes through; under ``vmap`` the mark runs once per example.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax_cpu_mpi._src.ffi import registration
from jax_cpu_mpi._src.ops.vma import vary, vma_of

MARK_TARGET = "jax_cpu_mpi_mark"

#: The ``action`` word of a tick's label.
IDLE, FORWARD, BACKWARD, WEIGHT, END = 0, 1, 2, 3, -1
ACTION_NAMES = {IDLE: "idle", FORWARD: "F", BACKWARD: "B", WEIGHT: "W", END: "end"}


def _targets_registered() -> bool:
    return registration.targets_available()


def _call(label: jax.Array, after: Any) -> tuple[jax.Array, Any]:
    call = jax.ffi.ffi_call(
        MARK_TARGET,
        (jax.ShapeDtypeStruct(label.shape, label.dtype),
         jax.ShapeDtypeStruct(after.shape, after.dtype)),
        vmap_method="sequential", input_output_aliases={0: 0, 1: 1})
    # The process reaches the handler out of band: an attribute would make each process's
    # program differ, and XLA's collectives between processes need the same program on all.
    registration.tell_this_process(jax.process_index())
    out = call(label, after)
    # JAX cannot type a custom call's results inside shard_map: they vary as the operands.
    return vary(out[0], vma_of(label)), vary(out[1], vma_of(after))


@jax.custom_jvp
def mark(label: jax.Array, after: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(label, after)`` unchanged, with the mark recorded on CPU while tracing (module
    docstring). ``label``: int32 ``[4]``; ``after``: one array."""
    if not _targets_registered():
        return label, after
    return jax.lax.platform_dependent(label, after, cpu=_call,
                                      default=lambda label, after: (label, after))


@mark.defjvp
def _mark_jvp(primals: tuple, tangents: tuple) -> tuple:
    label, after = primals
    out = mark(label, after)
    return out, (np.zeros(label.shape, jax.dtypes.float0), tangents[1])


__all__ = ["ACTION_NAMES", "BACKWARD", "END", "FORWARD", "IDLE", "MARK_TARGET", "WEIGHT",
           "mark"]
