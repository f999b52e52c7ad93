"""psum/pmean/pmax/pmin between processes over MPI, against gloo and NumPy in the same
program: mpirun -n 2, one or two devices per rank (one launch each, the whole matrix), and a
few collectives led by the third of 3 devices per rank."""

from __future__ import annotations

import pytest

from mpi_launcher import assert_mpi_ok, llvm_unoptimized, run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(240)
@pytest.mark.parametrize("devices_per_process", [1, 2])
def test_collectives_over_mpi_equal_gloo_and_numpy(devices_per_process):
    # With 2 devices per rank, both ways a device that does not lead its process's meeting
    # waits for the leader: parked (its call returns a pending future) and waiting in it.
    # The mode is read when a program runs (set_meeting_handoff), so one launch compiles
    # each program once and runs it in both modes, "on" first (collectives_cases.each_mode).
    # Compiled cheaply (llvm_unoptimized()): the launch is mostly compiling its hundreds of
    # small programs, and what it checks (MPI's results equal to gloo's in the same launch,
    # and to NumPy's) does not depend on how the kernels are generated.
    park = {"JAX_CPU_MPI_PARK": "auto"} if devices_per_process == 1 else {
        "JAX_CPU_MPI_PARK": "on", "JCM_TEST_PARK_MODES": "on,off"}
    run = run_mpi("collectives_cases.py", nprocs=2, devices_per_process=devices_per_process,
                  timeout=220, env={**park, **llvm_unoptimized()})
    assert_mpi_ok(run, 2)
    lines = [line for lines in run.by_rank().values() for line in lines]
    assert not any(line.startswith("FAIL") for line in lines), run.report()
    assert sum(line.startswith("ok ") for line in lines) >= 2 * 100, run.report()
    if devices_per_process == 2:
        for mode, took in (("on", "parked"), ("off", "waited")):
            assert sum(f"the matrix's devices {took} (park {mode}" in line
                       for line in lines) == 2, (mode, run.report())
            assert sum(f"the waiting path, 40 calls vs numpy (park {mode})" in line
                       for line in lines) == 2, (mode, run.report())


@pytest.mark.timeout(150)
def test_gloo_programs_from_the_persistent_cache_finish(tmp_path):
    # jaxlib 0.12.1 hangs in a gloo program loaded from JAX's persistent cache; jax_cpu_mpi
    # compiles such programs anew there and keeps loading the others (the program asserts
    # which came from the cache on process 0, for this jaxlib).
    run = run_mpi("gloo_cache.py", str(tmp_path), nprocs=2, timeout=130)
    assert_mpi_ok(run, 2)
    lines = [line for lines in run.by_rank().values() for line in lines]
    assert sum(line.startswith("ok ") for line in lines) == 2 * 2, run.report()


@pytest.mark.timeout(120)
def test_collectives_led_by_the_third_device_of_a_process():
    # 3 devices per process: the in-process meeting's leader at position 2, which the
    # matrix above (1 and 2 devices) never has; a psum it led was wrong (its operand was
    # overwritten before it was read).
    run = run_mpi("collectives_three_devices.py", nprocs=2, devices_per_process=3,
                  timeout=100)
    assert_mpi_ok(run, 2)
    lines = [line for lines in run.by_rank().values() for line in lines]
    assert not any(line.startswith("FAIL") for line in lines), run.report()
    assert sum(line.startswith("ok ") for line in lines) == 2 * 11, run.report()


@pytest.mark.timeout(120)
def test_a_peer_that_never_joins_fails_within_the_timeout():
    # Two devices per rank: the in-process meeting's failures are checked too.
    run = run_mpi("collectives_fault.py", nprocs=2, devices_per_process=2, timeout=100,
                  env={"JAX_CPU_MPI_RECV_TIMEOUT": "3", "JAX_CPU_MPI_ABORT_ON_ERROR": "0"})
    out = run.rank_output.get(0, "")
    for said in ("raised as expected", "refused at once", "meeting raised as expected",
                 "the device that came had parked", "meeting refused at once"):
        assert said in out, run.report()


@pytest.mark.timeout(90)
def test_a_collective_skipped_by_a_failed_call_is_not_met_by_the_next_call():
    """Rank 0's call fails in a precv before its psum, rank 1's psum of that call runs: rank
    0's next psum met it (both returning the other call's data: rank 0 got 1 + 10 for
    10 + 10). It is refused now, naming the psum and the failure; rank 1's ends within the
    timeout."""
    run = run_mpi("collectives_fault.py", "skipped", nprocs=2, devices_per_process=1,
                  timeout=70,
                  env={"JAX_CPU_MPI_RECV_TIMEOUT": "3", "JAX_CPU_MPI_ABORT_ON_ERROR": "0"})
    out = run.rank_output.get(0, "")
    for said in ("skipped collective: call failed: INVALID_ARGUMENT",
                 "skipped collective: refused at once: FAILED_PRECONDITION: psum"):
        assert said in out, run.report()
    assert "skipped collective: call failed: INTERNAL: psum" in run.rank_output.get(1, ""), (
        run.report())
    assert "skipped collective: FAIL" not in out + run.rank_output.get(1, ""), run.report()
