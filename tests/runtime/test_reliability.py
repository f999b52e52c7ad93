"""Reliability: huge messages, long loops, cached executables, dying ranks, concurrency.

The heavy cases run in child processes (``tests/mpi_programs/*.py``, alone or under
``mpirun``) so that their memory and their MPI job never touch the pytest process; the
concurrency cases run here, on the 8 virtual devices of conftest.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reliability import count_bad_rows, pattern, pattern_np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cpu_mpi
from concurrent_launches import Finished, Launches, mpi_launch
from conftest import make_mesh
from jax_cpu_mpi import config
from mpi_launcher import PROGRAMS, MpiRun, assert_mpi_ok, llvm_unoptimized, run_mpi

ROOT = Path(__file__).resolve().parents[2]


def run_alone(program: str, *args: str, timeout: float,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``tests/mpi_programs/<program>`` in a fresh Python process (no mpirun)."""
    full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(PROGRAMS / program), *args], env=full_env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def output_of(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


def result_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("RESULT ")]


# --- the checker the big-message programs rely on ----------------------------------------


def test_pattern_checker_sees_one_wrong_byte_anywhere():
    rows, cols = 37, 64  # blocks of 8 rows: the last block is clamped (overlaps)
    good = pattern(rows, cols, 5)
    np.testing.assert_array_equal(np.asarray(good), pattern_np(slice(0, rows), cols, 5))
    check = jax.jit(lambda y: count_bad_rows(y, 5, block_rows=8))
    assert int(check(good)) == 0
    for row, col in [(0, 0), (17, 31), (rows - 1, cols - 1)]:
        assert int(check(good.at[row, col].add(1))) >= 1, (row, col)
    # A copy shifted by one row, or another salt, differs everywhere.
    assert int(check(jnp.roll(good, 1, axis=0))) >= rows
    assert int(check(pattern(rows, cols, 6))) >= rows


# --- 1. messages over 2 GiB ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_message_over_2gib_between_two_devices_of_one_process():
    proc = run_alone("big_message.py", "local", timeout=280)
    assert proc.returncode == 0 and "JCM-OK" in proc.stdout, output_of(proc)
    assert "device 1 received all 2147487744 bytes intact" in proc.stdout, output_of(proc)
    print("\n".join(result_lines(proc.stdout)))


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_message_over_2gib_over_mpi():
    run = run_mpi("big_message.py", "mpi", nprocs=2, timeout=280,
                  env={"JAX_CPU_MPI_EXIT_TIMEOUT": "10"})
    assert_mpi_ok(run, 2)
    assert "device 1 received all 2147487744 bytes intact" in run.rank_output[1], run.report()
    print("\n".join(result_lines("".join(run.rank_output.values()))))
    everything = run.launcher_output + "".join(run.rank_output.values())
    # The exit barrier keeps the receiver progressing until the sender's request completes.
    assert "never received" not in everything, run.report()


# --- 2. long loops ------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_ten_thousand_steps_in_one_process_keep_memory_flat():
    proc = run_alone("long_loop.py", "local", timeout=220)
    assert proc.returncode == 0 and "JCM-OK" in proc.stdout, output_of(proc)
    print("\n".join(result_lines(proc.stdout)))


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_ten_thousand_steps_and_back_to_back_programs_over_mpi():
    run = run_mpi("long_loop.py", "mpi", nprocs=2, devices_per_process=2, timeout=220)
    assert_mpi_ok(run, 2)
    for rank in (0, 1):
        assert "every message matched" in run.rank_output[rank], run.report()
    print("\n".join(result_lines("".join(run.rank_output.values()))))


# --- 6. concurrency in one process ---------------------------------------------------------


def _chain(n: int) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(n - 1)]


def _payload(program: int, call: int, n: int, width: int) -> np.ndarray:
    """int32[n * width]: device d's block encodes (program, call, d, element)."""
    device = np.repeat(np.arange(n), width)
    element = np.tile(np.arange(width), n)
    return (program * 10**8 + call * 10**5 + device * 10**4 + element).astype(np.int32)


