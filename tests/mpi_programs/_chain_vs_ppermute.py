"""The check shared by the programs that set JAX up themselves (no ``_mpi_common``).

``plain_initialize.py`` and ``packaging_p2p.py`` start JAX their own way, so they cannot
import ``_mpi_common`` (it initializes JAX at import). Importing this module has no side
effect: it imports neither mpi4py nor jax_cpu_mpi, which those programs check for.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def assert_chain_matches_ppermute(mesh: jax.sharding.Mesh) -> np.ndarray:
    """psend/precv along the chain of the mesh's devices, both ways, equals ppermute.

    Runs plain ``jax.lax.psend``/``precv`` over axis ``x`` of ``mesh`` and the same
    program with ``ppermute``; returns the gathered (nonzero) result.
    """
    n = mesh.devices.size
    value = np.arange(4.0 * n, dtype=np.float32).reshape(n, 4) + 1  # the global value
    x = jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("x")),
                                     lambda index: value[index])
    forward = [(i, i + 1) for i in range(n - 1)]
    backward = [(i + 1, i) for i in range(n - 1)]

    def program(p2p: bool):
        def body(v):
            out = []
            for perm in (forward, backward):
                if p2p:
                    token = jax.lax.psend(v, "x", perm)
                    out.append(jax.lax.precv(token, jax.ShapeDtypeStruct(v.shape, v.dtype),
                                             "x", perm))
                else:
                    out.append(jax.lax.ppermute(v, "x", perm))
            return out[0] + 10 * out[1]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    got = np.asarray(multihost_utils.process_allgather(program(True)(x), tiled=True))
    want = np.asarray(multihost_utils.process_allgather(program(False)(x), tiled=True))
    np.testing.assert_array_equal(got, want)
    assert np.any(got != 0)
    return got
