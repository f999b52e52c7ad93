"""``jax.distributed.initialize()`` with no arguments under mpirun (our cluster environment).

The detection is checked in fresh Python processes with the launchers' variables set by
hand (JAX's cluster detection reads ``os.environ``, and whether mpi4py was imported can only
be told in a process that did not import it yet); ``mpirun -n 2`` runs the real thing on one
host. ``tests/runtime/test_across_hosts.py`` runs it across two hosts, and
``tests/test_packaging.py``
under Open MPI 5's ``mpirun``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_cpu_mpi._src import compat as _compat
from jax_cpu_mpi._src.runtime import launchers as cluster
from mpi_launcher import assert_mpi_ok, run_mpi

#: Every variable a launcher may have left in the test's environment.
_LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                "PMIX_RANK", "PMIX_NAMESPACE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_MCA_orte_hnp_uri", "SLURM_JOB_ID",
                "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
                "JAX_CPU_MPI_DISABLE", "JAX_COORDINATOR_PORT")
_HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
_PRRTE = {"PMIX_RANK": "2", "PMIX_NAMESPACE": "prterun-x-1", "OMPI_COMM_WORLD_RANK": "2",
          "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
_ORTE = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
         "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:34911"}
_SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "4",
          "SLURM_PROCID": "3", "SLURM_LOCALID": "1"}

# Runs JAX's own detection with explicit coordinator/count/id (so nothing is collective),
# and reports which environment JAX chose and what it filled in: for each case of BEFORE
# (before {imports} runs: what the startup hook did alone), then of CASES (after it), in
# turn (name -> [launcher variables, address, count, id]), with os.environ set to that
# case's variables and no other launcher's (JAX's and our detection read os.environ when
# called, nothing is cached).
# A case that raises reports its traceback, the others still run. ``mpi4py`` says whether
# the case imported mpi4py.MPI: the modules of an import are dropped from sys.modules after
# each case, so that the next case's import shows too (and is its own).
_DETECT = """
import json, os, sys, traceback
import jax
from jax._src import clusters
start = dict(os.environ)
base = {{k: v for k, v in start.items() if k not in {launch_vars!r}}}
results = {{}}

def run(cases):
  for name, (variables, address, count, pid) in cases.items():
    os.environ.clear()
    os.environ.update(base, **variables)
    try:
        env = next((e for e in clusters.ClusterEnv._cluster_types
                    if not e.opt_in_only_method and e.is_env_present()), None)
        if name.startswith("prrte") and env is not None and env.name == "ompi":
            # JAX 0.12 detects Open MPI 5 itself, through mpi4py (a real launch only).
            results[name] = {{"env": "ompi", "jax_detects_prrte": True}}
        else:
            address, count, pid, local = (
                clusters.ClusterEnv.auto_detect_unset_distributed_params(
                    address, count, pid, None, None, 30))
            results[name] = {{"env": env and env.name, "address": address, "count": count,
                              "id": pid, "local_device_ids": local,
                              "names": [e.name for e in clusters.ClusterEnv._cluster_types]}}
    except Exception:
        results[name] = {{"error": traceback.format_exc()}}
    results[name]["mpi4py"] = "mpi4py.MPI" in sys.modules
    for module in [m for m in sys.modules if m == "mpi4py" or m.startswith("mpi4py.")]:
        del sys.modules[module]
  os.environ.clear()
  os.environ.update(start)

