"""The schedules across processes: ``mpirun -n 2`` x 2 devices and ``mpirun -n 4`` x 1 device,
one launch each running every schedule against the one-device reference."""

from __future__ import annotations

import pytest

from mpi_launcher import assert_mpi_ok, llvm_unoptimized, run_mpi


@pytest.mark.mpi
@pytest.mark.timeout(400)
@pytest.mark.parametrize("nprocs,devices", [(2, 2), (4, 1)],
                         ids=["mpirun-n2x2devices", "mpirun-n4x1device"])
def test_every_schedule_matches_the_reference(nprocs, devices):
    # 4 stages; M = 5 is no multiple of P (and >= P, as interleaving needs). The kept
    # residuals' slots poisoned, as in one process (conftest.py), and so are the outputs of
    # the precvs that are no destination (left unwritten: no tick reads them). With 2
    # devices per process, GPipe sends messages over 4 MiB (the other launch keeps every
    # schedule's small messages). One schedule is enough: the pipeline never reads a zero
    # it receives (the two-op exchange's cases in p2p_semantics.py check the zeros), so this
    # checks the large path runs whole.
    # The ranks compile without LLVM's optimizations: compiling every schedule and the
    # reference is most of each launch, and what is checked (results within the tolerance
    # of the one-device reference, the poison never read, the large messages whole) is
    # decided by the HLO and our FFI handlers, never by how LLVM optimizes the kernels.
    large = ["--large=gpipe"] if devices == 2 else []
    run = run_mpi("pipeline_exactness.py", "4", "5", *large, nprocs=nprocs,
                  devices_per_process=devices, timeout=360,
                  env={"JAX_CPU_MPI_POISON_UNINITIALIZED": "1", **llvm_unoptimized()})
    assert_mpi_ok(run, nprocs)
