"""A chain psend/precv over all devices of the job equals ppermute."""

import _mpi_common as common
import jax
import numpy as np
from _mpi_common import P

n = jax.device_count()
mesh = jax.make_mesh((n,), ("x",))
perm = [(i, i + 1) for i in range(n - 1)]


def ours(x):
    tok = jax.lax.psend(x, "x", perm)
    return jax.lax.precv(tok, jax.ShapeDtypeStruct(x.shape, x.dtype), "x", perm)


def ref(x):
    return jax.lax.ppermute(x, "x", perm)


x = common.global_array(mesh, P("x"), np.arange(2 * n, dtype=np.float32))
run = lambda f: common.gather(  # noqa: E731
    jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x))
got, want = run(ours), run(ref)
np.testing.assert_array_equal(got, want)
want_full = np.concatenate([np.zeros(2, np.float32), np.arange(2 * n - 2, dtype=np.float32)])
np.testing.assert_array_equal(got, want_full)
common.ok()