def test_back_to_back_programs_on_same_and_disjoint_devices_never_mix():
    n, width, calls = 4, 256, 8
    devices = jax.devices()
    meshes = {"low": jax.sharding.Mesh(np.array(devices[:n]), ("x",)),
              "high": jax.sharding.Mesh(np.array(devices[n:2 * n]), ("x",))}
    perm = _chain(n)

    def transfer(v):
        tok = jax_cpu_mpi.psend(v, "x", perm)
        return jax_cpu_mpi.precv(tok, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)

    # Programs 0 and 1 use the same devices and channels; program 2 the other 4 devices.
    plan = {0: "low", 1: "low", 2: "high"}
    programs = {p: jax.jit(jax.shard_map(transfer, mesh=meshes[m], in_specs=P("x"),
                                         out_specs=P("x")))
                for p, m in plan.items()}
    inputs = {(p, c): jax.device_put(_payload(p, c, n, width),
                                     NamedSharding(meshes[m], P("x")))
              for p, m in plan.items() for c in range(calls)}
    for p in plan:
        jax.block_until_ready(programs[p](inputs[p, 0]))  # compile outside the burst
    outputs = {}
    for c in range(calls):  # dispatched back to back: nothing blocks before the checks
        for p in plan:
            outputs[p, c] = programs[p](inputs[p, c])
    for (p, c), out in outputs.items():
        sent = _payload(p, c, n, width).reshape(n, width)
        want = np.concatenate([np.zeros((1, width), np.int32), sent[:-1]])
        np.testing.assert_array_equal(np.asarray(out).reshape(n, width), want,
                                      err_msg=f"program {p}, call {c}")


def test_many_messages_in_flight_on_eight_devices_never_mix():
    """Each step, every device sends to each of the 7 others (7 channels each, 56 in all)
    before it receives, twice; round 1 forwards what round 0 received, so each message
    carries (source, step, round, shift) and the header of the message before it."""
    n, steps, rounds = 8, 40, 2
    shifts = range(1, n)
    mesh = make_mesh((n, "x"))
    perms = {k: [(i, (i + k) % n) for i in range(n)] for k in shifts}
    shape = jax.ShapeDtypeStruct((6,), jnp.int32)

    def body(_):
        me = lax.axis_index("x").astype(jnp.int32)

        def step(carry, t):
            received = []
            previous = {k: jnp.zeros((2,), jnp.int32) for k in shifts}
            for r in range(rounds):
                tokens = {}
                for k in shifts:  # all sends of the round first...
                    header = jnp.stack([me, t, jnp.int32(r), jnp.int32(k)])
                    tokens[k] = jax_cpu_mpi.psend(jnp.concatenate([header, previous[k]]), "x",
                                                  perms[k])
                got = {}
                for k in reversed(shifts):  # ...then the receives, in the other order
                    got[k] = jax_cpu_mpi.precv(tokens[k], shape, "x", perms[k])
                received.append(jnp.stack([got[k] for k in shifts]))
                previous = {k: jnp.stack([got[k][0], got[k][2]]) for k in shifts}
            return carry, jnp.stack(received)

        _, ys = lax.scan(step, 0, jnp.arange(steps, dtype=jnp.int32))
        return ys[None]  # [1, steps, rounds, shifts, 6]

    with config.overrides(gpu_parity=False):  # rings are cyclic pairs: GPU rejects them
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                  check_vma=False))
        got = np.asarray(f(jax.device_put(np.zeros(n, np.int32),
                                          NamedSharding(mesh, P("x")))))

    want = np.zeros((n, steps, rounds, n - 1, 6), np.int32)
    for d in range(n):
        for t in range(steps):
            for r in range(rounds):
                for i, k in enumerate(shifts):
                    src = (d - k) % n
                    forwarded = [(src - k) % n, 0] if r == 1 else [0, 0]
                    want[d, t, r, i] = [src, t, r, k, *forwarded]
    np.testing.assert_array_equal(got, want)


# --- 3. persistent compilation cache -------------------------------------------------------


