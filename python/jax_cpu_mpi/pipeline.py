"""Pipeline parallelism on ``psend``/``precv``: schedules as data, and a differentiable runner.

A schedule (:class:`GPipe`, :class:`OneFOneB`, :class:`Interleaved1F1B`, :class:`ZeroBubble`)
is a table tick x stage -> :class:`Action`; ``print(schedule)`` draws it.
:func:`value_and_grad` runs one inside ``jax.shard_map`` over a stage axis and returns the mean
loss and the gradients of every stage's parameters, equal to ``jax.value_and_grad`` of the
model on one device (:func:`reference_value_and_grad`); :func:`shard_value_and_grad` builds
the ``shard_map`` for a mesh. A stage function may draw random numbers (``key=``, one key per
microbatch and chunk) and the loss may have parameters (``loss_params=``, a head);
:class:`NnxStages` makes stacked stage parameters and a stage function of Flax NNX blocks.
Activations travel downstream and cotangents upstream with :func:`jax_cpu_mpi.psend` /
:func:`jax_cpu_mpi.precv`: the same program on CPU (in-process and MPI) and on GPU (NCCL).
See ``docs/pipelines.md``.
"""

from __future__ import annotations

from jax_cpu_mpi._src.pipeline.executor import PipelineError, microbatch_key, value_and_grad
from jax_cpu_mpi._src.pipeline.nnx import NnxStages
from jax_cpu_mpi._src.pipeline.reference import (
    chunk_list,
    reference_value_and_grad,
    split_microbatches,
    stack_stages,
)
from jax_cpu_mpi._src.pipeline.schedules import (
    Action,
    FromTable,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    ScheduleError,
    ZeroBubble,
    schedule_by_name,
)
from jax_cpu_mpi._src.pipeline.sharded import shard_value_and_grad

__all__ = ["Action", "FromTable", "GPipe", "Interleaved1F1B", "NnxStages", "OneFOneB",
           "PipelineError",
           "Schedule", "ScheduleError", "ZeroBubble", "chunk_list", "microbatch_key",
           "reference_value_and_grad",
           "schedule_by_name", "shard_value_and_grad", "split_microbatches", "stack_stages",
           "value_and_grad"]
