"""Batching rules for JAX's reduced/unreduced collectives and their no-op casts.

Every rule takes ``(axis_data, vals_in, dims_in, **params)`` like JAX's "fancy" batchers and
handles two cases:

* the vmapped axis is not one of the collective's axes: the collective is bound once on the
  batched operand (the batch dimension rides along, one collective for the whole batch);
* the vmapped axis is one of the collective's axes (``vmap(..., axis_name=a)``): the members
  of the collective along ``a`` are the batch elements, so that part of the collective is
  done locally on the batch dimension, the same way JAX's own ``all_gather`` /
  ``psum_scatter`` batchers do it, and any remaining (mesh) axes of a tuple ``axis_name``
  are still communicated in one collective.

Tuple axis names are linearized in tuple order (the first name is the major index), as
JAX's lowering does for replica groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

from jax_cpu_mpi._src.compat import (
    all_gather_reduced_p,
    available,
    unreduced_psum_p,
    unreduced_reduce_scatter_p,
    vary_unreduced_cast_p,
)

Rule = Callable[..., tuple[Any, Any]]


def as_tuple(axis_name: Any) -> tuple:
    """``axis_name`` as a tuple of names."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def group_size(names: tuple) -> int:
    """The product of the sizes of the named axes (1 for no names)."""
    return int(np.prod([lax.axis_size(n) for n in names], dtype=np.int64)) if names else 1


def batch_first(x: Any, d: int | None, size: int) -> Any:
    """``x`` with its batch dimension first (broadcast along a new one when unbatched)."""
    if d is None:
        return lax.broadcast(x, (size,))
    return jax.numpy.moveaxis(x, d, 0) if d != 0 else x


def _merge(x: Any, start: int, count: int) -> Any:
    """Merge ``count`` consecutive dimensions of ``x`` starting at ``start`` (row-major)."""
    shape = x.shape
    merged = int(np.prod(shape[start:start + count], dtype=np.int64))
    return lax.reshape(x, (*shape[:start], merged, *shape[start + count:]))


def _split(x: Any, dim: int, sizes: Sequence[int]) -> Any:
    """Split dimension ``dim`` of ``x`` into ``sizes`` (row-major)."""
    shape = x.shape
    return lax.reshape(x, (*shape[:dim], *sizes, *shape[dim + 1:]))


def frame_members(axis_data: Any, op: str) -> tuple:
    """The axes whose members are the batch elements of the vmapped axis, in order.

    Usually just the vmapped axis. Under ``vmap(..., spmd_axis_name=s)`` of a ``shard_map``,
    JAX splits the batch over the mesh axes ``s`` and batches the body with the local part:
    then the members along the vmapped axis are (``s``..., local batch element).
    """
    frame, local = axis_data.name, axis_data.size
    full = lax.axis_size(frame)
    if full == local:
        return (frame,)
    spmd = tuple(axis_data.spmd_name or ())
    if spmd and group_size(spmd) * local == full:
        return (*spmd, frame)
    raise ValueError(
        f"{op}: vmapped axis {frame!r} has size {full} but its batch here has {local} "
        f"elements, and spmd_axis_name={axis_data.spmd_name!r} does not account for the rest.")


class Group(NamedTuple):
    """A collective's axes around the vmapped one: ``before`` + (vmapped) + ``after``."""

    before: tuple
    after: tuple
    rest_size: int  # size of before + after (the part still communicated)
    prefix: int  # size of before
    spmd: tuple  # the mesh axes that split the batch (spmd_axis_name), last ones of before


def group_around_frame(axis_data: Any, names: tuple, axis_size: int, op: str) -> Group:
    """Split ``names`` around the vmapped axis (after :func:`frame_members`), checked."""
    k = names.index(axis_data.name)
    members = frame_members(axis_data, op)
    before, after = names[:k] + members[:-1], names[k + 1:]
    rest_size = group_size(before + after)
    if rest_size * axis_data.size != axis_size:
        raise ValueError(
            f"{op}: collective over {names!r} of size {axis_size}, but the vmapped axis "
            f"{axis_data.name!r} (batch of {axis_data.size}) and the other axes "
            f"{before + after!r} (size {rest_size}) do not make up that size.")
    return Group(before, after, rest_size, group_size(before), members[:-1])


def _partials_over(y: Any, axes: tuple) -> Any:
    """Type ``y`` as unreduced (partial sums) over those ``axes`` it varies over.

    With spmd_axis_name, the batch is split over mesh axes, so the partials of different
    batch elements vary over them; a reduction along the vmapped axis reduces them too.
    """
    varying = tuple(a for a in axes if a in jax.typeof(y).mat.varying)
    return vary_unreduced_cast_p.bind(y, axes=varying) if varying else y