def _cache_files(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


@pytest.mark.timeout(180)
def test_cached_executable_loaded_by_a_new_process_still_communicates(tmp_path):
    first = run_alone("cached_p2p.py", "local", str(tmp_path), "compile", timeout=80)
    assert first.returncode == 0 and "JCM-OK" in first.stdout, output_of(first)
    written = _cache_files(tmp_path)
    assert any(name.startswith("jit_cached_exchange-") for name in written), written
    second = run_alone("cached_p2p.py", "local", str(tmp_path), "hit", timeout=80)
    assert second.returncode == 0 and "JCM-OK" in second.stdout, output_of(second)
    assert "loaded from the cache, results correct" in second.stdout, output_of(second)
    assert _cache_files(tmp_path) == written  # read, not rewritten


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_cached_executable_loaded_by_a_new_mpi_job_still_communicates(tmp_path):
    first = run_mpi("cached_p2p.py", "mpi", str(tmp_path), "compile", nprocs=2,
                    devices_per_process=2, timeout=100)
    assert_mpi_ok(first, 2)
    written = _cache_files(tmp_path)
    assert any(name.startswith("jit_cached_exchange-") for name in written), written
    second = run_mpi("cached_p2p.py", "mpi", str(tmp_path), "hit", nprocs=2,
                     devices_per_process=2, timeout=100)
    assert_mpi_ok(second, 2)
    # Process 0 ran the executable it loaded from disk against process 1's.
    assert "loaded from the cache, results correct" in second.rank_output[0], second.report()
    assert _cache_files(tmp_path) == written


# --- 4. a rank dies mid-transfer -----------------------------------------------------------
#
# Each scenario ends its MPI job (that is the point), so each needs a launch of its own; a
# launch mostly waits (a rank sleeping, a receive timing out, an exit barrier), so the
# scenarios' launches of this file run a few at a time (FAULT_JOBS below) instead of one
# after the other. Each test still checks, and reports, its own launch.

DYING_TIMEOUT = 120  # hard limit of each job
#: The precv timeout inside: longer than the 3 s a dying rank waits (dying_rank.py) before
#: it dies, so the survivor is still waiting when its peer goes, with a margin of 3 s.
DYING_RECV_TIMEOUT = 6
STOPPED_TIMEOUT = 45  # hard limit of each stopped-sender job; the precv timeout inside is 3 s
NEVER_RECEIVED_TIMEOUT = 150
#: The pytest limit of a test of a fault job: its own job's limit, and the jobs queued
#: before it (3 at once, each bounded by its own limit).
FAULT_TEST_TIMEOUT = 3 * DYING_TIMEOUT + 60


def _dying_env(recv_timeout: float = DYING_RECV_TIMEOUT) -> dict[str, str]:
    return {"JAX_CPU_MPI_RECV_TIMEOUT": str(recv_timeout), "JAX_CPU_MPI_EXIT_TIMEOUT": "5"}


#: Every launch of the fault tests, in the order of the tests. 3 run at once: their ranks
#: mostly wait, but each starts with imports and a compile, and some scenarios time their
#: steps (sleeps of a few seconds).
FAULT_JOBS = Launches("fault job", {
    **{scenario: mpi_launch("dying_rank.py", scenario, limit=DYING_TIMEOUT, env=_dying_env())
       for scenario in ("killed-while-peer-receives", "killed-while-peer-sends",
                        "killed-mid-rendezvous", "exits-while-peer-sends",
                        "exits-mid-rendezvous", "hangs-while-peer-receives")},
    # Rank 0's kept psend and the precv that finishes it time out after 3 s.
    "stopped-mid-rendezvous": mpi_launch("dying_rank.py", "stopped-mid-rendezvous",
                                         limit=DYING_TIMEOUT, env=_dying_env(3)),
    # Rank 0's precv times out after 3 s.
    "stopped-then-peer-exits": mpi_launch("dying_rank.py", "stopped-then-peer-exits",
                                          limit=DYING_TIMEOUT, env=_dying_env(3)),
    **{f"stopped-sender-{path}": mpi_launch(
        "stopped_sender.py", path, limit=STOPPED_TIMEOUT,
        # Through UCX on TCP even between ranks of one host, and rendezvous from 16 KiB.
        env={**_dying_env(3), "MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self",
             "UCX_RNDV_THRESH": "16k"})
       for path in ("eager", "staged", "direct")},
    "never-received": mpi_launch("rendezvous.py", "never-received",
                                 limit=NEVER_RECEIVED_TIMEOUT,
                                 env={"JAX_CPU_MPI_RECV_TIMEOUT": "3",
                                      "JAX_CPU_MPI_EXIT_TIMEOUT": "20"}),
}, at_once=3)
_fault_jobs, fault_job = FAULT_JOBS.fixtures("fault_job")


def _check_dying(job: Finished) -> str:
    run = job.run
    assert run.returncode is not None, f"job hung ({job.elapsed:.0f} s):\n{run.report()}"
    everything = run.launcher_output + "".join(run.rank_output.values())
    assert "JCM-OK" not in everything and "completed" not in everything, run.report()
    for rank in (0, 1):
        assert "ready" in run.rank_output.get(rank, ""), run.report()
    return everything


@pytest.mark.mpi
@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["killed-while-peer-receives", "killed-while-peer-sends",
                                       "killed-mid-rendezvous"], indirect=True)
def test_rank_killed_mid_transfer_ends_the_job(fault_job):
    run, everything = fault_job.run, _check_dying(fault_job)
    assert run.returncode != 0, run.report()
    assert "dying now (kill)" in everything, run.report()
    assert re.search(r"signal 9|KILLED|Killed", run.launcher_output), run.report()


@pytest.mark.mpi
@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["exits-while-peer-sends", "exits-mid-rendezvous"],
                         indirect=True)
