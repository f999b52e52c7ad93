"""psum/pmean/pmax/pmin between processes over MPI, against gloo and NumPy in the same
program: mpirun -n 2, one or two devices per rank (one launch each, the whole matrix)."""

from __future__ import annotations

import pytest

from mpi_launcher import assert_mpi_ok, run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(240)
@pytest.mark.parametrize("devices_per_process", [1, 2])
def test_collectives_over_mpi_equal_gloo_and_numpy(devices_per_process):
    run = run_mpi("collectives_cases.py", nprocs=2, devices_per_process=devices_per_process,
                  timeout=220)
    assert_mpi_ok(run, 2)
    lines = [line for lines in run.by_rank().values() for line in lines]
    assert not any(line.startswith("FAIL") for line in lines), run.report()
    assert sum(line.startswith("ok ") for line in lines) >= 2 * 100, run.report()


@pytest.mark.timeout(120)
def test_a_peer_that_never_joins_fails_within_the_timeout():
    # Two devices per rank: the in-process meeting's failures are checked too.
    run = run_mpi("collectives_fault.py", nprocs=2, devices_per_process=2, timeout=100,
                  env={"JAX_CPU_MPI_RECV_TIMEOUT": "3", "JAX_CPU_MPI_ABORT_ON_ERROR": "0"})
    out = run.rank_output.get(0, "")
    for said in ("raised as expected", "refused at once", "meeting raised as expected",
                 "meeting refused at once"):
        assert said in out, run.report()
