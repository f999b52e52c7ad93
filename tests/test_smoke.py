"""The smallest end-to-end checks: one process, and mpirun -n 2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import make_mesh, needs_jax_p2p
from mpi_launcher import assert_mpi_ok, run_mpi


@needs_jax_p2p
@pytest.mark.filterwarnings("ignore:jax.lax.psend is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:jax.lax.precv is deprecated:DeprecationWarning")
def test_chain_matches_ppermute_in_one_process():
    """A plain jax.lax.psend/precv program runs unchanged (JAX's deprecated API)."""
    mesh = make_mesh((4, "x"))
    perm = [(0, 1), (1, 2), (2, 3)]

    def ours(x):
        tok = jax.lax.psend(x, "x", perm)
        return jax.lax.precv(tok, jax.ShapeDtypeStruct(x.shape, x.dtype), "x", perm)

    def ref(x):
        return jax.lax.ppermute(x, "x", perm)

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
    run = lambda f: np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"),  # noqa: E731
                                                     out_specs=P("x")))(x))
    np.testing.assert_array_equal(run(ours), run(ref))
    np.testing.assert_array_equal(run(ours), [0, 0, 0, 1, 2, 3, 4, 5])


@needs_jax_p2p
@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_chain_over_mpi():
    run = run_mpi("smoke_chain.py", nprocs=2, timeout=150)
    assert_mpi_ok(run, 2)