def test_rank_that_exits_early_ends_the_job(fault_job):
    # The launcher sees a rank leave without MPI_Finalize and tears the job down; MPICH's
    # mpirun then reports the status of the rank that left (0), so only "ended" is checked.
    everything = _check_dying(fault_job)
    assert "dying now (exit)" in everything, fault_job.run.report()


@pytest.mark.mpi
@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["hangs-while-peer-receives"], indirect=True)
def test_stuck_peer_makes_precv_fail_and_the_job_abort(fault_job):
    # Rank 0 stays alive and never sends. Rank 1's precv raises after the timeout; without
    # MPI_Abort its MPI_Finalize would wait for rank 0 forever: jax_cpu_mpi's excepthook
    # (JAX_CPU_MPI_ABORT_ON_ERROR, on by default) aborts the job.
    run, everything = fault_job.run, _check_dying(fault_job)
    assert run.returncode != 0, run.report()
    error = run.rank_output[1]
    for part in ("DEADLINE_EXCEEDED", "precv(axis_name=('x',), perm=[(0, 1)])",
                 f"partition 1 (process 1) waited {DYING_RECV_TIMEOUT} s",
                 "from partition 0 (process 0)"):
        assert part in error, run.report()
    assert "aborting the MPI job (MPI_Abort)" in everything, run.report()


@pytest.mark.mpi
@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["stopped-mid-rendezvous"], indirect=True)
def test_kept_one_way_send_to_a_receiver_stopped_in_its_precv_times_out(fault_job):
    # Rank 1 waits in its precv of 64 MiB and stops (SIGSTOP). Rank 0's psend (one-way:
    # device 0 receives nothing in the op) sends straight from its operand without a ready
    # signal, left in flight for the precv that keeps the operand; that precv finishes the
    # send, which waits a whole timeout for the stopped receiver (MPI cannot cancel it).
    # The precv must fail with the send's error, naming the psend and its peer, followed by
    # the transport's state at the timeout (MpiTransport::StallReport) like every timeout
    # between processes; the error left uncaught then aborts the job, stopped rank included.
    run, everything = fault_job.run, _check_dying(fault_job)
    assert run.returncode != 0, run.report()
    out = run.rank_output.get(0, "")
    assert "process 1: stopping inside the rendezvous" in run.rank_output.get(1, ""), run.report()
    failed = re.search(r"process 0: failed after ([0-9.]+) s: JaxRuntimeError: (.*)", out)
    assert failed, run.report()
    assert float(failed.group(1)) < 3 + 1 + 3, run.report()  # timeout, cancel grace, margin
    assert failed.group(2).startswith(
        "DEADLINE_EXCEEDED: psend(axis_name=('x',), perm=[(0, 1)]) of "
        "uint8[16384,4096] from partition 0 (process 0) to partition 1 (process 1) "
        "(MPI rank 1 on host "), run.report()
    for part in ("failed: the receiver did not take this message before the timeout "
                 "(JAX_CPU_MPI_RECV_TIMEOUT)",
                 "\n  Transport state at the timeout (this process is MPI rank 0; the peer MPI "
                 "rank 1;",
                 # The send's channel: its message, sent without a ready signal.
                 "\n    sends to rank 1, tag 1: 1 sent or under way (the latest #0); ready "
                 "signals read from the receiver: 0\n",
                 # Its matched send could not be cancelled: abandoned, the transport broken.
                 "\n    unreceived from rank 1: not probed (the transport is broken",
                 "\n    this process: 0 staged sends in flight (0 bytes), 0 direct sends in "
                 "flight, 0 deferred, ", "1 abandoned requests"):
        assert part in out, (part, run.report())
    assert "aborting the MPI job (MPI_Abort)" in everything, run.report()


@pytest.mark.mpi
@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["stopped-then-peer-exits"], indirect=True)
def test_handled_error_after_a_stopped_peer_aborts_the_whole_launch(fault_job):
    # Rank 1 stops (SIGSTOP) and never answers; rank 0's precv times out after 3 s, rank 0
    # catches the error and calls sys.exit(3). Its exit barrier is not met, so jax_cpu_mpi
    # aborts the launch (MPI_Abort) with status 3: mpirun ends within seconds, instead of
    # waiting for the stopped rank (then the job would hit DYING_TIMEOUT: a failure here).
    run = fault_job.run
    assert run.returncode is not None, f"mpirun waited for the stopped rank:\n{run.report()}"
    assert run.returncode != 0, run.report()
    out = run.rank_output.get(0, "")
    assert "process 1: stopping (SIGSTOP)" in run.rank_output.get(1, ""), run.report()
    for part in ("DEADLINE_EXCEEDED", "precv(axis_name=('x',), perm=[(1, 0)])",
                 "MPI rank(s) 1 (host ", "aborting the whole MPI launch (MPI_Abort) with "
                 "status 3", "JAX_CPU_MPI_ABORT_ON_ERROR=0"):
        assert part in out, (part, run.report())
    exited = float(re.search(r"sys\.exit\(3\) at ([0-9.]+)", out).group(1))
    # At most 2 s at the exit barrier (a peer is suspect), then MPI_Abort.
    assert fault_job.ended - exited < 15, (fault_job.ended - exited, run.report())