# ---------------------------------------------------------------- all_gather_reduced


def all_gather_reduced_rule(
    axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[int | None], *,
    all_gather_dimension: int, axis_name: Any, axis_size: int, tiled: bool,
) -> tuple[Any, int | None]:
    """Batching rule of ``all_gather_reduced_p`` (``all_gather(..., to='reduced')``)."""
    (x,), (d,) = vals_in, dims_in
    names = as_tuple(axis_name)
    params = dict(axis_name=axis_name, axis_size=axis_size, tiled=tiled)
    if axis_data.name not in names:
        if d is None:
            return all_gather_reduced_p.bind(
                x, all_gather_dimension=all_gather_dimension, **params), None
        if d == 0 or (d == all_gather_dimension and not tiled):
            return _gather_major(x, d, all_gather_dimension, names, axis_size, tiled)
        gdim = all_gather_dimension
        if d <= gdim:
            gdim += 1
        elif not tiled:  # the untiled gather inserts a dimension before the batch one
            d += 1
        return all_gather_reduced_p.bind(x, all_gather_dimension=gdim, **params), d
    return _gather_over_vmapped_axis(
        axis_data, x, d, all_gather_dimension, names, axis_size, tiled), None


def _gather_major(
    x: Any, d: int, gdim: int, names: tuple, axis_size: int, tiled: bool,
) -> tuple[Any, int]:
    """The batched gather with the gathered dimension in front of the batch dimension.

    XLA lays an all-gather out with its gathered dimension major. Gathering along dimension
    ``gdim + 1`` (behind the batch, as JAX's all_gather batcher does) makes XLA transpose
    both the operand and the result; gathering in front of the batch needs no transpose
    when the batch stays behind the gathered dimension (untiled, ``d == gdim``), and one
    transpose of the result otherwise.
    """
    y = all_gather_reduced_p.bind(x, all_gather_dimension=d, axis_name=names,
                                  axis_size=axis_size, tiled=False)  # (..., N, B, ...)
    if not tiled and d == gdim:
        return y, d + 1
    # d == 0: (N, B, *s) -> (B, *s[:gdim], N, *s[gdim:]), then N folds into s[gdim].
    y = jax.numpy.moveaxis(y, 0, gdim + 1)
    return (_merge(y, gdim + 1, 2) if tiled else y), 0


