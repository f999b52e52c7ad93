"""Jobs under Slurm's ``srun`` and ``sbatch``, on a one-node cluster the tests start.

The cluster (``tests/slurm_cluster.py``: ``munged``, ``slurmctld``, ``slurmd`` of Debian's
``slurm-wlm``, as root, in a temporary directory, on ports of its own) is made once for this
file and torn down after it. The ``mpich`` wheel's MPI talks to ``srun`` through PMI-2
(``--mpi=pmi2``). What runs, each launch with its own timeout and all its output shown on
failure:

* the lines ``docs/launchers.md`` shows, as written, in a folder where ``.venv`` is this
  Python's environment and ``example.py`` the README's example:
  ``srun -n 2 --mpi=pmi2 .venv/bin/python example.py`` (``jax_cpu_mpi.initialize_distributed()``
  under ``srun``, 2 tasks x 2 CPU devices) prints what the README says; the same line with
  ``--mpi=none`` fails with the error the docs quote;
* the docs' ``sbatch`` scripts: ``srun`` steps inside a batch job, ``jax-cpu-mpi info`` (names
  the launcher and the PMI) and the pipeline example with ``--check`` (a bare
  ``jax.distributed.initialize()``: JAX's Slurm detection; 2 tasks x 2 devices);
  and MPICH's ``mpirun`` inside a batch job (its ranks carry Slurm variables of another step:
  ``initialize_distributed()`` must start JAX from MPI, not from them);
* a rank that dies while its peer waits: the survivor's precv times out with the package's
  error, the job aborts, and Slurm cancels the step, well before the test's timeout.
* two nodes, a ``slurmd`` in each network-namespace host (``tests/netns_hosts.py``):
  ``srun -N 2`` puts a task on each, and the README example's messages cross the link.

Outside CI (``CI`` unset) a machine without Slurm skips, naming the command that installs
it; in CI (``.ci/run`` installs Slurm) a missing Slurm fails.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from mpi_launcher import PROGRAMS
from netns_hosts import TwoHosts
from netns_hosts import unavailable_reason as hosts_unavailable_reason
from slurm_cluster import SlurmCluster, unavailable_reason

pytestmark = [pytest.mark.mpi, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ROOT / "docs" / "launchers.md"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
#: The docs' lines, run as written (each must appear verbatim on its page).
SRUN_PMI2 = ("XLA_FLAGS=--xla_force_host_platform_device_count=2 "
             "srun -n 2 --mpi=pmi2 .venv/bin/python example.py")
SRUN_NONE = ("XLA_FLAGS=--xla_force_host_platform_device_count=2 "
             "srun -n 2 --mpi=none .venv/bin/python example.py")
#: A launch that works takes seconds; this is what a loaded 2-core CI machine may need.
LAUNCH_TIMEOUT = 180
#: Slurm 22.05's pmi2 plugin's error when it misreads a long PMI request (docs/launchers.md).
PMI2_MISREAD = "mpi/pmi2: value not properly terminated in client request"
#: The across-nodes launch's tries and each one's timeout: a launch takes a few seconds; one
#: whose PMI request was misread waits in MPI_Init until it is killed.
PMI2_MISREAD_TRIES = 3
PMI2_TRY_TIMEOUT = 80


def _skip_or_fail_in_ci(what: str, reason: str | None) -> None:
    """Skip where ``what`` cannot be had (``reason``), but fail in CI, where .ci/run installs
    Slurm: a failed install must not hide as skipped tests."""
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what} unavailable in CI: {reason}")
    pytest.skip(f"{what} unavailable: {reason}")


@pytest.fixture(scope="module")
def cluster():
    _skip_or_fail_in_ci("Slurm test cluster", unavailable_reason())
    bed = SlurmCluster()
    try:
        yield bed
    finally:
        bed.close()


def _readme_example() -> tuple[str, str]:
    """The README's example (its mpirun-run block) and the output the README shows."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- run: mpirun -n 2 devices=2 -->\n```python\n(.*?)```\n\n"
                      r"<!-- output -->\n```text\n(.*?)```", text, re.S)
    assert found, "README.md: the example block (run under mpirun) and its output"
    return found.group(1), found.group(2).strip()