@pytest.mark.mpi
@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["stopped-sender-eager", "stopped-sender-staged",
                                       "stopped-sender-direct"], indirect=True)
def test_sender_stopped_mid_message_fails_the_receive_in_time(fault_job):
    # stopped_sender.py: rank 0 stops (SIGSTOP) before its 8 B psend, or in the middle of a
    # staged (chunked) or direct message that rank 1's precv has already matched, which MPI
    # cannot cancel. Over TCP (as across hosts) the payload then never comes: the precv must
    # still fail with the timeout error within the timeout and the cancel grace (1 s), say
    # the transport is broken when it had to abandon a matched receive, and the job end;
    # every later op then fails at once, naming that precv as what broke the transport.
    path = fault_job.name.removeprefix("stopped-sender-")
    run = fault_job.run
    assert run.returncode is not None, f"job hung ({fault_job.elapsed:.0f} s):\n{run.report()}"
    assert run.returncode != 0, run.report()
    out = run.rank_output.get(1, "")
    failed = re.search(r"process 1: failed after ([0-9.]+) s, job_broken (True|False)", out)
    assert failed, run.report()
    assert float(failed.group(1)) < 3 + 1 + 3, run.report()  # timeout, grace, margin
    assert failed.group(2) == ("False" if path == "eager" else "True"), run.report()
    first_error = ("DEADLINE_EXCEEDED", "partition 1 (process 1) waited 3 s for uint8[",
                   "from partition 0 (process 0) (MPI rank 0")
    for part in first_error:
        assert part in out, run.report()
    # The error says whether the message started to arrive, and carries the transport's
    # state (MpiTransport::StallReport): how the receive went, and what rank 0 sent that
    # nobody took (once a receive was abandoned, the broken transport probes nothing).
    state = {"eager": ("it was a staged receive (no staged message matched)",
                       "unreceived from rank 0 now: nothing"),
             "staged": ("the message did not arrive whole (the message started to arrive "
                        "but its payload did not complete in time)",
                        "a staged message matched)", "not probed (the transport is broken"),
             # One-way and kept: framed from the operand (a chunk header, then the
             # payload), without a ready signal, and received as a staged message.
             "direct": ("the message did not arrive whole (the message started to arrive "
                        "but its payload did not complete in time)",
                        "a staged message matched)", "not probed (the transport is broken")}[path]
    for part in ("Transport state at the timeout (this process is MPI rank 1; the peer MPI "
                 "rank 0;", "receives from rank 0, tag 1: the latest, #", *state):
        assert part in out, (part, run.report())
    if path != "eager":
        later = re.search(r"process 1: the next op failed at once: (.*)", out)
        assert later, run.report()
        broken, _, cause = later.group(1).partition("The operation that broke it: ")
        assert "this process makes no more MPI calls" in broken, run.report()
        for part in ("precv(axis_name=('x',), perm=[(0, 1)])", *first_error[1:]):
            assert part in cause, (part, run.report())
        # Only the first error's first line: not its state again.
        assert "Transport state" not in cause, run.report()
    assert "aborting the MPI job (MPI_Abort)" in out, run.report()


@pytest.mark.mpi
@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["never-received"], indirect=True)
def test_large_send_nobody_receives_returns_and_exit_does_not_hang(fault_job):
    # Rank 1 ends at once and waits at its exit barrier (up to 20 s) for rank 0, whose precv
    # times out after 3 s: rank 0 must join that barrier with its send still undelivered
    # (a reachable peer, not a broken job) and both ranks end normally, reporting the send.
    run = fault_job.run
    assert_mpi_ok(run, 2)
    out = run.rank_output[0]
    assert "psend of 8388608 bytes returned after" in out, run.report()
    assert "precv failed after" in out and "DEADLINE_EXCEEDED" in out, run.report()
    everything = run.launcher_output + "".join(run.rank_output.values())
    assert "1 psend message(s) were never received" in everything, run.report()
    # Each end names what was left: the sender its send still undelivered (shape, peer,
    # channel), the receiver, once both met at exit, the first message waiting for a
    # precv that never came: the 8 B one sent first, whose eager send completed at once
    # (its sender knows nothing of it).
    assert "uint8[8388608] (8388608 bytes) to MPI rank 1 on tag 1, staged" in everything, (
        run.report())
    assert ("1 message(s) that peers sent were never taken by a precv here" in everything
            and "a staged message of 72 bytes (a payload of 8 bytes and its envelope) from "
                "MPI rank 0 on tag 1" in everything), run.report()
    assert fault_job.elapsed < NEVER_RECEIVED_TIMEOUT - 10, run.report()


