"""Chunks with parameters of different shapes: one function and one pytree per chunk.

The executor stacks parameters over the stage axis, so every chunk's pytree must have the
same shapes. Here each chunk's parameters are flattened to one vector
(``jax.flatten_util.ravel_pytree``), padded to the longest, and stacked; the stage function
unflattens the vector of the chunk it runs and calls that chunk's function (a ``lax.switch``
on the chunk index). Activations still pass from chunk to chunk, so every chunk's output must
be shaped like its input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

__all__ = ["PerChunkStages"]

PyTree = Any


class PerChunkStages:
    """``functions[c](params[c], x)`` for chunk ``c``, over flattened, padded parameters."""

    def __init__(self, functions: Sequence[Callable[[PyTree, PyTree], PyTree]],
                 params: Sequence[PyTree]) -> None:
        if len(functions) != len(params):
            raise ValueError(
                f"jax_cpu_mpi.pipeline: {len(functions)} stage functions but parameters for "
                f"{len(params)} chunks; give one pytree per function, in model order")
        self.functions = tuple(functions)
        flats, self.unravel = zip(*(ravel_pytree(p) for p in params), strict=True)
        dtypes = {f.dtype for f in flats}
        if len(dtypes) > 1:
            raise ValueError(
                f"jax_cpu_mpi.pipeline: chunks with parameters of different shapes must share "
                f"one dtype (they are flattened into one vector each); got "
                f"{sorted(map(str, dtypes))}")
        self.sizes = tuple(int(f.size) for f in flats)
        self.length = max(max(self.sizes), 1)
        self.flats = flats

    def stacked(self, stages: int, virtual_stages: int) -> jax.Array:
        """The padded vectors as ``[P, L]`` (or ``[P, V, L]``: chunk ``v * P + s`` at
        ``[s, v]``)."""
        padded = [jnp.pad(f, (0, self.length - f.size)) for f in self.flats]
        P, V = stages, virtual_stages
        if V == 1:
            return jnp.stack(padded)
        return jnp.stack([jnp.stack([padded[v * P + s] for v in range(V)]) for s in range(P)])

    def split(self, stacked: jax.Array, stages: int, virtual_stages: int) -> list[PyTree]:
        """Per-chunk pytrees (model order) from ``[P, L]`` / ``[P, V, L]`` vectors."""
        P, V = stages, virtual_stages
        rows = [stacked[c] if V == 1 else stacked[c % P, c // P] for c in range(P * V)]
        return [u(r[:n]) for u, r, n in zip(self.unravel, rows, self.sizes, strict=True)]

    def chunk(self, c: int, vector: jax.Array) -> PyTree:
        """Chunk ``c``'s parameters from its padded vector."""
        return self.unravel[c](vector[:self.sizes[c]])

    def apply(self, vector: jax.Array, x: PyTree, c: Any, *key: jax.Array) -> PyTree:
        """Chunk ``c`` (traced) on ``x`` (with its PRNG key, where the pipeline has one)."""
        branches = [lambda v, x, *k, i=i: self.functions[i](self.chunk(i, v), x, *k)
                    for i in range(len(self.functions))]
        if len(branches) == 1:
            return branches[0](vector, x, *key)
        return jax.lax.switch(c, branches, vector, x, *key)
