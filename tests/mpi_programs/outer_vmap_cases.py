"""``jax.vmap`` from OUTSIDE a shard_map whose specs carry reduced/unreduced sets (issue 28).

Shared by tests/batching/test_batching_outer_vmap.py (one process) and outer_vmap.py (mpirun). Each
case returns :class:`batching_cases.Check` rows ``(name, got, want)``: ``got`` from the
vmapped program, ``want`` from a Python loop over the batch of the unbatched program (each
example put on the mesh on its own). Reduced in_specs need a mesh whose axes are all
Explicit, so every mesh here is.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from batching_cases import Check, Gather, sample
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

B = 3  # batch size of every case
R = {"reduced": {"x"}}
U = {"unreduced": {"x"}}


def explicit_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    count = int(np.prod(shape))
    return jax.make_mesh(shape, names, devices=jax.devices()[:count],
                         axis_types=(AxisType.Explicit,) * len(shape))


def put(mesh, spec: P, value: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda index: value[index])


def batched_spec(spec: P, dim: int | None, batch_axis=None) -> P:
    """``spec`` with the batch dimension inserted at ``dim`` (sets kept)."""
    if dim is None:
        return spec
    parts = list(spec.partitions)
    parts.insert(dim, batch_axis)
    return P(*parts, reduced=spec.reduced, unreduced=spec.unreduced)


def stack(rows: list[np.ndarray], axis: int) -> np.ndarray:
    return np.stack(rows, axis=axis)


def _loop(mesh, fn: Callable, arrays, specs, in_axes, out_axes, gather: Gather, batch=B):
    """Each example on its own: slice the numpy inputs, put them on the mesh, run ``fn``."""
    rows = []
    for b in range(batch):
        args = [put(mesh, s, a if d is None else np.take(a, b, axis=d))
                for a, s, d in zip(arrays, specs, in_axes, strict=True)]
        rows.append(jax.tree.map(gather, fn(*args)))
    return jax.tree.map(lambda *r: stack(r, out_axes), *rows)


def _put_batched(mesh, arrays, specs, in_axes, batch_axis=None) -> list[jax.Array]:
    return [put(mesh, batched_spec(s, d, batch_axis), a)
            for a, s, d in zip(arrays, specs, in_axes, strict=True)]


def _batched(mesh, fn: Callable, arrays, specs, in_axes, out_axes, gather: Gather, *,
             batch_axis=None, **kw):
    args = _put_batched(mesh, arrays, specs, in_axes, batch_axis)
    out = jax.jit(jax.vmap(fn, in_axes=tuple(in_axes), out_axes=out_axes, **kw))(*args)
    return jax.tree.map(gather, out)


def _arrays(shapes, in_axes, seed, batch=B):
    """Numpy inputs, each with its batch dimension at its ``in_axes`` position."""
    out = []
    for k, (shape, d) in enumerate(zip(shapes, in_axes, strict=True)):
        a = sample((batch, *shape) if d is not None else shape, seed=seed + k)
        out.append(np.moveaxis(a, 0, d) if d is not None else a)
    return out


# --------------------------------------------------------------- reduced weights in_specs


def layer(mesh):
    """JAX's sharding-and-AD docs' ``apply_layer``: data on 'x', weights reduced over 'x'."""
    return jax.shard_map(lambda x, w: jnp.tanh(x @ w), mesh=mesh,
                         in_specs=(P("x", None), P(None, None, **R)), out_specs=P("x", None))


LAYER_SPECS = (P("x", None), P(None, None, **R))


def reduced_in_specs(mesh, gather: Gather, *, in_axes, out_axes=0) -> list[Check]:
    n = mesh.shape["x"]
    arrays = _arrays([(2 * n, 4), (4, 4)], in_axes, seed=100)
    f = layer(mesh)
    got = _batched(mesh, f, arrays, LAYER_SPECS, in_axes, out_axes, gather)
    want = _loop(mesh, jax.jit(f), arrays, LAYER_SPECS, in_axes, out_axes, gather)
    return [Check(f"reduced in_specs in_axes={in_axes} out_axes={out_axes}", got, want)]


def _loss(mesh):
    f = layer(mesh)
    return lambda w, x: jnp.sum(f(x, w) ** 2)


def vmap_grad_reduced(mesh, gather: Gather, *, in_axes) -> list[Check]:
    """``vmap(grad(loss))`` wrt reduced weights: the gradients come out unreduced over 'x'
    (checked), then one psum outside (a reshard to P())."""
    n = mesh.shape["x"]
    arrays = _arrays([(4, 4), (2 * n, 4)], in_axes, seed=110)
    specs = (LAYER_SPECS[1], LAYER_SPECS[0])
    grad = jax.grad(_loss(mesh))

    def batched(*args):
        g = jax.vmap(grad, in_axes=in_axes)(*args)
        assert jax.typeof(g).sharding.spec.unreduced == {"x"}, jax.typeof(g)
        return jax.reshard(g, P())

    args = _put_batched(mesh, arrays, specs, in_axes)
    got = gather(jax.jit(batched)(*args))
    want = _loop(mesh, jax.jit(lambda *a: jax.reshard(grad(*a), P())), arrays, specs,
                 in_axes, 0, gather)
    return [Check(f"vmap(grad) wrt reduced weights in_axes={in_axes}", got, want)]


# -------------------------------------------------------------------- unreduced results


def _partial_matmul(mesh, *, psum: bool):
    def body(a, b):
        u = jax.lax.pcast(a @ b, "x", to="unreduced")
        return jax.lax.psum(u, "x") if psum else u

    return jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x", None)),
                         out_specs=P() if psum else P(None, None, **U))


MATMUL_SPECS = (P(None, "x"), P("x", None))


def unreduced_out_specs(mesh, gather: Gather, *, in_axes, out_axes=0) -> list[Check]:
    """out_specs unreduced over 'x'; the value is read after one reduction (reshard)."""
    n = mesh.shape["x"]
    arrays = _arrays([(2, 2 * n), (2 * n, 3)], in_axes, seed=120)
    f = _partial_matmul(mesh, psum=False)

    def batched(*args):
        return jax.reshard(jax.vmap(f, in_axes=in_axes, out_axes=out_axes)(*args), P())

    args = _put_batched(mesh, arrays, MATMUL_SPECS, in_axes)
    got = gather(jax.jit(batched)(*args))
    want = _loop(mesh, jax.jit(lambda *a: jax.reshard(f(*a), P())), arrays, MATMUL_SPECS,
                 in_axes, out_axes, gather)
    return [Check(f"unreduced out_specs in_axes={in_axes} out_axes={out_axes}", got, want)]


def psum_of_unreduced(mesh, gather: Gather, *, in_axes) -> list[Check]:
    """psum of an unreduced value, out_specs=P(); and vmap(grad) of it (the transposed
    shard_map has reduced in_specs)."""
    n = mesh.shape["x"]
    arrays = _arrays([(2, 2 * n), (2 * n, 3)], in_axes, seed=130)
    f = _partial_matmul(mesh, psum=True)
    got = _batched(mesh, f, arrays, MATMUL_SPECS, in_axes, 0, gather)
    want = _loop(mesh, jax.jit(f), arrays, MATMUL_SPECS, in_axes, 0, gather)
    grad = jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), argnums=(0, 1))
    got_g = _batched(mesh, grad, arrays, MATMUL_SPECS, in_axes, 0, gather)
    want_g = _loop(mesh, jax.jit(grad), arrays, MATMUL_SPECS, in_axes, 0, gather)
    name = f"psum of unreduced, out_specs=P(), in_axes={in_axes}"
    return [Check(name, got, want), Check(f"{name}: vmap(grad) da", got_g[0], want_g[0]),
            Check(f"{name}: vmap(grad) db", got_g[1], want_g[1])]


# --------------------------------------------------------------------- spmd_axis_name


def spmd_axis_name(mesh2, gather: Gather) -> list[Check]:
    """Mesh ('y', 'x'): the batch split over 'y' (spmd_axis_name), weights reduced over 'x'.
    The arguments' vmapped dimension is unsharded (sharded over Explicit 'y' it is refused:
    :func:`refused_batch_sharded_over_explicit_axis`)."""
    n, batch = mesh2.shape["x"], 2 * mesh2.shape["y"]  # the batch splits over 'y'
    in_axes = (0, 0)
    arrays = _arrays([(2 * n, 4), (4, 4)], in_axes, seed=140, batch=batch)
    f = layer(mesh2)
    args = [put(mesh2, batched_spec(s, 0), a) for a, s in zip(arrays, LAYER_SPECS, strict=True)]
    got = gather(jax.jit(jax.vmap(f, spmd_axis_name="y"))(*args))
    loss = _loss(mesh2)
    g = jax.jit(lambda w, x: jax.reshard(
        jax.vmap(jax.grad(loss), spmd_axis_name="y")(w, x), P()))(args[1], args[0])
    want = _loop(mesh2, jax.jit(f), arrays, LAYER_SPECS, in_axes, 0, gather, batch)
    want_g = _loop(mesh2, jax.jit(lambda x, w: jax.reshard(jax.grad(loss)(w, x), P())),
                   arrays, LAYER_SPECS, in_axes, 0, gather, batch)
    return [Check("spmd_axis_name='y', reduced over 'x'", got, want),
            Check("spmd_axis_name='y': vmap(grad)", gather(g), want_g)]


# ------------------------------------------------------------------------ jit and scan


def scan_of_vmap(mesh, gather: Gather) -> list[Check]:
    """A scan over steps whose body is vmap(layer) (weights per step and example)."""
    n, steps = mesh.shape["x"], 2
    xs = sample((B, 2 * n, 4), seed=150)
    ws = sample((steps, B, 4, 4), seed=151)
    f = layer(mesh)

    def run(x, w):
        return jax.lax.scan(lambda c, wt: (jax.vmap(f)(c, wt), None), x, w)[0]

    got = gather(jax.jit(run)(put(mesh, P(None, "x", None), xs),
                              put(mesh, P(None, None, None, None, **R), ws)))
    one = jax.jit(lambda x, w: jax.lax.scan(lambda c, wt: (f(c, wt), None), x, w)[0])
    want = stack([gather(one(put(mesh, P("x", None), xs[b]),
                             put(mesh, P(None, None, None, **R), ws[:, b])))
                  for b in range(B)], 0)
    return [Check("scan over vmap(shard_map)", got, want)]


def _predict(mesh):
    f = layer(mesh)
    return lambda ws, x: jax.lax.scan(lambda c, w: (f(c, w), None), x, ws)[0]


def _step(mesh):
    """The gradient-accumulation step of JAX's sharding-and-AD docs, layers in shard_map:
    reduced weights, unreduced gradients accumulated over a scan of microbatches, one
    reduction per step."""
    predict = _predict(mesh)

    def loss(ws, x):
        return jnp.sum(predict(ws, x) ** 2)

    def step(ws, xs):
        def micro(acc, x):
            g = jax.grad(loss)(ws, x)
            assert jax.typeof(g).sharding.spec.unreduced == {"x"}, jax.typeof(g)
            return acc + g, None

        acc = jax.reshard(jnp.zeros_like(ws), P(**U))
        acc, _ = jax.lax.scan(micro, acc, xs)
        return jax.reshard(ws, P()) - 0.01 * jax.reshard(acc, P())

    return step, loss


STEP_SPECS = (P(None, None, None, **R), P(None, "x", None))  # ws: [layer, f, f], xs: [mb, b, f]


def vmap_of_predict(mesh, gather: Gather) -> list[Check]:
    """vmap of a scan over layers (a shard_map each), per-example weights and data."""
    n = mesh.shape["x"]
    in_axes = (0, 0)
    arrays = _arrays([(2, 4, 4), (2 * n, 4)], in_axes, seed=160)
    specs = (P(None, None, None, **R), P("x", None))
    f = _predict(mesh)
    got = _batched(mesh, f, arrays, specs, in_axes, 0, gather)
    want = _loop(mesh, jax.jit(f), arrays, specs, in_axes, 0, gather)
    return [Check("vmap of a scan over shard_map layers", got, want)]


def grad_accumulation(mesh, gather: Gather, *, in_axes) -> list[Check]:
    """vmap of the docs' step: an ensemble of models (in_axes=(0, 0)) or one model on
    several data streams (in_axes=(None, 0))."""
    n = mesh.shape["x"]
    arrays = _arrays([(2, 4, 4), (2, 2 * n, 4)], in_axes, seed=170)
    step, _ = _step(mesh)
    got = _batched(mesh, step, arrays, STEP_SPECS, in_axes, 0, gather)
    want = _loop(mesh, jax.jit(step), arrays, STEP_SPECS, in_axes, 0, gather)
    return [Check(f"vmap of the gradient-accumulation step in_axes={in_axes}", got, want)]


def microbatch_grads_by_vmap(mesh, gather: Gather) -> list[Check]:
    """The microbatch loop written as vmap(grad) over microbatches, then a sum (unreduced),
    against the docs' scan accumulation."""
    n = mesh.shape["x"]
    ws_np, xs_np = sample((2, 4, 4), seed=180), sample((B, 2 * n, 4), seed=181)
    _, loss = _step(mesh)
    ws, xs = put(mesh, STEP_SPECS[0], ws_np), put(mesh, STEP_SPECS[1], xs_np)

    def by_vmap(w, x):
        g = jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, x).sum(0)
        assert jax.typeof(g).sharding.spec.unreduced == {"x"}, jax.typeof(g)
        return jax.reshard(g, P())

    def by_scan(w, x):
        acc = jax.reshard(jnp.zeros_like(w), P(**U))
        acc, _ = jax.lax.scan(lambda a, xm: (a + jax.grad(loss)(w, xm), None), acc, x)
        return jax.reshard(acc, P())

    return [Check("vmap(grad) over microbatches, summed, vs scan accumulation",
                  gather(jax.jit(by_vmap)(ws, xs)), gather(jax.jit(by_scan)(ws, xs)))]


