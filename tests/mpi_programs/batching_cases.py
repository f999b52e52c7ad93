"""vmap scenarios for jax_cpu_mpi's batching rules, shared by tests/batching/test_batching.py (one
process) and batching_rules.py (mpirun).

Each case builds jitted ``shard_map`` programs over a 1-D mesh ``'x'``, runs the vmapped one,
and returns :class:`Check` rows ``(name, got, want)``. ``want`` comes from ``jax.lax.map`` of
the unbatched function, from the same program with a plain ``all_gather`` / ``ppermute``, or
from numpy. :func:`count_eqns` counts the collectives in the vmapped program's jaxpr: one
per program, not one per batch element.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi

Gather = Callable[[jax.Array], np.ndarray]
B = 3  # batch size of every case


class Check(NamedTuple):
    name: str
    got: np.ndarray
    want: np.ndarray


def put(mesh: jax.sharding.Mesh, spec: P, value: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(
        value.shape, NamedSharding(mesh, spec), lambda index: value[index])


def sample(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def count_eqns(fn: Callable, *args, name: str) -> int:
    """How many equations of primitive ``name`` the jaxpr of ``fn(*args)`` holds (nested too)."""

    def walk(jaxpr) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            total += eqn.primitive.name == name
            for sub in jex_core.jaxprs_in_params(eqn.params):
                total += walk(sub)
        return total

    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def numpy_gather(blocks: np.ndarray, axis: int, tiled: bool) -> np.ndarray:
    """all_gather of ``blocks[i]`` (the block of member i) along ``axis``."""
    if tiled:
        return np.concatenate(list(blocks), axis=axis)
    return np.stack(list(blocks), axis=axis)


def _shards(mesh) -> int:
    return mesh.shape["x"]


def _batched_spec(in_axes: int) -> P:
    """Spec of ``moveaxis(xs, 0, in_axes)`` for ``xs`` of shape (B, 2n, 3) sharded on dim 1."""
    return P(None, "x") if in_axes == 0 else P("x")


# ----------------------------------------------------------------- all_gather(to='reduced')


def reduced_gather(mesh, gather: Gather, *, axis: int, tiled: bool, in_axes: int) -> list[Check]:
    """vmap over a shard_map whose body gathers its block with ``all_gather(to='reduced')``.

    Each device returns the gathered value (cast back to varying, so out_specs can be
    P('x')): the result is the gathered value stacked once per device.
    """
    n = _shards(mesh)

    def reduced(w):
        y = jax.lax.all_gather(w, "x", axis=axis, tiled=tiled, to="reduced")
        return jax.lax.pcast(y, "x", to="varying")

    def plain(w):
        return jax.lax.all_gather(w, "x", axis=axis, tiled=tiled)

    def program(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    xs = sample((B, 2 * n, 3), seed=axis + 10 * tiled)
    batched = put(mesh, _batched_spec(in_axes), np.moveaxis(xs, 0, in_axes))
    stacked = put(mesh, P(None, "x"), xs)
    got = gather(jax.jit(jax.vmap(program(reduced), in_axes=in_axes))(batched))
    per_b = [numpy_gather(x.reshape(n, 2, 3), axis, tiled) for x in xs]
    want = np.stack([np.concatenate([g] * n, axis=0) for g in per_b])
    name = f"all_gather(to='reduced', axis={axis}, tiled={tiled}) in_axes={in_axes}"
    return [
        Check(f"{name} vs lax.map", got, gather(jax.lax.map(program(reduced), stacked))),
        Check(f"{name} vs plain all_gather", got, gather(jax.lax.map(program(plain), stacked))),
        Check(f"{name} vs numpy", got, want),
    ]


def reduced_gather_count(mesh, *, axis: int, tiled: bool) -> int:
    n = _shards(mesh)
    body = jax.shard_map(
        lambda w: jax.lax.pcast(jax.lax.all_gather(w, "x", axis=axis, tiled=tiled, to="reduced"),
                                "x", to="varying"),
        mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    xs = put(mesh, P(None, "x"), sample((B, 2 * n, 3), seed=0))
    return count_eqns(jax.vmap(body), xs, name="all_gather_reduced")


def inner_vmap_gather(mesh, gather: Gather, *, axis: int, tiled: bool) -> list[Check]:
    """vmap inside the shard_map body; the reduced value is the shard_map's output."""
    n = _shards(mesh)
    body = jax.vmap(lambda w: jax.lax.all_gather(w, "x", axis=axis, tiled=tiled, to="reduced"),
                    in_axes=1)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P(reduced={"x"})))
    xs = sample((B, 2 * n, 3), seed=5)
    got = gather(f(put(mesh, P("x"), np.moveaxis(xs, 0, 1))))
    want = np.stack([numpy_gather(x.reshape(n, 2, 3), axis, tiled) for x in xs])
    return [Check(f"vmap in shard_map body, axis={axis}, tiled={tiled}", got, want)]


# ------------------------------------------------------------------------ vmap of grad


