"""psend/precv across processes: mpirun -n 2, one or two devices per rank."""

from __future__ import annotations

import json
import os
import re

import pytest

from concurrent_launches import Finished, Launches, mpi_launch
from mpi_launcher import assert_mpi_ok, run_mpi

pytestmark = pytest.mark.mpi

#: The launches of the tests after the scenarios: each mostly waits (receive timeouts of 3 s,
#: a sleep of 3 s), so they run at once, started by the first of those tests.
WAITING_JOBS = Launches("job", {
    "errors": mpi_launch("p2p_errors.py", limit=160, env={"JAX_CPU_MPI_RECV_TIMEOUT": "3"}),
    "fast-dispatch": mpi_launch("fast_dispatch.py", limit=160, devices_per_process=2,
                                env={"JAX_CPU_MPI_RECV_TIMEOUT": "3"}),
    "send-lifecycle": mpi_launch("send_lifecycle.py", limit=160),
}, at_once=3)
_waiting_jobs, waiting_job = WAITING_JOBS.fixtures("waiting_job")
#: The pytest limit of each of those tests: its launch's limit, all three running at once.
WAITING_TEST_TIMEOUT = 180


def _transparent_huge_pages() -> bool:
    """Whether the kernel backs a range advised with MADV_HUGEPAGE by huge pages."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split("-")[0].split(".")
    try:
        return (int(release[0]), int(release[1])) >= (major, minor)
    except (IndexError, ValueError):
        return False


@pytest.mark.timeout(240)
@pytest.mark.parametrize("devices_per_process", [1, 2])
def test_all_scenarios_over_mpi(devices_per_process):
    # One run with the freed memory kept, one with glibc's defaults (set either way: the
    # default may change): the setting is applied at import and again when MPI is attached.
    keep = devices_per_process == 2
    run = run_mpi("p2p_semantics.py", nprocs=2, devices_per_process=devices_per_process,
                  timeout=220, env={"JAX_CPU_MPI_KEEP_FREED_MEMORY": "1" if keep else "0"})
    assert_mpi_ok(run, 2)
    lines = [line for lines in run.by_rank().values() for line in lines]
    assert sum(line.startswith("ok ") for line in lines) >= 2 * 25, run.report()
    # The largest messages' cases ran (the 32 MiB one-way calls, the last of them), unless
    # asked for small messages only (the rerun without JAX's psend/precv,
    # tests/ops/test_without_jax_p2p.py).
    if os.environ.get("JCM_TEST_SMALL_MESSAGES_ONLY") != "1":
        assert sum(line.startswith("ok   one way at 32 MiB") for line in lines) == 2 * 3, \
            run.report()
    # Waits sleep soon exactly when the node's ranks x devices outnumber the cores the
    # node's ranks run on (the union of their masks: unbound here, each rank's own), or the
    # rank's devices its own cores (both ranks run on this host).
    for rank_lines in run.by_rank().values():
        seen = json.loads(next(x for x in rank_lines if x.startswith("wait "))[5:])
        chosen = seen["chosen"]
        assert chosen["node_ranks"] == 2, run.report()
        assert chosen["local_devices"] == seen["local_devices"] == devices_per_process
        assert chosen["cores"] == seen["affinity"], run.report()
        assert chosen["sleeps_soon"] == (2 * devices_per_process > seen["affinity"])
        # JAX_CPU_MPI_WAIT=auto: a node with a core per busy thread gets the bounded wait
        # (spin, then yield, then sleep, each phase bounded by the clock), never the long one.
        assert chosen["mode"] == ("soon" if chosen["sleeps_soon"] else "bounded"), run.report()
        # The counts of what the waits did are in stats(), and a run of psend/precv waited.
        counts = json.loads(next(x for x in rank_lines if x.startswith("waits "))[6:])
        assert counts["wait_yields"] + counts["wait_sleeps"] > 0, run.report()
        # A receiver that waited half a second for a late sender, sleeping soon: its
        # sleeps grew past 50 us (to 500 us, at most 1/16 of the time slept), about a
        # thousand, where steps of 50 us made ten thousand, each a wake-up taken from the
        # threads that compute. (With a core of its own it keeps 50 us steps.)
        waited = json.loads(next(x for x in rank_lines if x.startswith("longwait "))[9:])
        if waited["receiver"] and chosen["mode"] == "soon":
            assert waited["sleeps"] <= waited["seconds"] / 250e-6, run.report()
        # The first large receive's output was advised for huge pages (where the kernel has
        # transparent huge pages), and its bytes arrived.
        if os.environ.get("JCM_TEST_SMALL_MESSAGES_ONLY") != "1":
            advice = json.loads(next(x for x in rank_lines if x.startswith("hugepage "))[9:])
            if advice is not None:
                assert advice["right"], run.report()
                assert advice["advised"] or not _transparent_huge_pages(), run.report()
            # A loop carry that XLA wrote before its first receive (4 KiB pages) is on huge
            # pages after the loop's receives into it (collapsed at the second), where the
            # kernel has THP "madvise" (under "always" it had them from the start) and
            # MADV_COLLAPSE (Linux 6.1).
            carry = json.loads(next(x for x in rank_lines if x.startswith("carryhuge "))[10:])
            if carry is not None:
                assert carry["right"], run.report()
                if _transparent_huge_pages() and _kernel_at_least(6, 1):
                    assert carry["huge_bytes"] == carry["range_bytes"] > 0, run.report()
        # The same for a parameter that another program wrote and every step sends, on the
        # sending process (its receiver got the bytes, checked on either process).
        if os.environ.get("JCM_TEST_SMALL_MESSAGES_ONLY") != "1":
            sent = json.loads(next(x for x in rank_lines if x.startswith("sendhuge "))[9:])
            assert sent["right"], run.report()
            if "huge_bytes" in sent and _transparent_huge_pages() and _kernel_at_least(6, 1):
                assert sent["huge_bytes"] == sent["range_bytes"] > 0, run.report()
        # New operands at a recycled address, each sent six times: on huge pages after
        # their sends, where the kernel can say which pages are huge (PAGEMAP_SCAN, Linux
        # 6.7). Without the freed memory kept, each is a fresh map over new 4 KiB pages at the
        # first one's address (glibc maps a block that large afresh): the case is what it
        # says where an operand after the first reused the first's address.
        if os.environ.get("JCM_TEST_SMALL_MESSAGES_ONLY") != "1":
            recycled = json.loads(next(x for x in rank_lines
                                       if x.startswith("recycledhuge "))[13:])
            assert recycled["right"], run.report()
            if ("after" in recycled and _transparent_huge_pages()
                    and _kernel_at_least(6, 7)):
                assert recycled["range_bytes"] > 0, run.report()
                assert all(a == recycled["range_bytes"] for a in recycled["after"]), \
                    run.report()
                if not keep:
                    assert 0 in recycled["addresses"][1:], run.report()
        # A 64 MiB block allocated again after one was freed: kept, none of its 16384 pages
        # faults again; glibc's default maps it afresh (16384 faults, 32 with huge pages).
        faults = json.loads(next(x for x in rank_lines if x.startswith("malloc "))[7:])
        if keep:
            assert faults["faults"] <= 4, run.report()
        else:
            assert faults["faults"] >= 32, run.report()


@pytest.mark.timeout(WAITING_TEST_TIMEOUT)
@pytest.mark.parametrize("waiting_job", ["errors"], indirect=True)
def test_errors_over_mpi(waiting_job: Finished):
    run = waiting_job.run
    assert_mpi_ok(run, 2)
    # The exit report (Runtime::note_failed_op): errors alike by their first line counted
    # there, "(2 times)" (each retyped message, sender first and receiver first; the two
    # timeouts), the first one's lines under it kept, the count not after them: the
    # first timeout's transport state, not the second's.
    out = run.rank_output[1]
    assert "jax_cpu_mpi: at exit, process 1 had 13 failed psend/precv" in out, run.report()
    assert out.count("must have the same shape and dtype. (2 times)\n") == 8, run.report()
    latest = dict(re.findall(r"timeout (\d): receives from rank 0, tag 1: the latest, #(\d+)",
                             out))
    assert len(latest) == 2 and latest["0"] != latest["1"], run.report()
    timeout = re.search(r"\n  - precv\(axis_name=\('x',\), perm=\[\(0, 1\)\]\) on partition 1 "
                        r"\(process 1\) waited 3 s [^\n]* \(2 times\)\n  Transport state at the "
                        r"timeout [^\n]*\n    receives from rank 0, tag 1: the latest, #(\d+), ",
                        out)
    assert timeout and timeout.group(1) == latest["0"], run.report()


@pytest.mark.timeout(WAITING_TEST_TIMEOUT)
@pytest.mark.parametrize("waiting_job", ["fast-dispatch"], indirect=True)
def test_fast_dispatch_over_mpi_and_its_errors(waiting_job: Finished):
    """2 devices per rank, then 1 device of each rank (with the device-thread hint): jit's
    C++ path, and a precv's timeout still a JaxRuntimeError."""
    run = waiting_job.run
    assert_mpi_ok(run, 2)
    for what in ("2 devices per process", "1 device per process"):
        assert f"{what}: raised as expected" in run.rank_output[1], run.report()


@pytest.mark.timeout(WAITING_TEST_TIMEOUT)
@pytest.mark.parametrize("waiting_job", ["send-lifecycle"], indirect=True)
def test_inflight_bound_and_sends_in_flight_at_exit(waiting_job: Finished):
    run = waiting_job.run
    assert_mpi_ok(run, 2)
    everything = run.launcher_output + "".join(run.rank_output.values())
    for bad in ("undelivered", "never received", "pending", "leaked"):
        assert bad not in everything.lower(), run.report()