@pytest.fixture
def workdir(tmp_path):
    """A folder as the docs assume: ``.venv`` (this Python's environment), ``example.py``."""
    (tmp_path / ".venv").symlink_to(sys.prefix)
    (tmp_path / "example.py").write_text(_readme_example()[0])
    return tmp_path


def _on_page(line: str, page: Path) -> None:
    assert line in page.read_text(), f"{page.name} no longer shows: {line}"


def _sbatch_script(launcher: str) -> str:
    """The page's batch script whose steps ``launcher`` starts (``srun`` or ``mpirun``)."""
    blocks = re.findall(r"```bash\n(#!/bin/bash\n#SBATCH .*?)```", LAUNCHERS.read_text(), re.S)
    found = [b for b in blocks if re.search(rf"^\S*{launcher} ", b, re.M)]
    assert len(found) == 1, f"docs/launchers.md: one sbatch script with {launcher} steps"
    return found[0]


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_docs_srun_lines(cluster, workdir):
    """``--mpi=pmi2`` runs the README example; ``--mpi=none`` fails with the docs' error."""
    _on_page(SRUN_PMI2, LAUNCHERS)
    step = cluster.run(["bash", "-c", SRUN_PMI2], LAUNCH_TIMEOUT, cwd=workdir)
    assert step.returncode == 0, step.report() + cluster.logs()
    assert _readme_example()[1] in step.output.splitlines(), step.report()

    _on_page(SRUN_NONE, TROUBLESHOOTING)
    step = cluster.run(["bash", "-c", SRUN_NONE], LAUNCH_TIMEOUT, cwd=workdir)
    assert step.returncode not in (0, None), step.report()
    error = ("MpiSetupError: psend: the mesh spans processes of a JAX job with 2 processes, but "
             "srun started this process without a PMI for MPI")
    assert error in step.output, step.report()
    _on_page(error, TROUBLESHOOTING)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_docs_sbatch_script(cluster, workdir):
    """The docs' batch script: ``jax-cpu-mpi info`` and the pipeline example's ``--check`` as
    ``srun`` steps of one ``sbatch`` job."""
    script = workdir / "job.sh"
    script.write_text(_sbatch_script("srun"))
    step = cluster.sbatch(script, LAUNCH_TIMEOUT, cwd=workdir)
    assert step.returncode == 0, step.report() + cluster.logs()
    out = step.output
    # info, under srun: both processes, the launcher and the PMI, JAX started by Slurm's
    # detection, MPI of one library.
    for process in (0, 1):
        assert f"== jax_cpu_mpi: process {process}/2 (MPI rank {process})" in out, step.report()
    launch = [line for line in out.splitlines() if line.startswith("launch:")]
    assert launch == ["launch:        srun (Slurm), PMI pmi2; jax.distributed: slurm"] * 2, (
        step.report())
    assert "same MPI:      yes" in out, step.report()
    # The pipeline example: 2 tasks x 2 devices, its own check against one device.
    assert re.search(r"^check: PASS", out, re.M), step.report()


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_dead_rank_ends_the_step(cluster):
    """Rank 1 leaves (``os._exit``) while rank 0's 256 MiB psend is in flight: that psend is
    one-way and kept, framed from its operand, so the precv that keeps the operand waits for
    rank 1 to take it and gives up after the receive timeout (and the grace of its cancel)
    with the psend's error, naming it, its peer and what to do; the uncaught error aborts
    the MPI job, Slurm cancels the step; nothing waits for the test's timeout."""
    step = cluster.run(
        ["srun", "-n", "2", "--mpi=pmi2", sys.executable, "-u",
         str(PROGRAMS / "dying_rank.py"), "exits-while-peer-sends"],
        LAUNCH_TIMEOUT,
        env={"JAX_CPU_MPI_RECV_TIMEOUT": "5", "JCM_TEST_DEVICES_PER_PROCESS": "1",
             "PYTHONPATH": os.pathsep.join(p for p in [str(PROGRAMS),
                                                       os.environ.get("PYTHONPATH")] if p),
             "PYTHONUNBUFFERED": "1"})
    assert step.returncode not in (0, None), step.report()
    assert "process 1: dying now (exit)" in step.output, step.report()
    failed = re.search(r"process 0: failed after ([0-9.]+) s: JaxRuntimeError: (.*)",
                       step.output)
    assert failed, step.report()
    # Within the timeout and the cancel's grace (mpi/transport.h, kCancelGrace), plus margin.
    assert float(failed.group(1)) < 5 + 1 + 3, step.report()
    assert failed.group(2).startswith(
        "DEADLINE_EXCEEDED: psend(axis_name=('x',), perm=[(0, 1)]) of "
        "uint8[65536,4096] from partition 0 (process 0) to partition 1 (process 1) "
        "(MPI rank 1 on host "), step.report()
    assert ("failed: the receiver did not take this message before the timeout "
            "(JAX_CPU_MPI_RECV_TIMEOUT); did its process fail or exit, or not reach its precv "
            "of this op in time? (set JAX_CPU_MPI_RECV_TIMEOUT to wait longer)"
            in failed.group(2)), step.report()
    assert "aborting the MPI job (MPI_Abort)" in step.output, step.report()
    assert re.search(r"STEP \d+\.\d+ ON \S+ CANCELLED", step.output), step.report()


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_docs_mpirun_in_batch_script(cluster, workdir):
    """MPICH's ``mpirun`` inside a batch job: the ranks carry the ``SLURM_*`` variables of
    mpirun's proxy step, not their own; ``initialize_distributed()`` starts JAX from MPI and
    the README example gives the README's output."""
    script = workdir / "job.sh"
    script.write_text(_sbatch_script("mpirun"))
    step = cluster.sbatch(script, LAUNCH_TIMEOUT, cwd=workdir)
    assert step.returncode == 0, step.report() + cluster.logs()
    assert _readme_example()[1] in step.output.splitlines(), step.report()


