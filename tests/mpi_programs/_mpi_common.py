"""Shared setup of the programs that tests launch under mpirun.

Import this first: it sets the number of CPU devices per process (from the launcher),
starts the JAX distributed runtime from MPI (``cluster_detection_method="mpi4py"``, or a
plain ``jax.distributed.initialize()`` after ``import jax_cpu_mpi`` when
``JCM_TEST_PLAIN_INITIALIZE=1``), and imports jax_cpu_mpi.
"""

from __future__ import annotations

import os
import sys

_devices = int(os.environ.get("JCM_TEST_DEVICES_PER_PROCESS", "1"))
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_devices}"
)

# The programs compare psend/precv with JAX's ppermute: keep ppermute on JAX's own path
# (under mpirun `auto` would lower it to psend/precv). collectives_cases.py sets it itself.
os.environ.setdefault("JAX_CPU_MPI_COLLECTIVES", "gloo")

import jax  # noqa: E402
import numpy as np  # noqa: E402

if os.environ.get("JCM_TEST_PLAIN_INITIALIZE") == "1":
    # As a user would under MPICH's or Open MPI 5's mpirun (jax_cpu_mpi._src.runtime.launchers).
    import jax_cpu_mpi

    assert "mpi4py.MPI" not in sys.modules
    jax.distributed.initialize()
else:
    # The port the launcher holds for this job (tests/mpi_launcher.py), not JAX's
    # hash(hostname) % 4096 one, which two jobs running at once may share.
    if "JCM_TEST_COORDINATOR_PORT" in os.environ:
        os.environ.setdefault("JAX_COORDINATOR_PORT", os.environ["JCM_TEST_COORDINATOR_PORT"])
    jax.distributed.initialize(cluster_detection_method="mpi4py")

import jax_p2p_removal  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cpu_mpi  # noqa: E402

if jax_p2p_removal.requested() and not jax_cpu_mpi._src.ops.primitives.OURS:
    raise RuntimeError("JAX's psend/precv removal was simulated, but jax_cpu_mpi binds JAX's")


def global_array(mesh: jax.sharding.Mesh, spec: P, value: np.ndarray) -> jax.Array:
    """A global array equal to ``value`` everywhere, sharded by ``spec`` over ``mesh``."""
    return jax.make_array_from_callback(
        value.shape, NamedSharding(mesh, spec), lambda index: value[index]
    )


def gather(x: jax.Array) -> np.ndarray:
    """The full value of a (possibly multi-process) global array, on every process."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather_over_mpi(x: jax.Array) -> np.ndarray:
    """``gather(x)`` of a global array whose shards span the processes, through mpi4py's
    MPI_COMM_WORLD: process_allgather compiles a program of its own (an XLA all-gather,
    on gloo) for each shape and dtype, which a launch checking many results pays for."""
    from mpi4py import MPI

    shards = [(s.index, np.asarray(s.data)) for s in x.addressable_shards if s.replica_id == 0]
    out = np.empty(x.shape, x.dtype)
    covered = np.zeros(x.shape, bool)
    for theirs in MPI.COMM_WORLD.allgather(shards):
        for index, data in theirs:
            out[index] = data
            covered[index] = True
    assert covered.all(), f"the shards of {x.shape} gathered leave elements out"
    return out


def ok() -> None:
    """Report success (the launcher counts one JCM-OK line per rank)."""
    print(f"process {jax.process_index()}: JCM-OK", flush=True)
    sys.stdout.flush()