# --- 4b. the rendezvous path of large MPI messages -----------------------------------------

#: The cases of rendezvous.py that one launch runs, in order (4 devices per process: the
#: many-channels case uses them all, ordering two, the others the first device of each
#: process). One launch instead of four: each would pay its ranks' imports and JAX's
#: startup.
RENDEZVOUS_CASES = ("paths", "exchange", "many-channels", "ordering", "prefault")
RENDEZVOUS_TIMEOUT = 400


@pytest.fixture(scope="module")
def rendezvous_run() -> MpiRun:
    # Compiled cheaply (llvm_unoptimized(), as the ring's and stale_after_failure.py's
    # launches): their ranks compile a hundred small programs, and what they check (which
    # path a message took, its bytes, the errors) is our handlers' work, not XLA's kernels'.
    return run_mpi("rendezvous.py", ",".join(RENDEZVOUS_CASES), nprocs=2,
                   devices_per_process=4, timeout=RENDEZVOUS_TIMEOUT, env=llvm_unoptimized())


def _case_output(run: MpiRun, case: str, rank: int) -> str:
    """What `rank` printed during `case`; fails, naming the case, unless the case ended."""
    out = run.rank_output.get(rank, "")
    begin, end = f"== case {case}: start\n", f"== case {case}: done\n"
    assert begin in out and end in out, \
        f"case {case!r} did not finish on rank {rank}:\n{run.report()}"
    return out[out.index(begin):out.index(end)]


@pytest.mark.mpi
@pytest.mark.timeout(RENDEZVOUS_TIMEOUT + 30)
def test_rendezvous_direct_staged_and_mismatched_messages(rendezvous_run):
    run = rendezvous_run
    for rank in (0, 1):
        out = _case_output(run, "paths", rank)
        for size in ((64 << 10) + 8, 1 << 20, (8 << 20) + 4096):
            # One-way and kept: framed from the operand however late the receiver.
            assert f"ok   {size} bytes, receiver ready first: framed" in out, run.report()
            assert f"ok   {size} bytes, receiver late: framed" in out, run.report()
        assert f"ok   {8 << 10} bytes, receiver ready first: staged" in out, run.report()
        assert out.count("ok   mismatch") == 4, run.report()
        assert out.count("ok   channel after errors") == 3, run.report()
    assert "sender returned after" in _case_output(run, "paths", 0), run.report()


@pytest.mark.mpi
@pytest.mark.timeout(RENDEZVOUS_TIMEOUT + 30)
def test_rendezvous_exchanges_both_ways_at_once(rendezvous_run):
    """Both ranks send before they receive (one op with a cycle: deferred sends, posted by
    the receive loops; two ops); mismatches in a cycle still fail fast with their message."""
    run = rendezvous_run
    for rank in (0, 1):
        out = _case_output(run, "exchange", rank)
        for name in ("one op", "two ops"):
            for size in (8, 4 << 10, 16 << 10, (100 << 10) + 8, 256 << 10, 1 << 20,
                         (8 << 20) + 4096):
                assert f"ok   exchange {name} {size} bytes" in out, run.report()
        for size in (8, 4 << 10, 16 << 10, 256 << 10, (8 << 20) + 4096):
            assert f"ok   exchange two ops apart {size} bytes" in out, run.report()
        assert out.count("ok   cycle mismatch") == 5, run.report()
        assert "ok   exchange after mismatches" in out, run.report()


@pytest.mark.mpi
@pytest.mark.timeout(RENDEZVOUS_TIMEOUT + 30)
def test_one_way_kept_send_waits_for_no_receiver_that_waits_for_it(rendezvous_run):
    """The precv that keeps a one-way framed send waits until its receiver takes it: a hop
    between independent psums (MPI and gloo) and two one-way ops in opposite directions in
    one step must complete, every byte right, within a short receive timeout."""
    run = rendezvous_run
    for rank in (0, 1):
        out = _case_output(run, "ordering", rank)
        for late in (0, 1):
            for collectives in ("mpi", "gloo"):
                assert f"ok   ordering hop between psums ({collectives}), rank {late} late" \
                    in out, run.report()
            for order in ("reversed", "same"):
                assert (f"ok   ordering two one-way ops, precvs in {order} order, rank {late} "
                        "late") in out, run.report()