def _loss(mesh, *, axis: int, tiled: bool, to: str) -> Callable:
    """A loss over a weight sharded on 'x' that the body gathers (reduced or plain)."""

    def body(w, d):
        kw = {"to": "reduced"} if to == "reduced" else {}
        y = jax.lax.all_gather(w, "x", axis=axis, tiled=tiled, **kw).reshape(-1)
        return jax.lax.psum(jnp.sum(jnp.sin(d @ y) ** 2), "x")

    return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P())


def vmap_grad(mesh, gather: Gather, *, axis: int, tiled: bool,
              batch_w: bool, batch_d: bool) -> list[Check]:
    """``vmap(grad(loss))`` vs ``lax.map(grad(loss))`` and vs the plain-all_gather loss."""
    n = _shards(mesh)
    ws = sample((B, 2 * n, 3), seed=20 + axis)
    ds = sample((B, 2 * n, 6 * n), seed=30 + axis)
    w_in = put(mesh, P(None, "x"), ws) if batch_w else put(mesh, P("x"), ws[0])
    d_in = put(mesh, P(None, "x"), ds) if batch_d else put(mesh, P("x"), ds[0])
    in_axes = (0 if batch_w else None, 0 if batch_d else None)
    grad = jax.grad(_loss(mesh, axis=axis, tiled=tiled, to="reduced"))
    grad_plain = jax.grad(_loss(mesh, axis=axis, tiled=tiled, to="varying"))
    got = gather(jax.jit(jax.vmap(grad, in_axes=in_axes))(w_in, d_in))

    def mapped(g):
        def one(args):
            w, d = args
            return g(w if batch_w else w_in, d if batch_d else d_in)
        xs = (w_in if batch_w else jnp.zeros(B), d_in if batch_d else jnp.zeros(B))
        return gather(jax.lax.map(one, xs))

    name = f"vmap(grad) axis={axis} tiled={tiled} in_axes={in_axes}"
    return [Check(f"{name} vs lax.map(grad)", got, mapped(grad)),
            Check(f"{name} vs plain all_gather", got, mapped(grad_plain))]


def vmap_grad_counts(mesh, *, axis: int, tiled: bool) -> tuple[int, int]:
    """(all_gather_reduced, unreduced_reduce_scatter) equations in ``vmap(grad(loss))``."""
    n = _shards(mesh)
    w = put(mesh, P(None, "x"), sample((B, 2 * n, 3), seed=1))
    d = put(mesh, P(None, "x"), sample((B, 2 * n, 6 * n), seed=2))
    fn = jax.vmap(jax.grad(_loss(mesh, axis=axis, tiled=tiled, to="reduced")))
    return (count_eqns(fn, w, d, name="all_gather_reduced"),
            count_eqns(fn, w, d, name="unreduced_reduce_scatter"))


# ------------------------------------------- vmap over a named axis within a mesh-axis tuple


def mixed_axes_gather(mesh, gather: Gather, *, names: tuple[str, str],
                      tiled: bool) -> list[Check]:
    """In a shard_map over 'x', ``vmap(axis_name='a')`` and a reduced gather over both axes.

    The members of ``names`` are (batch element, device), linearized in tuple order.
    """
    n = _shards(mesh)
    body = jax.vmap(lambda v: jax.lax.all_gather(v, names, tiled=tiled, to="reduced"),
                    in_axes=0, axis_name="a")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "x"),
                              out_specs=P(reduced={"x"})))
    xs = sample((B, 2 * n, 3), seed=40 + tiled)
    got = gather(f(put(mesh, P(None, "x"), xs)))
    blocks = xs.reshape(B, n, 2, 3)  # blocks[a, i] is member (a, device i)
    order = blocks.reshape(B * n, 2, 3) if names == ("a", "x") else \
        blocks.transpose(1, 0, 2, 3).reshape(B * n, 2, 3)
    want = numpy_gather(order, 0, tiled)
    return [Check(f"gather over {names} tiled={tiled}", got, np.broadcast_to(want, got.shape))]


def mixed_axes_scatter(mesh, gather: Gather, *, names: tuple[str, str],
                       tiled: bool) -> list[Check]:
    """In a shard_map over 'x', ``vmap(axis_name='a')`` and an unreduced_psum_scatter over both.

    Member (a, i) holds the partial ``zs[a, i]``; it receives chunk ``k`` of the total, ``k``
    its index in ``names`` order.
    """
    from jax_cpu_mpi._src.compat import parallel

    n, m = _shards(mesh), B * _shards(mesh)
    chunk = 2 if tiled else 1
    zs = sample((B, n, m * chunk, 5), seed=50 + tiled)

    def one(v):
        v = jax.lax.pcast(v[0], "x", to="unreduced")
        return parallel.unreduced_psum_scatter(v, names, scatter_dimension=0, tiled=tiled)

    f = jax.jit(jax.shard_map(jax.vmap(one, axis_name="a"), mesh=mesh, in_specs=P(None, "x"),
                              out_specs=P(None, "x")))
    got = gather(f(put(mesh, P(None, "x"), zs))).reshape(B, n, chunk, 5)
    total = zs.sum(axis=(0, 1)).reshape(m, chunk, 5)
    want = np.empty_like(got)
    for a in range(B):
        for i in range(n):
            want[a, i] = total[a * n + i if names == ("a", "x") else i * B + a]
    return [Check(f"unreduced_psum_scatter over {names} tiled={tiled}", got, want)]


