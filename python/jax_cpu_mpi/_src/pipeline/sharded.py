"""``shard_value_and_grad``: :func:`value_and_grad` with its ``shard_map`` built for a mesh."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jax_cpu_mpi._src.pipeline.executor import PipelineError, value_and_grad
from jax_cpu_mpi._src.pipeline.per_chunk import PerChunkStages
from jax_cpu_mpi._src.pipeline.schedules import Schedule

__all__ = ["shard_value_and_grad"]

PyTree = Any


def shard_value_and_grad(
    stage_fn: Callable[[PyTree, PyTree], PyTree] | Sequence[Callable[[PyTree, PyTree], PyTree]],
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    mesh: jax.sharding.Mesh,
    schedule: Schedule,
    *,
    axis_name: Hashable = "stage",
    data_axis_name: Hashable | None = None,
    return_outputs: bool = False,
    return_input_grads: bool = False,
    remat: bool = True,
) -> Callable[..., Any]:
    """A function ``(params, microbatches, targets, key=None, loss_params=None) -> (loss,
    grads[, loss_param_grads][, outputs][, input_grads])`` that runs :func:`value_and_grad`
    under ``jax.shard_map`` over ``mesh`` (wrap it in ``jax.jit``).

    ``key``: a PRNG key for stage functions that draw random numbers (dropout): they are then
    called ``stage_fn(chunk_params, x, chunk_key)``, one key per microbatch, chunk and data
    shard (:func:`microbatch_key`), as :func:`reference_value_and_grad` gives them.
    ``loss_params``: parameters of the loss (replicated), which ``loss_fn(loss_params, y,
    target)`` then takes; their gradient (replicated) follows ``grads``.

    ``params``: stacked leaves ``[P, ...]`` (``[P, V, ...]`` interleaved), sharded over
    ``axis_name``; ``microbatches`` / ``targets``: ``[M, batch, ...]`` leaves, the batch axis
    sharded over ``data_axis_name`` if given, else replicated. ``loss`` is replicated,
    ``grads`` are sharded like ``params``, ``outputs`` and ``input_grads`` (the gradient with
    respect to ``microbatches``) like the microbatches.

    Chunks whose parameters differ in shape: give ``stage_fn`` as a sequence of ``P x V``
    functions (model order) and ``params`` as a sequence of as many pytrees, one per chunk
    (the gradients come back the same way). Each chunk's parameters are flattened into one
    padded vector per chunk (they must share one dtype); activations must still keep their
    shape from chunk to chunk.

    ``remat``: as for :func:`value_and_grad` (``False`` keeps the forward's residuals).
    """
    if axis_name not in mesh.shape:
        raise PipelineError(f"jax_cpu_mpi.pipeline.shard_value_and_grad: the mesh has axes "
                            f"{dict(mesh.shape)}, no stage axis {axis_name!r}")
    P = mesh.shape[axis_name]
    V = schedule.virtual_stages
    if schedule.stages is not None and schedule.stages != P:
        raise PipelineError(
            f"jax_cpu_mpi.pipeline.shard_value_and_grad: {schedule._title()} has "
            f"stages={schedule.stages} x virtual_stages={V}, but the mesh axis {axis_name!r} "
            f"has {P} devices; P must be the axis size (P x V = {schedule.stages * V} chunks "
            f"is not {P} x {V})")
    data = PartitionSpec(None, data_axis_name) if data_axis_name is not None else PartitionSpec()
    stage = PartitionSpec(axis_name)
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

    def place(tree: PyTree, spec: PartitionSpec) -> PyTree:
        # A mesh with Explicit axes (jax.make_mesh's default) types shardings: shard_map then
        # takes only arrays already laid out as its in_specs say.
        if not explicit:
            return tree
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return jax.tree.map(lambda a: jax.reshard(a, sharding), tree)

    def body(params: PyTree, microbatches: PyTree, targets: PyTree, key: jax.Array | None,
             loss_params: PyTree | None) -> Any:
        return value_and_grad(stage_fn, params, loss_fn, microbatches, targets, schedule,
                              axis_name=axis_name, data_axis_name=data_axis_name,
                              return_outputs=return_outputs,
                              return_input_grads=return_input_grads, remat=remat,
                              key=key, loss_params=loss_params)

    def mapped(body: Callable[..., Any], key: jax.Array | None, loss_params: PyTree | None,
               *args: Any) -> Any:
        # The key and the loss's parameters, where given, replicated; None passes through
        # shard_map as an empty pytree.
        rep = PartitionSpec()
        out_specs = ((rep, stage) + ((rep,) if loss_params is not None else ())
                     + ((data,) if return_outputs else ())
                     + ((data,) if return_input_grads else ()))
        return jax.shard_map(body, mesh=mesh, in_specs=(stage, data, data, rep, rep),
                             out_specs=out_specs)(*args, place(key, rep),
                                                  place(loss_params, rep))

    def run(params: PyTree, microbatches: PyTree, targets: PyTree,
            key: jax.Array | None = None, loss_params: PyTree | None = None) -> Any:
        return mapped(body, key, loss_params, place(params, stage), place(microbatches, data),
                      place(targets, data))

    if callable(stage_fn):
        return run
    functions = tuple(stage_fn)
    if len(functions) != P * V:
        raise PipelineError(
            f"jax_cpu_mpi.pipeline.shard_value_and_grad: {len(functions)} stage functions "
            f"for {P} stages x {V} virtual stages; give one per chunk (P x V = {P * V})")

    def run_per_chunk(params: Sequence[PyTree], microbatches: PyTree, targets: PyTree,
                      key: jax.Array | None = None, loss_params: PyTree | None = None) -> Any:
        per_chunk = PerChunkStages(functions, params)

        def body(vectors: jax.Array, microbatches: PyTree, targets: PyTree,
                 key: jax.Array | None, loss_params: PyTree | None) -> Any:
            return value_and_grad(per_chunk, vectors, loss_fn, microbatches, targets,
                                  schedule, axis_name=axis_name,
                                  data_axis_name=data_axis_name,
                                  return_outputs=return_outputs,
                                  return_input_grads=return_input_grads, remat=remat,
                                  key=key, loss_params=loss_params)

        result = mapped(body, key, loss_params, place(per_chunk.stacked(P, V), stage),
                        place(microbatches, data), place(targets, data))
        # Gathered before it is cut into chunks (a cut across the sharded stage axis would
        # not type on a mesh with Explicit axes).
        grads = place(result[1], PartitionSpec())
        return (result[0], per_chunk.split(grads, P, V), *result[2:])

    return run_per_chunk
