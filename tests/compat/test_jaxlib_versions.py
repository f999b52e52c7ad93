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
from importlib import metadata
from pathlib import Path

import pytest

import background_builds
import older_jaxlib_build
from jax_cpu_mpi import _jax_cpu_mpi as ext

_PROGRAM = """
    import json, os, sys
    # An editable install's import hook (scikit-build-core's) finds jax_cpu_mpi before any
    # sys.path entry: where the test puts a build of its own first on the path, that decides.
    if any(os.path.isdir(os.path.join(p, "jax_cpu_mpi"))
           for p in os.environ["PYTHONPATH"].split(os.pathsep)):
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not type(f).__module__.startswith("_editable_skbc_")]
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
def older_build():
    """jax_cpu_mpi built against the previous jaxlib series' FFI headers, unpacked
    (tests/older_jaxlib_build.py). The build starts in the background, niced, as soon as
    collection ends (tests/background_builds.py): here the tests wait for it."""
    root = background_builds.older_jaxlib().built(
        "against older jaxlib headers", timeout=1400,
        skip_codes=(older_jaxlib_build.NO_INDEX, older_jaxlib_build.NO_OLDER))
    facts = json.loads((root / "build.json").read_text())
    return types.SimpleNamespace(root=root, site=root / "site", version=facts["version"],
                                 api_minor=facts["api_minor"])


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
