"""Framed messages without their chunk header when it is the channel's last one
(cpp/mpi/framing.h): tests/mpi_programs/framed_header.py over mpirun -n 2."""

from __future__ import annotations

import pytest

from mpi_launcher import assert_mpi_ok, llvm_unoptimized, run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(240)
@pytest.mark.parametrize("devices_per_process", [1, 2])
def test_framed_messages_bare(devices_per_process):
    # Compiled cheaply: the messages are at most 16 MiB, and every check (the bytes
    # received, the count of bare messages) is the transport's, not the kernels'.
    cases = "paths,changes,mismatch,timeout" if devices_per_process == 1 else "paths,changes"
    run = run_mpi("framed_header.py", cases, nprocs=2, devices_per_process=devices_per_process,
                  timeout=220, env={"JAX_CPU_MPI_RECV_TIMEOUT": "20", **llvm_unoptimized()})
    assert_mpi_ok(run, 2)
    lines = [line for lines in run.by_rank().values() for line in lines]
    assert sum(line == "framed_header done" for line in lines) == 2, run.report()
    # Every case's every call checked its results and its count of bare messages.
    expected = 2 * (10 * 2 + 2) + (2 * 8 if devices_per_process == 1 else 0)
    assert sum(line.startswith("ok ") for line in lines) == expected, run.report()
