"""Run under ``mpirun -n 2`` WITHOUT ``jax.distributed.initialize()`` (the mistake): each rank's
JAX runs alone, and the first psend/precv lowering must warn, once, naming the fix."""

import os
import warnings

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi

mesh = jax.make_mesh((2,), ("x",))
perm = [(0, 1)]


def step(v):
    tok = jax_cpu_mpi.psend(v, "x", perm)
    return jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)


f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
x = jax.device_put(jnp.arange(2.0), NamedSharding(mesh, P("x")))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = np.asarray(f(x))
    np.asarray(f(x + 1))  # traced and lowered again: no second warning
    g = jax.jit(jax.shard_map(lambda v: step(v) * 2, mesh=mesh, in_specs=P("x"),
                              out_specs=P("x")))
    np.asarray(g(x))
mine = [w for w in caught if issubclass(w.category, jax_cpu_mpi.MpiSetupWarning)]
print(f"process {jax.process_index()}/{jax.process_count()}: result {out.tolist()}", flush=True)
print(f"JCM-WARNINGS {len(mine)}", flush=True)
for w in mine:
    print(f"JCM-WARNING {w.message}", flush=True)