@pytest.mark.mpi
@pytest.mark.timeout(RENDEZVOUS_TIMEOUT + 30)
def test_waiting_precv_faults_in_its_output(rendezvous_run):
    """A precv of 6 MiB whose sender is late faults its output in while it waits (the
    one-way framed path and the plain rendezvous, both directions), and leaves a warm
    output's pages alone, and gets the bytes of lax.ppermute."""
    run = rendezvous_run
    for rank in (0, 1):
        out = _case_output(run, "prefault", rank)
        for direction in ("forward", "backward"):
            for path in ("framed", "plain"):
                for late in ("sender late", "receiver late", "warm output"):
                    assert f"ok   prefault {direction} {path}, {late}:" in out, run.report()


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_rendezvous_in_a_ring_of_three_ranks():
    """A ring of 3 ranks (each sends to the next, receives from the previous; one op with
    the cycle, one op per pair): a receive's own deferred send goes to another rank than
    the one it receives from, which 2 ranks never reach; every byte arrives, some direct."""
    run = run_mpi("rendezvous.py", "ring", nprocs=3, devices_per_process=1, timeout=200,
                  env=llvm_unoptimized())
    assert_mpi_ok(run, 3)
    for rank in range(3):
        out = _case_output(run, "ring", rank)
        for name in ("one op", "op per pair"):
            for size in (8, 16 << 10, (100 << 10) + 8, 1 << 20, (8 << 20) + 4096):
                assert f"ok   ring of 3 {name} {size} bytes" in out, run.report()
        assert "direct sends" in out, run.report()


@pytest.mark.mpi
@pytest.mark.timeout(RENDEZVOUS_TIMEOUT + 30)
def test_rendezvous_on_many_channels_at_once(rendezvous_run):
    run = rendezvous_run
    for rank in (0, 1):
        out = _case_output(run, "many-channels", rank)
        assert "ok   many channels: 16 each way, 6 rounds" in out, run.report()


@pytest.mark.mpi
@pytest.mark.timeout(RENDEZVOUS_TIMEOUT + 30)
def test_rendezvous_launch_ends_cleanly(rendezvous_run):
    # After its cases, every rank exits 0 (the exit drains, nothing left in flight).
    assert_mpi_ok(rendezvous_run, 2)
    # Every case ends with every message taken: none in flight from either rank, none
    # waiting unreceived at either (a message left would be a later case's precv's, or
    # pass its check on the old bytes); nor does the exit find one.
    for rank in (0, 1):
        out = rendezvous_run.rank_output.get(rank, "")
        for case in RENDEZVOUS_CASES:
            assert f"ok   case {case}: every message taken" in out, rendezvous_run.report()
    everything = rendezvous_run.launcher_output + "".join(rendezvous_run.rank_output.values())
    assert "were never received" not in everything, rendezvous_run.report()
    assert "never taken by a precv" not in everything, rendezvous_run.report()


# --- 4c. a message that a failed call left in a channel ------------------------------------

STALE_TIMEOUT = 150
#: (bytes, kind) of stale_after_failure.py's cases: in process all of them, over MPI those
#: that do not frame the send from its operand (the program says why).
STALE_CASES = ((8, "one-way"), (4 << 10, "one-way"), (64 << 10, "one-way"),
               (1 << 20, "one-way"), (1 << 20, "cycle"))
STALE_OVER_MPI = ((8, "one-way"), (4 << 10, "one-way"), (1 << 20, "cycle"))
#: The late senders' sizes (the same program's late_senders) and their refusal's words.
LATE_SIZES = (8, 4 << 10, 1 << 20)
LATE_REFUSED = ("refused: FAILED_PRECONDITION: ", "refused: an earlier precv on this channel",
                "timed out (precv(axis_name=('x',), perm=[(1, 0), (2, 3)])", "waited 1 s")
#: The sender side (the same program's sender_case): the refusal of the failing device's
#: next psend, and the receivers' errors.
SENDER_REFUSED = ("FAILED_PRECONDITION: psend(axis_name=('x',), perm=[(0, ",
                  "refused: an earlier call of a program that sends on this channel",
                  "expected float32[2]", "restart the job")


