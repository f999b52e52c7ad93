"""The extension across jaxlib versions: built against an older jaxlib's XLA FFI headers,
loaded into the installed (newer) jaxlib.

XLA checks the FFI API version of every handler when it is registered
(``jax.ffi.register_ffi_target``) and accepts the versions in its supported range, which
keeps older API versions for a while. So a build against jaxlib 0.11's headers (FFI API
0.4) must register, lower and run with jaxlib 0.12 (FFI API 0.5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from jax_cpu_mpi import _jax_cpu_mpi as ext

REPO = Path(__file__).resolve().parents[2]

#: For the installed jaxlib series, the older supported series whose headers we build with.
OLDER_SERIES = {"0.12": ("0.11", "0.12"), "0.11": ("0.10.2", "0.11")}


def _series(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _older_jaxlib_headers(root: Path) -> tuple[Path, str]:
    """Download the newest jaxlib of the previous series; extract its include directory."""
    installed = metadata.version("jaxlib")
    if _series(installed) not in OLDER_SERIES:
        pytest.skip(f"jaxlib {installed}: no older jaxlib series that jax_cpu_mpi supports")
    low, high = OLDER_SERIES[_series(installed)]
    download = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "-d", str(root / "wheels"), f"jaxlib>={low},<{high}"],
        capture_output=True, text=True, timeout=600)
    if download.returncode != 0:
        pytest.skip("cannot download an older jaxlib from the package index (no network?): "
                    f"{(download.stdout + download.stderr).strip().splitlines()[-3:]}")
    (wheel,) = (root / "wheels").glob("jaxlib-*.whl")
    version = wheel.name.split("-")[1]
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("jaxlib/include/xla/ffi/"):
                archive.extract(name, root / "headers")
    include = root / "headers" / "jaxlib" / "include"
    assert (include / "xla" / "ffi" / "api" / "ffi.h").exists()
    return include, version


def _api_minor(include: Path) -> int:
    for line in (include / "xla" / "ffi" / "api" / "c_api.h").read_text().splitlines():
        if line.startswith("#define XLA_FFI_API_MINOR"):
            return int(line.split()[-1])
    raise AssertionError("no XLA_FFI_API_MINOR in the headers")


_PROGRAM = """
    import json, sys
    import jax, numpy as np
    from importlib import metadata
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_cpu_mpi
    from jax_cpu_mpi import _jax_cpu_mpi as ext
    from jax_cpu_mpi._src.cli import info

    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    perm = [(0, 1), (1, 2), (2, 3)]
    def body(v):
        token = jax.lax.psend(v, "x", perm)
        return jax.lax.precv(token, jax.ShapeDtypeStruct(v.shape, v.dtype), "x", perm)
    x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh, P("x")))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    try:
        result = np.asarray(f(x)).tolist()
    except NotImplementedError as e:
        result = f"NotImplementedError: {e}"
    print(json.dumps({"module": jax_cpu_mpi.__file__, "jaxlib": metadata.version("jaxlib"),
                      "ffi": dict(ext.ffi_build_info()), "result": result,
                      "lowerings": info.lowerings_active(),
                      "features": {f["feature"]: f["state"] for f in jax_cpu_mpi.features()}}))
"""


@pytest.fixture(scope="module")
def older_build(tmp_path_factory):
    """jax_cpu_mpi built against the previous jaxlib series' FFI headers, unpacked."""
    root = tmp_path_factory.mktemp("older-jaxlib")
    include, version = _older_jaxlib_headers(root)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-w", str(root / "dist"), f"-Cbuild-dir={root / 'build'}",
         f"-Ccmake.define.JAX_CPU_MPI_FFI_INCLUDE_DIR={include}",
         f"-Ccmake.define.JAX_CPU_MPI_FFI_HEADERS_FROM=jaxlib {version}", str(REPO)],
        capture_output=True, text=True, timeout=1200,
        env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "2"})
    assert build.returncode == 0, build.stdout[-5000:] + build.stderr[-5000:]
    (wheel,) = (root / "dist").glob("jax_cpu_mpi-*.whl")
    site = root / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return types.SimpleNamespace(root=root, site=site, version=version,
                                 api_minor=_api_minor(include))


def _run(root: Path, *paths: Path) -> dict:
    """_PROGRAM with ``paths`` first on sys.path; its facts and its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_CPU_MPI_DISABLE"}
    # The extension finds the mpich wheel's libmpi through $ORIGIN/../../.. only when it
    # sits in <venv>/lib/pythonX.Y/site-packages; an unpacked wheel sits elsewhere.
    libs = [str(Path(sys.prefix) / "lib"), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    env.update(PYTHONPATH=os.pathsep.join(map(str, paths)), LD_LIBRARY_PATH=os.pathsep.join(libs),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_PROGRAM)], capture_output=True,
                         text=True, timeout=300, env=env, cwd=root)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    facts["stderr"] = run.stderr
    return facts


_PPERMUTE = [0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_build_against_older_jaxlib_headers_runs_with_this_jaxlib(older_build):
    assert older_build.api_minor <= dict(ext.ffi_build_info())["api_minor"]
    facts = _run(older_build.root, older_build.site)
    assert facts["module"].startswith(str(older_build.site)), facts  # the older build
    assert facts["ffi"] == {"api_major": 0, "api_minor": older_build.api_minor,
                            "headers_from": f"jaxlib {older_build.version}"}, facts
    assert facts["jaxlib"] == metadata.version("jaxlib")
    assert facts["lowerings"] == {"psend": True, "precv": True}
    assert facts["features"]["lowerings"] == "active"
    assert facts["result"] == _PPERMUTE


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_build_against_newer_headers_with_older_jaxlib_leaves_jax_working(older_build):
    """This environment's build (newer FFI API) with the older jax/jaxlib first on the path:
    JAX must start (the lowerings stay off, with the fix in the warning); the build against
    the older headers works there."""
    older = older_build.root / "older-jax"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(older),
         f"jax=={older_build.version}", *map(str, (older_build.root / "wheels").glob("*.whl"))],
        capture_output=True, text=True, timeout=600)
    if install.returncode != 0:
        pytest.skip(f"cannot install jax {older_build.version}: {install.stderr[-500:]}")
    ours = dict(ext.ffi_build_info())
    if ours["api_minor"] <= older_build.api_minor:
        pytest.skip("this build's FFI API is not newer than the older jaxlib's")
    facts = _run(older_build.root, older)  # this environment's jax_cpu_mpi
    assert facts["jaxlib"] == older_build.version and facts["ffi"] == ours, facts
    assert facts["features"]["lowerings"] == "off", facts
    assert facts["result"].startswith("NotImplementedError"), facts  # JAX's own error
    assert "only implemented on GPU" in facts["result"], facts
    assert f"XLA FFI API 0.{ours['api_minor']}" in facts["stderr"], facts["stderr"]
    assert "--no-build-isolation" in facts["stderr"], facts["stderr"]
    both = _run(older_build.root, older, older_build.site)  # the older build, older jaxlib
    assert both["module"].startswith(str(older_build.site)), both
    assert both["jaxlib"] == older_build.version and both["result"] == _PPERMUTE, both
