"""psend/precv across processes started by a given launcher recipe (tests/test_packaging.py).

``python packaging_p2p.py MODE``; MODE says how ``jax.distributed`` is started:

* ``slurm-env``: as under ``srun``: JAX's Slurm auto-detection, from SLURM_* variables set
  here with the process indices REVERSED against the MPI ranks (jax_cpu_mpi must route by
  its own rank map, not assume process index == rank);
* ``ompi-env``: Open MPI 5 (PRRTE), which JAX does not detect: explicit
  ``coordinator_address`` / ``num_processes`` / ``process_id`` from OMPI_COMM_WORLD_*.
* ``ompi-plain``: Open MPI 5 with a plain ``jax.distributed.initialize()`` after
  ``import jax_cpu_mpi``: jax_cpu_mpi's cluster environment reads the PMIx variables.

Except in ``ompi-plain``, jax_cpu_mpi is never imported by hand: the jax_plugins entry point
activates it. Checks that mpi4py is imported only once jax_cpu_mpi is loaded (in
``ompi-plain``: by the initialization, not before) and that MPI is attached before any
cross-process lowering, then that a chain of psend/precv in both
directions equals lax.ppermute.
"""

from __future__ import annotations

import os
import sys


def jax_detects_open_mpi_5() -> bool:
    """JAX >= 0.12: OmpiCluster recognises Open MPI 5 (PRRTE) and asks mpi4py for ranks."""
    from jax._src.clusters import ompi_cluster

    return hasattr(ompi_cluster.OmpiCluster, "_is_ompi_5")


mode = sys.argv[1]
rank = int(next(os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK") if v in os.environ))
size = int(next(os.environ[v] for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE") if v in os.environ))
devices = int(os.environ.get("JCM_TEST_DEVICES_PER_PROCESS", "1"))
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}")

if mode == "slurm-env":
    expected_index = size - 1 - rank
    os.environ.update({
        "SLURM_JOB_ID": os.environ["JCM_TEST_SLURM_JOB_ID"],
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NTASKS": str(size),
        "SLURM_PROCID": str(expected_index),
        "SLURM_LOCALID": str(expected_index),
    })
    # JAX's Slurm detection would take the port from the job id % 4096: the launcher's held
    # one (tests/mpi_launcher.py) instead, which no other job running at once can have.
    if "JCM_TEST_COORDINATOR_PORT" in os.environ:
        os.environ["JAX_COORDINATOR_PORT"] = os.environ["JCM_TEST_COORDINATOR_PORT"]
elif mode in ("ompi-env", "ompi-plain"):
    expected_index = rank
else:
    raise SystemExit(f"unknown mode {mode!r}")

import jax  # noqa: E402
from _chain_vs_ppermute import assert_chain_matches_ppermute  # noqa: E402

assert "mpi4py.MPI" not in sys.modules
if mode == "slurm-env":
    jax.distributed.initialize()  # JAX's SlurmCluster
elif mode == "ompi-plain":
    import jax_cpu_mpi  # noqa: F401  (registers its cluster environment)

    assert "mpi4py.MPI" not in sys.modules, "mpi4py imported before initialize()"
    jax.distributed.initialize()
    assert "mpi4py.MPI" in sys.modules  # rank 0 broadcast the coordinator address
else:
    jax.distributed.initialize(
        coordinator_address=f"localhost:{os.environ['JCM_TEST_PORT']}",
        num_processes=int(os.environ["OMPI_COMM_WORLD_SIZE"]),
        process_id=int(os.environ["OMPI_COMM_WORLD_RANK"]),
    )
# JAX >= 0.12 recognises Open MPI 5 (PRRTE) itself and asks mpi4py for the local rank (to
# pick local_device_ids) even when every other argument is given: then JAX initialized MPI
# (with mpi4py's default thread level, "multiple"), and jax_cpu_mpi must attach to it.
# ompi-plain: the initialization broadcast the coordinator's address over MPI (jax_cpu_mpi's
# cluster environment, or JAX >= 0.12's own Open MPI 5 detection).
# Otherwise jax_cpu_mpi, loaded by the plugin entry point when JAX creates its backend (not
# yet here), is the first to import mpi4py.MPI.
jax_initialized_mpi = "mpi4py.MPI" in sys.modules
if mode == "ompi-plain" or (mode == "ompi-env" and jax_detects_open_mpi_5()):
    assert jax_initialized_mpi, "jax.distributed.initialize() did not go through mpi4py"
else:
    assert not jax_initialized_mpi, "mpi4py.MPI imported before jax_cpu_mpi was loaded"

assert jax.process_index() == expected_index, (jax.process_index(), expected_index)
assert jax.process_count() == size

n = len(jax.devices())
mesh = jax.make_mesh((n,), ("x",), devices=jax.devices())
assert "jax_cpu_mpi" in sys.modules, "the jax_plugins entry point did not load jax_cpu_mpi"

from jax_cpu_mpi import _jax_cpu_mpi as ext  # noqa: E402

# Under an MPI launcher, MPI is attached once JAX's distributed runtime is up and jax_cpu_mpi
# is loaded, while every process is there: before any cross-process lowering, which the
# processes outside a mesh would never join.
assert ext.mpi_attached(), "MPI not attached when the plugin loaded"
assert_chain_matches_ppermute(mesh)
assert ext.mpi_attached()
initialized_by = "JAX" if jax_initialized_mpi else "jax_cpu_mpi"
print(f"process {jax.process_index()} (MPI rank {rank}): MPI initialized by {initialized_by}, "
      f"MPI {ext.mpi_build_info()['vendor']}, JCM-OK", flush=True)