# --------------------------------------------------------------------------- psend / precv


def sendrecv(x, axis, perm):
    tok = jax_cpu_mpi.psend(x, axis, perm)
    return jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct(x.shape, x.dtype), axis, perm)


def chain(n: int) -> list[tuple[int, int]]:
    """0 -> 1 -> ... -> n-1 (no cycle: GPU-parity mode rejects cycles in one psend)."""
    return [(i, i + 1) for i in range(n - 1)]


def p2p_batched(mesh, gather: Gather, *, in_axes: int) -> list[Check]:
    """vmap over a shard_map that sends its block along a chain: one message per device."""
    n = _shards(mesh)
    perm = chain(n)

    def program(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    ours = program(lambda x: sendrecv(x, "x", perm))
    ref = program(lambda x: jax.lax.ppermute(x, "x", perm))
    xs = sample((B, 2 * n, 3), seed=60)
    batched = put(mesh, _batched_spec(in_axes), np.moveaxis(xs, 0, in_axes))
    stacked = put(mesh, P(None, "x"), xs)
    got = gather(jax.jit(jax.vmap(ours, in_axes=in_axes))(batched))
    want = np.zeros_like(xs).reshape(B, n, 2, 3)
    for src, dst in perm:
        want[:, dst] = xs.reshape(B, n, 2, 3)[:, src]
    name = f"psend/precv in_axes={in_axes}"
    return [Check(f"{name} vs lax.map", got, gather(jax.lax.map(ours, stacked))),
            Check(f"{name} vs lax.map(ppermute)", got, gather(jax.lax.map(ref, stacked))),
            Check(f"{name} vs numpy", got, want.reshape(xs.shape))]


def p2p_unbatched_operand(mesh, gather: Gather) -> list[Check]:
    """Only the scale is batched: every batch element still sends (and receives) its message."""
    n = _shards(mesh)
    perm = chain(n)
    f = jax.shard_map(lambda x, s: sendrecv(x, "x", perm) * s, mesh=mesh,
                      in_specs=(P("x"), P()), out_specs=P("x"))
    ref = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "x", perm), mesh=mesh,
                                in_specs=P("x"), out_specs=P("x")))
    x = put(mesh, P("x"), sample((2 * n, 3), seed=61))
    scales = np.arange(1.0, B + 1, dtype=np.float32)
    got = gather(jax.jit(jax.vmap(f, in_axes=(None, 0)))(x, jnp.asarray(scales)))
    want = np.stack([gather(ref(x)) * s for s in scales])
    return [Check("psend of an unbatched operand under vmap", got, want)]


def p2p_counts(mesh) -> dict[str, int]:
    """psend/precv equations in a vmapped program, and psend results that are not tokens."""
    n = _shards(mesh)
    f = jax.vmap(jax.shard_map(lambda x: sendrecv(x, "x", chain(n)), mesh=mesh,
                               in_specs=P("x"), out_specs=P("x")))
    xs = put(mesh, P(None, "x"), sample((B, 2 * n, 3), seed=62))
    non_tokens = 0

    def walk(jaxpr):
        nonlocal non_tokens
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "psend":
                non_tokens += not isinstance(eqn.outvars[0].aval, jex_core.AbstractToken)
            for sub in jex_core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(f)(xs).jaxpr)
    return {"psend": count_eqns(f, xs, name="psend"), "precv": count_eqns(f, xs, name="precv"),
            "ppermute": count_eqns(f, xs, name="ppermute"), "non_token_psend": non_tokens}


# ------------------------------------------------------------------ unreduced_psum_scatter


def unreduced_scatter(mesh, gather: Gather, *, tiled: bool, in_axes: int) -> list[Check]:
    """vmap (inside the shard_map body) of ``unreduced_psum_scatter`` over 'x'.

    Device i holds the partials ``zs[i, b]``; batch element b of device i receives chunk i
    of ``sum_i zs[i, b]``.
    """
    from jax_cpu_mpi._src.compat import parallel

    n = _shards(mesh)
    chunk = 2 if tiled else 1
    zs = sample((n, B, n * chunk, 5), seed=70 + in_axes + 3 * tiled)

    def one(v):
        v = jax.lax.pcast(v, "x", to="unreduced")
        return parallel.unreduced_psum_scatter(v, "x", scatter_dimension=0, tiled=tiled)

    def body(v):
        return jax.vmap(one, in_axes=in_axes)(jnp.moveaxis(v[0], 0, in_axes))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P(None, "x")))
    got = gather(f(put(mesh, P("x"), zs))).reshape(B, n, chunk, 5)
    total = zs.sum(axis=0).reshape(B, n, chunk, 5)
    return [Check(f"unreduced_psum_scatter tiled={tiled} in_axes={in_axes}", got, total)]
