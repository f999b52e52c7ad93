"""``psum`` of a whole pytree as one collective per dtype and type, not one per leaf.

JAX binds ``psum`` leaf by leaf. In one process XLA's all-reduce combiner merges the
all-reduces afterwards, but a collective this package lowers over MPI is a custom call XLA
cannot merge: each leaf is then a meeting of the process's devices (and an MPI all-reduce
where the group crosses processes), with the waits and wake-ups of a meeting every time. A
pipeline's gradients are a dozen leaves or more. Packing the leaves into one buffer first
makes that one meeting; the sums are the same, element by element.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_cpu_mpi._src.ops.vma import vma_of

PyTree = Any


def psum_packed(tree: PyTree, axis_name: Hashable | tuple[Hashable, ...]) -> PyTree:
    """``jax.lax.psum(tree, axis_name)``, with the leaves of one dtype and one varying type
    (``check_vma``) reduced as one flat buffer.

    Leaves are grouped by type as well as dtype because packing a leaf with one that varies
    over more axes would make its result vary over them too (a ``concatenate`` casts its
    operands to the widest type), and an output spec that expects it invariant would then
    refuse it."""
    leaves, treedef = jax.tree.flatten(tree)
    out: list[Any] = [None] * len(leaves)
    groups: dict[tuple[Any, frozenset], list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault((jnp.result_type(leaf), vma_of(leaf)), []).append(i)
    for members in groups.values():
        if len(members) == 1:
            (i,) = members
            out[i] = jax.lax.psum(leaves[i], axis_name)
            continue
        flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in members])
        summed = jax.lax.psum(flat, axis_name)
        offsets = np.cumsum([0] + [int(np.size(leaves[i])) for i in members])
        for i, start, stop in zip(members, offsets[:-1], offsets[1:], strict=True):
            out[i] = summed[start:stop].reshape(np.shape(leaves[i]))
    return jax.tree.unflatten(treedef, out)


def pmean_packed(tree: PyTree, axis_name: Hashable | tuple[Hashable, ...]) -> PyTree:
    """``jax.lax.pmean(tree, axis_name)`` by :func:`psum_packed`: the packed sum divided by
    the axis size leaf by leaf, as ``pmean`` divides its sum."""
    size = jax.lax.psum(1, axis_name)
    return jax.tree.map(lambda x: x / size, psum_packed(tree, axis_name))