# ------------------------------------------------------------------------------ refused


def refused_spmd_over_reduced_axis(mesh) -> Callable[[], object]:
    """spmd_axis_name='x' where the weights are reduced over 'x': cannot be defined."""
    n = mesh.shape["x"]
    x = put(mesh, P(None, "x", None), sample((B, 2 * n, 4), seed=190))
    w = put(mesh, P(None, None, None, **R), sample((B, 4, 4), seed=191))
    return lambda: jax.make_jaxpr(jax.vmap(layer(mesh), spmd_axis_name="x"))(x, w)


def batch_sharded_over_explicit_axis(mesh2, gather: Gather) -> list[Check]:
    """The vmapped dimension sharded over Explicit 'y', weights reduced over 'x'. JAX 0.12
    runs it; JAX 0.10 raises its own NotImplementedError from jax.shard_map itself (vmap
    takes 'y' out of the context mesh, so the shard_map is manual over 'x' only, where that
    JAX refuses reduced in_specs), before any batching rule: use spmd_axis_name there."""
    n = mesh2.shape["x"]
    xs, ws = sample((2, 2 * n, 4), seed=192), sample((2, 4, 4), seed=193)
    x = put(mesh2, P("y", "x", None), xs)
    w = put(mesh2, P("y", None, None, **R), ws)
    got = gather(jax.jit(jax.vmap(layer(mesh2)))(x, w))
    want = np.stack([np.tanh(xs[b] @ ws[b]) for b in range(2)])
    return [Check("vmapped dimension sharded over Explicit 'y'", got, want)]
