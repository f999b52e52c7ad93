"""``jax_cpu_mpi.psend`` / ``jax_cpu_mpi.precv``: JAX's point-to-point API, kept alive.

JAX 0.12 deprecates ``jax.lax.psend`` / ``jax.lax.precv`` (a ``DeprecationWarning`` on each
access) and names no replacement; JAX removes deprecated APIs a few releases later. These
functions have JAX's signatures and semantics and bind the primitives of
:mod:`jax_cpu_mpi._src.ops.primitives`: JAX's own while JAX has them (so they never warn, and a
program may mix them with ``jax.lax.psend``/``precv``), ours once JAX drops them. On CPU
they lower to jax_cpu_mpi's transport, on GPU to ``stablehlo.send``/``recv`` (NCCL), the same
program on both.

Migrating is one import: replace ``jax.lax.psend`` / ``jax.lax.precv`` by
``jax_cpu_mpi.psend`` / ``jax_cpu_mpi.precv``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax

from jax_cpu_mpi._src import compat
from jax_cpu_mpi._src.compat import available, insert_collective_pvary, register_source_exclusion
from jax_cpu_mpi._src.ops.primitives import precv_p, psend_p

# A psend is located at the user's line, not at the bind below (as jax.lax.psend is).
register_source_exclusion(__file__)

AxisName = Hashable | tuple[Hashable, ...]
Perm = Sequence[tuple[int, int]]


def _axis_tuple(axis_name: Any) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (list, tuple)) else (axis_name,)


def _perm_tuple(perm: Perm) -> tuple[tuple[int, int], ...]:
    return tuple(map(tuple, perm))


def check_perm_in_axis(op_name: str, axis_name: tuple, perm: Perm, axis_size: int) -> None:
    """ValueError unless every index of ``perm`` addresses a device of the axis: ``0`` to
    ``axis_size - 1``, or ``-axis_size`` to ``-1`` counted from the end (as JAX's lowering
    reads them). Outside that range JAX fails with an ``IndexError`` or a wrong
    "sources and destinations must be unique"."""
    for pair in perm:
        if len(pair) != 2:
            raise ValueError(f"{op_name}: perm={list(map(tuple, perm))!r} must be "
                             f"(source, destination) pairs; got {tuple(pair)!r}")
        if all(-axis_size <= int(i) < axis_size for i in pair):
            continue
        axes = (f"axis {axis_name[0]!r} of size {axis_size}" if len(axis_name) == 1 else
                f"axes {tuple(axis_name)!r} of size {axis_size} (the product of their sizes)")
        raise ValueError(
            f"{op_name}: the pair {tuple(pair)!r} of perm={list(map(tuple, perm))!r} names a "
            f"device outside {axes}: indices must be 0..{axis_size - 1} (or "
            f"-{axis_size}..-1, counted from the end)")


def _check_perm(op_name: str, names: tuple, pairs: tuple) -> None:
    """:func:`check_perm_in_axis` at trace time, where the axis is bound (outside
    ``shard_map`` the bind that follows raises JAX's own unbound-axis error)."""
    try:
        size = jax.lax.axis_size(names if len(names) > 1 else names[0])
    except NameError:
        return
    check_perm_in_axis(op_name, names, pairs, int(size))


def _pvary(names: tuple, x: Any) -> Any:
    """What JAX's psend does to its operand: mark it varying over ``names`` (vma types)."""
    if available(insert_collective_pvary):
        return insert_collective_pvary(names, x)
    varying = getattr(jax.typeof(x), "vma", None)  # a JAX without the helper: public pcast
    missing = tuple(n for n in names if varying is not None and n not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


# The leaves of a pytree share every pair of devices, and a pair's messages are matched in
# the order their ops run; XLA CPU may run two psends (or two precvs) that no buffer links
# side by side, and two leaves of one shape then arrive swapped. So the leaves' sends are
# chained, and so are their receives, in tree_flatten order, through optimization_barrier:
# on CPU our lowering of it (lowering/barrier_tokens.py) and the module pass
# (passes/kept_operands.py) turn it into buffer dependencies, which XLA keeps at run time.
# Where that lowering is off, JAX's cannot lower a token on CPU at all: leaves unchained.


def _after_token(token: Any, value: Any) -> Any:
    """``value`` unchanged, computed only after the op that made ``token``."""
    if not compat.BARRIER_TOKENS.active:
        return value
    return jax.lax.optimization_barrier((token, value))[1]


def _token_after(value: Any, token: Any) -> Any:
    """``token``, usable only once ``value`` is computed."""
    if not compat.BARRIER_TOKENS.active:
        return token
    return jax.lax.optimization_barrier((token, value))[0]


def psend(x: Any, axis_name: AxisName, perm: Perm) -> Any:
    """Send ``x`` along the pairs ``perm`` of mesh axis ``axis_name``; returns a token.

    ``jax.lax.psend`` without its deprecation: the analog of XLA's Send, inside
    ``jax.shard_map``. Device ``src`` of each ``(src, dst)`` pair in ``perm`` (indices along
    ``axis_name``; sources unique, destinations unique) sends its block of ``x``; a matching
    :func:`precv` with the same ``perm`` on device ``dst`` receives it, so that
    ``precv(psend(x, a, perm), ..., a, perm)`` equals ``jax.lax.ppermute(x, a, perm)``
    (zeros on devices that are no destination). psend never waits for its receiver.

    Args:
      x: an array, or a pytree of arrays: one psend per leaf, in ``tree_flatten`` order,
        each leaf's send running after the one before it (so that a :func:`precv` of the
        same pytree receives every leaf in its own place).
      axis_name: a mesh axis name bound by ``shard_map``, or a tuple of them.
      perm: ``(source_index, destination_index)`` pairs.

    Returns:
      A token (a pytree of tokens for a pytree ``x``) for :func:`precv` and
      ``jax.lax.optimization_barrier`` to order later ops after this send.

    Raises:
      NameError: an axis name that no enclosing ``shard_map`` binds.
      ValueError: an index of ``perm`` outside the axis (``-n..n-1`` for an axis of size n).
    """
    names = _axis_tuple(axis_name)
    pairs = _perm_tuple(perm)
    _check_perm("psend", names, pairs)

    leaves, tree = jax.tree_util.tree_flatten(x)
    tokens: list[Any] = []
    for leaf in leaves:
        leaf = _pvary(names, leaf)
        if tokens:
            leaf = _after_token(tokens[-1], leaf)
        tokens.append(psend_p.bind(leaf, axis_name=names, perm=pairs))
    return jax.tree_util.tree_unflatten(tree, tokens)


def _is_shape(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def precv(token: Any, out_shape: Any, axis_name: AxisName, perm: Perm) -> Any:
    """Receive along the pairs ``perm`` of ``axis_name`` what the matching :func:`psend` sent.

    ``jax.lax.precv`` without its deprecation: the analog of XLA's Recv, inside
    ``jax.shard_map``. Device ``dst`` of each ``(src, dst)`` pair receives the block that
    device ``src`` sent with a :func:`psend` of the same ``perm``; a device that is no
    destination gets zeros. The result is not typed as varying over ``axis_name`` (as JAX's):
    a loop carry needs ``jax.lax.pcast(y, axis_name, to="varying")``.

    Args:
      token: a token from :func:`psend` or ``jax.lax.create_token()``; the receive is
        ordered after what produced it. For a pytree ``out_shape``, one token for every leaf
        or a pytree of tokens of the same structure (what :func:`psend` of a pytree returns).
      out_shape: a ``jax.ShapeDtypeStruct`` (anything with ``shape`` and ``dtype``) of the
        result, or a pytree of them: one precv per leaf, in ``tree_flatten`` order, each
        leaf's receive running after the one before it.
      axis_name: a mesh axis name bound by ``shard_map``, or a tuple of them.
      perm: ``(source_index, destination_index)`` pairs, those of the matching psend.

    Returns:
      An array of ``out_shape`` (a pytree of arrays for a pytree ``out_shape``).
    """
    names = _axis_tuple(axis_name)
    pairs = _perm_tuple(perm)
    _check_perm("precv", names, pairs)

    def recv(tok: Any, shape: Any) -> Any:
        aval = jax.core.ShapedArray(shape.shape, shape.dtype)  # as jax.lax.precv builds it
        return precv_p.bind(tok, out_shape=aval, axis_name=names, perm=pairs)

    if _is_shape(out_shape):
        return recv(token, out_shape)
    shapes, tree = jax.tree_util.tree_flatten(out_shape, is_leaf=_is_shape)
    tokens = jax.tree_util.tree_leaves(token)
    if len(tokens) == 1:
        tokens = tokens * len(shapes)
    elif jax.tree_util.tree_structure(token) != tree:
        raise ValueError(
            f"precv: token must be one token or a pytree of tokens shaped like out_shape "
            f"({tree}), got {jax.tree_util.tree_structure(token)}")
    received: list[Any] = []
    for tok, shape in zip(tokens, shapes, strict=True):
        if received:
            tok = _token_after(received[-1], tok)
        received.append(recv(tok, shape))
    return jax.tree_util.tree_unflatten(tree, received)


#: The ``jax.named_scope`` of :func:`precv_unread_off_destinations`: the module pass marks
#: a precv call whose location names it ``zero_fill = 0`` (passes/selected_zeros.py).
UNREAD_OFF_DESTINATIONS = "jax_cpu_mpi_precv_unread_off_destinations"


def precv_unread_off_destinations(token: Any, out_shape: Any, axis_name: AxisName,
                                  perm: Perm) -> Any:
    """:func:`precv` for a caller that never reads the result on a device that is no
    destination of ``perm`` (internal; the pipeline executor stores it in a slot no tick
    reads). There, on CPU, the result is not the zeros ``ppermute`` gives but whatever its
    buffer held (poison with ``JAX_CPU_MPI_POISON_UNINITIALIZED``): writing the zeros is a
    pass over the output in every step. On a destination, and on GPU (JAX's lowering, which
    ignores the scope), it is :func:`precv`. The marker is a named scope, which the
    lowered call's location carries, because the primitive is JAX's own (while JAX has
    it): its params cannot grow a keyword. (A lowering rule cannot read it: JAX caches one
    lowering per primitive and params, its name stack empty.)"""
    with jax.named_scope(UNREAD_OFF_DESTINATIONS):
        return precv(token, out_shape, axis_name, perm)


__all__ = ["UNREAD_OFF_DESTINATIONS", "precv", "precv_unread_off_destinations", "psend"]
