"""MPI jobs across two hosts, and what network faults do to them.

The hosts are two network namespaces of this machine joined by a veth link, each with its own
hostname and ``/etc/hosts``; MPICH's hydra starts the remote ranks through a bootstrap
wrapper, and UCX is forced onto TCP (``tests/netns_hosts.py``). One rank per host.

* Working jobs: every psend/precv scenario against ``ppermute`` (2 devices per host,
  ``jax.distributed.initialize()`` with no arguments), the pipeline example's ``--check``,
  a 256 MiB message, ``jax-cpu-mpi info``.
* Faults, with ``JAX_CPU_MPI_RECV_TIMEOUT`` of a few seconds: the link taken down mid-loop
  (error uncaught; error caught and ``sys.exit(1)``; 1 KiB messages, and 1 MiB ones, which
  take the rendezvous path, direct or staged), the link down and up again within the
  timeout, the rank on the other host killed. ``scripts/two_host_faults.py`` runs the
  link-down case over more sizes, both directions and repeated trials.

Each job runs on a pair of hosts of its own (unique names), deleted afterwards, also when
the test fails; the tests skip with the reason where namespaces cannot be made (not root, no
``ip``). The fault jobs, which mostly wait, run a few at a time, each test checking its own.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from concurrent_launches import Finished, Launch, Launches
from mpi_launcher import MpiRun, assert_mpi_ok
from netns_hosts import Job, TwoHosts, unavailable_reason

pytestmark = [pytest.mark.mpi, pytest.mark.across_hosts]

#: Seconds a precv waits in the fault tests.
FAULT_RECV_TIMEOUT = 5
#: What "within a few seconds" allows on a loaded 2-core CI machine.
PROMPT = 10.0


def _unavailable() -> str | None:
    """Why this file's tests skip here, or None."""
    reason = unavailable_reason()
    return None if reason is None else f"two-host test bed unavailable: {reason}"


@pytest.fixture
def hosts():
    reason = _unavailable()
    if reason is not None:
        pytest.skip(reason)
    bed = TwoHosts()
    try:
        yield bed
    finally:
        bed.close()


def _all_output(run) -> str:
    return run.launcher_output + "".join(run.rank_output.values())


# --- jobs that work ------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_p2p_scenarios_across_hosts(hosts):
    # 2 devices per host, one launch: every scenario's ring (and the pairs of the mesh of one
    # device per process: the two-way, late-receiver and fresh-map cases) crosses the link
    # both ways, so every size and path of the transport goes over TCP, as with 1 device
    # per host (the same programs; what 1 device per process adds, the one-device hint and
    # the wait it chooses, does not depend on the hosts: tests/runtime/test_p2p_mpi.py).
    env = {"JCM_TEST_PLAIN_INITIALIZE": "1",  # jax.distributed.initialize(), no arguments
           "UCX_LOG_LEVEL": "info"}  # prints the transports UCX chose
    run = hosts.run("p2p_semantics.py", devices_per_process=2, timeout=270, env=env)
    assert_mpi_ok(run, 2)
    lines = [line for lines in run.by_rank().values() for line in lines]
    assert sum(line.startswith("ok ") for line in lines) >= 2 * 25, run.report()
    # The ranks talk over the veth link with TCP, not through shared memory.
    veths = "|".join(hosts.veths.values())
    for rank in (0, 1):
        assert re.search(rf"inter-node cfg.*tag\(tcp/({veths})", run.rank_output[rank]), \
            run.report()


@pytest.mark.timeout(240)
def test_pipeline_example_check_across_hosts(hosts):
    # 4 stages on 2 hosts x 2 devices; the example calls jax.distributed.initialize().
    run = hosts.run("jax_cpu_mpi.examples.pipeline", "--stages", "4", "--microbatches", "4",
                    "--steps", "5", "--width", "16", "--batch", "64", "--check",
                    module=True, timeout=210)
    assert run.returncode == 0, run.report()
    assert re.search(r"^check: PASS ", run.rank_output[0], re.MULTILINE), run.report()
    assert "2 process(es) x 2 CPU device(s)" in run.rank_output[0], run.report()


@pytest.mark.timeout(240)
def test_256_mib_message_across_hosts(hosts):
    rows = 64 << 10  # of 4 KiB
    run = hosts.run("big_message.py", "mpi", str(rows), timeout=210)
    assert_mpi_ok(run, 2)
    assert f"device 1 received all {rows * 4096} bytes intact" in _all_output(run), run.report()