@pytest.mark.mpi
@pytest.mark.timeout(STALE_TIMEOUT + 30)
def test_message_of_a_failed_call_is_never_taken_as_a_later_calls():
    """A precv that XLA skipped after an op failed on its device leaves its peer's message in
    the channel: the next call's precv there must refuse, naming the failure, instead of
    returning that message's bytes as its own (it did: ``STALE``), in process and over MPI,
    either rank failing, eager, staged, framed and direct. So does a precv that timed out
    before its late sender's message came (the next call took that message as its own).
    The sender side: a call that failed on the sending device before its psends ran left
    the receivers' precvs waiting in the other process; the next call's psends there must be
    refused (their messages reached those precvs, which returned them as the failed call's:
    ``STALE``), and the waiting precvs time out instead."""
    run = run_mpi("stale_after_failure.py", nprocs=2, devices_per_process=8,
                  timeout=STALE_TIMEOUT,
                  env={"JAX_CPU_MPI_RECV_TIMEOUT": "20", **llvm_unoptimized()})
    assert_mpi_ok(run, 2)
    everything = run.launcher_output + "".join(run.rank_output.values())
    assert "STALE" not in everything and "FRESH" not in everything, run.report()
    refused = ("refused: FAILED_PRECONDITION: ", "refused: an earlier call of a program "
               "that receives on this channel", "expected float32[2]")
    for rank in (0, 1):
        out = run.rank_output.get(rank, "")
        lines = {line.split(": refused: ")[0]: line for line in out.splitlines()
                 if ": refused: " in line}
        names = [f"ok   in process {n} bytes {kind}" for n, kind in STALE_CASES]
        names += [f"ok   rank {rank} failing {n} bytes {kind}" for n, kind in STALE_OVER_MPI]
        for name in names:
            assert name in lines and all(part in lines[name] for part in refused), (
                name, run.report())
        # A precv that timed out before its late sender's message came: refused too.
        for where, n in [("in process", n) for n in LATE_SIZES] + [
                ("over MPI", n) for n in LATE_SIZES[:2]]:
            line = lines.get(f"ok   late sender {where} {n} bytes", "")
            assert all(part in line for part in LATE_REFUSED), (where, n, run.report())
        for n, kind in STALE_OVER_MPI:
            assert f"ok   rank {1 - rank} failing {n} bytes {kind}: peer side returned" in out, (
                run.report())
        # The failed op finished the send that the skipped precv kept: the peer got it.
        assert (f"ok   rank {1 - rank} failing {1 << 20} bytes cycle: the failed op finished "
                "the kept send") in out, run.report()
        # The sender side: the failing device's next psends are refused (in process too),
        # the 4 channels marked; the other rank's receivers time out, then refuse.
        for name in ("in process", f"rank {rank} failing"):
            line = next((x for x in out.splitlines() if x.startswith(f"sender G err {name}:")),
                        "")
            assert all(part in line for part in SENDER_REFUSED), (name, run.report())
            assert f"sender marks {name}: 4" in out, (name, run.report())
        assert f"sender F err rank {1 - rank} failing: DEADLINE_EXCEEDED: precv" in out, (
            run.report())
        assert (f"sender G err rank {1 - rank} failing: FAILED_PRECONDITION: precv") in out, (
            run.report())
        assert f"sender marks rank {1 - rank} failing: 0" in out, run.report()
    # The messages stay where they are: the exit names them.
    assert "never taken by a precv here" in everything, run.report()


@pytest.mark.mpi
@pytest.mark.timeout(STALE_TIMEOUT + 30)
def test_a_framed_send_nobody_takes_is_abandoned_without_a_crash():
    """A one-way psend framed from its operand (64 KiB) whose receiver was skipped after an
    op failed there times out in its keeper precv; MPI_Cancel of such a send crashed MPICH's
    UCX netmod (SIGSEGV in ucp_request_cancel, the whole job gone without a Python error)
    once the other rank's transport was broken. The send is now abandoned: every call after
    it fails with an error, and both ranks get to the end of the program."""
    run = run_mpi("stale_after_failure.py", "framed", nprocs=2, devices_per_process=4,
                  timeout=STALE_TIMEOUT, env=llvm_unoptimized())
    everything = run.launcher_output + "".join(run.rank_output.values())
    assert "Segmentation fault" not in everything and "signal 11" not in everything, (
        run.report())
    for rank in (0, 1):
        out = run.rank_output.get(rank, "")
        assert "ok   framed launch: done" in out and "JCM-OK" in out, run.report()
        # The framed send of the case where the other rank fails timed out with its error.
        assert (f"F err framed launch, rank {1 - rank} failing 65536 bytes one-way: "
                "DEADLINE_EXCEEDED") in out, run.report()
