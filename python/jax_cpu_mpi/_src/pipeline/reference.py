"""The model a pipeline computes, on one device: the reference its results must equal, and
helpers to lay out parameters and batches the way the pipeline wants them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_cpu_mpi._src.pipeline.executor import microbatch_key

__all__ = ["reference_value_and_grad", "split_microbatches", "stack_stages"]

PyTree = Any


def stack_stages(chunks: Sequence[PyTree], stages: int, virtual_stages: int = 1) -> PyTree:
    """Stack the parameters of ``stages * virtual_stages`` model chunks, given in model order,
    into the pipeline's layout: leaves ``[P, ...]``, or ``[P, V, ...]`` where chunk
    ``v * P + s`` sits at ``[s, v]`` (Megatron's looping placement). Every chunk's pytree must
    have the same shapes."""
    P, V = stages, virtual_stages
    if len(chunks) != P * V:
        raise ValueError(f"stack_stages: {len(chunks)} chunks for {P} stages x {V} virtual "
                         f"stages; need P x V = {P * V}")
    if V == 1:
        return jax.tree.map(lambda *a: jnp.stack(a), *chunks)
    rows = [jax.tree.map(lambda *a: jnp.stack(a), *[chunks[v * P + s] for v in range(V)])
            for s in range(P)]
    return jax.tree.map(lambda *a: jnp.stack(a), *rows)


def chunk_list(params: PyTree, virtual_stages: int = 1) -> list[PyTree]:
    """The inverse of :func:`stack_stages`: the chunks' parameters in model order."""
    P = jax.tree.leaves(params)[0].shape[0]
    V = virtual_stages
    if V == 1:
        return [jax.tree.map(lambda a, s=s: a[s], params) for s in range(P)]
    return [jax.tree.map(lambda a, c=c: a[c % P, c // P], params) for c in range(P * V)]


def split_microbatches(batch: PyTree, microbatches: int) -> PyTree:
    """``[B, ...]`` leaves to ``[M, B / M, ...]`` (consecutive samples per microbatch)."""
    def one(a: Any) -> Any:
        if a.shape[0] % microbatches:
            raise ValueError(f"split_microbatches: a batch of {a.shape[0]} samples does not "
                             f"split into {microbatches} equal microbatches")
        return a.reshape(microbatches, a.shape[0] // microbatches, *a.shape[1:])
    return jax.tree.map(one, batch)


def reference_value_and_grad(
    stage_fn: Callable[[PyTree, PyTree], PyTree],
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    params: PyTree,
    microbatches: PyTree,
    targets: PyTree,
    virtual_stages: int = 1,
    return_input_grads: bool = False,
    key: jax.Array | None = None,
    data_shards: int | None = None,
    loss_params: PyTree | None = None,
) -> tuple[Any, ...]:
    """``jax.value_and_grad`` of the model a pipeline runs, on one device, no pipeline.

    ``params`` are the stacked parameters (leaves ``[P, ...]`` or ``[P, V, ...]``); the model
    applies chunk ``0, 1, ..., P V - 1`` (chunk ``c = v * P + s``) to each microbatch; the loss
    is the mean over microbatches of ``loss_fn(output, target)``. Returns ``(loss, grads)``,
    and the gradient with respect to ``microbatches`` after them if ``return_input_grads``.

    ``key``: as for :func:`value_and_grad`, ``stage_fn(chunk, x, microbatch_key(key, m, c,
    d))``; ``data_shards``: the size of the pipeline's data axis, if it has one: each
    microbatch's batch axis (its leaves' first) is then cut into that many equal shards, each
    with its own keys, as the data shards of a pipeline draw them. (Without a key the shards
    change nothing: the chunks see the samples of a microbatch alike.) ``loss_params``:
    as for :func:`value_and_grad`, ``loss_fn(loss_params, output, target)``; their gradient
    then follows ``grads``.
    """
    V = virtual_stages

    def loss(params: PyTree, microbatches: PyTree, loss_params: PyTree) -> jax.Array:
        chunks = chunk_list(params, V)

        def apply(x: PyTree, m: jax.Array, d: jax.Array | None) -> PyTree:
            for c, chunk in enumerate(chunks):
                x = stage_fn(chunk, x) if key is None else \
                    stage_fn(chunk, x, microbatch_key(key, m, c, d))
            return x

        def one(x: PyTree, y: PyTree, m: jax.Array) -> jax.Array:
            if key is None or data_shards is None:
                x = apply(x, m, None)
            else:  # the shards of the batch axis, each with its keys, then joined again
                D = data_shards
                shards = jax.tree.map(lambda a: a.reshape(D, a.shape[0] // D, *a.shape[1:]), x)
                out = jax.vmap(lambda x, d: apply(x, m, d))(shards, jnp.arange(D))
                x = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), out)
            value = loss_fn(x, y) if loss_params is None else loss_fn(loss_params, x, y)
            return value.astype(jnp.float32)

        M = jax.tree.leaves(microbatches)[0].shape[0]
        return jnp.mean(jax.vmap(one)(microbatches, targets, jnp.arange(M)))

    argnums = (0,) + ((2,) if loss_params is not None else ()) + \
        ((1,) if return_input_grads else ())
    value, grads = jax.value_and_grad(loss, argnums=argnums)(params, microbatches, loss_params)
    return (value, *grads)
