"""Flax NNX modules as pipeline stages: blocks of one structure, stacked, and back.

A model's repeated blocks (``L`` modules of one class and configuration) become the
pipeline's stacked parameters: their ``nnx.Param`` states as plain nested dicts
(``nnx.to_pure_dict``: what Optax and Orbax take as they are), ``L / (P V)`` consecutive
blocks per chunk, in the ``[P, (V,) K, ...]`` layout of :func:`.reference.stack_stages` with
the chunk's ``K`` blocks on the axis after it; the stage function merges each block again
(``nnx.merge``) and calls it. :meth:`NnxStages.blocks` turns stacked parameters (or
gradients, or an optimizer's moments, anything shaped like them) back into one dict per
block, the model's own tree, which ``nnx.update`` writes into the modules.

Flax is imported when an :class:`NnxStages` is made, not with the package (it is optional:
the ``examples`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_cpu_mpi._src.pipeline.reference import chunk_list, stack_stages

__all__ = ["NnxStages"]

PyTree = Any


def _default_call(block: Any, x: PyTree, rngs: Any | None) -> PyTree:
    return block(x) if rngs is None else block(x, rngs=rngs)


class NnxStages:
    """Stacked stage parameters and a stage function for repeated Flax NNX blocks.

    Args:
      blocks: the model's blocks in model order, all of one graph (class, configuration,
        parameter shapes); their number a multiple of ``stages * virtual_stages``.
      stages: ``P``, the size of the pipeline's stage axis.
      virtual_stages: ``V`` (interleaved schedules), else 1.
      call: how a block runs: ``call(block, x, rngs)`` with ``rngs`` an ``nnx.Rngs`` whose
        ``dropout`` stream is the chunk's key (folded with the block's place in the chunk)
        when the pipeline has a key, else ``None``. The default calls ``block(x)``, or
        ``block(x, rngs=rngs)``.

    Only ``nnx.Param`` variables are stacked and trained; any other state (a counter, a
    batch statistic) is taken from the first block and stays fixed: randomness comes from
    the pipeline's key, not from ``nnx.Rngs`` held by the blocks.
    """

    def __init__(self, blocks: Sequence[Any], stages: int, virtual_stages: int = 1,
                 call: Callable[[Any, PyTree, Any | None], PyTree] | None = None) -> None:
        from flax import nnx

        self._nnx = nnx
        chunks = stages * virtual_stages
        if not blocks or len(blocks) % chunks:
            raise ValueError(
                f"jax_cpu_mpi.pipeline.NnxStages: {len(blocks)} blocks do not split evenly "
                f"over {stages} stages x {virtual_stages} virtual stage(s) = {chunks} chunks; "
                f"give a multiple of {chunks} blocks")
        splits = [nnx.split(b, nnx.Param, ...) for b in blocks]
        self.graphdef, _, self.rest = splits[0]
        for i, (graphdef, params, _) in enumerate(splits):
            if graphdef != self.graphdef or jax.tree.structure(params) != \
                    jax.tree.structure(splits[0][1]) or any(
                        a.shape != b.shape or a.dtype != b.dtype for a, b in zip(
                            jax.tree.leaves(params), jax.tree.leaves(splits[0][1]),
                            strict=True)):
                raise ValueError(
                    f"jax_cpu_mpi.pipeline.NnxStages: block {i} differs from block 0 in its "
                    f"graph or parameter shapes; the pipeline stacks the blocks' parameters, "
                    f"so every block must be the same module class and configuration")
        self.stages, self.virtual_stages = stages, virtual_stages
        self.per_chunk = len(blocks) // chunks
        self.call = call or _default_call
        self._block_params = [nnx.to_pure_dict(params) for _, params, _ in splits]

    @property
    def num_blocks(self) -> int:
        """``L``, the number of blocks."""
        return self.per_chunk * self.stages * self.virtual_stages

    def params(self) -> PyTree:
        """The blocks' parameters (as given when made, plain dicts) in the stacked layout."""
        return self.stack(self._block_params)

    def stack(self, per_block: Sequence[PyTree]) -> PyTree:
        """One pytree per block (``nnx.to_pure_dict(nnx.state(block, nnx.Param))``, or anything
        shaped like it), model order, to the pipeline's layout: leaves ``[P, K, ...]``
        (``[P, V, K, ...]``)."""
        if len(per_block) != self.num_blocks:
            raise ValueError(f"jax_cpu_mpi.pipeline.NnxStages.stack: {len(per_block)} "
                             f"pytrees for {self.num_blocks} blocks")
        K = self.per_chunk
        chunks = [jax.tree.map(lambda *a: jnp.stack(a), *per_block[c * K:(c + 1) * K])
                  for c in range(len(per_block) // K)]
        return stack_stages(chunks, self.stages, self.virtual_stages)

    def blocks(self, stacked: PyTree) -> list[PyTree]:
        """The inverse of :meth:`stack`: one pytree per block, in model order (of host or
        unsharded arrays: ``jax.device_get`` sharded ones first)."""
        K = self.per_chunk
        return [jax.tree.map(lambda a, k=k: a[k], chunk)
                for chunk in chunk_list(stacked, self.virtual_stages) for k in range(K)]

    def update(self, modules: Sequence[Any], stacked: PyTree) -> None:
        """Write stacked parameters into the blocks (``nnx.update``, block by block)."""
        for module, state in zip(modules, self.blocks(stacked), strict=True):
            self._nnx.update(module, state)

    def stage_fn(self, params: PyTree, x: PyTree, key: jax.Array | None = None) -> PyTree:
        """One chunk: its ``K`` blocks in order (``params``: leaves ``[K, ...]``). With a key
        (``value_and_grad(..., key=...)``), block ``k`` gets ``fold_in(key, k)`` as its
        ``dropout`` stream."""
        nnx = self._nnx
        for k in range(self.per_chunk):
            block = nnx.merge(self.graphdef, jax.tree.map(lambda a, k=k: a[k], params),
                              self.rest)
            rngs = None if key is None else nnx.Rngs(dropout=jax.random.fold_in(key, k))
            x = self.call(block, x, rngs)
        return x
