"""Two MPI jobs at once on one host, each with a coordinator of its own.

JAX's mpi4py detection takes the coordinator's port from ``hash(hostname) % 4096`` on rank 0:
with the same hash seed (or once in 4096 without), two jobs that run at once pick the same
port, gRPC lets both coordinators listen on it, and the jobs' processes abort with "different
incarnation" errors. The test programs (``_mpi_common.py``) take the port that
``mpi_launcher.run_mpi`` holds for each launch instead; ``PYTHONHASHSEED=0`` in both jobs
makes JAX's choice the same port for both, so the test fails whenever a launch falls back to it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from mpi_launcher import assert_mpi_ok, run_mpi


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_two_jobs_at_once_each_get_their_own_coordinator():
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(
            lambda token: run_mpi("coordinator_port.py", str(token), nprocs=2, timeout=150,
                                  env={"PYTHONHASHSEED": "0"}),
            (101, 202)))
    for run in runs:
        assert_mpi_ok(run, 2)


def test_initialize_distributed_over_mpi4py_gives_jax_a_held_port(monkeypatch):
    """Where ``initialize_distributed()`` starts JAX through mpi4py (a launcher our cluster
    environment does not serve), it passes the coordinator's address from the port rank 0
    holds (``launchers.coordinator_address``) instead of leaving JAX's hash-chosen one, and
    leaves an address the caller or ``JAX_COORDINATOR_ADDRESS`` gives alone."""
    from types import SimpleNamespace

    from jax_cpu_mpi._src.runtime import launchers

    calls: list[dict] = []
    monkeypatch.setattr(launchers.jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(launchers.jax.distributed, "initialize",
                        lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(launchers, "detect", lambda: SimpleNamespace(jax_method=lambda: "mpi4py"))
    monkeypatch.setattr(launchers.mpi_runtime, "import_mpi4py", lambda: None)
    monkeypatch.setattr(launchers, "coordinator_address",
                        lambda port=None: f"rank0host:{port or 40001}")
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)

    assert launchers.initialize_distributed(initialization_timeout=30) == "mpi4py"
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "40002")
    launchers.initialize_distributed()
    launchers.initialize_distributed(coordinator_address="given:1")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "fromenv:2")
    launchers.initialize_distributed()
    assert calls == [
        {"cluster_detection_method": "mpi4py", "coordinator_address": "rank0host:40001",
         "initialization_timeout": 30},
        {"cluster_detection_method": "mpi4py", "coordinator_address": "rank0host:40002"},
        {"cluster_detection_method": "mpi4py", "coordinator_address": "given:1"},
        {"cluster_detection_method": "mpi4py"},
    ]
