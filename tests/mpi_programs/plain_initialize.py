"""``jax.distributed.initialize()`` with no arguments under mpirun, after ``import jax_cpu_mpi``
(or before it: ``plain_initialize.py before-import``).

Run by tests/runtime/test_cluster.py (one host) and tests/runtime/test_across_hosts.py (two
hosts). Checks
that mpi4py is imported by the initialization and not before, that the process index is
the MPI rank and the coordinator runs on rank 0's host, then that a chain of psend/precv in
both directions over every device of the job equals lax.ppermute.
"""

from __future__ import annotations

import os
import socket
import sys

devices = int(os.environ.get("JCM_TEST_DEVICES_PER_PROCESS", "1"))
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}")

import jax  # noqa: E402

# after-import (default): as the docs say. before-import: jax.distributed.initialize() first,
# as users write it; the startup hook of an installed jax_cpu_mpi registered the cluster
# environment when JAX imported its clusters module.
before = len(sys.argv) > 1 and sys.argv[1] == "before-import"
if not before:
    import jax_cpu_mpi

assert "mpi4py.MPI" not in sys.modules, "mpi4py imported before jax.distributed.initialize()"
jax.distributed.initialize()
assert "mpi4py.MPI" in sys.modules
if before:
    import jax_cpu_mpi  # noqa: F401
print("mpi4py imported by initialize, not before", flush=True)

from _chain_vs_ppermute import assert_chain_matches_ppermute  # noqa: E402
from mpi4py import MPI  # noqa: E402

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
me = jax.process_index()
assert (me, jax.process_count()) == (rank, size), (me, jax.process_count(), rank, size)
host = socket.gethostname()
hosts = MPI.COMM_WORLD.allgather(host)
from jax._src import distributed  # noqa: E402

coordinator = distributed.global_state.coordinator_address
assert coordinator.rsplit(":", 1)[0] == hosts[0], (coordinator, hosts)
print(f"process index {me} of {size} on {host}, coordinator {coordinator}", flush=True)

n = jax.device_count()
assert_chain_matches_ppermute(jax.make_mesh((n,), ("x",)))
print(f"process {me}: psend/precv over {n} devices equals ppermute: JCM-OK", flush=True)
