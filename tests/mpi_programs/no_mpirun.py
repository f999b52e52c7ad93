"""Run as two plain processes (no mpirun): a mesh spanning them must fail at lowering."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import jax
import jax.numpy as jnp

process_id, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=process_id)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cpu_mpi  # noqa: E402

mesh = jax.make_mesh((2,), ("x",))
x = jax.make_array_from_callback((2,), NamedSharding(mesh, P("x")),
                                 lambda idx: jnp.zeros(2)[idx])
f = jax.jit(jax.shard_map(
    lambda v: jax_cpu_mpi.precv(jax_cpu_mpi.psend(v, "x", [(0, 1)]),
                                jax.ShapeDtypeStruct(v.shape, v.dtype), "x", [(0, 1)]),
    mesh=mesh, in_specs=P("x"), out_specs=P("x")))
try:
    f.lower(x)
    print("NO ERROR")
except jax_cpu_mpi.MpiSetupError as e:
    print("GOT MpiSetupError:", e, flush=True)