@pytest.fixture
def two_node_cluster():
    """Two nodes: a ``slurmd`` on each network-namespace host of ``tests/netns_hosts.py``."""
    _skip_or_fail_in_ci("two-node Slurm test cluster",
                        unavailable_reason() or hosts_unavailable_reason())
    hosts = TwoHosts()
    try:
        bed = SlurmCluster(hosts=hosts)
        try:
            yield bed
        finally:
            bed.close()
    finally:
        hosts.close()


@pytest.mark.across_hosts
@pytest.mark.timeout(PMI2_MISREAD_TRIES * PMI2_TRY_TIMEOUT + 120)
def test_srun_across_two_nodes(two_node_cluster, workdir):
    """``srun -N 2``: one task on each host, MPI over TCP across the veth link (the only way
    between the namespaces), the README example's output."""
    cluster = two_node_cluster
    step = cluster.run(["srun", "-N", "2", "--ntasks-per-node=1", "hostname"], 60)
    assert step.returncode == 0, step.report() + cluster.logs()
    assert sorted(step.output.split()) == sorted(cluster.nodes), step.report()
    line = SRUN_PMI2.replace("srun -n 2", "srun -N 2 --ntasks-per-node=1")
    # UCX on the link's interface only (each host has one of the two; UCX warns about the
    # other): with every interface, UCX's addresses are long enough that Slurm 22.05's pmi2
    # plugin now and then misreads the PMI request that carries them ("value not properly
    # terminated in client request") and MPI_Init fails (2 runs in 6 in the test bed). With
    # the machine loaded it still does (2 runs in 6 with 3 busy loops beside the test):
    # MPI_Init then waits forever, so that step is killed once the plugin's error shows (or at
    # a shorter timeout) and run again, for that signature only (docs/launchers.md says so);
    # any other failure fails at once.
    tries = []
    for _ in range(PMI2_MISREAD_TRIES):
        step = cluster.run(["bash", "-c", line], PMI2_TRY_TIMEOUT, cwd=workdir,
                           env={"UCX_TLS": "tcp,self",
                                "UCX_NET_DEVICES": ",".join(cluster.hosts.veths.values())},
                           give_up_on=PMI2_MISREAD)
        tries.append(step)
        if step.returncode == 0 or PMI2_MISREAD not in step.output:
            break
    report = "\n".join(t.report() for t in tries)
    assert step.returncode == 0, report + cluster.logs()
    assert _readme_example()[1] in step.output.splitlines(), step.report()