@pytest.mark.timeout(180)
def test_info_names_both_hosts_and_the_transports(hosts):
    run = hosts.run("jax_cpu_mpi", "info", module=True, timeout=150,
                    env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert run.returncode == 0, run.report()
    text = run.rank_output[0]
    for rank, host in ((0, "a"), (1, "b")):
        assert re.search(rf"process {rank}/2 \(MPI rank {rank}\) on {hosts.hostnames[host]} ",
                         text), run.report()
    assert "jax.distributed: mpirun" in text, run.report()
    # 4 devices: mailbox within a host, MPI between them.
    rows = [line.split()[1:] for line in text.splitlines()
            if re.match(r"^\s+(0|1|2048|2049)(\s+[.M]){4}$", line)]
    assert rows == [[".", ".", "M", "M"]] * 2 + [["M", "M", ".", "."]] * 2, run.report()


# --- network faults ------------------------------------------------------------------------
#
# A fault job mostly waits (for the loop to start, then a receive timeout of several
# seconds), so this file's fault jobs run a few at a time (FAULT_JOBS below), each on a pair
# of hosts of its own, instead of one after the other. Each test still checks, and reports,
# its own job; a job that ends or fails early does not touch the others' hosts.


def _fault_env(**extra: str) -> dict[str, str]:
    return {"JAX_CPU_MPI_RECV_TIMEOUT": str(FAULT_RECV_TIMEOUT), **extra}


#: The receive timeout of the 1 MiB link-down tests, and the seconds their launch may take
#: beyond it after the link goes down.
BIG_FAULT_RECV_TIMEOUT = 10
BIG_FAULT_SLACK = 30.0
#: A psend/precv that gave up at its deadline: a precv's own timeout, or the error of a send
#: that the precv finished (a direct send whose receiver stopped taking it, an in-flight bound
#: that never cleared).
_TIMEOUT_ERROR = re.compile(r"DEADLINE_EXCEEDED: precv\(axis_name=\('x',\)|psend\(axis_name="
                            r"\('x',\).* failed: .*(JAX_CPU_MPI_RECV_TIMEOUT|gave up waiting)")
#: The limit of each fault job's launch (TwoHosts.run kills it there).
FAULT_JOB_TIMEOUT = 120
#: The pytest limit of a fault test: its own job (the launch, then up to 15 s for the ranks
#: on the other host to end and 30 s for the fault injector) and the jobs queued before it
#: (3 at once, the longest first).
FAULT_TEST_TIMEOUT = 3 * (FAULT_JOB_TIMEOUT + 60) + 60
FLAP_OUTAGE = 2.0  # seconds the link is down in the flap job


def _link_down(hosts: TwoHosts, *, back_after_exits: bool = False) -> Callable[[Job], None]:
    """Takes the link down once rank 0 loops; with ``back_after_exits``, brings it back once
    both ranks have exited."""

    def cut(job: Job) -> None:
        job.wait_for(0, "JCM-LOOPING")
        job.mark("down")
        hosts.set_link(False)
        if back_after_exits:
            # mpiexec on host A cannot learn that host B's ranks ended while the link is
            # down: wait for both ranks to exit, then bring the link back so that it can.
            job.wait_for_exits(2, timeout=FAULT_RECV_TIMEOUT + 60)
            job.mark("up")
            hosts.set_link(True)

    return cut


def _flap(hosts: TwoHosts, workdir: Path, limit: float) -> MpiRun:
    # A 2 s outage, a 15 s receive timeout. The loop runs until the link is back (the file
    # below), so the outage falls inside it however loaded the machine is.
    link_back = workdir / "link-back-up"

    def flap(job: Job) -> None:
        job.wait_for(0, "JCM-LOOPING")
        hosts.set_link(False)
        time.sleep(FLAP_OUTAGE)
        hosts.set_link(True)
        link_back.touch()

    return hosts.run("network_fault.py", "flap", during=flap, timeout=limit,
                     env={"JAX_CPU_MPI_RECV_TIMEOUT": "15", "JCM_FLAP_CALLS": "100000",
                          "JCM_FLAP_UNTIL": str(link_back)})


def _kill_rank_1(hosts: TwoHosts, _: Path, limit: float) -> MpiRun:
    def kill(job: Job) -> None:
        job.wait_for(0, "JCM-LOOPING")
        line = job.wait_for(1, "pid ")
        job.mark("kill")
        os.kill(int(re.search(r"pid (\d+)", line).group(1)), signal.SIGKILL)

    return hosts.run("network_fault.py", "uncaught", env=_fault_env(), during=kill,
                     timeout=limit)

def _on_new_hosts(start: Callable[[TwoHosts, Path, float], MpiRun]) -> Launch:
    """A fault job, ``start(hosts, workdir, limit)``, on a fresh pair of hosts, deleted once
    it has ended (their names stay in the run's job, for the checks), with a scratch folder
    of its own."""

    def launch(limit: float) -> MpiRun:
        with TwoHosts() as hosts, tempfile.TemporaryDirectory(prefix="jcm-fault-") as workdir:
            return start(hosts, Path(workdir), limit)

    return Launch(launch, FAULT_JOB_TIMEOUT)


#: Every fault job (the longest first: the 1 MiB ones wait for a longer receive timeout), 3 at
#: once: their ranks mostly wait, but each starts with imports and a compile, and the tests
#: time how soon a job ends after its fault.
FAULT_JOBS = Launches("fault job", {
    **{f"1mib-{mode}": _on_new_hosts(lambda hosts, _, limit, mode=mode: hosts.run(
        "network_fault.py", mode, str(1 << 20), "pingpong", during=_link_down(hosts),
        timeout=limit, env={"JAX_CPU_MPI_RECV_TIMEOUT": str(BIG_FAULT_RECV_TIMEOUT)}))
       for mode in ("uncaught", "catch-exit")},
    "catch-exit-aborts": _on_new_hosts(lambda hosts, _, limit: hosts.run(
        "network_fault.py", "catch-exit", env=_fault_env(), during=_link_down(hosts),
        timeout=limit)),
    # JAX_CPU_MPI_ABORT_ON_ERROR=0: each process ends alone (the default aborts the launch).
    "catch-exit-alone": _on_new_hosts(lambda hosts, _, limit: hosts.run(
        "network_fault.py", "catch-exit", during=_link_down(hosts, back_after_exits=True),
        timeout=limit, env=_fault_env(JAX_CPU_MPI_ABORT_ON_ERROR="0"))),
    "uncaught": _on_new_hosts(lambda hosts, _, limit: hosts.run(
        "network_fault.py", "uncaught", env=_fault_env(), during=_link_down(hosts),
        timeout=limit)),
    "flap": _on_new_hosts(_flap),
    "killed": _on_new_hosts(_kill_rank_1),
}, at_once=3, unavailable=_unavailable)
_fault_jobs, fault_job = FAULT_JOBS.fixtures("fault_job")


def _job(done: Finished) -> Job:
    """The job of a fault test's launch, as its fault injector saw it."""
    return done.run.job  # type: ignore[attr-defined]


@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["uncaught"], indirect=True)
def test_link_down_uncaught_error_ends_every_rank_promptly(fault_job: Finished):
    run, job = fault_job.run, _job(fault_job)
    assert run.returncode not in (None, 0), run.report()
    # Every rank raised within the receive timeout plus a few seconds, with an error naming
    # the op, the pair and the peer's host; the job ended right after, on both hosts.
    assert job.ended_at - job.marks["down"] < FAULT_RECV_TIMEOUT + PROMPT, run.report()
    assert job.ranks_ended_at - job.marks["down"] < FAULT_RECV_TIMEOUT + PROMPT, run.report()
    for rank, peer_host in ((0, "b"), (1, "a")):
        text = run.rank_output[rank]
        assert "DEADLINE_EXCEEDED: precv(axis_name=('x',)" in text, run.report()
        assert f"MPI rank {1 - rank} on host {job.hosts.hostnames[peer_host]}" in text, \
            run.report()
        assert "cannot be reached over the network" in text, run.report()
    assert "MPI_Abort" in _all_output(run), run.report()


