"""Batching rules for ``psend_p`` / ``precv_p`` that keep token semantics.

JAX gives both primitives ``ppermute``'s batcher, so ``vmap`` of ``precv`` is a ``TypeError``
and ``vmap`` of ``psend`` silently turns into a ``ppermute`` that returns data instead of a
token. These rules replace it:

* **vmapped axis is not the p2p axis** (the usual case: a batch of messages). ``psend``
  sends the whole batch as ONE message, batch dimension first (an unbatched operand is
  broadcast: under ``vmap`` every batch element sends), and returns an unbatched token.
  ``precv`` receives ONE message of the batched ``out_shape`` (``(B, *out_shape.shape)``)
  and returns it with batch dimension 0. So a vmapped ``psend`` must meet a vmapped
  ``precv`` of the same batch size on the peer, as B unbatched sends meet B receives.
* **vmapped axis is the p2p axis** (``vmap(..., axis_name=a)`` with ``psend(x, a, perm)``):
  the peers are the batch elements of this very computation, so no message leaves the
  device. ``psend`` computes what ``ppermute`` would deliver (the operand permuted along
  the batch dimension, zeros where ``perm`` has no source), posts it in a trace-local
  mailbox keyed by the token it returns, and ``precv`` on that token returns it. The
  mailbox entry lives as long as the token object. A ``precv`` whose token does not come
  from such a ``psend`` (``lax.create_token()``, a token passed through a loop carry) has
  no sender inside the vmapped computation and raises ``NotImplementedError``; so does a
  p2p axis that mixes the vmapped axis with mesh axes.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax import lax

from jax_cpu_mpi._src.batching.collectives import as_tuple, batch_first, frame_members
from jax_cpu_mpi._src.compat import ShapedArray
from jax_cpu_mpi._src.ops.primitives import precv_p, psend_p


@dataclass(frozen=True)
class _Posted:
    """What a psend over the vmapped axis delivered, waiting for its precv."""

    token: weakref.ref
    value: Any
    dim: int | None
    axis_name: tuple
    perm: tuple
    elt_shape: tuple[int, ...]
    dtype: np.dtype


_MAILBOX: dict[int, _Posted] = {}


def _post(token: Any, posted_args: dict[str, Any]) -> None:
    key = id(token)

    def forget(ref: weakref.ref) -> None:
        entry = _MAILBOX.get(key)
        if entry is not None and entry.token is ref:
            del _MAILBOX[key]

    _MAILBOX[key] = _Posted(token=weakref.ref(token, forget), **posted_args)


def _lookup(token: Any) -> _Posted | None:
    entry = _MAILBOX.get(id(token))
    if entry is None or entry.token() is not token:
        return None
    return entry


def mailbox_size() -> int:
    """Number of psend results waiting for their precv (for tests)."""
    return len(_MAILBOX)


def _sources(op: str, perm: Sequence[tuple[int, int]], size: int, axis: Any) -> np.ndarray:
    """``src[dst]`` for each destination along the vmapped axis, -1 where none sends."""
    src_of = np.full(size, -1, dtype=np.int64)
    seen_src: set[int] = set()
    for src, dst in perm:
        s, t = int(src), int(dst)
        if not (0 <= s < size and 0 <= t < size):
            raise ValueError(
                f"{op} over vmapped axis {axis!r} (size {size}): perm {list(map(tuple, perm))} "
                f"has an index outside [0, {size}).")
        if s in seen_src or src_of[t] >= 0:
            raise ValueError(
                f"{op} over vmapped axis {axis!r} (size {size}): sources and destinations "
                f"of perm must be unique, got {list(map(tuple, perm))}.")
        seen_src.add(s)
        src_of[t] = s
    return src_of


def _permute_batch(x: Any, d: int | None, src_of: np.ndarray) -> tuple[Any, int | None]:
    """What each batch element receives: ``x[src_of[i]]``, zeros where ``src_of[i] < 0``."""
    size = src_of.size
    if (src_of >= 0).all():
        if d is None:
            return x, None
        return jax.numpy.take(x, src_of, axis=d), d
    xb = batch_first(x, d, size)
    gathered = jax.numpy.take(xb, np.maximum(src_of, 0), axis=0)
    mask = (src_of >= 0).reshape((size,) + (1,) * (xb.ndim - 1))
    return jax.numpy.where(mask, gathered, jax.numpy.zeros_like(gathered)), 0


def _mixed_axes_error(op: str, names: tuple, frame: Any) -> NotImplementedError:
    return NotImplementedError(
        f"{op}: vmap over axis {frame!r} with a p2p axis_name {names!r} that also spans other "
        "axes (more names, or a batch split over devices by spmd_axis_name) is not supported: "
        "the permutation would mix peers inside this computation and peers on other "
        f"devices. Use a vmap axis_name other than the p2p axes, or {op} over {frame!r} "
        "alone without spmd_axis_name.")


def psend_rule(
    axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[int | None], *,
    axis_name: Any, perm: tuple,
) -> tuple[Any, None]:
    """Batching rule of ``psend_p``: one message for the batch; the result stays a token."""
    (x,), (d,) = vals_in, dims_in
    names = as_tuple(axis_name)
    frame, size = axis_data.name, axis_data.size
    if frame not in names:
        return psend_p.bind(batch_first(x, d, size), axis_name=axis_name, perm=perm), None
    if len(names) > 1 or len(frame_members(axis_data, "psend")) > 1:
        raise _mixed_axes_error("psend", names, frame)
    value, dim = _permute_batch(x, d, _sources("psend", perm, size, frame))
    token = lax.create_token()
    elt = jax.typeof(x)
    elt_shape = tuple(int(s) for i, s in enumerate(elt.shape) if d is None or i != d)
    _post(token, dict(value=value, dim=dim, axis_name=names, perm=tuple(map(tuple, perm)),
                      elt_shape=elt_shape, dtype=np.dtype(elt.dtype)))
    return token, None


def precv_rule(
    axis_data: Any, vals_in: Sequence[Any], dims_in: Sequence[int | None], *,
    out_shape: ShapedArray, axis_name: Any, perm: tuple,
) -> tuple[Any, int | None]:
    """Batching rule of ``precv_p``: receives the batched ``out_shape`` (batch dimension 0)."""
    (token,), (td,) = vals_in, dims_in
    if td is not None:
        raise TypeError(f"precv: the token operand cannot be batched (batch dimension {td}).")
    names = as_tuple(axis_name)
    frame, size = axis_data.name, axis_data.size
    if frame not in names:
        batched = ShapedArray((size, *out_shape.shape), out_shape.dtype)
        return precv_p.bind(token, out_shape=batched, axis_name=axis_name, perm=perm), 0
    if len(names) > 1 or len(frame_members(axis_data, "precv")) > 1:
        raise _mixed_axes_error("precv", names, frame)
    posted = _lookup(token)
    if posted is None:
        raise NotImplementedError(
            f"precv over vmapped axis {frame!r}: under vmap(..., axis_name={frame!r}) the peers "
            "are batch elements of the same computation, so precv must take the token returned "
            f"by a psend over {frame!r} in the same vmapped function. This token has no such "
            "psend (lax.create_token(), or a token passed through a loop or a jit boundary "
            "traced separately).")
    want = (tuple(out_shape.shape), np.dtype(out_shape.dtype))
    sent = (posted.elt_shape, posted.dtype)
    if want != sent or tuple(map(tuple, perm)) != posted.perm:
        raise ValueError(
            f"precv over vmapped axis {frame!r}: out_shape {want[1].name}{list(want[0])} and "
            f"perm {list(map(tuple, perm))} must match those of the psend whose token it takes "
            f"({sent[1].name}{list(sent[0])}, perm {list(posted.perm)}).")
    return posted.value, posted.dim