def _gather_over_vmapped_axis(
    axis_data: Any, x: Any, d: int | None, gdim: int, names: tuple, axis_size: int,
    tiled: bool,
) -> Any:
    """all_gather over ``names`` where the batch elements are the members along the frame."""
    group = group_around_frame(axis_data, names, axis_size, "all_gather(to='reduced')")
    rest, rest_size = group.before + group.after, group.rest_size
    xb = batch_first(x, d, axis_data.size)  # (A, *s)
    if rest:
        # One collective over the other axes for the whole batch, stacked at 1 + gdim.
        xb = all_gather_reduced_p.bind(
            xb, all_gather_dimension=1 + gdim, axis_name=rest, axis_size=rest_size,
            tiled=False)
    else:
        xb = lax.expand_dims(xb, (1 + gdim,))
    # (A, *s[:gdim], P*S, *s[gdim:]) -> (*s[:gdim], P, A, S, *s[gdim:]) -> merge to N.
    xb = _split(xb, 1 + gdim, (group.prefix, rest_size // group.prefix))
    xb = jax.numpy.moveaxis(xb, 0, gdim + 1)
    y = _merge(xb, gdim, 3)
    if tiled:  # the stacked axis is major within the tiled dimension
        y = _merge(y, gdim, 2)
    return y


# ---------------------------------------------------------- unreduced_reduce_scatter


def unreduced_reduce_scatter_rule(
    axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[int | None], *,
    axis_name: Any, scatter_dimension: int, axis_size: int, tiled: bool,
) -> tuple[Any, int | None]:
    """Batching rule of ``unreduced_reduce_scatter_p`` (``unreduced_psum_scatter``)."""
    (x,), (d,) = vals_in, dims_in
    names = as_tuple(axis_name)
    params = dict(axis_name=axis_name, axis_size=axis_size, tiled=tiled)
    if axis_data.name not in names:
        if d is None:
            return unreduced_reduce_scatter_p.bind(
                x, scatter_dimension=scatter_dimension, **params), None
        sdim = scatter_dimension
        if d <= sdim:
            sdim += 1
        elif not tiled:  # the untiled scatter removes a dimension before the batch one
            d -= 1
        return unreduced_reduce_scatter_p.bind(x, scatter_dimension=sdim, **params), d
    return _scatter_over_vmapped_axis(
        axis_data, x, d, scatter_dimension, names, axis_size, tiled), 0


def _scatter_over_vmapped_axis(
    axis_data: Any, x: Any, d: int | None, sdim: int, names: tuple, axis_size: int,
    tiled: bool,
) -> Any:
    """Reduce-scatter over ``names`` where the batch elements are the members along the frame.

    Returns the result with its batch dimension first.
    """
    frame_size = axis_data.size
    group = group_around_frame(axis_data, names, axis_size, "unreduced_psum_scatter")
    rest, rest_size, prefix = group.before + group.after, group.rest_size, group.prefix
    # The sum over the members along the frame is a local sum over the batch.
    y = x * lax.convert_element_type(frame_size, x.dtype) if d is None else x.sum(axis=d)
    n = y.shape[sdim]
    chunk = n // axis_size
    # Split the scatter dimension as (P, A, S, chunk); the frame index becomes the batch.
    y = _split(y, sdim, (prefix, frame_size, rest_size // prefix, chunk))
    y = jax.numpy.moveaxis(y, sdim + 1, 0)
    y = _merge(y, 1 + sdim, 3)  # (B, ..., P*S*chunk, ...)
    if rest:  # one collective over the other axes for the whole batch
        y = _partials_over(y, group.spmd)
        return unreduced_reduce_scatter_p.bind(
            y, scatter_dimension=1 + sdim, axis_name=rest, axis_size=rest_size, tiled=tiled)
    return y if tiled else lax.squeeze(y, (1 + sdim,))


# ------------------------------------------------------------------- unreduced_psum


def unreduced_psum_rule(
    axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[int | None], *, axes: tuple,
) -> tuple[Any, int | None]:
    """Batching rule of ``unreduced_psum_p`` (``psum`` of an unreduced value)."""
    (x,), (d,) = vals_in, dims_in
    if axis_data.name not in axes:
        return unreduced_psum_p.bind(x, axes=axes), d
    y = x * lax.convert_element_type(axis_data.size, x.dtype) if d is None else x.sum(axis=d)
    spmd = frame_members(axis_data, "unreduced_psum")[:-1]
    rest = tuple(a for a in axes if a != axis_data.name) + spmd
    y = _partials_over(y, spmd)
    return (unreduced_psum_p.bind(y, axes=rest) if rest else y), None


# ---------------------------------------------------- unreduced_pmax / unreduced_pmin


def unreduced_extremum_rule(prim: Any, op: str) -> Rule:
    """Batching rule of ``unreduced_pmax_p`` / ``unreduced_pmin_p`` (JAX >= 0.12).

    ``op`` is ``"max"`` or ``"min"``. ``pmax``/``pmin`` of a value that is unreduced over
    ``axes`` with that reduction kind (``reduce_max(..., out_sharding=P(unreduced=...,
    unreduced_kind=max))``): ONE collective of the batched operand, elementwise, so the
    batch dimension stays. Over the vmapped axis itself it raises ``NotImplementedError``:
    ``lax.pmax`` already refuses a vmapped axis among the axes of an unreduced value (a
    vmapped axis has no unreduced state), and JAX 0.11 cannot reduce such a value locally.
    """
    name = f"unreduced_p{op}"

    def rule(axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[int | None], *,
             axes: tuple) -> tuple[Any, int | None]:
        (x,), (d,) = vals_in, dims_in
        if axis_data.name not in axes:
            return prim.bind(x, axes=axes), d
        raise NotImplementedError(
            f"{name} over the vmapped axis {axis_data.name!r} (axes={axes!r}) is not "
            "supported: a vmapped axis has no unreduced state. Reduce over the mesh axes "
            f"inside vmap, then over {axis_data.name!r} with jax.lax.p{op}.")

    rule.__name__ = rule.__qualname__ = f"{name}_batching_rule"
    return rule


# ------------------------------------------------------------------------ no-op casts


def cast_rule(prim: Any) -> Rule:
    """Batching rule of a no-op type cast (``pcast``) over ``axes``.

    The value is unchanged; a vmapped axis is not a mesh axis and has no varying / reduced /
    unreduced state, so it is dropped from ``axes``.
    """

    def rule(axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[int | None], *,
             axes: tuple) -> tuple[Any, int | None]:
        (x,), (d,) = vals_in, dims_in
        rest = tuple(a for a in axes if a != axis_data.name)
        return (prim.bind(x, axes=rest) if rest else x), d

    rule.__name__ = rule.__qualname__ = f"{prim.name if available(prim) else 'cast'}_batching_rule"
    return rule