@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["catch-exit-alone"], indirect=True)
def test_link_down_caught_error_and_sys_exit_ends_the_process_promptly(fault_job: Finished):
    # JAX_CPU_MPI_ABORT_ON_ERROR=0: each process ends alone (the default aborts the launch:
    # the next test).
    run, job = fault_job.run, _job(fault_job)
    assert sorted(job.exits) == [0, 1], run.report()
    for rank in (0, 1):
        status, exited_at = job.exits[rank]
        caught = re.search(r"JCM-CAUGHT at ([\d.]+)", run.rank_output[rank])
        assert caught, run.report()
        # Status 1 as asked (not 134: no SIGABRT from JAX's coordination service), and
        # within seconds of the error: no wait for sends to, or a barrier with, the peer.
        assert status == 1, run.report()
        assert exited_at - float(caught.group(1)) < PROMPT, run.report()
        assert "without MPI_Finalize" in run.rank_output[rank], run.report()
        assert "Terminating process because the JAX distributed service" not in \
            run.rank_output[rank], run.report()
    assert run.returncode is not None, run.report()  # mpiexec ended once the link was back


@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["catch-exit-aborts"], indirect=True)
def test_link_down_caught_error_and_sys_exit_aborts_the_whole_launch(fault_job: Finished):
    # The default: a process that exits (here sys.exit(1) after catching the precv error)
    # from a job whose peer stopped answering aborts the launch (MPI_Abort), so mpiexec ends
    # within seconds, with the link still down, instead of waiting for the other host.
    run, job = fault_job.run, _job(fault_job)
    assert run.returncode not in (None, 0), run.report()
    assert job.ended_at - job.marks["down"] < FAULT_RECV_TIMEOUT + PROMPT, run.report()
    for rank in (0, 1):
        assert re.search(r"JCM-CAUGHT at ([\d.]+)", run.rank_output[rank]), run.report()
    assert "aborting the whole MPI launch (MPI_Abort) with status 1" in _all_output(run), \
        run.report()


