"""Exit of an MPI job whose programs are still running: prompt, reported, with the program's
status (issue: JAX's own psend/precv tests read only their outputs' shapes).

Each launch has a timeout well under the receive timeout it sets: an op left waiting for a
peer that has finished makes the launch run into it (killed: a failing test).
"""

from __future__ import annotations

import re

import pytest

from mpi_launcher import assert_mpi_ok, run_mpi

# A precv that waited for its whole timeout would take 60 s; the launches end in a few.
ENV = {"JAX_CPU_MPI_RECV_TIMEOUT": "60", "JAX_CPU_MPI_EXIT_GRACE": "1"}
REPORT = "jax_cpu_mpi: at exit, process 0 had 1 failed psend/precv"


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["keep", "shutdown"])
def test_unread_output_lets_the_program_finish_and_reports_the_refused_message(mode):
    run = run_mpi("exit_unread_outputs.py", mode, nprocs=2, devices_per_process=4,
                  timeout=45, env=ENV)
    assert_mpi_ok(run, 2)
    if mode == "shutdown":
        assert all("shut down" in out for out in run.rank_output.values()), run.report()
    out = run.rank_output[0]
    assert out.count("jax_cpu_mpi: at exit") == 1 and REPORT in out, run.report()
    assert ("precv(axis_name=('x',), perm=[(7, 0)]) on partition 0 (process 0) expected "
            "float32[1,8] (32 bytes) from partition 7 (process 1), but the matching psend "
            "sent float32[8,8] (256 bytes)") in out, run.report()
    assert "jax_cpu_mpi: at exit" not in run.rank_output[1], run.report()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_dropped_output_ends_its_ops_at_exit_with_the_status_asked_for():
    run = run_mpi("exit_unread_outputs.py", "drop", nprocs=2, devices_per_process=4,
                  timeout=45, env=ENV)
    oks = sum(text.count("JCM-OK") for text in run.rank_output.values())
    assert run.returncode == 3 and oks == 2, run.report()
    out = run.rank_output[0]
    # How far the dropped program got before the exit is the scheduler's: on a loaded
    # machine a device of process 0 may not even reach its chain psend within the grace
    # (JAX 0.12's dispatch returns at once), which the report then lists too. What must
    # hold: one report, the back edge's precv in it, and every op it lists ended by the exit
    # (or refused for its size), none failed any other way.
    assert out.count("jax_cpu_mpi: at exit") == 1, run.report()
    assert re.search(r"jax_cpu_mpi: at exit, process 0 had \d+ failed psend/precv", out), \
        run.report()
    listed = [line for line in out.splitlines() if line.startswith("  - ")]
    assert any(line.startswith("  - precv(axis_name=('x',), perm=[(7, 0)])")
               and "on partition 0 (process 0)" in line for line in listed), run.report()
    ended = ("when the process exited: ended at exit after the grace period",
             "ran after this process closed its MPI transport at exit",
             "but the matching psend sent float32[8,8] (256 bytes)")
    assert all(any(e in line for e in ended) for line in listed), run.report()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_mesh_on_some_processes_runs_and_every_process_exits():
    # JAX's test_psend_precv_basic_two_gpus under mpirun -n 4: processes 1 and 2 are
    # outside the mesh, never lower its program, and exit at once (MPI's attach waited for
    # them forever at the lowering).
    run = run_mpi("subset_mesh.py", nprocs=4, devices_per_process=1, timeout=60, env=ENV)
    assert_mpi_ok(run, 4)
    for rank in (0, 3):
        assert "round trips over processes 0 and 3 right" in run.rank_output[rank], run.report()
    assert not any("jax_cpu_mpi: at exit" in out for out in run.rank_output.values()), \
        run.report()
