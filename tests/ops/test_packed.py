"""``psum_packed`` / ``pmean_packed``: a pytree's psum as one collective per dtype and
varying type, with the results of ``jax.lax.psum`` / ``pmean`` leaf by leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cpu_mpi._src.ops.packed import pmean_packed, psum_packed


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])


def _tree(x: jax.Array, n: jax.Array, c: jax.Array):
    """Leaves of two dtypes, of several shapes (a scalar among them), varying over both axes
    (from ``x`` and ``n``) and over ``a`` only (from ``c``)."""
    return {"w": x * 2.0, "s": jnp.sum(x), "v": x[:, :3] + 1.0, "n": n, "m": n * 3,
            "c": c * 1.5, "d": jnp.sin(c)}


def _run(reduce, axis):
    mesh = _mesh()
    x = jnp.arange(4 * 4 * 5, dtype=jnp.float32).reshape(4 * 4, 5) / 7.0
    n = jnp.arange(4 * 6, dtype=jnp.int32).reshape(4, 6)
    c = jnp.arange(2 * 3, dtype=jnp.float32).reshape(2, 3) - 2.5

    def body(x, n, c):
        return reduce(_tree(x, n, c), axis)

    reduced = set(axis if isinstance(axis, tuple) else (axis,))

    def spec(varying: tuple[str, ...]) -> P:  # what a result still varies over
        left = tuple(a for a in varying if a not in reduced)
        return P(left) if left else P()

    out_spec = {k: spec(("a", "b")) if k in "wsvnm" else spec(("a",)) for k in "wsvnmcd"}
    f = jax.jit(jax.shard_map(
        lambda x, n, c: jax.tree.map(lambda v: v[None] if v.ndim == 0 else v, body(x, n, c)),
        mesh=mesh, in_specs=(P(("a", "b")), P(("a", "b")), P("a")), out_specs=out_spec))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in
            ((x, P(("a", "b"))), (n, P(("a", "b"))), (c, P("a")))]
    return f, args


@pytest.mark.parametrize("axis", ["a", "b"])
def test_psum_packed_sums_like_psum(axis):
    got_f, args = _run(psum_packed, axis)
    want_f, _ = _run(jax.lax.psum, axis)
    got, want = got_f(*args), want_f(*args)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


def test_pmean_packed_divides_like_pmean():
    got_f, args = _run(pmean_packed, "b")
    want_f, _ = _run(jax.lax.pmean, "b")
    got, want = got_f(*args), want_f(*args)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


def test_one_collective_per_dtype_and_varying_type():
    """Seven leaves, of two dtypes, varying over (a, b) or over a only: float32 over both
    axes, int32 over both, float32 over a only -> 3 all-reduces, where psum makes 7 (an
    all-reduce per leaf; XLA merges them only in one process, not our calls over MPI)."""
    packed, args = _run(psum_packed, "b")
    plain, _ = _run(jax.lax.psum, "b")
    assert packed.lower(*args).as_text().count("stablehlo.all_reduce") == 3
    assert plain.lower(*args).as_text().count("stablehlo.all_reduce") == 7