@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["1mib-uncaught", "1mib-catch-exit"],
                         ids=["uncaught", "catch-exit"], indirect=True)
def test_link_down_mid_1_mib_messages_ends_the_launch(fault_job: Finished):
    # 1 MiB each way: the rendezvous path (straight from the operand when the receiver is
    # ready first, else staged), where a receive may have matched a message that the dead
    # link then cuts in half (MPI cannot cancel it: it is abandoned at the deadline). With
    # the link down for good, mpiexec on host A ends only through rank 0: its precv must
    # time out, and the error (uncaught, or caught and sys.exit(1)) abort the launch.
    run, job = fault_job.run, _job(fault_job)
    assert run.returncode not in (None, 0), run.report()
    assert job.ended_at - job.marks["down"] < BIG_FAULT_RECV_TIMEOUT + BIG_FAULT_SLACK, \
        run.report()
    assert _TIMEOUT_ERROR.search(run.rank_output[0]), run.report()
    if fault_job.name == "1mib-catch-exit":
        assert "JCM-CAUGHT" in run.rank_output[0], run.report()
        assert "aborting the whole MPI launch (MPI_Abort)" in _all_output(run), run.report()
    else:
        assert "MPI_Abort" in _all_output(run), run.report()


@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["flap"], indirect=True)
def test_link_down_and_up_within_the_timeout_the_loop_continues(fault_job: Finished):
    # A 2 s outage, a 15 s receive timeout: TCP retransmits, and every call completes with
    # exact values (the loop stalls for the outage, then goes on).
    run = fault_job.run
    assert_mpi_ok(run, 2)
    calls = set()
    for rank in (0, 1):
        longest = re.search(r"JCM-LONGEST-CALL ([\d.]+) s", run.rank_output[rank])
        assert longest and float(longest.group(1)) >= 0.75 * FLAP_OUTAGE, run.report()
        completed = re.search(r"completed (\d+) calls", run.rank_output[rank])
        assert completed, run.report()
        calls.add(int(completed.group(1)))
    assert len(calls) == 1 and calls.pop() < 100000, run.report()


@pytest.mark.timeout(FAULT_TEST_TIMEOUT)
@pytest.mark.parametrize("fault_job", ["killed"], indirect=True)
def test_rank_on_the_other_host_killed_ends_the_job_naming_the_host(fault_job: Finished):
    run, job = fault_job.run, _job(fault_job)
    assert run.returncode not in (None, 0), run.report()
    assert job.ended_at - job.marks["kill"] < PROMPT, run.report()
    # Hydra's report names the host of the rank that died, and the signal.
    assert re.search(rf"RUNNING AT {job.hosts.hostnames['b']}\s", run.launcher_output), \
        run.report()
    assert re.search(r"EXIT CODE: 9|signal 9|Killed", run.launcher_output), run.report()