run(json.loads({before!r}))
{imports}
run(json.loads({cases!r}))
print(json.dumps(results))
"""

#: The detections run in three fresh processes instead of one each (a fresh interpreter costs
#: the import of JAX): those with a launcher's rank variable in a process that started with
#: one (as a launched process does: where the package is installed, the startup hook
#: registered our environment before ``import jax_cpu_mpi``), the others in a process that
#: started without (``import jax_cpu_mpi`` registers it). Each of the two first runs a case
#: before it imports jax_cpu_mpi: what the startup hook did at interpreter start, with a
#: launcher's variables and without. JAX_CPU_MPI_DISABLE needs a process of its own (read
#: at interpreter start and at the import).
_HOOK = {"hook": (_HYDRA, "h:1", 4, 1)}
_HOOK_UNLAUNCHED = {"hook without a launcher": ({}, "h:1", 4, 1)}
_BATCH = {
    "hydra": (_HYDRA, "h:1", None, None),
    "prrte": (_PRRTE, "h:1", None, None),
    "orte": (_ORTE, "h:1", 4, 1),
    "slurm+hydra": ({**_SLURM, **_HYDRA}, "h:1", 4, 1),
}
_BATCH_UNLAUNCHED = {
    "slurm": (_SLURM, "h:1", 4, 1),
    "outside": ({}, None, None, None),
}


def _detect_all(cases: dict[str, tuple[dict[str, str], str | None, int | None, int | None]],
                imports: str = "import jax_cpu_mpi", *,
                start_env: dict[str, str] | None = None,
                before: dict | None = None) -> dict[str, dict]:
    """Each case's detection (``before``'s before ``imports``), in one fresh process started
    with ``start_env`` set."""
    full = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    full.update(start_env or {})
    code = _DETECT.format(imports=imports, cases=json.dumps(cases),
                          before=json.dumps(before or {}), launch_vars=_LAUNCH_VARS)
    proc = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _detect(env: dict[str, str], *, address: str | None = "h:1", count: int | None = 4,
            pid: int | None = 1, imports: str = "import jax_cpu_mpi") -> dict:
    """One detection in a process that started with ``env`` set."""
    got = _detect_all({"one": (env, address, count, pid)}, imports, start_env=env)["one"]
    assert "error" not in got, got["error"]
    return got


@pytest.fixture(scope="module")
def batch() -> dict[str, dict]:
    return {**_detect_all(_BATCH, start_env=_HYDRA, before=_HOOK),
            **_detect_all(_BATCH_UNLAUNCHED, before=_HOOK_UNLAUNCHED)}


def _case(batch: dict[str, dict], name: str) -> dict:
    """One case's result; an error in it, or mpi4py imported by it, fails the test that
    reads it."""
    got = batch[name]
    assert "error" not in got, (name, got["error"])
    assert not got["mpi4py"], (f"the {name} case imported mpi4py", got)
    return got


def test_registered_with_jax_after_jax_own_environments():
    base = _compat.cluster_env_base
    assert base is not None and cluster.registered()
    names = [c.name for c in base._cluster_types]
    assert names.count(cluster.NAME) == 1
    # JAX's Open MPI 4 and Slurm environments come first: they keep their detection.
    assert names.index("ompi") < names.index(cluster.NAME)
    assert names.index("slurm") < names.index(cluster.NAME)


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    (_HYDRA, "mpich"),
    (_PRRTE, "openmpi5"),
    (_ORTE, None),  # Open MPI 4: JAX's OmpiCluster
    ({**_SLURM, "PMI_RANK": "3", "PMI_SIZE": "4"}, None),  # srun --mpi=pmi2: JAX's Slurm
    ({**_SLURM, "PMIX_RANK": "3"}, None),  # srun --mpi=pmix
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, None),  # no PMIx: not ours
    ({"PMI_RANK": "0", "PMI_SIZE": "zero"}, None),
])
def test_launcher_from_environment(monkeypatch, env, expected):
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert cluster.launcher() == expected


def test_hydra_variables_give_process_id_count_and_local_rank_without_mpi4py(batch):
    # With the coordinator given, nothing collective runs: mpi4py stays unimported.
    got = _case(batch, "hydra")
    assert got["env"] == cluster.NAME
    assert (got["count"], got["id"], got["local_device_ids"]) == (4, 1, [1])


def test_prrte_variables_give_process_id_count_and_local_rank(batch, monkeypatch):
    ompi = next(c for c in _compat.cluster_env_base._cluster_types if c.name == "ompi")
    for var, value in _PRRTE.items():
        monkeypatch.setenv(var, value)
    got = _case(batch, "prrte")
    # The batch skips the case where this JAX's OmpiCluster is present (here too).
    assert got.get("jax_detects_prrte", False) == ompi.is_env_present(), got
    if ompi.is_env_present():
        # JAX 0.12 detects Open MPI 5 itself (through mpi4py, which needs a real launch):
        # JAX's environment comes first, as for Open MPI 4 (tests/test_packaging.py runs
        # the real Open MPI 5 launch).
        pytest.skip("this JAX's own OmpiCluster detects Open MPI 5 (PRRTE)")
    assert got["env"] == cluster.NAME
    assert (got["count"], got["id"], got["local_device_ids"]) == (3, 2, [0])


@pytest.mark.parametrize(("case", "jax_env"), [("orte", "ompi"), ("slurm", "slurm"),
                                               ("slurm+hydra", "slurm")])
def test_slurm_and_open_mpi_4_keep_jax_detection(batch, case, jax_env):
    assert _case(batch, case)["env"] == jax_env


def test_outside_a_launcher_nothing_is_detected_and_mpi4py_is_not_imported(batch):
    got = _case(batch, "outside")
    assert got["env"] is None and got["address"] is None


def _startup_hook_installed() -> bool:
    """Whether jax_cpu_mpi-startup.pth sits beside the package (an installed package; a
    source checkout on PYTHONPATH has none, and nothing runs at interpreter start)."""
    import jax_cpu_mpi

    return (Path(jax_cpu_mpi.__file__).parents[1] / "jax_cpu_mpi-startup.pth").exists()


def test_registered_at_start_under_a_launcher_without_import_not_when_disabled(batch):
    got = batch["hook"]
    assert "error" not in got, got["error"]
    if _startup_hook_installed():  # the startup hook registered it, once
        assert got["names"].count(cluster.NAME) == 1 and got["env"] == cluster.NAME, got
        assert (got["count"], got["id"]) == (4, 1), got
    else:
        assert cluster.NAME not in got["names"], got
    # Without a launcher's variables, the hook registers nothing.
    got = batch["hook without a launcher"]
    assert "error" not in got, got["error"]
    assert cluster.NAME not in got["names"], got
    got = _detect({**_HYDRA, "JAX_CPU_MPI_DISABLE": "1"})
    assert cluster.NAME not in got["names"] and got["env"] is None


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["after-import", "before-import"])
def test_plain_initialize_under_mpirun_on_one_host(order):
    if order == "before-import" and not _startup_hook_installed():
        pytest.skip("a source checkout: the startup hook (jax_cpu_mpi-startup.pth) is only "
                    "in an installed package")
    run = run_mpi("plain_initialize.py", order, nprocs=2, devices_per_process=2, timeout=130)
    assert_mpi_ok(run, 2)
    for rank, lines in run.by_rank().items():
        text = "\n".join(lines)
        assert f"process index {rank} of 2" in text, run.report()
        assert "mpi4py imported by initialize, not before" in text, run.report()


def test_forgotten_initialize_under_mpirun_warns_once_naming_the_fix():
    # mpirun -n 2, no jax.distributed.initialize(): each rank's JAX runs alone (a ring of
    # its own two devices); the first psend/precv lowering says so, once per process.
    run = run_mpi("no_initialize.py", nprocs=2, timeout=120)
    assert run.returncode == 0, run.report()
    for rank in (0, 1):
        out = run.rank_output[rank]
        assert "process 0/1: result [0.0, 0.0]" in out, run.report()
        assert "JCM-WARNINGS 1" in out, run.report()
        for part in (f"psend: this process is rank {rank} of 2 started by ",
                     f"PMI_RANK={rank}, PMI_SIZE=2", "jax.process_count() == 1",
                     "Call jax.distributed.initialize()",
                     "jax_cpu_mpi.initialize_distributed()"):
            assert part in out, (part, run.report())


def test_no_launcher_warning_in_a_plain_process(monkeypatch):
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cluster, "_warned_jax_alone", False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cluster.warn_if_jax_runs_alone("psend")
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "4")
    import jax_cpu_mpi

    with pytest.warns(jax_cpu_mpi.MpiSetupWarning, match=r"rank 1 of 4 started by MPICH"):
        cluster.warn_if_jax_runs_alone("precv")
