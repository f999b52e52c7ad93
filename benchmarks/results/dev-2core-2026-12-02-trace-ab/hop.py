"""Per-hop time of an 8 B psend/precv ping-pong inside one jitted ``lax.scan`` (1000 hops per
call). In one process: one device sending to itself (the handler and the mailbox on one
thread, no handoff between device threads for a loaded scheduler to stretch); under
``mpirun -n 2``: between the two ranks' devices. Prints one JSON line on rank 0: the per-hop
time (us) of each of ``CALLS`` calls (first argument, default 40), after 3 warm-up calls.
"""

from __future__ import annotations

import json
import os
import sys
import time

MPI = "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402

if MPI:
    jax.distributed.initialize(cluster_detection_method="mpi4py")

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cpu_mpi  # noqa: E402

HOPS = 1000
CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 40


def main() -> None:
    n = 2 if MPI else 1
    mesh = jax.make_mesh((n,), ("x",))
    fwd, bwd = ([(0, 1)], [(1, 0)]) if MPI else ([(0, 0)], [(0, 0)])
    jax_cpu_mpi.configure(gpu_parity=False)  # a device sending to itself is a cycle

    def body(v):
        def hop(c, _):
            like = jax.ShapeDtypeStruct(c.shape, c.dtype)
            y = jax_cpu_mpi.precv(jax_cpu_mpi.psend(c, "x", fwd), like, "x", fwd)
            z = jax_cpu_mpi.precv(jax_cpu_mpi.psend(y + 1, "x", bwd), like, "x", bwd)
            return z, None

        return jax.lax.scan(hop, v, None, length=HOPS // 2)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                              check_vma=False))
    x = jax.make_array_from_callback((2 * n,), NamedSharding(mesh, P("x")),
                                     lambda i: np.zeros(2 * n, np.float32)[i])
    for _ in range(3):
        jax.block_until_ready(f(x))
    per_hop = []
    for _ in range(CALLS):
        start = time.perf_counter()
        jax.block_until_ready(f(x))
        per_hop.append((time.perf_counter() - start) / HOPS * 1e6)
    if jax.process_index() == 0:
        print(json.dumps({"per_hop_us": per_hop}))


main()
